//! Fixed window counter: at most `limit` units per window aligned to the clock. Invariant: the
//! stored count belongs to the window starting at `start`; a count of an older window is zero.
//! Cheap and exact per aligned window, but up to `2 * limit` can pass around a boundary.
//!
//! # Math (the Redis port must reproduce this exactly; all values u64 µs, saturating)
//!
//! Parameters: `W = window` (>= 1), `L = limit` (>= 1). State: `start` (window start) and
//! `count`. Initial: `start = 0, count = 0`; idle iff `count == 0 || start + W <= now`.
//!
//! For a request of cost `c` at `now`:
//! - `n = max(now, start)` (a clock that steps back stays in the state's window, so it can
//!   never reopen a fresh one); `ws = n - n % W`; if `ws != start` then `start = ws, count = 0`.
//! - `end = ws + W`; `left = end - now`.
//! - `c > L` → Never { reset = left, or 0 if count == 0 } (no wait makes it fit).
//! - Admit iff `count + c <= L`: `count += c`; `remaining = L - count`; `reset = left`.
//! - Deny: `retry_after = left` (the next window is empty, so `c <= L` fits), `reset = left`.
//!   (In Redis the key is `start`-suffixed or carries TTL `left`.)
//!
//! Refund of `c` at `now`: after the same roll, `count = count - c` (saturating). A refund in
//! a later window finds nothing to give back.

use super::never;
use crate::limit::{Decision, NonZeroSpan, Span, Timestamp};

/// Fixed window state: window start and units admitted in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub start: Timestamp,
    pub count: u64,
}

impl Window {
    /// Back to initial: nothing counted in a window that is still open.
    pub fn is_idle(&self, w: NonZeroSpan, now: Timestamp) -> bool {
        self.count == 0 || self.start + w.get() <= now
    }

    /// Earliest time this state is idle without further traffic.
    pub fn idle_at(&self, w: NonZeroSpan) -> Timestamp {
        if self.count == 0 {
            Timestamp::ZERO
        } else {
            self.start + w.get()
        }
    }

    /// Moves to the window containing `now`; returns the time until that window ends.
    fn roll(&mut self, w: NonZeroSpan, now: Timestamp) -> Span {
        let ws = now.max(self.start).floor(w);
        if ws != self.start {
            self.start = ws;
            self.count = 0;
        }
        (ws + w.get()) - now
    }
}

/// One decision; see the module docs.
pub fn decide(w: NonZeroSpan, l: u64, st: &mut Window, now: Timestamp, cost: u64) -> Decision {
    let left = st.roll(w, now);
    let reset = if st.count == 0 { Span::ZERO } else { left };
    if cost > l {
        return never(reset);
    }
    match st.count.checked_add(cost).filter(|&n| n <= l) {
        Some(n) => {
            st.count = n;
            Decision::Allow { remaining: l - n, reset: if n == 0 { Span::ZERO } else { left } }
        }
        None => Decision::Deny { retry_after: left, reset },
    }
}

/// Gives back `cost` units in the current window.
pub fn refund(w: NonZeroSpan, st: &mut Window, now: Timestamp, cost: u64) {
    st.roll(w, now);
    st.count = st.count.saturating_sub(cost);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{allow, deny};

    /// A decision with window `w` and limit `l` at `now`, in µs.
    fn run(w: u64, l: u64, s: &mut Window, now: u64, cost: u64) -> Decision {
        decide(NonZeroSpan::from_micros(w).expect("non-zero"), l, s, Timestamp::from_micros(now), cost)
    }

    #[test]
    fn denies_until_the_aligned_window_ends() {
        let mut s = Window::default();
        assert_eq!(run(1_000, 2, &mut s, 1_250, 1), allow(1, 750));
        run(1_000, 2, &mut s, 1_300, 1);
        assert_eq!(run(1_000, 2, &mut s, 1_400, 1), deny(600, 600));
        assert!(!run(1_000, 2, &mut s, 1_999, 1).is_admitted());
        assert!(run(1_000, 2, &mut s, 2_000, 2).is_admitted());
    }

    #[test]
    fn boundary_burst_admits_twice_the_limit_in_a_short_interval() {
        // Documented weakness: L at the end of one window plus L at the start of the next.
        let (w, l) = (60_000_000, 100);
        let mut s = Window::default();
        let mut admitted = 0;
        for now in [w - 1, w] {
            for _ in 0..2 * l {
                if run(w, l, &mut s, now, 1).is_admitted() {
                    admitted += 1;
                }
            }
        }
        assert_eq!(admitted, 2 * l, "2L within 1 µs");
    }

    #[test]
    fn clock_stepping_back_does_not_reopen_a_window() {
        let mut s = Window::default();
        run(100, 1, &mut s, 250, 1);
        assert_eq!(run(100, 1, &mut s, 150, 1), deny(150, 150));
    }

    #[test]
    fn refund_restores_admission() {
        let mut s = Window::default();
        let (w, ten) = (NonZeroSpan::from_micros(100).expect("non-zero"), Timestamp::from_micros(10));
        run(100, 1, &mut s, 10, 1);
        assert!(!run(100, 1, &mut s, 10, 1).is_admitted());
        refund(w, &mut s, ten, 1);
        assert!(s.is_idle(w, ten));
        assert!(run(100, 1, &mut s, 10, 1).is_admitted());
    }
}
