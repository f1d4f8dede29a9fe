//! The request's target, decided once, before routing: one authority and one path, so that
//! routing, limit keys, forwarding and the stale-copy key all read the same values. A target
//! that could be read two ways is refused with `400` rather than guessed at.
//!
//! # Authority (RFC 9112 §3.2, RFC 9113 §8.3.1)
//! - The authority is the target's (absolute-form, HTTP/2 `:authority`) or else the `Host`
//!   field. Two `Host` fields, or a `Host` that names another authority than the target: 400.
//!   HTTP/1.1 without any: 400.
//! - It must be `host[:port]`: a name of letters, digits, `-`, `_`, `.`, an IPv4 address or a
//!   bracketed IPv6 address; a port of digits. No user info.
//! - Canonical form: lower case, no trailing dot, no empty port. The canonical value is put
//!   in `Host` (HTTP/2 requests get one), and that field is what every room reads.
//!
//! # Path
//! - `%XX` of an unreserved character (`A-Z a-z 0-9 - . _ ~`) is decoded; other escapes stay,
//!   with upper-case hex. `%2F` (`/`), `%5C` (`\`), `%00`, a raw `\` and a malformed escape: 400.
//! - Empty segments are merged (`//api` → `/api`); `.` and `..` segments are resolved
//!   (`/x/../api/` → `/api/`); a `..` above the root: 400.
//! - The normalised path is what routes match, what `path` keys hash and what is forwarded.
//! - Path parameters (`;v=1`) are forwarded as sent, but routes and `path` keys see each
//!   segment without them (`/api;v=1/users` is matched as `/api/users`), so a server that
//!   ignores them (Tomcat, Spring, Jetty) never receives a path that a stricter route would
//!   have taken. A `.` or `..` segment with parameters: 400.

use std::borrow::Cow;

use http::header::{HeaderMap, HeaderValue, HOST};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Method, Uri, Version};

use crate::answer::Error;

/// The normalised target of a request whose head [`decide`] accepted.
#[derive(Debug, Default)]
pub struct Target {
    /// The path routes match and `path` keys hash, when it is not `uri.path()` itself (the
    /// request had path parameters).
    matched: Option<Box<str>>,
}

impl Target {
    /// The path routes match: `parts.uri.path()` unless it had path parameters.
    #[inline]
    pub fn path<'a>(&'a self, parts: &'a Parts) -> &'a str {
        self.matched.as_deref().unwrap_or_else(|| parts.uri.path())
    }

    /// Sends the request on with `path` (a route's rewrite) and its own query: the upstream
    /// and the stale-copy key see the new path, while limit keys and `{path}` go on reading
    /// the one the client asked for ([`Target::path`]).
    ///
    /// # Errors
    /// `path` is not a valid request target.
    pub fn rewrite(&mut self, parts: &mut Parts, path: &str) -> Result<(), Error> {
        const BAD: Error = Error::BadRequest("the rewritten path is not a valid request target");
        let pq = match parts.uri.query() {
            Some(q) => PathAndQuery::try_from(format!("{path}?{q}")),
            None => PathAndQuery::try_from(path),
        }
        .map_err(|_| BAD)?;
        let mut uri = parts.uri.clone().into_parts();
        uri.path_and_query = Some(pq);
        let uri = Uri::from_parts(uri).map_err(|_| BAD)?;
        if self.matched.is_none() {
            self.matched = Some(parts.uri.path().into());
        }
        parts.uri = uri;
        Ok(())
    }
}

/// Decides the authority and the path of `parts`, rewriting both to their canonical form.
///
/// # Errors
/// [`Error::BadRequest`] for a target that is ambiguous or malformed (see the module docs).
pub fn decide(parts: &mut Parts) -> Result<Target, Error> {
    decide_authority(parts).map_err(Error::BadRequest)?;
    decide_path(parts).map_err(Error::BadRequest)
}

/// The host routes match and the stale-copy key uses: the canonical `Host` without port.
pub fn host(headers: &HeaderMap) -> Option<&str> {
    headers.get(HOST).and_then(|v| v.to_str().ok()).map(strip_port)
}

/// `host[:port]` → `host`; an IPv6 literal keeps its brackets.
pub fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.find(']').map_or(authority, |end| &authority[..=end]);
    }
    authority.rsplit_once(':').map_or(authority, |(host, _)| host)
}

