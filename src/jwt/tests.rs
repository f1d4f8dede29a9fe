use proptest::prelude::*;
use serde_json::json;

use super::*;

#[path = "../../tests/support/jwt.rs"]
mod mint;

use mint::Signer;

const NOW: i64 = 1_800_000_000;

fn rules() -> Rules {
    Rules {
        algorithms: Alg::ALL.into_iter().filter(|a| *a != Alg::HS256).fold(Algs::default(), Algs::with),
        issuers: vec!["https://id.example.com/".into()],
        audiences: vec!["api".into()],
        leeway_secs: 30,
        consumer_claim: "sub".into(),
        keep: vec!["org_id".into(), "plan".into()],
    }
}

fn claims() -> serde_json::Value {
    json!({"sub": "alice", "iss": "https://id.example.com/", "aud": "api", "exp": NOW + 60, "org_id": "acme", "n": 1})
}

fn set(signers: &[&Signer]) -> KeySet {
    KeySet::from_jwks(mint::jwks(signers).as_bytes()).expect("a key set")
}

#[test]
fn every_key_type_verifies_its_own_tokens() {
    let (rsa, ec, ed) = (Signer::rsa("r"), Signer::ec("e"), Signer::ed25519("d"));
    let keys = set(&[&rsa, &ec, &ed]);
    for (signer, alg) in [(&rsa, "RS256"), (&rsa, "PS256"), (&ec, "ES256"), (&ed, "EdDSA")] {
        let v = verify(signer.sign_as(alg, &claims()).as_bytes(), &keys, &rules(), NOW).expect(alg);
        assert_eq!(&*v.consumer, "alice");
        assert_eq!(v.claims, vec![("org_id".into(), "acme".into())], "only kept claims, only those present");
    }
}

#[test]
fn times_issuer_and_audience_are_checked_in_order() {
    let ec = Signer::ec("e");
    let keys = set(&[&ec]);
    let with = |k: &str, v: serde_json::Value| {
        let mut c = claims();
        c[k] = v;
        verify(ec.sign(&c).as_bytes(), &keys, &rules(), NOW)
    };
    assert_eq!(with("exp", json!(NOW - 31)), Err(Refusal::Expired));
    assert!(with("exp", json!(NOW - 29)).is_ok(), "within the leeway");
    assert_eq!(with("nbf", json!(NOW + 31)), Err(Refusal::NotYetValid));
    assert!(with("nbf", json!(NOW + 29)).is_ok());
    assert_eq!(with("iss", json!("https://evil.example/")), Err(Refusal::Issuer));
    assert_eq!(with("aud", json!("other")), Err(Refusal::Audience));
    assert!(with("aud", json!(["other", "api"])).is_ok());
    assert_eq!(with("sub", json!("")), Err(Refusal::NoSubject));
    assert_eq!(with("exp", json!("tomorrow")), Err(Refusal::Malformed));
    let mut c = claims();
    c.as_object_mut().unwrap().remove("exp");
    assert_eq!(verify(ec.sign(&c).as_bytes(), &keys, &rules(), NOW), Err(Refusal::NoExpiry));
    // An expired token for another audience is refused as expired: 401, not 403.
    let mut c = claims();
    c["exp"] = json!(NOW - 100);
    c["aud"] = json!("other");
    assert_eq!(verify(ec.sign(&c).as_bytes(), &keys, &rules(), NOW), Err(Refusal::Expired));
}

#[test]
fn a_bad_signature_or_another_key_is_refused() {
    let (ec, other) = (Signer::ec("e"), Signer::ec("e"));
    let keys = set(&[&ec]);
    let forged = other.sign(&claims());
    assert_eq!(verify(forged.as_bytes(), &keys, &rules(), NOW), Err(Refusal::Signature));
    // A changed payload under the original signature.
    let token = ec.sign(&claims());
    let mut parts: Vec<&str> = token.split('.').collect();
    let mut c = claims();
    c["sub"] = json!("mallory");
    let payload = URL_SAFE_NO_PAD.encode(c.to_string());
    parts[1] = &payload;
    assert_eq!(verify(parts.join(".").as_bytes(), &keys, &rules(), NOW), Err(Refusal::Signature));
}

#[test]
fn none_is_never_an_algorithm() {
    let keys = set(&[&Signer::ec("e")]);
    assert_eq!(verify(mint::unsigned(&claims()).as_bytes(), &keys, &rules(), NOW), Err(Refusal::Algorithm));
    let mut all = rules();
    all.algorithms = Alg::ALL.into_iter().fold(Algs::default(), Algs::with);
    assert_eq!(verify(mint::unsigned(&claims()).as_bytes(), &keys, &all, NOW), Err(Refusal::Algorithm));
}

#[test]
fn an_hmac_token_keyed_by_a_public_key_is_refused() {
    // Algorithm confusion: HS256 "signed" with the RSA key's public bytes, the route even
    // accepting HS256. The key is RSA: it verifies RS256 and PS256 only.
    let rsa = Signer::rsa("r");
    let keys = set(&[&rsa]);
    let mut all = rules();
    all.algorithms = Alg::ALL.into_iter().fold(Algs::default(), Algs::with);
    let jwk = rsa.jwk();
    for secret in [jwk.to_string(), jwk["n"].as_str().unwrap().to_owned()] {
        let token = mint::hs256_token(secret.as_bytes(), "r", &claims());
        assert_eq!(verify(token.as_bytes(), &keys, &all, NOW), Err(Refusal::UnknownKey));
    }
    // And a key set never yields an HMAC key, even when it holds an `oct` key.
    let oct = r#"{"keys":[{"kty":"oct","k":"c2VjcmV0","kid":"r"},{"kty":"EC","crv":"P-384","x":"AA","y":"AA"}]}"#;
    assert_eq!(KeySet::from_jwks(oct.as_bytes()).unwrap_err(), KeySetError::Empty);
}

