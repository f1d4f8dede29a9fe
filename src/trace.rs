//! OpenTelemetry traces of requests (`tracing:`): which requests are sampled, their W3C trace
//! context, the server span of a request and the client span of its upstream exchange, and
//! the export of finished spans over OTLP off the request path.
//!
//! The request path pays for tracing only when it is on: [`Tracer::start`] decides once per
//! request and returns `None` for a request that is not sampled, and a sampled request's span
//! lives in a `Box` its future points to. Finished spans go into a bounded queue with
//! `try_send` (a full queue drops the span and counts it, it never waits); one background
//! task per [`Tracer`] batches them and exports each batch once, under a deadline (see
//! [`export`]). The messages are `opentelemetry-proto`'s generated types: the SDK's span
//! machinery (contexts, processors, a global provider) would sit on the request path and
//! do nothing tollgate needs.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use http::header::{HeaderMap, HeaderValue};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, status::StatusCode, Span as OtlpSpan, Status};
use tokio::sync::mpsc;

use crate::config::TracingConfig;
use crate::metrics::TraceMetrics;
use crate::request_id::{valid_traceparent, TRACEPARENT};

pub mod export;

/// A sampled request's trace state: its ids, its start, and its upstream exchange's.
pub struct Span {
    trace_id: [u8; 16],
    id: [u8; 8],
    /// The caller's span, from a valid incoming `traceparent`.
    parent: Option<[u8; 8]>,
    start: u64,
    /// The upstream exchange's span: its id (the upstream's parent) and start (0: none).
    client_id: [u8; 8],
    client_start: u64,
    /// Where the upstream exchange went: the scheme, the authority and the origin-form target
    /// (the client span's `url.full`, `server.address`, `server.port`).
    target: Option<Box<Target>>,
    /// Server span attributes gathered before the end (the limits that denied).
    pub attributes: Vec<KeyValue>,
}

/// The upstream request of a traced exchange, as sent.
pub struct Target {
    pub scheme: &'static str,
    pub authority: http::uri::Authority,
    /// Path and query, as the upstream gets them.
    pub path_and_query: String,
}

/// Two finished spans of one request (the client span only when an upstream was asked).
pub struct Finished {
    server: OtlpSpan,
    client: Option<OtlpSpan>,
}

impl Finished {
    /// How many spans this holds (what a drop costs).
    fn count(&self) -> u64 {
        1 + u64::from(self.client.is_some())
    }
}

/// A config's tracer: the sampler and the sending end of the export queue. Built at
/// `Proxy::build`; a reload with the same `tracing:` keeps it (and its export task).
pub struct Tracer {
    pub config: TracingConfig,
    /// A request without a sampled parent is sampled when a random `u64` is below this.
    threshold: u64,
    queue: mpsc::Sender<Box<Finished>>,
    metrics: TraceMetrics,
}

