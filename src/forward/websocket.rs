//! A WebSocket tunnel whose messages are checked (a route's `message_limits`): the bytes are
//! copied as in a plain tunnel, while the frames (RFC 6455 §5.2) are followed as they pass:
//! only each frame's header is read, never its payload, and nothing is buffered beyond one
//! read. A data message is counted once, at its first frame (opcode text or binary; its
//! continuation frames are the same message); control frames (close, ping, pong) pass
//! uncounted. The message is held at its first frame's header while its decision is made
//! (and while it waits, with `action: delay`), so the client is slowed by its own socket.
//!
//! A stream over a limit is ended at a frame boundary each way: a close frame with 1008
//! (policy violation) and a reason naming the limit goes to the client, a masked one to the
//! upstream, then both connections are shut. A message over `max_message_size` gets 1009
//! (message too big) instead.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::body::watch::{Deciding, Refusal, Verdict, Watch};
use crate::metrics::TunnelMetrics;

const BUF: usize = 16 << 10;

/// Policy violation (RFC 6455 §7.4.1).
pub const CLOSE_POLICY: u16 = 1008;
/// Message too big.
pub const CLOSE_TOO_BIG: u16 = 1009;

/// A frame header as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub fin: bool,
    pub opcode: u8,
    /// Payload length.
    pub len: u64,
    /// Header length (2 to 14 bytes).
    pub size: usize,
}

/// The header at the start of `b`, or `None` when `b` holds only part of one.
pub fn header(b: &[u8]) -> Option<Header> {
    let (&b0, rest) = b.split_first()?;
    let &b1 = rest.first()?;
    let masked = b1 & 0x80 != 0;
    let (len, ext) = match b1 & 0x7f {
        126 => (u64::from(u16::from_be_bytes(b.get(2..4)?.try_into().ok()?)), 2),
        127 => (u64::from_be_bytes(b.get(2..10)?.try_into().ok()?), 8),
        n => (u64::from(n), 0),
    };
    let size = 2 + ext + if masked { 4 } else { 0 };
    if b.len() < size {
        return None;
    }
    Some(Header { fin: b0 & 0x80 != 0, opcode: b0 & 0x0f, len, size })
}

/// A close frame with `code` and `reason` (cut to fit a control frame's 125 bytes at a
/// character boundary); masked, as a client's frames are, when `mask` is given.
pub fn close_frame(code: u16, reason: &str, mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut end = reason.len().min(123);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut payload = code.to_be_bytes().to_vec();
    payload.extend_from_slice(&reason.as_bytes()[..end]);
    let mut out = vec![0x88];
    // At most 125: the length fits the first form.
    let len = payload.len() as u8;
    match mask {
        None => {
            out.push(len);
            out.extend_from_slice(&payload);
        }
        Some(key) => {
            out.push(0x80 | len);
            out.extend_from_slice(&key);
            out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
        }
    }
    out
}

/// Why one direction stopped.
#[derive(Debug)]
enum Stop {
    /// Its reading side ended.
    Ended,
    /// A message was refused; the direction is at a frame boundary.
    Refused(Refusal),
    /// Asked to stop at a frame boundary, it is at one.
    Boundary,
}

/// A message held at its first frame's header.
enum Hold {
    Deciding { decision: Deciding, waited: Duration, header: Header },
    Waiting { sleep: Pin<Box<tokio::time::Sleep>>, after: Duration, again: bool, waited: Duration, header: Header },
}

/// One direction of a checked tunnel.
struct Framed {
    buf: Box<[u8]>,
    start: usize,
    /// Bytes before this may be written: whole headers and payload.
    clear: usize,
    end: usize,
    /// Payload bytes of the current frame not yet cleared.
    payload_left: u64,
    /// The current data message's length so far.
    message_len: u64,
    /// Towards the upstream.
    up: bool,
    /// Its messages are counted.
    counts: bool,
    hold: Option<Hold>,
    refused: Option<Refusal>,
    /// Stop at the next frame boundary (the other direction refused).
    stopping: bool,
    dirty: bool,
    bytes: Counter,
}

