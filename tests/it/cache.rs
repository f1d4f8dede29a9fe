//! A route's HTTP cache (`cache:`, RFC 9111) over real sockets: fresh hits without the
//! upstream, what is never stored, `Vary`, credentials, revalidation with `304`, coalesced
//! misses, invalidation by unsafe methods, hits and limits, a huge answer past its cap, purges.
//! A copy is made stale without waiting: the upstream's own `Age` says it is older than its
//! `max-age`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;

use crate::support::{full, generated, get, get_with, h1, proxy_yaml, Tollgate, Upstream};

/// An upstream that counts its requests and answers each with `headers` and the path.
async fn counting(headers: &'static [(&'static str, &'static str)]) -> (Upstream, Arc<AtomicUsize>) {
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    let up = Upstream::start(move |req| {
        let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            let mut resp = Response::builder();
            for (k, v) in headers {
                resp = resp.header(*k, *v);
            }
            resp.body(full(format!("{} #{n}", req.uri().path()))).unwrap()
        }
    })
    .await;
    (up, count)
}

fn cached_route(up: std::net::SocketAddr, cache: &str) -> String {
    proxy_yaml(up, "", &format!("  - name: read\n    upstream: up\n    cache: {cache}\n"))
}

fn status_of(h: &http::HeaderMap) -> &str {
    h.get("cache-status").map_or("", |v| v.to_str().unwrap())
}

#[tokio::test]
async fn a_fresh_copy_is_served_without_the_upstream_with_age_and_cache_status() {
    let (up, count) = counting(&[("cache-control", "max-age=60"), ("age", "7")]).await;
    let tg = Tollgate::start(&cached_route(up.addr, "{}")).await;
    let (s, h, b) = get(tg.addr, "/a?x=1").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"/a #1"[..]));
    assert_eq!(status_of(&h), "tollgate; fwd=uri-miss; fwd-status=200; stored");
    for _ in 0..3 {
        let (s, h, b) = get(tg.addr, "/a?x=1").await;
        assert_eq!((s, &b[..]), (StatusCode::OK, &b"/a #1"[..]));
        let age: u64 = h["age"].to_str().unwrap().parse().unwrap();
        assert!((7..60).contains(&age), "Age {age}: the upstream's 7 plus the time held");
        assert!(status_of(&h).starts_with("tollgate; hit; ttl="), "{}", status_of(&h));
    }
    assert_eq!(count.load(Ordering::SeqCst), 1, "hits never reach the upstream");
    // Another query is another resource.
    assert_eq!(get(tg.addr, "/a?x=2").await.2, "/a #2");
    // HEAD is answered from the GET's copy, without a body.
    let mut send = h1(tg.addr).await;
    let resp =
        send.send_request(Request::head("/a?x=1").header("host", "localhost").body(full("")).unwrap()).await.unwrap();
    assert!(status_of(resp.headers()).contains("hit"));
    assert!(resp.into_body().collect().await.unwrap().to_bytes().is_empty());
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn answers_that_forbid_storing_or_have_no_lifetime_always_reach_the_upstream() {
    for headers in [
        &[("cache-control", "no-store")][..],
        &[("cache-control", "private, max-age=60")][..],
        &[("cache-control", "max-age=60"), ("set-cookie", "id=1")][..],
        &[("cache-control", "max-age=60"), ("vary", "*")][..],
        // No lifetime, and heuristic freshness is off by default.
        &[("last-modified", "Sun, 06 Nov 1994 08:49:37 GMT")][..],
        // Stale on arrival.
        &[("cache-control", "max-age=10"), ("age", "20")][..],
    ] {
        let leaked: &'static [(&'static str, &'static str)] = Box::leak(headers.to_vec().into_boxed_slice());
        let (up, count) = counting(leaked).await;
        let tg = Tollgate::start(&cached_route(up.addr, "{}")).await;
        get(tg.addr, "/x").await;
        let (_, h, b) = get(tg.addr, "/x").await;
        assert_eq!(b, "/x #2", "{headers:?} must not be served from the store");
        assert!(!status_of(&h).contains("hit"), "{headers:?}: {}", status_of(&h));
        assert_eq!(count.load(Ordering::SeqCst), 2);
    }
}

