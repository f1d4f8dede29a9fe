//! The certificates tollgate obtains itself, per TLS listener: `tls.acme` (from an ACME CA
//! such as Let's Encrypt, validated over HTTP-01 or TLS-ALPN-01) and `tls.internal` (from its
//! local development CA). The serde mirror and its validation; the `acme` room gets, stores
//! and renews what these describe.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use super::units::Dur;
use super::{key, Invalid, Seg};

/// Let's Encrypt's production directory.
pub const LETSENCRYPT: &str = "https://acme-v02.api.letsencrypt.org/directory";
/// Let's Encrypt's staging directory: the same API, untrusted certificates, far higher limits.
pub const LETSENCRYPT_STAGING: &str = "https://acme-staging-v02.api.letsencrypt.org/directory";

/// The names of `tls: { internal: true }`. Not `*.localhost`: rustls, OpenSSL and browsers
/// refuse a wildcard over a single label, so `app.localhost` and the like are listed by name.
pub const INTERNAL_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// How long a local CA's certificate is valid unless `internal.lifetime` says otherwise.
pub const INTERNAL_LIFETIME: Duration = Duration::from_secs(7 * 86_400);

/// At most this many names in one certificate (Let's Encrypt's bound).
const MAX_NAMES: usize = 100;

/// `tls.acme`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAcme {
    names: Vec<RawNames>,
    email: Option<String>,
    directory: Option<String>,
    challenge: Option<RawChallenge>,
    storage: Option<PathBuf>,
    directory_ca: Option<PathBuf>,
    eab: Option<RawEab>,
}

/// One entry of `names`: a name (a certificate of its own) or a list (one certificate for all).
#[derive(Deserialize)]
#[serde(untagged)]
enum RawNames {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Clone, Copy)]
enum RawChallenge {
    #[serde(rename = "http-01")]
    Http01,
    #[serde(rename = "tls-alpn-01")]
    TlsAlpn01,
}

/// External account binding: the key id and MAC key a CA such as ZeroSSL or Google's hands
/// out with an account.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEab {
    kid: String,
    hmac_key: Option<String>,
    hmac_key_file: Option<PathBuf>,
}

/// `tls.internal`: `true`, or `{ names, lifetime, storage }`.
pub(super) struct RawInternal(Option<RawInternalMap>);

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawInternalMap {
    names: Option<Vec<String>>,
    lifetime: Option<Dur>,
    storage: Option<PathBuf>,
}

impl<'de> Deserialize<'de> for RawInternal {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Option<RawInternal>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("`true`, or { names, lifetime, storage }")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(v.then_some(RawInternal(None)))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                RawInternalMap::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|m| Some(RawInternal(Some(m))))
            }
        }
        d.deserialize_any(V)?.ok_or_else(|| de::Error::custom("`internal: false` is the default; leave it out"))
    }
}

/// How an ACME CA validates that tollgate answers for a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Challenge {
    /// `http-01`: a request to `http://NAME/.well-known/acme-challenge/TOKEN` (port 80),
    /// answered by tollgate's plain listeners before routing.
    Http01,
    /// `tls-alpn-01`: a TLS handshake on port 443 offering ALPN `acme-tls/1`, answered by the
    /// TLS listener itself.
    TlsAlpn01,
}

impl Challenge {
    pub fn as_str(self) -> &'static str {
        match self {
            Challenge::Http01 => "http-01",
            Challenge::TlsAlpn01 => "tls-alpn-01",
        }
    }
}

/// External account binding, validated; the MAC key is read at load ([`load`]).
#[derive(Clone)]
pub struct Eab {
    pub kid: String,
    /// Base64url, as the CA hands it out.
    hmac_key: Option<String>,
    pub hmac_key_file: Option<PathBuf>,
    /// The decoded MAC key (set at load).
    pub key: Option<Arc<[u8]>>,
}

impl std::fmt::Debug for Eab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eab")
            .field("kid", &self.kid)
            .field("hmac_key_file", &self.hmac_key_file)
            .finish_non_exhaustive()
    }
}

