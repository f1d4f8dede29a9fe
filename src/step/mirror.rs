//! `mirror`: a copy of each of a route's forwarded requests (or of a sampled share) sent to
//! another upstream, fire-and-forget: the client's answer never waits for the copy, never
//! changes with it, and the mirror's failures never reach the client. The copies go through
//! the mirror upstream's own forwarder (its pools, its group with balancing and health), as
//! if the route pointed there: the path after the route's rewrite and `strip_prefix` (under
//! the mirror's base path), the client's fields with the forwarding fields and the route's
//! `request_headers` rules, the body, and the marker field (`x-tollgate-mirror: 1`).
//!
//! The body is copied as it passes to the primary, never held back: each chunk the primary's
//! upstream reads is copied into the copy's own buffer (not kept by reference: a chunk shares
//! its allocation with the connection's read buffer, which would stay alive with it) until the
//! body has ended, then the copy leaves with it. A body over `max_body` (known from its
//! `Content-Length`, or once it grows past it) stops being kept, and its copy is dropped: a
//! copy with a cut body would be another request. So the primary's body streams at its own
//! pace, and a copy holds at most `max_body` bytes.
//!
//! Invariants: at most `max_in_flight` copies are on their way at once per route (from the
//! moment one is decided until the mirror's answer has been read or has failed); over it, a
//! copy is dropped and counted; every copy decided is counted once, as sent or dropped by
//! reason; upgrades and CONNECT are never copied (a copy could not become a tunnel).

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::sync::oneshot;

use super::{Answered, Build, Builtin, Forwarding, Notes, Seen};
use crate::body::{Body, ClientBodyError, Inbound};
use crate::config::{Config, Route};
use crate::forward::{Backend, Downstream, Served};
use crate::metrics::{MirrorMetrics, MIRROR_CLASSES};

/// Indices into `MirrorMetrics::dropped` (`metrics::MIRROR_DROPPED`).
const IN_FLIGHT: usize = 0;
const TOO_LARGE: usize = 1;
const UNFINISHED: usize = 2;
const UPGRADE: usize = 3;

/// The most of a mirror's answer body read (and thrown away) so that its connection goes
/// back to the pool; a longer one's connection is closed instead.
const DRAIN: usize = 1 << 20;

const ONE: HeaderValue = HeaderValue::from_static("1");

pub(crate) struct Mirror {
    backend: Arc<Backend>,
    /// Its index among the config's upstreams: a split that sends a request there is not copied.
    index: usize,
    upstream: Arc<str>,
    route: Arc<str>,
    sample: f64,
    max_in_flight: i64,
    max_body: u64,
    header: HeaderName,
    compare: bool,
    /// The access log is on: each copy's answer gets a line too.
    log: bool,
    /// The route's `request_headers` rules, compiled for the copies (which outlive the request).
    rules: Option<Arc<crate::forward::rules::HeaderRules>>,
    counts: Arc<MirrorMetrics>,
}

/// Where the client's status meets the copy's, whichever comes second: the client's in the
/// high half, the mirror's in the low half (`FAILED`: no answer), 0 while not known.
#[derive(Clone)]
pub(crate) struct Meeting(Arc<AtomicU32>);

const FAILED: u32 = 0xFFFF;

impl Meeting {
    /// Records `status` (the client's when `client`), and returns the other side's if it
    /// was known first.
    fn meet(&self, status: u32, client: bool) -> Option<u32> {
        let mine = if client { status << 16 } else { status };
        let before = self.0.fetch_or(mine, Ordering::AcqRel);
        let other = if client { before & 0xFFFF } else { before >> 16 };
        (other != 0).then_some(other)
    }

    /// The client's status, if known.
    fn client(&self) -> Option<u16> {
        let v = self.0.load(Ordering::Acquire) >> 16;
        (v != 0).then_some(v as u16)
    }
}

impl Builtin for Mirror {
    fn compile(b: &mut Build<'_>) -> Option<Mirror> {
        let m = b.route.mirror.as_deref()?;
        let backend = b.backends.get(m.upstream)?.clone();
        Some(Mirror {
            backend,
            index: m.upstream,
            upstream: Arc::from(b.config.upstreams.get(m.upstream).map_or("?", |u| u.name.as_str())),
            route: Arc::from(b.route.name.as_str()),
            sample: m.sample,
            max_in_flight: i64::try_from(m.max_in_flight).unwrap_or(i64::MAX),
            max_body: m.max_body,
            header: m.header.clone(),
            compare: m.compare,
            log: b.config.log.access,
            rules: b.route.request_headers.as_deref().map(|r| Arc::new(crate::forward::rules::HeaderRules::new(r))),
            counts: Arc::new(b.metrics.mirror(&b.route.name)),
        })
    }

