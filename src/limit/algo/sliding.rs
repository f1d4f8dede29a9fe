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
//! For a request of cost `c`: `c > L` → Never { reset } (`reset` as below). Otherwise admit iff
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

use std::num::NonZeroU64;

use super::{
    lua_too_big, never, product, share, window_exact, window_params, Call, Kind, Param, Rule, Unfit, Words, Written,
    LUA_EXACT,
};
use crate::limit::{Algorithm, Decision, NonZeroSpan, Span, Timestamp};

/// The parameters of [`crate::limit::Algorithm::SlidingWindow`]: `W` and `L` above.
#[derive(Clone, Copy, Debug)]
pub struct SlidingWindow {
    pub window: NonZeroSpan,
    pub limit: NonZeroU64,
}

super::slot!(SlidingWindow => Counter);

impl From<SlidingWindow> for Algorithm {
    fn from(r: SlidingWindow) -> Algorithm {
        Algorithm::SlidingWindow { window: r.window, limit: r.limit }
    }
}

impl Rule for SlidingWindow {
    const NAME: &'static str = "sliding_window";
    const KIND: Kind = Kind::SlidingWindow;
    const FIELDS: &'static [&'static str] = &[];
    const DELAYS: bool = false;
    const PLANS: bool = true;
    const LEASES: bool = false;
    const SCRIPT: &'static str = include_str!("sliding_window.lua");

    type State = Counter;

    fn build(w: &Written<'_>) -> Result<Algorithm, Unfit> {
        let r = SlidingWindow { window: w.window()?, limit: w.limit()? };
        r.check_exact().map_err(|e| ("rate", e))?;
        Ok(r.into())
    }

    /// `start + 2·window` (the roll's next window).
    fn check_exact(&self) -> Result<(), String> {
        window_exact(self.window)
    }

    /// `3·L·W < 2^53` (a 1-day window allows L ≤ 34,700, 1 hour L ≤ 834,000).
    fn check_script(&self) -> Result<(), String> {
        if 3 * product(self.limit.get(), self.window.as_micros()) >= u128::from(LUA_EXACT) {
            return lua_too_big(
                "3 × limit × window (in µs) must stay below 2^53; use a shorter window or a smaller limit",
            );
        }
        Ok(())
    }

    /// `W`, `L`.
    fn script_args(&self, _: &Call, arg: &mut impl FnMut(u64)) {
        arg(self.window.as_micros());
        arg(self.limit.get());
    }

    /// The current window counts the `k` that fit.
    fn after_burst(&self, n: u64, cost: u64) -> Counter {
        let k = n.min(self.limit.get() / cost);
        Counter { start: Timestamp::ZERO, prev: 0, cur: k * cost }
    }

    fn describe(&self, cost: u64, words: &impl Words) -> String {
        let n = self.limit.get();
        format!(
            "about {n} in any {} (sliding window counter){}; request {} of a burst {}",
            words.span(self.window.get()),
            words.costs(cost),
            (n / cost).saturating_add(1),
            words.decision(self.overrun(n / cost, cost))
        )
    }

    fn params(&self) -> Vec<(&'static str, Param)> {
        window_params(self.window, self.limit)
    }

    fn decide(&self, st: &mut Counter, now: Timestamp, cost: u64) -> Decision {
        decide(self.window, self.limit.get(), st, now, cost)
    }

    fn refund(&self, st: &mut Counter, now: Timestamp, cost: u64) {
        refund(self.window, st, now, cost);
    }

    fn debit(&self, st: &mut Counter, now: Timestamp, cost: u64) {
        debit(self.window, self.limit.get(), st, now, cost);
    }

    fn is_idle(&self, st: &Counter, now: Timestamp) -> bool {
        st.is_idle(self.window, now)
    }

    fn idle_at(&self, st: &Counter) -> Timestamp {
        st.idle_at(self.window)
    }

    fn max_cost(&self) -> u64 {
        self.limit.get()
    }

    /// Two windows less 1 µs (a full window's count weighs on the next one, which the request
    /// may have to wait for well into), rounded to two.
    fn longest_wait(&self) -> Span {
        self.window.get() * 2
    }

    /// Its window.
    fn period(&self) -> Span {
        self.window.get()
    }

    /// "limit per window".
    fn policy(&self) -> (u64, u64) {
        (self.limit.get(), self.window.get().as_secs_ceil().max(1))
    }

    /// Each instance counts its share of the limit.
    fn fallback(&self, instances: NonZeroU64) -> Algorithm {
        SlidingWindow { limit: share(self.limit, instances), ..*self }.into()
    }
}

