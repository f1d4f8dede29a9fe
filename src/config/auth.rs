//! `auth:` (top level: the default of every route; per route: its own, or `none`): a JWT
//! verified against a key set (a file, a URL read again in the background, or an HS256
//! secret file), or an API key looked up by its SHA-256 digest (a file, or a Redis hash).
//! Key sets, secrets and key files are read and checked when the config loads, so a file
//! that does not parse is refused with the field that names it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use serde::de::MapAccess;
use serde::Deserialize;

use super::forms::{by_form, read_map, Forms};
use super::units::Dur;
use super::{key, Invalid, Seg};
use crate::jwt::{Alg, Algs, KeySet, Rules};
use crate::limit::KeyPart;

/// A key set, secret or key file larger than this is refused (each is read whole).
pub const MAX_AUTH_FILE_BYTES: u64 = 16 << 20;

/// The longest `leeway`: more is a clock that is wrong, not skewed.
pub const MAX_LEEWAY: Duration = Duration::from_secs(300);

/// HS256 secrets shorter than this are refused (RFC 7518 §3.2: a key of the hash's size).
pub const MIN_SECRET_BYTES: usize = 32;

/// The consumer of a request without credentials on an `optional` route.
pub const ANONYMOUS: &str = "anonymous";

/// A route's `auth`: how a request proves who it is.
#[derive(Debug, Clone)]
pub struct AuthConfig {
    pub method: Method,
    /// Requests without credentials pass as the consumer `anonymous` (bad ones are still refused).
    pub optional: bool,
    /// Verified claims (or `consumer`) forwarded as these fields; a client's own copies go first.
    pub claims_to_headers: Vec<(String, HeaderName)>,
    /// The credential (its header, or its cookie) is removed from the forwarded request.
    pub strip_credentials: bool,
    /// `failures:`: a limit on failed credentials per key (the client's IP by default), read
    /// before each verification and charged after each failure (see `gate::failures`).
    pub failures: Option<super::LimitConfig>,
}

/// The name of a failure limit that gives none: its metrics' and answers' `limit`.
pub const FAILURES_NAME: &str = "auth-failures";

#[derive(Debug, Clone)]
pub enum Method {
    Jwt(Box<JwtConfig>),
    ApiKey(ApiKeyConfig),
}

#[derive(Debug, Clone)]
pub struct JwtConfig {
    /// Verified tokens remembered by their SHA-256 (`cache`, entries; 0: none).
    pub cache: u64,
    pub keys: Jwks,
    /// `keep` is empty here: each route's compiled form sets what it keeps.
    pub rules: Rules,
    pub from: Credential,
}

/// Where a route's verification keys come from.
#[derive(Debug, Clone)]
pub enum Jwks {
    /// A key set file, read at load (and at each reload).
    File { path: PathBuf, keys: Arc<KeySet> },
    /// A key set URL, read when first needed and again in the background (see
    /// `auth::remote`); none is read at load. `min_refresh`: readings at most this often.
    Url { url: http::Uri, min_refresh: Duration },
    /// `secret_file`: one HS256 secret.
    Secret { path: PathBuf, keys: Arc<KeySet> },
}

/// Where a credential is in the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// A field; on `authorization`, the `Bearer` token (RFC 6750 §2.1).
    Header(HeaderName),
    /// A query parameter.
    Query(String),
    Cookie(String),
}

impl Credential {
    fn parse(s: &str) -> Result<Credential, String> {
        let bad = || format!("`{s}`: expected header:NAME, query:NAME or cookie:NAME");
        let (kind, name) = s.split_once(':').ok_or_else(bad)?;
        let name = name.trim();
        if name.is_empty() {
            return Err(bad());
        }
        match kind.trim() {
            "header" => HeaderName::from_bytes(name.as_bytes())
                .map(Credential::Header)
                .map_err(|_| format!("`{name}` is not a header name")),
            "query" => Ok(Credential::Query(name.to_owned())),
            "cookie" => Ok(Credential::Cookie(name.to_owned())),
            _ => Err(bad()),
        }
    }

    /// Whether this is a bearer token in `Authorization` (RFC 6750 §2.1).
    pub fn is_bearer(&self) -> bool {
        matches!(self, Credential::Header(h) if h == http::header::AUTHORIZATION)
    }
}

