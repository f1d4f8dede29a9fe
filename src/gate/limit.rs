//! One limit of a route with its store, its plan tiers and what a refused client is told.

use super::*;

use std::sync::Mutex;

use super::early::{Early, Told};
use crate::limit::sketch::{push_escaped, Hitter, Sketch, LABEL_BYTES};

/// One configured limit with its state.
pub struct Limit {
    pub config: LimitConfig,
    pub store: Arc<Store>,
    /// The `w` of its RateLimit-Policy item: the Retry-After of a never admissible cost.
    pub(super) window_secs: u64,
    /// The start of its `RateLimit` member (see [`ratelimit::member_head`]).
    pub(super) ratelimit_head: Box<str>,
    /// Last time a shadow denial was logged (µs), so a flood logs once a second.
    pub(super) shadow_logged: AtomicU64,
    pub metrics: LimitMetrics,
    /// With `cost.response_header`: responses whose header could not be read.
    pub(super) cost_unread: Option<prometheus_client::metrics::counter::Counter>,
    /// `plan: true`: by tier, its parameters and store (`None`: the tier is not limited by it).
    pub(super) tiers: Option<Vec<Option<TierLimit>>>,
    /// The keys it denied most, recently (for the admin listener). Only denials take this
    /// lock, one limit's only: the pass path never touches it.
    sketch: Mutex<Sketch>,
    /// The keys it denied and what each was told (see [`super::early`]).
    pub(super) early: Early,
}

/// A plan limit in one tier. Local: the limit's one store, decided with these parameters.
/// Redis: a store per tier on the same Redis keys (see [`crate::limit::RedisStore::for_plan`]).
pub(super) struct TierLimit {
    pub(super) alg: Algorithm,
    pub(super) store: Arc<Store>,
    pub(super) window_secs: u64,
}

impl Limit {
    pub fn new(config: LimitConfig, store: Arc<Store>, metrics: LimitMetrics) -> Limit {
        let (_, window_secs) = ratelimit::policy_numbers(&config.algorithm);
        let sketch = Mutex::new(Sketch::new(config.show_keys));
        let early = Early::new(config.max_keys);
        Limit {
            ratelimit_head: ratelimit::member_head(&config.name),
            config,
            store,
            window_secs,
            shadow_logged: AtomicU64::new(0),
            metrics,
            cost_unread: None,
            tiers: None,
            sketch,
            early,
        }
    }

    /// Counts a denial of `key` (enforced or shadow) in the heavy-hitter summary; with
    /// `show_keys`, a key that takes a counter gets its text from `ctx`. Out of line: only
    /// denials come here.
    /// A shadow limit remembers the wait it would have told (an enforced limit remembers the
    /// Retry-After the client gets, see [`Gate::check`]).
    #[cold]
    #[inline(never)]
    pub(super) fn note_denial(&self, key: KeyHash, ctx: &KeyCtx<'_>, now: Timestamp, decision: &Decision) {
        let parts = self.config.key.parts();
        self.sketch().record(key, now, |out| key_text(parts, ctx, out));
        if !self.enforced() {
            let secs = match *decision {
                Decision::Deny { retry_after, .. } => self.retry_after_secs(retry_after),
                Decision::Never { .. } | Decision::Allow { .. } | Decision::Delay { .. } => self.period_secs(None),
            };
            self.early.remember(key, now, secs);
        }
    }

    /// Whether `key` is back at `now` before the Retry-After it was told (counted): with
    /// `early_retry: { penalty: double }` on an enforced limit, the denial it gets instead of
    /// a decision. Costs one relaxed load while no key of its shard waits.
    #[inline]
    pub(super) fn early_retry(&self, key: KeyHash, now: Timestamp, tier: Option<TierId>) -> Option<Decision> {
        let told = self.early.told(key, now)?;
        self.penalised(told, now, tier)
    }

    #[cold]
    #[inline(never)]
    fn penalised(&self, told: Told, now: Timestamp, tier: Option<TierId>) -> Option<Decision> {
        self.metrics.early_retries.inc();
        if !(self.config.early_penalty && self.enforced()) {
            return None;
        }
        let wait = told.doubled(now, self.penalty_cap_secs(tier));
        Some(Decision::Deny { retry_after: wait, reset: wait })
    }

    /// The longest wait a penalty tells ([`ratelimit::penalty_cap_secs`]), in `tier`.
    pub(super) fn penalty_cap_secs(&self, tier: Option<TierId>) -> u64 {
        let alg = tier.and_then(|t| self.in_tier(t)).map_or(&self.config.algorithm, |t| &t.alg);
        ratelimit::penalty_cap_secs(alg)
    }

