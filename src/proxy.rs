//! The compiled configuration that serves requests: routes in order, their gates and
//! backends, the stale-copy cache and the metric handles. A [`Proxy`] is immutable; a reload
//! builds a new one (keeping the state of unchanged limits) and swaps it in whole.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::request::Parts;
use http::{HeaderValue, Method, Request, Response};
use hyper::body::Incoming;

use crate::answer::{Error, RouteAnswers, RouteFacts, StaleReason};
use crate::body::{Body, Inbound};
use crate::cache::Cache;
use crate::config::{Config, LimitConfig, Route, StoreKind, UpstreamKind};
use crate::forward::{self, Downstream, HttpForwarder};
use crate::gate::{Admission, Gate, Limit, Note};
use crate::limit::plan::Directory;
use crate::limit::store::redis::fallback_algorithm;
use crate::limit::{Clock, Identity, KeyPart, LocalStore, RedisClient, RedisStore, Store, SystemClock};
use crate::metrics::{Metrics, RouteMetrics};
use crate::peer::Peer;
use crate::request_id::RequestId;
use crate::request_key::{KeyCtx, TrustedProxies};
use crate::route;
use crate::step::{self, Answered, Flow, Steps};
use crate::target::{self, Target};

mod access;
mod serve;

use access::{Access, Stale};

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
    Respond(forward::Respond),
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
    /// `request_headers`, compiled (applied by the forwarder, in its one pass over the head).
    request_headers: Option<Arc<forward::rules::HeaderRules>>,
    /// The route's steps (`response_headers`, `cors`, `auth`, `extensions`), compiled; an
    /// empty slice for a route without any.
    steps: Steps,
    /// The upstream's name (a traced request's `tollgate.upstream`).
    upstream: String,
    /// `split:`: which upstream takes each request (`None`: the route's one upstream).
    split: Option<Box<forward::split::Chooser>>,
    /// `cache:`'s key: the route's stale copies are found by it, and stored by its step.
    cache_key: Option<Arc<crate::config::cache::CacheKey>>,
}

