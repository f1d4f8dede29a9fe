//! Answers encoded on their way back (gzip, brotli, zstd), chosen from the request's
//! `Accept-Encoding` and the route's `compression:`. Invariants: an answer is never encoded
//! twice, never buffered whole (each input frame goes out as soon as the encoder emits it,
//! a stream's at once), and an answer left as it is keeps every field it had.
//!
//! # API
//! - [`Compress::new`]`(config)`: a route's compiled `compression:`.
//! - [`Asked::new`]`(method, headers)`: what the answer side needs of the request (its
//!   `Accept-Encoding` parsed, [`Accepted`]; whether it is a `HEAD` or a `CONNECT`): small,
//!   `Copy`, taken on the request side and read on the answer side.
//! - [`Compress::decide`]`(&asked, origin, status, headers, length) -> Outcome`: the rules
//!   below, pure.
//! - [`Compress::apply`]`(&asked, origin, &mut resp) -> Outcome`: decides, edits the fields
//!   and wraps the body in the encoder ([`Encoded`]).
//!
//! # Rules
//! - Never encoded: tollgate's own answers (small, and the `429` path stays cheap), tunnels
//!   (`101`, a `CONNECT`'s `2xx`), `1xx`, `204`, `206`, an answer with a `Content-Encoding`
//!   other than `identity`, one with `Cache-Control: no-transform`, one whose `Content-Type`
//!   is missing or not in `types`. None of these gets a field changed.
//! - Then the answer depends on `Accept-Encoding`, so it gets `Vary: Accept-Encoding` (merged
//!   into the `Vary` it has; `Vary: *` stays), and is sent as it is when the request is a
//!   `HEAD`, the status is `304`, the client accepts none of the offered codings, or its
//!   length is known and below `min_size` (or zero) while the client still takes identity.
//! - Encoded: `Content-Encoding` set, `Content-Length` dropped (the length is the encoder's),
//!   a strong `ETag` made weak (`W/"…"`: the bytes changed, the resource did not),
//!   `Accept-Ranges` dropped (ranges of the encoded bytes are not served).
//! - Flushed: a `text/event-stream` answer after every frame of its upstream (an event is
//!   never held back); any answer whenever its upstream has nothing more ready (a slow
//!   answer's bytes do not wait for the next ones).

mod accept;
mod encoder;
mod stream;

use std::sync::Arc;

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body::Body as _;

pub use accept::{Accepted, Choice};
pub use stream::{Counters, Encoded};

use crate::body::Body;
use crate::config::compression::{Coding, CompressionConfig};

/// What the answer side needs of its request: taken when the request arrives (small, `Copy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Asked {
    pub accepted: Accepted,
    /// A `HEAD`: its answer says what the `GET` would be, unencoded.
    pub head: bool,
    /// A `CONNECT`: its `2xx` starts a tunnel.
    pub connect: bool,
}

impl Asked {
    pub fn new(method: &Method, headers: &HeaderMap) -> Asked {
        Asked {
            accepted: Accepted::parse(headers.get_all(header::ACCEPT_ENCODING)),
            head: method == Method::HEAD,
            connect: method == Method::CONNECT,
        }
    }
}

/// Where an answer comes from, as the answer side sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The upstream's (or the responder's, or a stale copy of an upstream's).
    Upstream,
    /// One tollgate made itself (a `429`, a problem answer).
    Own,
    /// A tunnel's (after `101`, or a `CONNECT`'s `2xx`).
    Tunnel,
}

/// What was done with an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Left as it was, not a field changed.
    Skip(Skip),
    /// Sent as it is, with `Vary: Accept-Encoding`.
    Identity(Plain),
    Encode(Coding),
}

/// Why an answer is none of compression's business.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    Own,
    Tunnel,
    /// `1xx`, `204`: no content.
    NoContent,
    /// `206`: a range of the unencoded bytes.
    Partial,
    /// A `Content-Encoding` already.
    Encoded,
    NoTransform,
    /// No `Content-Type`, or one not in `types`.
    Type,
}

/// Why an answer that could have been encoded was not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plain {
    Head,
    NotModified,
    /// The client accepts none of the offered codings.
    NotAccepted,
    /// Known to be shorter than `min_size`.
    Small,
}

/// A route's `compression:`, compiled.
pub struct Compress {
    config: Arc<CompressionConfig>,
    counters: Option<Counters>,
}

impl Compress {
    pub fn new(config: Arc<CompressionConfig>) -> Compress {
        Compress { config, counters: None }
    }

    /// Counts the bytes every encoded answer of the route takes and emits in `counters`.
    pub fn counted(mut self, counters: Counters) -> Compress {
        self.counters = Some(counters);
        self
    }