#[derive(Debug, Clone)]
pub struct ApiKeyConfig {
    pub from: Credential,
    pub keys: ApiKeys,
}

/// The SHA-256 digest of an API key.
pub type KeyDigest = [u8; 32];

#[derive(Debug, Clone)]
pub enum ApiKeys {
    /// A file of `sha256-hex consumer` lines, read at load.
    File { path: PathBuf, consumers: Arc<HashMap<KeyDigest, Box<str>>> },
    /// `HGET hash <sha256-hex>` → the consumer, cached locally for `cache`.
    Redis { hash: String, cache: Duration },
}

/// `auth:` on a route: `none`, or its own.
pub enum RawRouteAuth {
    Word(String),
    Own(Box<RawAuth>),
}

impl Forms for RawRouteAuth {
    const EXPECTING: &'static str = "`none` or a map with `jwt` or `api_key`";
    fn text(s: &str) -> Option<Self> {
        Some(RawRouteAuth::Word(s.to_owned()))
    }
    fn map<'de, M: MapAccess<'de>>(map: M) -> Option<Result<Self, M::Error>> {
        Some(read_map(map).map(|a| RawRouteAuth::Own(Box::new(a))))
    }
}
by_form!(RawRouteAuth);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    jwt: Option<RawJwt>,
    api_key: Option<RawApiKey>,
    #[serde(default)]
    optional: bool,
    #[serde(default)]
    claims_to_headers: BTreeMap<String, String>,
    #[serde(default)]
    strip_credentials: bool,
    failures: Option<super::limits::RawLimit>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJwt {
    jwks: Option<String>,
    secret_file: Option<PathBuf>,
    #[serde(default)]
    issuers: Vec<String>,
    #[serde(default)]
    audiences: Vec<String>,
    algorithms: Option<Vec<String>>,
    leeway: Option<Dur>,
    min_refresh: Option<Dur>,
    from: Option<String>,
    consumer_claim: Option<String>,
    cache: Option<u64>,
}

/// Verified tokens kept by default, and at most (`jwt.cache`).
pub const DEFAULT_CACHE: u64 = 10_000;
pub const MAX_CACHE: u64 = 10_000_000;

/// `min_refresh`'s bounds and default.
pub const MIN_REFRESH: (Duration, Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(3600), Duration::from_secs(10));

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApiKey {
    from: Option<String>,
    keys: RawKeys,
}

/// `keys:` of `api_key`: a file, or `{ redis_hash, cache }`.
enum RawKeys {
    File(PathBuf),
    Redis(RawRedisKeys),
}

impl Forms for RawKeys {
    const EXPECTING: &'static str = "a keys file, or `{ redis_hash: NAME }`";
    fn text(s: &str) -> Option<Self> {
        Some(RawKeys::File(s.into()))
    }
    fn map<'de, M: MapAccess<'de>>(map: M) -> Option<Result<Self, M::Error>> {
        Some(read_map(map).map(RawKeys::Redis))
    }
}
by_form!(RawKeys);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRedisKeys {
    redis_hash: String,
    cache: Option<Dur>,
}

/// Field names of claims are JSON member names; these are the ones a header may carry.
fn check_claim(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
        return Err(format!("`{}` is not a claim name", name.escape_debug()));
    }
    Ok(())
}

impl RawRouteAuth {
    /// `None`: the route has `auth: none`.
    pub fn validate(self, at: &[Seg], has_redis: bool) -> Result<Option<AuthConfig>, Invalid> {
        match self {
            RawRouteAuth::Word(w) if w == "none" => Ok(None),
            RawRouteAuth::Word(w) => {
                Err((at.to_vec(), format!("`{w}`: expected `none` or a map with `jwt` or `api_key`")))
            }
            RawRouteAuth::Own(raw) => raw.validate(at, has_redis).map(Some),
        }
    }
}

