//! OpenTelemetry traces (`tracing:`) end to end: requests through tollgate to real upstreams,
//! spans exported to a real OTLP receiver (the official `TraceService` served by tonic under
//! a hyper HTTP/2 server, or an OTLP/HTTP endpoint decoding the same protobuf messages).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::support::{full, get, get_with, proxy_yaml, Tollgate, Upstream};

/// Everything a receiver got: spans, and the `service.name` of their resource.
#[derive(Default)]
struct Received {
    spans: Vec<Span>,
    services: Vec<String>,
}

type Store = Arc<Mutex<Received>>;

fn keep(store: &Store, req: ExportTraceServiceRequest) {
    let mut r = store.lock().unwrap();
    for rs in req.resource_spans {
        let service = rs.resource.iter().flat_map(|r| &r.attributes).find(|kv| kv.key == "service.name");
        if let Some(Value::StringValue(s)) = service.and_then(|kv| kv.value.as_ref()).and_then(|v| v.value.clone()) {
            r.services.push(s);
        }
        for ss in rs.scope_spans {
            r.spans.extend(ss.spans);
        }
    }
}

struct Receiver(Store);

#[tonic::codegen::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        keep(&self.0, request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP/gRPC collector on 127.0.0.1:0.
struct Collector {
    addr: SocketAddr,
    store: Store,
    task: JoinHandle<()>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Collector {
    async fn grpc() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let store = Store::default();
        let service = TraceServiceServer::new(Receiver(store.clone()));
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let service = service.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let mut service = service.clone();
                        async move { tower::Service::call(&mut service, req).await }
                    });
                    let h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                    let _ = h2.serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        });
        Collector { addr, store, task }
    }

    /// An OTLP/HTTP collector: `POST /v1/traces` with a protobuf body.
    async fn http() -> (Upstream, Store) {
        let store = Store::default();
        let kept = store.clone();
        let up = Upstream::start(move |req| {
            let kept = kept.clone();
            async move {
                assert_eq!(req.uri().path(), "/v1/traces");
                assert_eq!(req.headers()["content-type"], "application/x-protobuf");
                let body = req.into_body().collect().await.unwrap().to_bytes();
                keep(&kept, ExportTraceServiceRequest::decode(body).unwrap());
                Response::new(full(ExportTraceServiceResponse::default().encode_to_vec()))
            }
        })
        .await;
        (up, store)
    }
}