impl Framed {
    fn new(up: bool, counts: bool, bytes: Counter) -> Framed {
        Framed {
            buf: vec![0; BUF].into_boxed_slice(),
            start: 0,
            clear: 0,
            end: 0,
            payload_left: 0,
            message_len: 0,
            up,
            counts,
            hold: None,
            refused: None,
            stopping: false,
            dirty: false,
            bytes,
        }
    }

    /// Clears what can be cleared of what was read: payload, and headers that need no
    /// decision; a counted message's first header starts a decision and stops the scan.
    fn scan(&mut self, watch: &dyn Watch) {
        while self.clear < self.end && self.hold.is_none() && self.refused.is_none() {
            if self.payload_left > 0 {
                let n = self.payload_left.min((self.end - self.clear) as u64);
                self.clear += n as usize;
                self.payload_left -= n;
                continue;
            }
            if self.stopping {
                return;
            }
            let Some(h) = header(&self.buf[self.clear..self.end]) else { return };
            match h.opcode {
                1 | 2 if self.counts => {
                    self.message_len = h.len;
                    self.hold = Some(Hold::Deciding {
                        decision: watch.message(self.up, h.len, Duration::ZERO),
                        waited: Duration::ZERO,
                        header: h,
                    });
                    return;
                }
                0 if self.counts => {
                    self.message_len = self.message_len.saturating_add(h.len);
                    if self.message_len > watch.max_message_size() {
                        self.refused = Some(watch.too_large(self.message_len));
                        return;
                    }
                }
                _ => {}
            }
            self.clear += h.size;
            self.payload_left = h.len;
        }
    }

    /// At a frame boundary with nothing cleared left to write.
    fn at_boundary(&self) -> bool {
        self.start == self.clear && self.payload_left == 0
    }

