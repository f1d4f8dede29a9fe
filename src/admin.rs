//! The admin listener: `/metrics` (Prometheus text), `/healthz` (alive), `/readyz` (config
//! loaded, listener up, Redis reachable where a limit depends on it), `/config` (the
//! effective config, secrets redacted), the limit table at runtime under `/limits` (see
//! [`limits`]) and the live dashboard (`/`, `/dashboard.json`). It binds loopback unless
//! configured otherwise; reads take no token, the one write (`DELETE` of a limit's key) needs
//! `admin.token`. Every request must name the listener itself (see [`host_allowed`]): a page
//! of another site that rebinds its name to this address cannot read it from an operator's
//! browser.

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
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::config::{Config, HostMatch, PathMatch, UpstreamKind};
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

/// `redis://user:secret@host` → `redis://user:***@host` (see [`crate::config::redact`]).
pub fn redact_url(url: &str) -> String {
    crate::config::redact(url)
}

fn dur(d: std::time::Duration) -> String {
    crate::config::units::Dur(d).to_string()
}

/// The config in effect (defaults filled in; `listen` and `admin` as bound, since a reload
/// cannot move them) as JSON; no secrets.
pub fn effective(c: &Config) -> Value {
    let upstreams: serde_json::Map<String, Value> = c
        .upstreams
        .iter()
        .map(|u| {
            let v = match &u.kind {
                UpstreamKind::Http(h) => {
                    let mut v = json!({
                    "url": format!("{}://{}{}", if h.tls.is_some() { "https" } else { "http" }, h.authority, h.base_path),
                    "connect_timeout": dur(h.connect_timeout),
                    "timeout": dur(h.timeout),
                    "read_timeout": dur(h.read_timeout),
                    "pool_idle_timeout": dur(h.pool_idle_timeout),
                    "pool_max_idle": h.pool_max_idle,
                    "preserve_host": h.preserve_host,
                    "tls": h.tls.as_ref().map(|t| json!({
                        "server_name": t.server_name,
                        "ca_file": t.ca_file.as_ref().map(|p| p.display().to_string()),
                        "client_cert": t.client_cert.as_ref().map(|c| c.cert.display().to_string()),
                        "tls_insecure_skip_verify": t.insecure_skip_verify,
                    })),
                });
                    // A group's servers, balance, retries, ejection and checks (not shown for `url:`).
                    if let Some(g) = &h.group {
                        let extra = json!({
                    "servers": g.servers.iter().map(|s| json!({
                        "url": format!("{}://{}", if h.tls.is_some() { "https" } else { "http" }, s.authority),
                        "weight": s.weight,
                    })).collect::<Vec<_>>(),
                    "balance": crate::config::group::describe_balance(&g.balance),
                    "retry": json!({
                        "attempts": g.retry.attempts,
                        "on": g.retry.on.names(),
                        "per_try_timeout": g.retry.per_try_timeout.map(dur),
                        "budget": { "ratio": g.retry.ratio, "min_per_s": g.retry.min_per_s },
                    }),
                    "health": g.health.as_ref().map(|c| json!({
                        "path": c.path,
                        "interval": dur(c.interval),
                        "timeout": dur(c.timeout),
                        "healthy": c.healthy,
                        "unhealthy": c.unhealthy,
                        "expect": format!("{}-{}", c.expect.0, c.expect.1),
                    })),
                    "outlier": json!({
                        "consecutive_failures": g.outlier.consecutive_failures,
                        "base_ejection_time": dur(g.outlier.base_ejection_time),
                        "max_ejection_time": dur(g.outlier.max_ejection_time),
                        "max_ejected_percent": g.outlier.max_ejected_percent,
                    }),
                        });
                        if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
                            v.extend(extra);
                        }
                    }
                    v
                }
                UpstreamKind::Respond(r) => json!({ "respond": {
                    "status": r.status.as_u16(),
                    "headers": r.headers.iter().map(|(k, v)| (k.as_str().to_owned(), Value::from(v.to_str().unwrap_or("")))).collect::<serde_json::Map<_, _>>(),
                    "body_bytes": r.body.len(),
                    "latency": dur(r.latency),
                }}),
            };
            (u.name.clone(), v)
        })
        .collect();
    let routes: Vec<Value> = c
        .routes
        .iter()
        .map(|r| {
            json!({
                "name": r.name,
                "match": {
                    "host": r.host.as_ref().map(|h| match h { HostMatch::Exact(e) => e.clone(), HostMatch::Suffix(s) => format!("*{s}") }),
                    "path_prefix": match &r.path { PathMatch::Prefix(p) => Some(p), PathMatch::Exact(_) => None },
                    "path": match &r.path { PathMatch::Exact(p) => Some(p), PathMatch::Prefix(_) => None },
                    "methods": r.methods.as_ref().map(|m| m.iter().map(|m| m.as_str().to_owned()).collect::<Vec<_>>()),
                },
                "upstream": c.upstreams[r.upstream].name,
                "strip_prefix": r.strip_prefix,
                "ratelimit_headers": r.ratelimit_headers,
                "concurrency": r.concurrency.as_ref().map(|k| json!({ "max": k.max, "max_wait": dur(k.max_wait), "adaptive": k.adaptive.as_ref().map(|a| json!({ "min": a.min, "max": a.max, "window": dur(a.window), "percentile": a.percentile, "tolerance": a.tolerance, "smoothing": a.smoothing, "relearn": a.relearn })) })),
                "limits": r.limits.iter().map(|l| json!({
                    "name": l.name,
                    "algorithm": crate::config::algorithm_name(&l.algorithm),
                    "rate": l.rate.to_string(),
                    "params": format!("{:?}", l.algorithm),
                    "key": l.key.parts().iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "store": format!("{:?}", l.store).to_lowercase(),
                    "cost": l.cost,
                    "mode": format!("{:?}", l.mode).to_lowercase(),
                    "lease": l.lease.map(|n| n.get()),
                    "max_keys": l.max_keys,
                })).collect::<Vec<_>>(),
                "on_limit": r.stale_on_limit.map(|d| json!({ "stale": { "max_age": dur(d) } })),
                "on_upstream_error": r.stale_on_upstream_error.map(|d| json!({ "stale": { "max_age": dur(d) } })),
                "gateway": crate::explain::describe_gateway(r),
            })
        })
        .collect();
    json!({
        "listen": c.listen.to_string(),
        "admin": c.admin.map(|a| a.to_string()),
        "trusted_proxies": c.trusted_proxies.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "server": {
            "header_read_timeout": dur(c.server.header_read_timeout),
            "keepalive_timeout": dur(c.server.keepalive_timeout),
            "send_timeout": dur(c.server.send_timeout),
            "body_read_timeout": dur(c.server.body_read_timeout),
            "max_header_bytes": c.server.max_header_bytes,
            "max_connections": c.server.max_connections,
            "grace_period": dur(c.server.grace_period),
            "h2": {
                "idle_timeout": dur(c.server.h2.idle_timeout),
                "ping_interval": dur(c.server.h2.ping_interval),
                "ping_timeout": dur(c.server.h2.ping_timeout),
                "max_concurrent_streams": c.server.h2.max_concurrent_streams,
                "max_header_list_size": c.server.h2.max_header_list_size,
                "max_pending_accept_reset_streams": c.server.h2.max_pending_accept_reset_streams,
                "max_local_error_reset_streams": c.server.h2.max_local_error_reset_streams,
                "initial_stream_window": c.server.h2.initial_stream_window,
                "initial_connection_window": c.server.h2.initial_connection_window,
                "max_frame_size": c.server.h2.max_frame_size,
                "max_send_buffer": c.server.h2.max_send_buffer,
            },
        },
        "problems": { "type_base": c.problem_type_base },
        "request_id": c.request_id.as_ref().map(|h| h.as_str().to_owned()),
        "log": { "format": format!("{:?}", c.log.format).to_lowercase(), "access": c.log.access },
        "cache": { "max_bytes": c.cache.max_bytes, "max_entry_bytes": c.cache.max_entry_bytes },
        "tracing": c.tracing.as_ref().map(|t| json!({
            "otlp": { "endpoint": t.endpoint.to_string(), "protocol": format!("{:?}", t.protocol).to_lowercase() },
            "sample": t.sample,
            "parent_based": t.parent_based,
            "service_name": t.service_name,
            "queue": t.queue,
            "batch": t.batch,
            "interval": dur(t.interval),
            "timeout": dur(t.timeout),
        })),
        "redis": c.redis.as_ref().map(|r| {
            let target = match &r.target {
                crate::limit::store::redis::Topology::Single(u) => json!({ "url": redact_url(u) }),
                crate::limit::store::redis::Topology::Cluster(urls) => json!({ "cluster": urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>() }),
            };
            json!({
                "target": target,
                "timeout": dur(r.timeout),
                "on_error": format!("{:?}", r.on_error).to_lowercase(),
                "instances": r.instances.get(),
                "breaker": { "failures": r.breaker_failures.get(), "cooldown": dur(r.breaker_cooldown) },
                "lease_ttl": dur(r.lease_ttl),
                "memo_keys": r.memo_keys,
                "connect_timeout": dur(r.connect_timeout),
            })
        }),
        "upstreams": upstreams,
        "routes": routes,
        "listeners": listeners(c),
    })
}

