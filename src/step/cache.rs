//! `cache`: a route's HTTP cache (RFC 9111) on the shared store of the `cache` room. The
//! request side serves a fresh copy without the upstream (before the limits, or after them
//! with `hits_spend_limits`), makes a stale copy's request conditional, and lets one miss per
//! key go forward while the others wait for its copy (coalescing). The answer side stores the
//! upstream's answer as it streams, refreshes a copy from a `304`, and drops a URL's copies
//! after an unsafe method changed it (RFC 9111 §4.4). `Cache-Status` (RFC 9211) says which.

use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use http::header::{self, HeaderMap, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use prometheus_client::metrics::counter::Counter;

use super::{Answered, Arrival, Arrived, Build, Builtin, Flow, Notes, Seen as StepSeen};
use crate::body::Body;
use crate::cache::{Asked, Cache as Store, Entry, Flight, Joined, Rules, CACHE_STATUS};
use crate::config::cache::RouteCacheConfig;
use crate::config::{Config, Route};

pub(crate) struct Cache {
    store: Store,
    config: Arc<RouteCacheConfig>,
    counts: Counts,
}

/// What the step did, by result (`tollgate_steps_total{step="cache"}`).
struct Counts {
    /// Served from a fresh copy.
    hit: Counter,
    /// Served from a fresh copy after waiting for the same key's miss.
    coalesced: Counter,
    /// Misses that began to wait for the same key's miss in flight.
    waited: Counter,
    /// Forwarded: nothing stored for the request.
    miss: Counter,
    /// Forwarded to revalidate a stale copy.
    stale: Counter,
    /// A stale copy refreshed by the upstream's `304`.
    revalidated: Counter,
    /// A URL's copies dropped after an unsafe method.
    invalidated: Counter,
    /// Forwarded as the request asked (`no-cache`, `no-store`, `max-age=0`).
    bypass: Counter,
    /// A stale copy served while a background request revalidates it.
    refreshed: Counter,
}

/// What a request of a cached route leaves for its answer side.
pub(crate) struct Seen {
    primary: u128,
    /// `fwd=` of the `Cache-Status` when forwarded; `None`: an unsafe method (invalidate).
    fwd: Option<&'static str>,
    /// The request's fields, for the answer's `Vary` (a forwarded GET only).
    headers: HeaderMap,
    /// The URL as stored (for purges), and the host (for `Location` invalidation).
    url: Box<str>,
    head: bool,
    /// The request asked `no-store`: its answer is not kept.
    no_store: bool,
    /// The stale copy revalidated with validators tollgate added.
    revalidating: Option<Entry>,
    /// The miss the same key's other requests wait on.
    flight: Option<Flight>,
    /// A fresh copy found before the limits, served once they admit the request.
    hit: Option<(Entry, &'static str)>,
    /// The copy a coalesced wait found, when hits spend limits.
    woke: Option<Arc<OnceLock<Entry>>>,
}

impl Seen {
    fn new(primary: u128, fwd: Option<&'static str>) -> Seen {
        Seen {
            primary,
            fwd,
            headers: HeaderMap::new(),
            url: Box::from(""),
            head: false,
            no_store: false,
            revalidating: None,
            flight: None,
            hit: None,
            woke: None,
        }
    }
}

impl Builtin for Cache {
    fn compile(b: &mut Build<'_>) -> Option<Cache> {
        let config = b.route.cache.clone()?;
        let route = b.route.name.as_str();
        let count = |result| b.metrics.step(route, "cache", result);
        Some(Cache {
            store: b.cache.clone(),
            config,
            counts: Counts {
                hit: count("hit"),
                coalesced: count("coalesced"),
                waited: count("waited"),
                miss: count("miss"),
                stale: count("stale"),
                revalidated: count("revalidated"),
                invalidated: count("invalidated"),
                bypass: count("bypass"),
                refreshed: count("stale_while_revalidate"),
            },
        })
    }

    fn describe(route: &Route, config: &Config) -> Option<String> {
        match (&route.cache, &config.cache.default) {
            (Some(c), _) => Some(describe(c, config.cache.max_bytes)),
            (None, Some(_)) => Some("cache: none (this route turns cache.default off)".to_owned()),
            (None, None) => None,
        }
    }

    fn arrive<'a>(&'a self, a: &'a mut Arrival<'_>, seen: &mut StepSeen) -> Arrived<'a> {
        let parts = &mut *a.parts;
        if parts.method != Method::GET && parts.method != Method::HEAD {
            if is_unsafe(&parts.method) {
                let host = Store::host(parts).to_owned();
                let primary =
                    self.store.url_key(&host, parts.uri.path(), parts.uri.query(), &parts.headers, &self.config.key);
                let mut s = Seen::new(primary, None);
                s.url = host.into_boxed_str();
                s.headers = parts.headers.clone();
                seen.cache = Some(Box::new(s));
            }
            return Arrived::Now(Flow::Next);
        }
        let asked = Asked::parse(&parts.headers);
        let Some(found) = self.store.lookup(parts, &self.config.key) else {
            return Arrived::Now(Flow::Next);
        };
        let now = SystemTime::now();
        let head = parts.method == Method::HEAD;
        if let Some(entry) = &found.entry {
            if entry.fresh_for(&asked, now) {
                a.notes.add("cache", "hit");
                return self.hit(entry.clone(), "hit", parts, seen, now);
            }
            // Stale within stale-while-revalidate: served now, revalidated in the background
            // (once per key at a time), unless the request asks for fresher.
            let plain = !asked.no_cache && asked.max_age.is_none() && asked.min_fresh.is_none();
            if plain && entry.within_swr(self.config.stale_while_revalidate.as_secs(), now) {
                if let Joined::Lead(flight) = self.store.join(found.primary) {
                    a.refresh.refresh(background(parts), flight);
                    self.counts.refreshed.inc();
                }
                a.notes.add("cache", "stale_while_revalidate");
                return self.hit(entry.clone(), "hit; detail=stale-while-revalidate", parts, seen, now);
            }
        }
        if asked.only_if_cached {
            return Arrived::Now(Flow::Answer(not_cached()));
        }
        let mut s = Seen::new(found.primary, Some(if found.url_stored { "vary-miss" } else { "uri-miss" }));
        s.head = head;
        s.no_store = asked.no_store;
        if asked.no_cache || asked.no_store || asked.max_age == Some(0) {
            s.fwd = Some("request");
        }
        let stale = found.entry.is_some();
        if let Some(entry) = found.entry {
            s.fwd = Some(if asked.no_cache { "request" } else { "stale" });
            if entry.set_validators(&mut parts.headers) {
                s.revalidating = Some(entry);
            }
        }
        if !head {
            s.headers = parts.headers.clone();
            s.url = Store::keyed_url(parts, &self.config.key).into_boxed_str();
        }
        // One miss per key goes forward; the others wait for its copy.
        let coalesce = !head && !stale && s.fwd != Some("request") && !self.config.coalesce_wait.is_zero();
        if !coalesce {
            seen.cache = Some(Box::new(s));
            return Arrived::Now(Flow::Next);
        }
        match self.store.join(found.primary) {
            Joined::Lead(flight) => {
                s.flight = Some(flight);
                seen.cache = Some(Box::new(s));
                Arrived::Now(Flow::Next)
            }
            Joined::Wait(mut rx) => {
                self.counts.waited.inc();
                let woke = self.config.hits_spend_limits.then(|| Arc::new(OnceLock::new()));
                s.woke = woke.clone();
                seen.cache = Some(Box::new(s));
                let parts = &*a.parts;
                Arrived::Later(Box::pin(async move {
                    let landed = Joined::landed(&mut rx, self.config.coalesce_wait).await;
                    let now = SystemTime::now();
                    let entry = match self.store.lookup(parts, &self.config.key).and_then(|f| f.entry) {
                        Some(e) if landed && e.fresh_for(&asked, now) => e,
                        // Timed out, or the answer was not stored: forwarded as a miss.
                        _ => return Flow::Next,
                    };
                    self.counts.coalesced.inc();
                    match woke {
                        Some(cell) => {
                            let _ = cell.set(entry);
                            Flow::AfterLimits
                        }
                        None => Flow::Stored(entry.respond(&parts.headers, head, "hit; detail=coalesced", now)),
                    }
                }))
            }
        }
    }

    fn admitted(&self, parts: &Parts, seen: &mut StepSeen) -> (Response<Body>, Answered) {
        let now = SystemTime::now();
        let head = parts.method == Method::HEAD;
        let found = seen.cache.as_deref_mut().and_then(|s| {
            s.hit
                .take()
                .or_else(|| s.woke.as_ref().and_then(|w| w.get().cloned()).map(|e| (e, "hit; detail=coalesced")))
        });
        match found {
            Some((entry, status)) => (entry.respond(&parts.headers, head, status, now), Answered::Stale),
            // Not reached: a step asks to answer after the limits only with a copy in hand.
            None => (not_cached(), Answered::Own),
        }
    }

    fn answer(&self, seen: &mut StepSeen, resp: &mut Response<Body>, from: Answered, notes: &mut Notes<'_>) {
        let Some(s) = seen.cache.take() else { return };
        if !matches!(from, Answered::Upstream | Answered::Responder) {
            return;
        }
        let mut s = *s;
        let status = resp.status();
        let Some(fwd) = s.fwd else {
            // An unsafe method that changed the resource (RFC 9111 §4.4: a non-error answer).
            if status.is_success() || status.is_redirection() {
                self.invalidate(&s, resp.headers());
                notes.add("cache", "invalidated");
            }
            return;
        };
        let now = SystemTime::now();
        if let (StatusCode::NOT_MODIFIED, Some(entry)) = (status, s.revalidating.take()) {
            let fresh = entry.freshen(&self.store, s.primary, resp.headers(), now);
            *resp = fresh.respond(&HeaderMap::new(), s.head, "fwd=stale; fwd-status=304", now);
            self.counts.revalidated.inc();
            notes.add("cache", "revalidated");
            return;
        }
        match fwd {
            "stale" => self.counts.stale.inc(),
            "request" => self.counts.bypass.inc(),
            _ => self.counts.miss.inc(),
        };
        let stored = !s.head && !s.no_store && {
            let rules = Rules::Http {
                heuristic: self.config.heuristic,
                max_entry_bytes: self.config.max_entry_bytes,
                key: &self.config.key,
            };
            let url = std::mem::take(&mut s.url);
            self.store.capture_http(s.primary, url, &s.headers, resp, now, rules, s.flight.take())
        };
        let value =
            format!("tollgate; fwd={fwd}; fwd-status={}{}", status.as_u16(), if stored { "; stored" } else { "" });
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().append(CACHE_STATUS, v);
        }
        notes.add("cache", if stored { "stored" } else { fwd });
    }
}

