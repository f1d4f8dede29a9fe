//! An adaptive concurrency limit: a gradient of latency, in the manner of Envoy's adaptive
//! concurrency filter and Netflix's Gradient2, with their known pitfalls designed out.
//!
//! Every `window` (with at least [`MIN_SAMPLES`] answers) the limit `L` moves by
//!
//! ```text
//! S  = the `percentile` of the window's round-trip times (successful answers only)
//! B  = the baseline: the lowest S seen; relearned at the floor (below)
//! g  = clamp(tolerance × B / S, 0.5, 1)
//! q  = √L when g = 1 and the window used at least half of L, else 0 (bounded growth)
//! L' = (1 − smoothing) × L + smoothing × (g × L + q), clamped to [min, max]
//! ```
//!
//! A window where more than [`FAILED_SHARE`] of the answers failed (5xx, timeouts, dropped)
//! uses g = 0.5 and leaves B alone: a stream of identical timeouts is not "no variance".
//! B only falls, except at the floor: after `relearn` windows with `L` at `min`, B becomes
//! that window's S. There is no probing phase that rejects requests to measure B; the
//! floor is the only place the baseline rises, so moderate overload cannot ratchet it up,
//! and an upstream that got slower for good is relearned instead of pinning the limit at
//! `min` forever.
//!
//! The math ([`Gradient`]) is separate from the slots ([`Cap`]), so tests drive it with
//! synthetic windows.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;

use crate::config::Adaptive;

/// A window needs this many answers before it moves the limit (else it runs on).
pub const MIN_SAMPLES: usize = 8;
/// Round-trip times kept per window; past this the newest replace the oldest.
const KEPT: usize = 256;
/// A window with more than this share of failed answers is overload.
pub const FAILED_SHARE: f64 = 0.1;

/// One window's answers, as the gradient sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Window {
    /// The `percentile` RTT of the successful answers (µs); `None` without any.
    pub rtt_us: Option<f64>,
    pub ok: u64,
    pub failed: u64,
    /// The most requests in flight during the window.
    pub peak: usize,
}

/// The limit's math: state and one step per window.
#[derive(Debug, Clone)]
pub struct Gradient {
    params: Adaptive,
    limit: f64,
    baseline: Option<f64>,
    at_floor: u32,
}

impl Gradient {
    /// Starts at `min`: the first window measures the baseline at the floor.
    pub fn new(params: Adaptive) -> Gradient {
        Gradient { limit: params.min as f64, params, baseline: None, at_floor: 0 }
    }

    pub fn limit(&self) -> usize {
        self.limit.round() as usize
    }

    /// The baseline RTT (µs), once measured.
    #[cfg(test)]
    pub fn baseline(&self) -> Option<f64> {
        self.baseline
    }

    /// Moves the limit by one window; returns the new limit.
    pub fn update(&mut self, w: Window) -> usize {
        let p = &self.params;
        let (min, max) = (p.min as f64, p.max as f64);
        let total = w.ok + w.failed;
        if total == 0 {
            return self.limit();
        }
        let overloaded = w.failed as f64 > FAILED_SHARE * total as f64;
        let gradient = match (overloaded, w.rtt_us) {
            (false, Some(s)) => {
                let s = s.max(1.0);
                let floor = self.limit <= min + 0.5;
                self.at_floor = if floor { self.at_floor + 1 } else { 0 };
                let b = match self.baseline {
                    None => s,
                    Some(_) if floor && self.at_floor >= p.relearn => s,
                    Some(b) => b.min(s),
                };
                if self.at_floor >= p.relearn {
                    self.at_floor = 0;
                }
                self.baseline = Some(b);
                (p.tolerance * b / s).clamp(0.5, 1.0)
            }
            _ => 0.5,
        };
        let used = w.peak as f64 * 2.0 >= self.limit;
        let queue = if gradient >= 1.0 && used { self.limit.sqrt() } else { 0.0 };
        let target = gradient * self.limit + queue;
        self.limit = ((1.0 - p.smoothing) * self.limit + p.smoothing * target).clamp(min, max);
        self.limit()
    }
}

/// What a window collects between updates.
struct Collecting {
    gradient: Gradient,
    started: Instant,
    rtts: Vec<u32>,
    seen: usize,
    ok: u64,
    failed: u64,
}

/// A route's adaptive cap: requests in flight against the current limit.
pub struct Cap {
    limit: AtomicUsize,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    released: Notify,
    window: Duration,
    percentile: f64,
    collecting: Mutex<Collecting>,
    gauge: Gauge,
}

/// A slot of an adaptive cap, held until the response body ends; on drop it gives its
/// round-trip time (when [`Held::succeeded`] said so) to the window.
pub struct Held {
    cap: Arc<Cap>,
    since: Instant,
    ok: bool,
}

