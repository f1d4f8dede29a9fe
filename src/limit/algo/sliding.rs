//! Sliding window counter: two aligned counters, the previous one weighted by how much of it
//! still overlaps the sliding window. Invariant: `prev`/`cur` are the counts of the windows
//! starting at `start - W` and `start`; the comparison is exact integer math, no division.
//!
//! # Math (the Redis port must reproduce this exactly; all values u64 µs, u128 products)
//!
//! Parameters: `W = window` (>= 1), `L = limit` (>= 1). State: `start`, `prev`, `cur`.
//! Initial: all zero; idle iff, after the roll below, `prev == 0 && cur == 0`.
//!
//! Roll to `now`: `n = max(now, start)` (a clock stepping back stays in the state's window),
//! `ws = n - n % W`; if `ws == start + W` then `prev = cur, cur = 0`; else if `ws != start`
//! then `prev = 0, cur = 0`; `start = ws`; `e = n - ws` (elapsed, `0 <= e < W`); `rest = W - e`;
//! `lag = n - now` (0 unless the clock stepped back; added to every duration below).
//!
//! For a request of cost `c`: `c > L` → Deny { retry_after = u64::MAX }. Otherwise admit iff
//! `prev*(W - e) + (cur + c)*W <= L*W` (i.e. estimate `prev*(W-e)/W + cur + c <= L`, exact).
//! - Allow: `cur += c`; `remaining = floor((L*W - prev*(W-e)) / W) - cur` (saturating);
//!   `reset = rest + W` if `cur > 0`, else `rest` if `prev > 0`, else 0.
//! - Deny (state unchanged): `retry_after` is the smallest wait after which the same request
//!   fits, computed in two steps:
//!   1. Still in this window: if `cur + c <= L` and `prev > 0`, let
//!      `fit = floor((L - cur - c)*W / prev)`; if `fit > 0` then `retry_after = rest - fit`
//!      (then `prev*(W - e') = prev*fit <= (L-cur-c)*W`; one µs earlier it does not fit).
//!   2. Otherwise in the next window, where `prev' = cur`, `cur' = 0`: wait
//!      `retry_after = rest + e2` with `e2 = 0` if `cur == 0`, else
//!      `e2 = W - min(W, floor((L - c)*W / cur))`. (`e2 == W` lands on the window after,
//!      which is empty, so it fits.) The estimate only falls within a window, so this is
//!      minimal.
//!
//!   `reset` as for Allow, without the new request.
//!
//! Error vs an exact sliding log: every aligned window admits at most `L` (the `cur` term
//! alone), and any interval of `W` µs admits at most `2L - 1` units: `a` units at the end of
//! one window (`a <= L`) leave the next window at most `L - ceil(a*(d+1)/W)`, where `d` is the
//! part of the interval in the first window. The worst case is a burst at a window's end after
//! an idle window. Under traffic spread evenly over the previous window it is exact.
//!
//! Refund of `c` at `now`: roll, then `cur = cur - c` (saturating).

use super::never;
use crate::limit::{Decision, Micros};

/// Sliding window counter state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub start: Micros,
    pub prev: u64,
    pub cur: u64,
}

/// The state rolled to `now`, with the elapsed time `e` and the clock lag.
struct Rolled {
    e: u64,
    lag: u64,
}

impl Counter {
    fn roll(&mut self, w: u64, now: Micros) -> Rolled {
        let n = now.max(self.start);
        let ws = n - n % w;
        if ws != self.start {
            let next = self.start.checked_add(w) == Some(ws);
            self.prev = if next { self.cur } else { 0 };
            self.cur = 0;
            self.start = ws;
        }
        Rolled { e: n - ws, lag: n - now }
    }

    /// Back to initial: nothing that still weighs on the estimate.
    pub fn is_idle(&self, w: u64, now: Micros) -> bool {
        let mut c = *self;
        c.roll(w, now);
        c.prev == 0 && c.cur == 0
    }

    /// Earliest time this state is idle without further traffic.
    pub fn idle_at(&self, w: u64) -> Micros {
        if self.cur > 0 {
            self.start.saturating_add(w.saturating_mul(2))
        } else if self.prev > 0 {
            self.start.saturating_add(w)
        } else {
            0
        }
    }

    fn reset(&self, rest: u64, w: u64) -> Micros {
        if self.cur > 0 {
            rest.saturating_add(w)
        } else if self.prev > 0 {
            rest
        } else {
            0
        }
    }
}

