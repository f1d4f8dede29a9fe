//! Degraded reads: the last good GET answer served when throttled or when the upstream fails.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tollgate::limit::{ManualClock, Span, Timestamp};

use crate::support::{full, get, get_with, h1, proxy_yaml, Tollgate, Upstream};

const T0: Timestamp = Timestamp::from_micros(1_700_000_000_000_000);
const SEC: Span = Span::from_secs(1);

/// One request per hour per route, then stale copies up to 5 minutes old.
fn throttled_route(upstream: std::net::SocketAddr, extra: &str) -> String {
    proxy_yaml(
        upstream,
        "",
        &format!(
            "  - name: read
    upstream: up
    limits:
      - {{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 1, key: path }}
    on_limit: {{ stale: {{ max_age: 5m }} }}
{extra}"
        ),
    )
}

/// An upstream answering with the path as body and the given extra header.
async fn upstream_with(header: Option<(&'static str, &'static str)>) -> Upstream {
    Upstream::start(move |req| async move {
        let mut resp = Response::builder().header("cache-control", "max-age=60");
        if let Some((n, v)) = header {
            resp = resp.header(n, v);
        }
        resp.body(full(format!("copy of {}", req.uri().path()))).unwrap()
    })
    .await
}

#[tokio::test]
async fn throttled_get_gets_the_stale_copy_with_age_and_cache_status() {
    let up = upstream_with(None).await;
    let clock = ManualClock::new(T0);
    let tg = Tollgate::start_with_clock(&throttled_route(up.addr, ""), clock.clone()).await;
    let (s, _, b) = get(tg.addr, "/a").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"copy of /a"[..]));

    clock.advance(SEC * 120);
    let (s, h, b) = get(tg.addr, "/a").await;
    assert_eq!(s, StatusCode::OK, "served stale instead of 429");
    assert_eq!(&b[..], b"copy of /a");
    assert_eq!(h["age"], "120");
    assert_eq!(h["cache-status"], "tollgate; hit; ttl=-60; detail=throttled");
    assert!(h.get("ratelimit").is_none(), "admitted-request RateLimit headers are not replayed");

    // Older than max_age: the normal 429.
    clock.advance(SEC * 300);
    let (s, h, _) = get(tg.addr, "/a").await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert!(h.contains_key("retry-after"));

    // Another path was never stored: 429 straight away once throttled.
    assert_eq!(get(tg.addr, "/b").await.0, StatusCode::OK);
    assert_eq!(get(tg.addr, "/b").await.0, StatusCode::OK, "stale copy of /b");
    assert_eq!(get(tg.addr, "/c").await.0, StatusCode::OK);
}

#[tokio::test]
async fn head_is_served_from_the_get_copy() {
    let up = upstream_with(None).await;
    let clock = ManualClock::new(T0);
    let tg = Tollgate::start_with_clock(&throttled_route(up.addr, ""), clock.clone()).await;
    assert_eq!(get(tg.addr, "/h").await.0, StatusCode::OK);
    let mut send = h1(tg.addr).await;
    let resp =
        send.send_request(Request::head("/h").header("host", "localhost").body(full("")).unwrap()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["cache-status"].to_str().unwrap().contains("detail=throttled"));
    assert!(resp.into_body().collect().await.unwrap().to_bytes().is_empty());
}

#[tokio::test]
async fn post_is_never_served_stale() {
    let up = upstream_with(None).await;
    let tg = Tollgate::start_with_clock(&throttled_route(up.addr, ""), ManualClock::new(T0)).await;
    let mut send = h1(tg.addr).await;
    for expected in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let req = Request::post("/p").header("host", "x").body(full("x")).unwrap();
        assert_eq!(send.send_request(req).await.unwrap().status(), expected);
    }
}

#[tokio::test]
async fn responses_that_forbid_storing_are_not_served_stale() {
    for header in [("cache-control", "no-store"), ("cache-control", "private"), ("set-cookie", "id=1")] {
        let up = upstream_with(Some(header)).await;
        let tg = Tollgate::start_with_clock(&throttled_route(up.addr, ""), ManualClock::new(T0)).await;
        assert_eq!(get(tg.addr, "/x").await.0, StatusCode::OK);
        assert_eq!(get(tg.addr, "/x").await.0, StatusCode::TOO_MANY_REQUESTS, "{header:?} must not be stored");
    }
}

