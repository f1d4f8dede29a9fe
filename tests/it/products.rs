//! API products (issue 25): calendar quotas, costs taken from the response, plans per client.
//! Throttling math runs on a manual clock; the Redis store runs against a real redis-server.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use tollgate::limit::store::redis::Topology;
use tollgate::limit::{
    Algorithm, Calendar, CalendarUnit, Decision, KeyHash, LocalStore, ManualClock, RedisClient, RedisConfig,
    RedisStore, Span, Timestamp,
};

use crate::support::redis::RedisNode;
use crate::support::{full, get, get_with, proxy_yaml, Tollgate, Upstream};

/// µs of an RFC 3339 instant.
fn t(s: &str) -> Timestamp {
    let ts: jiff::Timestamp = s.parse().unwrap();
    Timestamp::from_micros(u64::try_from(ts.as_microsecond()).unwrap())
}

fn redis_client(node: &RedisNode) -> Arc<RedisClient> {
    let mut cfg = RedisConfig::new(Topology::Single(node.url()));
    cfg.timeout = Duration::from_millis(500);
    RedisClient::new(cfg).unwrap()
}

fn redis_store(client: &Arc<RedisClient>, name: &str, alg: &Algorithm) -> RedisStore {
    RedisStore::new(client.clone(), name, alg.clone(), None, LocalStore::new(alg.clone(), 1_000))
}

fn month(zone: &str, limit: u64) -> Algorithm {
    let cal = Calendar::new(zone, CalendarUnit::Month).unwrap();
    Algorithm::FixedWindow { window: cal.longest(), limit: NonZeroU64::new(limit).unwrap(), calendar: Some(cal) }
}

fn day(zone: &str, limit: u64) -> Algorithm {
    let cal = Calendar::new(zone, CalendarUnit::Day).unwrap();
    Algorithm::FixedWindow { window: cal.longest(), limit: NonZeroU64::new(limit).unwrap(), calendar: Some(cal) }
}

const HOUR: u64 = 3_600_000_000;

/// The same decisions from the local store and from Redis (the script picks the calendar
/// boundaries the store passes), step by step.
async fn both_agree(alg: &Algorithm, name: &str, steps: &[(&str, Decision)]) {
    let node = RedisNode::start();
    let client = redis_client(&node);
    client.connect().await.unwrap();
    let local = LocalStore::new(alg.clone(), 16);
    let shared = redis_store(&client, name, alg);
    for (i, (when, want)) in steps.iter().enumerate() {
        assert_eq!(local.decide(KeyHash(7), t(when), 1), *want, "step {i} at {when} (local)");
        assert_eq!(shared.decide_at(KeyHash(7), t(when), 1).await.unwrap(), *want, "step {i} at {when} (redis)");
    }
    assert_eq!(client.metrics().snapshot().fallbacks, 0);
}

fn allow(remaining: u64, reset: u64) -> Decision {
    Decision::Allow { remaining, reset: Span::from_micros(reset) }
}

fn deny(retry_after: u64) -> Decision {
    Decision::Deny { retry_after: Span::from_micros(retry_after), reset: Span::from_micros(retry_after) }
}

#[tokio::test]
async fn monthly_quota_resets_on_the_first_in_both_stores() {
    // February 2026 in New York: 28 days, and the month starts at 05:00 UTC.
    let steps = [
        ("2026-02-28T04:00:00Z", allow(1, 25 * HOUR)),
        ("2026-02-28T05:00:00Z", allow(0, 24 * HOUR)),
        ("2026-03-01T04:59:59Z", deny(1_000_000)),
        // 1 March 00:00 EST; March is 31 days less the hour lost on the 8th (DST).
        ("2026-03-01T05:00:00Z", allow(1, (31 * 24 - 1) * HOUR)),
    ];
    both_agree(&month("America/New_York", 2), "cal-month", &steps).await;
}

#[tokio::test]
async fn daily_quota_on_a_daylight_saving_day_in_both_stores() {
    // 2026-10-25 in Berlin has 25 hours (03:00 CEST → 02:00 CET).
    let steps = [
        ("2026-10-25T00:00:00+02:00", allow(0, 25 * HOUR)),
        ("2026-10-25T23:30:00+01:00", deny(HOUR / 2)),
        ("2026-10-26T00:00:00+01:00", allow(0, 24 * HOUR)),
    ];
    both_agree(&day("Europe/Berlin", 1), "cal-day", &steps).await;
}

