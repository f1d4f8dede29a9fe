//! The body types at the proxy's two edges.
//!
//! - [`Body`]: every response tollgate sends. A full buffer (its own answers, the built-in
//!   responder, stale copies) or an upstream's body passed on as it arrives, with an
//!   idle-read deadline; optionally copied as it streams (a [`Tap`]), giving its upstream
//!   connection back (a [`Lease`]) and holding a concurrency slot until it ends.
//! - [`Inbound`]: a client's body as it arrives, from hyper (HTTP/1.1, HTTP/2) or from an
//!   HTTP/3 stream ([`h3::Recv`]); the request path takes either.
//! - [`RequestBody`]: a client's body on its way upstream, with an idle-read deadline and
//!   errors that say they are the client's ([`ClientBodyError`]).
//!
//! Enums and inline fields, not boxes, so the hot path allocates nothing for them. This
//! module knows neither the cache nor the pool: they plug in through [`Tap`] and [`Home`].
//!
//! An HTTP/2 upstream's response body also drives what is left of the request body
//! ([`h2::Pump`]): one future per request on both sides, no task.

pub mod h2;
pub mod h3;
pub mod unread;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;

use crate::timer::{Deadline, Sleep};

/// An upstream HTTP/1 connection, ready for one request, with the deadline its waits move
/// (for a response head, then between reads of the body).
pub struct UpstreamConn {
    pub send: hyper::client::conn::http1::SendRequest<RequestBody>,
    pub deadline: Deadline,
}

/// What a response body keeps until it has been sent in full, given by the room that owns
/// it and released by being dropped: a route's concurrency slot, an upstream stream's place.
/// An enum of the shapes those take, so that keeping one allocates nothing.
pub enum Guard {
    /// A semaphore permit (a fixed concurrency cap).
    Permit(tokio::sync::OwnedSemaphorePermit),
    /// A place in a counted set.
    Place(Place),
    /// Anything else, boxed by its owner.
    Boxed(Box<dyn Send + Sync>),
}

/// One place in a counted set (an HTTP/2 connection's open streams): counted when taken,
/// given back when dropped.
pub struct Place(Arc<AtomicUsize>);

impl Place {
    pub fn take(count: &Arc<AtomicUsize>) -> Place {
        count.fetch_add(1, Ordering::Relaxed);
        Place(count.clone())
    }

    /// Sets `bits` (above any count the set can reach) in the set's word: a flag its owner
    /// reads beside the count, such as a connection known to be closed.
    pub fn mark(&self, bits: usize) {
        self.0.fetch_or(bits, Ordering::Relaxed);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A hold on a client's stream that outlives its request (an HTTP/2 CONNECT's, for the
/// tunnel it becomes): the server puts it in the request's extensions, and whatever keeps the
/// stream open takes it.
#[derive(Clone)]
pub struct StreamHold(#[allow(dead_code)] pub Arc<dyn Send + Sync>); // held for its drop, never read

/// Where an upstream connection goes back to once the response it carried has ended.
pub trait Home: Send + Sync {
    fn put(&self, conn: UpstreamConn);
    /// A response on one of its connections sent nothing for its idle-read timeout; the
    /// connection is dropped, not put back.
    fn read_timed_out(&self);
}

/// An upstream connection lent to one response; given back when the body ends cleanly (if
/// `reuse`), and closed (dropped) on error or when the client goes away mid-body.
pub struct Lease {
    pub conn: UpstreamConn,
    pub home: Arc<dyn Home>,
    /// False when the answer's framing needed repair: such a connection is not trusted again.
    pub reuse: bool,
}

impl Lease {
    fn release(self) {
        if self.reuse {
            self.conn.deadline.disarm();
            self.home.put(self.conn);
        }
    }
}

/// A copy taken of a body as it streams (the stale-copy cache). Dropped without
/// [`Tap::end`] means the copy is abandoned: the body failed, had trailers, or was cut short.
pub trait Tap: Send {
    /// A data frame on its way to the client; `false` ends the copy (it is dropped).
    fn data(&mut self, data: &Bytes) -> bool;
    /// The body ended cleanly.
    fn end(self: Box<Self>);
}

/// A read deadline that runs only while the other side owes data: armed when a read finds
/// nothing, disarmed when something arrives. Armed lazily, so a body that is always ready
/// never touches a timer.
struct Idle {
    sleep: Option<Sleep>,
    /// Milliseconds (a u32 keeps bodies small; config bounds timeouts far below 49 days).
    after_ms: u32,
    armed: bool,
}

impl Idle {
    /// `after` zero: no deadline.
    fn new(after: Duration) -> Idle {
        let after_ms = u32::try_from(after.as_millis()).unwrap_or(u32::MAX);
        Idle { sleep: None, after_ms, armed: false }
    }

    fn after(&self) -> Duration {
        Duration::from_millis(u64::from(self.after_ms))
    }

    /// The read found nothing: true once `after` has passed since it last found something.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.after_ms == 0 {
            return false;
        }
        if !self.armed {
            let after = self.after();
            match &mut self.sleep {
                Some(s) => s.reset_after(after),
                None => self.sleep = Some(Sleep::after(after)),
            }
            self.armed = true;
        }
        self.sleep.as_mut().is_some_and(|s| Pin::new(s).poll(cx).is_ready())
    }

    fn progress(&mut self) {
        self.armed = false;
    }
}

/// The upstream body's read deadline: the leased connection's [`Deadline`], armed when a read
/// finds nothing and left alone while reads find something.
struct Quiet {
    /// Milliseconds; zero: no deadline.
    after_ms: u32,
    armed: bool,
}

impl Quiet {
    fn new(after: Duration) -> Quiet {
        Quiet { after_ms: u32::try_from(after.as_millis()).unwrap_or(u32::MAX), armed: false }
    }