impl Tracer {
    /// The tracer of `config`, with its export task spawned on the current runtime; `None`
    /// outside a runtime (tracing is then off, and said so).
    pub fn new(config: &TracingConfig, metrics: &TraceMetrics) -> Option<Arc<Tracer>> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::error!("tracing: no runtime to export spans from; tracing is off");
            return None;
        };
        let (queue, rx) = mpsc::channel(config.queue);
        runtime.spawn(export::run(config.clone(), rx, metrics.clone()));
        Some(Arc::new(Tracer {
            config: config.clone(),
            threshold: threshold(config.sample),
            queue,
            metrics: metrics.clone(),
        }))
    }

    /// The span of a request with `headers`, if it is sampled: a valid `traceparent` makes it
    /// that trace's child, and with `parent_based` its sampled flag decides; otherwise
    /// `sample` does.
    pub fn start(&self, headers: &HeaderMap) -> Option<Box<Span>> {
        let parent = headers.get(TRACEPARENT).and_then(|v| parse_traceparent(v.as_bytes()));
        let sampled = match parent {
            Some((_, _, flags)) if self.config.parent_based => flags & 1 == 1,
            _ => self.threshold == u64::MAX || fastrand::u64(..) < self.threshold,
        };
        if !sampled {
            return None;
        }
        let (trace_id, parent) = match parent {
            Some((trace, span, _)) => (trace, Some(span)),
            None => (nonzero_u128().to_be_bytes(), None),
        };
        Some(Box::new(Span {
            trace_id,
            id: nonzero_u64().to_be_bytes(),
            parent,
            start: unix_nanos(),
            client_id: nonzero_u64().to_be_bytes(),
            client_start: 0,
            target: None,
            attributes: Vec::new(),
        }))
    }

    /// Ends `span` as `name` with the server span's `attributes` (and the client span, when
    /// the upstream was asked) and queues it; a full queue drops it, counted.
    pub fn finish(&self, span: Span, name: String, status: u16, attributes: Vec<KeyValue>, client: Option<Exchange>) {
        let end = unix_nanos();
        let Span { trace_id, id, parent, start, client_id, client_start, target, attributes: early } = span;
        let mut attributes = attributes;
        attributes.extend(early);
        let client = client.filter(|_| client_start != 0).map(|c| OtlpSpan {
            trace_id: trace_id.to_vec(),
            span_id: client_id.to_vec(),
            parent_span_id: id.to_vec(),
            name: name.clone(),
            kind: SpanKind::Client as i32,
            start_time_unix_nano: client_start,
            end_time_unix_nano: client_start.saturating_add(u64::try_from(c.took.as_nanos()).unwrap_or(u64::MAX)),
            // A client span is an error for any 4xx or 5xx, and without an answer (HTTP
            // semantic conventions: a server span only for 5xx).
            status: error_status(c.status == 0 || c.status >= 400),
            attributes: client_attributes(c, target.as_deref()),
            // The W3C flags (sampled), and "whether the parent is remote" known: it is not.
            flags: HAS_IS_REMOTE | 1,
            ..OtlpSpan::default()
        });
        let server = OtlpSpan {
            trace_id: trace_id.to_vec(),
            span_id: id.to_vec(),
            parent_span_id: parent.map_or_else(Vec::new, |p| p.to_vec()),
            name,
            kind: SpanKind::Server as i32,
            start_time_unix_nano: start,
            end_time_unix_nano: end,
            attributes,
            status: error_status(status >= 500),
            flags: HAS_IS_REMOTE | if parent.is_some() { IS_REMOTE } else { 0 } | 1,
            ..OtlpSpan::default()
        };
        let finished = Box::new(Finished { server, client });
        if let Err(e) = self.queue.try_send(finished) {
            let lost = match &e {
                mpsc::error::TrySendError::Full(f) | mpsc::error::TrySendError::Closed(f) => f.count(),
            };
            self.metrics.dropped.inc_by(lost);
        }
    }
}

/// The client span's attributes: the exchange's own, and where it went (`server.address`,
/// `server.port` and `url.full`, the server that answered when a group chose one), and why it
/// failed (`error.type`: the status code of a 4xx or 5xx, the kind of failure without one).
fn client_attributes(c: Exchange, target: Option<&Target>) -> Vec<KeyValue> {
    let mut out = c.attributes;
    if let Some(t) = target {
        let served = c.server.as_deref().and_then(|s| s.parse::<http::uri::Authority>().ok());
        let authority = served.as_ref().unwrap_or(&t.authority);
        out.push(text("server.address", authority.host().trim_start_matches('[').trim_end_matches(']')));
        if let Some(port) = authority.port_u16() {
            out.push(int("server.port", i64::from(port)));
        }
        out.push(text("url.full", format!("{}://{authority}{}", t.scheme, t.path_and_query)));
    }
    match (c.status, c.failure) {
        (400.., _) => out.push(text("error.type", c.status.to_string())),
        (0, Some(kind)) => out.push(text("error.type", kind)),
        (0, None) => out.push(text("error.type", "_OTHER")),
        _ => {}
    }
    out
}

/// The `traceparent` an upstream gets for a request tracing does not sample: the caller's
/// trace (and parent) with the sampled flag cleared, or a new trace id and parent id not
/// sampled; so the upstream follows tollgate's decision instead of starting a root trace.
/// A malformed incoming one was already dropped (`request_id`).
pub fn unsampled(headers: &mut HeaderMap) {
    let incoming = headers.get(TRACEPARENT).and_then(|v| parse_traceparent(v.as_bytes()));
    let (trace_id, parent) = match incoming {
        Some((_, _, flags)) if flags & 1 == 0 => return,
        Some((trace, span, _)) => (trace, span),
        None => (nonzero_u128().to_be_bytes(), nonzero_u64().to_be_bytes()),
    };
    headers.insert(TRACEPARENT, traceparent(&trace_id, &parent, false));
}