impl Cache {
    /// A fresh copy answers the request: now, or once the limits admit it.
    fn hit<'a>(
        &'a self,
        entry: Entry,
        status: &'static str,
        parts: &Parts,
        seen: &mut StepSeen,
        now: SystemTime,
    ) -> Arrived<'a> {
        self.counts.hit.inc();
        if self.config.hits_spend_limits {
            let mut s = Seen::new(0, Some("hit"));
            s.hit = Some((entry, status));
            seen.cache = Some(Box::new(s));
            return Arrived::Now(Flow::AfterLimits);
        }
        let head = parts.method == Method::HEAD;
        Arrived::Now(Flow::Stored(entry.respond(&parts.headers, head, status, now)))
    }

    /// Drops the copies of the changed URL, and of its `Location` and `Content-Location` when
    /// they name the same host (RFC 9111 §4.4).
    fn invalidate(&self, s: &Seen, answer: &HeaderMap) {
        self.store.invalidate(s.primary);
        self.counts.invalidated.inc();
        let host = &*s.url;
        for name in [header::LOCATION, header::CONTENT_LOCATION] {
            let Some(uri) = answer.get(name).and_then(|v| v.to_str().ok()?.parse::<http::Uri>().ok()) else {
                continue;
            };
            let same = match uri.host() {
                None => true,
                Some(h) => h.eq_ignore_ascii_case(host),
            };
            if same && uri.path().starts_with('/') {
                self.store.invalidate(self.store.url_key(host, uri.path(), uri.query(), &s.headers, &self.config.key));
            }
        }
    }
}

