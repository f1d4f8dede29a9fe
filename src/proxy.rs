//! The compiled configuration that serves requests: routes in order, their gates and
//! targets, the stale-copy cache and the metric handles. A [`Proxy`] is immutable; a reload
//! builds a new one (keeping the state of unchanged limits) and swaps it in whole.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::request::Parts;
use http::{HeaderValue, Method, Request, Response};
use hyper::body::Incoming;

use crate::answer::{Error, RouteAnswers, RouteFacts, StaleReason};
use crate::body::Body;
use crate::cache::Cache;
use crate::config::{Config, LimitConfig, Route, StoreKind, UpstreamKind};
use crate::forward::{self, Downstream, HttpForwarder};
use crate::gate::{Admission, Gate, Limit, Note};
use crate::limit::plan::Directory;
use crate::limit::store::redis::fallback_algorithm;
use crate::limit::{Clock, KeyCtx, KeyPart, LocalStore, RedisClient, RedisStore, Store, SystemClock, TrustedProxies};
use crate::metrics::{Metrics, RouteMetrics};
use crate::peer::Peer;
use crate::request_id::RequestId;
use crate::route;
use crate::target::{self, Target};

/// The live proxy; a reload stores a new one, requests in flight keep the one they loaded.
pub type Shared = Arc<arc_swap::ArcSwap<Proxy>>;

/// A Redis-backed store for limit `l` of route `route`; its local fallback has the same
/// parameters divided by `instances`.
fn redis_store(client: &Arc<RedisClient>, route: &str, l: &LimitConfig) -> Arc<Store> {
    let fallback = LocalStore::new(fallback_algorithm(&l.algorithm, client.config().instances), l.max_keys);
    // Route and limit names are `[A-Za-z0-9._-]`: `route/limit` is unique per config.
    let name = format!("{route}/{}", l.name);
    let store = RedisStore::new(client.clone(), &name, l.algorithm.clone(), l.lease, fallback);
    // A plan limit's tiers share the limit's Redis keys: one state per client.
    let store = if l.plan.is_some() { store.for_plan() } else { store };
    Arc::new(Store::Redis(Box::new(store)))
}

/// Where a route sends admitted requests.
pub enum Backend {
    Http(Box<HttpForwarder>),
    /// `servers:`: a group with balancing, health and retries.
    Group(Arc<forward::group::Group>),
    Respond(crate::config::Responder),
}

/// Per-route runtime: gate, answers, metric handles, cache policy.
struct Lane {
    gate: Gate,
    answers: RouteAnswers,
    metrics: RouteMetrics,
    /// The route keys on `Authorization` / `Cookie`, so copies may be kept per credential.
    keyed_on_credentials: bool,
    /// One permit per open tunnel (`tunnels.max`).
    tunnels: Arc<tokio::sync::Semaphore>,
    /// `rewrite.path_regex`, compiled.
    rewrite: Option<Box<route::PathRewrite>>,
    /// `request_headers` and `response_headers`, compiled.
    request_headers: Option<Arc<forward::rules::HeaderRules>>,
    response_headers: Option<Arc<forward::rules::HeaderRules>>,
}

