//! Fixed window counter: at most `limit` units per window aligned to the clock. Invariant: the
//! stored count belongs to the window starting at `start`; a count of an older window is zero.
//! Cheap and exact per aligned window, but up to `2 * limit` can pass around a boundary.
//!
//! # Math (the Redis port must reproduce this exactly; all values u64 µs, saturating)
//!
//! Parameters: `W = window` (>= 1), `L = limit` (>= 1), optionally a [`Calendar`]. State:
//! `start` (window start), `end` (its end, a cache: not stored in Redis) and `count`. Initial:
//! `start = 0, end = 0, count = 0`; idle iff `count == 0 || end <= now`.
//!
//! For a request of cost `c` at `now`:
//! - `n = max(now, start)` (a clock that steps back stays in the state's window, so it can
//!   never reopen a fresh one). Unless `start <= n < end` (still in the known window): the
//!   window holding `n` is `ws = n - n % W, we = ws + W`, or with a calendar the zoned window
//!   `(ws, we)` holding `n` (the Redis script receives these boundaries as arguments); if
//!   `ws != start` then `start = ws, count = 0`; `end = we`.
//! - `left = end - now`.
//! - `c > L` → Never { reset = left, or 0 if count == 0 } (no wait makes it fit).
//! - Admit iff `count + c <= L`: `count += c`; `remaining = L - count`; `reset = left`.
//! - Deny: `retry_after = left` (the next window is empty, so `c <= L` fits), `reset = left`.
//!   (In Redis the key is `start`-suffixed or carries TTL `left`.)
//!
//! Refund of `c` at `now`: after the same roll, `count = count - c` (saturating). A refund in
//! a later window finds nothing to give back.
//!
//! Debit of `c` at `now` (a response cost more than its estimate): after the same roll,
//! `count = count + c` (saturating), even past `L`: the window then denies until it ends; what
//! the window overran by is not carried into the next one.

use std::num::NonZeroU64;

use super::{
    lua_too_big, never, share, window_exact, window_params, Call, Kind, Param, Rule, Unfit, Words, Written, LUA_SPAN,
    MAX_DEBT,
};
use crate::limit::{Algorithm, Calendar, Decision, NonZeroSpan, Span, Timestamp};

/// The parameters of [`crate::limit::Algorithm::FixedWindow`]: `W`, `L` and the calendar.
#[derive(Clone, Copy, Debug)]
pub struct FixedWindow<'a> {
    pub window: NonZeroSpan,
    pub limit: NonZeroU64,
    pub calendar: Option<&'a Calendar>,
}

impl FixedWindow<'_> {
    fn bounds(&self) -> Bounds<'_> {
        Bounds { window: self.window, calendar: self.calendar }
    }
}

super::slot!(FixedWindow => Window);

impl From<FixedWindow<'_>> for Algorithm {
    fn from(r: FixedWindow<'_>) -> Algorithm {
        Algorithm::FixedWindow { window: r.window, limit: r.limit, calendar: r.calendar.cloned() }
    }
}