/// One ACME account's settings (shared by the certificates of a `tls.acme` block).
#[derive(Debug, Clone)]
pub struct Acme {
    /// The directory URL.
    pub directory: String,
    pub email: Option<String>,
    pub challenge: Challenge,
    /// The folder of accounts, certificates, keys and locks (shared by instances).
    pub storage: PathBuf,
    /// CA certificates that sign the directory's HTTPS certificate (a private ACME server);
    /// the system's roots otherwise.
    pub directory_ca: Option<PathBuf>,
    /// `directory_ca`, read at load.
    pub directory_roots: Option<crate::pki::Roots>,
    pub eab: Option<Eab>,
}

/// The local CA's settings.
#[derive(Debug, Clone)]
pub struct Internal {
    pub lifetime: Duration,
    pub storage: PathBuf,
}

/// Where a managed certificate comes from.
#[derive(Debug, Clone)]
pub enum CertSource {
    Acme(Arc<Acme>),
    Internal(Arc<Internal>),
}

/// A certificate tollgate obtains and renews itself.
#[derive(Debug, Clone)]
pub struct ManagedCert {
    /// Stable across restarts: its folder under the storage and its key in the SNI store.
    pub id: String,
    pub names: Vec<String>,
    pub source: CertSource,
}

impl ManagedCert {
    /// The folder its certificate and key are stored in.
    pub fn folder(&self) -> PathBuf {
        match &self.source {
            CertSource::Acme(a) => a.storage.join(&self.id),
            CertSource::Internal(i) => i.storage.join(&self.id),
        }
    }
}

/// The storage folder when none is given: `$XDG_DATA_HOME/tollgate`, else
/// `~/.local/share/tollgate`, else `tollgate-data` beside the config file.
pub fn default_storage() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = env("XDG_DATA_HOME") {
        return d.join("tollgate");
    }
    match env("HOME") {
        Some(home) => home.join(".local/share/tollgate"),
        None => PathBuf::from("tollgate-data"),
    }
}

/// The folder of the local CA under a storage folder (its root, `root.pem`, and key, `root.key`).
pub fn local_ca_folder(storage: &Path) -> PathBuf {
    storage.join("local-ca")
}

/// A short, stable, file-name-safe form of `names` (the first name, and how many more).
fn slug(names: &[String]) -> String {
    let first: String = names
        .first()
        .map(|n| n.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '_' }).collect())
        .unwrap_or_default();
    if names.len() == 1 {
        return first;
    }
    let hash = xxhash_rust::xxh3::xxh3_64(names.join(",").as_bytes());
    format!("{first}+{}-{:08x}", names.len() - 1, hash as u32)
}

/// The folder of one directory's accounts and certificates: its host, and a hash of the URL.
fn directory_slug(url: &str) -> String {
    let host = url.split("://").nth(1).unwrap_or(url).split(['/', ':']).next().unwrap_or("acme");
    let host: String = host.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-').collect();
    format!("{host}-{:08x}", xxhash_rust::xxh3::xxh3_64(url.as_bytes()) as u32)
}

/// Whether `name` is a DNS name a CA can validate (no wildcard, no IP, LDH labels).
fn dns_name(name: &str) -> Result<(), String> {
    if name.starts_with("*.") {
        return Err(format!(
            "`{name}`: a wildcard needs the DNS-01 challenge, which tollgate does not answer; list the names"
        ));
    }
    if name.parse::<std::net::IpAddr>().is_ok() {
        return Err(format!("`{name}` is an IP address; ACME certificates here are for DNS names"));
    }
    let ok = name.len() <= 253
        && name.contains('.')
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(format!("`{name}` is not a DNS name (such as www.example.com)"))
    }
}