#[tokio::test]
async fn the_request_can_refuse_a_copy_or_ask_only_for_one() {
    let (up, count) = counting(&[("cache-control", "max-age=60")]).await;
    let tg = Tollgate::start(&cached_route(up.addr, "{}")).await;
    get(tg.addr, "/r").await;
    let (_, h, b) = get_with(tg.addr, "/r", &[("cache-control", "no-cache")]).await;
    assert_eq!(b, "/r #2");
    assert!(status_of(&h).contains("fwd=request"), "{}", status_of(&h));
    // The forced answer replaced the copy.
    assert_eq!(get(tg.addr, "/r").await.2, "/r #2");
    let (s, h, _) = get_with(tg.addr, "/nothing", &[("cache-control", "only-if-cached")]).await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT);
    assert!(status_of(&h).contains("only-if-cached"));
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn vary_keeps_a_variant_per_selecting_field_value() {
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    let up = Upstream::start(move |req| {
        seen.fetch_add(1, Ordering::SeqCst);
        let lang = req.headers().get("accept-language").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
        async move {
            Response::builder()
                .header("cache-control", "max-age=60")
                .header("vary", "Accept-Language")
                .body(full(format!("hello in {lang}")))
                .unwrap()
        }
    })
    .await;
    let tg = Tollgate::start(&cached_route(up.addr, "{}")).await;
    for _ in 0..2 {
        for lang in ["en", "fr"] {
            assert_eq!(get_with(tg.addr, "/v", &[("accept-language", lang)]).await.2, format!("hello in {lang}"));
        }
    }
    assert_eq!(count.load(Ordering::SeqCst), 2, "one upstream request per language");
    let (_, h, b) = get_with(tg.addr, "/v", &[("accept-language", "de")]).await;
    assert_eq!(b, "hello in de");
    assert!(status_of(&h).contains("fwd=vary-miss"), "{}", status_of(&h));
}

#[tokio::test]
async fn an_answer_to_credentials_is_kept_only_when_it_says_public_and_only_for_them() {
    for (headers, stored) in [
        (&[("cache-control", "max-age=60")][..], false),
        (&[("cache-control", "public, max-age=60")][..], true),
        (&[("cache-control", "s-maxage=60")][..], true),
    ] {
        let leaked: &'static [(&'static str, &'static str)] = Box::leak(headers.to_vec().into_boxed_slice());
        let (up, count) = counting(leaked).await;
        let tg = Tollgate::start(&cached_route(up.addr, "{}")).await;
        let alice = [("authorization", "Bearer alice")];
        get_with(tg.addr, "/me", &alice).await;
        get_with(tg.addr, "/me", &alice).await;
        assert_eq!(count.load(Ordering::SeqCst), if stored { 1 } else { 2 }, "{headers:?}");
        // Never another user's copy, nor an anonymous one.
        get_with(tg.addr, "/me", &[("authorization", "Bearer bob")]).await;
        get(tg.addr, "/me").await;
        assert_eq!(count.load(Ordering::SeqCst), if stored { 3 } else { 4 }, "{headers:?}");
    }
}

#[tokio::test]
async fn a_stale_copy_is_revalidated_and_a_304_refreshes_it() {
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    let up = Upstream::start(move |req| {
        let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
        let asked = req.headers().get("if-none-match").map(|v| v.to_str().unwrap().to_owned());
        async move {
            match asked.as_deref() {
                Some("\"v1\"") if n > 1 => Response::builder()
                    .status(304)
                    .header("etag", "\"v1\"")
                    .header("cache-control", "max-age=60")
                    .header("x-refreshed", "yes")
                    .body(full(""))
                    .unwrap(),
                _ => Response::builder()
                    .header("etag", "\"v1\"")
                    // Stale on arrival: the next request revalidates.
                    .header("cache-control", "max-age=10")
                    .header("age", "30")
                    .body(full("the body"))
                    .unwrap(),
            }
        }
    })
    .await;
    let tg = Tollgate::start(&cached_route(up.addr, "{}")).await;
    assert_eq!(get(tg.addr, "/doc").await.2, "the body");
    let (s, h, b) = get(tg.addr, "/doc").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"the body"[..]), "the stored body, refreshed");
    assert!(status_of(&h).contains("fwd=stale; fwd-status=304"), "{}", status_of(&h));
    assert_eq!(h["x-refreshed"], "yes", "the 304's fields update the copy");
    // Fresh again (max-age=60 from the 304): a hit.
    let (_, h, b) = get(tg.addr, "/doc").await;
    assert_eq!(b, "the body");
    assert!(status_of(&h).contains("hit"), "{}", status_of(&h));
    assert_eq!(count.load(Ordering::SeqCst), 2);
    // A client's own conditional the fresh copy satisfies: 304 from the store.
    let (s, h, b) = get_with(tg.addr, "/doc", &[("if-none-match", "W/\"v1\"")]).await;
    assert_eq!(s, StatusCode::NOT_MODIFIED);
    assert!(b.is_empty() && status_of(&h).contains("hit"));
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

