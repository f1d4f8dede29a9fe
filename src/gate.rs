//! The gate in front of a route: runs its limits (every one must admit) and its concurrency
//! cap, fixed (a semaphore) or adaptive ([`adaptive`]). It decides, and spreads the waits of
//! its denials over `retry_after_spread`; the answer module writes what a refused client gets.
//!
//! A request rejected by one limit consumes no quota in any other: all limits decide, and if
//! one denies, the admissions of the others are refunded (decide-then-refund; a refund is
//! exact for every algorithm, so no double charge remains). Shadow limits are charged and
//! refunded the same way, so they count exactly what they would if they enforced.
//!
//! A limit with `cost.response_header` admits on its estimate; the admission keeps its key
//! (the "ticket"), and [`Gate::settle`] debits or refunds the difference when the response
//! head arrives. Requests in flight are admitted on their estimates, so a key can overrun its
//! quota by at most the sum of (actual − estimate) of its requests in flight; the debt is then
//! repaid by waiting (Retry-After counts it, uncapped).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderValue};
use http::Response;
use smallvec::SmallVec;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

mod adaptive;
mod cap;
mod early;
mod failures;
mod headers;
mod limit;
pub mod messages;
mod ticket;

pub use cap::Slot;
pub use failures::Failures;
pub use limit::Limit;
pub use ticket::{Admission, Note};

use cap::Cap;
use limit::TierLimit;
use ticket::{Decided, Product};

use crate::answer::{Denied, Error};
use crate::body::Body;
use crate::config::{LimitConfig, Mode, Route};
use crate::limit::plan::{Directory, Lookup, TierId};
use crate::limit::{Algorithm, Decision, KeyHash, KeyPart, LocalStore, Span, Store, StoreError, Timestamp};
use crate::metrics::{LimitMetrics, Metrics};
use crate::ratelimit::{self, RATELIMIT, RATELIMIT_POLICY};
use crate::request_key::KeyCtx;

const MICROS_PER_SEC: u64 = 1_000_000;

/// A route's limits and concurrency cap.
pub struct Gate {
    route: String,
    /// The route's limits, then the failure limit of its `auth` (if any), which the admission
    /// does not check (see [`failures`]).
    limits: Vec<Limit>,
    /// How many of `limits` the admission checks: the route's own.
    checked: usize,
    cap: Option<Cap>,
    policy: Option<HeaderValue>,
    /// `retry_after_spread`: a denial's waits get `next % (spread + 1)` extra seconds.
    spread: u64,
    next: AtomicU64,
    /// Some limit takes its cost from the response.
    settles: bool,
    /// Some limit is `plan: true`: the client's tier is looked up first.
    directory: Option<Arc<Directory>>,
    /// `RateLimit-Policy` by tier (plan routes only).
    tier_policies: Vec<Option<HeaderValue>>,
}

impl Gate {
    /// Builds the gate of `route`; `store_for` supplies each limit's store (a reload passes
    /// the stores of unchanged limits so their state survives).
    pub fn new(route: &Route, metrics: &Metrics, store_for: &mut dyn FnMut(&LimitConfig) -> Arc<Store>) -> Gate {
        let limits: Vec<Limit> = route
            .limits
            .iter()
            .map(|l| {
                let store = store_for(l);
                let mut limit = Limit::new(l.clone(), store.clone(), metrics.limit(&route.name, &l.name));
                if l.response_cost.is_some() {
                    limit.cost_unread = Some(metrics.cost_unread(&route.name, &l.name));
                }
                if let Some(plan) = &l.plan {
                    let tiers = plan
                        .algorithms
                        .iter()
                        .map(|alg| {
                            let alg = alg.as_ref()?;
                            // Local: one state per client in the limit's store. Redis: a store
                            // per tier on the same keys.
                            let store = match &*store {
                                Store::Local(_) => store.clone(),
                                Store::Redis(_) => store_for(&LimitConfig { algorithm: alg.clone(), ..l.clone() }),
                            };
                            let window_secs = ratelimit::policy_numbers(alg).1;
                            Some(TierLimit { alg: alg.clone(), store, window_secs })
                        })
                        .collect();
                    limit.tiers = Some(tiers);
                }
                limit
            })
            .collect();
        let checked = limits.len();
        let mut limits = limits;
        if let Some(l) = route.auth.as_ref().and_then(|a| a.failures.as_ref()) {
            limits.push(Limit::new(l.clone(), store_for(l), metrics.limit(&route.name, &l.name)));
        }
        let settles = limits.iter().any(|l| l.config.response_cost.is_some());
        let enforced =
            limits[..checked].iter().filter(|l| l.enforced()).map(|l| (l.config.name.as_str(), &l.config.algorithm));
        let policy = if route.ratelimit_headers { ratelimit::policy(enforced) } else { None };
        Gate {
            route: route.name.clone(),
            limits,
            checked,
            cap: route.concurrency.as_ref().map(|c| {
                let gauge = metrics.concurrency_limit(&route.name);
                match &c.adaptive {
                    None => {
                        gauge.set(i64::try_from(c.max).unwrap_or(i64::MAX));
                        Cap::Fixed { slots: Arc::new(Semaphore::new(c.max)), max_wait: c.max_wait }
                    }
                    Some(a) => Cap::Adaptive { cap: adaptive::Cap::new(a.clone(), gauge), max_wait: c.max_wait },
                }
            }),
            policy,
            spread: route.retry_after_spread,
            next: AtomicU64::new(0),
            settles,
            directory: None,
            tier_policies: Vec::new(),
        }
    }

