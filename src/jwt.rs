//! JSON Web Tokens (RFC 7519) in the JWS compact form (RFC 7515), and the JSON Web Keys
//! (RFC 7517) that verify them. A key set is parsed once (when the config loads, or a key set
//! URL is read again) into keys that each know their one algorithm family, so a token cannot
//! choose how it is checked: `none` is never an algorithm, an HMAC secret never comes from a
//! key set, and a header's `alg` must name the key's own family (no algorithm confusion).
//! Pure: no I/O, and the time is the caller's.

use std::fmt;
use std::str::FromStr;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::signature;
use serde::Deserialize;
use serde_json::Value;

/// A token longer than this is refused before it is decoded.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// A claim value kept for keys and headers is cut to this many bytes.
pub const MAX_CLAIM_BYTES: usize = 1024;

/// Keys in one set at most (a key set is searched per token without a `kid`).
pub const MAX_KEYS: usize = 64;

/// The signature algorithms tollgate verifies (RFC 7518 names; EdDSA with Ed25519, RFC 8037).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Alg {
    RS256,
    PS256,
    ES256,
    EdDSA,
    HS256,
}

impl Alg {
    pub const ALL: [Alg; 5] = [Alg::RS256, Alg::PS256, Alg::ES256, Alg::EdDSA, Alg::HS256];

