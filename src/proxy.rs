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

use crate::answer::{Error, RouteAnswers, RouteFacts, StaleReason};
use crate::body::Body;
use crate::cache::Cache;
use crate::config::{Config, LimitConfig, Route, StoreKind, UpstreamKind};
use crate::forward::{self, Downstream, HttpForwarder};
use crate::gate::{Gate, Limit, Note};
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
        match http::HeaderValue::try_from(location) {
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

    /// The answer of the routed request: from upstream when admitted, else a refusal or a
    /// stale copy. One `async fn` holding the head once (see [`Proxy::handle`]).
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
            // Whether the peer is a trusted proxy: decided once, read by the request id and the
            // forwarding fields.
            let peer_trusted = this.trusted.is_trusted(peer.addr.ip());
            // The request's id, made as it enters; only a trusted proxy's own is read, so the
            // common case looks up no field.
            let id = this.config.request_id.as_ref().map(|name| RequestId::decide(name, &parts.headers, peer_trusted));
            // The field and its value, made once: the forwarded request gets a clone.
            let id_field = this.config.request_id.as_ref().zip(id.as_ref().map(RequestId::value));
            // The id as text, for the log and rule values; read only where they need it.
            let request_id = || id.as_ref().map(RequestId::as_str);
            // gRPC runs on HTTP/2 only: an HTTP/1 request costs one comparison here.
            let grpc = parts.version == http::Version::HTTP_2 && forward::grpc::is_grpc(&parts.headers);
            let (idx, mut target) = match routed {
                Ok(found) => found,
                Err(e) => {
                    if started.is_some() {
                        let (method, path, status) = (&parts.method, parts.uri.path(), e.status().as_u16());
                        let peer = peer.addr.ip();
                        tracing::info!(target: "tollgate::access", %peer, %method, path, status, error = e.kind(), request_id = request_id());
                    }
                    let mut resp = if grpc {
                        this.unrouted.respond_grpc(&e)
                    } else {
                        this.unrouted.respond(&e, &parts.method, parts.uri.path(), parts.version)
                    };
                    if let Some((name, id)) = id_field {
                        set_id(resp.headers_mut(), name, id);
                    }
                    return resp;
                }
            };
            let (route, lane) = (&this.config.routes[idx], &this.lanes[idx]);
            let mut log = Access::new(lane, route, &parts, this.config.log.access, id.as_ref());
            log.grpc = grpc;
            let version = parts.version;
            // Values with variables read the request as the client sent it (its head is not
            // changed before it is forwarded; `{path}` is the client's path after a rewrite too).
            let render = |rules: &Option<Arc<forward::rules::HeaderRules>>, parts: &Parts, target: &Target| {
                let rules = rules.as_ref().filter(|r| r.is_dynamic())?;
                Some(rules.render(&forward::rules::Vars {
                    route: &route.name,
                    headers: &parts.headers,
                    path: target.path(parts),
                    request_id: request_id(),
                    peer: peer.addr.ip(),
                    trusted: &this.trusted,
                }))
            };
            // Every answer may need these (a 429 too); the request's only once it is admitted.
            let response_values: RenderedValues = render(&lane.response_headers, &parts, &target);
            let mut resp = 'answer: {
                // TRACE reflects the request, credentials and all: not taken unless the route
                // lists it (nginx refuses it too).
                if parts.method == Method::TRACE && !takes_trace(route) {
                    break 'answer this.refused(route, lane, &Error::MethodNotAllowed, None, version, &mut log);
                }
                if let Some(rw) = &lane.rewrite {
                    if let Some(path) = rw.apply(target.path(&parts)) {
                        if let Err(e) = target.rewrite(&mut parts, &path) {
                            break 'answer this.refused(route, lane, &e, Some(&parts), version, &mut log);
                        }
                    }
                }
                let mut admission = None;
                if !lane.gate.is_open() {
                    // The key's context lives for the decision only, and the decision is moved
                    // out before any wait: the request's future keeps neither across another
                    // await (each would take a slot of its own in it).
                    let checked = {
                        let client_ip = this.trusted.client_ip(peer.addr.ip(), &parts.headers);
                        let ctx = KeyCtx {
                            route: &route.name,
                            client_ip,
                            path: target.path(&parts),
                            parts: &parts,
                            tls_client: peer.tls_client(),
                        };
                        lane.gate.check(&ctx, this.clock.now()).await
                    };
                    let wait = match checked {
                        Err(e) => break 'answer this.refused(route, lane, &e, Some(&parts), version, &mut log),
                        Ok(a) => {
                            log.note = a.note;
                            admission.insert(a).wait()
                        }
                    };
                    if !wait.is_zero() {
                        Box::pin(tokio::time::sleep(wait)).await;
                    }
                }
                // A copy of the head, only when a stale copy could be stored or served for it.
                let head = this.wants_copy(route, lane, &parts).then(|| Box::new(parts.clone()));
                if matches!(parts.method, Method::OPTIONS | Method::TRACE) {
                    match forward::hop::last(&mut parts.headers) {
                        Ok(false) => {}
                        Ok(true) if parts.method == Method::OPTIONS => break 'answer lane.answers.options(),
                        Ok(true) => break 'answer lane.answers.trace(&parts),
                        Err(e) => break 'answer this.refused(route, lane, &e, None, version, &mut log),
                    }
                }
                let mut resp = match &*this.targets[route.upstream] {
                    Backend::Respond(r) => {
                        // The whole request is read before the answer, as any server reads it.
                        if !http_body::Body::is_end_stream(&body) {
                            let read = forward::read_to_end(body, r.max_body, this.config.server.body_read_timeout);
                            if let Err(e) = Box::pin(read).await {
                                break 'answer this.refused(route, lane, &e, None, version, &mut log);
                            }
                        }
                        forward::respond(r).await
                    }
                    backend => {
                        let Some(strip) = strip_len(route, parts.uri.path(), target.path(&parts)) else {
                            break 'answer this.refused(
                                route,
                                lane,
                                &Error::BadRequest(STRIP_PARAMS),
                                Some(&parts),
                                version,
                                &mut log,
                            );
                        };
                        let request_values: RenderedValues = render(&lane.request_headers, &parts, &target);
                        let down = Downstream {
                            peer: peer.addr.ip(),
                            peer_trusted,
                            https: peer.tls.is_some(),
                            request_id: id_field.as_ref().map(|(name, id)| (*name, id.clone())),
                            rules: lane
                                .request_headers
                                .as_deref()
                                .map(|r| (r, request_values.as_deref().unwrap_or_default())),
                        };
                        let sent = Instant::now();
                        // An upgrade (HTTP/1.1 `Upgrade`, or an HTTP/2 CONNECT): hyper leaves an
                        // `OnUpgrade` in the request's (usually empty) extensions, and only a flag is
                        // kept here, so the request's future grows by a byte.
                        let upgrade = parts.extensions.get::<hyper::upgrade::OnUpgrade>().is_some();
                        // The tunnel slot of an upgrade the route tunnels (`upgrades:`) to a backend that
                        // can: taken first, it goes with the tunnel, or back on any other answer.
                        let tunnel_slot = |tunnels: bool, parts: &Parts| {
                            let wanted = tunnels
                                && !route.upgrades.is_empty()
                                && forward::tunnel::wanted(
                                    &parts.headers,
                                    &parts.extensions,
                                    parts.version,
                                    &route.upgrades,
                                )
                                .is_some();
                            if !wanted {
                                return Ok(None);
                            }
                            lane.tunnels.clone().try_acquire_owned().map(Some).map_err(|_| Error::TooManyTunnels)
                        };
                        let out = match backend {
                            Backend::Http(fwd) if upgrade => {
                                // Boxed: rare, and its future would enlarge every request's.
                                Box::pin(async {
                                    let slot = tunnel_slot(fwd.tunnels(), &parts)?;
                                    let req = Request::from_parts(parts, body);
                                    if let Some(slot) = slot {
                                        fwd.upgrade(req, strip, &down, &route.upgrades, slot).await
                                    } else if is_extended_connect(&req) {
                                        Err(Error::BadRequest(UNTUNNELLED_CONNECT))
                                    } else if fwd.is_h2() {
                                        fwd.forward_h2(req, strip, &down).await
                                    } else {
                                        // `Upgrade` removed: an ordinary request.
                                        fwd.forward(req, strip, &down).await
                                    }
                                })
                                .await
                            }
                            // Boxed: its future would otherwise enlarge every HTTP/1 request's.
                            Backend::Http(fwd) if fwd.is_h2() => {
                                Box::pin(fwd.forward_h2(Request::from_parts(parts, body), strip, &down)).await
                            }
                            Backend::Http(fwd) => fwd.forward(Request::from_parts(parts, body), strip, &down).await,
                            Backend::Group(group) => {
                                // `balance: hash`: the request's key, as a limit keys it.
                                let key = group.hash_key().map_or(0, |spec| {
                                    let ctx = KeyCtx {
                                        route: &route.name,
                                        client_ip: this.trusted.client_ip(peer.addr.ip(), &parts.headers),
                                        path: target.path(&parts),
                                        parts: &parts,
                                        tls_client: peer.tls_client(),
                                    };
                                    spec.hash(&ctx).0 as u64
                                });
                                // Boxed: a group's future stays out of every single-server request's.
                                // An ordinary request's box holds the forwarding future alone.
                                if !upgrade {
                                    Box::pin(group.forward(Request::from_parts(parts, body), strip, &down, key)).await
                                } else {
                                    Box::pin(async {
                                        let slot = tunnel_slot(group.tunnels(), &parts)?;
                                        let req = Request::from_parts(parts, body);
                                        if let Some(slot) = slot {
                                            group.upgrade(req, strip, &down, &route.upgrades, slot, key).await
                                        } else if is_extended_connect(&req) {
                                            Err(Error::BadRequest(UNTUNNELLED_CONNECT))
                                        } else {
                                            group.forward(req, strip, &down, key).await
                                        }
                                    })
                                    .await
                                }
                            }
                            Backend::Respond(_) => Err(Error::Internal("a responder reached the forwarding step")),
                        };
                        let took = sent.elapsed();
                        lane.metrics.upstream_seconds.observe(took);
                        log.upstream = Some((out.as_ref().map_or(0, |r| r.status().as_u16()), took));
                        match out {
                            Ok(resp) => resp,
                            Err(e) => break 'answer this.refused(route, lane, &e, head.as_deref(), version, &mut log),
                        }
                    }
                };
                // A cost taken from the response: debited or refunded now that the head is here.
                // Boxed, so that routes without one carry no larger future.
                if let Some(a) = admission.as_mut().filter(|a| Gate::owes(a)) {
                    Box::pin(lane.gate.settle(a, resp.headers(), this.clock.now())).await;
                }
                if let Some(head) = &head {
                    resp = this.after_upstream(route, lane, head, resp, &mut log);
                }
                let mut permit = None;
                if let Some(mut a) = admission {
                    lane.gate.decorate(&mut a, &mut resp);
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
                resp
            };
            if let Some((name, id)) = id_field {
                set_id(resp.headers_mut(), name, id);
            }
            if let Some(rules) = &lane.response_headers {
                rules.apply(resp.headers_mut(), response_values.as_deref().unwrap_or_default());
            }
            lane.metrics.response(resp.status().as_u16());
            if let Some(started) = started {
                log.emit(resp.status().as_u16(), started.elapsed(), peer.addr.ip());
            }
            resp
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
        for lane in &self.lanes {
            for l in lane.gate.limits() {
                l.metrics.keys.set(i64::try_from(l.live_keys()).unwrap_or(i64::MAX));
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
