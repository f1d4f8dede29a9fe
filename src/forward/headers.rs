//! Header rewriting at the proxy boundary (RFC 9110 §7.6): hop-by-hop fields are removed in
//! both directions, forwarding fields are added on the way in, `Via` both ways.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Version;
use smallvec::SmallVec;

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Fields that are hop-by-hop whatever `Connection` says (RFC 9110 §7.6.1, plus the
/// non-standard `Keep-Alive` and `Proxy-Connection`); `Connection` is first.
const FIXED: [HeaderName; 9] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    KEEP_ALIVE,
    PROXY_CONNECTION,
];

/// Bit `i` set: `FIXED[i]` is among `headers`' names; the bits from [`TRACE`] up say which
/// of the fields read later are there (the same pass over the names serves them).
fn fixed_present(headers: &HeaderMap) -> u16 {
    // One copy of the list per call: each use of a `const` array is a temporary to drop, and
    // once the callers grew that drop was no longer inlined away (+700 instructions a
    // request when it ran per name).
    let fixed = FIXED;
    let mut found = 0;
    for name in headers.keys() {
        // Most names are none of these, and their length says so at once.
        let len = name.as_str().len();
        if len >= 32 || CANDIDATE_LENGTHS & (1 << len) == 0 {
            continue;
        }
        if let Some(i) = fixed.iter().position(|f| f == name) {
            found |= 1 << i;
        } else if name == crate::request_id::TRACEPARENT {
            found |= TRACE;
        } else if name == X_FORWARDED_FOR {
            found |= FORWARDED_FOR;
        } else if name == X_FORWARDED_PROTO {
            found |= FORWARDED_PROTO;
        } else if name == X_FORWARDED_HOST {
            found |= FORWARDED_HOST;
        } else if is_forwarding_lookalike(name) {
            found |= LOOKALIKE;
        }
    }
    found
}

/// `x_forwarded_for`, `X_Forwarded-Proto` …: a spelling of a forwarding field tollgate writes
/// with `_` for `-`. Servers that map fields to CGI-style variables (WSGI, Rack, PHP) read it
/// as the real one and merge the two, so a client could add to what tollgate vouches for.
fn is_forwarding_lookalike(name: &HeaderName) -> bool {
    let name = name.as_str().as_bytes();
    let target: &[u8] = match name.len() {
        15 => b"x-forwarded-for",
        16 => b"x-forwarded-host",
        17 => b"x-forwarded-proto",
        _ => return false,
    };
    name.contains(&b'_') && name.iter().zip(target).all(|(&a, &b)| a == b || (a == b'_' && b == b'-'))
}

/// The lengths of the names `fixed_present` looks for, as bits.
const CANDIDATE_LENGTHS: u32 = {
    let names: [&str; 13] = [
        "connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
        "keep-alive",
        "proxy-connection",
        "traceparent",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
    ];
    let mut bits = 0u32;
    let mut i = 0;
    while i < names.len() {
        bits |= 1 << names[i].len();
        i += 1;
    }
    bits
};

/// The bits of `fixed_present` past the fixed list: a forwarding field's lookalike (removed
/// with the hop-by-hop fields), then the fields read later.
const LOOKALIKE: u16 = 1 << 11;
const TRACE: u16 = 1 << 12;
const FORWARDED_FOR: u16 = 1 << 13;
const FORWARDED_PROTO: u16 = 1 << 14;
const FORWARDED_HOST: u16 = 1 << 15;
const SEEN: u16 = TRACE | FORWARDED_FOR | FORWARDED_PROTO | FORWARDED_HOST;

/// What the pass of [`strip_hop_by_hop`] over a message's names saw of the fields read after
/// it: `traceparent` (see `crate::request_id`) and the `X-Forwarded-*` fields
/// ([`add_forwarding_proto`]), so that a request without them is not searched again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen(u16);

impl Seen {
    pub fn trace(self) -> bool {
        self.0 & TRACE != 0
    }

    fn has(self, bit: u16) -> bool {
        self.0 & bit != 0
    }
}

