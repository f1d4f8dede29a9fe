//! Certificates tollgate gets and renews itself: from an ACME CA (`tls.acme`: Let's Encrypt
//! or any RFC 8555 server) and from its local development CA (`tls.internal`). One manager
//! per process (on the first worker) keeps each configured certificate in the
//! [`Issued`](crate::pki::issued::Issued) store the listeners' SNI stores read: the stored one
//! at start, a new one at about two thirds of its lifetime (or in the window the CA's renewal
//! information suggests), swapped in without touching open connections.
//!
//! Failures are loud and safe: a certificate that cannot be had keeps the one in service (a
//! self-signed placeholder at a first start), is logged and counted
//! (`tollgate_acme_orders_total{result="failed"}`), and is tried again later, less and less
//! often. Instances that share the storage folder order a certificate once: the one that holds
//! its lock (Redis, or a lock file) orders, the others pick up what it stored, and any of them
//! answers the CA's HTTP-01 request from the shared storage.

mod client;
mod lock;
mod order;
pub mod storage;

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use instant_acme::Account;

use crate::body::Body;
use crate::config::managed::Acme;
use crate::config::{CertSource, Config, ManagedCert};
use crate::pki::ca::Pem;
use crate::pki::issued::{Current, Issued, Origin};
use crate::proxy::{Proxy, Shared};

/// An order is given up after this (and tried again later).
pub const ORDER_TIMEOUT: Duration = Duration::from_secs(300);

/// How often the manager looks for a changed config, and wakes at the latest.
const TICK: Duration = Duration::from_secs(1);

/// An instance that finds a certificate's lock taken looks again this soon.
const LOCKED_RETRY: Duration = Duration::from_secs(2);

/// The path an HTTP-01 validation asks for, before its token.
pub const HTTP01_PREFIX: &str = "/.well-known/acme-challenge/";

/// Seconds since the unix epoch.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// When a certificate valid from `not_before` to `not_after` is renewed: two thirds into its
/// lifetime (Let's Encrypt's advice; 60 days into 90, 4 into 6).
pub fn renewal_point(not_before: i64, not_after: i64) -> i64 {
    not_before + (not_after - not_before).max(0) * 2 / 3
}

/// A point of the renewal window `[start, end]` a CA suggested (RFC 9773): now when it has
/// begun, else `at` (0 to 1) of the way into it, so instances and clients spread out.
pub fn window_point(start: i64, end: i64, now: i64, at: f64) -> i64 {
    if start <= now {
        return now;
    }
    let span = (end - start).max(0) as f64;
    start + (span * at.clamp(0.0, 1.0)) as i64
}

/// How long after its `failures`-th failure in a row an order is tried again: from a minute
/// to six hours. A CA bounds failed validations (Let's Encrypt: 5 an hour per name and
/// account), so the first tries come quickly and the later ones seldom.
pub fn backoff(failures: u32) -> Duration {
    const STEPS: [u64; 8] = [60, 120, 300, 600, 1200, 1800, 3600, 3 * 3600];
    let secs = STEPS.get(failures.saturating_sub(1) as usize).copied().unwrap_or(6 * 3600);
    Duration::from_secs(secs)
}

/// The label a certificate's metrics and log lines carry: its first name.
fn label(cert: &ManagedCert) -> &str {
    cert.names.first().map_or("", String::as_str)
}

/// Every managed certificate of `config`, once each (two listeners may serve the same).
fn managed(config: &Config) -> Vec<&ManagedCert> {
    let mut out: Vec<&ManagedCert> = Vec::new();
    for m in config.listeners.iter().filter_map(|l| l.tls.as_ref()).flat_map(|t| &t.managed) {
        if !out.iter().any(|o| o.id == m.id) {
            out.push(m);
        }
    }
    out
}

