//! A request body that an answer did not need: tollgate answered before reading it (a `429`,
//! a `404`, a `401`, the responder to a client waiting for `100 Continue`).
//!
//! On HTTP/1.x the connection's next request starts where that body ends, so hyper, finding
//! the body unread when the answer is done, closes the connection. Left at that, the client
//! learns of it only when its next request on the connection fails (a broken pipe), and a
//! client that sees a broken connection retries at once, Retry-After or not. So the body is
//! read and thrown away first, as nginx does, up to [`MAX`] bytes within [`WAIT`], and the
//! connection stays open; a body that is larger or later, or a client that waits for
//! `100 Continue` (it sends nothing unless told to), gets the answer with `Connection: close`,
//! so that the close is announced. So does tollgate's own answer after the body went upstream
//! (a `502` when the upstream could not be reached): what the upstream did not take of it is
//! unread. HTTP/2 and HTTP/3 end the request's stream instead: nothing to do there.

use std::time::Duration;

use http::header::{self, HeaderValue};
use http::request::Parts;
use http::Response;
use http_body::Body as _;

use super::{Body, Inbound};

/// The most bytes of an unread body that are read and thrown away to keep its connection.
pub const MAX: u64 = 64 * 1024;

/// The longest an answer waits for an unread body to arrive (the whole body, not between reads).
pub const WAIT: Duration = Duration::from_secs(1);

/// What an answer made before the request body was read must do about that body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unread {
    /// Nothing: the request has no body to come, or its protocol ends the stream.
    Nothing,
    /// Read it (up to [`MAX`] within [`WAIT`]) and keep the connection.
    Discard,
    /// Say `Connection: close`: the client waits for `100 Continue`, or announced more than
    /// [`MAX`].
    Close,
}

impl Unread {
    /// What to do with `body` if the answer to the request `parts` comes before it is read.
    #[inline]
    pub fn of(body: &Inbound, parts: &Parts) -> Unread {
        if parts.version >= http::Version::HTTP_2 || body.is_end_stream() {
            return Unread::Nothing;
        }
        Unread::judge(body, parts)
    }

    #[cold]
    fn judge(body: &Inbound, parts: &Parts) -> Unread {
        let waits =
            parts.headers.get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if waits || body.size_hint().lower() > MAX {
            Unread::Close
        } else {
            Unread::Discard
        }
    }

    /// The body still in `slot` if the answer left it unread and it matters: taken, to be
    /// [`Left::settle`]d before the answer goes. `own`: the answer is tollgate's own (a
    /// refusal, a failure); if the body went upstream first, part of it may still be unread
    /// (the upstream could not be reached, or failed before reading it all), and the answer
    /// says `Connection: close`.
    #[inline]
    pub fn left(self, slot: &mut Option<Inbound>, own: bool) -> Option<Left> {
        if self == Unread::Nothing {
            return None;
        }
        match slot.take() {
            Some(body) => Some(Left { body: Some(body), close: self == Unread::Close }),
            None => own.then_some(Left { body: None, close: true }),
        }
    }
}

/// A body an answer left unread (see [`Unread::left`]).
pub struct Left {
    /// `None`: the body went upstream, and may be partly unread.
    body: Option<Inbound>,
    close: bool,
}

impl Left {
    /// Reads and throws away the body, or says `Connection: close` on `resp` where it cannot
    /// (or need not: `resp` closes already). The answer is taken and given back, so that a
    /// caller's future does not keep it across the wait (hyper moves that future by value).
    pub async fn settle(self, mut resp: Response<Body>) -> Response<Body> {
        let closes =
            resp.headers().get(header::CONNECTION).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
        let read = match self.body {
            Some(body) if !self.close && !closes => matches!(tokio::time::timeout(WAIT, discard(body)).await, Ok(true)),
            _ => false,
        };
        if !closes && !read {
            resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// Reads `body` to its end: true when it ended cleanly within [`MAX`] bytes.
async fn discard(mut body: Inbound) -> bool {
    let mut read = 0u64;
    loop {
        match std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await {
            None => return true,
            Some(Err(_)) => return false,
            Some(Ok(frame)) => {
                read = read.saturating_add(frame.data_ref().map_or(0, |d| d.len() as u64));
                if read > MAX {
                    return false;
                }
            }
        }
    }
}