    /// Gives a gate with `plan: true` limits the client directory (tiers are looked up before
    /// the limits decide), and renders each tier's RateLimit-Policy: the quota of the limits
    /// that apply in that tier.
    pub fn set_directory(&mut self, directory: Arc<Directory>, ratelimit_headers: bool) {
        if !self.limits.iter().any(|l| l.tiers.is_some()) {
            return;
        }
        let tiers = directory.plans().tiers.len();
        self.tier_policies = (0..tiers)
            .map(|t| {
                let t = TierId::try_from(t).ok()?;
                if !ratelimit_headers {
                    return None;
                }
                let checked = &self.limits[..self.checked];
                let enforced = checked.iter().filter(|l| l.enforced()).filter_map(|l| match &l.tiers {
                    None => Some((l.config.name.as_str(), &l.config.algorithm)),
                    Some(_) => l.in_tier(t).map(|tl| (l.config.name.as_str(), &tl.alg)),
                });
                ratelimit::policy(enforced)
            })
            .collect();
        self.directory = Some(directory);
    }

    /// The client's tier from the file or the cache, without waiting; a client value to fetch
    /// from Redis otherwise (no buffer is held across an await).
    fn lookup_tier(directory: &Directory, ctx: &KeyCtx<'_>) -> Lookup {
        use crate::limit::key::MAX_PART_BYTES;
        let plans = directory.plans();
        if let (Some(claim), Some(id)) = (&plans.tier_claim, ctx.identity()) {
            if let Some(t) = id.claim(claim).and_then(|name| plans.tier(name)) {
                return Lookup::Tier(t);
            }
        }
        match &plans.of {
            // The common case reads the header in place: no buffer to clear.
            KeyPart::Header(name) => {
                directory.lookup(ctx.parts.headers.get(name).map(|v| &v.as_bytes()[..v.len().min(MAX_PART_BYTES)]))
            }
            part => {
                let mut buf = [0u8; MAX_PART_BYTES];
                let value = ctx.value(part, &mut buf);
                directory.lookup(value)
            }
        }
    }

    /// Every limit of the route, the failure limit of its `auth` last (the admin listener
    /// shows it, the access log names it).
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// `RateLimit-Policy` of this route's answers, when it sends RateLimit headers.
    pub fn policy(&self) -> Option<&HeaderValue> {
        self.policy.as_ref()
    }

    /// True when the gate does nothing (no limits, no cap): the proxy skips it.
    pub fn is_open(&self) -> bool {
        self.checked == 0 && self.cap.is_none()
    }

    /// Whether the route has a concurrency cap (a traced request says what it did).
    pub fn has_cap(&self) -> bool {
        self.cap.is_some()
    }

