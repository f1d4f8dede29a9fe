//! HTTP/3: the QUIC endpoint of an `http3: true` listener, on a UDP socket of the TLS
//! listener's address. One endpoint per listener, on the first worker: the kernel's
//! `SO_REUSEPORT` spreads UDP datagrams by their addresses, and a QUIC connection may change
//! its client address (migration), so sockets per worker would need a steering program to
//! keep a connection on one; the endpoint's task and its connections share the first
//! worker's runtime instead.
//!
//! New connections pass [`crate::listen::quic::Admission`] (Retry past a handshake rate, a
//! bound per address a second) and `server.max_connections` (counted with TCP's). Each
//! request is handed to [`crate::proxy::Proxy::handle_peer`] as any other, its body an
//! [`Inbound::H3`]; its answer streamed back with its trailers. On shutdown each connection
//! sends GOAWAY, lets its requests finish within the grace period, then closes.

use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header;
use http_body_util::BodyExt;
use tokio::sync::watch;
use tokio::task::JoinSet;

mod head;

use super::{Current, Open, Stop, Stopping};
use crate::body::Inbound;
use crate::config::Quic;
use crate::listen::quic::{Admission, Verdict};
use crate::metrics::QuicMetrics;
use crate::proxy::Shared;

/// How long a connection that sent GOAWAY and has no request left waits for its client to
/// close it (so the last answers are delivered) before closing it itself.
const LINGER: Duration = Duration::from_secs(1);

/// HTTP/3's `H3_NO_ERROR`, for a connection closed without fault of its own.
const NO_ERROR: u32 = 0x100;

/// The UDP side of listener `idx`: an endpoint on `addr` (the TCP listener's own address).
///
/// # Errors
/// The UDP socket cannot be bound or registered.
pub(super) fn endpoint(addr: SocketAddr, config: Arc<quinn::ServerConfig>) -> std::io::Result<quinn::Endpoint> {
    let socket = std::net::UdpSocket::bind(addr)?;
    let runtime = Arc::new(quinn::TokioRuntime);
    quinn::Endpoint::new(quinn::EndpointConfig::default(), Some(quinn::ServerConfig::clone(&config)), socket, runtime)
}

/// Accepts QUIC connections of listener `idx` on `endpoint` until the server stops; then
/// waits (within the grace period, as the TCP side) for the connections' requests to end.
pub(super) async fn serve(endpoint: quinn::Endpoint, idx: usize, proxy: Shared, stop: Stop, mut current: Current) {
    let mut admission = Admission::default();
    let mut config = proxy.load().listener_quic(idx).cloned();
    let mut stopping = Stopping::new(stop.clone());
    loop {
        let incoming = tokio::select! {
            biased;
            () = std::future::poll_fn(|cx| if stopping.poll(cx) { Poll::Ready(()) } else { Poll::Pending }) => break,
            incoming = endpoint.accept() => incoming,
        };
        let Some(incoming) = incoming else { break };
        let settings = current.get(&proxy).clone();
        let now = proxy.load_full();
        let metrics = &settings.metrics.edge.quic;
        let (Some(listener), Some(fresh)) = (now.config.listeners.get(idx), now.listener_quic(idx)) else {
            metrics.refused("no_certificate");
            incoming.refuse();
            continue;
        };
        let quic = listener.http3.clone().unwrap_or_default();
        // A reload's certificates and settings apply to the connections that come next (each
        // is accepted with the config in effect; the endpoint's own, which makes its Retry
        // tokens, follows).
        if !config.as_ref().is_some_and(|c| Arc::ptr_eq(c, fresh)) {
            endpoint.set_server_config(Some(quinn::ServerConfig::clone(fresh)));
            config = Some(fresh.clone());
        }
        let ip = incoming.remote_address().ip();
        match admission.check(
            ip,
            incoming.remote_address_validated(),
            Instant::now(),
            quic.retry_above,
            quic.new_connections_per_ip,
        ) {
            Verdict::Accept => {}
            Verdict::Retry if incoming.may_retry() => {
                metrics.retries.inc();
                if let Err(e) = incoming.retry() {
                    e.into_incoming().ignore();
                }
                continue;
            }
            Verdict::Retry => {}
            Verdict::Refuse => {
                metrics.refused("per_ip");
                incoming.refuse();
                continue;
            }
        }
        let m = &settings.metrics;
        if m.open.inc() >= i64::try_from(settings.cfg.max_connections).unwrap_or(i64::MAX) {
            m.open.dec();
            m.refused.inc();
            incoming.refuse();
            continue;
        }
        m.accepted.inc();
        let open = Open(m.open.clone());
        let handshake_timeout = listener.tls.as_ref().map_or(Duration::from_secs(10), |t| t.handshake_timeout);
        let header_timeout = settings.cfg.header_read_timeout;
        let max_header_bytes = u64::try_from(settings.cfg.max_header_bytes).unwrap_or(u64::MAX);
        let (proxy, stop, metrics, fresh) = (proxy.clone(), stop.clone(), metrics.clone(), fresh.clone());
        drop(now);
        tokio::spawn(async move {
            let _open = open;
            let limits = Limits { quic, handshake_timeout, header_timeout, max_header_bytes };
            connection(incoming, fresh, limits, proxy, stop, metrics).await;
        });
    }
    // No new connection; those open get GOAWAY from their own tasks (they hold `stop`).
    drop(stop);
    endpoint.set_server_config(None);
}

