use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Request;
use http_body::{Body as HttpBody, Frame};
use http_body_util::BodyExt;

use super::*;
use crate::body::Tapped;

const MIN: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3_600);
/// `at(0)` as an HTTP-date.
const T0_DATE: &str = "Tue, 14 Nov 2023 22:13:20 GMT";

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

fn req(method: Method, uri: &str, headers: &[(&str, &str)]) -> Parts {
    let mut b = Request::builder().method(method).uri(uri).header(header::HOST, "example.com");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(()).expect("valid test request").into_parts().0
}

fn get(uri: &str) -> Parts {
    req(Method::GET, uri, &[])
}

fn ok(headers: &[(&str, &str)], body: &'static str) -> Response<Body> {
    let mut b = Response::builder().status(200);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Body::full(body)).expect("valid test response")
}

async fn body_of<B: HttpBody<Data = Bytes>>(body: B) -> Bytes
where
    B::Error: std::fmt::Debug,
{
    body.collect().await.expect("body without error").to_bytes()
}

/// Sends `resp` through the cache the way the proxy does, reading its body to the end.
async fn store(cache: &Cache, req: &Parts, resp: Response<Body>, now: SystemTime) -> Bytes {
    body_of(cache.capture(req, false, resp, now).into_body()).await
}

fn throttled(cache: &Cache, req: &Parts, max_age: Duration, now: SystemTime) -> Option<Response<Body>> {
    cache.stale(req, &WHOLE_URL, StaleReason::Throttled, max_age, now)
}

async fn stale_body(cache: &Cache, req: &Parts, now: SystemTime) -> Option<Bytes> {
    match throttled(cache, req, HOUR, now) {
        Some(resp) => Some(body_of(resp.into_body()).await),
        None => None,
    }
}

#[derive(Debug)]
struct Boom;

/// A body yielding scripted frames; `report_end` makes it say so once it has none left, as
/// hyper's bodies do, otherwise only the final `None` tells.
struct Script {
    frames: VecDeque<Result<Frame<Bytes>, Boom>>,
    report_end: bool,
}

impl Script {
    fn data(chunks: &[&'static str]) -> Script {
        Script {
            frames: chunks.iter().map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes())))).collect(),
            report_end: true,
        }
    }

    fn then(mut self, frame: Result<Frame<Bytes>, Boom>) -> Script {
        self.frames.push_back(frame);
        self
    }
}

impl HttpBody for Script {
    type Data = Bytes;
    type Error = Boom;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Boom>>> {
        Poll::Ready(self.frames.pop_front())
    }

    fn is_end_stream(&self) -> bool {
        self.report_end && self.frames.is_empty()
    }
}

/// Wraps `body` as [`Cache::capture`] would for a 200 with `headers` to GET `uri`.
fn capture_script(cache: &Cache, uri: &str, headers: &[(&str, &str)], body: Script) -> Tapped<Script> {
    let pending = cache.prepare(&get(uri), false, &ok(headers, ""), at(0)).expect("storable response");
    Tapped::new(body, pending)
}

#[tokio::test]
async fn throttled_get_gets_stale_copy_with_age_and_cache_status() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let page = get("/page?x=1");
    let resp = ok(
        &[
            ("cache-control", "max-age=60"),
            ("content-type", "text/plain"),
            ("ratelimit", "\"per-client\";r=3;t=1"),
            ("ratelimit-policy", "\"per-client\";q=10;w=1"),
        ],
        "hello",
    );
    assert_eq!(store(&cache, &page, resp, at(0)).await, "hello");

    let resp = throttled(&cache, &page, 10 * MIN, at(472)).expect("a stale copy");
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert_eq!(h["age"], "472");
    assert_eq!(h["cache-status"], "tollgate; hit; ttl=-412; detail=throttled");
    assert_eq!(h["content-type"], "text/plain");
    assert!(!h.contains_key("ratelimit") && !h.contains_key("ratelimit-policy"));
    assert_eq!(body_of(resp.into_body()).await, "hello");
    assert_eq!(cache.stats().hits_throttled, 1);
    assert_eq!(stale_body(&cache, &get("/page?x=2"), at(1)).await, None, "the query is part of the key");
}

