//! A request read for its limit keys: what each [`KeyPart`] holds in it (a header's values, a
//! query parameter decoded, the client IP through [`TrustedProxies`], the route, the path, the
//! TLS client, the identity `auth` verified), fed to the limit room's [`KeyMaterial`] to make
//! the [`KeyHash`] a limit decides on; and the same values as a plan's clients map names them.
//! The `limit` room defines keys and their digest; this one knows the request.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

use http::header::{HeaderMap, FORWARDED};
use ipnet::IpNet;

use crate::limit::key::{KeyMaterial, MAX_PART_BYTES};
use crate::limit::{Identity, KeyHash, KeyPart, KeySpec};

/// What a request's keys are computed from.
pub struct KeyCtx<'a> {
    pub route: &'a str,
    pub client_ip: IpAddr,
    /// The normalised path routes match (see [`crate::target`]), not the raw one: a client
    /// cannot get a fresh key by spelling its path another way.
    pub path: &'a str,
    pub parts: &'a http::request::Parts,
    /// The client certificate's identity on an mTLS connection (see [`crate::peer::Peer`]).
    pub tls_client: Option<&'a str>,
    /// Keys known already, by the index of the route's limit: what `tollgate replay` read in
    /// a log line for material the line lacks (`None` on the request path). A thin pointer:
    /// the context lives in every request's future across the decision.
    pub known: Option<&'a Vec<Option<KeyHash>>>,
}

#[cfg(test)]
impl<'a> KeyCtx<'a> {
    /// The context of the gate's tests: route `r`, client `10.0.0.1`, path `/`, `parts`.
    pub fn test(parts: &'a http::request::Parts) -> KeyCtx<'a> {
        KeyCtx {
            route: "r",
            client_ip: IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1)),
            path: "/",
            parts,
            tls_client: None,
            known: None,
        }
    }
}

impl<'a> KeyCtx<'a> {
    /// Who the route's `auth` verified the request is (`None`: the route has no `auth`): what
    /// `auth` put in the head's extensions.
    #[inline]
    pub fn identity(&self) -> Option<&'a Identity> {
        self.parts.extensions.get::<Box<Identity>>().map(|id| &**id)
    }

    /// The key of limit `i` known already (read from a log), if any.
    #[inline]
    pub fn known(&self, i: usize) -> Option<KeyHash> {
        self.known.and_then(|k| k.get(i).copied().flatten())
    }

    /// The key of the route's limit `i` of `spec`: the one known already, else this request's.
    #[inline]
    pub fn key_of(&self, i: usize, spec: &KeySpec) -> KeyHash {
        match self.known {
            None => self.key(spec),
            Some(_) => self.known(i).unwrap_or_else(|| self.key(spec)),
        }
    }

    /// The digest of this request's key of `spec` (see `limit::key` for the encoding).
    #[inline]
    pub fn key(&self, spec: &KeySpec) -> KeyHash {
        let mut m = KeyMaterial::new();
        for part in spec.parts() {
            match part {
                KeyPart::Route => m.route(self.route),
                KeyPart::ClientIp => m.client_ip(self.client_ip),
                KeyPart::Header(name) => m.header(name, self.parts.headers.get_all(name).iter().map(|v| v.as_bytes())),
                KeyPart::Query(name) => {
                    let mut buf = [0u8; MAX_PART_BYTES];
                    let n = query_value(self.parts.uri.query(), name, &mut buf);
                    m.query(name, n.map(|n| &buf[..n]));
                }
                KeyPart::Path => m.path(self.path),
                KeyPart::TlsClient => m.tls_client(self.tls_client),
                KeyPart::Consumer => m.consumer(self.identity().map(|id| &*id.consumer)),
                KeyPart::Claim(name) => m.claim(name, self.identity().and_then(|id| id.claim(name))),
                KeyPart::Cookie(name) => m.cookie(name, cookie(&self.parts.headers, name)),
            }
        }
        m.finish()
    }

    /// The request's value of `part`, as a plan's clients map names it: a header's first
    /// value, a query parameter decoded, the client IP as text, the TLS client certificate's
    /// identity, the route name or the path;
    /// `None` when the request has no such value. Capped at [`MAX_PART_BYTES`]; written into
    /// `buf` when it must be decoded or formatted, so nothing is allocated.
    pub fn value<'b>(&'b self, part: &KeyPart, buf: &'b mut [u8; MAX_PART_BYTES]) -> Option<&'b [u8]> {
        let ctx = self;
        let capped = |b: &'b [u8]| &b[..b.len().min(MAX_PART_BYTES)];
        match part {
            KeyPart::Route => Some(capped(ctx.route.as_bytes())),
            KeyPart::Path => Some(capped(ctx.path.as_bytes())),
            KeyPart::Header(name) => ctx.parts.headers.get(name).map(|v| capped(v.as_bytes())),
            KeyPart::Query(name) => {
                let n = query_value(ctx.parts.uri.query(), name, buf)?;
                Some(&buf[..n])
            }
            KeyPart::TlsClient => ctx.tls_client.map(|id| capped(id.as_bytes())),
            KeyPart::Consumer => ctx.identity().map(|id| capped(id.consumer.as_bytes())),
            KeyPart::Claim(name) => ctx.identity().and_then(|id| id.claim(name)).map(|v| capped(v.as_bytes())),
            KeyPart::Cookie(name) => cookie(&ctx.parts.headers, name).map(capped),
            KeyPart::ClientIp => {
                use std::io::Write;
                let mut w = &mut buf[..];
                write!(w, "{}", ctx.client_ip.to_canonical()).ok()?;
                let n = MAX_PART_BYTES - w.len();
                Some(&buf[..n])
            }
        }
    }
}