pub struct Proxy {
    pub config: Arc<Config>,
    backends: Vec<Arc<Backend>>,
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
    /// The QUIC config of each `http3` listener, made from its TLS config.
    listener_quic: Vec<Option<Arc<quinn::ServerConfig>>>,
    /// `tracing:`, with its export task; kept across reloads while the section is unchanged.
    tracer: Option<Arc<crate::trace::Tracer>>,
    /// The certificates the process obtained itself (ACME, the local CA) and the answers to
    /// ACME challenges: one store for the process, kept across reloads.
    issued: Arc<crate::pki::issued::Issued>,
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
        // The DNS client of `resolve:` servers, made only when a group has one.
        let resolves = config.upstreams.iter().any(|u| {
            matches!(&u.kind, UpstreamKind::Http(h) if h.group.as_ref().is_some_and(|g| g.servers.iter().any(|s| s.resolve != crate::config::group::Resolve::Fixed)))
        });
        let resolver = resolves
            .then(|| {
                forward::group::dns::Resolver::new(&config.dns)
                    .map(Arc::new)
                    .map_err(|e| tracing::error!("dns: {e}; `resolve:` servers are not found"))
                    .ok()
            })
            .flatten();
        let backends = config
            .upstreams
            .iter()
            .map(|u| {
                Arc::new(match &u.kind {
                    UpstreamKind::Http(h) => {
                        // The pools' shards: one per worker thread of the process.
                        let workers = crate::workers::count();
                        let read = config.server.body_read_timeout;
                        let before = previous.and_then(|p| p.groups().find(|g| g.name() == u.name));
                        let dns = resolver.as_ref();
                        match forward::group::Group::new(&u.name, h, read, &metrics, workers, dns, before) {
                            Some(group) => Backend::Group(group),
                            None => Backend::Http(Box::new(HttpForwarder::new(&u.name, h, read, &metrics, workers))),
                        }
                    }
                    UpstreamKind::Respond(r) => Backend::Respond(forward::Respond::new(r, crate::workers::count())),
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
        // Remote key sets by URL: one per URL, kept across reloads.
        let mut remotes: Vec<Arc<crate::auth::remote::Remote>> = Vec::new();
        let mut remote_for = |url: &http::Uri, every: Duration| {
            let same = |r: &&Arc<crate::auth::remote::Remote>| r.url() == url && r.min_interval() == every;
            if let Some(r) = remotes.iter().find(same) {
                return r.clone();
            }
            let lanes = previous.map(|p| p.lanes.as_slice()).unwrap_or_default();
            let kept = lanes.iter().filter_map(|l| l.steps.auth()?.remote()).find(same).cloned();
            let r = kept.unwrap_or_else(|| {
                // The URL's query may carry a secret: never a label.
                let label = format!("{}{}", url.authority().map_or("", |a| a.as_str()), url.path());
                let label = format!("{}://{label}", url.scheme_str().unwrap_or("https"));
                crate::auth::remote::Remote::new(url.clone(), every, metrics.key_set_reads(&label))
            });
            remotes.push(r.clone());
            r
        };
        let cache = match previous {
            Some(p)
                if p.config.cache.max_bytes == config.cache.max_bytes
                    && p.config.cache.max_entry_bytes == config.cache.max_entry_bytes =>
            {
                p.cache.clone()
            }
            _ => Cache::new(config.cache.max_bytes, config.cache.max_entry_bytes),
        };
        let lanes = config
            .routes
            .iter()
            .map(|r| {
                let (matching, rewrite) = route::compile(r);
                conditions.push(matching);
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
                    request_headers: r
                        .request_headers
                        .as_deref()
                        .map(|r| Arc::new(forward::rules::HeaderRules::new(r))),
                    steps: Steps::new(&mut step::Build {
                        config: &config,
                        route: r,
                        metrics: &metrics,
                        redis: redis.as_ref(),
                        remote_for: &mut remote_for,
                        cache: &cache,
                    }),
                    upstream: upstream.name.clone(),
                    split: r.split.as_deref().map(|s| Box::new(forward::split::Chooser::new(s, &r.name, &metrics))),
                    cache_key: r.cache.as_ref().map(|c| Arc::new(c.key.clone())),
                }
            })
            .collect();
        let trusted = TrustedProxies::new(config.trusted_proxies.clone());
        let unrouted = RouteAnswers::new(None, type_base, &metrics).with_request_id(config.request_id.clone());
        let issued = previous.map_or_else(Arc::default, |p| p.issued.clone());
        let listener_tls: Vec<_> = config.listeners.iter().map(|l| listener_tls(l, &issued)).collect();
        let listener_quic =
            config.listeners.iter().zip(&listener_tls).map(|(l, t)| listener_quic(l, t.as_ref())).collect();
        let tracer = config.tracing.as_ref().and_then(|t| {
            let kept = previous.and_then(|p| p.tracer.clone()).filter(|k| k.config == *t);
            kept.or_else(|| crate::trace::Tracer::new(t, metrics.traces()))
        });
        Proxy {
            config: Arc::new(config),
            backends,
            conditions,
            lanes,
            unrouted,
            trusted,
            clock,
            cache,
            metrics,
            redis,
            listener_tls,
            listener_quic,
            tracer,
            issued,
        }
    }

    /// The certificates the process obtained itself, and the ACME challenges it answers.
    pub fn issued(&self) -> &Arc<crate::pki::issued::Issued> {
        &self.issued
    }

    /// The rustls config of listener `idx` of the config, if it speaks TLS.
    pub fn listener_tls(&self, idx: usize) -> Option<&Arc<rustls::ServerConfig>> {
        self.listener_tls.get(idx).and_then(Option::as_ref)
    }

    /// The QUIC config of listener `idx` of the config, if it speaks HTTP/3.
    pub fn listener_quic(&self, idx: usize) -> Option<&Arc<quinn::ServerConfig>> {
        self.listener_quic.get(idx).and_then(Option::as_ref)
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

    /// The answer to an ACME HTTP-01 validation request: its key authorization, or the `404`
    /// of a token no order of this process (or of another sharing its storage) waits on.
    pub fn acme_http01(&self, key_authorization: Option<String>) -> Response<Body> {
        match key_authorization {
            Some(text) => crate::answer::acme_http01(text),
            None => self.unrouted.respond(
                &Error::NoRoute,
                &Method::GET,
                "/.well-known/acme-challenge/",
                http::Version::HTTP_11,
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
        // `show_keys` changes what the admin listener shows, `early_retry` what the gate
        // remembers of denials: neither changes the store's state.
        let same = |l: &&Limit| {
            LimitConfig { show_keys: limit.show_keys, early_penalty: limit.early_penalty, ..l.config.clone() } == *limit
        };
        self.lanes[idx].gate.limits().iter().find(same).map(|l| l.store.clone())
    }

    pub fn gates(&self) -> impl Iterator<Item = (&Route, &Gate)> {
        self.config.routes.iter().zip(self.lanes.iter().map(|l| &l.gate))
    }

    /// Each route with its metric handles (the admin dashboard samples them).
    pub fn route_metrics(&self) -> impl Iterator<Item = (&Route, &RouteMetrics)> {
        self.config.routes.iter().zip(self.lanes.iter().map(|l| &l.metrics))
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
}

impl Proxy {
    /// Ready unless a limit depends on a store that cannot answer (see `/readyz`).
    pub async fn readiness(&self) -> Result<(), String> {
        let down: Vec<&str> = self
            .config
            .routes
            .iter()
            .filter(|r| matches!(&*self.backends[r.upstream], Backend::Group(g) if !g.available()))
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

    /// Waits (at most `within`) for every group's `resolve:` names to have a first answer;
    /// returns those with no server then, as `upstream`: `name`.
    pub async fn first_answers(&self, within: Duration) -> Vec<String> {
        let mut missing = Vec::new();
        for g in self.groups() {
            for name in g.first_answers(within).await {
                missing.push(format!("upstream `{}`: `{name}`", g.name()));
            }
        }
        missing
    }

    /// Live keys per limit into the gauges (called when metrics are scraped).
    /// Each group upstream by name (`/config` shows its servers' state).
    pub fn groups(&self) -> impl Iterator<Item = &forward::group::Group> {
        self.backends.iter().filter_map(|t| match &**t {
            Backend::Group(g) => Some(&**g),
            _ => None,
        })
    }

    pub fn refresh_gauges(&self) {
        for g in self.groups() {
            g.refresh_gauges();
        }
        self.cache.settle();
        self.metrics.cache_held(self.cache.weighted_size(), self.cache.entry_count());
        let now = self.clock.now();
        for lane in &self.lanes {
            for l in lane.gate.limits() {
                l.metrics.keys.set(i64::try_from(l.live_keys(now)).unwrap_or(i64::MAX));
            }
        }
    }
}

/// The rustls config of `listener`, built from the files its config read; `None` for a plain
/// listener, or when it cannot be built (its handshakes then fail, counted as `no_certificate`).
fn listener_tls(
    listener: &crate::config::Listener,
    issued: &Arc<crate::pki::issued::Issued>,
) -> Option<Arc<rustls::ServerConfig>> {
    let tls = listener.tls.as_ref()?;
    let loaded = tls.loaded.as_ref()?;
    let certs: Vec<_> = loaded
        .certificates
        .iter()
        .map(|c| crate::pki::server::Cert { pair: &c.pair, ocsp: c.ocsp.as_deref() })
        .collect();
    let managed: Vec<_> =
        tls.managed.iter().map(|m| crate::pki::server::Managed { id: &m.id, names: &m.names }).collect();
    let alpn_challenges = tls.managed.iter().any(|m| {
        matches!(&m.source, crate::config::CertSource::Acme(a) if a.challenge == crate::config::Challenge::TlsAlpn01)
    });
    let served = crate::pki::server::Served { files: &certs, managed: &managed, issued: Some(issued), alpn_challenges };
    let client = loaded.client_ca.as_ref().map(|roots| crate::pki::server::ClientCheck {
        roots,
        optional: tls.client_auth == crate::config::ClientAuth::Optional,
    });
    crate::pki::server::config(&served, client)
        .map_err(|e| tracing::error!(listener = %listener.addr, "{e}; its TLS handshakes fail"))
        .ok()
}

/// The QUIC config of an `http3` listener; `None` without one, or when its TLS config could
/// not be built (its QUIC handshakes are then refused).
fn listener_quic(
    listener: &crate::config::Listener,
    tls: Option<&Arc<rustls::ServerConfig>>,
) -> Option<Arc<quinn::ServerConfig>> {
    let q = listener.http3.as_ref()?;
    let limits = crate::pki::server::QuicLimits {
        max_concurrent_streams: q.max_concurrent_streams,
        idle_timeout: q.idle_timeout,
        early_data: q.early_data,
    };
    crate::pki::server::quic(tls?, &limits)
        .map_err(|e| tracing::error!(listener = %listener.addr, "{e}; its HTTP/3 handshakes are refused"))
        .ok()
}

fn keys_on_credentials(route: &Route) -> bool {
    route.limits.iter().any(|l| {
        l.key.parts().iter().any(|p| {
            matches!(p, KeyPart::Header(h) if *h == http::header::AUTHORIZATION || *h == http::header::COOKIE)
                || matches!(p, KeyPart::Cookie(_))
        })
    })
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
        // no longer outlived the decision; 1,888 once the phases took their parts by reference
        // (a phase that takes the head or the answer by value keeps another copy of it); 2,000
        // once the request body stayed in reach through the forwarding step, for an answer
        // made before reading it to read it (`body::unread`); 1,968 with the route's steps (what
        // they keep of a request for its answers, inline), once an unrouted request's error was
        // boxed (the future keeps its arguments to the end) and the request id kept once,
        // shared, instead of twice.
        assert!(size <= 2000, "the request future grew to {size} bytes");
    }
}

#[cfg(test)]
mod reload_tests {
    use super::*;

    /// `early_retry` changes what the gate remembers of denials, not the store's state: a
    /// reload that turns the penalty on keeps every client's bucket.
    #[test]
    fn a_reload_that_changes_early_retry_keeps_the_limit_state() {
        let yaml = |extra: &str| {
            format!(
                "listen: 127.0.0.1:1\nupstreams:\n  up: {{ respond: {{ status: 200 }} }}\nroutes:\n  - name: r\n    upstream: up\n    limits:\n      - {{ name: b, algorithm: token_bucket, rate: 1/s{extra} }}\n"
            )
        };
        let load = |extra: &str| Config::from_yaml(std::path::Path::new("r.yaml"), &yaml(extra)).unwrap();
        let clock: Arc<dyn Clock> = Arc::new(crate::limit::SystemClock);
        let metrics = Arc::new(Metrics::new());
        let before = Proxy::build(load(""), clock.clone(), metrics.clone(), None);
        let after =
            Proxy::build(load(", early_retry: { penalty: double }"), clock.clone(), metrics.clone(), Some(&before));
        let store = |p: &Proxy| p.lanes[0].gate.limits()[0].store.clone();
        assert!(Arc::ptr_eq(&store(&before), &store(&after)));
        assert!(after.lanes[0].gate.limits()[0].config.early_penalty);
        let changed = Proxy::build(load(", burst: 2"), clock, metrics, Some(&after));
        assert!(!Arc::ptr_eq(&store(&after), &store(&changed)), "a changed limit starts afresh");
    }
}
