//! HTTP/2 connections: the protocol limits live in hyper's builder (see `Settings::new`);
//! here is the idle timeout hyper does not have. A stream counts as open from its request
//! until its response body is dropped (sent, or reset); a connection with no open stream
//! for `h2.idle_timeout` gets a graceful GOAWAY, and is dropped if the client has not let
//! it close within `h2.ping_timeout` after that. A CONNECT's stream outlives its response
//! when it becomes a tunnel (RFC 8441): it stays counted while the tunnel holds its
//! [`crate::body::StreamHold`].

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::Service;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use pin_project_lite::pin_project;

use super::detect::{Park, Prefixed};
use super::{ConnState, Stop, Stopping};

pub(super) async fn serve<IO, S, B>(
    io: TokioIo<Prefixed<IO>>,
    state: Arc<ConnState>,
    stop: Stop,
    service: S,
) -> Result<(), hyper::Error>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Park + Unpin + Send + 'static,
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>,
    B: HttpBody<Data = Bytes> + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<StreamFuture<S::Future>, Counted<B>>,
{
    let settings = state.settings.clone();
    let idle_timeout = settings.cfg.h2.idle_timeout;
    let conn = settings.h2.serve_connection(io, Streams { inner: service, state: state.clone() });
    tokio::pin!(conn);
    let mut stopping = Stopping::new(stop);
    // Checked lazily: it fires at most once per `idle_timeout` and then looks at the
    // counters, so streams do not touch it; and it is polled only when it fired.
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    let fired = Arc::new(Fired::default());
    let fired_waker = Waker::from(fired.clone());
    let mut armed = false;
    let mut asked = false;
    let mut hard_close: Option<Pin<Box<tokio::time::Sleep>>> = None;
    let done = std::future::poll_fn(|cx| loop {
        if let Poll::Ready(done) = conn.as_mut().poll(cx) {
            return Poll::Ready(done);
        }
        if asked {
            if let Some(hard) = hard_close.as_mut() {
                if hard.as_mut().poll(cx).is_ready() {
                    tracing::debug!("dropping an idle HTTP/2 connection that did not close after GOAWAY");
                    return Poll::Ready(Ok(()));
                }
            }
            return Poll::Pending;
        }
        if stopping.poll(cx) {
            asked = true;
            conn.as_mut().graceful_shutdown();
            continue;
        }
        if armed && !fired.0.load(Ordering::Acquire) {
            return Poll::Pending;
        }
        if !fired.arm(cx, idle.as_mut(), &fired_waker) {
            armed = true;
            return Poll::Pending;
        }
        armed = false;
        let now = Instant::now();
        let due = if state.open_streams.load(Ordering::Acquire) == 0 {
            let since = state.idle_since_us.load(Ordering::Acquire);
            state.accepted + std::time::Duration::from_micros(since) + idle_timeout
        } else {
            now + idle_timeout
        };
        if due <= now {
            settings.metrics.timeouts.h2_idle.inc();
            tracing::debug!("closing an idle HTTP/2 connection");
            asked = true;
            hard_close = Some(Box::pin(tokio::time::sleep(settings.cfg.h2.ping_timeout)));
            conn.as_mut().graceful_shutdown();
        } else {
            idle.as_mut().reset(due.into());
        }
    })
    .await;
    if let Err(e) = &done {
        if e.is_timeout() {
            settings.metrics.timeouts.h2_ping.inc();
        }
    }
    done
}

/// The idle timer's waker: it notes that the timer fired, then wakes the connection's task,
/// so the connection looks at one flag per wake-up instead of polling the timer.
#[derive(Default)]
struct Fired(AtomicBool, Mutex<Option<Waker>>);

impl Fired {
    /// Polls `sleep` on behalf of the task of `cx`; true when it has elapsed.
    fn arm(&self, cx: &Context<'_>, sleep: Pin<&mut tokio::time::Sleep>, waker: &Waker) -> bool {
        self.0.store(false, Ordering::Release);
        // Once per arming: the task of a spawned connection keeps its waker.
        *self.1.lock().unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
        sleep.poll(&mut Context::from_waker(waker)).is_ready()
    }
}

impl Wake for Fired {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::Release);
        if let Some(task) = self.1.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
            task.wake_by_ref();
        }
    }
}

/// Counts a stream as open until dropped.
struct StreamGuard(Arc<ConnState>);

impl StreamGuard {
    fn open(state: &Arc<ConnState>) -> StreamGuard {
        state.open_streams.fetch_add(1, Ordering::AcqRel);
        StreamGuard(state.clone())
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let state = &self.0;
        // The end time first, so a check that sees no open stream reads it current.
        let since = u64::try_from(state.accepted.elapsed().as_micros()).unwrap_or(u64::MAX);
        state.idle_since_us.fetch_max(since, Ordering::AcqRel);
        state.open_streams.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The service with each stream counted.
#[derive(Clone)]
pub(crate) struct Streams<S> {
    inner: S,
    state: Arc<ConnState>,
}

impl<S, B> Service<Request<Incoming>> for Streams<S>
where
    S: Service<Request<Incoming>, Response = Response<B>>,
    B: HttpBody,
{
    type Response = Response<Counted<B>>;
    type Error = S::Error;
    type Future = StreamFuture<S::Future>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        if req.method() == http::Method::CONNECT {
            // Counted as open for as long as the hold lives: a tunnel takes it for its life.
            req.extensions_mut().insert(crate::body::StreamHold(Arc::new(StreamGuard::open(&self.state))));
        }
        let head = req.method() == http::Method::HEAD;
        StreamFuture { guard: Some(StreamGuard::open(&self.state)), inner: Box::pin(self.inner.call(req)), head }
    }
}

/// A stream's answer; its guard moves into the response body. The answer's future is boxed
/// once: hyper moves a stream's future by value several times (into the stream task, into
/// the task's cell), and a pointer moves for less than the future's kilobytes (h2c
/// `benches/instr.sh`: 50,748 → 48,530 instructions a request). HTTP/1 keeps it unboxed: its
/// dispatcher moves it once, and the box would cost more than that copy.
pub(crate) struct StreamFuture<F> {
    inner: Pin<Box<F>>,
    guard: Option<StreamGuard>,
    /// The request is a HEAD: its answer goes without content (hyper's HTTP/2 server would
    /// send the body it is given).
    head: bool,
}

impl<F, B, E> Future for StreamFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: HttpBody,
{
    type Output = Result<Response<Counted<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        this.inner.as_mut().poll(cx).map(|answer| {
            let (guard, head) = (this.guard.take(), this.head);
            answer.map(|mut resp| {
                if head {
                    // The GET's fields, `Content-Length` included (hyper writes it only for a
                    // body it sends), and no content: HEADERS with END_STREAM.
                    let (mut parts, body) = resp.into_parts();
                    super::announce_length(&mut parts.headers, parts.status, &body);
                    resp = Response::from_parts(parts, body);
                }
                resp.map(|inner| Counted { inner, _guard: guard, head })
            })
        })
    }
}

pin_project! {
    /// A response body that keeps its stream counted as open; an answer to HEAD has none
    /// (the body it was made with is dropped with it, unread).
    pub(crate) struct Counted<B> {
        #[pin]
        inner: B,
        _guard: Option<StreamGuard>,
        head: bool,
    }
}

impl<B: HttpBody> HttpBody for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        if *this.head {
            return Poll::Ready(None);
        }
        this.inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.head || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.head {
            return SizeHint::with_exact(0);
        }
        self.inner.size_hint()
    }
}
