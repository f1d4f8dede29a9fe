//! Header rewriting at the proxy boundary (RFC 9110 §7.6): hop-by-hop fields are removed in
//! both directions, forwarding fields are added on the way in, `Via` both ways.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Version;

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes hop-by-hop fields: those named by `Connection`, and the fixed list.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most requests carry no Connection field: skip the collection then.
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
        headers.remove(header::CONNECTION);
    }
    for name in [
        KEEP_ALIVE,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        PROXY_CONNECTION,
    ] {
        if headers.contains_key(&name) {
            headers.remove(name);
        }
    }
}

/// `Via` value for a message received with `version`.
pub fn via_value(version: Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        Version::HTTP_2 => "2 tollgate",
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
/// is what we saw. `X-Forwarded-Proto` and `-Host` are ours unless a trusted peer set them.
pub fn add_forwarding(headers: &mut HeaderMap, peer: IpAddr, peer_trusted: bool, host: Option<&HeaderValue>) {
    let mut buf = itoa_ip(peer);
    // Several XFF fields are one list; fold them into one value, ours last.
    if headers.contains_key(&X_FORWARDED_FOR) {
        let mut joined = String::new();
        for v in headers.get_all(&X_FORWARDED_FOR) {
            if let Ok(s) = v.to_str() {
                joined.push_str(s);
                joined.push_str(", ");
            }
        }
        joined.push_str(&buf);
        buf = joined;
    }
    if let Ok(v) = HeaderValue::from_str(&buf) {
        headers.insert(X_FORWARDED_FOR, v);
    }
    if !(peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    if !(peer_trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        match host {
            Some(h) => {
                headers.insert(X_FORWARDED_HOST, h.clone());
            }
            None => {
                headers.remove(&X_FORWARDED_HOST);
            }
        }
    }
}

fn itoa_ip(ip: IpAddr) -> String {
    // IPv4-mapped IPv6 peers (dual-stack sockets) are written as IPv4.
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => v6.to_string(),
        },
        IpAddr::V4(v4) => v4.to_string(),
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
    fn appends_peer_to_forwarded_for_chain() {
        let mut h = map(&[("x-forwarded-for", "1.1.1.1"), ("x-forwarded-for", "2.2.2.2")]);
        add_forwarding(&mut h, "10.0.0.1".parse().unwrap(), false, Some(&HeaderValue::from_static("a.com")));
        assert_eq!(h["x-forwarded-for"], "1.1.1.1, 2.2.2.2, 10.0.0.1");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "a.com");
    }

    #[test]
    fn untrusted_peer_cannot_set_proto_or_host() {
        let mut h = map(&[("x-forwarded-proto", "https"), ("x-forwarded-host", "evil")]);
        add_forwarding(&mut h, "10.0.0.1".parse().unwrap(), false, Some(&HeaderValue::from_static("a.com")));
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "a.com");
        let mut h = map(&[("x-forwarded-proto", "https")]);
        add_forwarding(&mut h, "10.0.0.1".parse().unwrap(), true, None);
        assert_eq!(h["x-forwarded-proto"], "https");
    }

    #[test]
    fn mapped_ipv6_is_written_as_ipv4() {
        let mut h = HeaderMap::new();
        add_forwarding(&mut h, "::ffff:127.0.0.1".parse().unwrap(), false, None);
        assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    }
}
