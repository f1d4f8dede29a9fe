//! Early retries through the gate, on a manual clock: counted, penalised (doubling, capped
//! at the period, honest), and never for a client that waits what it was told.

use crate::answer::Error;
use crate::gate::{Gate, Limit};
use crate::limit::{Clock, ManualClock, Span, Timestamp};
use crate::metrics::Metrics;
use crate::request_key::KeyCtx;

const SEC: u64 = 1_000_000;

/// A gate over one route with `spread` and these limits (YAML list items).
fn gate(spread: &str, limits: &[&str]) -> Gate {
    let limits: String = limits.iter().map(|l| format!("      - {l}\n")).collect();
    let yaml = format!(
        "listen: 127.0.0.1:1\nupstreams:\n  up: {{ respond: {{ status: 200 }} }}\nroutes:\n  - name: r\n    upstream: up\n    retry_after_spread: {spread}\n    limits:\n{limits}"
    );
    let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
    Gate::new(&config.routes[0], &Metrics::new(), &mut |l| Limit::local_store(l))
}

/// The Retry-After of a 429 at `now` µs, `None` when admitted.
async fn ask(g: &Gate, now: u64) -> Option<u64> {
    let parts = http::Request::new(()).into_parts().0;
    let ctx = KeyCtx::test(&parts);
    match g.check(&ctx, Timestamp::from_micros(now)).await {
        Ok(_) => None,
        Err(Error::Throttled(d)) => Some(d.retry_after_secs),
        Err(e) => panic!("{e:?}"),
    }
}

fn early(g: &Gate, i: usize) -> u64 {
    g.limits()[i].metrics.early_retries.get()
}

#[tokio::test]
async fn an_early_retry_is_counted_whether_denied_or_admitted() {
    let g = gate("0s", &["{ name: b, algorithm: token_bucket, rate: 1/10s, burst: 1 }"]);
    assert_eq!(ask(&g, 0).await, None);
    assert_eq!(ask(&g, SEC).await, Some(9));
    assert_eq!(early(&g, 0), 0, "a first denial is no retry");
    // Back after 4 s of the 9 told: early, denied, told the 5 s left.
    assert_eq!(ask(&g, 5 * SEC).await, Some(5));
    assert_eq!(early(&g, 0), 1);
    // Back when told: admitted, not early.
    assert_eq!(ask(&g, 10 * SEC).await, None);
    assert_eq!(early(&g, 0), 1);

    // A spread tells more than the honest wait: a client back in between is admitted, and
    // still early.
    let g = gate("5s", &["{ name: w, algorithm: fixed_window, rate: 1/10s }"]);
    assert_eq!(ask(&g, 0).await, None);
    assert_eq!(ask(&g, 0).await, Some(10), "the first spread wait adds 0 s");
    assert_eq!(ask(&g, SEC).await, Some(10), "a denied early retry: 9 s + 1 s of spread");
    assert_eq!(early(&g, 0), 1);
    assert_eq!(ask(&g, 10 * SEC).await, None, "the window has turned: admitted");
    assert_eq!(early(&g, 0), 2, "yet before the 11 s told");
}

#[tokio::test]
async fn a_penalty_doubles_the_wait_up_to_the_period_and_stays_honest() {
    // Six tokens, one back every 10 s: a full refill (the period) takes 60 s.
    let g = gate(
        "0s",
        &["{ name: b, algorithm: token_bucket, rate: 1/10s, burst: 6, key: client_ip, early_retry: { penalty: double } }"],
    );
    for _ in 0..6 {
        assert_eq!(ask(&g, 0).await, None);
    }
    assert_eq!(ask(&g, 0).await, Some(10));
    let mut told = Vec::new();
    for s in 1..=4 {
        told.push(ask(&g, s * SEC).await.expect("a penalised retry is denied"));
    }
    assert_eq!(told, [20, 40, 60, 60], "doubled, then the 60 s period");
    assert_eq!(early(&g, 0), 4);
    // 1 s short of the last Retry-After: still early, still the period.
    assert_eq!(ask(&g, 63 * SEC).await, Some(60));
    // Waiting the Retry-After told gets in, and is no early retry.
    assert_eq!(ask(&g, 123 * SEC).await, None);
    assert_eq!(early(&g, 0), 5);
    assert_eq!(g.limits()[0].metrics.throttled.get(), 6);
}

#[tokio::test]
async fn a_penalised_retry_consumes_nothing_in_the_other_limits() {
    let g = gate(
        "0s",
        &[
            "{ name: strict, algorithm: fixed_window, rate: 1/m, early_retry: { penalty: double } }",
            "{ name: wide, algorithm: fixed_window, rate: 3/h }",
        ],
    );
    assert_eq!(ask(&g, 0).await, None);
    for s in 1..=5 {
        assert!(ask(&g, s * SEC).await.is_some());
    }
    assert_eq!(early(&g, 0), 4);
    // `wide` admitted and refunded every time: two of its three remain.
    assert_eq!(ask(&g, 240 * SEC).await, None);
    assert_eq!(ask(&g, 301 * SEC).await, None);
    assert!(ask(&g, 362 * SEC).await.is_some());
}

