//! Upstream groups (`servers:`): balancing, ejection and health checks, retries under a
//! budget — real hyper servers on loopback, one of them killed and restarted.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::{full, get, BoxBody, Tollgate, Upstream};

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, BoxBody>;

fn client() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A server answering its own `id` and counting what it got.
async fn counting(id: &'static str, hits: Arc<AtomicUsize>) -> Upstream {
    counting_on("127.0.0.1:0".parse().unwrap(), id, hits).await
}

async fn counting_on(addr: SocketAddr, id: &'static str, hits: Arc<AtomicUsize>) -> Upstream {
    Upstream::start_on(addr, move |req| {
        // Health checks are not counted: only the requests the group balanced.
        if req.uri().path() != "/health" {
            hits.fetch_add(1, Ordering::Relaxed);
        }
        async move { Response::new(full(id)) }
    })
    .await
}

async fn send(
    c: &Http,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &'static str,
) -> (StatusCode, http::HeaderMap, String) {
    let mut req = Request::builder().method(method).uri(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let resp = c.request(req.body(full(body)).unwrap()).await.expect("tollgate answers");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    (parts.status, parts.headers, String::from_utf8_lossy(&body).into_owned())
}

fn group_yaml(servers: &[SocketAddr], extra: &str) -> String {
    let list: String = servers.iter().map(|a| format!("      - url: http://{a}\n")).collect();
    format!("upstreams:\n  app:\n    servers:\n{list}{extra}routes:\n  - name: app\n    upstream: app\n")
}

/// A port nothing listens on.
async fn dead_port() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

async fn config_json(admin: SocketAddr) -> serde_json::Value {
    let (s, _, body) = get(admin, "/config").await;
    assert_eq!(s, StatusCode::OK);
    serde_json::from_slice(&body).unwrap()
}

fn states(doc: &serde_json::Value) -> Vec<String> {
    doc["upstreams"]["app"]["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["state"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_is_ejected_and_rejoins_after_its_checks_pass() {
    let hits: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
    let a = counting("a", hits[0].clone()).await;
    let b = counting("b", hits[1].clone()).await;
    let c = counting("c", hits[2].clone()).await;
    let b_addr = b.addr;
    let yaml = group_yaml(
        &[a.addr, b.addr, c.addr],
        "    balance: round_robin
    retry: { attempts: 3, on: [connect_failure, reset_before_response] }
    outlier: { consecutive_failures: 3, base_ejection_time: 1m }
    health: { path: /health, interval: 100ms, timeout: 1s, healthy: 1, unhealthy: 2 }
",
    );
    let tg = Tollgate::start(&yaml).await;
    let admin = tg.start_admin().await;
    let http = client();
    let url = tg.url("/x");
    for _ in 0..60 {
        assert_eq!(send(&http, "GET", &url, &[], "").await.0, StatusCode::OK);
    }
    let before: Vec<usize> = hits.iter().map(|h| h.load(Ordering::Relaxed)).collect();
    assert!(before.iter().all(|&n| n >= 15), "round robin spreads: {before:?}");

    drop(b);
    // Nothing was in flight on it: not one request may fail.
    for i in 0..90 {
        let (s, _, body) = send(&http, "GET", &url, &[], "").await;
        assert_eq!(s, StatusCode::OK, "request {i} after the kill: {body}");
        assert!(body == "a" || body == "c", "{body}");
    }
    let doc = config_json(admin).await;
    assert_ne!(states(&doc)[1], "healthy", "{doc}");
    assert_eq!(get(admin, "/readyz").await.0, StatusCode::OK, "two servers still serve");

    // Back on the same port: its checks pass, it rejoins before its ejection would end.
    let b_hits = hits[1].clone();
    let _b = counting_on(b_addr, "b", b_hits.clone()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while states(&config_json(admin).await)[1] != "healthy" {
        assert!(Instant::now() < deadline, "b never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = hits[1].load(Ordering::Relaxed);
    for _ in 0..60 {
        assert_eq!(send(&http, "GET", &url, &[], "").await.0, StatusCode::OK);
    }
    let served = hits[1].load(Ordering::Relaxed) - seen;
    assert!(served >= 10, "b takes its share again: {served} of 60");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_never_amplify_past_the_budget() {
    // Two servers, each failing every other request with 502.
    let total = Arc::new(AtomicUsize::new(0));
    let mut servers = Vec::new();
    for _ in 0..2 {
        let (total, own) = (total.clone(), Arc::new(AtomicUsize::new(0)));
        servers.push(
            Upstream::start(move |_req| {
                total.fetch_add(1, Ordering::Relaxed);
                let n = own.fetch_add(1, Ordering::Relaxed);
                async move {
                    let mut r = Response::new(full("x"));
                    if n % 2 == 0 {
                        *r.status_mut() = StatusCode::BAD_GATEWAY;
                    }
                    r
                }
            })
            .await,
        );
    }
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
    let yaml = group_yaml(
        &addrs,
        "    retry: { attempts: 3, on: [502], budget: { ratio: 0.2, min_per_s: 3 } }
    outlier: { consecutive_failures: 0 }
",
    );
    let tg = Tollgate::start(&yaml).await;
    let http = client();
    let url = tg.url("/x");
    let requests = 4000;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (http, url) = (http.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..requests / 8 {
                send(&http, "GET", &url, &[], "").await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let secs = started.elapsed().as_secs() + 1;
    let upstream = total.load(Ordering::Relaxed);
    // The budget: 20 % of the requests, plus 3/s (tower's reserve: 3 × its 10 s window),
    // plus what the 8 clients can take at once: tower's budget reads its balance and takes
    // from it in two steps, so requests in flight together may each take the last retry (seen
    // 7 over the bound on a loaded machine).
    let bound = requests + requests / 5 + 3 * (secs as usize + 10) + 2 * 8;
    assert!(upstream <= bound, "{upstream} tries for {requests} requests in {secs} s (bound {bound})");
    // Retries happened: without the budget, half the requests would be tried again.
    assert!(upstream > requests + requests / 10, "{upstream} tries: retries never ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_sends_less_to_a_slow_server() {
    let hits: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
    let fast1 = counting("f1", hits[0].clone()).await;
    let fast2 = counting("f2", hits[1].clone()).await;
    let slow_hits = hits[2].clone();
    let slow = Upstream::start(move |_req| {
        slow_hits.fetch_add(1, Ordering::Relaxed);
        async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Response::new(full("slow"))
        }
    })
    .await;
    let tg = Tollgate::start(&group_yaml(&[fast1.addr, fast2.addr, slow.addr], "    balance: least_request\n")).await;
    let http = client();
    let url = tg.url("/x");
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let (http, url) = (http.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..50 {
                assert_eq!(send(&http, "GET", &url, &[], "").await.0, StatusCode::OK);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let n: Vec<usize> = hits.iter().map(|h| h.load(Ordering::Relaxed)).collect();
    assert_eq!(n.iter().sum::<usize>(), 300);
    assert!(n[2] * 3 < n[0].min(n[1]), "the slow server got {} against {} and {}", n[2], n[0], n[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_keeps_each_key_on_one_server() {
    let hits: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
    let a = counting("a", hits[0].clone()).await;
    let b = counting("b", hits[1].clone()).await;
    let c = counting("c", hits[2].clone()).await;
    let tg = Tollgate::start(&group_yaml(&[a.addr, b.addr, c.addr], "    balance: { hash: header:x-session }\n")).await;
    let http = client();
    let url = tg.url("/x");
    let mut owners = std::collections::HashSet::new();
    for s in 0..30 {
        let session = format!("session-{s}");
        let (_, _, first) = send(&http, "GET", &url, &[("x-session", &session)], "").await;
        for _ in 0..4 {
            let (_, _, again) = send(&http, "GET", &url, &[("x-session", &session)], "").await;
            assert_eq!(again, first, "{session} moved");
        }
        owners.insert(first);
    }
    assert_eq!(owners.len(), 3, "30 keys spread over all three servers: {owners:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_that_reached_the_upstream_is_never_retried() {
    let hits: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::default()).collect();
    let mut servers = Vec::new();
    for h in &hits {
        let h = h.clone();
        servers.push(
            Upstream::start(move |req| {
                h.fetch_add(1, Ordering::Relaxed);
                async move {
                    let _ = req.into_body().collect().await;
                    let mut r = Response::new(full("bad"));
                    *r.status_mut() = StatusCode::BAD_GATEWAY;
                    r
                }
            })
            .await,
        );
    }
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
    let tg = Tollgate::start(&group_yaml(
        &addrs,
        "    retry: { attempts: 2, on: [connect_failure, reset_before_response, 502, 503, 504], budget: { min_per_s: 100 } }
    outlier: { consecutive_failures: 0 }
",
    ))
    .await;
    let http = client();
    let url = tg.url("/x");
    let count = || hits.iter().map(|h| h.load(Ordering::Relaxed)).sum::<usize>();
    let (s, _, _) = send(&http, "POST", &url, &[], "order=1").await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert_eq!(count(), 1, "the POST went upstream once");
    let (s, _, _) = send(&http, "POST", &url, &[], "").await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert_eq!(count(), 2, "a POST without a body is not retried either");
    // The same failure on a GET is retried on the other server.
    let (s, _, _) = send(&http, "GET", &url, &[], "").await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert_eq!(count(), 4, "the GET was tried on both servers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_503_with_retry_after_goes_to_the_client_at_once() {
    let hits = Arc::new(AtomicUsize::new(0));
    let mut servers = Vec::new();
    for _ in 0..2 {
        let h = hits.clone();
        servers.push(
            Upstream::start(move |_req| {
                h.fetch_add(1, Ordering::Relaxed);
                async move {
                    let mut r = Response::new(full("busy"));
                    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    r.headers_mut().insert("retry-after", "7".parse().unwrap());
                    r
                }
            })
            .await,
        );
    }
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
    let tg = Tollgate::start(&group_yaml(
        &addrs,
        "    retry: { attempts: 2, on: [503], budget: { min_per_s: 100 } }\n    outlier: { consecutive_failures: 0 }\n",
    ))
    .await;
    let (s, h, body) = send(&client(), "GET", &tg.url("/x"), &[], "").await;
    assert_eq!((s, body.as_str()), (StatusCode::SERVICE_UNAVAILABLE, "busy"));
    assert_eq!(h["retry-after"], "7");
    assert_eq!(hits.load(Ordering::Relaxed), 1, "not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_server_ejected_answers_503_with_retry_after_until_readmission() {
    // Two servers that are not there; passive ejection may take out the whole group here.
    let (x, y) = (dead_port().await, dead_port().await);
    let tg = Tollgate::start(&group_yaml(
        &[x, y],
        "    retry: { attempts: 1 }
    outlier: { consecutive_failures: 1, base_ejection_time: 20s, max_ejected_percent: 100 }
",
    ))
    .await;
    let admin = tg.start_admin().await;
    let http = client();
    let url = tg.url("/x");
    for _ in 0..20 {
        let (s, ..) = send(&http, "GET", &url, &[], "").await;
        if s == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert_eq!(s, StatusCode::BAD_GATEWAY, "a connect failure before both are ejected");
    }
    let (s, h, body) = send(&http, "GET", &url, &[], "").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(h["content-type"], "application/problem+json");
    assert!(body.contains("upstream-unavailable"), "{body}");
    let secs: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((15..=20).contains(&secs), "Retry-After {secs} s: no shorter than the re-admission, 20 s away");
    let (s, h, body) = get(admin, "/readyz").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h["content-type"], "application/problem+json");
    assert!(String::from_utf8_lossy(&body).contains("app"), "{body:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_health_checks_take_the_whole_group_out() {
    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let h = healthy.clone();
    let server = Upstream::start(move |req| {
        let ok = req.uri().path() != "/health" || h.load(Ordering::Relaxed);
        async move {
            let mut r = Response::new(full("ok"));
            if !ok {
                *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            }
            r
        }
    })
    .await;
    let tg = Tollgate::start(&group_yaml(
        &[server.addr],
        "    health: { path: /health, interval: 50ms, timeout: 1s, healthy: 1, unhealthy: 1, expect: 200-299 }\n",
    ))
    .await;
    let admin = tg.start_admin().await;
    let http = client();
    let url = tg.url("/x");
    assert_eq!(send(&http, "GET", &url, &[], "").await.0, StatusCode::OK);
    healthy.store(false, Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(admin, "/readyz").await.0 == StatusCode::OK {
        assert!(Instant::now() < deadline, "never marked down");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (s, h, _) = send(&http, "GET", &url, &[], "").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(h.contains_key("retry-after"));
    healthy.store(true, Ordering::Relaxed);
    while get(admin, "/readyz").await.0 != StatusCode::OK {
        assert!(Instant::now() < deadline, "never back up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(send(&http, "GET", &url, &[], "").await.0, StatusCode::OK);
    let (_, _, m) = get(admin, "/metrics").await;
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("tollgate_upstream_server_requests_total{upstream=\"app\""), "{m}");
    assert!(m.contains("tollgate_upstream_server_healthy{upstream=\"app\""), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_ejection_never_takes_out_more_than_its_share() {
    // Three servers that are all gone: at the default 50 %, only one may be ejected.
    let servers = [dead_port().await, dead_port().await, dead_port().await];
    let tg = Tollgate::start(&group_yaml(
        &servers,
        "    retry: { attempts: 1 }\n    outlier: { consecutive_failures: 1, base_ejection_time: 1m }\n",
    ))
    .await;
    let admin = tg.start_admin().await;
    let http = client();
    for _ in 0..30 {
        let (s, ..) = send(&http, "GET", &tg.url("/x"), &[], "").await;
        assert_eq!(s, StatusCode::BAD_GATEWAY, "the group is never emptied by ejection alone");
    }
    let st = states(&config_json(admin).await);
    assert_eq!(st.iter().filter(|s| *s == "ejected").count(), 1, "{st:?}");
}

/// An h2c (HTTP/2 prior knowledge) server answering `id`, counting the requests it got.
/// Stops when the returned handle is aborted (its connections with it).
async fn h2c(id: &'static str, hits: Arc<AtomicUsize>) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let hits = hits.clone();
            conns.spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    if req.uri().path() != "/health" {
                        hits.fetch_add(1, Ordering::Relaxed);
                    }
                    async move { Ok::<_, std::convert::Infallible>(Response::new(full(id))) }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_group_balances_and_checks_its_servers_over_http2() {
    let hits: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::default()).collect();
    let (a, ta) = h2c("a", hits[0].clone()).await;
    let (b, tb) = h2c("b", hits[1].clone()).await;
    let tg = Tollgate::start(&group_yaml(
        &[a, b],
        "    protocol: h2c\n    balance: round_robin\n    health: { path: /health, interval: 50ms, timeout: 2s, healthy: 1, unhealthy: 1 }\n",
    ))
    .await;
    let admin = tg.start_admin().await;
    let http = client();
    for _ in 0..10 {
        assert_eq!(send(&http, "GET", &tg.url("/x"), &[], "").await.0, StatusCode::OK);
    }
    assert_eq!((hits[0].load(Ordering::Relaxed), hits[1].load(Ordering::Relaxed)), (5, 5));
    // Its checks (HTTP/2 streams) fail once the server is gone: the group serves from the other.
    tb.abort();
    let deadline = Instant::now() + Duration::from_secs(10);
    while states(&config_json(admin).await)[1] != "unhealthy" {
        assert!(Instant::now() < deadline, "b never marked down");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..10 {
        let (s, _, body) = send(&http, "GET", &tg.url("/x"), &[], "").await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, "a"));
    }
    ta.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_group_retries_a_connect_failure_on_another_server() {
    let hits = Arc::new(AtomicUsize::new(0));
    let (a, ta) = h2c("a", hits.clone()).await;
    let dead = dead_port().await;
    let tg = Tollgate::start(&group_yaml(
        &[dead, a],
        "    protocol: h2c
    balance: round_robin
    retry: { budget: { min_per_s: 100 } }
    outlier: { consecutive_failures: 0 }
",
    ))
    .await;
    let http = client();
    for i in 0..10 {
        let (s, _, body) = send(&http, "POST", &tg.url("/x"), &[], "payload").await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, "a"), "request {i}");
    }
    assert_eq!(hits.load(Ordering::Relaxed), 10);
    ta.abort();
}

/// An h2c server (the `h2` crate's) that refuses every stream unprocessed (`REFUSED_STREAM`),
/// counting them.
async fn refusing(refused: Arc<AtomicUsize>) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let refused = refused.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else { return };
                while let Some(Ok((_, mut respond))) = conn.accept().await {
                    refused.fetch_add(1, Ordering::Relaxed);
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                }
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_group_sends_a_refused_stream_again_on_another_server() {
    let (hits, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (a, ta) = h2c("a", hits.clone()).await;
    let (r, tr) = refusing(refused.clone()).await;
    let tg = Tollgate::start(&group_yaml(
        &[r, a],
        "    protocol: h2c
    balance: round_robin
    retry: { budget: { min_per_s: 100 } }
    outlier: { consecutive_failures: 0 }
",
    ))
    .await;
    let http = client();
    for i in 0..10 {
        let (s, _, body) = send(&http, "GET", &tg.url("/x"), &[], "").await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, "a"), "request {i}");
    }
    assert_eq!(hits.load(Ordering::Relaxed), 10);
    assert!(refused.load(Ordering::Relaxed) >= 1, "the refusing server was tried");
    ta.abort();
    tr.abort();
}
