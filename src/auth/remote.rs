//! A key set read from a URL: parsed when it is read, never per request. Read again in the
//! background once its `Cache-Control: max-age` (bounded) has passed, and at once when a
//! token names a key it does not have, at most once per `min_interval`; a reading that fails
//! (the URL down, a set that does not parse) keeps the last good set.
//!
//! A token that needs the set while a reading is under way waits for that reading (at most
//! [`super::FETCH_TIMEOUT`], what a reading may take), whoever started it: the first tokens
//! of a fresh proxy and the first tokens signed by a new key are checked against the set being
//! read, not refused for want of it. A reading runs in a task of its own, so a client that
//! gives up does not cut it short for the others.
//!
//! Every set read gets a [`Generation`] no other set of the process ever has: a verified
//! token remembered with the generation that verified it is never taken for one verified by a
//! later set (an address could be reused, a counter is not).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::header::{ACCEPT, CACHE_CONTROL, HOST};
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::Notify;

use crate::jwt::{self, KeySet, Refusal, Rules, Verified};

/// A key set document larger than this is refused.
pub const MAX_JWKS_BYTES: usize = 1 << 20;

/// How long a set is used without reading it again when its answer says nothing.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(300);

/// The longest `max-age` honoured: keys are read again at least daily.
pub const MAX_MAX_AGE: Duration = Duration::from_secs(86_400);

/// Which key set verified a token: unique in the process for its whole life (never 0).
pub type Generation = u64;

/// The next [`Generation`]: a process-wide counter, so no two sets (fixed or read, of any
/// route, before or after a reload) share one.
pub fn next_generation() -> Generation {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A set as read, with its generation.
pub struct Read {
    pub generation: Generation,
    pub set: KeySet,
}

/// Why a token could not be verified after a reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unverified {
    /// The set says no.
    Refused(Refusal),
    /// No set was ever read (the URL down or its document bad): a well-formed token cannot
    /// be checked, which is not the client's fault.
    Unavailable,
}

/// One URL's key set, shared by the routes that name it.
pub struct Remote {
    url: Uri,
    /// Readings at most this often (and `max-age` never shorter).
    min_interval: Duration,
    keys: ArcSwapOption<Read>,
    /// When the set was last read (or tried), in ms since `epoch`; `u64::MAX`: never.
    tried_ms: AtomicU64,
    /// When the set goes stale, in ms since `epoch`.
    stale_ms: AtomicU64,
    /// A reading is under way (one at a time).
    busy: AtomicBool,
    /// Woken when a reading ends, either way.
    done: Notify,
    epoch: Instant,
    /// `tollgate_auth_key_set_reads_total{result="ok"}` and `{result="failed"}`.
    reads: (Counter, Counter),
}

impl Remote {
    /// `reads`: the counts of readings that gave a set and that failed.
    pub fn new(url: Uri, min_interval: Duration, reads: (Counter, Counter)) -> Arc<Remote> {
        Arc::new(Remote {
            reads,
            url,
            min_interval,
            keys: ArcSwapOption::empty(),
            tried_ms: AtomicU64::new(u64::MAX),
            stale_ms: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            done: Notify::new(),
            epoch: Instant::now(),
        })
    }

    pub fn url(&self) -> &Uri {
        &self.url
    }

