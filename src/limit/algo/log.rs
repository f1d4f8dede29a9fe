//! Sliding log: the exact list of admitted (timestamp, cost) within the last `window`.
//! Invariant: entries are sorted by time, `sum` is the sum of their costs, and every entry
//! counted at `now` has `ts + W > now`. Exact, but O(limit) memory per key.
//!
//! # Math (the Redis port must reproduce this exactly; all values u64 µs)
//!
//! Parameters: `W = window` (>= 1), `L = limit` (>= 1). State: a queue of `(ts, cost)` and
//! `sum`. Initial: empty; idle iff no entry has `ts + W > now`.
//!
//! For a request of cost `c` at `now`:
//! - Prune: drop entries from the front while `ts + W <= now` (saturating add).
//! - `c > L` → Never { reset = newest ts + W - now } (no wait makes it fit).
//! - Admit iff `sum + c <= L`: append `(max(now, newest ts), c)` (merged into the newest entry
//!   when the timestamp is equal; the `max` keeps the queue sorted if the clock steps back);
//!   `remaining = L - sum`; `reset = newest ts + W - now`.
//! - Deny (state unchanged): `need = sum + c - L`; walk from the oldest entry adding costs
//!   until the total is `>= need`; at that entry `i`, `retry_after = ts_i + W - now` (the
//!   moment entry `i` leaves the window; one µs earlier it still counts).
//!   `reset = newest ts + W - now`.
//!
//! Any `W`-long interval therefore admits at most `L`. Memory: one 16-byte entry per distinct
//! admitted µs, so up to `L` entries (and a `VecDeque` rounds capacity up to a power of two):
//! a 60,000/min limit may hold ~1 MiB per key here, and a 60,000-member ZSET is 7.1 MB in
//! Redis. Prefer the sliding window counter for large limits.
//!
//! Refund of `c` at `now`: take `c` units off the newest entries (the admission being undone).

use std::collections::VecDeque;
use std::num::NonZeroU64;

use super::{
    lua_too_big, never, share, window_exact, window_params, Call, Kind, Param, Rule, Unfit, Words, Written, LUA_SPAN,
};
use crate::limit::{Algorithm, Decision, NonZeroSpan, Span, Timestamp};

/// The parameters of [`crate::limit::Algorithm::SlidingLog`]: `W` and `L` above.
#[derive(Clone, Copy, Debug)]
pub struct SlidingLog {
    pub window: NonZeroSpan,
    pub limit: NonZeroU64,
}

super::slot!(SlidingLog => box Log);

impl From<SlidingLog> for Algorithm {
    fn from(r: SlidingLog) -> Algorithm {
        Algorithm::SlidingLog { window: r.window, limit: r.limit }
    }
}

