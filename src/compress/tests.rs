use std::io::Read;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body::{Body as HttpBody, Frame};
use http_body_util::BodyExt;

use super::*;
use crate::body::{Body, BodyError};
use crate::config::compression::{CompressionConfig, MediaRange, DEFAULT_MIN_SIZE};

fn compress() -> Compress {
    Compress::new(Arc::new(CompressionConfig::default()))
}

fn accepted(field: &str) -> Asked {
    asked(Method::GET, field)
}

fn asked(method: Method, field: &str) -> Asked {
    Asked::new(&method, &headers(&[("accept-encoding", field)]))
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(header::HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
    }
    h
}

fn decide(method: Method, ae: &str, status: u16, pairs: &[(&str, &str)], length: Option<u64>) -> Outcome {
    let c = compress();
    c.decide(&asked(method, ae), Origin::Upstream, StatusCode::from_u16(status).unwrap(), &headers(pairs), length)
}

const JSON: (&str, &str) = ("content-type", "application/json; charset=utf-8");

#[test]
fn eligible_answers_are_encoded_with_the_chosen_coding() {
    assert_eq!(decide(Method::GET, "gzip", 200, &[JSON], None), Outcome::Encode(Coding::Gzip));
    assert_eq!(decide(Method::GET, "gzip, br, zstd", 200, &[JSON], Some(5000)), Outcome::Encode(Coding::Zstd));
    assert_eq!(decide(Method::POST, "br", 201, &[JSON], None), Outcome::Encode(Coding::Br));
    // Error pages are text too.
    assert_eq!(decide(Method::GET, "gzip", 404, &[("content-type", "text/html")], None), Outcome::Encode(Coding::Gzip));
    for t in [
        "text/html",
        "TEXT/Plain",
        "application/problem+json",
        "image/svg+xml",
        "application/atom+xml",
        "text/event-stream",
    ] {
        assert_eq!(
            decide(Method::GET, "gzip", 200, &[("content-type", t)], None),
            Outcome::Encode(Coding::Gzip),
            "{t}"
        );
    }
}

#[test]
fn exclusions_leave_the_answer_untouched() {
    use Skip::*;
    type Case<'a> = (Method, u16, &'a [(&'a str, &'a str)], Skip);
    let cases: &[Case] = &[
        (Method::GET, 206, &[JSON, ("content-range", "bytes 0-9/100")], Partial),
        (Method::GET, 204, &[JSON], NoContent),
        (Method::GET, 101, &[JSON], Tunnel),
        (Method::CONNECT, 200, &[JSON], Tunnel),
        (Method::GET, 200, &[JSON, ("content-encoding", "gzip")], Encoded),
        (Method::GET, 200, &[JSON, ("content-encoding", "br")], Encoded),
        (Method::GET, 200, &[JSON, ("cache-control", "public, No-Transform")], NoTransform),
        (Method::GET, 200, &[("content-type", "image/png")], Type),
        (Method::GET, 200, &[("content-type", "application/grpc")], Type),
        (Method::GET, 200, &[("content-type", "application/octet-stream")], Type),
        (Method::GET, 200, &[], Type),
        (Method::GET, 200, &[("content-type", "nonsense")], Type),
    ];
    for (method, status, pairs, why) in cases {
        assert_eq!(
            decide(method.clone(), "gzip", *status, pairs, None),
            Outcome::Skip(*why),
            "{method} {status} {pairs:?}"
        );
    }
    let c = compress();
    let h = headers(&[JSON]);
    for (origin, why) in [(Origin::Own, Own), (Origin::Tunnel, Tunnel)] {
        assert_eq!(c.decide(&accepted("gzip"), origin, StatusCode::OK, &h, None), Outcome::Skip(why));
    }
    // `identity` is no coding.
    assert_eq!(
        decide(Method::GET, "gzip", 200, &[JSON, ("content-encoding", "identity")], None),
        Outcome::Encode(Coding::Gzip)
    );
}

