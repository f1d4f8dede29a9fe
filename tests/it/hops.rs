//! What tollgate answers itself at the last hop, and what it reads before answering:
//! `Max-Forwards` on `OPTIONS` and `TRACE` (RFC 9110 §7.6.2), `TRACE` refused unless a route
//! lists it, and the built-in responder reading the whole request before its answer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;

use crate::h2_abuse::raw::{self, frame, Raw};
use crate::support::raw::RawClient;
use crate::support::{full, h1, proxy_yaml, Tollgate, Upstream};

/// An upstream that counts requests and keeps the last `Max-Forwards` it saw.
async fn recording() -> (Upstream, Arc<AtomicUsize>, Arc<Mutex<Option<String>>>) {
    let (hits, seen) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new(None)));
    let (h, s) = (hits.clone(), seen.clone());
    let up = Upstream::start(move |req| {
        let (h, s) = (h.clone(), s.clone());
        async move {
            h.fetch_add(1, Ordering::SeqCst);
            *s.lock().unwrap() = req.headers().get("max-forwards").map(|v| v.to_str().unwrap().to_owned());
            http::Response::new(full("from upstream"))
        }
    })
    .await;
    (up, hits, seen)
}

async fn send(tg: &Tollgate, method: Method, headers: &[(&str, &str)]) -> (StatusCode, http::HeaderMap, String) {
    let mut c = h1(tg.addr).await;
    let mut req = Request::builder().method(method).uri("/a").header("host", "localhost");
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let resp = c.send_request(req.body(full("")).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn options_at_max_forwards_zero_is_answered_here_and_above_it_goes_on_lowered() {
    let (up, hits, seen) = recording().await;
    let tg =
        Tollgate::start(&proxy_yaml(up.addr, "", "  - upstream: up\n    match: { methods: [GET, OPTIONS] }\n")).await;

    let (status, headers, body) = send(&tg, Method::OPTIONS, &[("max-forwards", "0")]).await;
    assert_eq!(status, 200);
    assert_eq!(headers.get("allow").unwrap(), "GET, OPTIONS");
    assert_eq!(body, "");
    assert_eq!(hits.load(Ordering::SeqCst), 0, "Max-Forwards: 0 must not be forwarded");

    let (status, _, body) = send(&tg, Method::OPTIONS, &[("max-forwards", "5")]).await;
    assert_eq!((status.as_u16(), body.as_str()), (200, "from upstream"));
    assert_eq!(seen.lock().unwrap().as_deref(), Some("4"), "forwarded one lower");

    // Other methods ignore the field (RFC 9110 allows it), as nginx and HAProxy do.
    let (status, _, _) = send(&tg, Method::GET, &[("max-forwards", "0")]).await;
    assert_eq!(status, 200);
    assert_eq!(seen.lock().unwrap().as_deref(), Some("0"));
    assert_eq!(hits.load(Ordering::SeqCst), 2);

    let (status, headers, _) = send(&tg, Method::OPTIONS, &[("max-forwards", "x")]).await;
    assert_eq!(status, 400);
    assert_eq!(headers.get("content-type").unwrap(), "application/problem+json");
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn trace_is_refused_unless_the_route_lists_it() {
    let (up, hits, seen) = recording().await;
    let routes = "  - { match: { path_prefix: /t, methods: [GET, TRACE] }, upstream: up }\n  - upstream: up\n";
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", routes)).await;

    // A route that lists no methods takes every method but TRACE.
    let (status, headers, body) = send(&tg, Method::TRACE, &[]).await;
    assert_eq!(status, 405);
    assert_eq!(headers.get("allow").unwrap(), "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS");
    assert!(body.contains("method-not-allowed"), "{body}");
    let (status, _, _) = send(&tg, Method::TRACE, &[("max-forwards", "3")]).await;
    assert_eq!(status, 405);
    assert_eq!(hits.load(Ordering::SeqCst), 0);

    // A route that lists it: forwarded one lower, or reflected here at the last hop.
    let mut c = h1(tg.addr).await;
    let req = |mf: &str| {
        Request::builder()
            .method(Method::TRACE)
            .uri("/t")
            .header("host", "localhost")
            .header("max-forwards", mf)
            .header("x-probe", "yes")
            .header("authorization", "Bearer secret")
            .body(full(""))
            .unwrap()
    };
    let resp = c.send_request(req("1")).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(seen.lock().unwrap().as_deref(), Some("0"));
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    let resp = c.send_request(req("0")).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get("content-type").unwrap(), "message/http");
    let text = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(text.starts_with("TRACE /t HTTP/1.1\r\n"), "{text}");
    assert!(text.contains("x-probe: yes\r\n"), "{text}");
    assert!(!text.contains("secret"), "credentials must not be reflected: {text}");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

const RESPONDER: &str = "upstreams:\n  d: { respond: { body: ok, max_body: 16 } }\nroutes:\n  - upstream: d\n";

#[tokio::test]
async fn the_responder_answers_only_after_the_whole_body() {
    let tg = Tollgate::start(RESPONDER).await;
    let mut c = RawClient::connect(tg.addr).await;
    c.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello").await;
    assert!(c.open_after(Duration::from_millis(300)).await, "answered before the body was complete");
    c.send(b"world").await;
    let resp = c.final_response(false).await.unwrap();
    assert_eq!((resp.status(), resp.body_str().as_str()), (200, "ok"));

    // Past `max_body`: 413, announced or sent.
    c.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\n\r\n").await;
    let resp = c.final_response(false).await.unwrap();
    assert_eq!(resp.status(), 413);
    assert!(resp.body_str().contains("content-too-large"), "{}", resp.body_str());
    let mut c = RawClient::connect(tg.addr).await;
    c.send(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n0123456789abcdef\r\n1\r\nx\r\n0\r\n\r\n").await;
    assert_eq!(c.final_response(false).await.unwrap().status(), 413);
}

/// HPACK for `POST http://localhost/` with `content-length: {len}`.
fn post_block(len: &str) -> Vec<u8> {
    let mut b = raw::request_block("/");
    b[0] = 0x83; // :method POST
    b.extend_from_slice(&[0x0f, 0x0d]); // content-length (static 28), literal without indexing
    b.push(u8::try_from(len.len()).unwrap());
    b.extend_from_slice(len.as_bytes());
    b
}

#[tokio::test]
async fn an_h2_body_shorter_than_its_content_length_gets_no_answer_from_the_responder() {
    let tg = Tollgate::start(RESPONDER).await;
    let mut c = Raw::connect(tg.addr).await;
    c.send(&frame(raw::HEADERS, raw::END_HEADERS, 1, &post_block("10"))).await;
    // The head alone: an answer now would be one given before the request was read.
    let deadline = Instant::now() + Duration::from_millis(300);
    while let Ok(Some(f)) = c.next(deadline).await {
        assert_ne!(f.kind, raw::HEADERS, "answered before the body arrived");
    }
    c.send(&frame(0, raw::END_STREAM, 1, b"hello")).await;
    c.ending(Duration::from_millis(500)).await;
    assert!(c.answered.is_empty(), "a body 5 bytes short of its content-length was answered");
    assert_eq!(c.resets, vec![(1, 1)], "the stream is reset with PROTOCOL_ERROR (RFC 9113 §8.1.1)");
}

#[tokio::test]
async fn the_responder_answers_a_client_waiting_for_100_continue_at_once() {
    let tg = Tollgate::start(RESPONDER).await;
    let mut c = RawClient::connect(tg.addr).await;
    c.send(b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n").await;
    let resp = c.response(false).await.unwrap();
    assert_eq!((resp.status(), resp.body_str().as_str()), (200, "ok"), "a final answer, not 100 Continue");
}
