//! The limit table at runtime: `GET /limits` (every route's limits, their config and counters),
//! `GET /limits/{route}/{limit}/keys?top=N` (the keys denied most recently, with their state
//! now) and `DELETE /limits/{route}/{limit}/keys/{key}` (reset one key: the client is let
//! through at once). Reads are open like `/metrics`; the reset needs `admin.token`.

use std::net::SocketAddr;
use std::time::Duration;

use http::{header, Method, Request, Response};
use serde_json::{json, Value};

use crate::answer::AdminRefusal;
use crate::body::Body;
use crate::gate::Limit;
use crate::limit::algo::Param;
use crate::limit::sketch::Hitter;
use crate::limit::{Algorithm, Decision, KeyHash, Span, Store, Timestamp};
use crate::proxy::Proxy;

/// `top` when the query does not say.
const DEFAULT_TOP: usize = 10;
/// The most keys one answer lists (the summary holds fewer: [`crate::limit::sketch::COUNTERS`]).
const MAX_TOP: usize = 1000;

/// Answers a path under `/limits` (`rest` is what follows it).
pub(super) async fn answer<B>(req: &Request<B>, proxy: &Proxy, rest: &str, peer: SocketAddr) -> Response<Body> {
    let segs: Vec<&str> = rest.split('/').skip(1).collect();
    let read = req.method() == Method::GET || req.method() == Method::HEAD;
    match segs.as_slice() {
        [] | [""] if read => json_answer(&table(proxy)),
        [] | [""] => crate::answer::admin(&AdminRefusal::MethodNotAllowedHere("GET, HEAD")),
        [route, limit, "keys"] if read => match find(proxy, route, limit) {
            Ok(l) => match top_param(req.uri().query()) {
                Ok(n) => json_answer(&top(route, l, n, proxy.clock().now()).await),
                Err(why) => crate::answer::admin(&AdminRefusal::BadRequest(why)),
            },
            Err(refusal) => crate::answer::admin(&refusal),
        },
        [_, _, "keys"] => crate::answer::admin(&AdminRefusal::MethodNotAllowedHere("GET, HEAD")),
        [route, limit, "keys", key] if req.method() == Method::DELETE => {
            match reset(req, proxy, route, limit, key, peer).await {
                Ok(v) => json_answer(&v),
                Err(refusal) => crate::answer::admin(&refusal),
            }
        }
        [_, _, "keys", _] => crate::answer::admin(&AdminRefusal::MethodNotAllowedHere("DELETE")),
        _ => crate::answer::admin(&AdminRefusal::NotFound),
    }
}

fn json_answer(v: &Value) -> Response<Body> {
    let mut resp = Response::new(Body::full(bytes::Bytes::from(serde_json::to_string_pretty(v).unwrap_or_default())));
    resp.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    resp.headers_mut().insert(header::CACHE_CONTROL, http::HeaderValue::from_static("no-store"));
    resp
}

/// The limit `limit` of route `route`.
fn find<'p>(proxy: &'p Proxy, route: &str, limit: &str) -> Result<&'p Limit, AdminRefusal> {
    let (_, gate) = proxy
        .gates()
        .find(|(r, _)| r.name == route)
        .ok_or_else(|| AdminRefusal::NoSuchLimit(format!("no route named {route:?}")))?;
    gate.limits()
        .iter()
        .find(|l| l.config.name == limit)
        .ok_or_else(|| AdminRefusal::NoSuchLimit(format!("route {route:?} has no limit named {limit:?}")))
}

/// `?top=N`: 10 when absent, at most [`MAX_TOP`].
fn top_param(query: Option<&str>) -> Result<usize, String> {
    let Some(v) = query.into_iter().flat_map(|q| q.split('&')).find_map(|p| p.strip_prefix("top=")) else {
        return Ok(DEFAULT_TOP);
    };
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n.min(MAX_TOP)),
        _ => Err(format!("top must be a whole number from 1 to {MAX_TOP}, not {v:?}")),
    }
}

fn dur(s: Span) -> String {
    crate::config::units::Dur(Duration::from_micros(s.as_micros())).to_string()
}

/// Every route's limits: their config and their counters (as the metrics count them).
fn table(proxy: &Proxy) -> Value {
    let now = proxy.clock().now();
    let routes: Vec<Value> = proxy
        .gates()
        .filter(|(_, g)| !g.limits().is_empty())
        .map(|(r, g)| json!({ "route": r.name, "limits": g.limits().iter().map(|l| row(l, now)).collect::<Vec<_>>() }))
        .collect();
    json!({ "routes": routes })
}

/// One limit's row in [`table`].
fn row(l: &Limit, now: Timestamp) -> Value {
    let c = &l.config;
    let m = &l.metrics;
    let local = matches!(&*l.store, Store::Local(_));
    json!({
        "name": c.name,
        "algorithm": crate::config::algorithm_name(&c.algorithm),
        "rate": c.rate.to_string(),
        "params": params(&c.algorithm),
        "key": c.key.parts().iter().map(ToString::to_string).collect::<Vec<_>>(),
        "cost": c.cost,
        "store": if local { "local" } else { "redis" },
        "mode": format!("{:?}", c.mode).to_lowercase(),
        "plan": c.plan.is_some(),
        "show_keys": c.show_keys,
        "counters": {
            "allowed": m.allowed.get(),
            "throttled": m.throttled.get(),
            "delayed": m.delayed.get(),
            "shadow_throttled": m.shadow_throttled.get(),
        },
        // Keys holding state in this process (the local store); Redis' keys are Redis'.
        "live_keys": local.then(|| l.live_keys(now)),
    })
}

