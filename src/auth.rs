//! *Auth*, the phase between route and admit: a route's `auth` verifies the request's
//! credential once (a JWT against its key set, or an API key by its SHA-256 digest) and
//! yields the [`Identity`] that limit keys (`consumer`, `claim:NAME`), plans and upstream
//! fields read. Invariants: an identity comes only from a verified credential (or is
//! `anonymous` on an `optional` route); a client's own copies of the fields claims are
//! forwarded in are removed whatever the outcome; the credential itself is never logged.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION, COOKIE};
use http::request::Parts;
use http::uri::{PathAndQuery, Uri};
use prometheus_client::metrics::counter::Counter;
use smallvec::SmallVec;

use self::remote::{Generation, Unverified};
use crate::answer::{Challenge, Error, Why};
use crate::config::auth::{ApiKeys, AuthConfig, Credential, Jwks, KeyDigest, Method, ANONYMOUS};
use crate::config::Route;
use crate::jwt::{self, KeySet, Refusal, Rules};
use crate::limit::{Identity, KeyPart, RedisClient};
use crate::metrics::Metrics;

pub mod remote;

/// A route's compiled `auth`.
pub struct Auth {
    verifier: Verifier,
    optional: bool,
    from: Credential,
    to_headers: Vec<(Box<str>, HeaderName)>,
    strip: bool,
    counts: Counts,
}

enum Verifier {
    Jwt {
        keys: Keys,
        rules: Rules,
        cache: Option<TokenCache>,
    },
    /// A keys file: digest → consumer.
    KeyFile(Arc<HashMap<KeyDigest, Box<str>>>),
    /// A Redis hash of hex digests → consumer, behind a local cache (`None`: not a key).
    KeyHash {
        client: Option<Arc<RedisClient>>,
        hash: String,
        cache: moka::sync::Cache<KeyDigest, Option<Box<str>>>,
    },
}

enum Keys {
    /// A file's set or a secret, with the generation it was given when the route was built.
    Fixed(Arc<KeySet>, Generation),
    Remote(Arc<remote::Remote>),
}

impl Keys {
    /// Which key set verifies now: a cached verification made with another set is made again.
    fn generation(&self) -> Generation {
        match self {
            Keys::Fixed(_, generation) => *generation,
            Keys::Remote(r) => r.generation(),
        }
    }
}

/// Verified tokens by their SHA-256 (never the token itself): a token seen again skips the
/// signature check, which costs hundreds of thousands of instructions. Only tokens that
/// verified are kept, each until its `exp` (plus leeway) and with the key set that verified it.
type TokenCache = moka::sync::Cache<KeyDigest, Arc<Cached>, foldhash::fast::RandomState>;

struct Cached {
    identity: Identity,
    /// The last second it is good for (`exp` + leeway).
    until: i64,
    /// The [`Keys::generation`] of the set that verified it.
    generation: Generation,
}

/// The longest a verified token is remembered, whatever its `exp`.
const CACHE_TTL: Duration = Duration::from_secs(300);

const fn why(r: Refusal) -> Why {
    Why { reason: r.label(), description: Some(r.description()) }
}

/// Every refusal reason, in the order of [`Counts::refused`].
static WHYS: [Why; 13] = [
    Why { reason: "missing", description: None },
    Why { reason: "unknown_api_key", description: Some("the API key is not known") },
    Why { reason: "unavailable", description: None },
    why(Refusal::Malformed),
    why(Refusal::Algorithm),
    why(Refusal::UnknownKey),
    why(Refusal::Signature),
    why(Refusal::Expired),
    why(Refusal::NotYetValid),
    why(Refusal::NoExpiry),
    why(Refusal::Issuer),
    why(Refusal::Audience),
    why(Refusal::NoSubject),
];

const MISSING: usize = 0;
const UNKNOWN_KEY: usize = 1;
const UNAVAILABLE: usize = 2;

