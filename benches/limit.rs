//! One rate-limit decision per iteration, per algorithm: a hot key and 1M live keys, on 1 and 2
//! threads, with `governor`'s keyed limiter beside the token bucket as the reference. Every
//! decision reads the system clock, as the proxy does (governor reads its own quanta clock).
//!
//! Before the benches it prints the RSS of a store holding 1M live token-bucket keys
//! (`TOLLGATE_RSS=governor` measures governor's keyed limiter instead, `skip` skips it).
//!
//! Run: `cargo bench --bench limit` (filter e.g. `-- token_bucket`).

use std::hint::black_box;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tollgate::limit::{Algorithm, Clock, KeyHash, KeySpec, LocalStore, NonZeroSpan, Span, SystemClock};
use tollgate::KeyCtx;

const MANY: usize = 1_000_000;

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).expect("non-zero")
}

fn us(n: u64) -> NonZeroSpan {
    NonZeroSpan::from_micros(n).expect("non-zero")
}

fn nz32(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// Uniform 128-bit keys, as KeySpec::hash produces.
fn keys(n: usize) -> Vec<KeyHash> {
    (0..n as u64).map(|i| KeyHash(xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes()))).collect()
}

/// Parameters for a hot key: saturated, so most decisions deny (the expensive-to-get-wrong path).
fn hot_algorithms() -> Vec<(&'static str, Algorithm)> {
    let (sec, limit) = (1_000_000, nz(1_000));
    vec![
        ("token_bucket", Algorithm::TokenBucket { interval: us(1_000), burst: nz(100), warmup: Span::ZERO }),
        ("leaky_bucket", Algorithm::LeakyBucket { interval: us(1_000), max_delay: Span::from_micros(100_000) }),
        ("fixed_window", Algorithm::FixedWindow { window: us(sec), limit, calendar: None }),
        ("sliding_window", Algorithm::SlidingWindow { window: us(sec), limit }),
        ("sliding_log", Algorithm::SlidingLog { window: us(sec), limit: nz(100) }),
    ]
}

/// Parameters for 1M keys: slow enough that every key stays live (never back to initial)
/// during the run, and large enough that each key's few visits are admitted.
fn many_algorithms() -> Vec<(&'static str, Algorithm)> {
    let (min, limit) = (60_000_000, nz(1_000));
    vec![
        ("token_bucket", Algorithm::TokenBucket { interval: us(min), burst: limit, warmup: Span::ZERO }),
        ("leaky_bucket", Algorithm::LeakyBucket { interval: us(1_000), max_delay: Span::from_micros(10_000_000) }),
        ("fixed_window", Algorithm::FixedWindow { window: us(10 * min), limit, calendar: None }),
        ("sliding_window", Algorithm::SlidingWindow { window: us(10 * min), limit }),
        ("sliding_log", Algorithm::SlidingLog { window: us(10 * min), limit }),
    ]
}

/// Runs `iters` decisions split over `threads` threads; returns the wall time.
fn on_threads(threads: usize, iters: u64, f: impl Fn(usize, u64) + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let f = &f;
            s.spawn(move || f(t, iters / threads as u64));
        }
    });
    start.elapsed()
}

fn bench_hot(c: &mut Criterion) {
    for threads in [1, 2] {
        let mut g = c.benchmark_group(format!("hot_key/{threads}_thread"));
        for (name, alg) in hot_algorithms() {
            let store = LocalStore::new(alg, 1_000);
            let key = keys(1)[0];
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter_custom(|iters| {
                    on_threads(threads, iters, |_, n| {
                        for _ in 0..n {
                            black_box(store.decide(key, SystemClock.now(), 1));
                        }
                    })
                })
            });
        }
        let gov: DefaultKeyedRateLimiter<u128> =
            RateLimiter::keyed(Quota::per_second(nz32(1_000)).allow_burst(nz32(100)));
        g.bench_function(BenchmarkId::from_parameter("governor_token_bucket"), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, |_, n| {
                    for _ in 0..n {
                        let _ = black_box(gov.check_key(&7));
                    }
                })
            })
        });
        g.finish();
    }
}

