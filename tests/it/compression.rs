//! `compression:` over real sockets, read by decoders nobody here wrote: curl `--compressed`
//! (zlib, brotli and zstd as the system's libcurl links them) and Python's zlib, Brotli and
//! zstandard (tests/compress/client.py; scripts/test.sh installs the PyPI modules). Every
//! negotiation case, every exclusion, the fields (`Vary`, `ETag`), stale copies encoded per
//! client, request bodies passed as they are, and an event stream flushed per event: its
//! upstream sends the next event only once the client has decoded the last one, so an answer
//! held back by the encoder stalls the test.

use std::io::Read;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::support::{full, get_with, h1, BoxBody, Tollgate, Upstream};

/// Generous bound for what should happen at once (a loaded 2-core machine, a Python start).
const SOON: Duration = Duration::from_secs(60);

/// An API answer of about 100 KiB, the same every run.
fn payload() -> &'static Bytes {
    static P: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        let mut s = String::from("{\"items\":[");
        for i in 0..1500u32 {
            let status = ["pending", "shipped", "delivered"][(i % 3) as usize];
            s.push_str(&format!(
                "{{\"id\":{i},\"status\":\"{status}\",\"customer\":{{\"id\":{},\"email\":\"user{}@example.com\"}},\"total\":{}.{:02}}},",
                i * 7 % 500,
                i * 13 % 900,
                i * 37 % 1000,
                i % 100
            ));
        }
        s.push_str("{}]}");
        Bytes::from(s)
    })
}

fn sha256(data: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, data).as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// The upstream's state the tests steer.
#[derive(Default)]
struct Steer {
    /// The event stream's sender, once a client asked for `/events`.
    events: Mutex<Option<mpsc::Sender<Bytes>>>,
    /// `/stale` fails once this is set.
    failing: AtomicBool,
    /// The `Accept-Encoding` of each request for `/page`.
    page_asked: Mutex<Vec<String>>,
}

/// An HTML page of about 10 KiB whose end only a whole, decoded page shows.
fn page() -> String {
    let lines: String = (0..500).map(|i| format!("<p>line {i}</p>")).collect();
    format!("<!doctype html><html><body>{lines}<div id=\"end\">decoded-all</div></body></html>")
}

