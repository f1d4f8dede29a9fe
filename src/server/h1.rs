//! HTTP/1 connections: the keep-alive idle wait and the head read, timed apart.
//!
//! hyper has one header-read timer: it arms it whenever it starts waiting for a head, which
//! on a kept-alive connection is as soon as the previous response is written. Left alone,
//! an idle keep-alive connection would be closed after `header_read_timeout`, and the
//! head of a request that starts late in that wait would get what is left of it. Here the
//! timer is ours ([`HeadTimer`]) and hyper only tells it when a wait begins and ends:
//!
//! - the first head of a connection must be complete `header_read_timeout` after the
//!   accept (protocol detection included);
//! - a later wait is idle until bytes arrive, and ends after `keepalive_timeout`; once
//!   bytes arrive, the head must be complete `header_read_timeout` after them. Bytes a
//!   client sent ahead (pipelining) while the previous request was served count as idle
//!   time, so such a head gets at most `keepalive_timeout + header_read_timeout`.
//!
//! Either expiry closes the connection without an answer (as nginx does).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::service::Service;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

use super::detect::{Park, Prefixed};
use super::{ConnState, Stop, Stopping};
use crate::timer;

/// How long a kept-alive HTTP/1 connection waits for its next request before it is parked:
/// hyper's connection (its read and write buffers, its cached header map, the boxed slot
/// for a request's future: ~17 kB) is dropped, leaving the socket, the service and
/// [`ConnState`] (under 1 kB); the first byte of the next request builds a new one. A
/// connection that sends its requests back to back never pays for that rebuild. TLS
/// connections are not parked (see [`Park`]).
const PARK_AFTER: Duration = Duration::from_secs(1);

#[allow(clippy::manual_async_fn)]
pub(super) fn serve<IO, S, B>(
    mut io: TokioIo<Prefixed<IO>>,
    state: Arc<ConnState>,
    stop: Stop,
    mut service: S,
) -> impl Future<Output = Result<(), hyper::Error>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Park + Unpin + Send + 'static,
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible> + Unpin,
    B: http_body::Body<Data = Bytes> + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // A `fn` returning an `async move` block: its arguments are kept once (see
    // `server::connection`). While parked, the task keeps them, `stopping` and the park's
    // wait; the round with hyper's connection is boxed and dropped.
    async move {
        let mut stopping = Stopping::new(stop);
        loop {
            let parks = match Box::pin(round(io, service, &state, &mut stopping)).await {
                Round::Done(done) => return done,
                Round::Idle { io: i, service: s, parks } => {
                    (io, service) = (i, s);
                    parks
                }
            };
            if parks {
                match park(io.inner(), &state, &mut stopping).await {
                    Parked::Readable => {}
                    Parked::Closing => return Ok(()),
                }
            }
        }
    }
}

/// How a [`round`] of hyper's connection ended.
enum Round<IO, S> {
    Done(Result<(), hyper::Error>),
    /// Asked to park, it was idle; `parks` is false when hyper had read bytes ahead
    /// (pipelining): they are put back and served at once.
    Idle {
        io: TokioIo<Prefixed<IO>>,
        service: S,
        parks: bool,
    },
}

/// Serves the connection with a hyper connection until it ends or is idle long enough to be
/// parked.
async fn round<IO, S, B>(
    io: TokioIo<Prefixed<IO>>,
    service: S,
    state: &Arc<ConnState>,
    stopping: &mut Stopping,
) -> Round<IO, S>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Park + Unpin + Send + 'static,
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible> + Unpin,
    B: http_body::Body<Data = Bytes> + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // With upgrades: a 101 hands the socket to the tunnel (`forward::tunnel`); the
    // connection future then ends. The builder is a temporary (~100 bytes).
    let mut conn = {
        let mut builder = state.settings.h1.clone();
        builder.timer(HeadTimer(state.clone()));
        builder.serve_connection(io, service).with_upgrades()
    };
    let mut asked = false;
    let served = std::future::poll_fn(|cx| loop {
        if let Poll::Ready(done) = Pin::new(&mut conn).poll(cx) {
            return Poll::Ready(Some(done));
        }
        // A connection that has not yet delivered its first request is let finish it:
        // its client completed the handshake before the listener closed, and hyper
        // would close it (with the request unread) if asked now.
        if !asked && stopping.poll(cx) && state.first_head_done.load(Ordering::Relaxed) {
            asked = true;
            Pin::new(&mut conn).graceful_shutdown();
            continue;
        }
        // The head timer asks once a wait for a request has lasted `PARK_AFTER`: hyper
        // is then idle, its response flushed unless a write is pending.
        if IO::PARKABLE && !asked && state.park.load(Ordering::Relaxed) {
            state.park.store(false, Ordering::Relaxed);
            if !state.write_pending.load(Ordering::Relaxed) {
                return Poll::Ready(None);
            }
        }
        return Poll::Pending;
    })
    .await;
    if let Some(done) = served {
        return Round::Done(done);
    }
    // Asked to park, it was idle: never upgraded, so its parts are there.
    let Some(parts) = conn.into_parts() else { return Round::Done(Ok(())) };
    let (mut prefixed, rest) = (parts.io.into_inner(), parts.read_buf);
    tracing::trace!(rest = rest.len(), "parking an idle HTTP/1 connection");
    let parks = rest.is_empty();
    if parks {
        // Even empty, it may hold hyper's whole read buffer.
        drop(rest);
    } else {
        // Pipelined bytes hyper had read ahead: served at once.
        prefixed.put_back(rest);
    }
    Round::Idle { io: TokioIo::new(prefixed), service: parts.service, parks }
}

enum Parked {
    Readable,
    Closing,
}

