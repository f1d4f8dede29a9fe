//! Counts per second since a run's start, shared by the upstream and the clients (one clock).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One counter a second; events past the last second count in the last.
pub struct Series {
    start: Instant,
    buckets: Vec<AtomicU64>,
}

impl Series {
    pub fn new(start: Instant, secs: usize) -> Self {
        Series { start, buckets: (0..secs.max(1)).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Counts `n` events now.
    pub fn add(&self, n: u64) {
        self.add_at(Instant::now(), n);
    }

    /// Counts `n` events at `at` (before the start: the first second).
    pub fn add_at(&self, at: Instant, n: u64) {
        let s = at.saturating_duration_since(self.start).as_secs() as usize;
        let last = self.buckets.len() - 1;
        self.buckets[s.min(last)].fetch_add(n, Ordering::Relaxed);
    }

    pub fn values(&self) -> Vec<u64> {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect()
    }
}