/// A version-00 `traceparent`.
fn traceparent(trace_id: &[u8; 16], parent: &[u8; 8], sampled: bool) -> HeaderValue {
    let mut out = [0u8; 55];
    out[..3].copy_from_slice(b"00-");
    hex(trace_id, &mut out[3..35]);
    out[35] = b'-';
    hex(parent, &mut out[36..52]);
    out[52..].copy_from_slice(if sampled { b"-01" } else { b"-00" });
    HeaderValue::from_bytes(&out).unwrap_or(HeaderValue::from_static(""))
}

/// OTLP span flags: whether the parent is remote is known (bit 8), and it is (bit 9).
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// The upstream exchange of a traced request: the client span's attributes, its time to the
/// response head, and the upstream's status (0: none came).
pub struct Exchange {
    pub attributes: Vec<KeyValue>,
    pub took: std::time::Duration,
    pub status: u16,
    /// The group's server that took it (`host:port`).
    pub server: Option<String>,
    /// Without a status: the kind of failure (tollgate's answer's kind, `upstream_unreachable`).
    pub failure: Option<&'static str>,
}

impl Span {
    /// The upstream exchange to `target` starts now: the `traceparent` the upstream gets,
    /// naming the client span as its parent (sampled).
    pub fn upstream_starts(&mut self, target: Option<Target>) -> HeaderValue {
        self.client_start = unix_nanos();
        self.target = target.map(Box::new);
        traceparent(&self.trace_id, &self.client_id, true)
    }
}

fn error_status(failed: bool) -> Option<Status> {
    failed.then(|| Status { code: StatusCode::Error as i32, message: String::new() })
}

/// `sample` as a bound on a random `u64`.
fn threshold(sample: f64) -> u64 {
    if sample >= 1.0 {
        u64::MAX
    } else {
        (sample * u64::MAX as f64) as u64
    }
}

fn nonzero_u64() -> u64 {
    fastrand::u64(1..)
}

fn nonzero_u128() -> u128 {
    fastrand::u128(1..)
}

fn unix_nanos() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Lower-case hex of `bytes` into `out` (twice as long).
fn hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 15)];
    }
}

/// A valid `traceparent`'s trace id, parent id and flags.
fn parse_traceparent(v: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    if !valid_traceparent(v) {
        return None;
    }
    let mut trace = [0u8; 16];
    let mut span = [0u8; 8];
    unhex(&v[3..35], &mut trace)?;
    unhex(&v[36..52], &mut span)?;
    let mut flags = [0u8; 1];
    unhex(&v[53..55], &mut flags)?;
    Some((trace, span, flags[0]))
}

fn unhex(digits: &[u8], out: &mut [u8]) -> Option<()> {
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    for (pair, o) in digits.chunks_exact(2).zip(out.iter_mut()) {
        *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(())
}

/// An attribute.
fn attribute(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(value) }), ..KeyValue::default() }
}

/// A text attribute.
pub fn text(key: &str, value: impl Into<String>) -> KeyValue {
    attribute(key, any_value::Value::StringValue(value.into()))
}

/// An integer attribute.
pub fn int(key: &str, value: i64) -> KeyValue {
    attribute(key, any_value::Value::IntValue(value))
}

/// A number attribute.
pub fn float(key: &str, value: f64) -> KeyValue {
    attribute(key, any_value::Value::DoubleValue(value))
}

/// A list of texts.
pub fn texts<'a>(key: &str, values: impl Iterator<Item = &'a str>) -> KeyValue {
    let values = values.map(|v| AnyValue { value: Some(any_value::Value::StringValue(v.to_owned())) }).collect();
    attribute(key, any_value::Value::ArrayValue(opentelemetry_proto::tonic::common::v1::ArrayValue { values }))
}

/// `client.address` for a peer.
pub fn address(key: &str, ip: IpAddr) -> KeyValue {
    text(key, ip.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips_and_names_the_client_span() {
        let v = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let (trace, span, flags) = parse_traceparent(v).unwrap();
        assert_eq!(span, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert_eq!(flags, 1);
        let mut s = Span {
            trace_id: trace,
            id: [1; 8],
            parent: Some(span),
            start: 1,
            client_id: [0xab; 8],
            client_start: 0,
            target: None,
            attributes: Vec::new(),
        };
        let out = s.upstream_starts(None);
        assert_eq!(out, "00-4bf92f3577b34da6a3ce929d0e0e4736-abababababababab-01");
        assert!(valid_traceparent(out.as_bytes()));
        assert!(parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01").is_none());
    }

    #[test]
    fn the_threshold_spans_none_to_all() {
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(1.0), u64::MAX);
        let half = threshold(0.5);
        assert!(half > u64::MAX / 2 - 2 && half < u64::MAX / 2 + 2);
    }
}
