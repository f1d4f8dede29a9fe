//! Upgrades and tunnels: a real WebSocket client (tokio-tungstenite) through tollgate to a
//! real hyper upstream that upgrades, and what is never tunnelled.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use crate::support::{full, get, proxy_yaml, Tollgate, Upstream};

/// Generous bound for anything that should happen at once.
const SOON: Duration = Duration::from_secs(10);

/// An upstream that answers WebSocket upgrades with an echo (and closes after echoing
/// `bye`), and plain requests with `200 plain`; records each request's headers.
pub(crate) async fn ws_upstream(seen: Arc<Mutex<Vec<HeaderMap>>>) -> Upstream {
    Upstream::start(move |mut req| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(req.headers().clone());
            let Some(key) = req.headers().get("sec-websocket-key").cloned() else {
                return Response::new(full("plain"));
            };
            let on = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let Ok(io) = on.await else { return };
                let mut ws = WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, None).await;
                while let Some(Ok(msg)) = ws.next().await {
                    if !(msg.is_text() || msg.is_binary()) {
                        continue;
                    }
                    let bye = msg.to_text().is_ok_and(|t| t == "bye");
                    if ws.send(msg).await.is_err() {
                        return;
                    }
                    if bye {
                        let _ = ws.close(None).await;
                        // Wait for the client's Close reply, then drop the socket.
                        while let Some(Ok(_)) = ws.next().await {}
                        return;
                    }
                }
            });
            Response::builder()
                .status(101)
                .header("connection", "upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-accept", derive_accept_key(key.as_bytes()))
                .body(full(""))
                .unwrap()
        }
    })
    .await
}

fn yaml(up: &Upstream, route_extra: &str) -> String {
    proxy_yaml(up.addr, "", &format!("  - name: ws\n    upstream: up\n{route_extra}"))
}

type Client = WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>;

async fn connect(tg: &Tollgate) -> Result<Client, WsError> {
    let url = format!("ws://{}/chat", tg.addr);
    tokio::time::timeout(SOON, tokio_tungstenite::connect_async(url)).await.unwrap().map(|(ws, _)| ws)
}

async fn next(ws: &mut Client) -> Option<Result<Message, WsError>> {
    tokio::time::timeout(SOON, ws.next()).await.expect("the tunnel stalled")
}

