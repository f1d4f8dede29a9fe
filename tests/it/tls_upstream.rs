//! `https://` upstreams: verified against a private CA, SNI from the URL or `server_name`,
//! refused when the certificate is not trusted, `tls_insecure_skip_verify`, client
//! certificates, and pooled TLS connections reused (one handshake for many requests).

use std::path::Path;
use std::sync::atomic::Ordering;

use http::{Response, StatusCode};
use tollgate::config::Config;

use crate::support::tls::{y, Ca, Dir, HttpsUpstream};
use crate::support::{full, get, Tollgate};

fn config(yaml: &str) -> Config {
    Config::from_yaml(Path::new("test.yaml"), yaml).unwrap_or_else(|e| panic!("{e}"))
}

fn yaml(upstream: &str) -> String {
    format!("listen: 127.0.0.1:0\nupstreams:\n  up:\n{upstream}routes: [{{ upstream: up }}]\n")
}

#[tokio::test]
async fn https_upstream_verified_by_ca_file_reuses_its_connection() {
    let dir = Dir::new();
    let ca = Ca::new("internal CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let up = HttpsUpstream::start(&ca.issue(&["billing.internal"]), None, |req| {
        Response::new(full(format!("over tls: {}", req.uri().path())))
    })
    .await;
    let tg = Tollgate::start_config(config(&yaml(&format!(
        "    url: https://127.0.0.1:{}\n    ca_file: {}\n    server_name: billing.internal\n",
        up.addr.port(),
        y(&ca_file)
    ))))
    .await;
    let mut send = crate::support::h1(tg.addr).await;
    for i in 0..5 {
        let req = http::Request::get(format!("/r{i}")).header("host", "a").body(full("")).unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
        assert_eq!(body, format!("over tls: /r{i}"));
    }
    assert_eq!(up.connections.load(Ordering::Relaxed), 1, "one pooled TLS connection for five requests");
    assert_eq!(up.handshakes.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn an_untrusted_or_misnamed_upstream_certificate_is_a_502() {
    let dir = Dir::new();
    let ca = Ca::new("internal CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let up = HttpsUpstream::start(&ca.issue(&["billing.internal"]), None, |_| Response::new(full("secret"))).await;
    // The system roots do not know this CA.
    let tg = Tollgate::start_config(config(&yaml(&format!(
        "    url: https://127.0.0.1:{}\n    server_name: billing.internal\n",
        up.addr.port()
    ))))
    .await;
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::BAD_GATEWAY);
    // The right CA, the wrong name (SNI defaults to the URL's host, an IP the certificate lacks).
    let tg = Tollgate::start_config(config(&yaml(&format!(
        "    url: https://127.0.0.1:{}\n    ca_file: {}\n",
        up.addr.port(),
        y(&ca_file)
    ))))
    .await;
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::BAD_GATEWAY);
    // Development: no verification at all, and `check` says so.
    let c =
        config(&yaml(&format!("    url: https://127.0.0.1:{}\n    tls_insecure_skip_verify: true\n", up.addr.port())));
    let tg = Tollgate::start_config(c).await;
    let (status, _, body) = get(tg.addr, "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"secret"[..]));
}

#[tokio::test]
async fn upstream_mtls_presents_the_client_certificate() {
    let dir = Dir::new();
    let ca = Ca::new("internal CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let clients = Ca::new("proxies");
    let (cert, key) = clients.issue(&["proxy.internal"]).write(&dir, "proxy");
    let up = HttpsUpstream::start(&ca.issue(&["billing.internal"]), Some(&clients), |_| Response::new(full("mtls ok")))
        .await;
    let base = format!(
        "    url: https://127.0.0.1:{}\n    ca_file: {}\n    server_name: billing.internal\n",
        up.addr.port(),
        y(&ca_file)
    );
    let tg = Tollgate::start_config(config(&yaml(&base))).await;
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::BAD_GATEWAY, "no client certificate");
    let with = format!("{base}    client_cert: {{ cert: {}, key: {} }}\n", y(&cert), y(&key));
    let tg = Tollgate::start_config(config(&yaml(&with))).await;
    let (status, _, body) = get(tg.addr, "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"mtls ok"[..]));
}

#[test]
fn tls_fields_are_checked_at_load() {
    let dir = Dir::new();
    let err = Config::from_yaml(
        Path::new("test.yaml"),
        &yaml(&format!("    url: https://a.test\n    ca_file: {}\n", y(&dir.path("none.pem")))),
    )
    .unwrap_err();
    assert_eq!(err.path, "upstreams.up.ca_file", "{err}");
    assert!(err.message.contains("none.pem"), "{err}");
    let err = Config::from_yaml(Path::new("test.yaml"), &yaml("    url: http://a.test\n    server_name: a.test\n"))
        .unwrap_err();
    assert!(err.message.contains("applies to https:// upstreams"), "{err}");
    // Port 443 when none is written.
    let c = config(&yaml("    url: https://a.test/v1\n"));
    let tollgate::config::UpstreamKind::Http(h) = &c.upstreams[0].kind else { panic!() };
    assert_eq!(h.authority.as_str(), "a.test:443");
    assert_eq!(h.tls.as_ref().unwrap().server_name, "a.test");
}

/// What the upstream saw: the HTTP version, `:scheme` (HTTP/2 only), the authority and path.
fn seen(req: http::Request<hyper::body::Incoming>) -> Response<crate::support::BoxBody> {
    let host = req.headers().get("host").and_then(|h| h.to_str().ok()).map(str::to_owned);
    let authority = req.uri().authority().map(ToString::to_string).or(host).unwrap_or_default();
    let scheme = req.uri().scheme_str().unwrap_or("-").to_owned();
    Response::new(full(format!("{:?} {scheme} {authority} {}", req.version(), req.uri().path())))
}

fn tls_yaml(port: u16, ca_file: &Path, extra: &str) -> String {
    yaml(&format!(
        "    url: https://127.0.0.1:{port}\n    ca_file: {}\n    server_name: billing.internal\n{extra}",
        y(ca_file)
    ))
}

/// `n` requests at once on one HTTP/2 connection to tollgate; their bodies.
async fn burst(tg: &crate::support::Tollgate, n: usize) -> Vec<String> {
    let send = crate::support::h2(tg.addr).await;
    let calls = (0..n).map(|i| {
        let mut send = send.clone();
        async move {
            let req = http::Request::get(format!("http://a/r{i}")).body(full("")).unwrap();
            let resp = send.send_request(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
            String::from_utf8(body.to_vec()).unwrap()
        }
    });
    futures_util::future::join_all(calls).await
}

#[tokio::test]
async fn protocol_h2_multiplexes_requests_over_one_tls_connection() {
    let dir = Dir::new();
    let ca = Ca::new("internal CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let up = HttpsUpstream::start_alpn(&ca.issue(&["billing.internal"]), None, &[b"h2", b"http/1.1"], seen).await;
    let tg = Tollgate::start_config(config(&tls_yaml(up.addr.port(), &ca_file, "    protocol: h2\n"))).await;
    let got = burst(&tg, 20).await;
    for (i, body) in got.iter().enumerate() {
        assert_eq!(body, &format!("HTTP/2.0 https a /r{i}"));
    }
    // Sequential ones too, over HTTP/1.1 from the client.
    for i in 0..3 {
        let (status, _, body) = get(tg.addr, &format!("/s{i}")).await;
        assert_eq!((status, &body[..]), (StatusCode::OK, format!("HTTP/2.0 https localhost /s{i}").as_bytes()));
    }
    assert_eq!(up.handshakes.load(Ordering::Relaxed), 1, "23 requests as streams on one TLS connection");
}

#[tokio::test]
async fn protocol_auto_speaks_what_alpn_chose() {
    let dir = Dir::new();
    let ca = Ca::new("internal CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let cert = ca.issue(&["billing.internal"]);
    // An h2-capable server: HTTP/2, the whole burst on one connection.
    let h2 = HttpsUpstream::start_alpn(&cert, None, &[b"h2", b"http/1.1"], seen).await;
    let tg = Tollgate::start_config(config(&tls_yaml(h2.addr.port(), &ca_file, "    protocol: auto\n"))).await;
    for (i, body) in burst(&tg, 10).await.iter().enumerate() {
        assert_eq!(body, &format!("HTTP/2.0 https a /r{i}"));
    }
    let (_, _, body) = get(tg.addr, "/later").await;
    assert_eq!(&body[..], b"HTTP/2.0 https localhost /later");
    assert_eq!(h2.handshakes.load(Ordering::Relaxed), 1);
    // An HTTP/1.1-only server: HTTP/1.1, its connection pooled and reused.
    let h1 = HttpsUpstream::start_alpn(&cert, None, &[b"http/1.1"], seen).await;
    let tg = Tollgate::start_config(config(&tls_yaml(h1.addr.port(), &ca_file, "    protocol: auto\n"))).await;
    let mut send = crate::support::h1(tg.addr).await;
    for i in 0..5 {
        let req = http::Request::get(format!("/r{i}")).header("host", "a").body(full("")).unwrap();
        let resp = send.send_request(req).await.unwrap();
        let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
        assert_eq!(body, format!("HTTP/1.1 - a /r{i}"));
    }
    assert_eq!(h1.handshakes.load(Ordering::Relaxed), 1, "one pooled HTTP/1.1 connection for five requests");
}

#[tokio::test]
async fn protocol_h2_against_a_server_that_does_not_choose_h2_is_a_502_problem() {
    let dir = Dir::new();
    let ca = Ca::new("internal CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let cert = ca.issue(&["billing.internal"]);
    // One that answers ALPN with an alert (no protocol in common), one that ignores ALPN.
    for alpn in [&[&b"http/1.1"[..]][..], &[]] {
        let up = HttpsUpstream::start_alpn(&cert, None, alpn, seen).await;
        let tg = Tollgate::start_config(config(&tls_yaml(up.addr.port(), &ca_file, "    protocol: h2\n"))).await;
        let (status, headers, body) = get(tg.addr, "/").await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "server ALPN {alpn:?}");
        assert_eq!(headers["content-type"], "application/problem+json");
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(body.contains("did not choose HTTP/2 (ALPN `h2`)"), "{body}");
        // `auto` falls back to HTTP/1.1 on the same server.
        let tg = Tollgate::start_config(config(&tls_yaml(up.addr.port(), &ca_file, "    protocol: auto\n"))).await;
        let (status, _, body) = get(tg.addr, "/x").await;
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"HTTP/1.1 - localhost /x"[..]));
    }
}

#[test]
fn protocols_are_checked_against_the_url_scheme() {
    let err = |up: &str| Config::from_yaml(Path::new("test.yaml"), &yaml(up)).unwrap_err();
    let e = err("    url: http://a.test\n    protocol: h2\n");
    assert_eq!(e.path, "upstreams.up.protocol", "{e}");
    assert!(e.message.contains("this upstream is http://") && e.message.contains("use `h2c`"), "{e}");
    assert_eq!((e.line, e.column), (5, 15), "{e}");
    let e = err("    url: https://a.test\n    protocol: h2c\n");
    assert_eq!(e.path, "upstreams.up.protocol", "{e}");
    assert!(e.message.contains("this upstream is https://") && e.message.contains("use `h2`"), "{e}");
    let e = err("    url: https://a.test\n    h2: { max_connections: 2 }\n");
    assert_eq!(e.path, "upstreams.up.h2", "{e}");
    for ok in ["protocol: h2\n    h2: { max_connections: 2 }", "protocol: auto\n    h2: { ping_interval: 0s }"] {
        config(&yaml(&format!("    url: https://a.test\n    {ok}\n")));
    }
    let c = config(&yaml("    url: https://a.test\n    protocol: auto\n"));
    let tollgate::config::UpstreamKind::Http(h) = &c.upstreams[0].kind else { panic!() };
    assert_eq!(h.protocol, tollgate::config::UpstreamProtocol::Auto);
    let c = config(&yaml("    url: http://a.test\n    protocol: auto\n"));
    let tollgate::config::UpstreamKind::Http(h) = &c.upstreams[0].kind else { panic!() };
    assert_eq!(h.protocol, tollgate::config::UpstreamProtocol::Http1, "auto without TLS is HTTP/1.1");
}

#[tokio::test]
async fn a_group_of_https_servers_shares_one_verified_name() {
    let dir = Dir::new();
    let ca = Ca::new("internal CA");
    let ca_file = ca.write(&dir, "ca.pem");
    let cert = ca.issue(&["billing.internal"]);
    let a = HttpsUpstream::start(&cert, None, |_| Response::new(full("a"))).await;
    let b = HttpsUpstream::start(&cert, None, |_| Response::new(full("b"))).await;
    let tg = Tollgate::start_config(config(&yaml(&format!(
        "    servers: [{{ url: 'https://127.0.0.1:{}' }}, {{ url: 'https://127.0.0.1:{}' }}]\n    balance: round_robin\n    ca_file: {}\n    server_name: billing.internal\n",
        a.addr.port(),
        b.addr.port(),
        y(&ca_file)
    ))))
    .await;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        let (status, _, body) = get(tg.addr, "/").await;
        assert_eq!(status, StatusCode::OK);
        seen.insert(body);
    }
    assert_eq!(seen.len(), 2, "both servers answered over verified TLS");
    assert!(a.handshakes.load(Ordering::Relaxed) >= 1 && b.handshakes.load(Ordering::Relaxed) >= 1);
}
