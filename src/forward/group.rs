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

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, Uri, Version};
use hyper::body::{Body as _, Incoming};
use tower::retry::budget::{Budget as _, TpsBudget};

use super::{Downstream, HttpForwarder};
use crate::answer::{Error, UpstreamFailure};
use crate::body::{Body, RequestBody, UpstreamConn};
use crate::config::group::{Balance, GroupConfig, Health};
use crate::config::HttpUpstream;
use crate::limit::KeySpec;
use crate::metrics::{Metrics, ServerMetrics};

/// Peak-EWMA latency decays over this (as tower's and Finagle's default).
const DECAY_MS: f64 = 10_000.0;

/// One server of a group.
pub struct Member {
    pub fwd: HttpForwarder,
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

/// A server as `/config`, `explain` and `/readyz` show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServerView {
    pub url: String,
    pub weight: u32,
    /// `healthy`, `ejected` (passive, for `ejected_for_s` more) or `unhealthy` (active checks).
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ejected_for_s: Option<u64>,
    pub in_flight: i64,
}

pub struct Group {
    name: String,
    members: Vec<Member>,
    cfg: Arc<GroupConfig>,
    /// Weighted round robin: server indices, each as often as its weight, interleaved.
    schedule: Vec<u16>,
    next: AtomicUsize,
    budget: TpsBudget,
    /// Held while an ejection is decided, so concurrent failures cannot together eject
    /// more than `max_ejected_percent` (taken only once a server's failures reach the bound).
    ejecting: std::sync::Mutex<()>,
    preserve_host: bool,
    timeout: Duration,
    h2: bool,
    scheme: &'static str,
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
    /// A group for upstream `name`; `cfg.group` must be set.
    pub fn new(name: &str, cfg: &HttpUpstream, body_read_timeout: Duration, metrics: &Metrics) -> Option<Arc<Group>> {
        let gcfg = cfg.group.clone()?;
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let members: Vec<Member> = gcfg
            .servers
            .iter()
            .map(|s| {
                let mut one = cfg.clone();
                one.authority = s.authority.clone();
                one.group = None;
                let url = format!("{scheme}://{}", s.authority);
                Member {
                    fwd: HttpForwarder::new(name, &one, body_read_timeout, metrics),
                    weight: s.weight,
                    seed: xxhash_rust::xxh3::xxh3_64(s.authority.as_str().as_bytes()),
                    metrics: metrics.server(name, &url),
                    consecutive_failures: AtomicU32::new(0),
                    ejected_until: AtomicU64::new(0),
                    ejections: AtomicU32::new(0),
                    up: AtomicBool::new(true),
                    ewma_us: AtomicU64::new(0f64.to_bits()),
                    ewma_at: AtomicU64::new(0),
                }
            })
            .collect();
        let weights: Vec<u32> = members.iter().map(|m| m.weight).collect();
        let retry = &gcfg.retry;
        let group = Arc::new(Group {
            name: name.to_owned(),
            schedule: smooth_round_robin(&weights),
            members,
            budget: TpsBudget::new(Duration::from_secs(10), retry.min_per_s, retry.ratio),
            cfg: gcfg.clone(),
            next: AtomicUsize::new(0),
            ejecting: std::sync::Mutex::new(()),
            preserve_host: cfg.preserve_host,
            timeout: cfg.timeout,
            h2: cfg.protocol == crate::config::UpstreamProtocol::H2c,
            scheme,
        });
        if let Some(h) = &gcfg.health {
            group.start_checks(h);
        }
        Some(group)
    }

