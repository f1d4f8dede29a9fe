//! `admin:` — the admin listener's address, the bearer token its write endpoints need, and
//! the host names it answers besides its own address and `localhost`. Two forms:
//! `admin: 127.0.0.1:9901` (as before), or a mapping
//! `admin: { addr: ..., token: ..., token_file: ..., allowed_hosts: [...] }`. `token_file` wins over `token` (a file
//! keeps the secret out of the config and out of `/config`); giving both is a warning.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use super::{key, Invalid, Seg};

/// A token shorter than this is refused: it would be guessed.
pub const MIN_TOKEN_BYTES: usize = 16;

/// A token file larger than this is not a token.
const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// `admin:` as written.
pub(super) struct RawAdmin {
    pub(super) addr: SocketAddr,
    token: Option<String>,
    token_file: Option<PathBuf>,
    allowed_hosts: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdminMap {
    addr: SocketAddr,
    token: Option<String>,
    token_file: Option<PathBuf>,
    #[serde(default)]
    allowed_hosts: Vec<String>,
}

impl<'de> Deserialize<'de> for RawAdmin {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawAdmin;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "an address (127.0.0.1:9901) or { addr: ADDR, token: TEXT, token_file: PATH, allowed_hosts: [NAME] }",
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawAdmin, E> {
                let addr = v.parse().map_err(|_| E::custom(format!("invalid socket address {v:?}")))?;
                Ok(RawAdmin { addr, token: None, token_file: None, allowed_hosts: Vec::new() })
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<RawAdmin, A::Error> {
                let m = RawAdminMap::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(RawAdmin { addr: m.addr, token: m.token, token_file: m.token_file, allowed_hosts: m.allowed_hosts })
            }
        }
        d.deserialize_any(V)
    }
}

/// Where the admin token comes from, validated; the file is read by [`load_token`].
#[derive(Clone, PartialEq, Eq)]
pub enum TokenSource {
    Inline(AdminToken),
    File(PathBuf),
}

impl fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenSource::Inline(_) => f.write_str("Inline(***)"),
            TokenSource::File(p) => write!(f, "File({})", p.display()),
        }
    }
}

/// The bearer token of the admin listener's write endpoints. Never printed; compared in
/// constant time ([`AdminToken::admits`]).
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