/// Whether `e` refused a credential the request presented (a failure a route's
/// `auth.failures` counts): a bad one (401), or a token for another audience (403). A request
/// without one, or a credential that could not be checked (503), is not a failure.
pub fn is_failure(e: &Error) -> bool {
    match e {
        Error::Unauthenticated(c) => !std::ptr::eq(c.why, &WHYS[MISSING]),
        Error::WrongAudience(_) => true,
        _ => false,
    }
}

/// The row of a token's refusal.
fn token_row(r: Refusal) -> usize {
    WHYS.iter().position(|w| w.reason == r.label()).unwrap_or(MISSING)
}

/// The route's counters, resolved once.
struct Counts {
    authenticated: Counter,
    anonymous: Counter,
    refused: [Counter; WHYS.len()],
}

impl Auth {
    /// Compiles `config` for `route`: what the route's keys, plans and fields read of the
    /// identity decides which claims are kept. `remote_for`: the shared key set of a URL (one
    /// per URL, kept across reloads so that a reload does not read it again).
    pub fn new(
        config: &AuthConfig,
        route: &Route,
        plans: Option<&crate::limit::plan::Plans>,
        redis: Option<&Arc<RedisClient>>,
        metrics: &Metrics,
        remote_for: &mut dyn FnMut(&http::Uri, Duration) -> Arc<remote::Remote>,
    ) -> Auth {
        let verifier = match &config.method {
            Method::Jwt(j) => {
                let mut keep: Vec<String> = Vec::new();
                let mut want = |c: &str| {
                    if !keep.iter().any(|k| k == c) {
                        keep.push(c.to_owned());
                    }
                };
                for l in &route.limits {
                    for p in l.key.parts() {
                        if let KeyPart::Claim(c) = p {
                            want(c);
                        }
                    }
                }
                if let Some(p) = plans {
                    if let KeyPart::Claim(c) = &p.of {
                        want(c);
                    }
                    if let Some(c) = &p.tier_claim {
                        want(c);
                    }
                }
                for (c, _) in &config.claims_to_headers {
                    if c != "consumer" {
                        want(c);
                    }
                }
                let rules = Rules { keep, ..j.rules.clone() };
                let cache = (j.cache > 0).then(|| {
                    moka::sync::Cache::builder()
                        .max_capacity(j.cache)
                        .time_to_live(CACHE_TTL)
                        .build_with_hasher(foldhash::fast::RandomState::default())
                });
                let keys = match &j.keys {
                    Jwks::File { keys, .. } | Jwks::Secret { keys, .. } => {
                        Keys::Fixed(keys.clone(), remote::next_generation())
                    }
                    Jwks::Url { url, min_refresh } => Keys::Remote(remote_for(url, *min_refresh)),
                };
                Verifier::Jwt { keys, rules, cache }
            }
            Method::ApiKey(k) => match &k.keys {
                ApiKeys::File { consumers, .. } => Verifier::KeyFile(consumers.clone()),
                ApiKeys::Redis { hash, cache } => Verifier::KeyHash {
                    client: redis.cloned(),
                    hash: hash.clone(),
                    cache: moka::sync::Cache::builder().max_capacity(100_000).time_to_live(*cache).build(),
                },
            },
        };
        let name = route.name.as_str();
        Auth {
            verifier,
            optional: config.optional,
            from: match &config.method {
                Method::Jwt(j) => j.from.clone(),
                Method::ApiKey(k) => k.from.clone(),
            },
            to_headers: config.claims_to_headers.iter().map(|(c, h)| (c.as_str().into(), h.clone())).collect(),
            strip: config.strip_credentials,
            counts: Counts {
                authenticated: metrics.auth(name, "authenticated", "-"),
                anonymous: metrics.auth(name, "anonymous", "-"),
                refused: std::array::from_fn(|i| metrics.auth(name, "refused", WHYS[i].reason)),
            },
        }
    }

