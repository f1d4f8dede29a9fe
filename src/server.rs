//! The listener: HTTP/1.1 and h2c (prior knowledge) on one port. Entry point is [`serve`],
//! which takes a bound listener and a shutdown future so tests can bind port 0.
//!
//! Every connection is bounded in time from its first byte on: the protocol is detected
//! under `server.header_read_timeout` ([`detect`]), HTTP/1 separates the idle keep-alive
//! wait from the head read ([`h1`]), HTTP/2 has an idle timeout, a keep-alive PING and
//! explicit protocol limits ([`h2`]). `server.max_connections` bounds how many are open;
//! `server:` settings are read again at every accept, so a reload applies them to new
//! connections.

mod detect;
mod edge;
mod h1;
mod h2;
mod h3;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::{service_fn, Service};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::body::Body;
use crate::config::{Config, ServerConfig};
use crate::metrics::ConnMetrics;
use crate::proxy::Shared;

/// What connections are served with: `server:` compiled into hyper builders, once per config.
pub(crate) struct Settings {
    cfg: ServerConfig,
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
    metrics: ConnMetrics,
}

impl Settings {
    fn new(cfg: &ServerConfig, metrics: ConnMetrics) -> Settings {
        let mut h1 = http1::Builder::new();
        // The timer is per connection (see `h1::HeadTimer`); hyper's header-read timeout only
        // tells it when a head is awaited.
        h1.header_read_timeout(cfg.header_read_timeout)
            .max_buf_size(cfg.max_header_bytes)
            // One write per small response instead of writev (measured: a small win).
            .writev(false)
            .keep_alive(!cfg.keepalive_timeout.is_zero());
        let c = &cfg.h2;
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        // The ping sleep is polled on every wake of the connection and reset once per
        // interval: tokio's timer costs less than the coarse one for that pattern.
        h2.timer(TokioTimer::new())
            .max_concurrent_streams(c.max_concurrent_streams)
            .max_header_list_size(c.max_header_list_size)
            .max_pending_accept_reset_streams(c.max_pending_accept_reset_streams)
            .max_local_error_reset_streams(c.max_local_error_reset_streams)
            .initial_stream_window_size(c.initial_stream_window)
            .initial_connection_window_size(c.initial_connection_window)
            .max_frame_size(c.max_frame_size)
            .max_send_buf_size(c.max_send_buffer)
            // RFC 8441: WebSockets over HTTP/2 (extended CONNECT), tunnelled to HTTP/1.1 upstreams.
            .enable_connect_protocol();
        if !c.ping_interval.is_zero() {
            h2.keep_alive_interval(c.ping_interval).keep_alive_timeout(c.ping_timeout);
        }
        Settings { cfg: cfg.clone(), h1, h2, metrics }
    }
}

/// The settings of the config in effect, rebuilt only when `server:` changes: one pointer
/// comparison per accept.
pub(crate) struct Current {
    config: Arc<Config>,
    settings: Arc<Settings>,
}

impl Current {
    pub(crate) fn new(proxy: &Shared, metrics: ConnMetrics) -> Current {
        let config = proxy.load().config.clone();
        let settings = Arc::new(Settings::new(&config.server, metrics));
        Current { config, settings }
    }

    /// `Some(idx)` when listener `idx` of the config in effect is not plain HTTP.
    fn edge(&mut self, idx: usize, proxy: &Shared) -> Option<usize> {
        self.get(proxy);
        self.config.listeners.get(idx).is_some_and(|l| !l.is_plain()).then_some(idx)
    }

    pub(crate) fn get(&mut self, proxy: &Shared) -> &Arc<Settings> {
        let now = proxy.load();
        if !Arc::ptr_eq(&now.config, &self.config) {
            if now.config.server != self.config.server {
                self.settings = Arc::new(Settings::new(&now.config.server, self.settings.metrics.clone()));
            }
            self.config = now.config.clone();
        }
        &self.settings
    }
}

/// Tells connections that the server is shutting down. A connection registers its task's
/// waker once (in [`Waiters`]), then only reads `flag`: a request pays one load for it, and
/// an idle connection holds one slot (24 bytes) instead of a boxed wait on a `watch`
/// (~170 bytes, issue 23).
#[derive(Clone)]
pub(crate) struct Stop {
    /// `None`: never fires (the admin listener's connections).
    waiters: Option<Arc<Waiters>>,
    /// Held until the connection ends: the server waits for every receiver to go.
    _held: Option<watch::Receiver<bool>>,
}

impl Stop {
    /// A signal that never fires (the admin listener's connections).
    pub(crate) fn never() -> Stop {
        Stop { waiters: None, _held: None }
    }
}

