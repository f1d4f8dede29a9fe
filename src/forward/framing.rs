//! Response framing checks on an upstream's answer head (RFC 9112 §6.3, RFC 9110 §8.6 and
//! §15.2), so that the framing tollgate forwards describes the body it sends.
//!
//! hyper's client already fails the exchange (a `502` here) for a malformed status line or
//! field, obs-fold, two different `Content-Length` values, `Transfer-Encoding` on HTTP/1.0
//! and a head over its buffer; it reads and drops `1xx` interim answers other than `101`.
//! It decodes `chunked` when `Transfer-Encoding` ends with it, but leaves every field in the
//! head: a `Content-Length` beside it, or `5, 5`, would go on to the client as they came.

use http::header::{self, HeaderMap, HeaderValue};
use http::StatusCode;

/// Why an upstream's answer is refused (the client gets `502`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadResponse {
    /// `101 Switching Protocols`: tollgate never forwards `Upgrade`, so nobody asked for it.
    UnrequestedUpgrade,
    /// A status code outside 100–599 (RFC 9110 §15: not HTTP).
    Status,
    /// `Content-Length` values that are not digits or do not agree.
    ContentLength,
    /// A transfer coding other than `chunked`: its body would reach the client still coded,
    /// with nothing saying so once the hop-by-hop `Transfer-Encoding` is removed.
    TransferCoding,
}

impl BadResponse {
    /// Why the answer is refused, for the `502`'s detail.
    pub fn detail(self) -> &'static str {
        match self {
            BadResponse::UnrequestedUpgrade => "a 101 Switching Protocols nobody asked for",
            BadResponse::Status => "a status code outside 100-599",
            BadResponse::ContentLength => "Content-Length values that are invalid or disagree",
            BadResponse::TransferCoding => "a Transfer-Encoding other than chunked",
        }
    }
}

impl From<BadResponse> for crate::answer::Error {
    /// A `502` from the upstream's side (a stale copy may answer instead).
    fn from(bad: BadResponse) -> Self {
        crate::answer::Error::Upstream(crate::answer::UpstreamFailure::BadResponse(bad.detail()))
    }
}

/// Whether the upstream connection may carry another request after this answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    Yes,
    /// The head needed repair: an upstream that frames sloppily is not trusted with the
    /// next request (whatever it meant, the bytes after this body are suspect).
    No,
}

/// Checks an upstream answer's status and fields and repairs its framing fields in place:
/// `Content-Length` is dropped when a transfer coding framed the body (RFC 9112 §6.3), and
/// identical values (`5, 5`, or two fields) are folded to one (RFC 9110 §8.6).
///
/// # Errors
/// The first reason to refuse the answer with `502`.
pub fn check_response(status: StatusCode, headers: &mut HeaderMap) -> Result<Reuse, BadResponse> {
    let status = status.as_u16();
    if status == 101 {
        return Err(BadResponse::UnrequestedUpgrade);
    }
    if !(100..600).contains(&status) {
        return Err(BadResponse::Status);
    }
    // One pass over the fields instead of hashed lookups: every answer comes through here,
    // and nearly all carry one plain Content-Length or `chunked` alone.
    let (mut coded, mut lengths, mut plain) = (false, 0u32, true);
    for (name, value) in headers.iter() {
        if name == header::TRANSFER_ENCODING {
            coded = true;
        } else if name == header::CONTENT_LENGTH {
            lengths += 1;
            plain &= is_plain_number(value.as_bytes());
        }
    }
    if coded {
        if !only_chunked(headers) {
            return Err(BadResponse::TransferCoding);
        }
        if lengths == 0 {
            return Ok(Reuse::Yes);
        }
        headers.remove(header::CONTENT_LENGTH);
        return Ok(Reuse::No);
    }
    if lengths == 0 || (lengths == 1 && plain) {
        return Ok(Reuse::Yes);
    }
    fold_lengths(headers)
}

/// Every `Transfer-Encoding` field together names the one coding `chunked`.
fn only_chunked(headers: &HeaderMap) -> bool {
    let mut codings =
        headers.get_all(header::TRANSFER_ENCODING).iter().flat_map(|v| v.as_bytes().split(|&b| b == b','));
    let first = codings.next().map(trim);
    first.is_some_and(|c| c.eq_ignore_ascii_case(b"chunked")) && codings.next().is_none()
}

/// The `Content-Length` fields folded into one plain number, or `BadResponse`.
fn fold_lengths(headers: &mut HeaderMap) -> Result<Reuse, BadResponse> {
    let mut agreed: Option<u64> = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for item in value.as_bytes().split(|&b| b == b',') {
            let n = parse_digits(trim(item)).ok_or(BadResponse::ContentLength)?;
            if agreed.is_some_and(|a| a != n) {
                return Err(BadResponse::ContentLength);
            }
            agreed = Some(n);
        }
    }
    let n = agreed.ok_or(BadResponse::ContentLength)?;
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    Ok(Reuse::No)
}