    pub fn min_interval(&self) -> Duration {
        self.min_interval
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The current set, if one was read; a stale one is read again in the background (on the
    /// current runtime) while it is used.
    pub fn current(self: &Arc<Self>) -> arc_swap::Guard<Option<Arc<Read>>> {
        let keys = self.keys.load();
        if keys.is_some() && self.now_ms() >= self.stale_ms.load(Ordering::Relaxed) && self.may_read() {
            self.start_reading();
        }
        keys
    }

    /// The generation of the current set (0: none yet).
    pub fn generation(self: &Arc<Self>) -> Generation {
        self.current().as_ref().map_or(0, |r| r.generation)
    }

    /// Verifies with the current set (see [`Remote::current`]), and says which set that was.
    /// No set yet: [`Refusal::UnknownKey`].
    pub fn verify(self: &Arc<Self>, token: &[u8], rules: &Rules, now: i64) -> (Result<Verified, Refusal>, Generation) {
        match &*self.current() {
            Some(read) => (jwt::verify(token, &read.set, rules, now), read.generation),
            None => (Err(Refusal::UnknownKey), 0),
        }
    }

    /// After [`Refusal::UnknownKey`]: starts a reading if the last one is at least
    /// `min_interval` old and none is under way, waits for the reading under way (whoever
    /// started it, at most [`super::FETCH_TIMEOUT`]), then verifies with what is there.
    ///
    /// # Errors
    /// [`Unverified::Refused`], or [`Unverified::Unavailable`] for a well-formed token when no
    /// set was ever read.
    pub async fn verify_fresh(
        self: Arc<Self>,
        token: Vec<u8>,
        rules: Rules,
        now: i64,
    ) -> Result<(Verified, Generation), Unverified> {
        // Registered before the checks, so a reading that ends in between still wakes it.
        let done = self.done.notified();
        tokio::pin!(done);
        done.as_mut().enable();
        let tried = self.tried_ms.load(Ordering::Relaxed);
        let interval = u64::try_from(self.min_interval.as_millis()).unwrap_or(u64::MAX);
        let due = tried == u64::MAX || self.now_ms().saturating_sub(tried) >= interval;
        if due && self.may_read() {
            self.start_reading();
        }
        if self.busy.load(Ordering::Acquire) {
            // Bounded by the reading's own timeout; past it, the set as it stands.
            let _ = tokio::time::timeout(super::FETCH_TIMEOUT, done).await;
        }
        match &*self.keys.load() {
            Some(read) => {
                jwt::verify(&token, &read.set, &rules, now).map(|v| (v, read.generation)).map_err(Unverified::Refused)
            }
            // Nothing to verify with: a token that is not even well formed is still the
            // client's fault, any other cannot be judged.
            None => match jwt::verify(&token, &KeySet::default(), &rules, now) {
                Err(Refusal::UnknownKey) | Ok(_) => Err(Unverified::Unavailable),
                Err(r) => Err(Unverified::Refused(r)),
            },
        }
    }

    /// Takes the one reading slot.
    fn may_read(&self) -> bool {
        self.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// Runs a reading (the slot taken) in a task of its own on the current runtime; without
    /// one, gives the slot back.
    fn start_reading(self: &Arc<Self>) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let this = self.clone();
            rt.spawn(async move { this.read().await });
        } else {
            self.busy.store(false, Ordering::Release);
            self.done.notify_waiters();
        }
    }

    /// Reads the set (the slot taken), keeping the last good one on failure. The slot is given
    /// back, and the waiting requests woken, however this ends.
    async fn read(&self) {
        struct Slot<'a>(&'a AtomicBool, &'a Notify);
        impl Drop for Slot<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
                self.1.notify_waiters();
            }
        }
        let _slot = Slot(&self.busy, &self.done);
        self.tried_ms.store(self.now_ms(), Ordering::Relaxed);
        let interval = self.min_interval;
        match fetch(&self.url).await.and_then(|(body, max_age)| {
            let set = KeySet::from_jwks(&body).map_err(|e| e.to_string())?;
            Ok((set, max_age))
        }) {
            Ok((set, max_age)) => {
                let age = max_age.unwrap_or(DEFAULT_MAX_AGE).clamp(interval, MAX_MAX_AGE.max(interval));
                self.keys.store(Some(Arc::new(Read { generation: next_generation(), set })));
                self.reads.0.inc();
                let age = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
                self.stale_ms.store(self.now_ms().saturating_add(age), Ordering::Relaxed);
            }
            Err(e) => {
                self.reads.1.inc();
                tracing::warn!(url = %self.url, "the key set could not be read: {e}; the last good one is kept");
                // Tried again after the interval, not on every request.
                let interval = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
                self.stale_ms.store(self.now_ms().saturating_add(interval), Ordering::Relaxed);
            }
        }
    }
}

/// `GET url` over HTTP/1.1 (TLS for `https://`, on the web's roots): the body of a `200`,
/// bounded, and its `max-age`.
async fn fetch(url: &Uri) -> Result<(Bytes, Option<Duration>), String> {
    let https = url.scheme_str() == Some("https");
    let host = url.host().ok_or("no host")?;
    let port = url.port_u16().unwrap_or(if https { 443 } else { 80 });
    let authority = url.authority().map_or(host, |a| a.as_str());
    let path = url.path_and_query().map_or("/", |p| p.as_str());
    let req = Request::get(path)
        .header(HOST, authority)
        .header(ACCEPT, "application/jwk-set+json, application/json")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let call = async {
        let tcp = tokio::net::TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        if https {
            let mut roots = rustls::RootCertStore::empty();
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            let config = rustls::ClientConfig::builder_with_provider(crate::pki::provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots)
                .with_no_client_auth();
            let name = rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(|e| e.to_string())?;
            let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            exchange(tls, req).await
        } else {
            exchange(tcp, req).await
        }
    };
    tokio::time::timeout(super::FETCH_TIMEOUT, call).await.map_err(|_| "timed out".to_owned())?
}

async fn exchange<I>(io: I, req: Request<Empty<Bytes>>) -> Result<(Bytes, Option<Duration>), String>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    if resp.status() != StatusCode::OK {
        return Err(format!("status {}", resp.status()));
    }
    let max_age = resp.headers().get_all(CACHE_CONTROL).iter().find_map(|v| max_age(v.as_bytes()));
    let body = Limited::new(resp.into_body(), MAX_JWKS_BYTES).collect().await.map_err(|e| e.to_string())?;
    Ok((body.to_bytes(), max_age))
}

/// `max-age=N` of a `Cache-Control` field (`no-store`/`no-cache` read as 0: the interval).
fn max_age(field: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(field).ok()?;
    let mut found = None;
    for d in text.split(',') {
        let d = d.trim();
        if d.eq_ignore_ascii_case("no-store") || d.eq_ignore_ascii_case("no-cache") {
            return Some(Duration::ZERO);
        }
        if let Some((k, v)) = d.split_once('=') {
            if k.trim().eq_ignore_ascii_case("max-age") {
                found = v.trim().trim_matches('"').parse::<u64>().ok().map(Duration::from_secs);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_age_is_read_from_cache_control() {
        assert_eq!(max_age(b"public, max-age=600"), Some(Duration::from_secs(600)));
        assert_eq!(max_age(b"no-store"), Some(Duration::ZERO));
        assert_eq!(max_age(b"public"), None);
        assert_eq!(max_age(b"max-age=x"), None);
    }
}