pub struct Proxy {
    pub config: Arc<Config>,
    targets: Vec<Arc<Backend>>,
    /// Each route's header and query conditions, compiled (for [`route::find`]).
    conditions: Vec<Option<Box<route::Conditions>>>,
    lanes: Vec<Lane>,
    /// Answers to requests no route took (a bad target, no route).
    unrouted: RouteAnswers,
    trusted: TrustedProxies,
    clock: Arc<dyn Clock>,
    cache: Cache,
    metrics: Arc<Metrics>,
    /// The one connection of every `store: redis` limit; kept across reloads while `redis:` is unchanged.
    redis: Option<Arc<RedisClient>>,
    /// The rustls config of each listener (`None` for a plain one), in the config's order.
    listener_tls: Vec<Option<Arc<rustls::ServerConfig>>>,
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
                    UpstreamKind::Http(h) => {
                        match forward::group::Group::new(&u.name, h, config.server.body_read_timeout, &metrics) {
                            Some(group) => Backend::Group(group),
                            None => Backend::Http(Box::new(HttpForwarder::new(
                                &u.name,
                                h,
                                config.server.body_read_timeout,
                                &metrics,
                            ))),
                        }
                    }
                    UpstreamKind::Respond(r) => Backend::Respond(r.clone()),
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
        let type_base: Arc<str> = Arc::from(config.problem_type_base.as_str());
        let directory = config.plans.as_ref().map(|p| Arc::new(Directory::new(p.clone(), redis.clone())));
        let mut conditions = Vec::with_capacity(config.routes.len());
        let lanes = config
            .routes
            .iter()
            .map(|r| {
                let (matching, rewrite) = route::compile(r);
                conditions.push(matching);
                let rules = |rules: &Option<Arc<crate::config::HeaderRules>>| {
                    rules.as_deref().map(|r| Arc::new(forward::rules::HeaderRules::new(r)))
                };
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
                let mut gate = Gate::new(r, &metrics, &mut store_for);
                if let Some(d) = &directory {
                    gate.set_directory(d.clone(), r.ratelimit_headers);
                }
                let upstream = config.upstream(r);
                let facts = RouteFacts {
                    name: &r.name,
                    limits: r.limits.iter().map(|l| l.name.clone()).collect(),
                    policy: gate.policy().cloned(),
                    upstream: match &upstream.kind {
                        UpstreamKind::Http(h) => Some((upstream.name.as_str(), h.timeout)),
                        UpstreamKind::Respond(_) => None,
                    },
                    methods: r.methods.as_deref(),
                };
                Lane {
                    answers: RouteAnswers::new(Some(facts), type_base.clone(), &metrics)
                        .with_request_id(config.request_id.clone()),
                    gate,
                    metrics: metrics.route(&r.name),
                    keyed_on_credentials: keys_on_credentials(r),
                    tunnels: Arc::new(tokio::sync::Semaphore::new(r.tunnels.max)),
                    rewrite,
                    request_headers: rules(&r.request_headers),
                    response_headers: rules(&r.response_headers),
                }
            })
            .collect();
        let cache = match previous {
            Some(p) if p.config.cache == config.cache => p.cache.clone(),
            _ => Cache::new(config.cache.max_bytes, config.cache.max_entry_bytes),
        };
        let trusted = TrustedProxies::new(config.trusted_proxies.clone());
        let unrouted = RouteAnswers::new(None, type_base, &metrics).with_request_id(config.request_id.clone());
        let listener_tls = config.listeners.iter().map(listener_tls).collect();
        Proxy {
            config: Arc::new(config),
            targets,
            conditions,
            lanes,
            unrouted,
            trusted,
            clock,
            cache,
            metrics,
            redis,
            listener_tls,
        }
    }

    /// The rustls config of listener `idx` of the config, if it speaks TLS.
    pub fn listener_tls(&self, idx: usize) -> Option<&Arc<rustls::ServerConfig>> {
        self.listener_tls.get(idx).and_then(Option::as_ref)
    }

    /// The answer of a `redirect_https` listener: 308 to the request's URL over HTTPS on
    /// `port`; a request without a usable host gets the `400` any listener gives it.
    pub fn redirect_https(&self, req: Request<Incoming>, port: u16) -> Response<Body> {
        let (mut parts, _body) = req.into_parts();
        let decided = crate::framing::check(&mut parts).map_err(Error::from).and_then(|()| target::decide(&mut parts));
        let host = decided.as_ref().ok().and_then(|_| target::host(&parts.headers)).filter(|h| !h.is_empty());
        let Some(host) = host else {
            let e = decided.err().unwrap_or(Error::BadRequest("the request names no host to redirect to"));
            return self.unrouted.respond(&e, &parts.method, parts.uri.path(), parts.version);
        };
        let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let location = if port == 443 { format!("https://{host}{pq}") } else { format!("https://{host}:{port}{pq}") };
        match HeaderValue::try_from(location) {
            Ok(v) => crate::answer::redirect(v),
            Err(_) => self.unrouted.respond(
                &Error::BadRequest("the request's URL cannot be redirected"),
                &parts.method,
                parts.uri.path(),
                parts.version,
            ),
        }
    }

    /// Whether `ip` is in `trusted_proxies` (a PROXY header is read only from these).
    pub fn is_trusted(&self, ip: std::net::IpAddr) -> bool {
        self.trusted.is_trusted(ip)
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
        UNIX_EPOCH + Duration::from_micros(self.clock.now().as_micros())
    }

    /// Serves one request. Never fails: every problem is an answer from [`answer`].
    ///
    /// The target is decided, the route found and the head taken apart before the returned
    /// future exists, and the future holds the request in one place only: hyper moves it by
    /// value per request, so its size is copying work.
    pub fn handle(self: Arc<Proxy>, req: Request<Incoming>, peer: SocketAddr) -> impl Future<Output = Response<Body>> {
        self.handle_peer(req, Peer::plain(peer))
    }

    /// [`Proxy::handle`] for a client whose connection came through the `listen` room (TLS,
    /// a PROXY header): `peer` says who it is.
    // Inlined into both callers, as `handle` was into its one: measured, the request path's
    // framing and target checks otherwise stop being inlined (+1.8 % instructions per 429).
    #[inline(always)]
    pub fn handle_peer(self: Arc<Proxy>, req: Request<Incoming>, peer: Peer) -> impl Future<Output = Response<Body>> {
        let started = self.config.log.access.then(Instant::now);
        let (mut parts, body) = req.into_parts();
        let routed = crate::framing::check(&mut parts)
            .map_err(Error::from)
            .and_then(|()| target::decide(&mut parts))
            .and_then(|t| {
                let (path, query) = (t.path(&parts), parts.uri.query());
                let found =
                    route::find(&self.config.routes, &self.conditions, &parts.method, &parts.headers, path, query);
                found.map(|i| (i, t)).ok_or(Error::NoRoute)
            });
        self.serve(routed, parts, body, peer, started)
    }

    /// The routed request, in phases over one [`Ctx`]: *route* (done by the caller; a miss is
    /// answered here), *admit* ([`Proxy::admit`]), *forward* (or answer at the last hop, or
    /// from the responder), *settle* ([`Proxy::settle`]), then *finish* and *log*
    /// ([`Proxy::finish`]). One future holding the head once (see [`Proxy::handle`]): the
    /// forwarded request is made from it in this block, so no phase takes the head by value.
    // Not an `async fn`: its arguments would be kept twice in the future, as arguments and as
    // locals (376 bytes); captured by an `async move` block, each is kept once.
    #[allow(clippy::manual_async_fn)]
    fn serve(
        self: Arc<Proxy>,
        routed: Result<(usize, Target), Error>,
        mut parts: Parts,
        body: Incoming,
        peer: Peer,
        started: Option<Instant>,
    ) -> impl Future<Output = Response<Body>> {
        async move {
            let this = &*self;
            let _in_flight = InFlight::enter(&this.metrics);
            let mut ctx = Ctx::new(this, &parts, &peer);
            let (idx, mut target) = match routed {
                Ok(found) => found,
                Err(e) => return this.unrouted(&e, &parts, &mut ctx, started),
            };
            let (route, lane) = (&this.config.routes[idx], &this.lanes[idx]);
            let mut log = Access::new(lane, route, &parts, this.config.log.access, ctx.id.as_ref());
            log.grpc = ctx.grpc;
            // Every answer may need these (a 429 too); the request's only once it is admitted.
            let response_values = this.values(&lane.response_headers, route, &parts, &target, &ctx);
            let version = parts.version;
            let mut resp = 'answer: {
                let admission = match this.admit(route, lane, &mut parts, &mut target, &ctx, &mut log).await {
                    Ok(a) => a,
                    Err(e) => break 'answer this.refused(route, lane, &e, Some(&parts), version, &mut log),
                };
                // A copy of the head, only when a stale copy could be stored or served for it.
                let head = this.wants_copy(route, lane, &parts).then(|| Box::new(parts.clone()));
                match this.last_hop(lane, &mut parts) {
                    Ok(None) => {}
                    Ok(Some(here)) => break 'answer here,
                    Err(e) => break 'answer this.refused(route, lane, &e, None, version, &mut log),
                }
                let resp = match &*this.targets[route.upstream] {
                    Backend::Respond(r) => {
                        match Proxy::respond(r, &parts, body, this.config.server.body_read_timeout) {
                            Ok(answered) => answered.await,
                            Err(read) => match read.await {
                                Ok(()) => forward::respond(r).await,
                                Err(e) => break 'answer this.refused(route, lane, &e, None, version, &mut log),
                            },
                        }
                    }
                    backend => {
                        let Some(strip) = strip_len(route, parts.uri.path(), target.path(&parts)) else {
                            let e = Error::BadRequest(STRIP_PARAMS);
                            break 'answer this.refused(route, lane, &e, Some(&parts), version, &mut log);
                        };
                        let request_values = this.values(&lane.request_headers, route, &parts, &target, &ctx);
                        let down = ctx.downstream(lane, request_values.as_deref());
                        let key = this.hash_key(backend, route, &parts, &target, &peer);
                        // An upgrade (HTTP/1.1 `Upgrade`, or an HTTP/2 CONNECT): hyper leaves an
                        // `OnUpgrade` in the request's (usually empty) extensions.
                        let upgrade = parts.extensions.get::<hyper::upgrade::OnUpgrade>().is_some();
                        let req = Request::from_parts(parts, body);
                        let sent = Instant::now();
                        let out = match backend {
                            // Boxed: rare, and its future would enlarge every request's.
                            Backend::Http(fwd) if upgrade => {
                                Box::pin(Proxy::upgrade(route, lane, fwd, req, strip, &down)).await
                            }
                            // Boxed: its future would otherwise enlarge every HTTP/1 request's.
                            Backend::Http(fwd) if fwd.is_h2() => Box::pin(fwd.forward_h2(req, strip, &down)).await,
                            Backend::Http(fwd) => fwd.forward(req, strip, &down).await,
                            // Boxed: a group's future stays out of every single-server request's.
                            Backend::Group(g) if upgrade => {
                                Box::pin(Proxy::upgrade_group(route, lane, g, req, strip, &down, key)).await
                            }
                            Backend::Group(g) => Box::pin(g.forward(req, strip, &down, key)).await,
                            Backend::Respond(_) => Err(Error::Internal("a responder reached the forwarding step")),
                        };
                        lane.upstream_took(&mut log, out.as_ref().map_or(0, |r| r.status().as_u16()), sent.elapsed());
                        match out {
                            Ok(resp) => resp,
                            Err(e) => break 'answer this.refused(route, lane, &e, head.as_deref(), version, &mut log),
                        }
                    }
                };
                let mut resp = resp;
                this.settle(route, lane, admission, head.as_deref(), &mut resp, &mut log).await;
                resp
            };
            this.finish(
                lane,
                &mut resp,
                ctx.id_field.take(),
                response_values.as_deref(),
                &log,
                (started, peer.addr.ip()),
            );
            resp
        }
    }

    /// *Finish* and *log*: what every answer of the route carries (the request id, response
    /// header rules), its count, then the access log line.
    fn finish(
        &self,
        lane: &Lane,
        resp: &mut Response<Body>,
        id_field: Option<(&http::HeaderName, http::HeaderValue)>,
        response_values: Option<&[HeaderValue]>,
        log: &Access<'_>,
        (started, peer): (Option<Instant>, std::net::IpAddr),
    ) {
        if let Some((name, id)) = id_field {
            set_id(resp.headers_mut(), name, id);
        }
        if let Some(rules) = &lane.response_headers {
            rules.apply(resp.headers_mut(), response_values.unwrap_or_default());
        }
        lane.metrics.response(resp.status().as_u16());
        if let Some(started) = started {
            log.emit(resp.status().as_u16(), started.elapsed(), peer);
        }
    }

    /// The answer to a request no route took (a bad target, no route), logged.
    fn unrouted(&self, e: &Error, parts: &Parts, ctx: &mut Ctx<'_>, started: Option<Instant>) -> Response<Body> {
        if started.is_some() {
            let (method, path, status) = (&parts.method, parts.uri.path(), e.status().as_u16());
            let peer = ctx.peer.addr.ip();
            tracing::info!(target: "tollgate::access", %peer, %method, path, status, error = e.kind(), request_id = ctx.request_id());
        }
        let mut resp = if ctx.grpc {
            self.unrouted.respond_grpc(e)
        } else {
            self.unrouted.respond(e, &parts.method, parts.uri.path(), parts.version)
        };
        if let Some((name, id)) = ctx.id_field.take() {
            set_id(resp.headers_mut(), name, id);
        }
        resp
    }

    /// A route's header rule values for this request. They read the request as the client
    /// sent it (its head is not changed before it is forwarded; `{path}` is the client's path
    /// after a rewrite too).
    #[inline(always)]
    fn values(
        &self,
        rules: &Option<Arc<forward::rules::HeaderRules>>,
        route: &Route,
        parts: &Parts,
        target: &Target,
        ctx: &Ctx<'_>,
    ) -> RenderedValues {
        let rules = rules.as_ref().filter(|r| r.is_dynamic())?;
        Some(self.render(rules, route, parts, target, ctx))
    }

    #[cold]
    fn render(
        &self,
        rules: &forward::rules::HeaderRules,
        route: &Route,
        parts: &Parts,
        target: &Target,
        ctx: &Ctx<'_>,
    ) -> forward::rules::Values {
        rules.render(&forward::rules::Vars {
            route: &route.name,
            headers: &parts.headers,
            path: target.path(parts),
            request_id: ctx.request_id(),
            peer: ctx.peer.addr.ip(),
            trusted: &self.trusted,
        })
    }

    /// *Admit*: the route's method rule and path rewrite, then its limits and cap; waits
    /// out a shaping delay. `None`: the route has no gate.
    async fn admit(
        &self,
        route: &Route,
        lane: &Lane,
        parts: &mut Parts,
        target: &mut Target,
        ctx: &Ctx<'_>,
        log: &mut Access<'_>,
    ) -> Result<Option<Admission>, Error> {
        // TRACE reflects the request, credentials and all: not taken unless the route lists
        // it (nginx refuses it too).
        if parts.method == Method::TRACE && !takes_trace(route) {
            return Err(Error::MethodNotAllowed);
        }
        if let Some(rw) = &lane.rewrite {
            if let Some(path) = rw.apply(target.path(parts)) {
                target.rewrite(parts, &path)?;
            }
        }
        if lane.gate.is_open() {
            return Ok(None);
        }
        // The key's context lives for the decision only, and the decision is moved out
        // before any wait: the request's future keeps neither across another await (each
        // would take a slot of its own in it).
        let checked = {
            let key = self.key_ctx(route, parts, target, ctx.peer);
            lane.gate.check(&key, self.clock.now()).await
        };
        let admission = checked?;
        log.note = admission.note;
        let wait = admission.wait();
        if !wait.is_zero() {
            Box::pin(tokio::time::sleep(wait)).await;
        }
        Ok(Some(admission))
    }

    /// What limit keys (and a `hash` group's balancing) read of the request.
    #[inline(always)]
    fn key_ctx<'k>(&'k self, route: &'k Route, parts: &'k Parts, target: &'k Target, peer: &'k Peer) -> KeyCtx<'k> {
        KeyCtx {
            route: &route.name,
            client_ip: self.trusted.client_ip(peer.addr.ip(), &parts.headers),
            path: target.path(parts),
            parts,
            tls_client: peer.tls_client(),
        }
    }

    /// `balance: hash`: the request's key, as a limit keys it (0 for other backends).
    #[inline(always)]
    fn hash_key(&self, backend: &Backend, route: &Route, parts: &Parts, target: &Target, peer: &Peer) -> u64 {
        let Backend::Group(group) = backend else { return 0 };
        group.hash_key().map_or(0, |spec| spec.hash(&self.key_ctx(route, parts, target, peer)).0 as u64)
    }

    /// `Max-Forwards` on `OPTIONS` and `TRACE`: the answer tollgate gives as the last hop, if
    /// it is one (the field is lowered by one otherwise).
    fn last_hop(&self, lane: &Lane, parts: &mut Parts) -> Result<Option<Response<Body>>, Error> {
        if !matches!(parts.method, Method::OPTIONS | Method::TRACE) || !forward::hop::last(&mut parts.headers)? {
            return Ok(None);
        }
        Ok(Some(if parts.method == Method::OPTIONS { lane.answers.options() } else { lane.answers.trace(parts) }))
    }

    /// The built-in responder reads the whole request before its answer, as any server
    /// does (`Err`: that read, to be awaited first); a client that waits for `100 Continue`
    /// gets the final answer instead (RFC 9110 §10.1.1), as nginx's `return` gives it.
    #[allow(clippy::type_complexity)]
    fn respond<'r>(
        r: &'r crate::config::Responder,
        parts: &Parts,
        body: Incoming,
        idle: Duration,
    ) -> Result<impl Future<Output = Response<Body>> + 'r, Pin<Box<impl Future<Output = Result<(), Error>>>>> {
        let waits =
            parts.headers.get(http::header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if waits || http_body::Body::is_end_stream(&body) {
            return Ok(forward::respond(r));
        }
        Err(Box::pin(forward::read_to_end(body, r.max_body, idle)))
    }

    /// *Settle*: a cost taken from the response is debited or refunded now that the head is
    /// here; a stale copy is kept (or stands in for a 5xx); the RateLimit fields go on; the
    /// body (or the tunnel) holds the concurrency slot until it ends.
    async fn settle(
        &self,
        route: &Route,
        lane: &Lane,
        mut admission: Option<Admission>,
        head: Option<&Parts>,
        resp: &mut Response<Body>,
        log: &mut Access<'_>,
    ) {
        // Boxed, so that routes without one carry no larger future.
        if let Some(a) = admission.as_mut().filter(|a| Gate::owes(a)) {
            Box::pin(lane.gate.settle(a, resp.headers(), self.clock.now())).await;
        }
        if let Some(head) = head {
            let answered = std::mem::replace(resp, Response::new(Body::empty()));
            *resp = self.after_upstream(route, lane, head, answered, log);
        }
        let mut permit = None;
        if let Some(mut a) = admission {
            lane.gate.decorate(&mut a, resp);
            permit = a.permit;
        }
        if let Some(p) = &mut permit {
            p.answered(resp.status());
        }
        // A 200 too: the answer to an HTTP/2 extended CONNECT (RFC 8441).
        if matches!(resp.status().as_u16(), 101 | 200) {
            // The tunnel holds the concurrency slot and its tunnel slot for its life.
            if let Some(pending) = resp.extensions_mut().remove::<forward::tunnel::Pending>() {
                pending.start(route.tunnels.idle_timeout, lane.metrics.tunnels.clone(), permit.take());
            }
        }
        if let Some(permit) = permit {
            resp.body_mut().hold(permit.into());
        }
    }
}

