//! The dashboard's memory: a ring of per-second samples of counters tollgate already keeps
//! (answers by status class, 429s, stale copies, the upstream-time histogram, the Redis
//! store's calls and latency), taken by a task of the admin listener once a second. Rates
//! and quantiles are differences between two samples, so nothing on the request path works
//! for the dashboard; the math is here as pure functions.

use std::collections::{HashMap, VecDeque};

use crate::limit::store::redis::{Snapshot, LATENCY_BUCKETS_US};
use crate::metrics::{Seconds, SECONDS_BOUNDS};
use crate::proxy::Proxy;

/// Samples kept: one a second for five minutes.
pub const KEPT: usize = 300;

/// Buckets of the upstream-time histogram.
pub const BUCKETS: usize = SECONDS_BOUNDS + 1;

/// A route's counters at one instant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteSample {
    /// Milliseconds since the history began.
    pub at_ms: u64,
    /// Answers by status class, 1xx to 5xx.
    pub classes: [u64; 5],
    /// 429s answered (`tollgate_errors_total{kind="throttled"}`).
    pub throttled: u64,
    /// Stale copies served, for a limit or an upstream error.
    pub stale: u64,
    /// The upstream-time histogram's bucket counts (not cumulative).
    pub latency: [u64; BUCKETS],
}

impl RouteSample {
    /// Route `name`'s counters now.
    pub fn take(proxy: &Proxy, name: &str, m: &crate::metrics::RouteMetrics, at_ms: u64) -> RouteSample {
        // The series every route's answers resolve at build (`answer::KINDS`' throttled row).
        let throttled = proxy.metrics().error(name, "policy", "throttled").get();
        RouteSample {
            at_ms,
            classes: m.class_counts(),
            throttled,
            stale: m.stale_throttled.get() + m.stale_upstream_error.get(),
            latency: m.upstream_seconds.counts(),
        }
    }

    pub fn requests(&self) -> u64 {
        self.classes.iter().sum()
    }
}

/// The Redis store's counters at one instant.
#[derive(Clone, Debug, Default)]
pub struct RedisSample {
    pub at_ms: u64,
    pub snapshot: Snapshot,
}

/// The samples of every route (by name: a reload keeps a route's history) and of Redis.
#[derive(Default)]
pub struct History {
    pub routes: HashMap<String, VecDeque<RouteSample>>,
    pub redis: VecDeque<RedisSample>,
}

impl History {
    /// Takes one sample of everything `proxy` counts; routes a reload removed are forgotten.
    pub fn record(&mut self, proxy: &Proxy, at_ms: u64) {
        self.routes.retain(|name, _| proxy.config.routes.iter().any(|r| r.name == *name));
        for (route, m) in proxy.route_metrics() {
            let ring = self.routes.entry(route.name.clone()).or_insert_with(|| VecDeque::with_capacity(KEPT));
            push(ring, RouteSample::take(proxy, &route.name, m, at_ms));
        }
        match proxy.redis() {
            Some(client) => push(&mut self.redis, RedisSample { at_ms, snapshot: client.metrics().snapshot() }),
            None => self.redis.clear(),
        }
    }
}

/// Appends `sample`, dropping the oldest past [`KEPT`].
fn push<T>(ring: &mut VecDeque<T>, sample: T) {
    if ring.len() == KEPT {
        ring.pop_front();
    }
    ring.push_back(sample);
}

/// Events per second between two readings of a counter taken at `from_ms` and `to_ms`
/// (`None` when no time passed). A counter that went back (it cannot, but a route removed
/// and added again by reloads might read so) counts as zero.
pub fn rate(from: (u64, u64), to: (u64, u64)) -> Option<f64> {
    let ((from_ms, a), (to_ms, b)) = (from, to);
    let ms = to_ms.checked_sub(from_ms).filter(|ms| *ms > 0)?;
    Some(b.saturating_sub(a) as f64 * 1000.0 / ms as f64)
}

/// Bucket counts observed between two samples.
pub fn delta<const N: usize>(from: &[u64; N], to: &[u64; N]) -> [u64; N] {
    std::array::from_fn(|i| to[i].saturating_sub(from[i]))
}

/// The `q` quantile (0 < q ≤ 1) of a histogram with `counts` per bucket (not cumulative)
/// and `bounds`, the upper bound of each bucket but the last (which has none): the bucket
/// of the nearest-rank sample (rank ⌈q·n⌉), interpolated linearly inside it; for the last
/// bucket, its lower bound. Within one bucket's width of the true sample quantile. `None`
/// for an empty histogram.
pub fn quantile(counts: &[u64], bounds: &[f64], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).clamp(1, total);
    let mut below = 0;
    for (i, &n) in counts.iter().enumerate() {
        if n > 0 && below + n >= rank {
            let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
            let Some(&upper) = bounds.get(i) else { return Some(lower) };
            return Some(lower + (upper - lower) * (rank - below) as f64 / n as f64);
        }
        below += n;
    }
    None
}

