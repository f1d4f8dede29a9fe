//! The `tracing:` section: where OpenTelemetry spans of requests go and which requests make
//! them. Serde mirror (unknown fields denied) → [`TracingConfig`].

use std::time::Duration;

use http::Uri;
use serde::Deserialize;

use super::units::Dur;
use super::{key, Invalid, Seg};

/// How spans reach the collector (OTLP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OtlpProtocol {
    /// OTLP/gRPC: `TraceService/Export` over HTTP/2 without TLS (the collector's port 4317).
    #[default]
    Grpc,
    /// OTLP/HTTP with protobuf bodies: `POST /v1/traces` (the collector's port 4318).
    Http,
}

/// Validated `tracing:`: one server span (and a client span for the upstream exchange) per
/// sampled request, exported in batches off the request path.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// The collector: scheme `http`, its authority, and the path of an OTLP/HTTP export.
    pub endpoint: Uri,
    pub protocol: OtlpProtocol,
    /// The share of requests without a sampled parent that are traced, in [0, 1].
    pub sample: f64,
    /// An incoming valid `traceparent` decides by its sampled flag instead of `sample`.
    pub parent_based: bool,
    /// The resource's `service.name`.
    pub service_name: String,
    /// Finished spans waiting for export; past this many they are dropped (and counted).
    pub queue: usize,
    /// Spans per export call.
    pub batch: usize,
    /// A partial batch waits at most this long.
    pub interval: Duration,
    /// One export call's deadline (connect included); a failed batch is dropped, not retried.
    pub timeout: Duration,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    otlp: RawOtlp,
    sample: Option<f64>,
    #[serde(default = "yes")]
    parent_based: bool,
    service_name: Option<String>,
    queue: Option<usize>,
    batch: Option<usize>,
    interval: Option<Dur>,
    timeout: Option<Dur>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOtlp {
    endpoint: String,
    #[serde(default)]
    protocol: OtlpProtocol,
}

fn yes() -> bool {
    true
}

/// The longest queue accepted (each waiting span holds a few hundred bytes).
const MAX_QUEUE: usize = 1_000_000;

impl RawTracing {
    pub fn validate(self) -> Result<TracingConfig, Invalid> {
        let at = |field: &str| vec![key("tracing"), key(field)];
        let sample = self.sample.unwrap_or(0.01);
        if !(0.0..=1.0).contains(&sample) {
            return Err((at("sample"), format!("{sample} is not a share of requests; expected a number from 0 to 1")));
        }
        let endpoint = check_endpoint(
            &self.otlp.endpoint,
            self.otlp.protocol,
            vec![key("tracing"), key("otlp"), key("endpoint")],
        )?;
        let queue = self.queue.unwrap_or(2048);
        if queue == 0 || queue > MAX_QUEUE {
            return Err((at("queue"), format!("{queue} spans; expected 1 to {MAX_QUEUE}")));
        }
        let batch = self.batch.unwrap_or(512);
        if batch == 0 || batch > queue {
            return Err((at("batch"), format!("{batch} spans; expected 1 to the queue's {queue}")));
        }
        let positive = |d: Option<Dur>, field: &str, default: Duration| match d {
            None => Ok(default),
            Some(Dur(d)) if d.is_zero() => Err((at(field), "expected a duration above 0".to_owned())),
            Some(Dur(d)) => Ok(d),
        };
        let service_name = self.service_name.unwrap_or_else(|| "tollgate".to_owned());
        if service_name.is_empty() {
            return Err((at("service_name"), "expected a name".to_owned()));
        }
        Ok(TracingConfig {
            endpoint,
            protocol: self.otlp.protocol,
            sample,
            parent_based: self.parent_based,
            service_name,
            queue,
            batch,
            interval: positive(self.interval, "interval", Duration::from_secs(1))?,
            timeout: positive(self.timeout, "timeout", Duration::from_secs(5))?,
        })
    }
}

/// The collector's URL: `http://host:port[/path]`. OTLP/HTTP posts to the path given, or to
/// `/v1/traces` when there is none; gRPC calls its fixed method path.
fn check_endpoint(url: &str, protocol: OtlpProtocol, at: Vec<Seg>) -> Result<Uri, Invalid> {
    let bad = |why: &str| (at.clone(), format!("`{}` is not a collector URL: {why}", super::redact(url)));
    let uri: Uri = url.parse().map_err(|_| bad("expected e.g. http://127.0.0.1:4317"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(bad("TLS to the collector is not supported; export to a collector agent over plain http"))
        }
        _ => return Err(bad("expected the scheme http://")),
    }
    let Some(authority) = uri.authority().filter(|a| !a.host().is_empty()) else {
        return Err(bad("expected a host"));
    };
    if uri.query().is_some() || authority.as_str().contains('@') {
        return Err(bad("expected no query and no user"));
    }
    let path = match (protocol, uri.path()) {
        (OtlpProtocol::Http, "" | "/") => "/v1/traces",
        (OtlpProtocol::Http, p) => p,
        (OtlpProtocol::Grpc, _) => "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    };
    let port = authority.port_u16().unwrap_or(80);
    format!("http://{}:{port}{path}", authority.host()).parse().map_err(|_| bad("expected e.g. http://127.0.0.1:4317"))
}
