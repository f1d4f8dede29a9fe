//! Counters of the Redis store, shared by every limit on one connection. Plain relaxed
//! atomics: the metrics room reads a [`Snapshot`]; nothing here allocates or locks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (µs) of the latency histogram buckets; a last bucket holds the rest.
pub const LATENCY_BUCKETS_US: [u64; 10] = [100, 250, 500, 1_000, 2_500, 5_000, 10_000, 20_000, 50_000, 100_000];

/// Why a call to Redis did not give an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The decision deadline (`timeout`) passed.
    Timeout,
    /// Not connected, connection refused or dropped.
    Connection,
    /// Redis answered with an error (or a reply the store cannot read).
    Reply,
    /// The breaker is open: Redis was not called.
    BreakerOpen,
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FailureKind::Timeout => "timeout",
            FailureKind::Connection => "connection",
            FailureKind::Reply => "reply",
            FailureKind::BreakerOpen => "breaker_open",
        })
    }
}

#[derive(Debug, Default)]
pub struct RedisMetrics {
    calls: AtomicU64,
    timeouts: AtomicU64,
    connection_errors: AtomicU64,
    reply_errors: AtomicU64,
    short_circuits: AtomicU64,
    redirects: AtomicU64,
    fallbacks: AtomicU64,
    denial_hits: AtomicU64,
    lease_hits: AtomicU64,
    latency_sum_us: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
}

/// A copy of the counters (monotonic since start).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Script calls sent to Redis (decisions, leases, refunds), answered or not.
    pub calls: u64,
    pub timeouts: u64,
    pub connection_errors: u64,
    pub reply_errors: u64,
    /// Decisions answered without calling Redis because the breaker was open.
    pub short_circuits: u64,
    /// Cluster redirects (MOVED, ASK) the store followed itself after the cluster client's.
    pub redirects: u64,
    /// Decisions answered by `on_error` (allow, local or deny) instead of Redis.
    pub fallbacks: u64,
    /// Denials answered from the local memory of a Redis denial.
    pub denial_hits: u64,
    /// Admissions spent from a local lease.
    pub lease_hits: u64,
    pub latency_sum_us: u64,
    /// Counts per bucket of [`LATENCY_BUCKETS_US`] (not cumulative), plus one for the rest.
    pub latency_buckets: Vec<u64>,
}

impl RedisMetrics {
    pub(super) fn call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn failure(&self, kind: FailureKind) {
        let c = match kind {
            FailureKind::Timeout => &self.timeouts,
            FailureKind::Connection => &self.connection_errors,
            FailureKind::Reply => &self.reply_errors,
            FailureKind::BreakerOpen => &self.short_circuits,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn redirect(&self) {
        self.redirects.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn fallback(&self) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn denial_hit(&self) {
        self.denial_hits.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn lease_hit(&self) {
        self.lease_hits.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn latency(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.latency_sum_us.fetch_add(us, Ordering::Relaxed);
        let i = LATENCY_BUCKETS_US.iter().position(|&b| us <= b).unwrap_or(LATENCY_BUCKETS_US.len());
        self.latency[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Snapshot {
            calls: r(&self.calls),
            timeouts: r(&self.timeouts),
            connection_errors: r(&self.connection_errors),
            reply_errors: r(&self.reply_errors),
            short_circuits: r(&self.short_circuits),
            redirects: r(&self.redirects),
            fallbacks: r(&self.fallbacks),
            denial_hits: r(&self.denial_hits),
            lease_hits: r(&self.lease_hits),
            latency_sum_us: r(&self.latency_sum_us),
            latency_buckets: self.latency.iter().map(r).collect(),
        }
    }
}