/// Digits without a leading zero (or `0`): the only form forwarded as is.
fn is_plain_number(v: &[u8]) -> bool {
    !v.is_empty() && v.iter().all(u8::is_ascii_digit) && (v[0] != b'0' || v.len() == 1)
}

fn parse_digits(v: &[u8]) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.iter().try_fold(
        0u64,
        |n, &b| if b.is_ascii_digit() { n.checked_mul(10)?.checked_add(u64::from(b - b'0')) } else { None },
    )
}

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|b| !matches!(b, b' ' | b'\t')).unwrap_or(bytes.len());
    let end = bytes.iter().rposition(|b| !matches!(b, b' ' | b'\t')).map_or(start, |i| i + 1);
    &bytes[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(status: u16, fields: &[(&str, &str)]) -> http::response::Parts {
        let mut resp = http::Response::builder().status(status);
        for (n, v) in fields {
            resp = resp.header(*n, *v);
        }
        resp.body(()).unwrap().into_parts().0
    }

    fn lengths(p: &http::response::Parts) -> Vec<&str> {
        p.headers.get_all("content-length").iter().map(|v| v.to_str().unwrap()).collect()
    }

    fn check_response(p: &mut http::response::Parts) -> Result<Reuse, BadResponse> {
        super::check_response(p.status, &mut p.headers)
    }

    #[test]
    fn plain_answers_pass_untouched() {
        for fields in
            [&[][..], &[("content-length", "5")], &[("content-length", "0")], &[("transfer-encoding", "chunked")]]
        {
            let mut p = parts(200, fields);
            assert_eq!(check_response(&mut p), Ok(Reuse::Yes), "{fields:?}");
            assert_eq!(p.headers, parts(200, fields).headers);
        }
        let mut p = parts(304, &[("content-length", "12")]);
        assert_eq!(check_response(&mut p), Ok(Reuse::Yes));
    }

    #[test]
    fn content_length_beside_chunked_is_dropped() {
        let mut p = parts(200, &[("content-length", "3"), ("transfer-encoding", "chunked"), ("content-length", "3")]);
        assert_eq!(check_response(&mut p), Ok(Reuse::No));
        assert!(lengths(&p).is_empty(), "{p:?}");
        assert_eq!(p.headers["transfer-encoding"], "chunked");
        let mut p = parts(200, &[("transfer-encoding", "Chunked"), ("content-length", "x")]);
        assert_eq!(check_response(&mut p), Ok(Reuse::No));
    }

    #[test]
    fn other_transfer_codings_are_refused() {
        for te in [&["gzip"][..], &["gzip, chunked"], &["chunked, chunked"], &["gzip", "chunked"], &["identity"], &[""]]
        {
            let fields: Vec<(&str, &str)> = te.iter().map(|v| ("transfer-encoding", *v)).collect();
            assert_eq!(check_response(&mut parts(200, &fields)), Err(BadResponse::TransferCoding), "{te:?}");
        }
    }

    #[test]
    fn equal_lengths_fold_to_one() {
        for fields in [
            &[("content-length", "5, 5")][..],
            &[("content-length", "5"), ("content-length", "5")],
            &[("content-length", "5,5"), ("content-length", " 5 ")],
            &[("content-length", "005")],
        ] {
            let mut p = parts(200, fields);
            assert_eq!(check_response(&mut p), Ok(Reuse::No), "{fields:?}");
            assert_eq!(lengths(&p), ["5"], "{fields:?}");
        }
    }

    #[test]
    fn disagreeing_or_invalid_lengths_are_refused() {
        for fields in [
            &[("content-length", "5, 6")][..],
            &[("content-length", "5"), ("content-length", "6")],
            &[("content-length", "+5"), ("content-length", "5")],
            &[("content-length", "5,")],
            &[("content-length", "99999999999999999999"), ("content-length", "1")],
        ] {
            assert_eq!(check_response(&mut parts(200, fields)), Err(BadResponse::ContentLength), "{fields:?}");
        }
    }

    #[test]
    fn unrequested_upgrades_and_non_http_statuses_are_refused() {
        assert_eq!(check_response(&mut parts(101, &[("upgrade", "websocket")])), Err(BadResponse::UnrequestedUpgrade));
        assert_eq!(check_response(&mut parts(600, &[])), Err(BadResponse::Status));
        assert_eq!(check_response(&mut parts(999, &[])), Err(BadResponse::Status));
        let e = crate::answer::Error::from(BadResponse::Status);
        assert_eq!(e.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(e.source(), crate::answer::Source::Upstream);
    }
}