/// The upstream: one path per kind of answer.
async fn upstream(steer: Arc<Steer>) -> Upstream {
    Upstream::start(move |mut req| {
        let steer = steer.clone();
        async move {
            let path = req.uri().path().to_owned();
            let json = |body: BoxBody| Response::builder().header("content-type", "application/json").body(body);
            let resp = match path.as_str() {
                "/json" | "/limited/json" | "/plain" => Response::builder()
                    .header("content-type", "application/json; charset=utf-8")
                    .header("etag", "\"v1\"")
                    .header("accept-ranges", "bytes")
                    .header("vary", "Origin")
                    .body(full(payload().clone())),
                "/chunked" => {
                    let chunks: Vec<Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>> =
                        payload().chunks(10_000).map(|c| Ok(Frame::data(Bytes::copy_from_slice(c)))).collect();
                    json(BodyExt::boxed(http_body_util::StreamBody::new(futures_util::stream::iter(chunks))))
                }
                "/small" => json(full("{\"ok\":true}")),
                "/page" => {
                    let ae = req.headers().get("accept-encoding").map_or("", |v| v.to_str().unwrap_or("?"));
                    steer.page_asked.lock().unwrap().push(ae.to_owned());
                    Response::builder().header("content-type", "text/html; charset=utf-8").body(full(page()))
                }
                "/png" => Response::builder().header("content-type", "image/png").body(full(payload().clone())),
                "/encoded" => Response::builder()
                    .header("content-type", "application/json")
                    .header("content-encoding", "gzip")
                    .body(full(gzip(payload()))),
                "/no-transform" => Response::builder()
                    .header("content-type", "application/json")
                    .header("cache-control", "public, no-transform")
                    .body(full(payload().clone())),
                "/range" if req.headers().contains_key("range") => Response::builder()
                    .status(206)
                    .header("content-type", "application/json")
                    .header("content-range", format!("bytes 0-9999/{}", payload().len()))
                    .body(full(payload().slice(..10_000))),
                "/etag" if req.headers().get("if-none-match").is_some_and(|v| v.as_bytes().ends_with(b"\"v1\"")) => {
                    Response::builder().status(304).header("etag", "\"v1\"").body(full(""))
                }
                "/etag" => Response::builder()
                    .header("content-type", "application/json")
                    .header("etag", "\"v1\"")
                    .body(full(payload().clone())),
                "/stale" if steer.failing.load(Ordering::SeqCst) => Response::builder().status(503).body(full("down")),
                "/stale" => json(full(payload().clone())),
                "/echo" => {
                    let ce = req.headers().get("content-encoding").map(|v| v.to_str().unwrap().to_owned());
                    let body = req.body_mut().collect().await.unwrap().to_bytes();
                    let text = format!("{{\"content_encoding\":{:?},\"sha256\":\"{}\"}}", ce, sha256(&body));
                    Response::builder().header("content-type", "text/plain").body(full(text))
                }
                "/events" => {
                    let (tx, rx) = mpsc::channel::<Bytes>(1);
                    *steer.events.lock().unwrap() = Some(tx);
                    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
                        let event = rx.recv().await?;
                        Some((Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Frame::data(event)), rx))
                    });
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .header("cache-control", "no-cache")
                        .body(BodyExt::boxed(http_body_util::StreamBody::new(frames)))
                }
                "/ws" => {
                    let key = req.headers().get("sec-websocket-key").cloned().unwrap();
                    let on = hyper::upgrade::on(&mut req);
                    tokio::spawn(async move {
                        let Ok(io) = on.await else { return };
                        let mut ws = WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, None).await;
                        while let Some(Ok(msg)) = ws.next().await {
                            if msg.is_text() && ws.send(msg).await.is_err() {
                                return;
                            }
                        }
                    });
                    // A type among the compressed ones: only the tunnel rule keeps it plain.
                    Response::builder()
                        .status(101)
                        .header("connection", "upgrade")
                        .header("upgrade", "websocket")
                        .header("content-type", "text/plain")
                        .header("sec-websocket-accept", derive_accept_key(key.as_bytes()))
                        .body(full(""))
                }
                _ => Response::builder().status(404).body(full("")),
            };
            resp.unwrap()
        }
    })
    .await
}

/// tollgate in front of `up`: route `limited` (a limit that refuses the second request, and
/// `min_size: 0` so that its small `429` would be encoded if tollgate's own answers were),
/// `stale` (stale copies when the upstream fails), the rest on the defaults.
async fn tollgate(up: &Upstream) -> Tollgate {
    Tollgate::start(&format!(
        "listen: 127.0.0.1:0
compression: {{}}
upstreams:
  up: {{ url: 'http://{}' }}
routes:
  - name: limited
    match: {{ path_prefix: /limited/ }}
    upstream: up
    compression: {{ min_size: 0 }}
    limits: [{{ name: one, algorithm: token_bucket, rate: 1/h, burst: 1, key: route }}]
  - name: stale
    match: {{ path: /stale }}
    upstream: up
    on_upstream_error: {{ stale: {{ max_age: 1h }} }}
  - name: plain
    match: {{ path: /plain }}
    upstream: up
    compression: none
  - name: all
    upstream: up
",
        up.addr
    ))
    .await
}

async fn setup() -> (Arc<Steer>, Upstream, Tollgate) {
    let steer = Arc::new(Steer::default());
    let up = upstream(steer.clone()).await;
    let tg = tollgate(&up).await;
    (steer, up, tg)
}

/// Decodes `data` with the crates tollgate itself is built on (for the socket-level cases;
/// the other decoders are curl's and Python's).
fn decode(coding: Option<&str>, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match coding {
        None => out.extend_from_slice(data),
        Some("gzip") => {
            flate2::read::GzDecoder::new(data).read_to_end(&mut out).unwrap();
        }
        Some("br") => {
            brotli::Decompressor::new(data, 4096).read_to_end(&mut out).unwrap();
        }
        Some("zstd") => {
            zstd::stream::read::Decoder::new(data).unwrap().read_to_end(&mut out).unwrap();
        }
        Some(other) => panic!("unexpected coding {other}"),
    }
    out
}

