//! Tunnels: the bytes of an upgraded connection (RFC 9110 §7.8), copied both ways only after
//! the upstream has answered `101 Switching Protocols` to an upgrade the route allows.
//!
//! A tunnel holds whatever it is given to hold (the route's concurrency slot, its tunnel
//! slot) until it ends; it ends as a whole: when either side closes or fails, or when no
//! byte has moved either way for the route's `tunnels.idle_timeout`, both sides are closed.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use http::header::{self, HeaderMap, HeaderValue};
use http::Version;
use hyper::upgrade::{OnUpgrade, Upgraded};
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::body::watch::Watch;
use crate::metrics::TunnelMetrics;

/// Bytes read from one side before they are written to the other.
const BUF: usize = 16 << 10;

/// The `Upgrade` value to send upstream for this request: the protocols it asks for that
/// `allowed` lists (never `h2c`), or `None` when it is no upgrade the route passes on (it is
/// then forwarded as an ordinary request, `Upgrade` and `Connection` removed).
///
/// An upgrade is an HTTP/1.1 request with `Upgrade` and `upgrade` among its `Connection`
/// options (RFC 9110 §7.8); HTTP/2 has neither field, but an extended CONNECT with
/// `:protocol websocket` (RFC 8441) asks for the same, and goes upstream as one (see
/// [`websocket_key`]).
#[inline(always)]
pub fn wanted(
    headers: &HeaderMap,
    extensions: &http::Extensions,
    version: Version,
    allowed: &[HeaderValue],
) -> Option<HeaderValue> {
    // hyper's HTTP/1.1 server leaves an `OnUpgrade` on a request with `Upgrade` (and only
    // there): a plain request's empty extensions answer this without a field lookup.
    extensions.get::<OnUpgrade>()?;
    asked(headers, extensions, version, allowed)
}

#[cold]
fn asked(
    headers: &HeaderMap,
    extensions: &http::Extensions,
    version: Version,
    allowed: &[HeaderValue],
) -> Option<HeaderValue> {
    if version == Version::HTTP_2 {
        // hyper's HTTP/2 server leaves an `OnUpgrade` on every CONNECT, and `:protocol` on an
        // extended one. Only WebSocket is defined over it.
        let protocol = extensions.get::<hyper::ext::Protocol>()?.as_str();
        let passed = protocol.eq_ignore_ascii_case("websocket")
            && allowed.iter().any(|a| a.as_bytes().eq_ignore_ascii_case(b"websocket"));
        return passed.then(|| HeaderValue::from_static("websocket"));
    }
    if version != Version::HTTP_11 {
        return None;
    }
    let asked = headers.get(header::UPGRADE)?;
    if !connection_has_upgrade(headers) {
        return None;
    }
    let mut kept: Vec<&str> = Vec::new();
    let mut all = true;
    for field in headers.get_all(header::UPGRADE) {
        let Ok(text) = field.to_str() else { return None };
        for token in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let name = token.split_once('/').map_or(token, |(n, _)| n);
            if allowed.iter().any(|a| a.as_bytes().eq_ignore_ascii_case(name.as_bytes())) {
                kept.push(token);
            } else {
                all = false;
            }
        }
    }
    if kept.is_empty() {
        return None;
    }
    if all && headers.get_all(header::UPGRADE).iter().count() == 1 {
        return Some(asked.clone());
    }
    HeaderValue::from_str(&kept.join(", ")).ok()
}

fn connection_has_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .any(|v| v.as_bytes().split(|&b| b == b',').any(|t| trim(t).eq_ignore_ascii_case(b"upgrade")))
}

/// The protocol a `101` switched to, if it is one of `offered` (RFC 9110 §7.8: the server
/// names the one it chose in `Upgrade`).
pub fn chosen(resp: &HeaderMap, offered: &HeaderValue) -> Option<HeaderValue> {
    let value = resp.get(header::UPGRADE)?;
    let name = |t: &[u8]| -> Vec<u8> {
        let t = trim(t);
        t.split(|&b| b == b'/').next().unwrap_or(t).to_ascii_lowercase()
    };
    let picked = value.as_bytes();
    if picked.contains(&b',') {
        return None;
    }
    let picked_name = name(picked);
    offered.as_bytes().split(|&b| b == b',').any(|o| name(o) == picked_name).then(|| value.clone())
}

/// A fresh `Sec-WebSocket-Key` (RFC 6455 §4.1: 16 random bytes, base64) for the HTTP/1.1
/// handshake an extended CONNECT becomes (RFC 8441 §5: the HTTP/2 client sends none; the
/// proxy makes the one the upstream answers).
pub fn websocket_key() -> Option<HeaderValue> {
    use base64::Engine as _;
    let mut nonce = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce).ok()?;
    HeaderValue::from_str(&base64::engine::general_purpose::STANDARD.encode(nonce)).ok()
}

