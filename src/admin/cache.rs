//! The store of copies at runtime: `GET /cache` (its size and counters) and
//! `DELETE /cache/{host}{path}` (a purge: every copy of that URL, all variants and
//! credentials; with a trailing `*`, of every URL that starts with what precedes it;
//! `DELETE /cache/*` empties the store). URLs are named as the cache keys them: host in lower
//! case without port, path, and the query as the route's key keeps it. Reads are open like
//! `/metrics`; a purge needs `admin.token`.

use std::net::SocketAddr;

use http::{header, Method, Request, Response};
use serde_json::{json, Value};

use crate::answer::AdminRefusal;
use crate::body::Body;
use crate::proxy::Proxy;

/// Answers a path under `/cache` (`rest` is what follows it).
pub(super) fn answer<B>(req: &Request<B>, proxy: &Proxy, rest: &str, peer: SocketAddr) -> Response<Body> {
    let read = req.method() == Method::GET || req.method() == Method::HEAD;
    match rest {
        "" | "/" if read => json_answer(&stats(proxy)),
        "" | "/" => crate::answer::admin(&AdminRefusal::MethodNotAllowedHere("GET, HEAD")),
        _ if req.method() == Method::DELETE => match purge(req, proxy, rest, peer) {
            Ok(v) => json_answer(&v),
            Err(refusal) => crate::answer::admin(&refusal),
        },
        _ => crate::answer::admin(&AdminRefusal::MethodNotAllowedHere("DELETE")),
    }
}

fn stats(proxy: &Proxy) -> Value {
    let cache = proxy.cache();
    cache.settle();
    let s = cache.stats();
    json!({
        "max_bytes": proxy.config.cache.max_bytes,
        "bytes": s.bytes,
        "entries": s.entries,
        "stored": s.stored,
        "abandoned": s.abandoned,
        "stale_hits": { "throttled": s.hits_throttled, "upstream_error": s.hits_upstream_error },
        "stale_misses": s.misses,
    })
}

/// `DELETE /cache/{url}` (`rest` is `/{url}`): with the admin token, drops the URL's copies.
fn purge<B>(req: &Request<B>, proxy: &Proxy, rest: &str, peer: SocketAddr) -> Result<Value, AdminRefusal> {
    let Some(token) = &proxy.config.admin_token else {
        return Err(AdminRefusal::Forbidden("no admin token is configured (admin.token_file): writes are off"));
    };
    if !token.admits(req.headers().get(header::AUTHORIZATION).map(http::HeaderValue::as_bytes)) {
        return Err(AdminRefusal::Forbidden("send Authorization: Bearer <admin token>"));
    }
    let mut url = rest.strip_prefix('/').unwrap_or(rest).to_owned();
    if let Some(q) = req.uri().query() {
        url.push('?');
        url.push_str(q);
    }
    let (url, prefix) = match url.strip_suffix('*') {
        Some(start) => (start.to_owned(), true),
        None => (url, false),
    };
    if !prefix && !url.contains('/') {
        return Err(AdminRefusal::BadRequest(
            "name a URL as host/path (example.com/items?id=1), or a prefix ending in `*`".to_owned(),
        ));
    }
    let host_end = url.find('/').unwrap_or(url.len());
    let url = format!("{}{}", url[..host_end].to_ascii_lowercase(), &url[host_end..]);
    let purged = proxy.cache().purge(&url, prefix);
    tracing::warn!(url = %url, prefix, purged, by = %peer, "cache purged by the admin listener");
    Ok(json!({ "url": url, "prefix": prefix, "purged": purged }))
}

fn json_answer(v: &Value) -> Response<Body> {
    let mut resp = Response::new(Body::full(bytes::Bytes::from(serde_json::to_string_pretty(v).unwrap_or_default())));
    resp.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    resp.headers_mut().insert(header::CACHE_CONTROL, http::HeaderValue::from_static("no-store"));
    resp
}
