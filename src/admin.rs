//! The admin listener: `/metrics` (Prometheus text), `/healthz` (alive), `/readyz` (config
//! loaded, listener up, Redis reachable where a limit depends on it), `/config` (the
//! effective config, secrets redacted), the limit table at runtime under `/limits` (see
//! [`limits`]), the store of copies under `/cache` (see [`cache`]) and the live dashboard
//! (`/`, `/dashboard.json`). It binds loopback unless configured otherwise; reads take no
//! token, the writes (`DELETE` of a limit's key, a cache purge) need `admin.token`. Every request must name the listener itself (see [`host_allowed`]): a page
//! of another site that rebinds its name to this address cannot read it from an operator's
//! browser.

mod cache;
mod limits;

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::answer::AdminRefusal;
use crate::body::Body;
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use serde_json::Value;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::proxy::Shared;

mod dashboard;
mod history;

use dashboard::Dashboard;

/// Aborts the dashboard's sampler when the admin listener stops.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether the proxy listener is accepting; `/readyz` says not ready until it is.
#[derive(Default)]
pub struct Readiness {
    listening: AtomicBool,
}

impl Readiness {
    pub fn set_listening(&self, up: bool) {
        self.listening.store(up, Ordering::Relaxed);
    }
}

/// Serves the admin endpoints until `shutdown` resolves. Connections get the protocol
/// detection and the timeouts of the client listener (`server:`), not its connection cap.
pub async fn serve(listener: TcpListener, proxy: Shared, ready: Arc<Readiness>, shutdown: impl Future<Output = ()>) {
    let mut current = crate::server::Current::new(&proxy, crate::metrics::ConnMetrics::default());
    let dashboard = Arc::new(Dashboard::default());
    let _sampler = AbortOnDrop(tokio::spawn(dashboard.clone().sample(proxy.clone())).abort_handle());
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let settings = current.get(&proxy).clone();
        let proxy = proxy.clone();
        let ready = ready.clone();
        let dashboard = dashboard.clone();
        // The address the client reached (its `Host` may name it).
        let local = stream.local_addr().map_or(peer.ip(), |a| a.ip());
        let svc = service_fn(move |req| {
            let proxy = proxy.clone();
            let ready = ready.clone();
            let dashboard = dashboard.clone();
            async move { Ok::<_, Infallible>(answer(req, &proxy, &ready, (peer, local), &dashboard).await) }
        });
        tokio::spawn(crate::server::serve_other(stream, settings, svc));
    }
}

fn text(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut resp = Response::new(Body::full(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// The dashboard page may run its own inline script and style and talk to this listener,
/// nothing else.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:";

/// Whether a request's authority (HTTP/2's `:authority`, else `Host`) names this listener:
/// an IP literal that is the address the client reached or a loopback one, `localhost`, or a
/// name of `admin.allowed_hosts`, with any port (a tunnel's). A request without one is not a
/// browser's, and passes. A page of another site whose name now resolves here (DNS
/// rebinding) sends its own name, and is refused.
fn host_allowed(req: &Request<impl Sized>, local: IpAddr, allowed: &[String]) -> bool {
    let host = match req.uri().authority() {
        Some(a) => a.host(),
        None => match req.headers().get(header::HOST) {
            None => return true,
            Some(v) => match v.to_str().ok().and_then(|h| h.parse::<http::uri::Authority>().ok()) {
                Some(a) => return name_allowed(a.host(), local, allowed),
                None => return false,
            },
        },
    };
    name_allowed(host, local, allowed)
}

fn name_allowed(host: &str, local: IpAddr, allowed: &[String]) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return ip.is_loopback() || ip.to_canonical() == local.to_canonical();
    }
    let name = bare.strip_suffix('.').unwrap_or(bare);
    name.eq_ignore_ascii_case("localhost") || allowed.iter().any(|a| a.eq_ignore_ascii_case(name))
}

async fn answer(
    req: Request<Incoming>,
    shared: &Shared,
    ready: &Readiness,
    (peer, local): (SocketAddr, IpAddr),
    dashboard: &Dashboard,
) -> Response<Body> {
    let proxy = shared.load_full();
    if !host_allowed(&req, local, &proxy.config.admin_hosts) {
        return crate::answer::admin(&AdminRefusal::Forbidden(
            "the Host names neither this listener's address nor localhost nor a name of `admin.allowed_hosts`",
        ));
    }
    if let Some(rest) = req.uri().path().strip_prefix("/cache") {
        if rest.is_empty() || rest.starts_with('/') {
            return cache::answer(&req, &proxy, rest, peer);
        }
    }
    if let Some(rest) = req.uri().path().strip_prefix("/limits") {
        if rest.is_empty() || rest.starts_with('/') {
            return limits::answer(&req, &proxy, rest, peer).await;
        }
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return crate::answer::admin(&AdminRefusal::MethodNotAllowed);
    }
    match req.uri().path() {
        "/metrics" => {
            proxy.refresh_gauges();
            text(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                proxy.metrics().encode(proxy.redis().map(|r| &**r)),
            )
        }
        "/" => {
            let mut resp = text(StatusCode::OK, "text/html; charset=utf-8", dashboard::PAGE);
            resp.headers_mut().insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(PAGE_POLICY));
            resp
        }
        "/dashboard.json" => {
            let mut resp = text(StatusCode::OK, "application/json", dashboard.view(&proxy).to_string());
            resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        }
        "/healthz" => text(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => {
            let mut problems = Vec::new();
            if !ready.listening.load(Ordering::Relaxed) {
                problems.push("the proxy listener is not accepting".to_owned());
            }
            if let Err(e) = proxy.readiness().await {
                problems.push(e);
            }
            if problems.is_empty() {
                text(StatusCode::OK, "text/plain", "ready\n")
            } else {
                crate::answer::admin(&AdminRefusal::NotReady(problems.join("; ")))
            }
        }
        "/config" => {
            let mut doc = effective(&proxy.config);
            // A group's servers as they stand now: healthy, ejected or unhealthy.
            for g in proxy.groups() {
                if let Some(u) = doc.get_mut("upstreams").and_then(|u| u.get_mut(g.name())) {
                    u["servers"] = serde_json::to_value(g.servers()).unwrap_or_default();
                }
            }
            text(StatusCode::OK, "application/json", serde_json::to_string_pretty(&doc).unwrap_or_default())
        }
        _ => crate::answer::admin(&AdminRefusal::NotFound),
    }
}

/// The config in effect (defaults filled in; `listen` and `admin` as bound, since a reload
/// cannot move them) as JSON, in the shape of proxy.yaml, secrets redacted: the validated
/// config's own serialization (`config::shown`).
pub fn effective(c: &Config) -> Value {
    serde_json::to_value(c).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_config_hides_the_redis_password() {
        let yaml = "redis: { url: 'redis://app:hunter2@127.0.0.1:1/0' }\nupstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits: [{ algorithm: token_bucket, rate: 1/s, store: redis }]\n";
        let c = Config::from_yaml(std::path::Path::new("t.yaml"), yaml).unwrap();
        let doc = effective(&c).to_string();
        assert!(!doc.contains("hunter2"), "{doc}");
        assert!(doc.contains("redis://app:***@127.0.0.1:1/0"), "{doc}");
    }

    #[test]
    fn redacts_passwords_in_urls() {
        let redact = crate::config::redact;
        assert_eq!(redact("redis://:hunter2@h:6379/0"), "redis://***@h:6379/0");
        assert_eq!(redact("rediss://app:hunter2@h:6380"), "rediss://app:***@h:6380");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
    }
}