fn decide_authority(parts: &mut Parts) -> Result<(), &'static str> {
    let mut fields = parts.headers.get_all(HOST).iter();
    let field = fields.next().map(HeaderValue::as_bytes);
    if fields.next().is_some() {
        return Err("the request has two Host fields");
    }
    let target = parts.uri.authority().map(|a| a.as_str().as_bytes());
    let chosen = match (target, field) {
        // The common case: origin-form with a Host that is already canonical.
        (None, Some(f)) => match canonical(f)? {
            Cow::Borrowed(_) => return Ok(()),
            owned => owned,
        },
        (Some(t), Some(f)) => {
            let t = canonical(t)?;
            if canonical(f)? != t {
                return Err("the Host field names another authority than the request target");
            }
            if f == t.as_ref() {
                return Ok(());
            }
            t
        }
        (Some(t), None) => canonical(t)?,
        (None, None) if parts.version == Version::HTTP_11 => return Err("an HTTP/1.1 request needs a Host field"),
        (None, None) => return Ok(()),
    };
    let value = HeaderValue::from_bytes(&chosen).map_err(|_| "the authority is not a valid Host value")?;
    parts.headers.insert(HOST, value);
    Ok(())
}

const INVALID: u8 = 1;
const UPPER: u8 = 2;
const DOT: u8 = 4;
const DOUBLE_DOT: u8 = DOT << 2;

/// Byte classes of a host name: letters, digits, `-` and `_` are 0.
const HOST_BYTES: [u8; 256] = {
    let mut t = [INVALID; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        t[c] = match b {
            b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' => 0,
            b'A'..=b'Z' => UPPER,
            b'.' => DOT,
            _ => INVALID,
        };
        c += 1;
    }
    t
};

/// The canonical form of an authority (see the module docs); borrowed when already canonical.
/// Branch-free over the host's bytes through a table: this runs for every request.
fn canonical(raw: &[u8]) -> Result<Cow<'_, [u8]>, &'static str> {
    const BAD: &str = "the authority is not a valid host[:port]";
    if raw.first() == Some(&b'[') {
        return canonical_ipv6(raw);
    }
    // One pass: the host's bytes are classified up to the first `:`.
    let (mut seen, mut prev, mut colon) = (0u8, DOT, raw.len());
    for (i, &c) in raw.iter().enumerate() {
        if c == b':' {
            colon = i;
            break;
        }
        let class = HOST_BYTES[usize::from(c)];
        seen |= class | ((prev & class) << 2);
        prev = class;
    }
    let (host, port) = (&raw[..colon], raw.get(colon + 1..).unwrap_or(&[]));
    let bad_port = port.len() > 5 || !port.iter().all(u8::is_ascii_digit);
    if host.is_empty() || host[0] == b'.' || seen & (INVALID | DOUBLE_DOT) != 0 || bad_port {
        return Err(BAD);
    }
    let dot = prev == DOT;
    let empty_port = colon + 1 == raw.len();
    if seen & UPPER == 0 && !dot && !empty_port {
        return Ok(Cow::Borrowed(raw));
    }
    let mut out = if dot { &host[..host.len() - 1] } else { host }.to_ascii_lowercase();
    if !port.is_empty() {
        out.push(b':');
        out.extend_from_slice(port);
    }
    Ok(Cow::Owned(out))
}

/// `[v6]` or `[v6]:port`, lower-cased.
fn canonical_ipv6(raw: &[u8]) -> Result<Cow<'_, [u8]>, &'static str> {
    const BAD: &str = "the authority is not a valid host[:port]";
    let end = raw.iter().position(|&c| c == b']').ok_or(BAD)?;
    let inner = &raw[1..end];
    let port = match &raw[end + 1..] {
        b"" | b":" => &[][..],
        rest => rest.strip_prefix(b":").ok_or(BAD)?,
    };
    if inner.is_empty()
        || !inner.iter().all(|&c| c.is_ascii_hexdigit() || c == b':' || c == b'.')
        || port.len() > 5
        || !port.iter().all(u8::is_ascii_digit)
    {
        return Err(BAD);
    }
    if !raw.iter().any(u8::is_ascii_uppercase) && raw.last() != Some(&b':') {
        return Ok(Cow::Borrowed(raw));
    }
    let mut out = raw[..=end].to_ascii_lowercase();
    if !port.is_empty() {
        out.push(b':');
        out.extend_from_slice(port);
    }
    Ok(Cow::Owned(out))
}