#[test]
fn answers_that_depend_on_accept_encoding_but_go_as_they_are() {
    use Plain::*;
    assert_eq!(decide(Method::HEAD, "gzip", 200, &[JSON], None), Outcome::Identity(Head));
    assert_eq!(decide(Method::GET, "gzip", 304, &[], None), Outcome::Identity(NotModified));
    assert_eq!(decide(Method::GET, "gzip", 304, &[JSON], None), Outcome::Identity(NotModified));
    assert_eq!(decide(Method::GET, "gzip", 304, &[("content-type", "image/png")], None), Outcome::Skip(Skip::Type));
    assert_eq!(decide(Method::GET, "deflate", 200, &[JSON], None), Outcome::Identity(NotAccepted));
    assert_eq!(decide(Method::GET, "gzip;q=0", 200, &[JSON], None), Outcome::Identity(NotAccepted));
    assert_eq!(decide(Method::GET, "gzip", 200, &[JSON], Some(DEFAULT_MIN_SIZE - 1)), Outcome::Identity(Small));
    assert_eq!(decide(Method::GET, "gzip", 200, &[JSON], Some(DEFAULT_MIN_SIZE)), Outcome::Encode(Coding::Gzip));
    // A client that refuses identity gets a short answer encoded; an empty one stays empty.
    assert_eq!(decide(Method::GET, "gzip, identity;q=0", 200, &[JSON], Some(10)), Outcome::Encode(Coding::Gzip));
    assert_eq!(decide(Method::GET, "gzip", 200, &[JSON], Some(0)), Outcome::Identity(Small));
}

#[test]
fn no_field_no_compression() {
    let c = compress();
    let none = Asked::new(&Method::GET, &HeaderMap::new());
    let out = c.decide(&none, Origin::Upstream, StatusCode::OK, &headers(&[JSON]), None);
    assert_eq!(out, Outcome::Identity(Plain::NotAccepted));
}

#[test]
fn types_and_min_size_come_from_the_route() {
    let config = CompressionConfig {
        encodings: vec![Coding::Gzip],
        min_size: 0,
        types: vec![MediaRange::parse("application/octet-stream").unwrap()],
        ..CompressionConfig::default()
    };
    let c = Compress::new(Arc::new(config));
    let bin = headers(&[("content-type", "application/octet-stream")]);
    let ae = accepted("br, gzip;q=0.1");
    assert_eq!(c.decide(&ae, Origin::Upstream, StatusCode::OK, &bin, Some(3)), Outcome::Encode(Coding::Gzip));
    let json = headers(&[JSON]);
    assert_eq!(c.decide(&ae, Origin::Upstream, StatusCode::OK, &json, None), Outcome::Skip(Skip::Type));
}

fn answer(pairs: &[(&str, &str)], body: &'static [u8]) -> Response<Body> {
    let mut r = Response::new(Body::full(Bytes::from_static(body)));
    *r.headers_mut() = headers(pairs);
    r
}

fn big_json() -> &'static [u8] {
    static DATA: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    DATA.get_or_init(|| {
        let mut v = b"[".to_vec();
        for i in 0..4000 {
            v.extend_from_slice(format!("{{\"id\":{i},\"name\":\"item {i}\",\"tags\":[\"a\",\"b\"]}},").as_bytes());
        }
        v.extend_from_slice(b"{}]");
        v
    })
}

fn decode(coding: &str, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match coding {
        "gzip" => flate2::read::GzDecoder::new(data).read_to_end(&mut out).map(drop),
        "br" => brotli::Decompressor::new(data, 4096).read_to_end(&mut out).map(drop),
        "zstd" => zstd::stream::read::Decoder::new(data).and_then(|mut d| d.read_to_end(&mut out)).map(drop),
        other => panic!("{other}"),
    }
    .unwrap();
    out
}

#[tokio::test]
async fn an_encoded_answer_has_its_fields_edited_and_decodes_to_the_original() {
    for (ae, coding) in [("gzip", "gzip"), ("br", "br"), ("zstd", "zstd")] {
        let len = big_json().len().to_string();
        let resp = answer(
            &[JSON, ("content-length", &len), ("etag", "\"v1\""), ("accept-ranges", "bytes"), ("vary", "Origin")],
            big_json(),
        );
        let mut resp = resp;
        let outcome = compress().apply(&accepted(ae), Origin::Upstream, &mut resp);
        assert!(matches!(outcome, Outcome::Encode(_)));
        let h = resp.headers();
        assert_eq!(h[header::CONTENT_ENCODING], coding);
        assert!(h.get(header::CONTENT_LENGTH).is_none());
        assert!(h.get(header::ACCEPT_RANGES).is_none());
        assert_eq!(h[header::ETAG], "W/\"v1\"");
        let vary: Vec<_> = h.get_all(header::VARY).iter().map(|v| v.to_str().unwrap()).collect();
        assert_eq!(vary, ["Origin", "Accept-Encoding"]);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(body.len() < big_json().len() / 5, "{coding}: {}", body.len());
        assert_eq!(decode(coding, &body), big_json(), "{coding}");
    }
}

