//! The request id, made once where a request enters and read by every answer, log line and
//! forwarded request; and the W3C trace context check (`traceparent`, `tracestate`).
//!
//! A client's id is kept only when its peer is a trusted proxy and the id is well-formed
//! (1–128 of `A-Z a-z 0-9 - _ . : + / =`); otherwise tollgate makes one: 128 bits as 32
//! lower-case hex digits, from a per-thread SplitMix64 sequence with a random seed — unique
//! and cheap (no lock, no system call), but not a secret: never use it to authorise anything.

use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// The default field of the request id.
pub const DEFAULT_HEADER: HeaderName = HeaderName::from_static("x-request-id");
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The longest id accepted from a trusted proxy.
pub const MAX_GIVEN: usize = 128;

/// One request's id: its field value, shared (each answer and forwarded request that carries
/// it counts a reference; none copies it).
///
/// Marked sensitive: HTTP/2's HPACK then sends it as a literal never indexed instead of
/// inserting a value no later message repeats into the connection's table, where each
/// insert evicts entries worth keeping and lengthens the chain every later id is compared
/// against. HTTP/1 ignores the mark.
#[derive(Debug, Clone)]
pub struct RequestId(HeaderValue);

impl RequestId {
    /// The id for a request with `headers` whose peer is (`trusted`) or is not a trusted
    /// proxy; `name` is the field that carries ids.
    pub fn decide(name: &HeaderName, headers: &HeaderMap, trusted: bool) -> RequestId {
        if trusted {
            if let Some(v) = headers.get(name).filter(|v| well_formed(v.as_bytes())) {
                let mut v = v.clone();
                v.set_sensitive(true);
                return RequestId(v);
            }
        }
        RequestId::made()
    }

    /// A new id: 32 hex digits.
    pub fn made() -> RequestId {
        let n = next();
        let mut out = [0u8; 32];
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            let bits = (n >> (96 - 32 * i)) as u32;
            chunk.copy_from_slice(&hex8(bits).to_be_bytes());
        }
        // Owned by the value it becomes: a clone counts a reference, never copies.
        let mut v = HeaderValue::from_maybe_shared(Bytes::from_owner(out)).unwrap_or(HeaderValue::from_static(""));
        v.set_sensitive(true);
        RequestId(v)
    }

    /// The id's bytes (ASCII either way: made as hex digits, or checked when given).
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.0.as_bytes()).unwrap_or("")
    }

    /// The id as a field value (shared, and sensitive: see [`RequestId`]).
    pub fn value(&self) -> HeaderValue {
        self.0.clone()
    }
}

