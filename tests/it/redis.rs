//! The Redis store against real redis-server processes (single node and a 3-master cluster)
//! started by the tests on free loopback ports: same answers as the local math, TTLs on every
//! key, leases, the local memory of denials, and the outage policy.

use std::future::Future;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::limit::store::redis::{BreakerState, OnError, Topology};
use tollgate::limit::{
    decide, max_cost, refund, Algorithm, Decision, KeyHash, LocalStore, NonZeroSpan, RedisClient, RedisConfig,
    RedisStore, Span, Timestamp,
};

use crate::support::redis::{RedisCluster, RedisNode};
use crate::support::vectors::{stamp, vectors, Step};

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}

fn nzs(us: u64) -> NonZeroSpan {
    NonZeroSpan::from_micros(us).unwrap()
}

/// The time `us` µs after the clock's origin (the local `now` of a decision).
fn at_us(us: u64) -> Timestamp {
    Timestamp::from_micros(us)
}

fn client_with(target: Topology, f: impl FnOnce(&mut RedisConfig)) -> Arc<RedisClient> {
    let mut cfg = RedisConfig::new(target);
    // Generous: CI machines are slow and shared.
    cfg.timeout = Duration::from_millis(500);
    f(&mut cfg);
    RedisClient::new(cfg).unwrap()
}

fn store(client: &Arc<RedisClient>, name: &str, alg: Algorithm, lease: Option<u64>) -> RedisStore {
    let fallback = LocalStore::new(alg.clone(), 1_000);
    RedisStore::new(client.clone(), name, alg, lease.and_then(NonZeroU64::new), fallback)
}

fn tb(interval: u64, burst: u64) -> Algorithm {
    Algorithm::TokenBucket { interval: nzs(interval), burst: nz(burst), warmup: Span::ZERO }
}

#[test]
fn vectors_agree_with_pure_math_and_local_store() {
    for v in vectors() {
        let local = LocalStore::new(v.alg.clone(), 16);
        let mut st = None;
        for (i, step) in v.steps.iter().enumerate() {
            match *step {
                Step::Decide { at, cost, expect } => {
                    let (got, next) = decide(&v.alg, st.as_ref(), stamp(at), cost);
                    st = next;
                    assert_eq!(got, expect, "{} step {i} (pure)", v.name);
                    assert_eq!(local.decide(KeyHash(1), stamp(at), cost), expect, "{} step {i} (local)", v.name);
                }
                Step::Refund { at, cost } => {
                    st = refund(&v.alg, st.as_ref(), stamp(at), cost);
                    local.refund(KeyHash(1), stamp(at), cost);
                }
            }
        }
    }
}

/// Runs every vector through Redis stores on `target`, with and without the denial memory.
async fn vectors_on(target: Topology) {
    for memo_keys in [0, 1_000] {
        let client = client_with(target.clone(), |c| c.memo_keys = memo_keys);
        client.connect().await.unwrap();
        for (n, v) in vectors().into_iter().enumerate() {
            let s = store(&client, &format!("vec{n}"), v.alg.clone(), None);
            let key = KeyHash(0x5eed_0000 + n as u128 + (memo_keys as u128) * 1_000);
            for (i, step) in v.steps.iter().enumerate() {
                match *step {
                    Step::Decide { at, cost, expect } => {
                        let got = s.decide_at(key, stamp(at), cost).await.unwrap();
                        assert_eq!(got, expect, "{} step {i} (redis, memo {memo_keys})", v.name);
                    }
                    Step::Refund { at, cost } => s.refund_at(key, stamp(at), cost).await,
                }
            }
        }
        let m = client.metrics().snapshot();
        assert_eq!(m.fallbacks, 0, "{m:?}");
        if memo_keys > 0 {
            assert!(m.denial_hits > 0, "repeated denials are answered locally: {m:?}");
        }
    }
}