#[tokio::test]
async fn fields_already_right_are_kept() {
    let resp = answer(&[JSON, ("etag", "W/\"weak\""), ("vary", "accept-encoding, origin")], big_json());
    let mut resp = resp;
    compress().apply(&accepted("gzip"), Origin::Upstream, &mut resp);
    assert_eq!(resp.headers()[header::ETAG], "W/\"weak\"");
    assert_eq!(resp.headers().get_all(header::VARY).iter().count(), 1);
    let resp = answer(&[JSON, ("vary", "*")], big_json());
    let mut resp = resp;
    compress().apply(&accepted("gzip"), Origin::Upstream, &mut resp);
    assert_eq!(resp.headers()[header::VARY], "*");
}

#[tokio::test]
async fn identity_answers_get_vary_and_nothing_else() {
    let resp = answer(&[JSON, ("content-length", "5"), ("etag", "\"v1\"")], b"short");
    let mut resp = resp;
    let outcome = compress().apply(&accepted("gzip"), Origin::Upstream, &mut resp);
    assert_eq!(outcome, Outcome::Identity(Plain::Small));
    assert_eq!(resp.headers()[header::VARY], "Accept-Encoding");
    assert_eq!(resp.headers()[header::ETAG], "\"v1\"");
    assert_eq!(resp.headers()[header::CONTENT_LENGTH], "5");
    assert!(resp.headers().get(header::CONTENT_ENCODING).is_none());
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "short");
    // Skipped: not a field changed.
    let resp = answer(&[("content-type", "image/png")], b"png");
    let before = resp.headers().clone();
    let mut resp = resp;
    compress().apply(&accepted("gzip"), Origin::Upstream, &mut resp);
    assert_eq!(resp.headers(), &before);
}

/// A body fed by the test, frame by frame.
struct Chan(tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, BodyError>>);

impl HttpBody for Chan {
    type Data = Bytes;
    type Error = BodyError;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.0.poll_recv(cx)
    }
}

fn chan() -> (tokio::sync::mpsc::Sender<Result<Frame<Bytes>, BodyError>>, Chan) {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    (tx, Chan(rx))
}

/// The next frame if one is ready now (the body is polled once, without waiting).
fn ready<B: HttpBody<Data = Bytes, Error = BodyError> + Unpin>(b: &mut B) -> Option<Frame<Bytes>> {
    let waker = std::task::Waker::noop();
    match Pin::new(b).poll_frame(&mut Context::from_waker(waker)) {
        Poll::Ready(Some(Ok(f))) => Some(f),
        Poll::Ready(Some(Err(e))) => panic!("{e}"),
        Poll::Ready(None) | Poll::Pending => None,
    }
}

/// A streaming decoder's view of the bytes sent so far.
fn decoded_so_far(coding: Coding, sent: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; 4096];
    let mut got = 0;
    let mut read = |r: &mut dyn Read| {
        while let Ok(n) = r.read(&mut out[got..]) {
            if n == 0 {
                break;
            }
            got += n;
        }
    };
    match coding {
        Coding::Gzip => read(&mut flate2::read::GzDecoder::new(sent)),
        Coding::Br => read(&mut brotli::Decompressor::new(sent, 4096)),
        Coding::Zstd => read(&mut zstd::stream::read::Decoder::new(sent).unwrap()),
    }
    out.truncate(got);
    out
}

#[tokio::test]
async fn a_stream_is_flushed_after_every_frame() {
    for coding in [Coding::Gzip, Coding::Br, Coding::Zstd] {
        let (tx, rx) = chan();
        let mut body = Box::pin(Encoded::new(rx, coding, 4, None, true).map_err(|_| ()).unwrap());
        let mut sent = Vec::new();
        let mut want = Vec::new();
        for i in 0..3 {
            let event = format!("id: {i}\ndata: {{\"n\":{i}}}\n\n");
            want.extend_from_slice(event.as_bytes());
            tx.send(Ok(Frame::data(Bytes::from(event)))).await.unwrap();
            // The frame's bytes are out before the next one exists: whole, decodable.
            let frame = ready(&mut body).expect("the event's bytes");
            sent.extend_from_slice(frame.data_ref().unwrap());
            assert_eq!(decoded_so_far(coding, &sent), want, "{coding:?} event {i}");
        }
        drop(tx);
        while let Some(f) = body.frame().await {
            sent.extend_from_slice(f.unwrap().data_ref().unwrap());
        }
        assert_eq!(decode(coding.token(), &sent), want);
    }
}

