//! `tollgate token`: signs a JWT with a private key file, for trying a route's `auth.jwt` by
//! hand (the guide's tokens) and for tests. It is not an identity provider: the key is read
//! from a file, nothing is stored, and every claim is what the command line says.
//!
//! The key is a PKCS#8 PEM file (`-----BEGIN PRIVATE KEY-----`): an EC P-256 key signs ES256,
//! an Ed25519 key EdDSA (`openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256`, or
//! `-algorithm ed25519`).

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, Ed25519KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivatePkcs8KeyDer;
use serde_json::{Map, Value};

#[derive(clap::Args)]
pub struct TokenArgs {
    /// The private key (PKCS#8 PEM): EC P-256 signs ES256, Ed25519 signs EdDSA.
    #[arg(long)]
    key: PathBuf,
    /// The key's id in the key set (`kid` of the header); without it the verifier tries every
    /// key of its set.
    #[arg(long)]
    kid: Option<String>,
    /// The subject (`sub`): the consumer a limit with `key: consumer` counts.
    #[arg(long)]
    sub: Option<String>,
    /// The issuer (`iss`).
    #[arg(long)]
    iss: Option<String>,
    /// The audience (`aud`).
    #[arg(long)]
    aud: Option<String>,
    /// Valid for this long from now (`exp`).
    #[arg(long, default_value = "1h", value_parser = super::duration)]
    exp: Duration,
    /// Expired: `exp` an hour ago (a token to see the 401 of an expired one).
    #[arg(long, conflicts_with = "exp")]
    expired: bool,
    /// Not valid before this long from now (`nbf`).
    #[arg(long, value_parser = super::duration)]
    nbf: Option<Duration>,
    /// Another claim, `NAME=VALUE` (repeatable); a VALUE that is a JSON number, boolean,
    /// array or object is kept as one, any other is a string: `--claim org_id=acme --claim plan=pro`.
    #[arg(long = "claim", value_name = "NAME=VALUE")]
    claims: Vec<String>,
}

/// A signing key read from a PKCS#8 file.
enum Signer {
    Es256(EcdsaKeyPair),
    EdDsa(Ed25519KeyPair),
}

impl Signer {
    fn read(path: &std::path::Path) -> Result<Signer, String> {
        let der = PrivatePkcs8KeyDer::from_pem_file(path).map_err(|e| {
            format!("{}: {e} (expected a PKCS#8 PEM private key, `-----BEGIN PRIVATE KEY-----`)", path.display())
        })?;
        let rng = SystemRandom::new();
        if let Ok(k) = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, der.secret_pkcs8_der(), &rng) {
            return Ok(Signer::Es256(k));
        }
        if let Ok(k) = Ed25519KeyPair::from_pkcs8_maybe_unchecked(der.secret_pkcs8_der()) {
            return Ok(Signer::EdDsa(k));
        }
        Err(format!("{}: not an EC P-256 or Ed25519 private key", path.display()))
    }

    fn alg(&self) -> &'static str {
        match self {
            Signer::Es256(_) => "ES256",
            Signer::EdDsa(_) => "EdDSA",
        }
    }

    fn sign(&self, input: &[u8]) -> Result<Vec<u8>, String> {
        match self {
            Signer::Es256(k) => k
                .sign(&SystemRandom::new(), input)
                .map(|s| s.as_ref().to_vec())
                .map_err(|_| "signing failed".to_owned()),
            Signer::EdDsa(k) => Ok(k.sign(input).as_ref().to_vec()),
        }
    }
}

/// `NAME=VALUE` as a claim.
fn claim(arg: &str) -> Result<(String, Value), String> {
    let (name, value) =
        arg.split_once('=').ok_or_else(|| format!("--claim `{arg}`: expected NAME=VALUE (e.g. org_id=acme)"))?;
    if name.is_empty() {
        return Err(format!("--claim `{arg}`: the name is empty"));
    }
    let value = match serde_json::from_str::<Value>(value) {
        Ok(v @ (Value::Number(_) | Value::Bool(_) | Value::Array(_) | Value::Object(_))) => v,
        _ => Value::String(value.to_owned()),
    };
    Ok((name.to_owned(), value))
}

