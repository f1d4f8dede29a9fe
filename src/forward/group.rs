//! An upstream of several servers (`servers:`): which server takes a request (balancing),
//! which servers may (passive ejection, active checks), and retries under a budget.
//!
//! Each server is an [`HttpForwarder`] of its own (its pool, its connector); the group only
//! chooses. Invariants: a retry never goes to a server this request already tried; every
//! retry is withdrawn from a [`TpsBudget`] that one deposit per client request fills, so
//! upstream tries stay ≤ (1 + ratio) × requests + `min_per_s` × 10 s; a request is
//! replayed after bytes were sent only when it is idempotent and has no body.
//!
//! tower's `Balance` is not used: it owns the choice (so a retry cannot avoid the server it
//! just tried, nor can a hash pin a key) and wants every server as a polled `Service`; a
//! pick here is a few atomic loads. Its retry budget is used as is.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, Uri, Version};
use hyper::body::{Body as _, Incoming};
use tower::retry::budget::{Budget as _, TpsBudget};

mod balance;
pub mod dns;
mod health;

use super::{Downstream, HttpForwarder};
use crate::answer::{Cause, Error, UpstreamFailure};
use crate::body::{Body, Inbound, RequestBody, UpstreamConn};
use crate::config::group::{Balance, GroupConfig, Resolve};
use crate::config::HttpUpstream;
use crate::limit::KeySpec;
use crate::metrics::{Metrics, ServerMetrics};

/// One server of a group.
pub struct Member {
    pub fwd: HttpForwarder,
    /// Its address as logs, metrics and `/config` name it (`host:port`, or the address a
    /// resolved name gave).
    name: Arc<str>,
    /// The name it was found under (`resolve:` servers).
    from: Option<Arc<str>>,
    weight: u32,
    /// Mixed with a request's key for rendezvous hashing.
    seed: u64,
    /// Requests waiting for a response head (also the `in_flight` gauge).
    metrics: ServerMetrics,
    consecutive_failures: AtomicU32,
    /// Until when the server is ejected, on the coarse clock in ms (0: never was).
    ejected_until: AtomicU64,
    ejections: AtomicU32,
    /// The active checks' verdict (true until they say otherwise).
    up: AtomicBool,
    /// Peak-EWMA of the time to a response head (µs, f64 bits) and when it was last updated (ms).
    ewma_us: AtomicU64,
    ewma_at: AtomicU64,
}

impl Member {
    fn is_at(&self, p: &Place) -> bool {
        *self.name == *p.connect && self.fwd.authority == p.authority && self.weight == p.weight && self.from == p.from
    }
}

/// Where one member is: the address it is reached at, the authority it stands for (`Host`
/// when not preserved, the `:authority` of HTTP/2), its weight and the name it was found under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) connect: Arc<str>,
    pub(crate) authority: http::uri::Authority,
    pub(crate) weight: u32,
    pub(crate) from: Option<Arc<str>>,
}

/// A server as `/config`, `explain` and `/readyz` show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServerView {
    pub url: String,
    /// The name a `resolve:` server was found under.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolved_from: Option<String>,
    pub weight: u32,
    /// `healthy`, `ejected` (passive, for `ejected_for_s` more) or `unhealthy` (active checks).
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ejected_for_s: Option<u64>,
    pub in_flight: i64,
    /// Times it was ejected since tollgate started (`tollgate_upstream_server_ejections`).
    pub ejections: u64,
}

/// The servers of a group at one moment. A request keeps the set it started with for all its
/// tries; a DNS answer that changes the servers swaps in a new set (members that stay are
/// the same, with their pools, health and ejection).
pub(crate) struct Set {
    members: Vec<Arc<Member>>,
    /// Weighted round robin: member indices, each as often as its weight, interleaved.
    schedule: Vec<u16>,
}

impl Set {
    fn new(members: Vec<Arc<Member>>) -> Set {
        let weights: Vec<u32> = members.iter().map(|m| m.weight).collect();
        Set { schedule: balance::smooth_round_robin(&weights), members }
    }
}

/// What a new member is made from (a server found by DNS joins after the group was built).
struct Maker {
    upstream: HttpUpstream,
    body_read_timeout: Duration,
    metrics: Arc<Metrics>,
    workers: usize,
}

