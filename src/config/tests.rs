use std::path::Path;

use super::*;

const GOOD: &str = "\
listen: 127.0.0.1:0
upstreams:
  demo:
    respond: { status: 200, body: hi }
  api:
    url: http://127.0.0.1:3000/v1/
    timeout: 2s
routes:
  - name: api
    match: { host: '*.example.com', path_prefix: /api/, methods: [get, HEAD] }
    upstream: api
    strip_prefix: true
  - match: { path: /exact }
    upstream: demo
";

fn err(text: &str) -> ConfigError {
    match Config::from_yaml(Path::new("proxy.yaml"), text) {
        Ok(_) => panic!("config should be invalid:\n{text}"),
        Err(e) => e,
    }
}

#[test]
fn parses_a_good_config() {
    let c = Config::from_yaml(Path::new("proxy.yaml"), GOOD).unwrap();
    assert_eq!(c.routes.len(), 2);
    assert_eq!(c.routes[0].host, Some(HostMatch::Suffix(".example.com".into())));
    assert_eq!(c.routes[0].methods, Some(vec![Method::GET, Method::HEAD]));
    assert_eq!(c.routes[1].name, "route-1");
    match &c.upstream(&c.routes[0]).kind {
        UpstreamKind::Http(h) => {
            assert_eq!(h.authority.as_str(), "127.0.0.1:3000");
            assert_eq!(h.base_path, "/v1");
            assert_eq!(h.timeout, Duration::from_secs(2));
        }
        UpstreamKind::Respond(_) => panic!("api is an http upstream"),
    }
}

/// Each broken config must name this line, this field path and say this.
#[test]
fn broken_configs_name_line_column_and_field() {
    let cases: &[(&str, usize, &str, &str)] = &[
        // unknown field, deep inside
        (
            "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    match:\n      hots: a.com\n",
            5,
            "routes[0].match.hots",
            "unknown field `hots`",
        ),
        // bad duration
        (
            "upstreams:\n  a:\n    url: http://x:1\n    timeout: 5 parsecs\nroutes: [{ upstream: a }]\n",
            4,
            "upstreams.a.timeout",
            "unknown unit",
        ),
        // reference to a missing upstream
        (
            "upstreams:\n  demo: { respond: {} }\nroutes:\n  - name: x\n    upstream: dmeo\n",
            5,
            "routes[0].upstream",
            "unknown upstream `dmeo`; expected one of: demo",
        ),
        // wrong type
        (
            "upstreams:\n  demo: { respond: { status: lots } }\nroutes: [{ upstream: demo }]\n",
            2,
            "upstreams.demo.respond.status",
            "invalid type",
        ),
        // neither url nor respond
        ("upstreams:\n  demo: {}\nroutes: [{ upstream: demo }]\n", 2, "upstreams.demo", "expected `url"),
        // another scheme is refused with a reason
        (
            "upstreams:\n  a:\n    url: ftp://x\nroutes: [{ upstream: a }]\n",
            3,
            "upstreams.a.url",
            "expected http://host:port or https://",
        ),
        // path without slash
        (
            "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    match: { path_prefix: api }\n",
            4,
            "routes[0].match.path_prefix",
            "must start with `/`",
        ),
        // duplicate route names
        (
            "upstreams: { d: { respond: {} } }\nroutes:\n  - { name: a, upstream: d }\n  - { name: a, upstream: d }\n",
            4,
            "routes[1].name",
            "used twice",
        ),
        // bad listen address
        ("listen: localhost\nupstreams: {}\nroutes: []\n", 1, "listen", "invalid socket address"),
        // bad method
        (
            "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    match: { methods: [GET, 'B@D'] }\n",
            4,
            "routes[0].match.methods[1]",
            "not an HTTP method",
        ),
        // a cost the limit can never admit
        (
            "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits:\n      - algorithm: token_bucket\n        rate: 10/s\n        burst: 5\n        cost: 6\n",
            8,
            "routes[0].limits[0].cost",
            "can never be admitted",
        ),
        // a parameter of another algorithm
        (
            "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits:\n      - { algorithm: fixed_window, rate: 10/m, burst: 5 }\n",
            5,
            "routes[0].limits[0].burst",
            "applies to token_bucket only",
        ),
        // an unknown key part
        (
            "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits:\n      - algorithm: sliding_log\n        rate: 10/m\n        key: [client_ip, session:x]\n",
            7,
            "routes[0].limits[0].key",
            "session:x",
        ),
        // an unknown algorithm
        (
            "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits:\n      - { algorithm: token_buckets, rate: 1/s }\n",
            5,
            "routes[0].limits[0].algorithm",
            "unknown variant `token_buckets`",
        ),
        // syntax error
        ("upstreams: {}\nroutes: [}\n", 2, "routes", "did not find expected node content, while"),
        // missing routes
        ("upstreams: {}\n", 1, "", "missing field `routes`"),
    ];
    for (text, line, path, needle) in cases {
        let e = err(text);
        assert_eq!(e.line, *line, "line for {text:?}: {e}");
        assert!(e.column >= 1, "column for {text:?}: {e}");
        assert_eq!(e.path, *path, "path for {text:?}: {e}");
        assert!(e.message.contains(needle), "message for {text:?}: {e}");
        let shown = e.to_string();
        assert!(shown.starts_with(&format!("proxy.yaml:{line}:")), "{shown}");
    }
}

