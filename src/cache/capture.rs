//! The capturing body: passes every frame on the moment the inner body yields it and keeps a
//! copy; the copy is stored only if the body ends cleanly within the entry's byte budget.
//! A failed capture never touches the response itself.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::{Cache, Stored};

/// A response that is being copied; built by [`Cache`] only.
pub(super) struct Pending {
    pub cache: Cache,
    pub primary: u128,
    /// Everything but the body; `weight` counts the head so far.
    pub stored: Stored,
    pub buf: Vec<u8>,
    /// Body bytes this entry may still take.
    pub budget: usize,
}

pin_project! {
    /// Wraps a response body; see the module docs. Generic so tests can drive it with bodies
    /// that fail, which `hyper::body::Incoming` cannot be made to do without a socket.
    pub struct Capture<B> {
        #[pin]
        inner: B,
        // Boxed: keeps `crate::body::Body` small for the bodies that are not captured.
        pending: Option<Box<Pending>>,
    }

    impl<B> PinnedDrop for Capture<B> {
        fn drop(this: Pin<&mut Self>) {
            // Dropped before its end: the client went away or the server gave up.
            if let Some(p) = this.project().pending.take() {
                p.cache.abandoned();
            }
        }
    }
}

impl<B: HttpBody<Data = Bytes>> Capture<B> {
    pub(super) fn new(inner: B, mut pending: Box<Pending>) -> Capture<B> {
        // A body that is over before it starts (empty) may never be polled at all.
        if inner.is_end_stream() {
            finish(pending);
            return Capture { inner, pending: None };
        }
        let hint = inner.size_hint();
        let expected = hint.upper().unwrap_or(hint.lower());
        if let Ok(expected) = usize::try_from(expected) {
            if expected <= pending.budget {
                pending.buf.reserve_exact(expected);
            }
        }
        Capture { inner, pending: Some(pending) }
    }
}

impl<B: HttpBody<Data = Bytes>> HttpBody for Capture<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        let polled = ready!(this.inner.as_mut().poll_frame(cx));
        if let Some(p) = this.pending.as_mut() {
            let keep = match &polled {
                Some(Ok(frame)) => match frame.data_ref() {
                    Some(data) if data.len() <= p.budget => {
                        p.budget -= data.len();
                        p.buf.extend_from_slice(data);
                        true
                    }
                    // Over budget: stop copying, keep streaming.
                    Some(_) => false,
                    // Trailers are not stored, and a copy without them would be a different
                    // response (they may carry a checksum or a status).
                    None => false,
                },
                Some(Err(_)) => false,
                None => true,
            };
            if !keep {
                if let Some(p) = this.pending.take() {
                    p.cache.abandoned();
                }
            } else if polled.is_none() || this.inner.is_end_stream() {
                // hyper stops polling once `is_end_stream` is true, so the end may never be
                // seen as `None`.
                if let Some(p) = this.pending.take() {
                    finish(p);
                }
            }
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn finish(p: Box<Pending>) {
    let Pending { cache, primary, mut stored, mut buf, .. } = *p;
    // A body shorter or longer than its Content-Length was cut or is broken.
    let declared = stored.headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok());
    if declared.is_some_and(|n| n.trim().parse::<usize>().ok() != Some(buf.len())) {
        cache.abandoned();
        return;
    }
    buf.shrink_to_fit();
    stored.weight = stored.weight.saturating_add(buf.len());
    stored.body = Bytes::from(buf);
    cache.insert(primary, stored);
}