    /// Moves bytes from `from` to `to` until neither can go on.
    fn poll<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        from: &mut R,
        to: &mut W,
        watch: &dyn Watch,
        moved: &mut bool,
    ) -> Poll<io::Result<Stop>>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        loop {
            while self.start < self.clear {
                let n = ready!(Pin::new(&mut *to).poll_write(cx, &self.buf[self.start..self.clear]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                self.start += n;
                self.dirty = true;
                self.bytes.inc_by(n as u64);
                *moved = true;
            }
            if self.stopping && self.at_boundary() {
                self.hold = None;
                ready!(self.flush(cx, to))?;
                return Poll::Ready(Ok(Stop::Boundary));
            }
            if let Some(r) = self.refused.take() {
                ready!(self.flush(cx, to))?;
                return Poll::Ready(Ok(Stop::Refused(r)));
            }
            if let Some(hold) = &mut self.hold {
                let verdict = match hold {
                    Hold::Deciding { decision, .. } => match decision.as_mut().poll(cx) {
                        Poll::Ready(v) => v,
                        Poll::Pending => return self.pending(cx, to),
                    },
                    Hold::Waiting { sleep, .. } => {
                        if sleep.as_mut().poll(cx).is_pending() {
                            return self.pending(cx, to);
                        }
                        // The wait is over.
                        Verdict::Pass { after: Duration::ZERO }
                    }
                };
                self.decided(verdict, watch);
                continue;
            }
            let before = self.clear;
            self.scan(watch);
            if self.clear != before || self.hold.is_some() || self.refused.is_some() {
                continue;
            }
            // Everything cleared is written: keep a partial header, read more after it.
            if self.clear < self.end {
                self.buf.copy_within(self.clear..self.end, 0);
            }
            self.end -= self.clear;
            (self.start, self.clear) = (0, 0);
            let mut read = ReadBuf::new(&mut self.buf[self.end..]);
            match Pin::new(&mut *from).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) => {
                    let n = read.filled().len();
                    if n == 0 {
                        ready!(Pin::new(&mut *to).poll_flush(cx))?;
                        return Poll::Ready(Ok(Stop::Ended));
                    }
                    self.end += n;
                    *moved = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return self.pending(cx, to),
            }
        }
    }

    /// What a decision (or the end of a wait) does to the held message.
    fn decided(&mut self, verdict: Verdict, watch: &dyn Watch) {
        let Some(hold) = self.hold.take() else { return };
        let (waited, header, again_done) = match hold {
            Hold::Deciding { waited, header, .. } => (waited, header, None),
            Hold::Waiting { after, again, waited, header, .. } => (waited + after, header, Some(again)),
        };
        let verdict = match again_done {
            // A wait for a later decision is over: ask again.
            Some(true) => {
                self.hold =
                    Some(Hold::Deciding { decision: watch.message(self.up, header.len, waited), waited, header });
                return;
            }
            // A shaping wait is over: the message passes.
            Some(false) => Verdict::Pass { after: Duration::ZERO },
            None => verdict,
        };
        match verdict {
            Verdict::Pass { after } if after.is_zero() => {
                self.clear += header.size;
                self.payload_left = header.len;
            }
            Verdict::Pass { after } => self.wait(after, false, waited, header),
            Verdict::Again { after } => self.wait(after, true, waited, header),
            Verdict::Refuse(r) => self.refused = Some(r),
        }
    }

    fn wait(&mut self, after: Duration, again: bool, waited: Duration, header: Header) {
        let sleep = Box::pin(tokio::time::sleep(after));
        self.hold = Some(Hold::Waiting { sleep, after, again, waited, header });
    }

    fn flush<W: AsyncWrite + Unpin>(&mut self, cx: &mut Context<'_>, to: &mut W) -> Poll<io::Result<()>> {
        if self.dirty {
            ready!(Pin::new(&mut *to).poll_flush(cx))?;
            self.dirty = false;
        }
        Poll::Ready(Ok(()))
    }

    fn pending<W: AsyncWrite + Unpin>(&mut self, cx: &mut Context<'_>, to: &mut W) -> Poll<io::Result<Stop>> {
        ready!(self.flush(cx, to))?;
        Poll::Pending
    }
}