    /// Decides one request at `now`.
    ///
    /// # Errors
    /// [`Error::Throttled`] when an enforced limit denies, [`Error::OverCapacity`] when the
    /// cap is full, [`Error::StoreUnavailable`] when a store cannot decide and refuses.
    pub async fn check(&self, ctx: &KeyCtx<'_>, now: Timestamp) -> Result<Admission, Error> {
        let tier = match &self.directory {
            None => None,
            Some(d) => {
                let t = match Gate::lookup_tier(d, ctx) {
                    Lookup::Tier(t) => t,
                    // Boxed: a Redis cache miss, once per client per TTL.
                    Lookup::Fetch(value) => Box::pin(d.fetch(value)).await,
                };
                if d.plans().tiers.get(usize::from(t)).is_some_and(|t| t.deny) {
                    return Err(Error::Forbidden);
                }
                Some(t)
            }
        };
        let mut decided: SmallVec<[Decided; 4]> = SmallVec::new();
        let mut denied = false;
        for (i, limit) in self.limits[..self.checked].iter().enumerate() {
            if limit.tiers.is_some() && tier.is_some_and(|t| limit.in_tier(t).is_none()) {
                // This tier is not limited by it.
                continue;
            }
            let key = ctx.key_of(i, &limit.config.key);
            // A key back before its Retry-After is counted; with a penalty, denied unasked.
            let decision = match limit.early_retry(key, now, tier) {
                Some(d) => d,
                None => match limit.decide(tier, key, now).await {
                    Ok(d) => d,
                    Err(e) => {
                        // Fail closed (`on_error: deny`): nothing stays charged anywhere.
                        self.refund_admitted(&decided, tier, now).await;
                        tracing::debug!(route = %self.route, limit = %limit.config.name, error = %e, "limit store unavailable");
                        let secs = match &e {
                            StoreError::Unavailable { retry_after, .. } => retry_after.as_secs().max(1),
                            StoreError::Config(_) => 1,
                        };
                        return Err(Error::StoreUnavailable { limit: i, retry_after_secs: secs });
                    }
                },
            };
            if !decision.is_admitted() {
                limit.note_denial(key, ctx, now, &decision);
            }
            denied |= self.counted(limit, &decision, now);
            decided.push(Decided { limit: i, key, decision });
        }
        if denied {
            // Only what was admitted is given back: a flood against one limit admits nothing,
            // and skips the (async) refund step.
            if decided.iter().any(|d| d.decision.is_admitted()) {
                self.refund_admitted(&decided, tier, now).await;
            }
            let denied = self.denied(&decided, tier);
            self.remember_told(&decided, denied.retry_after_secs, now);
            return Err(Error::Throttled(denied));
        }

        let permit = match &self.cap {
            None => None,
            Some(cap) => match self.acquire(cap).await {
                Some(p) => Some(p),
                None => {
                    self.refund_admitted(&decided, tier, now).await;
                    return Err(Error::OverCapacity);
                }
            },
        };
        let note = self.note(&decided);
        let product = (self.settles || tier.is_some()).then(|| self.product(&decided, tier));
        Ok(Admission { permit, note, ratelimit: self.ratelimit_admitted(&decided), product })
    }

    /// Each enforced limit that denied remembers its key and the Retry-After the client gets
    /// (the longest of theirs): a request of that key sooner is an early retry.
    #[cold]
    #[inline(never)]
    fn remember_told(&self, decided: &[Decided], secs: u64, now: Timestamp) {
        for d in decided.iter().filter(|d| !d.decision.is_admitted()) {
            let limit = &self.limits[d.limit];
            if limit.enforced() {
                limit.early.remember(d.key, now, secs);
            }
        }
    }

    /// Counts `limit`'s `decision` (a shadow limit's denial is logged); whether it denies.
    #[inline]
    fn counted(&self, limit: &Limit, decision: &Decision, now: Timestamp) -> bool {
        match *decision {
            Decision::Allow { .. } => limit.metrics.allowed.inc(),
            Decision::Delay { .. } => limit.metrics.delayed.inc(),
            Decision::Deny { retry_after, .. } if !limit.enforced() => {
                limit.log_shadow(&self.route, now, Some(retry_after));
                limit.metrics.shadow_throttled.inc()
            }
            Decision::Never { .. } if !limit.enforced() => {
                limit.log_shadow(&self.route, now, None);
                limit.metrics.shadow_throttled.inc()
            }
            Decision::Deny { .. } | Decision::Never { .. } => {
                limit.metrics.throttled.inc();
                return true;
            }
        };
        false
    }

