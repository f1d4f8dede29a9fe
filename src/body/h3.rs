//! An HTTP/3 request's body: the receiving half of its QUIC stream, read through the `h3`
//! crate, data then trailers. Whether a body is empty is known without waiting when the
//! client's FIN came with the head (a GET's usually does) or `Content-Length` says so: a
//! bodiless request goes upstream without a body, as its HTTP/1.1 and HTTP/2 twins do.

use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Frame, SizeHint};

use super::ClientBodyError;

/// The receiving half of an HTTP/3 request stream.
pub type RecvStream = ::h3::server::RequestStream<h3_quinn::RecvStream, Bytes>;

/// An HTTP/3 request body.
pub struct Recv {
    stream: RecvStream,
    /// Data read ahead by [`Recv::new`]'s look.
    first: Option<Bytes>,
    /// `Content-Length`, when the client sent one.
    length: Option<u64>,
    data_done: bool,
    ended: bool,
}

impl Recv {
    /// The body of a request whose head announced `length` (its `Content-Length`, if any).
    /// Looks once, without waiting, for data or the end already received.
    pub fn new(stream: RecvStream, length: Option<u64>) -> Recv {
        let mut recv = Recv { stream, first: None, length, data_done: false, ended: length == Some(0) };
        if !recv.ended {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            match recv.stream.poll_recv_data(&mut cx) {
                Poll::Ready(Ok(Some(mut data))) => recv.first = Some(data.copy_to_bytes(data.remaining())),
                Poll::Ready(Ok(None)) => {
                    recv.data_done = true;
                    if let Poll::Ready(Ok(None)) = recv.stream.poll_recv_trailers(&mut cx) {
                        recv.ended = true;
                    }
                }
                // An error shows again on the first real read.
                Poll::Ready(Err(_)) | Poll::Pending => {}
            }
        }
        recv
    }

    pub(super) fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        if !self.data_done {
            match std::task::ready!(self.stream.poll_recv_data(cx)) {
                Ok(Some(mut data)) => return Poll::Ready(Some(Ok(Frame::data(data.copy_to_bytes(data.remaining()))))),
                Ok(None) => self.data_done = true,
                Err(e) => return Poll::Ready(Some(Err(error(&e)))),
            }
        }
        let trailers = std::task::ready!(self.stream.poll_recv_trailers(cx));
        self.ended = true;
        match trailers {
            Ok(Some(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(error(&e)))),
        }
    }

    pub(super) fn is_end_stream(&self) -> bool {
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

/// A body that broke HTTP/3's framing is malformed; a stream the client reset or a
/// connection that went away ended it early.
fn error(e: &::h3::error::StreamError) -> ClientBodyError {
    match e {
        ::h3::error::StreamError::StreamError { .. } => ClientBodyError::Malformed,
        _ => ClientBodyError::Incomplete,
    }
}
