//! Cache keys: 128-bit keyed hashes of request facts, so memory per key is fixed and a
//! client cannot aim two URLs at one key. Every piece is length-prefixed before hashing,
//! so `("ab", "c")` and `("a", "bc")` differ.

use std::hash::{BuildHasher, Hasher};

use http::header::{self, HeaderMap, HeaderName};
use http::request::Parts;

use super::policy::list_items;
use crate::config::cache::CacheKey;

/// Two independently keyed SipHash instances (std's `RandomState`): 128 bits, so an
/// accidental collision among a cache's entries is out of reach, and random keys per
/// process, so one cannot be searched for offline.
pub(super) struct Keys {
    a: std::collections::hash_map::RandomState,
    b: std::collections::hash_map::RandomState,
}

/// The hash state while one key is built.
struct KeyHasher<H> {
    a: H,
    b: H,
}

impl<H: Hasher> KeyHasher<H> {
    fn bytes(&mut self, bytes: &[u8]) {
        self.tag(bytes.len() as u64);
        self.a.write(bytes);
        self.b.write(bytes);
    }

    /// Like [`KeyHasher::bytes`] but ASCII-lowercased, through a stack buffer (no allocation).
    fn lower(&mut self, bytes: &[u8]) {
        self.tag(bytes.len() as u64);
        let mut buf = [0u8; 64];
        for chunk in bytes.chunks(buf.len()) {
            let out = &mut buf[..chunk.len()];
            out.copy_from_slice(chunk);
            out.make_ascii_lowercase();
            self.a.write(out);
            self.b.write(out);
        }
    }

    /// Bytes without their length (the caller tagged the length of the whole).
    fn raw(&mut self, bytes: &[u8]) {
        self.a.write(bytes);
        self.b.write(bytes);
    }

    fn tag(&mut self, n: u64) {
        self.a.write_u64(n);
        self.b.write_u64(n);
    }

    fn finish(self) -> u128 {
        (u128::from(self.a.finish()) << 64) | u128::from(self.b.finish())
    }
}

impl Keys {
    pub fn new() -> Keys {
        Keys { a: Default::default(), b: Default::default() }
    }

    fn hasher(&self) -> KeyHasher<impl Hasher> {
        KeyHasher { a: self.a.build_hasher(), b: self.b.build_hasher() }
    }

    /// The primary key: method family (HEAD shares GET's), host without port, path and
    /// query (as `spec` keeps it), and the request fields `spec` names. The request's
    /// credentials are part of every variant's key ([`Keys::variant`]), so a copy stored for
    /// one user can only ever answer the same user, and one URL's copies go together (an
    /// unsafe method or a purge drops them all). `None` for methods that are never cached.
    pub fn primary(&self, req: &Parts, spec: &CacheKey) -> Option<u128> {
        if req.method != http::Method::GET && req.method != http::Method::HEAD {
            return None;
        }
        Some(self.url_key(host(req), req.uri.path(), req.uri.query(), &req.headers, spec))
    }

    /// The primary key of a URL as a GET to it would have it (an unsafe method's own URL, its
    /// `Location`, or a purge's).
    pub fn url_key(&self, host: &str, path: &str, query: Option<&str>, headers: &HeaderMap, spec: &CacheKey) -> u128 {
        let mut h = self.hasher();
        h.bytes(b"GET");
        h.lower(host.as_bytes());
        if spec.query && spec.ignore_query.is_empty() {
            // The same bytes as `path?query` whole: a route keyed as the stale store keys.
            match query {
                Some(q) => {
                    h.tag((path.len() + 1 + q.len()) as u64);
                    h.raw(path.as_bytes());
                    h.raw(b"?");
                    h.raw(q.as_bytes());
                }
                None => h.bytes(if path.is_empty() { b"/" } else { path.as_bytes() }),
            }
        } else {
            h.bytes(if path.is_empty() { b"/" } else { path.as_bytes() });
            if spec.query {
                for pair in kept_params(query, spec) {
                    h.bytes(pair.as_bytes());
                }
            }
        }
        for name in &spec.headers {
            field(&mut h, headers, name);
        }
        h.finish()
    }

    /// The secondary key of a variant: the request's credentials, then the names in the
    /// response's `Vary` with the request's normalised values of those fields.
    pub fn variant(&self, vary: &[HeaderName], headers: &HeaderMap) -> u128 {
        let mut h = self.hasher();
        for name in [header::AUTHORIZATION, header::COOKIE] {
            field(&mut h, headers, &name);
        }
        h.tag(vary.len() as u64);
        for name in vary {
            h.bytes(name.as_str().as_bytes());
            field(&mut h, headers, name);
        }
        h.finish()
    }
}

/// The query's `name=value` pairs that `spec` keeps, in their order.
fn kept_params<'a>(query: Option<&'a str>, spec: &'a CacheKey) -> impl Iterator<Item = &'a str> {
    query.unwrap_or("").split('&').filter(move |pair| {
        let name = pair.split('=').next().unwrap_or(pair);
        !pair.is_empty() && !spec.ignore_query.iter().any(|i| i == name)
    })
}