    pub fn as_str(self) -> &'static str {
        match self {
            Alg::RS256 => "RS256",
            Alg::PS256 => "PS256",
            Alg::ES256 => "ES256",
            Alg::EdDSA => "EdDSA",
            Alg::HS256 => "HS256",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl FromStr for Alg {
    type Err = String;

    fn from_str(s: &str) -> Result<Alg, String> {
        Alg::ALL.into_iter().find(|a| a.as_str() == s).ok_or_else(|| {
            let known: Vec<&str> = Alg::ALL.iter().map(|a| a.as_str()).collect();
            format!("unknown algorithm `{s}`; expected one of: {}", known.join(", "))
        })
    }
}

impl fmt::Display for Alg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A set of algorithms (a route's `algorithms`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Algs(u8);

impl Algs {
    pub fn with(self, a: Alg) -> Algs {
        Algs(self.0 | a.bit())
    }

    pub fn contains(self, a: Alg) -> bool {
        self.0 & a.bit() != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// One verification key, with the algorithms its type allows.
pub struct Key {
    kid: Option<Box<str>>,
    kind: KeyKind,
}

enum KeyKind {
    /// Modulus and exponent, big-endian without leading zeros; `algs`: RS256 and PS256, or the
    /// one its JWK's `alg` names.
    Rsa {
        n: Box<[u8]>,
        e: Box<[u8]>,
        algs: Algs,
    },
    /// An uncompressed P-256 point (`04 || x || y`).
    Ec(Box<[u8]>),
    Ed25519(Box<[u8]>),
    Hmac(ring::hmac::Key),
}

impl Key {
    fn allows(&self, alg: Alg) -> bool {
        match &self.kind {
            KeyKind::Rsa { algs, .. } => algs.contains(alg),
            KeyKind::Ec(_) => alg == Alg::ES256,
            KeyKind::Ed25519(_) => alg == Alg::EdDSA,
            KeyKind::Hmac(_) => alg == Alg::HS256,
        }
    }

    fn verify(&self, alg: Alg, message: &[u8], sig: &[u8]) -> bool {
        match (&self.kind, alg) {
            (KeyKind::Rsa { n, e, .. }, Alg::RS256 | Alg::PS256) => {
                let params = if alg == Alg::RS256 {
                    &signature::RSA_PKCS1_2048_8192_SHA256
                } else {
                    &signature::RSA_PSS_2048_8192_SHA256
                };
                signature::RsaPublicKeyComponents { n: &**n, e: &**e }.verify(params, message, sig).is_ok()
            }
            (KeyKind::Ec(point), Alg::ES256) => {
                signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, point)
                    .verify(message, sig)
                    .is_ok()
            }
            (KeyKind::Ed25519(x), Alg::EdDSA) => {
                signature::UnparsedPublicKey::new(&signature::ED25519, x).verify(message, sig).is_ok()
            }
            (KeyKind::Hmac(k), Alg::HS256) => ring::hmac::verify(k, message, sig).is_ok(),
            _ => false,
        }
    }
}

/// The keys a route verifies with: a JSON Web Key Set, or one HMAC secret.
#[derive(Default)]
pub struct KeySet {
    keys: Vec<Key>,
}

impl fmt::Debug for KeySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kids: Vec<&str> = self.keys.iter().map(|k| k.kid.as_deref().unwrap_or("-")).collect();
        write!(f, "KeySet({})", kids.join(", "))
    }
}

/// Why a key set was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeySetError {
    #[error("not a JSON Web Key Set: {0}")]
    Json(String),
    #[error("key {index}: {why}")]
    Key { index: usize, why: String },
    #[error("no key tollgate can verify with (RSA of 2048 bits or more, EC P-256, OKP Ed25519)")]
    Empty,
    #[error("{0} keys; at most {MAX_KEYS} are read")]
    TooMany(usize),
}

#[derive(Deserialize)]
struct RawSet {
    keys: Vec<Value>,
}

#[derive(Deserialize)]
struct RawKey {
    kty: String,
    kid: Option<String>,
    #[serde(rename = "use")]
    use_: Option<String>,
    alg: Option<String>,
    crv: Option<String>,
    n: Option<String>,
    e: Option<String>,
    x: Option<String>,
    y: Option<String>,
}

impl KeySet {
    /// Parses a JSON Web Key Set. Keys for encryption (`use: enc`), of other types or curves,
    /// or with an algorithm tollgate does not verify are skipped; a key of a kind it verifies
    /// that does not parse refuses the whole set.
    ///
    /// # Errors
    /// [`KeySetError`]: not JSON, a bad key, or no usable key.
    pub fn from_jwks(json: &[u8]) -> Result<KeySet, KeySetError> {
        let raw: RawSet = serde_json::from_slice(json).map_err(|e| KeySetError::Json(e.to_string()))?;
        if raw.keys.len() > MAX_KEYS {
            return Err(KeySetError::TooMany(raw.keys.len()));
        }
        let mut keys = Vec::with_capacity(raw.keys.len());
        for (index, v) in raw.keys.into_iter().enumerate() {
            let fail = |why: String| KeySetError::Key { index, why };
            let k: RawKey = serde_json::from_value(v).map_err(|e| fail(e.to_string()))?;
            if k.use_.as_deref().is_some_and(|u| u != "sig") {
                continue;
            }
            let named = match k.alg.as_deref() {
                None => None,
                Some(a) => match a.parse::<Alg>() {
                    Ok(Alg::HS256) | Err(_) => continue,
                    Ok(a) => Some(a),
                },
            };
            let field = |name: &str, v: &Option<String>| -> Result<Vec<u8>, KeySetError> {
                let text = v.as_deref().ok_or_else(|| fail(format!("no `{name}`")))?;
                URL_SAFE_NO_PAD.decode(text).map_err(|e| fail(format!("`{name}` is not base64url: {e}")))
            };
            let kind = match (k.kty.as_str(), k.crv.as_deref()) {
                ("RSA", _) => {
                    let algs = match named {
                        None => Algs::default().with(Alg::RS256).with(Alg::PS256),
                        Some(a @ (Alg::RS256 | Alg::PS256)) => Algs::default().with(a),
                        Some(a) => return Err(fail(format!("an RSA key with `alg: {a}`"))),
                    };
                    let n = strip_zeros(field("n", &k.n)?);
                    let e = strip_zeros(field("e", &k.e)?);
                    if n.len() < 256 {
                        return Err(fail(format!("an RSA key of {} bits; at least 2048 are needed", n.len() * 8)));
                    }
                    if n.len() > 1024 || e.is_empty() || e.len() > 4 {
                        return Err(fail("an RSA key whose modulus or exponent is out of bounds".to_owned()));
                    }
                    KeyKind::Rsa { n: n.into(), e: e.into(), algs }
                }
                ("EC", Some("P-256")) => {
                    if named.is_some_and(|a| a != Alg::ES256) {
                        return Err(fail("a P-256 key for another algorithm than ES256".to_owned()));
                    }
                    let (x, y) = (field("x", &k.x)?, field("y", &k.y)?);
                    if x.len() != 32 || y.len() != 32 {
                        return Err(fail("a P-256 key's `x` and `y` are 32 bytes each".to_owned()));
                    }
                    let mut point = Vec::with_capacity(65);
                    point.push(4);
                    point.extend_from_slice(&x);
                    point.extend_from_slice(&y);
                    KeyKind::Ec(point.into())
                }
                ("OKP", Some("Ed25519")) => {
                    if named.is_some_and(|a| a != Alg::EdDSA) {
                        return Err(fail("an Ed25519 key for another algorithm than EdDSA".to_owned()));
                    }
                    let x = field("x", &k.x)?;
                    if x.len() != 32 {
                        return Err(fail("an Ed25519 key's `x` is 32 bytes".to_owned()));
                    }
                    KeyKind::Ed25519(x.into())
                }
                // Other curves, symmetric keys (a secret is never read from a key set).
                _ => continue,
            };
            keys.push(Key { kid: k.kid.map(Into::into), kind });
        }
        if keys.is_empty() {
            return Err(KeySetError::Empty);
        }
        Ok(KeySet { keys })
    }

