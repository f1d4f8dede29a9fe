//! Shared HTTP/2 connections to one HTTP/2 upstream: `protocol: h2c` (prior knowledge, no
//! TLS), `h2` (TLS, ALPN `h2` only), or the connections of an `auto` one whose ALPN chose `h2`
//! ([`H2Pool::adopt`]).
//!
//! The `h2` crate's client, driven without a task or channel per request: each connection has
//! one task (it reads and writes the socket and sends the keep-alive PINGs), and a request is
//! sent from its own future ([`exchange`]), which also pumps the request body until the
//! response head; after it, the response body does ([`crate::body::h2::Pump`]).
//!
//! Requests go as streams on the least busy open connection; a new connection is opened
//! when every open one carries `max_streams_per_connection` streams, up to
//! `max_connections`; past that the least busy one takes the stream anyway (HTTP/2 itself
//! holds it until the upstream's own stream limit allows). A stream counts from checkout
//! until its response body ends or is dropped ([`Stream`]). The list of connections is read
//! without a lock at checkout; the lock is taken only to add a connection or drop closed
//! ones. A connection is closed for new streams once its task ends (the upstream closed it,
//! or a PING went unanswered) or the upstream sent GOAWAY.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use h2::client::{Connection, SendRequest};
use h2::{Ping, PingPong, Reason, RecvStream};
use http::{Request, Response};
use http_body::Body as _;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::connector::{Alpn, Connected, Connector};
use super::pool::ConnectError;
use crate::body::h2::{Pump, Pumped};
use crate::body::{ClientBodyError, RequestBody};
use crate::config::UpstreamH2;

pub type Send = SendRequest<Bytes>;

/// One stream's place on its connection; given back on drop.
pub use crate::body::Place as Stream;

/// The bit of a connection's stream count that says it takes no new streams.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// hyper's HTTP/2 client windows, kept: a stream may have 2 MiB in flight, a connection 5 MiB.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
/// Request data h2 buffers per stream beyond the upstream's window.
const SEND_BUFFER: usize = 1024 * 1024;
/// The largest response head accepted.
const MAX_HEADER_LIST: u32 = 16 * 1024;

struct Conn {
    send: Send,
    /// Open streams, and [`CLOSED`].
    streams: Arc<AtomicUsize>,
}

impl Conn {
    fn load(&self) -> usize {
        self.streams.load(Ordering::Relaxed)
    }
}

pub struct H2Pool {
    /// Read at every checkout, without a lock.
    conns: ArcSwap<Vec<Arc<Conn>>>,
    /// Held to replace `conns` (a connection added, closed ones dropped).
    changing: std::sync::Mutex<()>,
    /// Held while connecting, so a burst opens one connection, not one per request.
    connecting: tokio::sync::Mutex<()>,
    /// TCP for `h2c`; TLS offering `h2` only for `h2` (and for `auto`, whose new connections
    /// are opened by the forwarder and handed over).
    connector: Connector,
    cfg: UpstreamH2,
}

impl H2Pool {
    pub fn new(connector: Connector, cfg: UpstreamH2) -> H2Pool {
        H2Pool {
            conns: ArcSwap::from_pointee(Vec::new()),
            changing: std::sync::Mutex::new(()),
            connecting: tokio::sync::Mutex::new(()),
            connector,
            cfg,
        }
    }

    pub fn connector(&self) -> &Connector {
        &self.connector
    }

    /// A connection for one more stream.
    ///
    /// # Errors
    /// No connection is open and none can be made.
    pub async fn checkout(&self) -> Result<(Send, Stream), ConnectError> {
        if let Some(got) = self.pick(true) {
            return Ok(got);
        }
        let _connecting = self.connecting.lock().await;
        // Another checkout may have connected while this one waited.
        if let Some(got) = self.pick(true) {
            return Ok(got);
        }
        // `h2` only: the connector refuses a TLS connection on which ALPN chose anything else.
        match self.connector.connect(Alpn::H2).await {
            Ok(c) => self.adopt(c).await,
            // The upstream refuses a new connection, but an open one may still carry it.
            Err(e) => self.pick(false).ok_or(e),
        }
    }

    /// Whether more streams fit on the open connections without a new one (`auto`: else a new
    /// connection is opened, and ALPN says which pool it joins).
    pub fn ready(&self) -> Option<(Send, Stream)> {
        self.pick(true)
    }

    /// The least busy open connection, however busy (`auto`, when a new one cannot be made).
    pub fn any(&self) -> Option<(Send, Stream)> {
        self.pick(false)
    }

