//! Shared HTTP/2 connections to one HTTP/2 upstream: `protocol: h2c` (prior knowledge, no
//! TLS), `h2` (TLS, ALPN `h2` only), or the connections of an `auto` one whose ALPN chose `h2`
//! ([`H2Pool::adopt`]).
//!
//! Requests go as streams on the least busy open connection; a new connection is opened
//! when every open one carries `max_streams_per_connection` streams, up to
//! `max_connections`; past that the least busy one takes the stream anyway (HTTP/2 itself
//! holds it until the upstream's own stream limit allows). A stream counts from checkout
//! until its response body ends or is dropped ([`Stream`]). Idle connections are kept alive
//! with PINGs; a closed one is dropped on the next checkout.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use super::connector::{Alpn, Connected, Connector};
use super::pool::ConnectError;
use crate::body::RequestBody;
use crate::config::UpstreamH2;

pub type Send = http2::SendRequest<RequestBody>;

struct Conn {
    send: Send,
    streams: Arc<AtomicUsize>,
}

/// One stream's place on its connection; given back on drop.
pub use crate::body::Place as Stream;

pub struct H2Pool {
    conns: std::sync::Mutex<Vec<Conn>>,
    /// Held while connecting, so a burst opens one connection, not one per request.
    connecting: tokio::sync::Mutex<()>,
    /// TCP for `h2c`; TLS offering `h2` only for `h2` (and for `auto`, whose new connections
    /// are opened by the forwarder and handed over).
    connector: Connector,
    cfg: UpstreamH2,
}

impl H2Pool {
    pub fn new(connector: Connector, cfg: UpstreamH2) -> H2Pool {
        H2Pool { conns: std::sync::Mutex::new(Vec::new()), connecting: tokio::sync::Mutex::new(()), connector, cfg }
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
        let got = (conn.send.clone(), take(&conn.streams));
        self.lock().push(conn);
        Ok(got)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.conns.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The least busy open connection: only one under the stream bound while more
    /// connections may be opened (`bounded`), else any.
    fn pick(&self, bounded: bool) -> Option<(Send, Stream)> {
        let mut conns = self.lock();
        conns.retain(|c| !c.send.is_closed());
        let least = conns.iter().min_by_key(|c| c.streams.load(Ordering::Relaxed))?;
        let busy = least.streams.load(Ordering::Relaxed);
        if bounded && busy >= self.cfg.max_streams_per_connection && conns.len() < self.cfg.max_connections {
            return None;
        }
        Some((least.send.clone(), take(&least.streams)))
    }

    async fn handshake<T>(&self, io: T) -> Result<Conn, ConnectError>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + std::marker::Send + 'static,
    {
        let mut builder = http2::Builder::new(TokioExecutor::new());
        builder.timer(TokioTimer::new());
        if !self.cfg.ping_interval.is_zero() {
            builder
                .keep_alive_interval(self.cfg.ping_interval)
                .keep_alive_timeout(self.cfg.ping_timeout)
                .keep_alive_while_idle(true);
        }
        let handshake = builder.handshake(TokioIo::new(io));
        let (send, conn) = tokio::time::timeout(self.connector.connect_timeout(), handshake)
            .await
            .map_err(|_| ConnectError::Timeout)?
            .map_err(ConnectError::Handshake)?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream HTTP/2 connection ended with an error");
            }
        });
        Ok(Conn { send, streams: Arc::new(AtomicUsize::new(0)) })
    }
}

fn take(streams: &Arc<AtomicUsize>) -> Stream {
    Stream::take(streams)
}