/// A stored or issued pair, put in service form: `None` when it does not cover `names` or has
/// expired at `now`.
fn usable(
    pem: &Pem,
    names: &[String],
    now: i64,
) -> Result<Option<(Arc<rustls::sign::CertifiedKey>, i64, i64)>, String> {
    let pair = pem.pair()?;
    let facts = pair.facts.clone().unwrap_or_default();
    let covers = names.iter().all(|n| facts.dns_names.contains(n) || facts.other_names.contains(n));
    if !covers || facts.not_after <= now {
        return Ok(None);
    }
    let key = pair.signing().map_err(|e| e.to_string())?;
    Ok(Some((Arc::new(key), facts.not_before, facts.not_after)))
}

/// The certificate stored for `cert`, if it covers its names and has not expired.
fn stored(cert: &ManagedCert, now: i64) -> Option<Current> {
    let folder = cert.folder();
    let pem = match storage::read_pair(&folder) {
        Ok(Some(p)) => p,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!(certificate = label(cert), error = %e, "cannot read a stored certificate");
            return None;
        }
    };
    match usable(&pem, &cert.names, now) {
        Ok(Some((key, not_before, not_after))) => {
            let origin = match cert.source {
                CertSource::Acme(_) => Origin::Acme,
                CertSource::Internal(_) => Origin::Internal,
            };
            Some(Current { key, origin, not_before, not_after })
        }
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(folder = %folder.display(), error = %e, "a stored certificate is unusable; a new one is made");
            None
        }
    }
}

/// A new certificate from the local CA of `storage`, stored in the certificate's folder.
fn issue_internal(
    cert: &ManagedCert,
    storage: &std::path::Path,
    lifetime: Duration,
    now: i64,
) -> Result<Current, String> {
    let ca = storage::local_ca(storage, now)?;
    let secs = i64::try_from(lifetime.as_secs()).unwrap_or(i64::MAX);
    let pem = ca.issue(&cert.names, now, secs)?;
    storage::write_pair(&cert.folder(), &pem)?;
    let (key, not_before, not_after) = usable(&pem, &cert.names, now)?.ok_or("the new certificate is unusable")?;
    Ok(Current { key, origin: Origin::Internal, not_before, not_after })
}

/// Puts `current` in service for `cert`, and says so in the metrics.
fn serve(issued: &Issued, metrics: &crate::metrics::Metrics, cert: &ManagedCert, current: Current) {
    metrics.certificates().served(label(cert), current.origin.as_str(), current.not_after);
    issued.set(&cert.id, current);
}

/// The first certificate of `cert` at start (blocking: files and keys): the stored one, a new
/// one from the local CA, or, for an ACME name with none yet, a self-signed placeholder.
fn prime_one(cert: &ManagedCert, issued: &Issued, metrics: &crate::metrics::Metrics, now: i64) {
    if let Some(current) = stored(cert, now) {
        return serve(issued, metrics, cert, current);
    }
    let placeholder_why = match &cert.source {
        CertSource::Internal(i) => match issue_internal(cert, &i.storage, i.lifetime, now) {
            Ok(current) => return serve(issued, metrics, cert, current),
            Err(e) => format!("the local CA could not issue one: {e}"),
        },
        CertSource::Acme(_) => "none is stored yet; the CA is asked for one now".to_owned(),
    };
    match crate::pki::ca::placeholder(&cert.names, now).and_then(|p| usable(&p, &cert.names, now)) {
        Ok(Some((key, not_before, not_after))) => {
            tracing::warn!(
                certificate = label(cert),
                names = %cert.names.join(", "),
                "no certificate for these names ({placeholder_why}): serving a self-signed placeholder, which no client trusts"
            );
            serve(issued, metrics, cert, Current { key, origin: Origin::Placeholder, not_before, not_after });
        }
        Ok(None) | Err(_) => {
            tracing::error!(certificate = label(cert), "no certificate and no placeholder: handshakes for it fail");
        }
    }
}

