//! Routing, header rewriting, streaming bodies and upstream failures.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;

use crate::support::process::Process;
use crate::support::{full, generated, get, h1, proxy_yaml, Tollgate, Upstream};

#[tokio::test]
async fn first_matching_route_wins_and_unmatched_is_404_problem() {
    let yaml = "
upstreams:
  a: { respond: { body: a } }
  b: { respond: { body: b } }
  c: { respond: { body: c } }
routes:
  - { name: api-get, match: { path_prefix: /api/, methods: [GET] }, upstream: a }
  - { name: api-any, match: { path_prefix: /api/ }, upstream: b }
  - { name: host, match: { host: '*.example.com', path: /exact }, upstream: c }
";
    let tg = Tollgate::start(yaml).await;
    let (s, _, b) = get(tg.addr, "/api/x").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"a"[..]));

    let mut send = h1(tg.addr).await;
    let req = Request::post("/api/x").header("host", "x").body(full("")).unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "b");

    let req = Request::get("/exact").header("host", "www.Example.com:8080").body(full("")).unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "c");

    let (s, h, b) = get(tg.addr, "/nothing").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(h["content-type"], "application/problem+json");
    let doc: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(doc["status"], 404);
    assert!(doc["type"].as_str().unwrap().ends_with("no-route"));
}

#[tokio::test]
async fn rewrites_headers_both_ways() {
    let seen: Arc<Mutex<Option<(String, HeaderMap)>>> = Arc::default();
    let record = seen.clone();
    let up = Upstream::start(move |req| {
        let record = record.clone();
        async move {
            *record.lock().unwrap() = Some((req.uri().to_string(), req.headers().clone()));
            Response::builder()
                .header("connection", "x-up-private")
                .header("x-up-private", "secret")
                .header("keep-alive", "timeout=5")
                .header("x-up-public", "ok")
                .body(full("hi"))
                .unwrap()
        }
    })
    .await;
    let yaml = proxy_yaml(up.addr, "", "  - { match: { path_prefix: /api/ }, upstream: up, strip_prefix: true }\n");
    let tg = Tollgate::start(&yaml).await;

    let mut send = h1(tg.addr).await;
    let req = Request::get("/api/users?id=7")
        .header("host", "shop.example.com")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "drop me")
        .header("te", "trailers")
        .header("proxy-authorization", "Basic Zm9v")
        .header("x-forwarded-for", "203.0.113.9")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "admin.internal")
        // Spellings a CGI-style server (WSGI, Rack, PHP) reads as the real fields and merges.
        .header("x_forwarded_for", "10.6.6.6")
        .header("X_Forwarded-Proto", "https")
        .header("x-forwarded_host", "admin.internal")
        .header("x_forwarded_fox", "not a lookalike")
        .header("x-end-to-end", "keep me")
        .body(full(""))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert!(h.get("x-up-private").is_none() && h.get("keep-alive").is_none(), "{h:?}");
    assert_eq!(h["x-up-public"], "ok");
    assert_eq!(h["via"], "1.1 tollgate");

    let (uri, h) = seen.lock().unwrap().clone().unwrap();
    assert_eq!(uri, "/users?id=7");
    for gone in ["x-hop", "te", "proxy-authorization", "connection"] {
        assert!(h.get(gone).is_none(), "{gone} reached the upstream: {h:?}");
    }
    for gone in ["x_forwarded_for", "x_forwarded-proto", "x-forwarded_host"] {
        assert!(h.get(gone).is_none(), "{gone} reached the upstream: {h:?}");
    }
    assert_eq!(h["x_forwarded_fox"], "not a lookalike");
    assert_eq!(h["x-end-to-end"], "keep me");
    assert_eq!(h["host"], "shop.example.com", "the client's Host is kept");
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http", "an untrusted peer cannot claim https");
    // The Host is the client's: no X-Forwarded-Host repeats it, and the client's own is gone.
    assert!(h.get("x-forwarded-host").is_none(), "{h:?}");
    assert_eq!(h["via"], "1.1 tollgate");
}

