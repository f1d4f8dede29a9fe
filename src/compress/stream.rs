//! [`Encoded`]: a body encoded as it streams. Each frame of the inner body is encoded when it
//! arrives; what the encoder emits goes out at once. Nothing waits for the end of the answer:
//! a stream (SSE) is flushed after every frame, any answer whenever its inner body has
//! nothing ready. A large frame is encoded a slice at a time, so one answer never holds its
//! worker for long.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body as HttpBody, Frame, SizeHint};
use pin_project_lite::pin_project;
use prometheus_client::metrics::counter::Counter;

use super::encoder::Encoder;
use crate::body::BodyError;
use crate::config::compression::Coding;

/// Input encoded per call of the encoder.
const SLICE: usize = 64 << 10;
/// Input one poll encodes without emitting anything before it lets the worker go (and asks
/// to be polled again): brotli may take megabytes before it emits its first block.
const BUDGET: usize = 256 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reading,
    /// The inner body ended with trailers; they go out after the encoder's last bytes.
    Trailers,
    Done,
}

pin_project! {
    /// `inner` encoded with one coding.
    pub struct Encoded<B> {
        #[pin]
        inner: B,
        encoder: Encoder,
        // What is left of the inner body's last data frame.
        input: Bytes,
        // Output not yet handed on.
        out: Vec<u8>,
        // Flush after every frame of the inner body (a stream of events).
        per_frame: bool,
        // Input given to the encoder since its last flush.
        unflushed: bool,
        trailers: Option<HeaderMap>,
        state: State,
        // The route's counters of bytes in and out, added to as the body goes.
        counters: Option<Counters>,
    }
}

/// A route's counts of the bytes its encoders took and emitted.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub bytes_in: Counter,
    pub bytes_out: Counter,
}

impl<B: HttpBody<Data = Bytes, Error = BodyError>> Encoded<B> {
    /// `inner` encoded with `coding` at `level`; `length`: its exact length when known; `per_frame`:
    /// flush after every frame. Gives `inner` back if the encoder cannot be made.
    pub fn new(
        inner: B,
        coding: Coding,
        level: i32,
        length: Option<u64>,
        per_frame: bool,
    ) -> Result<Encoded<B>, (B, io::Error)> {
        let encoder = match Encoder::new(coding, level, length) {
            Ok(e) => e,
            Err(e) => return Err((inner, e)),
        };
        Ok(Encoded {
            inner,
            encoder,
            input: Bytes::new(),
            out: Vec::new(),
            per_frame,
            unflushed: false,
            trailers: None,
            state: State::Reading,
            counters: None,
        })
    }

    /// Adds the bytes taken and emitted to `counters` as the body goes.
    pub fn counted(mut self, counters: Counters) -> Encoded<B> {
        self.counters = Some(counters);
        self
    }
}

type Polled = Poll<Option<Result<Frame<Bytes>, BodyError>>>;

fn emit(out: &mut Vec<u8>, counters: &Option<Counters>) -> Polled {
    if let Some(c) = counters {
        c.bytes_out.inc_by(out.len() as u64);
    }
    Poll::Ready(Some(Ok(Frame::data(Bytes::from(std::mem::take(out))))))
}

impl<B: HttpBody<Data = Bytes, Error = BodyError>> HttpBody for Encoded<B> {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let mut this = self.project();
        let mut spent = 0;
        loop {
            if !this.input.is_empty() {
                let slice = this.input.split_to(this.input.len().min(SLICE));
                spent += slice.len();
                if let Some(c) = this.counters {
                    c.bytes_in.inc_by(slice.len() as u64);
                }
                let mut done = this.encoder.encode(&slice, this.out);
                *this.unflushed = true;
                if this.input.is_empty() && *this.per_frame && done.is_ok() {
                    done = this.encoder.flush(this.out);
                    *this.unflushed = false;
                }
                if let Err(e) = done {
                    *this.state = State::Done;
                    this.out.clear();
                    return Poll::Ready(Some(Err(BodyError::Encode(e))));
                }
                if !this.out.is_empty() {
                    return emit(this.out, this.counters);
                }
                if spent >= BUDGET {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                continue;
            }
            match *this.state {
                State::Reading => {}
                State::Trailers => {
                    *this.state = State::Done;
                    return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
                }
                State::Done => return Poll::Ready(None),
            }
            let polled = if this.inner.is_end_stream() {
                // hyper may never poll a body that says it has ended: the encoder's end is ours.
                Poll::Ready(None)
            } else {
                this.inner.as_mut().poll_frame(cx)
            };
            let end = match polled {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        *this.input = data;
                        continue;
                    }
                    Err(frame) => match frame.into_trailers() {
                        Ok(trailers) => {
                            *this.trailers = Some(trailers);
                            State::Trailers
                        }
                        // A frame kind http-body may add later: nothing to encode.
                        Err(_) => continue,
                    },
                },
                Poll::Ready(Some(Err(e))) => {
                    *this.state = State::Done;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => State::Done,
                Poll::Pending => {
                    if *this.unflushed {
                        *this.unflushed = false;
                        if let Err(e) = this.encoder.flush(this.out) {
                            *this.state = State::Done;
                            return Poll::Ready(Some(Err(BodyError::Encode(e))));
                        }
                        if !this.out.is_empty() {
                            return emit(this.out, this.counters);
                        }
                    }
                    return Poll::Pending;
                }
            };
            *this.state = end;
            if let Err(e) = this.encoder.finish(this.out) {
                *this.state = State::Done;
                return Poll::Ready(Some(Err(BodyError::Encode(e))));
            }
            if !this.out.is_empty() {
                return emit(this.out, this.counters);
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state == State::Done && self.input.is_empty() && self.out.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
