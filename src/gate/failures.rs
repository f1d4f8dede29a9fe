//! The failure limit of a route's `auth` (`auth.failures`): how many failed credentials a key
//! (the client's IP by default) may present in a period. It is one of the gate's limits, kept
//! after the route's own (the admission does not check it), with their store, algorithms,
//! metrics and admin rows; the `auth` step asks it twice:
//!
//! - *before* the credential is verified, [`Failures::admits`] reads the key's state without
//!   changing it: would one more failure be admitted now? That is the algorithm's own
//!   decision for the limit's cost, made on a copy of the state (local) or by the script's
//!   read-only mode (Redis), so it is exact for every algorithm: a token bucket (GCRA) with a
//!   token left, a window whose count (or weighted count, or log) leaves room for the cost, a
//!   leaky bucket whose next slot is within `max_delay` (a delay counts as room: nothing waits
//!   here, the slot is only taken). When it would not be, the client gets the `429` at once,
//!   with the wait the denial names, and nothing is verified. A cost of 0 would not do: it
//!   fits an empty bucket, and says nothing about a failure to come.
//! - *after* a credential failed (a 401 for a bad credential, a 403 for another audience; not
//!   a request without one, not a store that could not say), [`Failures::failed`] charges
//!   the cost. Successes are never charged, so a client that stops failing has its budget back
//!   as the period passes, and a refused request charges nothing either.
//!
//! The Retry-After told is therefore honest: the only thing that can charge the key in the
//! meantime is a failure, and a refused client cannot fail. (Requests of the key in flight
//! when it trips were read before the last failure was charged: each may still be verified
//! once, and a charge it makes past the limit is refused by the store, so never counted.)

use super::*;

/// A route's failure limit, as the `auth` step asks it (see the module's words).
#[derive(Clone, Copy)]
pub struct Failures<'g> {
    limit: &'g Limit,
    /// Its index among the gate's limits (the answers and the access log name it by it).
    index: usize,
}

impl Gate {
    /// The failure limit of the route's `auth`, if it has one.
    #[inline]
    pub fn failures(&self) -> Option<Failures<'_>> {
        self.limits.get(self.checked).map(|limit| Failures { limit, index: self.checked })
    }
}