impl Rule for SlidingLog {
    const NAME: &'static str = "sliding_log";
    const KIND: Kind = Kind::SlidingLog;
    const FIELDS: &'static [&'static str] = &[];
    const DELAYS: bool = false;
    const PLANS: bool = true;
    const LEASES: bool = false;
    const SCRIPT: &'static str = include_str!("sliding_log.lua");

    type State = Log;

    /// One entry per admitted request: at most 100,000 a window.
    fn build(w: &Written<'_>) -> Result<Algorithm, Unfit> {
        let r = SlidingLog { window: w.window()?, limit: w.limit()? };
        if w.quantity > 100_000 {
            return Err((
                "rate",
                format!(
                    "sliding_log keeps one entry per admitted request: {} per window is too many; use sliding_window",
                    w.quantity
                ),
            ));
        }
        r.check_exact().map_err(|e| ("rate", e))?;
        Ok(r.into())
    }

    /// `start + 2·window` (the roll's next window).
    fn check_exact(&self) -> Result<(), String> {
        window_exact(self.window)
    }

    /// `W < 2^52` and `L < 2^52`.
    fn check_script(&self) -> Result<(), String> {
        if u128::from(self.window.as_micros()) >= LUA_SPAN || u128::from(self.limit.get()) >= LUA_SPAN {
            return lua_too_big("window and limit must stay below 2^52");
        }
        Ok(())
    }

    /// `W`, `L`.
    fn script_args(&self, _: &Call, arg: &mut impl FnMut(u64)) {
        arg(self.window.as_micros());
        arg(self.limit.get());
    }

    /// One entry at 0 holds the `k` that fit.
    fn after_burst(&self, n: u64, cost: u64) -> Log {
        let k = n.min(self.limit.get() / cost);
        if k == 0 {
            return Log::default();
        }
        Log { entries: [(Timestamp::ZERO, k * cost)].into(), sum: k * cost }
    }

    fn describe(&self, cost: u64, words: &impl Words) -> String {
        let n = self.limit.get();
        format!(
            "exactly {n} in any {} (sliding log){}; request {} of a burst {}",
            words.span(self.window.get()),
            words.costs(cost),
            (n / cost).saturating_add(1),
            words.decision(self.overrun(n / cost, cost))
        )
    }

    fn params(&self) -> Vec<(&'static str, Param)> {
        window_params(self.window, self.limit)
    }

    fn decide(&self, st: &mut Log, now: Timestamp, cost: u64) -> Decision {
        decide(self.window, self.limit.get(), st, now, cost)
    }

    fn refund(&self, st: &mut Log, now: Timestamp, cost: u64) {
        refund(self.window, st, now, cost);
    }

    fn debit(&self, st: &mut Log, now: Timestamp, cost: u64) {
        debit(self.window, st, now, cost);
    }

    fn is_idle(&self, st: &Log, now: Timestamp) -> bool {
        st.is_idle(self.window, now)
    }

    fn idle_at(&self, st: &Log) -> Timestamp {
        st.idle_at(self.window)
    }

    fn max_cost(&self) -> u64 {
        self.limit.get()
    }

    /// One window: the oldest entry leaves it by then.
    fn longest_wait(&self) -> Span {
        self.window.get()
    }

    /// Its window.
    fn period(&self) -> Span {
        self.window.get()
    }

    /// "limit per window".
    fn policy(&self) -> (u64, u64) {
        (self.limit.get(), self.window.get().as_secs_ceil().max(1))
    }

    /// Each instance logs its share of the limit.
    fn fallback(&self, instances: NonZeroU64) -> Algorithm {
        SlidingLog { limit: share(self.limit, instances), ..*self }.into()
    }
}

/// Sliding log state: admitted `(timestamp, cost)`, oldest first, and their total.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Log {
    pub entries: VecDeque<(Timestamp, u64)>,
    pub sum: u64,
}

impl Log {
    fn prune(&mut self, w: NonZeroSpan, now: Timestamp) {
        while let Some(&(ts, cost)) = self.entries.front() {
            if ts + w.get() > now {
                break;
            }
            self.sum = self.sum.saturating_sub(cost);
            self.entries.pop_front();
        }
        if self.entries.is_empty() {
            // Release the buffer of a key that went quiet: memory follows live traffic.
            self.entries = VecDeque::new();
            self.sum = 0;
        }
    }

    /// Back to initial: no entry left in the window.
    pub fn is_idle(&self, w: NonZeroSpan, now: Timestamp) -> bool {
        self.idle_at(w) <= now
    }

    /// Earliest time this state is idle without further traffic.
    pub fn idle_at(&self, w: NonZeroSpan) -> Timestamp {
        self.entries.back().map_or(Timestamp::ZERO, |&(ts, _)| ts + w.get())
    }

    fn reset(&self, w: NonZeroSpan, now: Timestamp) -> Span {
        self.idle_at(w) - now
    }
}

