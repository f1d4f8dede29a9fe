//! The admin listener's live dashboard: `/dashboard.json` against the counters, and the page
//! itself in a real browser (headless Chromium driven over WebDriver) against a running
//! tollgate under load.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use serde_json::{json, Value};

use crate::support::browser::{driver, session, webdriver};
use crate::support::process::Process;
use crate::support::{get, Tollgate, Upstream};

/// A route whose limit refuses most of a steady client's requests.
fn limited(upstream: SocketAddr) -> String {
    format!(
        "
upstreams:
  up: {{ servers: [ {{ url: 'http://{upstream}' }} ] }}
routes:
  - name: api
    upstream: up
    limits:
      - {{ name: low, algorithm: token_bucket, rate: 20/s, burst: 5, key: route }}
"
    )
}

async fn json_at(addr: SocketAddr, path: &str) -> Value {
    let (status, headers, body) = get(addr, path).await;
    assert_eq!(status, StatusCode::OK, "{path}");
    assert_eq!(headers["content-type"], "application/json");
    serde_json::from_slice(&body).unwrap()
}

#[tokio::test]
async fn the_json_counts_what_metrics_count_and_lists_the_429s() {
    let up = Upstream::fixed("ok").await;
    let tg = Tollgate::start(&limited(up.addr)).await;
    let admin = tg.start_admin().await;
    let mut refused = Vec::new();
    for _ in 0..12 {
        let (status, headers, _) = get(tg.addr, "/").await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            refused.push(headers["x-request-id"].to_str().unwrap().to_owned());
        }
    }
    assert!(!refused.is_empty(), "a burst of 5 admits at most 5 of 12 at once");
    let d = json_at(admin, "/dashboard.json").await;
    let route = &d["routes"][0];
    assert_eq!(route["name"], "api");
    assert_eq!(route["requests_total"], 12);
    assert_eq!(route["throttled_total"], refused.len());
    assert_eq!(route["classes_total"]["4xx"], refused.len());
    assert_eq!(route["limits"], json!(["low"]));
    assert_eq!(d["latency_histogram"], "upstream");
    let listed: Vec<&str> =
        d["throttled"].as_array().unwrap().iter().map(|t| t["request_id"].as_str().unwrap()).collect();
    assert_eq!(listed.first().copied(), refused.last().map(String::as_str), "newest first: {d}");
    assert!(refused.iter().all(|id| listed.contains(&id.as_str())), "{listed:?} {refused:?}");
    let t = &d["throttled"][0];
    assert_eq!((&t["route"], &t["limit"]), (&json!("api"), &json!("low")));
    assert!(t["retry_after"].as_u64().unwrap() >= 1, "{t}");
    assert_eq!(d["upstreams"][0]["name"], "up");
    assert_eq!(d["upstreams"][0]["servers"][0]["state"], "healthy");
    assert!(d["redis"].is_null());

    // The page: whole, and allowed to reach nothing but this listener.
    let (status, headers, page) = get(admin, "/").await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/html"));
    assert!(headers["content-security-policy"].to_str().unwrap().contains("connect-src 'self'"));
    assert!(String::from_utf8_lossy(&page).contains("/dashboard.json"));
}

/// What the page shows of route `api`, read in one script run.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shown {
    polls: u64,
    requests: u64,
    throttled: u64,
}

const READ: &str = "const s = document.querySelector('[data-route=\"api\"]');
  if (!s) return null;
  return { polls: +document.body.dataset.polls, requests: +s.dataset.requestsTotal, throttled: +s.dataset.throttledTotal,
    ids: [...document.querySelectorAll('#throttled tr[data-request-id]')].map(r => r.dataset.requestId),
    limits: document.getElementById('limits-panel').dataset.state,
    keys: document.querySelectorAll('#limits table[data-limit] tbody code').length };";

async fn read(driver: SocketAddr, session: &str) -> Option<(Shown, Value)> {
    let path = format!("/session/{session}/execute/sync");
    let v = webdriver(driver, Method::POST, &path, Some(json!({ "script": READ, "args": [] }))).await;
    let n = |k: &str| v[k].as_u64();
    Some((Shown { polls: n("polls")?, requests: n("requests")?, throttled: n("throttled")? }, v))
}

