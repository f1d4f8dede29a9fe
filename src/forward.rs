//! Sends an admitted request on: to an `http://` upstream through a pooled keep-alive
//! client, or to the built-in responder. Failures become problem+json answers here, so the
//! caller always gets a response; which failure it was is kept for the caller to act on.

pub mod framing;
pub mod headers;
pub mod pool;

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use serde_json::json;

use pool::{Pool, Returner};

use crate::body::Body;
use crate::config::{HttpUpstream, Responder};
use crate::problem;

/// What went wrong upstream; `None` in [`Forwarded::failure`] when a response came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No connection could be made (refused, unreachable, connect timeout): 502.
    Connect,
    /// No response head within `timeout`: 504.
    Timeout,
    /// The connection broke before a response head arrived: 502.
    Broken,
    /// The client's own request body broke while it was being sent (a malformed chunk, the
    /// client gone): `400`, and not the upstream's failure.
    ClientBody,
}

/// Per-request facts the forwarder needs from the downstream side.
pub struct Downstream {
    pub peer: IpAddr,
    pub peer_trusted: bool,
}

/// A pooled client for one `http://` upstream.
pub struct HttpForwarder {
    name: String,
    pool: Arc<Pool>,
    authority_value: HeaderValue,
    base_path: String,
    timeout: Duration,
    preserve_host: bool,
}

impl HttpForwarder {
    pub fn new(name: &str, cfg: &HttpUpstream) -> HttpForwarder {
        HttpForwarder {
            name: name.to_owned(),
            pool: Arc::new(Pool::new(
                cfg.authority.as_str().to_owned(),
                cfg.connect_timeout,
                cfg.pool_idle_timeout,
                cfg.pool_max_idle,
            )),
            authority_value: HeaderValue::from_str(cfg.authority.as_str()).unwrap_or(HeaderValue::from_static("")),
            base_path: cfg.base_path.clone(),
            timeout: cfg.timeout,
            preserve_host: cfg.preserve_host,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Forwards `req`, dropping the first `strip` bytes of its path (the route's prefix).
    ///
    /// The head is rewritten before the returned future exists, and the request lives in
    /// one place only while it waits: futures on the request path are moved several times
    /// by value, so every byte kept out of them is a byte not copied per request.
    pub fn forward<'a>(
        &'a self,
        req: Request<Incoming>,
        strip: usize,
        down: &Downstream,
    ) -> impl Future<Output = (Response<Body>, Option<Failure>)> + 'a {
        let prepared = self.prepare(req, strip, down);
        async move {
            let Some(req) = prepared else {
                return (bad_request("the request path cannot be forwarded"), None);
            };
            match crate::timer::timeout(self.timeout, self.exchange(req)).await {
                Ok(Ok((resp, conn))) => {
                    let (mut parts, body) = resp.into_parts();
                    // Framing hook (src/forward/framing.rs): a bad head is a 502 and the
                    // connection is dropped; a repaired one is not pooled again.
                    let conn = match framing::check_response(parts.status, &mut parts.headers) {
                        Ok(framing::Reuse::Yes) => Some(conn),
                        Ok(framing::Reuse::No) => None,
                        Err(bad) => return bad.refusal(&self.name),
                    };
                    headers::strip_hop_by_hop(&mut parts.headers);
                    headers::append_via(&mut parts.headers, parts.version);
                    parts.version = Version::HTTP_11;
                    let body = match conn {
                        Some(conn) => Body::upstream(body, Returner::new(self.pool.clone(), conn)),
                        None => Body::stream(body),
                    };
                    (Response::from_parts(parts, body), None)
                }
                // Framing hook (src/framing.rs): a body the client framed wrongly is its error.
                Ok(Err((Failure::ClientBody, _))) => (crate::framing::broken_body(), None),
                Ok(Err((failure, error))) => {
                    tracing::debug!(upstream = %self.name, %error, "upstream request failed");
                    (self.failure_response(failure), Some(failure))
                }
                Err(_) => (self.failure_response(Failure::Timeout), Some(Failure::Timeout)),
            }
        }
    }

    /// The request as it goes upstream: target, version, hop-by-hop fields, forwarding
    /// fields, `Via`, `Host`; `None` when its path cannot be forwarded.
    fn prepare(&self, mut req: Request<Incoming>, strip: usize, down: &Downstream) -> Option<Request<Incoming>> {
        let received = req.version();
        let uri = self.upstream_uri(req.uri(), strip).ok()?;
        // The client's Host: the Host header (HTTP/1) or the :authority (HTTP/2).
        let client_host = match req.headers().get(header::HOST) {
            Some(h) => Some(h.clone()),
            None => req.uri().authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()),
        };
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        let h = req.headers_mut();
        headers::strip_hop_by_hop(h);
        headers::add_forwarding(h, down.peer, down.peer_trusted, client_host.as_ref());
        headers::append_via(h, received);
        match (self.preserve_host, client_host) {
            (true, Some(host)) => {
                h.insert(header::HOST, host);
            }
            _ => {
                h.insert(header::HOST, self.authority_value.clone());
            }
        }
        Some(req)
    }