/// Every listener with the names its certificates serve (paths and names, never keys).
fn listeners(c: &Config) -> Value {
    c.listeners
        .iter()
        .map(|l| {
            json!({
                "addr": l.addr.to_string(),
                "tls": l.tls.as_ref().map(|t| json!({
                    "certificates": t.loaded.as_ref().map(|ld| ld.served.iter().map(|s| json!({
                        "cert": s.cert.display().to_string(),
                        "names": s.names,
                        "not_after": crate::pki::x509::date(s.not_after),
                    })).collect::<Vec<_>>()),
                    "obtained": t.managed.iter().map(|m| match &m.source {
                        crate::config::CertSource::Acme(a) => json!({
                            "names": m.names,
                            "from": "acme",
                            "directory": a.directory,
                            "challenge": a.challenge.as_str(),
                            "storage": a.storage.display().to_string(),
                        }),
                        crate::config::CertSource::Internal(i) => json!({
                            "names": m.names,
                            "from": "internal",
                            "lifetime": dur(i.lifetime),
                            "storage": i.storage.display().to_string(),
                        }),
                    }).collect::<Vec<_>>(),
                    "client_ca": t.client_ca.as_ref().map(|p| p.display().to_string()),
                    "client_auth": format!("{:?}", t.client_auth).to_lowercase(),
                    "handshake_timeout": dur(t.handshake_timeout),
                })),
                "proxy_protocol": l.proxy_protocol.map(|p| format!("{p:?}").to_lowercase()),
                "redirect_https": l.redirect_https,
            })
        })
        .collect()
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
        assert_eq!(redact_url("redis://:hunter2@h:6379/0"), "redis://***@h:6379/0");
        assert_eq!(redact_url("rediss://app:hunter2@h:6380"), "rediss://app:***@h:6380");
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
    }
}
