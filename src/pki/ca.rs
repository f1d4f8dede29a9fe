//! The certificates tollgate makes itself: its local development CA (a root, and the
//! short-lived leaves it signs), the self-signed placeholder served while an ACME name has no
//! certificate yet, the TLS-ALPN-01 answer (RFC 8737), and the key and CSR of an ACME order.
//! Pure computation on rcgen (ECDSA P-256 keys); what comes out is PEM text and rustls'
//! signing keys. Storing it is the `acme` room's business.

use std::net::IpAddr;

use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

/// A certificate chain (leaf first) and its private key, as PEM text.
#[derive(Clone)]
pub struct Pem {
    pub chain: String,
    pub key: String,
}

impl std::fmt::Debug for Pem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pem").field("chain", &self.chain).finish_non_exhaustive()
    }
}

impl Pem {
    /// The chain and key as a served [`super::KeyPair`]: parsed, the key loaded for signing
    /// and checked against the certificate.
    ///
    /// # Errors
    /// Text that is not a chain and its key.
    pub fn pair(&self) -> Result<super::KeyPair, String> {
        use rustls::pki_types::pem::PemObject;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(self.chain.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("not a PEM certificate chain ({e})"))?;
        let first = chain.first().ok_or("no CERTIFICATE block")?;
        let facts = super::x509::parse(first).ok_or("the first certificate cannot be read")?;
        let key = PrivateKeyDer::from_pem_slice(self.key.as_bytes()).map_err(|e| format!("no private key ({e})"))?;
        let pair = super::KeyPair { chain, key, facts: Some(facts) };
        let ck = pair.signing().map_err(|e| format!("unsupported private key ({e})"))?;
        ck.keys_match().map_err(|_| "the key does not belong to the certificate".to_owned())?;
        Ok(pair)
    }
}

/// How long a local CA's root is valid (it is made once and kept).
const ROOT_YEARS: i64 = 10;

/// Clocks a little behind ours still accept a new certificate: it is dated this much earlier
/// (less for very short lifetimes, a tenth of them).
const BACKDATE_SECS: i64 = 60;

fn err(e: rcgen::Error) -> String {
    format!("making a certificate failed: {e}")
}

fn new_key() -> Result<KeyPair, String> {
    KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(err)
}

/// A random positive serial of 16 bytes (RFC 5280 allows 20; CAs use at least 64 random bits).
fn serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    fastrand::fill(&mut bytes);
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    SerialNumber::from(bytes.to_vec())
}

fn at(secs: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(secs).unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

/// Subject alternative names: IP addresses as such, the rest as DNS names.
fn sans(names: &[String]) -> Result<Vec<SanType>, String> {
    names
        .iter()
        .map(|n| match n.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => n.clone().try_into().map(SanType::DnsName).map_err(|_| format!("`{n}` is not a DNS name")),
        })
        .collect()
}

/// Leaf parameters for `names`, valid from `not_before` to `not_after` (unix seconds).
fn leaf_params(names: &[String], not_before: i64, not_after: i64) -> Result<CertificateParams, String> {
    let mut params = CertificateParams::default();
    params.subject_alt_names = sans(names)?;
    if let Some(first) = names.first() {
        params.distinguished_name.push(DnType::CommonName, first.as_str());
    }
    params.not_before = at(not_before);
    params.not_after = at(not_after);
    params.serial_number = Some(serial());
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    Ok(params)
}

/// The parameters of a local CA's root named `name` (the same every time they are made, but
/// for the dates and serial: a stored root is re-made from them to sign with).
fn root_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.distinguished_name.push(DnType::CommonName, name);
    params.distinguished_name.push(DnType::OrganizationName, "tollgate local CA");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params
}

/// tollgate's local development CA: a root made once per storage folder, and the leaves it
/// signs for the configured names. Never for production: only the machines that install its
/// root (`tollgate trust`) accept what it signs.
pub struct LocalCa {
    /// The root as rcgen signs with it (its name, key and key identifier are the stored root's).
    issuer: Issuer<'static, KeyPair>,
    /// The stored root, as PEM: what clients trust.
    pub root_pem: String,
}

