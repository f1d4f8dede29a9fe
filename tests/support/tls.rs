//! TLS for tests: a private CA made by rcgen per test, certificates it signs written as PEM
//! into a fresh folder, a rustls client (hyper over tokio-rustls) and an https upstream.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::{full, BoxBody};

/// A folder of its own under the system's temp dir, removed on drop.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new() -> Dir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "tollgate-tls-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `text` to `name` through a rename, as certbot and ConfigMaps do.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        let tmp = self.path(&format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A certificate authority for one test.
pub struct Ca {
    pub cert: rcgen::Certificate,
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
}

/// A certificate and its key, as PEM and DER.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl Issued {
    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key_der.clone().into())
    }

    /// Writes `<name>.pem` and `<name>.key` into `dir`; returns their paths.
    pub fn write(&self, dir: &Dir, name: &str) -> (PathBuf, PathBuf) {
        (dir.write(&format!("{name}.pem"), &self.cert_pem), dir.write(&format!("{name}.key"), &self.key_pem))
    }
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let pem = cert.pem();
        Ca { cert, issuer: Issuer::new(params, key), pem }
    }

    /// A leaf for `names` (DNS names or IP addresses), ECDSA P-256, valid now.
    pub fn issue(&self, names: &[&str]) -> Issued {
        self.issue_with(names, |_| {})
    }

    /// A leaf whose params `adjust` changes first (validity, CN, …).
    pub fn issue_with(&self, names: &[&str], adjust: impl FnOnce(&mut CertificateParams)) -> Issued {
        let mut params = CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, names.first().copied().unwrap_or("client"));
        adjust(&mut params);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
            key_der: key.serialize_der(),
        }
    }

    pub fn write(&self, dir: &Dir, name: &str) -> PathBuf {
        dir.write(name, &self.pem)
    }

    pub fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.cert.der().clone()).unwrap();
        roots
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A client config trusting `ca`, offering `alpn`, presenting `client` if given.
pub fn client_config(ca: &Ca, alpn: &[&[u8]], client: Option<&Issued>) -> Arc<rustls::ClientConfig> {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(ca.roots());
    let mut c = match client {
        Some(i) => b.with_client_auth_cert(vec![i.der.clone()], i.key()).unwrap(),
        None => b.with_no_client_auth(),
    };
    c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(c)
}

/// A TLS connection to `addr` naming `sni` (an IP address sends no SNI).
pub async fn connect(
    addr: SocketAddr,
    sni: &str,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(sni.to_owned()).unwrap();
    tokio_rustls::TlsConnector::from(config).connect(name, tcp).await
}

/// An HTTP/1.1 (or, when ALPN chose it, HTTP/2) client over a TLS connection.
pub enum Client {
    H1(hyper::client::conn::http1::SendRequest<BoxBody>),
    H2(hyper::client::conn::http2::SendRequest<BoxBody>),
}

impl Client {
    pub async fn over(tls: tokio_rustls::client::TlsStream<TcpStream>) -> Client {
        if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
            let (send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.unwrap();
            tokio::spawn(conn);
            Client::H2(send)
        } else {
            let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
            tokio::spawn(conn);
            Client::H1(send)
        }
    }

    /// GET `path` with `host`; status, headers, body, and the response's HTTP version.
    pub async fn get(&mut self, host: &str, path: &str) -> (http::StatusCode, http::HeaderMap, Bytes, http::Version) {
        let resp = match self {
            Client::H1(s) => {
                let req = Request::get(path).header("host", host).body(full("")).unwrap();
                s.send_request(req).await.unwrap()
            }
            Client::H2(s) => {
                let req = Request::get(format!("https://{host}{path}")).body(full("")).unwrap();
                s.send_request(req).await.unwrap()
            }
        };
        let version = resp.version();
        let (parts, body) = resp.into_parts();
        (parts.status, parts.headers, body.collect().await.unwrap().to_bytes(), version)
    }
}

/// The certificate the server presented on `tls`.
pub fn served_cert(tls: &tokio_rustls::client::TlsStream<TcpStream>) -> CertificateDer<'static> {
    tls.get_ref().1.peer_certificates().unwrap()[0].clone().into_owned()
}

/// A real hyper HTTP/1.1 upstream over TLS (rustls) on 127.0.0.1:0; counts the TCP
/// connections it accepted and the handshakes that completed.
pub struct HttpsUpstream {
    pub addr: SocketAddr,
    pub connections: Arc<AtomicUsize>,
    pub handshakes: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl HttpsUpstream {
    /// Serves with `cert`; with `client_ca`, requires a client certificate signed by it.
    pub async fn start<F>(cert: &Issued, client_ca: Option<&Ca>, handler: F) -> HttpsUpstream
    where
        F: Fn(Request<Incoming>) -> Response<BoxBody> + Send + Sync + 'static,
    {
        HttpsUpstream::start_alpn(cert, client_ca, &[b"http/1.1"], handler).await
    }

    /// Offers `alpn` (none: the extension is not answered) and serves HTTP/2 on a connection
    /// whose ALPN chose `h2`, HTTP/1.1 on any other.
    pub async fn start_alpn<F>(cert: &Issued, client_ca: Option<&Ca>, alpn: &[&[u8]], handler: F) -> HttpsUpstream
    where
        F: Fn(Request<Incoming>) -> Response<BoxBody> + Send + Sync + 'static,
    {
        let b = rustls::ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions().unwrap();
        let b = match client_ca {
            Some(ca) => b.with_client_cert_verifier(
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(ca.roots()), provider())
                    .build()
                    .unwrap(),
            ),
            None => b.with_no_client_auth(),
        };
        let mut config = b.with_single_cert(vec![cert.der.clone()], cert.key()).unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (connections, handshakes) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (c, h) = (connections.clone(), handshakes.clone());
        let handler = Arc::new(handler);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                c.fetch_add(1, Ordering::Relaxed);
                let (acceptor, h, handler) = (acceptor.clone(), h.clone(), handler.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(stream).await else { return };
                    h.fetch_add(1, Ordering::Relaxed);
                    let svc = hyper::service::service_fn(move |req| {
                        let out = handler(req);
                        async move { Ok::<_, Infallible>(out) }
                    });
                    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(tls), svc)
                            .await;
                    } else {
                        let _ =
                            hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), svc).await;
                    }
                });
            }
        });
        HttpsUpstream { addr, connections, handshakes, task }
    }
}

impl Drop for HttpsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `path` as a YAML string.
pub fn y(p: &Path) -> String {
    format!("'{}'", p.display())
}
