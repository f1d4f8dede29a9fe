//! A route's HTTP cache reading the store (RFC 9111 §4): what a request finds, whether a copy
//! is fresh for it, the answer a copy makes (a hit, a `304` to a client's own conditional),
//! a copy refreshed by a `304` (§4.3.4), and storing an upstream answer with the route's
//! rules. "Now" is always a parameter.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use http::header::{self, HeaderMap};
use http::request::Parts;
use http::{Response, StatusCode};

use super::policy::{self, list_items, Directives};
use super::{key, tap, Cache, Flight, Rules, Stored};
use crate::body::Body;
use crate::config::cache::CacheKey;

/// What a request found: its URL's key, whether the URL is stored at all, and the variant
/// that answers it, if any.
pub struct Found {
    pub primary: u128,
    pub url_stored: bool,
    pub entry: Option<Entry>,
}

/// One stored variant, as a request found it.
#[derive(Clone)]
pub struct Entry(Arc<Stored>);

/// The request's own `Cache-Control` (RFC 9111 §5.2.1).
#[derive(Debug, Clone, Copy, Default)]
pub struct Asked {
    pub no_store: bool,
    pub no_cache: bool,
    pub max_age: Option<u64>,
    pub max_stale: Option<u64>,
    pub min_fresh: Option<u64>,
    pub only_if_cached: bool,
}

impl Asked {
    pub fn parse(headers: &HeaderMap) -> Asked {
        if !headers.contains_key(header::CACHE_CONTROL) {
            return Asked::default();
        }
        let d = Directives::parse(headers);
        Asked {
            no_store: d.no_store,
            no_cache: d.no_cache,
            max_age: d.max_age,
            max_stale: d.max_stale,
            min_fresh: d.min_fresh,
            only_if_cached: d.only_if_cached,
        }
    }
}

/// Request fields that make a request conditional: tollgate does not add its own validators
/// to such a request (the client's question goes to the upstream as it asked it).
const CONDITIONALS: [header::HeaderName; 5] =
    [header::IF_NONE_MATCH, header::IF_MODIFIED_SINCE, header::IF_MATCH, header::IF_UNMODIFIED_SINCE, header::IF_RANGE];

/// Fields of a `304` that do not replace the stored ones (RFC 9111 §3.2: the stored body's
/// framing stays).
const KEPT_ON_304: [header::HeaderName; 3] =
    [header::CONTENT_LENGTH, header::CONTENT_ENCODING, header::TRANSFER_ENCODING];

impl Entry {
    /// Current age in seconds.
    pub fn age(&self, now: SystemTime) -> u64 {
        self.0.age(now).as_secs()
    }

    /// Remaining freshness in seconds (negative: stale for that long).
    pub fn ttl(&self, now: SystemTime) -> i64 {
        let ttl = i128::from(self.0.lifetime) - i128::from(self.age(now));
        ttl.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
    }

    /// Whether the copy may answer a request asking `asked` without the upstream (RFC 9111
    /// §4.2, §5.2.1): fresh, and fresh enough for the request's `max-age` / `min-fresh`; or
    /// stale within the request's `max-stale` where the answer allows serving it stale.
    pub fn fresh_for(&self, asked: &Asked, now: SystemTime) -> bool {
        if self.0.no_cache || asked.no_cache {
            return false;
        }
        let age = self.age(now);
        if asked.max_age.is_some_and(|m| age > m) {
            return false;
        }
        let ttl = self.ttl(now);
        let need = i64::try_from(asked.min_fresh.unwrap_or(0)).unwrap_or(i64::MAX);
        if ttl > 0 && ttl >= need.max(1) {
            return true;
        }
        match asked.max_stale {
            Some(m) if self.0.allows_stale && asked.min_fresh.is_none() => i128::from(-ttl) <= i128::from(m),
            _ => false,
        }
    }

    /// Whether the copy may be served stale while it is revalidated in the background: within
    /// the answer's `stale-while-revalidate` (or the route's `extra` when the answer gives
    /// none), and the answer lets a stale copy be served at all.
    pub fn within_swr(&self, extra: u64, now: SystemTime) -> bool {
        if !self.0.allows_stale || self.0.no_cache {
            return false;
        }
        let window = self.0.stale_while_revalidate.unwrap_or(extra);
        let ttl = self.ttl(now);
        ttl <= 0 && i128::from(-ttl) < i128::from(window)
    }

    /// The validators to revalidate with (`If-None-Match`, `If-Modified-Since`), set on
    /// `req` when the client sent no conditional of its own; `true` when set.
    pub fn set_validators(&self, req: &mut HeaderMap) -> bool {
        if CONDITIONALS.iter().any(|c| req.contains_key(c)) {
            return false;
        }
        let h = &self.0.headers;
        let mut set = false;
        if let Some(etag) = h.get(header::ETAG) {
            req.insert(header::IF_NONE_MATCH, etag.clone());
            set = true;
        }
        if let Some(modified) = h.get(header::LAST_MODIFIED) {
            req.insert(header::IF_MODIFIED_SINCE, modified.clone());
            set = true;
        }
        set
    }

    /// The answer from this copy, with `Age` and `Cache-Status: tollgate; <status>` (the ttl
    /// appended). A client's own conditional that the copy satisfies gets a `304` (RFC 9110
    /// §13.1, evaluated by the cache as RFC 9111 §4.3.2 says). HEAD gets no body.
    pub fn respond(&self, req: &HeaderMap, head: bool, status: &str, now: SystemTime) -> Response<Body> {
        let cache_status = format!("tollgate; {status}; ttl={}", self.ttl(now));
        if self.0.status == StatusCode::OK && self.not_modified(req) {
            let mut resp = self.0.respond(now, true, &cache_status);
            *resp.status_mut() = StatusCode::NOT_MODIFIED;
            let h = resp.headers_mut();
            for name in
                [header::CONTENT_LENGTH, header::CONTENT_TYPE, header::CONTENT_ENCODING, header::TRANSFER_ENCODING]
            {
                h.remove(name);
            }
            return resp;
        }
        self.0.respond(now, head, &cache_status)
    }