/// The signed token (compact JWS), its claims at `now` (seconds since the epoch).
fn token_at(a: &TokenArgs, now: u64) -> Result<String, String> {
    let signer = Signer::read(&a.key)?;
    let mut header = Map::new();
    header.insert("alg".into(), signer.alg().into());
    header.insert("typ".into(), "JWT".into());
    if let Some(kid) = &a.kid {
        header.insert("kid".into(), kid.as_str().into());
    }
    let mut claims = Map::new();
    for (name, value) in [("sub", &a.sub), ("iss", &a.iss), ("aud", &a.aud)] {
        if let Some(v) = value {
            claims.insert(name.into(), v.as_str().into());
        }
    }
    claims.insert("iat".into(), now.into());
    let exp = if a.expired { now.saturating_sub(3600) } else { now.saturating_add(a.exp.as_secs()) };
    claims.insert("exp".into(), exp.into());
    if let Some(nbf) = a.nbf {
        claims.insert("nbf".into(), now.saturating_add(nbf.as_secs()).into());
    }
    for arg in &a.claims {
        let (name, value) = claim(arg)?;
        claims.insert(name, value);
    }
    let part = |m: &Map<String, Value>| URL_SAFE_NO_PAD.encode(Value::Object(m.clone()).to_string());
    let input = format!("{}.{}", part(&header), part(&claims));
    let signature = signer.sign(input.as_bytes())?;
    Ok(format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature)))
}

/// The token for `a`, signed now.
pub fn token(a: &TokenArgs) -> Result<String, String> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    token_at(a, now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_keep_json_values_and_strings() {
        assert_eq!(claim("org_id=acme").unwrap(), ("org_id".to_owned(), Value::String("acme".into())));
        assert_eq!(claim("n=3").unwrap(), ("n".to_owned(), Value::from(3)));
        assert_eq!(claim("scope=[\"a\"]").unwrap().1, serde_json::json!(["a"]));
        assert_eq!(claim("empty=").unwrap().1, Value::String(String::new()));
        assert!(claim("novalue").is_err());
        assert!(claim("=x").is_err());
    }

    #[test]
    fn the_guide_key_signs_a_token_its_key_set_verifies() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let args = TokenArgs {
            key: root.join("examples/jwt-test-only.pem"),
            kid: Some("guide-test-only".into()),
            sub: Some("alice".into()),
            iss: Some("https://id.example.com/".into()),
            aud: Some("api".into()),
            exp: Duration::from_secs(3600),
            expired: false,
            nbf: None,
            claims: vec!["org_id=acme".into()],
        };
        let t = token_at(&args, 1_000_000).unwrap();
        let parts: Vec<&str> = t.split('.').collect();
        assert_eq!(parts.len(), 3);
        let claims: Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[1]).unwrap()).unwrap();
        assert_eq!(claims["exp"], 1_003_600);
        assert_eq!(claims["org_id"], "acme");
        // The public half in examples/jwks.json verifies it.
        let jwks = std::fs::read_to_string(root.join("examples/jwks.json")).unwrap();
        let set: Value = serde_json::from_str(&jwks).unwrap();
        let k = &set["keys"][0];
        let mut point = vec![4u8];
        point.extend(URL_SAFE_NO_PAD.decode(k["x"].as_str().unwrap()).unwrap());
        point.extend(URL_SAFE_NO_PAD.decode(k["y"].as_str().unwrap()).unwrap());
        let public = ring::signature::UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_FIXED, point);
        let signed = format!("{}.{}", parts[0], parts[1]);
        public.verify(signed.as_bytes(), &URL_SAFE_NO_PAD.decode(parts[2]).unwrap()).unwrap();
    }
}
