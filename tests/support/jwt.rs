//! Signing keys made in the test (RSA by `openssl genpkey`, EC P-256 and Ed25519 by ring),
//! their public JWKs, and tokens signed with them. Shared by the unit tests of `src/jwt.rs`
//! and the integration tests.
#![allow(dead_code)]

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair as _, RsaKeyPair};
use serde_json::{json, Value};

/// A private key, its id, and what it signs.
pub struct Signer {
    pub kid: String,
    key: Kind,
}

enum Kind {
    Rsa(RsaKeyPair),
    Ec(EcdsaKeyPair),
    Ed(Ed25519KeyPair),
    Hmac(Vec<u8>),
}

fn b64(b: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(b)
}

/// A fresh 2048-bit RSA key, in DER from `openssl genpkey`.
fn rsa_der() -> Vec<u8> {
    let out = std::process::Command::new("openssl")
        .args(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-outform", "DER"])
        .output()
        .expect("openssl runs");
    assert!(out.status.success(), "openssl genpkey: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

impl Signer {
    pub fn rsa(kid: &str) -> Signer {
        // openssl writes PKCS#8 or, in some versions, PKCS#1 (`RSAPrivateKey`) as DER.
        let der = rsa_der();
        let key = RsaKeyPair::from_pkcs8(&der).or_else(|_| RsaKeyPair::from_der(&der)).expect("an RSA key");
        Signer { kid: kid.into(), key: Kind::Rsa(key) }
    }

    pub fn ec(kid: &str) -> Signer {
        let rng = SystemRandom::new();
        let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).expect("EC key");
        let key = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).expect("EC key");
        Signer { kid: kid.into(), key: Kind::Ec(key) }
    }

    pub fn ed25519(kid: &str) -> Signer {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).expect("Ed25519 key");
        let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("Ed25519 key");
        Signer { kid: kid.into(), key: Kind::Ed(key) }
    }

    pub fn hmac(secret: &[u8]) -> Signer {
        Signer { kid: String::new(), key: Kind::Hmac(secret.to_vec()) }
    }

    /// The public JWK (with `kid`).
    pub fn jwk(&self) -> Value {
        match &self.key {
            Kind::Rsa(k) => {
                let c: signature::RsaPublicKeyComponents<Vec<u8>> = k.public().into();
                json!({"kty": "RSA", "kid": self.kid, "use": "sig", "n": b64(&c.n), "e": b64(&c.e)})
            }
            Kind::Ec(k) => {
                let p = k.public_key().as_ref();
                json!({"kty": "EC", "crv": "P-256", "kid": self.kid, "x": b64(&p[1..33]), "y": b64(&p[33..65])})
            }
            Kind::Ed(k) => json!({"kty": "OKP", "crv": "Ed25519", "kid": self.kid, "x": b64(k.public_key().as_ref())}),
            Kind::Hmac(_) => json!({}),
        }
    }

    /// The algorithm this key signs with by default.
    pub fn alg(&self) -> &'static str {
        match &self.key {
            Kind::Rsa(_) => "RS256",
            Kind::Ec(_) => "ES256",
            Kind::Ed(_) => "EdDSA",
            Kind::Hmac(_) => "HS256",
        }
    }

    /// A token with `claims`, signed with this key's algorithm.
    pub fn sign(&self, claims: &Value) -> String {
        self.sign_as(self.alg(), claims)
    }

    /// A token whose header says `alg` (RSA keys sign RS256 or PS256; others their own).
    pub fn sign_as(&self, alg: &str, claims: &Value) -> String {
        let header = if self.kid.is_empty() {
            json!({"alg": alg, "typ": "JWT"})
        } else {
            json!({"alg": alg, "typ": "JWT", "kid": self.kid})
        };
        let signed = format!("{}.{}", b64(header.to_string().as_bytes()), b64(claims.to_string().as_bytes()));
        let rng = SystemRandom::new();
        let sig = match &self.key {
            Kind::Rsa(k) => {
                let pad: &'static dyn signature::RsaEncoding =
                    if alg == "PS256" { &signature::RSA_PSS_SHA256 } else { &signature::RSA_PKCS1_SHA256 };
                let mut sig = vec![0; k.public().modulus_len()];
                k.sign(pad, &rng, signed.as_bytes(), &mut sig).expect("RSA signs");
                sig
            }
            Kind::Ec(k) => k.sign(&rng, signed.as_bytes()).expect("EC signs").as_ref().to_vec(),
            Kind::Ed(k) => k.sign(signed.as_bytes()).as_ref().to_vec(),
            Kind::Hmac(s) => hs256(s, signed.as_bytes()),
        };
        format!("{signed}.{}", b64(&sig))
    }
}

/// An HMAC-SHA256 tag (for HS256 tokens, and for confusion attempts keyed by a public key).
pub fn hs256(secret: &[u8], message: &[u8]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    ring::hmac::sign(&key, message).as_ref().to_vec()
}

/// A token signed HS256 with `secret`, whose header names `kid`.
pub fn hs256_token(secret: &[u8], kid: &str, claims: &Value) -> String {
    let header = json!({"alg": "HS256", "kid": kid});
    let signed = format!("{}.{}", b64(header.to_string().as_bytes()), b64(claims.to_string().as_bytes()));
    format!("{signed}.{}", b64(&hs256(secret, signed.as_bytes())))
}

/// An unsigned token (`alg: none`).
pub fn unsigned(claims: &Value) -> String {
    format!("{}.{}.", b64(br#"{"alg":"none"}"#), b64(claims.to_string().as_bytes()))
}

/// A key set of these keys' public JWKs.
pub fn jwks(signers: &[&Signer]) -> String {
    json!({"keys": signers.iter().map(|s| s.jwk()).collect::<Vec<_>>()}).to_string()
}

/// Seconds since the epoch, now.
pub fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs() as i64
}
