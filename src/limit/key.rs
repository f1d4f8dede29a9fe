//! Which client a request counts against, as data: a [`KeySpec`] (the parts a key is made
//! of), and the 128-bit [`KeyHash`] its material is hashed to ([`KeyMaterial`]). Reading that
//! material from a request (its headers, query, client IP through trusted proxies) is the
//! `request_key` room's: this one knows no request. Invariants: request bytes are never
//! stored (only the digest), each part's material is capped, and hashing never fails.
//!
//! The digest is XXH3-128 (`xxhash-rust`) over a versioned, domain-separated encoding (below).
//! XXH3's output is frozen by its specification since xxHash 0.8, so it is stable across
//! processes, versions and architectures, which the shared Redis keys need; it hashes short
//! keys in a few tens of ns, and 128 bits make accidental collisions negligible (~1e-20 at a
//! billion keys). It is not a cryptographic hash: someone who can choose a key part could in
//! principle aim for another client's digest, but every part of a key is either the client's
//! own (its headers) or not under its control (peer IP, route), so nothing is gained that
//! sending the other client's header value would not give. A cryptographic hash (BLAKE3) would
//! cost more on the hot path and buy nothing for that reason.
//!
//! Encoding (`v1`): `"tollgate/key/v1"`, then per part a tag byte and its material:
//! route `0x01 len:u32le bytes`; client IP `0x02` then `0x04 + 4 bytes` or `0x06 + 16 bytes`
//! (IPv4-mapped IPv6 is folded to IPv4); header `0x03 len name`, then `0x00` if missing, else
//! `0x01 (len value)* 0xFFFFFFFF` over all values in order; query `0x04 len name`, then `0x00`
//! if missing, else `0x01 len value` (first occurrence, percent-decoded); path `0x05 len bytes`;
//! TLS client `0x06`, consumer `0x07`, then `0x00` if none, else `0x01 len bytes`; claim
//! `0x08 len name`, then `0x00` if missing, else `0x01 len value`; cookie `0x09 len name`, then
//! `0x00` if missing, else `0x01 len value` (the first cookie of that name).
//! Lengths are after capping: at most [`MAX_PART_BYTES`] of each part's values are hashed.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use http::header::HeaderName;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

/// At most this many bytes of each part's value are hashed; longer values share a prefix key.
pub const MAX_PART_BYTES: usize = 1024;

const DOMAIN: &[u8] = b"tollgate/key/v1";
const END: [u8; 4] = [0xFF; 4];

/// One component of a key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum KeyPart {
    /// The matched route's name.
    Route,
    /// The client IP, after [`TrustedProxies`].
    ClientIp,
    /// All values of a request header (missing → one shared "missing" key).
    Header(HeaderName),
    /// The first value of a query parameter, percent-decoded (missing → shared "missing" key).
    /// Parameter names are compared decoded, up to 255 bytes.
    Query(String),
    /// The request path (without query).
    Path,
    /// The verified TLS client certificate's identity (its first SAN, else its CN); clients
    /// without one share one "missing" key.
    TlsClient,
    /// The consumer the route's `auth` verified (a token's subject, an API key's consumer,
    /// `anonymous`); never read from an unverified field.
    Consumer,
    /// A verified token's claim, as text; a token without it shares one "missing" key.
    Claim(String),
    /// The first value of a cookie of the `Cookie` field (missing → one shared "missing" key).
    Cookie(String),
}

impl KeyPart {
    /// Whether this part reads the identity `auth` verified.
    pub fn needs_identity(&self) -> bool {
        matches!(self, KeyPart::Consumer | KeyPart::Claim(_))
    }
}

/// Who a request is, as the route's `auth` verified it: what `consumer` and `claim:NAME`
/// keys, plans and upstream fields read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub consumer: Box<str>,
    /// `(name, value)` of the claims the route reads, capped.
    pub claims: Vec<(Box<str>, Box<str>)>,
}

impl Identity {
    pub fn claim(&self, name: &str) -> Option<&str> {
        self.claims.iter().find(|(n, _)| &**n == name).map(|(_, v)| &**v)
    }
}

/// Errors from [`KeySpec::parse`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("empty key: expected e.g. \"client_ip\" or \"route, header:x-api-key\"")]
    Empty,
    #[error(
        "unknown key part {0:?}: expected route, client_ip, path, tls_client, consumer, header:NAME, query:NAME, \
         cookie:NAME or claim:NAME"
    )]
    Unknown(String),
    #[error("invalid header name {0:?}")]
    Header(String),
    #[error("empty query parameter name")]
    Query,
    #[error("empty claim name")]
    Claim,
    #[error("empty cookie name")]
    Cookie,
}

