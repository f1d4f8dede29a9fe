//! The five algorithms as pure functions: `(params, state, now, cost) -> (Decision, state)`.
//! No I/O, no clock: both stores run this same math. Invariants: integer µs ([`Timestamp`]s for
//! points in time, [`Span`]s for lengths), saturating arithmetic (u128 for products), a denial
//! never changes the quota, and a state that is back to its initial value is reported as `None`
//! so stores can forget it (a full bucket = no entry).
//!
//! Each submodule opens with the exact state, formulas and rounding, written for the author of
//! the Redis Lua port, which must reproduce them bit for bit.

pub mod fixed;
pub mod gcra;
pub mod leaky;
pub mod log;
pub mod sliding;

#[cfg(test)]
mod props;

/// Times and decisions written with plain µs, for the tests of `limit`.
#[cfg(test)]
pub(crate) mod expect {
    use std::num::NonZeroU64;

    use super::super::{Decision, NonZeroSpan, Span, Timestamp};

    pub fn nz(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).expect("non-zero")
    }

    pub fn nzs(us: u64) -> NonZeroSpan {
        NonZeroSpan::from_micros(us).expect("non-zero")
    }

    pub fn us(n: u64) -> Span {
        Span::from_micros(n)
    }

    pub fn at(n: u64) -> Timestamp {
        Timestamp::from_micros(n)
    }

    pub fn allow(remaining: u64, reset: u64) -> Decision {
        Decision::Allow { remaining, reset: Span::from_micros(reset) }
    }

    pub fn delay(wait: u64, remaining: u64, reset: u64) -> Decision {
        Decision::Delay { wait: Span::from_micros(wait), remaining, reset: Span::from_micros(reset) }
    }

    pub fn deny(retry_after: u64, reset: u64) -> Decision {
        Decision::Deny { retry_after: Span::from_micros(retry_after), reset: Span::from_micros(reset) }
    }
}

use std::num::NonZeroU64;

use super::{Calendar, Decision, NonZeroSpan, Span, Timestamp};

/// Algorithm with validated parameters (constructed from config; invalid ones cannot exist).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// GCRA. `interval` = time per token (period / quantity, rounded down to whole µs, >= 1 µs),
    /// `burst` = capacity. A zero `warmup` disables warm-up.
    TokenBucket { interval: NonZeroSpan, burst: NonZeroU64, warmup: Span },
    /// Constant outflow of one unit per `interval`; wait at most `max_delay` (0 = strict meter).
    LeakyBucket { interval: NonZeroSpan, max_delay: Span },
    /// `limit` units per `window` aligned to the clock (window start = now - now % window), or
    /// with a `calendar` per calendar hour, day or month in a time zone (`window` is then the
    /// longest such window: the longest Retry-After and the RateLimit-Policy `w`).
    FixedWindow { window: NonZeroSpan, limit: NonZeroU64, calendar: Option<Calendar> },
    /// Counter approximation: prev * (window - elapsed) / window + cur.
    SlidingWindow { window: NonZeroSpan, limit: NonZeroU64 },
    /// Exact log of admitted (timestamp, cost) within the last `window`.
    SlidingLog { window: NonZeroSpan, limit: NonZeroU64 },
}

/// Per-key state of one algorithm. Small and `Clone`; the sliding log is boxed so that the
/// common states stay 32 bytes in the store's map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    TokenBucket(gcra::Gcra),
    LeakyBucket(leaky::Meter),
    FixedWindow(fixed::Window),
    SlidingWindow(sliding::Counter),
    SlidingLog(Box<log::Log>),
}

impl State {
    /// The initial ("never seen") state of `alg`.
    pub fn initial(alg: &Algorithm) -> State {
        match alg {
            Algorithm::TokenBucket { .. } => State::TokenBucket(gcra::Gcra::default()),
            Algorithm::LeakyBucket { .. } => State::LeakyBucket(leaky::Meter::default()),
            Algorithm::FixedWindow { .. } => State::FixedWindow(fixed::Window::default()),
            Algorithm::SlidingWindow { .. } => State::SlidingWindow(sliding::Counter::default()),
            Algorithm::SlidingLog { .. } => State::SlidingLog(Box::default()),
        }
    }

