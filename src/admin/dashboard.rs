//! The live dashboard: `GET /` is one self-contained page (HTML, CSS and JS in the binary,
//! nothing fetched from elsewhere) that polls `GET /dashboard.json` once a second. The JSON
//! is computed here from the [`History`] the sampler keeps and from the counters as they
//! stand, so serving it costs the request path nothing.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::history::{self, History, RouteSample};
use crate::limit::store::redis::BreakerState;
use crate::proxy::{Proxy, Shared};

/// The page, with its style and script inline.
pub const PAGE: &str = include_str!("dashboard.html");

/// The window of the current rates, in seconds.
const RATE_WINDOW: usize = 10;
/// The window of the latency quantiles, in seconds.
const LATENCY_WINDOW: usize = 60;
/// Seconds per point of the latency sparklines.
const LATENCY_STEP: usize = 10;
/// Throttled requests listed, newest first, over all routes.
const RECENT: usize = 20;

/// The history shared by the sampler and the admin listener; `since` is its clock's zero.
pub struct Dashboard {
    history: Mutex<History>,
    since: Instant,
}

impl Default for Dashboard {
    fn default() -> Self {
        Dashboard { history: Mutex::new(History::default()), since: Instant::now() }
    }
}

impl Dashboard {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn history(&self) -> std::sync::MutexGuard<'_, History> {
        self.history.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Samples the live proxy once a second, forever (the admin listener aborts it when it
    /// stops). A late tick is skipped, not caught up: rates divide by the time that passed.
    pub async fn sample(self: Arc<Self>, shared: Shared) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let proxy = shared.load();
            let at = self.now_ms();
            self.history().record(&proxy, at);
        }
    }

    /// What the page shows, as JSON.
    pub fn view(&self, proxy: &Proxy) -> Value {
        let now_ms = self.now_ms();
        let history = self.history();
        let empty = VecDeque::new();
        let routes: Vec<Value> = proxy
            .route_metrics()
            .map(|(route, m)| {
                let ring = history.routes.get(&route.name).unwrap_or(&empty);
                let live = RouteSample::take(proxy, &route.name, m, now_ms);
                let mut v = route_view(ring, &live);
                v["name"] = json!(route.name);
                v["limits"] = json!(route.limits.iter().map(|l| &l.name).collect::<Vec<_>>());
                v
            })
            .collect();
        json!({
            "generated_at_ms": wall_ms(),
            "window_s": history::KEPT,
            "rate_window_s": RATE_WINDOW,
            "latency_window_s": LATENCY_WINDOW,
            "latency_step_s": LATENCY_STEP,
            "latency_histogram": "upstream",
            "in_flight": proxy.metrics().in_flight().get(),
            "routes": routes,
            "upstreams": proxy.groups().map(|g| json!({ "name": g.name(), "servers": g.servers() })).collect::<Vec<_>>(),
            "redis": redis_view(proxy, &history.redis),
            "throttled": recent(proxy),
        })
    }
}

/// Milliseconds since the Unix epoch.
fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Rounds for the page: three decimals are more than it shows.
fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// One route: totals as of `live`, rates over the last [`RATE_WINDOW`] seconds, latency
/// quantiles over the last [`LATENCY_WINDOW`], and per-second series for the sparklines.
fn route_view(ring: &VecDeque<RouteSample>, live: &RouteSample) -> Value {
    let per_s = |f: fn(&RouteSample) -> u64, a: &RouteSample, b: &RouteSample| {
        history::rate((a.at_ms, f(a)), (b.at_ms, f(b))).map(round)
    };
    let (rate, throttled, stale, classes) = match history::window(ring, RATE_WINDOW) {
        Some((a, b)) => (
            per_s(RouteSample::requests, a, b),
            per_s(|s| s.throttled, a, b),
            per_s(|s| s.stale, a, b),
            (0..5).map(|i| history::rate((a.at_ms, a.classes[i]), (b.at_ms, b.classes[i])).map(round)).collect(),
        ),
        None => (None, None, None, vec![None; 5]),
    };
    let bounds = history::latency_bounds_ms();
    let (p50, p99) = match history::window(ring, LATENCY_WINDOW) {
        Some((a, b)) => {
            let d = history::delta(&a.latency, &b.latency);
            (history::quantile(&d, &bounds, 0.5).map(round), history::quantile(&d, &bounds, 0.99).map(round))
        }
        None => (None, None),
    };
    let series = |f: fn(&RouteSample) -> u64| -> Vec<Option<f64>> {
        ring.iter().zip(ring.iter().skip(1)).map(|(a, b)| per_s(f, a, b)).collect()
    };
    // Latency points a step apart, oldest first, each over the step before it.
    let steps: Vec<usize> =
        (0..ring.len().saturating_sub(1) / LATENCY_STEP).map(|k| ring.len() - 1 - k * LATENCY_STEP).collect();
    let latency = |q: f64| -> Vec<Option<f64>> {
        steps
            .iter()
            .rev()
            .map(|&i| {
                history::quantile(&history::delta(&ring[i - LATENCY_STEP].latency, &ring[i].latency), &bounds, q)
                    .map(round)
            })
            .collect()
    };
    json!({
        "requests_total": live.requests(),
        "throttled_total": live.throttled,
        "stale_total": live.stale,
        "classes_total": { "1xx": live.classes[0], "2xx": live.classes[1], "3xx": live.classes[2], "4xx": live.classes[3], "5xx": live.classes[4] },
        "rate": rate,
        "throttled_rate": throttled,
        "stale_rate": stale,
        "classes_rate": { "1xx": classes[0], "2xx": classes[1], "3xx": classes[2], "4xx": classes[3], "5xx": classes[4] },
        "p50_ms": p50,
        "p99_ms": p99,
        "series": {
            "rate": series(RouteSample::requests),
            "throttled": series(|s| s.throttled),
            "stale": series(|s| s.stale),
            "p50_ms": latency(0.5),
            "p99_ms": latency(0.99),
        },
    })
}

