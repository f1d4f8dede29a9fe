//! Redis store: the shared truth for limits with `store: redis`. One EVALSHA per decision (a
//! Lua port of each algorithm, time from Redis `TIME`), keys hash-tagged for Cluster, plus
//! local memory of denials, optional token-bucket leases, and an `on_error` policy with breaker.
//!
//! # Keys
//! `tollgate:{<limit>:<32 hex digits of the KeyHash>}`: the braces are a Cluster hash tag, so
//! every key of one script shares a slot while different clients spread over the shards;
//! request bytes never reach Redis (only the digest), and a key is at most ~50 + limit bytes.
//!
//! # Leases (`lease: N`, token bucket only)
//! A decision that finds no local lease asks Redis for up to `N` units (at least the cost) in
//! one call and spends the rest locally until `lease_ttl` passes; unused units then lapse (they
//! were charged in Redis and are not given back). Worst case with `I` instances, rate `r = 1/T`:
//! - over-admission: none beyond Redis' bucket in units, but units are spent up to `lease_ttl`
//!   after they were taken, so any interval `t` admits at most `B + (t + lease_ttl)·r` (at most
//!   `lease_ttl·r` more than without leases, and never more than `I·(N-1)` extra at once);
//! - under-admission: up to `N-1` units per instance per lease that lapse unused, and one
//!   instance may be denied while another still holds unspent units.
//!
//! Redis calls per request ≈ `1/N` under sustained traffic on one key: while one decision
//! takes a fresh lease for a key, concurrent decisions for it wait for that lease (at most the
//! decision `timeout`) instead of each calling Redis, then spend from it or call themselves.
//!
//! # Local memory of denials
//! When Redis denies key `k` (cost `c`) for `retry_after`, this instance answers Deny for `k`
//! and the same cost (a larger one may need longer) locally until then, with the same
//! `retry_after` and `reset` Redis would give: a denial changes no state. The only difference:
//! a refund by another instance in between is noticed late (under-admission, never over).
//! Bounded by `memo_keys`. A [`Decision::Never`] (a cost above what the limit admits at once)
//! is decided without a call and not remembered: no wait changes it.

mod breaker;
mod client;
mod memo;
mod metrics;
mod noise;
mod script;

use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;

pub use breaker::BreakerState;
pub use client::RedisClient;
pub use metrics::{FailureKind, RedisMetrics, Snapshot, LATENCY_BUCKETS_US};
pub use noise::ClientLogCap;
pub use script::{check_precision, LUA_EXACT};

use self::client::Failure;
use self::memo::Memo;
/// For the fuzzing entry points: how a script's reply is read.
#[cfg(any(fuzzing, test))]
pub(crate) use self::script::decode as decode_reply;
use self::script::{decode, AlgScript, Op};
use super::{LocalStore, StoreError};
use crate::limit::{max_cost, Algorithm, Decision, KeyHash, Span, Timestamp};

/// Where Redis is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Topology {
    /// One node: `redis://[user:password@]host:port/db` or `rediss://` (TLS).
    Single(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
}

/// What a decision does when Redis gives no answer in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnError {
    /// Admit (fail open).
    Allow,
    /// Fail: the gate answers 503 with Retry-After (fail closed).
    Deny,
    /// Decide with an in-process limiter of the same parameters (divided by `instances`).
    #[default]
    Local,
}

/// Validated Redis settings (built by the config room from `redis:`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisConfig {
    pub target: Topology,
    /// Deadline of one decision (connection wait included).
    pub timeout: Duration,
    pub on_error: OnError,
    /// The local fallback divides rates and limits by this.
    pub instances: NonZeroU64,
    /// Consecutive failures that open the breaker.
    pub breaker_failures: NonZeroU32,
    /// How long the breaker stays open before one probe call.
    pub breaker_cooldown: Duration,
    /// Unspent leased units lapse after this.
    pub lease_ttl: Duration,
    /// Bound on keys remembered locally (denials, and leases), per limit.
    pub memo_keys: usize,
    /// Connecting (and PING) gives up after this.
    pub connect_timeout: Duration,
}

