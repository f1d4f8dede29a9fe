//! gRPC end to end: a real tonic client through tollgate to a real tonic service on an h2c
//! upstream (`protocol: h2c`). No protoc: the messages are written with prost's derive and
//! the service is tonic's server-side `Grpc` under a hyper HTTP/2 server.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use http::uri::PathAndQuery;
use http::{Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tollgate::limit::{ManualClock, Timestamp};
use tonic::{Code, Status};

use crate::support::tls::{y, Ca, Dir};
use crate::support::{full, Tollgate};

#[derive(Clone, PartialEq, prost::Message)]
struct Num {
    #[prost(int64, tag = "1")]
    n: i64,
}

type Codec = tonic_prost::ProstCodec<Num, Num>;
type NumStream = Pin<Box<dyn Stream<Item = Result<Num, Status>> + Send>>;

/// The service: `Add` (unary: n + 1; n < 0 fails with INVALID_ARGUMENT and a trailer of its
/// own), `Count` (server streaming: 0..n), `Sum` (client streaming), `Echo` (bidi), `Slow`
/// (answers after a minute).
struct Service {
    addr: SocketAddr,
    task: JoinHandle<()>,
    /// Connections accepted.
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn route(req: Request<hyper::body::Incoming>) -> http::Response<tonic::body::Body> {
    let path = req.uri().path().to_owned();
    match path.as_str() {
        "/t.T/Add" => {
            let svc = tower::service_fn(|r: tonic::Request<Num>| async move {
                let n = r.into_inner().n;
                if n < 0 {
                    let mut status = Status::invalid_argument("negative");
                    status.metadata_mut().insert("x-why", "below-zero".parse().unwrap());
                    return Err(status);
                }
                let mut resp = tonic::Response::new(Num { n: n + 1 });
                resp.metadata_mut().insert("x-served-by", "upstream".parse().unwrap());
                Ok(resp)
            });
            tonic::server::Grpc::new(Codec::default()).unary(svc, req).await
        }
        "/t.T/Count" => {
            let svc = tower::service_fn(|r: tonic::Request<Num>| async move {
                let n = r.into_inner().n;
                let s: NumStream = Box::pin(futures_util::stream::iter((0..n).map(|i| Ok(Num { n: i }))));
                Ok::<_, Status>(tonic::Response::new(s))
            });
            tonic::server::Grpc::new(Codec::default()).server_streaming(svc, req).await
        }
        "/t.T/Sum" => {
            let svc = tower::service_fn(|r: tonic::Request<tonic::Streaming<Num>>| async move {
                let mut s = r.into_inner();
                let mut total = 0;
                while let Some(m) = s.next().await {
                    total += m?.n;
                }
                Ok::<_, Status>(tonic::Response::new(Num { n: total }))
            });
            tonic::server::Grpc::new(Codec::default()).client_streaming(svc, req).await
        }
        "/t.T/Echo" => {
            let svc = tower::service_fn(|r: tonic::Request<tonic::Streaming<Num>>| async move {
                let s: NumStream = Box::pin(r.into_inner().map(|m| m.map(|m| Num { n: m.n * 10 })));
                Ok::<_, Status>(tonic::Response::new(s))
            });
            tonic::server::Grpc::new(Codec::default()).streaming(svc, req).await
        }
        "/t.T/Slow" => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Status::internal("too late").into_http()
        }
        _ => Status::unimplemented(path).into_http(),
    }
}

impl Service {
    async fn start() -> Service {
        Service::serve(None).await
    }

    /// Over TLS (ALPN `h2`), with a certificate `ca` issued for `grpc.internal`.
    async fn start_tls(ca: &Ca) -> Service {
        let cert = ca.issue(&["grpc.internal"]);
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.der.clone()], cert.key())
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Service::serve(Some(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)))).await
    }

    async fn serve(tls: Option<tokio_rustls::TlsAcceptor>) -> Service {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = std::sync::Arc::<std::sync::atomic::AtomicUsize>::default();
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|req| async move { Ok::<_, Infallible>(route(req).await) });
                    let h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                    let _ = match tls {
                        None => h2.serve_connection(TokioIo::new(stream), svc).await,
                        Some(tls) => {
                            let Ok(stream) = tls.accept(stream).await else { return };
                            h2.serve_connection(TokioIo::new(stream), svc).await
                        }
                    };
                });
            }
        });
        Service { addr, task, accepted }
    }
}

fn yaml(up: &Service, route_extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nupstreams:\n  g: {{ url: 'http://{}', protocol: h2c, h2: {{ max_streams_per_connection: 2 \
         }} }}\nroutes:\n  - name: grpc\n    upstream: g\n{route_extra}",
        up.addr
    )
}

async fn client(tg: &Tollgate) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", tg.addr)).unwrap().connect().await;
    let mut grpc = tonic::client::Grpc::new(channel.unwrap());
    grpc.ready().await.unwrap();
    grpc
}

/// A tonic client takes a call only once it said it is ready.
async fn ready(
    g: &mut tonic::client::Grpc<tonic::transport::Channel>,
) -> &mut tonic::client::Grpc<tonic::transport::Channel> {
    g.ready().await.unwrap();
    g
}