impl RawAuth {
    pub fn validate(self, at: &[Seg], has_redis: bool) -> Result<AuthConfig, Invalid> {
        let path = |rest: &[&str]| {
            let mut p = at.to_vec();
            p.extend(rest.iter().map(|r| key(r)));
            p
        };
        let method = match (self.jwt, self.api_key) {
            (Some(_), Some(_)) => {
                return Err((path(&["api_key"]), "give either `jwt` or `api_key`, not both".to_owned()))
            }
            (None, None) => return Err((at.to_vec(), "expected `jwt` or `api_key`".to_owned())),
            (Some(j), None) => Method::Jwt(Box::new(j.validate(&|f| path(&["jwt", f]))?)),
            (None, Some(k)) => Method::ApiKey(k.validate(&|f| path(&["api_key", f]), has_redis)?),
        };
        let mut claims_to_headers = Vec::with_capacity(self.claims_to_headers.len());
        for (claim, header) in self.claims_to_headers {
            let at = || path(&["claims_to_headers", &claim]);
            check_claim(&claim).map_err(|e| (at(), e))?;
            let name = HeaderName::from_bytes(header.as_bytes())
                .map_err(|_| (at(), format!("`{header}` is not a header name")))?;
            if super::rules::REFUSED.contains(&name) {
                return Err((at(), format!("`{name}` cannot carry a claim: it frames or routes the request")));
            }
            if matches!(method, Method::ApiKey(_)) && claim != "consumer" {
                return Err((at(), "an API key has no claims; only `consumer` can be forwarded".to_owned()));
            }
            claims_to_headers.push((claim, name));
        }
        let from = match &method {
            Method::Jwt(j) => &j.from,
            Method::ApiKey(k) => &k.from,
        };
        let failures = self.failures.map(|raw| failures(raw, from, &|f| path(&["failures", f]))).transpose()?;
        Ok(AuthConfig {
            method,
            optional: self.optional,
            claims_to_headers,
            strip_credentials: self.strip_credentials,
            failures,
        })
    }
}

/// `failures:`: a limit (the same fields as a route's) whose key reads nothing of the
/// credential, since it is read before the credential is verified.
fn failures(
    mut raw: super::limits::RawLimit,
    from: &Credential,
    at: &dyn Fn(&str) -> Vec<Seg>,
) -> Result<super::LimitConfig, Invalid> {
    if let Some((field, why)) = raw.unlike_failures() {
        return Err((at(field), format!("`{field}` does not apply to `failures`: {why}")));
    }
    raw.name.get_or_insert_with(|| FAILURES_NAME.to_owned());
    raw.key.get_or_insert_with(|| super::limits::KeyList(vec!["client_ip".to_owned()]));
    let limit = raw.validate(0, at)?;
    if let Some(part) = limit.key.parts().iter().find(|p| p.needs_identity()) {
        return Err((
            at("key"),
            format!(
                "`{part}` is known only once a credential is verified, and failures are counted before that; key \
                 failures on what the request shows without it (client_ip, header:NAME, tls_client...)"
            ),
        ));
    }
    let reads_credential = |p: &KeyPart| match (p, from) {
        (KeyPart::Header(k), Credential::Header(c)) => k == c,
        (KeyPart::Header(k), Credential::Cookie(_)) => k == http::header::COOKIE,
        (KeyPart::Query(k), Credential::Query(c)) => k == c,
        (KeyPart::Cookie(k), Credential::Cookie(c)) => k == c,
        _ => false,
    };
    if let Some(part) = limit.key.parts().iter().find(|p| reads_credential(p)) {
        return Err((
            at("key"),
            format!(
                "`{part}` reads the credential itself, so each guess would be a key of its own; key failures on \
                 who sends them (client_ip, tls_client...)"
            ),
        ));
    }
    Ok(limit)
}

