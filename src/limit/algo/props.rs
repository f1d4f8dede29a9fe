//! Property tests over random arrival times and costs: no algorithm ever admits more than its
//! documented bound, waiting `retry_after` or longer is admitted (and one µs less is not), no
//! `retry_after` exceeds [`longest_wait`], a refund at the same instant restores the previous
//! behaviour exactly, and `Never` is the answer exactly to a cost above `max_cost`.

use std::num::NonZeroU64;

use proptest::prelude::*;

use super::{decide, longest_wait, max_cost, refund, Algorithm, Decision, NonZeroSpan, Span, State, Timestamp};

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n.max(1)).expect("non-zero")
}

fn nzs(us: u64) -> NonZeroSpan {
    NonZeroSpan::from_micros(us.max(1)).expect("non-zero")
}

/// Small parameters so that boundaries, refills and merges happen often.
fn token_bucket() -> impl Strategy<Value = Algorithm> {
    (1u64..200, 1u64..10, prop_oneof![Just(0u64), 1u64..3_000]).prop_map(|(t, b, w)| Algorithm::TokenBucket {
        interval: nzs(t),
        burst: nz(b),
        warmup: Span::from_micros(w),
    })
}

fn leaky_bucket() -> impl Strategy<Value = Algorithm> {
    (1u64..200, 0u64..1_000)
        .prop_map(|(t, d)| Algorithm::LeakyBucket { interval: nzs(t), max_delay: Span::from_micros(d) })
}

fn windowed(make: fn(NonZeroSpan, NonZeroU64) -> Algorithm) -> impl Strategy<Value = Algorithm> {
    (1u64..1_000, 1u64..10).prop_map(move |(w, l)| make(nzs(w), nz(l)))
}

fn any_algorithm() -> impl Strategy<Value = Algorithm> {
    prop_oneof![
        token_bucket(),
        leaky_bucket(),
        windowed(|window, limit| Algorithm::FixedWindow { window, limit, calendar: None }),
        windowed(|window, limit| Algorithm::SlidingWindow { window, limit }),
        windowed(|window, limit| Algorithm::SlidingLog { window, limit }),
    ]
}

/// Arrivals as (gap since previous, cost seed); the seed maps onto `1..=max_cost`.
fn arrivals() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((prop_oneof![Just(0u64), 0u64..50, 0u64..3_000], any::<u64>()), 1..150)
}

fn cost_of(alg: &Algorithm, seed: u64) -> u64 {
    // Mostly unit costs, sometimes up to the maximum.
    if seed % 3 == 0 {
        1 + seed / 3 % max_cost(alg).min(1_000)
    } else {
        1
    }
}

/// Runs the arrivals from t0 = 1_000_000; returns (now, cost, decision) and the final state.
fn run(alg: &Algorithm, arr: &[(u64, u64)]) -> (Vec<(Timestamp, u64, Decision)>, Option<State>) {
    let mut now = Timestamp::from_micros(1_000_000);
    let mut state = None;
    let mut out = Vec::with_capacity(arr.len());
    for &(gap, seed) in arr {
        now = now + Span::from_micros(gap);
        let cost = cost_of(alg, seed);
        let (d, next) = decide(alg, state.as_ref(), now, cost);
        state = next;
        out.push((now, cost, d));
    }
    (out, state)
}

fn admitted(log: &[(Timestamp, u64, Decision)]) -> Vec<(Timestamp, u64)> {
    log.iter().filter(|(_, _, d)| d.is_admitted()).map(|&(t, c, _)| (t, c)).collect()
}

