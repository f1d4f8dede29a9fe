//! Stale copies of good GET responses, served instead of a 429 (throttled) or a 5xx (upstream
//! failed). Invariants: only complete 200 answers to GET within the per-entry limit are stored;
//! the store weighs at most `max_bytes`; nothing here reads a clock ("now" is a parameter).
//!
//! # API
//! - [`Cache::new`]`(max_bytes, max_entry_bytes)`; cheap to clone (one `Arc`).
//! - [`Cache::may_store`]`(&req, keyed_on_credentials)`: cheap pre-check, so a caller keeps a
//!   copy of the request head only when [`Cache::capture`] could store the answer.
//! - [`Cache::capture`]`(&req, keyed_on_credentials, resp, now) -> Response<Body>`: the same
//!   response, its body tapped ([`crate::body::Tap`]) when storable. Frames pass on at once.
//! - [`Cache::stale`]`(&req, reason, max_age, now) -> Option<Response<Body>>`: the stored
//!   copy with `Age` and `Cache-Status`, or `None` (caller sends its 429 / 502 / 504).
//! - [`Cache::stats`], [`Cache::weighted_size`], [`Cache::entry_count`]: for metrics.
//!
//! # Rules
//! - Stored: 200 to GET, no `Set-Cookie`, no `Vary: *`, no `no-store` / `private` / `no-cache`
//!   (tollgate never revalidates, so a `no-cache` copy could never be used), request without
//!   `no-store`, and without `Authorization` / `Cookie` unless the route keys on them. Those
//!   two request fields are always part of the key: a copy only ever answers the same
//!   credentials.
//! - Key: host (lower-case, no port), path and query, credentials; then per variant the
//!   request fields named by the response's `Vary`. Up to [`MAX_VARIANTS`] per URL, newest
//!   first.
//! - Served: within the route's `max_age` of receipt. For upstream errors (500/502/503/504)
//!   a response's own `stale-if-error=N` extends that to `lifetime + N` when longer (RFC
//!   5861: the origin allowed it). `must-revalidate`, `proxy-revalidate` and `s-maxage`
//!   responses are served only while fresh (RFC 9111 §4.2.4), whatever the route says.
//! - Weight: body + per header (name + value + [`HEADER_OVERHEAD`]) + [`VARIANT_OVERHEAD`],
//!   plus [`SLOT_OVERHEAD`] per URL; estimates that err high. The per-entry limit bounds one
//!   variant's weight.

mod capture;
mod flight;
mod key;
mod lookup;
mod policy;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use http_body::Body as _;

use crate::answer::StaleReason;
use crate::body::Body;
use crate::config::cache::{CacheKey, Heuristic};
use capture::Pending;
pub use flight::{Flight, Joined};
use key::Keys;
pub use lookup::{Asked, Entry};
use policy::Directives;

/// Variants kept per URL; the oldest goes first.
pub const MAX_VARIANTS: usize = 8;
/// Estimated bytes per stored header beyond name and value (`HeaderMap` bucket, index).
pub const HEADER_OVERHEAD: usize = 112;
/// Estimated bytes per variant beyond headers and body (the record, its `Arc`).
pub const VARIANT_OVERHEAD: usize = std::mem::size_of::<Stored>() + 32;
/// Estimated bytes per URL in the store (moka's node and map entry, the variant list).
pub const SLOT_OVERHEAD: usize = 256;

pub const CACHE_STATUS: HeaderName = HeaderName::from_static("cache-status");

/// The key of the stale store: the whole URL, nothing else (as a route's `cache.key` is by default).
pub static WHOLE_URL: CacheKey = CacheKey { query: true, ignore_query: Vec::new(), headers: Vec::new() };

/// Response fields that describe this exchange, not the resource; never replayed.
const NOT_REPLAYED: [HeaderName; 6] = [
    header::AGE,
    HeaderName::from_static("ratelimit"),
    HeaderName::from_static("ratelimit-policy"),
    HeaderName::from_static("ratelimit-limit"),
    HeaderName::from_static("ratelimit-remaining"),
    HeaderName::from_static("ratelimit-reset"),
];

/// Counters since start, plus the store's current size (moka's view, eventually consistent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// URLs (primary keys) held; each holds one or more variants.
    pub entries: u64,
    /// Weighted bytes held.
    pub bytes: u64,
    /// Variants written.
    pub stored: u64,
    /// Captures given up: body error, trailers, too large, cut short, client gone.
    pub abandoned: u64,
    pub hits_throttled: u64,
    pub hits_upstream_error: u64,
    /// Stale lookups that found no copy, or only one too old or not allowed to be served.
    pub misses: u64,
}

