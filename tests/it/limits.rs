//! Throttling through the proxy: 429s with honest headers, shaping, several limits,
//! concurrency caps and client identity.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Response, StatusCode};
use tollgate::limit::{ManualClock, Span, Timestamp};

use crate::support::{full, get, get_with, proxy_yaml, Tollgate, Upstream};

const T0: Timestamp = Timestamp::from_micros(1_700_000_000_000_000);

fn respond_yaml(route_extra: &str) -> String {
    format!("upstreams:\n  d: {{ respond: {{ body: ok }} }}\nroutes:\n  - name: api\n    upstream: d\n{route_extra}")
}

#[tokio::test]
async fn burst_then_429_with_retry_after_ratelimit_headers_and_problem_body() {
    let clock = ManualClock::new(T0);
    let yaml = respond_yaml(
        "    limits:\n      - { name: per-client, algorithm: token_bucket, rate: 10/s, burst: 3, key: client_ip }\n",
    );
    let tg = Tollgate::start_with_clock(&yaml, clock.clone()).await;
    for remaining in [2, 1, 0] {
        let (s, h, _) = get(tg.addr, "/").await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h["ratelimit-policy"], r#""per-client";q=3;w=1"#);
        assert_eq!(h["ratelimit"].to_str().unwrap(), format!(r#""per-client";r={remaining};t=1"#));
    }
    let (s, h, body) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["retry-after"], "1");
    assert_eq!(h["ratelimit"], r#""per-client";r=0;t=1"#);
    assert_eq!(h["content-type"], "application/problem+json");
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(doc["type"].as_str().unwrap().ends_with("quota-exceeded"), "{doc}");
    assert_eq!(doc["violated-policies"], serde_json::json!(["per-client"]));

    // One token comes back every 100 ms; waiting exactly that long is enough.
    clock.advance(Span::from_micros(100_000));
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn waiting_retry_after_is_admitted() {
    let clock = ManualClock::new(T0);
    let yaml = respond_yaml("    limits:\n      - { name: slow, algorithm: fixed_window, rate: 2/10s }\n");
    let tg = Tollgate::start_with_clock(&yaml, clock.clone()).await;
    let mut rejected = 0;
    for _ in 0..4 {
        let (s, h, _) = get(tg.addr, "/").await;
        if s == StatusCode::TOO_MANY_REQUESTS {
            rejected += 1;
            let secs: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
            assert!((1..=10).contains(&secs));
            clock.advance(Span::from_secs(secs));
            assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK, "waited Retry-After: {secs} and was still refused");
        }
    }
    assert!(rejected > 0);
}

#[tokio::test]
async fn leaky_bucket_spaces_requests_at_the_upstream() {
    let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let seen = arrivals.clone();
    let up = Upstream::start(move |_req| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(Instant::now());
            Response::new(full("ok"))
        }
    })
    .await;
    let yaml = proxy_yaml(
        up.addr,
        "",
        "  - upstream: up\n    limits:\n      - { name: smooth, algorithm: leaky_bucket, rate: 20/s, max_delay: 2s }\n",
    );
    let tg = Tollgate::start(&yaml).await;
    let addr = tg.addr;
    let clients: Vec<_> = (0..8).map(|_| tokio::spawn(async move { get(addr, "/").await.0 })).collect();
    for c in clients {
        assert_eq!(c.await.unwrap(), StatusCode::OK);
    }
    let mut times = arrivals.lock().unwrap().clone();
    times.sort();
    assert_eq!(times.len(), 8);
    // Released 50 ms apart (a timer never fires early); what happens between the release
    // and the upstream's clock read varies with the machine's load (gaps of 36 ms were seen
    // on a busy CI box), so each gap gets a generous floor and the whole spread a firm one.
    for pair in times.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap >= Duration::from_millis(25), "requests reached the upstream {gap:?} apart");
    }
    let spread = times[7] - times[0];
    assert!(spread >= Duration::from_millis(300), "8 requests at 20/s spread over only {spread:?}");
}

#[tokio::test]
async fn leaky_bucket_rejects_beyond_max_delay() {
    let clock = ManualClock::new(T0);
    let yaml = respond_yaml("    limits:\n      - { name: meter, algorithm: leaky_bucket, rate: 1/s, max_delay: 0 }\n");
    let tg = Tollgate::start_with_clock(&yaml, clock.clone()).await;
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    let (s, h, _) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["retry-after"], "1");
}