impl Rule for FixedWindow<'_> {
    const NAME: &'static str = "fixed_window";
    const KIND: Kind = Kind::FixedWindow;
    const FIELDS: &'static [&'static str] = &["calendar"];
    const DELAYS: bool = false;
    const PLANS: bool = true;
    const LEASES: bool = false;
    const SCRIPT: &'static str = include_str!("fixed_window.lua");

    type State = Window;

    fn build(w: &Written<'_>) -> Result<Algorithm, Unfit> {
        let r = FixedWindow { window: w.window()?, limit: w.limit()?, calendar: w.calendar.as_ref() };
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

    /// `W`, `L`, then `b0 <= local < b1 <= b2`: with a calendar, its window around this
    /// instance's clock and the next (the script picks the one holding Redis' time; clocks
    /// apart by more than a window are not expected); zeros for windows aligned to the epoch.
    fn script_args(&self, call: &Call, arg: &mut impl FnMut(u64)) {
        arg(self.window.as_micros());
        arg(self.limit.get());
        let (b0, b1, b2) = match self.calendar {
            Some(c) => {
                let (b0, b1) = c.window(call.local);
                (b0.as_micros(), b1.as_micros(), c.window(b1).1.as_micros())
            }
            None => (0, 0, 0),
        };
        arg(b0);
        arg(b1);
        arg(b2);
    }

    /// The window at 0 counts the `k` that fit.
    fn after_burst(&self, n: u64, cost: u64) -> Window {
        let k = n.min(self.limit.get() / cost);
        let (start, end) = self.bounds().at(Timestamp::ZERO);
        Window { start, end, count: k * cost }
    }

    fn describe(&self, cost: u64, words: &impl Words) -> String {
        let n = self.limit.get();
        let next = (n / cost).saturating_add(1);
        let gets = words.decision(self.overrun(n / cost, cost));
        match self.calendar {
            Some(cal) => format!(
                "{n} per calendar {cal}{} (windows start at its boundaries; months and DST days differ in length); request {next} {gets}; across a boundary up to {} can pass in a moment",
                words.costs(cost),
                n.saturating_mul(2)
            ),
            None => format!(
                "{n} per {} window aligned to the clock{}; request {next} {gets}; across a window boundary up to {} can pass in a moment",
                words.span(self.window.get()),
                words.costs(cost),
                n.saturating_mul(2)
            ),
        }
    }

    fn params(&self) -> Vec<(&'static str, Param)> {
        let mut p = window_params(self.window, self.limit);
        p.push(("calendar", Param::Calendar(self.calendar.cloned())));
        p
    }

    fn decide(&self, st: &mut Window, now: Timestamp, cost: u64) -> Decision {
        decide(self.bounds(), self.limit.get(), st, now, cost)
    }

    fn refund(&self, st: &mut Window, now: Timestamp, cost: u64) {
        refund(self.bounds(), st, now, cost);
    }

    /// At most [`MAX_DEBT`] units counted.
    fn debit(&self, st: &mut Window, now: Timestamp, cost: u64) {
        debit(self.bounds(), st, now, cost.min(MAX_DEBT));
        st.count = st.count.min(MAX_DEBT);
    }

    fn is_idle(&self, st: &Window, now: Timestamp) -> bool {
        st.is_idle(now)
    }

    fn idle_at(&self, st: &Window) -> Timestamp {
        st.idle_at()
    }

    fn max_cost(&self) -> u64 {
        self.limit.get()
    }

    /// One window (the longest calendar window with a calendar).
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

    /// Each instance counts its share of the limit in the same windows.
    fn fallback(&self, instances: NonZeroU64) -> Algorithm {
        FixedWindow { limit: share(self.limit, instances), ..*self }.into()
    }
}

/// Fixed window state: window start and end, and units admitted in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub start: Timestamp,
    /// End of the window at `start`; zero until the first roll (then always set).
    pub end: Timestamp,
    pub count: u64,
}

/// Where windows start and end: aligned to the epoch, or to a calendar.
#[derive(Clone, Copy, Debug)]
pub struct Bounds<'a> {
    pub window: NonZeroSpan,
    pub calendar: Option<&'a Calendar>,
}

impl Bounds<'_> {
    /// The window holding `n`.
    pub fn at(&self, n: Timestamp) -> (Timestamp, Timestamp) {
        match self.calendar {
            Some(c) => c.window(n),
            None => {
                let ws = n.floor(self.window);
                (ws, ws + self.window.get())
            }
        }
    }
}

impl Window {
    /// Back to initial: nothing counted in a window that is still open.
    pub fn is_idle(&self, now: Timestamp) -> bool {
        self.count == 0 || self.end <= now
    }

    /// Earliest time this state is idle without further traffic.
    pub fn idle_at(&self) -> Timestamp {
        if self.count == 0 {
            Timestamp::ZERO
        } else {
            self.end
        }
    }

    /// Moves to the window containing `now`; returns the time until that window ends.
    fn roll(&mut self, b: Bounds<'_>, now: Timestamp) -> Span {
        let n = now.max(self.start);
        if !(self.start <= n && n < self.end) {
            let (ws, we) = b.at(n);
            if ws != self.start {
                self.start = ws;
                self.count = 0;
            }
            self.end = we;
        }
        self.end - now
    }
}