#[tokio::test]
async fn calendar_quota_through_the_proxy_tells_the_seconds_to_the_boundary() {
    let clock = ManualClock::new(t("2026-01-31T23:00:00Z"));
    let yaml = "upstreams:\n  d: { respond: { body: ok } }\nroutes:\n  - name: api\n    upstream: d\n    limits:\n      - { name: monthly, algorithm: fixed_window, rate: 2/month, calendar: utc }\n";
    let tg = Tollgate::start_with_clock(yaml, clock.clone()).await;
    let (s, h, _) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["ratelimit"], r#""monthly";r=1;t=3600"#);
    // w is the longest month (31 days and an hour): the longest Retry-After it sends.
    assert_eq!(h["ratelimit-policy"], r#""monthly";q=2;w=2682000"#);
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    let (s, h, _) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["retry-after"], "3600");
    clock.set(t("2026-02-01T00:00:00Z"));
    let (s, h, _) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["ratelimit"], r#""monthly";r=1;t=2419200"#, "28 days of February");
}

fn every_algorithm() -> Vec<Algorithm> {
    let nz = |n| NonZeroU64::new(n).unwrap();
    let nzs = |n| tollgate::limit::NonZeroSpan::from_micros(n).unwrap();
    vec![
        Algorithm::TokenBucket { interval: nzs(1_000_000), burst: nz(3), warmup: Span::ZERO },
        Algorithm::TokenBucket { interval: nzs(1_000_000), burst: nz(3), warmup: Span::from_secs(10) },
        Algorithm::LeakyBucket { interval: nzs(1_000_000), max_delay: Span::from_secs(2) },
        Algorithm::FixedWindow { window: nzs(60_000_000), limit: nz(3), calendar: None },
        month("utc", 3),
        Algorithm::SlidingWindow { window: nzs(60_000_000), limit: nz(3) },
        Algorithm::SlidingLog { window: nzs(60_000_000), limit: nz(3) },
    ]
}

#[tokio::test]
async fn a_debit_below_zero_makes_later_requests_wait_in_both_stores() {
    let node = RedisNode::start();
    let client = redis_client(&node);
    client.connect().await.unwrap();
    let t0 = t("2026-05-10T10:00:00Z");
    let s = |secs: u64| t0 + Span::from_secs(secs);
    for (i, alg) in every_algorithm().into_iter().enumerate() {
        let local = LocalStore::new(alg.clone(), 16);
        let shared = redis_store(&client, &format!("debit{i}"), &alg);
        let k = KeyHash(9);
        // Admitted on an estimate of 1, the response said 6: 5 more are owed.
        assert!(local.decide(k, s(0), 1).is_admitted(), "{alg:?}");
        assert!(shared.decide_at(k, s(0), 1).await.unwrap().is_admitted(), "{alg:?}");
        local.debit(k, s(0), 5);
        shared.debit_at(k, s(0), 5).await;
        for at in [0, 1, 4, 59, 60, 61, 120] {
            let want = local.decide(k, s(at), 1);
            let got = shared.decide_at(k, s(at), 1).await.unwrap();
            assert_eq!(got, want, "{alg:?} at +{at}s");
            if at == 0 {
                let Decision::Deny { retry_after, .. } = want else { panic!("{alg:?}: {want:?} after a debt") };
                // A bucket that owes 3 past empty (6 taken of 3) waits for 4 tokens.
                if matches!(alg, Algorithm::TokenBucket { warmup, .. } if warmup.is_zero()) {
                    assert_eq!(retry_after, Span::from_secs(4), "honest Retry-After");
                }
            }
        }
        // A refund gives back what a response cost less than its estimate.
        let k = KeyHash(10);
        assert!(local.decide(k, s(0), 3).is_admitted());
        assert!(shared.decide_at(k, s(0), 3).await.unwrap().is_admitted());
        local.refund(k, s(0), 2);
        shared.refund_at(k, s(0), 2).await;
        assert_eq!(shared.decide_at(k, s(0), 2).await.unwrap(), local.decide(k, s(0), 2), "{alg:?}");
    }
    assert_eq!(client.metrics().snapshot().fallbacks, 0);
}

