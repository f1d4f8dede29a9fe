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
mod key;
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
use capture::Pending;
use key::Keys;
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
    received: SystemTime,
    /// The response's own `Age` when received (it may come from a cache upstream).
    initial_age: u64,
    /// Freshness lifetime in seconds (0 when the response gives none).
    lifetime: u64,
    stale_if_error: Option<u64>,
    /// False for `must-revalidate`, `proxy-revalidate`, `s-maxage`: fresh copies only.
    allows_stale: bool,
    weight: usize,
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
        if let Some(mut pending) = self.prepare(req, keyed_on_credentials, &resp, now) {
            let hint = resp.body().size_hint();
            let expected = hint.upper().unwrap_or(hint.lower());
            if let Ok(expected) = usize::try_from(expected) {
                if expected <= pending.budget {
                    pending.buf.reserve_exact(expected);
                }
            }
            resp.body_mut().tap(pending);
        }
        resp
    }

    /// The stored copy for `req` if one may be served for `reason` at `now`: at most `max_age`
    /// old (or older within the response's `stale-if-error`, for upstream errors). HEAD gets
    /// the headers of a GET copy and no body.
    pub fn stale(
        &self,
        req: &Parts,
        reason: StaleReason,
        max_age: Duration,
        now: SystemTime,
    ) -> Option<Response<Body>> {
        let found = self.find(req).filter(|s| s.servable(reason, max_age, s.age(now)));
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

    fn find(&self, req: &Parts) -> Option<Arc<Stored>> {
        let keys = &self.inner.keys;
        let slot = self.inner.store.get(&keys.primary(req)?)?;
        slot.list.iter().find(|v| v.variant == keys.variant(&v.vary, &req.headers)).cloned()
    }

    /// Decides whether `resp` to `req` may be stored and, if so, builds its record minus the body.
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
        let headers = resp.headers();
        let d = Directives::parse(headers);
        if d.no_store || d.private || d.no_cache || headers.contains_key(header::SET_COOKIE) {
            return None;
        }
        let vary = vary_names(headers)?;
        let primary = self.inner.keys.primary(req)?;
        let variant = self.inner.keys.variant(&vary, &req.headers);

        let mut kept = headers.clone();
        for name in NOT_REPLAYED {
            kept.remove(name);
        }
        let head: usize = kept.iter().map(|(n, v)| n.as_str().len() + v.len() + HEADER_OVERHEAD).sum();
        let weight = head + VARIANT_OVERHEAD + vary.iter().map(|n| n.as_str().len() + 16).sum::<usize>();
        let budget = self.inner.max_entry_bytes.checked_sub(weight)?;
        let received = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let stored = Stored {
            status: resp.status(),
            initial_age: headers.get(header::AGE).and_then(|v| v.to_str().ok()?.trim().parse().ok()).unwrap_or(0),
            lifetime: policy::freshness_lifetime(&d, headers, received),
            stale_if_error: d.stale_if_error,
            allows_stale: d.allows_stale(),
            headers: kept,
            body: Bytes::new(),
            vary,
            variant,
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
        }))
    }

    /// Adds a finished variant, replacing the one that answers the same requests.
    fn insert(&self, primary: u128, stored: Stored) {
        let inner = &self.inner;
        let stored = Arc::new(stored);
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

impl Stored {
    /// Current age: the response's own `Age` plus the time since it was received.
    fn age(&self, now: SystemTime) -> Duration {
        Duration::from_secs(self.initial_age) + now.duration_since(self.received).unwrap_or(Duration::ZERO)
    }

    fn servable(&self, reason: StaleReason, max_age: Duration, age: Duration) -> bool {
        let lifetime = Duration::from_secs(self.lifetime);
        if !self.allows_stale && age >= lifetime {
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
        let body = if head { Body::empty() } else { Body::full(self.body.clone()) };
        let mut resp = Response::new(body);
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.clone_from(&self.headers);
        h.insert(header::AGE, HeaderValue::from(age));
        // Appended: caches nearer the origin keep their members first (RFC 9211 §2).
        if let Ok(v) = HeaderValue::from_str(&status) {
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
