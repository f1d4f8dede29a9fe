//! Certificates and keys: PEM and DER files read with bounds, the few x509 facts tollgate
//! reads, the crypto provider of every TLS config, and the checks a config's files pass when
//! it loads (a key belongs to its certificate, nothing expired, CAs usable). What comes out
//! is data (DER bytes and facts); the rustls configs are built from it when the proxy is
//! ([`server`] for listeners, `forward::connector` for upstreams), never per connection.
//! The certificates tollgate makes itself ([`ca`]: its local CA, placeholders, ACME's keys and
//! CSRs) and the store of those it obtained ([`issued`]) live here too; getting them (network,
//! timers, files) is the `acme` room's.

pub mod ca;
pub mod issued;
pub mod server;
pub mod x509;

use std::io::Read;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;

/// PEM files larger than this are refused (a chain is a few KiB; a path to `/dev/zero` must
/// not hang the load).
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// The crypto provider of every TLS config tollgate builds: ring, or aws-lc-rs with the
/// `aws-lc-rs` feature (off by default: AWS-LC's C build costs minutes, see Cargo.toml).
/// The first call also makes it the process's default, for the configs that libraries build
/// themselves (the Redis client's for `rediss://`): with both rustls providers compiled in,
/// rustls cannot pick one on its own.
pub fn provider() -> Arc<CryptoProvider> {
    static P: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    P.get_or_init(|| {
        let p = Arc::new(chosen_provider());
        // Err only when a default was installed before (an embedding program's): it stays.
        let _ = CryptoProvider::install_default(CryptoProvider::clone(&p));
        p
    })
    .clone()
}

/// ring's provider (the default build).
#[cfg(not(feature = "aws-lc-rs"))]
fn chosen_provider() -> CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// aws-lc-rs' provider (the `aws-lc-rs` feature).
#[cfg(feature = "aws-lc-rs")]
fn chosen_provider() -> CryptoProvider {
    rustls::crypto::aws_lc_rs::default_provider()
}

/// The session ticket encrypter on the chosen provider's ciphers (see [`provider`]).
#[cfg(not(feature = "aws-lc-rs"))]
pub fn ticketer() -> Result<Arc<dyn rustls::server::ProducesTickets>, rustls::Error> {
    rustls::crypto::ring::Ticketer::new()
}

/// The session ticket encrypter on the chosen provider's ciphers (see [`provider`]).
#[cfg(feature = "aws-lc-rs")]
pub fn ticketer() -> Result<Arc<dyn rustls::server::ProducesTickets>, rustls::Error> {
    rustls::crypto::aws_lc_rs::Ticketer::new()
}

/// Reads a regular file of at most [`MAX_PEM_BYTES`] (a FIFO or a device would block or never
/// end: refused before it is opened).
pub fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: cannot read the file: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{}: not a regular file; expected a PEM file", path.display()));
    }
    let f = std::fs::File::open(path).map_err(|e| format!("{}: cannot read the file: {e}", path.display()))?;
    let mut buf = Vec::new();
    f.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| format!("{}: cannot read the file: {e}", path.display()))?;
    if buf.len() as u64 > MAX_PEM_BYTES {
        return Err(format!("{}: larger than {MAX_PEM_BYTES} bytes; expected a PEM file", path.display()));
    }
    Ok(buf)
}

/// Every `CERTIFICATE` block of a PEM file, in order.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read_file(path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: not a PEM certificate file ({e})", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no CERTIFICATE block; expected a PEM certificate chain", path.display()));
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 RSA or SEC1 EC).
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let pem = read_file(path)?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| format!("{}: no private key found ({e}); expected a PEM key (PKCS#8, RSA or EC)", path.display()))
}

/// An OCSP response to staple: a DER `OCSPResponse` (as `openssl ocsp -respout` writes it),
/// checked for its outer framing only; rustls sends it as it is.
pub fn read_ocsp(path: &Path) -> Result<Vec<u8>, String> {
    let der = read_file(path)?;
    if der_sequence_len(&der) != Some(der.len()) {
        return Err(format!(
            "{}: not an OCSP response; expected one DER OCSPResponse (`openssl ocsp -respout FILE` writes one)",
            path.display()
        ));
    }
    Ok(der)
}