impl AdminToken {
    /// Whether `authorization` (a request's `Authorization` value) is `Bearer <this token>`.
    /// Both sides are hashed (SHA-256) and the digests compared in constant time, so neither
    /// the token's bytes nor its length show in the time taken.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let Some(value) = authorization else { return false };
        let presented = match value.get(..7) {
            Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => value[7..].trim_ascii(),
            _ => return false,
        };
        let want = ring::digest::digest(&ring::digest::SHA256, self.0.as_bytes());
        let got = ring::digest::digest(&ring::digest::SHA256, presented);
        want.as_ref().iter().zip(got.as_ref()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

/// `admin:`, validated: where it listens, where its token comes from, and the names besides
/// its own address and `localhost` that a request's `Host` may give.
pub(super) struct Admin {
    pub(super) addr: SocketAddr,
    pub(super) token: Option<TokenSource>,
    pub(super) hosts: Vec<String>,
}

impl RawAdmin {
    /// The address, the token's source and the allowed host names (lowercase, without a
    /// final dot).
    pub(super) fn validate(self, warnings: &mut Vec<String>) -> Result<Admin, Invalid> {
        let at = |field: &str| vec![key("admin"), key(field)];
        let mut hosts = Vec::with_capacity(self.allowed_hosts.len());
        for (i, name) in self.allowed_hosts.iter().enumerate() {
            let name = check_host(name).map_err(|m| (vec![key("admin"), key("allowed_hosts"), Seg::Index(i)], m))?;
            hosts.push(name);
        }
        if let Some(t) = &self.token {
            check_token(t).map_err(|m| (at("token"), m))?;
        }
        let source = match (self.token, self.token_file) {
            (Some(_), Some(file)) => {
                warnings.push("admin: both `token` and `token_file` are given; `token_file` is used".to_owned());
                Some(TokenSource::File(file))
            }
            (None, Some(file)) => Some(TokenSource::File(file)),
            (Some(t), None) => Some(TokenSource::Inline(AdminToken(t))),
            (None, None) => None,
        };
        Ok(Admin { addr: self.addr, token: source, hosts })
    }
}

/// A host name a request's `Host` may give the admin listener: letters, digits, `-` and `.`
/// (no port: any port is accepted, a tunnel's too), lowercased, without a final dot.
fn check_host(name: &str) -> Result<String, String> {
    let bare = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    if bare.contains(':') {
        return Err(format!("`{name}`: give the name without a port (any port is accepted)"));
    }
    let label_ok =
        |l: &str| !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if bare.is_empty() || bare.len() > 253 || !bare.split('.').all(label_ok) {
        return Err(format!("`{name}` is not a host name (letters, digits, `-` and `.`)"));
    }
    Ok(bare)
}

/// A token is at least [`MIN_TOKEN_BYTES`] of visible ASCII (it travels in a header).
fn check_token(t: &str) -> Result<(), String> {
    if t.len() < MIN_TOKEN_BYTES {
        return Err(format!("the admin token must be at least {MIN_TOKEN_BYTES} bytes long"));
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the admin token must be visible ASCII (no spaces or control characters)".to_owned());
    }
    Ok(())
}

/// The token from its source; a relative `token_file` is resolved against `base` (the config's
/// directory), and its content trimmed of surrounding white space (a trailing newline).
pub(super) fn load_token(source: &TokenSource, base: &Path) -> Result<AdminToken, Invalid> {
    let path = match source {
        TokenSource::Inline(t) => return Ok(t.clone()),
        TokenSource::File(p) if p.is_relative() => base.join(p),
        TokenSource::File(p) => p.clone(),
    };
    let at = || vec![key("admin"), key("token_file")];
    let read = || -> std::io::Result<String> {
        use std::io::Read;
        let mut text = String::new();
        std::fs::File::open(&path)?.take(MAX_TOKEN_FILE_BYTES).read_to_string(&mut text)?;
        Ok(text)
    };
    let text = read().map_err(|e| (at(), format!("cannot read {}: {e}", path.display())))?;
    let token = text.trim();
    check_token(token).map_err(|m| (at(), format!("{}: {m}", path.display())))?;
    Ok(AdminToken(token.to_owned()))
}

/// Why an admin listener must not run as configured: bound off loopback without a token, its
/// write endpoints would have no protection but the network's. `tollgate check` refuses it.
pub fn exposure(addr: Option<SocketAddr>, token: Option<&AdminToken>) -> Option<String> {
    let addr = addr?;
    if addr.ip().is_loopback() || token.is_some() {
        return None;
    }
    Some(format!(
        "the admin listener is bound to {addr}, off loopback, without a token: give it `token_file` (or `token`) \
         so that only its holder can reset limits, or bind it to 127.0.0.1"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_token_is_admitted_only_when_it_matches() {
        let t = AdminToken("0123456789abcdef-secret".to_owned());
        assert!(t.admits(Some(b"Bearer 0123456789abcdef-secret")));
        assert!(t.admits(Some(b"bearer 0123456789abcdef-secret ")));
        for wrong in [
            &b"Bearer 0123456789abcdef-secreT"[..],
            b"Bearer ",
            b"Basic 0123456789abcdef-secret",
            b"",
            b"0123456789abcdef-secret",
        ] {
            assert!(!t.admits(Some(wrong)), "{}", String::from_utf8_lossy(wrong));
        }
        assert!(!t.admits(None));
        assert_eq!(format!("{t:?}"), "AdminToken(***)");
    }

    #[test]
    fn only_an_admin_listener_off_loopback_without_a_token_is_exposed() {
        let t = AdminToken("0123456789abcdef".to_owned());
        assert!(exposure(Some("127.0.0.1:9901".parse().unwrap()), None).is_none());
        assert!(exposure(Some("[::1]:9901".parse().unwrap()), None).is_none());
        assert!(exposure(Some("0.0.0.0:9901".parse().unwrap()), Some(&t)).is_none());
        assert!(exposure(Some("0.0.0.0:9901".parse().unwrap()), None).is_some_and(|m| m.contains("token_file")));
        assert!(exposure(None, None).is_none());
    }
}
