//! The one place that opens upstream connections: TCP, then TLS for `https://` upstreams
//! (a rustls client config per upstream and ALPN choice, built with the proxy from the files
//! the config read, never per request),
//! then the HTTP handshake. Nothing else in tollgate uses rustls' client side.
//!
//! Verification is on by default: against `ca_file` when given, else the system's roots
//! (or the bundled webpki roots when the system has none). `tls_insecure_skip_verify`
//! still checks handshake signatures, only not who signed the certificate or its name.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::net::TcpStream;

use crate::body::RequestBody;
use crate::config::UpstreamTls;
use crate::pki::provider;

/// Which application protocols a TLS connection offers (ALPN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// `http/1.1` only.
    Http1,
    /// `h2` only.
    H2,
    /// `h2`, then `http/1.1`: the upstream chooses.
    Either,
}

/// Why no connection could be had.
#[derive(Debug)]
pub enum ConnectError {
    Timeout,
    Io(std::io::Error),
    /// The TLS handshake failed (verification included).
    Tls(std::io::Error),
    Handshake(hyper::Error),
    /// The HTTP/2 handshake of tollgate's own client (the `h2` crate) failed.
    H2(h2::Error),
    /// `protocol: h2`: the TLS handshake ended without the upstream choosing `h2` by ALPN.
    NotH2,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Timeout => f.write_str("connect timed out"),
            ConnectError::Io(e) => write!(f, "connect failed: {e}"),
            ConnectError::Tls(e) => write!(f, "TLS handshake failed: {e}"),
            ConnectError::Handshake(e) => write!(f, "handshake failed: {e}"),
            ConnectError::H2(e) => write!(f, "HTTP/2 handshake failed: {e}"),
            ConnectError::NotH2 => f.write_str("the upstream did not choose `h2` by ALPN"),
        }
    }
}

/// The TLS client side of one upstream, built at load.
#[derive(Debug)]
pub struct TlsClient {
    /// By [`Alpn`]: `http/1.1`, `h2`, both.
    configs: [Arc<ClientConfig>; 3],
    server_name: ServerName<'static>,
}

impl TlsClient {
    /// The configs of `tls`, from its files as the config read and checked them.
    ///
    /// # Errors
    /// The config was built without its files, or rustls refuses them (files that passed
    /// their checks at load are not refused).
    pub fn build(tls: &UpstreamTls) -> Result<TlsClient, String> {
        let server_name = ServerName::try_from(tls.server_name.clone())
            .map_err(|_| format!("`{}` is not a DNS name or IP address", tls.server_name))?;
        let loaded = tls.loaded.as_ref().ok_or("the TLS files were not read")?;
        let builder = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| format!("TLS setup failed: {e}"))?;
        let builder = if tls.insecure_skip_verify {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(NoVerify))
        } else {
            let roots = match &loaded.roots {
                Some(roots) => Arc::new(roots.store()),
                None => system_roots(),
            };
            builder.with_root_certificates(roots)
        };
        let mut config = match &loaded.client_cert {
            None => builder.with_no_client_auth(),
            Some(pair) => builder
                .with_client_auth_cert(pair.chain.clone(), pair.key.clone_key())
                .map_err(|e| format!("client certificate: {e}"))?,
        };
        let mut with = |alpn: &[&[u8]]| {
            config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            Arc::new(config.clone())
        };
        let configs = [with(&[b"http/1.1"]), with(&[b"h2"]), with(&[b"h2", b"http/1.1"])];
        Ok(TlsClient { configs, server_name })
    }

    fn config(&self, alpn: Alpn) -> &Arc<ClientConfig> {
        &self.configs[match alpn {
            Alpn::Http1 => 0,
            Alpn::H2 => 1,
            Alpn::Either => 2,
        }]
    }
}

/// The system's trust anchors, read once per process; the bundled webpki roots when the
/// system has none.
pub(crate) fn system_roots() -> Arc<RootCertStore> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let mut roots = RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                tracing::info!("no system CA certificates found; using the bundled webpki roots");
                roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            }
            Arc::new(roots)
        })
        .clone()
}

