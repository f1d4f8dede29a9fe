//! A gRPC call's messages checked as its bodies pass (a route's message limits): each
//! length-prefixed message (PROTOCOL-HTTP2 of grpc/grpc: a compressed flag and a 32-bit
//! length, then the message) is found by its 5-byte prefix as the data frames pass; the
//! message itself is never read or buffered, so a compressed one counts as any other.
//!
//! A message waits at its prefix for its decision (the client's body is read no further
//! meanwhile, so its flow control slows it). A refused call ends: the request body fails
//! (the upstream's stream is reset), and the response ends with the refusal's trailers
//! (`grpc-status: 8`, `grpc-message`, `grpc-retry-pushback-ms`): both sides share one
//! [`Call`], so that a refusal on either side ends the other.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body as HttpBody, Frame, SizeHint};

use super::watch::{Deciding, Refusal, Verdict, Watch};
use super::{Body, BodyError, ClientBodyError, Inbound};

/// A task to wake: the one that last polled a side.
#[derive(Default)]
struct AtomicWaker(Mutex<Option<std::task::Waker>>);

impl AtomicWaker {
    fn new() -> AtomicWaker {
        AtomicWaker::default()
    }

    fn register(&self, cx: &Context<'_>) {
        let mut w = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *w = Some(cx.waker().clone());
        }
    }

    fn wake(&self) {
        let w = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// One call's checks, shared by its request and response bodies.
#[derive(Clone)]
pub struct Call(Arc<Shared>);

struct Shared {
    watch: Arc<dyn Watch>,
    refused: Mutex<Option<Refusal>>,
    /// The response body, waiting on its upstream while the request side may refuse.
    response: AtomicWaker,
    /// The request body, likewise.
    request: AtomicWaker,
    /// What the trailers of a refusal say (made by the answer room).
    trailers: fn(&Refusal) -> HeaderMap,
}

impl Call {
    /// `trailers` renders a refusal as the call's trailers.
    pub fn new(watch: Arc<dyn Watch>, trailers: fn(&Refusal) -> HeaderMap) -> Call {
        Call(Arc::new(Shared {
            watch,
            refused: Mutex::new(None),
            response: AtomicWaker::new(),
            request: AtomicWaker::new(),
            trailers,
        }))
    }

    /// The refusal that ended the call, if one did.
    pub fn refusal(&self) -> Option<Refusal> {
        self.0.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn refuse(&self, r: Refusal) {
        let mut slot = self.0.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(r);
        }
        drop(slot);
        self.0.response.wake();
        self.0.request.wake();
    }

    fn is_refused(&self) -> bool {
        self.0.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some()
    }

    /// The client's body, checked on its way upstream (when a limit counts that way).
    pub fn request(&self, body: Inbound) -> Inbound {
        if !self.0.watch.counts(true) {
            return body;
        }
        Inbound::Boxed(Box::pin(Counted::new(body, true, self.clone())))
    }

    /// The upstream's answer body, checked on its way to the client, and ended with the
    /// refusal's trailers when the call is refused.
    pub fn response(&self, body: Body) -> Body {
        Body::boxed(Counted::new(Box::pin(body), false, self.clone()))
    }

    /// The call is over (for the stream's log line).
    pub fn ended(&self, why: &str) {
        self.0.watch.ended(why);
    }
}

/// Where a body is in its messages' prefixes.
#[derive(Default)]
struct Framing {
    prefix: [u8; 5],
    have: usize,
    /// Bytes of the current message still to pass.
    left: u64,
}

impl Framing {
    /// Moves `pos` through `data` to just after the next whole prefix, and gives that
    /// message's length; `None` when `data` ends first.
    fn next(&mut self, data: &[u8], pos: &mut usize) -> Option<u64> {
        while *pos < data.len() {
            let rest = data.len() - *pos;
            if self.left > 0 {
                let n = usize::try_from(self.left).map_or(rest, |l| l.min(rest));
                *pos += n;
                self.left -= n as u64;
                continue;
            }
            let n = (5 - self.have).min(rest);
            self.prefix[self.have..self.have + n].copy_from_slice(&data[*pos..*pos + n]);
            self.have += n;
            *pos += n;
            if self.have == 5 {
                self.have = 0;
                let len =
                    u64::from(u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]));
                self.left = len;
                return Some(len);
            }
        }
        None
    }
}

/// A message held at its prefix.
enum Hold {
    Deciding { decision: Deciding, waited: Duration, len: u64 },
    Waiting { sleep: Pin<Box<tokio::time::Sleep>>, after: Duration, again: bool, waited: Duration, len: u64 },
}

/// A body whose messages are checked: the client's (`up`) or the upstream's.
struct Counted<B> {
    inner: B,
    up: bool,
    counts: bool,
    call: Call,
    framing: Framing,
    /// The data frame being scanned: `[..sent]` went on, `[..scanned]` is cleared.
    chunk: Option<Bytes>,
    sent: usize,
    scanned: usize,
    hold: Option<Hold>,
    done: bool,
}

impl<B> Counted<B> {
    fn new(inner: B, up: bool, call: Call) -> Counted<B> {
        let counts = call.0.watch.counts(up);
        Counted {
            inner,
            up,
            counts,
            call,
            framing: Framing::default(),
            chunk: None,
            sent: 0,
            scanned: 0,
            hold: None,
            done: false,
        }
    }

    fn waker(&self) -> &AtomicWaker {
        if self.up {
            &self.call.0.request
        } else {
            &self.call.0.response
        }
    }