impl RedisConfig {
    /// Defaults for everything but the target.
    pub fn new(target: Topology) -> RedisConfig {
        RedisConfig {
            target,
            timeout: Duration::from_millis(20),
            on_error: OnError::Local,
            instances: NonZeroU64::MIN,
            breaker_failures: NonZeroU32::new(5).unwrap_or(NonZeroU32::MIN),
            breaker_cooldown: Duration::from_secs(1),
            lease_ttl: Duration::from_secs(1),
            memo_keys: 100_000,
            connect_timeout: Duration::from_secs(1),
        }
    }
}

/// The parameters of the in-process fallback: rates and limits divided by `instances`, so that
/// `instances` proxies falling back together admit about what Redis would have.
/// Each algorithm says how ([`crate::limit::algo::Rule::fallback`]).
pub fn fallback_algorithm(alg: &Algorithm, instances: NonZeroU64) -> Algorithm {
    alg.fallback(instances)
}

/// A denial remembered locally.
#[derive(Clone, Copy, Debug)]
struct Denied {
    cost: u64,
    reset_at: Timestamp,
}

/// Units leased from Redis, spent locally.
#[derive(Debug, Default)]
struct Lease {
    units: u64,
    /// Redis' `remaining` after the lease was taken (for the RateLimit header).
    remaining: u64,
    reset_at: Timestamp,
    /// Set while one decision takes a fresh lease; the others wait on it.
    refill: Option<Arc<Notify>>,
}

/// Takes `cost` units from `l` when it holds that many.
fn spend(l: &mut Lease, now: Timestamp, cost: u64) -> Option<Decision> {
    if l.units < cost {
        return None;
    }
    l.units -= cost;
    Some(Decision::Allow { remaining: l.remaining.saturating_add(l.units), reset: l.reset_at - now })
}

/// What the local lease of a key says to one decision.
enum LeaseStep<'a> {
    Spent(Decision),
    /// Another decision is taking a lease for this key.
    Wait(OwnedNotified),
    /// This decision takes the lease; the others wait until the guard drops.
    Refill(RefillGuard<'a>),
    /// No room to remember a lease: call Redis without coordinating.
    Alone,
}

/// Ends a refill, with or without a lease (also when the deciding future is dropped), and
/// wakes the decisions waiting on it.
struct RefillGuard<'a> {
    leases: &'a Memo<Lease>,
    key: KeyHash,
    notify: Arc<Notify>,
}

impl Drop for RefillGuard<'_> {
    fn drop(&mut self) {
        // `now` zero: an expired entry is still cleared rather than judged.
        self.leases.with(self.key, Timestamp::ZERO, |l, _| {
            if l.refill.as_ref().is_some_and(|n| Arc::ptr_eq(n, &self.notify)) {
                l.refill = None;
            }
            (l.units > 0 || l.refill.is_some(), ())
        });
        self.notify.notify_waiters();
    }
}

/// The Redis-backed state of one limit.
#[derive(Debug)]
pub struct RedisStore {
    client: Arc<RedisClient>,
    alg: Algorithm,
    script: AlgScript,
    prefix: String,
    max_cost: u64,
    lease: Option<NonZeroU64>,
    leases: Memo<Lease>,
    denials: Memo<Denied>,
    fallback: LocalStore,
}

impl RedisStore {
    /// The store of limit `limit_name` (unique per config; `[A-Za-z0-9._-/]`) on `client`.
    /// `lease` is honoured for token buckets only (others: one call per decision); `fallback`
    /// serves `on_error: local` (see [`fallback_algorithm`]).
    pub fn new(
        client: Arc<RedisClient>,
        limit_name: &str,
        alg: Algorithm,
        lease: Option<NonZeroU64>,
        fallback: LocalStore,
    ) -> RedisStore {
        let lease = lease.filter(|n| n.get() > 1 && alg.leases());
        let memo_keys = client.config().memo_keys;
        // Braces would break the hash tag: keep them out of the name.
        let name: String = limit_name.chars().map(|c| if matches!(c, '{' | '}') { '_' } else { c }).collect();
        RedisStore {
            script: AlgScript::new(&alg),
            prefix: format!("tollgate:{{{name}:"),
            max_cost: max_cost(&alg),
            leases: Memo::new(if lease.is_some() { memo_keys } else { 0 }),
            denials: Memo::new(memo_keys),
            alg,
            lease,
            fallback,
            client,
        }
    }