#[tokio::test]
async fn a_request_rejected_by_one_limit_costs_nothing_in_the_other() {
    let clock = ManualClock::new(T0);
    let yaml = respond_yaml(
        "    limits:
      - { name: route-wide, algorithm: token_bucket, rate: 1/h, burst: 5, key: route }
      - { name: per-user, algorithm: token_bucket, rate: 1/h, burst: 2, key: header:x-user }
",
    );
    let tg = Tollgate::start_with_clock(&yaml, clock).await;
    let user = |u: &'static str| [("x-user", u)];
    // u1: two admitted, the third refused by per-user; route-wide must not have paid for it.
    assert_eq!(get_with(tg.addr, "/", &user("u1")).await.0, StatusCode::OK);
    assert_eq!(get_with(tg.addr, "/", &user("u1")).await.0, StatusCode::OK);
    let (s, _, body) = get_with(tg.addr, "/", &user("u1")).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["violated-policies"], serde_json::json!(["per-user"]));
    // route-wide has 3 left: u2 gets two, u3 gets the last one, then route-wide refuses.
    assert_eq!(get_with(tg.addr, "/", &user("u2")).await.0, StatusCode::OK);
    assert_eq!(get_with(tg.addr, "/", &user("u2")).await.0, StatusCode::OK);
    assert_eq!(get_with(tg.addr, "/", &user("u3")).await.0, StatusCode::OK);
    let (s, _, body) = get_with(tg.addr, "/", &user("u3")).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["violated-policies"], serde_json::json!(["route-wide"]));
}

#[tokio::test]
async fn concurrency_cap_answers_503_and_frees_the_slot_when_the_body_ends() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let hold = gate.clone();
    let up = Upstream::start(move |_req| {
        let hold = hold.clone();
        async move {
            let _p = hold.acquire().await.unwrap();
            Response::new(full("done"))
        }
    })
    .await;
    let yaml = proxy_yaml(up.addr, "", "  - upstream: up\n    concurrency: 2\n");
    let tg = Tollgate::start(&yaml).await;
    let addr = tg.addr;
    let a = tokio::spawn(async move { get(addr, "/").await.0 });
    let b = tokio::spawn(async move { get(addr, "/").await.0 });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (s, h, _) = get(addr, "/").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h["retry-after"], "1");
    gate.add_permits(2);
    assert_eq!(a.await.unwrap(), StatusCode::OK);
    assert_eq!(b.await.unwrap(), StatusCode::OK);
    gate.add_permits(1);
    assert_eq!(get(addr, "/").await.0, StatusCode::OK, "slots are free again once bodies ended");
}

#[tokio::test]
async fn concurrency_cap_with_max_wait_queues_briefly() {
    let yaml =
        respond_yaml("    concurrency: { max: 1, max_wait: 5s }\n").replace("body: ok", "body: ok, latency: 200ms");
    let tg = Tollgate::start(&yaml).await;
    let addr = tg.addr;
    let a = tokio::spawn(async move { get(addr, "/").await.0 });
    let b = tokio::spawn(async move { get(addr, "/").await.0 });
    assert_eq!(a.await.unwrap(), StatusCode::OK);
    assert_eq!(b.await.unwrap(), StatusCode::OK, "the second request waits for the slot");
}