fn field<'a>(h: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).map(|v| v.to_str().unwrap())
}

fn varies(h: &http::HeaderMap) -> bool {
    h.get_all("vary").iter().any(|v| v.to_str().unwrap().to_ascii_lowercase().contains("accept-encoding"))
}

#[tokio::test]
async fn every_negotiation_case() {
    let (_steer, _up, tg) = setup().await;
    // (Accept-Encoding, the coding expected; None: sent as it is)
    let cases: &[(Option<&str>, Option<&str>)] = &[
        (None, None),
        (Some(""), None),
        (Some("gzip"), Some("gzip")),
        (Some("x-gzip"), Some("gzip")),
        (Some("br"), Some("br")),
        (Some("zstd"), Some("zstd")),
        // A browser's list, all with the same weight: the server's order (zstd, br, gzip).
        (Some("gzip, deflate, br, zstd"), Some("zstd")),
        (Some("gzip, deflate, br"), Some("br")),
        (Some("gzip;q=1.0, br;q=0.5, zstd;q=0.1"), Some("gzip")),
        (Some("zstd;q=0, br;q=0, gzip;q=0.2"), Some("gzip")),
        (Some("*"), Some("zstd")),
        (Some("zstd;q=0, *;q=0.5"), Some("br")),
        (Some("*;q=0"), None),
        (Some("deflate, compress"), None),
        (Some("identity;q=1, gzip;q=0.5"), None),
        (Some("gzip;q=0"), None),
        (Some("gzip;q=abc"), None),
    ];
    for (ae, want) in cases {
        let headers: Vec<(&str, &str)> = ae.iter().map(|v| ("accept-encoding", *v)).collect();
        let (status, h, body) = get_with(tg.addr, "/json", &headers).await;
        assert_eq!(status, StatusCode::OK, "{ae:?}");
        assert_eq!(field(&h, "content-encoding"), *want, "{ae:?}");
        assert!(varies(&h), "{ae:?}: every eligible answer says it varies");
        assert_eq!(decode(*want, &body), payload().as_ref(), "{ae:?}");
        if want.is_some() {
            assert_eq!(field(&h, "etag"), Some("W/\"v1\""), "{ae:?}");
            assert!(h.get("content-length").is_none() && h.get("accept-ranges").is_none(), "{ae:?}");
            assert_eq!(field(&h, "transfer-encoding"), Some("chunked"), "{ae:?}");
            assert!(body.len() < payload().len() / 4, "{ae:?}: {} bytes", body.len());
        } else {
            assert_eq!(field(&h, "etag"), Some("\"v1\""), "{ae:?}");
            assert_eq!(field(&h, "content-length"), Some(payload().len().to_string().as_str()), "{ae:?}");
        }
        // The upstream's own Vary stays, Accept-Encoding beside it.
        assert!(h.get_all("vary").iter().any(|v| v == "Origin"), "{ae:?}");
    }
    let text = tg.shared.load().metrics().encode(None);
    for line in [
        "tollgate_compression_total{route=\"all\",result=\"zstd\"} 3",
        "tollgate_compression_total{route=\"all\",result=\"gzip\"} 4",
        "tollgate_compression_total{route=\"all\",result=\"br\"} 3",
        "tollgate_compression_total{route=\"all\",result=\"identity\"} 7",
        &format!("tollgate_compression_bytes_total{{route=\"all\",direction=\"in\"}} {}", 10 * payload().len()),
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
}

#[tokio::test]
async fn exclusions_go_as_they_are() {
    let (_steer, _up, tg) = setup().await;
    let ae = [("accept-encoding", "gzip, br, zstd")];
    // Not compression's business: no field changed, not even Vary.
    for path in ["/png", "/no-transform", "/plain"] {
        let (status, h, body) = get_with(tg.addr, path, &ae).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert!(h.get("content-encoding").is_none() && !varies(&h), "{path}: {h:?}");
        assert_eq!(body, payload(), "{path}");
    }
    // Encoded already: passed byte for byte.
    let (_, h, body) = get_with(tg.addr, "/encoded", &ae).await;
    assert_eq!(field(&h, "content-encoding"), Some("gzip"));
    assert_eq!(body.as_ref(), gzip(payload()).as_slice());
    // A range: the unencoded bytes.
    let (status, h, body) = get_with(tg.addr, "/range", &[ae[0], ("range", "bytes=0-9999")]).await;
    assert_eq!(status, StatusCode::PARTIAL_CONTENT);
    assert!(h.get("content-encoding").is_none() && !varies(&h), "{h:?}");
    assert_eq!(body, payload().slice(..10_000));
    // Dependent on Accept-Encoding but sent as they are: with Vary.
    let (status, h, body) = get_with(tg.addr, "/etag", &[ae[0], ("if-none-match", "W/\"v1\"")]).await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    assert!(h.get("content-encoding").is_none() && varies(&h) && body.is_empty(), "{h:?}");
    let (status, h, body) = get_with(tg.addr, "/small", &ae).await;
    assert_eq!(status, StatusCode::OK);
    assert!(h.get("content-encoding").is_none() && varies(&h), "{h:?}");
    assert_eq!(body, "{\"ok\":true}");
    let mut send = h1(tg.addr).await;
    let req = http::Request::head("/json").header("host", "x").header("accept-encoding", "gzip").body(full(""));
    let resp = send.send_request(req.unwrap()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers().get("content-encoding").is_none() && varies(resp.headers()), "{:?}", resp.headers());
    assert_eq!(field(resp.headers(), "content-length"), Some(payload().len().to_string().as_str()));
    // Of unknown length (chunked upstream): encoded.
    let (_, h, body) = get_with(tg.addr, "/chunked", &[("accept-encoding", "br")]).await;
    assert_eq!(field(&h, "content-encoding"), Some("br"));
    assert_eq!(decode(Some("br"), &body), payload().as_ref());
}

#[tokio::test]
async fn tollgates_own_answers_are_never_encoded() {
    let (_steer, _up, tg) = setup().await;
    let ae = [("accept-encoding", "gzip")];
    let (status, h, body) = get_with(tg.addr, "/limited/json", &ae).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(field(&h, "content-encoding"), Some("gzip"));
    assert_eq!(decode(Some("gzip"), &body), payload().as_ref());
    let (status, h, body) = get_with(tg.addr, "/limited/json", &ae).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(h.get("content-encoding").is_none() && !varies(&h), "{h:?}");
    assert!(String::from_utf8_lossy(&body).contains("\"status\":429"), "{body:?}");
}

#[tokio::test]
async fn a_tunnel_is_never_encoded() {
    let (_steer, _up, tg) = setup().await;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut req = format!("ws://{}/ws", tg.addr).into_client_request().unwrap();
    req.headers_mut().insert("accept-encoding", "gzip".parse().unwrap());
    let (mut ws, resp) = tokio::time::timeout(SOON, tokio_tungstenite::connect_async(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    assert!(resp.headers().get("content-encoding").is_none() && !varies(resp.headers()), "{:?}", resp.headers());
    ws.send(Message::text("hello through the tunnel")).await.unwrap();
    let echoed = tokio::time::timeout(SOON, ws.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(echoed.to_text().unwrap(), "hello through the tunnel");
}

#[tokio::test]
async fn a_stale_copy_is_stored_once_and_encoded_for_each_client() {
    let (steer, _up, tg) = setup().await;
    let (status, h, body) = get_with(tg.addr, "/stale", &[("accept-encoding", "gzip")]).await;
    assert_eq!((status, field(&h, "content-encoding")), (StatusCode::OK, Some("gzip")));
    assert_eq!(decode(Some("gzip"), &body), payload().as_ref());
    steer.failing.store(true, Ordering::SeqCst);
    // The copy kept is the upstream's own bytes: each client gets it in its coding.
    for (ae, want) in [(Some("br"), Some("br")), (Some("zstd"), Some("zstd")), (None, None)] {
        let headers: Vec<(&str, &str)> = ae.iter().map(|v| ("accept-encoding", *v)).collect();
        let (status, h, body) = get_with(tg.addr, "/stale", &headers).await;
        assert_eq!(status, StatusCode::OK, "{ae:?}");
        assert!(field(&h, "cache-status").is_some_and(|s| s.contains("detail=upstream-error")), "{h:?}");
        assert_eq!(field(&h, "content-encoding"), want, "{ae:?}");
        assert!(varies(&h), "{ae:?}");
        assert_eq!(decode(want, &body), payload().as_ref(), "{ae:?}");
    }
}

#[tokio::test]
async fn a_request_body_with_content_encoding_goes_upstream_as_it_came() {
    let (_steer, _up, tg) = setup().await;
    let sent = gzip(payload());
    let mut send = h1(tg.addr).await;
    let req = http::Request::post("/echo")
        .header("host", "x")
        .header("content-encoding", "gzip")
        .header("content-type", "application/json")
        .body(full(sent.clone()))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let seen = resp.into_body().collect().await.unwrap().to_bytes();
    let want = format!("{{\"content_encoding\":Some(\"gzip\"),\"sha256\":\"{}\"}}", sha256(&sent));
    assert_eq!(String::from_utf8_lossy(&seen), want);
}

#[tokio::test]
async fn curl_compressed_decodes_every_coding() {
    let (_steer, _up, tg) = setup().await;
    for (ae, want) in [("gzip", "gzip"), ("br", "br"), ("zstd", "zstd"), ("gzip, deflate, br, zstd", "zstd")] {
        let out = tokio::process::Command::new("curl")
            .args(["-sS", "--compressed", "-D", "/dev/stderr", "-H", &format!("Accept-Encoding: {ae}")])
            .arg(tg.url("/json"))
            .output()
            .await
            .expect("curl runs");
        assert!(out.status.success(), "{ae}: {}", String::from_utf8_lossy(&out.stderr));
        let head = String::from_utf8_lossy(&out.stderr).to_ascii_lowercase();
        assert!(head.contains(&format!("content-encoding: {want}\r\n")), "{ae}: {head}");
        assert_eq!(out.stdout, payload().as_ref(), "{ae}: curl decoded something else");
    }
}

/// Python's decoders, or `None` (the test says it was skipped) where Python lacks them.
fn python_with(modules: &str) -> Option<std::path::PathBuf> {
    let has = std::process::Command::new("python3").args(["-c", &format!("import {modules}")]).output();
    if !has.is_ok_and(|o| o.status.success()) {
        return None;
    }
    Some(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compress/client.py"))
}

#[tokio::test]
async fn python_decoders_read_every_coding() {
    let Some(script) = python_with("brotli, zstandard") else {
        eprintln!(
            "SKIPPED python_decoders_read_every_coding: python3 with brotli and zstandard is not installed \
             (pip3 install brotli zstandard; scripts/test.sh does it)"
        );
        return;
    };
    let (_steer, _up, tg) = setup().await;
    let port = tg.addr.port().to_string();
    for (path, ae, want) in [
        ("/json", "gzip", "gzip"),
        ("/json", "br", "br"),
        ("/json", "zstd", "zstd"),
        ("/chunked", "zstd;q=0.5, br;q=0.9", "br"),
        ("/json", "-", "identity"),
    ] {
        let out = tokio::process::Command::new("python3")
            .arg(&script)
            .args(["get", "127.0.0.1", &port, path, ae])
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "{ae}: {}", String::from_utf8_lossy(&out.stderr));
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(got["coding"], want, "{got}");
        assert_eq!(got["sha256"], sha256(payload()), "{path} {ae}: Python decoded something else: {got}");
        if want != "identity" {
            assert!(got["raw_len"].as_u64().unwrap() < payload().len() as u64 / 4, "{got}");
            let vary = got["headers"]["vary"].as_array().unwrap();
            assert!(vary.iter().any(|v| v == "Accept-Encoding"), "{got}");
        }
    }
}

/// Runs `client` (its stdout a line per decoded event) against `/events` and feeds the stream
/// one event at a time: the next only once the client has printed the last.
async fn events_one_at_a_time(steer: &Steer, mut client: tokio::process::Command, what: &str) {
    let mut child = client.stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true).spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let tx = tokio::time::timeout(SOON, async {
        loop {
            if let Some(tx) = steer.events.lock().unwrap().take() {
                return tx;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: the request never reached the upstream"));
    for i in 0..5 {
        let event = format!("id: {i}\ndata: {{\"n\":{i},\"text\":\"event number {i}\"}}\n\n");
        tx.send(Bytes::from(event)).await.unwrap();
        let line = tokio::time::timeout(SOON, lines.next_line()).await;
        let line = line.unwrap_or_else(|_| panic!("{what}: event {i} never reached the client: held back"));
        assert_eq!(
            line.unwrap().as_deref(),
            Some(format!("event {{\"n\":{i},\"text\":\"event number {i}\"}}").as_str()),
            "{what}"
        );
    }
    drop(tx);
    let last = tokio::time::timeout(SOON, lines.next_line()).await.unwrap().unwrap();
    assert_eq!(last.as_deref(), Some("end"), "{what}");
}

#[tokio::test]
async fn an_event_stream_is_flushed_per_event() {
    let (steer, _up, tg) = setup().await;
    let port = tg.addr.port().to_string();
    let script = python_with("brotli, zstandard");
    for coding in ["gzip", "br", "zstd"] {
        match &script {
            Some(script) => {
                let mut python = tokio::process::Command::new("python3");
                python.arg(script).args(["events", "127.0.0.1", &port, "/events", coding]);
                events_one_at_a_time(&steer, python, &format!("python {coding}")).await;
            }
            None => eprintln!("SKIPPED the Python half of an_event_stream_is_flushed_per_event: no brotli/zstandard"),
        }
    }
    // curl decodes as it reads; a small shell loop turns its events into lines.
    for coding in ["gzip", "br", "zstd"] {
        let mut curl = tokio::process::Command::new("sh");
        curl.args([
            "-c",
            r#"curl -sN --compressed -H "Accept-Encoding: $1" "$2" | while IFS= read -r l; do
                 case "$l" in "data: "*) printf 'event %s\n' "${l#data: }";; esac; done; echo end"#,
            "sh",
            coding,
            &tg.url("/events"),
        ]);
        events_one_at_a_time(&steer, curl, &format!("curl {coding}")).await;
    }
}

/// Headless Chromium loads a page through tollgate and shows it whole: a browser decodes what
/// tollgate encoded for it (whichever coding its `Accept-Encoding` made tollgate choose).
#[tokio::test]
async fn a_browser_shows_the_encoded_page() {
    let chromium = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| std::process::Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()));
    let Some(chromium) = chromium else {
        eprintln!("SKIPPED a_browser_shows_the_encoded_page: headless Chromium is not installed (scripts/test.sh installs it)");
        return;
    };
    let (steer, _up, tg) = setup().await;
    let out = tokio::time::timeout(
        SOON,
        tokio::process::Command::new(chromium)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"])
            .arg(tg.url("/page"))
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("chromium ended")
    .unwrap();
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(dom.contains("<p>line 499</p><div id=\"end\">decoded-all</div>"), "{dom}");
    let asked = steer.page_asked.lock().unwrap().clone();
    assert!(asked.first().is_some_and(|ae| ae.contains("gzip")), "the browser asked with {asked:?}");
    let text = tg.shared.load().metrics().encode(None);
    let encoded: u64 = ["gzip", "br", "zstd"]
        .iter()
        .filter_map(|c| {
            let line = format!("tollgate_compression_total{{route=\"all\",result=\"{c}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(line.as_str())?.parse::<u64>().ok())
        })
        .sum();
    assert!(encoded >= 1, "the page went out unencoded:\n{text}");
}