impl RawJwt {
    fn validate(self, at: &dyn Fn(&str) -> Vec<Seg>) -> Result<JwtConfig, Invalid> {
        let algorithms = match &self.algorithms {
            None => [Alg::RS256, Alg::PS256, Alg::ES256, Alg::EdDSA].into_iter().fold(Algs::default(), Algs::with),
            Some(list) => {
                let mut algs = Algs::default();
                for (i, a) in list.iter().enumerate() {
                    let mut p = at("algorithms");
                    p.push(Seg::Index(i));
                    algs = algs.with(a.parse::<Alg>().map_err(|e| (p, e))?);
                }
                if algs.is_empty() {
                    return Err((at("algorithms"), "expected at least one algorithm".to_owned()));
                }
                algs
            }
        };
        let keys = match (self.jwks, self.secret_file) {
            (Some(_), Some(_)) => {
                return Err((at("secret_file"), "give either `jwks` or `secret_file`, not both".to_owned()))
            }
            (None, None) => return Err((at("jwks"), "expected `jwks` (a file or URL) or `secret_file`".to_owned())),
            (Some(jwks), None) => {
                if algorithms.contains(Alg::HS256) {
                    return Err((
                        at("algorithms"),
                        "HS256 verifies with a shared secret, never with a key set: give `secret_file` instead of \
                         `jwks`"
                            .to_owned(),
                    ));
                }
                if jwks.starts_with("http://") || jwks.starts_with("https://") {
                    let url: http::Uri =
                        jwks.parse().map_err(|e| (at("jwks"), format!("`{jwks}` is not a URL: {e}")))?;
                    if url.host().is_none_or(str::is_empty) {
                        return Err((at("jwks"), format!("`{jwks}` has no host")));
                    }
                    let min_refresh = self.min_refresh.map_or(MIN_REFRESH.2, |d| d.0);
                    if !(MIN_REFRESH.0..=MIN_REFRESH.1).contains(&min_refresh) {
                        return Err((at("min_refresh"), "expected from 1s to 1h".to_owned()));
                    }
                    Jwks::Url { url, min_refresh }
                } else if self.min_refresh.is_some() {
                    return Err((at("min_refresh"), "`min_refresh` is for a `jwks` URL, not a file".to_owned()));
                } else if jwks.is_empty() {
                    return Err((at("jwks"), "expected a file or an http(s):// URL".to_owned()));
                } else {
                    Jwks::File { path: jwks.into(), keys: Arc::default() }
                }
            }
            (None, Some(path)) => {
                if self.algorithms.is_none() || algorithms != Algs::default().with(Alg::HS256) {
                    return Err((
                        at("algorithms"),
                        "a `secret_file` verifies HS256 only, and asks for it explicitly: `algorithms: [HS256]`"
                            .to_owned(),
                    ));
                }
                Jwks::Secret { path, keys: Arc::default() }
            }
        };
        let leeway = self.leeway.map_or(Duration::from_secs(30), |d| d.0);
        if leeway > MAX_LEEWAY {
            return Err((at("leeway"), format!("at most {}s", MAX_LEEWAY.as_secs())));
        }
        let from = match self.from {
            None => Credential::Header(http::header::AUTHORIZATION),
            Some(f) => Credential::parse(&f).map_err(|e| (at("from"), e))?,
        };
        let consumer_claim = self.consumer_claim.unwrap_or_else(|| "sub".to_owned());
        check_claim(&consumer_claim).map_err(|e| (at("consumer_claim"), e))?;
        for (field, list) in [("issuers", &self.issuers), ("audiences", &self.audiences)] {
            if let Some(i) = list.iter().position(String::is_empty) {
                let mut p = at(field);
                p.push(Seg::Index(i));
                return Err((p, "expected a non-empty string".to_owned()));
            }
        }
        let rules = Rules {
            algorithms,
            issuers: self.issuers,
            audiences: self.audiences,
            leeway_secs: i64::try_from(leeway.as_secs()).unwrap_or(0),
            consumer_claim,
            keep: Vec::new(),
        };
        let cache = self.cache.unwrap_or(DEFAULT_CACHE);
        if cache > MAX_CACHE {
            return Err((at("cache"), format!("at most {MAX_CACHE} tokens")));
        }
        Ok(JwtConfig { cache, keys, rules, from })
    }
}