/// Removes hop-by-hop fields: those named by `Connection`, and the fixed list. Returns
/// which of the fields read next the message has ([`Seen`]).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) -> Seen {
    // One pass over the names (a message has a handful) instead of a hashed lookup per
    // listed field; most requests have none of them and stop here.
    let found = fixed_present(headers);
    let seen = Seen(found & SEEN);
    let found = found & !SEEN;
    if found == 0 {
        return seen;
    }
    // Most messages that get here say `Connection: keep-alive` or `close` (every nginx
    // response does): those name nothing beyond the fixed list, so nothing is parsed into a
    // name and nothing is allocated for them.
    let mut named: SmallVec<[HeaderName; 4]> = SmallVec::new();
    if found & 1 != 0 {
        for value in headers.get_all(header::CONNECTION) {
            let v = value.as_bytes();
            if v.eq_ignore_ascii_case(b"keep-alive") || v.eq_ignore_ascii_case(b"close") {
                continue;
            }
            let Ok(value) = value.to_str() else { continue };
            for token in value.split(',').map(str::trim) {
                if token.is_empty() || token.eq_ignore_ascii_case("keep-alive") || token.eq_ignore_ascii_case("close") {
                    continue;
                }
                if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
                    if !FIXED.contains(&name) {
                        named.push(name);
                    }
                }
            }
        }
    }
    for (i, name) in FIXED.iter().enumerate() {
        if found & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    if found & LOOKALIKE != 0 {
        named.extend(headers.keys().filter(|n| is_forwarding_lookalike(n)).cloned());
    }
    // A field `Connection` named may be one `seen` counts: it says "there" of a field that
    // is gone, which only costs a lookup that finds nothing.
    for name in named {
        headers.remove(name);
    }
    seen
}

/// `Via` value for a message received with `version`.
pub fn via_value(version: Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        Version::HTTP_2 => "2 tollgate",
        Version::HTTP_3 => "3 tollgate",
        Version::HTTP_10 => "1.0 tollgate",
        _ => "1.1 tollgate",
    })
}

/// Appends our `Via` entry to any existing ones.
pub fn append_via(headers: &mut HeaderMap, received: Version) {
    headers.append(header::VIA, via_value(received));
}

/// Appends the peer to `X-Forwarded-For`. Fields from an untrusted peer are kept (the
/// upstream may log them) but the peer is always the last entry, so the chain's right end
/// is what we saw. `X-Forwarded-Proto` and `-Host` are ours unless a trusted peer set them;
/// `host` is the client's `Host` when the upstream gets another one (`None`: it gets the
/// client's, so no `X-Forwarded-Host` repeats it, and an untrusted one is removed). For a
/// client that came over TLS when `https`: `X-Forwarded-Proto: https`.
pub fn add_forwarding_proto(
    headers: &mut HeaderMap,
    peer: IpAddr,
    peer_trusted: bool,
    host: Option<&HeaderValue>,
    https: bool,
    seen: Seen,
) {
    if seen.has(FORWARDED_FOR) {
        // Several XFF fields are one list; fold them into one value, ours last.
        let mut chain = String::with_capacity(48);
        for v in headers.get_all(&X_FORWARDED_FOR) {
            if let Ok(s) = v.to_str() {
                chain.push_str(s);
                chain.push_str(", ");
            }
        }
        push_ip(&mut chain, canonical(peer));
        // From a String the value takes the buffer over: no second copy.
        if let Ok(v) = HeaderValue::try_from(chain) {
            headers.insert(X_FORWARDED_FOR, v);
        }
    } else {
        // The common case: the peer alone, written on the stack and copied once.
        let mut text = IpText::new();
        push_ip(&mut text, canonical(peer));
        if let Ok(v) = HeaderValue::from_bytes(text.as_bytes()) {
            headers.insert(X_FORWARDED_FOR, v);
        }
    }
    if !(peer_trusted && seen.has(FORWARDED_PROTO) && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(if https { "https" } else { "http" }));
    }
    if !(peer_trusted && seen.has(FORWARDED_HOST) && headers.contains_key(&X_FORWARDED_HOST)) {
        match host {
            Some(h) => {
                headers.insert(X_FORWARDED_HOST, h.clone());
            }
            None if seen.has(FORWARDED_HOST) => {
                headers.remove(&X_FORWARDED_HOST);
            }
            None => {}
        }
    }
}