/// Sliding window counter state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub start: Timestamp,
    pub prev: u64,
    pub cur: u64,
}

/// The state rolled to `now`, with the elapsed time `e` and the clock lag.
struct Rolled {
    e: Span,
    lag: Span,
}

impl Counter {
    fn roll(&mut self, w: NonZeroSpan, now: Timestamp) -> Rolled {
        let n = now.max(self.start);
        let ws = n.floor(w);
        if ws != self.start {
            let next = self.start.checked_add(w.get()) == Some(ws);
            self.prev = if next { self.cur } else { 0 };
            self.cur = 0;
            self.start = ws;
        }
        Rolled { e: n - ws, lag: n - now }
    }

    /// Back to initial: nothing that still weighs on the estimate.
    pub fn is_idle(&self, w: NonZeroSpan, now: Timestamp) -> bool {
        let mut c = *self;
        c.roll(w, now);
        c.prev == 0 && c.cur == 0
    }

    /// Earliest time this state is idle without further traffic.
    pub fn idle_at(&self, w: NonZeroSpan) -> Timestamp {
        if self.cur > 0 {
            self.start + w.get() * 2
        } else if self.prev > 0 {
            self.start + w.get()
        } else {
            Timestamp::ZERO
        }
    }

    fn reset(&self, rest: Span, w: NonZeroSpan) -> Span {
        if self.cur > 0 {
            rest + w.get()
        } else if self.prev > 0 {
            rest
        } else {
            Span::ZERO
        }
    }
}

/// `units × d` in µs·units, exact (the weighted comparisons below).
fn weigh(units: u64, d: Span) -> u128 {
    u128::from(units) * u128::from(d.as_micros())
}

/// One decision; see the module docs.
pub fn decide(w: NonZeroSpan, l: u64, st: &mut Counter, now: Timestamp, cost: u64) -> Decision {
    let Rolled { e, lag } = st.roll(w, now);
    let rest = w.get() - e;
    let w128 = u128::from(w.as_micros());
    let weighted = weigh(st.prev, rest);
    if cost > l {
        return never(st.reset(rest, w) + lag);
    }
    let cur = u128::from(st.cur) + u128::from(cost);
    if weighted + cur * w128 <= weigh(l, w.get()) {
        // cur + cost <= L here, so it fits in u64.
        st.cur = st.cur.saturating_add(cost);
        let room = (weigh(l, w.get()) - weighted) / w128;
        let remaining = u64::try_from(room).unwrap_or(u64::MAX).saturating_sub(st.cur);
        return Decision::Allow { remaining, reset: st.reset(rest, w) + lag };
    }
    Decision::Deny { retry_after: retry_after(w, l, st, rest, cost) + lag, reset: st.reset(rest, w) + lag }
}

/// Smallest wait after which `cost` fits (steps 1 and 2 of the module docs); `cost <= l`.
fn retry_after(w: NonZeroSpan, l: u64, st: &Counter, rest: Span, cost: u64) -> Span {
    // `units × W / by`, a span: the part of a window over which `by` units weigh `units`.
    let part = |units: u64, by: u64| weigh(units, w.get()) / u128::from(by);
    if let Some(spare) = l.checked_sub(st.cur).and_then(|s| s.checked_sub(cost)) {
        if st.prev > 0 {
            let fit = part(spare, st.prev);
            if fit > 0 {
                // fit < rest, otherwise the request would have been admitted.
                let fit = Span::from_micros(u64::try_from(fit).unwrap_or(u64::MAX)).min(rest);
                return rest - fit;
            }
        }
    }
    let e2 = if st.cur == 0 {
        Span::ZERO
    } else {
        let fit = part(l - cost, st.cur).min(u128::from(w.as_micros()));
        w.get() - Span::from_micros(u64::try_from(fit).unwrap_or(w.as_micros()))
    };
    rest + e2
}

