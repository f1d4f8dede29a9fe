//! A call that timed out is harmless when Redis runs it late: the decision was made without
//! Redis (`on_error`), so the script, run past the deadline the call carries (in Redis'
//! clock), charges nothing. Redis paused with SIGSTOP holds the calls; SIGCONT runs them.

use std::num::NonZeroU64;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use tollgate::limit::store::redis::Topology;
use tollgate::limit::{Algorithm, Decision, KeyHash, LocalStore, RedisStore, Span};

use super::{at_us, client_with, nz, nzs};
use crate::support::redis::RedisNode;
use crate::support::{get_with, proxy_yaml, Tollgate, Upstream};

/// Waits until Redis has run `n` more script calls than `before`.
async fn until_run(node: &RedisNode, before: u64, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.calls("evalsha") < before + n {
        assert!(Instant::now() < deadline, "Redis ran {} of {n} calls", node.calls("evalsha") - before);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Paused Redis, four requests of one client: three admitted by the local fallback, the
/// fourth refused with a Retry-After. The client waits exactly that; Redis runs the four late
/// calls meanwhile. The client must be admitted: the late calls charged nothing (before, they
/// filled the next window, and each admitted request was charged twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_waits_its_retry_after_is_admitted_after_redis_runs_late_calls() {
    let node = RedisNode::start();
    let up = Upstream::fixed("ok").await;
    let redis =
        format!("redis: {{ url: '{}', timeout: 50ms, on_error: local, breaker: {{ failures: 1000 }} }}\n", node.url());
    let route = |name: &str, alg: &str| {
        format!(
            "  - name: {name}\n    match: {{ path_prefix: /{name} }}\n    upstream: up\n    limits: [{{ name: l, {alg}, key: header:x-client, store: redis }}]\n"
        )
    };
    let routes = [
        route("fixed", "algorithm: fixed_window, rate: 3/4s"),
        route("sliding", "algorithm: sliding_window, rate: 3/4s"),
        route("bucket", "algorithm: token_bucket, rate: 3/4s, burst: 3"),
    ]
    .concat();
    let tg = Tollgate::start(&format!("{redis}{}", proxy_yaml(up.addr, "", &routes))).await;
    // Connected, Redis' clock learnt, every script loaded (a late call for a script Redis does
    // not know yet is refused `NOSCRIPT` whatever its deadline).
    for path in ["/fixed", "/sliding", "/bucket"] {
        assert_eq!(get_with(tg.addr, path, &[("x-client", "warm-up")]).await.0, StatusCode::OK);
    }
    let mut refused = Vec::new();
    for path in ["/fixed", "/sliding", "/bucket"] {
        if path == "/fixed" {
            // Four requests inside one window: start just after a boundary (epoch-aligned).
            let into = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() % 4_000;
            tokio::time::sleep(Duration::from_millis((4_050 - into as u64) % 4_000)).await;
        }
        let client = [("x-client", "alice")];
        let before = node.calls("evalsha");
        node.pause();
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(get_with(tg.addr, path, &client).await);
        }
        let statuses: Vec<StatusCode> = got.iter().map(|g| g.0).collect();
        assert_eq!(statuses[..3], [StatusCode::OK; 3], "{path}: {statuses:?}");
        assert_eq!(statuses[3], StatusCode::TOO_MANY_REQUESTS, "{path}: {statuses:?}");
        let wait: u64 = got[3].1["retry-after"].to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_secs(wait)).await;
        node.resume();
        until_run(&node, before, 4).await;
        let (status, headers, _) = get_with(tg.addr, path, &client).await;
        if status != StatusCode::OK {
            refused.push(format!("{path}: {status} after waiting Retry-After: {wait} ({headers:?})"));
        }
    }
    assert!(refused.is_empty(), "{refused:#?}");
}

fn every_algorithm() -> Vec<(Algorithm, bool)> {
    let w = 60_000_000;
    vec![
        (Algorithm::FixedWindow { window: nzs(w), limit: nz(10), calendar: None }, false),
        (Algorithm::SlidingWindow { window: nzs(w), limit: nz(10) }, false),
        (Algorithm::SlidingLog { window: nzs(w), limit: nz(10) }, false),
        (Algorithm::TokenBucket { interval: nzs(w / 10), burst: nz(10), warmup: Span::ZERO }, false),
        (Algorithm::TokenBucket { interval: nzs(w / 10), burst: nz(10), warmup: Span::ZERO }, true),
        (Algorithm::LeakyBucket { interval: nzs(w / 10), max_delay: Span::from_micros(w) }, false),
    ]
}

/// The remaining of a peek (no write) for `key`.
async fn remaining(s: &RedisStore, key: KeyHash) -> u64 {
    match s.peek(key, at_us(0), 1).await.unwrap() {
        Decision::Allow { remaining, .. } | Decision::Delay { remaining, .. } => remaining,
        d => panic!("{d:?}"),
    }
}

/// With an estimate of Redis' clock that went wrong (every deadline 10 s in the past), each
/// writing call is found late by every script, changes nothing, and is made once more with the
/// estimate the late answer taught: decided by Redis, charged once (a lease too), refunds and
/// debits applied once.
#[tokio::test]
async fn every_script_charges_nothing_past_the_deadline_and_a_wrong_clock_estimate_is_corrected() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |c| c.memo_keys = 0);
    client.connect().await.unwrap();
    for (n, (alg, lease)) in every_algorithm().into_iter().enumerate() {
        let fallback = LocalStore::new(alg.clone(), 16);
        let s = RedisStore::new(
            client.clone(),
            &format!("late{n}"),
            alg.clone(),
            lease.then(|| NonZeroU64::new(4).unwrap()),
            fallback,
        );
        let key = KeyHash(0x1a7e + n as u128);
        let full = remaining(&s, key).await;
        let what = format!("{alg:?} lease {lease}");
        // With a lease, debits and refunds go to the local lease first: the decision is enough.
        let steps: &[(&str, i64)] =
            if lease { &[("decide", 4)] } else { &[("decide", 1), ("debit", 2), ("refund", -1)] };
        for &(step, charged) in steps {
            client.skew_clock(-10_000_000);
            let before = (node.calls("evalsha"), client.metrics().snapshot().fallbacks);
            let left = remaining(&s, key).await;
            match step {
                "decide" => assert!(s.decide(key, at_us(0), 1).await.unwrap().is_admitted(), "{what}"),
                "debit" => s.debit(key, at_us(0), 2).await,
                _ => s.refund(key, at_us(0), 1).await,
            }
            // The peek, the late call, the one made again, the peek below.
            assert_eq!(node.calls("evalsha") - before.0, 2 + 1, "{what} {step}");
            assert_eq!(client.metrics().snapshot().fallbacks, before.1, "{what} {step}: decided without Redis");
            // Charged once (a lease of 4 taken once, one unit of it spent here).
            let now = remaining(&s, key).await;
            assert_eq!(left as i64 - now as i64, charged, "{what} {step}: {left} → {now}");
        }
        assert!(full >= 9, "{what}: {full}");
    }
}
