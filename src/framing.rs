//! Request framing checks beyond what hyper's HTTP/1 parser refuses (RFC 9112 §6), so that
//! what tollgate forwards has one meaning: the one the upstream will read.
//!
//! hyper already answers `400` and closes for: bare CR, NUL and other control bytes, obs-fold,
//! whitespace before a field's colon, malformed request lines (double spaces, HTTP/0.9, other
//! versions), `Transfer-Encoding` on HTTP/1.0, a last transfer coding other than `chunked`,
//! invalid `Content-Length` values and two different ones (`431` for heads over the limit and
//! lengths of 2^64 − 1). It forwards a request with both `Content-Length` and
//! `Transfer-Encoding` by the transfer coding alone, without the `Content-Length`, and closes
//! the connection after answering (RFC 9112 §6.3's other permitted choice); the dropped field
//! cannot be seen here. What hyper lets through, and this module refuses, is below.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;

/// Why a request head was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadFraming {
    /// More than one `Transfer-Encoding` field: hyper reads only the last one.
    TransferEncodingRepeated,
    /// A `Transfer-Encoding` other than the single coding `chunked`: hyper would decode the
    /// chunked coding and drop the others (`gzip, chunked` would reach the upstream as
    /// plain gzip bytes, labelled as nothing).
    TransferCoding,
    /// Both `Content-Length` and `Transfer-Encoding` (HTTP/2 heads, or a future parser that
    /// keeps both).
    LengthAndCoding,
    /// `Content-Length` that is not one run of digits.
    ContentLength,
    /// `content_length` or `transfer_encoding`: an upstream that reads `_` as `-` (CGI, WSGI,
    /// some frameworks) would frame the body differently from us.
    LookalikeField,
    /// An HTTP/3 head that RFC 9114 calls malformed (see [`Malformed`]).
    Http3(&'static str),
}

/// What makes an HTTP/3 request's head malformed (RFC 9114 §4.1.2), found by the HTTP/3
/// server where `h3` lets it through (a repeated or misplaced pseudo-header, `:status`, a
/// connection-specific field, `DATA` on a `Content-Length: 0` request): carried in the head's
/// extensions, so that it is refused here, with `400`, like any bad head.
#[derive(Debug, Clone, Copy)]
pub struct Malformed(pub &'static str);

impl BadFraming {
    /// Why the request is refused, for the `400`'s detail.
    pub fn detail(self) -> &'static str {
        match self {
            BadFraming::TransferEncodingRepeated => "request framing refused: more than one Transfer-Encoding field",
            BadFraming::TransferCoding => "request framing refused: Transfer-Encoding must be exactly `chunked`",
            BadFraming::LengthAndCoding => "request framing refused: both Content-Length and Transfer-Encoding",
            BadFraming::ContentLength => "request framing refused: Content-Length must be one decimal number",
            BadFraming::LookalikeField => {
                "request framing refused: a field named like Content-Length or Transfer-Encoding with `_` for `-`"
            }
            BadFraming::Http3(why) => why,
        }
    }
}

impl From<BadFraming> for crate::answer::Error {
    /// Refused with `400`; the answer says `Connection: close`, so what the client sent as a
    /// body is never read as a next request.
    fn from(bad: BadFraming) -> Self {
        crate::answer::Error::BadRequest(bad.detail())
    }
}

/// Checks the framing fields of a request head, and rewrites a valid `Content-Length` with
/// leading zeros to its plain form (`005` → `5`: some parsers read a leading zero as octal).
///
/// # Errors
/// The first reason to refuse the request.
pub fn check(parts: &mut Parts) -> Result<(), BadFraming> {
    if parts.version == http::Version::HTTP_3 {
        if let Some(Malformed(why)) = parts.extensions.get::<Malformed>() {
            return Err(BadFraming::Http3(why));
        }
    }
    let headers = &mut parts.headers;
    // One pass over the fields instead of hashed lookups: this runs on every request (the
    // 429s too), and nearly all have no framing field or one plain Content-Length.
    let (mut codings, mut lengths, mut plain) = (0u32, 0u32, true);
    for (name, value) in headers.iter() {
        if name == header::TRANSFER_ENCODING {
            codings += 1;
            if !trim(value.as_bytes()).eq_ignore_ascii_case(b"chunked") {
                return Err(BadFraming::TransferCoding);
            }
        } else if name == header::CONTENT_LENGTH {
            lengths += 1;
            plain &= is_plain_number(value.as_bytes());
        } else if is_lookalike(name) {
            return Err(BadFraming::LookalikeField);
        }
    }
    match (codings, lengths) {
        (0, 0) | (0, 1) if plain => Ok(()),
        (0, _) => canonical_length(headers),
        (1, 0) => Ok(()),
        (1, _) => Err(BadFraming::LengthAndCoding),
        _ => Err(BadFraming::TransferEncodingRepeated),
    }
}

/// Digits without a leading zero (or `0`): the form forwarded as is.
fn is_plain_number(v: &[u8]) -> bool {
    !v.is_empty() && v.iter().all(u8::is_ascii_digit) && (v[0] != b'0' || v.len() == 1)
}