    /// One HMAC-SHA256 secret (HS256, asked for explicitly with a secret file).
    pub fn hmac(secret: &[u8]) -> KeySet {
        let kind = KeyKind::Hmac(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret));
        KeySet { keys: vec![Key { kid: None, kind }] }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether a key has this id (a token naming an unknown one may ask for a fresh set).
    pub fn has_kid(&self, kid: &str) -> bool {
        self.keys.iter().any(|k| k.kid.as_deref() == Some(kid))
    }

    /// Keys that may verify `alg` for a token naming `kid`.
    fn candidates<'a>(&'a self, alg: Alg, kid: Option<&'a str>) -> impl Iterator<Item = &'a Key> + 'a {
        self.keys.iter().filter(move |k| k.allows(alg) && (kid.is_none() || k.kid.is_none() || k.kid.as_deref() == kid))
    }
}

fn strip_zeros(mut v: Vec<u8>) -> Vec<u8> {
    let zeros = v.iter().take_while(|&&b| b == 0).count();
    v.drain(..zeros);
    v
}

/// What a token must satisfy besides its signature.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rules {
    pub algorithms: Algs,
    /// `iss` must be one of these (empty: any).
    pub issuers: Vec<String>,
    /// `aud` must name one of these (empty: any).
    pub audiences: Vec<String>,
    /// Allowed clock skew on `exp` and `nbf`, in seconds.
    pub leeway_secs: i64,
    /// The claim that names the consumer (`sub` by default).
    pub consumer_claim: String,
    /// Claims kept in the identity (for keys, plans and upstream headers), in this order.
    pub keep: Vec<String>,
}

/// Why a token was refused; each is a metric label and a sentence for the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not three base64url parts of JSON, too long, or a header that asks for what tollgate
    /// does not do (`crit`).
    Malformed,
    /// `alg` is `none`, unknown, or not one the route accepts.
    Algorithm,
    /// No key of the set has the token's `kid` (or none fits its algorithm).
    UnknownKey,
    Signature,
    Expired,
    NotYetValid,
    NoExpiry,
    Issuer,
    /// Verified, but for another audience: the one refusal answered `403`.
    Audience,
    NoSubject,
}

impl Refusal {
    /// The metric label and access-log reason.
    pub const fn label(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::Algorithm => "algorithm",
            Refusal::UnknownKey => "unknown_key",
            Refusal::Signature => "bad_signature",
            Refusal::Expired => "expired",
            Refusal::NotYetValid => "not_yet_valid",
            Refusal::NoExpiry => "no_expiry",
            Refusal::Issuer => "issuer",
            Refusal::Audience => "audience",
            Refusal::NoSubject => "no_subject",
        }
    }

    /// What the client is told (RFC 6750's `error_description`: printable ASCII, no quote).
    pub const fn description(self) -> &'static str {
        match self {
            Refusal::Malformed => "the token is not a well-formed signed JWT",
            Refusal::Algorithm => "the token's algorithm is not accepted",
            Refusal::UnknownKey => "the token names a key that is not known",
            Refusal::Signature => "the token's signature does not verify",
            Refusal::Expired => "the token has expired",
            Refusal::NotYetValid => "the token is not valid yet",
            Refusal::NoExpiry => "the token has no expiry",
            Refusal::Issuer => "the token's issuer is not accepted",
            Refusal::Audience => "the token is for another audience",
            Refusal::NoSubject => "the token names no subject",
        }
    }
}

/// A verified token's facts: its consumer and the claims the route keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    pub consumer: Box<str>,
    /// `exp`: the token is good from now to then (plus leeway), what a cache of verified
    /// tokens may keep it for.
    pub expires: i64,
    /// `(name, value)` of each kept claim the token has, in [`Rules::keep`]'s order.
    pub claims: Vec<(Box<str>, Box<str>)>,
}

/// The decoded parts of a compact JWS, before any check of its signature.
#[derive(Debug)]
pub struct Parsed<'t> {
    pub alg: Alg,
    pub kid: Option<String>,
    /// `header.payload`, the signed bytes.
    pub signed: &'t [u8],
    pub payload: Vec<u8>,
    pub signature: Vec<u8>,
}

#[derive(Deserialize)]
struct Header {
    alg: String,
    kid: Option<String>,
    crit: Option<Value>,
}

