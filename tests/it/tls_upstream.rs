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