    /// True if this state has the shape `alg` expects.
    fn fits(&self, alg: &Algorithm) -> bool {
        matches!(
            (self, alg),
            (State::TokenBucket(_), Algorithm::TokenBucket { .. })
                | (State::LeakyBucket(_), Algorithm::LeakyBucket { .. })
                | (State::FixedWindow(_), Algorithm::FixedWindow { .. })
                | (State::SlidingWindow(_), Algorithm::SlidingWindow { .. })
                | (State::SlidingLog(_), Algorithm::SlidingLog { .. })
        )
    }

    /// True if at `now` this state is equivalent to the initial one (it may be forgotten).
    pub fn is_idle(&self, alg: &Algorithm, now: Timestamp) -> bool {
        match (self, alg) {
            (State::TokenBucket(s), Algorithm::TokenBucket { warmup, .. }) => s.is_idle(*warmup, now),
            (State::LeakyBucket(s), Algorithm::LeakyBucket { .. }) => s.is_idle(now),
            (State::FixedWindow(s), Algorithm::FixedWindow { .. }) => s.is_idle(now),
            (State::SlidingWindow(s), Algorithm::SlidingWindow { window, .. }) => s.is_idle(*window, now),
            (State::SlidingLog(s), Algorithm::SlidingLog { window, .. }) => s.is_idle(*window, now),
            // A state of another algorithm's shape is treated as initial everywhere.
            _ => true,
        }
    }

    /// Earliest time at which this state is idle, absent further traffic (for sweeps).
    pub fn idle_at(&self, alg: &Algorithm) -> Timestamp {
        match (self, alg) {
            (State::TokenBucket(s), Algorithm::TokenBucket { warmup, .. }) => s.idle_at(*warmup),
            (State::LeakyBucket(s), Algorithm::LeakyBucket { .. }) => s.tat,
            (State::FixedWindow(s), Algorithm::FixedWindow { .. }) => s.idle_at(),
            (State::SlidingWindow(s), Algorithm::SlidingWindow { window, .. }) => s.idle_at(*window),
            (State::SlidingLog(s), Algorithm::SlidingLog { window, .. }) => s.idle_at(*window),
            _ => Timestamp::ZERO,
        }
    }
}

/// Pure: no I/O, no clock. `state = None` means "never seen / back to initial".
/// Returns the decision and the new state (None = back to initial value, may be evicted).
pub fn decide(alg: &Algorithm, state: Option<&State>, now: Timestamp, cost: u64) -> (Decision, Option<State>) {
    let mut st = match state {
        Some(s) if s.fits(alg) => s.clone(),
        _ => State::initial(alg),
    };
    let d = decide_in_place(alg, &mut st, now, cost);
    let next = (!st.is_idle(alg, now)).then_some(st);
    (d, next)
}

/// Undo an admission of `cost` made at or before `now` (used when a later limit of the same
/// request denies: "a rejected request consumes no quota anywhere" — the gate uses refunds).
/// Exact when called at the same `now` as the admission; later, it never refunds more than that.
pub fn refund(alg: &Algorithm, state: Option<&State>, now: Timestamp, cost: u64) -> Option<State> {
    let mut st = match state {
        Some(s) if s.fits(alg) => s.clone(),
        // Nothing recorded: nothing to give back.
        _ => return None,
    };
    refund_in_place(alg, &mut st, now, cost);
    (!st.is_idle(alg, now)).then_some(st)
}

/// Largest cost this algorithm can ever admit at once (config validation: cost <= this).
/// A larger cost is always [`Decision::Never`].
pub fn max_cost(alg: &Algorithm) -> u64 {
    match alg {
        Algorithm::TokenBucket { burst, .. } => burst.get(),
        Algorithm::LeakyBucket { interval, max_delay } => leaky::max_cost(*interval, *max_delay),
        Algorithm::FixedWindow { limit, .. }
        | Algorithm::SlidingWindow { limit, .. }
        | Algorithm::SlidingLog { limit, .. } => limit.get(),
    }
}