/// The 8 lower-case hex digits of `x`, most significant first, as the bytes of a `u64`
/// (big-endian): nibbles spread one per byte, then `0`–`9` / `a`–`f` added without a branch.
fn hex8(x: u32) -> u64 {
    let mut n = u64::from(x);
    n = (n | (n << 16)) & 0x0000_ffff_0000_ffff;
    n = (n | (n << 8)) & 0x00ff_00ff_00ff_00ff;
    n = (n | (n << 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    // 1 in each byte whose nibble is 10 or more.
    let letters = ((n + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
    n + 0x3030_3030_3030_3030 + letters * (b'a' - b'0' - 10) as u64
}

/// Is `v` an id tollgate passes on?
pub fn well_formed(v: &[u8]) -> bool {
    (1..=MAX_GIVEN).contains(&v.len())
        && v.iter().all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'+' | b'/' | b'='))
}

thread_local! {
    /// SplitMix64 state; 0 until the thread's first id seeds it.
    static STATE: Cell<u64> = const { Cell::new(0) };
}

/// 128 bits: two SplitMix64 outputs. A thread never repeats a value before 2^63 ids, and
/// threads start at independent random points, so ids do not collide in practice.
fn next() -> u128 {
    STATE.with(|s| {
        let mut x = s.get();
        if x == 0 {
            x = seed();
        }
        let hi = splitmix(&mut x);
        let lo = splitmix(&mut x);
        s.set(x | 1);
        (u128::from(hi) << 64) | u128::from(lo)
    })
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A random seed: std's per-process random SipHash keys over the thread and the time.
fn seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write(format!("{:?}", std::thread::current().id()).as_bytes());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish() | 1
}

/// Drops a malformed W3C `traceparent` (and the `tracestate` that belongs to it, as the
/// Trace Context spec requires); a well-formed one passes untouched. Two `traceparent`
/// fields are malformed.
pub fn check_trace_context(headers: &mut HeaderMap) {
    let mut fields = headers.get_all(TRACEPARENT).iter();
    let Some(first) = fields.next() else { return };
    if fields.next().is_none() && valid_traceparent(first.as_bytes()) {
        return;
    }
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
}

/// `version-traceid-parentid-flags` in lower-case hex (W3C Trace Context §3.2): version
/// `ff` is invalid, all-zero ids are invalid, version `00` is exactly 55 bytes, a later
/// version may carry more after a `-`.
pub fn valid_traceparent(v: &[u8]) -> bool {
    let hex = |s: &[u8]| s.iter().all(|&b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let nonzero = |s: &[u8]| s.iter().any(|&b| b != b'0');
    if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return false;
    }
    let (version, trace, parent, flags) = (&v[..2], &v[3..35], &v[36..52], &v[53..55]);
    if !(hex(version) && hex(trace) && hex(parent) && hex(flags)) || version == b"ff" {
        return false;
    }
    if !nonzero(trace) || !nonzero(parent) {
        return false;
    }
    if version == b"00" {
        v.len() == 55
    } else {
        v.len() == 55 || v[55] == b'-'
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_ids_are_32_hex_digits_and_differ() {
        let a = RequestId::made();
        let b = RequestId::made();
        assert_eq!(a.as_str().len(), 32);
        assert!(a.as_str().bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        assert_ne!(a.as_str(), b.as_str());
        assert_eq!(a.value(), a.as_str());
        // Never indexed by HPACK: no later message repeats it.
        assert!(a.value().is_sensitive());
        let other = std::thread::spawn(|| RequestId::made().as_str().to_owned()).join().unwrap();
        assert_ne!(other, a.as_str());
    }

    #[test]
    fn hex_digits_are_those_of_the_number() {
        for x in [0u32, 1, 9, 10, 15, 16, 0xdead_beef, 0x0123_4567, 0x89ab_cdef, u32::MAX] {
            assert_eq!(hex8(x).to_be_bytes(), *format!("{x:08x}").as_bytes(), "{x:#x}");
        }
    }

    #[test]
    fn a_given_id_is_kept_only_from_a_trusted_peer_and_when_well_formed() {
        let mut h = HeaderMap::new();
        h.insert(DEFAULT_HEADER, HeaderValue::from_static("abc-123"));
        assert_eq!(RequestId::decide(&DEFAULT_HEADER, &h, true).as_str(), "abc-123");
        assert_ne!(RequestId::decide(&DEFAULT_HEADER, &h, false).as_str(), "abc-123");
        h.insert(DEFAULT_HEADER, HeaderValue::from_static("has space"));
        assert_ne!(RequestId::decide(&DEFAULT_HEADER, &h, true).as_str(), "has space");
        assert!(!well_formed(&[b'a'; MAX_GIVEN + 1]) && well_formed(&[b'a'; MAX_GIVEN]) && !well_formed(b""));
    }

    #[test]
    fn traceparent_validation() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(valid_traceparent(ok.as_bytes()));
        assert!(valid_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"));
        for bad in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ] {
            assert!(!valid_traceparent(bad.as_bytes()), "{bad}");
        }
        let mut h = HeaderMap::new();
        h.append(TRACEPARENT, HeaderValue::from_static(ok));
        h.append(TRACESTATE, HeaderValue::from_static("k=v"));
        check_trace_context(&mut h);
        assert_eq!(h.len(), 2);
        h.append(TRACEPARENT, HeaderValue::from_static(ok));
        check_trace_context(&mut h);
        assert!(h.is_empty(), "two traceparent fields are dropped with their tracestate");
    }
}