/// Issue 31 (6): a key given twice in any mapping is refused at the second one (serde_yaml let
/// the last upstream of a name win, and put a field given twice at 1:1).
#[test]
fn a_key_given_twice_is_refused_where_it_is_given_again() {
    let cases: &[(&str, (usize, usize), &str)] = &[
        ("upstreams: { ok: { respond: {} }, ok: { url: http://x:1 } }\nroutes: [{ upstream: ok }]\n", (1, 35), "upstreams.ok"),
        ("upstreams: { ok: { respond: {} } }\nroutes: [{ upstream: ok }]\nroutes: []\n", (3, 1), "routes"),
        (
            "upstreams:\n  ok:\n    respond: {}\nroutes:\n  - upstream: ok\n    limits:\n      - { name: a, rate: 1/s, rate: 2/s }\n",
            (7, 31),
            "routes[0].limits[0].rate",
        ),
        (
            "\u{feff}upstreams:\n  ok: { respond: {} }\n  \"ok\": { respond: {} }\nroutes: [{ upstream: ok }]\n",
            (3, 3),
            "upstreams.ok",
        ),
        // After a byte order mark, the first key too.
        ("\u{feff}upstreams: { ok: { respond: {} } }\nroutes: [{ upstream: ok }]\nupstreams: {}\n", (3, 1), "upstreams"),
    ];
    for (text, (line, column), path) in cases {
        let e = err(text);
        assert_eq!((e.line, e.column, e.path.as_str()), (*line, *column, *path), "{text:?}: {e}");
        assert!(e.message.contains("given twice") && e.message.contains("first on line"), "{e}");
    }
    // The same key in two mappings is no duplicate.
    Config::from_yaml(
        Path::new("proxy.yaml"),
        "upstreams: { a: { respond: {} }, b: { respond: {} } }\nroutes: [{ upstream: a }, { upstream: b }]\n",
    )
    .unwrap();
}

#[test]
fn the_shipped_config_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.yaml");
    Config::load(&path).unwrap();
}

