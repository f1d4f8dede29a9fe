//! The export task: finished spans from the queue, in batches (`batch` spans, or what came
//! within `interval`), sent over OTLP/gRPC or OTLP/HTTP (protobuf) with hyper's client.
//!
//! Each batch is sent once under `timeout`: a failed export drops its spans (counted) and the
//! task goes on with the next batch, so a collector that is down costs one connection attempt
//! per batch and the spans the full queue refuses meanwhile, never a retry storm or a wait on
//! the request path. Both protocols are plain HTTP exchanges (gRPC is a POST over HTTP/2 with
//! a 5-byte frame header and `grpc-status` in its trailers), so one hyper client does both and
//! tonic stays a test-only dependency.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{header, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::InstrumentationScope;
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span as OtlpSpan};
use prost::Message;
use tokio::sync::mpsc;

use super::Finished;
use crate::config::{OtlpProtocol, TracingConfig};
use crate::metrics::TraceMetrics;

/// Runs until every sender is gone (the tracer's config was replaced and its requests ended).
pub async fn run(config: TracingConfig, mut rx: mpsc::Receiver<Box<Finished>>, metrics: TraceMetrics) {
    let exporter = Exporter::new(&config);
    let mut batch: Vec<Box<Finished>> = Vec::with_capacity(config.batch);
    let mut failing = false;
    loop {
        // The first span of a batch: wait as long as it takes (an idle tracer costs nothing).
        if rx.recv_many(&mut batch, config.batch).await == 0 {
            return;
        }
        let deadline = tokio::time::sleep(config.interval);
        tokio::pin!(deadline);
        while batch.len() < config.batch {
            let room = config.batch - batch.len();
            tokio::select! {
                got = rx.recv_many(&mut batch, room) => if got == 0 { break },
                () = &mut deadline => break,
            }
        }
        let spans: u64 = batch.iter().map(|f| f.count()).sum();
        let body = exporter.encode(batch.drain(..));
        match tokio::time::timeout(config.timeout, exporter.send(body)).await {
            Ok(Ok(())) => {
                metrics.exported.inc_by(spans);
                failing = false;
            }
            outcome => {
                metrics.dropped.inc_by(spans);
                metrics.export_failures.inc();
                let why = match outcome {
                    Ok(Err(e)) => e,
                    _ => format!("no answer within {:?}", config.timeout),
                };
                // Once per outage at warn; every further failure at debug.
                if failing {
                    tracing::debug!(endpoint = %config.endpoint, spans, "span export failed: {why}");
                } else {
                    tracing::warn!(endpoint = %config.endpoint, spans, "span export failed: {why}; its spans are dropped");
                }
                failing = true;
            }
        }
    }
}

/// One collector's client and what every export request repeats.
struct Exporter {
    client: Client<HttpConnector, Full<Bytes>>,
    endpoint: Uri,
    protocol: OtlpProtocol,
    resource: Resource,
}

impl Exporter {
    fn new(config: &TracingConfig) -> Exporter {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.timeout));
        connector.set_nodelay(true);
        let mut builder = Client::builder(TokioExecutor::new());
        builder.pool_idle_timeout(Duration::from_secs(60));
        if config.protocol == OtlpProtocol::Grpc {
            builder.http2_only(true);
        }
        Exporter {
            client: builder.build(connector),
            endpoint: config.endpoint.clone(),
            protocol: config.protocol,
            resource: Resource {
                attributes: vec![super::text("service.name", config.service_name.as_str())],
                ..Resource::default()
            },
        }
    }

    /// The request body: one `ExportTraceServiceRequest` (gRPC: in its length-prefixed frame).
    fn encode(&self, batch: impl Iterator<Item = Box<Finished>>) -> Bytes {
        let mut spans: Vec<OtlpSpan> = Vec::new();
        for f in batch {
            let Finished { server, client } = *f;
            spans.push(server);
            spans.extend(client);
        }
        let message = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "tollgate".to_owned(),
                        version: env!("CARGO_PKG_VERSION").to_owned(),
                        ..InstrumentationScope::default()
                    }),
                    spans,
                    ..ScopeSpans::default()
                }],
                ..ResourceSpans::default()
            }],
        };
        let len = message.encoded_len();
        let mut buf = BytesMut::with_capacity(len + 5);
        if self.protocol == OtlpProtocol::Grpc {
            // Not compressed, then the message's length (gRPC over HTTP/2, "Length-Prefixed-Message").
            buf.put_u8(0);
            buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
        }
        // Encoding into a buffer of the message's own length cannot fail.
        let _ = message.encode(&mut buf);
        buf.freeze()
    }

    /// One export call; `Err` says why it failed.
    async fn send(&self, body: Bytes) -> Result<(), String> {
        let grpc = self.protocol == OtlpProtocol::Grpc;
        let content_type = if grpc { "application/grpc" } else { "application/x-protobuf" };
        let mut req = Request::post(self.endpoint.clone())
            .header(header::CONTENT_TYPE, HeaderValue::from_static(content_type))
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        if grpc {
            req.headers_mut().insert(header::TE, HeaderValue::from_static("trailers"));
        }
        let resp = self.client.request(req).await.map_err(|e| connect_error(&e))?;
        let status = resp.status();
        let head_status = grpc_status(resp.headers());
        let collected = resp.into_body().collect().await.map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("the collector answered {status}"));
        }
        if grpc {
            let code = head_status.or_else(|| collected.trailers().and_then(grpc_status));
            match code {
                Some(0) => {}
                Some(c) => return Err(format!("the collector answered grpc-status {c}")),
                None => return Err("the collector's answer had no grpc-status".to_owned()),
            }
        }
        Ok(())
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<u32> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// The client error with its cause (hyper-util's own text says only "client error (Connect)").
fn connect_error(e: &hyper_util::client::legacy::Error) -> String {
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}
