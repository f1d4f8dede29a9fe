//! Prometheus metrics, all prefixed `tollgate_`. Label values come only from config (route
//! and limit names) or fixed sets, never from request data, so cardinality is bounded.
//! Handles are resolved once per route and limit, so the hot path does plain atomic adds.
//!
//! One concept, though over 600 lines: the registry and its handles.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{
    EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

use crate::limit::store::redis::{BreakerState, RedisClient, Snapshot, LATENCY_BUCKETS_US};

mod throttles;

pub use throttles::Throttles;

/// A label value from config (a route or limit name), escaped as the text format requires.
/// Names are validated to `[A-Za-z0-9._-]`, so escaping changes nothing today; it keeps a
/// name that slipped past validation from writing series of its own.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Label(String);

impl Label {
    fn new(s: &str) -> Label {
        Label(s.to_owned())
    }
}

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        let mut rest = self.0.as_str();
        while let Some(i) = rest.find(['\\', '"', '\n']) {
            encoder.write_str(&rest[..i])?;
            encoder.write_str(match rest.as_bytes()[i] {
                b'\\' => "\\\\",
                b'"' => "\\\"",
                _ => "\\n",
            })?;
            rest = &rest[i + 1..];
        }
        encoder.write_str(rest)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteClass {
    route: Label,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: Label,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitResult {
    route: Label,
    limit: Label,
    result: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLimit {
    route: Label,
    limit: Label,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CompressionLabel {
    route: Label,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CompressionBytesLabel {
    route: Label,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AuthLabel {
    route: Label,
    result: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabel {
    route: Label,
    step: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KeySetLabel {
    url: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    route: String,
    source: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabel {
    upstream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerLabel {
    upstream: Label,
    server: Label,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SplitLabel {
    route: Label,
    upstream: Label,
    by: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DnsLabel {
    upstream: Label,
    name: Label,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DnsResultLabel {
    upstream: Label,
    name: Label,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StaleLabel {
    route: Label,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteDirection {
    route: Label,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TimeoutKind {
    kind: &'static str,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum Outcome {
    allowed,
    delayed,
    throttled,
    shadow_throttled,
}

/// Upper bounds of [`Seconds`]: 100 µs × 2^i, i < 19 (100 µs … ~26 s), then +Inf.
pub const SECONDS_BOUNDS: usize = 19;
const FIRST_BOUND_NS: u64 = 100_000;

/// A latency histogram of plain relaxed atomics. prometheus-client's own `Histogram` takes
/// a write lock per observation, which on a route's hot path is a lock every worker
/// thread shares; this one only adds.
#[derive(Clone, Debug, Default)]
pub struct Seconds(Arc<SecondsInner>);

#[derive(Debug, Default)]
struct SecondsInner {
    buckets: [AtomicU64; SECONDS_BOUNDS + 1],
    sum_ns: AtomicU64,
}

impl Seconds {
    pub fn observe(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let inner = &*self.0;
        inner.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        inner.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The count of each bucket (not cumulative), the last one above every bound: what the
    /// dashboard keeps a second at a time.
    pub fn counts(&self) -> [u64; SECONDS_BOUNDS + 1] {
        let inner = &*self.0;
        std::array::from_fn(|i| inner.buckets[i].load(Ordering::Relaxed))
    }

    /// The upper bound of bucket `i < SECONDS_BOUNDS`, in seconds.
    pub fn bound_secs(i: usize) -> f64 {
        (FIRST_BOUND_NS << i) as f64 / 1e9
    }
}

/// The first bucket whose bound holds `ns`: with q = ⌊(ns − 1) / 100 µs⌋, ns ≤ 100 µs × 2^i
/// exactly when q < 2^i, i.e. when q needs at most i bits.
fn bucket_of(ns: u64) -> usize {
    let q = ns.saturating_sub(1) / FIRST_BOUND_NS;
    ((u64::BITS - q.leading_zeros()) as usize).min(SECONDS_BOUNDS)
}

impl TypedMetric for Seconds {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Seconds {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let inner = &*self.0;
        let mut buckets = [(0.0, 0); SECONDS_BOUNDS + 1];
        for (i, (bound, n)) in buckets.iter_mut().enumerate() {
            *bound = if i < SECONDS_BOUNDS { (FIRST_BOUND_NS << i) as f64 / 1e9 } else { f64::MAX };
            *n = inner.buckets[i].load(Ordering::Relaxed);
        }
        // The count is the buckets' sum, so a scrape racing an observation stays consistent.
        let count = buckets.iter().map(|b| b.1).sum();
        let sum = inner.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// The process-wide registry; it outlives config reloads.
pub struct Metrics {
    registry: Registry,
    /// Every family registered, as `/metrics` names it once it has a series (see
    /// [`Metrics::families`]).
    families: Vec<(String, MetricType)>,
    requests: Family<RouteClass, Counter>,
    decisions: Family<LimitResult, Counter>,
    stale: Family<StaleLabel, Counter>,
    upstream_seconds: Family<RouteLabel, Seconds>,
    local_keys: Family<RouteLimit, Gauge>,
    cost_unread: Family<RouteLimit, Counter>,
    early_retries: Family<RouteLimit, Counter>,
    in_flight: Gauge,
    /// The store of copies (stale copies and routes' caches): bytes and URLs held, set at scrape.
    cache_bytes: Gauge,
    cache_entries: Gauge,
    concurrency_limit: Family<RouteLabel, Gauge>,
    errors: Family<ErrorLabel, Counter>,
    auth: Family<AuthLabel, Counter>,
    compression: Family<CompressionLabel, Counter>,
    compression_bytes: Family<CompressionBytesLabel, Counter>,
    steps: Family<StepLabel, Counter>,
    key_set_reads: Family<KeySetLabel, Counter>,
    upstream_read_timeouts: Family<UpstreamLabel, Counter>,
    tunnels_open: Family<RouteLabel, Gauge>,
    tunnel_bytes: Family<RouteDirection, Counter>,
    connections: ConnMetrics,
    servers: ServerFamilies,
    dns: DnsFamilies,
    split: Family<SplitLabel, Counter>,
    /// Each route's last throttled requests, by route name: kept across reloads as the
    /// counters are.
    throttles: std::sync::Mutex<std::collections::HashMap<String, Arc<Throttles>>>,
    traces: TraceMetrics,
    certificates: CertMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CertLabel {
    certificate: Label,
    origin: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OrderLabel {
    certificate: Label,
    result: &'static str,
}

/// The certificates tollgate obtains itself (`tls.acme`, `tls.internal`), by their first name.
#[derive(Clone, Default)]
pub struct CertMetrics {
    expiry: Family<CertLabel, Gauge>,
    orders: Family<OrderLabel, Counter>,
}

/// Where a served certificate came from, as the `origin` label says it.
const ORIGINS: [&str; 3] = ["acme", "internal", "placeholder"];

impl CertMetrics {
    /// `certificate` is in service from `origin` until `not_after` (unix seconds); its series
    /// of any other origin goes (a placeholder replaced by the CA's certificate).
    pub fn served(&self, certificate: &str, origin: &'static str, not_after: i64) {
        for other in ORIGINS.iter().filter(|o| **o != origin) {
            self.expiry.remove(&CertLabel { certificate: Label::new(certificate), origin: other });
        }
        self.expiry.get_or_create(&CertLabel { certificate: Label::new(certificate), origin }).set(not_after);
    }

    /// `certificate` is no longer configured.
    pub fn gone(&self, certificate: &str) {
        for origin in ORIGINS {
            self.expiry.remove(&CertLabel { certificate: Label::new(certificate), origin });
        }
    }

    /// One order ended: `issued` or `failed`.
    pub fn order(&self, certificate: &str, result: &'static str) {
        self.orders.get_or_create(&OrderLabel { certificate: Label::new(certificate), result }).inc();
    }
}

/// The span export's counters (`tracing:`): what reached the collector and what did not.
#[derive(Clone, Default)]
pub struct TraceMetrics {
    /// Spans the collector accepted.
    pub exported: Counter,
    /// Spans dropped: the queue was full, or their batch's export failed.
    pub dropped: Counter,
    /// Export calls that failed (no connection, a timeout, an error answer).
    pub export_failures: Counter,
}

/// The series of a group's servers (`servers:` upstreams), by upstream and server URL.
#[derive(Default)]
struct ServerFamilies {
    requests: Family<ServerLabel, Counter>,
    failures: Family<ServerLabel, Counter>,
    retried: Family<ServerLabel, Counter>,
    ejections: Family<ServerLabel, Counter>,
    ejected: Family<ServerLabel, Gauge>,
    healthy: Family<ServerLabel, Gauge>,
    in_flight: Family<ServerLabel, Gauge>,
    latency: Family<ServerLabel, Seconds>,
}

/// The series of the names groups resolve (`resolve:` servers).
#[derive(Default)]
struct DnsFamilies {
    resolutions: Family<DnsResultLabel, Counter>,
    servers: Family<DnsLabel, Gauge>,
    stale: Family<DnsLabel, Gauge>,
}

/// One resolved name's handles.
#[derive(Clone, Default)]
pub struct DnsMetrics {
    /// Lookups that gave servers.
    pub resolved: Counter,
    /// Lookups that failed or gave none (the last good servers stay).
    pub failed: Counter,
    /// Servers the name gives now.
    pub servers: Gauge,
    /// 1 while the last good servers are kept because the latest lookup failed.
    pub stale: Gauge,
}

/// One server's handles.
#[derive(Clone, Default)]
pub struct ServerMetrics {
    /// Tries sent to it (first tries and retries).
    pub requests: Counter,
    /// Tries that failed: no connection, broken, timed out, or a 5xx.
    pub failures: Counter,
    /// Failed tries that went on to another server.
    pub retried: Counter,
    pub ejections: Counter,
    /// 1 while passively ejected (set at scrape).
    pub ejected: Gauge,
    /// 1 while its active checks pass (or it has none).
    pub healthy: Gauge,
    /// Tries waiting for a response head.
    pub in_flight: Gauge,
    /// Time to the response head.
    pub latency: Seconds,
}

/// A route's tunnel handles: open tunnels, bytes each way.
#[derive(Clone, Default)]
pub struct TunnelMetrics {
    pub open: Gauge,
    /// Bytes from the client to the upstream.
    pub bytes_up: Counter,
    /// Bytes from the upstream to the client.
    pub bytes_down: Counter,
}

/// The client listener's connection handles (unregistered ones for the admin listener).
#[derive(Clone, Default)]
pub struct ConnMetrics {
    pub open: Gauge,
    /// This worker's accepted connections ([`ConnMetrics::for_worker`]).
    pub accepted: Counter,
    /// Accepted connections by worker: how the kernel spreads them over `server.workers`.
    accepted_by_worker: Family<WorkerLabel, Counter>,
    pub refused: Counter,
    pub timeouts: ConnTimeouts,
    /// TLS handshakes and PROXY headers of the `listen` room.
    pub edge: EdgeMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: u32,
}

impl ConnMetrics {
    /// The handles of worker `index` (see [`crate::workers`]).
    pub fn for_worker(&self, index: usize) -> ConnMetrics {
        let worker = u32::try_from(index).unwrap_or(u32::MAX);
        ConnMetrics { accepted: self.accepted_by_worker.get_or_create(&WorkerLabel { worker }).clone(), ..self.clone() }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// What happens at the edge of a connection, before HTTP.
#[derive(Clone, Default)]
pub struct EdgeMetrics {
    pub tls_handshakes: Counter,
    tls_failures: Family<ReasonLabel, Counter>,
    proxy_refused: Family<ReasonLabel, Counter>,
    /// HTTP/3 listeners' QUIC connections.
    pub quic: QuicMetrics,
}

/// What the QUIC endpoints of HTTP/3 listeners do, and the requests they carry (the
/// protocol's share of `requests`).
#[derive(Clone, Default)]
pub struct QuicMetrics {
    pub handshakes: Counter,
    pub open: Gauge,
    /// Retry packets sent: address validation asked of a new client.
    pub retries: Counter,
    refused: Family<ReasonLabel, Counter>,
    pub requests: Counter,
}

impl QuicMetrics {
    /// A new connection refused or dropped before HTTP/3, by a fixed reason.
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }
}

impl EdgeMetrics {
    /// A failed TLS handshake, by a fixed reason (`timeout`, `not_tls`, …).
    pub fn tls_failed(&self, reason: &'static str) {
        self.tls_failures.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// A connection closed for its PROXY header (or the lack of one), by reason.
    pub fn proxy_refused(&self, reason: &'static str) {
        self.proxy_refused.get_or_create(&ReasonLabel { reason }).inc();
    }
}

/// Connections closed by a server timeout, by which one.
#[derive(Clone, Default)]
pub struct ConnTimeouts {
    pub header_read: Counter,
    pub keepalive: Counter,
    pub send: Counter,
    pub h2_idle: Counter,
    pub h2_ping: Counter,
}

/// Per-route handles.
#[derive(Clone)]
pub struct RouteMetrics {
    classes: [Counter; 5],
    pub upstream_seconds: Seconds,
    pub stale_throttled: Counter,
    pub stale_upstream_error: Counter,
    pub tunnels: TunnelMetrics,
    /// The last throttled requests (the admin dashboard shows them).
    pub throttles: Arc<Throttles>,
}

impl RouteMetrics {
    pub fn response(&self, status: u16) {
        let i = usize::from(status / 100).clamp(1, 5) - 1;
        self.classes[i].inc();
    }

    /// Answers so far by status class, 1xx to 5xx.
    pub fn class_counts(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.classes[i].get())
    }
}

/// Per-limit handles.
#[derive(Clone)]
pub struct LimitMetrics {
    pub allowed: Counter,
    pub delayed: Counter,
    pub throttled: Counter,
    pub shadow_throttled: Counter,
    pub keys: Gauge,
    /// Requests of a key back before the Retry-After it was told (see `gate::early`).
    pub early_retries: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Recorded { registry: Registry::with_prefix("tollgate"), families: Vec::new() };
        let requests = Family::<RouteClass, Counter>::default();
        registry.register("requests", "Requests answered, by route and status class", requests.clone());
        let decisions = Family::<LimitResult, Counter>::default();
        registry.register("limiter_decisions", "Limiter decisions by route, limit and result", decisions.clone());
        let stale = Family::<StaleLabel, Counter>::default();
        registry.register("stale_responses", "Stale copies served, by route and reason", stale.clone());
        let upstream_seconds = Family::<RouteLabel, Seconds>::default();
        registry.register(
            "upstream_response_seconds",
            "Time to the upstream's response head",
            upstream_seconds.clone(),
        );
        let local_keys = Family::<RouteLimit, Gauge>::default();
        registry.register("local_store_keys", "Live keys in the in-process store", local_keys.clone());
        let cost_unread = Family::<RouteLimit, Counter>::default();
        registry.register(
            "response_cost_unread",
            "Responses of a limit with cost.response_header whose header was missing or not a number (nothing debited)",
            cost_unread.clone(),
        );
        let early_retries = Family::<RouteLimit, Counter>::default();
        registry.register(
            "early_retries",
            "Requests of a key this instance denied, back before the Retry-After it was told",
            early_retries.clone(),
        );
        let in_flight = Gauge::default();
        registry.register("requests_in_flight", "Requests being served", in_flight.clone());
        let cache_bytes = Gauge::default();
        registry.register(
            "cache_bytes",
            "Weighted bytes the store of copies holds (cache.max_bytes bounds it)",
            cache_bytes.clone(),
        );
        let cache_entries = Gauge::default();
        registry.register(
            "cache_entries",
            "URLs the store of copies holds (each with one or more variants)",
            cache_entries.clone(),
        );
        let concurrency_limit = Family::<RouteLabel, Gauge>::default();
        registry.register(
            "concurrency_limit",
            "The concurrency cap of a route now: its max, or where its adaptive limit stands",
            concurrency_limit.clone(),
        );
        let errors = Family::<ErrorLabel, Counter>::default();
        registry.register(
            "errors",
            "Answers tollgate made itself, by route (- before routing), source and kind",
            errors.clone(),
        );
        let auth = Family::<AuthLabel, Counter>::default();
        registry.register(
            "auth",
            "Requests of routes with `auth`, by route, result (authenticated, anonymous, refused) and reason",
            auth.clone(),
        );
        let compression = Family::<CompressionLabel, Counter>::default();
        registry.register(
            "compression",
            "Answers of routes with `compression`, by route and result (gzip, br, zstd: encoded; identity: sent as \
             they are with Vary: Accept-Encoding)",
            compression.clone(),
        );
        let compression_bytes = Family::<CompressionBytesLabel, Counter>::default();
        registry.register(
            "compression_bytes",
            "Bytes taken (in) and emitted (out) by the encoders of routes with `compression`",
            compression_bytes.clone(),
        );
        let steps = Family::<StepLabel, Counter>::default();
        registry.register(
            "steps",
            "What a route's steps did (e.g. cors: allowed, refused, preflight, preflight_refused), by route, step and result",
            steps.clone(),
        );
        let key_set_reads = Family::<KeySetLabel, Counter>::default();
        registry.register(
            "auth_key_set_reads",
            "Readings of a JWT key set URL, by URL (without its query) and result (ok, failed: the last good set kept)",
            key_set_reads.clone(),
        );
        let upstream_read_timeouts = Family::<UpstreamLabel, Counter>::default();
        registry.register(
            "upstream_read_timeouts",
            "Upstream responses cut off after sending nothing for the upstream's read_timeout",
            upstream_read_timeouts.clone(),
        );
        let tunnels_open = Family::<RouteLabel, Gauge>::default();
        registry.register("tunnels_open", "Tunnels (upgraded connections) open, by route", tunnels_open.clone());
        let tunnel_bytes = Family::<RouteDirection, Counter>::default();
        registry.register(
            "tunnel_bytes",
            "Bytes carried by tunnels, by route and direction (up: client to upstream)",
            tunnel_bytes.clone(),
        );
        let timeouts = Family::<TimeoutKind, Counter>::default();
        let kind = |kind| timeouts.get_or_create(&TimeoutKind { kind }).clone();
        let connections = ConnMetrics {
            timeouts: ConnTimeouts {
                header_read: kind("header_read"),
                keepalive: kind("keepalive"),
                send: kind("send"),
                h2_idle: kind("h2_idle"),
                h2_ping: kind("h2_ping"),
            },
            ..ConnMetrics::default()
        };
        registry.register(
            "connections_open",
            "Client connections open (protocol detection included)",
            connections.open.clone(),
        );
        registry.register(
            "connections_accepted",
            "Client connections accepted and served, by worker",
            connections.accepted_by_worker.clone(),
        );
        registry.register(
            "connections_refused",
            "Client connections closed on accept because server.max_connections were open",
            connections.refused.clone(),
        );
        registry.register("connection_timeouts", "Client connections closed by a server timeout, by kind", timeouts);
        let e = &connections.edge;
        registry.register("tls_handshakes", "TLS handshakes completed by client connections", e.tls_handshakes.clone());
        registry.register(
            "tls_handshake_failures",
            "TLS handshakes of client connections that failed, by reason",
            e.tls_failures.clone(),
        );
        registry.register(
            "proxy_protocol_refused",
            "Client connections closed for their PROXY protocol header, by reason",
            e.proxy_refused.clone(),
        );
        let q = &e.quic;
        registry.register("quic_handshakes", "QUIC handshakes completed by HTTP/3 clients", q.handshakes.clone());
        registry.register("quic_connections_open", "HTTP/3 client connections open", q.open.clone());
        registry.register(
            "quic_retries",
            "QUIC Retry packets sent (address validation of new clients)",
            q.retries.clone(),
        );
        registry.register(
            "quic_refused",
            "New QUIC connections refused or failed before HTTP/3, by reason",
            q.refused.clone(),
        );
        registry.register("http3_requests", "Requests received over HTTP/3 (a share of requests)", q.requests.clone());
        let servers = ServerFamilies::default();
        let s = &servers;
        registry.register("upstream_server_requests", "Tries sent to a server of a group", s.requests.clone());
        registry.register(
            "upstream_server_failures",
            "Tries to a server of a group that failed (connect, broken, timeout, 5xx)",
            s.failures.clone(),
        );
        registry.register(
            "upstream_server_retries",
            "Failed tries to a server of a group that were retried on another server",
            s.retried.clone(),
        );
        registry.register(
            "upstream_server_ejections",
            "Times a server of a group was ejected after consecutive failures",
            s.ejections.clone(),
        );
        registry.register("upstream_server_ejected", "1 while a server of a group is ejected", s.ejected.clone());
        registry.register(
            "upstream_server_healthy",
            "1 while a server of a group passes its active health checks (or has none)",
            s.healthy.clone(),
        );
        registry.register(
            "upstream_server_in_flight",
            "Tries to a server of a group waiting for a response head",
            s.in_flight.clone(),
        );
        registry.register(
            "upstream_server_response_seconds",
            "Time to a group server's response head",
            s.latency.clone(),
        );
        let split = Family::<SplitLabel, Counter>::default();
        registry.register(
            "route_split_requests",
            "Requests of a split route by the upstream chosen and how (weight, sticky, override)",
            split.clone(),
        );
        let dns = DnsFamilies::default();
        registry.register(
            "upstream_dns_resolutions",
            "Lookups of a group's resolve: names, by result (ok, failed: the last good servers stay)",
            dns.resolutions.clone(),
        );
        registry.register("upstream_dns_servers", "Servers a group's resolve: name gives now", dns.servers.clone());
        registry.register(
            "upstream_dns_stale",
            "1 while a group keeps a name's last good servers because its latest lookup failed",
            dns.stale.clone(),
        );
        let traces = TraceMetrics::default();
        registry.register("trace_spans_exported", "Spans the OTLP collector accepted", traces.exported.clone());
        registry.register(
            "trace_spans_dropped",
            "Spans dropped: the export queue was full, or their batch's export failed",
            traces.dropped.clone(),
        );
        registry.register(
            "trace_export_failures",
            "OTLP export calls that failed (no connection, a timeout, an error answer); their spans are dropped",
            traces.export_failures.clone(),
        );
        let certificates = CertMetrics::default();
        registry.register(
            "certificate_expiry_timestamp_seconds",
            "When each certificate tollgate obtains itself expires (unix seconds), by its first name and origin \
             (acme, internal, or placeholder: self-signed while its CA has issued none)",
            certificates.expiry.clone(),
        );
        registry.register(
            "acme_orders",
            "ACME orders, by certificate and result (issued, failed)",
            certificates.orders.clone(),
        );
        Metrics {
            certificates,
            traces,
            servers,
            dns,
            split,
            registry: registry.registry,
            families: registry.families,
            requests,
            decisions,
            stale,
            upstream_seconds,
            local_keys,
            cost_unread,
            early_retries,
            in_flight,
            cache_bytes,
            cache_entries,
            concurrency_limit,
            errors,
            auth,
            compression,
            compression_bytes,
            steps,
            key_set_reads,
            upstream_read_timeouts,
            tunnels_open,
            tunnel_bytes,
            connections,
            throttles: Default::default(),
        }
    }

    pub fn route(&self, route: &str) -> RouteMetrics {
        let class = |class| self.requests.get_or_create(&RouteClass { route: Label::new(route), class }).clone();
        let stale = |reason| self.stale.get_or_create(&StaleLabel { route: Label::new(route), reason }).clone();
        // A closure each: a family's read guard lives to the end of the expression that takes
        // it, and a second `get_or_create` on the same family in that expression would wait
        // for it forever.
        let bytes = |direction| {
            self.tunnel_bytes.get_or_create(&RouteDirection { route: Label::new(route), direction }).clone()
        };
        RouteMetrics {
            classes: [class("1xx"), class("2xx"), class("3xx"), class("4xx"), class("5xx")],
            upstream_seconds: self.upstream_seconds.get_or_create(&RouteLabel { route: Label::new(route) }).clone(),
            stale_throttled: stale("throttled"),
            stale_upstream_error: stale("upstream_error"),
            tunnels: TunnelMetrics {
                open: self.tunnels_open.get_or_create(&RouteLabel { route: Label::new(route) }).clone(),
                bytes_up: bytes("up"),
                bytes_down: bytes("down"),
            },
            throttles: self.throttles(route),
        }
    }

    /// The ring of route `route`'s last throttled requests, made on first use.
    fn throttles(&self, route: &str) -> Arc<Throttles> {
        let mut all = self.throttles.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        all.entry(route.to_owned()).or_default().clone()
    }

    /// The gauge `tollgate_concurrency_limit{route}`.
    pub fn concurrency_limit(&self, route: &str) -> Gauge {
        self.concurrency_limit.get_or_create(&RouteLabel { route: Label::new(route) }).clone()
    }

    pub fn limit(&self, route: &str, limit: &str) -> LimitMetrics {
        let get = |result| {
            self.decisions
                .get_or_create(&LimitResult { route: Label::new(route), limit: Label::new(limit), result })
                .clone()
        };
        LimitMetrics {
            allowed: get(Outcome::allowed),
            delayed: get(Outcome::delayed),
            throttled: get(Outcome::throttled),
            shadow_throttled: get(Outcome::shadow_throttled),
            keys: self
                .local_keys
                .get_or_create(&RouteLimit { route: Label::new(route), limit: Label::new(limit) })
                .clone(),
            early_retries: self
                .early_retries
                .get_or_create(&RouteLimit { route: Label::new(route), limit: Label::new(limit) })
                .clone(),
        }
    }

    /// Responses of a limit with `cost.response_header` whose header was missing or not a
    /// number (only such limits have the series).
    pub fn cost_unread(&self, route: &str, limit: &str) -> Counter {
        self.cost_unread.get_or_create(&RouteLimit { route: Label::new(route), limit: Label::new(limit) }).clone()
    }

    /// The counter of answers of `kind` (from `source`) on `route`.
    /// The count of route `route`'s `auth` results: `authenticated` and `anonymous` with
    /// reason `-`, `refused` with why.
    pub fn auth(&self, route: &str, result: &'static str, reason: &'static str) -> Counter {
        self.auth.get_or_create(&AuthLabel { route: Label::new(route), result, reason }).clone()
    }

    /// The count of route `route`'s answers with compression result `result`.
    pub fn compression(&self, route: &str, result: &'static str) -> Counter {
        self.compression.get_or_create(&CompressionLabel { route: Label::new(route), result }).clone()
    }

    /// The count of the bytes route `route`'s encoders took (`in`) or emitted (`out`).
    pub fn compression_bytes(&self, route: &str, direction: &'static str) -> Counter {
        self.compression_bytes.get_or_create(&CompressionBytesLabel { route: Label::new(route), direction }).clone()
    }

    /// The count of what step `step` of route `route` did (`result`).
    pub fn step(&self, route: &str, step: &'static str, result: &'static str) -> Counter {
        self.steps.get_or_create(&StepLabel { route: Label::new(route), step, result }).clone()
    }

    /// The counts of a key set URL's readings: those that gave a set, those that failed.
    pub fn key_set_reads(&self, url: &str) -> (Counter, Counter) {
        let count = |result| self.key_set_reads.get_or_create(&KeySetLabel { url: url.to_owned(), result }).clone();
        (count("ok"), count("failed"))
    }

    pub fn error(&self, route: &str, source: &'static str, kind: &'static str) -> Counter {
        self.errors.get_or_create(&ErrorLabel { route: route.to_owned(), source, kind }).clone()
    }

    /// The handles of server `server` (its URL) of group `upstream`.
    pub fn server(&self, upstream: &str, server: &str) -> ServerMetrics {
        let l = || ServerLabel { upstream: Label::new(upstream), server: Label::new(server) };
        let s = &self.servers;
        let healthy = s.healthy.get_or_create(&l()).clone();
        healthy.set(1);
        ServerMetrics {
            requests: s.requests.get_or_create(&l()).clone(),
            failures: s.failures.get_or_create(&l()).clone(),
            retried: s.retried.get_or_create(&l()).clone(),
            ejections: s.ejections.get_or_create(&l()).clone(),
            ejected: s.ejected.get_or_create(&l()).clone(),
            healthy,
            in_flight: s.in_flight.get_or_create(&l()).clone(),
            latency: s.latency.get_or_create(&l()).clone(),
        }
    }

    /// The count of split route `route`'s requests sent to `upstream`, chosen `by`.
    pub fn split(&self, route: &str, upstream: &str, by: &'static str) -> Counter {
        self.split.get_or_create(&SplitLabel { route: Label::new(route), upstream: Label::new(upstream), by }).clone()
    }

    /// The handles of name `name` resolved for group `upstream`.
    pub fn dns(&self, upstream: &str, name: &str) -> DnsMetrics {
        let l = || DnsLabel { upstream: Label::new(upstream), name: Label::new(name) };
        let r = |result| {
            self.dns
                .resolutions
                .get_or_create(&DnsResultLabel { upstream: Label::new(upstream), name: Label::new(name), result })
                .clone()
        };
        DnsMetrics {
            resolved: r("ok"),
            failed: r("failed"),
            servers: self.dns.servers.get_or_create(&l()).clone(),
            stale: self.dns.stale.get_or_create(&l()).clone(),
        }
    }

    pub fn upstream_read_timeouts(&self, upstream: &str) -> Counter {
        self.upstream_read_timeouts.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).clone()
    }

    pub fn in_flight(&self) -> &Gauge {
        &self.in_flight
    }

    /// Sets the store of copies' gauges: bytes held, URLs held.
    pub fn cache_held(&self, bytes: u64, entries: u64) {
        self.cache_bytes.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.cache_entries.set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    /// The certificates tollgate obtains itself.
    pub fn certificates(&self) -> &CertMetrics {
        &self.certificates
    }

    /// The span export's counters (`tracing:`).
    pub fn traces(&self) -> &TraceMetrics {
        &self.traces
    }

    pub fn connections(&self) -> &ConnMetrics {
        &self.connections
    }

    /// Every family `/metrics` can show, with its type: those of the registry (a family with
    /// labels shows once it has a series), then the Redis store's (shown with a Redis client).
    /// Names as exposed (`tollgate_`, and `_total` for counters).
    pub fn families(&self) -> Vec<(String, &'static str)> {
        let mut out: Vec<(String, &'static str)> = self
            .families
            .iter()
            .map(|(name, t)| {
                let (suffix, kind) = match t {
                    MetricType::Counter => ("_total", "counter"),
                    MetricType::Gauge => ("", "gauge"),
                    MetricType::Histogram => ("", "histogram"),
                    MetricType::Info => ("_info", "info"),
                    _ => ("", "unknown"),
                };
                (format!("tollgate_{name}{suffix}"), kind)
            })
            .collect();
        let mut redis = String::new();
        encode_redis(&mut redis, &Snapshot::default(), 0);
        for line in redis.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let mut words = line.split(' ');
            if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                let kind = if kind == "counter" {
                    "counter"
                } else if kind == "gauge" {
                    "gauge"
                } else {
                    "histogram"
                };
                let suffix = if kind == "counter" { "_total" } else { "" };
                out.push((format!("{name}{suffix}"), kind));
            }
        }
        out
    }

    /// The Prometheus text exposition (OpenMetrics flavour, which Prometheus scrapes), with
    /// the Redis store's counters when a Redis client exists.
    pub fn encode(&self, redis: Option<&RedisClient>) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        if let Some(client) = redis {
            // The store keeps plain atomics of its own; they are rendered at scrape time,
            // before the closing `# EOF`.
            let body = out.strip_suffix("# EOF\n").map(str::to_owned).unwrap_or(out);
            out = body;
            let state = match client.breaker_state() {
                BreakerState::Closed => 0,
                BreakerState::Open => 1,
                BreakerState::HalfOpen => 2,
            };
            encode_redis(&mut out, &client.metrics().snapshot(), state);
            out.push_str("# EOF\n");
        }
        out
    }
}

/// The registry while [`Metrics::new`] fills it, noting each family's name and type.
struct Recorded {
    registry: Registry,
    families: Vec<(String, MetricType)>,
}

impl Recorded {
    fn register(&mut self, name: &str, help: &str, metric: impl prometheus_client::registry::Metric) {
        self.families.push((name.to_owned(), metric.metric_type()));
        self.registry.register(name, help, metric);
    }
}

fn encode_redis(out: &mut String, s: &Snapshot, breaker: i64) {
    use std::fmt::Write;
    let _ = writeln!(out, "# HELP tollgate_redis_decision_seconds Latency of one Redis limiter call.");
    let _ = writeln!(out, "# TYPE tollgate_redis_decision_seconds histogram");
    let mut cumulative = 0;
    for (i, bound) in LATENCY_BUCKETS_US.iter().enumerate() {
        cumulative += s.latency_buckets.get(i).copied().unwrap_or(0);
        let _ = writeln!(out, "tollgate_redis_decision_seconds_bucket{{le=\"{}\"}} {cumulative}", *bound as f64 / 1e6);
    }
    cumulative += s.latency_buckets.get(LATENCY_BUCKETS_US.len()).copied().unwrap_or(0);
    let _ = writeln!(out, "tollgate_redis_decision_seconds_bucket{{le=\"+Inf\"}} {cumulative}");
    let _ = writeln!(out, "tollgate_redis_decision_seconds_sum {}", s.latency_sum_us as f64 / 1e6);
    let _ = writeln!(out, "tollgate_redis_decision_seconds_count {cumulative}");
    let _ = writeln!(out, "# HELP tollgate_redis_errors Redis calls that gave no answer, by kind.");
    let _ = writeln!(out, "# TYPE tollgate_redis_errors counter");
    for (kind, n) in [
        ("timeout", s.timeouts),
        ("connection", s.connection_errors),
        ("reply", s.reply_errors),
        ("breaker_open", s.short_circuits),
    ] {
        let _ = writeln!(out, "tollgate_redis_errors_total{{kind=\"{kind}\"}} {n}");
    }
    for (name, help, n) in [
        ("redis_calls", "Script calls sent to Redis.", s.calls),
        ("redis_fallbacks", "Decisions answered by on_error instead of Redis.", s.fallbacks),
        (
            "redis_redirects",
            "Cluster redirects (MOVED, ASK) followed by the store after the cluster client's own.",
            s.redirects,
        ),
        ("redis_denial_memory_hits", "Denials answered from the local memory of a Redis denial.", s.denial_hits),
        ("redis_lease_hits", "Admissions spent from a local lease.", s.lease_hits),
    ] {
        let _ = writeln!(out, "# HELP tollgate_{name} {help}");
        let _ = writeln!(out, "# TYPE tollgate_{name} counter");
        let _ = writeln!(out, "tollgate_{name}_total {n}");
    }
    let _ = writeln!(out, "# HELP tollgate_redis_breaker_state Redis circuit breaker: 0 closed, 1 open, 2 half-open.");
    let _ = writeln!(out, "# TYPE tollgate_redis_breaker_state gauge");
    let _ = writeln!(out, "tollgate_redis_breaker_state {breaker}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The families of `docs/reference/metrics.md`'s tables, with the type each row gives.
    fn documented() -> Vec<(String, String)> {
        include_str!("../docs/reference/metrics.md")
            .lines()
            .filter_map(|l| {
                let mut cells = l.split('|').map(str::trim).skip(1);
                let name = cells.next()?.strip_prefix('`')?.strip_suffix('`')?;
                let kind = cells.next()?;
                name.starts_with("tollgate_").then(|| (name.to_owned(), kind.to_owned()))
            })
            .collect()
    }

    #[test]
    fn every_family_is_documented_with_its_type_and_the_page_names_no_other() {
        let page = documented();
        let families = Metrics::new().families();
        let mut undocumented = Vec::new();
        for (name, kind) in &families {
            match page.iter().find(|(n, _)| n == name) {
                None => undocumented.push(name.clone()),
                Some((_, k)) => assert_eq!(k, kind, "{name}: the page says {k}"),
            }
        }
        assert!(undocumented.is_empty(), "not in docs/reference/metrics.md: {undocumented:?}");
        let unknown: Vec<&String> =
            page.iter().map(|(n, _)| n).filter(|n| !families.iter().any(|(f, _)| f == *n)).collect();
        assert!(unknown.is_empty(), "documented, never exported: {unknown:?}");
        // What /metrics shows is among them.
        let text = Metrics::new().encode(None);
        for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let name = line.split(' ').next().unwrap_or_default();
            assert!(families.iter().any(|(f, _)| f.starts_with(name)), "{name} shown but not listed");
        }
    }

    #[test]
    fn buckets_hold_values_up_to_their_bound() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(100_000), 0);
        assert_eq!(bucket_of(100_001), 1);
        assert_eq!(bucket_of(200_000), 1);
        assert_eq!(bucket_of(200_001), 2);
        assert_eq!(bucket_of(FIRST_BOUND_NS << 18), 18);
        assert_eq!(bucket_of((FIRST_BOUND_NS << 18) + 1), SECONDS_BOUNDS);
        assert_eq!(bucket_of(u64::MAX), SECONDS_BOUNDS);
        for i in 0..SECONDS_BOUNDS {
            let bound = FIRST_BOUND_NS << i;
            assert_eq!(bucket_of(bound), i, "{bound}");
            assert_eq!(bucket_of(bound + 1), i + 1, "{bound}");
        }
    }

    #[test]
    fn label_values_cannot_write_series_of_their_own() {
        let m = Metrics::new();
        let hostile = "x\"} 1\nfake_metric{a=\"b\\";
        m.route(hostile).response(200);
        m.limit(hostile, "l\nfake_limit 1");
        let text = m.encode(None);
        let lines = text.lines().map(|l| Ok(l.to_owned()));
        let scrape = prometheus_parse::Scrape::parse(lines).expect("the exposition parses");
        assert!(text.lines().all(|l| !l.starts_with("fake_")), "{text}");
        assert!(scrape.samples.iter().all(|s| !s.metric.starts_with("fake_")), "{text}");
        assert!(
            text.contains("route=\"x\\\"} 1\\nfake_metric{a=\\\"b\\\\\""),
            "the value is escaped, not dropped: {text}"
        );
    }

    #[test]
    fn seconds_encode_as_a_cumulative_histogram() {
        let m = Metrics::new();
        let r = m.route("api");
        r.upstream_seconds.observe(Duration::from_micros(50));
        r.upstream_seconds.observe(Duration::from_micros(150));
        r.upstream_seconds.observe(Duration::from_secs(60));
        let text = m.encode(None);
        let line = |needle: &str| text.lines().find(|l| l.starts_with(needle)).map(str::to_owned);
        let bucket =
            |le: &str| line(&format!("tollgate_upstream_response_seconds_bucket{{le=\"{le}\",route=\"api\"}}"));
        assert_eq!(
            bucket("0.0001").as_deref(),
            Some("tollgate_upstream_response_seconds_bucket{le=\"0.0001\",route=\"api\"} 1"),
            "{text}"
        );
        assert!(bucket("0.0002").is_some_and(|l| l.ends_with(" 2")), "{text}");
        assert!(bucket("+Inf").is_some_and(|l| l.ends_with(" 3")), "{text}");
        assert!(line("tollgate_upstream_response_seconds_count").is_some_and(|l| l.ends_with(" 3")), "{text}");
        let sum = line("tollgate_upstream_response_seconds_sum").unwrap_or_default();
        let sum: f64 = sum.rsplit(' ').next().unwrap_or("").parse().unwrap();
        assert!((sum - 60.0002).abs() < 1e-9, "{sum}");
    }
}