/// One decision; see the module docs.
pub fn decide(w: u64, l: u64, st: &mut Counter, now: Micros, cost: u64) -> Decision {
    let Rolled { e, lag } = st.roll(w, now);
    let rest = w - e;
    let (w128, l128) = (u128::from(w), u128::from(l));
    let weighted = u128::from(st.prev) * u128::from(rest);
    if cost > l {
        return never(st.reset(rest, w).saturating_add(lag));
    }
    let cur = u128::from(st.cur) + u128::from(cost);
    if weighted + cur * w128 <= l128 * w128 {
        // cur + cost <= L here, so it fits in u64.
        st.cur = st.cur.saturating_add(cost);
        let room = (l128 * w128 - weighted) / w128;
        let remaining = u64::try_from(room).unwrap_or(u64::MAX).saturating_sub(st.cur);
        return Decision::Allow { remaining, reset: st.reset(rest, w).saturating_add(lag) };
    }
    Decision::Deny {
        retry_after: retry_after(w, l, st, rest, cost).saturating_add(lag),
        reset: st.reset(rest, w).saturating_add(lag),
    }
}

/// Smallest wait after which `cost` fits (steps 1 and 2 of the module docs); `cost <= l`.
fn retry_after(w: u64, l: u64, st: &Counter, rest: u64, cost: u64) -> Micros {
    let w128 = u128::from(w);
    if let Some(spare) = l.checked_sub(st.cur).and_then(|s| s.checked_sub(cost)) {
        if st.prev > 0 {
            let fit = u128::from(spare) * w128 / u128::from(st.prev);
            if fit > 0 {
                // fit < rest, otherwise the request would have been admitted.
                let fit = u64::try_from(fit).unwrap_or(u64::MAX).min(rest);
                return rest - fit;
            }
        }
    }
    let e2 = if st.cur == 0 {
        0
    } else {
        let fit = u128::from(l - cost) * w128 / u128::from(st.cur);
        w - u64::try_from(fit.min(w128)).unwrap_or(w)
    };
    rest.saturating_add(e2)
}

/// Gives back `cost` units in the current window.
pub fn refund(w: u64, st: &mut Counter, now: Micros, cost: u64) {
    st.roll(w, now);
    st.cur = st.cur.saturating_sub(cost);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_the_previous_window_by_its_overlap() {
        // W=1000, L=10: 10 in [0,1000). At 1250, prev weighs 10*750/1000 = 7.5, so 2 fit.
        let (w, l) = (1_000, 10);
        let mut s = Counter::default();
        assert!(decide(w, l, &mut s, 500, 10).is_admitted());
        assert_eq!(decide(w, l, &mut s, 1_250, 2), Decision::Allow { remaining: 0, reset: 1_750 });
        // Next unit needs 10*(1000-e) + 3*1000 <= 10_000 → e >= 300 → wait 50.
        assert_eq!(decide(w, l, &mut s, 1_250, 1), Decision::Deny { retry_after: 50, reset: 1_750 });
        assert!(!decide(w, l, &mut s, 1_299, 1).is_admitted());
        assert!(decide(w, l, &mut s, 1_300, 1).is_admitted());
    }

    #[test]
    fn retry_after_crosses_into_the_next_window_when_needed() {
        let (w, l) = (1_000, 4);
        let mut s = Counter::default();
        assert!(decide(w, l, &mut s, 100, 2).is_admitted()); // prev-to-be
        assert!(decide(w, l, &mut s, 1_100, 1).is_admitted()); // prev weighs 2*0.9 → 1.8
                                                               // cur=1, c=2: 1 + 2 + 2*(1000-e)/1000 > 4 until... spare = 4-1-2 = 1, fit = 500.
        let Decision::Deny { retry_after, .. } = decide(w, l, &mut s, 1_100, 2) else {
            panic!("expected deny");
        };
        assert_eq!(retry_after, 400);
        // cur=1, c=4: never in this window; next window prev'=1: 1*(1000-e2) + 4000 <= 4000
        // → e2 = 1000 → the window after.
        let Decision::Deny { retry_after, .. } = decide(w, l, &mut s, 1_100, 4) else {
            panic!("expected deny");
        };
        assert_eq!(retry_after, 900 + 1_000);
        assert!(!decide(w, l, &mut s, 2_999, 4).is_admitted());
        assert!(decide(w, l, &mut s, 3_000, 4).is_admitted());
    }

    #[test]
    fn error_vs_exact_log_reaches_but_never_passes_two_l_minus_one() {
        // Idle window, then a full burst at the end of the next: the sliding counter then lets
        // nearly L more through in the following window, within one window-long interval.
        let (w, l) = (1_000, 10);
        let mut s = Counter::default();
        let mut times = Vec::new();
        for now in 1_990..3_000 {
            while decide(w, l, &mut s, now, 1).is_admitted() {
                times.push(now);
            }
        }
        let worst = times.iter().map(|&t0| times.iter().filter(|&&t| t >= t0 && t < t0 + w).count()).max().unwrap_or(0);
        assert_eq!(worst as u64, 2 * l - 1);
    }

    #[test]
    fn refund_restores_admission() {
        let mut s = Counter::default();
        decide(100, 1, &mut s, 10, 1);
        assert!(!decide(100, 1, &mut s, 10, 1).is_admitted());
        refund(100, &mut s, 10, 1);
        assert!(s.is_idle(100, 10));
        assert!(decide(100, 1, &mut s, 10, 1).is_admitted());
    }
}
