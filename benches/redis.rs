//! Decisions per second through the Redis store from one process (many decisions in flight on
//! the one multiplexed connection), beside `redis-benchmark` running the same EVALSHA (the
//! ceiling), and with a lease. Starts its own redis-server on a free loopback port.
//!
//! Run: `cargo bench --bench redis` (optional: `BENCH_SECS=5 BENCH_INFLIGHT=256`).

#[allow(dead_code)]
#[path = "../tests/support/redis.rs"]
mod support;

use std::num::NonZeroU64;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::limit::{
    Algorithm, KeyHash, LocalStore, NonZeroSpan, RedisClient, RedisConfig, RedisStore, Span, Timestamp,
};

const KEYS: u64 = 100_000;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A bucket that never runs dry during the run, so every decision writes (the expensive path).
fn alg() -> Algorithm {
    let nz = |n| NonZeroU64::new(n).unwrap_or(NonZeroU64::MIN);
    let interval = NonZeroSpan::from_micros(1_000).unwrap_or(NonZeroSpan::MIN);
    Algorithm::TokenBucket { interval, burst: nz(1_000_000_000), warmup: Span::ZERO }
}

/// `inflight` tasks deciding back to back for `secs`; returns decisions per second.
async fn run(store: Arc<RedisStore>, inflight: u64, secs: u64, spread: bool) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let tasks: Vec<_> = (0..inflight)
        .map(|t| {
            let (store, done) = (store.clone(), done.clone());
            tokio::spawn(async move {
                let mut i = t.wrapping_mul(7_919);
                while Instant::now() < stop {
                    let key = if spread {
                        KeyHash(u128::from(i % KEYS) << 64 | u128::from(i % KEYS))
                    } else {
                        KeyHash(t.into())
                    };
                    if store.decide(key, Timestamp::ZERO, 1).await.is_err() {
                        return;
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    i = i.wrapping_add(1);
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// `redis-benchmark` on the same script and arguments; requests per second.
fn ceiling(port: u16, sha: &str, clients: u64, pipeline: u64, n: u64) -> (f64, String) {
    let args: Vec<String> = [
        "-p",
        &port.to_string(),
        "-c",
        &clients.to_string(),
        "-P",
        &pipeline.to_string(),
        "-n",
        &n.to_string(),
        "-r",
        &KEYS.to_string(),
        "-q",
        "EVALSHA",
        sha,
        "1",
        "tollgate:{bench:__rand_int__}",
        "d",
        "1",
        "1000",
        "1000000000",
        "0",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cmd = format!("redis-benchmark {}", args.join(" "));
    let out =
        Command::new("redis-benchmark").args(&args).output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let text = out.unwrap_or_default();
    // "EVALSHA ...: 123456.78 requests per second, p50=..." (the last \r-separated progress line).
    let rps = text
        .rsplit(['\r', '\n'])
        .find_map(|l| l.split(": ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok()))
        .unwrap_or(0.0);
    (rps, cmd)
}

fn main() {
    let secs = env("BENCH_SECS", 3);
    let inflight = env("BENCH_INFLIGHT", 256);
    let node = support::RedisNode::start();
    // One worker: the other core is Redis' (the machine has two).
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build();
    let Ok(rt) = rt else {
        eprintln!("no runtime");
        return;
    };
    let mut cfg = RedisConfig::new(tollgate::limit::store::redis::Topology::Single(node.url()));
    cfg.timeout = Duration::from_secs(2);
    cfg.on_error = tollgate::limit::store::redis::OnError::Deny;
    let Ok(client) = RedisClient::new(cfg) else {
        eprintln!("bad config");
        return;
    };
    let store = |lease: Option<u64>| {
        Arc::new(RedisStore::new(
            client.clone(),
            "bench",
            alg(),
            lease.and_then(NonZeroU64::new),
            LocalStore::new(alg(), 16),
        ))
    };
    let plain = store(None);
    let sha = plain.script_sha().to_owned();
    rt.block_on(async {
        if let Err(e) = client.connect().await {
            eprintln!("connect: {e}");
            return;
        }
        // Warm up (loads the script).
        run(plain.clone(), 16, 1, true).await;
        let store_rps = run(plain.clone(), inflight, secs, true).await;
        println!("redis store, {inflight} in flight, 1 connection: {store_rps:>10.0} decisions/s");
        for (clients, pipeline) in [(50, 1), (inflight.min(50), 16)] {
            let (rps, cmd) = ceiling(node.port, &sha, clients, pipeline, (store_rps as u64).max(50_000) * secs);
            println!(
                "redis-benchmark -c {clients} -P {pipeline}:      {rps:>10.0} EVALSHA/s  ratio store/ceiling {:.2}",
                store_rps / rps.max(1.0)
            );
            println!("    {cmd}");
        }
        let leased = store(Some(20));
        let before = client.metrics().snapshot();
        // Hot keys (one per task): a lease serves a key's next 19 decisions locally.
        let lease_rps = run(leased, inflight, secs, false).await;
        let after = client.metrics().snapshot();
        let decisions = lease_rps * secs as f64;
        let calls = after.calls - before.calls;
        println!(
            "redis store with lease 20:  {lease_rps:>10.0} decisions/s, {calls} Redis calls, {:.3} calls per decision",
            calls as f64 / decisions.max(1.0)
        );
    });
}
