//! The gate in front of a route: runs its limits (every one must admit) and its concurrency
//! cap, and writes the answers a throttled client gets: `429` with an honest `Retry-After`,
//! RateLimit headers in the draft's structured syntax, and a problem+json body.
//!
//! A request rejected by one limit consumes no quota in any other: all limits decide, and if
//! one denies, the admissions of the others are refunded (decide-then-refund; a refund is
//! exact for every algorithm, so no double charge remains).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use serde_json::json;
use smallvec::SmallVec;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::body::Body;
use crate::config::{LimitConfig, Mode, Route};
use crate::limit::{Algorithm, Decision, KeyCtx, KeyHash, LocalStore, Micros, Store, StoreError};
use crate::metrics::{LimitMetrics, Metrics};
use crate::problem;

pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

const MICROS_PER_SEC: u64 = 1_000_000;

/// A limit keeps its rendered 429 for each Retry-After of 1 to this many seconds.
const CACHED_SECS: usize = 64;

/// A rendered 429: cloned per rejection (the values are shared, not copied).
#[derive(Clone)]
struct Rejection {
    headers: HeaderMap,
    body: Bytes,
}

/// One configured limit with its state.
pub struct Limit {
    pub config: LimitConfig,
    pub store: Arc<Store>,
    /// `q` and `w` of the RateLimit-Policy item.
    quota: u64,
    window_secs: u64,
    /// Last time a shadow denial was logged (µs), so a flood logs once a second.
    shadow_logged: AtomicU64,
    pub metrics: LimitMetrics,
    /// Its 429 when it alone denies, by Retry-After seconds − 1 (see [`Gate::too_many`]).
    rejections: Box<[OnceLock<Rejection>]>,
}

/// A route's limits and concurrency cap.
pub struct Gate {
    route: String,
    /// The route name escaped for a JSON string, for the hand-written 429 body.
    route_json: String,
    limits: Vec<Limit>,
    cap: Option<Cap>,
    policy: Option<HeaderValue>,
}

struct Cap {
    slots: Arc<Semaphore>,
    max_wait: Duration,
}

/// What the gate says about one request.
pub enum Verdict {
    Admit(Admission),
    /// `429` (a limit) or `503` (the concurrency cap); nothing was consumed.
    Reject(Response<Body>, Note),
}

/// What the gate decided, for the access log: the limit that bound the request (the one
/// with the fewest remaining, or the first that rejected), what it said, and any delay.
#[derive(Debug, Default, Clone, Copy)]
pub struct Note {
    pub limit: Option<usize>,
    pub remaining: Option<u64>,
    pub retry_after_secs: Option<u64>,
    pub delayed_us: u64,
    /// The concurrency cap rejected the request.
    pub overloaded: bool,
}

/// An admitted request: wait `wait` first (leaky-bucket shaping), hold `permit` until the
/// response body ends, and put `ratelimit` on the answer.
#[derive(Default)]
pub struct Admission {
    pub wait: Duration,
    pub permit: Option<OwnedSemaphorePermit>,
    pub note: Note,
    ratelimit: Option<HeaderValue>,
}

/// Decision of one enforced limit for this request.
struct Decided {
    limit: usize,
    key: KeyHash,
    decision: Decision,
}

/// Whole seconds, rounded up, at least 1: a client that waits this long is admitted.
pub fn retry_after_secs(us: Micros) -> u64 {
    us.div_ceil(MICROS_PER_SEC).max(1)
}

fn ceil_secs(us: Micros) -> u64 {
    us.div_ceil(MICROS_PER_SEC)
}

/// `q` and `w` of an algorithm's RateLimit-Policy item.
fn policy_numbers(alg: &Algorithm) -> (u64, u64) {
    match alg {
        // A full bucket refills in burst × interval: "burst per that many seconds".
        Algorithm::TokenBucket { interval, burst, .. } => {
            (burst.get(), ceil_secs(burst.get().saturating_mul(interval.get())).max(1))
        }
        // One per interval; the queue is not quota. Expressed per second when it can be.
        Algorithm::LeakyBucket { interval, .. } => {
            let per_sec = MICROS_PER_SEC / interval.get();
            if per_sec >= 1 {
                (per_sec, 1)
            } else {
                (1, ceil_secs(interval.get()))
            }
        }
        Algorithm::FixedWindow { window, limit }
        | Algorithm::SlidingWindow { window, limit }
        | Algorithm::SlidingLog { window, limit } => (limit.get(), ceil_secs(window.get()).max(1)),
    }
}