/// One decision; see the module docs.
pub fn decide(w: NonZeroSpan, l: u64, st: &mut Log, now: Timestamp, cost: u64) -> Decision {
    st.prune(w, now);
    if cost > l {
        return never(st.reset(w, now));
    }
    let Some(need) = st.sum.saturating_add(cost).checked_sub(l).filter(|&n| n > 0) else {
        if cost > 0 {
            let ts = st.entries.back().map_or(now, |&(ts, _)| ts.max(now));
            match st.entries.back_mut() {
                Some(last) if last.0 == ts => last.1 = last.1.saturating_add(cost),
                _ => st.entries.push_back((ts, cost)),
            }
            st.sum = st.sum.saturating_add(cost);
        }
        return Decision::Allow { remaining: l.saturating_sub(st.sum), reset: st.reset(w, now) };
    };
    let mut freed = 0u64;
    for &(ts, c) in &st.entries {
        freed = freed.saturating_add(c);
        if freed >= need {
            return Decision::Deny { retry_after: (ts + w.get()) - now, reset: st.reset(w, now) };
        }
    }
    // Unreachable: with `cost <= L` the entries hold at least `need`. No wait would help.
    never(st.reset(w, now))
}

/// Records `cost` more units at `now` (in the newest entry when it is as late), past the limit
/// if need be.
pub fn debit(w: NonZeroSpan, st: &mut Log, now: Timestamp, cost: u64) {
    st.prune(w, now);
    let cost = cost.min(super::MAX_DEBT.saturating_sub(st.sum));
    if cost == 0 {
        return;
    }
    let ts = st.entries.back().map_or(now, |&(ts, _)| ts.max(now));
    match st.entries.back_mut() {
        Some(last) if last.0 == ts => last.1 = last.1.saturating_add(cost),
        _ => st.entries.push_back((ts, cost)),
    }
    st.sum = st.sum.saturating_add(cost);
}

/// Takes `cost` units off the newest entries.
pub fn refund(w: NonZeroSpan, st: &mut Log, now: Timestamp, cost: u64) {
    st.prune(w, now);
    let mut left = cost;
    while left > 0 {
        let Some(last) = st.entries.back_mut() else {
            break;
        };
        let take = left.min(last.1);
        last.1 -= take;
        left -= take;
        st.sum = st.sum.saturating_sub(take);
        if last.1 == 0 {
            st.entries.pop_back();
        }
    }
    st.prune(w, now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{at, nzs};

    /// A decision with window `w` and limit `l` at `now`, in µs.
    fn run(w: u64, l: u64, s: &mut Log, now: u64, cost: u64) -> Decision {
        decide(nzs(w), l, s, at(now), cost)
    }

    #[test]
    fn retry_after_is_when_enough_old_entries_leave() {
        let (w, l) = (1_000, 3);
        let mut s = Log::default();
        for now in [100, 200, 300] {
            assert!(run(w, l, &mut s, now, 1).is_admitted());
        }
        let us = Span::from_micros;
        assert_eq!(run(w, l, &mut s, 400, 2), Decision::Deny { retry_after: us(800), reset: us(900) });
        assert!(!run(w, l, &mut s, 1_199, 2).is_admitted());
        assert_eq!(run(w, l, &mut s, 1_200, 2), Decision::Allow { remaining: 0, reset: us(1_000) });
    }

    #[test]
    fn merges_equal_timestamps_and_forgets_old_entries() {
        let mut s = Log::default();
        for _ in 0..5 {
            run(1_000, 10, &mut s, 7, 1);
        }
        assert_eq!(s.entries, VecDeque::from([(at(7), 5)]));
        assert!(s.is_idle(nzs(1_000), at(1_007)));
        run(1_000, 10, &mut s, 1_007, 1);
        assert_eq!((s.entries.len(), s.sum), (1, 1));
    }

    #[test]
    fn refund_restores_admission() {
        let mut s = Log::default();
        run(100, 2, &mut s, 10, 1);
        run(100, 2, &mut s, 20, 1);
        assert!(!run(100, 2, &mut s, 20, 1).is_admitted());
        refund(nzs(100), &mut s, at(20), 1);
        assert_eq!(s.entries, VecDeque::from([(at(10), 1)]));
        assert!(run(100, 2, &mut s, 20, 1).is_admitted());
    }
}