#[tokio::test]
async fn base_path_and_upstream_host() {
    let seen: Arc<Mutex<Option<(String, String, String)>>> = Arc::default();
    let record = seen.clone();
    let up = Upstream::start(move |req| {
        let record = record.clone();
        async move {
            let header = |n: &str| req.headers().get(n).map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
            *record.lock().unwrap() = Some((req.uri().to_string(), header("host"), header("x-forwarded-host")));
            Response::new(full(""))
        }
    })
    .await;
    let yaml = format!(
        "upstreams:\n  up:\n    url: http://{}/v2/\n    preserve_host: false\nroutes:\n  - {{ upstream: up }}\n",
        up.addr
    );
    let tg = Tollgate::start(&yaml).await;
    get(tg.addr, "/items").await;
    let (uri, host, forwarded_host) = seen.lock().unwrap().clone().unwrap();
    assert_eq!(uri, "/v2/items");
    assert_eq!(host, up.addr.to_string());
    assert_eq!(forwarded_host, "localhost", "the client's Host goes on in X-Forwarded-Host");
}

const MB: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_100_mb_both_ways_with_flat_memory() {
    // The upstream counts the upload and answers with a 100 MB download.
    let up = Upstream::start(|req| async move {
        let mut body = req.into_body();
        let mut received = 0usize;
        while let Some(frame) = body.frame().await {
            received += frame.unwrap().data_ref().map_or(0, Bytes::len);
        }
        Response::builder().header("x-received", received.to_string()).body(generated(100 * MB)).unwrap()
    })
    .await;
    // The proxy in a process of its own: client and upstream stay here, and other tests'
    // memory does not count.
    let tg = Process::start(&proxy_yaml(up.addr, "", "  - { upstream: up }\n")).await;
    // What the first request allocates once is not the body.
    let (s, _, _) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::OK);
    let before = tg.start_peak_rss();

    let mut send = h1(tg.addr).await;
    let req = Request::post("/upload").header("host", "x").body(generated(100 * MB)).unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.headers()["x-received"], (100 * MB).to_string());
    let mut body = resp.into_body();
    let mut got = 0usize;
    while let Some(frame) = body.frame().await {
        got += frame.unwrap().data_ref().map_or(0, Bytes::len);
    }
    assert_eq!(got, 100 * MB);
    // The high-water mark: a body buffered whole and freed before the end still shows.
    // Streamed, the peak is about 1 MiB above the start; either body whole adds 100 MB.
    let peak = tg.peak_rss_kib().saturating_sub(before);
    eprintln!("the proxy's RSS peaked {peak} KiB above its {before} KiB while streaming 200 MB");
    assert!(peak < 16 << 10, "the proxy's RSS peaked {} MiB above its start while streaming 200 MB", peak >> 10);
}

#[tokio::test]
async fn unreachable_upstream_is_502_problem_naming_it() {
    // Bind then drop, so nothing listens on the port.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let yaml = proxy_yaml(port, "    connect_timeout: 1s\n", "  - { upstream: up }\n");
    let tg = Tollgate::start(&yaml).await;
    let (s, h, b) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert_eq!(h["content-type"], "application/problem+json");
    let doc: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(doc["upstream"], "up");
    assert!(!String::from_utf8_lossy(&b).contains(&port.port().to_string()), "the address is not disclosed: {doc}");
}

#[tokio::test]
async fn silent_upstream_is_504() {
    silent_upstream_is_504_after(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn silent_upstream_is_504_on_a_coarse_timeout() {
    silent_upstream_is_504_after(Duration::from_secs(1)).await;
}

async fn silent_upstream_is_504_after(timeout: Duration) {
    let up = Upstream::start(|_req| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Response::new(full(""))
    })
    .await;
    let tg = Tollgate::start(&proxy_yaml(
        up.addr,
        &format!("    timeout: {}ms\n", timeout.as_millis()),
        "  - { upstream: up }\n",
    ))
    .await;
    let asked = std::time::Instant::now();
    let (s, _, b) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT);
    assert!(asked.elapsed() >= timeout, "answered before the {timeout:?} timeout");
    let doc: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert!(doc["type"].as_str().unwrap().ends_with("upstream-timeout"));
}

#[tokio::test]
async fn upstream_closing_mid_body_is_an_error_not_a_short_success() {
    // A raw upstream that promises 1000 bytes, sends 10 and closes.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n0123456789").await;
            let _ = s.shutdown().await;
        }
    });
    let tg = Tollgate::start(&proxy_yaml(addr, "", "  - { upstream: up }\n")).await;
    let mut send = h1(tg.addr).await;
    let resp = send.send_request(Request::get("/").header("host", "x").body(full("")).unwrap()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.into_body().collect().await.is_err(), "a truncated body must surface as an error");
}