/// Whether a `101`'s `Sec-WebSocket-Accept` answers `key` (RFC 6455 §4.2.2: base64 of the
/// SHA-1 of the key and the protocol's GUID).
pub fn accepts(resp: &HeaderMap, key: &HeaderValue) -> bool {
    use base64::Engine as _;
    const GUID: &[u8] = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(key.as_bytes());
    ctx.update(GUID);
    let expected = base64::engine::general_purpose::STANDARD.encode(ctx.finish());
    resp.get_all(header::SEC_WEBSOCKET_ACCEPT).iter().count() == 1
        && resp.get(header::SEC_WEBSOCKET_ACCEPT).is_some_and(|v| trim(v.as_bytes()) == expected.as_bytes())
}

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|b| !matches!(b, b' ' | b'\t')).unwrap_or(bytes.len());
    let end = bytes.iter().rposition(|b| !matches!(b, b' ' | b'\t')).map_or(start, |i| i + 1);
    &bytes[start..end]
}

/// Both ends of an accepted upgrade, waiting to be handed what the tunnel holds. It travels
/// from the forwarder to the request flow in the `101`'s extensions, which must be `Clone`:
/// hence the shared cell, taken once.
#[derive(Clone)]
pub struct Pending(Arc<Mutex<Option<Ends>>>);

struct Ends {
    client: OnUpgrade,
    upstream: OnUpgrade,
    held: Box<dyn std::any::Any + Send>,
    watch: Option<Arc<dyn Watch>>,
}

/// A request's message checks, for the tunnel it may become: put in its extensions by the
/// request path of a route with message limits, taken by the forwarder (see
/// [`super::websocket`]).
#[derive(Clone)]
pub struct Watched(pub Arc<dyn Watch>);

impl Pending {
    /// `held` (the route's tunnel slot) goes with the tunnel.
    /// With `watch`, the tunnel follows the WebSocket frames and checks its messages.
    pub fn new<H: Send + 'static>(
        client: OnUpgrade,
        upstream: OnUpgrade,
        held: H,
        watch: Option<Arc<dyn Watch>>,
    ) -> Pending {
        Pending(Arc::new(Mutex::new(Some(Ends { client, upstream, held: Box::new(held), watch }))))
    }

    /// Runs the tunnel on its own task once both sides have switched; what it holds (and
    /// `more`, the route's concurrency slot) is dropped when it ends, or when either side
    /// fails to switch.
    pub fn start<H: Send + 'static>(self, idle_timeout: Duration, metrics: TunnelMetrics, more: H) {
        let ends = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let Some(Ends { client, upstream, held, watch }) = ends else { return };
        tokio::spawn(async move {
            let (client, upstream) = match tokio::try_join!(client, upstream) {
                Ok(both) => both,
                Err(e) => {
                    tracing::debug!(error = %e, "an upgrade did not complete");
                    drop((held, more));
                    return;
                }
            };
            metrics.open.inc();
            let end = match watch {
                None => run(client, upstream, idle_timeout, &metrics).await,
                Some(watch) => super::websocket::run(client, upstream, idle_timeout, &metrics, watch).await,
            };
            metrics.open.dec();
            tracing::debug!(end, "tunnel closed");
            drop((held, more));
        });
    }
}

/// Copies both ways until one side ends or fails, or nothing moves for `idle`; then closes
/// both. Returns why it ended (for the debug log).
async fn run(client: Upgraded, upstream: Upgraded, idle: Duration, metrics: &TunnelMetrics) -> &'static str {
    let mut client = TokioIo::new(client);
    let mut upstream = TokioIo::new(upstream);
    let mut up = Pipe::new(metrics.bytes_up.clone());
    let mut down = Pipe::new(metrics.bytes_down.clone());
    let mut last = Instant::now();
    let sleep = tokio::time::sleep(idle);
    tokio::pin!(sleep);
    let end = poll_fn(|cx| {
        let mut moved = false;
        let ended = match up.poll(cx, &mut client, &mut upstream, &mut moved) {
            Poll::Ready(Ok(())) => Some("the client closed"),
            Poll::Ready(Err(_)) => Some("the client side failed"),
            Poll::Pending => None,
        }
        .or(match down.poll(cx, &mut upstream, &mut client, &mut moved) {
            Poll::Ready(Ok(())) => Some("the upstream closed"),
            Poll::Ready(Err(_)) => Some("the upstream side failed"),
            Poll::Pending => None,
        });
        if let Some(end) = ended {
            return Poll::Ready(end);
        }
        if moved {
            last = Instant::now();
        }
        // The timer is moved only when it fires: bytes flowing cost no timer reset.
        while sleep.as_mut().poll(cx).is_ready() {
            let due = last + idle;
            if due <= Instant::now() {
                return Poll::Ready("idle timeout");
            }
            sleep.as_mut().reset(due.into());
        }
        Poll::Pending
    })
    .await;
    // Close both together: a FIN each way, bounded so a stalled peer cannot hold the task.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = client.shutdown().await;
        let _ = upstream.shutdown().await;
    })
    .await;
    end
}

/// One direction of a tunnel: what was read and not yet written.
struct Pipe {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Written since the last flush.
    dirty: bool,
    bytes: Counter,
}