/// Values that used to pass `check` and then panicked, saturated or never connected at `run`
/// (issue 22 §4, issue 13 defects 2 and 3): each is refused at its own line and field.
#[test]
fn values_that_cannot_run_are_refused_where_they_are_written() {
    const UP: &str = "upstreams: { d: { respond: {} } }\nroutes:\n";
    let redis = |extra: &str, limit: &str| {
        format!("redis: {{ url: 'redis://127.0.0.1:1', on_error: local{extra} }}\n{UP}  - upstream: d\n    limits:\n      - {limit}\n")
    };
    let cases: Vec<(String, usize, &str, &str)> = vec![
        // a tokio semaphore cannot count 2^61 permits (it panicked at `run`)
        (format!("{UP}  - upstream: d\n    concurrency: 2305843009213693952\n"), 4, "routes[0].concurrency", "requests in flight a route can count"),
        (format!("{UP}  - upstream: d\n    concurrency: {{ max: 2305843009213693952 }}\n"), 4, "routes[0].concurrency", "requests in flight"),
        // burst × interval past 2^64 µs saturated the GCRA and admitted everything
        (
            format!("{UP}  - upstream: d\n    limits:\n      - algorithm: token_bucket\n        rate: 1/d\n        burst: 250000000\n        cost: 250000000\n"),
            7,
            "routes[0].limits[0].burst",
            "too long to compute exactly",
        ),
        (
            format!("{UP}  - upstream: d\n    limits:\n      - {{ algorithm: token_bucket, rate: 1000000/s, burst: 3074457345618258603 }}\n"),
            5,
            "routes[0].limits[0].burst",
            "3 × burst × interval",
        ),
        // route names are labels and key parts
        (format!("{UP}  - {{ name: 'x\"}} 1\n\n    fake{{a=\"b', upstream: d }}\n"), 3, "routes[0].name", "is not a name"),
        (format!("{UP}  - {{ name: 'a{{b', upstream: d }}\n"), 3, "routes[0].name", "letters, digits"),
        (format!("{UP}  - {{ name: '', upstream: d }}\n"), 3, "routes[0].name", "1 to 128"),
        (format!("{UP}  - {{ name: {}, upstream: d }}\n", "a".repeat(129)), 3, "routes[0].name", "1 to 128"),
        (
            format!("{UP}  - upstream: d\n    limits: [{{ name: {}, algorithm: fixed_window, rate: 1/s }}]\n", "l".repeat(129)),
            4,
            "routes[0].limits[0].name",
            "1 to 128",
        ),
        // the fallback of `on_error: local` divides by `instances`: the cost must fit it too
        (
            redis(", instances: 4", "{ algorithm: token_bucket, rate: 10/s, burst: 10, cost: 5, store: redis }"),
            6,
            "routes[0].limits[0].cost",
            "can never be admitted while Redis is down: with `redis.on_error: local` and `instances: 4` the local fallback admits at most 2 at once",
        ),
        (
            redis(", instances: 3", "{ algorithm: fixed_window, rate: 6/m, cost: 3, store: redis }"),
            6,
            "routes[0].limits[0].cost",
            "admits at most 2 at once",
        ),
        (
            redis(", instances: 18446744073709551615", "{ algorithm: token_bucket, rate: 1/s, store: redis }"),
            6,
            "routes[0].limits[0].rate",
            "the local fallback: burst",
        ),
        // upstream URLs that can never connect
        ("upstreams: { d: { url: 'http://127.0.0.1:0' } }\nroutes: [{ upstream: d }]\n".to_owned(), 1, "upstreams.d.url", "port `0`; expected a port from 1 to 65535"),
        ("upstreams: { d: { url: 'http://127.0.0.1:99999' } }\nroutes: [{ upstream: d }]\n".to_owned(), 1, "upstreams.d.url", "port `99999`"),
        ("upstreams: { d: { url: 'http://127.0.0.1:65536' } }\nroutes: [{ upstream: d }]\n".to_owned(), 1, "upstreams.d.url", "port `65536`"),
        ("upstreams: { d: { url: 'http://a:+80' } }\nroutes: [{ upstream: d }]\n".to_owned(), 1, "upstreams.d.url", "port `+80`"),
        ("upstreams: { d: { url: 'http://:8080' } }\nroutes: [{ upstream: d }]\n".to_owned(), 1, "upstreams.d.url", "has no host"),
        // adaptive concurrency: each parameter at its own line
        (format!("{UP}  - upstream: d\n    concurrency:\n      adaptive:\n        min: 10\n        max: 5\n"), 7, "routes[0].concurrency.adaptive.max", "between min (10)"),
        (format!("{UP}  - upstream: d\n    concurrency:\n      adaptive: {{ tolerance: 0.5 }}\n"), 5, "routes[0].concurrency.adaptive.tolerance", "between 1 and 10"),
        (format!("{UP}  - upstream: d\n    concurrency:\n      adaptive: {{ percentile: 0 }}\n"), 5, "routes[0].concurrency.adaptive.percentile", "above 0"),
        (format!("{UP}  - upstream: d\n    concurrency:\n      adaptive: {{ window: 0 }}\n"), 5, "routes[0].concurrency.adaptive.window", "between 1ms and 60s"),
        (format!("{UP}  - upstream: d\n    concurrency:\n      adaptive: {{ smoothing: 2 }}\n"), 5, "routes[0].concurrency.adaptive.smoothing", "at most 1"),
        (format!("{UP}  - upstream: d\n    concurrency:\n      adaptive: {{ min: 0 }}\n"), 5, "routes[0].concurrency.adaptive.min", "at least 1"),
        (format!("{UP}  - upstream: d\n    concurrency: {{ max: 5, adaptive: {{}} }}\n"), 4, "routes[0].concurrency", "not both"),
        (format!("{UP}  - upstream: d\n    concurrency: {{ max_wait: 1s }}\n"), 4, "routes[0].concurrency", "expected `max: N`"),
        (format!("{UP}  - upstream: d\n    retry_after_spread: 1.5s\n"), 4, "routes[0].retry_after_spread", "whole seconds"),
        (format!("{UP}  - upstream: d\n    retry_after_spread: 2h\n"), 4, "routes[0].retry_after_spread", "from 0 to 3600s"),
        // more limits on one route than a request should run
        (
            format!("{UP}  - upstream: d\n    limits:\n{}", "      - { algorithm: fixed_window, rate: 1/s }\n".repeat(MAX_LIMITS_PER_ROUTE + 1)),
            5,
            "routes[0].limits",
            "33 limits on one route (aliases expanded); at most 32",
        ),
    ];
    for (text, line, path, needle) in &cases {
        let e = err(text);
        assert_eq!((e.line, e.path.as_str()), (*line, *path), "{e}");
        assert!(e.message.contains(needle), "message for {text:?}: {e}");
    }
    // The bounds themselves are accepted.
    let ok = format!(
        "{UP}  - name: {}\n    upstream: d\n    concurrency: 2305843009213693951\n    limits:\n      - {{ algorithm: token_bucket, rate: 1000000/s, burst: 3074457345618258602 }}\n",
        "a".repeat(128)
    );
    Config::from_yaml(Path::new("proxy.yaml"), &ok).unwrap();
    let ok = redis(", instances: 4", "{ algorithm: token_bucket, rate: 10/s, burst: 10, cost: 2, store: redis }");
    Config::from_yaml(Path::new("proxy.yaml"), &ok).unwrap();
    let ok = redis(", instances: 4", "{ algorithm: token_bucket, rate: 10/s, burst: 10, cost: 5, store: redis }")
        .replace("local", "allow");
    Config::from_yaml(Path::new("proxy.yaml"), &ok).unwrap();
}