/// One decision; see the module docs.
pub fn decide(b: Bounds<'_>, l: u64, st: &mut Window, now: Timestamp, cost: u64) -> Decision {
    let left = st.roll(b, now);
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
pub fn refund(b: Bounds<'_>, st: &mut Window, now: Timestamp, cost: u64) {
    st.roll(b, now);
    st.count = st.count.saturating_sub(cost);
}

/// Charges `cost` more units in the current window, past the limit if need be.
pub fn debit(b: Bounds<'_>, st: &mut Window, now: Timestamp, cost: u64) {
    st.roll(b, now);
    st.count = st.count.saturating_add(cost);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{allow, deny};

    /// A decision with window `w` and limit `l` at `now`, in µs.
    fn run(w: u64, l: u64, s: &mut Window, now: u64, cost: u64) -> Decision {
        decide(bounds(w), l, s, Timestamp::from_micros(now), cost)
    }

    fn bounds(w: u64) -> Bounds<'static> {
        Bounds { window: NonZeroSpan::from_micros(w).expect("non-zero"), calendar: None }
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
        let ten = Timestamp::from_micros(10);
        run(100, 1, &mut s, 10, 1);
        assert!(!run(100, 1, &mut s, 10, 1).is_admitted());
        refund(bounds(100), &mut s, ten, 1);
        assert!(s.is_idle(ten));
        assert!(run(100, 1, &mut s, 10, 1).is_admitted());
    }

    /// µs of an RFC 3339 instant.
    fn t(s: &str) -> Timestamp {
        let ts: jiff::Timestamp = s.parse().expect("instant");
        Timestamp::from_micros(u64::try_from(ts.as_microsecond()).expect("after 1970"))
    }

    fn month_quota(l: u64, st: &mut Window, now: Timestamp, cal: &Calendar) -> Decision {
        let b = Bounds { window: cal.longest(), calendar: Some(cal) };
        decide(b, l, st, now, 1)
    }

    #[test]
    fn calendar_month_resets_on_the_first_whatever_its_length() {
        use crate::limit::CalendarUnit;
        let cal = Calendar::new("utc", CalendarUnit::Month).expect("utc");
        let mut s = Window::default();
        // February 2026 has 28 days: 3 used on the 27th, denied until 1 March 00:00 UTC.
        for _ in 0..3 {
            assert!(month_quota(3, &mut s, t("2026-02-27T12:00:00Z"), &cal).is_admitted());
        }
        let d = month_quota(3, &mut s, t("2026-02-28T23:59:59Z"), &cal);
        assert_eq!(d, deny(1_000_000, 1_000_000));
        assert_eq!(month_quota(3, &mut s, t("2026-03-01T00:00:00Z"), &cal), allow(2, 31 * 86_400 * 1_000_000));
    }

    #[test]
    fn calendar_day_in_a_zone_is_23_hours_on_spring_forward() {
        use crate::limit::CalendarUnit;
        let cal = Calendar::new("Europe/Berlin", CalendarUnit::Day).expect("zone");
        let b = Bounds { window: cal.longest(), calendar: Some(&cal) };
        let mut s = Window::default();
        // 2026-03-29 00:00 CET: the day lasts 23 h; the reset is that long, not 24 h.
        assert_eq!(decide(b, 1, &mut s, t("2026-03-29T00:00:00+01:00"), 1), allow(0, 23 * 3_600 * 1_000_000));
        assert!(!decide(b, 1, &mut s, t("2026-03-29T23:59:59+02:00"), 1).is_admitted());
        assert!(decide(b, 1, &mut s, t("2026-03-30T00:00:00+02:00"), 1).is_admitted());
        // Debt: a debit past the limit denies until the window ends, and is not carried over.
        debit(b, &mut s, t("2026-03-30T01:00:00+02:00"), 5);
        assert_eq!(s.count, 6);
        assert!(!decide(b, 1, &mut s, t("2026-03-30T23:00:00+02:00"), 1).is_admitted());
        assert!(decide(b, 1, &mut s, t("2026-03-31T00:00:00+02:00"), 1).is_admitted());
    }
}