#[tokio::test]
async fn vectors_agree_on_a_single_node() {
    let node = RedisNode::start();
    vectors_on(Topology::Single(node.url())).await;
    let keys = node.tollgate_keys();
    assert!(!keys.is_empty());
    assert!(keys.iter().all(|(_, ttl)| *ttl > 0), "every key has a TTL: {keys:?}");
}

#[tokio::test]
async fn vectors_agree_on_a_cluster() {
    let cluster = RedisCluster::start();
    vectors_on(Topology::Cluster(cluster.urls())).await;
    let keys = cluster.tollgate_keys();
    assert!(keys.iter().all(|(_, ttl)| *ttl > 0), "every key has a TTL: {keys:?}");
    let used = cluster.nodes.iter().filter(|n| !n.tollgate_keys().is_empty()).count();
    assert!(used >= 2, "keys spread over the shards");
}

#[tokio::test]
async fn production_decisions_use_redis_time_and_set_ttls() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |_| {});
    for (i, alg) in every_algorithm().into_iter().enumerate() {
        let s = store(&client, &format!("prod{i}"), alg, None);
        let mut admitted = 0;
        for _ in 0..10 {
            // The local `now` is deliberately nonsense: Redis decides on its own clock.
            if s.decide(KeyHash(42), at_us(7), 1).await.unwrap().is_admitted() {
                admitted += 1;
            }
        }
        // A cold warm-up bucket charges 3 intervals per unit: a third of the burst.
        let want = if i == 1 { 1 } else { 3 };
        assert_eq!(admitted, want, "alg {i}");
        s.refund(KeyHash(42), at_us(7), 1).await;
    }
    let keys = node.tollgate_keys();
    assert_eq!(keys.len(), 6, "{keys:?}");
    for (k, ttl) in &keys {
        assert!(*ttl > 0 && *ttl <= 120_000, "{k}: {ttl}");
        assert!(k.starts_with("tollgate:{prod") && k.ends_with('}'), "hash-tagged: {k}");
    }
    assert_eq!(client.metrics().snapshot().fallbacks, 0);
}

#[tokio::test]
async fn keys_carry_only_the_digest_in_a_hash_tag() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |_| {});
    let s = store(&client, "api.per-client", tb(1_000, 5), None);
    let k = s.redis_key(KeyHash(0xabc));
    assert_eq!(k, "tollgate:{api.per-client:00000000000000000000000000000abc}");
    let weird = store(&client, "a}{b", tb(1_000, 5), None);
    assert!(weird.redis_key(KeyHash(1)).starts_with("tollgate:{a__b:"));
}

#[tokio::test]
async fn script_flush_is_survived_by_reloading() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |_| {});
    let s = store(&client, "flush", tb(1_000_000, 2), None);
    assert!(s.decide(KeyHash(1), at_us(0), 1).await.unwrap().is_admitted());
    node.cli(&["SCRIPT", "FLUSH"]);
    assert!(s.decide(KeyHash(1), at_us(0), 1).await.unwrap().is_admitted());
    assert!(!s.decide(KeyHash(1), at_us(0), 1).await.unwrap().is_admitted());
    assert_eq!(client.metrics().snapshot().fallbacks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_are_pipelined_and_exact() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |c| c.memo_keys = 0);
    client.connect().await.unwrap();
    let s = Arc::new(store(&client, "conc", tb(60_000_000, 50), None));
    let tasks: Vec<_> = (0..400)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move { s.decide(KeyHash(9), at_us(0), 1).await.unwrap().is_admitted() })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 50);
    assert_eq!(client.metrics().snapshot().calls, 400);
}