/// An IP address's text on the stack (the longest, an IPv6 address, takes 39 bytes; 45 with
/// an embedded IPv4 address).
struct IpText {
    buf: [u8; 48],
    len: usize,
}

impl IpText {
    fn new() -> IpText {
        IpText { buf: [0; 48], len: 0 }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl std::fmt::Write for IpText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.buf.get_mut(self.len..self.len + s.len()).ok_or(std::fmt::Error)?;
        room.copy_from_slice(s.as_bytes());
        self.len += s.len();
        Ok(())
    }
}

/// `ip` in its text form; IPv4, the common case, without the formatting machinery (it was
/// a thousand instructions per request).
fn push_ip(out: &mut impl std::fmt::Write, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    let _ = out.write_str(".");
                }
                let _ = out.write_str(itoa::Buffer::new().format(octet));
            }
        }
        IpAddr::V6(v6) => {
            let _ = write!(out, "{v6}");
        }
    }
}

/// IPv4-mapped IPv6 peers (dual-stack sockets) are written as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(HeaderName::from_bytes(n.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn strips_fixed_and_connection_named_fields() {
        let mut h = map(&[
            ("connection", "keep-alive, x-secret"),
            ("connection", "x-other"),
            ("x-secret", "1"),
            ("x-other", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic x"),
            ("x-keep", "yes"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["x-keep"], "yes");
    }

    #[test]
    fn underscored_spellings_of_the_forwarding_fields_are_removed() {
        let mut h = map(&[
            ("x_forwarded_for", "10.6.6.6"),
            ("x-forwarded_proto", "https"),
            ("X_Forwarded_Host", "admin.internal"),
            ("x-forwarded-for", "203.0.113.9"),
            ("accept-encoding", "gzip"),
            ("x_forwarded_fox", "1"),
            ("x_forwarded_hosts", "1"),
        ]);
        let seen = strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["accept-encoding", "x-forwarded-for", "x_forwarded_fox", "x_forwarded_hosts"]);
        assert!(seen.has(FORWARDED_FOR));
    }

    #[test]
    fn connection_named_fields_go_even_without_fixed_ones() {
        let mut h = map(&[("connection", "x-secret"), ("x-secret", "1"), ("x-keep", "yes")]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        let mut h = map(&[("proxy-connection", "keep-alive"), ("x-keep", "yes")]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        let mut h = map(&[("x-keep", "yes"), ("host", "a")]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 2, "{h:?}");
    }

    /// The forwarding fields of a plain request from untrusted 10.0.0.1, whose upstream gets
    /// its own `Host` instead of the client's `a.com`.
    fn from_untrusted_for_a_com(h: &mut HeaderMap) {
        forward(h, "10.0.0.1", false, Some(&HeaderValue::from_static("a.com")));
    }

    /// What a request's head goes through: the hop-by-hop pass, then the forwarding fields.
    fn forward(h: &mut HeaderMap, peer: &str, trusted: bool, host: Option<&HeaderValue>) {
        let seen = strip_hop_by_hop(h);
        add_forwarding_proto(h, peer.parse().unwrap(), trusted, host, false, seen);
    }

    #[test]
    fn appends_peer_to_forwarded_for_chain() {
        let mut h = map(&[("x-forwarded-for", "1.1.1.1"), ("x-forwarded-for", "2.2.2.2")]);
        from_untrusted_for_a_com(&mut h);
        assert_eq!(h["x-forwarded-for"], "1.1.1.1, 2.2.2.2, 10.0.0.1");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "a.com");
    }

    #[test]
    fn untrusted_peer_cannot_set_proto_or_host() {
        let mut h = map(&[("x-forwarded-proto", "https"), ("x-forwarded-host", "evil")]);
        from_untrusted_for_a_com(&mut h);
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "a.com");
        let mut h = map(&[("x-forwarded-proto", "https")]);
        forward(&mut h, "10.0.0.1", true, None);
        assert_eq!(h["x-forwarded-proto"], "https");
        // Without a Host of the client's to pass on, an untrusted X-Forwarded-Host goes.
        let mut h = map(&[("x-forwarded-host", "evil"), ("x-forwarded-proto", "https")]);
        forward(&mut h, "10.0.0.1", false, None);
        assert!(!h.contains_key("x-forwarded-host"), "{h:?}");
        assert_eq!(h["x-forwarded-proto"], "http");
        // A trusted peer's stay.
        let mut h = map(&[("x-forwarded-host", "a.com"), ("x-forwarded-proto", "https")]);
        forward(&mut h, "10.0.0.1", true, Some(&HeaderValue::from_static("b.com")));
        assert_eq!(h["x-forwarded-host"], "a.com");
        assert_eq!(h["x-forwarded-proto"], "https");
    }

    #[test]
    fn mapped_ipv6_is_written_as_ipv4() {
        let mut h = HeaderMap::new();
        forward(&mut h, "::ffff:127.0.0.1", false, None);
        assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    }

    #[test]
    fn peers_are_written_as_std_writes_them() {
        for ip in ["0.0.0.0", "255.255.255.255", "10.0.20.3", "192.168.100.9", "::1", "2001:db8::8a2e:370:7334"] {
            let ip: IpAddr = ip.parse().unwrap();
            let mut out = String::new();
            push_ip(&mut out, ip);
            assert_eq!(out, ip.to_string());
        }
        // The longest texts fit the stack buffer of a field without a chain.
        for ip in ["255.255.255.255", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "1:2:3:4:5:6:255.255.255.255"] {
            let ip: IpAddr = ip.parse().unwrap();
            let mut h = HeaderMap::new();
            add_forwarding_proto(&mut h, ip, false, None, false, Seen::default());
            assert_eq!(h["x-forwarded-for"], ip.to_string().as_str());
        }
    }

    #[test]
    fn keep_alive_and_close_tokens_remove_only_the_fixed_fields() {
        let mut h =
            map(&[("connection", "Keep-Alive"), ("connection", " close ,"), ("keep-alive", "timeout=5"), ("x-a", "1")]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["x-a"], "1");
    }

    #[test]
    fn a_traceparent_is_noted_in_the_same_pass() {
        let mut h = map(&[("traceparent", "x"), ("x-keep", "yes")]);
        assert!(strip_hop_by_hop(&mut h).trace());
        let mut h = map(&[("traceparent", "x"), ("te", "trailers")]);
        assert!(strip_hop_by_hop(&mut h).trace());
        assert_eq!(h.len(), 1);
        assert!(!strip_hop_by_hop(&mut map(&[("x-keep", "yes"), ("te", "trailers")])).trace());
    }

    #[test]
    fn the_pass_sees_the_forwarding_fields_and_only_them() {
        let seen = |pairs: &[(&str, &str)]| strip_hop_by_hop(&mut map(pairs));
        assert_eq!(seen(&[("host", "a"), ("user-agent", "x"), ("x-forwarded-fo", "1")]), Seen::default());
        assert!(seen(&[("X-Forwarded-For", "1")]).has(FORWARDED_FOR));
        assert!(seen(&[("x-forwarded-proto", "https")]).has(FORWARDED_PROTO));
        assert!(seen(&[("x-forwarded-host", "a")]).has(FORWARDED_HOST));
        // Names of a candidate's length that are none of them.
        assert_eq!(seen(&[("x-forwarded-fox", "1"), ("x-forwarded-hosts", "a")]), Seen::default());
    }

    #[test]
    fn every_fixed_field_is_found_by_its_length() {
        for (i, name) in FIXED.iter().enumerate() {
            let mut h = map(&[("x-other", "1"), ("host", "a")]);
            h.insert(name.clone(), HeaderValue::from_static("v"));
            assert_eq!(fixed_present(&h), 1 << i, "{name}");
        }
    }
}