/// One `Content-Length` of digits only; leading zeros and padding removed in place.
fn canonical_length(headers: &mut HeaderMap) -> Result<(), BadFraming> {
    let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
    let Some(value) = values.next() else { return Ok(()) };
    // hyper folds equal repeats into one field; several here came another way (HTTP/2).
    if values.next().is_some() {
        return Err(BadFraming::ContentLength);
    }
    let digits = trim(value.as_bytes());
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(BadFraming::ContentLength);
    }
    let first = digits.iter().position(|&b| b != b'0').unwrap_or(digits.len() - 1);
    let canonical = HeaderValue::from_bytes(&digits[first..]).map_err(|_| BadFraming::ContentLength)?;
    headers.insert(header::CONTENT_LENGTH, canonical);
    Ok(())
}

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|b| !matches!(b, b' ' | b'\t')).unwrap_or(bytes.len());
    let end = bytes.iter().rposition(|b| !matches!(b, b' ' | b'\t')).map_or(start, |i| i + 1);
    &bytes[start..end]
}

/// `content_length` / `transfer_encoding` (names are lowercase in a `HeaderMap`).
fn is_lookalike(name: &HeaderName) -> bool {
    let name = name.as_str().as_bytes();
    let target: &[u8] = match name.len() {
        14 => b"content-length",
        17 => b"transfer-encoding",
        _ => return false,
    };
    name.contains(&b'_') && name.iter().zip(target).all(|(&a, &b)| a == b || (a == b'_' && b == b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(fields: &[(&str, &str)]) -> Parts {
        let mut req = http::Request::post("/a");
        for (n, v) in fields {
            req = req.header(*n, *v);
        }
        req.body(()).unwrap().into_parts().0
    }

    fn checked(fields: &[(&str, &str)]) -> Result<Parts, BadFraming> {
        let mut p = parts(fields);
        check(&mut p).map(|()| p)
    }

    #[test]
    fn plain_heads_pass_untouched() {
        for fields in [
            &[][..],
            &[("content-length", "5")],
            &[("content-length", "0")],
            &[("transfer-encoding", "chunked")],
            &[("transfer-encoding", "Chunked")],
            &[("x-content_length", "5"), ("content-lengths", "1"), ("host", "x")],
        ] {
            let p = checked(fields).unwrap_or_else(|e| panic!("{fields:?} refused: {e:?}"));
            assert_eq!(p.headers, parts(fields).headers);
        }
    }

    #[test]
    fn transfer_encoding_must_be_one_chunked() {
        assert_eq!(
            checked(&[("transfer-encoding", "chunked"), ("transfer-encoding", "chunked")]).err(),
            Some(BadFraming::TransferEncodingRepeated)
        );
        // The first field that is not `chunked` is the reason given.
        assert_eq!(
            checked(&[("transfer-encoding", "identity"), ("transfer-encoding", "chunked")]).err(),
            Some(BadFraming::TransferCoding)
        );
        for v in
            ["gzip, chunked", "chunked, chunked", "identity, chunked", "chunked;q=1", "xchunked", "\"chunked\"", ""]
        {
            assert_eq!(checked(&[("transfer-encoding", v)]).err(), Some(BadFraming::TransferCoding), "{v}");
        }
    }

    #[test]
    fn length_and_coding_together_are_refused() {
        let both = [("transfer-encoding", "chunked"), ("content-length", "5")];
        assert_eq!(checked(&both).err(), Some(BadFraming::LengthAndCoding));
    }

    #[test]
    fn content_length_is_one_run_of_digits() {
        for v in ["+5", "-5", "5 5", "5,5", "5, 5", "0x5", "5a", "", " "] {
            assert_eq!(checked(&[("content-length", v)]).err(), Some(BadFraming::ContentLength), "{v:?}");
        }
        assert_eq!(checked(&[("content-length", "5"), ("content-length", "5")]).err(), Some(BadFraming::ContentLength));
    }

    #[test]
    fn leading_zeros_are_written_away() {
        for (v, want) in [("005", "5"), ("00", "0"), ("0", "0"), ("010", "10"), (" 7 ", "7"), ("123", "123")] {
            let p = checked(&[("content-length", v)]).unwrap();
            assert_eq!(p.headers.get_all("content-length").iter().collect::<Vec<_>>(), [want], "{v:?}");
        }
    }

    #[test]
    fn underscore_lookalikes_are_refused() {
        for n in ["content_length", "transfer_encoding", "Content_Length", "transfer-encoding_x", "content_length2"] {
            let want = if n.len() == 14 || n.len() == 17 { Some(BadFraming::LookalikeField) } else { None };
            assert_eq!(checked(&[(n, "5")]).err(), want, "{n}");
        }
        assert!(!is_lookalike(&HeaderName::from_static("content_lengtx")));
        assert!(!is_lookalike(&HeaderName::from_static("content-length")));
        assert!(!is_lookalike(&HeaderName::from_static("content-_ength")));
        assert!(is_lookalike(&HeaderName::from_static("transfer_encoding")));
    }

    #[test]
    fn refusals_are_the_clients_400() {
        let e = crate::answer::Error::from(BadFraming::TransferCoding);
        assert_eq!(e.status(), http::StatusCode::BAD_REQUEST);
        assert_eq!(e.source(), crate::answer::Source::Downstream);
    }
}
