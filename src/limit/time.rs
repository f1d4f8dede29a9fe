//! Time in the throttling math: a [`Timestamp`] is a point in time, a [`Span`] a length of
//! time, both integer microseconds over a `u64`. Separate types so that a window start cannot
//! be passed where a wait is expected; only the operations the algorithms use exist, and every
//! one of them saturates (the algorithms' contract: saturating integer µs, never a panic).
//! Raw microseconds come in and go out only at the edges: the clock, config, the Redis
//! scripts' arguments and replies, and rendering.

use std::num::NonZeroU64;
use std::ops::{Add, Div, Mul, Sub};
use std::time::Duration;

const MICROS_PER_SEC: u64 = 1_000_000;

/// A point in time in µs: since the unix epoch for [`super::SystemClock`], since whatever
/// origin a test picks for [`super::ManualClock`]. Not `std::time::Instant`: this one is plain
/// data that the Redis store shares between processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

/// A length of time in µs: an interval, a window, a wait, a time until reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Span(u64);

/// A span of at least 1 µs: an algorithm's interval or window, which the math divides by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NonZeroSpan(NonZeroU64);

impl Timestamp {
    /// The clock's origin; also the "never seen" value of state fields.
    pub const ZERO: Timestamp = Timestamp(0);
    /// The latest representable time, where additions saturate.
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    pub const fn from_micros(us: u64) -> Timestamp {
        Timestamp(us)
    }

    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// `self + d`, or `None` past [`Timestamp::MAX`].
    pub fn checked_add(self, d: Span) -> Option<Timestamp> {
        self.0.checked_add(d.0).map(Timestamp)
    }

    /// The start of the window of length `w` that holds `self`, windows being aligned to the
    /// origin: `self - self % w`.
    pub fn floor(self, w: NonZeroSpan) -> Timestamp {
        Timestamp(self.0 - self.0 % w.0)
    }
}

impl Span {
    pub const ZERO: Span = Span(0);
    pub const MAX: Span = Span(u64::MAX);

    pub const fn from_micros(us: u64) -> Span {
        Span(us)
    }

    /// `secs` seconds, saturating.
    pub const fn from_secs(secs: u64) -> Span {
        Span(secs.saturating_mul(MICROS_PER_SEC))
    }

    /// `d` in whole µs, saturating at [`Span::MAX`].
    pub fn from_duration(d: Duration) -> Span {
        Span(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// Whole seconds, rounded up.
    pub const fn as_secs_ceil(self) -> u64 {
        self.0.div_ceil(MICROS_PER_SEC)
    }

    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// `self - d`, or `None` if `d` is longer.
    pub fn checked_sub(self, d: Span) -> Option<Span> {
        self.0.checked_sub(d.0).map(Span)
    }
}

impl NonZeroSpan {
    /// 1 µs.
    pub const MIN: NonZeroSpan = NonZeroSpan(NonZeroU64::MIN);

    /// `None` for a zero span.
    pub const fn new(d: Span) -> Option<NonZeroSpan> {
        match NonZeroU64::new(d.0) {
            Some(n) => Some(NonZeroSpan(n)),
            None => None,
        }
    }

    pub const fn from_micros(us: u64) -> Option<NonZeroSpan> {
        NonZeroSpan::new(Span(us))
    }

    pub const fn get(self) -> Span {
        Span(self.0.get())
    }

    pub const fn as_micros(self) -> u64 {
        self.0.get()
    }

    /// `self × n`, saturating (still at least 1 µs).
    pub const fn saturating_mul(self, n: NonZeroU64) -> NonZeroSpan {
        NonZeroSpan(self.0.saturating_mul(n))
    }
}

/// Later by `d`, saturating at [`Timestamp::MAX`].
impl Add<Span> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Span) -> Timestamp {
        Timestamp(self.0.saturating_add(d.0))
    }
}

/// Earlier by `d`, saturating at [`Timestamp::ZERO`].
impl Sub<Span> for Timestamp {
    type Output = Timestamp;
    fn sub(self, d: Span) -> Timestamp {
        Timestamp(self.0.saturating_sub(d.0))
    }
}

/// The time from `earlier` to `self`; zero if `earlier` is not earlier.
impl Sub for Timestamp {
    type Output = Span;
    fn sub(self, earlier: Timestamp) -> Span {
        Span(self.0.saturating_sub(earlier.0))
    }
}

/// Saturating at [`Span::MAX`].
impl Add for Span {
    type Output = Span;
    fn add(self, d: Span) -> Span {
        Span(self.0.saturating_add(d.0))
    }
}

/// Saturating at zero.
impl Sub for Span {
    type Output = Span;
    fn sub(self, d: Span) -> Span {
        Span(self.0.saturating_sub(d.0))
    }
}

/// `n` times as long, saturating at [`Span::MAX`].
impl Mul<u64> for Span {
    type Output = Span;
    fn mul(self, n: u64) -> Span {
        Span(self.0.saturating_mul(n))
    }
}

/// How many whole `d` fit in `self` (rounded down); `d` is never zero, so this cannot panic.
impl Div<NonZeroSpan> for Span {
    type Output = u64;
    fn div(self, d: NonZeroSpan) -> u64 {
        self.0 / d.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{at, us};

    #[test]
    fn every_operation_saturates() {
        assert_eq!(Timestamp::MAX + us(1), Timestamp::MAX);
        assert_eq!(at(3) - us(5), Timestamp::ZERO);
        assert_eq!(at(3) - at(5), Span::ZERO);
        assert_eq!(at(5) - at(3), us(2));
        assert_eq!(Span::MAX + us(1), Span::MAX);
        assert_eq!(us(3) - us(5), Span::ZERO);
        assert_eq!(us(u64::MAX / 2) * 3, Span::MAX);
        assert_eq!(Span::from_secs(u64::MAX), Span::MAX);
        assert_eq!(Span::from_duration(Duration::MAX), Span::MAX);
        assert_eq!(Timestamp::MAX.checked_add(us(1)), None);
        assert_eq!(us(3).checked_sub(us(5)), None);
        let max = NonZeroSpan::from_micros(u64::MAX).expect("non-zero");
        assert_eq!(max.saturating_mul(NonZeroU64::MAX), max);
    }

    #[test]
    fn windows_and_ratios() {
        let w = NonZeroSpan::from_micros(1_000).expect("non-zero");
        assert_eq!(at(2_999).floor(w), at(2_000));
        assert_eq!(at(3_000).floor(w), at(3_000));
        assert_eq!(us(2_999) / w, 2);
        assert_eq!(NonZeroSpan::new(Span::ZERO), None);
        assert_eq!(us(1_000_001).as_secs_ceil(), 2);
        assert_eq!(Span::from_duration(Duration::from_nanos(1_999)), us(1));
    }
}