impl Proxy {
    /// The tunnel slot of an upgrade the route tunnels (`upgrades:`) to a backend that can:
    /// taken first, it goes with the tunnel, or back on any other answer.
    fn tunnel_slot<B>(
        route: &Route,
        lane: &Lane,
        tunnels: bool,
        req: &Request<B>,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        let wanted = tunnels
            && !route.upgrades.is_empty()
            && forward::tunnel::wanted(req.headers(), req.extensions(), req.version(), &route.upgrades).is_some();
        if !wanted {
            return Ok(None);
        }
        lane.tunnels.clone().try_acquire_owned().map(Some).map_err(|_| Error::TooManyTunnels)
    }

    /// An upgrade (HTTP/1.1 `Upgrade`, or an HTTP/2 CONNECT) to a single server: a tunnel
    /// when the route allows one, else an ordinary request without `Upgrade`.
    async fn upgrade(
        route: &Route,
        lane: &Lane,
        fwd: &HttpForwarder,
        req: Request<Incoming>,
        strip: usize,
        down: &Downstream<'_>,
    ) -> Result<Response<Body>, Error> {
        if let Some(slot) = Proxy::tunnel_slot(route, lane, fwd.tunnels(), &req)? {
            fwd.upgrade(req, strip, down, &route.upgrades, slot).await
        } else if is_extended_connect(&req) {
            Err(Error::BadRequest(UNTUNNELLED_CONNECT))
        } else if fwd.is_h2() {
            fwd.forward_h2(req, strip, down).await
        } else {
            fwd.forward(req, strip, down).await
        }
    }

