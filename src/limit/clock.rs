//! Time source for the stores. Algorithms never read a clock; stores call [`Clock::now`] once
//! per decision so tests can drive time by hand with [`ManualClock`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::{Span, Timestamp};

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// Wall clock: µs since the unix epoch (0 if the system clock is set before 1970).
///
/// Wall time rather than a monotonic clock because the Redis store shares state between
/// processes; the algorithms tolerate small steps backwards (they saturate and never refill).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Timestamp::ZERO + Span::from_duration(since_epoch)
    }
}

/// A clock moved only by hand; clones share the same time.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `start`.
    pub fn new(start: Timestamp) -> Self {
        Self(Arc::new(AtomicU64::new(start.as_micros())))
    }

    /// Sets the time to `t` (may go backwards, to test that algorithms cope).
    pub fn set(&self, t: Timestamp) {
        self.0.store(t.as_micros(), Ordering::SeqCst);
    }

    /// Moves the time forward by `d` (saturating).
    pub fn advance(&self, d: Span) {
        // fetch_update never fails with a closure that always returns Some.
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| Some((Timestamp::from_micros(t) + d).as_micros()));
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_micros(self.0.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_is_shared_between_clones() {
        let a = ManualClock::new(Timestamp::from_micros(10));
        let b = a.clone();
        a.advance(Span::from_micros(5));
        assert_eq!(b.now(), Timestamp::from_micros(15));
        b.set(Timestamp::from_micros(3));
        assert_eq!(a.now(), Timestamp::from_micros(3));
        a.advance(Span::MAX);
        assert_eq!(a.now(), Timestamp::MAX);
    }

    #[test]
    fn system_clock_is_after_2020() {
        // 2020-01-01 in µs; guards against a seconds/millis mix-up.
        assert!(SystemClock.now() > Timestamp::from_micros(1_577_836_800_000_000));
    }
}
