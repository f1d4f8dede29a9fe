//! What the forwarder reads of a gRPC call (PROTOCOL-HTTP2 of grpc/grpc): whether a request
//! is one, its `grpc-timeout`, and `te: trailers`. The answers tollgate makes to gRPC calls
//! itself are in the answer room.

use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName};

pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// `content-type: application/grpc` or `application/grpc+…` / `;…`.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.len() >= 16
            && v[..16].eq_ignore_ascii_case(b"application/grpc")
            && matches!(v.get(16), None | Some(b'+' | b';'))
    })
}

/// `TE` lists `trailers`.
pub fn te_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .any(|v| v.as_bytes().split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers")))
}

/// The call's `grpc-timeout` (1 to 8 digits and a unit: H, M, S, m, u, n), if valid.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get(GRPC_TIMEOUT)?.as_bytes();
    let (&unit, digits) = v.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with(name: &str, v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn grpc_content_types_are_recognised() {
        for ct in ["application/grpc", "application/grpc+proto", "Application/GRPC;charset=x"] {
            assert!(is_grpc(&with("content-type", ct)), "{ct}");
        }
        for ct in ["application/grpc-web", "application/json", "application/grp"] {
            assert!(!is_grpc(&with("content-type", ct)), "{ct}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn grpc_timeouts_parse_with_every_unit() {
        let t = |v| timeout(&with("grpc-timeout", v));
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        assert_eq!(t("3S"), Some(Duration::from_secs(3)));
        assert_eq!(t("250m"), Some(Duration::from_millis(250)));
        assert_eq!(t("7u"), Some(Duration::from_micros(7)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "S", "123456789S", "1x", "-1S", "1.5S"] {
            assert_eq!(t(bad), None, "{bad}");
        }
    }

    #[test]
    fn te_trailers_is_found_among_other_codings() {
        assert!(te_trailers(&with("te", "trailers")));
        assert!(te_trailers(&with("te", "gzip, Trailers")));
        assert!(!te_trailers(&with("te", "gzip")));
    }
}