/// What one connection is served with, taken from the config when it was accepted.
struct Limits {
    quic: Quic,
    handshake_timeout: Duration,
    header_timeout: Duration,
    max_header_bytes: u64,
}

/// One QUIC connection: the handshake, then HTTP/3 until the client leaves, the idle
/// timeout closes it, or the server stops (GOAWAY, its requests finish, then it closes).
async fn connection(
    incoming: quinn::Incoming,
    config: Arc<quinn::ServerConfig>,
    limits: Limits,
    proxy: Shared,
    stop: Stop,
    metrics: QuicMetrics,
) {
    let connecting = match incoming.accept_with(config) {
        Ok(c) => c,
        Err(e) => {
            metrics.refused("handshake");
            tracing::debug!(error = %e, "QUIC connection refused");
            return;
        }
    };
    // With 0-RTT, requests may arrive before the handshake ends; only safe methods are
    // served before then (see `request`). Without it, nothing is read before the end. Either
    // way a handshake not done within `handshake_timeout` ends the connection (and frees its
    // place under `server.max_connections`).
    let (conn, confirmed) = if limits.quic.early_data {
        match connecting.into_0rtt() {
            Ok((conn, accepted)) => {
                let (tx, rx) = watch::channel(false);
                let (watched, metrics, timeout) = (conn.clone(), metrics.clone(), limits.handshake_timeout);
                tokio::spawn(async move {
                    // Resolves once the handshake ends (whether the client used 0-RTT or not),
                    // or the connection closed first: only the first lets requests on. The
                    // connection's task ends once the connection is closed.
                    match tokio::time::timeout(timeout, accepted).await {
                        Ok(_) if watched.close_reason().is_none() => {
                            metrics.handshakes.inc();
                            let _ = tx.send(true);
                        }
                        // Dropped: the requests waiting for it are dropped.
                        Ok(_) => metrics.refused("handshake"),
                        Err(_) => {
                            metrics.refused("handshake_timeout");
                            watched.close(quinn::VarInt::from_u32(NO_ERROR), b"handshake timeout");
                        }
                    }
                });
                (conn, Some(rx))
            }
            Err(_) => return metrics.refused("handshake"),
        }
    } else {
        match tokio::time::timeout(limits.handshake_timeout, connecting).await {
            Ok(Ok(conn)) => {
                metrics.handshakes.inc();
                (conn, None)
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "QUIC handshake failed");
                return metrics.refused("handshake");
            }
            Err(_) => return metrics.refused("handshake_timeout"),
        }
    };
    metrics.open.inc();
    let _open = Open(metrics.open.clone());
    let peer = crate::listen::quic::peer(&conn);
    let built = h3::server::builder()
        .max_field_section_size(limits.max_header_bytes)
        .build::<_, Bytes>(h3_quinn::Connection::new(conn.clone()))
        .await;
    let mut h3c = match built {
        Ok(c) => c,
        Err(e) => return tracing::debug!(error = %e, "HTTP/3 connection setup failed"),
    };
    let mut requests = JoinSet::new();
    let mut stopping = Stopping::new(stop.clone());
    loop {
        tokio::select! {
            biased;
            () = std::future::poll_fn(|cx| if stopping.poll(cx) { Poll::Ready(()) } else { Poll::Pending }) => {
                // GOAWAY: no request after those already taken.
                let _ = h3c.shutdown(0).await;
                break;
            }
            Some(_) = requests.join_next(), if !requests.is_empty() => {}
            accepted = h3c.accept() => match accepted {
                Ok(Some(resolver)) => {
                    let (proxy, peer, confirmed, metrics) = (proxy.clone(), peer.clone(), confirmed.clone(), metrics.clone());
                    let header_timeout = limits.header_timeout;
                    requests.spawn(async move {
                        let Ok(Ok((req, stream, malformed))) = tokio::time::timeout(header_timeout, resolve(resolver)).await else {
                            return;
                        };
                        metrics.requests.inc();
                        request(req, stream, proxy, peer, confirmed, malformed).await;
                    });
                }
                // The client sent GOAWAY and its requests are done, or the connection ended
                // (closed by the client, or idle).
                Ok(None) | Err(_) => break,
            },
        }
    }
    // In-flight requests finish (the server's grace period bounds this: past it, the task
    // ends with the runtime).
    while requests.join_next().await.is_some() {}
    drop(h3c);
    // The client closes once it has the last answers; after a short wait, the server does.
    let _ = tokio::time::timeout(LINGER, conn.closed()).await;
    conn.close(0u32.into(), b"");
    drop(stop);
}

