//! Message limits (`message_limits:`) with real clients: Python's `websockets` through
//! tollgate to a real WebSocket upstream (the tunnel tests' echo server), sending faster than
//! the limit allows.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tollgate::limit::{ManualClock, Timestamp};

use crate::support::{proxy_yaml, Tollgate, Upstream};

/// A proxy whose limits read a clock that stands still: a window of the test never ends
/// under it, however slow the machine.
async fn still(yaml: &str) -> Tollgate {
    Tollgate::start_with_clock(yaml, ManualClock::new(Timestamp::from_micros(1_700_000_000_000_000))).await
}
use crate::tunnel::ws_upstream;

/// Python with `modules`, or `None` (the test says it was skipped).
fn python_with(modules: &str) -> bool {
    let has = std::process::Command::new("python3").args(["-c", &format!("import {modules}")]).output();
    has.is_ok_and(|o| o.status.success())
}

fn script(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/messages").join(name)
}

fn metric(tg: &Tollgate, line_start: &str) -> Option<f64> {
    let text = tg.shared.load().metrics().encode(None);
    text.lines().find(|l| l.starts_with(line_start)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

fn ws_yaml(up: &Upstream, message_limits: &str) -> String {
    proxy_yaml(up.addr, "", &format!("  - name: ws\n    upstream: up\n    message_limits:\n{message_limits}"))
}

/// Runs the Python client: `count` messages of `size` bytes to `tg`'s `/chat`.
async fn ws_client(tg: &Tollgate, count: u32, size: usize) -> serde_json::Value {
    let url = format!("ws://{}/chat", tg.addr);
    let run = tokio::process::Command::new("python3")
        .arg(script("ws_client.py"))
        .args([url, count.to_string(), size.to_string()])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run).await.expect("the client hung").unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

macro_rules! needs_python {
    ($modules:expr, $test:expr) => {
        if !python_with($modules) {
            eprintln!("SKIPPED {}: python3 with {} is not installed (scripts/test.sh installs it)", $test, $modules);
            return;
        }
    };
}

#[tokio::test]
async fn a_websocket_client_over_its_message_limit_is_closed_with_1008_naming_the_limit() {
    needs_python!("websockets", "a_websocket_client_over_its_message_limit_is_closed_with_1008_naming_the_limit");
    let up = ws_upstream(Arc::default()).await;
    // A window of a minute: the sixth message of the test is always over it.
    let tg =
        still(&ws_yaml(&up, "      limits: [ { name: chat, algorithm: fixed_window, rate: 5/m, key: client_ip } ]\n"))
            .await;
    let got = ws_client(&tg, 20, 100).await;
    assert_eq!(got["close_code"], 1008, "{got}");
    let reason = got["close_reason"].as_str().unwrap();
    assert!(reason.contains("`chat`"), "{reason}");
    // Five admitted; their echoes may still be on their way when the stream is closed.
    assert!(got["echoed"].as_u64().unwrap() <= 5, "{got}");
    let m = |result: &str| {
        metric(
            &tg,
            &format!("tollgate_stream_messages_total{{route=\"ws\",protocol=\"websocket\",result=\"{result}\"}}"),
        )
    };
    assert_eq!(m("passed"), Some(5.0));
    assert_eq!(m("refused"), Some(1.0));
    // The limit's own decisions, as a request limit's are counted.
    assert_eq!(
        metric(&tg, "tollgate_limiter_decisions_total{route=\"ws\",limit=\"chat\",result=\"throttled\"}"),
        Some(1.0)
    );
    // The next connection of the same client is still over the window: closed at its first.
    let again = ws_client(&tg, 3, 10).await;
    assert_eq!((again["close_code"].as_u64(), again["echoed"].as_u64()), (Some(1008), Some(0)), "{again}");
}

#[tokio::test]
async fn with_action_delay_a_fast_websocket_client_is_slowed_not_closed() {
    needs_python!("websockets", "with_action_delay_a_fast_websocket_client_is_slowed_not_closed");
    let up = ws_upstream(Arc::default()).await;
    // 20 a second, one at once: ten messages take at least 9 × 50 ms however fast they come.
    let tg = Tollgate::start(&ws_yaml(
        &up,
        "      limits: [ { name: pace, algorithm: token_bucket, rate: 20/s, burst: 1, action: delay, max_delay: 5s } ]\n",
    ))
    .await;
    let got = ws_client(&tg, 10, 1000).await;
    assert_eq!(got["close_code"], serde_json::Value::Null, "{got}");
    assert_eq!(got["echoed"], 10, "{got}");
    let seconds = got["seconds"].as_f64().unwrap();
    assert!(seconds >= 0.45, "ten messages at 20/s went through in {seconds} s");
    let delayed = metric(&tg, "tollgate_stream_messages_total{route=\"ws\",protocol=\"websocket\",result=\"delayed\"}");
    assert!(delayed.unwrap_or(0.0) >= 1.0, "{delayed:?}");
}

#[tokio::test]
async fn a_websocket_message_over_max_message_size_is_refused_with_1009() {
    needs_python!("websockets", "a_websocket_message_over_max_message_size_is_refused_with_1009");
    let up = ws_upstream(Arc::default()).await;
    let tg = Tollgate::start(&ws_yaml(
        &up,
        "      max_message_size: 1MiB\n      limits: [ { name: chat, algorithm: token_bucket, rate: 100/s } ]\n",
    ))
    .await;
    // 10 MB in one message: refused at its header, never read.
    let got = ws_client(&tg, 1, 10 << 20).await;
    assert_eq!(got["close_code"], 1009, "{got}");
    assert!(got["close_reason"].as_str().unwrap().contains("max_message_size"), "{got}");
    let too_large =
        metric(&tg, "tollgate_stream_messages_total{route=\"ws\",protocol=\"websocket\",result=\"too_large\"}");
    assert_eq!(too_large, Some(1.0));
    let up_bytes = metric(&tg, "tollgate_tunnel_bytes_total{route=\"ws\",direction=\"up\"}").unwrap();
    assert!(up_bytes < f64::from(1u32 << 20), "{up_bytes} bytes of the refused message reached the upstream");
}

#[tokio::test]
async fn messages_under_the_limit_pass_fragmented_and_interleaved_with_control_frames() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::{Frame, FrameHeader};
    use tokio_tungstenite::tungstenite::Message;
    let up = ws_upstream(Arc::default()).await;
    let tg =
        Tollgate::start(&ws_yaml(&up, "      limits: [ { name: chat, algorithm: fixed_window, rate: 3/m } ]\n")).await;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/chat", tg.addr)).await.unwrap();
    // One message in three frames, a ping between them: one message counted.
    let frame = |opcode, fin, data: &[u8]| {
        let header = FrameHeader { is_final: fin, opcode, ..FrameHeader::default() };
        Message::Frame(Frame::from_payload(header, data.to_vec().into()))
    };
    ws.send(frame(OpCode::Data(Data::Text), false, b"he")).await.unwrap();
    ws.send(Message::Ping(b"p".to_vec().into())).await.unwrap();
    ws.send(frame(OpCode::Data(Data::Continue), false, b"ll")).await.unwrap();
    ws.send(frame(OpCode::Data(Data::Continue), true, b"o")).await.unwrap();
    let mut got = Vec::new();
    while got.is_empty() {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await.unwrap().unwrap().unwrap() {
            Message::Text(t) => got.push(t.to_string()),
            Message::Pong(_) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, ["hello"]);
    for _ in 0..2 {
        ws.send(Message::text("x")).await.unwrap();
        assert_eq!(ws.next().await.unwrap().unwrap(), Message::text("x"));
    }
    ws.send(Message::text("over")).await.unwrap();
    match ws.next().await {
        Some(Ok(Message::Close(Some(c)))) => assert_eq!(u16::from(c.code), 1008),
        other => panic!("expected a close 1008, got {other:?}"),
    }
}

/// The Python gRPC service (`grpc_peer.py serve`), an h2c upstream; killed when dropped.
struct GrpcUpstream {
    port: u16,
    _child: tokio::process::Child,
}

impl GrpcUpstream {
    async fn start() -> GrpcUpstream {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new("python3")
            .arg(script("grpc_peer.py"))
            .arg("serve")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await.unwrap().unwrap();
        let port = line.expect("the service's port").trim().parse().unwrap();
        GrpcUpstream { port, _child: child }
    }
}

fn grpc_yaml(up: &GrpcUpstream, message_limits: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nupstreams:\n  g: {{ url: 'http://127.0.0.1:{}', protocol: h2c }}\nroutes:\n  - name: rpc\n    \
         upstream: g\n    message_limits:\n{message_limits}",
        up.port
    )
}

/// Runs the Python gRPC client: `mode` (`upload`, `download`, `echo`) with `count` messages of
/// `size` bytes, through `tg`.
async fn grpc_client(tg: &Tollgate, mode: &str, count: u32, size: usize) -> serde_json::Value {
    let run = tokio::process::Command::new("python3")
        .arg(script("grpc_peer.py"))
        .args([mode.to_owned(), tg.addr.to_string(), count.to_string(), size.to_string()])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run).await.expect("the client hung").unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

fn grpc_metric(tg: &Tollgate, result: &str) -> Option<f64> {
    metric(tg, &format!("tollgate_stream_messages_total{{route=\"rpc\",protocol=\"grpc\",result=\"{result}\"}}"))
}

/// A call over its limit: `RESOURCE_EXHAUSTED`, the limit named, a pushback in milliseconds
/// no longer than `max_ms` (the limit's period).
fn assert_exhausted(got: &serde_json::Value, limit: &str, max_ms: u64) {
    assert_eq!(got["code"], "RESOURCE_EXHAUSTED", "{got}");
    assert!(got["details"].as_str().unwrap().contains(&format!("`{limit}`")), "{got}");
    let pushback: u64 = got["trailers"]["grpc-retry-pushback-ms"].as_str().expect("a pushback").parse().unwrap();
    assert!((1..=max_ms).contains(&pushback), "{got}");
}

#[tokio::test]
async fn a_client_streaming_call_over_its_message_limit_ends_with_resource_exhausted_and_pushback() {
    needs_python!("grpc", "a_client_streaming_call_over_its_message_limit_ends_with_resource_exhausted_and_pushback");
    let up = GrpcUpstream::start().await;
    let tg = still(&grpc_yaml(
        &up,
        "      limits: [ { name: uploads, algorithm: fixed_window, rate: 5/m, key: [client_ip, path] } ]\n",
    ))
    .await;
    let got = grpc_client(&tg, "upload", 20, 100).await;
    assert_exhausted(&got, "uploads", 60_000);
    assert_eq!(grpc_metric(&tg, "passed"), Some(5.0));
    assert_eq!(grpc_metric(&tg, "refused"), Some(1.0));
    // A call within the limit (on a proxy of its own) goes through whole.
    let tg2 = still(&grpc_yaml(
        &up,
        "      limits: [ { name: uploads, algorithm: fixed_window, rate: 5/m, key: [client_ip, path] } ]\n",
    ))
    .await;
    let got = grpc_client(&tg2, "upload", 5, 100).await;
    assert_eq!((got["code"].as_str(), got["answer"].as_str()), (Some("OK"), Some("5")), "{got}");
}

#[tokio::test]
async fn server_streaming_and_bidi_calls_are_counted_each_way_they_are_asked() {
    needs_python!("grpc", "server_streaming_and_bidi_calls_are_counted_each_way_they_are_asked");
    let up = GrpcUpstream::start().await;
    let tg = still(&grpc_yaml(
        &up,
        "      limits: [ { name: replies, algorithm: fixed_window, rate: 5/m, direction: upstream } ]\n",
    ))
    .await;
    let got = grpc_client(&tg, "download", 20, 0).await;
    assert_exhausted(&got, "replies", 60_000);
    assert_eq!(got["received"], 5, "{got}");
    let tg = still(&grpc_yaml(&up, "      limits: [ { name: talk, algorithm: fixed_window, rate: 5/m } ]\n")).await;
    let got = grpc_client(&tg, "echo", 20, 10).await;
    assert_exhausted(&got, "talk", 60_000);
    assert!(got["received"].as_u64().unwrap() <= 5, "{got}");
}

#[tokio::test]
async fn a_10_mb_grpc_message_over_max_message_size_is_refused_without_a_pushback() {
    needs_python!("grpc", "a_10_mb_grpc_message_over_max_message_size_is_refused_without_a_pushback");
    let up = GrpcUpstream::start().await;
    let tg = Tollgate::start(&grpc_yaml(
        &up,
        "      max_message_size: 1MiB\n      limits: [ { name: uploads, algorithm: token_bucket, rate: 100/s } ]\n",
    ))
    .await;
    let got = grpc_client(&tg, "upload", 1, 10 << 20).await;
    assert_eq!(got["code"], "RESOURCE_EXHAUSTED", "{got}");
    assert!(got["details"].as_str().unwrap().contains("max_message_size"), "{got}");
    assert!(got["trailers"].get("grpc-retry-pushback-ms").is_none(), "waiting does not help: {got}");
    assert_eq!(grpc_metric(&tg, "too_large"), Some(1.0));
}

#[tokio::test]
async fn with_action_delay_a_fast_grpc_client_is_slowed_and_its_call_succeeds() {
    needs_python!("grpc", "with_action_delay_a_fast_grpc_client_is_slowed_and_its_call_succeeds");
    let up = GrpcUpstream::start().await;
    let tg = Tollgate::start(&grpc_yaml(
        &up,
        "      limits: [ { name: pace, algorithm: token_bucket, rate: 20/s, burst: 1, action: delay, max_delay: 5s } ]\n",
    ))
    .await;
    let started = std::time::Instant::now();
    let got = grpc_client(&tg, "upload", 10, 100).await;
    assert_eq!((got["code"].as_str(), got["answer"].as_str()), (Some("OK"), Some("10")), "{got}");
    // Ten messages at 20 a second, one at once: at least 9 × 50 ms, however fast they came.
    assert!(started.elapsed() >= Duration::from_millis(450), "{:?}", started.elapsed());
    assert!(grpc_metric(&tg, "delayed").unwrap_or(0.0) >= 1.0);
}

#[tokio::test]
async fn a_redis_message_limit_is_shared_by_two_instances() {
    needs_python!("websockets", "a_redis_message_limit_is_shared_by_two_instances");
    let node = crate::support::redis::RedisNode::start();
    let up = ws_upstream(Arc::default()).await;
    // Six messages, then one an hour: nothing refills during the test.
    let yaml = format!(
        "{}redis: {{ url: '{}' }}\n",
        ws_yaml(
            &up,
            "      limits: [ { name: shared, algorithm: token_bucket, rate: 1/h, burst: 6, key: client_ip, store: redis } ]\n"
        ),
        node.url()
    );
    let (one, two) = (Tollgate::start(&yaml).await, Tollgate::start(&yaml).await);
    let first = ws_client(&one, 4, 10).await;
    assert_eq!((first["close_code"].as_u64(), first["echoed"].as_u64()), (None, Some(4)), "{first}");
    // The other instance sees the four: two more pass, the third is over.
    let second = ws_client(&two, 5, 10).await;
    assert_eq!(second["close_code"], 1008, "{second}");
    assert!(second["close_reason"].as_str().unwrap().contains("`shared`"), "{second}");
    let passed = |tg: &Tollgate| {
        metric(tg, "tollgate_stream_messages_total{route=\"ws\",protocol=\"websocket\",result=\"passed\"}")
    };
    assert_eq!((passed(&one), passed(&two)), (Some(4.0), Some(2.0)));
    // Its state is under keys of its own, apart from the route's request limits.
    let keys = node.tollgate_keys();
    assert!(keys.iter().any(|(k, _)| k.starts_with("tollgate:{ws/messages/shared:")), "{keys:?}");
}

#[tokio::test]
async fn a_redis_message_limit_on_grpc_calls_is_shared_by_two_instances() {
    needs_python!("grpc", "a_redis_message_limit_on_grpc_calls_is_shared_by_two_instances");
    let node = crate::support::redis::RedisNode::start();
    let up = GrpcUpstream::start().await;
    let yaml = format!(
        "{}redis: {{ url: '{}' }}\n",
        grpc_yaml(
            &up,
            "      limits: [ { name: shared, algorithm: token_bucket, rate: 1/h, burst: 6, key: client_ip, store: redis } ]\n"
        ),
        node.url()
    );
    let (one, two) = (Tollgate::start(&yaml).await, Tollgate::start(&yaml).await);
    let first = grpc_client(&one, "upload", 4, 10).await;
    assert_eq!((first["code"].as_str(), first["answer"].as_str()), (Some("OK"), Some("4")), "{first}");
    let second = grpc_client(&two, "upload", 5, 10).await;
    assert_exhausted(&second, "shared", 3_600_000);
    assert_eq!(grpc_metric(&two, "passed"), Some(2.0));
}