    /// [`Proxy::upgrade`] to a group of servers.
    async fn upgrade_group(
        route: &Route,
        lane: &Lane,
        group: &forward::group::Group,
        req: Request<Incoming>,
        strip: usize,
        down: &Downstream<'_>,
        key: u64,
    ) -> Result<Response<Body>, Error> {
        if let Some(slot) = Proxy::tunnel_slot(route, lane, group.tunnels(), &req)? {
            group.upgrade(req, strip, down, &route.upgrades, slot, key).await
        } else if is_extended_connect(&req) {
            Err(Error::BadRequest(UNTUNNELLED_CONNECT))
        } else {
            group.forward(req, strip, down, key).await
        }
    }
}

impl Lane {
    /// The upstream exchange's status (0: none came) and time, for the metric and the log.
    fn upstream_took(&self, log: &mut Access<'_>, status: u16, took: Duration) {
        self.metrics.upstream_seconds.observe(took);
        log.upstream = Some((status, took));
    }
}

/// What every phase of one request reads: who sent it and under which id.
struct Ctx<'a> {
    peer: &'a Peer,
    /// Whether the peer is a trusted proxy: decided once, read by the request id and the
    /// forwarding fields.
    peer_trusted: bool,
    /// The request's id, made as it enters; only a trusted proxy's own is read, so the
    /// common case looks up no field.
    id: Option<RequestId>,
    /// The field and its value, made once: the forwarded request gets a clone.
    id_field: Option<(&'a http::HeaderName, http::HeaderValue)>,
    /// gRPC runs on HTTP/2 only: an HTTP/1 request costs one comparison here.
    grpc: bool,
}