/// Structured-field String: the names are validated to `[A-Za-z0-9._-]`, so no escaping.
fn sf_item(out: &mut String, name: &str) {
    if !out.is_empty() {
        out.push_str(", ");
    }
    out.push('"');
    out.push_str(name);
    out.push('"');
}

fn push_param(out: &mut String, key: &str, value: u64) {
    out.push(';');
    out.push_str(key);
    out.push('=');
    out.push_str(itoa::Buffer::new().format(value));
}

impl Limit {
    pub fn new(config: LimitConfig, store: Arc<Store>, metrics: LimitMetrics) -> Limit {
        let (quota, window_secs) = policy_numbers(&config.algorithm);
        let rejections = (0..CACHED_SECS).map(|_| OnceLock::new()).collect();
        Limit { config, store, quota, window_secs, shadow_logged: AtomicU64::new(0), metrics, rejections }
    }

    /// Live keys in this limit's in-process state (for Redis: denials and leases held locally).
    pub fn live_keys(&self) -> usize {
        match &*self.store {
            Store::Local(s) => s.len(),
            Store::Redis(s) => {
                let (denials, leases) = s.remembered();
                denials + leases
            }
        }
    }

    /// A fresh in-process store for `config`.
    pub fn local_store(config: &LimitConfig) -> Arc<Store> {
        Arc::new(Store::Local(LocalStore::new(config.algorithm.clone(), config.max_keys)))
    }

    /// The local store answers at once; Redis applies its `on_error` policy itself and fails
    /// only with `on_error: deny`.
    async fn decide(&self, key: KeyHash, now: Micros) -> Result<Decision, StoreError> {
        match &*self.store {
            Store::Local(s) => Ok(s.decide(key, now, self.config.cost)),
            // Boxed: the Redis future is large, and an unboxed one would make every local
            // decision's future as large (and memcpy'd as such).
            Store::Redis(s) => Box::pin(s.decide(key, now, self.config.cost)).await,
        }
    }

    async fn refund(&self, key: KeyHash, now: Micros) {
        match &*self.store {
            Store::Local(s) => s.refund(key, now, self.config.cost),
            Store::Redis(s) => Box::pin(s.refund(key, now, self.config.cost)).await,
        }
    }

    fn log_shadow(&self, route: &str, now: Micros, retry_after: Micros) {
        let last = self.shadow_logged.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= MICROS_PER_SEC
            && self.shadow_logged.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            tracing::info!(route, limit = %self.config.name, retry_after_ms = retry_after / 1000, "shadow limit would reject");
        }
    }
}

impl Gate {
    /// Builds the gate of `route`; `store_for` supplies each limit's store (a reload passes
    /// the stores of unchanged limits so their state survives).
    pub fn new(route: &Route, metrics: &Metrics, store_for: &mut dyn FnMut(&LimitConfig) -> Arc<Store>) -> Gate {
        let limits: Vec<Limit> = route
            .limits
            .iter()
            .map(|l| Limit::new(l.clone(), store_for(l), metrics.limit(&route.name, &l.name)))
            .collect();
        let mut policy = String::new();
        for l in limits.iter().filter(|l| l.config.mode == Mode::Enforce) {
            sf_item(&mut policy, &l.config.name);
            push_param(&mut policy, "q", l.quota);
            push_param(&mut policy, "w", l.window_secs);
        }
        let policy =
            (route.ratelimit_headers && !policy.is_empty()).then(|| HeaderValue::from_str(&policy).ok()).flatten();
        let quoted = serde_json::to_string(&route.name).unwrap_or_default();
        Gate {
            route_json: quoted.get(1..quoted.len().saturating_sub(1)).unwrap_or("").to_owned(),
            route: route.name.clone(),
            limits,
            cap: route
                .concurrency
                .as_ref()
                .map(|c| Cap { slots: Arc::new(Semaphore::new(c.max)), max_wait: c.max_wait }),
            policy,
        }
    }

    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// True when the gate does nothing (no limits, no cap): the proxy skips it.
    pub fn is_open(&self) -> bool {
        self.limits.is_empty() && self.cap.is_none()
    }

