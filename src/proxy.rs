//! The compiled configuration that serves requests: routes in order, their gates and
//! targets, the stale-copy cache and the metric handles. A [`Proxy`] is immutable; a reload
//! builds a new one (keeping the state of unchanged limits) and swaps it in whole.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::request::Parts;
use http::{Method, Request, Response};
use hyper::body::Incoming;

use crate::body::Body;
use crate::cache::{Cache, StaleReason};
use crate::config::{Config, LimitConfig, Route, StoreKind, UpstreamKind};
use crate::forward::{self, Downstream, Failure, HttpForwarder};
use crate::gate::{Gate, Limit, Note, Verdict};
use crate::limit::store::redis::fallback_algorithm;
use crate::limit::{Clock, KeyCtx, KeyPart, LocalStore, RedisClient, RedisStore, Store, SystemClock, TrustedProxies};
use crate::metrics::{Metrics, RouteMetrics};
use crate::{problem, route};

/// A Redis-backed store for limit `l` of route `route`; its local fallback has the same
/// parameters divided by `instances`.
fn redis_store(client: &Arc<RedisClient>, route: &str, l: &LimitConfig) -> Arc<Store> {
    let fallback = LocalStore::new(fallback_algorithm(&l.algorithm, client.config().instances), l.max_keys);
    // Route and limit names are `[A-Za-z0-9._-]`: `route/limit` is unique per config.
    let name = format!("{route}/{}", l.name);
    Arc::new(Store::Redis(Box::new(RedisStore::new(client.clone(), &name, l.algorithm.clone(), l.lease, fallback))))
}

/// Where a route sends admitted requests.
pub enum Target {
    Http(Box<HttpForwarder>),
    Respond(crate::config::Responder),
}

/// Per-route runtime: gate, metric handles, cache policy.
struct Lane {
    gate: Gate,
    metrics: RouteMetrics,
    /// The route keys on `Authorization` / `Cookie`, so copies may be kept per credential.
    keyed_on_credentials: bool,
}

pub struct Proxy {
    pub config: Arc<Config>,
    targets: Vec<Arc<Target>>,
    lanes: Vec<Lane>,
    trusted: TrustedProxies,
    clock: Arc<dyn Clock>,
    cache: Cache,
    metrics: Arc<Metrics>,
    /// The one connection of every `store: redis` limit; kept across reloads while `redis:` is unchanged.
    redis: Option<Arc<RedisClient>>,
}

/// Counts a request in `requests_in_flight` until dropped: when it is answered, or when the
/// client goes away first and hyper drops the request's future.
struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl InFlight<'_> {
    fn enter(metrics: &Metrics) -> InFlight<'_> {
        metrics.in_flight().inc();
        InFlight(metrics.in_flight())
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Which stale copy, if any, answered a request (for the access log).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stale {
    No,
    Throttled,
    UpstreamError,
}

impl Proxy {
    /// Compiles `config` with the system clock, fresh state and its own metrics.
    pub fn new(config: Config) -> Proxy {
        Proxy::build(config, Arc::new(SystemClock), Arc::new(Metrics::new()), None)
    }

    /// Compiles `config`; limits read time from `clock` (tests pass a manual clock).
    pub fn with_clock(config: Config, clock: Arc<dyn Clock>) -> Proxy {
        Proxy::build(config, clock, Arc::new(Metrics::new()), None)
    }