fn metric(tg: &Tollgate, line_start: &str) -> Option<f64> {
    let text = tg.shared.load().metrics().encode(None);
    text.lines().find(|l| l.starts_with(line_start)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Polls `cond` until it holds (bounded); the tunnel's task ends a moment after its sockets.
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

#[tokio::test]
async fn websocket_echoes_small_and_large_messages_and_counts_the_tunnel() {
    let seen = Arc::default();
    let up = ws_upstream(Arc::clone(&seen)).await;
    let tg = Tollgate::start(&yaml(&up, "")).await;
    let mut ws = connect(&tg).await.unwrap();
    {
        let h = &seen.lock().unwrap()[0];
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
        assert!(h.contains_key("sec-websocket-key"));
        assert!(h["via"].to_str().unwrap().contains("tollgate"));
    }
    ws.send(Message::text("hello")).await.unwrap();
    assert_eq!(next(&mut ws).await.unwrap().unwrap(), Message::text("hello"));
    // Far beyond the tunnel's buffer and the sockets' windows: both directions at once.
    let big: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
    ws.send(Message::binary(big.clone())).await.unwrap();
    match next(&mut ws).await.unwrap().unwrap() {
        Message::Binary(b) => assert!(b[..] == big[..], "the large message came back changed"),
        other => panic!("expected the binary echo, got {other:?}"),
    }
    assert_eq!(metric(&tg, "tollgate_tunnels_open{route=\"ws\"}"), Some(1.0));
    let up_bytes = metric(&tg, "tollgate_tunnel_bytes_total{route=\"ws\",direction=\"up\"}").unwrap();
    assert!(up_bytes > f64::from(4u32 << 20), "{up_bytes}");
    ws.close(None).await.unwrap();
    // The server's Close reply, then the end of the stream.
    while let Some(Ok(_)) = next(&mut ws).await {}
    assert!(eventually(|| metric(&tg, "tollgate_tunnels_open{route=\"ws\"}") == Some(0.0)).await);
}

#[tokio::test]
async fn the_upstream_closing_closes_the_client_side() {
    let up = ws_upstream(Arc::default()).await;
    let tg = Tollgate::start(&yaml(&up, "")).await;
    let mut ws = connect(&tg).await.unwrap();
    ws.send(Message::text("bye")).await.unwrap();
    assert_eq!(next(&mut ws).await.unwrap().unwrap(), Message::text("bye"));
    match next(&mut ws).await {
        Some(Ok(Message::Close(_))) => {}
        other => panic!("expected the upstream's Close, got {other:?}"),
    }
    // The client's Close reply reaches the upstream, which closes; the tunnel ends.
    while let Some(Ok(_)) = next(&mut ws).await {}
    assert!(eventually(|| metric(&tg, "tollgate_tunnels_open{route=\"ws\"}") == Some(0.0)).await);
}

#[tokio::test]
async fn a_silent_tunnel_is_closed_after_its_idle_timeout() {
    let up = ws_upstream(Arc::default()).await;
    let tg = Tollgate::start(&yaml(&up, "    tunnels: { idle_timeout: 300ms }\n")).await;
    let mut ws = connect(&tg).await.unwrap();
    ws.send(Message::text("one")).await.unwrap();
    assert_eq!(next(&mut ws).await.unwrap().unwrap(), Message::text("one"));
    // Nothing more is sent: tollgate closes both sides (no Close frame, the socket ends).
    match next(&mut ws).await {
        None | Some(Err(_)) => {}
        Some(Ok(m)) => panic!("expected the tunnel to end, got {m:?}"),
    }
    assert!(eventually(|| metric(&tg, "tollgate_tunnels_open{route=\"ws\"}") == Some(0.0)).await);
}

#[tokio::test]
async fn a_tunnel_holds_its_concurrency_slot_until_it_closes() {
    let up = ws_upstream(Arc::default()).await;
    let tg = Tollgate::start(&yaml(&up, "    concurrency: 1\n")).await;
    let mut ws = connect(&tg).await.unwrap();
    ws.send(Message::text("x")).await.unwrap();
    assert_eq!(next(&mut ws).await.unwrap().unwrap(), Message::text("x"));
    let (s, _, _) = get(tg.addr, "/plain").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "the open tunnel holds the only slot");
    ws.close(None).await.unwrap();
    while let Some(Ok(_)) = next(&mut ws).await {}
    slot_comes_back(&tg).await;
}

#[tokio::test]
async fn tunnels_beyond_the_route_bound_are_refused() {
    let up = ws_upstream(Arc::default()).await;
    let tg = Tollgate::start(&yaml(&up, "    tunnels: { max: 1 }\n")).await;
    let mut first = connect(&tg).await.unwrap();
    first.send(Message::text("x")).await.unwrap();
    assert_eq!(next(&mut first).await.unwrap().unwrap(), Message::text("x"));
    match connect(&tg).await {
        Err(WsError::Http(resp)) => assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE),
        other => panic!("expected a 503, got {:?}", other.map(|_| ())),
    }
    // Plain requests on the route are not tunnels.
    assert_eq!(get(tg.addr, "/plain").await.0, StatusCode::OK);
}

#[tokio::test]
async fn an_upstream_refusing_the_upgrade_gives_an_ordinary_answer() {
    let up = Upstream::start(|_req| async {
        Response::builder().status(403).header("connection", "close").body(full("no sockets here")).unwrap()
    })
    .await;
    let tg = Tollgate::start(&yaml(&up, "")).await;
    match connect(&tg).await {
        Err(WsError::Http(resp)) => {
            assert_eq!(resp.status(), StatusCode::FORBIDDEN);
            assert!(resp.headers().get("upgrade").is_none());
            assert_eq!(resp.body().as_deref(), Some(&b"no sockets here"[..]));
        }
        other => panic!("expected the upstream's 403, got {:?}", other.map(|_| ())),
    }
}