fn path(p: &'static str) -> PathAndQuery {
    PathAndQuery::from_static(p)
}

#[tokio::test]
async fn unary_calls_pass_with_headers_and_trailers() {
    let up = Service::start().await;
    let tg = Tollgate::start(&yaml(&up, "")).await;
    let mut grpc = client(&tg).await;
    let resp = ready(&mut grpc)
        .await
        .unary(tonic::Request::new(Num { n: 41 }), path("/t.T/Add"), Codec::default())
        .await
        .unwrap();
    assert_eq!(resp.metadata().get("x-served-by").unwrap(), "upstream");
    assert!(resp.metadata().get("via").unwrap().to_str().unwrap().contains("tollgate"));
    assert_eq!(resp.into_inner().n, 42);
    // The status, its message and the upstream's own trailer come back in the trailers.
    let e = ready(&mut grpc)
        .await
        .unary(tonic::Request::new(Num { n: -1 }), path("/t.T/Add"), Codec::default())
        .await
        .unwrap_err();
    assert_eq!((e.code(), e.message()), (Code::InvalidArgument, "negative"));
    assert_eq!(e.metadata().get("x-why").unwrap(), "below-zero");
}

#[tokio::test]
async fn streaming_calls_of_every_kind_pass() {
    let up = Service::start().await;
    let tg = Tollgate::start(&yaml(&up, "")).await;
    let mut grpc = client(&tg).await;

    let resp = ready(&mut grpc).await.server_streaming(
        tonic::Request::new(Num { n: 500 }),
        path("/t.T/Count"),
        Codec::default(),
    );
    let got: Vec<i64> = resp.await.unwrap().into_inner().map(|m| m.unwrap().n).collect().await;
    assert_eq!(got, (0..500).collect::<Vec<_>>());

    let input = futures_util::stream::iter((1..=100).map(|n| Num { n }));
    let resp =
        ready(&mut grpc).await.client_streaming(tonic::Request::new(input), path("/t.T/Sum"), Codec::default()).await;
    assert_eq!(resp.unwrap().into_inner().n, 5050);

    // Bidirectional: each answer arrives before the next message is sent.
    echo_in_turns(&mut grpc, 20).await;
    // Several calls at once share few upstream connections (2 streams each at most).
    let calls =
        (0..6).map(|i| {
            let mut g = grpc.clone();
            async move {
                ready(&mut g).await.unary(tonic::Request::new(Num { n: i }), path("/t.T/Add"), Codec::default()).await
            }
        });
    for (i, r) in futures_util::future::join_all(calls).await.into_iter().enumerate() {
        assert_eq!(r.unwrap().into_inner().n, i as i64 + 1);
    }
    let conns = up.accepted.load(std::sync::atomic::Ordering::Relaxed);
    assert!((1..=4).contains(&conns), "{conns} upstream connections for 10 calls (h2.max_connections is 4)");
}

/// A bidirectional call to `/t.T/Echo` of `rounds` messages, each sent only once the answer
/// to the one before arrived; the stream ends with the OK trailers.
async fn echo_in_turns(grpc: &mut tonic::client::Grpc<tonic::transport::Channel>, rounds: i64) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Num>(1);
    let resp =
        ready(grpc).await.streaming(tonic::Request::new(tokio_stream_from(rx)), path("/t.T/Echo"), Codec::default());
    tx.send(Num { n: 1 }).await.unwrap();
    let mut answers = resp.await.unwrap().into_inner();
    for n in 1..=rounds {
        if n > 1 {
            tx.send(Num { n }).await.unwrap();
        }
        let got = tokio::time::timeout(Duration::from_secs(10), answers.next()).await.unwrap();
        assert_eq!(got.unwrap().unwrap().n, n * 10);
    }
    drop(tx);
    assert!(answers.next().await.is_none(), "the stream ends with the OK trailers");
}