    /// The `n` keys it denied most recently, highest count first (see [`crate::limit::sketch`]).
    pub fn top_denied(&self, n: usize, now: Timestamp) -> Vec<Hitter> {
        self.sketch().top(n, now)
    }

    /// The key of a text shown by `show_keys`, while the summary holds it.
    pub fn key_of_text(&self, text: &str) -> Option<KeyHash> {
        self.sketch().find_label(text)
    }

    /// What a request of this limit's cost for `key` would be answered now, changing nothing:
    /// from the local store, or from Redis in one call that writes nothing. A plan limit is
    /// read with its default parameters (the client's tier is not known here).
    ///
    /// # Errors
    /// [`StoreError`] when Redis does not answer.
    pub async fn peek(&self, key: KeyHash, now: Timestamp) -> Result<Decision, StoreError> {
        match &*self.store {
            Store::Local(s) => Ok(s.peek(None, key, now, self.config.cost)),
            Store::Redis(s) => s.peek(key, now, self.config.cost).await,
        }
    }

    /// Whether one more of this limit's cost for `key` would be admitted now, changing
    /// nothing: the local store's state read under its shard's lock, or Redis' (a denial it
    /// answered remembered until its Retry-After; see [`crate::limit::RedisStore::would_admit`]).
    pub(super) async fn would_admit(&self, key: KeyHash, now: Timestamp) -> Result<Decision, StoreError> {
        match &*self.store {
            Store::Local(s) => Ok(s.peek(None, key, now, self.config.cost)),
            // Boxed: only routes whose failure limit is kept in Redis carry its future.
            Store::Redis(s) => Box::pin(s.would_admit(key, now, self.config.cost)).await,
        }
    }

    /// Resets `key` (an operator lets the client through at once): its state in the local
    /// store, or its Redis key (`DEL`) and what this instance remembers of it, for every tier;
    /// its count in the summary. Whether a state was there.
    ///
    /// # Errors
    /// [`StoreError`] when Redis does not answer the `DEL`.
    pub async fn reset(&self, key: KeyHash) -> Result<bool, StoreError> {
        self.sketch().forget(key);
        self.early.forget(key);
        for t in self.tiers.iter().flatten().flatten() {
            if let Store::Redis(s) = &*t.store {
                s.forget(key);
            }
        }
        match &*self.store {
            Store::Local(s) => Ok(s.reset(key)),
            Store::Redis(s) => s.reset(key).await,
        }
    }

    fn sketch(&self) -> std::sync::MutexGuard<'_, Sketch> {
        // Plain counts that every update leaves consistent: a poisoned lock is still usable.
        self.sketch.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Live keys in this limit's in-process state at `now`: keys that still hold state (a
    /// local store sweeps first), for Redis denials and leases held locally.
    pub fn live_keys(&self, now: Timestamp) -> usize {
        match &*self.store {
            Store::Local(s) => s.live(now),
            Store::Redis(s) => {
                let (denials, leases) = s.remembered();
                denials + leases
            }
        }
    }

    /// A fresh in-process store for `config`.
    pub fn local_store(config: &LimitConfig) -> Arc<Store> {
        let tiers = config.plan.iter().flat_map(|p| p.algorithms.iter().flatten().cloned());
        Arc::new(Store::Local(LocalStore::with_tiers(config.algorithm.clone(), config.max_keys, tiers)))
    }

    pub(super) fn enforced(&self) -> bool {
        self.config.mode == Mode::Enforce
    }

    /// The local store answers at once; Redis applies its `on_error` policy itself and fails
    /// only with `on_error: deny`. A plan limit decides with the parameters of `tier`.
    pub(super) async fn decide(
        &self,
        tier: Option<TierId>,
        key: KeyHash,
        now: Timestamp,
    ) -> Result<Decision, StoreError> {
        let (store, alg) = self.store_in(tier);
        match (&**store, alg) {
            (Store::Local(s), None) => Ok(s.decide(key, now, self.config.cost)),
            (Store::Local(s), Some(alg)) => Ok(s.decide_as(alg, key, now, self.config.cost)),
            // Boxed: the Redis future is large, and an unboxed one would make every local
            // decision's future as large (and memcpy'd as such).
            (Store::Redis(s), _) => Box::pin(s.decide(key, now, self.config.cost)).await,
        }
    }

    /// [`Limit::decide`] at `cost` (a message's, which may differ from the configured one).
    pub(super) async fn decide_cost(&self, key: KeyHash, now: Timestamp, cost: u64) -> Result<Decision, StoreError> {
        match &*self.store {
            Store::Local(s) => Ok(s.decide(key, now, cost)),
            Store::Redis(s) => Box::pin(s.decide(key, now, cost)).await,
        }
    }

