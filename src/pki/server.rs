//! The rustls `ServerConfig` of a TLS listener, made from its checked files: SNI selection
//! (exact names, `*.` wildcards, the first certificate for clients without SNI or with an
//! unknown name), ALPN `h2` and `http/1.1`, TLS 1.2 and 1.3 with rustls' AEAD-only suites,
//! session tickets from one process-wide ticketer, and optional client-certificate
//! verification. Built once per config (at `Proxy::build`), never per connection.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;

use super::issued::{Issued, ACME_TLS_ALPN};
use super::{provider, KeyPair, Roots};

/// One certificate a listener serves, and the OCSP response stapled to its handshakes.
pub struct Cert<'a> {
    pub pair: &'a KeyPair,
    pub ocsp: Option<&'a [u8]>,
}

/// Client certificates a listener verifies.
pub struct ClientCheck<'a> {
    pub roots: &'a Roots,
    /// A client without a certificate is let through (its identity is then unknown).
    pub optional: bool,
}

/// A certificate the process obtains itself (ACME, the local CA): served under `names` once
/// the `acme` room has put one in the [`Issued`] store under `id`.
pub struct Managed<'a> {
    pub id: &'a str,
    pub names: &'a [String],
}

/// What a listener serves: its files' certificates, then its managed ones (the first of
/// either answers clients without SNI), and whether it answers TLS-ALPN-01 validations.
pub struct Served<'a> {
    pub files: &'a [Cert<'a>],
    pub managed: &'a [Managed<'a>],
    /// The process's store of issued certificates; needed when `managed` is not empty.
    pub issued: Option<&'a Arc<Issued>>,
    pub alpn_challenges: bool,
}

/// The listener's rustls config.
///
/// # Errors
/// A pair whose key the provider cannot sign with, or a verifier rustls refuses; files that
/// passed their checks at load have neither.
pub fn config(served: &Served<'_>, client: Option<ClientCheck<'_>>) -> Result<Arc<rustls::ServerConfig>, String> {
    let mut sni = Sni { issued: served.issued.cloned(), alpn_challenges: served.alpn_challenges, ..Sni::default() };
    let mut add = |names: Vec<String>, entry: Entry| {
        for name in names {
            match name.strip_prefix("*.") {
                Some(suffix) => sni.wildcard.entry(suffix.to_owned()).or_insert_with(|| entry.clone()),
                None => sni.exact.entry(name).or_insert_with(|| entry.clone()),
            };
        }
        sni.default.get_or_insert(entry);
    };
    for cert in served.files {
        let mut ck = cert.pair.signing().map_err(|e| format!("unsupported private key ({e})"))?;
        if let Some(response) = cert.ocsp {
            ck.ocsp = Some(response.to_vec());
        }
        let names = cert.pair.facts.as_ref().map(super::x509::Facts::served_names).unwrap_or_default();
        add(names, Entry::Static(Arc::new(ck)));
    }
    for m in served.managed {
        // IP addresses are not SNI names: such a certificate answers as the default only.
        let names = m.names.iter().filter(|n| n.parse::<std::net::IpAddr>().is_err()).map(|n| n.to_ascii_lowercase());
        add(names.collect(), Entry::Issued(Arc::from(m.id)));
    }
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| format!("TLS setup failed: {e}"))?;
    let builder = match client {
        None => builder.with_no_client_auth(),
        Some(check) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(check.roots.store()), provider());
            let verifier = if check.optional { verifier.allow_unauthenticated() } else { verifier };
            builder.with_client_cert_verifier(verifier.build().map_err(|e| e.to_string())?)
        }
    };
    let alpn_challenges = sni.alpn_challenges;
    let mut config = builder.with_cert_resolver(Arc::new(sni));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    if alpn_challenges {
        // Last: rustls picks the first of ours the client offers, and only a validator offers it.
        config.alpn_protocols.push(ACME_TLS_ALPN.to_vec());
    }
    if let Some(t) = ticketer() {
        config.ticketer = t;
    }
    Ok(Arc::new(config))
}

/// One ticketer for the process, so tickets survive a certificate reload; it rotates its
/// keys itself.
fn ticketer() -> Option<Arc<dyn rustls::server::ProducesTickets>> {
    static T: OnceLock<Option<Arc<dyn rustls::server::ProducesTickets>>> = OnceLock::new();
    T.get_or_init(|| match super::ticketer() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(error = %e, "TLS session tickets are off: no ticketer");
            None
        }
    })
    .clone()
}