#[tokio::test]
async fn a_shadow_limit_counts_early_retries_and_never_penalises() {
    let g = gate(
        "0s",
        &["{ name: s, algorithm: fixed_window, rate: 1/m, mode: shadow, early_retry: { penalty: double } }"],
    );
    for s in 0..5 {
        assert_eq!(ask(&g, s * SEC).await, None);
    }
    // Denied (in shadow) at 1 s, told 59 s it would have been: 2, 3 and 4 s are early.
    assert_eq!(early(&g, 0), 3);
    assert_eq!(g.limits()[0].metrics.shadow_throttled.get(), 4);
}

#[tokio::test]
async fn a_leaky_bucket_delay_is_no_denial() {
    let g = gate(
        "0s",
        &["{ name: q, algorithm: leaky_bucket, rate: 1/s, max_delay: 3s, early_retry: { penalty: double } }"],
    );
    for _ in 0..4 {
        assert_eq!(ask(&g, 0).await, None);
    }
    assert_eq!(early(&g, 0), 0);
    // The queue is full: a denial, told 1 s; back at once, it is penalised up to the
    // queue's drain time.
    let first = ask(&g, 0).await.expect("queue full");
    assert_eq!(first, 1);
    assert_eq!(ask(&g, 1).await, Some(2));
    assert_eq!(ask(&g, 2).await, Some(4));
    assert_eq!(ask(&g, 3).await, Some(4), "capped at the queue's drain time");
    assert_eq!(early(&g, 0), 3);
}

/// Limits probed with a penalty: every algorithm.
const PROBED: [&str; 6] = [
    "{ name: l, algorithm: sliding_window, rate: 2/s, early_retry: { penalty: double } }",
    "{ name: l, algorithm: fixed_window, rate: 2/3s, early_retry: { penalty: double } }",
    "{ name: l, algorithm: sliding_log, rate: 2/s, early_retry: { penalty: double } }",
    "{ name: l, algorithm: token_bucket, rate: 2/s, burst: 4, early_retry: { penalty: double } }",
    "{ name: l, algorithm: token_bucket, rate: 1/2s, burst: 3, warmup: 3s, early_retry: { penalty: double } }",
    "{ name: l, algorithm: leaky_bucket, rate: 2/s, max_delay: 1500ms, early_retry: { penalty: double } }",
];

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// A client that always waits at least the Retry-After it was told is never counted
    /// early, never penalised, and is admitted when it comes back; pace, extra waits and the
    /// spread are random.
    #[test]
    fn a_client_that_waits_is_never_penalised(
        which in 0..PROBED.len(),
        spread in 0u64..4,
        phase in 0u64..4_000_000,
        pace in 0u64..300_000,
        extra in proptest::collection::vec(0u64..3_000_000, 1..6),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let g = gate(&format!("{spread}s"), &[PROBED[which]]);
            let clock = ManualClock::new(Timestamp::from_micros(1_000_000_000_000 + phase));
            for wait in extra {
                let mut told = None;
                for _ in 0..200 {
                    clock.advance(Span::from_micros(pace));
                    if let Some(secs) = ask(&g, clock.now().as_micros()).await {
                        told = Some(secs);
                        break;
                    }
                }
                let told = told.expect("a 429 within 200 requests");
                clock.advance(Span::from_secs(told) + Span::from_micros(wait));
                assert_eq!(ask(&g, clock.now().as_micros()).await, None, "{}: refused after waiting {told} s", PROBED[which]);
            }
            assert_eq!(early(&g, 0), 0, "{}", PROBED[which]);
        });
    }

    /// However often and whenever a penalised client comes back early, waiting the last
    /// Retry-After it was told then gets it in.
    #[test]
    fn the_retry_after_of_a_penalty_is_honest(
        which in 0..PROBED.len(),
        phase in 0u64..4_000_000,
        retries in proptest::collection::vec(0u64..2_000_000, 1..8),
        latency in 0u64..5_000,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let g = gate("0s", &[PROBED[which]]);
            let clock = ManualClock::new(Timestamp::from_micros(1_000_000_000_000 + phase));
            let mut told = None;
            for _ in 0..200 {
                clock.advance(Span::from_micros(10_000));
                told = ask(&g, clock.now().as_micros()).await;
                if told.is_some() {
                    break;
                }
            }
            let mut told = told.expect("a 429 within 200 requests");
            let mut penalised = 0;
            for gap in retries {
                // Back before the Retry-After: always denied, told at least as long.
                if gap >= told * SEC {
                    continue;
                }
                clock.advance(Span::from_micros(gap));
                let again = ask(&g, clock.now().as_micros()).await.expect("an early retry is denied");
                penalised += 1;
                told = again;
            }
            proptest::prop_assert_eq!(early(&g, 0), penalised);
            clock.advance(Span::from_secs(told) + Span::from_micros(latency));
            proptest::prop_assert_eq!(ask(&g, clock.now().as_micros()).await, None, "{}: refused after {} s", PROBED[which], told);
            Ok(())
        })?;
    }
}