/// Splits and decodes a compact JWS: three base64url parts, the header JSON with a known
/// `alg` (never `none`) and no `crit`. Never panics, whatever the bytes.
///
/// # Errors
/// [`Refusal::Malformed`] or [`Refusal::Algorithm`].
pub fn parse(token: &[u8]) -> Result<Parsed<'_>, Refusal> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(Refusal::Malformed);
    }
    let mut it = token.split(|&b| b == b'.');
    let (Some(h), Some(p), Some(s), None) = (it.next(), it.next(), it.next(), it.next()) else {
        return Err(Refusal::Malformed);
    };
    let header = URL_SAFE_NO_PAD.decode(h).map_err(|_| Refusal::Malformed)?;
    let header: Header = serde_json::from_slice(&header).map_err(|_| Refusal::Malformed)?;
    if header.crit.is_some() {
        return Err(Refusal::Malformed);
    }
    let alg = header.alg.parse::<Alg>().map_err(|_| Refusal::Algorithm)?;
    let payload = URL_SAFE_NO_PAD.decode(p).map_err(|_| Refusal::Malformed)?;
    let signature = URL_SAFE_NO_PAD.decode(s).map_err(|_| Refusal::Malformed)?;
    Ok(Parsed { alg, kid: header.kid, signed: &token[..h.len() + 1 + p.len()], payload, signature })
}

/// Verifies `token` against `keys` and `rules` at `now` (seconds since the epoch): the
/// algorithm, the signature, then `exp` (required), `nbf`, `iss`, and last `aud`, so that
/// [`Refusal::Audience`] means a token that is good but not for this route.
///
/// # Errors
/// The first [`Refusal`] found.
pub fn verify(token: &[u8], keys: &KeySet, rules: &Rules, now: i64) -> Result<Verified, Refusal> {
    let parsed = parse(token)?;
    if !rules.algorithms.contains(parsed.alg) {
        return Err(Refusal::Algorithm);
    }
    let mut candidates = keys.candidates(parsed.alg, parsed.kid.as_deref()).peekable();
    if candidates.peek().is_none() {
        return Err(Refusal::UnknownKey);
    }
    if !candidates.any(|k| k.verify(parsed.alg, parsed.signed, &parsed.signature)) {
        return Err(Refusal::Signature);
    }
    let claims: serde_json::Map<String, Value> =
        serde_json::from_slice(&parsed.payload).map_err(|_| Refusal::Malformed)?;
    let exp = claims.get("exp").map(numeric_date).ok_or(Refusal::NoExpiry)?.ok_or(Refusal::Malformed)?;
    if now > exp.saturating_add(rules.leeway_secs) {
        return Err(Refusal::Expired);
    }
    if let Some(nbf) = claims.get("nbf") {
        let nbf = numeric_date(nbf).ok_or(Refusal::Malformed)?;
        if now.saturating_add(rules.leeway_secs) < nbf {
            return Err(Refusal::NotYetValid);
        }
    }
    let expires = exp;
    if !rules.issuers.is_empty() {
        let iss = claims.get("iss").and_then(Value::as_str);
        if !iss.is_some_and(|i| rules.issuers.iter().any(|r| r == i)) {
            return Err(Refusal::Issuer);
        }
    }
    let consumer =
        claims.get(&rules.consumer_claim).and_then(text).filter(|c| !c.is_empty()).ok_or(Refusal::NoSubject)?;
    if !rules.audiences.is_empty() {
        let ok = match claims.get("aud") {
            Some(Value::String(a)) => rules.audiences.contains(a),
            Some(Value::Array(list)) => {
                list.iter().filter_map(Value::as_str).any(|a| rules.audiences.iter().any(|r| r == a))
            }
            _ => false,
        };
        if !ok {
            return Err(Refusal::Audience);
        }
    }
    let kept = rules
        .keep
        .iter()
        .filter_map(|name| claims.get(name).and_then(text).map(|v| (name.as_str().into(), v)))
        .collect();
    Ok(Verified { consumer, expires, claims: kept })
}

/// A NumericDate (seconds, maybe with a fraction) as whole seconds.
fn numeric_date(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64().or_else(|| n.as_f64().filter(|f| f.is_finite()).map(|f| f.floor() as i64)),
        _ => None,
    }
}

/// A claim as text: a string, a number's JSON form, or `true`/`false`; capped.
fn text(v: &Value) -> Option<Box<str>> {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        _ => return None,
    };
    let mut end = s.len().min(MAX_CLAIM_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Some(s[..end].into())
}

#[cfg(test)]
mod tests;