    fn describe(route: &Route, config: &Config) -> Option<String> {
        let m = route.mirror.as_deref()?;
        let share = if m.sample >= 1.0 {
            "every request".to_owned()
        } else {
            format!("{} % (drawn at random) of the requests", (m.sample * 1000.0).round() / 10.0)
        };
        let body = match m.max_body {
            n if n % (1 << 20) == 0 && n > 0 => format!("{} MiB", n >> 20),
            n if n % (1 << 10) == 0 && n > 0 => format!("{} KiB", n >> 10),
            n => format!("{n} bytes"),
        };
        let name = config.upstreams.get(m.upstream).map_or("?", |u| u.name.as_str());
        let split = route.split.as_ref().is_some_and(|s| s.sides.iter().any(|side| side.upstream == m.upstream));
        Some(format!(
            "mirror: copies {share} the limits admit to `{name}`{} (same method, path after the route's rewrite, \
             fields, and bodies up to {body}; marked `{}: 1`), at most {} at once, fire-and-forget: the client \
             never waits for a copy nor sees its answer; the answers are counted{}",
            if split { " (but those the split sends there)" } else { "" },
            m.header,
            m.max_in_flight,
            if m.compare { " and their status compared with the client's" } else { "" },
        ))
    }

    const FORWARDS: bool = true;

    fn forwarding(&self, f: &mut Forwarding<'_>, seen: &mut Seen) {
        // A split sent it to the mirror's upstream: it is there already.
        if f.upstream == self.index || (self.sample < 1.0 && fastrand::f64() >= self.sample) {
            return;
        }
        if f.upgrade || f.parts.method == http::Method::CONNECT {
            self.counts.dropped[UPGRADE].inc();
            f.notes.add("mirror", "upgrade");
            return;
        }
        // A copy's place among those on their way, taken now: it holds its body while it waits.
        if self.counts.in_flight.inc() >= self.max_in_flight {
            self.counts.in_flight.dec();
            self.counts.dropped[IN_FLIGHT].inc();
            f.notes.add("mirror", "in_flight");
            return;
        }
        let place = Place(self.counts.clone());
        let Some(client) = f.body.take() else {
            self.counts.dropped[UNFINISHED].inc();
            return;
        };
        let body = if client.is_end_stream() {
            *f.body = Some(client);
            // Sent now: its body is known (none).
            self.counts.sent.inc();
            Copied::Now(Vec::new())
        } else if client.size_hint().lower() > self.max_body {
            *f.body = Some(client);
            self.counts.dropped[TOO_LARGE].inc();
            f.notes.add("mirror", "body_too_large");
            return;
        } else {
            let (tx, rx) = oneshot::channel();
            // Room for the whole body when its length is known (at most `max_body`: checked above).
            let room = client.size_hint().exact().map_or(0, |n| usize::try_from(n).unwrap_or(0));
            let copy = Copying { buf: bytes::BytesMut::with_capacity(room), max: self.max_body, done: tx };
            *f.body = Some(Inbound::boxed(Tee { inner: client, copy: Some(copy) }));
            Copied::Later(rx)
        };
        let meeting = self.compare.then(|| Meeting(Arc::new(AtomicU32::new(0))));
        seen.mirror.clone_from(&meeting);
        let copy = Copy {
            head: head_of(f.parts, &self.header),
            strip: f.strip,
            down: Owned::of(f.down, self.rules.as_ref()),
            key: (f.hash)(&self.backend),
        };
        f.notes.add("mirror", "copied");
        let task = Task {
            backend: self.backend.clone(),
            upstream: self.upstream.clone(),
            route: self.route.clone(),
            log: self.log,
            meeting,
            _place: place,
        };
        tokio::spawn(task.run(copy, body));
    }

    fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered, _: &mut Notes<'_>) {
        let Some(meeting) = seen.mirror.take() else { return };
        if from == Answered::Tunnel {
            return;
        }
        let status = u32::from(resp.status().as_u16());
        if let Some(mirror) = meeting.meet(status, true) {
            if mirror != FAILED && mirror != status {
                self.counts.differences.inc();
            }
        }
    }
}