    pub fn name(&self) -> &str {
        &self.name
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

    fn eligible(&self, i: usize, tried: &Tried, now: u64) -> bool {
        let m = &self.members[i];
        !tried.has(i) && m.up.load(Ordering::Relaxed) && m.ejected_until.load(Ordering::Relaxed) <= now
    }

    /// The server for the next try, `None` when no untried server may take one.
    fn pick(&self, key: u64, tried: &Tried, now: u64) -> Option<usize> {
        let n = self.members.len();
        let ok = |i: usize| self.eligible(i, tried, now);
        match &self.cfg.balance {
            Balance::LeastRequest => {
                if n == 1 {
                    return ok(0).then_some(0);
                }
                let a = fastrand::usize(..n);
                let mut b = fastrand::usize(..n - 1);
                if b >= a {
                    b += 1;
                }
                match (ok(a), ok(b)) {
                    (true, true) => Some(if self.cost(a, now) <= self.cost(b, now) { a } else { b }),
                    (true, false) => Some(a),
                    (false, true) => Some(b),
                    (false, false) => {
                        (0..n).filter(|&i| ok(i)).min_by(|&x, &y| self.cost(x, now).total_cmp(&self.cost(y, now)))
                    }
                }
            }
            Balance::RoundRobin => {
                let len = self.schedule.len();
                let start = self.next.fetch_add(1, Ordering::Relaxed);
                (0..len).map(|k| usize::from(self.schedule[(start + k) % len])).find(|&i| ok(i))
            }
            Balance::Hash(_) => (0..n).filter(|&i| ok(i)).max_by(|&x, &y| {
                let score = |i: usize| {
                    let m = &self.members[i];
                    // Weighted rendezvous: -w / ln(u), u uniform in (0, 1) from the key and server.
                    let u = ((mix(key ^ m.seed) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                    -f64::from(m.weight) / u.ln()
                };
                score(x).total_cmp(&score(y))
            }),
        }
    }

    /// Least-request load: requests waiting × decayed peak latency, per unit of weight.
    fn cost(&self, i: usize, now: u64) -> f64 {
        let m = &self.members[i];
        let waiting = m.metrics.in_flight.get().max(0) as f64;
        (waiting + 1.0) * (decayed(m, now, 0.0) + 1.0) / f64::from(m.weight)
    }

    /// A try on server `i` ended: `failed` for a connect failure, a broken exchange, a
    /// timeout or a 5xx; `took` the time to its head, when one came.
    fn observe(&self, i: usize, failed: bool, took: Option<Duration>) {
        let m = &self.members[i];
        let now = self.now_ms();
        if let Some(t) = took {
            m.metrics.latency.observe(t);
            let us = t.as_secs_f64() * 1e6;
            m.ewma_us.store(decayed(m, now, us).to_bits(), Ordering::Relaxed);
            m.ewma_at.store(now, Ordering::Relaxed);
        }
        if !failed {
            m.consecutive_failures.store(0, Ordering::Relaxed);
            return;
        }
        m.metrics.failures.inc();
        let outlier = &self.cfg.outlier;
        let run = m.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if outlier.consecutive_failures == 0 || run < outlier.consecutive_failures {
            return;
        }
        let _deciding = self.ejecting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Passive ejection takes out at most `max_ejected_percent` of the group.
        let ejected = self.members.iter().filter(|o| o.ejected_until.load(Ordering::Relaxed) > now).count();
        let allowed = self.members.len() * outlier.max_ejected_percent as usize / 100;
        if ejected >= allowed || m.ejected_until.load(Ordering::Relaxed) > now {
            return;
        }
        // Repeat ejections grow; one that stayed in for `max_ejection_time` starts over.
        let last_end = m.ejected_until.load(Ordering::Relaxed);
        let max_ms = millis(outlier.max_ejection_time);
        let n = if last_end != 0 && now.saturating_sub(last_end) > max_ms {
            m.ejections.store(1, Ordering::Relaxed);
            1
        } else {
            m.ejections.fetch_add(1, Ordering::Relaxed) + 1
        };
        let length = millis(outlier.base_ejection_time).saturating_mul(u64::from(n)).min(max_ms);
        m.ejected_until.store(now.saturating_add(length), Ordering::Relaxed);
        m.consecutive_failures.store(0, Ordering::Relaxed);
        m.metrics.ejections.inc();
        tracing::warn!(
            upstream = %self.name,
            server = %m.fwd.authority,
            failures = run,
            ejected_ms = length,
            "upstream server ejected after consecutive failures"
        );
    }

    /// The answer when no server may take a request: 503 with a Retry-After no shorter
    /// than the earliest re-admission (passive) or the checks that could restore one.
    fn unavailable(&self, now: u64) -> Error {
        let health =
            self.cfg.health.as_ref().map_or(u64::MAX, |h| millis(h.interval).saturating_mul(u64::from(h.healthy)));
        let wait_ms = self
            .members
            .iter()
            .map(|m| {
                let until = m.ejected_until.load(Ordering::Relaxed);
                let passive = until.saturating_sub(now);
                if m.up.load(Ordering::Relaxed) {
                    passive
                } else {
                    passive.max(health)
                }
            })
            .min()
            .unwrap_or(1000);
        let secs = wait_ms.div_ceil(1000).clamp(1, 86_400);
        Error::Upstream(UpstreamFailure::Unavailable { retry_after_secs: secs as u32 })
    }

    /// Whether some server may take requests now (`/readyz`).
    pub fn available(&self) -> bool {
        let now = self.now_ms();
        (0..self.members.len()).any(|i| self.eligible(i, &Tried::default(), now))
    }

    /// Each server with its state now.
    pub fn servers(&self) -> Vec<ServerView> {
        let now = self.now_ms();
        self.members
            .iter()
            .map(|m| {
                let until = m.ejected_until.load(Ordering::Relaxed);
                let (state, ejected_for_s) = if !m.up.load(Ordering::Relaxed) {
                    ("unhealthy", None)
                } else if until > now {
                    ("ejected", Some((until - now).div_ceil(1000)))
                } else {
                    ("healthy", None)
                };
                ServerView {
                    url: format!("{}://{}", self.scheme, m.fwd.authority),
                    weight: m.weight,
                    state,
                    ejected_for_s,
                    in_flight: m.metrics.in_flight.get(),
                }
            })
            .collect()
    }

    /// Health and ejection gauges (at scrape).
    pub fn refresh_gauges(&self) {
        let now = self.now_ms();
        for m in &self.members {
            m.metrics.healthy.set(i64::from(m.up.load(Ordering::Relaxed)));
            m.metrics.ejected.set(i64::from(m.ejected_until.load(Ordering::Relaxed) > now));
        }
    }

    fn enter(&self, i: usize) -> InFlight<'_> {
        let m = &self.members[i].metrics;
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
        req: Request<Incoming>,
        strip: usize,
        down: &Downstream<'_>,
        key: u64,
    ) -> Result<Response<Body>, Error> {
        self.budget.deposit();
        let mut tried = Tried::default();
        let now = self.now_ms();
        let Some(mut at) = self.pick(key, &tried, now) else { return Err(self.unavailable(now)) };
        if self.h2 {
            // Boxed: an HTTP/1.1 group's future does not carry an h2 stream's.
            return Box::pin(self.forward_h2(req, strip, down, key, at, tried)).await;
        }
        let retry = &self.cfg.retry;
        // Each borrowed request lives in a block that ends before the first await: a borrowed
        // local stays in the future's state until its scope ends, even once moved.
        let (mut pending, replay) = {
            let req = self.members[at].fwd.prepare(req, strip, down)?;
            // Replayable after bytes were sent: idempotent and without a body (which is not
            // kept). Kept only where a retry after sending may happen (a connect failure gives
            // the request back, so the default `on: [connect_failure]` copies nothing).
            let after_sent =
                retry.on.reset_before_response || retry.on.status_502 || retry.on.status_503 || retry.on.status_504;
            let replay = (after_sent && retry.attempts > 1 && idempotent(req.method()) && req.body().is_end_stream())
                .then(|| Head {
                    method: req.method().clone(),
                    uri: req.uri().clone(),
                    version: req.version(),
                    headers: req.headers().clone(),
                });
            (Some(req), replay)
        };
        let started = Instant::now();
        let mut tries = 0;
        loop {
            tries += 1;
            let first = tries == 1;
            tried.add(at);
            let member = &self.members[at];
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
            let waiting = self.enter(at);
            // The coarse wheel for waits of a second or more: no tokio timer entry per try.
            let out = crate::timer::timeout(wait, attempt(&member.fwd, req)).await;
            drop(waiting);
            // Whether this failure may go to another server, and the request it goes with.
            let (error, unsent, answered) = match out {
                Ok(Ok((resp, conn))) => {
                    let status = resp.status();
                    self.observe(at, status.is_server_error(), Some(sent.elapsed()));
                    // A 503 (or 429) with Retry-After is the upstream's word: passed on at once.
                    let retryable = match status.as_u16() {
                        502 => retry.on.status_502,
                        503 => retry.on.status_503 && !resp.headers().contains_key(header::RETRY_AFTER),
                        504 => retry.on.status_504,
                        _ => false,
                    };
                    if !(retryable && replay.is_some() && tries < retry.attempts) {
                        return member.fwd.accept(resp, conn);
                    }
                    (Error::Upstream(UpstreamFailure::Broken), None, Some((resp, conn)))
                }
                Ok(Err(Failed { error, unsent })) => {
                    let upstream = matches!(error, Error::Upstream(_));
                    // A pooled connection the server closed while idle is not its failure.
                    let stale = unsent.is_some() && error != Error::Upstream(UpstreamFailure::Connect);
                    if upstream && !stale {
                        self.observe(at, true, None);
                    }
                    let allowed = match (&unsent, &error) {
                        (Some(_), _) => retry.on.connect_failure,
                        (None, Error::Upstream(UpstreamFailure::Broken)) => {
                            retry.on.reset_before_response && replay.is_some()
                        }
                        _ => false,
                    };
                    if allowed && upstream && tries < retry.attempts {
                        (error, unsent, None)
                    } else {
                        return Err(error);
                    }
                }
                Err(_) => {
                    self.observe(at, true, None);
                    let error = Error::Upstream(UpstreamFailure::Timeout);
                    if retry.on.status_504
                        && replay.is_some()
                        && tries < retry.attempts
                        && started.elapsed() < self.timeout
                    {
                        (error, None, None)
                    } else {
                        return Err(error);
                    }
                }
            };
            // Another server, never one already tried, and only within the budget.
            let next = self.pick(key, &tried, self.now_ms());
            match next {
                Some(n) if self.budget.withdraw() => {
                    self.members[at].metrics.retried.inc();
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

    /// An `h2c` group: a request that never left (no connection) goes to another server;
    /// one that was sent is not tried again (its stream's request cannot be had back).
    async fn forward_h2(
        &self,
        req: Request<Incoming>,
        strip: usize,
        down: &Downstream<'_>,
        key: u64,
        mut at: usize,
        mut tried: Tried,
    ) -> Result<Response<Body>, Error> {
        let first = &self.members[at].fwd;
        let mut req = first.prepare(req, strip, down)?;
        first.h2_target(&mut req)?;
        let retry = &self.cfg.retry;
        let mut tries = 0;
        loop {
            tries += 1;
            tried.add(at);
            let member = &self.members[at];
            if !self.preserve_host {
                // The `:authority` is this server's own.
                if let Ok(uri) = member.fwd.h2_uri(member.fwd.authority.clone(), req.uri()) {
                    *req.uri_mut() = uri;
                }
            }
            let waiting = self.enter(at);
            let sent = Instant::now();
            let out = member.fwd.h2_exchange(req).await;
            drop(waiting);
            match out {
                Ok(resp) => {
                    self.observe(at, resp.status().is_server_error(), Some(sent.elapsed()));
                    return Ok(resp);
                }
                Err(Failed { error, unsent }) => {
                    if matches!(error, Error::Upstream(_)) {
                        self.observe(at, true, None);
                    }
                    let (Some(unsent), true) = (unsent, retry.on.connect_failure && tries < retry.attempts) else {
                        return Err(error);
                    };
                    match self.pick(key, &tried, self.now_ms()) {
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
        req: Request<Incoming>,
        strip: usize,
        down: &Downstream<'_>,
        allowed: &[HeaderValue],
        held: H,
        key: u64,
    ) -> Result<Response<Body>, Error> {
        let now = self.now_ms();
        let Some(at) = self.pick(key, &Tried::default(), now) else { return Err(self.unavailable(now)) };
        let _waiting = self.enter(at);
        let sent = Instant::now();
        let out = self.members[at].fwd.upgrade(req, strip, down, allowed, held).await;
        let failed = match &out {
            Ok(r) => r.status().is_server_error(),
            Err(e) => matches!(e, Error::Upstream(_)),
        };
        self.observe(at, failed, out.as_ref().ok().map(|_| sent.elapsed()));
        out
    }

    /// One checker task per server; each ends once the group is gone (a reload replaced it).
    fn start_checks(self: &Arc<Self>, h: &Health) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        for i in 0..self.members.len() {
            let group: Weak<Group> = Arc::downgrade(self);
            let h = h.clone();
            rt.spawn(async move {
                let mut tick = tokio::time::interval(h.interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let (mut passes, mut fails) = (0u32, 0u32);
                loop {
                    tick.tick().await;
                    let Some(group) = group.upgrade() else { return };
                    let passed = group.check(i, &h).await;
                    let m = &group.members[i];
                    if passed {
                        passes = passes.saturating_add(1);
                        fails = 0;
                        if passes >= h.healthy {
                            if !m.up.swap(true, Ordering::Relaxed) {
                                tracing::info!(upstream = %group.name, server = %m.fwd.authority, "upstream server passes its health checks again");
                            }
                            // Passing checks end a passive ejection early.
                            if m.ejected_until.load(Ordering::Relaxed) > group.now_ms() {
                                m.ejected_until.store(group.now_ms(), Ordering::Relaxed);
                                m.consecutive_failures.store(0, Ordering::Relaxed);
                            }
                        }
                    } else {
                        fails = fails.saturating_add(1);
                        passes = 0;
                        if fails >= h.unhealthy && m.up.swap(false, Ordering::Relaxed) {
                            tracing::warn!(upstream = %group.name, server = %m.fwd.authority, "upstream server fails its health checks");
                        }
                    }
                }
            });
        }
    }

    /// One health check of server `i`: `GET path` on a connection of its own (a stream for
    /// h2c), passing when the status is in `expect` within `timeout`.
    async fn check(&self, i: usize, h: &Health) -> bool {
        let fwd = &self.members[i].fwd;
        let run = async {
            let mut req = Request::new(RequestBody::empty());
            req.headers_mut().insert(header::HOST, fwd.authority_value.clone());
            req.headers_mut().insert(header::USER_AGENT, HeaderValue::from_static("tollgate-health-check"));
            if let Some(h2) = &fwd.h2 {
                *req.uri_mut() = Uri::builder()
                    .scheme("http")
                    .authority(fwd.authority.clone())
                    .path_and_query(h.path.as_str())
                    .build()
                    .ok()?;
                *req.version_mut() = Version::HTTP_2;
                req.headers_mut().remove(header::HOST);
                let (mut send, _stream) = h2.checkout().await.ok()?;
                send.send_request(req).await.ok().map(|r| r.status().as_u16())
            } else {
                *req.uri_mut() = h.path.parse().ok()?;
                let mut send = fwd.pool.connector().http1().await.ok()?;
                send.send_request(req).await.ok().map(|r| r.status().as_u16())
            }
        };
        match tokio::time::timeout(h.timeout, run).await {
            Ok(Some(status)) => (h.expect.0..=h.expect.1).contains(&status),
            _ => false,
        }
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
            return Err(Failed { error: Error::Upstream(UpstreamFailure::Connect), unsent: Some(req) });
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

/// The peak-EWMA latency of `m` at `now`, after a sample of `sample_us` (0: none, decay only).
fn decayed(m: &Member, now: u64, sample_us: f64) -> f64 {
    let est = f64::from_bits(m.ewma_us.load(Ordering::Relaxed));
    if sample_us > est {
        return sample_us;
    }
    let elapsed = now.saturating_sub(m.ewma_at.load(Ordering::Relaxed)) as f64;
    let decay = (-elapsed / DECAY_MS).exp();
    est * decay + sample_us * (1.0 - decay)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A 64-bit finaliser (splitmix64): spreads nearby keys over the whole range.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Smooth weighted round robin (as nginx): each server as often as its weight, spread out.
fn smooth_round_robin(weights: &[u32]) -> Vec<u16> {
    let total: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut current = vec![0i64; weights.len()];
    let mut out = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
    for _ in 0..total {
        for (c, &w) in current.iter_mut().zip(weights) {
            *c += i64::from(w);
        }
        let Some((best, _)) = current.iter().enumerate().max_by_key(|&(i, &c)| (c, std::cmp::Reverse(i))) else {
            break;
        };
        current[best] -= total;
        out.push(u16::try_from(best).unwrap_or(0));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_serves_each_server_by_its_weight_spread_out() {
        let s = smooth_round_robin(&[5, 1, 1]);
        assert_eq!(s.len(), 7);
        assert_eq!(s.iter().filter(|&&i| i == 0).count(), 5);
        // nginx's smooth order: the heavy server never takes all its turns in a row.
        assert_eq!(s, vec![0, 0, 1, 0, 2, 0, 0]);
    }

    /// Rendezvous scores as `pick` computes them, over a plain list of seeds.
    fn owner(key: u64, seeds: &[(u64, u32)]) -> usize {
        let score = |&(seed, w): &(u64, u32)| {
            let u = ((mix(key ^ seed) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            -f64::from(w) / u.ln()
        };
        (0..seeds.len()).max_by(|&x, &y| score(&seeds[x]).total_cmp(&score(&seeds[y]))).unwrap()
    }

    #[test]
    fn removing_one_server_moves_only_its_keys() {
        let seeds: Vec<(u64, u32)> =
            (0..5).map(|i| (xxhash_rust::xxh3::xxh3_64(format!("10.0.0.{i}:80").as_bytes()), 1)).collect();
        let keys = 20_000u64;
        let before: Vec<usize> = (0..keys).map(|k| owner(mix(k), &seeds)).collect();
        // Server 2 leaves.
        let rest: Vec<(u64, u32)> = seeds.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, s)| *s).collect();
        let index_of = |j: usize| if j >= 2 { j + 1 } else { j };
        let mut moved = 0;
        for k in 0..keys {
            let after = index_of(owner(mix(k), &rest));
            if before[k as usize] != 2 {
                assert_eq!(after, before[k as usize], "key {k} moved though its server stayed");
            } else {
                moved += 1;
            }
        }
        // Its own share, about 1/5 of the keys, and nothing else.
        assert!((3_000..5_000).contains(&moved), "{moved} keys moved");
        // Each server holds about a fifth.
        for s in 0..5 {
            let held = before.iter().filter(|&&o| o == s).count();
            assert!((3_200..4_800).contains(&held), "server {s} holds {held}");
        }
    }

    #[test]
    fn weights_share_hash_keys_in_proportion() {
        let seeds = [(1u64, 3u32), (2, 1)];
        let heavy = (0..20_000u64).filter(|&k| owner(mix(k), &seeds) == 0).count();
        assert!((14_000..16_000).contains(&heavy), "{heavy}");
    }

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