/// Waits with no buffer for the next request's first byte, the end of the keep-alive
/// timeout, or the server's shutdown (an idle connection is closed at once then). The
/// keep-alive deadline is the connection's head deadline, already registered: a parked
/// connection holds no timer entry of its own.
async fn park<IO: Park>(io: &Prefixed<IO>, state: &ConnState, stopping: &mut Stopping) -> Parked {
    let cfg = &state.settings.cfg;
    let since = state.accepted + Duration::from_micros(state.idle_since_us.load(Ordering::Relaxed));
    let keepalive = state.head_deadline.get_or_init(timer::Deadline::new);
    keepalive.arm_at(since + timer::TICK + cfg.keepalive_timeout);
    let parked = std::future::poll_fn(|cx| {
        if stopping.poll(cx) {
            return Poll::Ready(Parked::Closing);
        }
        // An error is hyper's to see, as it would have with the connection unparked.
        if io.poll_read_ready(cx).is_ready() {
            return Poll::Ready(Parked::Readable);
        }
        if keepalive.poll_expired(cx).is_ready() {
            state.settings.metrics.timeouts.keepalive.inc();
            tracing::debug!("closing an idle HTTP/1 connection: keep-alive timeout");
            return Poll::Ready(Parked::Closing);
        }
        Poll::Pending
    })
    .await;
    keepalive.disarm();
    parked
}

/// hyper's timer for one connection; it only ever arms the header-read timeout. Every wait
/// of the connection moves one [`timer::Deadline`], registered once per connection: a wait
/// costs no timer entry and no clock read (hyper asks [`HeadTimer`] for "now", which the
/// coarse clock answers).
struct HeadTimer(Arc<ConnState>);

impl hyper::rt::Timer for HeadTimer {
    fn sleep(&self, duration: std::time::Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(self.now() + duration)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        let state = &self.0;
        let cfg = &state.settings.cfg;
        let phase = if state.first_wait.load(Ordering::Relaxed) {
            state.bytes_seen.store(false, Ordering::Relaxed);
            // hyper armed it at now + header_read_timeout: that "now" is when the wait began.
            Phase::Idle(deadline.checked_sub(cfg.header_read_timeout).unwrap_or(deadline))
        } else {
            state.first_wait.store(true, Ordering::Relaxed);
            Phase::First(state.accepted + cfg.header_read_timeout)
        };
        Box::pin(HeadSleep { state: state.clone(), phase, armed: false, park_asked: false })
    }

    fn now(&self) -> Instant {
        timer::coarse_now()
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: Instant) {
        // hyper re-arms only a timer that fired, on a connection it is closing.
        *sleep = Box::pin(HeadSleep {
            state: self.0.clone(),
            phase: Phase::Head(new_deadline),
            armed: false,
            park_asked: false,
        });
    }
}

#[derive(Clone, Copy)]
enum Phase {
    /// The first head, due at this instant.
    First(Instant),
    /// Waiting for the next request since this instant (on the coarse clock: up to a tick
    /// early, so its deadline gets a tick more).
    Idle(Instant),
    /// A later head, due at this instant.
    Head(Instant),
}

/// One wait for a head. The connection's deadline is armed on its first poll only: a head
/// that arrives whole in one read never arms anything.
struct HeadSleep {
    state: Arc<ConnState>,
    phase: Phase,
    armed: bool,
    /// An idle wait has asked its connection to park (once).
    park_asked: bool,
}

impl HeadSleep {
    fn deadline(&self) -> &timer::Deadline {
        self.state.head_deadline.get_or_init(timer::Deadline::new)
    }
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let cfg = &this.state.settings.cfg;
        if let Phase::Idle(_) = this.phase {
            if this.state.bytes_seen.load(Ordering::Relaxed) {
                this.phase = Phase::Head(timer::coarse_now() + timer::TICK + cfg.header_read_timeout);
                this.armed = false;
            }
        }
        loop {
            if !this.armed {
                let due = match this.phase {
                    Phase::First(due) | Phase::Head(due) => due,
                    Phase::Idle(since) if this.park_asked || cfg.keepalive_timeout <= PARK_AFTER => {
                        since + timer::TICK + cfg.keepalive_timeout
                    }
                    Phase::Idle(since) => since + timer::TICK + PARK_AFTER,
                };
                this.deadline().arm_at(due);
                this.armed = true;
            }
            if this.deadline().poll_expired(cx).is_pending() {
                return Poll::Pending;
            }
            match this.phase {
                Phase::Idle(since) if !this.park_asked && cfg.keepalive_timeout > PARK_AFTER => {
                    // Time to park; the deadline moves on to the keep-alive timeout.
                    this.park_asked = true;
                    this.armed = false;
                    let us = since.saturating_duration_since(this.state.accepted).as_micros();
                    this.state.idle_since_us.store(u64::try_from(us).unwrap_or(u64::MAX), Ordering::Relaxed);
                    this.state.park.store(true, Ordering::Relaxed);
                }
                _ => break,
            }
        }
        let timeouts = &this.state.settings.metrics.timeouts;
        if let Phase::Idle(_) = this.phase {
            timeouts.keepalive.inc();
            tracing::debug!("closing an idle HTTP/1 connection: keep-alive timeout");
        } else {
            timeouts.header_read.inc();
            tracing::debug!("closing an HTTP/1 connection: header read timeout");
        }
        Poll::Ready(())
    }
}

impl Drop for HeadSleep {
    fn drop(&mut self) {
        // hyper drops the sleep once the head is read (or the connection ends).
        if self.armed {
            self.deadline().disarm();
        }
        if let Phase::First(_) = self.phase {
            self.state.first_head_done.store(true, Ordering::Relaxed);
        }
    }
}

impl hyper::rt::Sleep for HeadSleep {}