/// An upstream that answers `x-tokens-used` with the request's `x-want` (none without it).
async fn llm() -> Upstream {
    Upstream::start(|req| async move {
        let mut resp = http::Response::new(full("answer"));
        if let Some(v) = req.headers().get("x-want") {
            resp.headers_mut().insert("x-tokens-used", v.clone());
        }
        resp
    })
    .await
}

/// A request as client `key` whose response costs `want` (`None`: no cost header).
async fn ask(tg: &Tollgate, key: &str, want: Option<&str>) -> (StatusCode, http::HeaderMap) {
    let mut h = vec![("x-api-key", key)];
    if let Some(w) = want {
        h.push(("x-want", w));
    }
    let (s, h, _) = get_with(tg.addr, "/v1/chat", &h).await;
    (s, h)
}

/// 10 tokens an hour, burst 10, each request admitted on an estimate of 1.
fn tokens_yaml(up: std::net::SocketAddr, store: &str, redis: &str) -> String {
    format!(
        "{redis}{}",
        proxy_yaml(
            up,
            "",
            &format!(
                "  - name: api\n    upstream: up\n    limits:\n      - name: tokens\n        algorithm: token_bucket\n        rate: 10/h\n        burst: 10\n        key: header:x-api-key\n        store: {store}\n        cost: {{ estimate: 1, response_header: x-tokens-used }}\n"
            )
        )
    )
}