#[tokio::test]
async fn spoofed_forwarded_for_from_untrusted_peer_does_not_change_the_key() {
    let limit = "    limits:\n      - { name: ip, algorithm: token_bucket, rate: 1/h, burst: 1, key: client_ip }\n";
    let clock = ManualClock::new(T0);
    let tg = Tollgate::start_with_clock(&respond_yaml(limit), clock.clone()).await;
    assert_eq!(get_with(tg.addr, "/", &[("x-forwarded-for", "198.51.100.1")]).await.0, StatusCode::OK);
    assert_eq!(
        get_with(tg.addr, "/", &[("x-forwarded-for", "198.51.100.2")]).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "a new X-Forwarded-For from an untrusted peer must not buy a new bucket"
    );

    // Behind a trusted proxy (the loopback peer), the forwarded address is the client.
    let trusted = format!("trusted_proxies: [127.0.0.1/32]\n{}", respond_yaml(limit));
    let tg = Tollgate::start_with_clock(&trusted, clock).await;
    assert_eq!(get_with(tg.addr, "/", &[("x-forwarded-for", "198.51.100.1")]).await.0, StatusCode::OK);
    assert_eq!(get_with(tg.addr, "/", &[("x-forwarded-for", "198.51.100.2")]).await.0, StatusCode::OK);
    assert_eq!(get_with(tg.addr, "/", &[("x-forwarded-for", "198.51.100.2")]).await.0, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn shadow_mode_never_rejects_and_headers_can_be_turned_off() {
    let clock = ManualClock::new(T0);
    let yaml = respond_yaml(
        "    ratelimit_headers: false\n    limits:\n      - { name: trial, algorithm: token_bucket, rate: 1/h, burst: 1, mode: shadow }\n",
    );
    let tg = Tollgate::start_with_clock(&yaml, clock).await;
    for _ in 0..5 {
        let (s, h, _) = get(tg.addr, "/").await;
        assert_eq!(s, StatusCode::OK);
        assert!(h.get("ratelimit").is_none() && h.get("ratelimit-policy").is_none());
    }
}

#[tokio::test]
async fn retry_after_spread_sends_each_throttled_client_a_different_sufficient_wait() {
    let clock = ManualClock::new(T0);
    let yaml = respond_yaml(
        "    retry_after_spread: 3s\n    limits:\n      - { name: m, algorithm: fixed_window, rate: 1/m }\n",
    );
    let tg = Tollgate::start_with_clock(&yaml, clock.clone()).await;
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    let mut waits = Vec::new();
    for _ in 0..8 {
        let (status, headers, body) = get(tg.addr, "/").await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        let secs: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        // The problem document and the RateLimit field say the same.
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains(&format!("\"retry-after\":{secs}")), "{text}");
        assert!(headers["ratelimit"].to_str().unwrap().contains(&format!(";t={secs}")), "{headers:?}");
        waits.push(secs);
    }
    // The minute's window ends 40 s after T0 (20 s into it): never sooner, then 41 … 43 in turn.
    assert_eq!(waits, [40, 41, 42, 43, 40, 41, 42, 43]);
}

/// `tollgate_early_retries_total` of route `api`, limit `limit`, from the admin listener.
async fn early_retries(admin: std::net::SocketAddr, limit: &str) -> u64 {
    let (_, _, body) = get(admin, "/metrics").await;
    let text = String::from_utf8_lossy(&body).into_owned();
    let series = format!("tollgate_early_retries_total{{route=\"api\",limit=\"{limit}\"}} ");
    let line = text.lines().find(|l| l.starts_with(&series)).unwrap_or_else(|| panic!("no {series} in\n{text}"));
    line[series.len()..].trim().parse().unwrap()
}

fn retry_after(h: &http::HeaderMap) -> u64 {
    h["retry-after"].to_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn early_retries_are_counted_and_penalised_and_a_client_that_waits_is_not() {
    let clock = ManualClock::new(T0);
    let yaml = respond_yaml(
        "    limits:\n      - { name: b, algorithm: token_bucket, rate: 1/10s, burst: 6, key: client_ip, early_retry: { penalty: double } }\n",
    );
    let tg = Tollgate::start_with_clock(&yaml, clock.clone()).await;
    let admin = tg.start_admin().await;
    for _ in 0..6 {
        assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    }
    let (s, h, _) = get(tg.addr, "/").await;
    assert_eq!((s, retry_after(&h)), (StatusCode::TOO_MANY_REQUESTS, 10));
    assert_eq!(early_retries(admin, "b").await, 0);
    // Back after 1 s, then 2 s: refused, told twice the last wait each time.
    let mut told = Vec::new();
    for _ in 0..2 {
        clock.advance(Span::from_secs(1));
        let (s, h, _) = get(tg.addr, "/").await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
        told.push(retry_after(&h));
    }
    assert_eq!(told, [20, 40]);
    assert_eq!(early_retries(admin, "b").await, 2);
    // Waiting what it was told: admitted, and no early retry.
    clock.advance(Span::from_secs(40));
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    assert_eq!(early_retries(admin, "b").await, 2);
}