/// A certificate of the SNI store: loaded from files with the config, or issued to the
/// process and looked up in its [`Issued`] store at each handshake (so a renewal needs no
/// new config).
#[derive(Debug, Clone)]
enum Entry {
    Static(Arc<CertifiedKey>),
    Issued(Arc<str>),
}

/// Certificates by the name a client asks for.
#[derive(Default, Debug)]
struct Sni {
    exact: HashMap<String, Entry>,
    /// `*.example.com` under `example.com`: one label, any name.
    wildcard: HashMap<String, Entry>,
    default: Option<Entry>,
    issued: Option<Arc<Issued>>,
    /// Answer a client that offers ALPN `acme-tls/1` alone with the TLS-ALPN-01 certificate.
    alpn_challenges: bool,
}

impl Sni {
    fn find(&self, name: &str) -> Option<&Entry> {
        // rustls hands the name lower-cased and without a trailing dot.
        self.exact.get(name).or_else(|| name.split_once('.').and_then(|(_, parent)| self.wildcard.get(parent)))
    }

    fn key(&self, entry: &Entry) -> Option<Arc<CertifiedKey>> {
        match entry {
            Entry::Static(k) => Some(k.clone()),
            Entry::Issued(id) => self.issued.as_ref()?.get(id),
        }
    }
}

impl ResolvesServerCert for Sni {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        if self.alpn_challenges {
            let mut offered = hello.alpn().into_iter().flatten();
            if offered.next() == Some(ACME_TLS_ALPN) && offered.next().is_none() {
                // A validation (RFC 8737): its answer, or no certificate at all.
                return self.issued.as_ref()?.alpn(hello.server_name()?);
            }
        }
        let found = hello.server_name().and_then(|n| self.find(n)).and_then(|e| self.key(e));
        found.or_else(|| self.key(self.default.as_ref()?))
    }
}

/// Single-use tickets an HTTP/3 listener with 0-RTT keeps (about 200 bytes each).
const EARLY_DATA_TICKETS: usize = 65_536;

/// No stateless tickets: sessions are kept in the server's store (see [`quic`]).
#[derive(Debug)]
struct NoTickets;

impl rustls::server::ProducesTickets for NoTickets {
    fn enabled(&self) -> bool {
        false
    }

    fn lifetime(&self) -> u32 {
        0
    }

    fn encrypt(&self, _: &[u8]) -> Option<Vec<u8>> {
        None
    }

    fn decrypt(&self, _: &[u8]) -> Option<Vec<u8>> {
        None
    }
}

/// What an HTTP/3 listener's QUIC connections are allowed (its `quic:` settings).
pub struct QuicLimits {
    pub max_concurrent_streams: u32,
    pub idle_timeout: std::time::Duration,
    pub early_data: bool,
}

/// The QUIC config of an HTTP/3 listener, made from its TLS config: the same certificates,
/// SNI store, client checks and ticketer, ALPN `h3`; 0-RTT only with `early_data` (rustls'
/// `max_early_data_size` 0 otherwise); the stream bounds and idle timeout of `limits`. A
/// client may open three unidirectional streams, the control and QPACK streams HTTP/3 needs.
///
/// # Errors
/// A TLS config QUIC cannot run on (none that [`config`] builds), or an idle timeout out of
/// QUIC's range (refused at load).
pub fn quic(tls: &rustls::ServerConfig, limits: &QuicLimits) -> Result<Arc<quinn::ServerConfig>, String> {
    let mut tls = tls.clone();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    tls.max_early_data_size = if limits.early_data { u32::MAX } else { 0 };
    if limits.early_data {
        // rustls takes early data only on a stateful ticket, and takes each once: a replay of
        // the flight finds its ticket gone and gets a full handshake (one process; bounded
        // store, the oldest tickets go first).
        tls.ticketer = Arc::new(NoTickets);
        tls.session_storage = rustls::server::ServerSessionMemoryCache::new(EARLY_DATA_TICKETS);
    }
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(Arc::new(tls))
        .map_err(|e| format!("QUIC setup failed: {e}"))?;
    let mut transport = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(limits.idle_timeout).map_err(|e| format!("quic.idle_timeout: {e}"))?;
    transport
        .max_concurrent_bidi_streams(limits.max_concurrent_streams.into())
        .max_concurrent_uni_streams(3u32.into())
        .max_idle_timeout(Some(idle));
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(Arc::new(transport));
    Ok(Arc::new(config))
}