/// An open upstream connection before HTTP.
pub enum Connected {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Connected {
    /// ALPN chose `h2` (never on a plain connection).
    pub fn is_h2(&self) -> bool {
        match self {
            Connected::Plain(_) => false,
            Connected::Tls(s) => s.get_ref().1.alpn_protocol() == Some(b"h2"),
        }
    }
}

/// Opens connections to one upstream.
#[derive(Debug, Clone)]
pub struct Connector {
    addr: String,
    connect_timeout: Duration,
    /// `https://` upstreams: the client configs, or why they could not be built (every
    /// connection then fails its TLS step instead of going out in plain text).
    tls: Option<Result<Arc<TlsClient>, Arc<str>>>,
}

impl Connector {
    /// `addr` is `host:port`; `tls` is set for `https://` upstreams.
    pub fn new(addr: String, connect_timeout: Duration, tls: Option<Result<Arc<TlsClient>, Arc<str>>>) -> Connector {
        Connector { addr, connect_timeout, tls }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// TCP (and TLS offering `alpn`) within `connect_timeout`.
    ///
    /// # Errors
    /// Timeout, refused, or a failed TLS handshake.
    pub async fn connect(&self, alpn: Alpn) -> Result<Connected, ConnectError> {
        let open = async {
            let stream = TcpStream::connect(self.addr.as_str()).await.map_err(ConnectError::Io)?;
            let _ = stream.set_nodelay(true);
            match &self.tls {
                None => Ok(Connected::Plain(stream)),
                Some(Err(why)) => Err(ConnectError::Tls(std::io::Error::other(why.to_string()))),
                Some(Ok(tls)) => {
                    let connector = tokio_rustls::TlsConnector::from(tls.config(alpn).clone());
                    let s = connector.connect(tls.server_name.clone(), stream).await.map_err(|e| {
                        // A server that has no protocol in common with `h2` only says so by alert.
                        if alpn == Alpn::H2 && no_common_protocol(&e) {
                            ConnectError::NotH2
                        } else {
                            ConnectError::Tls(e)
                        }
                    })?;
                    if alpn == Alpn::H2 && s.get_ref().1.alpn_protocol() != Some(b"h2") {
                        return Err(ConnectError::NotH2);
                    }
                    Ok(Connected::Tls(Box::new(s)))
                }
            }
        };
        tokio::time::timeout(self.connect_timeout, open).await.map_err(|_| ConnectError::Timeout)?
    }

    /// A new HTTP/1.1 connection, its task spawned.
    ///
    /// # Errors
    /// As [`Connector::connect`], or a failed HTTP handshake.
    pub async fn http1(&self) -> Result<http1::SendRequest<RequestBody>, ConnectError> {
        Connector::http1_on(self.connect(Alpn::Http1).await?).await
    }

    /// HTTP/1.1 on a connection already open (one whose ALPN chose `http/1.1`), its task spawned.
    ///
    /// # Errors
    /// A failed HTTP/1 handshake.
    pub async fn http1_on(connected: Connected) -> Result<http1::SendRequest<RequestBody>, ConnectError> {
        let mut b = http1::Builder::new();
        // One write per small message instead of writev (measured: a small win).
        b.writev(false);
        match connected {
            Connected::Plain(s) => spawn_h1(&b, s, false).await,
            Connected::Tls(s) => spawn_h1(&b, s, false).await,
        }
    }

    /// A new HTTP/1.1 connection whose task lets a `101` hand its socket (plain or TLS) to
    /// `hyper::upgrade::on`: the upstream end of a tunnel.
    ///
    /// # Errors
    /// As [`Connector::connect`], and a failed HTTP/1 handshake.
    pub async fn http1_for_upgrade(&self) -> Result<http1::SendRequest<RequestBody>, ConnectError> {
        let b = http1::Builder::new();
        match self.connect(Alpn::Http1).await? {
            Connected::Plain(s) => spawn_h1(&b, s, true).await,
            Connected::Tls(s) => spawn_h1(&b, s, true).await,
        }
    }
}

/// The handshake failed on the server's `no_application_protocol` alert (RFC 7301 §3.2).
fn no_common_protocol(e: &std::io::Error) -> bool {
    matches!(
        e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()),
        Some(rustls::Error::AlertReceived(rustls::AlertDescription::NoApplicationProtocol))
    )
}

async fn spawn_h1<T>(b: &http1::Builder, io: T, upgrades: bool) -> Result<http1::SendRequest<RequestBody>, ConnectError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = b.handshake(TokioIo::new(io)).await.map_err(ConnectError::Handshake)?;
    tokio::spawn(async move {
        let ended = if upgrades { conn.with_upgrades().await } else { conn.await };
        if let Err(e) = ended {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    Ok(send)
}

/// `tls_insecure_skip_verify`: any certificate and name; the handshake's signatures are
/// still checked, so the connection is at least with the holder of that certificate.
#[derive(Debug)]
struct NoVerify;

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &provider().signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &provider().signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        provider().signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_upstream_whose_tls_could_not_be_built_never_gets_plain_text() {
        let tls = UpstreamTls {
            ca_file: None,
            server_name: "localhost".into(),
            client_cert: None,
            insecure_skip_verify: false,
            loaded: None,
        };
        let why = TlsClient::build(&tls).map(|_| ()).unwrap_err();
        assert!(why.contains("not read"), "{why}");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let connector = Connector::new(addr, Duration::from_secs(5), Some(Err(why.into())));
        assert!(matches!(connector.connect(Alpn::Http1).await, Err(ConnectError::Tls(_))));
    }
}