/// The stale-copy store; see the module docs.
#[derive(Clone)]
pub struct Cache {
    inner: Arc<Inner>,
}

struct Inner {
    store: moka::sync::Cache<u128, Arc<Variants>>,
    keys: Keys,
    flights: flight::Flights,
    max_bytes: u64,
    max_entry_bytes: usize,
    stored: AtomicU64,
    abandoned: AtomicU64,
    hits_throttled: AtomicU64,
    hits_upstream_error: AtomicU64,
    misses: AtomicU64,
}

/// The variants of one URL, newest first.
struct Variants {
    list: Vec<Arc<Stored>>,
    weight: u32,
}

/// One stored response and what is needed to judge and replay it.
struct Stored {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    vary: Box<[HeaderName]>,
    variant: u128,
    /// The URL as the key has it (`host/path?query`), for purges.
    url: Box<str>,
    received: SystemTime,
    /// The age the response had when received: its own `Age` (it may come from a cache
    /// upstream) or the time since its `Date`, whichever is more (RFC 9111 §4.2.3).
    initial_age: u64,
    /// Freshness lifetime in seconds (0 when the response gives none).
    lifetime: u64,
    stale_if_error: Option<u64>,
    stale_while_revalidate: Option<u64>,
    /// False for `must-revalidate`, `proxy-revalidate`, `s-maxage`, `no-cache`: fresh copies only.
    allows_stale: bool,
    /// `no-cache`: stored, but revalidated before each use.
    no_cache: bool,
    weight: usize,
}

/// How an answer is judged for storing.
#[derive(Clone, Copy)]
pub enum Rules<'a> {
    /// The stale store's: 200 only, never `no-cache`.
    Stale,
    /// A route's HTTP cache (RFC 9111 §3).
    Http { heuristic: Option<Heuristic>, max_entry_bytes: Option<u64>, key: &'a CacheKey },
}