    fn after(&self) -> Duration {
        Duration::from_millis(u64::from(self.after_ms))
    }

    /// The read found nothing: true once `after` has passed since it last found something.
    fn expired(&mut self, deadline: &Deadline, cx: &mut Context<'_>) -> bool {
        if self.after_ms == 0 {
            return false;
        }
        if !self.armed {
            deadline.arm_for(self.after());
            self.armed = true;
        }
        deadline.poll_expired(cx).is_ready()
    }
}

/// Why a response body stopped early.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("upstream body failed: {0}")]
    Upstream(#[from] hyper::Error),
    #[error("upstream sent nothing for {0:?}")]
    IdleTimeout(Duration),
    #[error("upstream stream failed: {0}")]
    Stream(#[from] ::h2::Error),
    #[error("the request body failed: {0}")]
    ClientBody(ClientBodyError),
    /// The built-in responder's `resets`: the answer is cut on purpose.
    #[error("cut by the responder (respond.resets)")]
    Cut,
    #[error("the answer's encoder failed: {0}")]
    Encode(std::io::Error),
}

pin_project! {
    #[project = KindProj]
    enum Kind {
        Full { data: Option<Bytes> },
        // An upstream body; `lease` goes back to its pool once the body ends.
        Upstream { #[pin] inner: Incoming, lease: Option<Lease>, quiet: Quiet },
        // An HTTP/2 upstream's stream (trailers pass); `stream` is its place on the shared
        // connection, given back when the body ends.
        Stream { #[pin] inner: Incoming, idle: Idle, stream: Option<Place> },
        // A stream of tollgate's own HTTP/2 client: the response as h2 hands it over, and the
        // request body's unfinished pump (boxed: most requests finish theirs before the head).
        H2 { recv: ::h2::RecvStream, pump: Option<Box<h2::Pump>>, idle: Idle, stream: Option<Place>, data_done: bool },
        // A body another room made (an answer encoded on its way out, the responder's slow or
        // cut bodies), boxed by the room that made it.
        Boxed { inner: Pin<Box<dyn HttpBody<Data = Bytes, Error = BodyError> + Send>> },
    }
}

pin_project! {
    /// A response body.
    pub struct Body {
        #[pin]
        kind: Kind,
        tap: Option<Box<dyn Tap>>,
        // A route's concurrency slot: released when the body ends (or is dropped).
        hold: Option<Guard>,
    }
}

impl Body {
    fn of(kind: Kind) -> Body {
        Body { kind, tap: None, hold: None }
    }

    pub fn empty() -> Body {
        Body::of(Kind::Full { data: None })
    }

    pub fn full(data: impl Into<Bytes>) -> Body {
        let data: Bytes = data.into();
        Body::of(Kind::Full { data: (!data.is_empty()).then_some(data) })
    }

    /// An upstream body. `lease` goes back to its pool when the body ends (if it may be
    /// reused); a body that sends nothing for `idle_timeout` (zero: no limit) fails, and its
    /// connection is dropped.
    pub fn upstream(inner: Incoming, lease: Lease, idle_timeout: Duration) -> Body {
        if inner.is_end_stream() {
            // hyper may never poll an empty body: the connection is free already.
            lease.release();
            return Body::of(Kind::Upstream { inner, lease: None, quiet: Quiet::new(Duration::ZERO) });
        }
        Body::of(Kind::Upstream { inner, lease: Some(lease), quiet: Quiet::new(idle_timeout) })
    }

    /// A response streamed from an HTTP/2 upstream, trailers included; one that sends
    /// nothing for `idle_timeout` (zero: no limit) fails.
    pub fn stream(inner: Incoming, stream: Place, idle_timeout: Duration) -> Body {
        Body::of(Kind::Stream { inner, idle: Idle::new(idle_timeout), stream: Some(stream) })
    }

    /// A response on a stream of an HTTP/2 upstream, trailers included, with what is left to
    /// send of the request body; one that sends nothing for `idle_timeout` (zero: no limit)
    /// fails. `stream` is the stream's place on its connection, given back when the body ends.
    pub fn h2(recv: ::h2::RecvStream, pump: Option<h2::Pump>, stream: Place, idle_timeout: Duration) -> Body {
        let pump = pump.map(Box::new);
        Body::of(Kind::H2 { recv, pump, idle: Idle::new(idle_timeout), stream: Some(stream), data_done: false })
    }

    /// A body made by another room (an encoded answer, the responder's faults).
    pub fn boxed(inner: impl HttpBody<Data = Bytes, Error = BodyError> + Send + 'static) -> Body {
        Body::of(Kind::Boxed { inner: Box::pin(inner) })
    }

    /// Copies the body into `tap` as it streams.
    pub fn tap(&mut self, tap: Box<dyn Tap>) {
        if self.is_end_stream() {
            // Over before it starts (empty): it may never be polled.
            tap.end();
        } else {
            self.tap = Some(tap);
        }
    }

    #[cfg(test)]
    pub(crate) fn is_tapped(&self) -> bool {
        self.tap.is_some()
    }

    /// Keeps `guard` until the body has been sent in full.
    pub fn hold(&mut self, guard: Guard) {
        self.hold = Some(guard);
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.project();
        let (polled, ended) = match this.kind.project() {
            KindProj::Full { data } => (Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))), true),
            KindProj::Upstream { mut inner, lease, quiet } => match inner.as_mut().poll_frame(cx) {
                Poll::Pending if lease.as_ref().is_some_and(|l| quiet.expired(&l.conn.deadline, cx)) => {
                    // The upstream connection is mid-response: it can never be reused.
                    if let Some(l) = lease.take() {
                        l.home.read_timed_out();
                    }
                    (Poll::Ready(Some(Err(BodyError::IdleTimeout(quiet.after())))), true)
                }
                Poll::Pending => (Poll::Pending, false),
                Poll::Ready(polled) => {
                    quiet.armed = false;
                    let ended = match &polled {
                        None => true,
                        Some(Ok(_)) => inner.is_end_stream(),
                        Some(Err(_)) => {
                            drop(lease.take());
                            true
                        }
                    };
                    if ended {
                        if let Some(l) = lease.take() {
                            l.release();
                        }
                    }
                    (Poll::Ready(polled.map(|r| r.map_err(BodyError::from))), ended)
                }
            },
            KindProj::Stream { inner, idle, stream } => match inner.poll_frame(cx) {
                Poll::Pending if idle.expired(cx) => {
                    stream.take();
                    (Poll::Ready(Some(Err(BodyError::IdleTimeout(idle.after())))), true)
                }
                Poll::Pending => (Poll::Pending, false),
                Poll::Ready(polled) => {
                    idle.progress();
                    let ended = !matches!(polled, Some(Ok(_)));
                    if ended {
                        stream.take();
                    }
                    (Poll::Ready(polled.map(|r| r.map_err(BodyError::from))), ended)
                }
            },
            KindProj::H2 { recv, pump, idle, stream, data_done } => {
                let polled = poll_h2(recv, pump, idle, data_done, cx);
                let ended = match &polled {
                    Poll::Ready(Some(Ok(_))) => recv.is_end_stream(),
                    Poll::Ready(_) => true,
                    Poll::Pending => false,
                };
                if ended {
                    // Whatever the client still sends is not wanted: the stream is over.
                    pump.take();
                    stream.take();
                }
                (polled, ended)
            }
            KindProj::Boxed { inner } => {
                let polled = inner.as_mut().poll_frame(cx);
                let ended = match &polled {
                    Poll::Ready(Some(Ok(_))) => inner.is_end_stream(),
                    Poll::Ready(_) => true,
                    Poll::Pending => false,
                };
                (polled, ended)
            }
        };
        if let Poll::Ready(frame) = &polled {
            feed(this.tap, frame, ended);
            if ended {
                this.hold.take();
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Upstream { inner, .. } | Kind::Stream { inner, .. } => inner.is_end_stream(),
            Kind::H2 { recv, .. } => recv.is_end_stream(),
            Kind::Boxed { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            Kind::Upstream { inner, .. } | Kind::Stream { inner, .. } => inner.size_hint(),
            Kind::H2 { recv, .. } if recv.is_end_stream() => SizeHint::with_exact(0),
            Kind::H2 { .. } => SizeHint::default(),
            Kind::Boxed { inner } => inner.size_hint(),
        }
    }
}

type Polled = Poll<Option<Result<Frame<Bytes>, BodyError>>>;

/// One frame of an HTTP/2 upstream's response: the request body's pump driven first (the
/// upstream may wait for it before answering more), then data (its window room given back as
/// it is handed on), then trailers. Nothing for `idle` while the upstream owes data fails.
fn poll_h2(
    recv: &mut ::h2::RecvStream,
    pump: &mut Option<Box<h2::Pump>>,
    idle: &mut Idle,
    data_done: &mut bool,
    cx: &mut Context<'_>,
) -> Polled {
    if let Some(p) = pump.as_mut() {
        match p.poll(cx) {
            Poll::Pending => {}
            Poll::Ready(h2::Pumped::Client(e)) => {
                pump.take();
                return Poll::Ready(Some(Err(BodyError::ClientBody(e))));
            }
            Poll::Ready(_) => {
                pump.take();
            }
        }
    }
    let polled = if *data_done {
        recv.poll_trailers(cx).map(|t| t.map(|t| t.map(Frame::trailers)).transpose())
    } else {
        match recv.poll_data(cx) {
            Poll::Ready(Some(Ok(data))) => {
                // Handed on: the upstream may send as much again.
                let _ = recv.flow_control().release_capacity(data.len());
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(None) => {
                *data_done = true;
                recv.poll_trailers(cx).map(|t| t.map(|t| t.map(Frame::trailers)).transpose())
            }
            other => other.map(|d| d.map(|d| d.map(Frame::data))),
        }
    };
    match polled {
        Poll::Pending if idle.expired(cx) => Poll::Ready(Some(Err(BodyError::IdleTimeout(idle.after())))),
        Poll::Pending => Poll::Pending,
        Poll::Ready(frame) => {
            idle.progress();
            Poll::Ready(frame.map(|r| r.map_err(BodyError::from)))
        }
    }
}

/// Passes one polled frame to `tap`; `ended`: the body is over after it. Trailers and errors
/// abandon the copy (dropped without `end`). hyper stops polling once `is_end_stream` is
/// true, so the end may never be seen as `None`.
fn feed<E>(tap: &mut Option<Box<dyn Tap>>, frame: &Option<Result<Frame<Bytes>, E>>, ended: bool) {
    let Some(t) = tap.as_mut() else { return };
    let copied = match frame {
        Some(Ok(f)) => f.data_ref().is_some_and(|d| t.data(d)),
        Some(Err(_)) => false,
        None => true,
    };
    match tap.take() {
        Some(t) if copied && ended => t.end(),
        Some(t) if copied => *tap = Some(t),
        _ => {}
    }
}

/// Any body with a tap, driven the way [`Body`] drives its own: lets tests feed a tap from
/// bodies that fail, which `Incoming` cannot be made to do without a socket.
#[cfg(test)]
pub(crate) use tapped::Tapped;

#[cfg(test)]
mod tapped {
    use super::*;

    pin_project! {
        pub(crate) struct Tapped<B> {
            #[pin]
            inner: B,
            tap: Option<Box<dyn Tap>>,
        }
    }

    impl<B: HttpBody<Data = Bytes>> Tapped<B> {
        pub(crate) fn new(inner: B, tap: Box<dyn Tap>) -> Tapped<B> {
            Tapped { inner, tap: Some(tap) }
        }
    }

    impl<B: HttpBody<Data = Bytes>> HttpBody for Tapped<B> {
        type Data = Bytes;
        type Error = B::Error;

        fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
            let mut this = self.project();
            let polled = std::task::ready!(this.inner.as_mut().poll_frame(cx));
            let ended = polled.is_none() || this.inner.is_end_stream();
            feed(this.tap, &polled, ended);
            Poll::Ready(polled)
        }

        fn is_end_stream(&self) -> bool {
            self.inner.is_end_stream()
        }
    }
}

/// Why a client's request body could not be passed on. The client's fault: it gets `400`
/// if no answer has started, and it is never counted as an upstream failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ClientBodyError {
    #[error("the body is malformed or longer than announced")]
    Malformed,
    #[error("the client ended the body before it was complete")]
    Incomplete,
    #[error("the client sent no body data for longer than `server.body_read_timeout`")]
    Timeout,
}

impl ClientBodyError {
    fn of(e: &hyper::Error) -> ClientBodyError {
        let eof = std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof);
        if e.is_incomplete_message() || e.is_canceled() || eof {
            ClientBodyError::Incomplete
        } else {
            ClientBodyError::Malformed
        }
    }

    /// The client-body failure behind an upstream exchange's error, if that is what it was.
    pub fn behind(e: &hyper::Error) -> Option<ClientBodyError> {
        std::error::Error::source(e).and_then(|s| s.downcast_ref::<ClientBodyError>()).copied()
    }
}

/// A client's request body as it arrives: hyper's (HTTP/1.1, HTTP/2), or an HTTP/3 stream's,
/// boxed so that the common case stays as small as hyper's own body.
pub enum Inbound {
    Hyper(Incoming),
    H3(Box<h3::Recv>),
    /// No body: a request tollgate makes itself (a cache's background revalidation).
    Empty,
}

impl From<Incoming> for Inbound {
    #[inline(always)]
    fn from(b: Incoming) -> Inbound {
        Inbound::Hyper(b)
    }
}

impl HttpBody for Inbound {
    type Data = Bytes;
    type Error = ClientBodyError;