    /// A request's query as the access log may keep it: without the credential when the
    /// route reads one from the query, whether or not the request is admitted and whatever
    /// `strip_credentials` says (`None`: nothing left).
    pub fn loggable_query(&self, query: &str) -> Option<String> {
        match &self.from {
            Credential::Query(name) => match query_without(query, name) {
                Some(kept) => (!kept.is_empty()).then_some(kept),
                None => Some(query.to_owned()),
            },
            _ => Some(query.to_owned()),
        }
    }

    /// The remote key set this route reads, if any (a reload keeps it when unchanged).
    pub fn remote(&self) -> Option<&Arc<remote::Remote>> {
        match &self.verifier {
            Verifier::Jwt { keys: Keys::Remote(r), .. } => Some(r),
            _ => None,
        }
    }

    fn scheme(&self) -> &'static str {
        match self.verifier {
            Verifier::Jwt { .. } => "Bearer",
            _ => "ApiKey",
        }
    }

    fn refuse(&self, row: usize) -> Error {
        self.counts.refused[row].inc();
        let why = &WHYS[row];
        let c = Challenge { scheme: self.scheme(), why };
        if why.reason == Refusal::Audience.label() {
            Error::WrongAudience(c)
        } else {
            Error::Unauthenticated(c)
        }
    }

    /// *Auth*: the request's identity, or its refusal. The head loses the client's copies of
    /// the fields claims go in, then gets the verified ones (and loses the credential with
    /// `strip_credentials`). `now`: seconds since the epoch.
    ///
    /// # Errors
    /// [`Error::Unauthenticated`] (401), [`Error::WrongAudience`] (403), or
    /// [`Error::AuthUnavailable`] (503) when the key store does not answer, or a key set URL
    /// was never read.
    pub async fn check(&self, parts: &mut Parts, now: i64) -> Result<Box<Identity>, Error> {
        if !self.to_headers.is_empty() {
            remove_forged(&self.to_headers, &mut parts.headers);
        }
        let identity = match &self.verifier {
            Verifier::Jwt { keys, rules, cache } => match credential(&self.from, parts) {
                None => None,
                Some(token) => {
                    let seen = cache.as_ref().map(|c| (c, digest(token), keys.generation()));
                    let hit = seen.as_ref().and_then(|(c, d, generation)| {
                        c.get(d).filter(|e| e.generation == *generation && now <= e.until)
                    });
                    match hit {
                        Some(e) => Some(e.identity.clone()),
                        None => {
                            let (verified, generation) = match keys {
                                Keys::Fixed(set, generation) => (jwt::verify(token, set, rules, now), *generation),
                                Keys::Remote(r) => match r.verify(token, rules, now) {
                                    (Err(Refusal::UnknownKey), _) => {
                                        // Boxed, copied: a key set read (or waited for), at most
                                        // once an interval.
                                        let token = token.to_vec();
                                        match Box::pin(r.clone().verify_fresh(token, rules.clone(), now)).await {
                                            Ok((v, generation)) => (Ok(v), generation),
                                            Err(Unverified::Refused(why)) => (Err(why), 0),
                                            Err(Unverified::Unavailable) => {
                                                self.counts.refused[UNAVAILABLE].inc();
                                                return Err(Error::AuthUnavailable);
                                            }
                                        }
                                    }
                                    other => other,
                                },
                            };
                            let v = verified.map_err(|r| self.refuse(token_row(r)))?;
                            let identity = Identity { consumer: v.consumer, claims: v.claims };
                            if let Some((c, d, _)) = seen {
                                // Remembered with the set that verified it, whatever a reading
                                // made current meanwhile.
                                let until = v.expires.saturating_add(rules.leeway_secs);
                                c.insert(d, Arc::new(Cached { identity: identity.clone(), until, generation }));
                            }
                            Some(identity)
                        }
                    }
                }
            },
            Verifier::KeyFile(map) => match credential(&self.from, parts).map(digest) {
                None => None,
                Some(d) => match lookup(map, &d) {
                    Some(c) => Some(Identity { consumer: c.into(), claims: Vec::new() }),
                    None => return Err(self.refuse(UNKNOWN_KEY)),
                },
            },
            Verifier::KeyHash { client, hash, cache } => match credential(&self.from, parts).map(digest) {
                None => None,
                Some(d) => {
                    let found = match cache.get(&d) {
                        Some(found) => found,
                        None => {
                            let Some(client) = client else {
                                self.counts.refused[UNAVAILABLE].inc();
                                return Err(Error::AuthUnavailable);
                            };
                            let hex = hex(&d);
                            match Box::pin(client.hget(hash, hex.as_bytes())).await {
                                Some(found) => {
                                    let found: Option<Box<str>> = found
                                        .filter(|c| crate::config::auth::check_consumer(c))
                                        .map(String::into_boxed_str);
                                    cache.insert(d, found.clone());
                                    found
                                }
                                None => {
                                    self.counts.refused[UNAVAILABLE].inc();
                                    return Err(Error::AuthUnavailable);
                                }
                            }
                        }
                    };
                    match found {
                        Some(c) => Some(Identity { consumer: c, claims: Vec::new() }),
                        None => return Err(self.refuse(UNKNOWN_KEY)),
                    }
                }
            },
        };
        let identity = match identity {
            Some(id) => {
                self.counts.authenticated.inc();
                id
            }
            None if self.optional => {
                self.counts.anonymous.inc();
                Identity { consumer: ANONYMOUS.into(), claims: Vec::new() }
            }
            None => return Err(self.refuse(MISSING)),
        };
        if self.strip {
            strip(&self.from, parts);
        }
        for (claim, name) in &self.to_headers {
            let value = if &**claim == "consumer" { Some(&*identity.consumer) } else { identity.claim(claim) };
            if let Some(v) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
                parts.headers.insert(name, v);
            }
        }
        Ok(Box::new(identity))
    }
}

