//! The shared table of decision vectors: parameters, then a sequence of (now, cost) → expected
//! decision (and refunds). The same table runs against the pure math, the local store and the
//! Redis scripts, which must agree exactly. Times and spans in the table are µs; times are
//! after [`BASE`].

use std::num::NonZeroU64;

use tollgate::limit::{Algorithm, Decision, NonZeroSpan, Span, Timestamp};

/// A realistic epoch time (µs), aligned to every window used below.
const BASE: u64 = 1_700_000_000_000_000;

/// The time `offset` µs after [`BASE`].
pub fn stamp(offset: u64) -> Timestamp {
    Timestamp::from_micros(BASE + offset)
}

pub struct Vector {
    pub name: &'static str,
    pub alg: Algorithm,
    pub steps: Vec<Step>,
}

pub enum Step {
    Decide { at: u64, cost: u64, expect: Decision },
    Refund { at: u64, cost: u64 },
}

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}
fn nzs(us: u64) -> NonZeroSpan {
    NonZeroSpan::from_micros(us).unwrap()
}
fn us(n: u64) -> Span {
    Span::from_micros(n)
}
fn tb(interval: u64, burst: u64, warmup: u64) -> Algorithm {
    Algorithm::TokenBucket { interval: nzs(interval), burst: nz(burst), warmup: us(warmup) }
}
fn lb(interval: u64, max_delay: u64) -> Algorithm {
    Algorithm::LeakyBucket { interval: nzs(interval), max_delay: us(max_delay) }
}
fn fw(window: u64, limit: u64) -> Algorithm {
    Algorithm::FixedWindow { window: nzs(window), limit: nz(limit), calendar: None }
}
fn sw(window: u64, limit: u64) -> Algorithm {
    Algorithm::SlidingWindow { window: nzs(window), limit: nz(limit) }
}
fn sl(window: u64, limit: u64) -> Algorithm {
    Algorithm::SlidingLog { window: nzs(window), limit: nz(limit) }
}
fn d(at: u64, cost: u64, expect: Decision) -> Step {
    Step::Decide { at, cost, expect }
}
fn r(at: u64, cost: u64) -> Step {
    Step::Refund { at, cost }
}
fn allow(remaining: u64, reset: u64) -> Decision {
    Decision::Allow { remaining, reset: us(reset) }
}
fn delay(wait: u64, remaining: u64, reset: u64) -> Decision {
    Decision::Delay { wait: us(wait), remaining, reset: us(reset) }
}
fn deny(retry_after: u64, reset: u64) -> Decision {
    Decision::Deny { retry_after: us(retry_after), reset: us(reset) }
}