/// The head of a background revalidation of `parts`'s copy: a GET with the client's fields
/// (its `Vary` ones choose the variant), no body, and `Cache-Control: max-age=0`, which makes
/// this step revalidate rather than serve.
fn background(parts: &Parts) -> Parts {
    let mut req = http::Request::new(());
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    let h = req.headers_mut();
    h.clone_from(&parts.headers);
    for name in [header::CONTENT_LENGTH, header::TRANSFER_ENCODING, header::EXPECT] {
        h.remove(name);
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("max-age=0"));
    req.into_parts().0
}

/// `only-if-cached` with no usable copy: `504` (RFC 9111 §5.2.1.7).
fn not_cached() -> Response<Body> {
    let mut resp = Response::new(Body::full("no stored answer for this request (only-if-cached)\n"));
    *resp.status_mut() = StatusCode::GATEWAY_TIMEOUT;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    h.insert(CACHE_STATUS, HeaderValue::from_static("tollgate; fwd=miss; detail=only-if-cached"));
    resp
}

/// Methods that change the resource (RFC 9110 §9.2.1: not safe); a known safe one never
/// invalidates.
fn is_unsafe(m: &Method) -> bool {
    !matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::CONNECT)
}

/// A route's `cache` in words.
fn describe(c: &RouteCacheConfig, max_bytes: u64) -> String {
    let mut key = String::from("host, path");
    if c.key.query {
        key.push_str(", query");
        if !c.key.ignore_query.is_empty() {
            key.push_str(&format!(" without {}", c.key.ignore_query.join(", ")));
        }
    }
    for h in &c.key.headers {
        key.push_str(", ");
        key.push_str(h.as_str());
    }
    let hits = if c.hits_spend_limits {
        "hits go through the route's limits"
    } else {
        "hits spend no limit (they never reach the upstream)"
    };
    let heuristic = match c.heuristic {
        Some(h) => format!("{}% of the time since Last-Modified, at most {}s", h.percent, h.max.as_secs()),
        None => "none (answers without a lifetime are revalidated)".to_owned(),
    };
    let coalesce = if c.coalesce_wait.is_zero() {
        "every miss is forwarded".to_owned()
    } else {
        let ms = c.coalesce_wait.as_millis();
        let wait = if ms % 1000 == 0 { format!("{}s", ms / 1000) } else { format!("{ms}ms") };
        format!("one miss per key is forwarded, the others wait up to {wait} for it")
    };
    let store = match max_bytes {
        n if n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    };
    format!(
        "cache: GET and HEAD answers kept by RFC 9111 (Cache-Control, Expires, Vary; private, no-store and \
         Set-Cookie answers never; credentials only with public, s-maxage or must-revalidate) in the shared \
         store of {store}, keyed by {key} and the request's Authorization and Cookie; heuristic \
         freshness: {heuristic}; {hits}; {coalesce}; stale copies revalidated with If-None-Match / \
         If-Modified-Since; unsafe methods drop the URL's copies; Cache-Status on every answer"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::cache::{CacheKey, Heuristic};

    #[test]
    fn the_explain_line_says_the_defaults_and_the_choices() {
        let mut c = RouteCacheConfig {
            hits_spend_limits: false,
            max_entry_bytes: None,
            coalesce_wait: std::time::Duration::from_secs(5),
            heuristic: None,
            stale_while_revalidate: std::time::Duration::ZERO,
            key: CacheKey { query: true, ..CacheKey::default() },
        };
        let line = describe(&c, 64 << 20);
        for part in ["store of 64 MiB", "heuristic freshness: none", "hits spend no limit", "wait up to 5s"] {
            assert!(line.contains(part), "{part} in {line}");
        }
        c.hits_spend_limits = true;
        c.heuristic = Some(Heuristic { percent: 10, max: std::time::Duration::from_secs(3600) });
        c.coalesce_wait = std::time::Duration::ZERO;
        c.key.ignore_query = vec!["utm_source".into()];
        let line = describe(&c, 1000);
        for part in [
            "hits go through the route's limits",
            "10% of the time since Last-Modified",
            "every miss is forwarded",
            "query without utm_source",
            "1000 bytes",
        ] {
            assert!(line.contains(part), "{part} in {line}");
        }
    }
}