/// The upper bounds of the upstream-time histogram, in milliseconds.
pub fn latency_bounds_ms() -> [f64; SECONDS_BOUNDS] {
    std::array::from_fn(|i| Seconds::bound_secs(i) * 1000.0)
}

/// The upper bounds of the Redis latency histogram, in milliseconds.
pub fn redis_bounds_ms() -> [f64; LATENCY_BUCKETS_US.len()] {
    LATENCY_BUCKETS_US.map(|us| us as f64 / 1000.0)
}

/// The sample about `secs` seconds before the last one of `ring` (the oldest when the ring
/// is younger), and the last one.
pub fn window<T>(ring: &VecDeque<T>, secs: usize) -> Option<(&T, &T)> {
    let last = ring.back()?;
    let first = ring.get(ring.len().saturating_sub(secs + 1))?;
    Some((first, last))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rates_are_per_second_and_never_negative() {
        assert_eq!(rate((0, 10), (2000, 30)), Some(10.0));
        assert_eq!(rate((1000, 5), (1500, 6)), Some(2.0));
        assert_eq!(rate((1000, 5), (1000, 9)), None);
        assert_eq!(rate((2000, 5), (1000, 9)), None);
        assert_eq!(rate((0, 9), (1000, 5)), Some(0.0));
    }

    #[test]
    fn quantiles_of_simple_histograms() {
        let bounds = [1.0, 2.0, 4.0];
        assert_eq!(quantile(&[0, 0, 0, 0], &bounds, 0.5), None);
        // Ten samples in (1, 2]: the median is halfway through the bucket.
        assert_eq!(quantile(&[0, 10, 0, 0], &bounds, 0.5), Some(1.5));
        assert_eq!(quantile(&[0, 10, 0, 0], &bounds, 1.0), Some(2.0));
        // 99 fast and one above every bound: p99 is fast, p100 the last bound.
        assert_eq!(quantile(&[99, 0, 0, 1], &bounds, 0.99), Some(1.0));
        assert_eq!(quantile(&[99, 0, 0, 1], &bounds, 1.0), Some(4.0));
        assert_eq!(delta(&[1, 5, 7], &[2, 5, 9]), [1, 0, 2]);
    }

    #[test]
    fn a_window_reaches_back_as_far_as_the_ring_does() {
        let ring: VecDeque<u64> = (0..5).collect();
        assert_eq!(window(&ring, 2), Some((&2, &4)));
        assert_eq!(window(&ring, 10), Some((&0, &4)));
        assert_eq!(window(&VecDeque::<u64>::new(), 1), None);
    }

    #[test]
    fn the_ring_keeps_five_minutes() {
        let mut ring = VecDeque::new();
        for i in 0..(KEPT + 7) {
            push(&mut ring, i);
        }
        assert_eq!(ring.len(), KEPT);
        assert_eq!(ring.front(), Some(&7));
    }

    proptest! {
        /// Samples observed into the upstream-time histogram: each quantile read from the
        /// bucket counts is within the width of the bucket holding the true (nearest-rank)
        /// quantile of the samples.
        #[test]
        fn quantiles_are_within_a_bucket_of_the_samples(
            samples in proptest::collection::vec(1u64..40_000_000_000, 1..400),
            q in 0.01f64..=1.0,
        ) {
            let h = Seconds::default();
            for ns in &samples {
                h.observe(std::time::Duration::from_nanos(*ns));
            }
            let bounds = latency_bounds_ms();
            let got = quantile(&h.counts(), &bounds, q).unwrap();
            let mut sorted = samples.clone();
            sorted.sort_unstable();
            let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
            let truth_ns = sorted[rank - 1];
            let truth = truth_ns as f64 / 1e6;
            // The bucket of the true quantile, found in integers (the histogram's own rule).
            let i = (0..SECONDS_BOUNDS).find(|i| truth_ns <= 100_000u64 << i).unwrap_or(SECONDS_BOUNDS);
            let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
            let upper = bounds.get(i).copied().unwrap_or(f64::INFINITY);
            let eps = 1e-9;
            prop_assert!(lower - eps <= got && got <= upper + eps, "{got} outside ({lower}, {upper}] of {truth}");
            prop_assert!((got - truth).abs() <= upper - lower + eps, "{got} vs {truth}");
        }
    }
}