#[tokio::test]
async fn copy_older_than_max_age_is_not_served() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let page = get("/");
    store(&cache, &page, ok(&[], "x"), at(0)).await;
    assert!(throttled(&cache, &page, 5 * MIN, at(300)).is_some());
    assert!(throttled(&cache, &page, 5 * MIN, at(301)).is_none());
    // A clock that went backwards reads as age 0, not as a panic or a huge age.
    let resp = throttled(&cache, &page, 5 * MIN, at(0) - MIN).expect("a copy");
    assert_eq!(resp.headers()["age"], "0");
    let s = cache.stats();
    assert_eq!((s.hits_throttled, s.misses), (2, 1));
}

#[tokio::test]
async fn age_includes_the_age_the_response_arrived_with() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let page = get("/");
    store(&cache, &page, ok(&[("age", "100"), ("cache-control", "max-age=60")], "x"), at(0)).await;
    let resp = throttled(&cache, &page, HOUR, at(10)).expect("a copy");
    assert_eq!(resp.headers()["age"], "110");
    assert_eq!(resp.headers()["cache-status"], "tollgate; hit; ttl=-50; detail=throttled");
    assert!(throttled(&cache, &page, Duration::from_secs(109), at(10)).is_none());
}

#[tokio::test]
async fn ttl_comes_from_expires_minus_date_without_max_age() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let page = get("/");
    let resp = ok(&[("date", T0_DATE), ("expires", "Tue, 14 Nov 2023 22:15:00 GMT")], "x");
    store(&cache, &page, resp, at(0)).await;
    let resp = throttled(&cache, &page, HOUR, at(472)).expect("a copy");
    assert_eq!(resp.headers()["cache-status"], "tollgate; hit; ttl=-372; detail=throttled");
    assert_eq!(resp.headers()["date"], T0_DATE, "the stored Date is replayed");
}

#[tokio::test]
async fn only_200_answers_to_get_are_stored() {
    let cache = Cache::new(1 << 20, 64 << 10);
    for method in [Method::POST, Method::PUT, Method::HEAD] {
        store(&cache, &req(method.clone(), "/m", &[]), ok(&[], "x"), at(0)).await;
        assert!(throttled(&cache, &req(method, "/m", &[]), HOUR, at(1)).is_none());
    }
    assert_eq!(stale_body(&cache, &get("/m"), at(1)).await, None);

    let mut not_found = ok(&[], "x");
    *not_found.status_mut() = StatusCode::NOT_FOUND;
    store(&cache, &get("/404"), not_found, at(0)).await;
    assert_eq!(stale_body(&cache, &get("/404"), at(1)).await, None);

    store(&cache, &get("/m"), ok(&[], "x"), at(0)).await;
    assert!(throttled(&cache, &req(Method::POST, "/m", &[]), HOUR, at(1)).is_none(), "POST is never answered");
    assert_eq!(stale_body(&cache, &get("/m"), at(1)).await.as_deref(), Some(&b"x"[..]));
}

#[tokio::test]
async fn forbidding_response_fields_prevent_storing() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let refused: [(&str, &str); 7] = [
        ("cache-control", "no-store"),
        ("cache-control", "max-age=60, Private"),
        ("cache-control", "private=\"x-user\""),
        ("cache-control", "no-cache"),
        ("set-cookie", "session=1"),
        ("vary", "*"),
        ("vary", "accept, *"),
    ];
    for (i, field) in refused.iter().enumerate() {
        let page = get(&format!("/r{i}"));
        assert_eq!(store(&cache, &page, ok(&[*field], "kept whole"), at(0)).await, "kept whole");
        assert_eq!(stale_body(&cache, &page, at(1)).await, None, "{field:?} must not be stored");
    }
    let page = get("/public");
    store(&cache, &page, ok(&[("cache-control", "public, max-age=60")], "y"), at(0)).await;
    assert!(stale_body(&cache, &page, at(1)).await.is_some());
}

#[tokio::test]
async fn request_no_store_prevents_storing() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let page = req(Method::GET, "/", &[("cache-control", "no-store")]);
    assert!(!cache.may_store(&page, false));
    store(&cache, &page, ok(&[], "x"), at(0)).await;
    assert_eq!(stale_body(&cache, &get("/"), at(1)).await, None);
}