impl Held {
    /// The answer was not a failure (below 500): its time is a sample.
    pub fn succeeded(&mut self) {
        self.ok = true;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.cap.in_flight.fetch_sub(1, Ordering::Release);
        self.cap.released.notify_one();
        self.cap.record(self.since.elapsed(), self.ok);
    }
}

impl Cap {
    pub fn new(params: Adaptive, gauge: Gauge) -> Arc<Cap> {
        let gradient = Gradient::new(params.clone());
        gauge.set(i64::try_from(gradient.limit()).unwrap_or(i64::MAX));
        Arc::new(Cap {
            limit: AtomicUsize::new(gradient.limit()),
            in_flight: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            released: Notify::new(),
            window: params.window,
            percentile: params.percentile,
            collecting: Mutex::new(Collecting {
                gradient,
                started: Instant::now(),
                rtts: Vec::with_capacity(KEPT),
                seen: 0,
                ok: 0,
                failed: 0,
            }),
            gauge,
        })
    }

    /// A slot now, or `None` at the limit.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Held> {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut cur = self.in_flight.load(Ordering::Relaxed);
        loop {
            if cur >= limit {
                return None;
            }
            match self.in_flight.compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        self.peak.fetch_max(cur + 1, Ordering::Relaxed);
        Some(Held { cap: self.clone(), since: Instant::now(), ok: false })
    }