/// Waits (generously) until `store` holds at least `n` spans; returns them.
async fn spans(store: &Store, n: usize) -> Vec<Span> {
    for _ in 0..400 {
        {
            let r = store.lock().unwrap();
            if r.spans.len() >= n {
                return r.spans.clone();
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("expected {n} spans, got {}", store.lock().unwrap().spans.len());
}

/// A span's attributes by key (texts, integers and lists as text; numbers as text too).
fn attrs(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => s.clone(),
                Some(Value::IntValue(i)) => i.to_string(),
                Some(Value::DoubleValue(d)) => d.to_string(),
                Some(Value::BoolValue(b)) => b.to_string(),
                Some(Value::ArrayValue(a)) => a
                    .values
                    .iter()
                    .filter_map(|v| match &v.value {
                        Some(Value::StringValue(s)) => Some(s.clone()),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join(","),
                _ => String::new(),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A config: `tracing:` exporting to `otlp` (the endpoint, then any more of `otlp:`), with
/// `extra` (the default sample unless it says), and one route `api` to `upstream`.
fn config(upstream: SocketAddr, otlp: &str, extra: &str, limits: &str) -> String {
    let mut yaml =
        format!("tracing:\n  otlp: {{ endpoint: {otlp} }}\n  service_name: edge-test\n  interval: 20ms\n{extra}");
    yaml.push_str(&proxy_yaml(upstream, "", &format!("  - name: api\n    upstream: up\n{limits}")));
    yaml
}

/// An upstream that answers 200 and keeps each request's `traceparent`.
async fn recording_upstream() -> (Upstream, Arc<Mutex<Vec<String>>>) {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let kept = seen.clone();
    let up = Upstream::start(move |req| {
        let kept = kept.clone();
        async move {
            let tp = req.headers().get("traceparent").map(|v| v.to_str().unwrap().to_owned());
            kept.lock().unwrap().push(tp.unwrap_or_default());
            Response::new(full("ok"))
        }
    })
    .await;
    (up, seen)
}

#[tokio::test]
async fn a_200_has_a_server_span_and_a_client_span_whose_id_the_upstream_gets() {
    let collector = Collector::grpc().await;
    let (up, seen) = recording_upstream().await;
    let limits =
        "    limits:\n      - { name: per-ip, algorithm: token_bucket, rate: 100/s, burst: 100, key: client_ip }\n";
    let yaml = config(up.addr, &format!("http://{}", collector.addr), "  sample: 1\n", limits);
    let tg = Tollgate::start(&yaml).await;
    let (status, headers, _) = get(tg.addr, "/items/7").await;
    assert_eq!(status, StatusCode::OK);

    let got = spans(&collector.store, 2).await;
    let server = got.iter().find(|s| s.kind == SpanKind::Server as i32).expect("a server span");
    let client = got.iter().find(|s| s.kind == SpanKind::Client as i32).expect("a client span");
    assert_eq!(server.trace_id.len(), 16);
    assert_eq!(client.trace_id, server.trace_id);
    assert_eq!(client.parent_span_id, server.span_id, "the client span is the server span's child");
    assert!(server.parent_span_id.is_empty(), "no incoming traceparent: a root span");
    assert!(server.start_time_unix_nano <= client.start_time_unix_nano);
    assert!(client.end_time_unix_nano <= server.end_time_unix_nano);
    assert_eq!(server.name, "GET api");

    let a = attrs(server);
    for (k, v) in [
        ("http.request.method", "GET"),
        ("http.route", "api"),
        ("url.path", "/items/7"),
        ("http.response.status_code", "200"),
        ("client.address", "127.0.0.1"),
        ("server.address", "localhost"),
        ("network.protocol.version", "1.1"),
        ("tollgate.route", "api"),
        ("tollgate.limit", "per-ip"),
        ("tollgate.limit.decision", "allow"),
        ("tollgate.upstream", "up"),
    ] {
        assert_eq!(a.get(k).map(String::as_str), Some(v), "{k} in {a:?}");
    }
    assert_eq!(a["tollgate.request_id"], headers["x-request-id"].to_str().unwrap());
    assert!(a.contains_key("tollgate.limit.remaining"));
    let c = attrs(client);
    assert_eq!(c["http.response.status_code"], "200");
    assert_eq!(c["tollgate.upstream"], "up");
    // Where the exchange went (HTTP client semantic conventions).
    assert_eq!(c["server.address"], "127.0.0.1", "{c:?}");
    assert_eq!(c["server.port"], up.addr.port().to_string(), "{c:?}");
    assert_eq!(c["url.full"], format!("http://{}/items/7", up.addr), "{c:?}");
    assert!(!c.contains_key("error.type"), "{c:?}");

    // The upstream's parent is the client span.
    let tp = seen.lock().unwrap()[0].clone();
    assert_eq!(tp, format!("00-{}-{}-01", hex(&server.trace_id), hex(&client.span_id)));
    assert_eq!(collector.store.lock().unwrap().services[0], "edge-test");
    let exported = tg.shared.load().metrics().encode(None);
    assert!(exported.contains("tollgate_trace_spans_exported_total 2"), "{exported}");
}

#[tokio::test]
async fn a_429s_span_has_the_denial_and_retry_after() {
    let collector = Collector::grpc().await;
    let (up, seen) = recording_upstream().await;
    let limits =
        "    limits:\n      - { name: hourly, algorithm: token_bucket, rate: 1/h, burst: 1, key: client_ip }\n";
    let yaml = config(up.addr, &format!("http://{}", collector.addr), "  sample: 1\n", limits);
    let tg = Tollgate::start(&yaml).await;
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    let (status, headers, _) = get(tg.addr, "/").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);

    let got = spans(&collector.store, 3).await;
    let denied = got
        .iter()
        .find(|s| attrs(s).get("http.response.status_code").map(String::as_str) == Some("429"))
        .expect("the 429's span");
    let a = attrs(denied);
    assert_eq!(a["tollgate.limit"], "hourly");
    assert_eq!(a["tollgate.limit.decision"], "deny");
    assert_eq!(a["tollgate.limit.denied"], "hourly");
    assert_eq!(a["error.type"], "throttled");
    assert_eq!(a["tollgate.retry_after"], headers["retry-after"].to_str().unwrap());
    assert!(a["tollgate.retry_after"].parse::<u64>().unwrap() > 0);
    let children = got.iter().filter(|s| s.parent_span_id == denied.span_id).count();
    assert_eq!(children, 0, "a refused request asked no upstream");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_leaky_bucket_delay_is_in_the_span_with_its_wait() {
    let collector = Collector::grpc().await;
    let (up, _seen) = recording_upstream().await;
    let limits =
        "    limits:\n      - { name: smooth, algorithm: leaky_bucket, rate: 5/s, max_delay: 5s, key: route }\n";
    let yaml = config(up.addr, &format!("http://{}", collector.addr), "  sample: 1\n", limits);
    let tg = Tollgate::start(&yaml).await;
    let (a, b) = tokio::join!(get(tg.addr, "/a"), get(tg.addr, "/b"));
    assert_eq!((a.0, b.0), (StatusCode::OK, StatusCode::OK));

    let got = spans(&collector.store, 4).await;
    let delayed: Vec<_> = got
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .map(attrs)
        .filter(|a| a.get("tollgate.limit.decision").map(String::as_str) == Some("delay"))
        .collect();
    assert_eq!(delayed.len(), 1, "one of the two waited for its slot: {got:?}");
    let wait: f64 = delayed[0]["tollgate.limit.wait_ms"].parse().unwrap();
    assert!(wait > 0.0, "{wait}");
    assert_eq!(delayed[0]["tollgate.limit"], "smooth");
}

#[tokio::test]
async fn sampling_follows_sample_and_a_sampled_parent() {
    let collector = Collector::grpc().await;
    let (up, seen) = recording_upstream().await;
    let yaml = config(up.addr, &format!("http://{}", collector.addr), "  sample: 0\n  parent_based: true\n", "");
    let tg = Tollgate::start(&yaml).await;
    let unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    for _ in 0..5 {
        assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    }
    assert_eq!(get_with(tg.addr, "/", &[("traceparent", unsampled)]).await.0, StatusCode::OK);
    let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    assert_eq!(get_with(tg.addr, "/", &[("traceparent", sampled)]).await.0, StatusCode::OK);

    // FIFO export: had an earlier request made spans, they would be here by now too.
    let got = spans(&collector.store, 2).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let got_later = collector.store.lock().unwrap().spans.len();
    assert_eq!((got.len(), got_later), (2, 2), "only the request with a sampled parent was traced");
    let server = got.iter().find(|s| s.kind == SpanKind::Server as i32).unwrap();
    assert_eq!(hex(&server.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736", "the caller's trace");
    assert_eq!(hex(&server.parent_span_id), "00f067aa0ba902b7", "the caller's span is the parent");
    let seen = seen.lock().unwrap();
    assert_eq!(seen[5], unsampled, "an unsampled parent passes through untouched");
    assert!(seen[6].starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && seen[6] != sampled);
}

#[tokio::test]
async fn without_parent_based_the_sample_decides_alone() {
    let collector = Collector::grpc().await;
    let (up, seen) = recording_upstream().await;
    let yaml = config(up.addr, &format!("http://{}", collector.addr), "  sample: 0\n  parent_based: false\n", "");
    let tg = Tollgate::start(&yaml).await;
    let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    assert_eq!(get_with(tg.addr, "/", &[("traceparent", sampled)]).await.0, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(collector.store.lock().unwrap().spans.is_empty());
    // The caller's trace, not sampled: the upstream follows tollgate's decision.
    assert_eq!(seen.lock().unwrap()[0], "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
}

/// A request tracing does not sample still tells the upstream, with the unsampled flag: at
/// sample 0.2 every upstream request carries a `traceparent`, and exactly those whose spans
/// were exported say sampled (`-01`), their client span being the parent; the others say
/// `-00`, so the upstream does not start traces of its own for them.
#[tokio::test]
async fn an_unsampled_request_tells_the_upstream_it_is_not_sampled() {
    let collector = Collector::grpc().await;
    let (up, seen) = recording_upstream().await;
    let yaml = config(up.addr, &format!("http://{}", collector.addr), "  sample: 0.2\n", "");
    let tg = Tollgate::start(&yaml).await;
    for _ in 0..200 {
        assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 200);
    let sampled: Vec<&String> = seen.iter().filter(|t| t.ends_with("-01")).collect();
    let unsampled = seen.iter().filter(|t| t.ends_with("-00")).count();
    assert_eq!(sampled.len() + unsampled, 200, "every upstream request has a traceparent: {seen:?}");
    assert!(sampled.len() > 10 && unsampled > 100, "about a fifth sampled: {} of 200", sampled.len());
    for t in &seen {
        assert_eq!((t.len(), &t[..3]), (55, "00-"), "{t}");
    }
    let got = spans(&collector.store, 2 * sampled.len()).await;
    let clients: Vec<String> = got
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .map(|s| format!("00-{}-{}-01", hex(&s.trace_id), hex(&s.span_id)))
        .collect();
    let mut sampled: Vec<String> = sampled.into_iter().cloned().collect();
    let mut clients = clients;
    sampled.sort();
    clients.sort();
    assert_eq!(sampled, clients, "each sampled traceparent names an exported client span");
}

/// A failed connect: the client span says what failed (`error.type`) and where it tried.
#[tokio::test]
async fn a_failed_connects_client_span_has_its_error_type() {
    let collector = Collector::grpc().await;
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let yaml = config(dead, &format!("http://{}", collector.addr), "  sample: 1\n", "");
    let tg = Tollgate::start(&yaml).await;
    assert_eq!(get(tg.addr, "/x?y=1").await.0, StatusCode::BAD_GATEWAY);
    let got = spans(&collector.store, 2).await;
    let client = got.iter().find(|s| s.kind == SpanKind::Client as i32).expect("a client span");
    let c = attrs(client);
    assert_eq!(c["error.type"], "upstream_connect", "{c:?}");
    assert_eq!(c["server.port"], dead.port().to_string(), "{c:?}");
    assert_eq!(c["url.full"], format!("http://{dead}/x?y=1"), "{c:?}");
    assert!(client.status.as_ref().is_some_and(|s| s.code == 2), "an error status: {:?}", client.status);
}

#[tokio::test]
async fn otlp_http_receives_the_same_spans() {
    let (collector, store) = Collector::http().await;
    let (up, _seen) = recording_upstream().await;
    let yaml = config(up.addr, &format!("http://{}, protocol: http", collector.addr), "  sample: 1\n", "");
    let tg = Tollgate::start(&yaml).await;
    assert_eq!(get(tg.addr, "/x").await.0, StatusCode::OK);
    let got = spans(&store, 2).await;
    let server = got.iter().find(|s| s.kind == SpanKind::Server as i32).unwrap();
    assert_eq!(attrs(server)["url.path"], "/x");
}

#[tokio::test]
async fn a_dead_collector_costs_only_dropped_spans() {
    // A port with nothing behind it.
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let (up, _seen) = recording_upstream().await;
    let extra = "  sample: 1\n  queue: 4\n  batch: 2\n  timeout: 500ms\n";
    let yaml = config(up.addr, &format!("http://{dead}"), extra, "");
    let tg = Tollgate::start(&yaml).await;
    for _ in 0..50 {
        let answered = tokio::time::timeout(Duration::from_secs(10), get(tg.addr, "/")).await;
        assert_eq!(answered.expect("answered while the collector is down").0, StatusCode::OK);
    }
    // Every span is lost: to the full queue, or with its failed batch.
    let mut dropped = 0;
    for _ in 0..400 {
        let text = tg.shared.load().metrics().encode(None);
        dropped = metric(&text, "tollgate_trace_spans_dropped_total");
        if dropped == 100 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(dropped, 100, "two spans a request, all dropped");
    let text = tg.shared.load().metrics().encode(None);
    assert!(metric(&text, "tollgate_trace_export_failures_total") >= 1);
    assert_eq!(metric(&text, "tollgate_trace_spans_exported_total"), 0);
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{name} in {text}"))
}

#[tokio::test]
async fn the_tracing_section_is_checked() {
    let cases = [
        ("tracing: { otlp: { endpoint: http://127.0.0.1:4317 }, sample: 1.5 }\n", "tracing.sample"),
        ("tracing: { otlp: { endpoint: \"127.0.0.1:4317\" } }\n", "tracing.otlp.endpoint"),
        ("tracing: { otlp: { endpoint: https://collector:4317 } }\n", "tracing.otlp.endpoint"),
        ("tracing: { otlp: { endpoint: http://c:4317, protocol: thrift } }\n", "tracing.otlp.protocol"),
        ("tracing: { otlp: { endpoint: http://c:4317 }, batch: 0 }\n", "tracing.batch"),
    ];
    for (section, field) in cases {
        let yaml = format!("{section}{}", proxy_yaml("127.0.0.1:1".parse().unwrap(), "", "  - upstream: up\n"));
        let e = tollgate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap_err();
        assert_eq!((e.path.as_str(), e.line), (field, 1), "{e}");
        assert!(e.column > 1, "{e}");
    }
}

#[tokio::test]
async fn a_groups_client_span_names_the_server_that_answered_and_the_retries() {
    let collector = Collector::grpc().await;
    let (up, _seen) = recording_upstream().await;
    // The group's first server refuses connections: a request sent there is retried on `up`.
    let yaml = format!(
        "tracing:\n  otlp: {{ endpoint: http://{} }}\n  sample: 1\n  interval: 20ms\n{}",
        collector.addr,
        crate::support::dead_then_live_group(up.addr)
    );
    let tg = Tollgate::start(&yaml).await;
    for _ in 0..2 {
        assert_eq!(get(tg.addr, "/x").await.0, StatusCode::OK);
    }
    let got = spans(&collector.store, 4).await;
    let clients: Vec<_> = got.iter().filter(|s| s.kind == SpanKind::Client as i32).map(attrs).collect();
    assert_eq!(clients.len(), 2, "{clients:?}");
    for c in &clients {
        assert_eq!(c["tollgate.upstream.server"], up.addr.to_string(), "{c:?}");
    }
    let retries: Vec<&str> = clients.iter().map(|c| c["tollgate.upstream.retries"].as_str()).collect();
    assert!(retries.contains(&"1"), "a request whose first try met the dead server was retried once: {retries:?}");
}