impl Cache {
    /// A cache holding at most `max_bytes` (weighted) and at most `max_entry_bytes` per variant.
    pub fn new(max_bytes: u64, max_entry_bytes: usize) -> Cache {
        // One URL must fit the store (moka drops what weighs more than its capacity), and all
        // its variants must fit moka's u32 weight.
        let fits = usize::try_from(max_bytes).unwrap_or(usize::MAX).saturating_sub(SLOT_OVERHEAD);
        let max_entry_bytes = max_entry_bytes.min(fits).min(u32::MAX as usize / (MAX_VARIANTS + 1));
        let store = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &u128, v: &Arc<Variants>| v.weight)
            .build();
        Cache {
            inner: Arc::new(Inner {
                store,
                keys: Keys::new(),
                flights: flight::Flights::new(),
                max_bytes,
                max_entry_bytes,
                stored: AtomicU64::new(0),
                abandoned: AtomicU64::new(0),
                hits_throttled: AtomicU64::new(0),
                hits_upstream_error: AtomicU64::new(0),
                misses: AtomicU64::new(0),
            }),
        }
    }

    /// True when the answer to `req` could be stored, judged from the request alone.
    pub fn may_store(&self, req: &Parts, keyed_on_credentials: bool) -> bool {
        if req.method != Method::GET || Directives::parse(&req.headers).no_store {
            return false;
        }
        let credentials = req.headers.contains_key(header::AUTHORIZATION) || req.headers.contains_key(header::COOKIE);
        keyed_on_credentials || !credentials
    }

    /// Returns `resp`, its body wrapped so that a copy is stored when it ends cleanly, if the
    /// response may be stored. `now` is when the response head was received.
    pub fn capture(
        &self,
        req: &Parts,
        keyed_on_credentials: bool,
        resp: Response<Body>,
        now: SystemTime,
    ) -> Response<Body> {
        let mut resp = resp;
        if let Some(pending) = self.prepare(req, keyed_on_credentials, &resp, now) {
            tap(&mut resp, pending);
        }
        resp
    }

    /// The stored copy for `req` if one may be served for `reason` at `now`: at most `max_age`
    /// old (or older within the response's `stale-if-error`, for upstream errors). HEAD gets
    /// the headers of a GET copy and no body. `key`: the route's cache key.
    pub fn stale(
        &self,
        req: &Parts,
        key: &CacheKey,
        reason: StaleReason,
        max_age: Duration,
        now: SystemTime,
    ) -> Option<Response<Body>> {
        let found =
            self.find(req, key).filter(|s| s.status == StatusCode::OK && s.servable(reason, max_age, s.age(now)));
        let inner = &self.inner;
        let Some(stored) = found else {
            inner.misses.fetch_add(1, Relaxed);
            return None;
        };
        match reason {
            StaleReason::Throttled => inner.hits_throttled.fetch_add(1, Relaxed),
            StaleReason::UpstreamError { .. } => inner.hits_upstream_error.fetch_add(1, Relaxed),
        };
        Some(stored.replay(reason, now, req.method == Method::HEAD))
    }

    pub fn stats(&self) -> CacheStats {
        let i = &self.inner;
        CacheStats {
            entries: i.store.entry_count(),
            bytes: i.store.weighted_size(),
            stored: i.stored.load(Relaxed),
            abandoned: i.abandoned.load(Relaxed),
            hits_throttled: i.hits_throttled.load(Relaxed),
            hits_upstream_error: i.hits_upstream_error.load(Relaxed),
            misses: i.misses.load(Relaxed),
        }
    }

    /// Weighted bytes held, as of moka's last maintenance run.
    pub fn weighted_size(&self) -> u64 {
        self.inner.store.weighted_size()
    }

    /// URLs held, as of moka's last maintenance run.
    pub fn entry_count(&self) -> u64 {
        self.inner.store.entry_count()
    }

    /// Drops every copy of the URL of primary key `primary` (all its variants).
    pub fn invalidate(&self, primary: u128) {
        self.inner.store.invalidate(&primary);
    }

    /// Drops every URL whose keyed form (`host/path?query`) is `url`, or starts with it when
    /// `prefix`; returns how many. Walks the store: an operator's purge, not a request's.
    pub fn purge(&self, url: &str, prefix: bool) -> usize {
        let mut n = 0;
        for (k, v) in self.inner.store.iter() {
            let Some(first) = v.list.first() else { continue };
            let hit = if prefix { first.url.starts_with(url) } else { &*first.url == url };
            if hit {
                self.inner.store.invalidate(&*k);
                n += 1;
            }
        }
        self.inner.store.run_pending_tasks();
        n
    }

    /// Runs moka's pending maintenance (evictions, counts), for tests and gauges.
    pub fn settle(&self) {
        self.inner.store.run_pending_tasks();
    }

    fn find(&self, req: &Parts, key: &CacheKey) -> Option<Arc<Stored>> {
        let keys = &self.inner.keys;
        let slot = self.inner.store.get(&keys.primary(req, key)?)?;
        slot.list.iter().find(|v| v.variant == keys.variant(&v.vary, &req.headers)).cloned()
    }

    /// Decides whether `resp` to `req` may be stored as a stale copy and, if so, builds its
    /// record minus the body.
    fn prepare(
        &self,
        req: &Parts,
        keyed_on_credentials: bool,
        resp: &Response<Body>,
        now: SystemTime,
    ) -> Option<Box<Pending>> {
        if resp.status() != StatusCode::OK || !self.may_store(req, keyed_on_credentials) {
            return None;
        }
        let primary = self.inner.keys.primary(req, &WHOLE_URL)?;
        let url = key::keyed_url(req, &WHOLE_URL).into_boxed_str();
        self.prepare_with(primary, url, &req.headers, resp, now, Rules::Stale)
    }

    /// Decides whether `resp` to a request with `req_headers` may be stored under `primary`
    /// by `rules` and, if so, builds its record minus the body.
    fn prepare_with(
        &self,
        primary: u128,
        url: Box<str>,
        req_headers: &HeaderMap,
        resp: &Response<Body>,
        now: SystemTime,
        rules: Rules<'_>,
    ) -> Option<Box<Pending>> {
        let headers = resp.headers();
        let d = Directives::parse(headers);
        if d.no_store || d.private || headers.contains_key(header::SET_COOKIE) {
            return None;
        }
        let received = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let explicit = d.max_age.is_some() || d.s_maxage.is_some() || headers.contains_key(header::EXPIRES);
        let mut lifetime = policy::freshness_lifetime(&d, headers, received);
        let max_entry = match rules {
            Rules::Stale => {
                if d.no_cache {
                    return None;
                }
                self.inner.max_entry_bytes
            }
            Rules::Http { heuristic, max_entry_bytes, .. } => {
                let status = resp.status();
                if !policy::storable_status(status, explicit || d.public) {
                    return None;
                }
                // RFC 9111 §3.5: an answer to credentials is shared only when it says so.
                let shared_ok = d.public || d.must_revalidate || d.s_maxage.is_some();
                if req_headers.contains_key(header::AUTHORIZATION) && !shared_ok {
                    return None;
                }
                if let (false, Some(h)) = (explicit, heuristic) {
                    if policy::heuristically_cacheable(status) {
                        lifetime = policy::heuristic_lifetime(headers, received, h.percent, h.max.as_secs());
                    }
                }
                let own = max_entry_bytes.map_or(usize::MAX, |b| usize::try_from(b).unwrap_or(usize::MAX));
                self.inner.max_entry_bytes.min(own)
            }
        };
        let vary = vary_names(headers)?;
        let variant = self.inner.keys.variant(&vary, req_headers);

        let mut kept = headers.clone();
        for name in NOT_REPLAYED {
            kept.remove(name);
        }
        let head: usize = kept.iter().map(|(n, v)| n.as_str().len() + v.len() + HEADER_OVERHEAD).sum();
        let weight = head + VARIANT_OVERHEAD + url.len() + vary.iter().map(|n| n.as_str().len() + 16).sum::<usize>();
        let budget = max_entry.checked_sub(weight)?;
        let own_age = policy::age(headers);
        let apparent = headers
            .get(header::DATE)
            .and_then(|v| policy::http_date(v.as_bytes()))
            .map_or(0, |date| received.saturating_sub(date));
        let stored = Stored {
            status: resp.status(),
            initial_age: own_age.max(apparent),
            lifetime,
            stale_if_error: d.stale_if_error,
            stale_while_revalidate: d.stale_while_revalidate,
            allows_stale: d.allows_stale() && !d.no_cache,
            no_cache: d.no_cache,
            headers: kept,
            body: Bytes::new(),
            vary,
            variant,
            url,
            received: now,
            weight,
        };
        Some(Box::new(Pending {
            cache: self.clone(),
            primary,
            stored: Some(stored),
            buf: Vec::new(),
            budget,
            done: false,
            flight: None,
        }))
    }

    /// Adds a finished variant, replacing the one that answers the same requests.
    fn insert(&self, primary: u128, stored: Stored) {
        self.insert_arc(primary, Arc::new(stored));
    }

    fn insert_arc(&self, primary: u128, stored: Arc<Stored>) {
        let inner = &self.inner;
        // moka's admission (TinyLFU) counts reads only: this read makes "how often this URL is
        // fetched" the popularity that decides what stays when the store is full.
        let _ = inner.store.get(&primary);
        let limit = inner.max_bytes.min(u64::from(u32::MAX)) as usize;
        inner.store.entry(primary).and_upsert_with(|old| {
            let mut list = Vec::with_capacity(MAX_VARIANTS);
            let mut weight = SLOT_OVERHEAD + stored.weight;
            list.push(Arc::clone(&stored));
            let older = old.as_ref().map_or(&[][..], |e| &e.value().list[..]);
            for v in older.iter().filter(|v| v.variant != stored.variant) {
                // Keep the slot admissible as a whole: moka drops anything above capacity.
                if list.len() == MAX_VARIANTS || weight + v.weight > limit {
                    break;
                }
                weight += v.weight;
                list.push(Arc::clone(v));
            }
            Arc::new(Variants { list, weight: u32::try_from(weight).unwrap_or(u32::MAX) })
        });
        inner.stored.fetch_add(1, Relaxed);
    }

    fn abandoned(&self) {
        self.inner.abandoned.fetch_add(1, Relaxed);
    }
}

