//! Token bucket as GCRA (generic cell rate algorithm), with optional linear warm-up.
//! Invariant: only `tat` and `start` are stored; a key with `tat <= now` has a full bucket and
//! is indistinguishable from a key never seen.
//!
//! # Math (the Redis port must reproduce this exactly; all values u64 µs, saturating)
//!
//! Parameters: `T = interval` (µs per unit, >= 1), `B = burst` (>= 1), `W = warmup` (0 = off),
//! tolerance `tau = B*T`. State: `tat` (theoretical arrival time), `start` (when the key's
//! warm-up began). Initial state (a missing Redis key): `tat = 0, start = 0`.
//! `cold(now) = tat == 0 || tat + W <= now` (with `W = 0`: bucket full); a cold state is
//! initial and may be forgotten (Redis TTL = `tat + W - now`).
//!
//! For a request of cost `c` at `now`:
//! 1. `c > B` → Never { reset = max(tat - now, 0) } (no wait makes it fit; config validation
//!    forbids such a cost).
//! 2. `tat0 = max(tat, now)`; `start' = now if cold(now) else start`.
//! 3. Admission check at the warm rate: `late = tat0 + c*T - now`. Admit iff `late <= tau`.
//!    Deny: `retry_after = late - tau`, `reset = max(tat - now, 0)`, state unchanged.
//! 4. Charge per unit: `Ti = T` if `W == 0`, else
//!    `Ti = floor(3*T*W / (W + 2*min(W, now - start')))` (u128 intermediate): `3T` on a cold
//!    key, `T` once it has been active for `W`, so its rate ramps from rate/3 to rate.
//!    New state: `tat' = tat0 + c*Ti`, `start'`.
//! 5. `reset = tat' - now` (saturating). `remaining`: with `slack = now + tau - max(tat', now)`
//!    and `Tn` = the per-unit charge of step 4 for a request at the same `now` after this one:
//!    `remaining = 0` if `slack < T`, else `1 + (slack - T) / Tn`. Without warm-up this is
//!    `slack / T`.
//!
//! Refund of `c` at `now` (exact when `now` equals the admission's): if `tat <= now` nothing;
//! else `tat = max(tat - c*Ti, now)` with `Ti` from `start`; if then `tat <= now` and
//! `start == now` the admission was a cold start, so the state goes back to initial.
//!
//! Without warm-up this is textbook GCRA: a burst of `B` at one instant, then exactly one unit
//! per `T`, so a saturating client gets `B + floor(t/T)` units in `[0, t]`, and waiting
//! `retry_after` always fits (the same `late` minus the wait equals `tau`, or the key refilled).
//! Warm-up only ever charges more than `T` per unit, so it never admits more than the plain
//! bucket; because the check uses `c*T` (not `c*Ti`), any `c <= B` still fits into a full bucket
//! and `retry_after` stays exact. "Idle" (back to cold) means: the bucket refilled and then `W`
//! more passed without a request — so a steady client below the full rate stays warm.

use std::num::NonZeroU64;

use super::{
    debt_cap, lua_too_big, never, product, share, Call, Kind, Param, Rule, Unfit, Words, Written, EXACT_SPAN, LUA_SPAN,
};
use crate::limit::{Algorithm, Decision, NonZeroSpan, Span, Timestamp};

/// The parameters of [`crate::limit::Algorithm::TokenBucket`]: `T`, `B` and `W` above.
#[derive(Clone, Copy, Debug)]
pub struct TokenBucket {
    pub interval: NonZeroSpan,
    pub burst: NonZeroU64,
    pub warmup: Span,
}

super::slot!(TokenBucket => Gcra);

impl From<TokenBucket> for Algorithm {
    fn from(r: TokenBucket) -> Algorithm {
        Algorithm::TokenBucket { interval: r.interval, burst: r.burst, warmup: r.warmup }
    }
}