    /// For the access log: the enforced limit with the fewest remaining, and the longest wait.
    #[inline]
    fn note(&self, decided: &[Decided]) -> Note {
        let mut note = Note::default();
        for d in decided.iter().filter(|d| self.limits[d.limit].enforced()) {
            let (remaining, wait) = match d.decision {
                Decision::Allow { remaining, .. } => (remaining, Span::ZERO),
                Decision::Delay { wait, remaining, .. } => (remaining, wait),
                Decision::Deny { .. } | Decision::Never { .. } => (0, Span::ZERO),
            };
            note.delayed_us = note.delayed_us.max(wait.as_micros());
            if note.remaining.is_none_or(|r| remaining < r) {
                note.remaining = Some(remaining);
                note.limit = Some(d.limit);
            }
        }
        note
    }

    /// What an API product route's admission remembers: the costs the response settles, the tier.
    fn product(&self, decided: &[Decided], tier: Option<TierId>) -> Box<Product> {
        let owed = decided
            .iter()
            .filter(|d| self.limits[d.limit].config.response_cost.is_some() && d.decision.is_admitted())
            .map(|d| (d.limit, d.key))
            .collect();
        Box::new(Product { owed, tier })
    }

    /// Gives back every admission of a request that is refused, shadow limits' included.
    async fn refund_admitted(&self, decided: &[Decided], tier: Option<TierId>, now: Timestamp) {
        for d in decided.iter().filter(|d| d.decision.is_admitted()) {
            let limit = &self.limits[d.limit];
            limit.refund(tier, d.key, now, limit.config.cost).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn gate(limits: &str) -> (crate::config::Config, Gate) {
        let yaml = format!(
            "listen: 127.0.0.1:1\nupstreams:\n  up: {{ respond: {{ status: 200 }} }}\nroutes:\n  - name: r\n    upstream: up\n    limits:\n{limits}"
        );
        let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
        let gate = Gate::new(&config.routes[0], &Metrics::new(), &mut |l| Limit::local_store(l));
        (config, gate)
    }

    /// The gate's decision at `now` µs.
    async fn check(gate: &Gate, now: u64) -> Result<Admission, Error> {
        let parts = http::Request::new(()).into_parts().0;
        let ctx = KeyCtx::test(&parts);
        gate.check(&ctx, Timestamp::from_micros(now)).await
    }

    /// A full fixed cap: a request waits up to `max_wait` for a slot, gets one released in
    /// that time, and is refused the moment the wait is over. On tokio's paused clock, so the
    /// waits are exact: a loaded machine cannot stretch or shorten them.
    #[tokio::test(start_paused = true)]
    async fn a_full_cap_waits_exactly_max_wait_for_a_slot() {
        let yaml = "upstreams: { up: { respond: {} } }\nroutes:\n  - { name: r, upstream: up, concurrency: { max: 1, max_wait: 100ms } }\n";
        let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), yaml).unwrap();
        let g = Arc::new(Gate::new(&config.routes[0], &Metrics::new(), &mut |l| Limit::local_store(l)));
        let held = check(&g, 0).await.unwrap();
        // Released 60 ms into the wait: the waiter gets the slot then.
        let waiter = tokio::spawn({
            let g = g.clone();
            async move {
                let started = tokio::time::Instant::now();
                let got = check(&g, 0).await;
                (got.is_ok(), started.elapsed())
            }
        });
        tokio::time::sleep(Duration::from_millis(60)).await;
        drop(held);
        assert_eq!(waiter.await.unwrap(), (true, Duration::from_millis(60)));
        // Nobody releases: refused after exactly max_wait.
        let held = check(&g, 0).await.unwrap();
        let started = tokio::time::Instant::now();
        assert!(matches!(check(&g, 0).await, Err(Error::OverCapacity)));
        assert_eq!(started.elapsed(), Duration::from_millis(100));
        drop(held);
    }

    #[test]
    fn an_admission_stays_128_bytes() {
        // Moved with the request's future: past 128 bytes the moves become memcpy calls
        // (measured: about 300 instructions a request more).
        assert!(std::mem::size_of::<Admission>() <= 128, "{}", std::mem::size_of::<Admission>());
    }