#[test]
fn an_upstream_url_without_a_port_means_port_80() {
    for (url, authority) in
        [("http://127.0.0.1", "127.0.0.1:80"), ("http://[::1]/v1", "[::1]:80"), ("http://a:08080", "a:8080")]
    {
        let c = Config::from_yaml(
            Path::new("p.yaml"),
            &format!("upstreams: {{ d: {{ url: '{url}' }} }}\nroutes: [{{ upstream: d }}]\n"),
        )
        .unwrap();
        match &c.upstreams[0].kind {
            UpstreamKind::Http(h) => assert_eq!(h.authority.as_str(), authority),
            UpstreamKind::Respond(_) => panic!("an http upstream"),
        }
    }
}

#[test]
fn urls_with_credentials_are_redacted_in_every_message() {
    for text in [
        "redis: { url: 'redis://app:hunter2@' }\nupstreams: {}\nroutes: []\n",
        "redis: { url: 'app:hunter2@redis:6379' }\nupstreams: {}\nroutes: []\n",
        "redis: { cluster: ['redis://h:1', 'redis://app:hunter2@h:99999999'] }\nupstreams: {}\nroutes: []\n",
        "redis: { url: 'redis://h:1', timeout: 'redis://app:hunter2@h:1' }\nupstreams: {}\nroutes: []\n",
        "redis: { url: 'redis://h:1', instances: 'redis://app:hun ter2@h:1' }\nupstreams: {}\nroutes: []\n",
    ] {
        let e = err(text).to_string();
        assert!(!e.contains("hunter2") && !e.contains("ter2"), "{e}");
    }
    assert_eq!(redact("a `redis://app:pa/ss@h:1/0` b"), "a `redis://app:***@h:1/0` b");
    assert_eq!(redact("redis://:pw@h"), "redis://***@h");
    assert_eq!(redact("see http://h:1/x and redis://u:p@h"), "see http://h:1/x and redis://u:***@h");
}

#[test]
fn an_error_at_the_end_of_the_text_points_inside_it() {
    for (text, want) in [("#", (1, 2)), ("listen: 127.0.0.1:8080", (1, 23)), ("routes: []\nupstreams: {}", (1, 1))] {
        let e = Config::from_yaml(Path::new("t.yaml"), text).expect_err("incomplete config");
        let lines: Vec<&str> = text.split('\n').collect();
        assert!(e.line >= 1 && e.line <= lines.len(), "{e} is outside {text:?}");
        assert!(e.column >= 1 && e.column <= lines[e.line - 1].chars().count() + 1, "{e} is outside {text:?}");
        if text == "#" {
            assert_eq!((e.line, e.column), want, "{e}");
        }
    }
}