    /// A slot within `max_wait`, or `None`.
    pub async fn acquire(self: &Arc<Self>, max_wait: Duration) -> Option<Held> {
        if let Some(h) = self.try_acquire() {
            return Some(h);
        }
        if max_wait.is_zero() {
            return None;
        }
        let deadline = tokio::time::Instant::now() + max_wait;
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(h) = self.try_acquire() {
                return Some(h);
            }
            tokio::time::timeout_at(deadline, released).await.ok()?;
        }
    }

    /// Adds one answer to the window; closes the window when it is due. Never waits: when
    /// another answer holds the window, this one is left out (a sample, not a count).
    fn record(&self, took: Duration, ok: bool) {
        let Ok(mut c) = self.collecting.try_lock() else { return };
        if ok {
            let us = u32::try_from(took.as_micros()).unwrap_or(u32::MAX);
            if c.rtts.len() < KEPT {
                c.rtts.push(us);
            } else {
                let i = c.seen % KEPT;
                c.rtts[i] = us;
            }
            c.seen += 1;
            c.ok += 1;
        } else {
            c.failed += 1;
        }
        if (c.ok + c.failed) < MIN_SAMPLES as u64 || c.started.elapsed() < self.window {
            return;
        }
        let rtt_us = (!c.rtts.is_empty()).then(|| {
            c.rtts.sort_unstable();
            let rank = ((self.percentile / 100.0) * c.rtts.len() as f64).ceil() as usize;
            f64::from(c.rtts[rank.clamp(1, c.rtts.len()) - 1])
        });
        let peak = self.peak.swap(self.in_flight.load(Ordering::Relaxed), Ordering::Relaxed);
        let window = Window { rtt_us, ok: c.ok, failed: c.failed, peak };
        let limit = c.gradient.update(window);
        self.limit.store(limit, Ordering::Relaxed);
        self.gauge.set(i64::try_from(limit).unwrap_or(i64::MAX));
        // A raised limit may admit waiters at once.
        self.released.notify_waiters();
        c.rtts.clear();
        c.seen = 0;
        c.ok = 0;
        c.failed = 0;
        c.started = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Adaptive {
        Adaptive { min: 4, max: 1000, ..Adaptive::default() }
    }

    /// A simulated upstream with `slots` workers of `service` µs each and a queue: with `l`
    /// requests in flight and demand to fill them, the median answer takes
    /// `service × max(1, l / slots)`.
    fn window(l: usize, slots: usize, service: f64) -> Window {
        let rtt = service * (l as f64 / slots as f64).max(1.0);
        Window { rtt_us: Some(rtt), ok: 100, failed: 0, peak: l }
    }

    fn run(g: &mut Gradient, windows: usize, slots: usize, service: f64) -> Vec<usize> {
        (0..windows).map(|_| g.update(window(g.limit(), slots, service))).collect()
    }

    #[test]
    fn converges_near_the_upstream_slots_with_latency_near_unloaded() {
        let mut g = Gradient::new(params());
        let limits = run(&mut g, 400, 50, 10_000.0);
        let settled = &limits[300..];
        let (lo, hi) = (*settled.iter().min().unwrap(), *settled.iter().max().unwrap());
        // At most tolerance × slots plus the √L of one growth step.
        assert!(lo >= 50 && hi <= 72, "settled between {lo} and {hi}");
        let rtt = window(hi, 50, 10_000.0).rtt_us.unwrap();
        assert!(rtt <= 10_000.0 * 1.45, "latency {rtt} µs");
        assert_eq!(g.baseline(), Some(10_000.0));
    }

    #[test]
    fn moderate_overload_does_not_grow_the_limit_without_bound() {
        // Gradient2's drift: a long average that follows the overloaded latency lets the limit
        // climb. Here the baseline only falls, so thousands of windows stay bounded.
        let mut g = Gradient::new(params());
        let limits = run(&mut g, 5000, 20, 5_000.0);
        assert!(limits[1000..].iter().all(|&l| l <= 30), "max {:?}", limits.iter().max());
    }

    #[test]
    fn recovers_when_the_upstream_gets_faster_and_relearns_when_slower() {
        let mut g = Gradient::new(params());
        run(&mut g, 300, 40, 10_000.0);
        let before = g.limit();
        // Slower for good (a new release): 4× the latency at every concurrency. The limit
        // falls to the floor, the floor relearns the baseline, and it climbs back.
        let slow = run(&mut g, 200, 40, 40_000.0);
        assert!(slow.contains(&4), "never reached the floor: {slow:?}");
        let after = run(&mut g, 600, 40, 40_000.0);
        assert!(*after.last().unwrap() >= 40, "stuck at {:?}", &after[after.len() - 5..]);
        assert_eq!(g.baseline(), Some(40_000.0));
        // Faster again: the baseline falls to the fastest window seen (12.5 ms: the limit
        // was above the slots), so the limit settles at most tolerance² × slots, latency at
        // most tolerance² × unloaded, until the next visit to the floor.
        let fast = run(&mut g, 300, 40, 10_000.0);
        let last = *fast.last().unwrap();
        assert!((40..=66).contains(&last) && before >= 40, "{before} then {last}");
        assert!(window(last, 40, 10_000.0).rtt_us.unwrap() <= 1.65 * 10_000.0);
    }

    #[test]
    fn steady_timeouts_shrink_the_limit_and_leave_the_baseline() {
        let mut g = Gradient::new(params());
        run(&mut g, 300, 100, 2_000.0);
        let high = g.limit();
        // Every answer a timeout: identical, no variance, yet overload.
        for _ in 0..100 {
            g.update(Window { rtt_us: None, ok: 0, failed: 50, peak: high });
        }
        assert_eq!((g.limit(), g.baseline()), (4, Some(2_000.0)));
        // 20 % failures with fine latency: still overload.
        let mut g2 = Gradient::new(params());
        run(&mut g2, 300, 100, 2_000.0);
        let l = g2.limit();
        g2.update(Window { rtt_us: Some(2_000.0), ok: 80, failed: 20, peak: l });
        assert!(g2.limit() < l);
    }

    #[test]
    fn an_idle_route_does_not_inflate_its_limit() {
        let mut g = Gradient::new(params());
        run(&mut g, 300, 30, 1_000.0);
        let l = g.limit();
        // Two requests in flight at a time, fast answers: no reason to grow.
        for _ in 0..1000 {
            g.update(Window { rtt_us: Some(1_000.0), ok: 20, failed: 0, peak: 2 });
        }
        assert_eq!(g.limit(), l);
    }

    #[test]
    fn growth_per_window_is_bounded_and_stays_within_min_and_max() {
        let mut g = Gradient::new(Adaptive { min: 4, max: 100, ..Adaptive::default() });
        let mut last = g.limit();
        for _ in 0..500 {
            let l = g.update(Window { rtt_us: Some(1_000.0), ok: 50, failed: 0, peak: last });
            // smoothing × √L, rounded
            assert!(l as f64 <= last as f64 + 0.2 * (last as f64).sqrt() + 1.0, "{last} → {l}");
            assert!((4..=100).contains(&l));
            last = l;
        }
        assert_eq!(last, 100);
    }

    // Paused time: the 20 ms and 10 s waits are virtual, so a loaded machine cannot turn the
    // first into a release and the second into a timeout.
    #[tokio::test(start_paused = true)]
    async fn the_cap_counts_slots_against_the_limit_and_waiters_get_released_ones() {
        let cap = Cap::new(params(), Gauge::default());
        let held: Vec<Held> = (0..4).map(|_| cap.try_acquire().unwrap()).collect();
        assert!(cap.try_acquire().is_none());
        assert!(cap.acquire(Duration::from_millis(20)).await.is_none());
        let waiter = {
            let cap = cap.clone();
            tokio::spawn(async move { cap.acquire(Duration::from_secs(10)).await.is_some() })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        assert!(waiter.await.unwrap());
        assert_eq!(cap.in_flight.load(Ordering::Relaxed), 0);
    }
}