/// Gives back `cost` units in the current window.
pub fn refund(w: NonZeroSpan, st: &mut Counter, now: Timestamp, cost: u64) {
    st.roll(w, now);
    st.cur = st.cur.saturating_sub(cost);
}

/// Charges `cost` more units in the current window, past the limit `l` if need be, but to at
/// most `2 l` (a debt of one window; the Redis port stays below 2^53 with `3 l W`).
pub fn debit(w: NonZeroSpan, l: u64, st: &mut Counter, now: Timestamp, cost: u64) {
    st.roll(w, now);
    st.cur = st.cur.saturating_add(cost).min(l.saturating_mul(2));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{allow, deny};

    /// A decision with window `w` and limit `l` at `now`, in µs.
    fn run(w: u64, l: u64, s: &mut Counter, now: u64, cost: u64) -> Decision {
        decide(NonZeroSpan::from_micros(w).expect("non-zero"), l, s, Timestamp::from_micros(now), cost)
    }

    /// The `retry_after` of a denial, in µs.
    fn retry_after_us(d: Decision) -> u64 {
        let Decision::Deny { retry_after, .. } = d else {
            panic!("expected deny, got {d:?}");
        };
        retry_after.as_micros()
    }

    #[test]
    fn weights_the_previous_window_by_its_overlap() {
        // W=1000, L=10: 10 in [0,1000). At 1250, prev weighs 10*750/1000 = 7.5, so 2 fit.
        let (w, l) = (1_000, 10);
        let mut s = Counter::default();
        assert!(run(w, l, &mut s, 500, 10).is_admitted());
        assert_eq!(run(w, l, &mut s, 1_250, 2), allow(0, 1_750));
        // Next unit needs 10*(1000-e) + 3*1000 <= 10_000 → e >= 300 → wait 50.
        assert_eq!(run(w, l, &mut s, 1_250, 1), deny(50, 1_750));
        assert!(!run(w, l, &mut s, 1_299, 1).is_admitted());
        assert!(run(w, l, &mut s, 1_300, 1).is_admitted());
    }

    #[test]
    fn retry_after_crosses_into_the_next_window_when_needed() {
        let (w, l) = (1_000, 4);
        let mut s = Counter::default();
        assert!(run(w, l, &mut s, 100, 2).is_admitted()); // prev-to-be
        assert!(run(w, l, &mut s, 1_100, 1).is_admitted()); // prev weighs 2*0.9 → 1.8
                                                            // cur=1, c=2: 1 + 2 + 2*(1000-e)/1000 > 4 until... spare = 4-1-2 = 1, fit = 500.
        assert_eq!(retry_after_us(run(w, l, &mut s, 1_100, 2)), 400);
        // cur=1, c=4: never in this window; next window prev'=1: 1*(1000-e2) + 4000 <= 4000
        // → e2 = 1000 → the window after.
        assert_eq!(retry_after_us(run(w, l, &mut s, 1_100, 4)), 900 + 1_000);
        assert!(!run(w, l, &mut s, 2_999, 4).is_admitted());
        assert!(run(w, l, &mut s, 3_000, 4).is_admitted());
    }

    #[test]
    fn error_vs_exact_log_reaches_but_never_passes_two_l_minus_one() {
        // Idle window, then a full burst at the end of the next: the sliding counter then lets
        // nearly L more through in the following window, within one window-long interval.
        let (w, l) = (1_000, 10);
        let mut s = Counter::default();
        let mut times = Vec::new();
        for now in 1_990..3_000 {
            while run(w, l, &mut s, now, 1).is_admitted() {
                times.push(now);
            }
        }
        let worst = times.iter().map(|&t0| times.iter().filter(|&&t| t >= t0 && t < t0 + w).count()).max().unwrap_or(0);
        assert_eq!(worst as u64, 2 * l - 1);
    }

    #[test]
    fn refund_restores_admission() {
        let mut s = Counter::default();
        let (w, ten) = (NonZeroSpan::from_micros(100).expect("non-zero"), Timestamp::from_micros(10));
        run(100, 1, &mut s, 10, 1);
        assert!(!run(100, 1, &mut s, 10, 1).is_admitted());
        refund(w, &mut s, ten, 1);
        assert!(s.is_idle(w, ten));
        assert!(run(100, 1, &mut s, 10, 1).is_admitted());
    }
}