#[tokio::test]
async fn a_remembered_denial_does_not_ask_redis_again() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |_| {});
    let s = store(&client, "memo", tb(60_000_000, 1), None);
    assert!(s.decide(KeyHash(3), at_us(1_000), 1).await.unwrap().is_admitted());
    let Decision::Deny { retry_after, .. } = s.decide(KeyHash(3), at_us(1_000), 1).await.unwrap() else {
        panic!("expected deny");
    };
    let calls = client.metrics().snapshot().calls;
    for i in 1..=100 {
        let d = s.decide(KeyHash(3), at_us(1_000 + i), 1).await.unwrap();
        assert!(matches!(d, Decision::Deny { retry_after: r, .. } if r == retry_after - Span::from_micros(i)), "{d:?}");
    }
    let m = client.metrics().snapshot();
    assert_eq!(m.calls, calls, "no call to Redis while the denial lasts");
    assert_eq!(m.denial_hits, 100);
    // Another key and the end of the remembered denial go to Redis again.
    assert!(s.decide(KeyHash(4), at_us(1_000), 1).await.unwrap().is_admitted());
    let _ = s.decide(KeyHash(3), at_us(1_000) + retry_after, 1).await.unwrap();
    assert_eq!(client.metrics().snapshot().calls, calls + 2);
}

#[tokio::test]
async fn lease_needs_about_one_call_per_n_requests() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |c| c.lease_ttl = Duration::from_secs(30));
    let s = store(&client, "lease", tb(1_000, 10_000), Some(20));
    let before = node.calls("evalsha");
    for i in 0..400 {
        assert!(s.decide(KeyHash(5), at_us(i), 1).await.unwrap().is_admitted());
    }
    let calls = node.calls("evalsha") - before;
    let m = client.metrics().snapshot();
    assert_eq!(m.calls, 20, "{m:?}");
    assert!(calls <= 21, "Redis saw {calls} EVALSHA for 400 requests with lease 20");
    assert_eq!(m.lease_hits, 380);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_share_one_lease_call() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |c| {
        c.lease_ttl = Duration::from_secs(30);
        c.timeout = Duration::from_secs(5);
    });
    client.connect().await.unwrap();
    let s = Arc::new(store(&client, "herd", tb(1_000, 100_000), Some(20)));
    // 400 decisions on one key at once: without coordination each would miss the empty lease
    // and call Redis; with it, one call per 20 decisions.
    let tasks: Vec<_> = (0..400)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move { s.decide(KeyHash(12), at_us(0), 1).await.unwrap().is_admitted() })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 400);
    let m = client.metrics().snapshot();
    assert_eq!(m.calls, 20, "{m:?}");
    assert_eq!(m.lease_hits, 380, "{m:?}");
}

#[tokio::test]
async fn a_dropped_lease_call_does_not_hold_up_the_key() {
    let node = RedisNode::start();
    // A decision timeout far above the test's: a waiter held up by the abandoned call would
    // wait for all of it.
    let client = client_with(Topology::Single(node.url()), |c| {
        c.lease_ttl = Duration::from_secs(30);
        c.timeout = Duration::from_secs(20);
    });
    client.connect().await.unwrap();
    let s = store(&client, "dropped", tb(1_000, 100_000), Some(20));
    // Start a lease call and abandon it before Redis answers (a client that went away).
    {
        let mut first = Box::pin(s.decide(KeyHash(13), at_us(0), 1));
        let waker = futures_util::task::noop_waker();
        let _ = first.as_mut().poll(&mut std::task::Context::from_waker(&waker));
    }
    // The next decision takes its own lease at once instead of waiting on the abandoned one.
    let d = tokio::time::timeout(Duration::from_secs(5), s.decide(KeyHash(13), at_us(1), 1)).await;
    assert!(d.expect("not held up").unwrap().is_admitted());
    assert!(s.decide(KeyHash(13), at_us(2), 1).await.unwrap().is_admitted());
    let calls = client.metrics().snapshot().calls;
    assert!((1..=2).contains(&calls), "the abandoned call, if it was sent, and one lease: {calls}");
}