/// The URL a primary key stands for, as the admin listener's purge names it:
/// `host/path?query` (host lower-case without port, the query as the key keeps it).
pub(super) fn keyed_url(req: &Parts, spec: &CacheKey) -> String {
    let host = host(req).to_ascii_lowercase();
    let path = req.uri.path();
    let mut url = String::with_capacity(host.len() + path.len() + req.uri.query().map_or(0, |q| q.len() + 1));
    url.push_str(&host);
    url.push_str(path);
    if spec.query {
        let mut first = true;
        for pair in kept_params(req.uri.query(), spec) {
            url.push(if first { '?' } else { '&' });
            url.push_str(pair);
            first = false;
        }
    }
    url
}

/// Hashes one request field, normalised as RFC 9111 §4.1 allows: field lines combined, list
/// items trimmed of whitespace (outside quoted strings), so `a, b` matches `a,b` and two lines
/// `a` and `b`. An absent field differs from an empty one.
fn field<H: Hasher>(h: &mut KeyHasher<H>, headers: &HeaderMap, name: &HeaderName) {
    let mut lines = headers.get_all(name).iter().peekable();
    if lines.peek().is_none() {
        h.tag(0);
        return;
    }
    h.tag(1);
    for line in lines {
        for item in list_items(line.as_bytes()) {
            h.bytes(item);
        }
    }
    h.tag(u64::MAX);
}

/// The request's host without port: the URI's authority (absolute-form, HTTP/2) or `Host`.
pub(super) fn host(req: &Parts) -> &str {
    let raw = match req.uri.authority() {
        Some(a) => a.as_str(),
        None => req.headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or(""),
    };
    let raw = raw.rsplit('@').next().unwrap_or(raw);
    let host = if raw.starts_with('[') {
        raw.find(']').map_or(raw, |i| &raw[..=i])
    } else {
        raw.split(':').next().unwrap_or(raw)
    };
    // `example.com.` names the same host as `example.com`.
    host.strip_suffix('.').unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    fn parts(uri: &str, host: &str) -> Parts {
        let mut b = Request::get(uri);
        if !host.is_empty() {
            b = b.header(header::HOST, host);
        }
        b.body(()).map(|r| r.into_parts().0).expect("valid test request")
    }

    fn all() -> CacheKey {
        CacheKey { query: true, ..CacheKey::default() }
    }

    #[test]
    fn ignored_parameters_and_a_left_out_query_share_a_key() {
        let k = Keys::new();
        let spec = CacheKey { ignore_query: vec!["utm_source".into()], ..all() };
        let base = k.primary(&parts("/a?b=1", "example.com"), &spec);
        assert_eq!(k.primary(&parts("/a?b=1&utm_source=x", "example.com"), &spec), base);
        assert_eq!(k.primary(&parts("/a?utm_source=y&b=1", "example.com"), &spec), base);
        assert_ne!(k.primary(&parts("/a?b=2&utm_source=x", "example.com"), &spec), base);
        let no_query = CacheKey { query: false, ..CacheKey::default() };
        assert_eq!(
            k.primary(&parts("/a?b=1", "example.com"), &no_query),
            k.primary(&parts("/a", "example.com"), &no_query)
        );
        assert_eq!(keyed_url(&parts("/a?utm_source=y&b=1", "Example.com:80"), &spec), "example.com/a?b=1");
        // The whole query hashed as one piece: the stale store's key.
        assert_eq!(
            k.primary(&parts("/a?b=1", "example.com"), &all()),
            Some(k.url_key("example.com", "/a", Some("b=1"), &HeaderMap::new(), &all()))
        );
    }

    #[test]
    fn host_is_lowercased_without_port() {
        let k = Keys::new();
        let base = k.primary(&parts("/a?b=1", "example.com"), &all());
        assert_eq!(k.primary(&parts("/a?b=1", "EXAMPLE.com:8080"), &all()), base);
        assert_eq!(k.primary(&parts("/a?b=1", "example.com."), &all()), base);
        assert_eq!(k.primary(&parts("http://Example.COM:81/a?b=1", ""), &all()), base);
        assert_ne!(k.primary(&parts("/a?b=2", "example.com"), &all()), base);
        assert_ne!(k.primary(&parts("/A?b=1", "example.com"), &all()), base);
        assert_ne!(k.primary(&parts("/a?b=1", "example.org"), &all()), base);
    }

    #[test]
    fn ipv6_host_keeps_brackets() {
        let k = Keys::new();
        assert_eq!(k.primary(&parts("/", "[::1]:8080"), &all()), k.primary(&parts("/", "[::1]"), &all()));
        assert_ne!(k.primary(&parts("/", "[::1]"), &all()), k.primary(&parts("/", "[::2]"), &all()));
    }

    #[test]
    fn variant_values_are_normalised() {
        let k = Keys::new();
        let vary = [header::ACCEPT_ENCODING];
        let mut a = HeaderMap::new();
        a.insert(header::ACCEPT_ENCODING, "gzip, br".parse().expect("value"));
        let mut b = HeaderMap::new();
        b.append(header::ACCEPT_ENCODING, "gzip".parse().expect("value"));
        b.append(header::ACCEPT_ENCODING, " br".parse().expect("value"));
        let mut empty = HeaderMap::new();
        empty.insert(header::ACCEPT_ENCODING, "".parse().expect("value"));
        assert_eq!(k.variant(&vary, &a), k.variant(&vary, &b));
        assert_ne!(k.variant(&vary, &a), k.variant(&vary, &HeaderMap::new()));
        assert_ne!(k.variant(&vary, &empty), k.variant(&vary, &HeaderMap::new()));
        assert_ne!(k.variant(&vary, &a), k.variant(&[], &a));
    }
}