/// An algorithm's parameters, in the config's words (each algorithm names its own).
fn params(alg: &Algorithm) -> Value {
    let shown = alg.params().into_iter().map(|(name, p)| {
        let v = match p {
            Param::Span(s) => Value::from(dur(s)),
            Param::Count(n) => Value::from(n),
            Param::Calendar(c) => Value::from(c.map(|c| c.to_string())),
        };
        (name.to_owned(), v)
    });
    Value::Object(shown.collect())
}

/// The `n` keys `l` denied most recently, each with its state now.
async fn top(route: &str, l: &Limit, n: usize, now: Timestamp) -> Value {
    let mut keys = Vec::new();
    for h in l.top_denied(n, now) {
        let state = match l.peek(h.key, now).await {
            Ok(d) => state(d),
            Err(e) => json!({ "error": e.to_string() }),
        };
        keys.push(shown(&h, state));
    }
    json!({
        "route": route,
        "limit": l.config.name,
        "decay": { "half_life": dur(crate::limit::sketch::HALF_LIFE) },
        "keys": keys,
    })
}

/// One key of [`top`]: its text (`show_keys`) or digest, its count and its state.
fn shown(h: &Hitter, state: Value) -> Value {
    json!({
        "key": h.label.clone().unwrap_or_else(|| hex(h.key)),
        "hash": hex(h.key),
        "count": h.count,
        "error": h.error,
        "state": state,
    })
}

fn hex(k: KeyHash) -> String {
    format!("{:032x}", k.0)
}

/// What a request of the limit's cost would be answered now.
fn state(d: Decision) -> Value {
    let secs = crate::ratelimit::retry_after_secs;
    match d {
        Decision::Allow { remaining, reset } => {
            json!({ "admitted": true, "remaining": remaining, "retry_after": 0, "reset": reset.as_secs_ceil() })
        }
        Decision::Delay { wait, remaining, reset } => {
            json!({ "admitted": true, "remaining": remaining, "delay": dur(wait), "retry_after": 0, "reset": reset.as_secs_ceil() })
        }
        Decision::Deny { retry_after, reset } => {
            json!({ "admitted": false, "remaining": 0, "retry_after": secs(retry_after), "reset": reset.as_secs_ceil() })
        }
        Decision::Never { .. } => json!({ "admitted": false, "remaining": 0, "never": true }),
    }
}

/// `DELETE /limits/{route}/{limit}/keys/{key}`: with the admin token, resets the key.
async fn reset<B>(
    req: &Request<B>,
    proxy: &Proxy,
    route: &str,
    limit: &str,
    key: &str,
    peer: SocketAddr,
) -> Result<Value, AdminRefusal> {
    let Some(token) = &proxy.config.admin_token else {
        return Err(AdminRefusal::Forbidden("no admin token is configured (admin.token_file): writes are off"));
    };
    if !token.admits(req.headers().get(header::AUTHORIZATION).map(http::HeaderValue::as_bytes)) {
        return Err(AdminRefusal::Forbidden("send Authorization: Bearer <admin token>"));
    }
    let l = find(proxy, route, limit)?;
    let shown = percent_decode(key).ok_or_else(|| AdminRefusal::BadRequest("the key is not valid UTF-8".to_owned()))?;
    let hash = parse_key(l, &shown)?;
    let held = l.reset(hash).await.map_err(|e| AdminRefusal::StoreUnavailable(e.to_string()))?;
    tracing::warn!(route, limit, key = %shown, hash = %hex(hash), by = %peer, held, "limit key reset by the admin listener");
    Ok(json!({ "route": route, "limit": limit, "key": shown, "hash": hex(hash), "reset": true, "held_state": held }))
}

/// A key as shown: its digest (32 hex digits), or with `show_keys` its text while the summary
/// holds it.
fn parse_key(l: &Limit, shown: &str) -> Result<KeyHash, AdminRefusal> {
    if shown.len() == 32 && shown.bytes().all(|b| b.is_ascii_hexdigit()) {
        if let Ok(k) = u128::from_str_radix(shown, 16) {
            return Ok(KeyHash(k));
        }
    }
    if !l.config.show_keys {
        return Err(AdminRefusal::BadRequest(
            "a key is its 32 hex digits, as /limits/{route}/{limit}/keys shows it".to_owned(),
        ));
    }
    l.key_of_text(shown).ok_or_else(|| {
        AdminRefusal::NoSuchLimit("no recently throttled key has this text; give its 32 hex digits (`hash`)".to_owned())
    })
}

/// `%XX` decoded; `None` when the result is not UTF-8. A bad escape stays as written.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| char::from(c).to_digit(16);
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push(u8::try_from(hi << 4 | lo).unwrap_or(b'?'));
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_is_ten_unless_asked_and_never_past_the_bound() {
        assert_eq!(top_param(None), Ok(10));
        assert_eq!(top_param(Some("x=1&top=3")), Ok(3));
        assert_eq!(top_param(Some("top=100000")), Ok(MAX_TOP));
        assert!(top_param(Some("top=0")).is_err());
        assert!(top_param(Some("top=-1")).is_err());
    }

    #[test]
    fn shown_keys_are_percent_decoded() {
        assert_eq!(percent_decode("client_ip%3D10.0.0.1%20x").as_deref(), Some("client_ip=10.0.0.1 x"));
        assert_eq!(percent_decode("100%").as_deref(), Some("100%"));
        assert_eq!(percent_decode("%ff"), None);
    }
}
