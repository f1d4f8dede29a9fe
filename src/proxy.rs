//! The compiled configuration that serves requests: routes in order and their targets.
//! A [`Proxy`] is immutable; a reload builds a new one and swaps it in whole.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use crate::body::Body;
use crate::config::{Config, UpstreamKind};
use crate::forward::{self, Downstream, HttpForwarder};
use crate::gate::{Gate, Limit, Verdict};
use crate::limit::{Clock, KeyCtx, SystemClock, TrustedProxies};
use crate::{problem, route};

/// Where a route sends admitted requests.
pub enum Target {
    Http(Box<HttpForwarder>),
    Respond(crate::config::Responder),
}

pub struct Proxy {
    pub config: Arc<Config>,
    targets: Vec<Arc<Target>>,
    /// One per route, same index.
    gates: Vec<Gate>,
    trusted: TrustedProxies,
    clock: Arc<dyn Clock>,
}

impl Proxy {
    /// Compiles `config` with the system clock and fresh limiter state.
    pub fn new(config: Config) -> Proxy {
        Proxy::with_clock(config, Arc::new(SystemClock))
    }

    /// Compiles `config`; limits read time from `clock` (tests pass a manual clock).
    pub fn with_clock(config: Config, clock: Arc<dyn Clock>) -> Proxy {
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
        let gates = config.routes.iter().map(|r| Gate::new(r, &mut Limit::local_store)).collect();
        let trusted = TrustedProxies::new(config.trusted_proxies.clone());
        Proxy { config: Arc::new(config), targets, gates, trusted, clock }
    }

    pub fn gates(&self) -> &[Gate] {
        &self.gates
    }

    /// Serves one request. Never fails: every problem is an HTTP answer.
    pub async fn handle(&self, mut req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let routes = &self.config.routes;
        let Some(idx) = route::find(routes, req.method(), req.uri(), req.headers()) else {
            return problem::no_route(req.method(), req.uri().path());
        };
        let route = &routes[idx];
        let gate = &self.gates[idx];
        let mut admission = None;
        if !gate.is_open() {
            let (parts, body) = req.into_parts();
            let client_ip = self.trusted.client_ip(peer.ip(), &parts.headers);
            let ctx = KeyCtx { route: &route.name, client_ip, parts: &parts };
            match gate.check(&ctx, self.clock.now()).await {
                Verdict::Reject(resp) => return resp,
                Verdict::Admit(a) => {
                    if !a.wait.is_zero() {
                        tokio::time::sleep(a.wait).await;
                    }
                    admission = Some(a);
                }
            }
            req = Request::from_parts(parts, body);
        }
        let mut resp = match &*self.targets[route.upstream] {
            Target::Respond(r) => forward::respond(r).await,
            Target::Http(fwd) => {
                let down = Downstream { peer: peer.ip(), peer_trusted: self.trusted.is_trusted(peer.ip()) };
                let path = req.uri().path();
                let strip = path.len() - route::upstream_path(route, path).len();
                fwd.forward(req, strip, &down).await.0
            }
        };
        if let Some(mut a) = admission {
            gate.decorate(&mut a, &mut resp);
            if let Some(permit) = a.permit {
                resp.body_mut().hold(permit);
            }
        }
        resp
    }
}