    #[tokio::test]
    async fn the_ratelimit_state_of_an_admission_is_never_indexed_by_hpack() {
        let (_, g) = gate("      - { name: per-client, algorithm: token_bucket, rate: 10/s, burst: 5 }\n");
        let a = check(&g, 1).await.unwrap();
        let state = a.ratelimit.as_ref().expect("a RateLimit state");
        assert!(state.is_sensitive(), "{state:?}: its remaining count changes with every answer");
    }

    #[tokio::test]
    async fn shadow_admissions_are_refunded_when_another_limit_rejects() {
        // The shadow bucket holds 2; the enforced window admits 1 a minute.
        let (_, g) = gate(
            "      - { name: shadow, algorithm: token_bucket, rate: 1/10s, burst: 2, mode: shadow }\n      - { name: strict, algorithm: fixed_window, rate: 1/m }\n",
        );
        assert!(check(&g, 1).await.is_ok());
        assert!(matches!(check(&g, 2).await, Err(Error::Throttled(_))));
        // Refunded: the shadow bucket still has its second token, as it would if it enforced.
        assert!(matches!(check(&g, 3).await, Err(Error::Throttled(_))));
        assert_eq!(g.limits[0].metrics.shadow_throttled.get(), 0);
        assert_eq!(g.limits[0].metrics.allowed.get(), 3);
    }

    #[tokio::test]
    async fn retry_after_never_exceeds_the_limit_period() {
        let (_, g) = gate("      - { name: w, algorithm: fixed_window, rate: 2/10s }\n");
        assert!(check(&g, 0).await.is_ok());
        assert!(check(&g, 0).await.is_ok());
        let Err(Error::Throttled(d)) = check(&g, 0).await else { panic!("admitted") };
        assert_eq!(d.retry_after_secs, 10);
        // A window's wait is measured from now; it is never longer than a window.
        assert_eq!(g.limits[0].retry_after_secs(Span::MAX), 10);
        assert_eq!(g.limits[0].retry_after_secs(Span::from_micros(3_000_001)), 4);
    }