pub fn vectors() -> Vec<Vector> {
    vec![
        Vector {
            name: "token bucket: burst, then one unit per interval",
            alg: tb(100, 3, 0),
            steps: vec![
                d(0, 1, allow(2, 100)),
                d(0, 1, allow(1, 200)),
                d(0, 1, allow(0, 300)),
                d(0, 1, deny(100, 300)),
                d(50, 1, deny(50, 250)),
                d(100, 1, allow(0, 300)),
                d(100, 2, deny(200, 300)),
                d(400, 3, allow(0, 300)),
                d(400, 0, allow(0, 300)),
                d(10000, 3, allow(0, 300)),
                r(10000, 2),
                d(10000, 2, allow(0, 300)),
            ],
        },
        Vector {
            name: "token bucket with warm-up: a third of the rate when cold",
            alg: tb(100, 3, 10_000),
            steps: vec![
                d(0, 1, allow(0, 300)),
                d(0, 1, deny(100, 300)),
                d(300, 1, allow(0, 283)),
                d(5000, 1, allow(1, 150)),
                d(5000, 2, deny(50, 150)),
                d(5150, 1, allow(1, 147)),
                r(5150, 1),
                d(20000, 1, allow(0, 300)),
                d(40000, 3, allow(0, 900)),
                d(40000, 1, deny(700, 900)),
                d(80000, 1, allow(0, 300)),
                r(80000, 1),
                d(80000, 1, allow(0, 300)),
            ],
        },
        Vector {
            name: "token bucket: large costs",
            alg: tb(1_000, 10, 0),
            steps: vec![
                d(0, 10, allow(0, 10000)),
                d(1, 1, deny(999, 9999)),
                d(5000, 4, allow(1, 9000)),
                d(5000, 1, allow(0, 10000)),
                d(5001, 1, deny(999, 9999)),
                d(9999, 6, deny(1001, 5001)),
            ],
        },
        Vector {
            name: "leaky bucket: queue up to max_delay",
            alg: lb(100, 250),
            steps: vec![
                d(0, 1, allow(2, 100)),
                d(0, 1, delay(100, 1, 200)),
                d(0, 1, delay(200, 0, 300)),
                d(0, 1, deny(50, 300)),
                d(50, 1, delay(250, 0, 350)),
                d(1000, 1, allow(2, 100)),
                d(1000, 3, delay(100, 0, 400)),
                d(1000, 1, deny(150, 400)),
                r(1000, 1),
                d(1000, 1, deny(50, 300)),
            ],
        },
        Vector {
            name: "leaky bucket: strict meter",
            alg: lb(100, 0),
            steps: vec![
                d(0, 1, allow(0, 100)),
                d(40, 1, deny(60, 60)),
                d(100, 1, allow(0, 100)),
                d(100, 1, deny(100, 100)),
                r(100, 1),
                d(100, 1, allow(0, 100)),
            ],
        },
        Vector {
            name: "fixed window: aligned windows",
            alg: fw(1_000, 2),
            steps: vec![
                d(250, 1, allow(1, 750)),
                d(300, 1, allow(0, 700)),
                d(400, 1, deny(600, 600)),
                r(400, 1),
                d(400, 1, allow(0, 600)),
                d(999, 1, deny(1, 1)),
                d(1000, 2, allow(0, 1000)),
                d(1500, 1, deny(500, 500)),
                d(3100, 1, allow(1, 900)),
                d(3100, 0, allow(1, 900)),
            ],
        },
        Vector {
            name: "sliding window: weighted previous window",
            alg: sw(1_000, 10),
            steps: vec![
                d(500, 10, allow(0, 1500)),
                d(1250, 2, allow(0, 1750)),
                d(1250, 1, deny(50, 1750)),
                d(1299, 1, deny(1, 1701)),
                d(1300, 1, allow(0, 1700)),
                r(1300, 1),
                d(1300, 1, allow(0, 1700)),
                d(2999, 5, allow(4, 1001)),
                d(3000, 10, deny(1000, 1000)),
                d(3100, 4, allow(1, 1900)),
                d(3100, 1, allow(0, 1900)),
            ],
        },
        Vector {
            name: "sliding window: retry_after into the next window",
            alg: sw(1_000, 4),
            steps: vec![
                d(100, 2, allow(2, 1900)),
                d(1100, 1, allow(1, 1900)),
                d(1100, 2, deny(400, 1900)),
                d(1100, 4, deny(1900, 1900)),
                d(1500, 2, allow(0, 1500)),
                d(1500, 1, deny(500, 1500)),
                d(2999, 4, deny(1, 1)),
                d(3000, 4, allow(0, 2000)),
            ],
        },
        Vector {
            name: "sliding log: exact window",
            alg: sl(1_000, 3),
            steps: vec![
                d(100, 1, allow(2, 1000)),
                d(200, 1, allow(1, 1000)),
                d(300, 1, allow(0, 1000)),
                d(400, 2, deny(800, 900)),
                d(1199, 2, deny(1, 101)),
                d(1200, 2, allow(0, 1000)),
                d(1200, 1, deny(100, 1000)),
                r(1200, 1),
                d(1200, 1, allow(0, 1000)),
                d(2500, 3, allow(0, 1000)),
                d(2500, 1, deny(1000, 1000)),
            ],
        },
        Vector {
            name: "sliding log: equal timestamps merge",
            alg: sl(1_000, 10),
            steps: vec![
                d(7, 1, allow(9, 1000)),
                d(7, 1, allow(8, 1000)),
                d(7, 1, allow(7, 1000)),
                d(500, 2, allow(5, 1000)),
                d(1006, 6, deny(1, 494)),
                d(1007, 5, allow(3, 1000)),
                d(1007, 3, allow(0, 1000)),
                r(1007, 2),
                d(1007, 4, deny(493, 1000)),
                d(1499, 1, allow(1, 1000)),
            ],
        },
    ]
}