/// The cost scenario, the same through both stores: debit, refund, a missing header, a debt.
async fn response_cost_scenario(tg: &Tollgate, admin: std::net::SocketAddr) {
    let remaining = |h: &http::HeaderMap| h["ratelimit"].to_str().unwrap().to_owned();
    // 8 tokens used: 1 at admission, 7 debited when the head arrived.
    let (s, h) = ask(tg, "k1", Some("8")).await;
    assert_eq!((s, remaining(&h).as_str()), (StatusCode::OK, r#""tokens";r=9;t=360"#), "admitted on the estimate");
    let (s, h) = ask(tg, "k1", Some("0")).await;
    assert_eq!(s, StatusCode::OK);
    assert!(remaining(&h).starts_with(r#""tokens";r=1;"#), "8 debited before this one: {h:?}");
    // That one cost 0: its estimate was refunded. A missing header debits nothing.
    let (s, h) = ask(tg, "k1", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(remaining(&h).starts_with(r#""tokens";r=1;"#), "the refund came back: {h:?}");
    let (s, _) = ask(tg, "k1", Some("oops")).await;
    assert_eq!(s, StatusCode::OK);
    // 10 of 10 used. A request can still not start...
    let (s, h) = ask(tg, "k1", Some("20")).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["retry-after"], "360");
    // ... but another client can, and its response costs 20 of its 10: a debt of 10.
    assert_eq!(ask(tg, "k2", Some("20")).await.0, StatusCode::OK);
    let (s, h) = ask(tg, "k2", Some("1")).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    // Repaid at 10 an hour: 10 owed plus the 1 asked for is 11 tokens, 6 × 11 = 66 minutes,
    // past the bucket's own period (the cap of Retry-After without a response cost).
    assert_eq!(h["retry-after"], "3960");
    let (_, _, body) = get(admin, "/metrics").await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(text.contains(r#"tollgate_response_cost_unread_total{route="api",limit="tokens"} 2"#), "{text}");
}

#[tokio::test]
async fn response_cost_is_debited_and_refunded_in_the_local_store() {
    let up = llm().await;
    let clock = ManualClock::new(t("2026-05-10T10:00:00Z"));
    let tg = Tollgate::start_with_clock(&tokens_yaml(up.addr, "local", ""), clock).await;
    let admin = tg.start_admin().await;
    response_cost_scenario(&tg, admin).await;
}

#[tokio::test]
async fn response_cost_is_debited_and_refunded_in_redis() {
    let node = RedisNode::start();
    let up = llm().await;
    let redis = format!("redis: {{ url: '{}', timeout: 500ms, on_error: deny }}\n", node.url());
    let tg = Tollgate::start(&tokens_yaml(up.addr, "redis", &redis)).await;
    let admin = tg.start_admin().await;
    response_cost_scenario(&tg, admin).await;
    // One script call per settled response: 7 decisions, the 3 responses whose cost differs
    // from the estimate, and the first call's NOSCRIPT (the script is loaded then).
    assert_eq!(node.calls("evalsha"), 7 + 3 + 1);
}

/// Tiers `free` (3 an hour, burst 3, and 5 a month), `pro` (10 an hour, burst 10, no monthly
/// quota) and `blocked`; clients from `clients` (a file path or a redis_hash map).
fn plans_yaml(clients: &str, store: &str, redis: &str) -> String {
    format!(
        "{redis}plans:
  of: header:x-api-key
  clients: {clients}
  default: free
  tiers:
    free:
      per-hour: {{ rate: 3/h, burst: 3 }}
      monthly: {{ rate: 5/month }}
    pro:
      per-hour: {{ rate: 10/h, burst: 10 }}
    blocked: deny
upstreams:
  d: {{ respond: {{ body: ok }} }}
routes:
  - name: api
    upstream: d
    limits:
      - {{ name: per-hour, algorithm: token_bucket, plan: true, key: header:x-api-key, store: {store} }}
      - {{ name: monthly, algorithm: fixed_window, calendar: utc, plan: true, key: header:x-api-key, store: {store} }}
"
    )
}

/// A clients file in a fresh folder under /tmp.
fn clients_file(text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-plans-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("clients.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Requests of client `key` admitted in a row (stops at the first refusal, at most 20).
async fn admitted(tg: &Tollgate, key: &str) -> usize {
    for n in 0..20 {
        if get_with(tg.addr, "/", &[("x-api-key", key)]).await.0 != StatusCode::OK {
            return n;
        }
    }
    20
}

/// Swaps in the config read again, as a reload does (unchanged limits keep their state).
fn reload(tg: &Tollgate, yaml: &str) {
    let config = tollgate::config::Config::from_yaml(std::path::Path::new("test.yaml"), yaml).unwrap();
    let old = tg.shared.load();
    let next = tollgate::Proxy::build(config, old.clock().clone(), old.metrics().clone(), Some(&old));
    tg.shared.store(Arc::new(next));
}

#[tokio::test]
async fn tiers_from_a_file_with_default_deny_and_a_policy_per_tier() {
    let path = clients_file("key-pro: pro\nkey-bad: blocked\nkey-typo: gold\n");
    let yaml = plans_yaml(&format!("'{}'", path.display()), "local", "");
    let config = tollgate::config::Config::from_yaml(std::path::Path::new("test.yaml"), &yaml).unwrap();
    assert_eq!(config.warnings.len(), 1, "{:?}", config.warnings);
    let w = &config.warnings[0];
    assert!(w.contains("clients.yaml:3:") && w.contains("unknown tier `gold`") && w.contains("`free`"), "{w}");
    let tg = Tollgate::start_with_clock(&yaml, ManualClock::new(t("2026-05-10T10:00:00Z"))).await;

    let (s, h, _) = get_with(tg.addr, "/", &[("x-api-key", "key-pro")]).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["ratelimit-policy"], r#""per-hour";q=10;w=3600"#, "pro has no monthly quota");
    assert_eq!(h["ratelimit"], r#""per-hour";r=9;t=360"#);
    for key in ["key-typo", "someone"] {
        let (s, h, _) = get_with(tg.addr, "/", &[("x-api-key", key)]).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h["ratelimit-policy"], r#""per-hour";q=3;w=3600, "monthly";q=5;w=2682000"#, "{key} is free");
    }
    // Without the header: the default tier, one shared "missing" key.
    let (s, h, _) = get(tg.addr, "/").await;
    assert_eq!(s, StatusCode::OK);
    assert!(h["ratelimit-policy"].to_str().unwrap().contains("monthly"));
    let (s, h, body) = get_with(tg.addr, "/", &[("x-api-key", "key-bad")]).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(h["content-type"], "application/problem+json");
    assert!(String::from_utf8_lossy(&body).contains("plan-denied"), "{body:?}");
    // Free: 3 an hour. Pro: 10, of which one is spent.
    assert_eq!(admitted(&tg, "someone").await, 2);
    assert_eq!(admitted(&tg, "key-pro").await, 9);
    // Its 429 shows its own tier's policy too, not the route's default one.
    let (s, h, _) = get_with(tg.addr, "/", &[("x-api-key", "key-pro")]).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["ratelimit-policy"], r#""per-hour";q=10;w=3600"#);
    assert_eq!(h["retry-after"], "360");
    let (s, h, _) = get_with(tg.addr, "/", &[("x-api-key", "someone")]).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["ratelimit-policy"], r#""per-hour";q=3;w=3600, "monthly";q=5;w=2682000"#);
}

#[tokio::test]
async fn a_move_between_tiers_in_the_file_keeps_the_spent_quota() {
    let path = clients_file("key-a: free\n");
    let yaml = plans_yaml(&format!("'{}'", path.display()), "local", "");
    let tg = Tollgate::start_with_clock(&yaml, ManualClock::new(t("2026-05-10T10:00:00Z"))).await;
    assert_eq!(admitted(&tg, "key-a").await, 3, "free: 3 of 3");
    std::fs::write(&path, "key-a: pro\n").unwrap();
    reload(&tg, &yaml);
    // 3 of pro's 10 are spent already: 7 left, not 10 and not 0.
    assert_eq!(admitted(&tg, "key-a").await, 7);
    // Back to free: 10 spent of 3, the bucket owes 7 more than it holds.
    std::fs::write(&path, "key-a: free\n").unwrap();
    reload(&tg, &yaml);
    let (s, h, _) = get_with(tg.addr, "/", &[("x-api-key", "key-a")]).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    // 10 owed at 20 minutes each (3 an hour): one more fits once 8 are repaid, 160 minutes,
    // longer than the bucket's period (a debt is not capped).
    assert_eq!(h["retry-after"], "9600", "{h:?}");
}

#[tokio::test]
async fn tiers_from_a_redis_hash_through_the_cache_and_state_in_redis() {
    let node = RedisNode::start();
    node.cli(&["HSET", "tollgate:clients", "key-r", "free", "key-x", "blocked"]);
    let redis = format!("redis: {{ url: '{}', timeout: 500ms, on_error: deny }}\n", node.url());
    let yaml = plans_yaml("{ redis_hash: 'tollgate:clients', cache: 100ms }", "redis", &redis);
    let tg = Tollgate::start(&yaml).await;
    assert_eq!(get_with(tg.addr, "/", &[("x-api-key", "key-x")]).await.0, StatusCode::FORBIDDEN);
    assert_eq!(admitted(&tg, "key-r").await, 3, "free: 3 of 3");
    node.cli(&["HSET", "tollgate:clients", "key-r", "pro"]);
    // Within the cache's TTL the tier may still be the old one; after it, the new one.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (s, h, _) = get_with(tg.addr, "/", &[("x-api-key", "key-r")]).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["ratelimit-policy"], r#""per-hour";q=10;w=3600"#);
    assert!(h["ratelimit"].to_str().unwrap().starts_with(r#""per-hour";r=6;"#), "3 of 10 were spent: {h:?}");
    assert_eq!(admitted(&tg, "key-r").await, 6);
    // One state per client in Redis whatever its tier: two limits, two keys of key-r.
    let keys: Vec<_> = node.tollgate_keys().into_iter().filter(|(k, _)| k.starts_with("tollgate:{")).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
}

#[test]
fn a_client_listed_twice_in_the_clients_file_is_refused_at_its_line() {
    // Issue 31 (6): the second entry used to win silently.
    let path = clients_file("key-pro: pro\nkey-free: free\n'key-pro': free\n");
    let yaml = plans_yaml(&format!("'{}'", path.display()), "local", "");
    let Err(e) = tollgate::config::Config::from_yaml(std::path::Path::new("test.yaml"), &yaml) else {
        panic!("a client listed twice is accepted");
    };
    let shown = e.to_string();
    assert!(shown.contains("plans.clients: "), "{shown}");
    assert!(shown.contains("clients.yaml:3: client `key-pro` is listed twice (first on line 1)"), "{shown}");
}
