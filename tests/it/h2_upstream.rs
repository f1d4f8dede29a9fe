//! HTTP/2 to `h2c` upstreams, where tollgate's own client (the `h2` crate, driven from each
//! request's future) can go wrong: bodies beyond the flow-control windows both ways, a
//! response that starts before the request body ends, a client gone mid-response (the
//! upstream's stream reset, its place on the connection given back), a connection the
//! upstream GOAWAYs, one whose PINGs go unanswered, fields HTTP/2 refuses, and a client body
//! that fails (the client's 400, not an upstream failure).

use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::support::{full, BoxBody, Tollgate};

/// Generous: only a hang fails it.
const PATIENCE: Duration = Duration::from_secs(20);

fn yaml(up: SocketAddr, h2: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nupstreams:\n  up: {{ url: 'http://{up}', protocol: h2c, timeout: 5s{h2} }}\nroutes:\n  - name: all\n    upstream: up\n"
    )
}

/// `n` bytes that differ from one offset to the next (a shifted or dropped chunk shows).
fn pattern(n: usize) -> Bytes {
    (0..n).map(|i| (i % 251) as u8 ^ (i >> 16) as u8).collect::<Vec<u8>>().into()
}

/// A hyper h2c upstream: `/echo` streams the request body back as it arrives, `/big/N`
/// answers `pattern(N)`, `/read` reads the whole body before answering its length, anything
/// else records its request fields and answers `ok`. It
/// grants each stream only the protocol's initial window (64 KiB), so that a larger body
/// needs flow control.
async fn hyper_upstream(seen: Arc<Mutex<Vec<HeaderMap>>>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let seen = seen.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        let body: BoxBody = if path == "/echo" {
                            req.into_body().map_err(Into::into).boxed()
                        } else if path == "/read" {
                            match req.into_body().collect().await {
                                Ok(b) => full(b.to_bytes().len().to_string()),
                                Err(_) => full("body failed"),
                            }
                        } else if let Some(n) = path.strip_prefix("/big/") {
                            full(pattern(n.parse().unwrap()))
                        } else {
                            seen.lock().unwrap().push(req.headers().clone());
                            full("ok")
                        };
                        Ok::<_, std::convert::Infallible>(Response::new(body))
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .initial_stream_window_size(65_535)
                    .initial_connection_window_size(65_535)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_beyond_the_windows_pass_whole_both_ways() {
    let up = hyper_upstream(Arc::default()).await;
    let tg = Tollgate::start(&yaml(up, "")).await;
    let three_mib = pattern(3 * 1024 * 1024);
    // Up and back through one stream: the upstream's 64 KiB window and tollgate's own 2 MiB.
    let mut h1 = crate::support::h1(tg.addr).await;
    let req = Request::post("/echo").header("host", "a").body(full(three_mib.clone())).unwrap();
    let resp = tokio::time::timeout(PATIENCE, h1.send_request(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = tokio::time::timeout(PATIENCE, resp.into_body().collect()).await.unwrap().unwrap().to_bytes();
    assert!(body == three_mib, "the echoed body differs ({} bytes of {})", body.len(), three_mib.len());
    // Down only, over an HTTP/2 client, twice on the same upstream connection: the windows
    // were given back as the first was handed on.
    let mut send = crate::support::h2(tg.addr).await;
    for _ in 0..2 {
        let req = Request::get(format!("http://a/big/{}", three_mib.len())).body(full("")).unwrap();
        let resp = tokio::time::timeout(PATIENCE, send.send_request(req)).await.unwrap().unwrap();
        let body = tokio::time::timeout(PATIENCE, resp.into_body().collect()).await.unwrap().unwrap().to_bytes();
        assert!(body == three_mib, "the downloaded body differs ({} bytes of {})", body.len(), three_mib.len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_streams_while_the_request_body_is_still_coming() {
    let up = hyper_upstream(Arc::default()).await;
    let tg = Tollgate::start(&yaml(up, "")).await;
    let mut send = crate::support::h2(tg.addr).await;
    let (tx, rx) = mpsc::channel::<Result<hyper::body::Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>>(1);
    let body = http_body_util::StreamBody::new(tokio_stream_from(rx)).boxed();
    let req = Request::post("http://a/echo").body(body).unwrap();
    let resp = tokio::time::timeout(PATIENCE, send.send_request(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "the head came before the request body ended");
    let mut resp = resp.into_body();
    for turn in ["one", "two", "three"] {
        tx.send(Ok(hyper::body::Frame::data(Bytes::from(turn)))).await.unwrap();
        let frame = tokio::time::timeout(PATIENCE, resp.frame()).await.unwrap().unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), turn, "each piece comes back before the next is sent");
    }
    drop(tx);
    let rest = tokio::time::timeout(PATIENCE, resp.collect()).await.unwrap().unwrap().to_bytes();
    assert!(rest.is_empty(), "{rest:?}");
}

fn tokio_stream_from<T: Send + 'static>(mut rx: mpsc::Receiver<T>) -> impl futures_util::Stream<Item = T> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn fields_http2_refuses_never_reach_the_upstream() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let up = hyper_upstream(seen.clone()).await;
    let tg = Tollgate::start(&yaml(up, "")).await;
    let mut send = crate::support::h1(tg.addr).await;
    // A chunked body: `Transfer-Encoding` on the way in.
    let (tx, rx) = mpsc::channel::<Result<hyper::body::Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>>(1);
    tx.send(Ok(hyper::body::Frame::data(Bytes::from("data")))).await.unwrap();
    drop(tx);
    let req = Request::post("/fields")
        .header("host", "a")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "1")
        .header("keep-alive", "timeout=5")
        .header("proxy-connection", "keep-alive")
        .header("te", "trailers, deflate")
        .header("x-kept", "1")
        .body(http_body_util::StreamBody::new(tokio_stream_from(rx)).boxed())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let got = seen.lock().unwrap().pop().unwrap();
    for refused in ["connection", "x-hop", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"] {
        assert!(!got.contains_key(refused), "{refused} reached the upstream: {got:?}");
    }
    assert_eq!(got.get("te").unwrap(), "trailers", "only `te: trailers` goes on over HTTP/2");
    assert_eq!(got.get("x-kept").unwrap(), "1");
}

/// What an `h2`-crate upstream does with a connection once it answered its first stream.
#[derive(Clone, Copy, PartialEq)]
enum After {
    /// Goes on serving.
    Serving,
    /// Sends GOAWAY, finishes what it has, and closes.
    GoingAway,
    /// Stops reading its socket (PINGs go unanswered), and holds it open.
    Freezing,
}

type Handler =
    Arc<dyn Fn(usize, h2::server::SendResponse<Bytes>) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// An h2c upstream on the `h2` crate's server: `handle(n, respond)` answers the `n`th stream
/// (from 0); its first connection does as `after` says. Counts connections; sends on `ended`
/// when one has closed.
async fn h2_upstream(after: After, handle: Handler) -> (SocketAddr, Arc<AtomicUsize>, mpsc::UnboundedReceiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let streams = Arc::new(AtomicUsize::new(0));
    let (ended_tx, ended) = mpsc::unbounded_channel();
    let counted = conns.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            // `after` is the first connection's way only.
            let after = if counted.fetch_add(1, Ordering::Relaxed) == 0 { after } else { After::Serving };
            let (handle, streams, ended_tx) = (handle.clone(), streams.clone(), ended_tx.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else { return };
                let mut first = true;
                while let Some(Ok((_req, respond))) = conn.accept().await {
                    let answered = tokio::spawn(handle(streams.fetch_add(1, Ordering::Relaxed), respond));
                    if std::mem::take(&mut first) {
                        match after {
                            After::Serving => {}
                            After::GoingAway => conn.graceful_shutdown(),
                            After::Freezing => {
                                // Driven a while so the answer goes out, then never again.
                                let _ = answered.await;
                                let drive = async { while conn.accept().await.is_some() {} };
                                let _ = tokio::time::timeout(Duration::from_millis(300), drive).await;
                                let _held = conn;
                                std::future::pending::<()>().await;
                                return;
                            }
                        }
                    }
                }
                let _ = ended_tx.send(());
            });
        }
    });
    (addr, conns, ended)
}