impl FromStr for KeyPart {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, KeyError> {
        let s = s.trim();
        if let Some(name) = s.strip_prefix("header:") {
            let name = name.trim();
            return HeaderName::from_bytes(name.as_bytes())
                .map(KeyPart::Header)
                .map_err(|_| KeyError::Header(name.to_owned()));
        }
        if let Some(name) = s.strip_prefix("query:") {
            let name = name.trim();
            if name.is_empty() {
                return Err(KeyError::Query);
            }
            return Ok(KeyPart::Query(name.to_owned()));
        }
        if let Some(name) = s.strip_prefix("cookie:") {
            let name = name.trim();
            if name.is_empty() {
                return Err(KeyError::Cookie);
            }
            return Ok(KeyPart::Cookie(name.to_owned()));
        }
        if let Some(name) = s.strip_prefix("claim:") {
            let name = name.trim();
            if name.is_empty() {
                return Err(KeyError::Claim);
            }
            return Ok(KeyPart::Claim(name.to_owned()));
        }
        match s {
            "consumer" => Ok(KeyPart::Consumer),
            "route" => Ok(KeyPart::Route),
            "client_ip" => Ok(KeyPart::ClientIp),
            "path" => Ok(KeyPart::Path),
            "tls_client" => Ok(KeyPart::TlsClient),
            other => Err(KeyError::Unknown(other.to_owned())),
        }
    }
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::Route => f.write_str("route"),
            KeyPart::ClientIp => f.write_str("client_ip"),
            KeyPart::Header(h) => write!(f, "header:{h}"),
            KeyPart::Query(q) => write!(f, "query:{q}"),
            KeyPart::Path => f.write_str("path"),
            KeyPart::TlsClient => f.write_str("tls_client"),
            KeyPart::Consumer => f.write_str("consumer"),
            KeyPart::Claim(c) => write!(f, "claim:{c}"),
            KeyPart::Cookie(c) => write!(f, "cookie:{c}"),
        }
    }
}

/// An ordered list of key parts (never empty).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeySpec(Vec<KeyPart>);

/// 128-bit digest of the key material; request bytes never stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyHash(pub u128);

impl KeySpec {
    /// Parses `"client_ip"` or a comma-separated list like `"route, header:x-api-key"`.
    ///
    /// # Errors
    /// [`KeyError`] for an empty list, an unknown part or an invalid header name.
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        let parts = s.split(',').map(str::parse).collect::<Result<Vec<KeyPart>, _>>()?;
        Self::new(parts)
    }

    /// A spec from parts (as from a YAML list).
    ///
    /// # Errors
    /// [`KeyError::Empty`] if `parts` is empty.
    pub fn new(parts: Vec<KeyPart>) -> Result<Self, KeyError> {
        if parts.is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(Self(parts))
    }

    pub fn parts(&self) -> &[KeyPart] {
        &self.0
    }
}

/// The encoding of one key, part by part in its spec's order (see the module docs); the
/// `request_key` room feeds it what a request holds for each part.
///
/// Short material (a route and a client IP take 30 bytes) is gathered on the stack and hashed
/// in one call, which skips XXH3's streaming state (its set-up and finish); material that
/// outgrows the buffer continues in that state. Both give the same digest: XXH3's streaming
/// form is specified to equal the one-shot hash of the concatenated input.
pub struct KeyMaterial {
    buf: [u8; MATERIAL_INLINE],
    len: usize,
    spilled: Option<Xxh3>,
}

impl Default for KeyMaterial {
    fn default() -> Self {
        KeyMaterial::new()
    }
}

impl KeyMaterial {
    #[inline(always)]
    pub fn new() -> KeyMaterial {
        // A constant, domain included: built where it is used, not built and then moved (with
        // its streaming state, ~770 bytes: measured, a `memcpy` of 100 instructions a key).
        KeyMaterial { buf: START, len: DOMAIN.len(), spilled: None }
    }

    #[inline]
    pub fn route(&mut self, route: &str) {
        self.update(&[0x01]);
        bytes(self, route.as_bytes());
    }

    #[inline]
    pub fn client_ip(&mut self, ip: IpAddr) {
        self.update(&[0x02]);
        match ip.to_canonical() {
            IpAddr::V4(a) => {
                self.update(&[0x04]);
                self.update(&a.octets());
            }
            IpAddr::V6(a) => {
                self.update(&[0x06]);
                self.update(&a.octets());
            }
        }
    }