/// Puts in service, before the listeners accept, a certificate for every managed entry of
/// `proxy`'s config that has none yet. Blocking: run it off the runtime (or before it).
pub fn prime(proxy: &Proxy) {
    let now = unix_now();
    for cert in managed(&proxy.config) {
        if proxy.issued().current(&cert.id).is_none() {
            prime_one(cert, proxy.issued(), proxy.metrics(), now);
        }
    }
}

/// One configured certificate's schedule.
struct Entry {
    cert: ManagedCert,
    /// Unix seconds: when it is to be renewed.
    renew_at: i64,
    /// Unix seconds: when to act next (renew, retry, look for another instance's, ask the CA
    /// for its renewal window).
    due: i64,
    failures: u32,
    /// Unix seconds: when to ask the CA for the renewal window again; `None` when it offers
    /// none (or for the local CA).
    ari_at: Option<i64>,
}

impl Entry {
    fn new(cert: ManagedCert, current: Option<&Current>, now: i64) -> Entry {
        let renew_at = match current {
            Some(c) if c.origin != Origin::Placeholder => renewal_point(c.not_before, c.not_after),
            _ => now,
        };
        let ari_at = matches!(cert.source, CertSource::Acme(_)).then_some(now);
        Entry { cert, renew_at, due: renew_at.min(ari_at.unwrap_or(i64::MAX)), failures: 0, ari_at }
    }

    fn served(&mut self, c: &Current, now: i64) {
        self.renew_at = renewal_point(c.not_before, c.not_after);
        self.failures = 0;
        if self.ari_at.is_some() {
            self.ari_at = Some(now);
        }
        self.due = self.renew_at.min(self.ari_at.unwrap_or(i64::MAX));
    }
}

/// The manager of one process.
struct Manager {
    shared: Shared,
    entries: HashMap<String, Entry>,
    accounts: HashMap<PathBuf, Account>,
    /// This instance's lock token.
    token: String,
}

/// Runs the manager until `shutdown` resolves: first puts a certificate in service for every
/// managed entry that has none, then keeps them renewed, following reloads.
pub async fn run(shared: Shared, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    let mut m = Manager {
        shared,
        entries: HashMap::new(),
        accounts: HashMap::new(),
        token: format!("{:016x}", fastrand::u64(..)),
    };
    let mut seen: Option<Arc<Config>> = None;
    loop {
        let proxy = m.shared.load_full();
        if !seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, &proxy.config)) {
            m.follow(&proxy).await;
            seen = Some(proxy.config.clone());
        }
        let now = unix_now();
        let mut due: Vec<(i64, String)> =
            m.entries.iter().filter(|(_, e)| e.due <= now).map(|(id, e)| (e.due, id.clone())).collect();
        due.sort();
        for (_, id) in due {
            let act = m.act(&proxy, &id);
            tokio::select! {
                () = &mut shutdown => return,
                () = act => {}
            }
        }
        let next = m.entries.values().map(|e| e.due).min().unwrap_or(i64::MAX);
        let wait = Duration::from_secs(u64::try_from(next - unix_now()).unwrap_or(0)).min(TICK);
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

impl Manager {
    /// Takes in a new config: its new certificates primed and scheduled, the gone ones out.
    async fn follow(&mut self, proxy: &Arc<Proxy>) {
        let p = proxy.clone();
        let _ = tokio::task::spawn_blocking(move || prime(&p)).await;
        let now = unix_now();
        let wanted = managed(&proxy.config);
        for cert in &wanted {
            match self.entries.get_mut(&cert.id) {
                Some(e) => e.cert = (*cert).clone(),
                None => {
                    let current = proxy.issued().current(&cert.id);
                    self.entries.insert(cert.id.clone(), Entry::new((*cert).clone(), current.as_ref(), now));
                }
            }
        }
        let gone: Vec<String> =
            self.entries.keys().filter(|id| !wanted.iter().any(|c| &c.id == *id)).cloned().collect();
        for id in gone {
            if let Some(e) = self.entries.remove(&id) {
                proxy.metrics().certificates().gone(label(&e.cert));
            }
            proxy.issued().remove(&id);
        }
    }