impl RawAcme {
    /// The certificates of this block; `at` places a field under the listener's `tls.acme`.
    pub(super) fn validate(self, at: &dyn Fn(&[&str]) -> Vec<Seg>) -> Result<Vec<ManagedCert>, Invalid> {
        let directory = match self.directory.as_deref() {
            None | Some("letsencrypt") => LETSENCRYPT.to_owned(),
            Some("letsencrypt-staging") => LETSENCRYPT_STAGING.to_owned(),
            Some(url) if url.starts_with("https://") && url.parse::<http::Uri>().is_ok() => url.to_owned(),
            Some(other) => {
                return Err((
                    at(&["directory"]),
                    format!(
                        "`{other}` is not a directory; expected letsencrypt, letsencrypt-staging or an https:// URL"
                    ),
                ))
            }
        };
        if let Some(email) = &self.email {
            let ok = email.split_once('@').is_some_and(|(u, d)| !u.is_empty() && d.contains('.'))
                && !email.contains(|c: char| c.is_whitespace() || c.is_control());
            if !ok {
                return Err((at(&["email"]), format!("`{email}` is not an email address")));
            }
        }
        let eab = match self.eab {
            None => None,
            Some(e) => {
                if e.kid.trim().is_empty() {
                    return Err((at(&["eab", "kid"]), "expected the key id the CA gave".to_owned()));
                }
                match (&e.hmac_key, &e.hmac_key_file) {
                    (None, None) => {
                        return Err((at(&["eab"]), "expected `hmac_key` or `hmac_key_file`".to_owned()));
                    }
                    (Some(_), Some(_)) => {
                        return Err((
                            at(&["eab", "hmac_key"]),
                            "give `hmac_key` or `hmac_key_file`, not both".to_owned(),
                        ))
                    }
                    _ => {}
                }
                let key = match &e.hmac_key {
                    Some(k) => Some(decode_mac(k).map_err(|m| (at(&["eab", "hmac_key"]), m))?),
                    None => None,
                };
                Some(Eab { kid: e.kid, hmac_key: e.hmac_key, hmac_key_file: e.hmac_key_file, key })
            }
        };
        let acme = Arc::new(Acme {
            challenge: match self.challenge {
                None | Some(RawChallenge::Http01) => Challenge::Http01,
                Some(RawChallenge::TlsAlpn01) => Challenge::TlsAlpn01,
            },
            storage: self.storage.unwrap_or_else(default_storage),
            directory_ca: self.directory_ca,
            directory_roots: None,
            email: self.email,
            eab,
            directory,
        });
        if self.names.is_empty() {
            return Err((at(&["names"]), "expected at least one name".to_owned()));
        }
        let folder = format!("acme/{}", directory_slug(&acme.directory));
        let mut out = Vec::with_capacity(self.names.len());
        for (i, entry) in self.names.into_iter().enumerate() {
            let (names, listed) = match entry {
                RawNames::One(n) => (vec![n], false),
                RawNames::Many(list) => (list, true),
            };
            let names: Vec<String> = names.into_iter().map(|n| n.trim_end_matches('.').to_ascii_lowercase()).collect();
            let place = |j: Option<usize>| {
                let mut p = at(&["names"]);
                p.push(Seg::Index(i));
                p.extend(j.filter(|_| listed).map(Seg::Index));
                p
            };
            if names.is_empty() || names.len() > MAX_NAMES {
                return Err((place(None), format!("expected 1 to {MAX_NAMES} names in one certificate")));
            }
            for (j, n) in names.iter().enumerate() {
                dns_name(n).map_err(|m| (place(Some(j)), m))?;
            }
            out.push(ManagedCert {
                id: format!("{folder}/{}", slug(&names)),
                names,
                source: CertSource::Acme(acme.clone()),
            });
        }
        Ok(out)
    }
}

/// A MAC key as CAs hand it out: base64url (padding and the standard alphabet tolerated).
fn decode_mac(text: &str) -> Result<Arc<[u8]>, String> {
    use base64::Engine;
    let t = text.trim().trim_end_matches('=');
    let decoded = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(t))
        .map_err(|_| "not a base64url MAC key (as the CA gave it)".to_owned())?;
    if decoded.len() < 16 {
        return Err("the MAC key is shorter than 16 bytes; expected the key the CA gave".to_owned());
    }
    Ok(decoded.into())
}

