//! What every protocol owes a client whatever made the answer: a HEAD answer has the GET's
//! fields and no content (HTTP/1.1, h2c, h2 over TLS, HTTP/3), and an answer made before the
//! request body arrived keeps (or announces that it closes) an HTTP/1.1 connection.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use tollgate::config::Config;

use crate::support::quic::H3;
use crate::support::raw::{get_request, RawClient};
use crate::support::tls::{client_config, connect, Ca, Client, Dir};
use crate::support::{full, h1, h2, BoxBody, Tollgate, Upstream};

/// Routes: `/r` the responder, `/limited` the responder under a limit of one request an hour
/// for everyone, `/up` an upstream, `/dead` one that cannot be reached; anything else is no
/// route's. A plain listener (HTTP/1.1,
/// h2c) and a TLS one with HTTP/3.
fn yaml(up: std::net::SocketAddr) -> String {
    format!(
        "listen:
  - addr: 127.0.0.1:0
  - addr: 127.0.0.1:0
    tls: {{ certificates: [{{ cert: api.pem, key: api.key }}] }}
    http3: true
upstreams:
  up: {{ url: 'http://{up}' }}
  dead: {{ url: 'http://127.0.0.1:1' }}
  say: {{ respond: {{ status: 200, headers: {{ content-type: text/plain }}, body: \"hello from the responder\\n\" }} }}
routes:
  - {{ name: responder, match: {{ path_prefix: /r }}, upstream: say }}
  - name: limited
    match: {{ path_prefix: /limited }}
    upstream: say
    limits: [{{ name: one, algorithm: fixed_window, rate: 1/h, key: route }}]
  - {{ name: relayed, match: {{ path_prefix: /up }}, upstream: up }}
  - {{ name: unreachable, match: {{ path_prefix: /dead }}, upstream: dead }}
"
    )
}

struct Site {
    _dir: Dir,
    ca: Ca,
    tg: Tollgate,
    _up: Upstream,
}

async fn site() -> Site {
    let up = Upstream::fixed("from the upstream").await;
    let dir = Dir::new();
    let ca = Ca::new("test CA");
    ca.issue(&["api.test"]).write(&dir, "api");
    let file = dir.write("proxy.yaml", &yaml(up.addr));
    let tg = Tollgate::start_config(Config::load(&file).unwrap_or_else(|e| panic!("{e}"))).await;
    Site { _dir: dir, ca, tg, _up: up }
}

/// One client connection of each kind.
enum Conn {
    H1(hyper::client::conn::http1::SendRequest<BoxBody>),
    H2(hyper::client::conn::http2::SendRequest<BoxBody>, &'static str),
    H3(H3),
}

type Answer = (StatusCode, HeaderMap, Bytes);

impl Conn {
    async fn ask(&mut self, method: Method, path: &str) -> Result<Answer, String> {
        let resp = match self {
            Conn::H1(send) => {
                let req = Request::builder().method(method).uri(path).header("host", "api.test");
                send.send_request(req.body(full("")).unwrap()).await
            }
            Conn::H2(send, scheme) => {
                let req = Request::builder().method(method).uri(format!("{scheme}://api.test{path}"));
                send.send_request(req.body(full("")).unwrap()).await
            }
            Conn::H3(h3) => return h3.request(method.as_str(), path, b"").await,
        };
        let (parts, body) = resp.map_err(|e| e.to_string())?.into_parts();
        let body = body.collect().await.map_err(|e| format!("the body: {e}"))?.to_bytes();
        Ok((parts.status, parts.headers, body))
    }
}

fn names(h: &HeaderMap) -> Vec<&str> {
    let mut names: Vec<&str> = h.keys().map(|n| n.as_str()).collect();
    names.sort_unstable();
    names
}

#[tokio::test]
async fn a_head_answer_has_the_gets_fields_and_no_content_on_every_protocol() {
    let s = site().await;
    let (plain, tls) = (s.tg.addrs[0], s.tg.addrs[1]);
    // The limit's one request of the hour: every later one is a 429.
    assert_eq!(crate::support::get(plain, "/limited").await.0, StatusCode::OK);
    let h2_tls = match Client::over(connect(tls, "api.test", client_config(&s.ca, &[b"h2"], None)).await.unwrap()).await
    {
        Client::H2(send) => send,
        Client::H1(_) => panic!("ALPN did not choose h2"),
    };
    let mut conns = [
        ("HTTP/1.1", Conn::H1(h1(plain).await)),
        ("h2c", Conn::H2(h2(plain).await, "http")),
        ("h2", Conn::H2(h2_tls, "https")),
        ("HTTP/3", Conn::H3(H3::connect(tls, &s.ca).await.unwrap())),
    ];
    let mut failed = Vec::new();
    for (proto, conn) in &mut conns {
        for (path, status) in [
            ("/r", StatusCode::OK),
            ("/limited", StatusCode::TOO_MANY_REQUESTS),
            ("/nope", StatusCode::NOT_FOUND),
            ("/up", StatusCode::OK),
        ] {
            let (get, head) = (conn.ask(Method::GET, path).await, conn.ask(Method::HEAD, path).await);
            let problem = match (get, head) {
                (Err(e), _) => Some(format!("GET failed: {e}")),
                (_, Err(e)) => Some(format!("HEAD failed: {e}")),
                (Ok((gs, gh, gb)), Ok((hs, hh, hb))) => {
                    let length = gb.len().to_string();
                    // The 404's detail names the method: HEAD's would be one byte longer.
                    let head_length = if path == "/nope" { gb.len() + 1 } else { gb.len() }.to_string();
                    if (gs, hs) != (status, status) {
                        Some(format!("statuses {gs} and {hs}, not {status}"))
                    } else if !hb.is_empty() {
                        Some(format!("HEAD's content: {hb:?}"))
                    } else if gh.get("content-length").is_none_or(|v| v != length.as_str()) {
                        Some(format!("GET's Content-Length is not {length}: {gh:?}"))
                    } else if hh.get("content-length").is_none_or(|v| v != head_length.as_str()) {
                        Some(format!("HEAD's Content-Length is not {head_length}: {hh:?}"))
                    } else if names(&gh) != names(&hh) {
                        Some(format!("fields {:?} for GET, {:?} for HEAD", names(&gh), names(&hh)))
                    } else {
                        None
                    }
                }
            };
            if let Some(p) = problem {
                failed.push(format!("{proto} {path}: {p}"));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Sends a request head announcing `length` bytes (with `extra` fields), and the body
/// `late` after it, if given.
async fn post(addr: std::net::SocketAddr, path: &str, length: usize, extra: &str, late: Option<Duration>) -> RawClient {
    let mut c = RawClient::connect(addr).await;
    c.send(format!("POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n{extra}\r\n").as_bytes()).await;
    if let Some(after) = late {
        tokio::time::sleep(after).await;
        c.send(&vec![b'x'; length]).await;
    }
    c
}

#[tokio::test]
async fn an_answer_made_before_the_body_arrived_reads_it_and_the_connection_goes_on() {
    let s = site().await;
    let plain = s.tg.addrs[0];
    assert_eq!(crate::support::get(plain, "/limited").await.0, StatusCode::OK);
    let mut failed = Vec::new();
    // A 429 and a 404, answered before their 1-byte bodies come 50 ms after the heads.
    for (path, status) in [("/limited", 429), ("/nope", 404)] {
        let mut c = post(plain, path, 1, "", Some(Duration::from_millis(50))).await;
        match c.final_response(false).await {
            Ok(first) if first.status() == status && first.header("connection").is_none() => {
                c.send(&get_request("/r")).await;
                match c.final_response(false).await {
                    Ok(next) if next.status() == 200 => {}
                    other => failed.push(format!("{path}: the next request on the connection: {other:?}")),
                }
            }
            other => failed.push(format!("{path}: {other:?}")),
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[tokio::test]
async fn an_answer_that_cannot_read_the_body_says_connection_close() {
    let s = site().await;
    let plain = s.tg.addrs[0];
    assert_eq!(crate::support::get(plain, "/limited").await.0, StatusCode::OK);
    let cases = [
        // Waiting for `100 Continue`, which an answer made first does not send.
        ("/limited", 10, "expect: 100-continue\r\n", 429),
        ("/r", 10, "expect: 100-continue\r\n", 200),
        // More than is read to keep a connection (64 KiB).
        ("/limited", 64 * 1024 + 1, "", 429),
        // A body that does not come within the wait (1 s).
        ("/nope", 10, "", 404),
        // Sent upstream, which could not be reached: what it did not take is unread.
        ("/dead", 10, "", 502),
    ];
    let mut failed = Vec::new();
    for (path, length, extra, status) in cases {
        let mut c = post(plain, path, length, extra, None).await;
        let first = c.response(false).await;
        let closes = first.as_ref().is_ok_and(|m| m.status() == status && m.header("connection") == Some("close"));
        if !closes {
            failed.push(format!("{path} {extra:?} {length} bytes: {first:?}"));
        } else if let Err(e) = c.closed().await {
            failed.push(format!("{path} {extra:?} {length} bytes: not closed after the answer: {e:?}"));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
