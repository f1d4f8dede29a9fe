//! `BENCH_AUTH`: a key made here (EC P-256, Ed25519) or read (RSA), its key set or keys file
//! written beside the credential a client sends, and the route's `auth:` section.

use std::path::Path;

use anyhow::Context;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair as _, RsaKeyPair};

type Sign = Box<dyn Fn(&[u8]) -> anyhow::Result<Vec<u8>>>;

/// What the bench's route and client do with credentials besides the kind.
#[derive(Default)]
pub struct Options<'a> {
    /// An RSA key (DER) for `rs256`.
    pub rsa_key: Option<&'a str>,
    /// The client's credential is a bad one: a token whose signature does not verify, or an
    /// unknown API key (`BENCH_AUTH_BAD`): every request is verified, and refused.
    pub bad: bool,
    /// `auth.failures` at this rate, burst 1, by client IP (`BENCH_AUTH_FAILURES`): with a bad
    /// credential, every request after the first is refused before verification.
    pub failures: Option<&'a str>,
}

/// Writes the key set (or keys file) and `credential` into `dir`; the route's `auth:` lines.
///
/// # Errors
/// An unknown kind, a key that cannot be made or read, a file that cannot be written.
pub fn prepare(kind: &str, dir: &Path, o: &Options<'_>) -> anyhow::Result<String> {
    let failures = match o.failures {
        Some(rate) => format!(", failures: {{ algorithm: token_bucket, rate: {rate}, burst: 1 }}"),
        None => String::new(),
    };
    let rsa_key = o.rsa_key;
    std::fs::create_dir_all(dir).context("BENCH_AUTH_DIR")?;
    let b64 = |b: &[u8]| URL_SAFE_NO_PAD.encode(b);
    let rng = SystemRandom::new();
    let (alg, jwk, sign): (&str, String, Sign) = match kind {
        "api_key" => {
            let keys = dir.join("keys.txt");
            let line = format!("{} bench-consumer\n", crate::config::auth::hash_key(b"bench-key"));
            std::fs::write(&keys, line).context("writing the keys file")?;
            let key = if o.bad { "not-a-bench-key" } else { "bench-key" };
            std::fs::write(dir.join("credential"), format!("x-api-key: {key}")).context("writing the credential")?;
            return Ok(format!("    auth: {{ api_key: {{ keys: {:?} }}{failures} }}\n", keys.display().to_string()));
        }
        "es256" => {
            let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
            let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).map_err(|_| anyhow::anyhow!("EC key"))?;
            let key = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).map_err(|_| anyhow::anyhow!("EC key"))?;
            let p = key.public_key().as_ref().to_vec();
            let jwk =
                format!(r#"{{"kty":"EC","crv":"P-256","kid":"b","x":"{}","y":"{}"}}"#, b64(&p[1..33]), b64(&p[33..]));
            let sign = move |m: &[u8]| {
                Ok(key.sign(&SystemRandom::new(), m).map_err(|_| anyhow::anyhow!("signing"))?.as_ref().to_vec())
            };
            ("ES256", jwk, Box::new(sign))
        }
        "eddsa" => {
            let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| anyhow::anyhow!("Ed25519 key"))?;
            let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).map_err(|_| anyhow::anyhow!("Ed25519 key"))?;
            let jwk = format!(r#"{{"kty":"OKP","crv":"Ed25519","kid":"b","x":"{}"}}"#, b64(key.public_key().as_ref()));
            ("EdDSA", jwk, Box::new(move |m: &[u8]| Ok(key.sign(m).as_ref().to_vec())))
        }
        "rs256" => {
            let path = rsa_key.context("BENCH_AUTH=rs256 needs BENCH_AUTH_KEY (an RSA key in DER)")?;
            let der = std::fs::read(path).context("BENCH_AUTH_KEY")?;
            let key = RsaKeyPair::from_pkcs8(&der)
                .or_else(|_| RsaKeyPair::from_der(&der))
                .map_err(|e| anyhow::anyhow!("BENCH_AUTH_KEY: {e}"))?;
            let c: signature::RsaPublicKeyComponents<Vec<u8>> = key.public().into();
            let jwk = format!(r#"{{"kty":"RSA","kid":"b","n":"{}","e":"{}"}}"#, b64(&c.n), b64(&c.e));
            let sign = move |m: &[u8]| {
                let mut sig = vec![0; key.public().modulus_len()];
                key.sign(&signature::RSA_PKCS1_SHA256, &SystemRandom::new(), m, &mut sig)
                    .map_err(|_| anyhow::anyhow!("signing"))?;
                Ok(sig)
            };
            ("RS256", jwk, Box::new(sign))
        }
        other => anyhow::bail!("BENCH_AUTH={other}: expected es256, rs256, eddsa or api_key"),
    };
    let jwks = dir.join("jwks.json");
    std::fs::write(&jwks, format!(r#"{{"keys":[{jwk}]}}"#)).context("writing the key set")?;
    let exp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() + 86_400;
    let header = format!(r#"{{"alg":"{alg}","kid":"b","typ":"JWT"}}"#);
    let claims = format!(r#"{{"sub":"bench-consumer","aud":"bench","iss":"bench","exp":{exp}}}"#);
    let signed = format!("{}.{}", b64(header.as_bytes()), b64(claims.as_bytes()));
    let mut signature = sign(signed.as_bytes())?;
    if o.bad {
        // Same length and form, another value: verified in full, and refused.
        signature[0] ^= 1;
    }
    let token = format!("{signed}.{}", b64(&signature));
    std::fs::write(dir.join("credential"), format!("authorization: Bearer {token}"))
        .context("writing the credential")?;
    Ok(format!(
        "    auth: {{ jwt: {{ jwks: {:?}, issuers: [bench], audiences: [bench], algorithms: [{alg}] }}{failures} }}\n",
        jwks.display().to_string()
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn bench_auth_configs_are_valid() {
        for kind in ["es256", "eddsa", "api_key"] {
            let dir = std::env::temp_dir().join(format!("tollgate-bench-auth-{}-{kind}", std::process::id()));
            let failures = super::Options { bad: true, failures: Some("1/h"), ..Default::default() };
            for o in [super::Options::default(), failures] {
                let auth = super::prepare(kind, &dir, &o).unwrap();
                let store = super::super::BenchStore { auth: Some(auth), ..Default::default() };
                let yaml = super::super::bench_yaml("127.0.0.1:18020", "127.0.0.1:18000", "10/s", 10, &store);
                crate::config::Config::from_yaml(std::path::Path::new("b.yaml"), &yaml).unwrap();
            }
            let auth = super::prepare(kind, &dir, &super::Options::default()).unwrap();
            let store = super::super::BenchStore { auth: Some(auth), ..Default::default() };
            let yaml = super::super::bench_yaml("127.0.0.1:18020", "127.0.0.1:18000", "10/s", 10, &store);
            crate::config::Config::from_yaml(std::path::Path::new("b.yaml"), &yaml).unwrap();
            assert!(std::fs::read_to_string(dir.join("credential")).unwrap().contains(": "));
        }
    }
}
