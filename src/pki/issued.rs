//! The certificates tollgate obtained itself (from an ACME CA, or its local CA) that listeners
//! serve, and the answers to ACME challenges in progress. The `acme` room writes here; a
//! listener's SNI store reads certificates by their id at each handshake (one atomic load),
//! and the challenge answers are read only by the validation requests themselves. One store
//! per process, kept across reloads, so a renewed certificate reaches every listener at once
//! and a connection keeps the certificate it was made with.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use rustls::sign::CertifiedKey;

/// ALPN of a TLS-ALPN-01 validation (RFC 8737): a connection that chose it is closed after
/// the handshake.
pub const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";

/// Where a served certificate comes from, as metrics and `/config` show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Acme,
    Internal,
    /// Self-signed, while no CA has issued one yet.
    Placeholder,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Acme => "acme",
            Origin::Internal => "internal",
            Origin::Placeholder => "placeholder",
        }
    }
}

/// One certificate in service.
#[derive(Debug, Clone)]
pub struct Current {
    pub key: Arc<CertifiedKey>,
    pub origin: Origin,
    /// Unix seconds, from the certificate.
    pub not_before: i64,
    pub not_after: i64,
}

/// The issued certificates by id, and the challenge answers.
#[derive(Default)]
pub struct Issued {
    certs: ArcSwap<HashMap<Arc<str>, Current>>,
    /// HTTP-01: token → key authorization.
    http: Mutex<HashMap<String, String>>,
    /// TLS-ALPN-01: name → the answer's certificate.
    alpn: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued").field("certs", &self.certs.load().len()).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Issued {
    /// The certificate in service under `id`.
    pub fn get(&self, id: &str) -> Option<Arc<CertifiedKey>> {
        self.certs.load().get(id).map(|c| c.key.clone())
    }

    /// What is in service under `id`, with its dates and origin.
    pub fn current(&self, id: &str) -> Option<Current> {
        self.certs.load().get(id).cloned()
    }

    /// Puts `cert` in service under `id`: handshakes from now on get it; connections made with
    /// the previous one keep it.
    pub fn set(&self, id: &str, cert: Current) {
        self.certs.rcu(|old| {
            let mut new = HashMap::clone(old);
            new.insert(Arc::from(id), cert.clone());
            new
        });
    }

    /// Takes the certificate under `id` out of service (its config entry is gone).
    pub fn remove(&self, id: &str) {
        self.certs.rcu(|old| {
            let mut new = HashMap::clone(old);
            new.remove(id);
            new
        });
    }

    /// The ids in service.
    pub fn ids(&self) -> Vec<Arc<str>> {
        self.certs.load().keys().cloned().collect()
    }

    /// Answers the HTTP-01 `token` with `key_authorization` until [`Issued::forget_http`].
    pub fn answer_http(&self, token: &str, key_authorization: &str) {
        lock(&self.http).insert(token.to_owned(), key_authorization.to_owned());
    }

    pub fn forget_http(&self, token: &str) {
        lock(&self.http).remove(token);
    }

    /// The key authorization that answers `token`, if a challenge of this process is pending.
    pub fn http(&self, token: &str) -> Option<String> {
        lock(&self.http).get(token).cloned()
    }

    /// Answers TLS-ALPN-01 validations of `name` with `cert` until [`Issued::forget_alpn`].
    pub fn answer_alpn(&self, name: &str, cert: Arc<CertifiedKey>) {
        lock(&self.alpn).insert(name.to_ascii_lowercase(), cert);
    }

    pub fn forget_alpn(&self, name: &str) {
        lock(&self.alpn).remove(&name.to_ascii_lowercase());
    }

    /// The TLS-ALPN-01 answer for `name` (as rustls hands it: lower case).
    pub fn alpn(&self, name: &str) -> Option<Arc<CertifiedKey>> {
        lock(&self.alpn).get(name).cloned()
    }
}