/// The value of the first cookie named `name` in the request's `Cookie` fields (RFC 6265
/// §5.4: `name=value` pairs separated by `;`), without allocating.
fn cookie<'a>(headers: &'a http::HeaderMap, name: &str) -> Option<&'a [u8]> {
    headers.get_all(http::header::COOKIE).iter().find_map(|field| {
        field.as_bytes().split(|&b| b == b';').find_map(|pair| {
            let pair = pair.trim_ascii();
            let eq = pair.iter().position(|&b| b == b'=')?;
            (pair[..eq].trim_ascii() == name.as_bytes()).then(|| pair[eq + 1..].trim_ascii())
        })
    })
}

/// Decodes `%XX` and `+` from `raw` into `out`, stopping when `out` is full; returns the length.
fn percent_decode(raw: &[u8], out: &mut [u8]) -> usize {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    let (mut i, mut n) = (0, 0);
    while i < raw.len() && n < out.len() {
        let decoded = match raw[i] {
            b'+' => b' ',
            b'%' => match (raw.get(i + 1).and_then(|&b| hex(b)), raw.get(i + 2).and_then(|&b| hex(b))) {
                (Some(hi), Some(lo)) => {
                    i += 2;
                    hi << 4 | lo
                }
                _ => b'%',
            },
            b => b,
        };
        out[n] = decoded;
        n += 1;
        i += 1;
    }
    n
}

/// The first value of parameter `name` in `query`, decoded into `buf`.
pub fn query_value(query: Option<&str>, name: &str, buf: &mut [u8]) -> Option<usize> {
    let mut name_buf = [0u8; 256];
    for pair in query?.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let kn = percent_decode(k.as_bytes(), &mut name_buf);
        if kn < name_buf.len() && &name_buf[..kn] == name.as_bytes() {
            return Some(percent_decode(v.as_bytes(), buf));
        }
    }
    None
}

/// Proxies whose `X-Forwarded-For` / `Forwarded` headers are believed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<IpNet>);

impl TrustedProxies {
    pub fn new(nets: Vec<IpNet>) -> Self {
        Self(nets)
    }

