//! PROXY protocol v1 and v2 headers written by hand: the address they carry becomes the
//! client's (X-Forwarded-For, `client_ip` limits); an untrusted peer is refused.

use std::path::Path;
use std::time::Duration;

use http::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate::config::Config;

use crate::support::{full, Tollgate, Upstream};

async fn xff_upstream() -> Upstream {
    Upstream::start(|req| async move {
        let xff = req.headers().get("x-forwarded-for").and_then(|v| v.to_str().ok()).unwrap_or("-").to_owned();
        Response::new(full(xff))
    })
    .await
}

async fn start(mode: &str, trusted: &str, up: &Upstream) -> Tollgate {
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    proxy_protocol: {mode}\ntrusted_proxies: [{trusted}]\nupstreams: {{ up: {{ url: 'http://{}' }} }}\nroutes:\n  - upstream: up\n    limits: [{{ name: one, algorithm: fixed_window, rate: 1/h, key: client_ip }}]\n",
        up.addr
    );
    Tollgate::start_config(Config::from_yaml(Path::new("test.yaml"), &yaml).unwrap()).await
}

/// Sends `header` and a GET on one connection; the whole answer as text ("" when closed).
async fn exchange(tg: &Tollgate, header: &[u8]) -> String {
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    let mut bytes = header.to_vec();
    bytes.extend_from_slice(b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n");
    s.write_all(&bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

fn v2(ip: [u8; 4], port: u16) -> Vec<u8> {
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x21, 0x11, 0, 12]);
    h.extend_from_slice(&ip);
    h.extend_from_slice(&[127, 0, 0, 1]);
    h.extend_from_slice(&port.to_be_bytes());
    h.extend_from_slice(&8080u16.to_be_bytes());
    h
}

#[tokio::test]
async fn v1_header_from_a_trusted_balancer_names_the_client() {
    let up = xff_upstream().await;
    let tg = start("v1", "127.0.0.1/32", &up).await;
    let a = exchange(&tg, b"PROXY TCP4 203.0.113.7 127.0.0.1 40000 8080\r\n").await;
    assert!(a.starts_with("HTTP/1.1 200") && a.ends_with("203.0.113.7"), "{a}");
    // The limit keys on the carried address: the same client is throttled, another is not.
    let a = exchange(&tg, b"PROXY TCP4 203.0.113.7 127.0.0.1 40001 8080\r\n").await;
    assert!(a.starts_with("HTTP/1.1 429"), "{a}");
    let a = exchange(&tg, b"PROXY TCP6 2001:db8::9 ::1 40001 8080\r\n").await;
    assert!(a.starts_with("HTTP/1.1 200") && a.ends_with("2001:db8::9"), "{a}");
    // No header on a v1 listener, or a v2 one: closed without an answer.
    assert_eq!(exchange(&tg, b"").await, "");
    assert_eq!(exchange(&tg, &v2([198, 51, 100, 1], 1)).await, "");
}

#[tokio::test]
async fn v2_and_optional_headers() {
    let up = xff_upstream().await;
    let tg = start("v2", "127.0.0.0/8", &up).await;
    let a = exchange(&tg, &v2([198, 51, 100, 20], 5555)).await;
    assert!(a.starts_with("HTTP/1.1 200") && a.ends_with("198.51.100.20"), "{a}");
    let tg = start("optional", "127.0.0.0/8", &up).await;
    let a = exchange(&tg, &v2([198, 51, 100, 21], 5555)).await;
    assert!(a.ends_with("198.51.100.21"), "{a}");
    let a = exchange(&tg, b"PROXY TCP4 198.51.100.22 127.0.0.1 1 2\r\n").await;
    assert!(a.ends_with("198.51.100.22"), "{a}");
    // None at all: the socket's address.
    let a = exchange(&tg, b"").await;
    assert!(a.starts_with("HTTP/1.1 200") && a.ends_with("127.0.0.1"), "{a}");
}

#[tokio::test]
async fn an_untrusted_peer_is_refused() {
    let up = xff_upstream().await;
    for mode in ["v1", "optional"] {
        let tg = start(mode, "10.0.0.0/8", &up).await;
        assert_eq!(exchange(&tg, b"PROXY TCP4 203.0.113.7 127.0.0.1 1 2\r\n").await, "", "{mode}");
        let text = tg.shared.load().metrics().encode(None);
        assert!(text.contains("tollgate_proxy_protocol_refused_total{reason=\"untrusted\"} 1"), "{text}");
    }
    // `optional` serves an untrusted peer that sends no header, as itself.
    let tg = start("optional", "10.0.0.0/8", &up).await;
    let a = exchange(&tg, b"").await;
    assert!(a.starts_with("HTTP/1.1 200") && a.ends_with("127.0.0.1"), "{a}");
}

#[test]
fn proxy_protocol_needs_trusted_proxies() {
    let yaml = "listen:\n  - addr: 127.0.0.1:0\n    proxy_protocol: v2\nupstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n";
    let err = Config::from_yaml(Path::new("test.yaml"), yaml).unwrap_err();
    assert_eq!((err.line, err.path.as_str()), (3, "listen[0].proxy_protocol"), "{err}");
}
