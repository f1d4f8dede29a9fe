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
