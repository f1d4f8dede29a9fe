//! The listener against slow, idle, silent and numerous clients: protocol detection under
//! the header deadline, keep-alive apart from the head read, h2 idle and ping timeouts, the
//! send timeout, the admin listener, `max_connections`, slow readers and reloads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate::config::Config;
use tollgate::Proxy;

use crate::h2_abuse::raw::{self, Raw};
use crate::support::{full, h1, h2, proxy_yaml, BoxBody, Tollgate, Upstream};

/// A config whose only route answers `ok` itself, with `server` as the `server:` section.
fn yaml(server: &str) -> String {
    format!(
        "server: {{ {server} }}\nupstreams: {{ d: {{ respond: {{ body: ok }} }}, slow: {{ respond: {{ body: late, latency: 30s }} }} }}\nroutes:\n  - {{ match: {{ path_prefix: /slow }}, upstream: slow }}\n  - {{ upstream: d }}\n"
    )
}

/// Reads and discards until the server closes `s` (EOF or an error); false if it is still
/// open after `within`.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// True when `s` is still open at `until` (nothing but data read before then).
async fn open_until(s: &mut TcpStream, until: Instant) -> bool {
    !closed_within(s, until.saturating_duration_since(Instant::now())).await
}

/// One `GET /` on an open HTTP/1.1 connection; returns the response head and body text.
async fn roundtrip(s: &mut TcpStream) -> String {
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.ends_with(b"\r\n\r\nok") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("an answer within 5 s")
            .unwrap();
        assert!(n > 0, "closed before the answer: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

fn timeouts(tg: &Tollgate, kind: &str) -> u64 {
    let p = tg.shared.load();
    let t = &p.metrics().connections().timeouts;
    match kind {
        "header_read" => t.header_read.get(),
        "keepalive" => t.keepalive.get(),
        "send" => t.send.get(),
        "h2_idle" => t.h2_idle.get(),
        "h2_ping" => t.h2_ping.get(),
        _ => unreachable!(),
    }
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_the_header_read_timeout() {
    let tg = Tollgate::start(&yaml("header_read_timeout: 300ms")).await;
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(10)).await, "a silent connection is still open after 10 s");
    assert!(timeouts(&tg, "header_read") >= 1);
}

#[tokio::test]
async fn part_of_the_h2_preface_trickled_byte_by_byte_does_not_extend_the_deadline() {
    let tg = Tollgate::start(&yaml("header_read_timeout: 500ms")).await;
    // All of the preface but its last byte, one byte every 100 ms: 2.3 s of trickle.
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    let started = Instant::now();
    let mut closed = false;
    for b in &raw::PREFACE[..23] {
        if s.write_all(&[*b]).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(closed || closed_within(&mut s, Duration::from_secs(10)).await, "a partial preface held the connection");
    // The deadline counts from the accept, not from the last byte.
    assert!(started.elapsed() < Duration::from_secs(8), "closed only after {:?}", started.elapsed());
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    s.write_all(&raw::PREFACE[..16]).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(10)).await, "half a preface held the connection");
}

#[tokio::test]
async fn an_idle_keep_alive_connection_outlives_the_header_timeout_until_the_keepalive_timeout() {
    let tg = Tollgate::start(&yaml("header_read_timeout: 300ms, keepalive_timeout: 2s")).await;
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    assert!(roundtrip(&mut s).await.starts_with("HTTP/1.1 200"));
    // Three header timeouts of idleness: hyper's own timer alone would have closed it.
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(roundtrip(&mut s).await.starts_with("HTTP/1.1 200"), "the kept-alive connection was closed");
    let idle_from = Instant::now();
    assert!(open_until(&mut s, idle_from + Duration::from_millis(1500)).await, "closed before keepalive_timeout");
    assert!(closed_within(&mut s, Duration::from_secs(10)).await, "an idle connection outlived keepalive_timeout");
    assert!(timeouts(&tg, "keepalive") >= 1);
}

