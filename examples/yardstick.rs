//! The yardstick of issue 15: the smallest hyper proxy that does what tollgate's hot path
//! must do, so that tollgate's own cost can be told from hyper's and tokio's. Not part of
//! the product: it has no config, no routing, no error model and no timeouts.
//!
//! It is what `shared/reference/hyper-performance.md` measured as its best variant: one
//! thread, mimalloc, `writev(false)` on both sides, HTTP/1.1 to the upstream through
//! `hyper::client::conn::http1` with the connection's future spawned, a per-client-IP token
//! bucket (a mutex-held map and a clock read) on the path, hop-by-hop fields stripped both
//! ways, and `X-Forwarded-For`, `X-Forwarded-Proto` and `Via` added.
//!
//! It reads the environment of the benchmark harness (`shared/bench/run.sh`), so it runs as
//! its candidate and under `benches/instr.sh` like `tollgate bench`:
//! `UPSTREAM_ADDR`, `LISTEN_ADDR`, `REJECT_PORT` (with `REJECT_RATE`/s and `REJECT_BURST`),
//! `H2_PORT` (h2c with prior knowledge). `YARD_UPSTREAM=conn` gives every client connection
//! its own upstream connection instead of taking one from a small shared idle pool (the
//! default). `YARD_BARE=1` leaves out the limiter and the header work.
//!
//! ```sh
//! cargo build --release --example yardstick
//! N=10000 benches/instr.sh target/release/examples/yardstick target/release/tollgate
//! ```

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Conn = SendRequest<Incoming>;

/// A per-client-IP token bucket as GCRA: one theoretical arrival time per address.
struct Bucket {
    tat: Mutex<HashMap<IpAddr, u64>>,
    interval_ns: u64,
    tolerance_ns: u64,
    start: Instant,
}

impl Bucket {
    fn new(per_sec: u64, burst: u64) -> Bucket {
        let interval_ns = 1_000_000_000 / per_sec.max(1);
        Bucket {
            tat: Mutex::new(HashMap::new()),
            interval_ns,
            tolerance_ns: interval_ns * burst,
            start: Instant::now(),
        }
    }

    /// `Ok` to admit, `Err(seconds)` to wait.
    fn admit(&self, ip: IpAddr) -> Result<(), u64> {
        let now = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut map = self.tat.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let tat = map.entry(ip).or_insert(now);
        let next = (*tat).max(now) + self.interval_ns;
        if next - now > self.tolerance_ns {
            return Err((next - now - self.tolerance_ns).div_ceil(1_000_000_000).max(1));
        }
        *tat = next;
        Ok(())
    }
}

/// Idle upstream connections shared by every client connection.
struct Pool {
    idle: Mutex<Vec<Conn>>,
    addr: String,
}

impl Pool {
    async fn connect(addr: &str) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (send, conn) = hyper::client::conn::http1::Builder::new()
            .writev(false)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        Ok(send)
    }

    async fn checkout(&self) -> std::io::Result<Conn> {
        loop {
            let popped = self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
            match popped {
                Some(mut c) => {
                    if c.ready().await.is_ok() {
                        return Ok(c);
                    }
                }
                None => return Pool::connect(&self.addr).await,
            }
        }
    }

    fn put(&self, conn: Conn) {
        if !conn.is_closed() {
            self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(conn);
        }
    }
}

/// Where this client connection's upstream connection comes from.
enum Upstream {
    /// The shared pool; a connection goes back when the response body ends.
    Pool(Arc<Pool>),
    /// This client connection's own, made on its first request.
    Own(Arc<tokio::sync::Mutex<Option<Conn>>>, String),
}

/// A response body that gives its pooled connection back when it ends.
struct Returning {
    inner: Incoming,
    back: Option<(Arc<Pool>, Conn)>,
}