#[test]
fn hs256_verifies_with_an_explicit_secret_only_when_listed() {
    let secret = b"0123456789abcdef0123456789abcdef";
    let keys = KeySet::hmac(secret);
    let token = Signer::hmac(secret).sign(&claims());
    assert_eq!(verify(token.as_bytes(), &keys, &rules(), NOW), Err(Refusal::Algorithm));
    let mut hs = rules();
    hs.algorithms = Algs::default().with(Alg::HS256);
    assert!(verify(token.as_bytes(), &keys, &hs, NOW).is_ok());
    let wrong = Signer::hmac(b"another secret of thirty-two byte").sign(&claims());
    assert_eq!(verify(wrong.as_bytes(), &keys, &hs, NOW), Err(Refusal::Signature));
}

#[test]
fn kid_picks_the_key_and_an_unknown_kid_says_so() {
    let (a, b) = (Signer::ec("a"), Signer::ec("b"));
    let keys = set(&[&a]);
    assert!(keys.has_kid("a") && !keys.has_kid("b"));
    assert_eq!(verify(b.sign(&claims()).as_bytes(), &keys, &rules(), NOW), Err(Refusal::UnknownKey));
    let both = set(&[&a, &b]);
    assert!(verify(b.sign(&claims()).as_bytes(), &both, &rules(), NOW).is_ok());
}

#[test]
fn a_route_that_does_not_list_an_algorithm_refuses_it() {
    let ed = Signer::ed25519("d");
    let keys = set(&[&ed]);
    let mut es = rules();
    es.algorithms = Algs::default().with(Alg::ES256);
    assert_eq!(verify(ed.sign(&claims()).as_bytes(), &keys, &es, NOW), Err(Refusal::Algorithm));
}

#[test]
fn key_sets_that_cannot_verify_are_refused_with_the_key() {
    assert!(matches!(KeySet::from_jwks(b"{"), Err(KeySetError::Json(_))));
    assert_eq!(KeySet::from_jwks(br#"{"keys":[]}"#).unwrap_err(), KeySetError::Empty);
    let short = r#"{"keys":[{"kty":"RSA","n":"AQAB","e":"AQAB"}]}"#;
    assert!(matches!(KeySet::from_jwks(short.as_bytes()), Err(KeySetError::Key { index: 0, .. })));
    let bad_ec = r#"{"keys":[{"kty":"EC","crv":"P-256","x":"AQAB","y":"AQAB"}]}"#;
    assert!(matches!(KeySet::from_jwks(bad_ec.as_bytes()), Err(KeySetError::Key { index: 0, .. })));
    let not_b64 = r#"{"keys":[{"kty":"OKP","crv":"Ed25519","x":"!!"}]}"#;
    assert!(matches!(KeySet::from_jwks(not_b64.as_bytes()), Err(KeySetError::Key { index: 0, .. })));
    // Encryption keys are skipped, not refused.
    let ec = Signer::ec("e");
    let mut enc = ec.jwk();
    enc["use"] = json!("enc");
    let mixed = json!({"keys": [enc, ec.jwk()]}).to_string();
    assert_eq!(KeySet::from_jwks(mixed.as_bytes()).unwrap().len(), 1);
}

#[test]
fn malformed_tokens_are_refused_without_panicking() {
    let keys = set(&[&Signer::ec("e")]);
    for t in ["", ".", "..", "a.b.c", "a.b.c.d", "eyJhbGciOiJFUzI1NiJ9..", "eyJ9.e30.AA"] {
        assert!(verify(t.as_bytes(), &keys, &rules(), NOW).is_err(), "{t:?}");
    }
    let long = "a".repeat(MAX_TOKEN_BYTES + 1);
    assert_eq!(parse(long.as_bytes()).unwrap_err(), Refusal::Malformed);
    let crit = format!("{}.e30.AA", URL_SAFE_NO_PAD.encode(r#"{"alg":"ES256","crit":["b64"]}"#));
    assert_eq!(parse(crit.as_bytes()).unwrap_err(), Refusal::Malformed);
}

proptest! {
    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse(&bytes);
    }

    #[test]
    fn parse_never_panics_on_dotted_base64(parts in proptest::collection::vec("[A-Za-z0-9_-]{0,40}", 0..5)) {
        let _ = parse(parts.join(".").as_bytes());
    }

    #[test]
    fn any_changed_byte_breaks_a_token(i in 0usize..400, b in any::<u8>()) {
        let ec = Signer::ec("e");
        let keys = set(&[&ec]);
        let token = ec.sign(&claims()).into_bytes();
        let mut changed = token.clone();
        let i = i % changed.len();
        prop_assume!(changed[i] != b);
        changed[i] = b;
        // A changed byte may decode to the same bits (base64's last character): only a
        // token whose decoded parts changed must fail.
        let same = parse(&changed).ok().zip(parse(&token).ok()).is_some_and(|(a, o)| {
            a.signed == o.signed && a.signature == o.signature
        });
        prop_assert!(same || verify(&changed, &keys, &rules(), NOW).is_err());
    }
}