impl Rule for TokenBucket {
    const NAME: &'static str = "token_bucket";
    const KIND: Kind = Kind::TokenBucket;
    const FIELDS: &'static [&'static str] = &["burst", "warmup"];
    const DELAYS: bool = false;
    const PLANS: bool = true;
    const LEASES: bool = true;
    const SCRIPT: &'static str = include_str!("token_bucket.lua");

    type State = Gcra;

    /// `burst` defaults to the rate's quantity; a burst too long to compute is the burst's
    /// fault when it is written, else the rate's.
    fn build(w: &Written<'_>) -> Result<Algorithm, Unfit> {
        let interval = w.interval()?;
        let burst = NonZeroU64::new(w.burst.unwrap_or(w.quantity))
            .ok_or_else(|| ("burst", "burst must be at least 1".to_owned()))?;
        let r = TokenBucket { interval, burst, warmup: w.warmup.unwrap_or(Span::ZERO) };
        r.check_exact().map_err(|e| (if w.burst.is_some() { "burst" } else { "rate" }, e))?;
        Ok(r.into())
    }

    /// `tat` up to `now + 3·burst·interval` (a cold warm-up charge is 3·interval per unit; a
    /// cost is at most the burst) plus `warmup`; every other product is taken in u128.
    fn check_exact(&self) -> Result<(), String> {
        let (t, b, w) = (self.interval.as_micros(), self.burst.get(), self.warmup.as_micros());
        if product(b, t).saturating_mul(3).saturating_add(u128::from(w)) >= EXACT_SPAN {
            return Err(format!(
                "burst {b} × {t} µs per token is too long to compute exactly (3 × burst × interval plus \
                 warmup must stay below 2^63 µs, about 97,000 years of refill); lower the burst or raise the rate"
            ));
        }
        Ok(())
    }

    /// `3·B·T + W < 2^52` and `3·T·W < 2^53`.
    fn check_script(&self) -> Result<(), String> {
        let (t, b, w) = (self.interval.as_micros(), self.burst.get(), self.warmup.as_micros());
        if 3 * product(b, t) + u128::from(w) >= LUA_SPAN {
            return lua_too_big("burst × interval (×3) plus warmup must stay below 2^52 µs");
        }
        if 3 * product(t, w) >= u128::from(super::LUA_EXACT) {
            return lua_too_big("3 × interval × warmup must stay below 2^53 µs²; use a shorter warmup");
        }
        Ok(())
    }

    /// `T`, `B`, `W`, the lease size, and `1` for a plan limit (its state records `per`).
    fn script_args(&self, call: &Call, arg: &mut impl FnMut(u64)) {
        arg(self.interval.as_micros());
        arg(self.burst.get());
        arg(self.warmup.as_micros());
        arg(call.lease);
        arg(u64::from(call.plan));
    }

    /// The burst admits `k` of them (`c·(3k + 1) <= B` warming up: a unit is charged `3T`
    /// but checked at `T`), each moving `tat` by its charge.
    fn after_burst(&self, n: u64, cost: u64) -> Gcra {
        let (t, fits) = (self.interval.get(), self.burst.get() / cost);
        let (charge, admitted) = if self.warmup.is_zero() { (t, fits) } else { (t * 3, fits.div_ceil(3)) };
        let k = n.min(admitted);
        Gcra { tat: Timestamp::ZERO + charge * k.saturating_mul(cost), start: Timestamp::ZERO, per: Span::ZERO }
    }

    fn describe(&self, cost: u64, words: &impl Words) -> String {
        let b = self.burst.get();
        let fits = b / cost;
        let mut s = format!(
            "bursts of {b}{}, then {} requests/s (one every {}); request {} of a burst {}",
            words.costs(cost),
            words.per_second(self.interval),
            words.span(self.interval.get()),
            fits.saturating_add(1),
            words.decision(self.overrun(fits, cost))
        );
        if !self.warmup.is_zero() {
            s.push_str(&format!(
                "; after idling (bucket full again) it starts at a third of that rate and burst and ramps up over {}",
                words.span(self.warmup)
            ));
        }
        s
    }

    fn params(&self) -> Vec<(&'static str, Param)> {
        vec![
            ("interval", Param::Span(self.interval.get())),
            ("burst", Param::Count(self.burst.get())),
            ("warmup", Param::Span(self.warmup)),
        ]
    }

    fn decide(&self, st: &mut Gcra, now: Timestamp, cost: u64) -> Decision {
        decide(self.interval, self.burst.get(), self.warmup, st, now, cost)
    }

    fn refund(&self, st: &mut Gcra, now: Timestamp, cost: u64) {
        refund(self.interval, self.warmup, st, now, cost);
    }

    fn debit(&self, st: &mut Gcra, now: Timestamp, cost: u64) {
        debit(self.interval, self.warmup, st, now, cost, debt_cap(now));
    }

    fn is_idle(&self, st: &Gcra, now: Timestamp) -> bool {
        st.is_idle(self.warmup, now)
    }

    fn idle_at(&self, st: &Gcra) -> Timestamp {
        st.idle_at(self.warmup)
    }

    fn max_cost(&self) -> u64 {
        self.burst.get()
    }

    /// `burst × interval`, three times that with a warm-up (a cold unit is charged up to
    /// `3 × interval`).
    fn longest_wait(&self) -> Span {
        let full = self.interval.get() * self.burst.get();
        if self.warmup.is_zero() {
            full
        } else {
            full * 3
        }
    }

    /// A full bucket's refill, `burst × interval`.
    fn period(&self) -> Span {
        self.interval.get() * self.burst.get()
    }

    /// "burst per the seconds a full bucket takes to refill".
    fn policy(&self) -> (u64, u64) {
        (self.burst.get(), self.period().as_secs_ceil().max(1))
    }

    /// Each instance refills at `1 / instances` of the rate, with its share of the burst.
    fn fallback(&self, instances: NonZeroU64) -> Algorithm {
        TokenBucket {
            interval: self.interval.saturating_mul(instances),
            burst: share(self.burst, instances),
            warmup: self.warmup,
        }
        .into()
    }
}