/// The whole length of the DER SEQUENCE `der` starts with (tag, length and contents).
fn der_sequence_len(der: &[u8]) -> Option<usize> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    if tag != 0x30 {
        return None;
    }
    if first < 0x80 {
        return Some(2 + usize::from(first));
    }
    let n = usize::from(first & 0x7f);
    if n == 0 || n > 4 || rest.len() < n {
        return None;
    }
    let len = rest[..n].iter().fold(0usize, |acc, &b| acc << 8 | usize::from(b));
    Some(2 + n + len)
}

/// The trust anchors of a PEM file of CA certificates, each checked usable as one.
#[derive(Debug, Clone)]
pub struct Roots(Vec<CertificateDer<'static>>);

impl Roots {
    /// Reads `path` and checks every certificate is a usable CA certificate.
    ///
    /// # Errors
    /// The file cannot be read, holds no certificate, or one is not a usable anchor.
    pub fn read(path: &Path) -> Result<Roots, String> {
        let certs = read_certs(path)?;
        let mut store = RootCertStore::empty();
        for cert in &certs {
            store.add(cert.clone()).map_err(|e| format!("{}: not a usable CA certificate ({e})", path.display()))?;
        }
        Ok(Roots(certs))
    }

    /// The anchors as rustls takes them (each was checked when read).
    pub fn store(&self) -> RootCertStore {
        let mut store = RootCertStore::empty();
        store.add_parsable_certificates(self.0.iter().cloned());
        store
    }
}

/// Which file of a pair a problem is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairFile {
    Cert,
    Key,
}

/// A certificate chain and its private key, read from PEM files and checked together.
#[derive(Debug)]
pub struct KeyPair {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    /// The first certificate's facts; a served certificate always has them.
    pub facts: Option<x509::Facts>,
}

impl KeyPair {
    /// A certificate a listener serves: parses, not expired at `now` (unix seconds), the key
    /// is one the provider signs with and belongs to the certificate.
    ///
    /// # Errors
    /// The file at fault and a message naming it.
    pub fn served(cert: &Path, key: &Path, now: i64) -> Result<KeyPair, (PairFile, String)> {
        let chain = read_certs(cert).map_err(|e| (PairFile::Cert, e))?;
        let facts = x509::parse(&chain[0])
            .ok_or_else(|| (PairFile::Cert, format!("{}: the first certificate cannot be read", cert.display())))?;
        if facts.not_after < now {
            return Err((
                PairFile::Cert,
                format!("{}: the certificate expired on {}", cert.display(), x509::date(facts.not_after)),
            ));
        }
        let der = read_key(key).map_err(|e| (PairFile::Key, e))?;
        let pair = KeyPair { chain, key: der, facts: Some(facts) };
        let ck =
            pair.signing().map_err(|e| (PairFile::Key, format!("{}: unsupported private key ({e})", key.display())))?;
        ck.keys_match().map_err(|_| {
            (
                PairFile::Key,
                format!("{}: this key does not belong to the certificate in {}", key.display(), cert.display()),
            )
        })?;
        Ok(pair)
    }

    /// A client certificate presented to an upstream: not expired at `now` when its first
    /// certificate can be read, and a key rustls accepts for it (as `with_client_auth_cert`).
    ///
    /// # Errors
    /// A message naming the file at fault.
    pub fn client(cert: &Path, key: &Path, now: i64) -> Result<KeyPair, String> {
        let chain = read_certs(cert)?;
        let facts = x509::parse(&chain[0]);
        if let Some(f) = &facts {
            if f.not_after < now {
                return Err(format!("{}: the certificate expired on {}", cert.display(), x509::date(f.not_after)));
            }
        }
        let der = read_key(key)?;
        let pair = KeyPair { chain, key: der, facts };
        CertifiedKey::from_der(pair.chain.clone(), pair.key.clone_key(), &provider())
            .map_err(|e| format!("{}: {e}", key.display()))?;
        Ok(pair)
    }

    /// The chain with its key loaded for signing.
    ///
    /// # Errors
    /// The provider cannot sign with the key.
    pub fn signing(&self) -> Result<CertifiedKey, rustls::Error> {
        let key = provider().key_provider.load_private_key(self.key.clone_key())?;
        Ok(CertifiedKey::new(self.chain.clone(), key))
    }
}