    /// Compiles `config`. With `previous`, every limit whose route name and definition are
    /// unchanged keeps its state (a reload must not hand every client a fresh bucket), and
    /// the cache survives when its size settings are unchanged.
    pub fn build(config: Config, clock: Arc<dyn Clock>, metrics: Arc<Metrics>, previous: Option<&Proxy>) -> Proxy {
        let targets = config
            .upstreams
            .iter()
            .map(|u| {
                Arc::new(match &u.kind {
                    UpstreamKind::Http(h) => Target::Http(Box::new(HttpForwarder::new(&u.name, h))),
                    UpstreamKind::Respond(r) => Target::Respond(r.clone()),
                })
            })
            .collect();
        let redis = config.redis.as_ref().and_then(|rc| {
            let kept = previous.and_then(|p| p.redis.clone()).filter(|c| c.config() == rc);
            kept.or_else(|| match RedisClient::new(rc.clone()) {
                Ok(c) => Some(c),
                Err(e) => {
                    // Validation checked the URLs; if one still fails, limits decide locally.
                    tracing::error!("redis: {e}; `store: redis` limits use in-process state");
                    None
                }
            })
        });
        let lanes = config
            .routes
            .iter()
            .map(|r| {
                let mut store_for = |l: &LimitConfig| {
                    let kept = previous.and_then(|p| p.store_of(&r.name, l)).filter(|s| match &**s {
                        // A Redis store holds its connection: keep it only on the same one.
                        Store::Redis(s) => redis.as_ref().is_some_and(|c| Arc::ptr_eq(c, s.client())),
                        Store::Local(_) => l.store == StoreKind::Local || redis.is_none(),
                    });
                    kept.unwrap_or_else(|| match (&redis, l.store) {
                        (Some(client), StoreKind::Redis) => redis_store(client, &r.name, l),
                        _ => Limit::local_store(l),
                    })
                };
                Lane {
                    gate: Gate::new(r, &metrics, &mut store_for),
                    metrics: metrics.route(&r.name),
                    keyed_on_credentials: keys_on_credentials(r),
                }
            })
            .collect();
        let cache = match previous {
            Some(p) if p.config.cache == config.cache => p.cache.clone(),
            _ => Cache::new(config.cache.max_bytes, config.cache.max_entry_bytes),
        };
        let trusted = TrustedProxies::new(config.trusted_proxies.clone());
        Proxy { config: Arc::new(config), targets, lanes, trusted, clock, cache, metrics, redis }
    }

    /// The shared Redis connection, if the config has a `redis:` section (readiness, metrics).
    pub fn redis(&self) -> Option<&Arc<RedisClient>> {
        self.redis.as_ref()
    }

    /// The store of limit `limit` on route `route`, if it exists with the same definition.
    fn store_of(&self, route: &str, limit: &LimitConfig) -> Option<Arc<Store>> {
        let idx = self.config.routes.iter().position(|r| r.name == route)?;
        self.lanes[idx].gate.limits().iter().find(|l| l.config == *limit).map(|l| l.store.clone())
    }