fn tokio_stream_from(mut rx: tokio::sync::mpsc::Receiver<Num>) -> impl Stream<Item = Num> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// The same calls to an upstream reached by HTTP/2 over TLS (`protocol: h2`, and `auto`,
/// which ALPN makes HTTP/2): trailers, every kind of stream, `grpc-timeout`, one connection.
#[tokio::test]
async fn calls_pass_to_an_h2_upstream_over_tls() {
    let dir = Dir::new();
    let ca = Ca::new("grpc CA");
    let ca_file = ca.write(&dir, "ca.pem");
    for protocol in ["h2", "auto"] {
        let up = Service::start_tls(&ca).await;
        let tg = Tollgate::start(&format!(
            "listen: 127.0.0.1:0\nupstreams:\n  g:\n    url: 'https://{}'\n    protocol: {protocol}\n    ca_file: {}\n    \
             server_name: grpc.internal\nroutes:\n  - name: grpc\n    upstream: g\n",
            up.addr,
            y(&ca_file)
        ))
        .await;
        let mut grpc = client(&tg).await;
        let add = |n| tonic::Request::new(Num { n });
        let resp = ready(&mut grpc).await.unary(add(41), path("/t.T/Add"), Codec::default()).await.unwrap();
        assert_eq!(resp.into_inner().n, 42, "{protocol}");
        let e = ready(&mut grpc).await.unary(add(-1), path("/t.T/Add"), Codec::default()).await.unwrap_err();
        assert_eq!((e.code(), e.message()), (Code::InvalidArgument, "negative"));
        assert_eq!(e.metadata().get("x-why").unwrap(), "below-zero", "the upstream's trailer");
        let resp = ready(&mut grpc).await.server_streaming(add(300), path("/t.T/Count"), Codec::default());
        let got: Vec<i64> = resp.await.unwrap().into_inner().map(|m| m.unwrap().n).collect().await;
        assert_eq!(got, (0..300).collect::<Vec<_>>());
        let input = futures_util::stream::iter((1..=100).map(|n| Num { n }));
        let resp = ready(&mut grpc)
            .await
            .client_streaming(tonic::Request::new(input), path("/t.T/Sum"), Codec::default())
            .await;
        assert_eq!(resp.unwrap().into_inner().n, 5050);
        echo_in_turns(&mut grpc, 5).await;
        let mut send = crate::support::h2(tg.addr).await;
        let req = Request::post("http://x/t.T/Slow")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("grpc-timeout", "200m")
            .body(full(vec![0u8, 0, 0, 0, 0]))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(20), send.send_request(req)).await.unwrap().unwrap();
        assert_eq!(resp.headers()["grpc-status"], "4", "{protocol}: DEADLINE_EXCEEDED from tollgate");
        assert_eq!(up.accepted.load(std::sync::atomic::Ordering::Relaxed), 1, "{protocol}: one TLS connection");
    }
}

#[tokio::test]
async fn a_throttled_call_is_resource_exhausted_with_pushback() {
    let up = Service::start().await;
    let clock = ManualClock::new(Timestamp::from_micros(1_700_000_000_000_000));
    let yaml = yaml(&up, "    limits:\n      - { name: calls, algorithm: token_bucket, rate: 1/30s, burst: 1 }\n");
    let tg = Tollgate::start_with_clock(&yaml, clock).await;
    let mut grpc = client(&tg).await;
    assert!(ready(&mut grpc)
        .await
        .unary(tonic::Request::new(Num { n: 1 }), path("/t.T/Add"), Codec::default())
        .await
        .is_ok());
    let e = ready(&mut grpc)
        .await
        .unary(tonic::Request::new(Num { n: 1 }), path("/t.T/Add"), Codec::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("limit `calls`"), "{e:?}");
    assert_eq!(e.metadata().get("grpc-retry-pushback-ms").unwrap(), "30000");
}

#[tokio::test]
async fn grpc_timeout_bounds_the_wait_for_the_upstream() {
    let up = Service::start().await;
    let tg = Tollgate::start(&yaml(&up, "")).await;
    // A raw HTTP/2 client, so that only tollgate can end the call.
    let mut send = crate::support::h2(tg.addr).await;
    let req = Request::post("http://x/t.T/Slow")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", "200m")
        .body(full(vec![0u8, 0, 0, 0, 0]))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), send.send_request(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["grpc-status"], "4");
    assert_eq!(resp.headers()["content-type"], "application/grpc");
}

#[tokio::test]
async fn no_route_is_unimplemented_and_a_dead_upstream_unavailable_never_stale() {
    let tg = Tollgate::start(
        "listen: 127.0.0.1:0\nupstreams:\n  g: { url: 'http://127.0.0.1:1', protocol: h2c }\nroutes:\n  - name: \
         grpc\n    match: { path_prefix: /t.T/ }\n    upstream: g\n    on_upstream_error: { stale: { max_age: 1h } }\n",
    )
    .await;
    let mut grpc = client(&tg).await;
    let e = ready(&mut grpc)
        .await
        .unary(tonic::Request::new(Num { n: 1 }), path("/other.S/M"), Codec::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    let e = ready(&mut grpc)
        .await
        .unary(tonic::Request::new(Num { n: 1 }), path("/t.T/Add"), Codec::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("could not connect"), "{e:?}");
}

#[test]
fn h2_on_http_and_h2_settings_on_http1_are_refused_by_config() {
    let check = |up: &str| {
        let yaml = format!(
            "listen: 127.0.0.1:0\nupstreams:\n  g: {{ url: 'http://127.0.0.1:1', {up} }}\nroutes:\n  - upstream: g\n"
        );
        tollgate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let e = check("protocol: h2").unwrap_err();
    assert!(e.contains("upstreams.g.protocol") && e.contains("use `h2c`"), "{e}");
    let e = check("h2: { max_connections: 2 }").unwrap_err();
    assert!(e.contains("upstreams.g.h2") && e.contains("protocol: h2c"), "{e}");
    let e = check("protocol: h2c, h2: { max_streams_per_connection: 0 }").unwrap_err();
    assert!(e.contains("max_streams_per_connection"), "{e}");
    assert!(check("protocol: auto").is_ok());
}