/// GCRA state: theoretical arrival time and warm-up start, and `per`: the interval `tat` was
/// charged at (zero: the limit's own). A plan limit decides one key with the interval of the
/// client's tier; when the tier changed, [`rescale`] carries the units owed over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gcra {
    pub tat: Timestamp,
    pub start: Timestamp,
    pub per: Span,
}

/// Carries a state charged at another interval over to `t` (a client moved to another tier):
/// the units it owes at `now`, `ceil((tat - now) / per)`, are owed at the new interval,
/// `tat = now + units × t` (at most `now + 2^51 µs`). Whole units are kept exactly; a token
/// partly refilled counts as spent (never more admitted than the quota). The Redis script
/// does the same.
pub fn rescale(t: NonZeroSpan, st: &mut Gcra, now: Timestamp) {
    let Some(per) = NonZeroSpan::new(st.per) else { return };
    if per == t || st.tat <= now {
        return;
    }
    let owed = st.tat - now;
    let units = (owed / per) + u64::from(owed.as_micros() % per.as_micros() != 0);
    st.tat = now + (t.get() * units).min(Span::from_micros(super::MAX_DEBT));
    st.per = t.get();
}

impl Gcra {
    /// Back to initial (cold, full bucket) at `now` for warm-up `w`.
    pub fn is_idle(&self, w: Span, now: Timestamp) -> bool {
        self.tat == Timestamp::ZERO || self.tat + w <= now
    }

    /// Earliest time this state is idle without further traffic.
    pub fn idle_at(&self, w: Span) -> Timestamp {
        self.tat + w
    }
}

/// The time charged per unit at `now` for a key warming up since `start` (step 4).
fn charge(t: NonZeroSpan, w: Span, start: Timestamp, now: Timestamp) -> Span {
    if w.is_zero() {
        return t.get();
    }
    let warm = (now - start).min(w);
    // A ratio of spans times a span: in u128 µs, back to a span at the end.
    let num = 3u128 * u128::from(t.as_micros()) * u128::from(w.as_micros());
    let den = u128::from(w.as_micros()) + 2 * u128::from(warm.as_micros());
    Span::from_micros(u64::try_from(num / den).unwrap_or(u64::MAX))
}

/// One decision; see the module docs.
pub fn decide(t: NonZeroSpan, b: u64, w: Span, st: &mut Gcra, now: Timestamp, cost: u64) -> Decision {
    rescale(t, st, now);
    let tau = t.get() * b;
    if cost > b {
        return never(st.tat - now);
    }
    let tat0 = st.tat.max(now);
    let start = if st.is_idle(w, now) { now } else { st.start };
    let late = (tat0 + t.get() * cost) - now;
    if late > tau {
        return Decision::Deny { retry_after: late - tau, reset: st.tat - now };
    }
    st.tat = tat0 + charge(t, w, start, now) * cost;
    st.start = start;
    st.per = t.get();
    Decision::Allow { remaining: remaining(t, tau, w, st, now), reset: st.tat - now }
}

/// Unit requests admissible now after the state `st` (step 5).
fn remaining(t: NonZeroSpan, tau: Span, w: Span, st: &Gcra, now: Timestamp) -> u64 {
    let slack = (now + tau) - st.tat.max(now);
    if slack < t.get() {
        return 0;
    }
    let start = if st.is_idle(w, now) { now } else { st.start };
    1 + (slack - t.get()) / NonZeroSpan::new(charge(t, w, start, now)).unwrap_or(NonZeroSpan::MIN)
}