impl<'a> Ctx<'a> {
    fn new(proxy: &'a Proxy, parts: &Parts, peer: &'a Peer) -> Ctx<'a> {
        let peer_trusted = proxy.trusted.is_trusted(peer.addr.ip());
        let id = proxy.config.request_id.as_ref().map(|name| RequestId::decide(name, &parts.headers, peer_trusted));
        let id_field = proxy.config.request_id.as_ref().zip(id.as_ref().map(RequestId::value));
        let grpc = parts.version == http::Version::HTTP_2 && forward::grpc::is_grpc(&parts.headers);
        Ctx { peer, peer_trusted, id, id_field, grpc }
    }

    /// The id as text, for the log and rule values.
    fn request_id(&self) -> Option<&str> {
        self.id.as_ref().map(RequestId::as_str)
    }

    /// What the forwarded request says of its client; `values`: the route's request header
    /// rule values.
    #[inline(always)]
    fn downstream<'d>(&'d self, lane: &'d Lane, values: Option<&'d [HeaderValue]>) -> Downstream<'d> {
        Downstream {
            peer: self.peer.addr.ip(),
            peer_trusted: self.peer_trusted,
            https: self.peer.tls.is_some(),
            request_id: self.id_field.clone(),
            rules: lane.request_headers.as_deref().map(|r| (r, values.unwrap_or_default())),
        }
    }
}