    pub fn gates(&self) -> impl Iterator<Item = (&Route, &Gate)> {
        self.config.routes.iter().zip(self.lanes.iter().map(|l| &l.gate))
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    fn wall_now(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_micros(self.clock.now())
    }

    /// Serves one request. Never fails: every problem is an HTTP answer.
    ///
    /// The route is found and the head taken apart before the returned future exists, and
    /// the future holds the request in one place only: hyper moves it by value per request,
    /// so its size is copying work (it was 3.7 kB before this shape, about half now).
    pub fn handle(self: Arc<Proxy>, req: Request<Incoming>, peer: SocketAddr) -> impl Future<Output = Response<Body>> {
        let started = self.config.log.access.then(Instant::now);
        let found = route::find(&self.config.routes, req.method(), req.uri(), req.headers());
        let (mut parts, body) = req.into_parts();
        async move {
            // Framing hook (src/framing.rs): an ambiguous head is answered 400 before anything
            // else. Here, not before the future exists: the head is checked where it lies.
            if let Err(bad) = crate::framing::check(&mut parts) {
                return bad.response(parts.version);
            }
            let this = &*self;
            let in_flight = InFlight::enter(&this.metrics);
            let (resp, log) = 'served: {
                let Some(idx) = found else {
                    break 'served (problem::no_route(&parts.method, parts.uri.path()), None);
                };
                let (route, lane) = (&this.config.routes[idx], &this.lanes[idx]);
                let mut log = Access::new(lane, route, &parts, this.config.log.access);
                let mut admission = None;
                if !lane.gate.is_open() {
                    let client_ip = this.trusted.client_ip(peer.ip(), &parts.headers);
                    let ctx = KeyCtx { route: &route.name, client_ip, parts: &parts };
                    match lane.gate.check(&ctx, this.clock.now()).await {
                        Verdict::Reject(resp, note) => {
                            log.note = note;
                            break 'served (this.throttled(route, lane, &parts, resp, &mut log), Some(log));
                        }
                        Verdict::Admit(a) => {
                            if !a.wait.is_zero() {
                                Box::pin(tokio::time::sleep(a.wait)).await;
                            }
                            log.note = a.note;
                            admission = Some(a);
                        }
                    }
                }
                // A copy of the head, only when a stale copy could be stored or served for it.
                let head = this.wants_copy(route, lane, &parts).then(|| Box::new(parts.clone()));
                let (mut resp, failure) = match &*this.targets[route.upstream] {
                    Target::Respond(r) => (forward::respond(r).await, None),
                    Target::Http(fwd) => {
                        let down = Downstream { peer: peer.ip(), peer_trusted: this.trusted.is_trusted(peer.ip()) };
                        let path = parts.uri.path();
                        let strip = path.len() - route::upstream_path(route, path).len();
                        let sent = Instant::now();
                        let out = fwd.forward(Request::from_parts(parts, body), strip, &down).await;
                        let took = sent.elapsed();
                        lane.metrics.upstream_seconds.observe(took);
                        log.upstream = Some((out.1.map_or(out.0.status().as_u16(), |_| 0), took));
                        out
                    }
                };
                if let Some(head) = &head {
                    resp = this.after_upstream(route, lane, head, resp, failure, &mut log);
                }
                if let Some(mut a) = admission {
                    lane.gate.decorate(&mut a, &mut resp);
                    if let Some(permit) = a.permit {
                        resp.body_mut().hold(permit);
                    }
                }
                (resp, Some(log))
            };
            drop(in_flight);
            if let Some(log) = log {
                log.lane.metrics.response(resp.status().as_u16());
                if let Some(started) = started {
                    log.emit(resp.status().as_u16(), started.elapsed());
                }
            }
            resp
        }
    }

    fn wants_copy(&self, route: &Route, lane: &Lane, parts: &Parts) -> bool {
        if route.stale_on_limit.is_none() && route.stale_on_upstream_error.is_none() {
            return false;
        }
        match parts.method {
            Method::GET => self.cache.may_store(parts, lane.keyed_on_credentials),
            Method::HEAD => route.stale_on_upstream_error.is_some(),
            _ => false,
        }
    }

    /// The gate said no: a stale copy when the route allows one, else the gate's answer.
    fn throttled(
        &self,
        route: &Route,
        lane: &Lane,
        parts: &Parts,
        resp: Response<Body>,
        log: &mut Access,
    ) -> Response<Body> {
        if let Some(max_age) = route.stale_on_limit {
            if matches!(parts.method, Method::GET | Method::HEAD) {
                if let Some(stale) = self.cache.stale(parts, StaleReason::Throttled, max_age, self.wall_now()) {
                    lane.metrics.stale_throttled.inc();
                    log.stale = Stale::Throttled;
                    return stale;
                }
            }
        }
        resp
    }