#[test]
fn calendar_windows_are_checked_where_written() {
    const UP: &str = "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits:\n";
    let cases = [
        (
            "      - { algorithm: fixed_window, rate: 5/month, calendar: Mars/Base }\n",
            "routes[0].limits[0].calendar",
            "is not a time zone",
        ),
        (
            "      - { algorithm: fixed_window, rate: 5/2d, calendar: utc }\n",
            "routes[0].limits[0].rate",
            "one hour, day or month",
        ),
        (
            "      - { algorithm: token_bucket, rate: 5/d, calendar: utc }\n",
            "routes[0].limits[0].calendar",
            "fixed_window only",
        ),
    ];
    for (limit, path, needle) in cases {
        let e = err(&format!("{UP}{limit}"));
        assert_eq!((e.line, e.path.as_str()), (5, path), "{e}");
        assert!(e.message.contains(needle), "{e}");
    }
    let ok = format!("{UP}      - {{ algorithm: fixed_window, rate: 1000/month, calendar: Europe/Berlin }}\n");
    let c = Config::from_yaml(Path::new("proxy.yaml"), &ok).unwrap();
    let crate::limit::Algorithm::FixedWindow { calendar: Some(cal), .. } = &c.routes[0].limits[0].algorithm else {
        panic!("no calendar")
    };
    assert_eq!(cal.unit(), crate::limit::CalendarUnit::Month);
    assert_eq!(c.routes[0].limits[0].rate.to_string(), "1000/month");
}

#[test]
fn response_cost_is_checked_where_written() {
    const UP: &str = "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits:\n";
    let limit = |cost: &str| format!("{UP}      - {{ algorithm: token_bucket, rate: 10/s, cost: {cost} }}\n");
    let e = err(&limit("{ estimate: 1, response_header: 'x y' }"));
    assert_eq!(e.path, "routes[0].limits[0].cost", "{e}");
    assert!(e.message.contains("not a header name"), "{e}");
    let e = err(&limit("{ estimate: 1 }"));
    assert!(e.message.contains("response_header"), "{e}");
    let e = err(&limit("{ estimate: 11, response_header: x-n }"));
    assert!(e.message.contains("admits at most 10"), "{e}");
    let c = Config::from_yaml(Path::new("p.yaml"), &limit("{ estimate: 2, response_header: X-Tokens }")).unwrap();
    let l = &c.routes[0].limits[0];
    assert_eq!((l.cost, l.response_cost.as_ref().map(|h| h.as_str())), (2, Some("x-tokens")));
}

#[test]
fn plan_mistakes_are_refused_where_they_are_written() {
    let yaml = |tiers: &str, limit: &str| {
        format!(
            "plans:\n  of: header:x-key\n  clients: /nonexistent/clients.yaml\n  default: free\n  tiers:\n{tiers}upstreams: {{ d: {{ respond: {{}} }} }}\nroutes:\n  - upstream: d\n    limits:\n      - {limit}\n"
        )
    };
    let free = "    free:\n      fast: { rate: 5/s }\n";
    let cases = [
        // a plan limit that no tier names
        (yaml(free, "{ name: slow, algorithm: token_bucket, plan: true }"), 12, "routes[0].limits[0].plan", "no tier"),
        // a tier entry that names no plan limit
        (
            yaml(
                "    free:\n      fast: { rate: 5/s }\n      typo: { rate: 1/s }\n",
                "{ name: fast, algorithm: token_bucket, plan: true }",
            ),
            8,
            "plans.tiers.free.typo",
            "no `plan: true` limit",
        ),
        // a plan limit with its own rate
        (
            yaml(free, "{ name: fast, algorithm: token_bucket, plan: true, rate: 1/s }"),
            12,
            "routes[0].limits[0].rate",
            "from the client's tier",
        ),
        // a bad rate in a tier is reported at the tier
        (
            yaml(
                "    free:\n      fast: { rate: 5/s, burst: 0 }\n",
                "{ name: fast, algorithm: token_bucket, plan: true }",
            ),
            7,
            "plans.tiers.free.fast.burst",
            "at least 1",
        ),
        (
            yaml(free, "{ name: fast, algorithm: leaky_bucket, plan: true }"),
            12,
            "routes[0].limits[0].algorithm",
            "token_bucket or a window",
        ),
        (
            yaml(free, "{ name: fast, algorithm: token_bucket }").replace("default: free", "default: gold"),
            4,
            "plans.default",
            "unknown tier `gold`",
        ),
        (
            yaml(free, "{ name: fast, algorithm: token_bucket, plan: true }"),
            3,
            "plans.clients",
            "cannot read the clients file",
        ),
    ];
    for (text, line, path, needle) in &cases {
        let e = err(text);
        assert_eq!((e.line, e.path.as_str()), (*line, *path), "{e}");
        assert!(e.message.contains(needle), "{e}");
    }
    let e = err(&yaml(free, "{ name: fast, algorithm: token_bucket, plan: true }").replace("plans:", "plans_:"));
    assert!(e.message.contains("unknown field"), "{e}");
}