/// Removes the client's own copies of the fields claims go in: their names, and every name
/// that reads the same once `_` is taken for `-` (`x_consumer` beside `x-consumer`: CGI and
/// WSGI servers turn both into one `HTTP_X_CONSUMER`, the client's value joined to the
/// verified one), whatever the protocol the request came in.
fn remove_forged(produced: &[(Box<str>, HeaderName)], headers: &mut HeaderMap) {
    for (_, name) in produced {
        headers.remove(name);
    }
    let mut spelt: SmallVec<[HeaderName; 2]> = SmallVec::new();
    for name in headers.keys() {
        let n = name.as_str().as_bytes();
        if produced.iter().any(|(_, p)| same_once_dashed(n, p.as_str().as_bytes())) {
            spelt.push(name.clone());
        }
    }
    for name in &spelt {
        headers.remove(name);
    }
}

/// Whether two (lowercase) field names are the same with `_` read as `-`.
fn same_once_dashed(a: &[u8], b: &[u8]) -> bool {
    let dash = |c: u8| if c == b'_' { b'-' } else { c };
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| dash(*x) == dash(*y))
}

/// The credential `from` names in the request, if it sent one (a bearer token without its
/// scheme); an `Authorization` of another scheme is a credential that will not verify.
fn credential<'p>(from: &Credential, parts: &'p Parts) -> Option<&'p [u8]> {
    match from {
        Credential::Header(name) => {
            let v = parts.headers.get(name)?.as_bytes();
            if name != AUTHORIZATION {
                return Some(v);
            }
            match v.get(..7) {
                Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => Some(trim(&v[7..])),
                _ => Some(v),
            }
        }
        Credential::Query(name) => {
            let query = parts.uri.query()?;
            query.split('&').find_map(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                (k == name).then_some(v.as_bytes())
            })
        }
        Credential::Cookie(name) => parts.headers.get_all(COOKIE).iter().find_map(|v| cookie(v.as_bytes(), name)),
    }
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|c| *c != b' ').unwrap_or(b.len());
    let end = b.iter().rposition(|c| *c != b' ').map_or(start, |e| e + 1);
    &b[start..end.max(start)]
}