#[tokio::test]
async fn credentials_prevent_storing_unless_the_route_keys_on_them() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let alice = req(Method::GET, "/me", &[("authorization", "Bearer alice")]);
    let bob = req(Method::GET, "/me", &[("authorization", "Bearer bob")]);
    let cookie = req(Method::GET, "/me", &[("cookie", "sid=alice")]);
    for r in [&alice, &cookie] {
        assert!(!cache.may_store(r, false));
        store(&cache, r, ok(&[], "private"), at(0)).await;
        assert!(throttled(&cache, r, HOUR, at(1)).is_none());
    }

    assert!(cache.may_store(&alice, true));
    body_of(cache.capture(&alice, true, ok(&[], "alice's"), at(0)).into_body()).await;
    assert_eq!(stale_body(&cache, &alice, at(1)).await.as_deref(), Some(&b"alice's"[..]));
    assert_eq!(stale_body(&cache, &bob, at(1)).await, None, "a copy answers the same credentials only");
    assert_eq!(stale_body(&cache, &get("/me"), at(1)).await, None);

    store(&cache, &get("/me"), ok(&[], "anonymous"), at(0)).await;
    assert_eq!(stale_body(&cache, &bob, at(1)).await, None, "an anonymous copy is not served to a user");
}

#[tokio::test]
async fn vary_separates_variants() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let gzip = req(Method::GET, "/v", &[("accept-encoding", "gzip, br")]);
    let gzip_again = req(Method::GET, "/v", &[("accept-encoding", "gzip,br")]);
    let br = req(Method::GET, "/v", &[("accept-encoding", "br")]);
    let plain = get("/v");
    let vary = ("vary", "Accept-Encoding");
    store(&cache, &gzip, ok(&[vary, ("content-encoding", "gzip")], "gz"), at(0)).await;
    store(&cache, &plain, ok(&[vary], "plain"), at(0)).await;

    assert_eq!(stale_body(&cache, &gzip_again, at(1)).await.as_deref(), Some(&b"gz"[..]));
    assert_eq!(stale_body(&cache, &plain, at(1)).await.as_deref(), Some(&b"plain"[..]));
    assert_eq!(stale_body(&cache, &br, at(1)).await, None);

    // A newer answer for the same variant replaces it and leaves the other alone.
    store(&cache, &gzip, ok(&[vary, ("content-encoding", "gzip")], "gz2"), at(2)).await;
    assert_eq!(stale_body(&cache, &gzip, at(3)).await.as_deref(), Some(&b"gz2"[..]));
    assert_eq!(stale_body(&cache, &plain, at(3)).await.as_deref(), Some(&b"plain"[..]));
}

#[tokio::test]
async fn variants_per_url_are_capped() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let lang =
        |i: usize| req(Method::GET, "/l", &[("accept-language", ["a", "b", "c", "d", "e", "f", "g", "h", "i"][i])]);
    for i in 0..=MAX_VARIANTS {
        store(&cache, &lang(i), ok(&[("vary", "accept-language")], "x"), at(0)).await;
    }
    assert!(stale_body(&cache, &lang(0), at(1)).await.is_none(), "the oldest variant went first");
    for i in 1..=MAX_VARIANTS {
        assert!(stale_body(&cache, &lang(i), at(1)).await.is_some());
    }
}

#[tokio::test]
async fn head_is_served_from_a_get_copy_without_body() {
    let cache = Cache::new(1 << 20, 64 << 10);
    store(&cache, &get("/h"), ok(&[("content-length", "5")], "hello"), at(0)).await;
    let resp = throttled(&cache, &req(Method::HEAD, "/h", &[]), HOUR, at(7)).expect("a copy");
    assert_eq!(resp.headers()["content-length"], "5");
    assert_eq!(resp.headers()["age"], "7");
    assert!(resp.body().is_end_stream());
    assert_eq!(body_of(resp.into_body()).await, "");
}