#[test]
fn early_retry_penalty_is_off_unless_asked_and_checked_where_written() {
    const UP: &str = "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits:\n";
    let limit = |extra: &str| format!("{UP}      - {{ algorithm: token_bucket, rate: 10/s{extra} }}\n");
    for (extra, on) in [
        ("", false),
        (", early_retry: {}", false),
        (", early_retry: { penalty: none }", false),
        (", early_retry: { penalty: double }", true),
    ] {
        let c = Config::from_yaml(Path::new("p.yaml"), &limit(extra)).unwrap();
        assert_eq!(c.routes[0].limits[0].early_penalty, on, "{extra}");
    }
    let e = err(&limit(", early_retry: { penalty: triple }"));
    assert_eq!((e.line, e.path.as_str()), (5, "routes[0].limits[0].early_retry.penalty"), "{e}");
    assert!(e.message.contains("unknown variant `triple`"), "{e}");
    let e = err(&limit(", early_retry: { penality: double }"));
    assert_eq!(e.path, "routes[0].limits[0].early_retry.penality", "{e}");
}

/// A field written as a word, a number or a mapping: a mistake inside the mapping is reported
/// at its own field and line, as the same mistake anywhere else is; a value of no allowed form
/// says which forms are allowed. None says "did not match any variant".
#[test]
fn a_mistake_inside_a_field_of_several_forms_names_its_own_field() {
    let route = |extra: &str| format!("upstreams:\n  d: {{ respond: {{}} }}\nroutes:\n  - upstream: d\n{extra}");
    let group = |extra: &str| {
        format!(
            "upstreams:\n  g:\n    servers: [{{ url: 'http://127.0.0.1:1' }}]\n{extra}routes: [{{ upstream: g }}]\n"
        )
    };
    let cases: Vec<(String, usize, &str, &str)> = vec![
        // route `auth`: a missing field, a misspelt one
        (
            route("    auth:\n      api_key:\n        from: header:x-key\n      strip_credentials: true\n"),
            // the first line of the mapping that lacks it, as at the top level
            7,
            "routes[0].auth.api_key",
            "missing field `keys`",
        ),
        (
            route("    auth:\n      api_key: { keys: k.txt }\n      strip_credential: true\n"),
            7,
            "routes[0].auth.strip_credential",
            "unknown field `strip_credential`, expected one of",
        ),
        (route("    auth: 5\n"), 5, "routes[0].auth", "expected `none` or a map with `jwt` or `api_key`"),
        // api_key `keys` as a Redis hash
        (
            route("    auth:\n      api_key:\n        keys: { redis_hsh: keys }\n"),
            7,
            "routes[0].auth.api_key.keys.redis_hsh",
            "unknown field `redis_hsh`",
        ),
        // `concurrency`
        (
            route("    concurrency:\n      max: 3\n      max_wiat: 1s\n"),
            7,
            "routes[0].concurrency.max_wiat",
            "unknown field `max_wiat`",
        ),
        (route("    concurrency: lots\n"), 5, "routes[0].concurrency", "expected a count, or `{ max: N"),
        // a group's `balance`, `retry.on`, `health.expect`
        (group("    balance:\n      hahs: client_ip\n"), 5, "upstreams.g.balance.hahs", "unknown field `hahs`"),
        (
            group("    retry: { attempts: 2, on: [{ status: 502 }] }\n"),
            4,
            "upstreams.g.retry.on[0]",
            "expected a retry condition",
        ),
        (
            group("    health: { path: /h, expect: [200] }\n"),
            4,
            "upstreams.g.health.expect",
            "expected a status code (200) or a range",
        ),
        // a header condition's second key, misspelt: not "give one of them, not both"
        (
            route("    match:\n      headers:\n        x-debug: { present: false, regx: a }\n"),
            7,
            "routes[0].match.headers.x-debug",
            "unknown field `regx`, expected `present` or `regex`",
        ),
        // a certificate's names for ACME: a name or a list of them
        (
            "listen:\n  - addr: 127.0.0.1:8443\n    tls:\n      acme: { names: [{ name: a.example }] }\n  - { addr: 127.0.0.1:8080, redirect_https: true }\nupstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n"
                .to_owned(),
            4,
            "listen[0].tls.acme.names[0]",
            "expected a name, or a list of names for one certificate",
        ),
        // a group server's `resolve`
        (
            "upstreams:\n  g:\n    servers: [{ url: 'http://a.internal:1', resolve: [srv] }]\nroutes: [{ upstream: g }]\n".to_owned(),
            3,
            "upstreams.g.servers[0].resolve",
            "expected `true` (A and AAAA records), `srv` or `false`",
        ),
        // `server.workers`
        (
            "server: { workers: [2] }\nupstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n".to_owned(),
            1,
            "server.workers",
            "expected `auto` or a worker count",
        ),
        // `plans.clients` from Redis
        (
            "redis: { url: 'redis://127.0.0.1:1' }\nplans:\n  of: header:x-key\n  clients:\n    redis_hash: c\n    cahce: 1m\n  default: free\n  tiers: { free: {} }\nupstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n"
                .to_owned(),
            6,
            "plans.clients.cahce",
            "unknown field `cahce`",
        ),
    ];
    for (text, line, path, message) in &cases {
        let e = err(text);
        assert!(!e.message.contains("did not match any variant"), "{e}\n{text}");
        assert_eq!((e.line, e.path.as_str()), (*line, *path), "{e}\n{text}");
        assert!(e.message.contains(message), "{e}\n{text}");
    }
}