/// The rustls config of `listener`, built from the files its config read; `None` for a plain
/// listener, or when it cannot be built (its handshakes then fail, counted as `no_certificate`).
fn listener_tls(listener: &crate::config::Listener) -> Option<Arc<rustls::ServerConfig>> {
    let tls = listener.tls.as_ref()?;
    let loaded = tls.loaded.as_ref()?;
    let certs: Vec<_> = loaded
        .certificates
        .iter()
        .map(|c| crate::pki::server::Cert { pair: &c.pair, ocsp: c.ocsp.as_deref() })
        .collect();
    let client = loaded.client_ca.as_ref().map(|roots| crate::pki::server::ClientCheck {
        roots,
        optional: tls.client_auth == crate::config::ClientAuth::Optional,
    });
    crate::pki::server::config(&certs, client)
        .map_err(|e| tracing::error!(listener = %listener.addr, "{e}; its TLS handshakes fail"))
        .ok()
}

/// Whether `route` takes `TRACE`: only when its `methods:` list it.
fn takes_trace(route: &Route) -> bool {
    route.methods.as_ref().is_some_and(|m| m.contains(&Method::TRACE))
}

impl Proxy {
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

    /// The answer to a request that was refused or failed: a stale copy when the route allows
    /// one for this kind of failure and `head` is known, else the error's own answer.
    fn refused(
        &self,
        route: &Route,
        lane: &Lane,
        e: &Error,
        head: Option<&Parts>,
        version: http::Version,
        log: &mut Access,
    ) -> Response<Body> {
        log.error = Some(e.kind());
        if log.grpc {
            // A gRPC client reads the answer from grpc-status; a stale copy is never one.
            if let Error::Throttled(d) = e {
                log.note.retry_after_secs = Some(d.retry_after_secs);
            }
            return lane.answers.respond_grpc(e);
        }
        if let Error::Throttled(d) = e {
            log.note = Note {
                limit: d.limits.first().map(|l| l.0),
                remaining: Some(0),
                retry_after_secs: Some(d.retry_after_secs),
                delayed_us: 0,
            };
        }
        if let (Some(reason), Some(parts)) = (e.stale_reason(), head) {
            let max_age = match reason {
                StaleReason::Throttled => route.stale_on_limit,
                StaleReason::UpstreamError { .. } => route.stale_on_upstream_error,
            };
            if let Some(stale) = max_age.and_then(|max_age| self.stale(lane, parts, reason, max_age, log)) {
                return stale;
            }
        }
        let (method, path) = head.map_or((&Method::GET, ""), |p| (&p.method, p.uri.path()));
        lane.answers.respond(e, method, path, version)
    }

