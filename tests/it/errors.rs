//! One error model: every failure is answered by its source (issue 13), one authority and one
//! path per request (issues 14, 22), and the timeouts after the response head (issue 22).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::{full, get_with, proxy_yaml, Tollgate, Upstream};

/// Writes `request` on a fresh connection and reads until the proxy closes it (or 10 s pass).
async fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    read_to_close(&mut s).await
}

async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => panic!("connection still open after 10 s; read so far: {}", String::from_utf8_lossy(&out)),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn problem_type(answer: &str) -> String {
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    let doc: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
    doc["type"].as_str().unwrap_or("").to_owned()
}

async fn metrics(tg: &Tollgate) -> String {
    tg.shared.load().metrics().encode(None)
}

/// An upstream that reads the whole request body before answering with its length.
async fn body_reader() -> Upstream {
    Upstream::start(|req: Request<hyper::body::Incoming>| async move {
        match req.into_body().collect().await {
            Ok(b) => Response::new(full(b.to_bytes().len().to_string())),
            Err(_) => Response::new(full("body failed")),
        }
    })
    .await
}

#[tokio::test]
async fn a_malformed_client_body_is_the_clients_400_not_an_upstream_failure() {
    let up = body_reader().await;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", "  - { name: r, upstream: up }\n")).await;
    let answer =
        exchange(tg.addr, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZ\r\n\r\n")
            .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(problem_type(&answer).ends_with(":bad-request-body"), "{answer}");
    let m = metrics(&tg).await;
    assert!(m.contains(r#"tollgate_errors_total{route="r",source="downstream",kind="client_body"} 1"#), "{m}");
    assert!(m.contains(r#"tollgate_errors_total{route="r",source="upstream",kind="upstream_broken"} 0"#), "{m}");
}

#[tokio::test]
async fn a_client_that_stops_mid_body_gets_400_after_the_body_read_timeout() {
    let up = body_reader().await;
    let yaml = proxy_yaml(up.addr, "", "  - { name: r, upstream: up }\n")
        .replace("routes:", "server: { body_read_timeout: 300ms }\nroutes:");
    let tg = Tollgate::start(&yaml).await;
    let started = Instant::now();
    let answer = exchange(tg.addr, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc").await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("body_read_timeout"), "{answer}");
    // Well before the upstream's 30 s response timeout would have answered 504.
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn a_trailing_dot_host_takes_its_own_route() {
    let yaml = "
upstreams:
  api: { respond: { body: api } }
  rest: { respond: { body: rest } }
routes:
  - { name: api, match: { host: api.example.com }, upstream: api }
  - { name: rest, upstream: rest }
";
    let tg = Tollgate::start(yaml).await;
    for host in ["api.example.com", "API.example.com.", "api.example.com.:8080"] {
        let (status, _, body) = get_with(tg.addr, "/", &[("host", host)]).await;
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"api"[..]), "{host}");
    }
}

/// An upstream that answers with the Host it was sent.
async fn host_echo() -> Upstream {
    Upstream::start(|req: Request<hyper::body::Incoming>| async move {
        let host = req.headers().get("host").map(|h| h.to_str().unwrap_or("").to_owned()).unwrap_or_default();
        Response::new(full(host))
    })
    .await
}

#[tokio::test]
async fn an_absolute_form_target_and_a_host_that_disagree_are_refused() {
    let up = host_echo().await;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", "  - { upstream: up }\n")).await;
    let smuggled = exchange(
        tg.addr,
        b"GET http://public.example.com/x HTTP/1.1\r\nHost: admin.internal\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(smuggled.starts_with("HTTP/1.1 400"), "{smuggled}");
    assert!(!smuggled.contains("admin.internal\r\n\r\n"), "{smuggled}");
    // Agreeing forms are served, and the upstream sees the one canonical authority.
    let agreed = exchange(
        tg.addr,
        b"GET http://Public.Example.com/x HTTP/1.1\r\nHost: public.example.com.\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(agreed.starts_with("HTTP/1.1 200") && agreed.ends_with("\r\n\r\npublic.example.com"), "{agreed}");
    let two = exchange(tg.addr, b"GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n").await;
    assert!(two.starts_with("HTTP/1.1 400"), "{two}");
    let none = exchange(tg.addr, b"GET / HTTP/1.1\r\n\r\n").await;
    assert!(none.starts_with("HTTP/1.1 400"), "{none}");
}

#[tokio::test]
async fn an_h2_authority_and_a_host_field_that_disagree_are_refused() {
    let up = host_echo().await;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", "  - { upstream: up }\n")).await;
    let tcp = TcpStream::connect(tg.addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut send = |host: Option<&str>| {
        let mut req = Request::get("http://public.example.com/page");
        if let Some(h) = host {
            req = req.header("host", h);
        }
        let (resp, _) = client.send_request(req.body(()).unwrap(), true).unwrap();
        resp
    };
    let smuggled = send(Some("admin.internal")).await.unwrap();
    assert_eq!(smuggled.status(), StatusCode::BAD_REQUEST);
    let plain = send(None).await.unwrap();
    assert_eq!(plain.status(), StatusCode::OK);
    let mut body = plain.into_body();
    let mut seen = Vec::new();
    while let Some(chunk) = body.data().await {
        seen.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(seen, b"public.example.com");
}

#[tokio::test]
async fn every_spelling_of_a_limited_path_meets_its_limit() {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let record = seen.clone();
    let up = Upstream::start(move |req: Request<hyper::body::Incoming>| {
        record.lock().unwrap().push(req.uri().to_string());
        async { Response::new(full("ok")) }
    })
    .await;
    let routes = "  - name: api
    match: { path_prefix: /api/ }
    upstream: up
    limits: [{ name: strict, algorithm: token_bucket, rate: 1/h, burst: 1, key: client_ip }]
  - { name: lenient, upstream: up }
";
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", routes)).await;
    let (status, _, _) = get_with(tg.addr, "/api/users", &[]).await;
    assert_eq!(status, StatusCode::OK);
    for path in [
        "/%61pi/users",
        "/x/../api/users",
        "//api/users",
        "/api;v=1/users",
        "/;v=1/api/users",
        "/api/./users",
        "/%2e/api/users",
    ] {
        let (status, _, _) = get_with(tg.addr, path, &[]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{path} escaped the /api/ limit");
    }
    for path in ["/api%2Fusers", "/api%2fusers", "/..%2Fapi/users", "/../api/users", "/a/..;/api/users"] {
        let answer = exchange(tg.addr, format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{path}: {answer}");
    }
    let (status, _, _) = get_with(tg.addr, "/other/%7Ething", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(*seen.lock().unwrap(), ["/api/users", "/other/~thing"], "the upstream sees normalised paths");
}

/// A raw upstream: answers every request on a connection with `head` plus `body`, then
/// holds the connection open without a word. Counts connections.
async fn silent_after(head: &'static str, body: &'static str) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let count = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(body.as_bytes()).await;
                tokio::time::sleep(Duration::from_secs(60)).await;
            });
        }
    });
    (addr, conns)
}

#[tokio::test]
async fn an_upstream_silent_after_its_head_is_cut_off_and_frees_the_slot() {
    let (addr, conns) = silent_after("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", "0123456789").await;
    let yaml = format!(
        "upstreams:\n  up: {{ url: http://{addr}, read_timeout: 300ms }}\nroutes:\n  - {{ name: r, upstream: up, concurrency: 1 }}\n"
    );
    let tg = Tollgate::start(&yaml).await;
    for round in 1..=2 {
        // The head was sent: the client sees its connection closed before the 100 bytes.
        let answer = exchange(tg.addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "round {round}: {answer}");
        assert!(answer.ends_with("0123456789"), "round {round}: {answer}");
    }
    // Round 2 was served, so the slot of round 1 was released; its connection was not reused.
    assert_eq!(conns.load(Ordering::SeqCst), 2);
    let m = metrics(&tg).await;
    assert!(m.contains(r#"tollgate_upstream_read_timeouts_total{upstream="up"} 2"#), "{m}");
}

#[tokio::test]
async fn a_101_nobody_asked_for_is_a_502() {
    let (addr, conns) =
        silent_after("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", "").await;
    let tg = Tollgate::start(&format!("upstreams:\n  up: {{ url: http://{addr} }}\nroutes:\n  - {{ upstream: up }}\n"))
        .await;
    for _ in 0..2 {
        let answer = exchange(tg.addr, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
        assert!(problem_type(&answer).ends_with(":upstream-bad-response"), "{answer}");
    }
    assert_eq!(conns.load(Ordering::SeqCst), 2, "such a connection never returns to the pool");
}

#[tokio::test]
async fn the_problem_type_base_is_the_operators() {
    let yaml = "problems: { type_base: 'https://api.example.com/problems/' }\nupstreams: { d: { respond: {} } }\nroutes: [{ match: { path: /x }, upstream: d }]\n";
    let tg = Tollgate::start(yaml).await;
    let answer = exchange(tg.addr, b"GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
    assert_eq!(problem_type(&answer), "https://api.example.com/problems/no-route");
    let bad = tollgate::config::Config::from_yaml(
        std::path::Path::new("t.yaml"),
        "problems: { type_base: 'no scheme here' }\nupstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n",
    )
    .expect_err("refused");
    assert_eq!((bad.line, bad.path.as_str()), (1, "problems.type_base"), "{bad}");
}