/// `tls.acme` and `tls.internal` mistakes: each at its own line, column and field.
#[test]
fn certificates_tollgate_gets_itself_are_checked_where_they_are_written() {
    let cfg = |tls: &str, more: &str| {
        format!(
            "listen:\n  - addr: 127.0.0.1:8443\n    tls:\n{tls}{more}upstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n"
        )
    };
    let plain = "  - { addr: 127.0.0.1:8080, redirect_https: true }\n";
    let cases: [(String, &str, (usize, usize), &str); 8] = [
        (cfg("      acme: { names: ['*.example.com'] }\n", plain), "listen[0].tls.acme.names[0]", (4, 23), "DNS-01"),
        (cfg("      acme: { names: [127.0.0.1] }\n", plain), "listen[0].tls.acme.names[0]", (4, 23), "IP address"),
        (
            cfg("      acme: { names: [a.example, [b.example, a.example]] }\n", plain),
            "listen[0].tls.acme.names",
            (4, 22),
            "named twice",
        ),
        (cfg("      acme: { names: [a.example] }\n", ""), "listen[0].tls.acme.challenge", (4, 13), "plain listener"),
        (
            cfg("      acme: { names: [a.example], directory: http://ca.example/dir }\n", plain),
            "listen[0].tls.acme.directory",
            (4, 46),
            "https://",
        ),
        (
            cfg("      acme: { names: [a.example], eab: { kid: k, hmac_key: c2hvcnQ } }\n", plain),
            "listen[0].tls.acme.eab.hmac_key",
            (4, 60),
            "16 bytes",
        ),
        (
            cfg("      internal: { names: ['*.localhost'] }\n", ""),
            "listen[0].tls.internal.names[0]",
            (4, 27),
            "app.localhost",
        ),
        (cfg("      internal: { lifetime: 1s }\n", ""), "listen[0].tls.internal.lifetime", (4, 29), "5s to 397d"),
    ];
    for (text, path, (line, column), words) in cases {
        let e = err(&text);
        assert_eq!(e.path, path, "{e}");
        assert!(e.message.contains(words), "{e}");
        assert_eq!((e.line, e.column), (line, column), "{e}\n{text}");
    }
    let ok = Config::from_yaml(
        Path::new("p.yaml"),
        &cfg("      acme: { names: [a.example], challenge: tls-alpn-01 }\n", ""),
    )
    .unwrap();
    assert!(ok.warnings.iter().any(|w| w.contains("port 443")), "{:?}", ok.warnings);
    let ok = Config::from_yaml(Path::new("p.yaml"), &cfg("      internal: true\n", plain)).unwrap();
    let tls = ok.listeners[0].tls.as_ref().unwrap();
    assert_eq!(tls.managed[0].names, ["localhost", "127.0.0.1", "::1"]);
    assert!(!ok.listeners[1].acme_http, "only http-01 makes plain listeners answer validations");
    let ok = Config::from_yaml(Path::new("p.yaml"), &cfg("      acme: { names: [a.example] }\n", plain)).unwrap();
    assert!(ok.listeners[1].acme_http && !ok.listeners[1].is_plain());
    assert!(ok.warnings.iter().any(|w| w.contains("port 80")), "{:?}", ok.warnings);
}