    /// Decides one request at `now`.
    pub async fn check(&self, ctx: &KeyCtx<'_>, now: Micros) -> Verdict {
        let mut decided: SmallVec<[Decided; 4]> = SmallVec::new();
        let mut denied = false;
        for (i, limit) in self.limits.iter().enumerate() {
            let key = limit.config.key.hash(ctx);
            let decision = match limit.decide(key, now).await {
                Ok(d) => d,
                Err(e) => {
                    // Fail closed (`on_error: deny`): nothing stays charged anywhere.
                    self.refund_admitted(&decided, now).await;
                    let secs = match &e {
                        StoreError::Unavailable { retry_after, .. } => retry_after.as_secs().max(1),
                        StoreError::Config(_) => 1,
                    };
                    let note = Note { limit: Some(i), retry_after_secs: Some(secs), ..Note::default() };
                    return Verdict::Reject(self.store_unavailable(&limit.config.name, secs, &e), note);
                }
            };
            match decision {
                Decision::Allow { .. } => {
                    limit.metrics.allowed.inc();
                }
                Decision::Delay { .. } => {
                    limit.metrics.delayed.inc();
                }
                Decision::Deny { retry_after, .. } if limit.config.mode == Mode::Shadow => {
                    limit.metrics.shadow_throttled.inc();
                    limit.log_shadow(&self.route, now, retry_after);
                }
                Decision::Deny { .. } => {
                    limit.metrics.throttled.inc();
                }
            }
            if limit.config.mode == Mode::Shadow {
                continue;
            }
            denied |= !decision.is_admitted();
            decided.push(Decided { limit: i, key, decision });
        }
        if denied {
            self.refund_admitted(&decided, now).await;
            let (resp, note) = self.too_many(&decided);
            return Verdict::Reject(resp, note);
        }

        let permit = match &self.cap {
            None => None,
            Some(cap) => match self.acquire(cap).await {
                Some(p) => Some(p),
                None => {
                    self.refund_admitted(&decided, now).await;
                    return Verdict::Reject(self.overloaded(), Note { overloaded: true, ..Note::default() });
                }
            },
        };
        let mut note = Note::default();
        for d in &decided {
            let (remaining, wait) = match d.decision {
                Decision::Allow { remaining, .. } => (remaining, 0),
                Decision::Delay { wait, remaining, .. } => (remaining, wait),
                Decision::Deny { .. } => (0, 0),
            };
            note.delayed_us = note.delayed_us.max(wait);
            if note.remaining.is_none_or(|r| remaining < r) {
                note.remaining = Some(remaining);
                note.limit = Some(d.limit);
            }
        }
        Verdict::Admit(Admission {
            wait: Duration::from_micros(note.delayed_us),
            permit,
            note,
            ratelimit: self.ratelimit_admitted(&decided),
        })
    }

