//! Leaky bucket as a meter: admitted units leave at exactly one per `interval`; a request may
//! wait for its slot up to `max_delay`. Invariant: only `tat` (next free slot) is stored, and
//! `tat - now <= max_delay + cost*T` right after any admission, so the queue is bounded.
//!
//! # Math (the Redis port must reproduce this exactly; all values u64 µs, saturating)
//!
//! Parameters: `T = interval` (>= 1), `D = max_delay` (0 = strict meter, never delays).
//! State: `tat` = time the next slot is free. Initial: `tat = 0`; idle iff `tat <= now`.
//! `max_cost = D / T + 1` (one slot now plus the queue; a bigger cost would hold the meter
//! longer than the whole queue and is `Never { reset = max(tat - now, 0) }`).
//!
//! For a request of cost `c` at `now`:
//! - `slot = max(tat, now)`, `wait = slot - now`.
//! - Admit iff `wait <= D`: `tat' = slot + c*T`; `Allow` if `wait == 0`, else `Delay { wait }`
//!   (the request goes through at its first slot; the next request queues behind all `c`).
//!   `reset = tat' - now`; `remaining = 0` if `tat' - now > D`, else `(D - (tat' - now))/T + 1`
//!   (unit requests that would still be admitted now, each waiting one more `T`).
//! - Deny: `retry_after = wait - D`, `reset = tat - now`, state unchanged. After that wait the
//!   same request waits exactly `D`, so it is admitted (as a `Delay`, or `Allow` when `D = 0`).
//!
//! Refund of `c` at `now`: if `tat > now`, `tat = max(tat - c*T, now)`.

use std::num::NonZeroU64;

use super::{debt_cap, lua_too_big, never, Call, Kind, Param, Rule, Unfit, Words, Written, EXACT_SPAN, LUA_SPAN};
use crate::limit::{Algorithm, Decision, NonZeroSpan, Span, Timestamp};

/// The parameters of [`crate::limit::Algorithm::LeakyBucket`]: `T` and `D` above.
#[derive(Clone, Copy, Debug)]
pub struct LeakyBucket {
    pub interval: NonZeroSpan,
    pub max_delay: Span,
}

super::slot!(LeakyBucket => Meter);

impl From<LeakyBucket> for Algorithm {
    fn from(r: LeakyBucket) -> Algorithm {
        Algorithm::LeakyBucket { interval: r.interval, max_delay: r.max_delay }
    }
}

impl Rule for LeakyBucket {
    const NAME: &'static str = "leaky_bucket";
    const KIND: Kind = Kind::LeakyBucket;
    const FIELDS: &'static [&'static str] = &["max_delay"];
    const DELAYS: bool = true;
    const PLANS: bool = false;
    const LEASES: bool = false;
    const SCRIPT: &'static str = include_str!("leaky_bucket.lua");

    type State = Meter;

    fn build(w: &Written<'_>) -> Result<Algorithm, Unfit> {
        let r = LeakyBucket { interval: w.interval()?, max_delay: w.max_delay.unwrap_or(Span::ZERO) };
        r.check_exact().map_err(|e| ("rate", e))?;
        Ok(r.into())
    }

    /// `tat` up to `now + 2·max_delay + interval`.
    fn check_exact(&self) -> Result<(), String> {
        if 2 * u128::from(self.max_delay.as_micros()) + u128::from(self.interval.as_micros()) >= EXACT_SPAN {
            return Err("max_delay is too long to compute exactly (2 × max_delay plus the interval must stay \
                        below 2^63 µs)"
                .to_owned());
        }
        Ok(())
    }

    /// `2·D + T < 2^52`.
    fn check_script(&self) -> Result<(), String> {
        if 2 * u128::from(self.max_delay.as_micros()) + u128::from(self.interval.as_micros()) >= LUA_SPAN {
            return lua_too_big("max_delay must stay below 2^51 µs");
        }
        Ok(())
    }

    /// `T`, `D`.
    fn script_args(&self, _: &Call, arg: &mut impl FnMut(u64)) {
        arg(self.interval.as_micros());
        arg(self.max_delay.as_micros());
    }

    /// Request `k + 1` waits `k · cost · T`, admitted while that is at most `max_delay`.
    fn after_burst(&self, n: u64, cost: u64) -> Meter {
        // A cost is at least 1, so a step is at least the interval.
        let step = NonZeroSpan::new(self.interval.get() * cost).unwrap_or(self.interval);
        let k = n.min(self.max_delay / step + 1);
        Meter { tat: Timestamp::ZERO + step.get() * k }
    }

    fn describe(&self, cost: u64, words: &impl Words) -> String {
        let t = self.interval;
        if self.max_delay.is_zero() {
            format!(
                "a strict meter of one request every {} ({} requests/s){}: a request sooner than that {}",
                words.span(t.get()),
                words.per_second(t),
                words.costs(cost),
                words.decision(self.overrun(1, cost))
            )
        } else {
            let queue = (self.max_delay / t).saturating_add(1);
            format!(
                "smoothed to one request every {} ({} requests/s){}: up to {queue} waiting requests are delayed (at most {}), request {} {}",
                words.span(t.get()),
                words.per_second(t),
                words.costs(cost),
                words.span(self.max_delay),
                (queue / cost).saturating_add(1),
                words.decision(self.overrun(queue / cost, cost))
            )
        }
    }

    fn params(&self) -> Vec<(&'static str, Param)> {
        vec![("interval", Param::Span(self.interval.get())), ("max_delay", Param::Span(self.max_delay))]
    }

    fn decide(&self, st: &mut Meter, now: Timestamp, cost: u64) -> Decision {
        decide(self.interval, self.max_delay, st, now, cost)
    }

    fn refund(&self, st: &mut Meter, now: Timestamp, cost: u64) {
        refund(self.interval, st, now, cost);
    }

    /// The slots of `cost` more units after the queue: `tat = max(tat, now) + c*T`.
    fn debit(&self, st: &mut Meter, now: Timestamp, cost: u64) {
        st.tat = (st.tat.max(now) + self.interval.get() * cost).min(debt_cap(now));
    }

    fn is_idle(&self, st: &Meter, now: Timestamp) -> bool {
        st.is_idle(now)
    }

    fn idle_at(&self, st: &Meter) -> Timestamp {
        st.tat
    }

    fn max_cost(&self) -> u64 {
        max_cost(self.interval, self.max_delay)
    }

    /// The largest cost's slots: `interval × (max_delay / interval + 1)`.
    fn longest_wait(&self) -> Span {
        self.interval.get() * self.max_cost()
    }

    /// The time its queue takes to drain: [`Rule::longest_wait`].
    fn period(&self) -> Span {
        self.longest_wait()
    }

    /// One per interval (the queue is not quota), per second when it can be.
    fn policy(&self) -> (u64, u64) {
        let per_sec = Span::from_secs(1) / self.interval;
        if per_sec >= 1 {
            (per_sec, 1)
        } else {
            (1, self.interval.get().as_secs_ceil())
        }
    }

    /// Each instance lets one through per `instances` intervals; the wait stays.
    fn fallback(&self, instances: NonZeroU64) -> Algorithm {
        LeakyBucket { interval: self.interval.saturating_mul(instances), max_delay: self.max_delay }.into()
    }
}