/// The wakers of the connections waiting for the server to stop: a slab with a free list.
#[derive(Default)]
struct Waiters {
    flag: AtomicBool,
    slots: std::sync::Mutex<(Vec<Option<std::task::Waker>>, Vec<usize>)>,
}

impl Waiters {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<Option<std::task::Waker>>, Vec<usize>)> {
        self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers `waker` unless the server is already stopping (`None` then).
    fn register(&self, waker: &std::task::Waker) -> Option<usize> {
        let mut slots = self.lock();
        // Under the lock: `fire` sets the flag before it takes the lock, so a waker
        // registered here is woken by it, or the flag is seen.
        if self.flag.load(Ordering::Acquire) {
            return None;
        }
        let (wakers, free) = &mut *slots;
        Some(match free.pop() {
            Some(i) => {
                wakers[i] = Some(waker.clone());
                i
            }
            None => {
                wakers.push(Some(waker.clone()));
                wakers.len() - 1
            }
        })
    }

    fn unregister(&self, key: usize) {
        let mut slots = self.lock();
        let (wakers, free) = &mut *slots;
        if let Some(slot) = wakers.get_mut(key) {
            if slot.take().is_some() {
                free.push(key);
            }
        }
        // After a spike of connections, the room goes back with the last of them.
        if free.len() == wakers.len() && wakers.capacity() > 64 {
            *slots = Default::default();
        }
    }

    /// The server is stopping: every connection is woken once, and sees the flag.
    fn fire(&self) {
        self.flag.store(true, Ordering::Release);
        let wakers = std::mem::take(&mut *self.lock());
        for w in wakers.0.into_iter().flatten() {
            w.wake();
        }
    }
}

/// Fires [`Waiters`] when dropped: when the server is done, or its future dropped.
struct FireOnDrop(Arc<Waiters>);

impl Drop for FireOnDrop {
    fn drop(&mut self) {
        self.0.fire();
    }
}

/// Polls [`Stop`] for one connection. Registered with the waker of its first poll: a
/// connection is polled by its one task.
struct Stopping {
    stop: Stop,
    key: Option<usize>,
    fired: bool,
}

impl Stopping {
    fn new(stop: Stop) -> Stopping {
        Stopping { stop, key: None, fired: false }
    }

    /// Whether the server is shutting down.
    fn poll(&mut self, cx: &mut Context<'_>) -> bool {
        if self.fired {
            return true;
        }
        let Some(waiters) = &self.stop.waiters else { return false };
        if waiters.flag.load(Ordering::Acquire) {
            self.fired = true;
        } else if self.key.is_none() {
            self.key = waiters.register(cx.waker());
            self.fired = self.key.is_none();
        }
        self.fired
    }
}

impl Drop for Stopping {
    fn drop(&mut self) {
        if let (Some(waiters), Some(key)) = (&self.stop.waiters, self.key) {
            if !waiters.flag.load(Ordering::Acquire) {
                waiters.unregister(key);
            }
        }
    }
}

/// What the timers of one connection share with its reads and its streams.
pub(crate) struct ConnState {
    settings: Arc<Settings>,
    accepted: Instant,
    /// HTTP/1: bytes arrived since the last wait for a head began.
    bytes_seen: AtomicBool,
    /// HTTP/1: the first wait for a head has begun (later waits start idle).
    first_wait: AtomicBool,
    /// HTTP/1: the first request's head has been read.
    first_head_done: AtomicBool,
    /// HTTP/1: the deadline of the current wait for a head (see `h1`), made on first use.
    head_deadline: std::sync::OnceLock<crate::timer::Deadline>,
    /// HTTP/1: the connection has waited long enough for its next request to be parked
    /// (see `h1`); set by its head timer, taken by its task.
    park: AtomicBool,
    /// A write waits for the client to take bytes (an HTTP/1 connection is not parked then).
    write_pending: AtomicBool,
    /// HTTP/2: streams whose response has not ended.
    open_streams: AtomicUsize,
    /// In µs since `accepted`. HTTP/2: when the last stream ended; HTTP/1: when the wait for
    /// the next request began, once the connection is to be parked.
    idle_since_us: AtomicU64,
}

impl ConnState {
    fn new(settings: Arc<Settings>, accepted: Instant) -> ConnState {
        ConnState {
            settings,
            accepted,
            bytes_seen: AtomicBool::new(false),
            first_wait: AtomicBool::new(false),
            first_head_done: AtomicBool::new(false),
            head_deadline: std::sync::OnceLock::new(),
            park: AtomicBool::new(false),
            write_pending: AtomicBool::new(false),
            open_streams: AtomicUsize::new(0),
            idle_since_us: AtomicU64::new(0),
        }
    }
}