/// Taps `resp`'s body with `pending`, reserving its expected length when it fits the budget.
fn tap(resp: &mut Response<Body>, mut pending: Box<Pending>) {
    let hint = resp.body().size_hint();
    let expected = hint.upper().unwrap_or(hint.lower());
    if let Ok(expected) = usize::try_from(expected) {
        if expected <= pending.budget {
            pending.buf.reserve_exact(expected);
        }
    }
    resp.body_mut().tap(pending);
}

impl Stored {
    /// Current age: the age it arrived with plus the time since it was received.
    fn age(&self, now: SystemTime) -> Duration {
        Duration::from_secs(self.initial_age) + now.duration_since(self.received).unwrap_or(Duration::ZERO)
    }

    fn servable(&self, reason: StaleReason, max_age: Duration, age: Duration) -> bool {
        let lifetime = Duration::from_secs(self.lifetime);
        if !self.allows_stale && (age >= lifetime || self.no_cache) {
            return false;
        }
        let limit = match (reason, self.stale_if_error) {
            // stale-if-error is about errors only (RFC 5861 §4: 500, 502, 503, 504).
            (StaleReason::UpstreamError { status: 500 | 502 | 503 | 504 }, Some(n)) => {
                max_age.max(lifetime + Duration::from_secs(n))
            }
            _ => max_age,
        };
        age <= limit
    }