/// The longest `retry_after` a denial of `alg` can carry for a cost it admits (at most
/// [`max_cost`]), absent a debit: what a client may have to wait, which can be longer than the
/// limit's period. Token bucket: `burst × interval`, three times that with a warm-up (a cold
/// unit is charged up to `3 × interval`). Leaky bucket: the largest cost's slots,
/// `interval × (max_delay / interval + 1)`. Fixed window and log: one window. Sliding window:
/// two windows less 1 µs (a full window's count weighs on the next one, which the request may
/// have to wait for well into), rounded here to two.
pub fn longest_wait(alg: &Algorithm) -> Span {
    match alg {
        Algorithm::TokenBucket { interval, burst, warmup } => {
            let full = interval.get() * burst.get();
            if warmup.is_zero() {
                full
            } else {
                full * 3
            }
        }
        Algorithm::LeakyBucket { interval, max_delay } => interval.get() * leaky::max_cost(*interval, *max_delay),
        Algorithm::FixedWindow { window, .. } | Algorithm::SlidingLog { window, .. } => window.get(),
        Algorithm::SlidingWindow { window, .. } => window.get() * 2,
    }
}

/// [`decide`] on a mutable state, without cloning (the store's hot path). A state of another
/// algorithm's shape is first reset to `alg`'s initial state.
pub fn decide_in_place(alg: &Algorithm, st: &mut State, now: Timestamp, cost: u64) -> Decision {
    if !st.fits(alg) {
        *st = State::initial(alg);
    }
    match (alg, st) {
        (Algorithm::TokenBucket { interval, burst, warmup }, State::TokenBucket(s)) => {
            gcra::decide(*interval, burst.get(), *warmup, s, now, cost)
        }
        (Algorithm::LeakyBucket { interval, max_delay }, State::LeakyBucket(s)) => {
            leaky::decide(*interval, *max_delay, s, now, cost)
        }
        (Algorithm::FixedWindow { window, limit, calendar }, State::FixedWindow(s)) => {
            fixed::decide(fixed::Bounds { window: *window, calendar: calendar.as_ref() }, limit.get(), s, now, cost)
        }
        (Algorithm::SlidingWindow { window, limit }, State::SlidingWindow(s)) => {
            sliding::decide(*window, limit.get(), s, now, cost)
        }
        (Algorithm::SlidingLog { window, limit }, State::SlidingLog(s)) => {
            log::decide(*window, limit.get(), s, now, cost)
        }
        // Unreachable after the reset above; deny rather than panic.
        _ => never(Span::ZERO),
    }
}

/// [`refund`] on a mutable state, without cloning. A mismatched state is left alone.
pub fn refund_in_place(alg: &Algorithm, st: &mut State, now: Timestamp, cost: u64) {
    match (alg, st) {
        (Algorithm::TokenBucket { interval, warmup, .. }, State::TokenBucket(s)) => {
            gcra::refund(*interval, *warmup, s, now, cost)
        }
        (Algorithm::LeakyBucket { interval, .. }, State::LeakyBucket(s)) => leaky::refund(*interval, s, now, cost),
        (Algorithm::FixedWindow { window, calendar, .. }, State::FixedWindow(s)) => {
            fixed::refund(fixed::Bounds { window: *window, calendar: calendar.as_ref() }, s, now, cost)
        }
        (Algorithm::SlidingWindow { window, .. }, State::SlidingWindow(s)) => sliding::refund(*window, s, now, cost),
        (Algorithm::SlidingLog { window, .. }, State::SlidingLog(s)) => log::refund(*window, s, now, cost),
        _ => {}
    }
}

/// Charges `cost` more units at `now` without a decision: the part of a response's cost above
/// its estimate. It may take the quota below zero (a token bucket's `tat` beyond `now + burst
/// × interval`, a window's count beyond its limit); later requests then wait until it is
/// repaid, and their `retry_after` includes that. A debt is capped at [`MAX_DEBT`] ahead of
/// `now` (so the Redis scripts stay exact in doubles).
pub fn debit(alg: &Algorithm, state: Option<&State>, now: Timestamp, cost: u64) -> Option<State> {
    let mut st = match state {
        Some(s) if s.fits(alg) => s.clone(),
        _ => State::initial(alg),
    };
    debit_in_place(alg, &mut st, now, cost);
    (!st.is_idle(alg, now)).then_some(st)
}

