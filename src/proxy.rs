//! The compiled configuration that serves requests: routes in order and their targets.
//! A [`Proxy`] is immutable; a reload builds a new one and swaps it in whole.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use crate::body::Body;
use crate::config::{Config, UpstreamKind};
use crate::forward::{self, Downstream, HttpForwarder};
use crate::{problem, route};

/// Where a route sends admitted requests.
pub enum Target {
    Http(Box<HttpForwarder>),
    Respond(crate::config::Responder),
}

pub struct Proxy {
    pub config: Arc<Config>,
    targets: Vec<Arc<Target>>,
}

impl Proxy {
    pub fn new(config: Config) -> Proxy {
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
        Proxy { config: Arc::new(config), targets }
    }

    fn peer_trusted(&self, peer: &SocketAddr) -> bool {
        let ip = peer.ip();
        self.config.trusted_proxies.iter().any(|net| net.contains(&ip))
    }

    /// Serves one request. Never fails: every problem is an HTTP answer.
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let routes = &self.config.routes;
        let Some(idx) = route::find(routes, req.method(), req.uri(), req.headers()) else {
            return problem::no_route(req.method(), req.uri().path());
        };
        let route = &routes[idx];
        match &*self.targets[route.upstream] {
            Target::Respond(r) => forward::respond(r).await,
            Target::Http(fwd) => {
                let down = Downstream { peer: peer.ip(), peer_trusted: self.peer_trusted(&peer) };
                let path = req.uri().path();
                let strip = path.len() - route::upstream_path(route, path).len();
                fwd.forward(req, strip, &down).await.0
            }
        }
    }
}