    async fn act(&mut self, proxy: &Arc<Proxy>, id: &str) {
        let Some(entry) = self.entries.get(id) else { return };
        let cert = entry.cert.clone();
        let now = unix_now();
        match &cert.source {
            CertSource::Internal(i) => {
                let (c, i) = (cert.clone(), i.clone());
                let made = tokio::task::spawn_blocking(move || issue_internal(&c, &i.storage, i.lifetime, now)).await;
                let made = made.map_err(|e| e.to_string()).and_then(|r| r);
                let Some(entry) = self.entries.get_mut(id) else { return };
                match made {
                    Ok(current) => {
                        tracing::info!(certificate = label(&cert), not_after = %crate::pki::x509::date(current.not_after), "renewed a local CA certificate");
                        entry.served(&current, now);
                        serve(proxy.issued(), proxy.metrics(), &cert, current);
                    }
                    Err(e) => self.failed(proxy, id, &e, now),
                }
            }
            CertSource::Acme(acme) => {
                let acme = acme.clone();
                self.acme(proxy, id, &cert, &acme, now).await;
            }
        }
    }

    /// Logs and counts a failure of `id`'s certificate and schedules the next try.
    fn failed(&mut self, proxy: &Proxy, id: &str, why: &str, now: i64) {
        let Some(entry) = self.entries.get_mut(id) else { return };
        entry.failures += 1;
        let wait = backoff(entry.failures);
        entry.due = now + i64::try_from(wait.as_secs()).unwrap_or(i64::MAX);
        let serving = match proxy.issued().current(id) {
            Some(c) if c.origin == Origin::Placeholder => "the self-signed placeholder".to_owned(),
            Some(c) => format!("the certificate in service (valid until {})", crate::pki::x509::date(c.not_after)),
            None => "nothing".to_owned(),
        };
        tracing::error!(
            certificate = label(&entry.cert),
            names = %entry.cert.names.join(", "),
            failures = entry.failures,
            retry_in_secs = wait.as_secs(),
            "could not get a certificate: {why}; serving {serving} meanwhile"
        );
    }

    /// The account of `acme`'s directory, made or read once per process.
    async fn account(&mut self, acme: &Acme, id: &str) -> Result<Account, String> {
        let folder = order::directory_folder(acme, id);
        if let Some(a) = self.accounts.get(&folder) {
            return Ok(a.clone());
        }
        let a = order::account(acme, &folder).await?;
        self.accounts.insert(folder, a.clone());
        Ok(a)
    }

    /// The certificate another instance stored, if it is newer than the one in service.
    async fn picked_up(&mut self, proxy: &Proxy, cert: &ManagedCert, now: i64) -> Option<Current> {
        let c = cert.clone();
        let found = tokio::task::spawn_blocking(move || stored(&c, now)).await.ok().flatten()?;
        let newer = proxy
            .issued()
            .current(&cert.id)
            .is_none_or(|cur| cur.origin == Origin::Placeholder || cur.not_after < found.not_after);
        (newer && renewal_point(found.not_before, found.not_after) > now).then_some(found)
    }