    fn replay(&self, reason: StaleReason, now: SystemTime, head: bool) -> Response<Body> {
        let age = self.age(now).as_secs();
        let ttl = i128::from(self.lifetime) - i128::from(age);
        let status = match reason {
            StaleReason::Throttled => format!("tollgate; hit; ttl={ttl}; detail=throttled"),
            StaleReason::UpstreamError { status } => {
                format!("tollgate; fwd=bypass; fwd-status={status}; ttl={ttl}; detail=upstream-error")
            }
        };
        self.respond(now, head, &status)
    }

    /// The stored answer with its `Age` and `Cache-Status: <status>`; HEAD without the body.
    fn respond(&self, now: SystemTime, head: bool, status: &str) -> Response<Body> {
        let age = self.age(now).as_secs();
        let body = if head { Body::empty() } else { Body::full(self.body.clone()) };
        let mut resp = Response::new(body);
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.clone_from(&self.headers);
        h.insert(header::AGE, HeaderValue::from(age));
        // Appended: caches nearer the origin keep their members first (RFC 9211 §2).
        if let Ok(v) = HeaderValue::from_str(status) {
            h.append(CACHE_STATUS, v);
        }
        resp
    }
}

/// The field names of the response's `Vary`, lower-case; `None` for `Vary: *` or a name that
/// is not a valid field name (such a response cannot be matched safely, so it is not stored).
fn vary_names(headers: &HeaderMap) -> Option<Box<[HeaderName]>> {
    let mut names: Vec<HeaderName> = Vec::new();
    for line in headers.get_all(header::VARY) {
        for item in policy::list_items(line.as_bytes()) {
            if item == b"*" {
                return None;
            }
            let name = HeaderName::from_bytes(item).ok()?;
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    Some(names.into_boxed_slice())
}

/// The parsers of response fields, for [`crate::fuzzing`] only: they stay private to this room.
#[doc(hidden)]
#[cfg(any(fuzzing, test))]
pub(crate) mod fuzzing {
    use http::header::{HeaderMap, HeaderName};

    use super::policy::{self, Directives};

    /// What the policy reads from a response's `Cache-Control`, `Expires` and `Date`.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct CacheControl {
        pub no_store: bool,
        pub no_cache: bool,
        pub private: bool,
        pub must_revalidate: bool,
        pub proxy_revalidate: bool,
        pub max_age: Option<u64>,
        pub s_maxage: Option<u64>,
        pub stale_if_error: Option<u64>,
        pub allows_stale: bool,
        /// Freshness lifetime in seconds of a response received at `received` (unix seconds).
        pub lifetime: u64,
    }

    pub fn cache_control(headers: &HeaderMap, received: u64) -> CacheControl {
        let d = Directives::parse(headers);
        CacheControl {
            allows_stale: d.allows_stale(),
            lifetime: policy::freshness_lifetime(&d, headers, received),
            no_store: d.no_store,
            no_cache: d.no_cache,
            private: d.private,
            must_revalidate: d.must_revalidate,
            proxy_revalidate: d.proxy_revalidate,
            max_age: d.max_age,
            s_maxage: d.s_maxage,
            stale_if_error: d.stale_if_error,
        }
    }

    pub fn list_items(value: &[u8]) -> Vec<&[u8]> {
        policy::list_items(value).collect()
    }

    pub fn http_date(value: &[u8]) -> Option<u64> {
        policy::http_date(value)
    }

    pub fn vary_names(headers: &HeaderMap) -> Option<Box<[HeaderName]>> {
        super::vary_names(headers)
    }
}

#[cfg(test)]
mod tests;