/// A request stream's head, read and decoded by `h3` (which refuses what it finds malformed
/// with `H3_MESSAGE_ERROR`), with what RFC 9114 finds malformed in it beyond that (see
/// [`head`]): the pseudo-headers read from the encoded section before `h3` decodes it.
async fn resolve(
    mut resolver: h3::server::RequestResolver<h3_quinn::Connection, Bytes>,
) -> Result<(http::Request<()>, Stream, Option<&'static str>), h3::error::StreamError> {
    let frame = std::future::poll_fn(|cx| resolver.frame_stream.poll_next(cx)).await;
    let mut malformed = match &frame {
        Ok(Some(h3::proto::frame::Frame::Headers(section))) => head::pseudo_headers(section),
        _ => None,
    };
    let (req, stream) = resolver.accept_with_frame(frame)?.resolve().await?;
    malformed = malformed.or_else(|| head::connection_fields(req.headers()));
    Ok((req, stream, malformed))
}

type Stream = h3::server::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;

/// One request: through the proxy's request path, its answer sent back on the stream. A
/// `malformed` head goes there too, marked, to be refused with `400` like any bad head (see
/// [`crate::framing::Malformed`]); the client is asked to stop sending with
/// `H3_MESSAGE_ERROR`.
async fn request(
    mut req: http::Request<()>,
    stream: Stream,
    proxy: Shared,
    peer: crate::peer::Peer,
    confirmed: Option<watch::Receiver<bool>>,
    malformed: Option<&'static str>,
) {
    // 0-RTT: an unsafe request waits for the handshake's end, which a replayed flight never
    // reaches; a safe one is served at once (and counted by limits as any request).
    if let Some(mut rx) = confirmed {
        if !req.method().is_safe() && rx.wait_for(|c| *c).await.is_err() {
            return;
        }
    }
    let head_only = req.method() == http::Method::HEAD;
    let length =
        req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let (mut send, recv) = stream.split();
    let mut body = crate::body::h3::Recv::new(recv, length);
    if let Some(why) = malformed {
        body.refuse();
        req.extensions_mut().insert(crate::framing::Malformed(why));
    } else if !body.is_end_stream() && length == Some(0) {
        // No data may follow; the end is awaited here, since nothing polls an empty body.
        if let Err(e) = body.end_of_empty().await {
            req.extensions_mut().insert(crate::framing::Malformed(e));
        }
    }
    let req = req.map(|()| Inbound::H3(Box::new(body)));
    let resp = proxy.load_full().handle_peer(req, peer).await;
    let (mut parts, body) = resp.into_parts();
    // Fields of a connection, which HTTP/3 has no use for (RFC 9114 §4.2).
    for name in [header::CONNECTION, header::TRANSFER_ENCODING, header::UPGRADE] {
        parts.headers.remove(name);
    }
    parts.headers.remove("keep-alive");
    parts.headers.remove("proxy-connection");
    // hyper writes these two on HTTP/1.1 and HTTP/2 answers; HTTP/3's must too (RFC 9110
    // §6.6.1, and a HEAD answer carries the GET's fields: see `announce_length`).
    if !parts.headers.contains_key(header::DATE) {
        parts.headers.insert(header::DATE, date::now());
    }
    super::announce_length(&mut parts.headers, parts.status, &body);
    let bodiless = head_only || matches!(parts.status.as_u16(), 204 | 304);
    if send.send_response(http::Response::from_parts(parts, ())).await.is_err() {
        return;
    }
    if !bodiless {
        let mut body = pin!(body);
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(e) => {
                    tracing::debug!(error = %e, "an HTTP/3 answer's body failed");
                    send.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
                    return;
                }
            };
            match frame.into_data() {
                Ok(data) => {
                    if send.send_data(data).await.is_err() {
                        return;
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        if send.send_trailers(trailers).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }
    let _ = send.finish().await;
}

/// The `Date` of HTTP/3 answers, formatted at most once a second on each thread.
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    use http::HeaderValue;

    thread_local! {
        static NOW: RefCell<(u64, HeaderValue)> = const { RefCell::new((u64::MAX, HeaderValue::from_static(""))) };
    }

    pub(super) fn now() -> HeaderValue {
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        NOW.with_borrow_mut(|(at, value)| {
            if *at != secs {
                if let Ok(formatted) = HeaderValue::try_from(httpdate::fmt_http_date(now)) {
                    (*at, *value) = (secs, formatted);
                }
            }
            value.clone()
        })
    }
}