    async fn acme(&mut self, proxy: &Arc<Proxy>, id: &str, cert: &ManagedCert, acme: &Arc<Acme>, now: i64) {
        // Another instance may have renewed it.
        if let Some(found) = self.picked_up(proxy, cert, now).await {
            tracing::info!(certificate = label(cert), "took the certificate another instance stored");
            if let Some(e) = self.entries.get_mut(id) {
                e.served(&found, now);
            }
            return serve(proxy.issued(), proxy.metrics(), cert, found);
        }
        let Some(entry) = self.entries.get(id) else { return };
        if entry.renew_at > now {
            // Only the renewal window is due.
            return self.ask_window(proxy, id, cert, acme, now).await;
        }
        let mut locks = match proxy.redis() {
            Some(r) => lock::Locks::Redis(r.clone()),
            None => lock::Locks::Files,
        };
        let mut taken = locks.take(id, &cert.folder(), &self.token, now).await;
        if let (Err(e), lock::Locks::Redis(_)) = (&taken, &locks) {
            // A certificate must not expire because Redis is down: the storage's lock instead.
            tracing::warn!(certificate = label(cert), error = %e, "the order lock falls back to a lock file");
            locks = lock::Locks::Files;
            taken = locks.take(id, &cert.folder(), &self.token, now).await;
        }
        let held = match taken {
            Ok(Some(h)) => h,
            Ok(None) => {
                tracing::debug!(certificate = label(cert), "another instance is ordering this certificate");
                if let Some(e) = self.entries.get_mut(id) {
                    e.due = now + i64::try_from(LOCKED_RETRY.as_secs()).unwrap_or(2);
                }
                return;
            }
            Err(e) => return self.failed(proxy, id, &format!("the order lock: {e}"), now),
        };
        // The previous holder may have stored it between our look and our lock.
        if let Some(found) = self.picked_up(proxy, cert, now).await {
            locks.release(held).await;
            if let Some(e) = self.entries.get_mut(id) {
                e.served(&found, now);
            }
            return serve(proxy.issued(), proxy.metrics(), cert, found);
        }
        let got = tokio::time::timeout(ORDER_TIMEOUT, self.order(proxy, id, cert, acme)).await;
        locks.release(held).await;
        let got = got.unwrap_or_else(|_| Err(format!("the order took longer than {}s", ORDER_TIMEOUT.as_secs())));
        let now = unix_now();
        match got {
            Ok(current) => {
                proxy.metrics().certificates().order(label(cert), "issued");
                tracing::info!(
                    certificate = label(cert),
                    names = %cert.names.join(", "),
                    not_after = %crate::pki::x509::date(current.not_after),
                    directory = %acme.directory,
                    "certificate issued"
                );
                if let Some(e) = self.entries.get_mut(id) {
                    e.served(&current, now);
                }
                serve(proxy.issued(), proxy.metrics(), cert, current);
            }
            Err(why) => {
                proxy.metrics().certificates().order(label(cert), "failed");
                self.failed(proxy, id, &why, now);
            }
        }
    }

    /// One order, stored and made ready to serve.
    async fn order(&mut self, proxy: &Proxy, id: &str, cert: &ManagedCert, acme: &Acme) -> Result<Current, String> {
        let account = self.account(acme, id).await?;
        let folder = order::directory_folder(acme, id);
        let pem = order::order(&account, &cert.names, acme.challenge, proxy.issued(), &folder).await?;
        let now = unix_now();
        let (key, not_before, not_after) =
            usable(&pem, &cert.names, now)?.ok_or("the CA's certificate does not cover the names, or has expired")?;
        let dir = cert.folder();
        tokio::task::spawn_blocking(move || storage::write_pair(&dir, &pem)).await.map_err(|e| e.to_string())??;
        Ok(Current { key, origin: Origin::Acme, not_before, not_after })
    }