/// Answers `ok` in full.
fn ok(respond: &mut h2::server::SendResponse<Bytes>) {
    let mut send = respond.send_response(Response::new(()), false).unwrap();
    send.send_data(Bytes::from("ok"), true).unwrap();
}

async fn get_ok(send: &mut hyper::client::conn::http2::SendRequest<BoxBody>) {
    let req = Request::get("http://a/").body(full("")).unwrap();
    let resp = tokio::time::timeout(PATIENCE, send.send_request(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_response_resets_the_upstream_stream_and_frees_its_place() {
    let (reset_tx, mut reset) = mpsc::unbounded_channel();
    let handler: Handler = Arc::new(move |n, mut respond| {
        let reset_tx = reset_tx.clone();
        Box::pin(async move {
            if n > 0 {
                return ok(&mut respond);
            }
            let mut send = respond.send_response(Response::new(()), false).unwrap();
            send.send_data(Bytes::from("first"), false).unwrap();
            let _ = reset_tx.send(poll_fn(|cx| send.poll_reset(cx)).await.ok());
        })
    });
    let (up, conns, _) = h2_upstream(After::Serving, handler).await;
    // One stream a connection while a second may be opened: a place not given back would
    // send the next request to a new connection.
    let tg = Tollgate::start(&yaml(up, ", h2: { max_connections: 2, max_streams_per_connection: 1 }")).await;
    let mut send = crate::support::h2(tg.addr).await;
    let resp = send.send_request(Request::get("http://a/").body(full("")).unwrap()).await.unwrap();
    let mut body = resp.into_body();
    let first = tokio::time::timeout(PATIENCE, body.frame()).await.unwrap().unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "first");
    drop(body);
    let reason = tokio::time::timeout(PATIENCE, reset.recv()).await.unwrap().unwrap();
    assert_eq!(reason, Some(h2::Reason::CANCEL), "the upstream's stream was reset");
    get_ok(&mut send).await;
    assert_eq!(conns.load(Ordering::Relaxed), 1, "the abandoned stream's place was given back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_goaway_the_next_request_goes_on_a_new_connection() {
    let handler: Handler = Arc::new(|_, mut respond| Box::pin(async move { ok(&mut respond) }));
    let (up, conns, mut ended) = h2_upstream(After::GoingAway, handler).await;
    let tg = Tollgate::start(&yaml(up, "")).await;
    let mut send = crate::support::h2(tg.addr).await;
    get_ok(&mut send).await;
    tokio::time::timeout(PATIENCE, ended.recv()).await.unwrap().unwrap();
    get_ok(&mut send).await;
    get_ok(&mut send).await;
    assert_eq!(conns.load(Ordering::Relaxed), 2, "one connection after the GOAWAY, kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_pings_go_unanswered_is_dropped() {
    let handler: Handler = Arc::new(|_, mut respond| Box::pin(async move { ok(&mut respond) }));
    let (up, conns, _) = h2_upstream(After::Freezing, handler).await;
    let tg = Tollgate::start(&yaml(up, ", h2: { ping_interval: 100ms, ping_timeout: 200ms }")).await;
    let mut send = crate::support::h2(tg.addr).await;
    get_ok(&mut send).await;
    // The frozen connection is dropped once a PING goes unanswered; until then a request on
    // it fails when the connection is dropped (a 502) or waits for its 5 s timeout (a 504);
    // after, it goes on a new connection.
    let started = std::time::Instant::now();
    loop {
        let req = Request::get("http://a/").body(full("")).unwrap();
        let resp = tokio::time::timeout(PATIENCE, send.send_request(req)).await.unwrap().unwrap();
        if resp.status() == StatusCode::OK {
            break;
        }
        assert!(matches!(resp.status().as_u16(), 502 | 504), "{}", resp.status());
        assert!(started.elapsed() < PATIENCE * 2, "the frozen connection was never dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(conns.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn a_malformed_client_body_is_the_clients_400_not_an_upstream_failure() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = hyper_upstream(Arc::default()).await;
    let tg = Tollgate::start(&yaml(up, "").replace("name: all", "name: r")).await;
    let mut s = tokio::net::TcpStream::connect(tg.addr).await.unwrap();
    s.write_all(b"POST /read HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZ\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, s.read_to_end(&mut answer)).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("bad-request-body"), "{answer}");
    let m = tg.shared.load().metrics().encode(None);
    assert!(m.contains(r#"tollgate_errors_total{route="r",source="downstream",kind="client_body"} 1"#), "{m}");
    assert!(m.contains(r#"tollgate_errors_total{route="r",source="upstream",kind="upstream_broken"} 0"#), "{m}");
}