impl LocalCa {
    /// A new CA, its root valid for ten years from `now` (unix seconds); with the PEM of its
    /// private key, to be stored beside the root.
    ///
    /// # Errors
    /// rcgen could not make the key or the certificate.
    pub fn create(now: i64) -> Result<(LocalCa, String), String> {
        // A name of its own per CA, so two machines' roots never look alike in a trust store.
        let name = format!("tollgate local CA {:08x}", fastrand::u32(..));
        let mut params = root_params(&name);
        params.not_before = at(now - 3600);
        params.not_after = at(now + ROOT_YEARS * 365 * 86_400);
        params.serial_number = Some(serial());
        let key = new_key()?;
        let root_pem = params.self_signed(&key).map_err(err)?.pem();
        let key_pem = key.serialize_pem();
        Ok((LocalCa { issuer: Issuer::new(params, key), root_pem }, key_pem))
    }

    /// The CA stored as `root_pem` and `key_pem`.
    ///
    /// # Errors
    /// The texts are not a root certificate and its key.
    pub fn load(root_pem: &str, key_pem: &str) -> Result<LocalCa, String> {
        let pair = Pem { chain: root_pem.to_owned(), key: key_pem.to_owned() }.pair()?;
        let name =
            pair.facts.as_ref().and_then(|f| f.common_name.clone()).ok_or("the root certificate has no common name")?;
        let key = KeyPair::from_pem(key_pem).map_err(|e| format!("the CA key cannot be read ({e})"))?;
        // The same name and key as the stored root: what a leaf's issuer and AKI are made of.
        Ok(LocalCa { issuer: Issuer::new(root_params(&name), key), root_pem: root_pem.to_owned() })
    }

    /// A leaf for `names` (DNS names, `*.` wildcards, IP addresses), valid from `now` for
    /// `lifetime_secs`, signed by the root; the chain is the leaf alone (clients hold the root).
    ///
    /// # Errors
    /// A name that is neither a DNS name nor an IP address, or rcgen failed.
    pub fn issue(&self, names: &[String], now: i64, lifetime_secs: i64) -> Result<Pem, String> {
        let back = BACKDATE_SECS.min(lifetime_secs / 10);
        let mut params = leaf_params(names, now - back, now + lifetime_secs)?;
        params.use_authority_key_identifier_extension = true;
        let key = new_key()?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        Ok(Pem { chain: cert.pem(), key: key.serialize_pem() })
    }
}

/// A self-signed certificate for `names`, valid for a day from `now`: served while a name has
/// no certificate from its CA yet (no client trusts it; the logs and metrics say why).
///
/// # Errors
/// A name rcgen refuses, or rcgen failed.
pub fn placeholder(names: &[String], now: i64) -> Result<Pem, String> {
    let mut params = leaf_params(names, now - BACKDATE_SECS, now + 86_400)?;
    params.distinguished_name.push(DnType::OrganizationName, "tollgate placeholder (no certificate yet)");
    let key = new_key()?;
    let cert = params.self_signed(&key).map_err(err)?;
    Ok(Pem { chain: cert.pem(), key: key.serialize_pem() })
}

/// The certificate of a TLS-ALPN-01 answer for `name` (RFC 8737): self-signed, the name as
/// its only SAN, the SHA-256 `digest` of the key authorization in the critical
/// `acmeIdentifier` extension; served only to clients that offer ALPN `acme-tls/1` alone.
///
/// # Errors
/// A name rcgen refuses, or a key the provider cannot sign with.
pub fn alpn_challenge(name: &str, digest: &[u8], now: i64) -> Result<CertifiedKey, String> {
    let mut params = leaf_params(&[name.to_owned()], now - BACKDATE_SECS, now + 86_400)?;
    params.custom_extensions = vec![CustomExtension::new_acme_identifier(digest)];
    let key = new_key()?;
    let cert = params.self_signed(&key).map_err(err)?;
    let der = PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let signing = super::provider().key_provider.load_private_key(der).map_err(|e| e.to_string())?;
    Ok(CertifiedKey::new(vec![cert.der().clone()], signing))
}

