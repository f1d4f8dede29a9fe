//! Test helpers: an in-process tollgate on 127.0.0.1:0, real hyper upstreams, real clients.
#![allow(dead_code)]

pub mod browser;
pub mod jwt;
pub mod process;
pub mod raw;
pub mod redis;
pub mod tls;
pub mod vectors;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tollgate::config::Config;
use tollgate::Proxy;

pub type BoxBody = http_body_util::combinators::BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

pub fn full(data: impl Into<Bytes>) -> BoxBody {
    Full::new(data.into()).map_err(|never| match never {}).boxed()
}

/// A body of `total` bytes produced in 64 KiB chunks, never held whole.
pub fn generated(total: usize) -> BoxBody {
    let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
    let n = total / chunk.len();
    let frames = futures_util::stream::iter((0..n).map(move |_| Ok(hyper::body::Frame::data(chunk.clone()))));
    http_body_util::StreamBody::new(frames).boxed()
}

/// A running tollgate; dropping it without `shutdown` aborts it.
pub struct Tollgate {
    pub addr: SocketAddr,
    /// Every listener's address, in the config's order (`addr` is the first).
    pub addrs: Vec<SocketAddr>,
    pub shared: tollgate::Shared,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Tollgate {
    pub async fn start(yaml: &str) -> Tollgate {
        let config = Config::from_yaml(Path::new("test.yaml"), yaml).unwrap_or_else(|e| panic!("test config: {e}"));
        Tollgate::start_config(config).await
    }

    /// Starts with limits reading time from `clock`.
    pub async fn start_with_clock(yaml: &str, clock: tollgate::limit::ManualClock) -> Tollgate {
        let config = Config::from_yaml(Path::new("test.yaml"), yaml).unwrap_or_else(|e| panic!("test config: {e}"));
        Tollgate::start_proxy(Proxy::with_clock(config, Arc::new(clock))).await
    }

    pub async fn start_config(config: Config) -> Tollgate {
        Tollgate::start_proxy(Proxy::new(config)).await
    }

    pub async fn start_proxy(proxy: Proxy) -> Tollgate {
        // Every listener of the config on its own 127.0.0.1:0.
        let mut listeners = Vec::new();
        for _ in 0..proxy.config.listeners.len().max(1) {
            listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
        }
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let shared = Arc::new(ArcSwap::from_pointee(proxy));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(tollgate::serve_all(listeners, shared.clone(), async move {
            let _ = rx.await;
        }));
        Tollgate { addr: addrs[0], addrs, shared, stop: Some(tx), task: Some(task) }
    }

    /// Starts the admin listener for this proxy on 127.0.0.1:0.
    pub async fn start_admin(&self) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ready = Arc::new(tollgate::Readiness::default());
        ready.set_listening(true);
        tokio::spawn(tollgate::serve_admin(listener, self.shared.clone(), ready, std::future::pending()));
        addr
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Signals shutdown and returns the server task, which ends once connections drain.
    pub fn shutdown(&mut self) -> JoinHandle<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.take().expect("shut down twice")
    }
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

type Handler = Arc<dyn Fn(Request<Incoming>) -> Pin<Box<dyn Future<Output = Response<BoxBody>> + Send>> + Send + Sync>;

/// A real hyper HTTP/1.1 upstream on 127.0.0.1:0 running `handler` for every request.
pub struct Upstream {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
    /// Open connections, closed on drop so a dropped upstream is really gone.
    conns: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
}

impl Upstream {
    pub async fn start<F, Fut>(handler: F) -> Upstream
    where
        F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<BoxBody>> + Send + 'static,
    {
        Upstream::start_on("127.0.0.1:0".parse().unwrap(), handler).await
    }

    /// As [`Upstream::start`], on `addr` (a port a dropped upstream just left: retried
    /// until the old socket is gone).
    pub async fn start_on<F, Fut>(addr: SocketAddr, handler: F) -> Upstream
    where
        F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<BoxBody>> + Send + 'static,
    {
        let handler: Handler = Arc::new(move |req| Box::pin(handler(req)));
        let mut tries = 0;
        let listener = loop {
            match TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(e) if tries < 100 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => panic!("cannot bind {addr}: {e}"),
            }
        };
        let addr = listener.local_addr().unwrap();
        let conns: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let tracked = conns.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let handler = handler.clone();
                let mut list = tracked.lock().unwrap();
                list.retain(|t| !t.is_finished());
                list.push(tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let handler = handler.clone();
                        async move { Ok::<_, Infallible>(handler(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .with_upgrades()
                        .await;
                }));
            }
        });
        Upstream { addr, task, conns }
    }

    /// Answers 200 with `body` to everything.
    pub async fn fixed(body: &'static str) -> Upstream {
        Upstream::start(move |_req| async move { Response::new(full(body)) }).await
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

/// An HTTP/1.1 connection to `addr` with hyper's client (no header rewriting of its own).
pub async fn h1(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<BoxBody> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    send
}

/// An HTTP/2 prior-knowledge (h2c) connection to `addr`.
pub async fn h2(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<BoxBody> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    send
}

/// GET `path` on a fresh HTTP/1.1 connection; returns status, headers and the whole body.
pub async fn get(addr: SocketAddr, path: &str) -> (http::StatusCode, http::HeaderMap, Bytes) {
    get_with(addr, path, &[]).await
}

/// GET `path` with extra request headers.
pub async fn get_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (http::StatusCode, http::HeaderMap, Bytes) {
    let mut send = h1(addr).await;
    let mut req = Request::get(path);
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
        req = req.header("host", "localhost");
    }
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let resp = send.send_request(req.body(full("")).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, body)
}

/// A config with one upstream `up` at `addr` plus `extra` YAML lines appended to the route list.
pub fn proxy_yaml(upstream: SocketAddr, upstream_extra: &str, routes: &str) -> String {
    format!("listen: 127.0.0.1:0\nupstreams:\n  up:\n    url: http://{upstream}\n{upstream_extra}routes:\n{routes}")
}

/// Upstream `app`: a group whose first server refuses connections (a port nothing listens on)
/// and whose second is `live`, round robin, a connect failure retried once; route `api` to it.
pub fn dead_then_live_group(live: SocketAddr) -> String {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    format!(
        "upstreams:
  app:
    servers: [{{ url: 'http://{dead}' }}, {{ url: 'http://{live}' }}]
    balance: round_robin
    retry: {{ attempts: 2, on: [connect_failure], budget: {{ min_per_s: 100 }} }}
    outlier: {{ consecutive_failures: 0 }}
routes: [{{ name: api, upstream: app }}]
"
    )
}
