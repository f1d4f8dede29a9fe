//! The server side of TLS: certificates and keys read from PEM files at load (never per
//! connection), one rustls `ServerConfig` per listener with SNI selection (exact names,
//! `*.` wildcards, the first certificate for clients without SNI or with an unknown name),
//! ALPN `h2` and `http/1.1`, TLS 1.2 and 1.3 with rustls' AEAD-only suites, session tickets
//! from one process-wide ticketer, and optional client-certificate verification.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;

use super::x509;
use crate::config::{CertFiles, ClientAuth, TlsListener};

/// PEM files larger than this are refused (a chain is a few KiB; a path to `/dev/zero` must
/// not hang the load).
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// The crypto provider of every TLS config tollgate builds: ring (see BENCHMARKS.md for why
/// not aws-lc-rs).
pub fn provider() -> Arc<CryptoProvider> {
    static P: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    P.get_or_init(|| Arc::new(rustls::crypto::ring::default_provider())).clone()
}

/// Which file of a TLS section a problem is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Cert(usize),
    Key(usize),
    Ocsp(usize),
    ClientCa,
}

/// A listener's TLS, loaded: the rustls config and what each certificate serves.
#[derive(Debug)]
pub struct Loaded {
    pub config: Arc<rustls::ServerConfig>,
    pub served: Vec<Served>,
}

/// One certificate as `check`, `explain` and `/config` show it (never key material).
#[derive(Debug, Clone)]
pub struct Served {
    pub cert: std::path::PathBuf,
    pub names: Vec<String>,
    /// Unix seconds.
    pub not_after: i64,
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

/// A certificate chain and its key, checked: parses, the key matches, not expired at `now`.
pub fn certified_key(
    files: &CertFiles,
    i: usize,
    now: i64,
) -> Result<(Arc<CertifiedKey>, x509::Facts), (Field, String)> {
    let chain = read_certs(&files.cert).map_err(|e| (Field::Cert(i), e))?;
    let facts = x509::parse(&chain[0])
        .ok_or_else(|| (Field::Cert(i), format!("{}: the first certificate cannot be read", files.cert.display())))?;
    if facts.not_after < now {
        return Err((
            Field::Cert(i),
            format!("{}: the certificate expired on {}", files.cert.display(), x509::date(facts.not_after)),
        ));
    }
    let key = read_key(&files.key).map_err(|e| (Field::Key(i), e))?;
    let signing = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| (Field::Key(i), format!("{}: unsupported private key ({e})", files.key.display())))?;
    let ck = CertifiedKey::new(chain, signing);
    ck.keys_match().map_err(|_| {
        (
            Field::Key(i),
            format!("{}: this key does not belong to the certificate in {}", files.key.display(), files.cert.display()),
        )
    })?;
    Ok((Arc::new(ck), facts))
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

/// Trust anchors from a PEM file of CA certificates.
pub fn read_roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots.add(cert).map_err(|e| format!("{}: not a usable CA certificate ({e})", path.display()))?;
    }
    Ok(roots)
}

/// Loads and checks a listener's certificates and builds its rustls config.
///
/// # Errors
/// The field whose file is at fault, and a message naming the file.
pub fn load(tls: &TlsListener, now: i64) -> Result<Loaded, (Field, String)> {
    let mut sni = Sni::default();
    let mut served = Vec::with_capacity(tls.certificates.len());
    for (i, served_cert) in tls.certificates.iter().enumerate() {
        let files = &served_cert.files;
        let (mut ck, facts) = certified_key(files, i, now)?;
        if let Some(path) = &served_cert.ocsp {
            let response = read_ocsp(path).map_err(|e| (Field::Ocsp(i), e))?;
            let mut stapled = CertifiedKey::clone(&ck);
            stapled.ocsp = Some(response);
            ck = Arc::new(stapled);
        }
        let names = facts.served_names();
        for name in &names {
            match name.strip_prefix("*.") {
                Some(suffix) => sni.wildcard.entry(suffix.to_owned()).or_insert_with(|| ck.clone()),
                None => sni.exact.entry(name.clone()).or_insert_with(|| ck.clone()),
            };
        }
        sni.default.get_or_insert_with(|| ck.clone());
        served.push(Served { cert: files.cert.clone(), names, not_after: facts.not_after });
    }
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| (Field::Cert(0), format!("TLS setup failed: {e}")))?;
    let builder = match &tls.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let roots = read_roots(ca).map_err(|e| (Field::ClientCa, e))?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
            let verifier = match tls.client_auth {
                ClientAuth::Required => verifier,
                ClientAuth::Optional => verifier.allow_unauthenticated(),
            };
            let verifier = verifier.build().map_err(|e| (Field::ClientCa, format!("{}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(Arc::new(sni));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    if let Some(t) = ticketer() {
        config.ticketer = t;
    }
    Ok(Loaded { config: Arc::new(config), served })
}

/// One ticketer for the process, so tickets survive a certificate reload; it rotates its
/// keys itself.
fn ticketer() -> Option<Arc<dyn rustls::server::ProducesTickets>> {
    static T: OnceLock<Option<Arc<dyn rustls::server::ProducesTickets>>> = OnceLock::new();
    T.get_or_init(|| match rustls::crypto::ring::Ticketer::new() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(error = %e, "TLS session tickets are off: no ticketer");
            None
        }
    })
    .clone()
}

/// Certificates by the name a client asks for.
#[derive(Default, Debug)]
struct Sni {
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// `*.example.com` under `example.com`: one label, any name.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    default: Option<Arc<CertifiedKey>>,
}

impl Sni {
    fn find(&self, name: &str) -> Option<&Arc<CertifiedKey>> {
        // rustls hands the name lower-cased and without a trailing dot.
        self.exact.get(name).or_else(|| name.split_once('.').and_then(|(_, parent)| self.wildcard.get(parent)))
    }
}

impl ResolvesServerCert for Sni {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        hello.server_name().and_then(|n| self.find(n)).or(self.default.as_ref()).cloned()
    }
}