    /// Asks the CA when to renew (RFC 9773 renewal information), if it says.
    async fn ask_window(&mut self, proxy: &Proxy, id: &str, cert: &ManagedCert, acme: &Acme, now: i64) {
        let current = proxy.issued().current(id);
        let facts =
            current.as_ref().and_then(|c| c.key.end_entity_cert().ok()).and_then(|d| crate::pki::x509::parse(d));
        let asked = match facts.as_ref().and_then(|f| Some((f.authority_key_id.as_deref()?, f.serial.as_slice()))) {
            None => Err(None),
            Some((aki, serial)) => match self.account(acme, id).await {
                Err(e) => Err(Some(e)),
                Ok(account) => {
                    let cid = instant_acme::CertificateIdentifier::new(aki.into(), serial.into());
                    match account.renewal_info(&cid).await {
                        Ok(info) => Ok(info),
                        Err(instant_acme::Error::Unsupported(_)) => Err(None),
                        Err(e) => Err(Some(e.to_string())),
                    }
                }
            },
        };
        let Some(entry) = self.entries.get_mut(id) else { return };
        match asked {
            Ok((info, retry)) => {
                let w = info.suggested_window;
                let at = window_point(w.start.unix_timestamp(), w.end.unix_timestamp(), now, fastrand::f64());
                entry.renew_at = at;
                let again = i64::try_from(retry.as_secs()).unwrap_or(0).clamp(3600, 86_400);
                entry.ari_at = Some(now + again);
                tracing::debug!(certificate = label(cert), renew_at = %crate::pki::x509::date(at), "the CA's renewal window");
            }
            // The CA offers none: two thirds of the lifetime it is.
            Err(None) => entry.ari_at = None,
            Err(Some(e)) => {
                tracing::debug!(certificate = label(cert), error = %e, "cannot read the CA's renewal window");
                entry.ari_at = Some(now + 3600);
            }
        }
        entry.due = entry.renew_at.min(entry.ari_at.unwrap_or(i64::MAX));
    }
}

/// The token of an HTTP-01 validation request (`GET /.well-known/acme-challenge/TOKEN`).
pub fn http01_token<B>(req: &Request<B>) -> Option<&str> {
    req.uri().path().strip_prefix(HTTP01_PREFIX)
}

/// Answers an HTTP-01 validation request for `token`: the key authorization of this
/// process's pending challenge, else one another instance published in the shared storage,
/// else `404`.
pub async fn answer_http01(proxy: Arc<Proxy>, token: String) -> Response<Body> {
    let found = if storage::valid_token(&token) { key_authorization(&proxy, &token).await } else { None };
    proxy.acme_http01(found)
}

async fn key_authorization(proxy: &Proxy, token: &str) -> Option<String> {
    if let Some(ka) = proxy.issued().http(token) {
        return Some(ka);
    }
    let mut folders: Vec<PathBuf> = Vec::new();
    for cert in managed(&proxy.config) {
        if let CertSource::Acme(a) = &cert.source {
            let f = order::answer_file(&order::directory_folder(a, &cert.id), token);
            if !folders.contains(&f) {
                folders.push(f);
            }
        }
    }
    tokio::task::spawn_blocking(move || {
        folders.iter().find_map(|f| storage::read(f).ok().flatten()).and_then(|b| String::from_utf8(b).ok())
    })
    .await
    .ok()
    .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_comes_two_thirds_into_the_lifetime() {
        let day = 86_400;
        assert_eq!(renewal_point(0, 90 * day), 60 * day);
        assert_eq!(renewal_point(100, 106), 104);
        assert_eq!(renewal_point(100, 50), 100, "a certificate dated backwards is renewed at once");
    }

    #[test]
    fn a_window_that_has_begun_means_now_and_a_later_one_is_spread_over() {
        assert_eq!(window_point(100, 200, 150, 0.9), 150);
        assert_eq!(window_point(100, 200, 50, 0.0), 100);
        assert_eq!(window_point(100, 200, 50, 0.5), 150);
        assert_eq!(window_point(100, 200, 50, 7.0), 200);
    }

    #[test]
    fn retries_slow_down_to_six_hours() {
        let waits: Vec<u64> = (1..=10).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(waits, [60, 120, 300, 600, 1200, 1800, 3600, 10_800, 21_600, 21_600]);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(backoff(u32::MAX).as_secs(), 21_600);
        // Five failures of one name take over half an hour: within Let's Encrypt's 5 an hour.
        assert!(waits[..4].iter().sum::<u64>() >= 1080);
    }
}