/// Route `api`'s answers and 429s as `/metrics` counts them now.
async fn counted(tg: &Process) -> (u64, u64) {
    let (_, _, body) = get(tg.admin, "/metrics").await;
    let text = String::from_utf8_lossy(&body);
    let value = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64;
    let requests = text.lines().filter(|l| l.starts_with("tollgate_requests_total{route=\"api\",")).map(value).sum();
    let throttled = text
        .lines()
        .find(|l| l.starts_with("tollgate_errors_total{route=\"api\",source=\"policy\",kind=\"throttled\"}"))
        .map_or(0, value);
    (requests, throttled)
}

/// Reads the page between two scrapes of `/metrics`, waiting for two polls in between so the
/// numbers shown were computed after the first scrape: each lies between the two.
async fn bracketed(tg: &Process, driver: SocketAddr, session: &str) -> Shown {
    let before = counted(tg).await;
    let (first, _) = read(driver, session).await.expect("the route is shown");
    let deadline = Instant::now() + Duration::from_secs(30);
    let shown = loop {
        let (now, _) = read(driver, session).await.expect("the route is shown");
        if now.polls >= first.polls + 2 {
            break now;
        }
        assert!(Instant::now() < deadline, "the page stopped polling at {now:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let after = counted(tg).await;
    assert!(before.0 <= shown.requests && shown.requests <= after.0, "requests {before:?} {shown:?} {after:?}");
    assert!(before.1 <= shown.throttled && shown.throttled <= after.1, "429s {before:?} {shown:?} {after:?}");
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_in_a_browser_moves_with_the_metrics() {
    let Some((driver, chromium)) = driver().await else { return };
    let up = Upstream::fixed("ok").await;
    let tg = Process::start(&limited(up.addr)).await;

    // A client sending about 100 requests a second, most of them refused.
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(Mutex::new(HashSet::new()));
    let client = tokio::spawn({
        let (stop, refused, addr) = (stop.clone(), refused.clone(), tg.addr);
        async move {
            while !stop.load(Ordering::Relaxed) {
                let (status, headers, _) = get(addr, "/").await;
                if status == StatusCode::TOO_MANY_REQUESTS {
                    let id = headers["x-request-id"].to_str().unwrap().to_owned();
                    refused.lock().unwrap().insert(id);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });

    let session = session(driver.addr, &chromium).await;
    let url = format!("http://{}/", tg.admin);
    webdriver(driver.addr, Method::POST, &format!("/session/{session}/url"), Some(json!({ "url": url }))).await;

    // The page shows the route once its first poll is back, and 429s once some were answered.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if read(driver.addr, &session).await.is_some_and(|(s, _)| s.throttled > 0) {
            break;
        }
        assert!(Instant::now() < deadline, "the page never showed a 429 of route api");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let first = bracketed(&tg, driver.addr, &session).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = bracketed(&tg, driver.addr, &session).await;
    assert!(second.requests > first.requests && second.throttled > first.throttled, "{first:?} {second:?}");

    // The last throttled requests are the client's own 429s, by request id.
    let (_, v) = read(driver.addr, &session).await.unwrap();
    let ids: Vec<String> = serde_json::from_value(v["ids"].clone()).unwrap();
    let seen = refused.lock().unwrap().clone();
    assert!(!ids.is_empty() && ids.iter().any(|id| seen.contains(id)), "{ids:?}");
    // The limit table panel lists the throttled client's key (it refreshes every 5 s).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, v) = read(driver.addr, &session).await.unwrap();
        if v["limits"] == "ok" && v["keys"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the limit table panel never listed a throttled key: {v}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    if let Some(path) = std::env::var_os("TOLLGATE_DASHBOARD_SCREENSHOT") {
        let png = webdriver(driver.addr, Method::GET, &format!("/session/{session}/screenshot"), None).await;
        use base64::Engine;
        let png = base64::engine::general_purpose::STANDARD.decode(png.as_str().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
    webdriver(driver.addr, Method::DELETE, &format!("/session/{session}"), None).await;
    stop.store(true, Ordering::Relaxed);
    client.await.unwrap();
}
