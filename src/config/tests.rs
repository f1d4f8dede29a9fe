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
        // https is refused with a reason
        (
            "upstreams:\n  a:\n    url: https://x\nroutes: [{ upstream: a }]\n",
            3,
            "upstreams.a.url",
            "https upstreams are not supported",
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
            "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits:\n      - algorithm: sliding_log\n        rate: 10/m\n        key: [client_ip, cookie:x]\n",
            7,
            "routes[0].limits[0].key",
            "cookie:x",
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

#[test]
fn the_shipped_config_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.yaml");
    Config::load(&path).unwrap();
}