    /// Held by `auto` while it opens a connection that may join this pool, so that a burst
    /// opens one connection, not one per request, once the upstream is known to speak h2.
    pub async fn connecting(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.connecting.lock().await
    }

    /// A new connection (prior knowledge, or ALPN chose `h2`) made HTTP/2 and added to the
    /// pool, with one stream taken on it.
    ///
    /// # Errors
    /// The HTTP/2 handshake fails or times out.
    pub async fn adopt(&self, connected: Connected) -> Result<(Send, Stream), ConnectError> {
        let conn = match connected {
            Connected::Plain(s) => self.handshake(s).await?,
            Connected::Tls(s) => self.handshake(s).await?,
        };
        let got = (conn.send.clone(), Stream::take(&conn.streams));
        self.change(|conns| conns.push(Arc::new(conn)));
        Ok(got)
    }

    /// The least busy open connection: only one under the stream bound while more
    /// connections may be opened (`bounded`), else any. Lock-free unless a closed connection
    /// is found (it is dropped from the list).
    fn pick(&self, bounded: bool) -> Option<(Send, Stream)> {
        let conns = self.conns.load();
        let mut least: Option<(&Arc<Conn>, usize)> = None;
        let mut open = 0;
        for c in conns.iter() {
            let busy = c.load();
            if busy & CLOSED != 0 {
                continue;
            }
            open += 1;
            if least.is_none_or(|(_, b)| busy < b) {
                least = Some((c, busy));
            }
        }
        if open < conns.len() {
            self.change(|conns| conns.retain(|c| c.load() & CLOSED == 0));
        }
        let (least, busy) = least?;
        if bounded && busy >= self.cfg.max_streams_per_connection && open < self.cfg.max_connections {
            return None;
        }
        Some((least.send.clone(), Stream::take(&least.streams)))
    }

    /// Replaces the list of connections by `f` of a copy of it.
    fn change(&self, f: impl FnOnce(&mut Vec<Arc<Conn>>)) {
        let _changing = self.changing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut conns = Vec::clone(&self.conns.load());
        f(&mut conns);
        self.conns.store(Arc::new(conns));
    }

    async fn handshake<T>(&self, io: T) -> Result<Conn, ConnectError>
    where
        T: AsyncRead + AsyncWrite + Unpin + std::marker::Send + 'static,
    {
        let heard = Arc::new(AtomicBool::new(false));
        let handshake = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_send_buffer_size(SEND_BUFFER)
            .max_header_list_size(MAX_HEADER_LIST)
            .enable_push(false)
            .handshake::<Heard<T>, Bytes>(Heard { io, heard: heard.clone() });
        let (send, mut conn) = tokio::time::timeout(self.connector.connect_timeout(), handshake)
            .await
            .map_err(|_| ConnectError::Timeout)?
            .map_err(ConnectError::H2)?;
        let streams = Arc::new(AtomicUsize::new(0));
        let pings = if self.cfg.ping_interval.is_zero() {
            None
        } else {
            conn.ping_pong().map(|pings| Pings {
                pings,
                heard,
                every: self.cfg.ping_interval,
                wait: self.cfg.ping_timeout,
            })
        };
        tokio::spawn(drive(conn, pings, streams.clone()));
        Ok(Conn { send, streams })
    }
}

/// A connection's keep-alive: a PING once nothing was read for `every` (checked every
/// `every`, so after one to two of them); no PONG within `wait` closes it.
struct Pings {
    pings: PingPong,
    /// Something was read since the last check.
    heard: Arc<AtomicBool>,
    every: Duration,
    wait: Duration,
}

/// A connection's socket that notes when something was read (a relaxed store per read), so
/// that a busy connection is not sent PINGs.
struct Heard<T> {
    io: T,
    heard: Arc<AtomicBool>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Heard<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.heard.store(true, Ordering::Relaxed);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Heard<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A connection's task: reads and writes its socket until it ends (or a PING goes
/// unanswered), then marks it [`CLOSED`]. Dropping the connection fails its open streams.
async fn drive<T>(conn: Connection<Heard<T>, Bytes>, pings: Option<Pings>, streams: Arc<AtomicUsize>)
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut conn = std::pin::pin!(conn);
    let ended = match pings {
        None => conn.await,
        Some(mut p) => loop {
            tokio::select! {
                ended = &mut conn => break ended,
                () = tokio::time::sleep(p.every) => {}
            }
            if p.heard.swap(false, Ordering::Relaxed) {
                continue;
            }
            let pong = tokio::time::timeout(p.wait, p.pings.ping(Ping::opaque()));
            tokio::select! {
                ended = &mut conn => break ended,
                answered = pong => if !matches!(answered, Ok(Ok(_))) {
                    tracing::debug!("upstream HTTP/2 connection closed: no PONG within {:?}", p.wait);
                    break Ok(());
                },
            }
        },
    };
    streams.fetch_or(CLOSED, Ordering::Relaxed);
    if let Err(e) = ended {
        tracing::debug!(error = %e, "upstream HTTP/2 connection ended with an error");
    }
}