    /// Polls the held message's decision or wait: whether it let go of the message.
    fn poll_hold(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let watch = &self.call.0.watch;
        loop {
            let Some(hold) = &mut self.hold else { return Poll::Ready(()) };
            let next = match hold {
                Hold::Deciding { decision, waited, len } => {
                    let verdict = match decision.as_mut().poll(cx) {
                        Poll::Ready(v) => v,
                        Poll::Pending => return Poll::Pending,
                    };
                    match verdict {
                        Verdict::Pass { after } if after.is_zero() => None,
                        Verdict::Pass { after } => Some(Hold::Waiting {
                            sleep: Box::pin(tokio::time::sleep(after)),
                            after,
                            again: false,
                            waited: *waited,
                            len: *len,
                        }),
                        Verdict::Again { after } => Some(Hold::Waiting {
                            sleep: Box::pin(tokio::time::sleep(after)),
                            after,
                            again: true,
                            waited: *waited,
                            len: *len,
                        }),
                        Verdict::Refuse(r) => {
                            self.call.refuse(r);
                            None
                        }
                    }
                }
                Hold::Waiting { sleep, after, again, waited, len } => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    if *again {
                        let waited = *waited + *after;
                        Some(Hold::Deciding { decision: watch.message(self.up, *len, waited), waited, len: *len })
                    } else {
                        None
                    }
                }
            };
            self.hold = next;
        }
    }

    /// The cleared part of the chunk not yet sent, if any.
    fn take_cleared(&mut self) -> Option<Bytes> {
        let chunk = self.chunk.as_ref()?;
        if self.scanned == self.sent {
            return None;
        }
        let out = chunk.slice(self.sent..self.scanned);
        self.sent = self.scanned;
        Some(out)
    }

    /// Scans the chunk: clears up to the next counted prefix (which starts a decision).
    fn scan(&mut self) {
        let Some(chunk) = &self.chunk else { return };
        while self.scanned < chunk.len() && self.hold.is_none() {
            match self.framing.next(chunk, &mut self.scanned) {
                Some(len) if self.counts => {
                    let decision = self.call.0.watch.message(self.up, len, Duration::ZERO);
                    self.hold = Some(Hold::Deciding { decision, waited: Duration::ZERO, len });
                }
                _ => {}
            }
        }
    }
}

/// What a side does when its call is refused.
trait Side: Sized {
    /// The frame (or error) that ends this side.
    fn refused(call: &Call) -> Option<Result<Frame<Bytes>, Self>>;
}

impl Side for ClientBodyError {
    fn refused(_: &Call) -> Option<Result<Frame<Bytes>, ClientBodyError>> {
        Some(Err(ClientBodyError::Refused))
    }
}

impl Side for BodyError {
    fn refused(call: &Call) -> Option<Result<Frame<Bytes>, BodyError>> {
        let r = call.refusal()?;
        Some(Ok(Frame::trailers((call.0.trailers)(&r))))
    }
}

impl<B> HttpBody for Counted<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Side,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if this.call.is_refused() {
                this.done = true;
                this.chunk = None;
                return Poll::Ready(B::Error::refused(&this.call));
            }
            if this.hold.is_some() {
                this.waker().register(cx);
                if this.poll_hold(cx).is_pending() {
                    return Poll::Pending;
                }
                continue;
            }
            if let Some(out) = this.take_cleared() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
            if let Some(chunk) = &this.chunk {
                if this.scanned < chunk.len() {
                    this.scan();
                    continue;
                }
                this.chunk = None;
            }
            this.waker().register(cx);
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    if this.call.is_refused() {
                        continue;
                    }
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        (this.sent, this.scanned) = (0, 0);
                        this.chunk = Some(data);
                    }
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
            || (self.chunk.is_none() && self.hold.is_none() && !self.call.is_refused() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        // Cut short by a refusal, or ended with trailers of its own: no exact length.
        SizeHint::default()
    }
}

impl<B> Drop for Counted<B> {
    fn drop(&mut self) {
        // The response side ends with the call (the request side may end first).
        if self.up {
            return;
        }
        let why = match self.call.refusal() {
            Some(r) if r.too_large => "a message over max_message_size",
            Some(_) => "a message over a message limit",
            None if self.done => "the call ended",
            None => "the call was cut short",
        };
        self.call.ended(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_found_across_and_within_chunks() {
        let mut f = Framing::default();
        // A message of 3 bytes (zeros, which would read as a prefix), an empty one, then three
        // bytes of a compressed one's prefix.
        let a = [0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0x00, 0xa0];
        let mut pos = 0;
        assert_eq!(f.next(&a, &mut pos), Some(3));
        assert_eq!(pos, 5);
        assert_eq!(f.next(&a, &mut pos), Some(0));
        assert_eq!(pos, 13);
        assert_eq!(f.next(&a, &mut pos), None);
        assert_eq!(pos, a.len());
        // The rest of its prefix: 10 MiB announced, none of it here.
        let b = [0, 0];
        let mut pos = 0;
        assert_eq!(f.next(&b, &mut pos), Some(10 << 20));
        assert_eq!(pos, 2);
        // Its body passes uncounted, in pieces.
        let body = vec![7u8; 4 << 20];
        for _ in 0..2 {
            let mut pos = 0;
            assert_eq!(f.next(&body, &mut pos), None);
        }
        let mut tail = vec![7u8; 2 << 20];
        tail.extend_from_slice(&[0, 0, 0, 0, 1]);
        let mut pos = 0;
        assert_eq!(f.next(&tail, &mut pos), Some(1));
        assert_eq!(pos, tail.len());
    }
}
