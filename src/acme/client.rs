//! The HTTPS client ACME requests go over: hyper's HTTP/1.1 on tokio-rustls with tollgate's
//! crypto provider, trusting the system's roots or the directory's own CA (`directory_ca`,
//! a private ACME server). One connection per request: an order makes a dozen requests a
//! few times a quarter, not worth a pool.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper_util::rt::TokioIo;
use instant_acme::{BodyWrapper, BytesResponse, Error, HttpClient};
use rustls::pki_types::ServerName;

/// One request, connect to last header byte, within this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// An HTTPS-only client for one directory.
pub struct Client {
    tls: Arc<rustls::ClientConfig>,
}

impl Client {
    /// Trusting `roots` (the directory's CA), or the system's when `None`.
    ///
    /// # Errors
    /// rustls refuses the protocol versions (never with the built-in provider).
    pub fn new(roots: Option<&crate::pki::Roots>) -> Result<Client, String> {
        let roots = match roots {
            Some(r) => Arc::new(r.store()),
            None => crate::forward::connector::system_roots(),
        };
        let mut config = rustls::ClientConfig::builder_with_provider(crate::pki::provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| format!("TLS setup failed: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Client { tls: Arc::new(config) })
    }
}

fn other(e: impl std::fmt::Display) -> Error {
    Error::Other(e.to_string().into())
}

async fn send(tls: Arc<rustls::ClientConfig>, req: http::Request<BodyWrapper<Bytes>>) -> Result<BytesResponse, Error> {
    let (mut parts, body) = req.into_parts();
    if parts.uri.scheme_str() != Some("https") {
        return Err(other(format!("{}: ACME goes over https:// only", parts.uri)));
    }
    let host = parts.uri.host().ok_or_else(|| other("a URL without a host"))?.to_owned();
    let port = parts.uri.port_u16().unwrap_or(443);
    let authority = parts.uri.authority().map(|a| a.as_str().to_owned()).unwrap_or_else(|| host.clone());
    let bare = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let tcp = tokio::net::TcpStream::connect((bare.as_str(), port))
        .await
        .map_err(|e| other(format!("{host}:{port}: {e}")))?;
    let name = ServerName::try_from(bare).map_err(|_| other(format!("`{host}` is not a server name")))?;
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| other(format!("{host}: TLS: {e}")))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    // Origin form, with Host: what every server reads.
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    parts.uri = path.parse().map_err(other)?;
    let host_value = http::HeaderValue::try_from(authority).map_err(other)?;
    parts.headers.insert(http::header::HOST, host_value);
    let resp = send.send_request(http::Request::from_parts(parts, body)).await.map_err(other)?;
    Ok(BytesResponse::from(resp))
}

impl HttpClient for Client {
    fn request(
        &self,
        req: http::Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, Error>> + Send>> {
        let tls = self.tls.clone();
        Box::pin(async move {
            tokio::time::timeout(REQUEST_TIMEOUT, send(tls, req))
                .await
                .map_err(|_| other("the ACME server did not answer in time"))?
        })
    }
}