/// A copy's place among those on its route's way, given back when dropped.
struct Place(Arc<MirrorMetrics>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

/// The copy's head: method, target, version and fields as the primary's forwarder gets them,
/// and the marker; no extensions (the identity, an upgrade's handle stay the client's).
fn head_of(parts: &Parts, marker: &HeaderName) -> Parts {
    let (mut head, ()) = Request::new(()).into_parts();
    head.method = parts.method.clone();
    head.uri = parts.uri.clone();
    head.version = parts.version;
    head.headers = parts.headers.clone();
    head.headers.insert(marker.clone(), ONE);
    head
}

/// What [`Downstream`] says of the client, owned by the copy's task.
struct Owned {
    peer: std::net::IpAddr,
    peer_trusted: bool,
    https: bool,
    request_id: Option<(HeaderName, HeaderValue)>,
    rules: Option<(Arc<crate::forward::rules::HeaderRules>, Vec<HeaderValue>)>,
}

impl Owned {
    fn of(d: &Downstream<'_>, rules: Option<&Arc<crate::forward::rules::HeaderRules>>) -> Owned {
        Owned {
            peer: d.peer,
            peer_trusted: d.peer_trusted,
            https: d.https,
            request_id: d.request_id.as_ref().map(|(n, v)| ((*n).clone(), v.clone())),
            rules: rules.zip(d.rules).map(|(r, (_, values))| (r.clone(), values.to_vec())),
        }
    }

    fn downstream<'a>(&'a self, served: &'a Served) -> Downstream<'a> {
        Downstream {
            peer: self.peer,
            peer_trusted: self.peer_trusted,
            https: self.https,
            request_id: self.request_id.as_ref().map(|(n, v)| (n, v.clone())),
            rules: self.rules.as_ref().map(|(r, v)| (&**r, v.as_slice())),
            served,
        }
    }
}

/// The copy as decided on the request path.
struct Copy {
    head: Parts,
    strip: usize,
    down: Owned,
    key: u64,
}

/// The copy's body: known now (none), or once the client's has passed.
enum Copied {
    Now(Vec<Bytes>),
    Later(oneshot::Receiver<Result<Vec<Bytes>, usize>>),
}

/// The copy's own life, off the request path.
struct Task {
    backend: Arc<Backend>,
    upstream: Arc<str>,
    route: Arc<str>,
    log: bool,
    meeting: Option<Meeting>,
    _place: Place,
}

impl Task {
    async fn run(self, copy: Copy, body: Copied) {
        let counts = &self._place.0;
        let chunks = match body {
            Copied::Now(chunks) => chunks,
            Copied::Later(rx) => match rx.await {
                Ok(Ok(chunks)) => {
                    counts.sent.inc();
                    chunks
                }
                Ok(Err(reason)) => {
                    counts.dropped[reason].inc();
                    return;
                }
                // The client's body was dropped before its end: not read to the end, or failed.
                Err(_) => {
                    counts.dropped[UNFINISHED].inc();
                    return;
                }
            },
        };
        let Copy { mut head, strip, down, key } = copy;
        let len: usize = chunks.iter().map(Bytes::len).sum();
        if len > 0 || head.headers.contains_key(CONTENT_LENGTH) {
            head.headers.insert(CONTENT_LENGTH, HeaderValue::from(len));
        }
        let (method, path) = (head.method.clone(), head.uri.path().to_owned());
        let req = Request::from_parts(head, Inbound::boxed(Chunks(chunks.into())));
        let served = Served::default();
        let sent = Instant::now();
        let out = self.backend.send(req, strip, &down.downstream(&served), key).await;
        let took = sent.elapsed();
        counts.seconds.observe(took);
        let (status, cause) = match out {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let class = usize::from(status / 100).clamp(1, 5) - 1;
                counts.answered[class].inc();
                drain(resp.into_body()).await;
                (Some(status), None)
            }
            Err(e) => {
                counts.answered[MIRROR_CLASSES.len() - 1].inc();
                (None, Some(e.kind()))
            }
        };
        let primary = self.meeting.as_ref().and_then(|m| {
            let other = m.meet(status.map_or(FAILED, u32::from), false);
            if let (Some(client), Some(mine)) = (other, status) {
                if client != u32::from(mine) {
                    counts.differences.inc();
                }
            }
            m.client()
        });
        if self.log {
            tracing::info!(
                target: "tollgate::mirror",
                route = &*self.route,
                upstream = &*self.upstream,
                method = %method,
                path = %path,
                status,
                duration_ms = took.as_secs_f64() * 1e3,
                client_status = primary,
                error = cause,
                request_id = down.request_id.as_ref().and_then(|(_, v)| v.to_str().ok()),
            );
        }
    }
}