/// `keepalive_timeout: 0` is the documented way to turn keep-alive off: the config loads (it
/// is no HTTP/2 field's zero), an HTTP/1.1 answer says `connection: close` and the connection
/// ends after it, and h2c keeps serving on its own idle timeout.
#[tokio::test]
async fn keepalive_timeout_zero_turns_http1_keep_alive_off() {
    let config = Config::from_yaml(std::path::Path::new("t.yaml"), &yaml("keepalive_timeout: 0"))
        .unwrap_or_else(|e| panic!("the documented value is refused: {e}"));
    assert_eq!(config.server.keepalive_timeout, Duration::ZERO);
    assert_eq!(config.server.h2.idle_timeout, Duration::from_secs(75), "HTTP/2 idles for the default");
    let tg = Tollgate::start_config(config).await;
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    let answer = roundtrip(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "{answer}");
    assert!(closed_within(&mut s, Duration::from_secs(10)).await, "the connection was kept alive");
    let mut c = h2(tg.addr).await;
    for _ in 0..2 {
        let resp = c.send_request(Request::get("http://x/").body(full("")).unwrap()).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
    }
    // Its own zero is still the HTTP/2 field's mistake, named as such.
    let e = Config::from_yaml(std::path::Path::new("t.yaml"), &yaml("h2: { idle_timeout: 0 }")).unwrap_err();
    assert_eq!(e.path, "server.h2.idle_timeout", "{e}");
}

