//! Connections of listeners that are not plain HTTP: the `listen` room's edge steps (PROXY
//! header, TLS) first, then HTTP with the [`Peer`](crate::peer::Peer) they made, or the
//! HTTPS redirect. Kept apart from the plain path, which never comes here.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http::{HeaderValue, Response};
use hyper::service::service_fn;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpStream;

use super::{connection as plain_connection, detect, h2, serve_io, Answer, BodyOut, Serves, Settings, Stop};
use crate::body::Body;
use crate::config::Config;
use crate::listen::Stream;
use crate::proxy::Shared;

/// A connection of a listener that is not plain HTTP: its edge steps (PROXY header, TLS),
/// then HTTP with the [`Peer`](crate::peer::Peer) they made, or the HTTPS redirect.
pub(super) async fn connection(
    stream: TcpStream,
    socket: SocketAddr,
    idx: usize,
    settings: Arc<Settings>,
    stop: Stop,
    proxy: Shared,
) {
    let accepted = Instant::now();
    let now = proxy.load_full();
    let Some(listener) = now.config.listeners.get(idx) else { return };
    let trusted = now.is_trusted(socket.ip());
    let header_timeout = settings.cfg.header_read_timeout;
    let tls = now.listener_tls(idx);
    let edge =
        crate::listen::edge(stream, socket, listener, tls, trusted, accepted, header_timeout, &settings.metrics.edge);
    let Some((stream, peer)) = edge.await else { return };
    let redirect = listener.redirect_https.then(|| https_port(&now.config));
    // Rendered once per connection of an HTTP/3 listener, added to each of its answers.
    let alt_svc = listener.http3.as_ref().map(|_| alt_svc(listener.addr.port(), socket_port(&stream)));
    // A plain listener answers ACME HTTP-01 validations before redirecting or routing; other
    // listeners' services pay nothing for it.
    let acme_http = listener.acme_http;
    drop(now);
    let served = match redirect {
        Some(port) if acme_http => {
            let service = service_fn(move |req| match challenge(&proxy, &req) {
                Some(inner) => ChallengeOr::Challenge { inner },
                None => ChallengeOr::Other { inner: std::future::ready(Ok(proxy.load().redirect_https(req, port))) },
            });
            serve_stream(stream, accepted, settings, stop, service).await
        }
        Some(port) => {
            let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                // A body the redirect does not read ends an HTTP/1 connection: announced (see
                // `crate::body::unread`), so that the client's next request goes on a new one.
                let unread = req.version() < http::Version::HTTP_2 && !http_body::Body::is_end_stream(req.body());
                let mut resp = proxy.load().redirect_https(req, port);
                if unread {
                    resp.headers_mut().insert(http::header::CONNECTION, HeaderValue::from_static("close"));
                }
                std::future::ready(Ok::<_, Infallible>(resp))
            });
            serve_stream(stream, accepted, settings, stop, service).await
        }
        None if acme_http => {
            let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| match challenge(&proxy, &req) {
                Some(inner) => ChallengeOr::Challenge { inner },
                None => {
                    ChallengeOr::Other { inner: Answer { inner: proxy.load_full().handle_peer(req, peer.clone()) } }
                }
            });
            serve_stream(stream, accepted, settings, stop, service).await
        }
        None => match alt_svc {
            None => {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| Answer {
                    inner: proxy.load_full().handle_peer(req, peer.clone()),
                });
                serve_stream(stream, accepted, settings, stop, service).await
            }
            Some(value) => {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| AltSvc {
                    inner: Answer { inner: proxy.load_full().handle_peer(req, peer.clone()) },
                    value: value.clone(),
                });
                serve_stream(stream, accepted, settings, stop, service).await
            }
        },
    };
    if let Err(e) = served {
        tracing::debug!(%socket, error = %e, "connection ended with an error");
    }
}

/// The answer of an ACME HTTP-01 validation request, if `req` is one.
fn challenge<B>(
    proxy: &Shared,
    req: &hyper::Request<B>,
) -> Option<Pin<Box<dyn Future<Output = Response<Body>> + Send>>> {
    let token = crate::acme::http01_token(req)?.to_owned();
    Some(Box::pin(crate::acme::answer_http01(proxy.load_full(), token)))
}

pin_project_lite::pin_project! {
    /// An ACME validation's answer, or the listener's own.
    #[project = ChallengeOrProj]
    enum ChallengeOr<F> {
        Challenge { inner: Pin<Box<dyn Future<Output = Response<Body>> + Send>> },
        Other { #[pin] inner: F },
    }
}

impl<F: Future<Output = Result<Response<Body>, Infallible>>> Future for ChallengeOr<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        match self.project() {
            ChallengeOrProj::Challenge { inner } => inner.as_mut().poll(cx).map(Ok),
            ChallengeOrProj::Other { inner } => inner.poll(cx),
        }
    }
}

/// `Alt-Svc` naming HTTP/3 on the listener's port (the bound one when the config says 0).
fn alt_svc(configured: u16, bound: Option<u16>) -> HeaderValue {
    let port = if configured == 0 { bound.unwrap_or(0) } else { configured };
    HeaderValue::try_from(format!("h3=\":{port}\"; ma=86400")).unwrap_or(HeaderValue::from_static("clear"))
}

fn socket_port(stream: &Stream) -> Option<u16> {
    let tcp = match stream {
        Stream::Plain(s) => s,
        Stream::Tls(s) => s.get_ref().0,
    };
    tcp.local_addr().ok().map(|a| a.port())
}

pin_project_lite::pin_project! {
    /// An answer of an HTTP/3 listener's TCP side, with `Alt-Svc` on.
    struct AltSvc<F> {
        #[pin]
        inner: F,
        value: HeaderValue,
    }
}

impl<F: Future<Output = Result<hyper::Response<B>, Infallible>>, B> Future for AltSvc<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        this.inner.poll(cx).map(|r| {
            r.map(|mut resp| {
                resp.headers_mut().insert(http::header::ALT_SVC, this.value.clone());
                resp
            })
        })
    }
}

/// The port HTTPS redirects name: the first TLS listener's (443 when there is none).
fn https_port(config: &Config) -> u16 {
    config.listeners.iter().find(|l| l.tls.is_some()).map_or(443, |l| l.addr.port())
}

async fn serve_stream<S, B>(
    stream: Stream,
    accepted: Instant,
    settings: Arc<Settings>,
    stop: Stop,
    service: S,
) -> Result<(), hyper::Error>
where
    S: Serves<B>,
    B: BodyOut,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<h2::StreamFuture<S::Future>, h2::Counted<B>>,
{
    match stream {
        Stream::Plain(s) => plain_connection(s, accepted, settings, stop, service).await,
        Stream::Tls(s) => {
            // ALPN decides; a client that offered none speaks HTTP/1.1.
            let proto =
                if s.get_ref().1.alpn_protocol() == Some(b"h2") { detect::Proto::Http2 } else { detect::Proto::Http1 };
            serve_io(s, [0; detect::PREFACE.len()], 0, proto, accepted, settings, stop, service).await
        }
    }
}