/// Polls `cond` until it holds, yielding between tries (a measured condition, not a duration).
async fn until(mut cond: impl FnMut() -> bool) {
    for _ in 0..20_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("condition never held");
}

/// An upstream that counts its requests and holds each answer (`max-age=60`, `body`) until
/// `release` is notified.
async fn held(body: &'static str) -> (Upstream, Arc<AtomicUsize>, Arc<tokio::sync::Notify>) {
    let count = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let (seen, gate) = (count.clone(), release.clone());
    let up = Upstream::start(move |_req| {
        seen.fetch_add(1, Ordering::SeqCst);
        let gate = gate.clone();
        async move {
            gate.notified().await;
            Response::builder().header("cache-control", "max-age=60").body(full(body)).unwrap()
        }
    })
    .await;
    (up, count, release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_misses_on_a_cold_key_make_one_upstream_request() {
    // Held until every client is in: they all miss while this one is in flight.
    let (up, count, release) = held("cold").await;
    let tg = Tollgate::start(&cached_route(up.addr, "{ coalesce_wait: 60s }")).await;
    let mut clients = Vec::new();
    for _ in 0..100 {
        let addr = tg.addr;
        clients.push(tokio::spawn(async move { get(addr, "/cold").await }));
    }
    let shared = tg.shared.clone();
    until(|| {
        shared
            .load()
            .metrics()
            .encode(None)
            .contains("tollgate_steps_total{route=\"read\",step=\"cache\",result=\"waited\"} 99")
    })
    .await;
    assert_eq!(count.load(Ordering::SeqCst), 1);
    release.notify_one();
    let mut coalesced = 0;
    for c in clients {
        let (s, h, b) = c.await.unwrap();
        assert_eq!((s, &b[..]), (StatusCode::OK, &b"cold"[..]));
        coalesced += usize::from(status_of(&h).contains("detail=coalesced"));
    }
    assert_eq!(count.load(Ordering::SeqCst), 1, "one upstream request for 100 clients");
    assert_eq!(coalesced, 99);
    let metrics = tg.shared.load().metrics().encode(None);
    assert!(
        metrics.contains("tollgate_steps_total{route=\"read\",step=\"cache\",result=\"coalesced\"} 99"),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_unsafe_method_drops_the_urls_copies() {
    let (up, count) = counting(&[("cache-control", "max-age=60"), ("location", "/other")]).await;
    let tg = Tollgate::start(&cached_route(up.addr, "{}")).await;
    get(tg.addr, "/item").await;
    get(tg.addr, "/other").await;
    assert_eq!(get(tg.addr, "/item").await.2, "/item #1");
    let mut send = h1(tg.addr).await;
    let post = Request::post("/item").header("host", "localhost").body(full("new")).unwrap();
    assert_eq!(send.send_request(post).await.unwrap().status(), StatusCode::OK);
    assert_eq!(get(tg.addr, "/item").await.2, "/item #4", "the POST's URL is fetched again");
    assert_eq!(get(tg.addr, "/other").await.2, "/other #5", "and its Location's");
    assert_eq!(count.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn hits_spend_no_limit_unless_the_route_says_so() {
    for spend in [false, true] {
        let (up, _) = counting(&[("cache-control", "max-age=60")]).await;
        let yaml = proxy_yaml(
            up.addr,
            "",
            &format!(
                "  - upstream: up
    cache: {{ hits_spend_limits: {spend} }}
    limits: [{{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 1, key: route }}]
"
            ),
        );
        let tg = Tollgate::start(&yaml).await;
        assert_eq!(get(tg.addr, "/l").await.0, StatusCode::OK);
        let (s, h, _) = get(tg.addr, "/l").await;
        if spend {
            assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "the hit spent the limit");
        } else {
            assert_eq!(s, StatusCode::OK);
            assert!(status_of(&h).contains("hit"));
        }
    }
    // Spending, a hit within the limit is served after it.
    let (up, count) = counting(&[("cache-control", "max-age=60")]).await;
    let yaml = proxy_yaml(
        up.addr,
        "",
        "  - upstream: up
    cache: { hits_spend_limits: true }
    limits: [{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 3, key: route }]
",
    );
    let tg = Tollgate::start(&yaml).await;
    get(tg.addr, "/l").await;
    let (s, h, _) = get(tg.addr, "/l").await;
    assert_eq!(s, StatusCode::OK);
    assert!(status_of(&h).contains("hit"));
    assert!(h.contains_key("ratelimit"), "a metered hit says what it spent");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_huge_answer_streams_through_and_is_not_stored_past_its_cap() {
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    let up = Upstream::start(move |_req| {
        seen.fetch_add(1, Ordering::SeqCst);
        async move { Response::builder().header("cache-control", "max-age=60").body(generated(8 << 20)).unwrap() }
    })
    .await;
    let tg = Tollgate::start(&cached_route(up.addr, "{ max_entry_bytes: 1MiB }")).await;
    for _ in 0..2 {
        let (s, _, b) = get(tg.addr, "/big").await;
        assert_eq!((s, b.len()), (StatusCode::OK, 8 << 20));
    }
    assert_eq!(count.load(Ordering::SeqCst), 2, "not stored: both went to the upstream");
    let cache = tg.shared.load().cache().clone();
    assert_eq!(cache.stats().stored, 0);
    assert!(cache.stats().abandoned >= 2);
}

#[tokio::test]
async fn stale_while_revalidate_serves_the_stale_copy_and_refreshes_it_in_the_background() {
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    let up = Upstream::start(move |req| {
        let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
        let asked = req.headers().get("cache-control").map(|v| v.to_str().unwrap().to_owned());
        async move {
            let resp = Response::builder().header("x-asked", asked.unwrap_or_default());
            let resp = if n == 1 {
                // Stale on arrival, within its stale-while-revalidate.
                resp.header("cache-control", "max-age=10, stale-while-revalidate=600").header("age", "20")
            } else {
                resp.header("cache-control", "max-age=60")
            };
            resp.body(full(format!("v{n}"))).unwrap()
        }
    })
    .await;
    let tg = Tollgate::start(&cached_route(up.addr, "{}")).await;
    assert_eq!(get(tg.addr, "/swr").await.2, "v1");
    let (s, h, b) = get(tg.addr, "/swr").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"v1"[..]), "the stale copy, at once");
    assert!(status_of(&h).contains("detail=stale-while-revalidate"), "{}", status_of(&h));
    until(|| count.load(Ordering::SeqCst) == 2).await;
    let mut body = b;
    for _ in 0..10_000 {
        let (_, h, b) = get(tg.addr, "/swr").await;
        body = b;
        if body == "v2" {
            assert!(status_of(&h).starts_with("tollgate; hit; ttl="), "{}", status_of(&h));
            assert_eq!(h["x-asked"], "max-age=0", "the background request revalidated");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert_eq!(body, "v2", "the background answer replaced the copy");
    assert_eq!(count.load(Ordering::SeqCst), 2, "one background request");
}

#[tokio::test]
async fn ignored_query_parameters_share_a_copy_and_a_heuristic_lifetime_is_opt_in() {
    let (up, count) = counting(&[("last-modified", "Sun, 06 Nov 1994 08:49:37 GMT")]).await;
    let yaml = format!(
        "cache:\n  default: {{ heuristic: {{ percent: 10 }}, key: {{ ignore_query: [utm_source] }} }}\n{}",
        proxy_yaml(up.addr, "", "  - { name: other, upstream: up, cache: none, match: { path_prefix: /none } }\n  - { name: read, upstream: up }\n")
    );
    let tg = Tollgate::start(&yaml).await;
    assert_eq!(get(tg.addr, "/q?a=1&utm_source=x").await.2, "/q #1");
    let (_, h, b) = get(tg.addr, "/q?utm_source=y&a=1").await;
    assert_eq!(b, "/q #1", "the default applies, the ignored parameter is left out of the key");
    assert!(status_of(&h).contains("hit"));
    get(tg.addr, "/none").await;
    assert_eq!(get(tg.addr, "/none").await.2, "/none #3", "`cache: none` turns the default off");
    assert_eq!(count.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_failing_upstream_gets_the_routes_stale_copy_found_by_the_routes_key() {
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    let up = Upstream::start(move |_req| {
        let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            if n == 1 {
                Response::builder()
                    .header("cache-control", "max-age=10")
                    .header("age", "30")
                    .header("etag", "\"e\"")
                    .body(full("good"))
                    .unwrap()
            } else {
                Response::builder().status(503).body(full("down")).unwrap()
            }
        }
    })
    .await;
    let yaml = proxy_yaml(
        up.addr,
        "",
        "  - upstream: up
    cache: { key: { ignore_query: [session] } }
    on_upstream_error: { stale: { max_age: 1h } }
",
    );
    let tg = Tollgate::start(&yaml).await;
    assert_eq!(get(tg.addr, "/e?session=1").await.2, "good");
    let (s, h, b) = get(tg.addr, "/e?session=2").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"good"[..]), "revalidation failed: the stale copy");
    assert!(status_of(&h).contains("fwd-status=503; ttl=-"), "{}", status_of(&h));
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

const TOKEN: &str = "s3cret-admin-token-0123456789";

async fn delete(addr: std::net::SocketAddr, path: &str, auth: Option<&str>) -> (StatusCode, serde_json::Value) {
    let mut send = h1(addr).await;
    let mut req = Request::delete(path).header("host", "localhost");
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let resp = send.send_request(req.body(full("")).unwrap()).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null))
}

#[tokio::test]
async fn the_admin_listener_purges_a_url_or_a_prefix_with_the_token_and_counts_the_store() {
    let (up, count) = counting(&[("cache-control", "max-age=600")]).await;
    let yaml = format!("admin: {{ addr: 127.0.0.1:0, token: {TOKEN} }}\n{}", cached_route(up.addr, "{}"));
    let tg = Tollgate::start(&yaml).await;
    let admin = tg.start_admin().await;
    for path in ["/a/1?x=1", "/a/2", "/b"] {
        get(tg.addr, path).await;
        get(tg.addr, path).await;
    }
    assert_eq!(count.load(Ordering::SeqCst), 3);
    let bearer = format!("Bearer {TOKEN}");
    assert_eq!(delete(admin, "/cache/localhost/a/1?x=1", None).await.0, StatusCode::FORBIDDEN);
    assert_eq!(
        delete(admin, "/cache/localhost/a/1?x=1", Some("Bearer wrong-token-0123456789")).await.0,
        StatusCode::FORBIDDEN
    );
    let (s, v) = delete(admin, "/cache/LOCALHOST/a/1?x=1", Some(&bearer)).await;
    assert_eq!((s, v["purged"].as_u64()), (StatusCode::OK, Some(1)), "{v}");
    assert_eq!(get(tg.addr, "/a/1?x=1").await.2, "/a/1 #4");
    assert_eq!(get(tg.addr, "/a/2").await.2, "/a/2 #2", "another URL stays");
    let (_, v) = delete(admin, "/cache/localhost/a/*", Some(&bearer)).await;
    assert_eq!(v["purged"].as_u64(), Some(2), "{v}");
    assert_eq!(get(tg.addr, "/a/2").await.2, "/a/2 #5");
    assert_eq!(get(tg.addr, "/b").await.2, "/b #3");
    assert_eq!(count.load(Ordering::SeqCst), 5);

    let metrics = crate::support::get(admin, "/metrics").await.2;
    let text = String::from_utf8_lossy(&metrics);
    for line in [
        "tollgate_steps_total{route=\"read\",step=\"cache\",result=\"hit\"} 5",
        "tollgate_steps_total{route=\"read\",step=\"cache\",result=\"miss\"} 5",
        "tollgate_cache_entries 2",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    assert!(text.contains("tollgate_cache_bytes "));
    let stats: serde_json::Value = serde_json::from_slice(&crate::support::get(admin, "/cache").await.2).unwrap();
    assert_eq!(stats["entries"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_whose_hits_spend_limits_are_served_once_the_limits_admit_them() {
    let (up, count, release) = held("metered").await;
    let yaml = proxy_yaml(
        up.addr,
        "",
        "  - name: read
    upstream: up
    cache: { hits_spend_limits: true, coalesce_wait: 60s }
    limits: [{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 100, key: route }]
",
    );
    let tg = Tollgate::start(&yaml).await;
    let mut clients = Vec::new();
    for _ in 0..10 {
        let addr = tg.addr;
        clients.push(tokio::spawn(async move { get(addr, "/m").await }));
    }
    let shared = tg.shared.clone();
    until(|| shared.load().metrics().encode(None).contains("step=\"cache\",result=\"waited\"} 9")).await;
    release.notify_one();
    for c in clients {
        let (s, h, b) = c.await.unwrap();
        assert_eq!((s, &b[..]), (StatusCode::OK, &b"metered"[..]));
        assert!(h.contains_key("ratelimit"), "each spent the limit");
    }
    assert_eq!(count.load(Ordering::SeqCst), 1);
}