    /// Limits of the Retry-After probe: every algorithm, windows of 1 and 2 s, costs above 1.
    const PROBED: [&str; 9] = [
        "{ name: l, algorithm: sliding_window, rate: 2/s }",
        "{ name: l, algorithm: sliding_window, rate: 3/2s }",
        "{ name: l, algorithm: sliding_window, rate: 4/s, cost: 3 }",
        "{ name: l, algorithm: fixed_window, rate: 2/s }",
        "{ name: l, algorithm: sliding_log, rate: 2/s }",
        "{ name: l, algorithm: token_bucket, rate: 2/s }",
        "{ name: l, algorithm: token_bucket, rate: 2/s, burst: 4, warmup: 3s, cost: 4 }",
        "{ name: l, algorithm: leaky_bucket, rate: 2/s }",
        "{ name: l, algorithm: leaky_bucket, rate: 2/s, max_delay: 1500ms, cost: 3 }",
    ];

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// A client sends until its first 429, waits exactly its Retry-After (plus a little
        /// latency) and is admitted; one second earlier it is still refused. Arrival phases,
        /// earlier traffic and the client's pace are random; time is a manual clock.
        #[test]
        fn waiting_the_retry_after_sent_is_enough(
            which in 0..PROBED.len(),
            phase in 0u64..4_000_000,
            before in proptest::collection::vec(0u64..700_000, 0..6),
            pace in 0u64..20_000,
            latency in 0u64..5_000,
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                use crate::limit::{Clock, ManualClock};
                let (_, g) = gate(&format!("      - {}\n", PROBED[which]));
                let clock = ManualClock::new(Timestamp::from_micros(1_000_000_000_000 + phase));
                let at = |c: &ManualClock| c.now().as_micros();
                for gap in before {
                    clock.advance(Span::from_micros(gap));
                    let _ = check(&g, at(&clock)).await;
                }
                let mut secs = None;
                for _ in 0..200 {
                    clock.advance(Span::from_micros(pace));
                    if let Err(Error::Throttled(d)) = check(&g, at(&clock)).await {
                        secs = Some(d.retry_after_secs);
                        break;
                    }
                }
                let secs = secs.expect("a 429 within 200 requests");
                let denied = clock.now();
                clock.set(denied + Span::from_secs(secs - 1));
                assert!(check(&g, at(&clock)).await.is_err(), "{}: admitted 1 s before Retry-After: {secs}", PROBED[which]);
                clock.set(denied + Span::from_secs(secs) + Span::from_micros(latency));
                let again = check(&g, at(&clock)).await;
                assert!(again.is_ok(), "{}: refused after Retry-After: {secs} (phase {phase})", PROBED[which]);
            });
        }
    }

    #[tokio::test]
    async fn a_never_admissible_cost_is_denied_with_the_limit_period() {
        // Config validation refuses a cost above what a limit admits, so here the store holds a
        // smaller bucket (2) than the configured one (4, cost 3): as a divided fallback might.
        for mode in ["enforce", "shadow"] {
            let yaml = format!(
                "listen: 127.0.0.1:1\nupstreams:\n  up: {{ respond: {{ status: 200 }} }}\nroutes:\n  - name: r\n    upstream: up\n    limits:\n      - {{ name: big, algorithm: token_bucket, rate: 1/10s, burst: 4, cost: 3, mode: {mode} }}\n"
            );
            let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
            let g = Gate::new(&config.routes[0], &Metrics::new(), &mut |l| {
                let crate::limit::Algorithm::TokenBucket { interval, warmup, .. } = l.algorithm else { unreachable!() };
                let small = crate::limit::Algorithm::TokenBucket { interval, burst: 2.try_into().unwrap(), warmup };
                Arc::new(Store::Local(LocalStore::new(small, l.max_keys)))
            });
            let limit = &g.limits[0];
            if mode == "shadow" {
                assert!(check(&g, 0).await.is_ok());
                assert_eq!(limit.metrics.shadow_throttled.get(), 1);
                continue;
            }
            let Err(Error::Throttled(d)) = check(&g, 0).await else { panic!("admitted") };
            // The bucket's period: 4 × 10 s, what a never admissible cost is answered with.
            assert_eq!((&d.limits[..], d.retry_after_secs), (&[(0, 40)][..], 40));
            assert_eq!(limit.never_secs(None), 40);
            assert_eq!(limit.metrics.throttled.get(), 1);
        }
    }

    #[tokio::test]
    async fn a_thousand_denials_in_one_second_spread_their_retry_after_evenly() {
        let yaml = "listen: 127.0.0.1:1\nupstreams:\n  up: { respond: { status: 200 } }\nroutes:\n  - name: r\n    upstream: up\n    retry_after_spread: 9s\n    limits:\n      - { name: w, algorithm: fixed_window, rate: 1/m }\n";
        let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), yaml).unwrap();
        let g = Gate::new(&config.routes[0], &Metrics::new(), &mut |l| Limit::local_store(l));
        assert!(check(&g, 0).await.is_ok());
        let mut seen = [0u32; 10];
        for i in 0..1000u64 {
            // Within the first second of the window: the honest wait is 60 s, rounded up.
            let now = 1 + i * 999;
            let Err(Error::Throttled(d)) = check(&g, now).await else { panic!("admitted") };
            let honest = ratelimit::retry_after_secs(Span::from_micros(60_000_000 - now));
            assert!(d.retry_after_secs >= honest, "{} < {honest}", d.retry_after_secs);
            assert_eq!(d.limits[0].1, d.retry_after_secs);
            seen[(d.retry_after_secs - honest) as usize] += 1;
        }
        // Ten values 60 … 69 s, a hundred clients each.
        assert_eq!(seen, [100; 10]);
        // Without a spread, all of them would come back together.
        let (_, plain) = gate("      - { name: w, algorithm: fixed_window, rate: 1/m }\n");
        assert!(check(&plain, 0).await.is_ok());
        for now in [1, 500_000, 999_999] {
            let Err(Error::Throttled(d)) = check(&plain, now).await else { panic!("admitted") };
            assert_eq!(d.retry_after_secs, 60);
        }
    }

    #[tokio::test]
    async fn denial_names_every_enforced_limit_that_denied() {
        let (_, g) = gate(
            "      - { name: a, algorithm: token_bucket, rate: 1/10s, burst: 1 }\n      - { name: b, algorithm: fixed_window, rate: 1/m }\n",
        );
        assert!(check(&g, 0).await.is_ok());
        let Err(Error::Throttled(d)) = check(&g, 1).await else { panic!("admitted") };
        assert_eq!(&d.limits[..], &[(0, 10), (1, 60)]);
        assert_eq!(d.retry_after_secs, 60);
    }
}