impl RawApiKey {
    fn validate(self, at: &dyn Fn(&str) -> Vec<Seg>, has_redis: bool) -> Result<ApiKeyConfig, Invalid> {
        let from = match self.from {
            None => Credential::Header(HeaderName::from_static("x-api-key")),
            Some(f) => Credential::parse(&f).map_err(|e| (at("from"), e))?,
        };
        let keys = match self.keys {
            RawKeys::File(path) => ApiKeys::File { path, consumers: Arc::default() },
            RawKeys::Redis(r) => {
                if !has_redis {
                    return Err((at("keys"), "`redis_hash` needs a `redis:` section".to_owned()));
                }
                if r.redis_hash.is_empty() {
                    return Err((at("keys"), "`redis_hash` must name a hash".to_owned()));
                }
                ApiKeys::Redis { hash: r.redis_hash, cache: r.cache.map_or(Duration::from_secs(30), |d| d.0) }
            }
        };
        Ok(ApiKeyConfig { from, keys })
    }
}

/// Reads a file of at most [`MAX_AUTH_FILE_BYTES`].
fn read(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_AUTH_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_AUTH_FILE_BYTES {
        return Err(format!("{} is larger than {MAX_AUTH_FILE_BYTES} bytes", path.display()));
    }
    Ok(bytes)
}

/// Reads and checks the files `auth` names (relative to `base`); a problem comes with the
/// path of its field under `at`.
pub fn load(auth: &mut AuthConfig, base: &Path, at: &[Seg]) -> Result<(), Invalid> {
    let field = |rest: &[&str]| {
        let mut p = at.to_vec();
        p.extend(rest.iter().map(|r| key(r)));
        p
    };
    let resolve = |p: &mut PathBuf| {
        if p.is_relative() {
            *p = base.join(&*p);
        }
    };
    match &mut auth.method {
        Method::Jwt(j) => match &mut j.keys {
            Jwks::File { path, keys } => {
                resolve(path);
                let bytes = read(path).map_err(|e| (field(&["jwt", "jwks"]), e))?;
                let set = KeySet::from_jwks(&bytes)
                    .map_err(|e| (field(&["jwt", "jwks"]), format!("{}: {e}", path.display())))?;
                *keys = Arc::new(set);
            }
            Jwks::Secret { path, keys } => {
                resolve(path);
                let bytes = read(path).map_err(|e| (field(&["jwt", "secret_file"]), e))?;
                let secret = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
                let secret = secret.strip_suffix(b"\r").unwrap_or(secret);
                if secret.len() < MIN_SECRET_BYTES {
                    return Err((
                        field(&["jwt", "secret_file"]),
                        format!(
                            "{}: a secret of {} bytes; HS256 needs at least {MIN_SECRET_BYTES}",
                            path.display(),
                            secret.len()
                        ),
                    ));
                }
                *keys = Arc::new(KeySet::hmac(secret));
            }
            Jwks::Url { .. } => {}
        },
        Method::ApiKey(k) => {
            if let ApiKeys::File { path, consumers } = &mut k.keys {
                resolve(path);
                let bytes = read(path).map_err(|e| (field(&["api_key", "keys"]), e))?;
                let map =
                    parse_keys(&bytes).map_err(|e| (field(&["api_key", "keys"]), format!("{}:{e}", path.display())))?;
                *consumers = Arc::new(map);
            }
        }
    }
    Ok(())
}

/// A warning for each `jwks` URL read over plain HTTP from another host than this one: anyone
/// on the path can answer with a key set of their own, and every token signed with it passes.
/// (A loopback host, such as a sidecar's, is not warned about.)
pub fn plain_http_warnings(default: Option<&AuthConfig>, routes: &[super::Route]) -> Vec<String> {
    let own =
        routes.iter().enumerate().filter(|(_, r)| r.auth_own).filter_map(|(i, r)| Some((Some(i), r.auth.as_deref()?)));
    default
        .map(|a| (None, a))
        .into_iter()
        .chain(own)
        .filter_map(|(route, auth)| {
            let Method::Jwt(j) = &auth.method else { return None };
            let Jwks::Url { url, .. } = &j.keys else { return None };
            if url.scheme_str() != Some("http") || url.host().is_some_and(is_loopback) {
                return None;
            }
            let at = route.map_or_else(|| "auth.jwt.jwks".to_owned(), |i| format!("routes[{i}].auth.jwt.jwks"));
            Some(format!(
                "{at}: `{url}` is read over plain HTTP: anyone on the path can swap the key set (and sign tokens \
                 that pass); use https://"
            ))
        })
        .collect()
}