fn bench_many(c: &mut Criterion) {
    let keys = keys(MANY);
    for (name, alg) in many_algorithms() {
        let store = LocalStore::new(alg, 2 * MANY);
        for k in &keys {
            store.decide(*k, SystemClock.now(), 1);
        }
        assert_eq!(store.len(), MANY, "{name}: all keys live");
        for threads in [1, 2] {
            let mut g = c.benchmark_group(format!("1M_keys/{threads}_thread"));
            // Each thread walks its own half of the keys, so they never share a key.
            let cursor: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter_custom(|iters| {
                    on_threads(threads, iters, |t, n| {
                        let half = MANY / threads;
                        let mut i = cursor[t].load(Ordering::Relaxed);
                        for _ in 0..n {
                            i = (i + 1) % half;
                            black_box(store.decide(keys[t * half + i], SystemClock.now(), 1));
                        }
                        cursor[t].store(i, Ordering::Relaxed);
                    })
                })
            });
            g.finish();
        }
    }
    let gov: DefaultKeyedRateLimiter<u128> = RateLimiter::keyed(
        Quota::with_period(Duration::from_secs(60)).expect("non-zero period").allow_burst(nz32(1_000)),
    );
    for k in &keys {
        let _ = gov.check_key(&k.0);
    }
    for threads in [1, 2] {
        let mut g = c.benchmark_group(format!("1M_keys/{threads}_thread"));
        let cursor: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
        g.bench_function(BenchmarkId::from_parameter("governor_token_bucket"), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, |t, n| {
                    let half = MANY / threads;
                    let mut i = cursor[t].load(Ordering::Relaxed);
                    for _ in 0..n {
                        i = (i + 1) % half;
                        let _ = black_box(gov.check_key(&keys[t * half + i].0));
                    }
                    cursor[t].store(i, Ordering::Relaxed);
                })
            })
        });
        g.finish();
    }
}

/// What a decision costs besides the map: the clock read and the key digest.
fn bench_parts(c: &mut Criterion) {
    let mut g = c.benchmark_group("parts");
    g.bench_function("system_clock_now", |b| b.iter(|| black_box(SystemClock.now())));
    let req = http::Request::builder()
        .uri("/api/v1/items?user=alice")
        .header("x-api-key", "0123456789abcdef0123456789abcdef")
        .body(())
        .expect("request")
        .into_parts()
        .0;
    let ctx = KeyCtx {
        route: "api",
        client_ip: "203.0.113.9".parse().expect("ip"),
        path: req.uri.path(),
        parts: &req,
        tls_client: None,
        known: None,
    };
    for spec in ["client_ip", "route, client_ip, header:x-api-key"] {
        let spec_v = KeySpec::parse(spec).expect("spec");
        g.bench_function(BenchmarkId::new("key_hash", spec), |b| b.iter(|| black_box(black_box(&ctx).key(&spec_v))));
    }
    g.finish();
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// RSS growth for 1M live token-bucket keys (measured first, in a fresh process).
fn report_rss() {
    let which = std::env::var("TOLLGATE_RSS").unwrap_or_default();
    if which == "skip" {
        return;
    }
    let keys = keys(MANY);
    let before = rss_kib();
    let now = SystemClock.now();
    if which == "governor" {
        let gov: DefaultKeyedRateLimiter<u128> = RateLimiter::keyed(Quota::per_minute(nz32(1)).allow_burst(nz32(10)));
        for k in &keys {
            let _ = gov.check_key(&k.0);
        }
        print_rss("governor keyed", gov.len(), before, rss_kib());
    } else {
        let store = LocalStore::new(many_algorithms()[0].1.clone(), 2 * MANY);
        for k in &keys {
            store.decide(*k, now, 1);
        }
        assert_eq!(store.len(), MANY);
        print_rss("tollgate LocalStore token bucket", store.len(), before, rss_kib());
    }
}

fn print_rss(what: &str, live: usize, before: u64, after: u64) {
    let grown = after.saturating_sub(before);
    println!(
        "RSS {what}: {live} live keys: {before} KiB -> {after} KiB (+{:.1} MiB, {} B/key)",
        grown as f64 / 1024.0,
        grown * 1024 / live.max(1) as u64
    );
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args()
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_hot, bench_many, bench_parts
}

fn main() {
    report_rss();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