/// Largest total cost admitted in any half-open interval `[t, t + len)`.
fn max_in_any_interval(adm: &[(Timestamp, u64)], len: NonZeroSpan) -> u64 {
    adm.iter()
        .map(|&(t0, _)| adm.iter().filter(|&&(t, _)| t >= t0 && t < t0 + len.get()).map(|&(_, c)| c).sum::<u64>())
        .max()
        .unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn token_bucket_never_exceeds_burst_plus_rate(alg in token_bucket(), arr in arrivals()) {
        let Algorithm::TokenBucket { interval, burst, .. } = alg else { unreachable!() };
        let adm = admitted(&run(&alg, &arr).0);
        for (i, &(ti, _)) in adm.iter().enumerate() {
            let mut sum = 0;
            for &(tj, c) in &adm[i..] {
                sum += c;
                let bound = burst.get() + (tj - ti) / interval;
                prop_assert!(sum <= bound, "{sum} > {bound} in [{ti:?}, {tj:?}]");
            }
        }
    }

    #[test]
    fn token_bucket_saturated_admits_exactly_burst_plus_elapsed(
        t in 1u64..300, b in 1u64..20, horizon in 0u64..5_000,
    ) {
        let alg = Algorithm::TokenBucket { interval: nzs(t), burst: nz(b), warmup: Span::ZERO };
        let mut state = None;
        let mut n = 0;
        for now in (7_000..=7_000 + horizon).map(Timestamp::from_micros) {
            loop {
                let (d, next) = decide(&alg, state.as_ref(), now, 1);
                state = next;
                if !d.is_admitted() { break; }
                n += 1;
            }
        }
        prop_assert_eq!(n, b + horizon / t);
    }

    #[test]
    fn leaky_bucket_outflow_is_one_unit_per_interval(alg in leaky_bucket(), arr in arrivals()) {
        let Algorithm::LeakyBucket { interval, max_delay } = alg else { unreachable!() };
        let mut next_free = Timestamp::ZERO;
        for (now, cost, d) in run(&alg, &arr).0 {
            let wait = match d {
                Decision::Allow { .. } => Span::ZERO,
                Decision::Delay { wait, .. } => wait,
                Decision::Deny { .. } | Decision::Never { .. } => continue,
            };
            prop_assert!(wait <= max_delay);
            prop_assert!(now + wait >= next_free, "slot {:?} before {next_free:?}", now + wait);
            next_free = now + wait + interval.get() * cost;
        }
    }

    #[test]
    fn fixed_window_never_exceeds_limit_per_aligned_window(
        alg in windowed(|window, limit| Algorithm::FixedWindow { window, limit, calendar: None }),
        arr in arrivals(),
    ) {
        let Algorithm::FixedWindow { window, limit, .. } = alg else { unreachable!() };
        let adm = admitted(&run(&alg, &arr).0);
        let mut per = std::collections::HashMap::new();
        for (t, c) in adm {
            *per.entry(t.floor(window)).or_insert(0) += c;
        }
        prop_assert!(per.values().all(|&n| n <= limit.get()), "{per:?}");
    }

    #[test]
    fn sliding_window_stays_within_documented_bound(
        alg in windowed(|window, limit| Algorithm::SlidingWindow { window, limit }),
        arr in arrivals(),
    ) {
        let Algorithm::SlidingWindow { window, limit } = alg else { unreachable!() };
        let adm = admitted(&run(&alg, &arr).0);
        let mut per = std::collections::HashMap::new();
        for &(t, c) in &adm {
            *per.entry(t.floor(window)).or_insert(0) += c;
        }
        prop_assert!(per.values().all(|&n| n <= limit.get()), "{per:?}");
        let worst = max_in_any_interval(&adm, window);
        prop_assert!(worst < 2 * limit.get(), "{worst} >= 2L");
    }

    #[test]
    fn sliding_log_never_exceeds_limit_in_any_window(
        alg in windowed(|window, limit| Algorithm::SlidingLog { window, limit }),
        arr in arrivals(),
    ) {
        let Algorithm::SlidingLog { window, limit } = alg else { unreachable!() };
        let adm = admitted(&run(&alg, &arr).0);
        prop_assert!(max_in_any_interval(&adm, window) <= limit.get());
    }

    #[test]
    fn waiting_retry_after_is_admitted(
        alg in any_algorithm(), arr in arrivals(), gap in 0u64..100, seed in any::<u64>(),
        later in prop_oneof![Just(0u64), 0u64..3_000],
    ) {
        let (log, state) = run(&alg, &arr);
        let now = log.last().map_or(Timestamp::ZERO, |l| l.0) + Span::from_micros(gap);
        let cost = cost_of(&alg, seed);
        let (d, after) = decide(&alg, state.as_ref(), now, cost);
        if let Decision::Deny { retry_after, .. } = d {
            prop_assert!(retry_after > Span::ZERO && retry_after < Span::MAX);
            // The Retry-After header is capped at this bound.
            prop_assert!(retry_after <= longest_wait(&alg), "{retry_after:?} > {:?}", longest_wait(&alg));
            // Nothing consumed by the denial; waiting longer (a rounded-up header, latency)
            // is admitted too.
            let (d2, _) = decide(&alg, after.as_ref(), now + retry_after, cost);
            prop_assert!(d2.is_admitted(), "not admitted after {retry_after:?}: {d2:?}");
            let (d3, _) = decide(&alg, after.as_ref(), now + retry_after + Span::from_micros(later), cost);
            prop_assert!(d3.is_admitted(), "not admitted {later} µs after {retry_after:?}: {d3:?}");
            let (d1, _) = decide(&alg, state.as_ref(), now + retry_after - Span::from_micros(1), cost);
            prop_assert!(!d1.is_admitted(), "retry_after {retry_after:?} not minimal");
        }
    }

    #[test]
    fn never_answers_exactly_a_cost_above_max_cost(
        alg in any_algorithm(), arr in arrivals(), gap in 0u64..100, extra in 1u64..1_000, probe in any::<u64>(),
    ) {
        let (log, state) = run(&alg, &arr);
        // Costs up to max_cost: a wait, or an admission, never `Never`.
        prop_assert!(log.iter().all(|(_, _, d)| !matches!(d, Decision::Never { .. })), "{log:?}");
        let now = log.last().map_or(Timestamp::ZERO, |l| l.0) + Span::from_micros(gap);
        let (d, after) = decide(&alg, state.as_ref(), now, max_cost(&alg).saturating_add(extra));
        prop_assert!(matches!(d, Decision::Never { .. }), "{d:?}");
        // Nothing consumed.
        let probe = cost_of(&alg, probe);
        prop_assert_eq!(
            decide(&alg, after.as_ref(), now, probe).0,
            decide(&alg, state.as_ref(), now, probe).0
        );
    }

    #[test]
    fn refund_restores_admission(
        alg in any_algorithm(), arr in arrivals(), gap in 0u64..100,
        seed in any::<u64>(), probe in any::<u64>(),
    ) {
        let (log, before) = run(&alg, &arr);
        let now = log.last().map_or(Timestamp::ZERO, |l| l.0) + Span::from_micros(gap);
        let cost = cost_of(&alg, seed);
        let (d, after) = decide(&alg, before.as_ref(), now, cost);
        if d.is_admitted() {
            let back = refund(&alg, after.as_ref(), now, cost);
            let probe = cost_of(&alg, probe);
            prop_assert_eq!(
                decide(&alg, back.as_ref(), now, probe).0,
                decide(&alg, before.as_ref(), now, probe).0
            );
        }
    }

    #[test]
    fn remaining_units_are_really_admissible(alg in any_algorithm(), arr in arrivals()) {
        let (log, mut state) = run(&alg, &arr);
        let Some(&(now, _, d)) = log.last() else { return Ok(()) };
        let remaining = match d {
            Decision::Allow { remaining, .. } | Decision::Delay { remaining, .. } => remaining,
            Decision::Deny { .. } | Decision::Never { .. } => return Ok(()),
        };
        for _ in 0..remaining.min(50) {
            let (d, next) = decide(&alg, state.as_ref(), now, 1);
            prop_assert!(d.is_admitted());
            state = next;
        }
        if remaining < 50 {
            prop_assert!(!decide(&alg, state.as_ref(), now, 1).0.is_admitted());
        }
    }
}