/// Gives back `cost` units charged at `now` (same `Ti` as the admission when `now` is equal).
pub fn refund(t: NonZeroSpan, w: Span, st: &mut Gcra, now: Timestamp, cost: u64) {
    rescale(t, st, now);
    if st.tat <= now {
        return;
    }
    let back = charge(t, w, st.start, now) * cost;
    // Never below `now`: a bucket cannot be fuller than full.
    st.tat = (st.tat - back).max(now);
    if st.tat <= now && st.start == now {
        // The refunded admission was this key's cold start: it is cold again.
        *st = Gcra::default();
    }
}

/// Charges `cost` more units at `now` (a response cost above its estimate), at the per-unit
/// charge of a decision at `now`; `tat` may pass `now + tau` (a debt) but not `cap`.
pub fn debit(t: NonZeroSpan, w: Span, st: &mut Gcra, now: Timestamp, cost: u64, cap: Timestamp) {
    rescale(t, st, now);
    let start = if st.is_idle(w, now) { now } else { st.start };
    st.tat = (st.tat.max(now) + charge(t, w, start, now) * cost).min(cap);
    st.start = start;
    st.per = t.get();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{allow, at, deny, us};

    fn run(t: u64, b: u64, w: u64, st: &mut Gcra, now: u64, c: u64) -> Decision {
        decide(NonZeroSpan::from_micros(t).expect("non-zero"), b, us(w), st, at(now), c)
    }

    fn charge_us(t: u64, w: u64, start: u64, now: u64) -> u64 {
        charge(NonZeroSpan::from_micros(t).expect("non-zero"), us(w), at(start), at(now)).as_micros()
    }

    fn refund_us(t: u64, w: u64, st: &mut Gcra, now: u64, c: u64) {
        refund(NonZeroSpan::from_micros(t).expect("non-zero"), us(w), st, at(now), c)
    }

    /// (tat, start) in µs.
    fn us_of(s: &Gcra) -> (u64, u64) {
        (s.tat.as_micros(), s.start.as_micros())
    }

    #[test]
    fn admits_burst_then_denies_when_bucket_empty() {
        let mut s = Gcra::default();
        for left in (0..3).rev() {
            assert_eq!(run(100, 3, 0, &mut s, 1_000, 1), allow(left, 100 * (3 - left)));
        }
        assert_eq!(run(100, 3, 0, &mut s, 1_000, 1), deny(100, 300));
    }

    #[test]
    fn waiting_retry_after_is_admitted() {
        let mut s = Gcra::default();
        run(100, 3, 0, &mut s, 0, 3);
        let Decision::Deny { retry_after, .. } = run(100, 3, 0, &mut s, 10, 2) else {
            panic!("expected deny");
        };
        let retry_after = retry_after.as_micros();
        assert_eq!(retry_after, 190);
        assert!(!run(100, 3, 0, &mut s, 10 + retry_after - 1, 2).is_admitted());
        assert!(run(100, 3, 0, &mut s, 10 + retry_after, 2).is_admitted());
    }

    #[test]
    fn saturation_admits_burst_plus_elapsed_over_interval() {
        for (t, b, horizon) in [(100, 5, 10_000), (7, 1, 1_000), (1_000, 40, 123_456)] {
            let mut s = Gcra::default();
            let mut admitted = 0;
            for now in 0..=horizon {
                while run(t, b, 0, &mut s, now, 1).is_admitted() {
                    admitted += 1;
                }
            }
            assert_eq!(admitted, b + horizon / t, "t={t} b={b}");
        }
    }

    #[test]
    fn refund_restores_admission() {
        let mut s = Gcra::default();
        run(100, 2, 0, &mut s, 0, 2);
        assert!(!run(100, 2, 0, &mut s, 0, 1).is_admitted());
        refund_us(100, 0, &mut s, 0, 1);
        assert!(run(100, 2, 0, &mut s, 0, 1).is_admitted());
        refund_us(100, 0, &mut s, 0, 2);
        assert!(s.is_idle(Span::ZERO, Timestamp::ZERO));
    }

    #[test]
    fn warmup_starts_at_a_third_of_the_rate() {
        // T=100, B=3, W=10_000. Cold: each unit is charged 300 but checked at 100.
        let (t, b, w) = (100, 3, 10_000);
        let mut s = Gcra::default();
        assert!(run(t, b, w, &mut s, 0, 1).is_admitted()); // tat = 300
        assert_eq!(run(t, b, w, &mut s, 0, 1), deny(100, 300));
        // Fully warm after W of continuous activity: the charge is back to T.
        assert_eq!(charge_us(t, w, 0, w), t);
        assert_eq!(charge_us(t, w, 0, 5 * w), t);
        assert_eq!(charge_us(t, w, 0, 0), 3 * t);
        assert_eq!(charge_us(t, w, 0, w / 2), 150);
    }

    #[test]
    fn warmup_cold_key_still_fits_a_full_burst_request() {
        let mut s = Gcra::default();
        assert!(run(100, 3, 10_000, &mut s, 0, 3).is_admitted());
        assert_eq!(s.tat, at(900));
    }

    #[test]
    fn steady_client_below_full_rate_stays_warm_until_idle_for_warmup() {
        let (t, b, w) = (100, 2, 1_000);
        let mut s = Gcra::default();
        // One unit every 150 µs: above the cold rate (1/300), below the warm rate (1/100).
        let mut denied_after_warm = 0;
        for now in (0..=5_000).step_by(150) {
            let d = run(t, b, w, &mut s, now, 1);
            if now > 2 * w && !d.is_admitted() {
                denied_after_warm += 1;
            }
        }
        assert_eq!(s.start, Timestamp::ZERO, "never went cold");
        assert_eq!(denied_after_warm, 0);
        // Bucket refilled, but not yet idle for W: still warm, charged T.
        let now = s.tat.as_micros() + w - 1;
        assert!(run(t, b, w, &mut s, now, 1).is_admitted());
        assert_eq!(us_of(&s), (now + t, 0));
        // Idle for W after refilling: the next admission restarts warm-up at 3T.
        let now = s.tat.as_micros() + w;
        assert!(run(t, b, w, &mut s, now, 1).is_admitted());
        assert_eq!(us_of(&s), (now + 3 * t, now));
    }

    #[test]
    fn warmup_ramps_a_saturating_single_unit_bucket_to_full_rate() {
        let (t, b, w) = (100, 1, 10_000);
        let mut s = Gcra::default();
        let mut admitted = Vec::new();
        for now in 0..=4 * w {
            if run(t, b, w, &mut s, now, 1).is_admitted() {
                admitted.push(now);
            }
        }
        // Cold gaps are 3T; after W the gaps are exactly T.
        assert_eq!(admitted[1] - admitted[0], 3 * t);
        let late: Vec<u64> = admitted.windows(2).map(|p| p[1] - p[0]).skip(100).collect();
        assert!(late.iter().all(|&g| g == t), "{late:?}");
        assert!(admitted.len() as u64 <= 1 + 4 * w / t);
    }

    #[test]
    fn refund_of_a_cold_start_makes_the_key_cold_again() {
        let mut s = Gcra::default();
        assert!(run(100, 3, 1_000, &mut s, 5_000, 1).is_admitted());
        refund_us(100, 1_000, &mut s, 5_000, 1);
        assert_eq!(s, Gcra::default());
    }

    #[test]
    fn saturates_instead_of_overflowing() {
        let mut s = Gcra::default();
        let d = run(u64::MAX / 2, u64::MAX, 0, &mut s, u64::MAX - 5, 3);
        assert!(d.is_admitted());
        assert_eq!(s.tat, Timestamp::MAX);
    }

    #[test]
    fn a_move_to_another_interval_keeps_the_units_owed() {
        // Free: 1 per second, burst 3; all 3 spent.
        let mut s = Gcra::default();
        for _ in 0..3 {
            assert!(run(1_000_000, 3, 0, &mut s, 0, 1).is_admitted());
        }
        assert_eq!(s.per, us(1_000_000));
        // Pro: 10 per second, burst 10. 3 owed of 10: 7 left, this request takes one.
        assert_eq!(run(100_000, 10, 0, &mut s, 0, 1), allow(6, 400_000));
        // Half a second later under free again: 4 units owed at 100 ms were 400 ms, 500 ms
        // passed: nothing owed.
        assert_eq!(run(1_000_000, 3, 0, &mut s, 500_000, 1), allow(2, 1_000_000));
        // A partly refilled token counts as spent: 1.5 owed at 1 s → 2 owed at 100 ms.
        let mut s = Gcra { tat: at(1_500_000), start: at(0), per: us(1_000_000) };
        assert_eq!(run(100_000, 10, 0, &mut s, 0, 1), allow(7, 300_000));
    }
}