/// How far ahead of `now` a debit can push a bucket's `tat` (2^51 µs, about 71 years), and the
/// most a window can count (2^51 units).
pub const MAX_DEBT: u64 = 1 << 51;

/// [`debit`] on a mutable state. A state of another algorithm's shape is first reset.
pub fn debit_in_place(alg: &Algorithm, st: &mut State, now: Timestamp, cost: u64) {
    if cost == 0 {
        return;
    }
    if !st.fits(alg) {
        *st = State::initial(alg);
    }
    let cap = now + Span::from_micros(MAX_DEBT);
    match (alg, st) {
        (Algorithm::TokenBucket { interval, warmup, .. }, State::TokenBucket(s)) => {
            gcra::debit(*interval, *warmup, s, now, cost, cap)
        }
        (Algorithm::LeakyBucket { interval, .. }, State::LeakyBucket(s)) => {
            s.tat = (s.tat.max(now) + interval.get() * cost).min(cap);
        }
        (Algorithm::FixedWindow { window, calendar, .. }, State::FixedWindow(s)) => {
            fixed::debit(fixed::Bounds { window: *window, calendar: calendar.as_ref() }, s, now, cost.min(MAX_DEBT));
            s.count = s.count.min(MAX_DEBT);
        }
        (Algorithm::SlidingWindow { window, limit }, State::SlidingWindow(s)) => {
            sliding::debit(*window, limit.get(), s, now, cost)
        }
        (Algorithm::SlidingLog { window, .. }, State::SlidingLog(s)) => log::debit(*window, s, now, cost),
        _ => {}
    }
}

/// The decision for a cost larger than [`max_cost`]: never admissible. `reset` is the state's
/// own, as a denial at `now` would report it.
pub(crate) fn never(reset: Span) -> Decision {
    Decision::Never { reset }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{at, nz, nzs, us};

    #[test]
    fn state_stays_small() {
        assert!(std::mem::size_of::<State>() <= 32);
    }

    #[test]
    fn pure_decide_reports_initial_as_none() {
        let alg = Algorithm::TokenBucket { interval: nzs(10), burst: nz(2), warmup: Span::ZERO };
        let (d, s) = decide(&alg, None, at(100), 1);
        assert_eq!(d, Decision::Allow { remaining: 1, reset: us(10) });
        let s = s.expect("state after admission");
        // Once the bucket has refilled the state is initial again.
        let (_, again) = decide(&alg, Some(&s), at(110), 0);
        assert_eq!(again, None);
        assert_eq!(refund(&alg, Some(&s), at(100), 1), None);
    }

    #[test]
    fn mismatched_state_is_treated_as_initial() {
        let tb = Algorithm::TokenBucket { interval: nzs(10), burst: nz(1), warmup: Span::ZERO };
        let fw = Algorithm::FixedWindow { window: nzs(100), limit: nz(1), calendar: None };
        let (_, s) = decide(&fw, None, at(5), 1);
        let (d, _) = decide(&tb, s.as_ref(), at(5), 1);
        assert!(d.is_admitted());
    }

    #[test]
    fn cost_above_max_is_never_admitted() {
        for alg in [
            Algorithm::TokenBucket { interval: nzs(10), burst: nz(3), warmup: us(50) },
            Algorithm::LeakyBucket { interval: nzs(10), max_delay: us(25) },
            Algorithm::FixedWindow { window: nzs(10), limit: nz(3), calendar: None },
            Algorithm::SlidingWindow { window: nzs(10), limit: nz(3) },
            Algorithm::SlidingLog { window: nzs(10), limit: nz(3) },
        ] {
            let m = max_cost(&alg);
            assert!(decide(&alg, None, at(1000), m).0.is_admitted(), "{alg:?}");
            let (d, s) = decide(&alg, None, at(1000), m + 1);
            assert!(matches!(d, Decision::Never { .. }), "{alg:?}: {d:?}");
            assert_eq!(s, None);
        }
    }
}