/// A checked tunnel: copies both ways as [`super::tunnel`]'s plain one does, following the
/// frames; ends as it does, or when a message is refused (see the module's words). Tells
/// `watch` why it ended.
pub(super) async fn run(
    client: Upgraded,
    upstream: Upgraded,
    idle: Duration,
    metrics: &TunnelMetrics,
    watch: Arc<dyn Watch>,
) -> &'static str {
    let mut client = TokioIo::new(client);
    let mut upstream = TokioIo::new(upstream);
    let mut up = Framed::new(true, watch.counts(true), metrics.bytes_up.clone());
    let mut down = Framed::new(false, watch.counts(false), metrics.bytes_down.clone());
    let mut last = Instant::now();
    let sleep = tokio::time::sleep(idle);
    tokio::pin!(sleep);
    let w = &*watch;
    let ended: Result<(bool, Refusal), &'static str> = poll_fn(|cx| {
        let mut moved = false;
        match up.poll(cx, &mut client, &mut upstream, w, &mut moved) {
            Poll::Ready(Ok(Stop::Refused(r))) => return Poll::Ready(Ok((true, r))),
            Poll::Ready(Ok(_)) => return Poll::Ready(Err("the client closed")),
            Poll::Ready(Err(_)) => return Poll::Ready(Err("the client side failed")),
            Poll::Pending => {}
        }
        match down.poll(cx, &mut upstream, &mut client, w, &mut moved) {
            Poll::Ready(Ok(Stop::Refused(r))) => return Poll::Ready(Ok((false, r))),
            Poll::Ready(Ok(_)) => return Poll::Ready(Err("the upstream closed")),
            Poll::Ready(Err(_)) => return Poll::Ready(Err("the upstream side failed")),
            Poll::Pending => {}
        }
        if moved {
            last = Instant::now();
        }
        while sleep.as_mut().poll(cx).is_ready() {
            let due = last + idle;
            if due <= Instant::now() {
                return Poll::Ready(Err("idle timeout"));
            }
            sleep.as_mut().reset(due.into());
        }
        Poll::Pending
    })
    .await;
    let refused = ended.is_ok();
    let end = match ended {
        Err(end) => end,
        Ok((refused_up, refusal)) => {
            let code = if refusal.too_large { CLOSE_TOO_BIG } else { CLOSE_POLICY };
            let mask = mask_key();
            // The refused side is at a boundary; the other one is brought to its next one
            // (its current frame finished, no new one started), bounded in time.
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                let (other, from, to): (&mut Framed, &mut TokioIo<Upgraded>, &mut TokioIo<Upgraded>) = if refused_up {
                    (&mut down, &mut upstream, &mut client)
                } else {
                    (&mut up, &mut client, &mut upstream)
                };
                other.stopping = true;
                let mut moved = false;
                let _ = poll_fn(|cx| other.poll(cx, from, to, w, &mut moved)).await;
                let _ = upstream.write_all(&close_frame(code, &refusal.reason, Some(mask))).await;
                let _ = upstream.flush().await;
                let _ = client.write_all(&close_frame(code, &refusal.reason, None)).await;
                let _ = client.flush().await;
            })
            .await;
            if refusal.too_large {
                "a message over max_message_size"
            } else {
                "a message over a message limit"
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = client.shutdown().await;
        let _ = upstream.shutdown().await;
    })
    .await;
    if refused {
        // A lingering close: what the client sent after the refused message is read and
        // dropped until it closes too (bounded), so that its unread bytes do not turn our
        // close into a reset that could take the close frame with it.
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            let mut sink = [0u8; 4096];
            while matches!(tokio::io::AsyncReadExt::read(&mut client, &mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    }
    watch.ended(end);
    end
}

/// A close frame's mask key (RFC 6455 §5.3: unpredictable).
fn mask_key() -> [u8; 4] {
    let mut key = [0u8; 4];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key).is_err() {
        key = [0x5a, 0xa5, 0x3c, 0xc3];
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_read_in_every_length_form() {
        assert_eq!(header(&[0x81]), None);
        assert_eq!(header(&[0x81, 0x05]), Some(Header { fin: true, opcode: 1, len: 5, size: 2 }));
        assert_eq!(header(&[0x02, 0x85, 1, 2, 3]), None, "a mask key is part of the header");
        assert_eq!(header(&[0x02, 0x85, 1, 2, 3, 4]), Some(Header { fin: false, opcode: 2, len: 5, size: 6 }));
        assert_eq!(header(&[0x82, 126, 0x01]), None);
        assert_eq!(header(&[0x82, 126, 0x01, 0x00]), Some(Header { fin: true, opcode: 2, len: 256, size: 4 }));
        let long = [0x82, 0xff, 0, 0, 0, 0, 0, 0xa0, 0, 0, 9, 9, 9, 9];
        assert_eq!(header(&long[..13]), None);
        assert_eq!(header(&long), Some(Header { fin: true, opcode: 2, len: 10 << 20, size: 14 }));
    }

    #[test]
    fn close_frames_fit_a_control_frame_and_are_masked_towards_the_upstream() {
        let f = close_frame(1008, &"é".repeat(100), None);
        assert_eq!(&f[..4], &[0x88, 124, 0x03, 0xf0]);
        assert!(f.len() <= 127);
        assert!(std::str::from_utf8(&f[4..]).is_ok(), "cut at a character boundary");
        let m = close_frame(1008, "x", Some([1, 2, 3, 4]));
        assert_eq!(m, vec![0x88, 0x83, 1, 2, 3, 4, 0x03 ^ 1, 0xf0 ^ 2, b'x' ^ 3]);
    }
}