    /// stale-if-error on a failed answer; otherwise keep a copy of a good GET answer.
    fn after_upstream(
        &self,
        route: &Route,
        lane: &Lane,
        head: &Parts,
        resp: Response<Body>,
        failure: Option<Failure>,
        log: &mut Access,
    ) -> Response<Body> {
        let status = resp.status().as_u16();
        if failure.is_some() || matches!(status, 500 | 502 | 503 | 504) {
            if let Some(max_age) = route.stale_on_upstream_error {
                let reason = StaleReason::UpstreamError { status };
                if let Some(stale) = self.cache.stale(head, reason, max_age, self.wall_now()) {
                    lane.metrics.stale_upstream_error.inc();
                    log.stale = Stale::UpstreamError;
                    return stale;
                }
            }
            return resp;
        }
        if head.method == Method::GET {
            return self.cache.capture(head, lane.keyed_on_credentials, resp, self.wall_now());
        }
        resp
    }

    /// Ready unless a limit depends on a store that cannot answer (see `/readyz`).
    pub async fn readiness(&self) -> Result<(), String> {
        let Some(redis) = &self.redis else { return Ok(()) };
        // With `on_error: allow` every limit admits while Redis is down: still ready.
        if redis.config().on_error == crate::limit::store::redis::OnError::Allow {
            return Ok(());
        }
        redis.ping().await.map_err(|e| format!("Redis does not answer: {e}"))
    }

    /// Live keys per limit into the gauges (called when metrics are scraped).
    pub fn refresh_gauges(&self) {
        for lane in &self.lanes {
            for l in lane.gate.limits() {
                l.metrics.keys.set(i64::try_from(l.live_keys()).unwrap_or(i64::MAX));
            }
        }
    }
}

fn keys_on_credentials(route: &Route) -> bool {
    route.limits.iter().any(|l| {
        l.key
            .parts()
            .iter()
            .any(|p| matches!(p, KeyPart::Header(h) if *h == http::header::AUTHORIZATION || *h == http::header::COOKIE))
    })
}

/// The facts of one request for the access log.
struct Access<'a> {
    lane: &'a Lane,
    route: &'a str,
    method: Method,
    path: String,
    note: Note,
    upstream: Option<(u16, Duration)>,
    stale: Stale,
}

impl<'a> Access<'a> {
    /// `logging`: the access log is on, so the path is worth copying.
    fn new(lane: &'a Lane, route: &'a Route, parts: &Parts, logging: bool) -> Access<'a> {
        Access {
            lane,
            route: &route.name,
            method: parts.method.clone(),
            path: if logging { parts.uri.path().to_owned() } else { String::new() },
            note: Note::default(),
            upstream: None,
            stale: Stale::No,
        }
    }

    fn emit(&self, status: u16, took: Duration) {
        let limit = self.note.limit.and_then(|i| self.lane.gate.limits().get(i)).map(|l| l.config.name.as_str());
        tracing::info!(
            target: "tollgate::access",
            route = self.route,
            method = %self.method,
            path = %self.path,
            status,
            duration_ms = took.as_secs_f64() * 1e3,
            upstream_status = self.upstream.map(|u| u.0),
            upstream_ms = self.upstream.map(|u| u.1.as_secs_f64() * 1e3),
            limit,
            remaining = self.note.remaining,
            retry_after = self.note.retry_after_secs,
            delayed_ms = self.note.delayed_us as f64 / 1e3,
            overloaded = self.note.overloaded,
            stale = match self.stale {
                Stale::No => "no",
                Stale::Throttled => "throttled",
                Stale::UpstreamError => "upstream_error",
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn future_size<A, F>(_: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// hyper moves a request's future by value (into its slot, out of the service call), so
    /// its size is copying per request: 4 kB before `handle` and `forward` took their shape.
    #[test]
    fn the_request_future_stays_small() {
        let yaml = crate::bench::bench_yaml("127.0.0.1:1", "127.0.0.1:2", "10/s", 10, &Default::default());
        let proxy = Arc::new(Proxy::new(Config::from_yaml(std::path::Path::new("b.yaml"), &yaml).unwrap()));
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let size = future_size(|r: Request<Incoming>| proxy.clone().handle(r, peer));
        assert!(size <= 2560, "the request future grew to {size} bytes");
    }
}
