//! Protocol detection: the first bytes of a connection say whether it is h2c (the 24-byte
//! HTTP/2 preface) or HTTP/1. They are read into a small buffer and replayed to hyper by
//! [`Prefixed`], which also tells the HTTP/1 head timer when bytes arrive.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncBufRead, AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::ConnState;
use crate::timer;

/// RFC 9113 §3.4.
pub(super) const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

pub(super) enum Proto {
    Http1,
    Http2,
}

/// Reads until the bytes differ from the HTTP/2 preface (HTTP/1) or hold all of it (h2c);
/// returns how many of `buf` were filled. The caller bounds it in time.
pub(super) async fn detect(stream: &TcpStream, buf: &mut [u8; 24]) -> io::Result<(Proto, usize)> {
    let mut n = 0;
    loop {
        stream.readable().await?;
        match stream.try_read(&mut buf[n..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => {
                n += k;
                if buf[..n] != PREFACE[..n] {
                    return Ok((Proto::Http1, n));
                }
                if n == PREFACE.len() {
                    return Ok((Proto::Http2, n));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// The connection with the detection bytes put back in front, and a deadline on writes
/// that make no progress (`server.send_timeout`).
pub(super) struct Prefixed<S = TcpStream> {
    stream: S,
    prefix: [u8; 24],
    at: usize,
    len: usize,
    /// Bytes read before an HTTP/1 connection was parked, put back for the next reader.
    rest: Bytes,
    state: Arc<ConnState>,
    /// Armed while a write waits for the client to take bytes.
    stalled: Option<timer::Sleep>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Prefixed<S> {
    pub(super) fn new(stream: S, prefix: [u8; 24], len: usize, state: Arc<ConnState>) -> Prefixed<S> {
        Prefixed { stream, prefix, at: 0, len, rest: Bytes::new(), state, stalled: None }
    }

    /// Puts bytes read but not used back in front of the stream.
    pub(super) fn put_back(&mut self, rest: Bytes) {
        self.rest = rest;
    }
}

/// What the server needs of a stream beyond reading and writing: parking an idle HTTP/1
/// connection (a wait for the next byte that reads nothing), and a read that does no work
/// when the socket has nothing. A plain socket can park; a TLS stream may hold decrypted
/// bytes its socket no longer shows (and rustls keeps its own buffers), so TLS connections
/// are never parked.
pub(crate) trait Park {
    const PARKABLE: bool;
    /// Ready once the stream has bytes to read (or has ended), without reading them. Called
    /// only when [`Park::PARKABLE`].
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;

    /// Reads what is there into `buf`, like [`AsyncRead::poll_read`].
    fn poll_read_some(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>>;
}

impl Park for TcpStream {
    const PARKABLE: bool = true;

    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        TcpStream::poll_read_ready(self, cx)
    }

    fn poll_read_some(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        // tokio's read is already a readiness check when the socket has nothing.
        AsyncRead::poll_read(self, cx, buf)
    }
}

impl Park for Box<tokio_rustls::server::TlsStream<TcpStream>> {
    const PARKABLE: bool = false;

    fn poll_read_ready(&self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Never parked: readiness is what a read says.
        Poll::Ready(Ok(()))
    }

    /// One record's plaintext at most, and no rustls work while the socket has nothing.
    /// hyper polls its connection's read every time the connection's task wakes (the
    /// upstream's answer, the body's end, the flush): 4 to 5 reads a keep-alive request, one
    /// with data. tokio-rustls' own read runs its socket step (`read_tls`, the deframer,
    /// the I/O state) on every one of them, and after a read with data tries once more to
    /// fill the rest of the buffer, which only finds the socket empty. Here, with no
    /// plaintext held (`wants_read`), the socket's readiness answers first, as tokio's plain
    /// read does; the rest is the stream's buffered read (`poll_fill_buf`), which reports
    /// the same ends and errors as its `poll_read`.
    fn poll_read_some(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let tls = Pin::into_inner(self);
        let (tcp, conn) = tls.get_ref();
        // rustls' next step would be a socket read that returns WouldBlock: the same wait.
        if conn.wants_read() && tcp.poll_read_ready(cx).is_pending() {
            return Poll::Pending;
        }
        let mut tls = Pin::new(tls.as_mut());
        let data = match tls.as_mut().poll_fill_buf(cx) {
            Poll::Ready(Ok(data)) => data,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        };
        let n = data.len().min(buf.remaining());
        buf.put_slice(&data[..n]);
        tls.consume(n);
        Poll::Ready(Ok(()))
    }
}

impl<S: Park> Prefixed<S> {
    /// See [`Park`].
    pub(super) fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream.poll_read_ready(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Prefixed<S> {
    /// A write is pending: fails it once the client has taken nothing for `send_timeout`.
    /// The error ends the connection in hyper, whatever it was waiting to write.
    fn stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let timeout = self.state.settings.cfg.send_timeout;
        let state = &self.state;
        let sleep = self.stalled.get_or_insert_with(|| {
            state.write_pending.store(true, Ordering::Relaxed);
            timer::Sleep::after(timeout)
        });
        if Pin::new(sleep).poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.state.settings.metrics.timeouts.send.inc();
        Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the client took no bytes within server.send_timeout")))
    }

    fn wrote<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match polled {
            Poll::Pending => match self.stalled(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => Poll::Pending,
            },
            done => {
                if self.stalled.is_some() {
                    self.stalled = None;
                    self.state.write_pending.store(false, Ordering::Relaxed);
                }
                done
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Park + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.len {
            let n = (this.len - this.at).min(buf.remaining());
            buf.put_slice(&this.prefix[this.at..this.at + n]);
            this.at += n;
            return Poll::Ready(Ok(()));
        }
        if !this.rest.is_empty() {
            let n = this.rest.len().min(buf.remaining());
            buf.put_slice(&this.rest[..n]);
            this.rest.advance(n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read_some(cx, buf);
        if buf.filled().len() > before {
            this.state.bytes_seen.store(true, Ordering::Relaxed);
        }
        polled
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.wrote(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.wrote(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