/// `localhost`, or an address of 127.0.0.0/8 or `::1`.
fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost") || bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Reads the files of the default `auth` and of each route's own.
pub fn load_all(config: &mut super::Config, base: &Path) -> Result<(), Invalid> {
    if let Some(auth) = config.auth.as_mut() {
        load(Arc::make_mut(auth), base, &[key("auth")])?;
    }
    for (i, route) in config.routes.iter_mut().enumerate() {
        match &mut route.auth {
            Some(auth) if route.auth_own => {
                load(Arc::make_mut(auth), base, &[key("routes"), Seg::Index(i), key("auth")])?
            }
            Some(_) => route.auth = config.auth.clone(),
            None => {}
        }
    }
    Ok(())
}

/// The files the config's `auth` sections read (a change reloads the config).
pub fn files(config: &super::Config) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let all = config.auth.iter().chain(config.routes.iter().filter_map(|r| r.auth.as_ref()));
    for auth in all {
        let path = match &auth.method {
            Method::Jwt(j) => match &j.keys {
                Jwks::File { path, .. } | Jwks::Secret { path, .. } => Some(path),
                Jwks::Url { .. } => None,
            },
            Method::ApiKey(k) => match &k.keys {
                ApiKeys::File { path, .. } => Some(path),
                ApiKeys::Redis { .. } => None,
            },
        };
        if let Some(p) = path.filter(|p| !out.contains(p)) {
            out.push(p.clone());
        }
    }
    out
}

/// Whether `id` may name a consumer: it is a key part, a metric-free log field and a header
/// value, so printable and short.
pub fn check_consumer(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic())
}

/// A keys file: one `SHA256-HEX CONSUMER` per line; blank lines and `#` comments skipped.
///
/// # Errors
/// `LINE: what is wrong`.
pub fn parse_keys(bytes: &[u8]) -> Result<HashMap<KeyDigest, Box<str>>, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "1: the file is not UTF-8".to_owned())?;
    let mut map = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(hex), Some(consumer), None) = (words.next(), words.next(), words.next()) else {
            return Err(format!("{n}: expected `SHA256-HEX CONSUMER` (see `tollgate hash-key`)"));
        };
        let digest = from_hex(hex).ok_or_else(|| format!("{n}: `{hex}` is not 64 hex digits (a SHA-256 digest)"))?;
        if !check_consumer(consumer) {
            return Err(format!(
                "{n}: `{}` is not a consumer id (printable, up to 128 bytes)",
                consumer.escape_debug()
            ));
        }
        if map.insert(digest, consumer.into()).is_some() {
            return Err(format!("{n}: this key is listed twice"));
        }
    }
    Ok(map)
}

fn from_hex(s: &str) -> Option<KeyDigest> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in b.chunks(2).enumerate() {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        out[i] = (hi * 16 + lo) as u8;
    }
    Some(out)
}

/// The lowercase hex SHA-256 of an API key, as a keys file and a Redis hash hold it.
pub fn hash_key(key: &[u8]) -> String {
    use std::fmt::Write;
    let digest = ring::digest::digest(&ring::digest::SHA256, key);
    let mut hex = String::with_capacity(64);
    for b in digest.as_ref() {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keys_file_is_read_with_its_line_numbers() {
        let good = format!("# keys\n\n{} acme\n{}  globex # no\n", hash_key(b"k1"), hash_key(b"k2"));
        assert!(parse_keys(good.as_bytes()).unwrap_err().starts_with("4:"));
        let good = format!("# keys\n\n{} acme\n{}  globex\n", hash_key(b"k1"), hash_key(b"k2"));
        let map = parse_keys(good.as_bytes()).unwrap();
        let digest = from_hex(&hash_key(b"k2")).unwrap();
        assert_eq!(map.get(&digest).map(|c| &**c), Some("globex"));
        assert!(parse_keys(b"abc acme\n").unwrap_err().starts_with("1:"));
        let twice = format!("{0} a\n{0} b\n", hash_key(b"k"));
        assert_eq!(parse_keys(twice.as_bytes()).unwrap_err(), "2: this key is listed twice");
    }

    #[test]
    fn hash_key_is_sha256_hex() {
        assert_eq!(hash_key(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