/// A new key and the CSR of an order for `names` (DER), with the key as PEM.
///
/// # Errors
/// A name rcgen refuses, or rcgen failed.
pub fn csr(names: &[String]) -> Result<(Vec<u8>, String), String> {
    let mut params = CertificateParams::default();
    params.subject_alt_names = sans(names)?;
    let key = new_key()?;
    let csr = params.serialize_request(&key).map_err(err)?;
    Ok((csr.der().to_vec(), key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn now() -> i64 {
        1_800_000_000
    }

    /// A leaf from a CA re-made from its stored files verifies under the stored root: the
    /// root is made once, and every later start signs with it.
    #[test]
    fn a_stored_ca_signs_leaves_its_root_verifies() {
        use rustls::client::danger::ServerCertVerifier;
        let (ca, key_pem) = LocalCa::create(now()).unwrap();
        let again = LocalCa::load(&ca.root_pem, &key_pem).unwrap();
        let leaf = again.issue(&names(&["localhost", "127.0.0.1", "*.dev.localhost"]), now(), 3600).unwrap();
        let pair = leaf.pair().unwrap();
        let facts = pair.facts.clone().unwrap();
        assert_eq!(facts.dns_names, ["localhost", "*.dev.localhost"]);
        assert_eq!(facts.other_names, ["127.0.0.1"]);
        assert_eq!(facts.not_after, now() + 3600);
        use rustls::pki_types::pem::PemObject;
        let root = CertificateDer::from_pem_slice(ca.root_pem.as_bytes()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(root).unwrap();
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), crate::pki::provider())
                .build()
                .unwrap();
        let at = rustls::pki_types::UnixTime::since_unix_epoch(std::time::Duration::from_secs(now() as u64 + 10));
        for name in ["localhost", "app.dev.localhost", "127.0.0.1"] {
            let server = rustls::pki_types::ServerName::try_from(name).unwrap();
            verifier
                .verify_server_cert(&pair.chain[0], &[], &server, &[], at)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let other = LocalCa::create(now()).unwrap().0;
        assert_ne!(other.root_pem, ca.root_pem);
        let stranger = other.issue(&names(&["localhost"]), now(), 3600).unwrap().pair().unwrap();
        let server = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        assert!(verifier.verify_server_cert(&stranger.chain[0], &[], &server, &[], at).is_err());
    }

    #[test]
    fn a_root_and_a_key_that_do_not_belong_together_are_refused() {
        let (a, _) = LocalCa::create(now()).unwrap();
        let (_, key_b) = LocalCa::create(now()).unwrap();
        assert!(LocalCa::load(&a.root_pem, &key_b).err().unwrap().contains("does not belong"));
        assert!(LocalCa::load("junk", &key_b).is_err());
    }

    #[test]
    fn an_alpn_answer_carries_the_digest_in_a_critical_extension() {
        let digest = [7u8; 32];
        let ck = alpn_challenge("a.example", &digest, now()).unwrap();
        let der = ck.cert[0].as_ref();
        // id-pe-acmeIdentifier 1.3.6.1.5.5.7.1.31, critical, OCTET STRING { OCTET STRING digest }
        let oid =
            [0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x01, 0x1f, 0x01, 0x01, 0xff, 0x04, 0x22, 0x04, 0x20];
        let at = der.windows(oid.len()).position(|w| w == oid).expect("the acmeIdentifier extension");
        assert_eq!(&der[at + oid.len()..at + oid.len() + 32], &digest);
        assert_eq!(crate::pki::x509::parse(der).unwrap().dns_names, ["a.example"]);
    }

    #[test]
    fn a_placeholder_and_a_csr_name_what_they_are_for() {
        let p = placeholder(&names(&["shop.example"]), now()).unwrap().pair().unwrap();
        assert_eq!(p.facts.unwrap().dns_names, ["shop.example"]);
        let (csr, key) = csr(&names(&["shop.example", "www.shop.example"])).unwrap();
        assert!(key.contains("PRIVATE KEY"));
        let text = String::from_utf8_lossy(&csr);
        assert!(text.contains("www.shop.example"));
    }
}