    /// True if `ip` (IPv4-mapped folded to IPv4) is inside a trusted network.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.0.iter().any(|net| net.contains(&ip))
    }

    /// The client's address.
    ///
    /// The peer, unless the peer is trusted; then `X-Forwarded-For` (all values, comma lists)
    /// is read right to left, skipping trusted hops: the first untrusted address is the client,
    /// and if every hop is trusted the leftmost is. Without `X-Forwarded-For`, the `for=` of
    /// `Forwarded` (RFC 7239) is read the same way. An entry that is not an address (garbage,
    /// `unknown`, an obfuscated `_name`, an element without `for=`) stops the walk: the last
    /// good address seen (a trusted hop, or the peer) is the client. That fails safe: whatever
    /// lies left of an unreadable hop could have been written by the client itself.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = peer.to_canonical();
        if !self.is_trusted(peer) {
            return peer;
        }
        let xff = headers.get_all("x-forwarded-for");
        if xff.iter().next().is_some() {
            let hops = xff.iter().rev().flat_map(|v| {
                let s = v.to_str().unwrap_or("\0");
                s.rsplit(',').map(parse_xff)
            });
            return self.walk(peer, hops);
        }
        let fwd = headers.get_all(FORWARDED);
        let hops = fwd.iter().rev().flat_map(|v| {
            let s = v.to_str().unwrap_or("\0");
            s.rsplit(',').map(parse_forwarded_element)
        });
        self.walk(peer, hops)
    }

    fn walk(&self, peer: IpAddr, hops: impl Iterator<Item = Option<IpAddr>>) -> IpAddr {
        let mut last = peer;
        for hop in hops {
            let Some(ip) = hop else {
                return last;
            };
            let ip = ip.to_canonical();
            if !self.is_trusted(ip) {
                return ip;
            }
            last = ip;
        }
        last
    }
}

/// One `X-Forwarded-For` entry: an address, optionally with a port (`1.2.3.4:80`, `[::1]:80`).
fn parse_xff(entry: &str) -> Option<IpAddr> {
    let e = entry.trim();
    if let Ok(ip) = IpAddr::from_str(e) {
        return Some(ip);
    }
    if let Ok(sa) = SocketAddr::from_str(e) {
        return Some(sa.ip());
    }
    e.strip_prefix('[').and_then(|r| r.strip_suffix(']')).and_then(|r| Ipv6Addr::from_str(r).ok()).map(IpAddr::V6)
}

/// The `for=` node of one `Forwarded` element, if it is an address.
fn parse_forwarded_element(element: &str) -> Option<IpAddr> {
    let node = element.split(';').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        k.trim().eq_ignore_ascii_case("for").then_some(v.trim())
    })?;
    let node = node.strip_prefix('"').and_then(|n| n.strip_suffix('"')).unwrap_or(node);
    if let Some(rest) = node.strip_prefix('[') {
        // "[2001:db8::1]" or "[2001:db8::1]:port" (the port may be obfuscated: ignored).
        let (addr, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.starts_with(':')) {
            return None;
        }
        return Ipv6Addr::from_str(addr).ok().map(IpAddr::V6);
    }
    // "192.0.2.43" or "192.0.2.43:47011"; "unknown" and "_hidden" fail to parse.
    let addr = node.split_once(':').map_or(node, |(a, _)| a);
    Ipv4Addr::from_str(addr).ok().map(IpAddr::V4)
}

#[cfg(test)]
mod cookie_tests {
    use super::*;
    use crate::limit::{KeyError, KeyPart};