/// The Redis store, when the config has one: its breaker, calls and errors per second and
/// latency quantiles over the last [`LATENCY_WINDOW`] seconds.
fn redis_view(proxy: &Proxy, ring: &VecDeque<history::RedisSample>) -> Value {
    let Some(client) = proxy.redis() else { return Value::Null };
    let breaker = match client.breaker_state() {
        BreakerState::Closed => "closed",
        BreakerState::Open => "open",
        BreakerState::HalfOpen => "half_open",
    };
    let errors = |s: &crate::limit::store::redis::Snapshot| s.timeouts + s.connection_errors + s.reply_errors;
    let now = client.metrics().snapshot();
    let mut v = json!({
        "breaker": breaker,
        "calls_total": now.calls,
        "errors_total": errors(&now),
        "fallbacks_total": now.fallbacks,
        "short_circuits_total": now.short_circuits,
    });
    if let Some((a, b)) = history::window(ring, RATE_WINDOW) {
        let r = |f: &dyn Fn(&crate::limit::store::redis::Snapshot) -> u64| {
            history::rate((a.at_ms, f(&a.snapshot)), (b.at_ms, f(&b.snapshot))).map(round)
        };
        v["calls_rate"] = json!(r(&|s| s.calls));
        v["errors_rate"] = json!(r(&errors));
    }
    if let Some((a, b)) = history::window(ring, LATENCY_WINDOW) {
        let d: Vec<u64> = b
            .snapshot
            .latency_buckets
            .iter()
            .enumerate()
            .map(|(i, n)| n.saturating_sub(a.snapshot.latency_buckets.get(i).copied().unwrap_or(0)))
            .collect();
        let bounds = history::redis_bounds_ms();
        v["p50_ms"] = json!(history::quantile(&d, &bounds, 0.5).map(round));
        v["p99_ms"] = json!(history::quantile(&d, &bounds, 0.99).map(round));
    }
    v
}

/// The last throttled requests of every route, newest first, with wall-clock times.
fn recent(proxy: &Proxy) -> Vec<Value> {
    let (coarse_now, wall_now) = (crate::timer::now_ms(), wall_ms());
    let mut all: Vec<(u64, Value)> = proxy
        .route_metrics()
        .flat_map(|(route, m)| {
            m.throttles.recent().into_iter().map(move |t| {
                // The failure limit of the route's `auth` comes after its own.
                let failures = route.auth.as_ref().and_then(|a| a.failures.as_ref());
                let limit = route.limits.iter().chain(failures).nth(usize::from(t.limit)).map(|l| l.name.as_str());
                let at = wall_now.saturating_sub(coarse_now.saturating_sub(t.at_ms));
                let v = json!({
                    "route": route.name,
                    "limit": limit,
                    "retry_after": t.retry_after_secs,
                    "request_id": t.request_id(),
                    "at_ms": at,
                });
                (t.at_ms, v)
            })
        })
        .collect();
    all.sort_by_key(|t| std::cmp::Reverse(t.0));
    all.into_iter().take(RECENT).map(|(_, v)| v).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_ms: u64, ok: u64, throttled: u64, fast: u64, slow: u64) -> RouteSample {
        let mut latency = [0; history::BUCKETS];
        latency[0] = fast;
        latency[5] = slow;
        RouteSample { at_ms, classes: [0, ok, 0, throttled, 0], throttled, stale: 0, latency }
    }

    #[test]
    fn a_route_view_has_rates_quantiles_and_series() {
        // 100 answers a second, 20 of them 429s; 98 of every 100 upstream exchanges fast.
        let ring: VecDeque<RouteSample> = (0..=30).map(|s| sample(s * 1000, s * 80, s * 20, s * 98, s * 2)).collect();
        let live = sample(30_500, 2450, 610, 0, 0);
        let v = route_view(&ring, &live);
        assert_eq!(v["requests_total"], 3060);
        assert_eq!(v["throttled_total"], 610);
        assert_eq!(v["rate"], 100.0);
        assert_eq!(v["throttled_rate"], 20.0);
        assert_eq!(v["classes_rate"]["4xx"], 20.0);
        assert_eq!(v["series"]["rate"].as_array().map(Vec::len), Some(30));
        assert_eq!(v["series"]["p99_ms"].as_array().map(Vec::len), Some(3));
        let p50 = v["p50_ms"].as_f64().unwrap();
        assert!(p50 > 0.0 && p50 <= 0.1, "{v}");
        // The slow 2 %: p99 is in the bucket (1.6 ms, 3.2 ms].
        let p99 = v["p99_ms"].as_f64().unwrap();
        assert!(p99 > 1.6 && p99 <= 3.2, "{v}");
    }

    #[test]
    fn a_young_route_has_totals_but_no_rates() {
        let v = route_view(&VecDeque::new(), &sample(0, 3, 1, 0, 0));
        assert_eq!(v["requests_total"], 4);
        assert!(v["rate"].is_null() && v["p99_ms"].is_null(), "{v}");
    }

    #[test]
    fn the_page_is_whole_and_small() {
        assert!(PAGE.len() < 40 * 1024, "{} bytes", PAGE.len());
        assert!(PAGE.contains("/dashboard.json"));
        // The SVG namespace is a name, not a fetch; nothing else may point elsewhere.
        let rest = PAGE.replace("http://www.w3.org/2000/svg", "");
        assert!(!rest.contains("http:") && !rest.contains("https:") && !rest.contains("//fonts"), "an external URL");
    }
}