    /// Gives back `cost` charged for `key` (in `tier`, for a plan limit).
    pub(super) async fn refund(&self, tier: Option<TierId>, key: KeyHash, now: Timestamp, cost: u64) {
        let (store, alg) = self.store_in(tier);
        match (&**store, alg) {
            (Store::Local(s), None) => s.refund(key, now, cost),
            (Store::Local(s), Some(alg)) => s.refund_as(alg, key, now, cost),
            (Store::Redis(s), _) => Box::pin(s.refund(key, now, cost)).await,
        }
    }

    /// The store and, for a plan limit in `tier`, the parameters to decide with.
    pub(super) fn store_in(&self, tier: Option<TierId>) -> (&Arc<Store>, Option<&Algorithm>) {
        match tier.and_then(|t| self.in_tier(t)) {
            Some(t) => (&t.store, Some(&t.alg)),
            None => (&self.store, None),
        }
    }

    /// This plan limit in `tier`: `None` when the tier is not limited by it.
    pub(super) fn in_tier(&self, tier: TierId) -> Option<&TierLimit> {
        self.tiers.as_ref()?.get(usize::from(tier))?.as_ref()
    }

    pub(super) async fn debit(&self, tier: Option<TierId>, key: KeyHash, now: Timestamp, cost: u64) {
        let (store, alg) = self.store_in(tier);
        match (&**store, alg) {
            (Store::Local(s), None) => s.debit(key, now, cost),
            (Store::Local(s), Some(alg)) => s.debit_as(alg, key, now, cost),
            (Store::Redis(s), _) => Box::pin(s.debit(key, now, cost)).await,
        }
    }

    /// Retry-After seconds of a denial: rounded up, and never longer than the longest wait
    /// the algorithm can need ([`ratelimit::retry_after_capped`]; a client that waits the
    /// number sent is admitted).
    pub(super) fn retry_after_secs(&self, retry_after: Span) -> u64 {
        // A debt (a response that cost more than its estimate, or units spent in a larger
        // tier) can take longer still.
        if self.config.response_cost.is_some() || self.tiers.is_some() {
            return ratelimit::retry_after_secs(retry_after);
        }
        ratelimit::retry_after_capped(&self.config.algorithm, retry_after)
    }

    /// The period `w` of this limit (in `tier`, for a plan limit): the Retry-After of a never
    /// admissible cost.
    pub(super) fn period_secs(&self, tier: Option<TierId>) -> u64 {
        tier.and_then(|t| self.in_tier(t)).map_or(self.window_secs, |t| t.window_secs).max(1)
    }

    /// Retry-After seconds of a [`Decision::Never`]: the longest a denial of this limit sends,
    /// its period. Config validation keeps every configured cost within what the limit (and
    /// its Redis fallback) admits, so this answers only a store that disagrees with it.
    pub(super) fn never_secs(&self, tier: Option<TierId>) -> u64 {
        self.period_secs(tier)
    }

    /// `retry_after`: `None` for a [`Decision::Never`].
    pub(super) fn log_shadow(&self, route: &str, now: Timestamp, retry_after: Option<Span>) {
        let now = now.as_micros();
        let last = self.shadow_logged.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= MICROS_PER_SEC
            && self.shadow_logged.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            let retry_after_ms = retry_after.map(|r| r.as_micros() / 1000);
            tracing::info!(route, limit = %self.config.name, retry_after_ms, "shadow limit would reject");
        }
    }
}

/// A key's text for `show_keys`: `part=value` per part, space-separated (`-` for a value the
/// request lacks), escaped and capped at [`LABEL_BYTES`] by [`push_escaped`].
fn key_text(parts: &[KeyPart], ctx: &KeyCtx<'_>, out: &mut String) {
    use std::io::Write;
    let mut buf = [0u8; crate::limit::key::MAX_PART_BYTES];
    for (i, part) in parts.iter().enumerate() {
        if out.len() >= LABEL_BYTES {
            return;
        }
        // The part's name through a stack buffer: a label allocates nothing.
        let mut name = [0u8; LABEL_BYTES];
        let mut w = &mut name[..];
        let _ = write!(w, "{}{part}=", if i > 0 { " " } else { "" });
        let n = LABEL_BYTES - w.len();
        push_escaped(out, &name[..n]);
        push_escaped(out, ctx.value(part, &mut buf).unwrap_or(b"-"));
    }
}