/// Counts an open connection until dropped.
struct Open(prometheus_client::metrics::gauge::Gauge);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Serves connections from `listener` until `shutdown` resolves, then stops accepting and
/// gives open connections the configured grace period to finish.
pub async fn serve(listener: TcpListener, proxy: Shared, shutdown: impl Future<Output = ()>) {
    serve_all(vec![listener], proxy, shutdown).await;
}

/// [`serve`] for several listeners: `listeners[i]` serves `listen[i]` of the config (TLS,
/// PROXY header, redirect; see [`crate::listen`]). A plain listener's sockets go straight to
/// HTTP.
pub async fn serve_all(listeners: Vec<TcpListener>, proxy: Shared, shutdown: impl Future<Output = ()>) {
    let metrics = proxy.load().metrics().connections().for_worker(crate::workers::index());
    let mut current = Current::new(&proxy, metrics);
    let (stop_tx, stop_rx) = watch::channel(false);
    let waiters = Arc::new(Waiters::default());
    let stop = Stop { waiters: Some(waiters.clone()), _held: Some(stop_rx) };
    // Connections stop when the server does, or when its future is dropped.
    let fire = FireOnDrop(waiters);
    // HTTP/3 beside each `http3` listener, on the first worker only (see `h3`).
    if crate::workers::index() == 0 {
        let now = proxy.load_full();
        for (idx, l) in listeners.iter().enumerate() {
            let Some(config) = now.listener_quic(idx) else { continue };
            let served = l.local_addr().and_then(|addr| h3::endpoint(addr, config.clone()).map(|e| (addr, e)));
            match served {
                Ok((addr, endpoint)) => {
                    tracing::info!(%addr, "HTTP/3 listening (UDP)");
                    let current = Current::new(&proxy, current.settings.metrics.clone());
                    tokio::spawn(h3::serve(endpoint, idx, proxy.clone(), stop.clone(), current));
                }
                Err(e) => tracing::error!(error = %e, "cannot open the HTTP/3 (UDP) socket of a listener"),
            }
        }
    }
    tokio::pin!(shutdown);
    let accept_any = |cx: &mut Context<'_>| {
        for (i, l) in listeners.iter().enumerate() {
            if let Poll::Ready(r) = l.poll_accept(cx) {
                return Poll::Ready((i, r));
            }
        }
        Poll::Pending
    };
    loop {
        let (idx, stream, peer) = tokio::select! {
            (idx, accepted) = std::future::poll_fn(accept_any) => match accepted {
                Ok((stream, peer)) => (idx, stream, peer),
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let edge = current.edge(idx, &proxy);
        accept(stream, peer, edge, current.get(&proxy), &proxy, &stop);
    }
    // Connections whose handshake the kernel completed are served rather than reset when
    // the listener closes: each gets its first request answered (see `h1::serve`).
    for (idx, listener) in listeners.into_iter().enumerate() {
        match listener.into_std() {
            Ok(listener) => {
                while let Ok((stream, peer)) = listener.accept() {
                    match stream.set_nonblocking(true).and_then(|()| TcpStream::from_std(stream)) {
                        Ok(stream) => {
                            let edge = current.edge(idx, &proxy);
                            accept(stream, peer, edge, current.get(&proxy), &proxy, &stop);
                        }
                        Err(e) => tracing::debug!(error = %e, "could not adopt a connection while closing"),
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "could not drain the listen queue"),
        }
    }
    let grace = proxy.load().config.server.grace_period;
    tracing::info!(?grace, "shutting down: no new connections, finishing in-flight requests");
    fire.0.fire();
    // Every connection holds a receiver; the last one to end closes the channel.
    drop(stop);
    tokio::select! {
        () = stop_tx.closed() => tracing::info!("all connections closed"),
        () = tokio::time::sleep(grace) => tracing::warn!("grace period over, closing remaining connections"),
    }
}

/// Spawns the task of one accepted connection, or closes it at once past `max_connections`.
/// `edge`: the index of a listener that is not plain HTTP (its connection goes through
/// [`crate::listen`] first).
fn accept(
    stream: TcpStream,
    peer: SocketAddr,
    edge: Option<usize>,
    settings: &Arc<Settings>,
    proxy: &Shared,
    stop: &Stop,
) {
    let m = &settings.metrics;
    // Workers accept side by side: the count is taken before the check, so the bound holds
    // exactly across them (a connection refused meanwhile may make another refuse one more
    // than needed, never admit one too many).
    if m.open.inc() >= i64::try_from(settings.cfg.max_connections).unwrap_or(i64::MAX) {
        m.open.dec();
        m.refused.inc();
        tracing::debug!(%peer, max = settings.cfg.max_connections, "connection refused: server.max_connections reached");
        return;
    }
    m.accepted.inc();
    let open = Open(m.open.clone());
    let _ = stream.set_nodelay(true);
    let proxy = proxy.clone();
    if let Some(idx) = edge {
        let (settings, stop) = (settings.clone(), stop.clone());
        tokio::spawn(async move {
            let _open = open;
            edge::connection(stream, peer, idx, settings, stop, proxy).await;
        });
        return;
    }
    let service = service_fn(move |req| Answer { inner: proxy.load_full().handle(req, peer) });
    let conn = connection(stream, Instant::now(), settings.clone(), stop.clone(), service);
    tokio::spawn(async move {
        let _open = open;
        if let Err(e) = conn.await {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
        }
    });
}

/// A service a connection is served with (the proxy's, or the admin listener's).
pub(crate) trait Serves<B>:
    Service<Request<Incoming>, Response = Response<B>, Error = Infallible, Future: Send + 'static>
    + Clone
    + Send
    + Sync
    + Unpin
    + 'static
{
}

impl<S, B> Serves<B> for S where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible, Future: Send + 'static>
        + Clone
        + Send
        + Sync
        + Unpin
        + 'static
{
}

/// A response body a connection sends.
pub(crate) trait BodyOut:
    http_body::Body<Data = Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

impl<B> BodyOut for B where
    B: http_body::Body<Data = Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

/// Serves one connection of another listener (the admin's) with the same detection and
/// timeouts, until it ends.
pub(crate) async fn serve_other<S, B>(stream: TcpStream, settings: Arc<Settings>, service: S)
where
    S: Serves<B>,
    B: BodyOut,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<h2::StreamFuture<S::Future>, h2::Counted<B>>,
{
    let _ = connection(stream, Instant::now(), settings, Stop::never(), service).await;
}

/// Detects the protocol under the header-read deadline, then serves the connection.
///
/// A `fn` returning an `async move` block, as is `h1::serve`: an `async fn` keeps its
/// arguments twice in its future, and this future is the task of every connection, which a
/// parked HTTP/1 connection keeps (issue 23: 512 bytes in a release build, 1,080 before).
#[allow(clippy::manual_async_fn)]
fn connection<S, B>(
    stream: TcpStream,
    accepted: Instant,
    settings: Arc<Settings>,
    stop: Stop,
    service: S,
) -> impl Future<Output = Result<(), hyper::Error>>
where
    S: Serves<B>,
    B: BodyOut,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<h2::StreamFuture<S::Future>, h2::Counted<B>>,
{
    async move {
        let mut prefix = [0u8; detect::PREFACE.len()];
        let detected = tokio::select! {
            biased;
            found = detect::detect(&stream, &mut prefix) => found,
            () = crate::timer::Sleep::until(accepted + settings.cfg.header_read_timeout) => {
                settings.metrics.timeouts.header_read.inc();
                return Ok(());
            }
        };
        // Whoever closes before saying anything has nothing to answer.
        let Ok((proto, len)) = detected else { return Ok(()) };
        serve_io(stream, prefix, len, proto, accepted, settings, stop, service).await
    }
}

/// Serves a connection whose protocol is known, with `prefix[..len]` read ahead of `stream`.
/// Not `async`: the future it returns is the protocol's alone, with nothing of its own kept
/// beside it (the task of a parked HTTP/1 connection is this future).
#[allow(clippy::too_many_arguments)]
fn serve_io<IO, S, B>(
    stream: IO,
    prefix: [u8; detect::PREFACE.len()],
    len: usize,
    proto: detect::Proto,
    accepted: Instant,
    settings: Arc<Settings>,
    stop: Stop,
    service: S,
) -> impl Future<Output = Result<(), hyper::Error>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + detect::Park + Unpin + Send + 'static,
    S: Serves<B>,
    B: BodyOut,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<h2::StreamFuture<S::Future>, h2::Counted<B>>,
{
    let state = Arc::new(ConnState::new(settings, accepted));
    let io = TokioIo::new(detect::Prefixed::new(stream, prefix, len, state.clone()));
    match proto {
        detect::Proto::Http1 => Serving::Http1 { inner: h1::serve(io, state, stop, service) },
        // Boxed: hyper's HTTP/2 connection is large (~4 kB), and inline it would size the
        // task of every connection, HTTP/1 ones included, parked or not.
        detect::Proto::Http2 => Serving::Http2 { inner: Box::pin(h2::serve(io, state, stop, service)) },
    }
}

pin_project_lite::pin_project! {
    /// The future of a connection by protocol.
    #[project = ServingProj]
    enum Serving<H1, H2> {
        Http1 { #[pin] inner: H1 },
        Http2 { inner: Pin<Box<H2>> },
    }
}

impl<H1: Future<Output = O>, H2: Future<Output = O>, O> Future for Serving<H1, H2> {
    type Output = O;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<O> {
        match self.project() {
            ServingProj::Http1 { inner } => inner.poll(cx),
            ServingProj::Http2 { inner } => inner.as_mut().poll(cx),
        }
    }
}

/// The length an answer's content announces, for the protocols whose codec does not write it
/// (HTTP/3 always, HTTP/2 for HEAD): `Content-Length` from a body that knows its length, as
/// hyper writes it for HTTP/1.1 and for HTTP/2 answers that have content, unless the answer
/// has one already or a status that carries no content.
///
/// With it, the HEAD rule (RFC 9110 §9.3.2: the GET's fields, no content) holds for every
/// answer on every protocol, whatever made it (an upstream, the responder, a 404, a 429, the
/// admin listener): hyper's HTTP/1.1 sends no content to HEAD, and the HTTP/2 ([`h2`]) and
/// HTTP/3 ([`h3`]) servers call this, then send none either.
fn announce_length<B: http_body::Body>(headers: &mut http::HeaderMap, status: http::StatusCode, body: &B) {
    if status.is_informational() || matches!(status.as_u16(), 204 | 304) || body.is_end_stream() {
        return;
    }
    if let Some(len) = body.size_hint().exact() {
        headers.entry(http::header::CONTENT_LENGTH).or_insert_with(|| http::HeaderValue::from(len));
    }
}

pin_project_lite::pin_project! {
    /// A request's future as hyper's service wants it: never an error. Not an `async`
    /// block, which would hold the request twice (see [`Proxy::handle`]).
    struct Answer<F> {
        #[pin]
        inner: F,
    }
}

impl<F: Future<Output = Response<Body>>> Future for Answer<F> {
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx).map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Wake, Waker};

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn stop() -> (Stop, Arc<Waiters>) {
        let waiters = Arc::new(Waiters::default());
        (Stop { waiters: Some(waiters.clone()), _held: None }, waiters)
    }

    #[test]
    fn stopping_wakes_each_registered_connection_once_and_forgets_dropped_ones() {
        let (stop, waiters) = stop();
        let counts: Vec<Arc<Count>> = (0..3).map(|_| Arc::default()).collect();
        let mut stoppings: Vec<Stopping> = (0..3).map(|_| Stopping::new(stop.clone())).collect();
        for (s, c) in stoppings.iter_mut().zip(&counts) {
            let waker = Waker::from(c.clone());
            assert!(!s.poll(&mut Context::from_waker(&waker)));
            // Polled again, it registers nothing more.
            assert!(!s.poll(&mut Context::from_waker(&waker)));
        }
        assert_eq!(waiters.lock().0.iter().flatten().count(), 3);
        drop(stoppings.pop());
        assert_eq!(waiters.lock().0.iter().flatten().count(), 2, "a dropped connection leaves its slot");
        waiters.fire();
        let woken: Vec<usize> = counts.iter().map(|c| c.0.load(Ordering::Relaxed)).collect();
        assert_eq!(woken, [1, 1, 0]);
        let waker = Waker::from(counts[0].clone());
        assert!(stoppings.iter_mut().all(|s| s.poll(&mut Context::from_waker(&waker))));
        // A connection that first looks after the server began stopping sees it at once.
        assert!(Stopping::new(stop.clone()).poll(&mut Context::from_waker(&waker)));
        assert!(!Stopping::new(Stop::never()).poll(&mut Context::from_waker(&waker)));
    }

    #[test]
    fn the_slots_of_a_spike_of_connections_go_back_with_the_last_one() {
        let (stop, waiters) = stop();
        let waker = Waker::from(Arc::new(Count::default()));
        let mut stoppings: Vec<Stopping> = (0..1_000).map(|_| Stopping::new(stop.clone())).collect();
        for s in &mut stoppings {
            s.poll(&mut Context::from_waker(&waker));
        }
        assert!(waiters.lock().0.capacity() >= 1_000);
        drop(stoppings);
        assert_eq!(waiters.lock().0.capacity(), 0);
    }
}
