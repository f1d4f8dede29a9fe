//! Running it: admin endpoints, metrics, hot reload, access log.

use std::io::Write;
use std::sync::{Arc, Mutex};

use http::StatusCode;
use tollgate::limit::{ManualClock, Timestamp};
use tollgate::Reloader;

use crate::support::{dead_then_live_group, get, get_with, Tollgate};

const T0: Timestamp = Timestamp::from_micros(1_700_000_000_000_000);

const LIMITED: &str = "
upstreams:
  d: { respond: { body: v1 } }
routes:
  - name: api
    upstream: d
    limits:
      - { name: per-client, algorithm: token_bucket, rate: 1/h, burst: 2, key: client_ip }
      - { name: per-user, algorithm: token_bucket, rate: 1/h, burst: 5, key: header:x-user }
";

fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
        .unwrap_or_else(|| panic!("no sample {name} {labels:?}"))
}

async fn scrape(admin: std::net::SocketAddr) -> prometheus_parse::Scrape {
    let (s, h, body) = get(admin, "/metrics").await;
    assert_eq!(s, StatusCode::OK);
    assert!(h["content-type"].to_str().unwrap().contains("openmetrics-text"));
    let text = String::from_utf8(body.to_vec()).unwrap();
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    prometheus_parse::Scrape::parse(lines).unwrap()
}

#[tokio::test]
async fn metrics_parse_and_move_with_traffic() {
    let tg = Tollgate::start_with_clock(LIMITED, ManualClock::new(T0)).await;
    let admin = tg.start_admin().await;
    for _ in 0..3 {
        get(tg.addr, "/").await;
    }
    let m = scrape(admin).await;
    assert_eq!(sample(&m, "tollgate_requests_total", &[("route", "api"), ("class", "2xx")]), 2.0);
    assert_eq!(sample(&m, "tollgate_requests_total", &[("route", "api"), ("class", "4xx")]), 1.0);
    let decision =
        |limit, result| sample(&m, "tollgate_limiter_decisions_total", &[("limit", limit), ("result", result)]);
    assert_eq!(decision("per-client", "allowed"), 3.0 - 1.0);
    assert_eq!(decision("per-client", "throttled"), 1.0);
    assert_eq!(decision("per-user", "allowed"), 3.0, "per-user admitted all three (the third was refunded)");
    assert_eq!(sample(&m, "tollgate_local_store_keys", &[("limit", "per-client")]), 1.0);

    get(tg.addr, "/").await;
    let m = scrape(admin).await;
    assert_eq!(sample(&m, "tollgate_requests_total", &[("route", "api"), ("class", "4xx")]), 2.0);
}

#[tokio::test]
async fn health_ready_and_config_endpoints() {
    let tg = Tollgate::start(LIMITED).await;
    let admin = tg.start_admin().await;
    assert_eq!(get(admin, "/healthz").await.0, StatusCode::OK);
    assert_eq!(get(admin, "/readyz").await.0, StatusCode::OK);
    // The admin listener's refusals are problem+json, like every answer tollgate makes.
    let (s, h, body) = get(admin, "/nope").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(h["content-type"], "application/problem+json");
    assert!(String::from_utf8_lossy(&body).contains("/metrics, /healthz"), "{body:?}");
    let mut c = crate::support::h1(admin).await;
    let post = http::Request::post("/metrics").header("host", "localhost").body(crate::support::full("")).unwrap();
    let resp = c.send_request(post).await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(resp.headers()["allow"], "GET, HEAD");
    let (s, _, body) = get(admin, "/config").await;
    assert_eq!(s, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["routes"][0]["limits"][1]["name"], "per-user");
    assert_eq!(doc["server"]["header_read_timeout"], "10s", "defaults are filled in");
}

struct TempConfig(std::path::PathBuf);