    #[test]
    fn a_cookie_key_reads_the_named_cookie_of_any_cookie_field() {
        let mut h = http::HeaderMap::new();
        h.append(http::header::COOKIE, http::HeaderValue::from_static("theme=dark; session = abc ;x=1"));
        h.append(http::header::COOKIE, http::HeaderValue::from_static("other=2; session=late"));
        assert_eq!(cookie(&h, "session"), Some(&b"abc"[..]));
        assert_eq!(cookie(&h, "other"), Some(&b"2"[..]));
        assert_eq!(cookie(&h, "sess"), None);
        assert_eq!(cookie(&http::HeaderMap::new(), "session"), None);
        assert_eq!("cookie:session".parse::<KeyPart>(), Ok(KeyPart::Cookie("session".to_owned())));
        assert_eq!("cookie: ".parse::<KeyPart>(), Err(KeyError::Cookie));
        assert_eq!(KeyPart::Cookie("s".to_owned()).to_string(), "cookie:s");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> http::request::Parts {
        let mut b = Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("valid request").into_parts().0
    }

    fn hash(spec: &str, route: &str, ip: &str, p: &http::request::Parts) -> KeyHash {
        let ctx = KeyCtx {
            route,
            client_ip: ip.parse().expect("ip"),
            path: p.uri.path(),
            parts: p,
            tls_client: None,
            known: None,
        };
        ctx.key(&KeySpec::parse(spec).expect("spec"))
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        parts("/", pairs).headers
    }

    fn trusted(nets: &[&str]) -> TrustedProxies {
        TrustedProxies::new(nets.iter().map(|n| n.parse().expect("net")).collect())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn digest_is_stable_across_versions() {
        // Pinned: Redis keys are shared by instances and survive upgrades. If this changes,
        // bump the encoding version in DOMAIN instead.
        let p = parts("/a?user=bob", &[("x-api-key", "k1")]);
        let h = hash("route, client_ip, header:x-api-key, query:user, path", "r", "10.0.0.1", &p);
        assert_eq!(h, KeyHash(PINNED));
    }

    const PINNED: u128 = 182024283052744900161319907794309170810;

    #[test]
    fn digest_matches_the_documented_encoding() {
        let p = parts("/a?user=b%6fb", &[("x-api-key", "k1"), ("x-api-key", "k2")]);
        let got = hash("route, client_ip, header:x-api-key, query:user, query:none, path", "r", "::ffff:10.0.0.1", &p);
        let mut m: Vec<u8> = b"tollgate/key/v1".to_vec();
        m.extend([0x01, 1, 0, 0, 0, b'r']);
        m.extend([0x02, 0x04, 10, 0, 0, 1]);
        m.extend([0x03, 9, 0, 0, 0]);
        m.extend(b"x-api-key");
        m.extend([0x01, 2, 0, 0, 0, b'k', b'1', 2, 0, 0, 0, b'k', b'2', 0xFF, 0xFF, 0xFF, 0xFF]);
        m.extend([0x04, 4, 0, 0, 0]);
        m.extend(b"user");
        m.extend([0x01, 3, 0, 0, 0, b'b', b'o', b'b']);
        m.extend([0x04, 4, 0, 0, 0]);
        m.extend(b"none");
        m.extend([0x00]);
        m.extend([0x05, 2, 0, 0, 0, b'/', b'a']);
        assert_eq!(got, KeyHash(xxhash_rust::xxh3::xxh3_128(&m)));
    }

    #[test]
    fn long_material_hashes_as_its_encoding() {
        // Past the stack buffer the material continues in XXH3's streaming state: the digest
        // must still be the one-shot hash of the whole encoding.
        for len in [80, 90, 91, 99, 100, 101, 200, 240, 600, 2000] {
            let value = "v".repeat(len);
            let p = parts("/", &[("x-long", value.as_str())]);
            let got = hash("route, header:x-long", "r", "10.0.0.1", &p);
            let capped = len.min(MAX_PART_BYTES);
            let mut m: Vec<u8> = b"tollgate/key/v1".to_vec();
            m.extend([0x01, 1, 0, 0, 0, b'r']);
            m.extend([0x03, 6, 0, 0, 0]);
            m.extend(b"x-long");
            m.push(0x01);
            m.extend((capped as u32).to_le_bytes());
            m.extend(std::iter::repeat_n(b'v', capped));
            m.extend([0xFF; 4]);
            assert_eq!(got, KeyHash(xxhash_rust::xxh3::xxh3_128(&m)), "value of {len} bytes");
        }
    }

    #[test]
    fn parts_are_length_prefixed_and_ordered() {
        let p = parts("/", &[("a", "x"), ("b", "yz")]);
        let q = parts("/", &[("a", "xy"), ("b", "z")]);
        assert_ne!(hash("header:a, header:b", "r", "1.1.1.1", &p), hash("header:a, header:b", "r", "1.1.1.1", &q));
        assert_ne!(hash("route, path", "r", "1.1.1.1", &p), hash("path, route", "r", "1.1.1.1", &p));
        // Same bytes under different part kinds stay apart.
        let r = parts("/?r=r", &[("r", "r")]);
        assert_ne!(hash("header:r", "r", "1.1.1.1", &r), hash("query:r", "r", "1.1.1.1", &r));
        assert_ne!(hash("route", "/", "1.1.1.1", &r), hash("path", "x", "1.1.1.1", &r));
    }

    #[test]
    fn missing_header_has_its_own_marker() {
        let none = parts("/", &[]);
        let empty = parts("/", &[("x-api-key", "")]);
        let other = parts("/", &[("x-other", "v")]);
        let h = |p| hash("header:x-api-key", "r", "1.1.1.1", p);
        assert_eq!(h(&none), h(&other), "all requests without it share one bucket");
        assert_ne!(h(&none), h(&empty));
        let q = |u: &str| hash("query:user", "r", "1.1.1.1", &parts(u, &[]));
        assert_eq!(q("/"), q("/?other=1"));
        assert_ne!(q("/"), q("/?user="));
        assert_eq!(q("/?user=a%20b"), q("/?user=a+b&user=c"));
    }

    #[test]
    fn values_are_capped_before_hashing() {
        let long = "a".repeat(5 * MAX_PART_BYTES);
        let longer = format!("{long}b");
        let h = |v: &str| hash("header:x", "r", "1.1.1.1", &parts("/", &[("x", v)]));
        assert_eq!(h(&long), h(&longer));
        // Repeating the header does not grow the material past the cap either: the first value
        // spends the part's whole budget, so what later values say is never hashed.
        let many: Vec<(&str, &str)> = (0..10).map(|_| ("x", long.as_str())).collect();
        let mut others = many.clone();
        for (i, v) in ["b", "c", "different"].into_iter().enumerate() {
            others[i + 1].1 = v;
        }
        let h = |pairs: &[(&str, &str)]| hash("header:x", "r", "1.1.1.1", &parts("/", pairs));
        assert_eq!(h(&many), h(&others));
        // Within the budget every value counts.
        assert_ne!(h(&[("x", "a"), ("x", "b")]), h(&[("x", "a"), ("x", "c")]));
    }

    #[test]
    fn ipv4_mapped_ipv6_is_the_same_client() {
        let p = parts("/", &[]);
        assert_eq!(hash("client_ip", "r", "::ffff:10.1.2.3", &p), hash("client_ip", "r", "10.1.2.3", &p));
        assert_ne!(hash("client_ip", "r", "10.1.2.4", &p), hash("client_ip", "r", "10.1.2.3", &p));
    }

    #[test]
    fn xff_from_untrusted_peer_is_ignored() {
        let t = trusted(&["10.0.0.0/8"]);
        let h = headers(&[("x-forwarded-for", "1.2.3.4")]);
        assert_eq!(t.client_ip(ip("203.0.113.9"), &h), ip("203.0.113.9"));
    }

    #[test]
    fn trusted_chain_is_read_right_to_left() {
        let t = trusted(&["10.0.0.0/8", "fd00::/8"]);
        // Client spoofs "6.6.6.6"; the real client 7.7.7.7 was appended by our proxies.
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 7.7.7.7"), ("x-forwarded-for", "10.0.0.2,10.0.0.3")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &h), ip("7.7.7.7"));
        assert_eq!(t.client_ip(ip("::ffff:10.0.0.4"), &h), ip("7.7.7.7"));
        let all = headers(&[("x-forwarded-for", "10.9.9.9, [fd00::1]:443, 10.0.0.2")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &all), ip("10.9.9.9"), "leftmost");
        let ported = headers(&[("x-forwarded-for", "[2001:db8::7]:1234, 10.0.0.2:80")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &ported), ip("2001:db8::7"));
    }

    #[test]
    fn garbage_stops_at_the_last_good_address() {
        let t = trusted(&["10.0.0.0/8"]);
        let h = headers(&[("x-forwarded-for", "1.2.3.4, junk, 10.0.0.2")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &h), ip("10.0.0.2"));
        let h = headers(&[("x-forwarded-for", "1.2.3.4,")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &h), ip("10.0.0.4"));
        // With no header at all, a trusted peer is the client.
        assert_eq!(t.client_ip(ip("10.0.0.4"), &HeaderMap::new()), ip("10.0.0.4"));
    }

    #[test]
    fn forwarded_is_used_without_xff() {
        let t = trusted(&["10.0.0.0/8"]);
        let h = headers(&[("forwarded", "for=6.6.6.6, for=\"[2001:db8:cafe::17]:4711\";proto=https, For=10.0.0.2")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &h), ip("2001:db8:cafe::17"));
        let h = headers(&[("forwarded", "for=192.0.2.43:47011;by=10.0.0.1")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &h), ip("192.0.2.43"));
        // Obfuscated and unknown identifiers are not addresses: stop at the trusted hop.
        let h = headers(&[("forwarded", "for=1.2.3.4, for=_hidden, for=10.0.0.2")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &h), ip("10.0.0.2"));
        let h = headers(&[("forwarded", "for=unknown")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &h), ip("10.0.0.4"));
        // XFF wins when both are present.
        let h = headers(&[("forwarded", "for=1.1.1.1"), ("x-forwarded-for", "2.2.2.2")]);
        assert_eq!(t.client_ip(ip("10.0.0.4"), &h), ip("2.2.2.2"));
    }
}
