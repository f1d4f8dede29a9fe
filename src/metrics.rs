//! Prometheus metrics, all prefixed `tollgate_`. Label values come only from config (route
//! and limit names) or fixed sets, never from request data, so cardinality is bounded.
//! Handles are resolved once per route and limit, so the hot path does plain atomic adds.

use std::sync::atomic::AtomicI64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorKind {
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

fn seconds_buckets() -> Histogram {
    // 100 µs … ~26 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 19))
}

fn redis_buckets() -> Histogram {
    // 50 µs … ~100 ms: a decision's deadline is 20 ms by default.
    Histogram::new(exponential_buckets(0.00005, 2.0, 12))
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
    pub redis: RedisMetrics,
}

/// What the Redis store reports.
#[derive(Clone)]
pub struct RedisMetrics {
    pub decision_seconds: Histogram,
    errors: Family<ErrorKind, Counter>,
    /// 0 closed (calling Redis), 1 open (not calling), 2 half-open (probing).
    pub breaker_state: Gauge<i64, AtomicI64>,
}

impl RedisMetrics {
    /// Counts a failed decision; `kind` is one of a fixed set (`timeout`, `io`, `script`, …).
    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&ErrorKind { kind }).inc();
    }
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
        let redis = RedisMetrics {
            decision_seconds: redis_buckets(),
            errors: Family::default(),
            breaker_state: Gauge::default(),
        };
        registry.register(
            "redis_decision_seconds",
            "Latency of one Redis limiter decision",
            redis.decision_seconds.clone(),
        );
        registry.register("redis_errors", "Failed Redis decisions by kind", redis.errors.clone());
        registry.register(
            "redis_breaker_state",
            "Redis circuit breaker: 0 closed, 1 open, 2 half-open",
            redis.breaker_state.clone(),
        );
        Metrics { registry, requests, decisions, stale, upstream_seconds, local_keys, in_flight, redis }
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

    /// The Prometheus text exposition (OpenMetrics flavour, which Prometheus scrapes).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
