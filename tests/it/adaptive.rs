//! The adaptive concurrency limit against a real upstream with `SLOTS` workers and a queue:
//! its latency grows with the requests it holds. More clients than slots push all the time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::Response;
use tokio::sync::Semaphore;

use crate::support::{full, proxy_yaml, Tollgate, Upstream};

const SLOTS: usize = 5;
const CLIENTS: usize = 30;

/// The upstream: each request queues for one of `SLOTS` workers, then takes `service` µs.
/// Records (when it arrived, how long it took in all).
struct Slotted {
    up: Upstream,
    service_us: Arc<AtomicU64>,
    took: Arc<Mutex<Vec<(Instant, Duration)>>>,
}

async fn slotted(service: Duration) -> Slotted {
    let slots = Arc::new(Semaphore::new(SLOTS));
    let service_us = Arc::new(AtomicU64::new(service.as_micros() as u64));
    let took: Arc<Mutex<Vec<(Instant, Duration)>>> = Arc::default();
    let (s, t, sv) = (slots.clone(), took.clone(), service_us.clone());
    let up = Upstream::start(move |_req| {
        let (slots, took, service) = (s.clone(), t.clone(), sv.clone());
        async move {
            let arrived = Instant::now();
            let _slot = slots.acquire().await.unwrap();
            tokio::time::sleep(Duration::from_micros(service.load(Ordering::Relaxed))).await;
            took.lock().unwrap().push((arrived, arrived.elapsed()));
            Response::new(full("ok"))
        }
    })
    .await;
    Slotted { up, service_us, took }
}

impl Slotted {
    /// The median time in the upstream (queue + service) of requests that arrived after `since`.
    fn median_since(&self, since: Instant) -> Duration {
        let mut v: Vec<Duration> = self.took.lock().unwrap().iter().filter(|(a, _)| *a >= since).map(|x| x.1).collect();
        assert!(v.len() > 20, "only {} requests reached the upstream", v.len());
        v.sort();
        v[v.len() / 2]
    }

    fn count_since(&self, since: Instant) -> usize {
        self.took.lock().unwrap().iter().filter(|(a, _)| *a >= since).count()
    }
}

/// `tollgate_concurrency_limit{route="adaptive"}` from the admin listener.
async fn limit(admin: std::net::SocketAddr) -> usize {
    let (_, _, body) = crate::support::get(admin, "/metrics").await;
    let text = String::from_utf8_lossy(&body).into_owned();
    let line = text
        .lines()
        .find(|l| l.starts_with("tollgate_concurrency_limit{route=\"adaptive\"}"))
        .unwrap_or_else(|| panic!("{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_converges_near_the_upstream_slots_keeps_latency_and_recovers() {
    let service = Duration::from_millis(20);
    let up = slotted(service).await;
    let route = "  - name: adaptive\n    upstream: up\n    concurrency: { adaptive: { min: 2, max: 200, window: 50ms }, max_wait: 1s }\n";
    let tg = Tollgate::start(&proxy_yaml(up.up.addr, "", route)).await;
    let admin = tg.start_admin().await;
    assert_eq!(limit(admin).await, 2, "starts at min");

    let stop = Arc::new(AtomicBool::new(false));
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let url: hyper::Uri = tg.url("/").parse().unwrap();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (client, url, stop) = (client.clone(), url.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match client.get(url.clone()).await {
                    Ok(resp) if resp.status() == 200 => {
                        let _ = resp.into_body().collect().await;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        }));
    }

    // 1. Thirty clients against five slots: without a limit the upstream would hold all
    //    thirty, six deep, 120 ms each. The limit settles near the slots instead.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let settled = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let l = limit(admin).await;
    let median = up.median_since(settled);
    let rate_before = up.count_since(settled);
    eprintln!("phase 1: limit {l}, upstream median {median:?}, {rate_before} requests");
    // Near the slots: a starved test machine adds tollgate's own delays to every round trip,
    // so a little below them is allowed too; a limit at min (2) or up at 30 is not.
    assert!((SLOTS - 2..=3 * SLOTS).contains(&l), "limit {l}");
    assert!(median <= service * 5 / 2, "upstream median {median:?} with limit {l}");

    // 2. The upstream gets 4× slower: the limit falls, relearns the slower baseline at its
    //    floor and climbs back near the slots rather than staying at the floor.
    //    The limit is read all along, so a limit that never moved does not pass; it stays
    //    at the floor for five windows (`relearn`) of over 300 ms each here (eight answers,
    //    two at a time, 80 ms each), which no reading misses.
    up.service_us.store(4 * service.as_micros() as u64, Ordering::Relaxed);
    let slowed = Instant::now();
    let mut lowest = usize::MAX;
    while slowed.elapsed() < Duration::from_secs(5) {
        lowest = lowest.min(limit(admin).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let slow = limit(admin).await;
    eprintln!("phase 2: limit {l} -> lowest {lowest} -> {slow}");
    assert!(
        lowest < l && lowest <= 3,
        "after the slowdown the limit fell from {l} to {lowest} at most, not near its floor (2)"
    );
    assert!((SLOTS - 2..=3 * SLOTS).contains(&slow), "limit {slow} after the slowdown (lowest {lowest})");
    assert!(slow > lowest, "the limit stayed at {lowest} after the slowdown");

    // 3. Fast again: latency back near the unloaded value, throughput back.
    up.service_us.store(service.as_micros() as u64, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let recovered = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let l = limit(admin).await;
    let median = up.median_since(recovered);
    eprintln!("phase 3: limit {l}, upstream median {median:?}, {} requests", up.count_since(recovered));
    assert!((SLOTS - 2..=3 * SLOTS).contains(&l), "limit {l} after recovery");
    assert!(median <= service * 5 / 2, "upstream median {median:?} after recovery with limit {l}");
    assert!(up.count_since(recovered) * 2 >= rate_before, "throughput did not recover");

    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
}