    /// The store of one tier of a plan limit: every tier's store of the limit shares its
    /// Redis keys (one state per client, whatever its tier), and token-bucket states record
    /// the interval they were charged at so a client that changes tier keeps the units it owes.
    /// No leases.
    pub fn for_plan(mut self) -> RedisStore {
        self.script = self.script.for_plan();
        self.lease = None;
        self
    }

    pub fn algorithm(&self) -> &Algorithm {
        &self.alg
    }

    pub fn client(&self) -> &Arc<RedisClient> {
        &self.client
    }

    /// Keys remembered locally: (denials, leases), for a metric.
    pub fn remembered(&self) -> (usize, usize) {
        (self.denials.len(), self.leases.len())
    }

    /// The Redis key of `key` (for tests and operators).
    pub fn redis_key(&self, key: KeyHash) -> String {
        format!("{}{:032x}}}", self.prefix, key.0)
    }

    /// SHA1 of this limit's script (`EVALSHA <sha> 1 <key> ...`, e.g. for redis-benchmark).
    pub fn script_sha(&self) -> &str {
        self.script.sha()
    }

    /// Decides one request of `cost` for `key`. `now` (local clock, µs) only times the local
    /// memory of denials and leases; Redis decides on its own clock.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when Redis gives no answer and `on_error: deny` (503). With
    /// `allow` the answer is an admission, with `local` the fallback's decision.
    pub async fn decide(&self, key: KeyHash, now: Timestamp, cost: u64) -> Result<Decision, StoreError> {
        self.decide_inner(key, now, cost, None).await
    }

    /// [`RedisStore::decide`] with the scripts on an explicit clock (tests only: production
    /// decisions read Redis `TIME`).
    #[doc(hidden)]
    pub async fn decide_at(&self, key: KeyHash, now: Timestamp, cost: u64) -> Result<Decision, StoreError> {
        self.decide_inner(key, now, cost, Some(now)).await
    }

    async fn decide_inner(
        &self,
        key: KeyHash,
        now: Timestamp,
        cost: u64,
        script_now: Option<Timestamp>,
    ) -> Result<Decision, StoreError> {
        let m = self.client.metrics();
        if cost > self.max_cost {
            // Decided here, without a call: the scripts are never asked about a cost that no
            // state admits. The key's reset is not known without one, hence zero.
            return Ok(Decision::Never { reset: Span::ZERO });
        }
        if let Some(d) = self.remembered_denial(key, now, cost) {
            return Ok(d);
        }
        let mut refill = None;
        let mut deadline = None;
        while self.lease.is_some() {
            match self.lease_step(key, now, cost) {
                LeaseStep::Spent(d) => {
                    m.lease_hit();
                    return Ok(d);
                }
                LeaseStep::Wait(notified) => {
                    // Wait for the lease being taken, then spend from it or take the next one;
                    // past the decision timeout, call Redis without waiting any longer.
                    let until =
                        *deadline.get_or_insert_with(|| tokio::time::Instant::now() + self.client.config().timeout);
                    // Boxed: rare next to spending, and it would enlarge every decision's future.
                    if Box::pin(tokio::time::timeout_at(until, notified)).await.is_err() {
                        break;
                    }
                    if let Some(d) = self.remembered_denial(key, now, cost) {
                        return Ok(d);
                    }
                }
                LeaseStep::Refill(guard) => {
                    refill = Some(guard);
                    break;
                }
                LeaseStep::Alone => break,
            }
        }
        let decided = self.call(key, now, cost, script_now).await;
        drop(refill);
        decided
    }

