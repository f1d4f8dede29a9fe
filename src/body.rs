//! The one response body type: a full buffer (built-in responder, problem answers) or an
//! upstream stream passed through untouched, optionally holding a concurrency slot until the
//! body ends. An enum, not a box, so the hot path does not allocate for it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tokio::sync::OwnedSemaphorePermit;

use crate::forward::pool::Returner;

fn release(ret: &mut Option<Returner>) {
    if let Some(r) = ret.take() {
        r.release();
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind {
        Full { data: Option<Bytes> },
        // An upstream body; `ret` gives its connection back to the pool once it ends.
        Stream { #[pin] inner: Incoming, ret: Option<Returner> },
        // Any body, copied for the cache as it streams (see `crate::cache::Capture`).
        Captured { #[pin] inner: crate::cache::Capture<Pin<Box<Body>>> },
    }
}

pin_project! {
    /// A response body.
    pub struct Body {
        #[pin]
        kind: Kind,
        // A route's concurrency slot: released when the body ends (or is dropped).
        hold: Option<OwnedSemaphorePermit>,
    }
}

impl Body {
    pub fn empty() -> Body {
        Body { kind: Kind::Full { data: None }, hold: None }
    }

    pub fn full(data: impl Into<Bytes>) -> Body {
        let data: Bytes = data.into();
        Body { kind: Kind::Full { data: (!data.is_empty()).then_some(data) }, hold: None }
    }

    pub fn stream(inner: Incoming) -> Body {
        Body { kind: Kind::Stream { inner, ret: None }, hold: None }
    }

    /// An upstream body whose connection goes back to its pool when the body ends.
    pub fn upstream(inner: Incoming, ret: Returner) -> Body {
        if inner.is_end_stream() {
            // hyper may never poll an empty body: the connection is free already.
            ret.release();
            return Body::stream(inner);
        }
        Body { kind: Kind::Stream { inner, ret: Some(ret) }, hold: None }
    }

    /// `inner` copied for the cache as it streams.
    pub fn captured(inner: crate::cache::Capture<Pin<Box<Body>>>) -> Body {
        Body { kind: Kind::Captured { inner }, hold: None }
    }

    pub fn is_captured(&self) -> bool {
        matches!(self.kind, Kind::Captured { .. })
    }

    /// Keeps `permit` until the body has been sent in full.
    pub fn hold(&mut self, permit: OwnedSemaphorePermit) {
        self.hold = Some(permit);
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.project();
        let polled = match this.kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Stream { mut inner, ret } => {
                let polled = inner.as_mut().poll_frame(cx);
                match &polled {
                    Poll::Ready(None) => release(ret),
                    Poll::Ready(Some(Ok(_))) if inner.is_end_stream() => release(ret),
                    Poll::Ready(Some(Err(_))) => drop(ret.take()),
                    _ => {}
                }
                polled
            }
            KindProj::Captured { inner } => inner.poll_frame(cx),
        };
        if let Poll::Ready(None | Some(Err(_))) = polled {
            this.hold.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Stream { inner, .. } => inner.is_end_stream(),
            Kind::Captured { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            Kind::Stream { inner, .. } => inner.size_hint(),
            Kind::Captured { inner } => inner.size_hint(),
        }
    }
}