/// How an exchange ended without a response head.
pub enum Failure {
    /// The connection takes no new streams (closed, or GOAWAY received): the request was
    /// not sent, and comes back whole.
    Unsent(Request<RequestBody>, h2::Error),
    /// The client's body failed first.
    Client(ClientBodyError),
    /// The upstream failed the stream (or its connection). `unsent`: the upstream said it
    /// did not process it (`REFUSED_STREAM`, or past a GOAWAY's last stream), and the
    /// request was kept whole to be sent again (see [`exchange`]).
    Upstream { error: h2::Error, unsent: Option<Request<RequestBody>> },
}

/// A response head: the response with its stream, and the request body's pump if the
/// request body has not all gone yet.
pub type Answer = (Response<RecvStream>, Option<Pump>);

/// Sends `req` as a stream on `send`'s connection and waits for the response head, pumping
/// the request body meanwhile. The request is sent with `END_STREAM` when its body is empty.
/// `keep`: a copy of the head is kept so that a stream the upstream refuses unprocessed can be
/// sent again elsewhere (only a caller that may retry asks: the copy costs per request).
///
/// # Errors
/// See [`Failure`].
pub async fn exchange(mut send: Send, req: Request<RequestBody>, keep: bool) -> Result<Answer, Failure> {
    if let Err(e) = poll_fn(|cx| send.poll_ready(cx)).await {
        return Err(Failure::Unsent(req, e));
    }
    let (parts, body) = req.into_parts();
    let head = Request::from_parts(parts, ());
    let kept = keep.then(|| copy(&head));
    let end = body.is_end_stream();
    let (mut answer, stream) = match send.send_request(head, end) {
        Ok(sent) => sent,
        Err(error) => return Err(Failure::Upstream { error, unsent: None }),
    };
    drop(send);
    let mut pump = (!end).then(|| Pump::new(body, stream));
    // The body went (or was refused) without any of it taken from the client: it was empty.
    let mut emptied = end;
    let answered = poll_fn(|cx| {
        if let Some(p) = pump.as_mut() {
            match p.poll(cx) {
                Poll::Pending => {}
                Poll::Ready(Pumped::Client(e)) => return Poll::Ready(Err(Failure::Client(e))),
                Poll::Ready(done) => {
                    emptied = matches!(done, Pumped::Done) && !p.touched();
                    pump = None;
                }
            }
        }
        Pin::new(&mut answer).poll(cx).map_err(|error| Failure::Upstream { error, unsent: None })
    })
    .await;
    match answered {
        Ok(resp) => Ok((resp, pump)),
        Err(Failure::Upstream { error, .. }) if unprocessed(&error) => {
            let body = match pump {
                Some(p) if !p.touched() => Some(p.into_body()),
                Some(_) => None,
                None => emptied.then(RequestBody::empty),
            };
            let unsent = kept.zip(body).map(|(head, body)| {
                let (parts, ()) = head.into_parts();
                Request::from_parts(parts, body)
            });
            Err(Failure::Upstream { error, unsent })
        }
        Err(f) => Err(f),
    }
}

/// The upstream said it did not process the stream: `REFUSED_STREAM` (RFC 9113 §8.7), or a
/// GOAWAY whose last stream is before it (h2 fails those streams with the GOAWAY's error).
fn unprocessed(e: &h2::Error) -> bool {
    e.reason() == Some(Reason::REFUSED_STREAM) || (e.is_go_away() && e.is_remote())
}

/// A request head's copy, to be sent again.
fn copy(head: &Request<()>) -> Request<()> {
    let mut again = Request::new(());
    *again.method_mut() = head.method().clone();
    *again.uri_mut() = head.uri().clone();
    *again.version_mut() = head.version();
    *again.headers_mut() = head.headers().clone();
    again
}

/// Whether the upstream's answer failed as malformed (h2 refused its head or framing).
pub fn malformed(e: &h2::Error) -> bool {
    e.is_library() && e.reason() == Some(Reason::PROTOCOL_ERROR)
}

/// Marks `stream`'s connection closed for new streams (it refused one: GOAWAY, or closed).
pub fn close(stream: &Stream) {
    stream.mark(CLOSED);
}
