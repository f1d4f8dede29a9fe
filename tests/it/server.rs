//! The listener: h2c, header limits, graceful shutdown.

use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{full, h2, proxy_yaml, Tollgate, Upstream};

#[tokio::test]
async fn serves_h2c_with_prior_knowledge() {
    let up = Upstream::start(|req| async move {
        // The upstream side is HTTP/1.1 and sees the client's authority as Host.
        let host = req.headers().get("host").map(|h| h.to_str().unwrap().to_owned()).unwrap_or_default();
        Response::new(full(format!("{:?} {host}", req.version())))
    })
    .await;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", "  - { upstream: up }\n")).await;
    let mut send = h2(tg.addr).await;
    let mut waiting = Vec::new();
    for _ in 0..10 {
        let req = Request::get(format!("http://api.test:{}/", tg.addr.port())).body(full("")).unwrap();
        waiting.push(send.send_request(req));
    }
    for resp in waiting {
        let resp = resp.await.unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_2);
        assert_eq!(resp.headers()["via"], "1.1 tollgate");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, format!("HTTP/1.1 api.test:{}", tg.addr.port()));
    }
}

#[tokio::test]
async fn oversized_request_head_is_431() {
    let tg = Tollgate::start("upstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n").await;
    let mut s = tokio::net::TcpStream::connect(tg.addr).await.unwrap();
    let big = "a".repeat(40 * 1024);
    let req = format!("GET / HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\n\r\n");
    let _ = s.write_all(req.as_bytes()).await;
    let mut buf = vec![0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 431"), "{head}");
}

/// Sends half a head and never the rest: the proxy must close the connection (or answer
/// 408) on its own, not before `timeout` and not long after it. The bound above is loose
/// for a loaded machine yet fails a timer seconds late, which a fixed 10 s would let pass.
async fn head_is_cut_off_after(timeout: Duration) {
    let yaml = format!(
        "server: {{ header_read_timeout: {}ms }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n",
        timeout.as_millis()
    );
    let tg = Tollgate::start(&yaml).await;
    let slack = Duration::from_secs(2);
    // Before the connect: the proxy's clock starts at the accept, which comes later.
    let started = std::time::Instant::now();
    let mut s = tokio::net::TcpStream::connect(tg.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut buf = vec![0u8; 1024];
    let read = tokio::time::timeout(timeout + slack, s.read(&mut buf)).await;
    let closed_after = started.elapsed();
    match read {
        Ok(Ok(n)) => {
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "unexpected answer: {text}");
        }
        Ok(Err(_)) => {}
        Err(_) => panic!("connection still open {:?} after a {timeout:?} header timeout", timeout + slack),
    }
    assert!(closed_after >= timeout, "cut off after {closed_after:?}, before the {timeout:?} header timeout");
}

#[tokio::test]
async fn slow_client_head_is_cut_off() {
    head_is_cut_off_after(Duration::from_millis(300)).await;
}

#[tokio::test]
async fn slow_client_head_is_cut_off_by_a_coarse_timeout() {
    // A second or more runs on the coarse clock (src/timer.rs), not on tokio's.
    head_is_cut_off_after(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_request() {
    let up = Upstream::start(|_req| async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        Response::new(full("finished"))
    })
    .await;
    let mut tg = Tollgate::start(&proxy_yaml(up.addr, "", "  - { upstream: up }\n")).await;
    let addr = tg.addr;
    let in_flight = tokio::spawn(async move { crate::support::get(addr, "/slow").await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let server = tg.shutdown();
    // New connections are refused once the listener is gone.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "still accepting after shutdown");
    let (status, _, body) = in_flight.await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"finished"[..]));
    tokio::time::timeout(Duration::from_secs(10), server).await.expect("server drains and returns").unwrap();
}