#[test]
fn compression_is_a_default_a_route_may_replace_or_turn_off() {
    use super::compression::{Coding, CompressionConfig, MediaRange};
    let text = "compression: { levels: { br: 5 } }
upstreams: { d: { respond: {} } }
routes:
  - { name: a, upstream: d }
  - { name: b, upstream: d, compression: none }
  - name: c
    upstream: d
    compression:
      encodings: [gzip]
      min_size: 2KiB
      types: [text/html, Application/*+JSON, text/html]
  - { name: d, upstream: d, compression: {} }
";
    let c = Config::from_yaml(Path::new("p.yaml"), text).unwrap();
    let default = c.compression.clone().unwrap();
    assert_eq!(default.levels.br, 5);
    assert_eq!(c.routes[0].compression, Some(default));
    assert_eq!(c.routes[1].compression, None);
    let own = c.routes[2].compression.as_deref().unwrap();
    assert_eq!(own.encodings, [Coding::Gzip]);
    assert_eq!(own.min_size, 2048);
    assert_eq!(own.types, [MediaRange::parse("text/html").unwrap(), MediaRange::parse("application/*+json").unwrap()]);
    // A route's own section replaces the default whole: what it leaves out is the built-in value.
    assert_eq!(own.levels.br, 4);
    assert_eq!(c.routes[3].compression.as_deref(), Some(&CompressionConfig::default()));
    // No section anywhere: nothing is compressed.
    let plain =
        Config::from_yaml(Path::new("p.yaml"), "upstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n");
    assert_eq!(plain.unwrap().routes[0].compression, None);
}

#[test]
fn compression_mistakes_name_line_column_and_field() {
    const UP: &str = "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    compression:\n";
    let cases: &[(&str, usize, &str, &str)] = &[
        ("      encodings: [gzip, deflate]\n", 5, "routes[0].compression.encodings[1]", "`deflate` is not a coding"),
        ("      encodings: [gzip, gzip]\n", 5, "routes[0].compression.encodings[1]", "listed twice"),
        ("      encodings: []\n", 5, "routes[0].compression.encodings", "`compression: none` turns"),
        ("      levels: { gzip: 0 }\n", 5, "routes[0].compression.levels.gzip", "gzip takes 1 to 9"),
        ("      levels: { br: 11 }\n", 5, "routes[0].compression.levels.br", "br takes 0 to 9"),
        ("      levels: { zstd: 22 }\n", 5, "routes[0].compression.levels.zstd", "zstd takes 1 to 19"),
        ("      levels: { deflate: 3 }\n", 5, "routes[0].compression.levels.deflate", "unknown field"),
        ("      types: [text/html, html]\n", 5, "routes[0].compression.types[1]", "`html`: expected a media type"),
        ("      types: []\n", 5, "routes[0].compression.types", "at least one media type"),
        ("      min_size: lots\n", 5, "routes[0].compression.min_size", "is not a size"),
        ("      level: 3\n", 5, "routes[0].compression.level", "unknown field"),
    ];
    for (body, line, path, needle) in cases {
        let e = err(&format!("{UP}{body}"));
        assert_eq!((e.line, e.path.as_str()), (*line, *path), "{body}: {e}");
        assert!(e.message.contains(needle), "{body}: {e}");
    }
    let e = err("upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    compression: off\n");
    assert_eq!((e.line, e.path.as_str()), (4, "routes[0].compression"), "{e}");
    assert!(e.message.contains("`off`: expected `none` or a map"), "{e}");
    let e = err("compression: { levels: { br: -1 } }\nupstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n");
    assert_eq!((e.line, e.path.as_str()), (1, "compression.levels.br"), "{e}");
}
