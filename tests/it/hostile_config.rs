//! The config file as an attack surface (issue 22 §4; issue 13 defects 2 and 3): whatever
//! `check` accepts runs, whatever cannot run is refused with exit 2 and a position, nothing in
//! a file can stall the parser, multiply itself through aliases or leak a password, and
//! `check` into a closed pipe ends quietly.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use tollgate::config::Config;
use tollgate::limit::{KeyHash, Store};
use tollgate::Proxy;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// A config file removed on drop.
pub struct TempFile(pub std::path::PathBuf);

impl TempFile {
    pub fn new(text: &str) -> TempFile {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "tollgate-hostile-{}-{}.yaml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&p, text).unwrap();
        TempFile(p)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn tollgate(cmd: &str, text: &str) -> Output {
    let f = TempFile::new(text);
    Command::new(BIN).args([cmd, "-c"]).arg(&f.0).output().unwrap()
}

/// `tollgate check` on `text`: it must refuse with exit 2; returns stderr.
fn refused(text: &str) -> String {
    let out = tollgate("check", text);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "check accepted it or crashed: {out:?}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn accepted(text: &str) -> String {
    let out = tollgate("check", text);
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

const UP: &str = "upstreams: { d: { respond: {} } }\n";

#[test]
fn deep_nesting_is_refused_before_the_yaml_parser() {
    // ~200 KB, 100,000 levels: over 20 s of CPU in libyaml's scanner before this bound.
    let n = 100_000;
    let flow = format!("{UP}routes: {}{}\n", "[".repeat(n), "]".repeat(n));
    let err = refused(&flow);
    assert!(err.contains(":2:40: nested deeper than 32 levels"), "{err}");
    let block = format!("{UP}routes:\n{}x\n", "- ".repeat(n));
    let err = refused(&block);
    assert!(err.contains(":3:") && err.contains("nested deeper than 32 levels"), "{err}");
    let keys: String = (0..40).map(|i| format!("{}k{i}:\n", " ".repeat(i))).collect();
    let err = refused(&format!("{UP}routes: []\nx:\n{keys}"));
    assert!(err.contains(":36:") && err.contains("nested deeper"), "{err}");
}

#[test]
fn a_file_over_the_size_bound_is_refused_unread() {
    let mut text = format!("{UP}routes: [{{ upstream: d }}]\n");
    let pad = tollgate::config::MAX_CONFIG_BYTES + 1 - text.len();
    text.push_str(&"#".repeat(pad - 1));
    text.push('\n');
    let err = refused(&text);
    assert!(err.contains("at most 4194304 bytes (4 MiB) are accepted"), "{err}");
    // At the bound it is read and accepted.
    text.truncate(tollgate::config::MAX_CONFIG_BYTES - 1);
    text.push('\n');
    accepted(&text);
}

/// `routes` routes; the first anchors `limits` limits, the others alias them.
fn aliased(routes: usize, limits: usize) -> String {
    let mut out = format!("{UP}routes:\n  - name: r0\n    upstream: d\n    limits: &all\n");
    for j in 0..limits {
        out.push_str(&format!("      - {{ name: l{j}, algorithm: token_bucket, rate: 10/s, key: client_ip }}\n"));
    }
    for i in 1..routes {
        out.push_str(&format!("  - {{ name: r{i}, upstream: d, limits: *all }}\n"));
    }
    out
}

#[test]
fn aliases_cannot_multiply_routes_and_limits() {
    // 100 routes × 300 aliased limits: a 26 KB file that became 30,000 limits and ~700 MB.
    let err = refused(&aliased(100, 300));
    assert!(err.contains("aliases repeat more than 100000 YAML nodes"), "{err}");
    // 1,000 × 1,000 (80 KB): past 2.8 GB before.
    let err = refused(&aliased(1_000, 1_000));
    assert!(err.contains("aliases repeat more than"), "{err}");
    // A billion laughs in a few lines.
    let mut laughs = format!("{UP}routes: [{{ upstream: d }}]\nx: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for (name, prev) in [("b", "a"), ("c", "b"), ("d", "c"), ("e", "d"), ("f", "e"), ("g", "f")] {
        laughs.push_str(&format!("{name}: &{name} [{}]\n", vec![format!("*{prev}"); 10].join(", ")));
    }
    let err = refused(&laughs);
    assert!(err.contains("aliases repeat more than"), "{err}");
    // Written out instead of aliased, limits are still bounded per route and in all.
    let err = refused(&aliased(1, 33));
    assert!(err.contains("routes[0].limits: 33 limits on one route (aliases expanded); at most 32"), "{err}");
    let mut many = format!("{UP}routes:\n");
    for i in 0..400 {
        many.push_str(&format!("  - name: r{i}\n    upstream: d\n    limits:\n"));
        for j in 0..26 {
            many.push_str(&format!("      - {{ name: l{j}, algorithm: fixed_window, rate: 1/s }}\n"));
        }
    }
    let err = refused(&many);
    assert!(err.contains("routes[384].limits: this route brings the limits of all routes to 10010"), "{err}");
    let routes: String = (0..10_001).map(|i| format!("  - {{ name: r{i}, upstream: d }}\n")).collect();
    let err = refused(&format!("{UP}routes:\n{routes}"));
    assert!(err.contains("10001 routes (aliases expanded); at most 10000"), "{err}");
    // Aliases as people use them pass, and `check` says what they expand to.
    let out = accepted(&aliased(100, 3));
    let first = out.lines().next().unwrap_or("");
    assert_eq!(
        first,
        "config ok: listen 127.0.0.1:8080, 1 upstream(s), 100 route(s), 300 limit(s); aliases repeat 2772 YAML nodes"
    );
}

#[test]
fn values_that_would_panic_or_saturate_at_run_are_refused_by_check() {
    let err = refused(&format!("{UP}routes: [{{ upstream: d, concurrency: 2305843009213693952 }}]\n"));
    assert!(err.contains(":2:38: routes[0].concurrency: concurrency 2305843009213693952 is more than"), "{err}");
    // burst × interval past 2^64 µs: the bucket saturated and admitted everything.
    let text = format!(
        "{UP}routes:\n  - upstream: d\n    limits: [{{ algorithm: token_bucket, rate: 1/d, burst: 250000000, cost: 250000000 }}]\n"
    );
    let err = refused(&text);
    assert!(
        err.contains(":4:") && err.contains("routes[0].limits[0].burst") && err.contains("too long to compute exactly"),
        "{err}"
    );
}

#[test]
fn hostile_route_names_are_refused() {
    let text = format!("{UP}routes: [{{ name: \"x\\\"}} 1\\nfake_metric{{a=\\\"b\", upstream: d }}]\n");
    let err = refused(&text);
    assert!(err.contains("routes[0].name: `x\\\"} 1\\nfake_metric{a=\\\"b` is not a name"), "{err}");
}

/// Issue 13 defect 3: `a{b` and `a_b` shared one Redis state (braces were mapped to `_`).
#[tokio::test]
async fn distinct_routes_never_share_a_redis_key() {
    let redis = "redis: { url: 'redis://127.0.0.1:1' }\n";
    let err = refused(&format!("{redis}{UP}routes:\n  - {{ name: 'a{{b', upstream: d }}\n"));
    assert!(err.contains("routes[0].name"), "{err}");
    // Names that look alike, and route/limit splits that concatenate alike.
    let routes: [(&str, &[&str]); 7] = [
        ("a_b", &["l"]),
        ("a.b", &["l"]),
        ("a-b", &["l"]),
        ("ab", &["l"]),
        ("a", &["b.l", "b_l", "b-l"]),
        ("a.b.l", &["x"]),
        ("A_B", &["l"]),
    ];
    let mut text = format!("{redis}{UP}routes:\n");
    for (route, limits) in routes {
        let limits: Vec<String> = limits
            .iter()
            .map(|l| format!("{{ name: '{l}', algorithm: fixed_window, rate: 1/s, store: redis }}"))
            .collect();
        text.push_str(&format!("  - {{ name: '{route}', upstream: d, limits: [{}] }}\n", limits.join(", ")));
    }
    let proxy = Proxy::new(Config::from_yaml(Path::new("t.yaml"), &text).unwrap());
    let mut keys = Vec::new();
    for (route, gate) in proxy.gates() {
        for limit in gate.limits() {
            let Store::Redis(store) = &*limit.store else { panic!("{} is a redis limit", route.name) };
            keys.push(store.redis_key(KeyHash(7)));
        }
    }
    assert_eq!(keys.len(), 9);
    let distinct: std::collections::HashSet<_> = keys.iter().collect();
    assert_eq!(distinct.len(), keys.len(), "{keys:?}");
    assert!(keys.contains(&format!("tollgate:{{a.b/l:{:032x}}}", 7)), "{keys:?}");
}

#[test]
fn redis_passwords_are_redacted_in_check_errors() {
    for url in ["redis://app:hunter2@", "app:hunter2@redis:6379", "redis://app:hunter2@h:99999999/0"] {
        let err = refused(&format!("redis: {{ url: '{url}' }}\n{UP}routes: [{{ upstream: d }}]\n"));
        assert!(!err.contains("hunter2") && err.contains("***"), "{err}");
    }
}

#[test]
fn upstream_urls_that_can_never_connect_are_refused() {
    for (url, needle) in [
        ("http://127.0.0.1:0", "port `0`"),
        ("http://127.0.0.1:99999", "port `99999`"),
        ("http://:8080", "has no host"),
    ] {
        let err = refused(&format!("upstreams: {{ u: {{ url: '{url}' }} }}\nroutes: [{{ upstream: u }}]\n"));
        assert!(err.contains(&format!(":1:24: upstreams.u.url: `{url}` ")) && err.contains(needle), "{err}");
    }
    // No port means port 80, as everywhere else: the forwarder connects to 127.0.0.1:80.
    let out = accepted("upstreams: { u: { url: 'http://127.0.0.1' } }\nroutes: [{ upstream: u }]\n");
    assert!(out.contains("-> u (http://127.0.0.1:80)"), "{out}");
}

#[test]
fn check_into_a_closed_pipe_ends_quietly() {
    let routes: String = (0..5_000).map(|i| format!("  - {{ name: route-number-{i}, upstream: d }}\n")).collect();
    let f = TempFile::new(&format!("{UP}routes:\n{routes}"));
    let mut child = Command::new(BIN)
        .args(["check", "-c"])
        .arg(&f.0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Like `| head -1`: one line, then the reader goes away with the rest unread (the output
    // is larger than a pipe's buffer, so the writer meets the closed pipe).
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with("config ok"), "{first}");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?} {err}", out.status);
    assert!(err.is_empty(), "{err}");
}

#[test]
fn explain_of_the_shipped_config_is_unchanged() {
    let out =
        Command::new(BIN).args(["explain", "-c", concat!(env!("CARGO_MANIFEST_DIR"), "/proxy.yaml")]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "\
route `api` -> upstream `api`
  per client IP `per-client`: bursts of 20, then 10 requests/s (one every 100ms); request 21 of a burst gets 429 with Retry-After: 1
  per client IP + header x-api-key `per-key-daily`: about 10000 in any 24h (sliding window counter); request 10001 of a burst gets 429 with Retry-After: 86409
  every limit must admit; a request one limit rejects costs nothing in the others
route `slow` -> upstream `slow`
  for the whole route `smooth`: smoothed to one request every 200ms (5 requests/s): up to 6 waiting requests are delayed (at most 1s), request 7 gets 429 with Retry-After: 1
  at most 8 requests in flight; the next gets 503 with Retry-After: 1 after waiting up to 100ms
route `everything-else` -> upstream `demo`
  per client IP `per-client`: bursts of 10, then 5 requests/s (one every 200ms); request 11 of a burst gets 429 with Retry-After: 1
every request has an id in x-request-id: a trusted proxy's well-formed one, else a new one; sent upstream, on every answer and in the access log
"
    );
}

#[test]
fn explain_answers_a_burst_of_a_billion_and_the_largest_burst() {
    // Simulated request by request, 10^9 took ~28 s (release, minutes in debug) and the
    // largest burst `check` accepts would take millennia; in closed form each is one decision.
    let largest = (1u64 << 63).div_ceil(3) - 1;
    for (rate, burst) in [("1000/s", 1_000_000_000), ("1000000/s", largest)] {
        let text = format!(
            "{UP}routes:\n  - upstream: d\n    limits: [{{ name: big, algorithm: token_bucket, rate: {rate}, burst: {burst} }}]\n"
        );
        let out = tollgate("explain", &text);
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("request {} of a burst gets 429 with Retry-After: 1", burst + 1)), "{text}");
    }
}
