//! Prometheus metrics, all prefixed `tollgate_`. Label values come only from config (route
//! and limit names) or fixed sets, never from request data, so cardinality is bounded.
//! Handles are resolved once per route and limit, so the hot path does plain atomic adds.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::limit::store::redis::{BreakerState, RedisClient, Snapshot, LATENCY_BUCKETS_US};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteClass {
    route: String,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitResult {
    route: String,
    limit: String,
    result: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLimit {
    route: String,
    limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StaleLabel {
    route: String,
    reason: &'static str,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum Outcome {
    allowed,
    delayed,
    throttled,
    shadow_throttled,
}

fn seconds_buckets() -> Histogram {
    // 100 µs … ~26 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 19))
}

/// The process-wide registry; it outlives config reloads.
pub struct Metrics {
    registry: Registry,
    requests: Family<RouteClass, Counter>,
    decisions: Family<LimitResult, Counter>,
    stale: Family<StaleLabel, Counter>,
    upstream_seconds: Family<RouteLabel, Histogram, fn() -> Histogram>,
    local_keys: Family<RouteLimit, Gauge>,
    in_flight: Gauge,
}

/// Per-route handles.
#[derive(Clone)]
pub struct RouteMetrics {
    classes: [Counter; 5],
    pub upstream_seconds: Histogram,
    pub stale_throttled: Counter,
    pub stale_upstream_error: Counter,
}

impl RouteMetrics {
    pub fn response(&self, status: u16) {
        let i = usize::from(status / 100).clamp(1, 5) - 1;
        self.classes[i].inc();
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
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("tollgate");
        let requests = Family::<RouteClass, Counter>::default();
        registry.register("requests", "Requests answered, by route and status class", requests.clone());
        let decisions = Family::<LimitResult, Counter>::default();
        registry.register("limiter_decisions", "Limiter decisions by route, limit and result", decisions.clone());
        let stale = Family::<StaleLabel, Counter>::default();
        registry.register("stale_responses", "Stale copies served, by route and reason", stale.clone());
        let upstream_seconds =
            Family::<RouteLabel, Histogram, fn() -> Histogram>::new_with_constructor(seconds_buckets);
        registry.register(
            "upstream_response_seconds",
            "Time to the upstream's response head",
            upstream_seconds.clone(),
        );
        let local_keys = Family::<RouteLimit, Gauge>::default();
        registry.register("local_store_keys", "Live keys in the in-process store", local_keys.clone());
        let in_flight = Gauge::default();
        registry.register("requests_in_flight", "Requests being served", in_flight.clone());
        Metrics { registry, requests, decisions, stale, upstream_seconds, local_keys, in_flight }
    }

    pub fn route(&self, route: &str) -> RouteMetrics {
        let class = |class| self.requests.get_or_create(&RouteClass { route: route.to_owned(), class }).clone();
        let stale = |reason| self.stale.get_or_create(&StaleLabel { route: route.to_owned(), reason }).clone();
        RouteMetrics {
            classes: [class("1xx"), class("2xx"), class("3xx"), class("4xx"), class("5xx")],
            upstream_seconds: self.upstream_seconds.get_or_create(&RouteLabel { route: route.to_owned() }).clone(),
            stale_throttled: stale("throttled"),
            stale_upstream_error: stale("upstream_error"),
        }
    }

    pub fn limit(&self, route: &str, limit: &str) -> LimitMetrics {
        let get = |result| {
            self.decisions
                .get_or_create(&LimitResult { route: route.to_owned(), limit: limit.to_owned(), result })
                .clone()
        };
        LimitMetrics {
            allowed: get(Outcome::allowed),
            delayed: get(Outcome::delayed),
            throttled: get(Outcome::throttled),
            shadow_throttled: get(Outcome::shadow_throttled),
            keys: self
                .local_keys
                .get_or_create(&RouteLimit { route: route.to_owned(), limit: limit.to_owned() })
                .clone(),
        }
    }

    pub fn in_flight(&self) -> &Gauge {
        &self.in_flight
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
