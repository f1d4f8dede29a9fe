//! The slow upstream: `workers` slots, each holding a request for `service` before its answer,
//! and an unbounded FIFO queue in front of them. Its capacity is `workers / service` a second;
//! past it the queue, and the latency, grow without bound. A request's work is a task of its
//! own, so it is done even when the client stopped waiting: the storm's mechanism.
//!
//! It listens on two ports (two app servers sharing one pool, as two servers in front of one
//! database), so that a proxy's group can retry on "another server" that is the same capacity.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};

use crate::series::Series;

/// What the upstream counted, per second since the run's start.
pub struct Counts {
    /// Requests that reached it (its offered load).
    pub arrivals: Series,
    /// Requests whose work it finished (whether anybody still waited or not).
    pub completions: Series,
}

/// How long a request holds its slot: `service`, times `factor` in the slowdown's window
/// (a database that got slower: the capacity falls by that factor).
#[derive(Clone, Copy, Debug)]
pub struct Service {
    pub service: Duration,
    pub start: Instant,
    pub slow_at: Duration,
    pub slow_for: Duration,
    pub factor: f64,
}

impl Service {
    fn now(&self) -> Duration {
        let t = self.start.elapsed();
        if t >= self.slow_at && t < self.slow_at + self.slow_for {
            self.service.mul_f64(self.factor.max(0.0))
        } else {
            self.service
        }
    }
}

/// Serves on `ports` until the runtime ends.
///
/// # Errors
/// A port could not be bound.
pub async fn serve(ports: &[u16], workers: usize, service: Service, counts: Arc<Counts>) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(workers));
    for &port in ports {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
        let (slots, counts) = (slots.clone(), counts.clone());
        tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    // Out of descriptors, most likely: wait for some to close instead of spinning.
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (slots, counts) = (slots.clone(), counts.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |_req: Request<hyper::body::Incoming>| {
                        let (slots, counts) = (slots.clone(), counts.clone());
                        async move {
                            counts.arrivals.add(1);
                            let (tx, rx) = oneshot::channel();
                            // The work: a slot in FIFO order (tokio's semaphore is fair), then
                            // `service` in it. Not tied to this connection: done either way.
                            tokio::spawn(async move {
                                let Ok(_slot) = slots.acquire().await else { return };
                                tokio::time::sleep(service.now()).await;
                                counts.completions.add(1);
                                let _ = tx.send(());
                            });
                            let _ = rx.await;
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok\n"))))
                        }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        });
    }
    Ok(())
}