/// Cookie `name`'s value in one `Cookie` field (`a=1; b=2`).
fn cookie<'v>(field: &'v [u8], name: &str) -> Option<&'v [u8]> {
    field.split(|&b| b == b';').find_map(|pair| {
        let pair = trim(pair);
        let i = pair.iter().position(|&b| b == b'=')?;
        (&pair[..i] == name.as_bytes()).then(|| &pair[i + 1..])
    })
}

/// `strip_credentials`: the credential's field goes, its cookie from `Cookie` (the other
/// cookies stay), or its parameter from the query (every copy of it; the others stay, in
/// their order), as Kong's `hide_credentials` does.
fn strip(from: &Credential, parts: &mut Parts) {
    let headers = &mut parts.headers;
    match from {
        Credential::Header(name) => {
            headers.remove(name);
        }
        Credential::Cookie(name) => {
            let kept: Vec<HeaderValue> = headers
                .get_all(COOKIE)
                .iter()
                .filter_map(|v| {
                    let rest: Vec<&[u8]> = v
                        .as_bytes()
                        .split(|&b| b == b';')
                        .map(trim)
                        .filter(|pair| !pair.is_empty() && cookie(pair, name).is_none())
                        .collect();
                    HeaderValue::from_bytes(&rest.join(&b"; "[..])).ok().filter(|v| !v.is_empty())
                })
                .collect();
            headers.remove(COOKIE);
            for v in kept {
                headers.append(COOKIE, v);
            }
        }
        Credential::Query(name) => {
            if let Some(uri) = without_param(&parts.uri, name) {
                parts.uri = uri;
            }
        }
    }
}

/// `query` less every `name=…` parameter (the others kept in order); `None` when it has none.
fn query_without(query: &str, name: &str) -> Option<String> {
    let named = |pair: &&str| pair.split_once('=').map_or(*pair, |(k, _)| k) == name;
    if !query.split('&').any(|p| named(&p)) {
        return None;
    }
    let kept: Vec<&str> = query.split('&').filter(|p| !named(p)).collect();
    Some(kept.join("&"))
}

/// `uri` less every `name=…` parameter of its query; `None` when it has none.
fn without_param(uri: &Uri, name: &str) -> Option<Uri> {
    let kept = query_without(uri.query()?, name)?;
    let path = uri.path();
    let pq = if kept.is_empty() { path.to_owned() } else { format!("{path}?{kept}") };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(pq).ok()?);
    Uri::from_parts(parts).ok()
}

fn digest(key: &[u8]) -> KeyDigest {
    let d = ring::digest::digest(&ring::digest::SHA256, key);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// The consumer of a key digest, compared in constant time once found: the map finds the
/// entry by the digest's hash, and the comparison of the whole digest does not stop at the
/// first differing byte.
fn lookup<'m>(map: &'m HashMap<KeyDigest, Box<str>>, d: &KeyDigest) -> Option<&'m str> {
    let (stored, consumer) = map.get_key_value(d)?;
    constant_time_eq(stored, d).then_some(&**consumer)
}

#[inline(never)]
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for i in 0..32 {
        diff |= a[i] ^ b[i];
    }
    std::hint::black_box(diff) == 0
}

fn hex(d: &KeyDigest) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(64);
    for b in d {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
}