impl Failures<'_> {
    /// Its index among the gate's limits, and the `RateLimit-Policy` its `429` carries (its
    /// own: the route's answers do not report it), when the limit enforces.
    pub fn policy(&self) -> (usize, Option<HeaderValue>) {
        let l = self.limit;
        let policy = ratelimit::policy(std::iter::once((l.config.name.as_str(), &l.config.algorithm)));
        (self.index, policy.filter(|_| l.enforced()))
    }

    /// Before a credential is verified: whether the key of `ctx` may fail once more at `now`.
    ///
    /// # Errors
    /// [`Error::Throttled`] (429, with the wait after which a failure is admitted again) when
    /// it may not and the limit enforces; [`Error::StoreUnavailable`] when its store cannot
    /// say and its policy refuses.
    pub async fn admits(&self, ctx: &KeyCtx<'_>, now: Timestamp) -> Result<(), Error> {
        let limit = self.limit;
        let key = ctx.key_of(self.index, &limit.config.key);
        let decision = match limit.would_admit(key, now).await {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(limit = %limit.config.name, error = %e, "failure limit store unavailable");
                let secs = match &e {
                    StoreError::Unavailable { retry_after, .. } => retry_after.as_secs().max(1),
                    StoreError::Config(_) => 1,
                };
                return Err(Error::StoreUnavailable { limit: self.index, retry_after_secs: secs });
            }
        };
        let secs = match decision {
            Decision::Allow { .. } | Decision::Delay { .. } => return Ok(()),
            Decision::Deny { retry_after, .. } => limit.retry_after_secs(retry_after),
            Decision::Never { .. } => limit.never_secs(None),
        };
        self.refused(key, ctx, now, &decision, secs)
    }

    #[cold]
    #[inline(never)]
    fn refused(&self, key: KeyHash, ctx: &KeyCtx<'_>, now: Timestamp, d: &Decision, secs: u64) -> Result<(), Error> {
        let limit = self.limit;
        limit.note_denial(key, ctx, now, d);
        if !limit.enforced() {
            limit.log_shadow(ctx.route, now, Some(Span::from_secs(secs)));
            limit.metrics.shadow_throttled.inc();
            return Ok(());
        }
        limit.metrics.throttled.inc();
        let mut limits = SmallVec::new();
        limits.push((self.index, secs));
        Err(Error::Throttled(Denied { limits, retry_after_secs: secs, policy: None }))
    }

    /// After a credential of the key of `ctx` failed: charges the limit's cost (counted as
    /// `allowed`: a failure the limit took). A store that cannot take it leaves it uncharged.
    pub async fn failed(&self, ctx: &KeyCtx<'_>, now: Timestamp) {
        let limit = self.limit;
        let key = ctx.key_of(self.index, &limit.config.key);
        match limit.decide(None, key, now).await {
            Ok(d) if d.is_admitted() => {
                limit.metrics.allowed.inc();
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(limit = %limit.config.name, error = %e, "failure not counted"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Clock, ManualClock};

    /// A gate whose route has no limits of its own and `failures: { LIMIT }`.
    fn gate(failures: &str) -> Gate {
        let yaml = format!(
            "upstreams: {{ up: {{ respond: {{}} }} }}\nroutes:\n  - name: r\n    upstream: up\n    auth:\n      jwt: {{ jwks: 'https://id.example.com/jwks.json' }}\n      failures: {failures}\n"
        );
        let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
        Gate::new(&config.routes[0], &Metrics::new(), &mut |l| Limit::local_store(l))
    }

    /// Every algorithm, windows of 1 and 2 s, costs above 1, a leaky bucket that delays.
    const LIMITS: [&str; 8] = [
        "{ algorithm: sliding_window, rate: 2/s }",
        "{ algorithm: sliding_window, rate: 4/2s, cost: 3 }",
        "{ algorithm: fixed_window, rate: 3/s }",
        "{ algorithm: sliding_log, rate: 2/s }",
        "{ algorithm: token_bucket, rate: 2/s, burst: 3 }",
        "{ algorithm: token_bucket, rate: 2/s, burst: 4, warmup: 3s, cost: 2 }",
        "{ algorithm: leaky_bucket, rate: 2/s }",
        "{ algorithm: leaky_bucket, rate: 2/s, max_delay: 1500ms, cost: 2 }",
    ];

    #[tokio::test]
    async fn failing_without_pause_is_refused_within_the_limit_for_every_algorithm() {
        for limit in LIMITS {
            let g = gate(limit);
            let f = g.failures().unwrap();
            let parts = http::Request::new(()).into_parts().0;
            let ctx = KeyCtx::test(&parts);
            let now = Timestamp::from_micros(1_000_000_000_000);
            let mut failed = 0;
            while f.admits(&ctx, now).await.is_ok() {
                f.failed(&ctx, now).await;
                failed += 1;
                assert!(failed <= 4, "{limit}: {failed} failures at one instant");
            }
            assert!(failed >= 1, "{limit}");
        }
    }

    #[tokio::test]
    async fn a_route_without_failures_has_none_and_the_admission_never_checks_one() {
        let yaml = "upstreams: { up: { respond: {} } }\nroutes:\n  - name: r\n    upstream: up\n";
        let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), yaml).unwrap();
        assert!(Gate::new(&config.routes[0], &Metrics::new(), &mut |l| Limit::local_store(l)).failures().is_none());
        // A route with only a failure limit: the admission has nothing to check.
        let g = gate("{ algorithm: fixed_window, rate: 1/h }");
        assert!(g.is_open() && g.policy().is_none());
        assert_eq!(g.limits().len(), 1);
        let f = g.failures().unwrap();
        assert_eq!(f.policy(), (0, Some(HeaderValue::from_static(r#""auth-failures";q=1;w=3600"#))));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Clients arrive at random, and each admitted one fails or not at random. Reading the
        /// limit never changes it (asked twice, the same answer; the next charge agrees with
        /// it), successes charge nothing, and a client refused with Retry-After N is still
        /// refused N − 1 s later, and let through at N.
        #[test]
        fn reading_is_exact_and_the_wait_told_is_honest(
            which in 0..LIMITS.len(),
            phase in 0u64..4_000_000,
            steps in proptest::collection::vec((0u64..400_000, proptest::bool::ANY), 1..40),
            latency in 0u64..5_000,
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let g = gate(LIMITS[which]);
                let f = g.failures().unwrap();
                let parts = http::Request::new(()).into_parts().0;
                let ctx = KeyCtx::test(&parts);
                let clock = ManualClock::new(Timestamp::from_micros(1_000_000_000_000 + phase));
                let mut refused = None;
                for (gap, fails) in steps {
                    clock.advance(Span::from_micros(gap));
                    let first = f.admits(&ctx, clock.now()).await;
                    let again = f.admits(&ctx, clock.now()).await;
                    assert_eq!(first.is_ok(), again.is_ok(), "{}: a read changed the state", LIMITS[which]);
                    match first {
                        Ok(()) if fails => {
                            let charged = f.limit.metrics.allowed.get();
                            f.failed(&ctx, clock.now()).await;
                            assert_eq!(f.limit.metrics.allowed.get(), charged + 1, "{}: read yes, charge no", LIMITS[which]);
                        }
                        Ok(()) => {}
                        Err(Error::Throttled(d)) => {
                            // Read no, charge no (a refused client cannot fail; were it to, the
                            // store would refuse the charge too).
                            let charged = f.limit.metrics.allowed.get();
                            f.failed(&ctx, clock.now()).await;
                            assert_eq!(f.limit.metrics.allowed.get(), charged, "{}: read no, charge yes", LIMITS[which]);
                            refused = Some((clock.now(), d.retry_after_secs));
                            break;
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                }
                let Some((at, secs)) = refused else { return };
                assert!(secs >= 1);
                clock.set(at + Span::from_secs(secs - 1));
                assert!(f.admits(&ctx, clock.now()).await.is_err(), "{}: let through 1 s before Retry-After: {secs}", LIMITS[which]);
                clock.set(at + Span::from_secs(secs) + Span::from_micros(latency));
                assert!(f.admits(&ctx, clock.now()).await.is_ok(), "{}: refused after Retry-After: {secs}", LIMITS[which]);
            });
        }
    }
}
