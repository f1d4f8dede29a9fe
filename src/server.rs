//! The listener: HTTP/1.1 and h2c (prior knowledge) on one port, with a header-read
//! timeout, a request-head size limit and graceful shutdown. Entry point is [`serve`],
//! which takes a bound listener and a shutdown future so tests can bind port 0.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper::Response;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::body::Body;
use crate::config::ServerConfig;
use crate::proxy::Proxy;

/// The live proxy; a reload stores a new one, requests in flight keep the one they loaded.
pub type Shared = Arc<ArcSwap<Proxy>>;

fn builder(cfg: &ServerConfig) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    // The header-read timeout is armed for every request: a long one on the coarse clock.
    if cfg.header_read_timeout >= crate::timer::COARSE_FROM {
        b.http1().timer(crate::timer::CoarseTimer);
    } else {
        b.http1().timer(TokioTimer::new());
    }
    b.http1()
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size(cfg.max_header_bytes)
        // One write per small response instead of writev (measured: a small win).
        .writev(false)
        .keep_alive(true);
    b.http2().timer(TokioTimer::new()).max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX));
    b
}

/// Serves connections from `listener` until `shutdown` resolves, then stops accepting and
/// gives open connections the configured grace period to finish.
pub async fn serve(listener: TcpListener, proxy: Shared, shutdown: impl Future<Output = ()>) {
    let cfg = proxy.load().config.server.clone();
    let builder = builder(&cfg);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let proxy = proxy.clone();
        let service = service_fn(move |req| Answer { inner: proxy.load_full().handle(req, peer) });
        let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tracing::info!(grace = ?cfg.grace_period, "shutting down: no new connections, finishing in-flight requests");
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections closed"),
        () = tokio::time::sleep(cfg.grace_period) => tracing::warn!("grace period over, closing remaining connections"),
    }
}

pin_project_lite::pin_project! {
    /// A request's future as hyper's service wants it: never an error. Not an `async`
    /// block, which would hold the request twice (see [`Proxy::handle`]).
    struct Answer<F> {
        #[pin]
        inner: F,
    }
}

impl<F: Future<Output = Response<Body>>> Future for Answer<F> {
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx).map(Ok)
    }
}