#[tokio::test]
async fn an_http1_connection_parked_while_idle_serves_what_comes_next_and_closes_on_shutdown() {
    let mut tg = Tollgate::start(&yaml("keepalive_timeout: 60s")).await;
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    assert!(roundtrip(&mut s).await.starts_with("HTTP/1.1 200"));
    // Idle past the park delay (1 s): hyper's connection is taken apart, the socket kept.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Two pipelined requests wake it: both answered, in order, on the same connection.
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches("\r\n\r\nok").count() < 2 {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("answers").unwrap();
        assert!(n > 0, "closed before the answers: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(String::from_utf8_lossy(&got).matches("HTTP/1.1 200").count(), 2);
    // A head that arrives in pieces after another park.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    s.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(roundtrip_rest(&mut s, b"host: x\r\n\r\n").await.starts_with("HTTP/1.1 200"));
    // Parked again, it is closed at once when the server shuts down.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let done = tg.shutdown();
    assert!(closed_within(&mut s, Duration::from_secs(5)).await, "a parked connection held the shutdown");
    tokio::time::timeout(Duration::from_secs(5), done).await.expect("shutdown finished").unwrap();
    assert_eq!(timeouts(&tg, "keepalive"), 0);
}

/// Sends the rest of a request and reads its answer.
async fn roundtrip_rest(s: &mut TcpStream, rest: &[u8]) -> String {
    s.write_all(rest).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.ends_with(b"\r\n\r\nok") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("an answer").unwrap();
        assert!(n > 0, "closed before the answer: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn a_head_begun_late_in_the_keep_alive_wait_gets_the_whole_header_timeout() {
    let tg = Tollgate::start(&yaml("header_read_timeout: 1s, keepalive_timeout: 2s")).await;
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    assert!(roundtrip(&mut s).await.starts_with("HTTP/1.1 200"));
    let idle_from = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let begun = Instant::now();
    // Past the keep-alive deadline (idle_from + 2 s), the head still has its second.
    let checkpoint = (idle_from + Duration::from_millis(2300)).max(begun + Duration::from_millis(300));
    assert!(checkpoint < begun + Duration::from_secs(1), "the test itself ran too slowly to tell");
    assert!(open_until(&mut s, checkpoint).await, "the head was cut off by the keep-alive deadline");
    // But a slow head is not let run past header_read_timeout from its first byte.
    assert!(closed_within(&mut s, Duration::from_secs(10)).await, "a partial head was held");
    assert!(timeouts(&tg, "header_read") >= 1);
}

#[tokio::test]
async fn an_idle_h2_connection_is_closed_after_its_idle_timeout() {
    let tg = Tollgate::start(&yaml("h2: { idle_timeout: 1s }")).await;
    let stream = TcpStream::connect(tg.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake::<_, _, BoxBody>(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    let conn = tokio::spawn(conn);
    let resp = send.send_request(Request::get("http://x/").body(full("")).unwrap()).await.unwrap();
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
    let idle_from = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    assert!(ended.is_ok(), "an idle h2 connection is still open 10 s after a 1 s idle timeout");
    assert!(idle_from.elapsed() >= Duration::from_millis(900), "closed early: {:?}", idle_from.elapsed());
    assert!(timeouts(&tg, "h2_idle") >= 1);
}

#[tokio::test]
async fn an_h2_stream_in_progress_keeps_its_connection_from_idling_out() {
    // Each of these outlasts the idle timeout: an answer that takes 2.5 s to start, and one
    // whose body takes 2.5 s to end.
    let up = Upstream::start(|req| async move {
        if req.uri().path() == "/slow-head" {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            return Response::new(full("late"));
        }
        let frames = futures_util::stream::unfold(0, |i| async move {
            if i == 5 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            Some((Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Frame::data(Bytes::from_static(b"x"))), i + 1))
        });
        Response::new(http_body_util::BodyExt::boxed(http_body_util::StreamBody::new(frames)))
    })
    .await;
    let tg = Tollgate::start(
        &proxy_yaml(up.addr, "", "  - { upstream: up }\n")
            .replace("listen: 127.0.0.1:0\n", "listen: 127.0.0.1:0\nserver: { h2: { idle_timeout: 1s } }\n"),
    )
    .await;
    let mut send = h2(tg.addr).await;
    for (path, body) in [("/slow-head", "late"), ("/slow-body", "xxxxx")] {
        let resp = send.send_request(Request::get(format!("http://x{path}")).body(full("")).unwrap()).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), body);
    }
    // No GOAWAY came while they ran: the connection still takes new streams.
    let resp = send.send_request(Request::get("http://x/").body(full("")).unwrap()).await;
    assert!(resp.is_ok(), "the connection idled out under a running stream: {resp:?}");
    assert_eq!(timeouts(&tg, "h2_idle"), 0);
}

#[tokio::test]
async fn an_h2_client_that_does_not_answer_pings_is_closed() {
    let tg = Tollgate::start(&yaml("h2: { idle_timeout: 60s, ping_interval: 300ms, ping_timeout: 500ms }")).await;
    let mut c = Raw::connect(tg.addr).await;
    // A stream that stays open for 30 s, so only the ping can end the connection.
    c.send(&raw::frame(raw::HEADERS, raw::END_HEADERS | raw::END_STREAM, 1, &raw::request_block("/slow"))).await;
    c.answer_pings = false;
    let ending = c.ending(Duration::from_secs(10)).await;
    assert!(c.pings_seen > 0, "the server sent no PING");
    assert!(!matches!(ending, raw::Ending::Open), "still open 10 s after an unanswered ping");
    assert!(timeouts(&tg, "h2_ping") >= 1);
}

#[tokio::test]
async fn a_client_that_stops_reading_is_closed_after_the_send_timeout() {
    const TOTAL: usize = 64 << 20;
    let up = Upstream::start(|_req| async { Response::new(crate::support::generated(TOTAL)) }).await;
    let tg = Tollgate::start(
        &proxy_yaml(up.addr, "", "  - { upstream: up }\n")
            .replace("listen: 127.0.0.1:0\n", "listen: 127.0.0.1:0\nserver: { send_timeout: 1s }\n"),
    )
    .await;
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    // Read nothing for a while: the proxy's writes stall, and the send timeout runs.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut got = 0;
    let mut buf = vec![0u8; 1 << 20];
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the stalled connection was not closed");
    assert!(got < TOTAL, "the whole body arrived ({got} bytes): nothing timed out");
    assert!(timeouts(&tg, "send") >= 1);
}

#[tokio::test]
async fn the_admin_listener_cuts_off_silent_connections_and_partial_heads() {
    let tg = Tollgate::start(&yaml("header_read_timeout: 300ms")).await;
    let admin = tg.start_admin().await;
    let mut silent = TcpStream::connect(admin).await.unwrap();
    let mut partial = TcpStream::connect(admin).await.unwrap();
    partial.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut preface = TcpStream::connect(admin).await.unwrap();
    preface.write_all(&raw::PREFACE[..10]).await.unwrap();
    for (what, s) in [("silent", &mut silent), ("partial head", &mut partial), ("partial preface", &mut preface)] {
        assert!(closed_within(s, Duration::from_secs(10)).await, "admin: a {what} connection is still open");
    }
    // And it still answers.
    let (status, _, _) = crate::support::get(admin, "/healthz").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn connections_past_max_connections_are_closed_at_once_and_counted() {
    let tg = Tollgate::start(&yaml("max_connections: 2")).await;
    let conns = || tg.shared.load().metrics().connections().clone();
    let mut a = TcpStream::connect(tg.addr).await.unwrap();
    let mut b = TcpStream::connect(tg.addr).await.unwrap();
    assert!(roundtrip(&mut a).await.starts_with("HTTP/1.1 200"));
    assert!(roundtrip(&mut b).await.starts_with("HTTP/1.1 200"));
    assert_eq!(conns().open.get(), 2);
    let mut c = TcpStream::connect(tg.addr).await.unwrap();
    let _ = c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await;
    let mut buf = [0u8; 64];
    let refused = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await;
    assert!(matches!(refused, Ok(Ok(0) | Err(_))), "the third connection was not closed at once: {refused:?}");
    assert_eq!(conns().refused.get(), 1);
    assert_eq!(conns().open.get(), 2);
    let admin = tg.start_admin().await;
    let (_, _, text) = crate::support::get(admin, "/metrics").await;
    let text = String::from_utf8_lossy(&text);
    for line in [
        "tollgate_connections_refused_total 1",
        "tollgate_connections_open 2",
        "tollgate_connections_accepted_total{worker=\"0\"} 2",
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in /metrics:\n{text}");
    }
    assert!(text.contains("tollgate_connection_timeouts_total{kind=\"keepalive\"} 0"), "{text}");
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(5);
    while conns().open.get() > 1 {
        assert!(Instant::now() < deadline, "a closed connection is still counted as open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut d = TcpStream::connect(tg.addr).await.unwrap();
    assert!(roundtrip(&mut d).await.starts_with("HTTP/1.1 200"), "a free slot is not reused");
    assert!(roundtrip(&mut b).await.starts_with("HTTP/1.1 200"));
}

#[tokio::test]
async fn a_reload_applies_server_settings_to_new_connections() {
    let tg = Tollgate::start(&yaml("header_read_timeout: 30s")).await;
    let conns = || tg.shared.load().metrics().connections().clone();
    let before = TcpStream::connect(tg.addr).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while conns().open.get() != 1 {
        assert!(Instant::now() < deadline, "the first connection was not accepted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let old = tg.shared.load_full();
    let config =
        Config::from_yaml(std::path::Path::new("t.yaml"), &yaml("header_read_timeout: 2s, max_connections: 3"))
            .unwrap();
    tg.shared.store(Arc::new(Proxy::build(config, old.clock().clone(), old.metrics().clone(), Some(&old))));
    let mut after = TcpStream::connect(tg.addr).await.unwrap();
    assert!(closed_within(&mut after, Duration::from_secs(10)).await, "a new connection kept the old timeout");
    // max_connections too: `before` (under the old settings) and two more fill it.
    let _more = [TcpStream::connect(tg.addr).await.unwrap(), TcpStream::connect(tg.addr).await.unwrap()];
    let deadline = Instant::now() + Duration::from_secs(5);
    while conns().open.get() != 3 {
        assert!(Instant::now() < deadline, "{} connections open, expected 3", conns().open.get());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _refused = TcpStream::connect(tg.addr).await.unwrap();
    while conns().refused.get() != 1 {
        assert!(Instant::now() < deadline, "max_connections of the reloaded config did not apply");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(before);
}

/// The answer of [`counting_upstream`].
const BODY: usize = 64 << 20;

/// A 64 MiB answer whose frames count into `produced` as the upstream's hyper takes them.
async fn counting_upstream(produced: Arc<AtomicU64>) -> Upstream {
    const TOTAL: usize = BODY;
    Upstream::start(move |_req| {
        let produced = produced.clone();
        async move {
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            let frames = futures_util::stream::iter((0..TOTAL / chunk.len()).map(move |_| {
                produced.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Frame::data(chunk.clone()))
            }));
            Response::new(http_body_util::BodyExt::boxed(http_body_util::StreamBody::new(frames)))
        }
    })
    .await
}

/// Waits until `produced` stops moving, then returns it.
async fn settled(produced: &AtomicU64) -> u64 {
    let mut last = produced.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = produced.load(Ordering::Relaxed);
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// Bytes the kernel holds for the TCP connections of `ports` (either end on one of them):
/// what was sent and not yet acknowledged, and what was received and not yet read, from
/// `/proc/net/tcp` (listening sockets left out).
fn queued_in_sockets(ports: &[u16]) -> u64 {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let port = |addr: &str| addr.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
    let hex = |v: &str| u64::from_str_radix(v, 16).unwrap_or(0);
    table
        .lines()
        .skip(1)
        .filter_map(|row| {
            let f: Vec<&str> = row.split_whitespace().collect();
            let (local, remote, state, queues) = (port(f.get(1)?)?, port(f.get(2)?)?, *f.get(3)?, *f.get(4)?);
            let ours = ports.contains(&local) || ports.contains(&remote);
            let (tx, rx) = queues.split_once(':')?;
            (ours && state != "0A").then(|| hex(tx) + hex(rx))
        })
        .sum()
}

/// What the proxy and the two hyper ends may hold besides the kernel's socket queues: a few
/// 64 KiB frames in each, hyper's HTTP/1 write buffer, an HTTP/2 stream's send buffer
/// (`max_send_buffer`, 400 KiB) and the client's receive window (1 MiB).
const FRAMES_SLACK: u64 = 4 << 20;

/// Reads 4 MiB of `body` a frame every 2 ms, then checks how far the upstream ran ahead: by
/// the bytes the kernel queues on the two connections (measured: Linux grows a slow reader's
/// buffers as it likes, up to `tcp_rmem`'s 32 MiB here) and a few frames, never by the rest
/// of the 64 MiB body.
async fn read_slowly(mut body: hyper::body::Incoming, produced: &AtomicU64, ports: &[u16]) {
    let mut read = 0u64;
    while read < (4 << 20) {
        let frame = body.frame().await.unwrap().unwrap();
        read += frame.data_ref().map_or(0, |d| d.len() as u64);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let ahead = settled(produced).await - read;
    let queued = queued_in_sockets(ports);
    eprintln!("slow reader: the upstream ran {} KiB ahead; {} KiB queued in the sockets", ahead >> 10, queued >> 10);
    assert!(
        ahead <= queued + FRAMES_SLACK,
        "the upstream ran {} KiB ahead of a slow client, {} KiB more than the sockets hold",
        ahead >> 10,
        (ahead - queued) >> 10
    );
    // The check means something only while the body is larger than what the buffers hold.
    assert!(queued + FRAMES_SLACK < BODY as u64 - read, "{} KiB queued in the sockets", queued >> 10);
}

#[tokio::test]
async fn a_slow_http1_reader_holds_the_upstream_back() {
    let produced = Arc::new(AtomicU64::new(0));
    let up = counting_upstream(produced.clone()).await;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", "  - { upstream: up }\n")).await;
    let mut send = h1(tg.addr).await;
    let resp = send.send_request(Request::get("/").header("host", "x").body(full("")).unwrap()).await.unwrap();
    read_slowly(resp.into_body(), &produced, &[up.addr.port(), tg.addr.port()]).await;
}

#[tokio::test]
async fn a_slow_h2_reader_holds_the_upstream_back() {
    let produced = Arc::new(AtomicU64::new(0));
    let up = counting_upstream(produced.clone()).await;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", "  - { upstream: up }\n")).await;
    let mut send = h2(tg.addr).await;
    let resp = send.send_request(Request::get("http://x/").body(full("")).unwrap()).await.unwrap();
    read_slowly(resp.into_body(), &produced, &[up.addr.port(), tg.addr.port()]).await;
}

#[test]
fn server_settings_are_checked_where_they_are_written() {
    let path = std::path::Path::new("t.yaml");
    for (server, field) in [
        ("max_connections: 0", "server.max_connections"),
        ("workers: 0", "server.workers"),
        ("workers: many", "server.workers"),
        ("workers: 5000", "server.workers"),
        ("send_timeout: 0", "server.send_timeout"),
        ("h2: { max_frame_size: 1KiB }", "server.h2.max_frame_size"),
        ("h2: { initial_connection_window: 1000 }", "server.h2.initial_connection_window"),
        ("h2: { initial_stream_window: 4GiB }", "server.h2.initial_stream_window"),
        ("h2: { max_concurrent_streams: 0 }", "server.h2.max_concurrent_streams"),
        ("h2: { ping_timeout: 0 }", "server.h2.ping_timeout"),
        ("h2: { max_streams: 10 }", "server.h2"),
    ] {
        let err = Config::from_yaml(path, &yaml(server)).expect_err(server);
        assert!(err.path.starts_with(field), "{server}: {err}");
        assert_eq!(err.line, 1, "{server}: {err}");
    }
    let c = Config::from_yaml(path, &yaml("keepalive_timeout: 20s, max_header_bytes: 32768")).unwrap();
    assert_eq!(c.server.h2.idle_timeout, Duration::from_secs(20), "h2 idles out like HTTP/1 by default");
    assert_eq!(c.server.h2.max_header_list_size, 32768);
    assert_eq!(c.server.h2.ping_interval, Duration::from_secs(30));
    assert_eq!(c.server.workers, tollgate::config::Workers::Auto);
    for (text, workers) in
        [("workers: auto", tollgate::config::Workers::Auto), ("workers: 2", tollgate::config::Workers::Count(2))]
    {
        assert_eq!(Config::from_yaml(path, &yaml(text)).unwrap().server.workers, workers, "{text}");
    }
}