impl RawInternal {
    pub(super) fn validate(self, at: &dyn Fn(&[&str]) -> Vec<Seg>) -> Result<ManagedCert, Invalid> {
        let m = self.0.unwrap_or_default();
        let names: Vec<String> = match m.names {
            None => INTERNAL_NAMES.iter().map(|s| (*s).to_owned()).collect(),
            Some(list) => list.into_iter().map(|n| n.trim_end_matches('.').to_ascii_lowercase()).collect(),
        };
        if names.is_empty() || names.len() > MAX_NAMES {
            return Err((at(&["names"]), format!("expected 1 to {MAX_NAMES} names")));
        }
        for (j, n) in names.iter().enumerate() {
            let at_name = || {
                let mut p = at(&["names"]);
                p.push(Seg::Index(j));
                p
            };
            let dns = n.strip_prefix("*.").unwrap_or(n);
            if n.starts_with("*.") && !dns.contains('.') {
                return Err((
                    at_name(),
                    format!("`{n}`: clients refuse a wildcard over one label; list the names (app.{dns}, api.{dns})"),
                ));
            }
            let ok = n.parse::<std::net::IpAddr>().is_ok()
                || (!dns.is_empty()
                    && dns
                        .split('.')
                        .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')));
            if !ok {
                return Err((at_name(), format!("`{n}` is neither a DNS name nor an IP address")));
            }
        }
        let lifetime = m.lifetime.map_or(INTERNAL_LIFETIME, |d| d.0);
        if lifetime < Duration::from_secs(5) || lifetime > Duration::from_secs(397 * 86_400) {
            // 397 days: what browsers accept of any server certificate.
            return Err((at(&["lifetime"]), "expected a duration from 5s to 397d".to_owned()));
        }
        let internal = Arc::new(Internal { lifetime, storage: m.storage.unwrap_or_else(default_storage) });
        Ok(ManagedCert { id: format!("internal/{}", slug(&names)), names, source: CertSource::Internal(internal) })
    }
}

/// Resolves the storage folders and files of `certs` against `base` (the config's folder) and
/// reads what they name (the directory's CA, the EAB MAC key file); `at` places a field under
/// the listener's `tls`.
pub(super) fn load(certs: &mut [ManagedCert], base: &Path, at: &dyn Fn(&[&str]) -> Vec<Seg>) -> Result<(), Invalid> {
    let resolve = |p: &Path| if p.is_relative() { base.join(p) } else { p.to_owned() };
    // The certificates of one block share their settings: the block is read once.
    let mut done: Option<(Arc<Acme>, Arc<Acme>)> = None;
    for m in certs.iter_mut() {
        match &mut m.source {
            CertSource::Internal(i) => {
                let storage = resolve(&i.storage);
                if storage != i.storage {
                    *i = Arc::new(Internal { storage, ..Internal::clone(i) });
                }
            }
            CertSource::Acme(a) => {
                if let Some((old, new)) = &done {
                    if Arc::ptr_eq(old, a) {
                        *a = new.clone();
                        continue;
                    }
                }
                let old = a.clone();
                let mut acme = Acme::clone(a);
                acme.storage = resolve(&acme.storage);
                if let Some(ca) = &acme.directory_ca {
                    let ca = resolve(ca);
                    acme.directory_roots =
                        Some(crate::pki::Roots::read(&ca).map_err(|e| (at(&["acme", "directory_ca"]), e))?);
                    acme.directory_ca = Some(ca);
                }
                if let Some(eab) = &mut acme.eab {
                    if let Some(file) = &eab.hmac_key_file {
                        let file = resolve(file);
                        let text = crate::pki::read_file(&file)
                            .map_err(|e| (at(&["acme", "eab", "hmac_key_file"]), e))
                            .and_then(|b| {
                                String::from_utf8(b).map_err(|_| {
                                    (at(&["acme", "eab", "hmac_key_file"]), format!("{}: not text", file.display()))
                                })
                            })?;
                        eab.key = Some(decode_mac(&text).map_err(|m| {
                            (at(&["acme", "eab", "hmac_key_file"]), format!("{}: {m}", file.display()))
                        })?);
                        eab.hmac_key_file = Some(file);
                    } else if eab.key.is_none() {
                        eab.key = eab
                            .hmac_key
                            .as_deref()
                            .map(decode_mac)
                            .transpose()
                            .map_err(|m| (at(&["acme", "eab"]), m))?;
                    }
                }
                let acme = Arc::new(acme);
                done = Some((old, acme.clone()));
                *a = acme;
            }
        }
    }
    Ok(())
}

/// The files a listener's managed certificates read at load (a change reloads the config).
pub(super) fn files(certs: &[ManagedCert]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for m in certs {
        if let CertSource::Acme(a) = &m.source {
            out.extend(a.directory_ca.clone());
            out.extend(a.eab.as_ref().and_then(|e| e.hmac_key_file.clone()));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Key path of a managed field: `listen[i].tls.<field…>`.
pub(super) fn path(i: usize, field: &[&str]) -> Vec<Seg> {
    let mut p = vec![key("listen"), Seg::Index(i), key("tls")];
    p.extend(field.iter().map(|f| key(f)));
    p
}