#[tokio::test]
async fn an_answer_is_flushed_when_its_upstream_pauses() {
    let (tx, rx) = chan();
    let mut body = Box::pin(Encoded::new(rx, Coding::Gzip, 6, None, false).map_err(|_| ()).unwrap());
    tx.send(Ok(Frame::data(Bytes::from_static(b"{\"first\":1}")))).await.unwrap();
    tx.send(Ok(Frame::data(Bytes::from_static(b",{\"second\":2}")))).await.unwrap();
    // Both frames were ready: encoded together, then flushed once the channel had no more.
    let mut sent = Vec::new();
    while let Some(frame) = ready(&mut body) {
        sent.extend_from_slice(frame.data_ref().unwrap());
    }
    assert_eq!(decoded_so_far(Coding::Gzip, &sent), b"{\"first\":1},{\"second\":2}");
    assert!(!body.is_end_stream());
}

#[tokio::test]
async fn trailers_follow_the_last_encoded_bytes() {
    let (tx, rx) = chan();
    let body = Encoded::new(rx, Coding::Zstd, 3, None, false).map_err(|_| ()).unwrap();
    tx.send(Ok(Frame::data(Bytes::from_static(b"hello, hello, hello")))).await.unwrap();
    let mut t = HeaderMap::new();
    t.insert("x-done", HeaderValue::from_static("yes"));
    tx.send(Ok(Frame::trailers(t))).await.unwrap();
    drop(tx);
    let collected = body.collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["x-done"], "yes");
    assert_eq!(decode("zstd", &collected.to_bytes()), b"hello, hello, hello");
}

#[tokio::test]
async fn an_upstream_failure_ends_the_encoded_body_with_it() {
    let (tx, rx) = chan();
    let mut body = Box::pin(Encoded::new(rx, Coding::Br, 4, None, false).map_err(|_| ()).unwrap());
    tx.send(Ok(Frame::data(Bytes::from_static(b"partial")))).await.unwrap();
    tx.send(Err(BodyError::IdleTimeout(std::time::Duration::from_secs(1)))).await.unwrap();
    let mut saw_error = false;
    while let Some(f) = body.frame().await {
        if f.is_err() {
            saw_error = true;
        }
    }
    assert!(saw_error);
    assert!(body.is_end_stream());
}

#[tokio::test]
async fn a_large_frame_is_encoded_a_slice_at_a_time() {
    // 4 MiB of incompressible-enough text in one frame: brotli emits before its end.
    let mut data = Vec::with_capacity(4 << 20);
    let mut x: u32 = 1;
    while data.len() < 4 << 20 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        data.extend_from_slice(format!("{x:08x} ").as_bytes());
    }
    let data = Bytes::from(data);
    let counters = Counters::default();
    let encoded = Encoded::new(Body::full(data.clone()), Coding::Br, 1, None, false).map_err(|_| ()).unwrap();
    let mut body = Box::pin(encoded.counted(counters.clone()));
    let mut sent = Vec::new();
    let mut first = None;
    std::future::poll_fn(|cx| loop {
        match body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                // The first bytes leave before the frame is all encoded.
                first.get_or_insert(counters.bytes_in.get());
                sent.extend_from_slice(f.data_ref().unwrap());
            }
            Poll::Ready(Some(Err(e))) => panic!("{e}"),
            Poll::Ready(None) => return Poll::Ready(()),
            // Gave the worker back: woken at once.
            Poll::Pending => {}
        }
    })
    .await;
    assert!(first.unwrap() < data.len() as u64 / 2, "first bytes after {first:?} of {}", data.len());
    assert_eq!(decode("br", &sent), data);
    assert_eq!(counters.bytes_in.get(), data.len() as u64);
    assert_eq!(counters.bytes_out.get(), sent.len() as u64);
}

#[tokio::test]
async fn a_routes_counters_get_the_bytes_in_and_out() {
    let counters = Counters::default();
    let c = compress().counted(counters.clone());
    let mut resp = answer(&[JSON], big_json());
    c.apply(&accepted("gzip"), Origin::Upstream, &mut resp);
    let sent = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(counters.bytes_in.get(), big_json().len() as u64);
    assert_eq!(counters.bytes_out.get(), sent.len() as u64);
}