impl Pipe {
    fn new(bytes: Counter) -> Pipe {
        Pipe { buf: vec![0; BUF].into_boxed_slice(), start: 0, end: 0, dirty: false, bytes }
    }

    /// Moves bytes from `from` to `to` until neither can go on; `Ready(Ok)` at `from`'s end.
    fn poll<R, W>(&mut self, cx: &mut Context<'_>, from: &mut R, to: &mut W, moved: &mut bool) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        loop {
            while self.start < self.end {
                let n = ready!(Pin::new(&mut *to).poll_write(cx, &self.buf[self.start..self.end]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                self.start += n;
                self.dirty = true;
                self.bytes.inc_by(n as u64);
                *moved = true;
            }
            let mut read = ReadBuf::new(&mut self.buf);
            match Pin::new(&mut *from).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) => {
                    let n = read.filled().len();
                    if n == 0 {
                        return Pin::new(&mut *to).poll_flush(cx);
                    }
                    (self.start, self.end) = (0, n);
                    *moved = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if self.dirty {
                        ready!(Pin::new(&mut *to).poll_flush(cx))?;
                        self.dirty = false;
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A head as hyper's server hands it on: with an `OnUpgrade` when it has `Upgrade`.
    fn head(version: Version, fields: &[(&str, &str)]) -> http::request::Parts {
        let mut req = http::Request::builder().version(version).uri("/ws");
        for (n, v) in fields {
            req = req.header(*n, *v);
        }
        let mut parts = req.body(()).unwrap().into_parts().0;
        if parts.headers.contains_key(header::UPGRADE) {
            let mut carrier = http::Request::new(());
            let on = hyper::upgrade::on(&mut carrier);
            parts.extensions.insert(on);
        }
        parts
    }

    fn ws() -> Vec<HeaderValue> {
        vec![HeaderValue::from_static("websocket")]
    }

    #[test]
    fn an_allowed_upgrade_is_passed_on_as_asked() {
        let p = head(Version::HTTP_11, &[("connection", "keep-alive, Upgrade"), ("upgrade", "WebSocket")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()).unwrap(), "WebSocket");
    }

    #[test]
    fn h2c_and_unlisted_protocols_are_never_passed_on() {
        let p = head(Version::HTTP_11, &[("connection", "upgrade"), ("upgrade", "h2c")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()), None);
        let p = head(Version::HTTP_11, &[("connection", "upgrade"), ("upgrade", "h2c, websocket")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()).unwrap(), "websocket");
        let p = head(Version::HTTP_11, &[("connection", "upgrade"), ("upgrade", "websocket")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &[]), None);
        let p = head(Version::HTTP_11, &[("connection", "upgrade"), ("upgrade", "foo/2")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()), None);
    }

    #[test]
    fn an_upgrade_needs_the_connection_option_and_http_1_1() {
        let p = head(Version::HTTP_11, &[("upgrade", "websocket")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()), None);
        let p = head(Version::HTTP_11, &[("connection", "upgraded"), ("upgrade", "websocket")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()), None);
        let p = head(Version::HTTP_10, &[("connection", "upgrade"), ("upgrade", "websocket")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()), None);
        let p = head(Version::HTTP_2, &[("connection", "upgrade"), ("upgrade", "websocket")]);
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()), None);
    }

    #[test]
    fn an_extended_connect_for_websocket_is_an_upgrade() {
        let mut p = head(Version::HTTP_2, &[]);
        let mut carrier = http::Request::new(());
        p.extensions.insert(hyper::upgrade::on(&mut carrier));
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()), None, "a plain CONNECT");
        p.extensions.insert(hyper::ext::Protocol::from_static("websocket"));
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()).unwrap(), "websocket");
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &[]), None);
        p.extensions.insert(hyper::ext::Protocol::from_static("connect-udp"));
        assert_eq!(wanted(&p.headers, &p.extensions, p.version, &ws()), None);
    }

    #[test]
    fn the_accept_check_follows_rfc_6455() {
        // RFC 6455 §1.3's example.
        let key = HeaderValue::from_static("dGhlIHNhbXBsZSBub25jZQ==");
        let mut h = HeaderMap::new();
        assert!(!accepts(&h, &key));
        h.insert(header::SEC_WEBSOCKET_ACCEPT, HeaderValue::from_static("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="));
        assert!(accepts(&h, &key));
        h.insert(header::SEC_WEBSOCKET_ACCEPT, HeaderValue::from_static("s3pPLMBiTxaQ9kYGzzhZRbK+xOo"));
        assert!(!accepts(&h, &key));
        let (a, b) = (websocket_key().unwrap(), websocket_key().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 24);
    }

    #[test]
    fn a_101_must_name_one_offered_protocol() {
        let offered = HeaderValue::from_static("websocket");
        let mut h = HeaderMap::new();
        assert_eq!(chosen(&h, &offered), None);
        h.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        assert_eq!(chosen(&h, &offered), None);
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket, h2c"));
        assert_eq!(chosen(&h, &offered), None);
        h.insert(header::UPGRADE, HeaderValue::from_static("WebSocket"));
        assert_eq!(chosen(&h, &offered).unwrap(), "WebSocket");
    }
}