#[tokio::test]
async fn leases_never_admit_more_than_the_bucket_and_lapse() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |c| c.lease_ttl = Duration::from_millis(100));
    // Three instances sharing one bucket of 30 that refills once a minute.
    let stores: Vec<_> = (0..3)
        .map(|_| {
            store(
                &client_with(Topology::Single(node.url()), |c| c.lease_ttl = Duration::from_millis(100)),
                "shared",
                tb(60_000_000, 30),
                Some(8),
            )
        })
        .collect();
    let _ = client;
    let mut admitted = 0;
    for round in 0..20 {
        for s in &stores {
            if s.decide(KeyHash(6), at_us(round), 1).await.unwrap().is_admitted() {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 30, "leases hand out exactly the bucket when all of it is spent");
    // Units left in a lease lapse: after lease_ttl nothing more is admitted locally.
    let s = &stores[0];
    let _ = s.decide(KeyHash(7), at_us(0), 1).await.unwrap(); // takes a lease of 8, spends 1
    assert!(s.decide(KeyHash(7), at_us(1), 1).await.unwrap().is_admitted(), "spent from the lease");
    let lapsed = 1 + 100_000;
    assert!(s.decide(KeyHash(7), at_us(lapsed), 1).await.unwrap().is_admitted(), "fresh lease from Redis");
}

#[tokio::test]
async fn on_error_policies_when_redis_is_unreachable() {
    // A port nobody listens on: every call fails fast (connection refused).
    let dead = RedisNode::start();
    let url = dead.url();
    drop(dead);
    for (policy, want) in [(OnError::Allow, Some(true)), (OnError::Local, Some(true)), (OnError::Deny, None)] {
        let client = client_with(Topology::Single(url.clone()), |c| {
            c.on_error = policy;
            c.timeout = Duration::from_millis(50);
        });
        let s = store(&client, "down", tb(60_000_000, 1), None);
        let first = s.decide(KeyHash(1), at_us(0), 1).await;
        match want {
            Some(admit) => assert_eq!(first.unwrap().is_admitted(), admit, "{policy:?}"),
            None => assert!(first.is_err(), "{policy:?}"),
        }
        if policy == OnError::Local {
            // The fallback has the same parameters: a burst of 1.
            assert!(!s.decide(KeyHash(1), at_us(0), 1).await.unwrap().is_admitted());
        }
        assert!(client.ping().await.is_err());
        assert!(client.metrics().snapshot().fallbacks >= 1);
    }
}

/// One of each algorithm, with room for costs above 1.
fn every_algorithm() -> [Algorithm; 6] {
    [
        tb(1_000_000, 3),
        Algorithm::TokenBucket { interval: nzs(1_000_000), burst: nz(3), warmup: Span::from_secs(10) },
        Algorithm::LeakyBucket { interval: nzs(1_000_000), max_delay: Span::from_secs(2) },
        Algorithm::FixedWindow { window: nzs(60_000_000), limit: nz(3), calendar: None },
        Algorithm::SlidingWindow { window: nzs(60_000_000), limit: nz(3) },
        Algorithm::SlidingLog { window: nzs(60_000_000), limit: nz(3) },
    ]
}

#[tokio::test]
async fn a_cost_above_the_limit_is_never_admissible_in_either_store() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |_| {});
    client.connect().await.unwrap();
    for (i, alg) in every_algorithm().into_iter().enumerate() {
        let (max, now) = (max_cost(&alg), stamp(0));
        let local = LocalStore::new(alg.clone(), 16);
        let shared = store(&client, &format!("never{i}"), alg.clone(), None);
        for over in [max + 1, u64::MAX] {
            let d = local.decide(KeyHash(1), now, over);
            assert!(matches!(d, Decision::Never { .. }), "{alg:?} cost {over} (local): {d:?}");
            let d = shared.decide_at(KeyHash(1), now, over).await.unwrap();
            assert!(matches!(d, Decision::Never { .. }), "{alg:?} cost {over} (redis): {d:?}");
        }
        // The largest cost that fits is admitted by both: a `Never` consumed nothing.
        assert!(local.decide(KeyHash(1), now, max).is_admitted(), "{alg:?} (local)");
        assert!(shared.decide_at(KeyHash(1), now, max).await.unwrap().is_admitted(), "{alg:?} (redis)");
        // Spent, a cost that fits is a plain denial with a wait, not `Never`.
        let d = shared.decide_at(KeyHash(1), now, max).await.unwrap();
        assert!(matches!(d, Decision::Deny { .. }), "{alg:?}: {d:?}");
    }
    // With a lease, and on Redis' own clock.
    let leased = store(&client, "never-lease", tb(1_000, 10), Some(5));
    assert!(matches!(leased.decide(KeyHash(2), at_us(0), 11).await.unwrap(), Decision::Never { .. }));
    assert!(leased.decide(KeyHash(2), at_us(0), 10).await.unwrap().is_admitted());
    let m = client.metrics().snapshot();
    assert_eq!(m.fallbacks, 0, "{m:?}");
    // Two calls per algorithm and the lease: a `Never` is decided without asking Redis.
    assert_eq!(m.calls, 6 * 2 + 1, "{m:?}");
}