/// How long a remote key set's reading may take.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Signing keys and tokens made in the tests (shared with the integration tests; the jwt
/// room's tests load the same file, privately).
#[cfg(test)]
#[allow(clippy::duplicate_mod)]
#[path = "../tests/support/jwt.rs"]
mod mint;

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn credentials_are_found_where_the_route_says() {
        let bearer = Credential::Header(AUTHORIZATION);
        assert_eq!(credential(&bearer, &parts("/", &[("authorization", "Bearer  abc ")])), Some(&b"abc"[..]));
        assert_eq!(credential(&bearer, &parts("/", &[("authorization", "bearer abc")])), Some(&b"abc"[..]));
        assert_eq!(credential(&bearer, &parts("/", &[("authorization", "Basic abc")])), Some(&b"Basic abc"[..]));
        assert_eq!(credential(&bearer, &parts("/", &[])), None);
        let q = Credential::Query("token".into());
        assert_eq!(credential(&q, &parts("/?a=1&token=xyz", &[])), Some(&b"xyz"[..]));
        assert_eq!(credential(&q, &parts("/?tokens=xyz", &[])), None);
        let c = Credential::Cookie("session".into());
        let p = parts("/", &[("cookie", "a=1; session=tok"), ("cookie", "b=2")]);
        assert_eq!(credential(&c, &p), Some(&b"tok"[..]));
    }

    #[test]
    fn stripping_a_cookie_keeps_the_others() {
        let mut p = parts("/", &[("cookie", "a=1; session=tok; b=2"), ("cookie", "session=x")]);
        strip(&Credential::Cookie("session".into()), &mut p);
        let left: Vec<&str> = p.headers.get_all(COOKIE).iter().map(|v| v.to_str().unwrap()).collect();
        assert_eq!(left, ["a=1; b=2"]);
        let mut p = parts("/", &[("authorization", "Bearer t"), ("x-other", "1")]);
        strip(&Credential::Header(AUTHORIZATION), &mut p);
        assert!(p.headers.get(AUTHORIZATION).is_none() && p.headers.get("x-other").is_some());
    }

    #[test]
    fn stripping_a_query_credential_keeps_the_other_parameters() {
        let q = Credential::Query("token".into());
        for (before, after) in [
            ("/a?x=1&token=t&y=2", "/a?x=1&y=2"),
            ("/a?token=t", "/a"),
            ("/a?token=t&token=u&tokens=v", "/a?tokens=v"),
            ("/a?token", "/a"),
            ("/a?x=1", "/a?x=1"),
            ("/a", "/a"),
        ] {
            let mut p = parts(before, &[]);
            strip(&q, &mut p);
            assert_eq!(p.uri.to_string(), after, "{before}");
        }
    }

    #[test]
    fn underscored_spellings_of_a_claim_field_are_removed() {
        let produced: Vec<(Box<str>, HeaderName)> = vec![
            ("consumer".into(), HeaderName::from_static("x-consumer-id")),
            ("org".into(), HeaderName::from_static("x_org")),
        ];
        let mut p = parts(
            "/",
            &[
                ("x-consumer-id", "a"),
                ("x_consumer_id", "b"),
                ("X_Consumer-ID", "c"),
                ("x-consumer-idx", "kept"),
                ("x-org", "d"),
                ("x_org", "e"),
                ("x_other", "kept"),
            ],
        );
        remove_forged(&produced, &mut p.headers);
        let mut left: Vec<&str> = p.headers.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["x-consumer-idx", "x_other"]);
    }

    #[test]
    fn the_logged_query_never_has_the_credential() {
        let mut config = crate::config::Config::from_yaml(
            std::path::Path::new("t.yaml"),
            "upstreams: { up: { url: 'http://127.0.0.1:1' } }
routes:
  - name: api
    upstream: up
    auth: { jwt: { jwks: 'https://id.example.com/jwks', from: 'query:token' } }
",
        )
        .unwrap();
        let route = config.routes.remove(0);
        let metrics = Metrics::new();
        let mut remote_for =
            |u: &Uri, d: Duration| remote::Remote::new(u.clone(), d, metrics.key_set_reads(&u.to_string()));
        let auth = Auth::new(route.auth.as_deref().unwrap(), &route, None, None, &metrics, &mut remote_for);
        assert_eq!(auth.loggable_query("a=1&token=t&b=2&token=u").as_deref(), Some("a=1&b=2"));
        assert_eq!(auth.loggable_query("token=t"), None);
        assert_eq!(auth.loggable_query("tokens=t").as_deref(), Some("tokens=t"));
    }

    /// A real key set server whose document the test changes; each answer says `no-store`, so
    /// every token naming a key the set lacks may read it again (past the interval).
    async fn key_server(doc: Arc<std::sync::Mutex<String>>) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let doc = doc.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |_req| {
                        let body = doc.lock().unwrap().clone();
                        async move {
                            let mut r = http::Response::new(http_body_util::Full::new(bytes::Bytes::from(body)));
                            r.headers_mut().insert(http::header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                            Ok::<_, std::convert::Infallible>(r)
                        }
                    });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
                });
            }
        });
        addr
    }

    /// A token verified (and remembered) with a key that the set then loses stays refused
    /// however many sets are read after: each reading's set is a new generation, never one an
    /// earlier set had (a set's address, the old tag, comes back as the allocator reuses it).
    #[tokio::test]
    async fn a_removed_key_stays_refused_over_many_readings() {
        const TOKENS: usize = 20;
        const READINGS: usize = 100;
        let (old, new) = (mint::Signer::ec("old"), mint::Signer::ec("new"));
        let doc = Arc::new(std::sync::Mutex::new(mint::jwks(&[&old, &new])));
        let server = key_server(doc.clone()).await;
        let url = format!("http://{server}/jwks");
        let mut config = crate::config::Config::from_yaml(
            std::path::Path::new("t.yaml"),
            &format!("upstreams: {{ up: {{ url: 'http://127.0.0.1:1' }} }}\nroutes:\n  - name: api\n    upstream: up\n    auth: {{ jwt: {{ jwks: '{url}' }} }}\n"),
        )
        .unwrap();
        let route = config.routes.remove(0);
        let metrics = Metrics::new();
        // Readings as often as a token asks (the config's floor is 1 s; the mechanism is the same).
        let mut remote_for =
            |u: &Uri, _: Duration| remote::Remote::new(u.clone(), Duration::ZERO, metrics.key_set_reads("t"));
        let auth = Auth::new(route.auth.as_deref().unwrap(), &route, None, None, &metrics, &mut remote_for);
        let now = mint::now();
        let claims = |jti: usize| serde_json::json!({"sub": "alice", "exp": now + 600, "jti": jti});
        let check = |token: String| {
            let mut p = parts("/", &[("authorization", &format!("Bearer {token}"))]);
            let auth = &auth;
            async move { auth.check(&mut p, now).await.map(|id| id.consumer) }
        };
        let remote = auth.remote().unwrap().clone();
        let mut seen = std::collections::HashSet::new();
        // A token naming a key nobody has: the set is read again (under way, waited for).
        let stranger = |i: usize| mint::Signer::ec(&format!("k{i}")).sign(&claims(i));
        // Readings while the key is there: after each, one more token of it verifies and is
        // remembered with the set of the moment.
        let mut revoked = Vec::new();
        for i in 0..TOKENS {
            assert!(check(stranger(i)).await.is_err());
            assert!(seen.insert(remote.generation()), "reading {i}: a generation came back");
            revoked.push(old.sign(&claims(i)));
            assert_eq!(check(revoked[i].clone()).await.ok().as_deref(), Some("alice"));
        }
        *doc.lock().unwrap() = mint::jwks(&[&new]);
        for i in TOKENS..TOKENS + READINGS {
            assert!(check(stranger(i)).await.is_err());
            assert!(seen.insert(remote.generation()), "reading {i}: a generation came back");
            for (n, t) in revoked.iter().enumerate() {
                assert!(check(t.clone()).await.is_err(), "reading {i}: removed key's token {n} passed again");
            }
        }
    }

    #[test]
    fn digests_compare_whole() {
        let a = digest(b"key");
        let mut b = a;
        assert!(constant_time_eq(&a, &b));
        b[31] ^= 1;
        assert!(!constant_time_eq(&a, &b));
        assert_eq!(hex(&a), crate::config::auth::hash_key(b"key"));
    }
}