pub struct Group {
    name: String,
    cfg: Arc<GroupConfig>,
    set: ArcSwap<Set>,
    next: AtomicUsize,
    budget: TpsBudget,
    /// Held while an ejection is decided, so concurrent failures cannot together eject
    /// more than `max_ejected_percent` (taken only once a server's failures reach the bound).
    ejecting: std::sync::Mutex<()>,
    preserve_host: bool,
    timeout: Duration,
    h2: bool,
    scheme: &'static str,
    make: Maker,
    /// Per `servers:` entry (by index), what DNS last gave for a `resolve:` one; written by
    /// the discovery task only, read by a reload (which starts from it) and `/config`.
    found: std::sync::Mutex<Vec<dns::Found>>,
    /// `resolve:` entries that had a first answer (an address or a failure); see
    /// [`Group::first_answers`].
    answered: tokio::sync::watch::Sender<usize>,
}

/// Servers a request has tried (at most 256 in a group).
#[derive(Default)]
struct Tried([u64; 4]);

impl Tried {
    fn has(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
    fn add(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
}

/// One try of an HTTP/1.1 group: where it went and when.
struct Try {
    at: usize,
    tries: u32,
    sent: Instant,
    started: Instant,
    replayable: bool,
}

/// A try's outcome: an answer or failure with the connection it came on, or a timeout.
type Attempted = Result<Result<(Response<Incoming>, UpstreamConn), Failed>, crate::timer::Elapsed>;

/// What [`Group::judge`] makes of a try. Returned once per try and taken apart at once (the
/// same bytes the loop held before); boxing a variant would allocate per try.
#[allow(clippy::large_enum_variant)]
enum Judged {
    Done(Result<Response<Body>, Error>),
    Again { error: Error, unsent: Option<Request<RequestBody>>, answered: Option<(Response<Incoming>, UpstreamConn)> },
}

/// How one try ended without a response head.
pub(super) struct Failed {
    pub(super) error: Error,
    /// The request, when it never left: another server may take it whatever its method.
    pub(super) unsent: Option<Request<RequestBody>>,
}

/// Counts a request in its server's in-flight gauge until dropped.
struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Group {
    /// A group for upstream `name`; `None` unless `cfg.group` is set. `resolver` finds the
    /// `resolve:` servers; `previous` (the same upstream before a reload) gives them their
    /// last good addresses at once, so a reload never waits for DNS.
    pub fn new(
        name: &str,
        cfg: &HttpUpstream,
        body_read_timeout: Duration,
        metrics: &Arc<Metrics>,
        workers: usize,
        resolver: Option<&Arc<dns::Resolver>>,
        previous: Option<&Group>,
    ) -> Option<Arc<Group>> {
        let gcfg = cfg.group.clone()?;
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let mut upstream = cfg.clone();
        upstream.group = None;
        let make = Maker { upstream, body_read_timeout, metrics: metrics.clone(), workers };
        let found = dns::Found::start(&gcfg, previous.filter(|p| p.scheme == scheme));
        let retry = &gcfg.retry;
        let group = Arc::new(Group {
            name: name.to_owned(),
            set: ArcSwap::from_pointee(Set::new(Vec::new())),
            budget: TpsBudget::new(Duration::from_secs(10), retry.min_per_s, retry.ratio),
            cfg: gcfg.clone(),
            next: AtomicUsize::new(0),
            ejecting: std::sync::Mutex::new(()),
            preserve_host: cfg.preserve_host,
            timeout: cfg.timeout,
            h2: cfg.protocol == crate::config::UpstreamProtocol::H2c,
            scheme,
            make,
            found: std::sync::Mutex::new(found),
            answered: tokio::sync::watch::Sender::new(0),
        });
        group.rebuild();
        if gcfg.servers.iter().any(|s| s.resolve != Resolve::Fixed) {
            match resolver {
                Some(r) => group.start_discovery(r.clone()),
                None => tracing::error!(upstream = name, "no DNS resolver: its `resolve:` servers are never found"),
            }
        }
        Some(group)
    }

    /// A member at `place`, its health checks started.
    fn member(self: &Arc<Self>, place: &Place) -> Arc<Member> {
        let mut one = self.make.upstream.clone();
        one.authority = place.authority.clone();
        let fwd = HttpForwarder::at(
            &self.name,
            &one,
            &place.connect,
            self.make.body_read_timeout,
            &self.make.metrics,
            self.make.workers,
        );
        let url = format!("{}://{}", self.scheme, place.connect);
        let member = Arc::new(Member {
            fwd,
            name: place.connect.clone(),
            from: place.from.clone(),
            weight: place.weight,
            seed: xxhash_rust::xxh3::xxh3_64(place.connect.as_bytes()),
            metrics: self.make.metrics.server(&self.name, &url),
            consecutive_failures: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            ejections: AtomicU32::new(0),
            up: AtomicBool::new(true),
            ewma_us: AtomicU64::new(0f64.to_bits()),
            ewma_at: AtomicU64::new(0),
        });
        if let Some(h) = &self.cfg.health {
            self.start_check(&member, h);
        }
        member
    }

    /// Makes the set from the fixed servers and what DNS found, keeping every member whose
    /// place is unchanged; swaps it in when it differs from the current one.
    fn rebuild(self: &Arc<Self>) {
        let places = {
            let found = self.found.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            dns::places(&self.cfg, &found)
        };
        let current = self.set.load_full();
        let same =
            current.members.len() == places.len() && current.members.iter().zip(&places).all(|(m, p)| m.is_at(p));
        if same && !places.is_empty() {
            return;
        }
        let members = places
            .iter()
            .map(|p| current.members.iter().find(|m| m.is_at(p)).cloned().unwrap_or_else(|| self.member(p)))
            .collect();
        self.set.store(Arc::new(Set::new(members)));
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The address of the server at `index` of the current set (as [`Served`](super::Served)
    /// names it). Should DNS change the set while the request was out, the name may be
    /// another's: it is for the log line only.
    pub fn server_name(&self, index: usize) -> Option<Arc<str>> {
        self.set.load().members.get(index).map(|m| m.name.clone())
    }

    /// The key a `hash` group balances on.
    pub fn hash_key(&self) -> Option<&KeySpec> {
        match &self.cfg.balance {
            Balance::Hash(k) => Some(k),
            _ => None,
        }
    }

    /// Whether upgrades can be tunnelled (HTTP/1.1 servers only).
    pub fn tunnels(&self) -> bool {
        !self.h2
    }

    /// Milliseconds on the coarse clock (a tick is 100 ms; ejections last seconds): no
    /// clock read per request.
    fn now_ms(&self) -> u64 {
        crate::timer::now_ms().max(1)
    }

    fn enter<'s>(&self, set: &'s Set, i: usize) -> InFlight<'s> {
        let m = &set.members[i].metrics;
        m.requests.inc();
        m.in_flight.inc();
        InFlight(&m.in_flight)
    }

    /// Forwards `req` to a server of the group, retrying on another one as `retry:` allows.
    /// `key` is the request's hash key (`balance: hash`), else anything.
    ///
    /// # Errors
    /// As [`HttpForwarder::forward`]; an unavailable upstream when no server may take it.
    pub async fn forward(
        &self,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
        key: u64,
    ) -> Result<Response<Body>, Error> {
        self.budget.deposit();
        // The servers as they are now, for every try of this request.
        let set = self.set.load_full();
        let mut tried = Tried::default();
        let now = self.now_ms();
        let Some(mut at) = self.pick(&set, key, &tried, now) else { return Err(self.unavailable(&set, now)) };
        if self.h2 {
            // Boxed: an HTTP/1.1 group's future does not carry an h2 stream's.
            return Box::pin(self.forward_h2(&set, req, strip, down, key, at, tried)).await;
        }
        let retry = &self.cfg.retry;
        // Each borrowed request lives in a block that ends before the first await: a borrowed
        // local stays in the future's state until its scope ends, even once moved.
        let (mut pending, replay) = {
            let req = set.members[at].fwd.prepare(req, strip, down)?;
            let replay = self.replay_head(&req);
            (Some(req), replay)
        };
        let started = Instant::now();
        let mut tries = 0;
        loop {
            tries += 1;
            let first = tries == 1;
            tried.add(at);
            down.served.record(at, tries);
            let member = &set.members[at];
            let req = {
                let Some(mut req) = pending.take().or_else(|| replay.as_ref().map(Head::request)) else {
                    return Err(Error::Internal("a retry without its request"));
                };
                if !self.preserve_host {
                    req.headers_mut().insert(header::HOST, member.fwd.authority_value.clone());
                }
                req
            };
            // The first try starts now: one clock read less.
            let left = if first { self.timeout } else { self.timeout.saturating_sub(started.elapsed()) };
            let wait = retry.per_try_timeout.map_or(left, |t| t.min(left));
            let sent = if first { started } else { Instant::now() };
            let waiting = self.enter(&set, at);
            // The coarse wheel for waits of a second or more: no tokio timer entry per try.
            let out = crate::timer::timeout(wait, attempt(&member.fwd, req)).await;
            drop(waiting);
            // Whether this failure may go to another server, and the request it goes with.
            let try_ = Try { at, tries, sent, started, replayable: replay.is_some() };
            let (error, unsent, answered) = match self.judge(&set, out, &try_) {
                Judged::Done(result) => return result,
                Judged::Again { error, unsent, answered } => (error, unsent, answered),
            };
            // Another server, never one already tried, and only within the budget.
            let next = self.pick(&set, key, &tried, self.now_ms());
            match next {
                Some(n) if self.budget.withdraw() => {
                    set.members[at].metrics.retried.inc();
                    at = n;
                    pending = unsent;
                }
                _ => {
                    return match answered {
                        Some((resp, conn)) => member.fwd.accept(resp, conn),
                        None => Err(error),
                    }
                }
            }
        }
    }

    /// What one try's outcome means: passed on as it is, or tried again elsewhere (with the
    /// error, the request given back, and an answer to pass on if no other server may take it).
    fn judge(&self, set: &Set, out: Attempted, t: &Try) -> Judged {
        let retry = &self.cfg.retry;
        let member = &set.members[t.at];
        match out {
            Ok(Ok((resp, conn))) => {
                let status = resp.status();
                self.observe(set, t.at, status.is_server_error(), Some(t.sent.elapsed()));
                // A 503 (or 429) with Retry-After is the upstream's word: passed on at once.
                let retryable = match status.as_u16() {
                    502 => retry.on.status_502,
                    503 => retry.on.status_503 && !resp.headers().contains_key(header::RETRY_AFTER),
                    504 => retry.on.status_504,
                    _ => false,
                };
                if !(retryable && t.replayable && t.tries < retry.attempts) {
                    return Judged::Done(member.fwd.accept(resp, conn));
                }
                Judged::Again {
                    error: Error::Upstream(UpstreamFailure::Broken(Cause::default())),
                    unsent: None,
                    answered: Some((resp, conn)),
                }
            }
            Ok(Err(Failed { error, unsent })) => {
                let upstream = matches!(error, Error::Upstream(_));
                // A pooled connection the server closed while idle is not its failure.
                let stale = unsent.is_some() && !matches!(error, Error::Upstream(UpstreamFailure::Connect(_)));
                if upstream && !stale {
                    self.observe(set, t.at, true, None);
                }
                let allowed = match (&unsent, &error) {
                    (Some(_), _) => retry.on.connect_failure,
                    (None, Error::Upstream(UpstreamFailure::Broken(_))) => {
                        retry.on.reset_before_response && t.replayable
                    }
                    _ => false,
                };
                if allowed && upstream && t.tries < retry.attempts {
                    Judged::Again { error, unsent, answered: None }
                } else {
                    Judged::Done(Err(error))
                }
            }
            Err(_) => {
                self.observe(set, t.at, true, None);
                let error = Error::Upstream(UpstreamFailure::Timeout);
                if retry.on.status_504 && t.replayable && t.tries < retry.attempts && t.started.elapsed() < self.timeout
                {
                    Judged::Again { error, unsent: None, answered: None }
                } else {
                    Judged::Done(Err(error))
                }
            }
        }
    }

    /// The head to send again after bytes went out: idempotent and without a body (which is
    /// not kept). Kept only where a retry after sending may happen (a connect failure gives
    /// the request back, so the default `on: [connect_failure]` copies nothing).
    fn replay_head(&self, req: &Request<RequestBody>) -> Option<Head> {
        let retry = &self.cfg.retry;
        let after_sent =
            retry.on.reset_before_response || retry.on.status_502 || retry.on.status_503 || retry.on.status_504;
        (after_sent && retry.attempts > 1 && idempotent(req.method()) && req.body().is_end_stream()).then(|| Head {
            method: req.method().clone(),
            uri: req.uri().clone(),
            version: req.version(),
            headers: req.headers().clone(),
        })
    }

    /// An `h2c` group: a request that never left (no connection) goes to another server;
    /// one that was sent is not tried again (its stream's request cannot be had back).
    #[allow(clippy::too_many_arguments)]
    async fn forward_h2(
        &self,
        set: &Set,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
        key: u64,
        mut at: usize,
        mut tried: Tried,
    ) -> Result<Response<Body>, Error> {
        let first = &set.members[at].fwd;
        let mut req = first.prepare(req, strip, down)?;
        first.h2_target(&mut req)?;
        let retry = &self.cfg.retry;
        let mut tries = 0;
        loop {
            tries += 1;
            tried.add(at);
            down.served.record(at, tries);
            let member = &set.members[at];
            if !self.preserve_host && tries > 1 {
                // The `:authority` is this server's own.
                member.fwd.h2_own_authority(&mut req)?;
            }
            let waiting = self.enter(set, at);
            let sent = Instant::now();
            // The head is kept to be sent again only while another try may follow.
            let keep = retry.on.connect_failure && tries < retry.attempts;
            let out = member.fwd.h2_exchange(req, keep).await;
            drop(waiting);
            match out {
                Ok(resp) => {
                    self.observe(set, at, resp.status().is_server_error(), Some(sent.elapsed()));
                    return Ok(resp);
                }
                Err(Failed { error, unsent }) => {
                    if matches!(error, Error::Upstream(_)) {
                        self.observe(set, at, true, None);
                    }
                    let (Some(unsent), true) = (unsent, retry.on.connect_failure && tries < retry.attempts) else {
                        return Err(error);
                    };
                    match self.pick(set, key, &tried, self.now_ms()) {
                        Some(next) if self.budget.withdraw() => {
                            member.metrics.retried.inc();
                            at = next;
                            req = unsent;
                        }
                        _ => return Err(error),
                    }
                }
            }
        }
    }

    /// An upgrade request to one server (no retry: the client's side is taken once).
    ///
    /// # Errors
    /// As [`HttpForwarder::upgrade`].
    pub async fn upgrade<H: Send + 'static>(
        &self,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
        allowed: &[HeaderValue],
        held: H,
        key: u64,
    ) -> Result<Response<Body>, Error> {
        let now = self.now_ms();
        let set = self.set.load_full();
        let Some(at) = self.pick(&set, key, &Tried::default(), now) else { return Err(self.unavailable(&set, now)) };
        let _waiting = self.enter(&set, at);
        let sent = Instant::now();
        let out = set.members[at].fwd.upgrade(req, strip, down, allowed, held).await;
        let failed = match &out {
            Ok(r) => r.status().is_server_error(),
            Err(e) => matches!(e, Error::Upstream(_)),
        };
        self.observe(&set, at, failed, out.as_ref().ok().map(|_| sent.elapsed()));
        out
    }
}

/// What a replayed request is made from.
struct Head {
    method: Method,
    uri: Uri,
    version: Version,
    headers: http::HeaderMap,
}

impl Head {
    fn request(&self) -> Request<RequestBody> {
        let mut req = Request::new(RequestBody::empty());
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers.clone();
        req
    }
}

/// One HTTP/1.1 try: a pooled or new connection, and the response head on it. The request
/// comes back when it never left (no connection; a pooled one closed before it was written).
async fn attempt(fwd: &HttpForwarder, req: Request<RequestBody>) -> Result<(Response<Incoming>, UpstreamConn), Failed> {
    let conn = match fwd.pool.take_ready() {
        Some(conn) => Ok(conn),
        None => Box::pin(fwd.pool.checkout()).await,
    };
    let mut conn = match conn {
        Ok(conn) => conn,
        Err(e) => {
            tracing::debug!(upstream = %fwd.name, server = %fwd.authority, error = %e, "upstream connect failed");
            return Err(Failed { error: Error::Upstream(UpstreamFailure::Connect(Cause::of(&e))), unsent: Some(req) });
        }
    };
    match conn.send.try_send_request(req).await {
        Ok(resp) => Ok((resp, conn)),
        Err(mut e) => {
            let unsent = e.take_message();
            Err(Failed { error: fwd.failed(e.error()), unsent })
        }
    }
}

/// Safe to send twice (RFC 9110 §9.2.2).
fn idempotent(m: &Method) -> bool {
    matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tried_servers_are_remembered_up_to_256() {
        let mut t = Tried::default();
        for i in [0, 63, 64, 200, 255] {
            assert!(!t.has(i));
            t.add(i);
            assert!(t.has(i));
        }
        assert!(!t.has(1));
    }
}