/// Sends `head` raw and returns the whole answer (the server closes after it).
async fn raw(tg: &Tollgate, head: &str) -> String {
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(SOON, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn upgrade_h2c_and_unlisted_protocols_are_never_forwarded() {
    let seen: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
    let up = ws_upstream(Arc::clone(&seen)).await;
    let tg = Tollgate::start(&format!(
        "{}  - name: nows\n    match: {{ path_prefix: /nows }}\n    upstream: up\n    upgrades: []\n",
        proxy_yaml(up.addr, "", "")
    ))
    .await;
    let answer = raw(
        &tg,
        "GET /nows/x HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings, close\r\nupgrade: h2c\r\n\
         http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("plain"), "{answer}");
    let answer = raw(
        &tg,
        "GET /nows/x HTTP/1.1\r\nhost: x\r\nconnection: upgrade, close\r\nupgrade: websocket\r\n\
         sec-websocket-version: 13\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    for h in seen.lock().unwrap().iter() {
        for name in ["upgrade", "http2-settings", "connection"] {
            assert!(!h.contains_key(name), "{name} reached the upstream: {h:?}");
        }
    }
}

#[tokio::test]
async fn h2c_in_upgrades_is_refused_by_config() {
    let yaml = "listen: 127.0.0.1:0\nupstreams:\n  up: { url: 'http://127.0.0.1:1' }\nroutes:\n  - upstream: up\n    \
                upgrades: [websocket, h2c]\n";
    let e = tollgate::config::Config::from_yaml(std::path::Path::new("t.yaml"), yaml).unwrap_err().to_string();
    assert!(e.contains("routes[0].upgrades[1]") && e.contains("h2c smuggling"), "{e}");
}

#[tokio::test]
async fn a_101_to_a_protocol_not_offered_is_a_bad_gateway() {
    let up = Upstream::start(|_req| async {
        Response::builder().status(101).header("connection", "upgrade").header("upgrade", "h2c").body(full("")).unwrap()
    })
    .await;
    let tg = Tollgate::start(&yaml(&up, "")).await;
    match connect(&tg).await {
        Err(WsError::Http(resp)) => assert_eq!(resp.status(), StatusCode::BAD_GATEWAY),
        other => panic!("expected a 502, got {:?}", other.map(|_| ())),
    }
    assert_eq!(metric(&tg, "tollgate_tunnels_open{route=\"ws\"}"), Some(0.0));
}

/// A client's end of an HTTP/2 extended CONNECT stream as a byte stream, for tungstenite.
struct H2Io {
    send: h2::SendStream<bytes::Bytes>,
    recv: h2::RecvStream,
    buf: bytes::Bytes,
}

impl tokio::io::AsyncRead for H2Io {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        out: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        while self.buf.is_empty() {
            match std::task::ready!(self.recv.poll_data(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Ok(b)) => {
                    let _ = self.recv.flow_control().release_capacity(b.len());
                    self.buf = b;
                }
                Some(Err(e)) => return Poll::Ready(Err(std::io::Error::other(e))),
            }
        }
        let n = out.remaining().min(self.buf.len());
        out.put_slice(&self.buf.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for H2Io {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        // h2 queues what the flow-control window does not yet allow.
        let sent = self.send.send_data(bytes::Bytes::copy_from_slice(buf), false).map_err(std::io::Error::other);
        std::task::Poll::Ready(sent.map(|()| buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let _ = self.send.send_data(bytes::Bytes::new(), true);
        std::task::Poll::Ready(Ok(()))
    }
}

/// An RFC 8441 extended CONNECT for `websocket` to `path` over HTTP/2 (h2c) with the `h2`
/// crate's client: the response head, and the stream as a WebSocket when it is a 200.
async fn h2_websocket(tg: &Tollgate, path: &str) -> (http::response::Parts, Option<WebSocketStream<H2Io>>) {
    let tcp = TcpStream::connect(tg.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    // The server's SETTINGS announce SETTINGS_ENABLE_CONNECT_PROTOCOL (RFC 8441 §3).
    assert!(eventually(|| client.is_extended_connect_protocol_enabled()).await, "not announced");
    let req = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(format!("http://{}{path}", tg.addr))
        .header("sec-websocket-version", "13")
        .extension(h2::ext::Protocol::from_static("websocket"))
        .body(())
        .unwrap();
    let (resp, send) = client.send_request(req, false).unwrap();
    let resp = tokio::time::timeout(SOON, resp).await.unwrap().unwrap();
    let (parts, recv) = resp.into_parts();
    if parts.status != StatusCode::OK {
        return (parts, None);
    }
    let io = H2Io { send, recv, buf: bytes::Bytes::new() };
    (parts, Some(WebSocketStream::from_raw_socket(io, Role::Client, None).await))
}

async fn next_h2(ws: &mut WebSocketStream<H2Io>) -> Option<Result<Message, WsError>> {
    tokio::time::timeout(SOON, ws.next()).await.expect("the tunnel stalled")
}

#[tokio::test]
async fn websocket_over_http2_reaches_an_http1_upstream() {
    let seen = Arc::default();
    let up = ws_upstream(Arc::clone(&seen)).await;
    let tg = Tollgate::start(&yaml(&up, "")).await;
    let (head, ws) = h2_websocket(&tg, "/chat").await;
    assert_eq!(head.status, StatusCode::OK);
    assert!(head.headers.get("sec-websocket-accept").is_none() && head.headers.get("upgrade").is_none());
    let mut ws = ws.unwrap();
    {
        // The HTTP/1.1 handshake tollgate made of it.
        let h = &seen.lock().unwrap()[0];
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
        assert_eq!(h["sec-websocket-version"], "13");
        assert_eq!(h["sec-websocket-key"].len(), 24, "16 random bytes in base64");
    }
    ws.send(Message::text("hello")).await.unwrap();
    assert_eq!(next_h2(&mut ws).await.unwrap().unwrap(), Message::text("hello"));
    let big: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    ws.send(Message::binary(big.clone())).await.unwrap();
    match next_h2(&mut ws).await.unwrap().unwrap() {
        Message::Binary(b) => assert!(b[..] == big[..], "the large message came back changed"),
        other => panic!("expected the binary echo, got {other:?}"),
    }
    assert_eq!(metric(&tg, "tollgate_tunnels_open{route=\"ws\"}"), Some(1.0));
    // The upstream closes after `bye`: the client's stream ends too.
    ws.send(Message::text("bye")).await.unwrap();
    assert_eq!(next_h2(&mut ws).await.unwrap().unwrap(), Message::text("bye"));
    assert!(matches!(next_h2(&mut ws).await, Some(Ok(Message::Close(_)))));
    while let Some(Ok(_)) = next_h2(&mut ws).await {}
    assert!(eventually(|| metric(&tg, "tollgate_tunnels_open{route=\"ws\"}") == Some(0.0)).await);
}

#[tokio::test]
async fn an_extended_connect_not_switched_is_an_ordinary_answer_or_refused() {
    // The upstream refuses: its answer passes.
    let refusing = Upstream::start(|_req| async { Response::builder().status(403).body(full("no")).unwrap() }).await;
    let tg = Tollgate::start(&yaml(&refusing, "")).await;
    let (head, _) = h2_websocket(&tg, "/chat").await;
    assert_eq!(head.status, StatusCode::FORBIDDEN);
    // A success that switched nothing would open a tunnel to nothing: 502.
    let plain = Upstream::start(|_req| async { Response::new(full("a page")) }).await;
    let tg = Tollgate::start(&yaml(&plain, "")).await;
    assert_eq!(h2_websocket(&tg, "/chat").await.0.status, StatusCode::BAD_GATEWAY);
    // A 101 with a wrong Sec-WebSocket-Accept: 502.
    let wrong = Upstream::start(|_req| async {
        Response::builder()
            .status(101)
            .header("connection", "upgrade")
            .header("upgrade", "websocket")
            .header("sec-websocket-accept", derive_accept_key(b"another key"))
            .body(full(""))
            .unwrap()
    })
    .await;
    let tg = Tollgate::start(&yaml(&wrong, "")).await;
    assert_eq!(h2_websocket(&tg, "/chat").await.0.status, StatusCode::BAD_GATEWAY);
    // A route that passes no upgrades never forwards it.
    let seen = Arc::default();
    let up = ws_upstream(Arc::clone(&seen)).await;
    let tg = Tollgate::start(&yaml(&up, "    upgrades: []\n")).await;
    let (head, _) = h2_websocket(&tg, "/chat").await;
    assert_eq!(head.status, StatusCode::BAD_REQUEST);
    // Nor does a route to a group of servers.
    let other = ws_upstream(Arc::clone(&seen)).await;
    let group = format!(
        "listen: 127.0.0.1:0\nupstreams:\n  up:\n    servers: [{{ url: 'http://{}' }}, {{ url: 'http://{}' }}]\nroutes:\n  - name: ws\n    upstream: up\n    upgrades: []\n",
        up.addr, other.addr
    );
    let tg = Tollgate::start(&group).await;
    let (head, _) = h2_websocket(&tg, "/chat").await;
    assert_eq!(head.status, StatusCode::BAD_REQUEST);
    assert!(seen.lock().unwrap().is_empty(), "nothing reached the upstream");
}

#[tokio::test]
async fn a_websocket_over_http2_holds_its_concurrency_slot_and_idles_out() {
    let up = ws_upstream(Arc::default()).await;
    let tg = Tollgate::start(&yaml(&up, "    concurrency: 1\n    tunnels: { idle_timeout: 500ms }\n")).await;
    let (_, ws) = h2_websocket(&tg, "/chat").await;
    let mut ws = ws.unwrap();
    ws.send(Message::text("x")).await.unwrap();
    assert_eq!(next_h2(&mut ws).await.unwrap().unwrap(), Message::text("x"));
    assert_eq!(get(tg.addr, "/plain").await.0, StatusCode::SERVICE_UNAVAILABLE, "the tunnel holds the only slot");
    // Silent past its idle timeout: tollgate ends the stream, and the slot comes back.
    match next_h2(&mut ws).await {
        None | Some(Err(_)) => {}
        Some(Ok(m)) => panic!("expected the tunnel to end, got {m:?}"),
    }
    slot_comes_back(&tg).await;
}

/// The HTTP/2 connection carrying a WebSocket is not idle: its stream stays open for the
/// tunnel's life, so the connection's `h2.idle_timeout` never closes it under the tunnel.
#[tokio::test]
async fn an_http2_connection_carrying_a_websocket_is_not_idle() {
    let up = ws_upstream(Arc::default()).await;
    let yaml = yaml(&up, "").replace(
        "listen: 127.0.0.1:0\n",
        "listen: 127.0.0.1:0\nserver: { h2: { idle_timeout: 200ms, ping_timeout: 200ms } }\n",
    );
    let tg = Tollgate::start(&yaml).await;
    let (_, ws) = h2_websocket(&tg, "/chat").await;
    let mut ws = ws.unwrap();
    for i in 0..4 {
        // Well past idle_timeout + ping_timeout between messages.
        tokio::time::sleep(Duration::from_millis(500)).await;
        ws.send(Message::text(format!("m{i}"))).await.unwrap();
        assert_eq!(next_h2(&mut ws).await.unwrap().unwrap(), Message::text(format!("m{i}")));
    }
}

/// The route's only concurrency slot is free again (the tunnel that held it closed): `/plain`
/// answers 200 within a few seconds.
async fn slot_comes_back(tg: &Tollgate) {
    let mut last = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..200 {
        last = get(tg.addr, "/plain").await.0;
        if last == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(last, StatusCode::OK, "the slot came back when the tunnel closed");
}