    #[inline]
    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        // Both variants are `Unpin`.
        match self.get_mut() {
            Inbound::Hyper(b) => Pin::new(b).poll_frame(cx).map(|p| p.map(|r| r.map_err(|e| ClientBodyError::of(&e)))),
            Inbound::H3(b) => b.poll_frame(cx),
            Inbound::Empty => Poll::Ready(None),
        }
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        match self {
            Inbound::Hyper(b) => b.is_end_stream(),
            Inbound::H3(b) => b.is_end_stream(),
            Inbound::Empty => true,
        }
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        match self {
            Inbound::Hyper(b) => b.size_hint(),
            Inbound::H3(b) => b.size_hint(),
            Inbound::Empty => SizeHint::with_exact(0),
        }
    }
}

pin_project! {
    /// A client's request body on its way upstream.
    pub struct RequestBody {
        #[pin]
        inner: Option<Inbound>,
        idle: Idle,
    }
}

impl RequestBody {
    /// `idle_timeout`: the longest the client may leave a started body without data.
    pub fn new(inner: Inbound, idle_timeout: Duration) -> RequestBody {
        RequestBody { inner: Some(inner), idle: Idle::new(idle_timeout) }
    }

    /// No body: a health check, or a bodiless request sent again to another server.
    pub fn empty() -> RequestBody {
        RequestBody { inner: None, idle: Idle::new(Duration::from_secs(1)) }
    }
}

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        let this = self.project();
        let Some(inner) = this.inner.as_pin_mut() else { return Poll::Ready(None) };
        match inner.poll_frame(cx) {
            Poll::Pending if this.idle.expired(cx) => Poll::Ready(Some(Err(ClientBodyError::Timeout))),
            Poll::Pending => Poll::Pending,
            Poll::Ready(polled) => {
                this.idle.progress();
                Poll::Ready(polled)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Inbound::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.as_ref().map_or(SizeHint::with_exact(0), Inbound::size_hint)
    }
}
