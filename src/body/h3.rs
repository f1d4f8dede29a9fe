//! An HTTP/3 request's body: the receiving half of its QUIC stream, read through the `h3`
//! crate, data then trailers. Whether a body is empty is known without waiting when the
//! client's FIN came with the head (a GET's usually does) or `Content-Length` says so: a
//! bodiless request goes upstream without a body, as its HTTP/1.1 and HTTP/2 twins do.
//!
//! HTTP/3 frames a body by its DATA frames and the stream's end; a `Content-Length` that
//! does not equal their sum makes the request malformed (RFC 9114 §4.1.2), which HTTP/2's
//! codec checks for tollgate and `h3` does not. Here: data past the announced length, or an
//! end before it, fails the body as [`ClientBodyError::Malformed`] (the client's fault: `400`,
//! no upstream blamed). The last announced bytes are handed on once the end is seen, since a
//! reader that has all the bytes it was told of (hyper's client) would never look further.
//!
//! A body the answer did not need is stopped with `H3_NO_ERROR` (§4.1; QUIC's own stream
//! would say 0, which HTTP/3 does not define) when it was never read: `h3-quinn` holds the
//! stream inside a read in flight, and asking it to stop then would panic, so a body read
//! in part is left to QUIC's code. A body announced by `Content-Length` is not looked at
//! before it is read, so an answer made before it (a `429`) stops it with `H3_NO_ERROR`.

use std::task::{Context, Poll};

use ::h3::error::Code;
use bytes::{Buf, Bytes};
use http_body::{Frame, SizeHint};

use super::ClientBodyError;

/// The receiving half of an HTTP/3 request stream.
pub type RecvStream = ::h3::server::RequestStream<h3_quinn::RecvStream, Bytes>;

/// An HTTP/3 request body.
pub struct Recv {
    stream: RecvStream,
    /// Data read but not yet handed on: what [`Recv::new`]'s look found, or the last
    /// announced bytes, until the end is seen.
    held: Option<Bytes>,
    /// `Content-Length`, when the client sent one.
    length: Option<u64>,
    /// Bytes of data received so far.
    received: u64,
    data_done: bool,
    ended: bool,
    /// The body broke its framing (seen by the first look): the first read fails.
    broken: bool,
    /// The stream has been read (a read may be in flight in `h3-quinn`, which holds the
    /// stream meanwhile): it can no longer be asked to stop.
    touched: bool,
}

impl Recv {
    /// The body of a request whose head announced `length` (its `Content-Length`, if any).
    /// Unless that says the body has bytes, looks once, without waiting, for data or the end
    /// already received.
    pub fn new(stream: RecvStream, length: Option<u64>) -> Recv {
        let mut recv = Recv {
            stream,
            held: None,
            length,
            received: 0,
            data_done: false,
            ended: false,
            broken: false,
            touched: false,
        };
        if length.is_some_and(|n| n > 0) {
            return recv;
        }
        recv.touched = true;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match recv.stream.poll_recv_data(&mut cx) {
            Poll::Ready(Ok(Some(mut data))) => {
                let data = data.copy_to_bytes(data.remaining());
                recv.received = data.len() as u64;
                recv.broken = recv.over();
                recv.held = Some(data);
            }
            Poll::Ready(Ok(None)) => {
                recv.data_done = true;
                if let Poll::Ready(Ok(None)) = recv.stream.poll_recv_trailers(&mut cx) {
                    recv.ended = true;
                }
            }
            // An error shows again on the first real read.
            Poll::Ready(Err(_)) | Poll::Pending => {}
        }
        recv
    }

    /// More data than announced.
    fn over(&self) -> bool {
        self.length.is_some_and(|n| self.received > n)
    }

    /// The data ended before the announced length.
    fn short(&self) -> bool {
        self.length.is_some_and(|n| self.received != n)
    }

    /// Every announced byte has come: the end must be seen before the last are handed on.
    fn complete(&self) -> bool {
        self.length == Some(self.received)
    }

    /// The request is refused whole: nothing of the body is read, and the client is asked
    /// to stop sending it with `H3_MESSAGE_ERROR` where it can be (see the module's doc).
    pub fn refuse(&mut self) {
        self.stop(Code::H3_MESSAGE_ERROR);
        self.held = None;
        self.ended = true;
    }

    fn stop(&mut self, code: Code) {
        if !std::mem::replace(&mut self.touched, true) {
            self.stream.stop_sending(code);
        }
    }

    /// The body failed its framing: no more of it is read.
    fn malformed(&mut self) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        self.held = None;
        self.ended = true;
        Poll::Ready(Some(Err(ClientBodyError::Malformed)))
    }

    /// Waits for the end of a body announced empty (`Content-Length: 0`) whose end had not come
    /// with its head. `Err`: data came instead.
    pub async fn end_of_empty(&mut self) -> Result<(), &'static str> {
        match std::future::poll_fn(|cx| self.poll_frame(cx)).await {
            None | Some(Ok(_)) => Ok(()),
            Some(Err(_)) => Err("malformed HTTP/3 request: DATA after `Content-Length: 0`"),
        }
    }

    pub(super) fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if std::mem::take(&mut self.broken) {
            return self.malformed();
        }
        self.touched = true;
        while !self.data_done {
            if !self.complete() {
                if let Some(data) = self.held.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
            }
            match std::task::ready!(self.stream.poll_recv_data(cx)) {
                Ok(Some(mut data)) => {
                    if !data.has_remaining() {
                        continue;
                    }
                    let data = data.copy_to_bytes(data.remaining());
                    self.received = self.received.saturating_add(data.len() as u64);
                    if self.over() {
                        return self.malformed();
                    }
                    // Bytes are held only once complete, and more then is over: none are lost.
                    self.held = Some(data);
                }
                Ok(None) => {
                    self.data_done = true;
                    if self.short() {
                        return self.malformed();
                    }
                }
                Err(e) => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(error(&e))));
                }
            }
        }
        if let Some(data) = self.held.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        let trailers = std::task::ready!(self.stream.poll_recv_trailers(cx));
        self.ended = true;
        match trailers {
            Ok(Some(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(error(&e)))),
        }
    }

    pub fn is_end_stream(&self) -> bool {
        self.ended
    }

    pub(super) fn size_hint(&self) -> SizeHint {
        match self.length {
            _ if self.ended => SizeHint::with_exact(0),
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

impl Drop for Recv {
    /// A body never read: the client may stop sending it (RFC 9114 §4.1), with `H3_NO_ERROR`.
    fn drop(&mut self) {
        self.stop(Code::H3_NO_ERROR);
    }
}

/// A body that broke HTTP/3's framing is malformed; a stream the client reset or a
/// connection that went away ended it early.
fn error(e: &::h3::error::StreamError) -> ClientBodyError {
    match e {
        ::h3::error::StreamError::StreamError { .. } => ClientBodyError::Malformed,
        _ => ClientBodyError::Incomplete,
    }
}