    /// The rules of the module docs. `length`: the answer's body length when known.
    pub fn decide(
        &self,
        asked: &Asked,
        origin: Origin,
        status: StatusCode,
        headers: &HeaderMap,
        length: Option<u64>,
    ) -> Outcome {
        match origin {
            Origin::Own => return Outcome::Skip(Skip::Own),
            Origin::Tunnel => return Outcome::Skip(Skip::Tunnel),
            Origin::Upstream => {}
        }
        if status == StatusCode::SWITCHING_PROTOCOLS || (asked.connect && status.is_success()) {
            return Outcome::Skip(Skip::Tunnel);
        }
        if status.is_informational() || status == StatusCode::NO_CONTENT {
            return Outcome::Skip(Skip::NoContent);
        }
        if status == StatusCode::PARTIAL_CONTENT {
            return Outcome::Skip(Skip::Partial);
        }
        if headers
            .get_all(header::CONTENT_ENCODING)
            .iter()
            .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))
        {
            return Outcome::Skip(Skip::Encoded);
        }
        if has_token(headers, &header::CACHE_CONTROL, b"no-transform") {
            return Outcome::Skip(Skip::NoTransform);
        }
        let typed = media_type(headers);
        if status == StatusCode::NOT_MODIFIED {
            // It carries the `Vary` its 200 would (RFC 9110 §15.4.5): unknown type included.
            return match typed {
                Some((kind, sub)) if !self.takes(kind, sub) => Outcome::Skip(Skip::Type),
                _ => Outcome::Identity(Plain::NotModified),
            };
        }
        match typed {
            Some((kind, sub)) if self.takes(kind, sub) => {}
            _ => return Outcome::Skip(Skip::Type),
        }
        if asked.head {
            return Outcome::Identity(Plain::Head);
        }
        let accepted = &asked.accepted;
        let coding = match accepted.choose(&self.config.encodings) {
            Choice::Encode(c) => c,
            Choice::Identity => return Outcome::Identity(Plain::NotAccepted),
        };
        if length.is_some_and(|n| n == 0 || n < self.config.min_size) && !accepted.refuses_identity() {
            return Outcome::Identity(Plain::Small);
        }
        Outcome::Encode(coding)
    }

    /// Decides for `resp` and applies the outcome: fields edited, the body wrapped in the
    /// encoder when it is encoded.
    pub fn apply(&self, asked: &Asked, origin: Origin, resp: &mut Response<Body>) -> Outcome {
        let exact = resp.body().size_hint().exact();
        let length = exact.or_else(|| content_length(resp.headers()));
        let outcome = self.decide(asked, origin, resp.status(), resp.headers(), length);
        let coding = match outcome {
            Outcome::Skip(_) => return outcome,
            Outcome::Identity(_) => {
                add_vary(resp.headers_mut());
                return outcome;
            }
            Outcome::Encode(c) => c,
        };
        let stream = media_type(resp.headers())
            .is_some_and(|(k, s)| k.eq_ignore_ascii_case("text") && s.eq_ignore_ascii_case("event-stream"));
        let body = std::mem::replace(resp.body_mut(), Body::empty());
        match Encoded::new(body, coding, self.config.levels.of(coding), exact, stream) {
            Ok(encoded) => {
                *resp.body_mut() = match &self.counters {
                    Some(c) => Body::boxed(encoded.counted(c.clone())),
                    None => Body::boxed(encoded),
                };
                encoded_fields(resp.headers_mut(), coding);
                outcome
            }
            Err((body, e)) => {
                // An encoder that cannot be made (zstd's C code out of memory): the answer goes
                // as it is.
                tracing::warn!("compression: {} encoder not made: {e}", coding.token());
                *resp.body_mut() = body;
                add_vary(resp.headers_mut());
                Outcome::Identity(Plain::NotAccepted)
            }
        }
    }

    fn takes(&self, kind: &str, sub: &str) -> bool {
        self.config.types.iter().any(|r| r.matches(kind, sub))
    }
}

/// The length an answer announces.
fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// The fields of an encoded answer.
fn encoded_fields(headers: &mut HeaderMap, coding: Coding) {
    headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding.token()));
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::ACCEPT_RANGES);
    add_vary(headers);
    if let Some(etag) = headers.get(header::ETAG) {
        if etag.as_bytes().first() == Some(&b'"') {
            let mut weak = Vec::with_capacity(etag.len() + 2);
            weak.extend_from_slice(b"W/");
            weak.extend_from_slice(etag.as_bytes());
            if let Ok(v) = HeaderValue::from_bytes(&weak) {
                headers.insert(header::ETAG, v);
            }
        }
    }
}

/// Adds `Accept-Encoding` to `Vary` unless it is there already, or `Vary` is `*`.
fn add_vary(headers: &mut HeaderMap) {
    let present = headers.get_all(header::VARY).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .map(<[u8]>::trim_ascii)
            .any(|n| n == b"*" || n.eq_ignore_ascii_case(b"accept-encoding"))
    });
    if !present {
        headers.append(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    }
}

/// Whether a list field (`Cache-Control`) names `token` (directives ignore case and arguments).
fn has_token(headers: &HeaderMap, name: &header::HeaderName, token: &[u8]) -> bool {
    headers.get_all(name).iter().any(|v| {
        v.as_bytes().split(|&b| b == b',').any(|d| {
            let d = d.trim_ascii();
            let name = d.split(|&b| b == b'=').next().unwrap_or_default().trim_ascii();
            name.eq_ignore_ascii_case(token)
        })
    })
}

/// The answer's media type as written (compared ignoring case): `("text", "html")`.
fn media_type(headers: &HeaderMap) -> Option<(&str, &str)> {
    let v = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let essence = v.split(';').next()?.trim();
    let (kind, sub) = essence.split_once('/')?;
    (!kind.is_empty() && !sub.is_empty()).then_some((kind, sub))
}

#[cfg(test)]
mod tests;