#[tokio::test]
async fn requests_with_credentials_are_not_stored() {
    let up = upstream_with(None).await;
    let tg = Tollgate::start_with_clock(&throttled_route(up.addr, ""), ManualClock::new(T0)).await;
    let auth = [("authorization", "Bearer secret")];
    assert_eq!(get_with(tg.addr, "/me", &auth).await.0, StatusCode::OK);
    assert_eq!(get_with(tg.addr, "/me", &auth).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(get(tg.addr, "/me").await.0, StatusCode::TOO_MANY_REQUESTS, "nor served to anyone else");
}

#[tokio::test]
async fn vary_separates_variants() {
    let up = Upstream::start(|req| async move {
        let lang = req.headers().get("accept-language").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
        Response::builder().header("vary", "accept-language").body(full(format!("hello in {lang}"))).unwrap()
    })
    .await;
    // Key on the language so each variant gets its one admitted request.
    let yaml = proxy_yaml(
        up.addr,
        "",
        "  - upstream: up
    limits:
      - { name: hourly, algorithm: token_bucket, rate: 1/h, burst: 2, key: route }
    on_limit: { stale: { max_age: 5m } }
",
    );
    let tg = Tollgate::start_with_clock(&yaml, ManualClock::new(T0)).await;
    assert_eq!(get_with(tg.addr, "/v", &[("accept-language", "en")]).await.2, "hello in en");
    assert_eq!(get_with(tg.addr, "/v", &[("accept-language", "fr")]).await.2, "hello in fr");
    // Throttled now: each language gets its own copy, an unseen one gets 429.
    let (s, h, b) = get_with(tg.addr, "/v", &[("accept-language", "en")]).await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"hello in en"[..]));
    assert!(h["cache-status"].to_str().unwrap().contains("throttled"));
    assert_eq!(get_with(tg.addr, "/v", &[("accept-language", "fr")]).await.2, "hello in fr");
    assert_eq!(get_with(tg.addr, "/v", &[("accept-language", "de")]).await.0, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn upstream_failure_serves_the_stale_copy_marked_upstream_error() {
    let status = Arc::new(AtomicU16::new(200));
    let current = status.clone();
    let up = Upstream::start(move |_req| {
        let code = current.load(Ordering::SeqCst);
        async move { Response::builder().status(code).body(full(format!("status {code}"))).unwrap() }
    })
    .await;
    let yaml = proxy_yaml(up.addr, "", "  - upstream: up\n    on_upstream_error: { stale: { max_age: 1h } }\n");
    let clock = ManualClock::new(T0);
    let tg = Tollgate::start_with_clock(&yaml, clock.clone()).await;
    assert_eq!(get(tg.addr, "/d").await.2, "status 200");

    clock.advance(SEC * 412);
    status.store(503, Ordering::SeqCst);
    let (s, h, b) = get(tg.addr, "/d").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"status 200"[..]));
    assert_eq!(h["cache-status"], "tollgate; fwd=bypass; fwd-status=503; ttl=-412; detail=upstream-error");
    assert_eq!(h["age"], "412");

    // The upstream gone entirely: connect failure, still the stale copy.
    drop(up);
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let (s, h, _) = get(tg.addr, "/d").await;
    assert_eq!(s, StatusCode::OK);
    assert!(h["cache-status"].to_str().unwrap().contains("fwd-status=502"), "{:?}", h["cache-status"]);

    // Nothing stored for this path: the normal 502.
    assert_eq!(get(tg.addr, "/never").await.0, StatusCode::BAD_GATEWAY);
    // Too old: the normal error.
    clock.advance(SEC * 3_600);
    assert_eq!(get(tg.addr, "/d").await.0, StatusCode::BAD_GATEWAY);
}

#[tokio::test]
async fn a_flood_of_large_distinct_responses_stays_within_the_byte_bound() {
    let up = Upstream::start(|_req| async { Response::new(full(vec![b'z'; 40 * 1024])) }).await;
    let yaml = format!(
        "cache: {{ max_bytes: 512KiB, max_entry_bytes: 64KiB }}\n{}",
        proxy_yaml(up.addr, "", "  - upstream: up\n    on_upstream_error: { stale: { max_age: 1h } }\n")
    );
    let tg = Tollgate::start(&yaml).await;
    for i in 0..200 {
        let (s, _, b) = get(tg.addr, &format!("/item/{i}")).await;
        assert_eq!((s, b.len()), (StatusCode::OK, 40 * 1024));
    }
    let cache = tg.shared.load().cache().clone();
    let stored = cache.weighted_size();
    assert!(stored <= 512 * 1024, "cache holds {stored} bytes, bound is 512 KiB");
    assert!(cache.entry_count() >= 5, "the cache keeps what fits ({} entries)", cache.entry_count());
}