#[tokio::test]
async fn upstream_error_reason_reports_fwd_status() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let page = get("/");
    store(&cache, &page, ok(&[("cache-control", "max-age=60"), ("cache-status", "origin-cache; hit")], "x"), at(0))
        .await;
    let resp =
        cache.stale(&page, &WHOLE_URL, StaleReason::UpstreamError { status: 502 }, HOUR, at(472)).expect("a copy");
    let statuses: Vec<_> = resp.headers().get_all(CACHE_STATUS).iter().collect();
    assert_eq!(
        statuses,
        ["origin-cache; hit", "tollgate; fwd=bypass; fwd-status=502; ttl=-412; detail=upstream-error"]
    );
    assert_eq!(cache.stats().hits_upstream_error, 1);
    assert_eq!(cache.stats().hits_throttled, 0);
}

#[tokio::test]
async fn stale_if_error_extends_max_age_for_upstream_errors_only() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let page = get("/");
    store(&cache, &page, ok(&[("cache-control", "max-age=60, stale-if-error=3600")], "x"), at(0)).await;
    let error = |status, secs| {
        cache.stale(&page, &WHOLE_URL, StaleReason::UpstreamError { status }, 5 * MIN, at(secs)).is_some()
    };
    assert!(error(503, 1_000));
    assert!(error(500, 3_660));
    assert!(!error(504, 3_661));
    assert!(!error(429, 1_000), "not an error stale-if-error covers");
    assert!(throttled(&cache, &page, 5 * MIN, at(1_000)).is_none(), "throttling is bound by the route");
}

#[tokio::test]
async fn revalidation_directives_allow_fresh_copies_only() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let fields = ["max-age=60, must-revalidate", "max-age=60, proxy-revalidate", "s-maxage=60", "max-age=60"];
    for (i, cc) in fields.iter().enumerate() {
        let page = get(&format!("/{i}"));
        store(&cache, &page, ok(&[("cache-control", cc), ("cache-control", "stale-if-error=600")], "x"), at(0)).await;
        let fresh = cache
            .stale(&page, &WHOLE_URL, StaleReason::UpstreamError { status: 502 }, HOUR, at(59))
            .expect("fresh copy");
        assert_eq!(
            fresh.headers()["cache-status"],
            "tollgate; fwd=bypass; fwd-status=502; ttl=1; detail=upstream-error"
        );
        let stale = cache.stale(&page, &WHOLE_URL, StaleReason::UpstreamError { status: 502 }, HOUR, at(60));
        assert_eq!(stale.is_some(), *cc == "max-age=60", "{cc}");
    }
}

#[tokio::test]
async fn flood_of_large_distinct_responses_stays_within_the_byte_bound() {
    const BIG: &str = include_str!("policy.rs");
    assert!(BIG.len() > 4_000);
    let max_bytes = 64 << 10;
    let cache = Cache::new(max_bytes, 16 << 10);

    store(&cache, &get("/one"), ok(&[], BIG), at(0)).await;
    cache.inner.store.run_pending_tasks();
    assert!(cache.weighted_size() >= (BIG.len() + SLOT_OVERHEAD + VARIANT_OVERHEAD) as u64);

    for i in 0..300 {
        store(&cache, &get(&format!("/flood/{i}")), ok(&[("content-type", "text/plain")], BIG), at(i)).await;
        if i % 50 == 0 {
            cache.inner.store.run_pending_tasks();
            assert!(cache.weighted_size() <= max_bytes);
        }
    }
    cache.inner.store.run_pending_tasks();
    let s = cache.stats();
    assert!(s.bytes <= max_bytes && s.bytes > 0, "{s:?}");
    assert!(s.entries <= max_bytes / BIG.len() as u64, "{s:?}");
    assert_eq!(s.stored, 301);
}

#[tokio::test]
async fn body_that_ends_cleanly_is_stored_from_its_frames() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let body = capture_script(&cache, "/s", &[], Script::data(&["ab", "cd"]));
    assert_eq!(body_of(body).await, "abcd");
    assert_eq!(stale_body(&cache, &get("/s"), at(1)).await.as_deref(), Some(&b"abcd"[..]));

    // Without `is_end_stream`, the final `None` completes the copy.
    let mut script = Script::data(&["ef"]);
    script.report_end = false;
    assert_eq!(body_of(capture_script(&cache, "/t", &[], script)).await, "ef");
    assert_eq!(stale_body(&cache, &get("/t"), at(1)).await.as_deref(), Some(&b"ef"[..]));
}