    fn stale(
        &self,
        lane: &Lane,
        parts: &Parts,
        reason: StaleReason,
        max_age: Duration,
        log: &mut Access,
    ) -> Option<Response<Body>> {
        if !matches!(parts.method, Method::GET | Method::HEAD) {
            return None;
        }
        let stale = self.cache.stale(parts, reason, max_age, self.wall_now())?;
        match reason {
            StaleReason::Throttled => {
                lane.metrics.stale_throttled.inc();
                log.stale = Stale::Throttled;
            }
            StaleReason::UpstreamError { .. } => {
                lane.metrics.stale_upstream_error.inc();
                log.stale = Stale::UpstreamError;
            }
        }
        Some(stale)
    }

    /// stale-if-error on an upstream 5xx; otherwise keep a copy of a good GET answer.
    fn after_upstream(
        &self,
        route: &Route,
        lane: &Lane,
        head: &Parts,
        resp: Response<Body>,
        log: &mut Access,
    ) -> Response<Body> {
        let status = resp.status().as_u16();
        if matches!(status, 500 | 502 | 503 | 504) {
            if let Some(max_age) = route.stale_on_upstream_error {
                let reason = StaleReason::UpstreamError { status };
                if let Some(stale) = self.stale(lane, head, reason, max_age, log) {
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
        let down: Vec<&str> = self
            .config
            .routes
            .iter()
            .filter(|r| matches!(&*self.targets[r.upstream], Backend::Group(g) if !g.available()))
            .map(|r| r.name.as_str())
            .collect();
        if !down.is_empty() {
            return Err(format!("no healthy upstream server for route(s) {}", down.join(", ")));
        }
        let Some(redis) = &self.redis else { return Ok(()) };
        // With `on_error: allow` every limit admits while Redis is down: still ready.
        if redis.config().on_error == crate::limit::store::redis::OnError::Allow {
            return Ok(());
        }
        redis.ping().await.map_err(|e| format!("Redis does not answer: {e}"))
    }

    /// Live keys per limit into the gauges (called when metrics are scraped).
    /// Each group upstream by name (`/config` shows its servers' state).
    pub fn groups(&self) -> impl Iterator<Item = &forward::group::Group> {
        self.targets.iter().filter_map(|t| match &**t {
            Backend::Group(g) => Some(&**g),
            _ => None,
        })
    }

    pub fn refresh_gauges(&self) {
        for g in self.groups() {
            g.refresh_gauges();
        }
        let now = self.clock.now();
        for lane in &self.lanes {
            for l in lane.gate.limits() {
                l.metrics.keys.set(i64::try_from(l.live_keys(now)).unwrap_or(i64::MAX));
            }
        }
    }
}

/// A route's header rule values for one request (see [`forward::rules::HeaderRules::render`]).
type RenderedValues = Option<forward::rules::Values>;

/// Sets the request id on an answer. Tollgate's own answers are clones of an exactly full map
/// that already holds the field (empty): its value is replaced in place, since an insert would
/// first grow the map. Other answers have room: one insert (one hash) does it.
fn set_id(headers: &mut http::HeaderMap, name: &http::HeaderName, id: http::HeaderValue) {
    if headers.len() >= headers.capacity() {
        if let Some(v) = headers.get_mut(name) {
            *v = id;
            return;
        }
    }
    headers.insert(name, id);
}

const STRIP_PARAMS: &str = "the path has parameters inside the prefix the route strips";

const UNTUNNELLED_CONNECT: &str =
    "an extended CONNECT is tunnelled only for `websocket`, on a route whose `upgrades` lists it, to an HTTP/1.1 upstream";

/// An HTTP/2 extended CONNECT (RFC 8441): tunnelled where the route allows it, never forwarded
/// as if it were a request.
fn is_extended_connect<B>(req: &Request<B>) -> bool {
    req.extensions().get::<hyper::ext::Protocol>().is_some()
}

/// Bytes of `path` (as forwarded) that `route`'s `strip_prefix` removes, given `matched`, the
/// same path as routes see it. `None` when path parameters sit inside the stripped prefix,
/// where no byte count of the forwarded path corresponds to it.
fn strip_len(route: &Route, path: &str, matched: &str) -> Option<usize> {
    let kept = route::upstream_path(route, matched).len();
    let prefix = &matched[..matched.len() - kept];
    path.starts_with(prefix).then_some(prefix.len())
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
    /// The kind of error tollgate answered, if it did.
    error: Option<&'static str>,
    request_id: Option<&'a RequestId>,
    /// A gRPC call: tollgate's own answers are gRPC statuses, never stale copies.
    grpc: bool,
}

impl<'a> Access<'a> {
    /// `logging`: the access log is on, so the path is worth copying.
    fn new(
        lane: &'a Lane,
        route: &'a Route,
        parts: &Parts,
        logging: bool,
        request_id: Option<&'a RequestId>,
    ) -> Access<'a> {
        Access {
            lane,
            route: &route.name,
            method: parts.method.clone(),
            path: if logging { parts.uri.path().to_owned() } else { String::new() },
            note: Note::default(),
            upstream: None,
            stale: Stale::No,
            error: None,
            request_id,
            grpc: false,
        }
    }

    /// `peer`: the client's address (the socket's, or the one a PROXY header carried).
    fn emit(&self, status: u16, took: Duration, peer: std::net::IpAddr) {
        let limit = self.note.limit.and_then(|i| self.lane.gate.limits().get(i)).map(|l| l.config.name.as_str());
        tracing::info!(
            target: "tollgate::access",
            route = self.route,
            %peer,
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
            error = self.error,
            stale = match self.stale {
                Stale::No => "no",
                Stale::Throttled => "throttled",
                Stale::UpstreamError => "upstream_error",
            },
            request_id = self.request_id.map(RequestId::as_str),
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
        // 2,624 bytes once TLS peers, gateway rules, tunnels, gRPC and plans met in one future;
        // 2,240 once `serve` stopped keeping its arguments twice; 2,208 once the key's context
        // no longer outlived the decision.
        assert!(size <= 2240, "the request future grew to {size} bytes");
    }
}