#[tokio::test]
async fn the_local_fallback_answers_never_for_a_cost_above_its_divided_limit() {
    // Config validation refuses such a cost (issue 13, defect 2); if one got through, the
    // fallback says `Never` rather than a denial with a wait of ~2^64 µs.
    let dead = RedisNode::start();
    let url = dead.url();
    drop(dead);
    let client = client_with(Topology::Single(url), |c| c.timeout = Duration::from_millis(50));
    let fallback = LocalStore::new(tb(2_000_000, 2), 16);
    let s = RedisStore::new(client.clone(), "divided", tb(1_000_000, 4), None, fallback);
    let d = s.decide(KeyHash(1), at_us(0), 3).await.unwrap();
    assert!(matches!(d, Decision::Never { .. }), "{d:?}");
    assert!(client.metrics().snapshot().fallbacks >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_falls_back_within_the_deadline_and_recovers_without_restart() {
    let mut node = RedisNode::start();
    let timeout = Duration::from_millis(50);
    let client = client_with(Topology::Single(node.url()), |c| {
        c.timeout = timeout;
        c.breaker_failures = std::num::NonZeroU32::new(3).unwrap();
        c.breaker_cooldown = Duration::from_millis(200);
        c.memo_keys = 0;
    });
    client.connect().await.unwrap();
    let s = Arc::new(store(&client, "outage", tb(1_000_000, 10_000_000), None));
    let run = |s: Arc<RedisStore>, n: usize| async move {
        let mut worst = Duration::ZERO;
        for i in 0..n {
            let t = Instant::now();
            let d = s.decide(KeyHash(i as u128 % 7), at_us(0), 1).await.expect("on_error: local never fails");
            assert!(d.is_admitted());
            worst = worst.max(t.elapsed());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        worst
    };
    let traffic = tokio::spawn(run(s.clone(), 1_500));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut node = tokio::task::spawn_blocking(move || {
        node.kill();
        std::thread::sleep(Duration::from_millis(700));
        node.restart();
        node
    })
    .await
    .unwrap();
    let worst = traffic.await.unwrap();
    assert!(worst < timeout + Duration::from_millis(400), "a decision took {worst:?}");
    let m = client.metrics().snapshot();
    assert!(m.fallbacks > 0 && m.short_circuits > 0, "the outage was seen and the breaker opened: {m:?}");
    // Shared limiting resumes by itself: decisions reach the new Redis process.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let before = client.metrics().snapshot().fallbacks;
        let _ = s.decide(KeyHash(99), at_us(0), 1).await.unwrap();
        if client.metrics().snapshot().fallbacks == before && !node.tollgate_keys().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "never recovered: {:?}", client.metrics().snapshot());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(client.breaker_state(), BreakerState::Closed);
    client.ping().await.unwrap();
    node.kill();
}

#[tokio::test]
async fn password_and_acl_user_in_the_url() {
    let node = RedisNode::start();
    node.cli(&["CONFIG", "SET", "requirepass", "s3cret"]);
    let pw = |args: &[&str]| {
        let mut a = vec!["-a", "s3cret", "--no-auth-warning"];
        a.extend_from_slice(args);
        node.cli(&a)
    };
    pw(&["ACL", "SETUSER", "gate", "on", ">g4te", "~tollgate:*", "+@all"]);
    for url in
        [format!("redis://:s3cret@127.0.0.1:{}", node.port), format!("redis://gate:g4te@127.0.0.1:{}/0", node.port)]
    {
        let client = client_with(Topology::Single(url.clone()), |c| c.on_error = OnError::Deny);
        client.ping().await.unwrap_or_else(|e| panic!("{url}: {e}"));
        let s = store(&client, "auth", tb(60_000_000, 5), None);
        assert!(s.decide(KeyHash(1), at_us(0), 1).await.unwrap().is_admitted(), "{url}");
    }
    let wrong = client_with(Topology::Single(format!("redis://:nope@127.0.0.1:{}", node.port)), |_| {});
    assert!(wrong.ping().await.is_err());
}

mod cluster;
mod late;
mod nodelay;
mod partition;
mod proxy;

/// Issue 31's probe against the Lua scripts: a client sends until its first denial, waits
/// exactly the `Retry-After` the gate would send (plus a little latency) and is admitted; a
/// second earlier it is still refused. Arrival phases and the client's pace are pseudo-random;
/// the scripts run on the test's clock.
#[tokio::test]
async fn waiting_the_retry_after_sent_is_enough_with_redis() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |_| {});
    let sw = |w: u64, l: u64| Algorithm::SlidingWindow { window: nzs(w), limit: nz(l) };
    let probed = [
        (sw(1_000_000, 2), 1),
        (sw(2_000_000, 3), 1),
        (sw(1_000_000, 4), 3),
        (Algorithm::FixedWindow { window: nzs(1_000_000), limit: nz(2), calendar: None }, 1),
        (Algorithm::SlidingLog { window: nzs(1_000_000), limit: nz(2) }, 1),
        (tb(500_000, 2), 1),
        (Algorithm::TokenBucket { interval: nzs(500_000), burst: nz(4), warmup: Span::from_secs(3) }, 4),
        (Algorithm::LeakyBucket { interval: nzs(500_000), max_delay: Span::from_micros(1_500_000) }, 3),
    ];
    // A second boundary (and a two-second one) of the unix clock.
    let base = 1_700_000_000_000_000u64;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    for (n, (alg, cost)) in probed.into_iter().enumerate() {
        let s = store(&client, &format!("probe{n}"), alg.clone(), None);
        for trial in 0..40u64 {
            let key = KeyHash(0x9_0000 + (n as u128) * 1_000 + u128::from(trial));
            let mut now = base + trial * 10_000_000 + next(4_000_000);
            let pace = next(20_000);
            let mut secs = None;
            for _ in 0..200 {
                now += pace;
                if let Decision::Deny { retry_after, .. } = s.decide_at(key, at_us(now), cost).await.unwrap() {
                    secs = Some(tollgate::retry_after_capped(&alg, retry_after));
                    break;
                }
            }
            let secs = secs.expect("a denial within 200 requests");
            let early = s.decide_at(key, at_us(now + (secs - 1) * 1_000_000), cost).await.unwrap();
            assert!(!early.is_admitted(), "{alg:?}: admitted 1 s before Retry-After: {secs}");
            let later = now + secs * 1_000_000 + next(5_000);
            let d = s.decide_at(key, at_us(later), cost).await.unwrap();
            assert!(d.is_admitted(), "{alg:?}: refused after Retry-After: {secs} (phase {}): {d:?}", now % 2_000_000);
        }
    }
    assert_eq!(client.metrics().snapshot().fallbacks, 0);
}