    /// All values of header `name`, in order (none: the shared "missing" key).
    #[inline]
    pub fn header<'v>(&mut self, name: &HeaderName, values: impl Iterator<Item = &'v [u8]>) {
        self.update(&[0x03]);
        bytes(self, name.as_str().as_bytes());
        let mut values = values.peekable();
        if values.peek().is_none() {
            self.update(&[0x00]);
            return;
        }
        self.update(&[0x01]);
        // One budget for all values: repeating a header cannot grow the material.
        let mut budget = MAX_PART_BYTES;
        for v in values {
            let v = &v[..v.len().min(budget)];
            budget -= v.len();
            bytes(self, v);
        }
        self.update(&END);
    }

    /// Query parameter `name`'s first value, decoded (`None`: the shared "missing" key).
    #[inline]
    pub fn query(&mut self, name: &str, value: Option<&[u8]>) {
        self.update(&[0x04]);
        bytes(self, name.as_bytes());
        self.present(value);
    }

    #[inline]
    pub fn path(&mut self, path: &str) {
        self.update(&[0x05]);
        bytes(self, path.as_bytes());
    }

    #[inline]
    pub fn tls_client(&mut self, id: Option<&str>) {
        self.update(&[0x06]);
        self.present(id.map(str::as_bytes));
    }

    #[inline]
    pub fn consumer(&mut self, consumer: Option<&str>) {
        self.update(&[0x07]);
        self.present(consumer.map(str::as_bytes));
    }

    /// The first cookie named `name` (`None`: the shared "missing" key).
    #[inline]
    pub fn cookie(&mut self, name: &str, value: Option<&[u8]>) {
        self.update(&[0x09]);
        bytes(self, name.as_bytes());
        self.present(value);
    }

    #[inline]
    pub fn claim(&mut self, name: &str, value: Option<&str>) {
        self.update(&[0x08]);
        bytes(self, name.as_bytes());
        self.present(value.map(str::as_bytes));
    }

    /// `0x00` for a missing value, else `0x01` and the value.
    #[inline]
    fn present(&mut self, value: Option<&[u8]>) {
        match value {
            None => self.update(&[0x00]),
            Some(v) => {
                self.update(&[0x01]);
                bytes(self, v);
            }
        }
    }

    #[inline]
    pub fn finish(&self) -> KeyHash {
        KeyHash(self.digest())
    }
}

/// A key's material before its parts: the domain.
const START: [u8; MATERIAL_INLINE] = {
    let mut b = [0u8; MATERIAL_INLINE];
    let mut i = 0;
    while i < DOMAIN.len() {
        b[i] = DOMAIN[i];
        i += 1;
    }
    b
};

/// Material up to this many bytes is hashed in one call (a route and a client IP take 30; the
/// buffer is zeroed per key, so it is not larger than most keys need).
const MATERIAL_INLINE: usize = 128;

impl KeyMaterial {
    #[inline]
    fn update(&mut self, b: &[u8]) {
        if let Some(h) = &mut self.spilled {
            h.update(b);
            return;
        }
        match self.buf.get_mut(self.len..self.len + b.len()) {
            Some(room) => {
                room.copy_from_slice(b);
                self.len += b.len();
            }
            None => self.spill(b),
        }
    }

    #[cold]
    fn spill(&mut self, b: &[u8]) {
        let mut h = Xxh3::new();
        h.update(&self.buf[..self.len]);
        h.update(b);
        self.spilled = Some(h);
    }

    #[inline]
    fn digest(&self) -> u128 {
        match &self.spilled {
            Some(h) => h.digest128(),
            None => xxh3_128(&self.buf[..self.len]),
        }
    }
}

/// Length-prefixed, capped material: the prefix keeps `[a, bc]` apart from `[ab, c]`.
fn bytes(h: &mut KeyMaterial, b: &[u8]) {
    let b = &b[..b.len().min(MAX_PART_BYTES)];
    // b.len() <= 1024, so the cast is lossless.
    h.update(&(b.len() as u32).to_le_bytes());
    h.update(b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_single_part_and_lists() {
        assert_eq!(KeySpec::parse("client_ip").expect("ok").parts(), &[KeyPart::ClientIp]);
        let spec = KeySpec::parse(" route, header:X-Api-Key ,query:user,path").expect("ok");
        assert_eq!(
            spec.parts(),
            &[
                KeyPart::Route,
                KeyPart::Header(HeaderName::from_static("x-api-key")),
                KeyPart::Query("user".into()),
                KeyPart::Path,
            ]
        );
        assert_eq!(KeySpec::parse("ip"), Err(KeyError::Unknown("ip".into())));
        assert_eq!(KeySpec::parse("query:"), Err(KeyError::Query));
        assert!(matches!(KeySpec::parse("header:bad name"), Err(KeyError::Header(_))));
        assert_eq!(KeySpec::new(vec![]), Err(KeyError::Empty));
    }

    #[test]
    fn the_material_is_the_documented_encoding() {
        let mut k = KeyMaterial::new();
        k.route("r");
        k.client_ip("::ffff:10.0.0.1".parse().unwrap());
        k.header(&HeaderName::from_static("x-api-key"), [&b"k1"[..], b"k2"].into_iter());
        k.query("user", Some(b"bob"));
        k.query("none", None);
        k.path("/a");
        k.tls_client(None);
        k.consumer(Some("c"));
        k.claim("t", None);
        k.cookie("s", Some(b"v"));
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
        m.extend([0x06, 0x00]);
        m.extend([0x07, 0x01, 1, 0, 0, 0, b'c']);
        m.extend([0x08, 1, 0, 0, 0, b't', 0x00]);
        m.extend([0x09, 1, 0, 0, 0, b's', 0x01, 1, 0, 0, 0, b'v']);
        assert_eq!(k.finish(), KeyHash(xxh3_128(&m)));
        // No value of a header: the "missing" marker, not an empty list.
        let mut k = KeyMaterial::new();
        k.header(&HeaderName::from_static("x"), std::iter::empty());
        let mut m: Vec<u8> = b"tollgate/key/v1".to_vec();
        m.extend([0x03, 1, 0, 0, 0, b'x', 0x00]);
        assert_eq!(k.finish(), KeyHash(xxh3_128(&m)));
    }
}