impl TempConfig {
    fn new(text: &str) -> TempConfig {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "tollgate-reload-{}-{}.yaml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let t = TempConfig(p);
        t.write(text);
        t
    }
    fn write(&self, text: &str) {
        std::fs::File::create(&self.0).unwrap().write_all(text.as_bytes()).unwrap();
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[tokio::test]
async fn a_broken_reload_keeps_the_old_config_serving() {
    let file = TempConfig::new(LIMITED);
    let tg = Tollgate::start_with_clock(LIMITED, ManualClock::new(T0)).await;
    let reloader = Reloader::new(file.0.clone(), tg.shared.clone(), Box::new(|_| {}));
    file.write(&LIMITED.replace("upstream: d\n", "upstream: nowhere\n"));
    let err = reloader.reload().await.unwrap_err();
    assert_eq!((err.line, err.path.as_str()), (6, "routes[0].upstream"), "{err}");
    assert_eq!(get(tg.addr, "/").await.2, "v1");

    file.write(&LIMITED.replace("body: v1", "body: v2"));
    reloader.reload().await.unwrap();
    assert_eq!(get(tg.addr, "/").await.2, "v2");
}

#[tokio::test]
async fn a_reload_that_changes_one_limit_keeps_the_others_state() {
    let file = TempConfig::new(LIMITED);
    let tg = Tollgate::start_with_clock(LIMITED, ManualClock::new(T0)).await;
    let reloader = Reloader::new(file.0.clone(), tg.shared.clone(), Box::new(|_| {}));
    let user = [("x-user", "ann")];
    for expected in [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        assert_eq!(get_with(tg.addr, "/", &user).await.0, expected);
    }
    // per-user changes; per-client is unchanged and must keep its empty bucket.
    file.write(&LIMITED.replace("burst: 5", "burst: 50"));
    reloader.reload().await.unwrap();
    assert_eq!(
        get_with(tg.addr, "/", &user).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "the throttled client stays throttled"
    );

    // Changing per-client itself starts it afresh (documented).
    file.write(&LIMITED.replace("burst: 2", "burst: 3"));
    reloader.reload().await.unwrap();
    assert_eq!(get_with(tg.addr, "/", &user).await.0, StatusCode::OK);
}

/// A writer the test can read back.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// JSON log lines of this thread captured until the guard is dropped.
    pub(crate) fn json_logs() -> (Captured, tracing::subscriber::DefaultGuard) {
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt().json().with_writer(move || writer.clone()).finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    /// The access log lines captured so far, and all the text.
    pub(crate) fn access_lines(&self) -> (Vec<serde_json::Value>, String) {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        let lines = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "tollgate::access")
            .collect();
        (lines, text)
    }
}

#[tokio::test(flavor = "current_thread")]
async fn access_log_lines_carry_the_decision() {
    let (logs, _guard) = Captured::json_logs();
    let yaml = format!("log: {{ access: true }}\n{LIMITED}");
    let tg = Tollgate::start_with_clock(&yaml, ManualClock::new(T0)).await;
    for _ in 0..3 {
        get(tg.addr, "/x").await;
    }
    let (lines, text) = logs.access_lines();
    assert_eq!(lines.len(), 3, "{text}");
    let f = |i: usize| &lines[i]["fields"];
    assert_eq!(f(0)["status"], 200);
    assert_eq!(f(0)["route"], "api");
    assert_eq!(f(0)["limit"], "per-client");
    assert_eq!(f(0)["remaining"], 1);
    assert_eq!(f(2)["status"], 429);
    assert_eq!(f(2)["limit"], "per-client");
    assert_eq!(f(2)["retry_after"], 3600);
    assert_eq!(f(2)["stale"], "no");
}

#[tokio::test(flavor = "current_thread")]
async fn an_upstream_failure_is_logged_with_its_cause() {
    let (logs, _guard) = Captured::json_logs();
    // A port nothing listens on: the connect is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let tg = Tollgate::start(&format!(
        "log: {{ access: true }}\nupstreams: {{ gone: {{ url: 'http://{closed}' }} }}\nroutes: [{{ name: api, upstream: gone }}]\n"
    ))
    .await;
    let (status, _, body) = get(tg.addr, "/x").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let body = String::from_utf8_lossy(&body);
    assert!(!body.to_lowercase().contains("refused"), "the cause stays out of the client's answer: {body}");
    let (lines, text) = logs.access_lines();
    let line = lines.first().unwrap_or_else(|| panic!("no access line in {text}"));
    let f = &line["fields"];
    assert_eq!(f["error"], "upstream_connect");
    let cause = f["cause"].as_str().unwrap_or_else(|| panic!("no cause in {line}"));
    assert!(cause.to_lowercase().contains("refused"), "{cause}");
}

#[tokio::test]
async fn a_client_that_gives_up_leaves_no_request_in_flight() {
    use tokio::io::AsyncWriteExt;
    let tg = Tollgate::start(
        "
upstreams:
  slow: { respond: { body: late, latency: 30s } }
routes:
  - { name: slow, upstream: slow }
",
    )
    .await;
    let admin = tg.start_admin().await;
    let mut client = tokio::net::TcpStream::connect(tg.addr).await.unwrap();
    client.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    assert_eq!(in_flight_becomes(admin, 1.0).await, 1.0, "the slow request is in flight");
    drop(client);
    assert_eq!(in_flight_becomes(admin, 0.0).await, 0.0, "the abandoned request is no longer counted");
}

/// `tollgate_requests_in_flight` once it reads `want`, or its last reading after 5 s.
async fn in_flight_becomes(admin: std::net::SocketAddr, want: f64) -> f64 {
    let mut seen = f64::NAN;
    for _ in 0..250 {
        seen = sample(&scrape(admin).await, "tollgate_requests_in_flight", &[]);
        if seen == want {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    seen
}

#[tokio::test(flavor = "current_thread")]
async fn a_group_request_is_logged_with_the_server_that_took_it_and_its_tries() {
    let (logs, _guard) = Captured::json_logs();
    let live =
        Tollgate::start("upstreams: { ok: { respond: { status: 200 } } }\nroutes: [{ name: ok, upstream: ok }]\n")
            .await;
    // The group's first server refuses connections: its tries go on to the live one.
    let tg = Tollgate::start(&format!("log: {{ access: true }}\n{}", dead_then_live_group(live.addr))).await;
    for _ in 0..4 {
        assert_eq!(get(tg.addr, "/x").await.0, StatusCode::OK);
    }
    let (lines, text) = logs.access_lines();
    let lines: Vec<_> = lines.iter().filter(|l| l["fields"]["route"] == "api").collect();
    assert_eq!(lines.len(), 4, "{text}");
    let live = live.addr.to_string();
    for line in &lines {
        assert_eq!(line["fields"]["upstream_server"], live.as_str(), "{line}");
    }
    let tries: Vec<_> = lines.iter().map(|l| l["fields"]["upstream_tries"].as_u64().unwrap()).collect();
    // A request whose first try went to the dead server took two; none took more.
    assert!(tries.contains(&2) && tries.iter().all(|&t| t == 1 || t == 2), "{tries:?}");
}