    /// One decision (or lease) from Redis; a lease taken is stored before it returns.
    async fn call(
        &self,
        key: KeyHash,
        now: Timestamp,
        cost: u64,
        script_now: Option<Timestamp>,
    ) -> Result<Decision, StoreError> {
        let op = match self.lease {
            Some(n) => Op::Lease(n.get().max(cost)),
            None => Op::Decide,
        };
        let rkey = self.redis_key(key);
        let build = |deadline| self.script.invocation(rkey.as_bytes(), op, cost, now, deadline, script_now);
        let reply = match self.client.invoke(build, script_now.is_none()).await {
            Ok(r) => r,
            Err(f) => return self.on_error(key, now, cost, f),
        };
        let Some((decision, granted)) = decode(&reply) else {
            let f = Failure { kind: FailureKind::Reply, retry_in: Duration::ZERO, error: None };
            return self.on_error(key, now, cost, f);
        };
        match decision {
            Decision::Deny { retry_after, reset } => {
                self.denials.insert(key, now, now + retry_after, Denied { cost, reset_at: now + reset });
            }
            Decision::Allow { remaining, reset } if granted > cost => {
                let expires = now + Span::from_duration(self.client.config().lease_ttl);
                // A fresh lease replaces what was left of the last one, so no unit is spent
                // later than `lease_ttl` after Redis charged it.
                self.leases.upsert(key, now, expires, Lease::default, |l, until| {
                    (l.units, l.remaining, l.reset_at, *until) = (granted - cost, remaining, now + reset, expires);
                    (true, ())
                });
                return Ok(Decision::Allow { remaining: remaining.saturating_add(granted - cost), reset });
            }
            _ => {}
        }
        Ok(decision)
    }

    /// What deciding `cost` for `key` would answer now, from Redis (one script call that writes
    /// nothing; its `TIME`), for the admin listener. Units leased by this instance and not yet
    /// spent are not counted.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when Redis gives no answer or a malformed one.
    pub async fn peek(&self, key: KeyHash, now: Timestamp, cost: u64) -> Result<Decision, StoreError> {
        if cost > self.max_cost {
            return Ok(Decision::Never { reset: Span::ZERO });
        }
        let rkey = self.redis_key(key);
        let build = |deadline| self.script.invocation(rkey.as_bytes(), Op::Peek, cost, now, deadline, None);
        let unavailable =
            |f: Failure| StoreError::Unavailable { kind: f.kind, retry_after: f.retry_in, message: f.to_string() };
        let reply = self.client.invoke(build, true).await.map_err(unavailable)?;
        decode(&reply)
            .map(|(d, _)| d)
            .ok_or_else(|| unavailable(Failure { kind: FailureKind::Reply, retry_in: Duration::ZERO, error: None }))
    }

    /// Resets `key`: `DEL` of its Redis key (every instance sees a fresh state at its next
    /// call), and this instance forgets its remembered denial, its lease and its fallback
    /// state. Other instances may answer a denial they remember until its Retry-After.
    /// Whether Redis held a state for it.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when Redis does not answer the `DEL`.
    pub async fn reset(&self, key: KeyHash) -> Result<bool, StoreError> {
        self.forget(key);
        self.client.del(&self.redis_key(key)).await
    }

    /// Forgets what this instance remembers of `key` (denial, lease, fallback state).
    pub fn forget(&self, key: KeyHash) {
        self.denials.remove(key);
        self.leases.remove(key);
        self.fallback.reset(key);
    }

    /// A denial of `key` at `cost` remembered from Redis, still standing at `now`.
    fn remembered_denial(&self, key: KeyHash, now: Timestamp, cost: u64) -> Option<Decision> {
        let (until, reset_at) =
            self.denials.with(key, now, |d, until| (true, (cost == d.cost).then_some((until, d.reset_at))))??;
        self.client.metrics().denial_hit();
        Some(Decision::Deny { retry_after: until - now, reset: reset_at - now })
    }