#[tokio::test]
async fn body_is_stored_once_it_reports_its_end_without_a_final_poll() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let page = get("/");
    let mut body = cache.capture(&page, false, ok(&[], "once"), at(0)).into_body();
    let frame = body.frame().await.expect("a frame").expect("no error");
    assert_eq!(frame.into_data().ok().as_deref(), Some(&b"once"[..]));
    assert_eq!(stale_body(&cache, &page, at(1)).await.as_deref(), Some(&b"once"[..]));

    // An empty body may never be polled at all.
    let _unpolled = cache.capture(&get("/empty"), false, Response::new(Body::empty()), at(0));
    assert_eq!(stale_body(&cache, &get("/empty"), at(1)).await.as_deref(), Some(&b""[..]));
}

#[tokio::test]
async fn body_that_errors_mid_stream_is_passed_on_but_not_stored() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let mut body = capture_script(&cache, "/e", &[], Script::data(&["ab", "cd"]).then(Err(Boom)));
    for want in ["ab", "cd"] {
        let frame = body.frame().await.expect("a frame").expect("no error yet");
        assert_eq!(frame.into_data().ok().as_deref(), Some(want.as_bytes()));
    }
    assert!(matches!(body.frame().await, Some(Err(Boom))));
    assert_eq!(stale_body(&cache, &get("/e"), at(1)).await, None);
    assert_eq!(cache.stats().abandoned, 1);
}

#[tokio::test]
async fn body_over_the_entry_limit_passes_through_whole_but_is_not_stored() {
    const KB: &str = include_str!("key.rs");
    let limit = VARIANT_OVERHEAD + 3 * KB.len() / 2;
    let cache = Cache::new(1 << 20, limit);
    let body = capture_script(&cache, "/big", &[], Script::data(&[KB, KB, KB]));
    assert_eq!(body_of(body).await.len(), 3 * KB.len());
    assert_eq!(stale_body(&cache, &get("/big"), at(1)).await, None);
    assert_eq!(cache.stats().abandoned, 1);

    // The same limit holds one chunk: the refusal above was about size.
    assert_eq!(body_of(capture_script(&cache, "/small", &[], Script::data(&[KB]))).await.len(), KB.len());
    assert!(stale_body(&cache, &get("/small"), at(1)).await.is_some());
}

#[tokio::test]
async fn trailers_cut_short_bodies_and_dropped_bodies_are_not_stored() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let trailers = Frame::trailers(HeaderMap::new());
    body_of(capture_script(&cache, "/tr", &[], Script::data(&["ab"]).then(Ok(trailers)))).await;
    assert_eq!(stale_body(&cache, &get("/tr"), at(1)).await, None);

    body_of(capture_script(&cache, "/cl", &[("content-length", "10")], Script::data(&["short"]))).await;
    assert_eq!(stale_body(&cache, &get("/cl"), at(1)).await, None);

    let mut script = Script::data(&["ab", "cd"]);
    script.report_end = false;
    let mut body = capture_script(&cache, "/drop", &[], script);
    body.frame().await.expect("a frame").expect("no error");
    drop(body);
    assert_eq!(stale_body(&cache, &get("/drop"), at(1)).await, None);
    assert_eq!(cache.stats().abandoned, 3);
}

#[tokio::test]
async fn unstorable_responses_are_returned_unwrapped() {
    let cache = Cache::new(1 << 20, 64 << 10);
    let resp = cache.capture(&get("/"), false, ok(&[("cache-control", "no-store")], "x"), at(0));
    assert!(!resp.body().is_tapped());
    let resp = cache.capture(&get("/"), false, ok(&[], "x"), at(0));
    assert!(resp.body().is_tapped());
}

#[test]
fn entry_limit_is_clamped_to_what_the_store_can_hold() {
    let cache = Cache::new(4_096, 1 << 20);
    assert!(cache.inner.max_entry_bytes <= 4_096 - SLOT_OVERHEAD);
}

#[test]
fn cache_and_captured_bodies_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Cache>();
    send::<Body>();
}