/// Meter state: the time the next slot is free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meter {
    pub tat: Timestamp,
}

impl Meter {
    /// Back to initial: the queue is empty.
    pub fn is_idle(&self, now: Timestamp) -> bool {
        self.tat <= now
    }
}

/// Largest admissible cost: one slot now plus `D / T` queued.
pub fn max_cost(t: NonZeroSpan, d: Span) -> u64 {
    (d / t).saturating_add(1)
}

/// One decision; see the module docs.
pub fn decide(t: NonZeroSpan, d: Span, st: &mut Meter, now: Timestamp, cost: u64) -> Decision {
    if cost > max_cost(t, d) {
        return never(st.tat - now);
    }
    let slot = st.tat.max(now);
    let wait = slot - now;
    if wait > d {
        return Decision::Deny { retry_after: wait - d, reset: wait };
    }
    st.tat = slot + t.get() * cost;
    let reset = st.tat - now;
    let remaining = match d.checked_sub(reset) {
        Some(room) => room / t + 1,
        None => 0,
    };
    if wait.is_zero() {
        Decision::Allow { remaining, reset }
    } else {
        Decision::Delay { wait, remaining, reset }
    }
}

/// Gives back `cost` slots (exact at the admission's `now`).
pub fn refund(t: NonZeroSpan, st: &mut Meter, now: Timestamp, cost: u64) {
    if st.tat > now {
        st.tat = (st.tat - t.get() * cost).max(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{allow, at, delay, deny, us};

    const T: NonZeroSpan = match NonZeroSpan::from_micros(100) {
        Some(t) => t,
        None => NonZeroSpan::MIN,
    };

    /// A decision with T = 100 µs, max_delay `d`, at `now`, in µs.
    fn run(d: u64, s: &mut Meter, now: u64, cost: u64) -> Decision {
        decide(T, us(d), s, at(now), cost)
    }

    #[test]
    fn queues_up_to_max_delay_then_denies() {
        // One unit per 100 µs, wait at most 250 µs: slots at 0, 100, 200 (wait 200), not 300.
        let mut s = Meter::default();
        assert_eq!(run(250, &mut s, 1_000, 1), allow(2, 100));
        assert_eq!(run(250, &mut s, 1_000, 1), delay(100, 1, 200));
        assert_eq!(run(250, &mut s, 1_000, 1), delay(200, 0, 300));
        assert_eq!(run(250, &mut s, 1_000, 1), deny(50, 300));
        assert_eq!(run(250, &mut s, 1_050, 1), delay(250, 0, 350));
    }

    #[test]
    fn strict_meter_never_delays() {
        let mut s = Meter::default();
        assert!(matches!(run(0, &mut s, 0, 1), Decision::Allow { remaining: 0, .. }));
        assert_eq!(run(0, &mut s, 40, 1), deny(60, 60));
        assert!(matches!(run(0, &mut s, 100, 1), Decision::Allow { .. }));
    }

    #[test]
    fn refund_restores_admission() {
        let mut s = Meter::default();
        run(0, &mut s, 0, 1);
        assert!(!run(0, &mut s, 0, 1).is_admitted());
        refund(T, &mut s, Timestamp::ZERO, 1);
        assert!(s.is_idle(Timestamp::ZERO));
        assert!(run(0, &mut s, 0, 1).is_admitted());
    }

    #[test]
    fn outflow_never_exceeds_one_unit_per_interval() {
        // Whatever the arrivals, admitted slots are spaced by at least T.
        let mut s = Meter::default();
        let mut slots = Vec::new();
        for now in (0..5_000).step_by(7) {
            let slot = match run(300, &mut s, now, 1) {
                Decision::Allow { .. } => at(now),
                Decision::Delay { wait, .. } => at(now) + wait,
                Decision::Deny { .. } | Decision::Never { .. } => continue,
            };
            slots.push(slot);
        }
        assert!(slots.windows(2).all(|p| p[1] - p[0] >= T.get()));
        assert_eq!(slots.len(), 50 + 3);
    }
}