    /// Spends from the key's lease, or finds who takes the next one (under one lock).
    fn lease_step(&self, key: KeyHash, now: Timestamp, cost: u64) -> LeaseStep<'_> {
        // A marker made here lives as long as a lease would; the refill ends it sooner.
        let until = now + Span::from_duration(self.client.config().lease_ttl);
        let step = self.leases.upsert(key, now, until, Lease::default, |l, _| {
            if let Some(d) = spend(l, now, cost) {
                return (l.units > 0 || l.refill.is_some(), LeaseStep::Spent(d));
            }
            match &l.refill {
                Some(n) => (true, LeaseStep::Wait(n.clone().notified_owned())),
                None => {
                    let notify = Arc::new(Notify::new());
                    l.refill = Some(notify.clone());
                    (true, LeaseStep::Refill(RefillGuard { leases: &self.leases, key, notify }))
                }
            }
        });
        step.unwrap_or(LeaseStep::Alone)
    }

    fn on_error(&self, key: KeyHash, now: Timestamp, cost: u64, f: Failure) -> Result<Decision, StoreError> {
        self.client.metrics().fallback();
        match self.client.config().on_error {
            OnError::Allow => Ok(Decision::Allow { remaining: 0, reset: Span::ZERO }),
            OnError::Local => Ok(self.fallback.decide(key, now, cost)),
            OnError::Deny => Err(StoreError::Unavailable {
                kind: f.kind,
                retry_after: f.retry_in.max(Duration::from_secs(1)),
                message: f.to_string(),
            }),
        }
    }

    /// Undoes an admission of `cost` for `key` (a later limit of the same request denied).
    /// Leased units go back to the local lease; otherwise Redis refunds on its own clock (so a
    /// warm-up charge may differ by the µs between the two calls). Never fails: a refund that
    /// cannot reach Redis goes to the fallback (it only under-admits there), and is counted.
    pub async fn refund(&self, key: KeyHash, now: Timestamp, cost: u64) {
        self.refund_inner(key, now, cost, None).await;
    }

    /// [`RedisStore::refund`] on an explicit clock (tests only).
    #[doc(hidden)]
    pub async fn refund_at(&self, key: KeyHash, now: Timestamp, cost: u64) {
        self.refund_inner(key, now, cost, Some(now)).await;
    }

    /// Charges `cost` more for `key` (a response cost above its estimate; see
    /// [`crate::limit::debit`]): first from the key's local lease, the rest in one script call
    /// on Redis' clock. Never fails: a debit that cannot reach Redis goes to the fallback with
    /// `on_error: local`, and is otherwise lost (counted as a fallback).
    pub async fn debit(&self, key: KeyHash, now: Timestamp, cost: u64) {
        self.debit_inner(key, now, cost, None).await;
    }

    /// [`RedisStore::debit`] on an explicit clock (tests only).
    #[doc(hidden)]
    pub async fn debit_at(&self, key: KeyHash, now: Timestamp, cost: u64) {
        self.debit_inner(key, now, cost, Some(now)).await;
    }

    async fn debit_inner(&self, key: KeyHash, now: Timestamp, cost: u64, script_now: Option<Timestamp>) {
        let mut cost = cost;
        if self.lease.is_some() {
            self.leases.with(key, now, |l, _| {
                let take = l.units.min(cost);
                l.units -= take;
                cost -= take;
                (l.units > 0 || l.refill.is_some(), ())
            });
        }
        if cost == 0 {
            return;
        }
        let rkey = self.redis_key(key);
        let build = |deadline| self.script.invocation(rkey.as_bytes(), Op::Debit, cost, now, deadline, script_now);
        if self.client.invoke(build, script_now.is_none()).await.is_err() {
            self.client.metrics().fallback();
            if self.client.config().on_error == OnError::Local {
                self.fallback.debit(key, now, cost);
            }
        }
    }

    async fn refund_inner(&self, key: KeyHash, now: Timestamp, cost: u64, script_now: Option<Timestamp>) {
        if self.lease.is_some()
            && self.leases.with(key, now, |l, _| (true, l.units = l.units.saturating_add(cost))).is_some()
        {
            return;
        }
        // Whatever was denied before may fit now.
        self.denials.remove(key);
        let rkey = self.redis_key(key);
        let build = |deadline| self.script.invocation(rkey.as_bytes(), Op::Refund, cost, now, deadline, script_now);
        if self.client.invoke(build, script_now.is_none()).await.is_err()
            && self.client.config().on_error == OnError::Local
        {
            self.fallback.refund(key, now, cost);
        }
    }
}