/// Reads an answer's body to its end (at most [`DRAIN`] bytes), so that its connection goes
/// back to the pool; a longer or failing one is dropped, closing its connection.
async fn drain(mut body: Body) {
    let mut read = 0usize;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        match frame {
            Ok(f) => {
                read += f.data_ref().map_or(0, Bytes::len);
                if read > DRAIN {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}

/// A client's body on its way to the primary, kept as it passes for the copy.
struct Tee {
    inner: Inbound,
    /// `None` once the copy is whole, or given up.
    copy: Option<Copying>,
}

struct Copying {
    buf: bytes::BytesMut,
    max: u64,
    /// The whole body, or why the copy is given up (an index of `MIRROR_DROPPED`); dropped
    /// unsent when the client's body is (not read to its end).
    done: oneshot::Sender<Result<Vec<Bytes>, usize>>,
}

impl Tee {
    fn give_up(&mut self, reason: usize) {
        if let Some(c) = self.copy.take() {
            let _ = c.done.send(Err(reason));
        }
    }

    fn finish(&mut self) {
        if let Some(c) = self.copy.take() {
            let _ = c.done.send(Ok(vec![c.buf.freeze()]));
        }
    }
}

impl HttpBody for Tee {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        // Every field is `Unpin`.
        let this = self.get_mut();
        let polled = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &polled {
            Some(Ok(frame)) => match frame.data_ref() {
                Some(data) => {
                    if let Some(c) = this.copy.as_mut() {
                        if (c.buf.len() + data.len()) as u64 > c.max {
                            this.give_up(TOO_LARGE);
                        } else {
                            c.buf.extend_from_slice(data);
                        }
                    }
                    // hyper stops polling once the body says it has ended.
                    if this.inner.is_end_stream() {
                        this.finish();
                    }
                }
                // Trailers: the copy would lose them.
                None => this.give_up(UNFINISHED),
            },
            Some(Err(_)) => this.give_up(UNFINISHED),
            None => this.finish(),
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

/// A copy's body: the chunks kept of the client's.
struct Chunks(std::collections::VecDeque<Bytes>);

impl HttpBody for Chunks {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        Poll::Ready(self.get_mut().0.pop_front().map(|d| Ok(Frame::data(d))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.iter().map(|b| b.len() as u64).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn the_second_to_know_meets_the_first() {
        let m = Meeting(Arc::new(AtomicU32::new(0)));
        assert_eq!(m.meet(200, true), None);
        assert_eq!(m.meet(503, false), Some(200));
        let m = Meeting(Arc::new(AtomicU32::new(0)));
        assert_eq!(m.meet(FAILED, false), None);
        assert_eq!(m.meet(404, true), Some(FAILED));
        assert_eq!(m.client(), Some(404));
    }

    /// A body from a channel, as a client sends it a chunk at a time.
    fn client(chunks: &[&'static str]) -> Inbound {
        let frames: Vec<Result<Frame<Bytes>, ClientBodyError>> =
            chunks.iter().map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes())))).collect();
        Inbound::boxed(http_body_util::StreamBody::new(futures_util::stream::iter(frames)))
    }

    fn tee(inner: Inbound, max: u64) -> (Tee, oneshot::Receiver<Result<Vec<Bytes>, usize>>) {
        let (done, rx) = oneshot::channel();
        (Tee { inner, copy: Some(Copying { buf: bytes::BytesMut::new(), max, done }) }, rx)
    }

    #[tokio::test]
    async fn the_tee_passes_the_body_whole_and_keeps_a_copy_up_to_its_bound() {
        let (t, mut rx) = tee(client(&["ab", "cd", "e"]), 5);
        let passed = t.collect().await.unwrap().to_bytes();
        assert_eq!(passed, "abcde");
        let kept: Vec<Bytes> = rx.try_recv().unwrap().unwrap();
        assert_eq!(kept.concat(), b"abcde");

        let (t, mut rx) = tee(client(&["ab", "cd", "ef"]), 5);
        assert_eq!(t.collect().await.unwrap().to_bytes(), "abcdef", "the primary gets it all");
        assert_eq!(rx.try_recv().unwrap(), Err(TOO_LARGE));

        // Dropped before its end (the primary's upstream answered without reading it all).
        let (mut t, mut rx) = tee(client(&["ab", "cd"]), 5);
        let _ = std::future::poll_fn(|cx| Pin::new(&mut t).poll_frame(cx)).await;
        drop(t);
        assert!(rx.try_recv().is_err());
    }
}