impl http_body::Body for Returning {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => self.inner.is_end_stream(),
            Poll::Ready(Some(Err(_))) => {
                self.back = None;
                false
            }
            Poll::Pending => false,
        };
        if ended {
            if let Some((pool, conn)) = self.back.take() {
                pool.put(conn);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

type Body = http_body_util::Either<Returning, http_body_util::Full<Bytes>>;

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

fn strip_hop_by_hop(h: &mut HeaderMap) {
    for name in
        [header::CONNECTION, KEEP_ALIVE, header::TE, header::TRAILER, header::TRANSFER_ENCODING, header::UPGRADE]
    {
        if h.contains_key(&name) {
            h.remove(name);
        }
    }
}

fn status(code: StatusCode, body: &'static str) -> Response<Body> {
    let mut resp =
        Response::new(http_body_util::Either::Right(http_body_util::Full::new(Bytes::from_static(body.as_bytes()))));
    *resp.status_mut() = code;
    resp
}

async fn handle(
    mut req: Request<Incoming>,
    peer: IpAddr,
    bucket: Option<Arc<Bucket>>,
    upstream: &Upstream,
) -> Response<Body> {
    if let Some(b) = &bucket {
        if let Err(secs) = b.admit(peer) {
            let mut resp = status(StatusCode::TOO_MANY_REQUESTS, "too many requests\n");
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
            return resp;
        }
        let h = req.headers_mut();
        strip_hop_by_hop(h);
        let mut xff = String::with_capacity(16);
        use std::fmt::Write;
        let _ = write!(xff, "{peer}");
        if let Ok(v) = HeaderValue::try_from(xff) {
            h.append(HeaderName::from_static("x-forwarded-for"), v);
        }
        h.insert(HeaderName::from_static("x-forwarded-proto"), HeaderValue::from_static("http"));
        h.append(header::VIA, HeaderValue::from_static("1.1 yardstick"));
    }
    if let Some(pq) = req.uri().path_and_query().cloned() {
        *req.uri_mut() = Uri::from(pq);
    }
    *req.version_mut() = http::Version::HTTP_11;
    let sent = match upstream {
        Upstream::Pool(pool) => match pool.checkout().await {
            Ok(mut conn) => conn.send_request(req).await.map(|r| (r, Some((pool.clone(), conn)))),
            Err(_) => return status(StatusCode::BAD_GATEWAY, "upstream unreachable\n"),
        },
        Upstream::Own(slot, addr) => {
            let mut slot = slot.lock().await;
            if slot.as_ref().is_none_or(SendRequest::is_closed) {
                match Pool::connect(addr).await {
                    Ok(c) => *slot = Some(c),
                    Err(_) => return status(StatusCode::BAD_GATEWAY, "upstream unreachable\n"),
                }
            }
            let Some(conn) = slot.as_mut() else { return status(StatusCode::BAD_GATEWAY, "no connection\n") };
            if conn.ready().await.is_err() {
                return status(StatusCode::BAD_GATEWAY, "upstream closed\n");
            }
            conn.send_request(req).await.map(|r| (r, None))
        }
    };
    match sent {
        Ok((resp, back)) => {
            let (mut parts, inner) = resp.into_parts();
            if bucket.is_some() {
                strip_hop_by_hop(&mut parts.headers);
                parts.headers.append(header::VIA, HeaderValue::from_static("1.1 yardstick"));
            }
            Response::from_parts(parts, http_body_util::Either::Left(Returning { inner, back }))
        }
        Err(_) => status(StatusCode::BAD_GATEWAY, "upstream failed\n"),
    }
}

async fn serve(listener: TcpListener, upstream_addr: String, bucket: Option<Arc<Bucket>>, h2: bool, own: bool) {
    let pool = Arc::new(Pool { idle: Mutex::new(Vec::new()), addr: upstream_addr.clone() });
    loop {
        let Ok((stream, peer)) = listener.accept().await else { continue };
        let _ = stream.set_nodelay(true);
        let upstream = Arc::new(if own {
            Upstream::Own(Arc::new(tokio::sync::Mutex::new(None)), upstream_addr.clone())
        } else {
            Upstream::Pool(pool.clone())
        });
        let bucket = bucket.clone();
        let peer: SocketAddr = peer;
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let (bucket, upstream) = (bucket.clone(), upstream.clone());
                async move { Ok::<_, Infallible>(handle(req, peer.ip(), bucket, &upstream).await) }
            });
            let io = TokioIo::new(stream);
            if h2 {
                let _ =
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new()).serve_connection(io, service).await;
            } else {
                let _ = hyper::server::conn::http1::Builder::new().writev(false).serve_connection(io, service).await;
            }
        });
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let upstream = env("UPSTREAM_ADDR").ok_or("UPSTREAM_ADDR is not set")?;
    let listen = env("LISTEN_ADDR").ok_or("LISTEN_ADDR is not set")?;
    let host = listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h).to_owned();
    let bare = env("YARD_BARE").is_some_and(|v| v == "1");
    let own = env("YARD_UPSTREAM").is_some_and(|v| v == "conn");
    let pass = (!bare).then(|| Arc::new(Bucket::new(1_000_000_000, 100_000_000)));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let mut listeners = vec![(TcpListener::bind(&listen).await?, pass.clone(), false)];
        if let Some(port) = env("REJECT_PORT") {
            let rate = env("REJECT_RATE").map_or(Ok(1000), |r| r.parse())?;
            let burst = env("REJECT_BURST").map_or(Ok(100), |b| b.parse())?;
            let bucket = Some(Arc::new(Bucket::new(rate, burst)));
            listeners.push((TcpListener::bind(format!("{host}:{port}")).await?, bucket, false));
        }
        if let Some(port) = env("H2_PORT") {
            listeners.push((TcpListener::bind(format!("{host}:{port}")).await?, pass, true));
        }
        for (listener, bucket, h2) in listeners {
            tokio::spawn(serve(listener, upstream.clone(), bucket, h2, own));
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        Ok(())
    })
}