    async fn acquire(&self, cap: &Cap) -> Option<OwnedSemaphorePermit> {
        match cap.slots.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) if cap.max_wait.is_zero() => None,
            Err(_) => Box::pin(tokio::time::timeout(cap.max_wait, cap.slots.clone().acquire_owned())).await.ok()?.ok(),
        }
    }

    async fn refund_admitted(&self, decided: &[Decided], now: Micros) {
        for d in decided.iter().filter(|d| d.decision.is_admitted()) {
            self.limits[d.limit].refund(d.key, now).await;
        }
    }

    fn ratelimit_admitted(&self, decided: &[Decided]) -> Option<HeaderValue> {
        if self.policy.is_none() || decided.is_empty() {
            return None;
        }
        let mut out = String::with_capacity(32 * decided.len());
        for d in decided {
            let (remaining, reset) = match d.decision {
                Decision::Allow { remaining, reset } | Decision::Delay { remaining, reset, .. } => (remaining, reset),
                Decision::Deny { reset, .. } => (0, reset),
            };
            sf_item(&mut out, &self.limits[d.limit].config.name);
            push_param(&mut out, "r", remaining);
            push_param(&mut out, "t", ceil_secs(reset));
        }
        HeaderValue::try_from(out).ok()
    }

    /// Puts the RateLimit headers of an admitted request on its answer.
    pub fn decorate(&self, admission: &mut Admission, resp: &mut Response<Body>) {
        if let (Some(policy), Some(rl)) = (&self.policy, admission.ratelimit.take()) {
            let h = resp.headers_mut();
            h.insert(RATELIMIT_POLICY, policy.clone());
            h.insert(RATELIMIT, rl);
        }
    }

    /// The 429 and what it says for the log. A flood gets this answer, so when one limit
    /// denies with a short Retry-After it is a clone of an answer rendered once (the
    /// rendering costs five hashed header inserts and five allocations).
    fn too_many(&self, decided: &[Decided]) -> (Response<Body>, Note) {
        let denying = || decided.iter().filter(|d| !d.decision.is_admitted());
        let first = denying().next().map(|d| d.limit);
        let several = denying().nth(1).is_some();
        let retry_us = denying()
            .filter_map(|d| match d.decision {
                Decision::Deny { retry_after, .. } => Some(retry_after),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let secs = retry_after_secs(retry_us);
        let note = Note { limit: first, remaining: Some(0), retry_after_secs: Some(secs), ..Note::default() };
        let slot = usize::try_from(secs - 1).ok().filter(|&s| s < CACHED_SECS && !several);
        let rejection = match (first, slot) {
            (Some(limit), Some(slot)) => {
                self.limits[limit].rejections[slot].get_or_init(|| self.render_too_many(decided, secs)).clone()
            }
            _ => self.render_too_many(decided, secs),
        };
        let mut resp = Response::new(Body::full(rejection.body));
        *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        *resp.headers_mut() = rejection.headers;
        (resp, note)
    }

    /// Body and headers of the 429 for the denying limits of `decided`, retry after `secs`.
    /// Written by hand rather than through `serde_json::Value`: limit names are validated to
    /// `[A-Za-z0-9._-]`, the route name is escaped once in [`Gate::new`].
    fn render_too_many(&self, decided: &[Decided], secs: u64) -> Rejection {
        let denied = || decided.iter().filter(|d| !d.decision.is_admitted());
        let mut rl = String::with_capacity(48);
        for d in denied() {
            if let Decision::Deny { retry_after, .. } = d.decision {
                sf_item(&mut rl, &self.limits[d.limit].config.name);
                push_param(&mut rl, "r", 0);
                push_param(&mut rl, "t", retry_after_secs(retry_after));
            }
        }
        let secs_text = itoa::Buffer::new().format(secs).to_owned();
        let mut body = String::with_capacity(256);
        body.push_str(r#"{"type":""#);
        body.push_str(problem::TYPE_BASE);
        body.push_str(r#"quota-exceeded","title":"Too many requests","status":429,"detail":"route `"#);
        body.push_str(&self.route_json);
        body.push_str("`: ");
        for (n, d) in denied().enumerate() {
            if n > 0 {
                body.push_str(" and ");
            }
            body.push_str("limit `");
            body.push_str(&self.limits[d.limit].config.name);
            body.push('`');
        }
        body.push_str(" admits no more requests now; retry after ");
        body.push_str(&secs_text);
        body.push_str(r#" s","violated-policies":["#);
        for (n, d) in denied().enumerate() {
            if n > 0 {
                body.push(',');
            }
            body.push('"');
            body.push_str(&self.limits[d.limit].config.name);
            body.push('"');
        }
        body.push_str(r#"],"retry-after":"#);
        body.push_str(&secs_text);
        body.push('}');

        let mut headers = HeaderMap::with_capacity(5);
        headers.insert(http::header::CONTENT_TYPE, problem::CONTENT_TYPE);
        headers.insert(http::header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Ok(v) = HeaderValue::try_from(secs_text) {
            headers.insert(RETRY_AFTER, v);
        }
        if let Some(policy) = &self.policy {
            headers.insert(RATELIMIT_POLICY, policy.clone());
            if let Ok(v) = HeaderValue::try_from(rl) {
                headers.insert(RATELIMIT, v);
            }
        }
        Rejection { headers, body: Bytes::from(body) }
    }

    fn store_unavailable(&self, limit: &str, secs: u64, e: &StoreError) -> Response<Body> {
        tracing::debug!(route = %self.route, limit, error = %e, "limit store unavailable");
        let mut resp = problem::response(
            StatusCode::SERVICE_UNAVAILABLE,
            "limit-store-unavailable",
            "Rate limit store unavailable",
            &format!("route `{}`: limit `{limit}` cannot be checked right now; retry after {secs} s", self.route),
            json!({ "retry-after": secs }),
        );
        resp.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
        resp
    }

    fn overloaded(&self) -> Response<Body> {
        let mut resp = problem::response(
            StatusCode::SERVICE_UNAVAILABLE,
            "concurrency-limit",
            "Too many requests in flight",
            &format!("route `{}` has reached its limit of requests in flight; retry shortly", self.route),
            json!({ "retry-after": 1 }),
        );
        resp.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1_000_000), 1);
        assert_eq!(retry_after_secs(1_000_001), 2);
        assert_eq!(retry_after_secs(2_500_000), 3);
    }

    fn gate(limits: &str) -> Gate {
        let yaml = format!(
            "listen: 127.0.0.1:1\nupstreams:\n  up: {{ respond: {{ status: 200 }} }}\nroutes:\n  - name: r\n    upstream: up\n    limits:\n{limits}"
        );
        let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
        Gate::new(&config.routes[0], &Metrics::new(), &mut |l| Limit::local_store(l))
    }

    async fn reject(gate: &Gate, now: Micros) -> (Response<Body>, String) {
        let (parts, ()) = http::Request::new(()).into_parts();
        let ctx = KeyCtx { route: "r", client_ip: "10.0.0.1".parse().unwrap(), parts: &parts };
        let Verdict::Reject(resp, _) = gate.check(&ctx, now).await else { panic!("admitted at {now}") };
        use http_body_util::BodyExt;
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        (Response::from_parts(parts, Body::empty()), String::from_utf8(bytes.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn cached_rejections_follow_the_retry_after() {
        // One request per 10 s: denied at 0 s (retry after 10), at 4.5 s (6), at 9.2 s (1).
        let g = gate("      - { name: slow, algorithm: token_bucket, rate: 1/10s, burst: 1 }\n");
        let parts = http::Request::new(()).into_parts().0;
        let ctx = KeyCtx { route: "r", client_ip: "10.0.0.1".parse().unwrap(), parts: &parts };
        let Verdict::Admit(_) = g.check(&ctx, 0).await else { panic!() };
        for round in 0..2 {
            for (now, secs) in [(1, "10"), (4_500_000, "6"), (9_200_000, "1")] {
                let (resp, body) = reject(&g, now).await;
                assert_eq!(resp.headers()[RETRY_AFTER], secs, "round {round} at {now}");
                assert_eq!(resp.headers()[RATELIMIT], format!("\"slow\";r=0;t={secs}").as_str());
                assert!(body.ends_with(&format!(r#""retry-after":{secs}}}"#)), "{body}");
            }
        }
    }

    #[tokio::test]
    async fn two_denying_limits_are_both_named() {
        let g = gate(
            "      - { name: a, algorithm: token_bucket, rate: 1/10s, burst: 1 }\n      - { name: b, algorithm: fixed_window, rate: 1/m }\n",
        );
        let parts = http::Request::new(()).into_parts().0;
        let ctx = KeyCtx { route: "r", client_ip: "10.0.0.1".parse().unwrap(), parts: &parts };
        let Verdict::Admit(_) = g.check(&ctx, 0).await else { panic!() };
        let (resp, body) = reject(&g, 1).await;
        assert_eq!(resp.headers()[RATELIMIT], "\"a\";r=0;t=10, \"b\";r=0;t=60");
        assert_eq!(resp.headers()[RETRY_AFTER], "60");
        assert!(body.contains(r#""violated-policies":["a","b"]"#), "{body}");
    }
}
