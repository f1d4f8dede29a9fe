//! Who is at the other end of a client connection: its address and what its TLS handshake
//! settled. Made once by the `listen` room (or from the socket for plain HTTP), read by
//! limit keys and forwarding headers.

use std::net::SocketAddr;
use std::sync::Arc;

/// Who is at the other end of a client connection.
#[derive(Clone, Debug)]
pub struct Peer {
    /// The client's address: the socket's, or the one a PROXY header carried.
    pub addr: SocketAddr,
    /// Present on TLS connections.
    pub tls: Option<Arc<TlsPeer>>,
}

impl Peer {
    /// A plain connection from `addr`.
    pub fn plain(addr: SocketAddr) -> Peer {
        Peer { addr, tls: None }
    }

    /// The client's verified certificate identity (mTLS), for `key: tls_client`.
    pub fn tls_client(&self) -> Option<&str> {
        self.tls.as_deref().and_then(|t| t.client.as_deref())
    }
}

/// What the TLS handshake settled.
#[derive(Debug, Default)]
pub struct TlsPeer {
    /// The name the client asked for (SNI), lower-case.
    pub sni: Option<Box<str>>,
    /// ALPN chose `h2`.
    pub h2: bool,
    /// The verified client certificate's identity: its first SAN entry, else its subject CN.
    pub client: Option<Box<str>>,
}