    /// A pooled connection, and the response head on it.
    #[allow(clippy::manual_async_fn)] // an `async fn` would hold `req` twice: argument and local
    fn exchange(
        &self,
        req: Request<Incoming>,
    ) -> impl Future<Output = Result<(Response<Incoming>, SendRequest<Incoming>), (Failure, String)>> + '_ {
        async move {
            let mut conn = self.pool.checkout().await.map_err(|e| (Failure::Connect, e.to_string()))?;
            match conn.send_request(req).await {
                Ok(resp) => Ok((resp, conn)),
                // hyper's "user" error on a send is the request body we gave it, the client's
                // (or a dispatch task dropped with the runtime, at shutdown only).
                Err(e) if e.is_user() => Err((Failure::ClientBody, e.to_string())),
                Err(e) => Err((Failure::Broken, e.to_string())),
            }
        }
    }

    /// The origin-form target sent upstream: base path, the path less its first `strip`
    /// bytes (the route's prefix), the query. Without a rewrite the parsed target is reused.
    fn upstream_uri(&self, uri: &Uri, strip: usize) -> Result<Uri, http::Error> {
        let path = uri.path().get(strip..).unwrap_or("");
        if self.base_path.is_empty() && strip == 0 && uri.authority().is_none() && path.starts_with('/') {
            if let Some(pq) = uri.path_and_query() {
                return Ok(Uri::from(pq.clone()));
            }
        }
        let query = uri.query();
        let slash = if path.starts_with('/') { "" } else { "/" };
        let mut pq = String::with_capacity(self.base_path.len() + path.len() + 2 + query.map_or(0, str::len));
        pq.push_str(&self.base_path);
        pq.push_str(slash);
        pq.push_str(path);
        if let Some(q) = query {
            pq.push('?');
            pq.push_str(q);
        }
        Ok(Uri::from(PathAndQuery::try_from(pq)?))
    }

    /// The problem answer for `failure`; it names the upstream, never its address.
    pub fn failure_response(&self, failure: Failure) -> Response<Body> {
        let (status, kind, title, detail) = match failure {
            Failure::Connect => (
                StatusCode::BAD_GATEWAY,
                "upstream-unreachable",
                "Upstream unreachable",
                format!("could not connect to upstream `{}`", self.name),
            ),
            Failure::Broken => (
                StatusCode::BAD_GATEWAY,
                "upstream-failed",
                "Upstream failed",
                format!("upstream `{}` closed the connection without a response", self.name),
            ),
            Failure::ClientBody => return crate::framing::broken_body(),
            Failure::Timeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream-timeout",
                "Upstream timed out",
                format!("upstream `{}` sent no response within {:?}", self.name, self.timeout),
            ),
        };
        problem::response(status, kind, title, &detail, json!({ "upstream": self.name }))
    }
}

fn bad_request(detail: &str) -> Response<Body> {
    problem::response(StatusCode::BAD_REQUEST, "bad-request", "Bad request", detail, serde_json::Value::Null)
}

/// The built-in responder: answers by itself after an optional fixed latency.
pub async fn respond(r: &Responder) -> Response<Body> {
    if !r.latency.is_zero() {
        Box::pin(tokio::time::sleep(r.latency)).await;
    }
    let mut resp = Response::new(Body::full(r.body.clone()));
    *resp.status_mut() = r.status;
    resp.headers_mut().clone_from(&r.headers);
    resp
}