fn decide_path(parts: &mut Parts) -> Result<Target, &'static str> {
    let path = parts.uri.path();
    if !path.starts_with('/') {
        // `OPTIONS *` is the one target that is not a path; no route matches it.
        return if path == "*" && parts.method == Method::OPTIONS { Ok(Target::default()) } else { Err(BAD_PATH) };
    }
    let bytes = path.as_bytes();
    let mut simple = true;
    let mut params = false;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'%' | b'\\' => simple = false,
            b';' => params = true,
            b'/' if matches!(bytes.get(i + 1), Some(b'/' | b'.')) => simple = false,
            _ => {}
        }
    }
    if !simple {
        let normal = normalize(path)?;
        if normal != path {
            rewrite_path(&mut parts.uri, &normal)?;
        }
    }
    if !params {
        return Ok(Target::default());
    }
    Ok(Target { matched: Some(without_params(parts.uri.path()).into_boxed_str()) })
}

/// The normalised `path` as routes see it: each segment without its parameters, and the
/// segments left empty by that merged away as `//` is (`/;x/api` is `/api`, as a server
/// that drops parameters reads it); a last segment left empty keeps its slash.
fn without_params(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let segments = path.split('/').skip(1);
    let mut trailing = false;
    for seg in segments {
        let bare = seg.split(';').next().unwrap_or("");
        trailing = bare.is_empty();
        if !trailing {
            out.push('/');
            out.push_str(bare);
        }
    }
    if out.is_empty() || trailing {
        out.push('/');
    }
    out
}

const BAD_PATH: &str = "the request target is not a path";

/// The normalised path (see the module docs).
fn normalize(path: &str) -> Result<String, &'static str> {
    let mut out = String::with_capacity(path.len());
    // Start offsets in `out` of the segments kept, so `..` can drop the last one.
    let mut starts: Vec<usize> = Vec::new();
    let segments: Vec<&str> = path[1..].split('/').collect();
    let last = segments.len() - 1;
    let mut trailing = false;
    for (i, raw) in segments.iter().enumerate() {
        let seg = decode_segment(raw)?;
        let bare = seg.split(';').next().unwrap_or("");
        if (bare == "." || bare == "..") && bare.len() != seg.len() {
            return Err("a dot segment of the path carries parameters");
        }
        match seg.as_ref() {
            "" | "." => trailing = i == last,
            ".." => {
                let start = starts.pop().ok_or("the path climbs above the root")?;
                out.truncate(start);
                trailing = i == last;
            }
            _ => {
                starts.push(out.len());
                out.push('/');
                out.push_str(&seg);
                trailing = false;
            }
        }
    }
    if out.is_empty() || trailing {
        out.push('/');
    }
    Ok(out)
}

/// One segment with unreserved escapes decoded and the others in upper-case hex.
fn decode_segment(raw: &str) -> Result<Cow<'_, str>, &'static str> {
    if raw.contains('\\') {
        return Err("the path contains a backslash");
    }
    if !raw.contains('%') {
        return Ok(Cow::Borrowed(raw));
    }
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let hex = |i: usize| rest.as_bytes().get(at + i).and_then(|c| char::from(*c).to_digit(16));
        let (Some(hi), Some(lo)) = (hex(1), hex(2)) else {
            return Err("the path contains a malformed %-escape");
        };
        match (hi * 16 + lo) as u8 {
            b'/' | b'\\' | 0 => return Err("the path contains an escaped slash, backslash or NUL"),
            b if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => out.push(char::from(b)),
            b => {
                out.push('%');
                out.push(char::from(b"0123456789ABCDEF"[usize::from(b >> 4)]));
                out.push(char::from(b"0123456789ABCDEF"[usize::from(b & 0xf)]));
            }
        }
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    Ok(Cow::Owned(out))
}

/// Replaces the path of `uri`, keeping its query (and dropping scheme and authority, which
/// the `Host` field now carries).
fn rewrite_path(uri: &mut Uri, path: &str) -> Result<(), &'static str> {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    *uri = Uri::from(PathAndQuery::try_from(pq).map_err(|_| BAD_PATH)?);
    Ok(())
}

#[cfg(test)]
mod tests;
