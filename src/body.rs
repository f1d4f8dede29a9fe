//! The one response body type: a full buffer (built-in responder, problem answers) or an
//! upstream stream passed through untouched. An enum, not a box, so the hot path does not
//! allocate for it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;

pin_project! {
    /// A response body.
    #[project = KindProj]
    pub enum Body {
        Full { data: Option<Bytes> },
        Stream { #[pin] inner: Incoming },
    }
}

impl Body {
    pub fn empty() -> Body {
        Body::Full { data: None }
    }

    pub fn full(data: impl Into<Bytes>) -> Body {
        let data: Bytes = data.into();
        Body::Full { data: (!data.is_empty()).then_some(data) }
    }

    pub fn stream(inner: Incoming) -> Body {
        Body::Stream { inner }
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Stream { inner } => inner.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full { data } => data.is_none(),
            Body::Stream { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            Body::Stream { inner } => inner.size_hint(),
        }
    }
}
