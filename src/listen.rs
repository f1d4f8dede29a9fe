//! The edge of a connection, before HTTP: a PROXY protocol header (from trusted peers only),
//! then a TLS handshake, both under a deadline. What comes out is a stream for the server and
//! a [`Peer`]: the client's address (the socket's, or the one the PROXY header carried) and
//! its TLS facts, made once here and read by keys and forwarding headers.
//!
//! A plain listener without a PROXY header never comes here: the server serves its sockets
//! directly, so plain HTTP pays nothing for this room.

pub mod proxy_protocol;
pub mod quic;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use crate::config::Listener;
use crate::metrics::EdgeMetrics;
use crate::peer::{Peer, TlsPeer};
/// The certificate facts a handshake reads (the client identity for `key: tls_client`).
pub use crate::pki::x509;

/// The stream the server goes on with.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// Runs the edge steps of `listener` on an accepted socket, its handshakes with `tls_config`
/// (the listener's rustls config, built with the proxy): `None` when the connection is to be
/// closed (refused, timed out, failed handshake; each counted in `metrics`).
#[allow(clippy::too_many_arguments)]
pub async fn edge(
    mut stream: TcpStream,
    socket: SocketAddr,
    listener: &Listener,
    tls_config: Option<&Arc<rustls::ServerConfig>>,
    trusted: bool,
    accepted: Instant,
    header_timeout: Duration,
    metrics: &EdgeMetrics,
) -> Option<(Stream, Peer)> {
    let mut peer = Peer::plain(socket);
    if let Some(mode) = listener.proxy_protocol {
        let read = proxy_protocol::read(&mut stream, mode, trusted);
        match tokio::time::timeout_at((accepted + header_timeout).into(), read).await {
            Ok(Ok(carried)) => {
                if let Some(addr) = carried {
                    peer.addr = addr;
                }
            }
            Ok(Err(why)) => {
                metrics.proxy_refused(why.as_str());
                tracing::debug!(%socket, reason = why.as_str(), "PROXY protocol header refused");
                return None;
            }
            Err(_) => {
                metrics.proxy_refused("timeout");
                return None;
            }
        }
    }
    let Some(tls) = &listener.tls else { return Some((Stream::Plain(stream), peer)) };
    let Some(tls_config) = tls_config else {
        // Only a config built without its files (a test's `from_yaml` of a bad path) lands here.
        metrics.tls_failed("no_certificate");
        return None;
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(tls_config.clone());
    let done = tokio::time::timeout_at((accepted + tls.handshake_timeout).into(), acceptor.accept(stream)).await;
    let stream = match done {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let reason = failure_reason(&e);
            metrics.tls_failed(reason);
            tracing::debug!(client = %peer.addr, reason, error = %e, "TLS handshake failed");
            return None;
        }
        Err(_) => {
            metrics.tls_failed("timeout");
            return None;
        }
    };
    metrics.tls_handshakes.inc();
    if stream.get_ref().1.alpn_protocol() == Some(crate::pki::issued::ACME_TLS_ALPN) {
        // A TLS-ALPN-01 validation saw its certificate: nothing more is said (RFC 8737 §3).
        tracing::debug!(client = %peer.addr, "TLS-ALPN-01 validation answered");
        let mut stream = stream;
        let _ = tokio::time::timeout(Duration::from_secs(1), tokio::io::AsyncWriteExt::shutdown(&mut stream)).await;
        return None;
    }
    let conn = stream.get_ref().1;
    let client = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|c| x509::parse(c))
        .and_then(|f| f.identity())
        .map(String::into_boxed_str);
    peer.tls = Some(Arc::new(TlsPeer {
        sni: conn.server_name().map(Box::from),
        h2: conn.alpn_protocol() == Some(b"h2"),
        client,
    }));
    Some((Stream::Tls(Box::new(stream)), peer))
}

/// A fixed label for why a handshake failed (a metric label: never request data).
fn failure_reason(e: &std::io::Error) -> &'static str {
    use rustls::Error as E;
    match e.get_ref().and_then(|i| i.downcast_ref::<E>()) {
        Some(E::InvalidMessage(_)) => "not_tls",
        Some(E::NoCertificatesPresented) => "client_certificate_missing",
        Some(E::InvalidCertificate(_)) => "client_certificate_invalid",
        Some(E::PeerIncompatible(_)) => "incompatible",
        Some(E::AlertReceived(_)) => "alert_received",
        Some(_) => "other",
        None => match e.kind() {
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe => "closed",
            _ => "other",
        },
    }
}