    /// Whether the request's `If-None-Match` (or, without one, `If-Modified-Since`) is
    /// satisfied by this copy: the client's own copy is current.
    fn not_modified(&self, req: &HeaderMap) -> bool {
        let h = &self.0.headers;
        if let Some(inm) = req.get(header::IF_NONE_MATCH) {
            let Some(etag) = h.get(header::ETAG) else { return false };
            let ours = weak(etag.as_bytes());
            return req
                .get_all(header::IF_NONE_MATCH)
                .iter()
                .flat_map(|l| list_items(l.as_bytes()))
                .any(|t| t == b"*" || weak(t) == ours)
                && !inm.is_empty();
        }
        let Some(since) = req.get(header::IF_MODIFIED_SINCE).and_then(|v| policy::http_date(v.as_bytes())) else {
            return false;
        };
        let modified = h.get(header::LAST_MODIFIED).and_then(|v| policy::http_date(v.as_bytes()));
        modified.is_some_and(|m| m <= since)
    }

    /// This copy refreshed by the upstream's `304` (RFC 9111 §4.3.4): its fields updated from
    /// the `304`'s, received now, stored in its place under `primary`.
    pub fn freshen(&self, cache: &Cache, primary: u128, not_modified: &HeaderMap, now: SystemTime) -> Entry {
        let old = &*self.0;
        let mut headers = old.headers.clone();
        for name in not_modified.keys() {
            if KEPT_ON_304.contains(name) || super::NOT_REPLAYED.contains(name) {
                continue;
            }
            headers.remove(name);
            for v in not_modified.get_all(name) {
                headers.append(name.clone(), v.clone());
            }
        }
        let d = Directives::parse(&headers);
        let received = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let own_age = super::policy::age(not_modified);
        let lifetime = if d.max_age.is_some() || d.s_maxage.is_some() || headers.contains_key(header::EXPIRES) {
            policy::freshness_lifetime(&d, &headers, received)
        } else {
            old.lifetime
        };
        let head: usize = headers.iter().map(|(n, v)| n.as_str().len() + v.len() + super::HEADER_OVERHEAD).sum();
        let weight = head
            + super::VARIANT_OVERHEAD
            + old.url.len()
            + old.body.len()
            + old.vary.iter().map(|n| n.as_str().len() + 16).sum::<usize>();
        let fresh = Arc::new(Stored {
            status: old.status,
            headers,
            body: old.body.clone(),
            vary: old.vary.clone(),
            variant: old.variant,
            url: old.url.clone(),
            received: now,
            initial_age: own_age,
            lifetime,
            stale_if_error: d.stale_if_error,
            stale_while_revalidate: d.stale_while_revalidate,
            allows_stale: d.allows_stale() && !d.no_cache,
            no_cache: d.no_cache,
            weight,
        });
        cache.insert_arc(primary, fresh.clone());
        Entry(fresh)
    }
}

/// An entity-tag without its weak prefix (`W/"a"` and `"a"` compare equal: RFC 9110 §8.8.3.2).
fn weak(tag: &[u8]) -> &[u8] {
    tag.strip_prefix(b"W/").unwrap_or(tag)
}

impl Cache {
    /// What `req` (a GET or HEAD) finds under `key`; `None` for other methods.
    pub fn lookup(&self, req: &Parts, key: &CacheKey) -> Option<Found> {
        let keys = &self.inner.keys;
        let primary = keys.primary(req, key)?;
        let Some(slot) = self.inner.store.get(&primary) else {
            return Some(Found { primary, url_stored: false, entry: None });
        };
        let entry = slot.list.iter().find(|v| v.variant == keys.variant(&v.vary, &req.headers)).cloned().map(Entry);
        Some(Found { primary, url_stored: true, entry })
    }

    /// The primary key of a URL on `host` as a GET to it would have (for invalidation).
    pub fn url_key(&self, host: &str, path: &str, query: Option<&str>, headers: &HeaderMap, key: &CacheKey) -> u128 {
        self.inner.keys.url_key(host, path, query, headers, key)
    }

    /// The URL `req` is stored under, as purges name it.
    pub fn keyed_url(req: &Parts, key: &CacheKey) -> String {
        key::keyed_url(req, key)
    }

    /// The host part of `req`'s key (no port, no trailing dot).
    pub fn host(req: &Parts) -> &str {
        key::host(req)
    }

    /// Taps `resp` (an upstream's answer to a GET with `req_headers`) to be stored under
    /// `primary` by a route's `rules`, holding `flight` until the copy is stored or given up;
    /// `true` when the answer may be stored (the copy is then taken as it streams).
    #[allow(clippy::too_many_arguments)]
    pub fn capture_http(
        &self,
        primary: u128,
        url: Box<str>,
        req_headers: &HeaderMap,
        resp: &mut Response<Body>,
        now: SystemTime,
        rules: Rules<'_>,
        flight: Option<Flight>,
    ) -> bool {
        match self.prepare_with(primary, url, req_headers, resp, now, rules) {
            Some(mut pending) => {
                pending.flight = flight;
                tap(resp, pending);
                true
            }
            None => false,
        }
    }
}
