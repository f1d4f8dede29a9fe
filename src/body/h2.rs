//! The client's request body on its way into an HTTP/2 upstream's stream ([`Pump`]). It is
//! driven by whoever waits on the exchange: the request's future until the response head,
//! then the response body (`Body::h2`), so that no task is spawned per request.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use h2::{Reason, SendStream};
use http_body::Body as HttpBody;

use super::{ClientBodyError, RequestBody};

/// A client's body being sent on an upstream stream, as fast as the client sends it and the
/// upstream's flow-control windows allow.
pub struct Pump {
    body: RequestBody,
    send: SendStream<Bytes>,
    /// A chunk taken from the client that waits for window room, and whether it ends the body.
    held: Option<(Bytes, bool)>,
    /// Something was taken from the client: the request can no longer be sent again whole.
    touched: bool,
}

/// How a [`Pump`] stopped.
#[derive(Debug)]
pub enum Pumped {
    /// The whole body (and its trailers) went upstream.
    Done,
    /// The upstream no longer takes it (its stream was reset or closed): whatever the
    /// response says is what happened.
    Stopped,
    /// The client's body failed; the upstream's stream was reset.
    Client(ClientBodyError),
}

impl Pump {
    pub fn new(body: RequestBody, send: SendStream<Bytes>) -> Pump {
        Pump { body, send, held: None, touched: false }
    }

    /// Whether any of the body has been taken from the client.
    pub fn touched(&self) -> bool {
        self.touched
    }

    /// The client's body, untouched (a refused stream's request, sent again elsewhere).
    pub fn into_body(self) -> RequestBody {
        self.body
    }

    /// Sends what the client has sent so far, as far as the windows allow; ready once the
    /// pump has stopped for good.
    pub fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Pumped> {
        loop {
            // Woken by a reset too, while waiting for the client or for window room.
            if self.send.poll_reset(cx).is_ready() {
                return Poll::Ready(Pumped::Stopped);
            }
            if let Some((data, end)) = self.held.take() {
                if let Err(stopped) = self.send_held(data, end, cx) {
                    return stopped;
                }
                if end {
                    return Poll::Ready(Pumped::Done);
                }
                continue;
            }
            // The next frame is read before any window is reserved: a reservation with
            // nothing to send would pin connection-level capacity other streams need.
            let frame = match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                None => {
                    return Poll::Ready(match self.send.send_data(Bytes::new(), true) {
                        Ok(()) => Pumped::Done,
                        Err(_) => Pumped::Stopped,
                    })
                }
                Some(Err(e)) => {
                    self.send.send_reset(Reason::CANCEL);
                    return Poll::Ready(Pumped::Client(e));
                }
                Some(Ok(frame)) => frame,
            };
            self.touched = true;
            match frame.into_data() {
                Ok(data) => {
                    let end = self.body.is_end_stream();
                    if data.is_empty() {
                        if self.send.send_data(data, end).is_err() {
                            return Poll::Ready(Pumped::Stopped);
                        }
                        if end {
                            return Poll::Ready(Pumped::Done);
                        }
                        continue;
                    }
                    // A small claim: h2 raises it to the chunk's length once it holds the chunk.
                    self.send.reserve_capacity(1);
                    self.held = Some((data, end));
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        self.send.reserve_capacity(0);
                        return Poll::Ready(match self.send.send_trailers(trailers) {
                            Ok(()) => Pumped::Done,
                            Err(_) => Pumped::Stopped,
                        });
                    }
                }
            }
        }
    }

    /// Hands the held chunk to h2 once the stream has window room (h2 splits it into frames
    /// as the windows open). `Err`: the pump stopped, or waits (the chunk is held again).
    fn send_held(&mut self, data: Bytes, end: bool, cx: &mut Context<'_>) -> Result<(), Poll<Pumped>> {
        while self.send.capacity() == 0 {
            match self.send.poll_capacity(cx) {
                Poll::Pending => {
                    self.held = Some((data, end));
                    return Err(Poll::Pending);
                }
                Poll::Ready(Some(Ok(0))) => {}
                Poll::Ready(Some(Ok(_))) => break,
                Poll::Ready(Some(Err(_)) | None) => return Err(Poll::Ready(Pumped::Stopped)),
            }
        }
        self.send.send_data(data, end).map_err(|_| Poll::Ready(Pumped::Stopped))
    }
}
