//! Time source for the stores. Algorithms never read a clock; stores call [`Clock::now`] once
//! per decision so tests can drive time by hand with [`ManualClock`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::Micros;

/// A source of the current time in microseconds.
pub trait Clock: Send + Sync + 'static {
    /// The current time in µs.
    fn now(&self) -> Micros;
}

/// Wall clock: µs since the unix epoch (0 if the system clock is set before 1970).
///
/// Wall time rather than a monotonic clock because the Redis store shares state between
/// processes; the algorithms tolerate small steps backwards (they saturate and never refill).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Micros {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A clock moved only by hand; clones share the same time.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `start`.
    pub fn new(start: Micros) -> Self {
        Self(Arc::new(AtomicU64::new(start)))
    }

    /// Sets the time to `t` (may go backwards, to test that algorithms cope).
    pub fn set(&self, t: Micros) {
        self.0.store(t, Ordering::SeqCst);
    }

    /// Moves the time forward by `d` (saturating).
    pub fn advance(&self, d: Micros) {
        // fetch_update never fails with a closure that always returns Some.
        let _ = self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| Some(t.saturating_add(d)));
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Micros {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_is_shared_between_clones() {
        let a = ManualClock::new(10);
        let b = a.clone();
        a.advance(5);
        assert_eq!(b.now(), 15);
        b.set(3);
        assert_eq!(a.now(), 3);
        a.advance(u64::MAX);
        assert_eq!(a.now(), u64::MAX);
    }

    #[test]
    fn system_clock_is_after_2020() {
        // 2020-01-01 in µs; guards against a seconds/millis mix-up.
        assert!(SystemClock.now() > 1_577_836_800_000_000);
    }
}
