//! Gateway rules: header and query conditions, path rewrites, header rules both ways,
//! request ids and trace context, against real sockets and a real upstream.

use std::path::Path;
use std::sync::{Arc, Mutex};

use http::{HeaderMap, Response, StatusCode};
use tollgate::config::Config;
use tollgate::limit::{ManualClock, Span, Timestamp};

use crate::support::{full, get, get_with, proxy_yaml, Tollgate, Upstream};

type Seen = Arc<Mutex<Vec<(String, HeaderMap)>>>;

/// An upstream that records each request's target and headers and answers with a `Server`
/// field, an `X-Powered-By` and `max-age=60` (so stale copies can be kept).
async fn recorder() -> (Upstream, Seen) {
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let up = Upstream::start(move |req| {
        let record = record.clone();
        async move {
            record.lock().unwrap().push((req.uri().to_string(), req.headers().clone()));
            Response::builder()
                .header("server", "upstream/1.0")
                .header("x-powered-by", "php")
                .header("cache-control", "max-age=60")
                .body(full(format!("upstream saw {}", req.uri())))
                .unwrap()
        }
    })
    .await;
    (up, seen)
}

fn last(seen: &Seen) -> (String, HeaderMap) {
    seen.lock().unwrap().last().cloned().expect("the upstream saw no request")
}

fn is_made_id(v: &str) -> bool {
    v.len() == 32 && v.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Routes by conditions to responders that answer with the route's name.
const MATCHERS: &str = r#"
upstreams:
  v2: { respond: { body: v2 } }
  authed: { respond: { body: authed } }
  anon: { respond: { body: anon } }
  curl: { respond: { body: curl } }
  beta: { respond: { body: beta } }
  tenant: { respond: { body: tenant } }
  rest: { respond: { body: rest } }
routes:
  - { match: { path_prefix: /api/, headers: { X-Api-Version: 2 } }, upstream: v2 }
  - { match: { path_prefix: /auth/, headers: { authorization: { present: true } } }, upstream: authed }
  - { match: { path_prefix: /auth/, headers: { authorization: { present: false } } }, upstream: anon }
  - { match: { headers: { user-agent: { regex: "curl/[0-9.]+" } } }, upstream: curl }
  - { match: { query: { beta: "1", debug: { present: false } } }, upstream: beta }
  - { match: { headers: { x-tenant: acme } }, upstream: tenant }
  - { upstream: rest }
"#;

#[tokio::test]
async fn routes_match_on_headers_and_query() {
    let tg = Tollgate::start(MATCHERS).await;
    let body = |r: (StatusCode, HeaderMap, bytes::Bytes)| String::from_utf8(r.2.to_vec()).unwrap();
    // Exact value; the name is written X-Api-Version in the file and sent in lower case.
    assert_eq!(body(get_with(tg.addr, "/api/x", &[("x-api-version", "2")]).await), "v2");
    assert_eq!(body(get_with(tg.addr, "/api/x", &[("X-API-VERSION", "2")]).await), "v2");
    assert_eq!(body(get_with(tg.addr, "/api/x", &[("x-api-version", "20")]).await), "rest");
    assert_eq!(body(get(tg.addr, "/api/x").await), "rest");
    // Present and absent; an empty value is present.
    assert_eq!(body(get_with(tg.addr, "/auth/x", &[("authorization", "")]).await), "authed");
    assert_eq!(body(get(tg.addr, "/auth/x").await), "anon");
    // A regex must match the whole value.
    assert_eq!(body(get_with(tg.addr, "/x", &[("user-agent", "curl/8.5.0")]).await), "curl");
    assert_eq!(body(get_with(tg.addr, "/x", &[("user-agent", "curl/8.5.0 (x)")]).await), "rest");
    // Query: the first `beta`, decoded; `debug` must be absent.
    assert_eq!(body(get(tg.addr, "/x?beta=1").await), "beta");
    assert_eq!(body(get(tg.addr, "/x?a=b&beta=%31").await), "beta");
    assert_eq!(body(get(tg.addr, "/x?beta=1&debug").await), "rest");
    assert_eq!(body(get(tg.addr, "/x?beta=0&beta=1").await), "rest");
    // A header sent several times matches when any of its values does.
    assert_eq!(body(get_with(tg.addr, "/x", &[("x-tenant", "other"), ("x-tenant", "acme")]).await), "tenant");
    assert_eq!(body(get_with(tg.addr, "/x", &[("x-tenant", "other, acme")]).await), "rest", "one field is one value");
}

#[tokio::test]
async fn path_regex_rewrites_with_captures_and_keeps_the_query() {
    let (up, seen) = recorder().await;
    let routes = r#"  - match: { path_prefix: /api/v2/ }
    upstream: up
    rewrite: { path_regex: { pattern: "^/api/v2/(\\w+)/(.*)$", replace: "/$2/$1" } }
  - { upstream: up }
"#;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", routes)).await;
    let (s, _, _) = get(tg.addr, "/api/v2/users/7/orders?x=1&y=%20").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(last(&seen).0, "/7/orders/users?x=1&y=%20");
    // A path the pattern does not match is forwarded unchanged.
    get(tg.addr, "/api/v2/?q").await;
    assert_eq!(last(&seen).0, "/api/v2/?q");
}

#[tokio::test]
async fn request_rules_remove_set_and_add_with_every_variable() {
    let (up, seen) = recorder().await;
    let routes = r#"  - name: edge
    match: { path_prefix: /app/ }
    upstream: up
    strip_prefix: true
    request_headers:
      remove: [x-internal-token, X-Forwarded-Proto]
      set:
        x-route: "{route}"
        x-client-ip: "{client_ip}"
        x-host: "{host}"
        x-path: "{path}"
        x-id: "id={request_id}"
        x-user: "{header:X-Internal-Token}"
        x-gone: "{header:x-missing}"
      add: { x-via-gateway: tollgate, x-version: 3 }
"#;
    let yaml = format!("trusted_proxies: [127.0.0.1/32]\n{}", proxy_yaml(up.addr, "", routes));
    let tg = Tollgate::start(&yaml).await;
    let (_, resp, _) = get_with(
        tg.addr,
        "/app/a/../b?q=1",
        &[
            ("host", "Shop.Example.com:8080"),
            ("x-internal-token", "secret"),
            ("x-route", "forged"),
            ("x-gone", "client's"),
            ("x-via-gateway", "client"),
            ("x-forwarded-for", "203.0.113.7"),
        ],
    )
    .await;
    let (uri, h) = last(&seen);
    assert_eq!(uri, "/b?q=1");
    assert!(h.get("x-internal-token").is_none() && h.get("x-forwarded-proto").is_none(), "{h:?}");
    assert_eq!(h["x-route"], "edge", "set replaces what the client sent");
    assert_eq!(h["x-client-ip"], "203.0.113.7", "the trusted-proxy-aware client address");
    assert_eq!(h["x-host"], "shop.example.com");
    assert_eq!(h["x-path"], "/app/b", "the client's normalised path, before strip_prefix");
    let id = resp["x-request-id"].to_str().unwrap();
    assert!(is_made_id(id), "{id}");
    assert_eq!(h["x-id"], format!("id={id}"));
    assert_eq!(h["x-user"], "secret", "values read the request as the client sent it");
    assert!(h.get("x-gone").is_none(), "an empty value removes the field");
    let via: Vec<_> = h.get_all("x-via-gateway").iter().map(|v| v.to_str().unwrap()).collect();
    assert_eq!(via, ["client", "tollgate"], "add appends");
    assert_eq!(h["x-version"], "3");
}

const RESPONSE_RULES: &str = r#"    response_headers:
      remove: [server, x-powered-by]
      set: { strict-transport-security: "max-age=31536000", x-route: "{route}" }
      add: { x-served-by: "tollgate {request_id}" }
"#;

fn assert_response_rules(h: &HeaderMap, route: &str) {
    assert!(h.get("server").is_none() && h.get("x-powered-by").is_none(), "{h:?}");
    assert_eq!(h["strict-transport-security"], "max-age=31536000");
    assert_eq!(h["x-route"], route);
    let id = h["x-request-id"].to_str().unwrap();
    assert_eq!(h["x-served-by"], format!("tollgate {id}"));
}

#[tokio::test]
async fn response_rules_apply_to_proxied_answers_429s_and_the_responder() {
    let (up, _seen) = recorder().await;
    let routes = format!(
        "  - name: limited
    match: {{ path_prefix: /limited }}
    upstream: up
    limits: [{{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 1 }}]
{RESPONSE_RULES}  - name: local
    match: {{ path_prefix: /local }}
    upstream: responder
{RESPONSE_RULES}"
    );
    let yaml = proxy_yaml(up.addr, "  responder: { respond: { headers: { server: builtin }, body: hi } }\n", &routes);
    let tg = Tollgate::start(&yaml).await;
    let (s, h, _) = get(tg.addr, "/limited").await;
    assert_eq!(s, StatusCode::OK);
    assert_response_rules(&h, "limited");
    let (s, h, _) = get(tg.addr, "/limited").await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_response_rules(&h, "limited");
    assert_eq!(h["content-type"], "application/problem+json");
    // The cached 429 is cloned, and each clone gets its own request's id.
    let (s, h2, _) = get(tg.addr, "/limited").await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_ne!(h["x-request-id"], h2["x-request-id"]);
    assert_response_rules(&h2, "limited");
    let (s, h, _) = get(tg.addr, "/local").await;
    assert_eq!(s, StatusCode::OK);
    assert_response_rules(&h, "local");
}

#[tokio::test]
async fn response_rules_apply_to_stale_copies() {
    let (up, _seen) = recorder().await;
    let routes = format!(
        "  - name: read
    upstream: up
    limits: [{{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 1 }}]
    on_limit: {{ stale: {{ max_age: 5m }} }}
{RESPONSE_RULES}"
    );
    let clock = ManualClock::new(Timestamp::from_micros(1_700_000_000_000_000));
    let tg = Tollgate::start_with_clock(&proxy_yaml(up.addr, "", &routes), clock.clone()).await;
    assert_eq!(get(tg.addr, "/s").await.0, StatusCode::OK);
    clock.advance(Span::from_secs(10));
    let (s, h, b) = get(tg.addr, "/s").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"upstream saw /s"[..]));
    assert!(h["cache-status"].to_str().unwrap().contains("detail=throttled"), "{h:?}");
    assert_response_rules(&h, "read");
}

#[tokio::test]
async fn the_stale_copy_key_is_the_rewritten_path() {
    let (up, seen) = recorder().await;
    let routes = r#"  - name: read
    upstream: up
    rewrite: { path_regex: { pattern: "^/(v1|v2)/(.*)$", replace: "/$2" } }
    limits: [{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 1 }]
    on_limit: { stale: { max_age: 5m } }
"#;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", routes)).await;
    assert_eq!(get(tg.addr, "/v1/doc").await.0, StatusCode::OK);
    assert_eq!(last(&seen).0, "/doc");
    // Throttled: /v2/doc rewrites to the same upstream path, whose copy answers.
    let (s, h, b) = get(tg.addr, "/v2/doc").await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"upstream saw /doc"[..]), "{h:?}");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn request_ids_are_made_kept_from_trusted_proxies_and_on_every_answer() {
    let (up, seen) = recorder().await;
    let routes = "  - { name: r, match: { path_prefix: /r }, upstream: up, limits: [{ algorithm: token_bucket, rate: 1/h, burst: 1 }] }\n";
    // Untrusted peer: the client's id is replaced by a new one, upstream and client alike.
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", routes)).await;
    let (_, h, _) = get_with(tg.addr, "/r", &[("x-request-id", "client-chosen")]).await;
    let id = h["x-request-id"].to_str().unwrap().to_owned();
    assert!(is_made_id(&id), "{id}");
    assert_eq!(last(&seen).1["x-request-id"], id.as_str());
    // Tollgate's own answers carry one too: a 429 and a 404.
    let (s, h, _) = get(tg.addr, "/r").await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert!(is_made_id(h["x-request-id"].to_str().unwrap()) && h["x-request-id"] != id.as_str());
    let (s, h, _) = get(tg.addr, "/nowhere").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(is_made_id(h["x-request-id"].to_str().unwrap()));

    // A trusted proxy's well-formed id is kept; a malformed one is replaced.
    let (up, seen) = recorder().await;
    let yaml = format!("trusted_proxies: [127.0.0.1/32]\n{}", proxy_yaml(up.addr, "", "  - { upstream: up }\n"));
    let tg = Tollgate::start(&yaml).await;
    let (_, h, _) = get_with(tg.addr, "/", &[("x-request-id", "lb-7f3a:1")]).await;
    assert_eq!(h["x-request-id"], "lb-7f3a:1");
    assert_eq!(last(&seen).1["x-request-id"], "lb-7f3a:1");
    let (_, h, _) = get_with(tg.addr, "/", &[("x-request-id", "two words")]).await;
    assert!(is_made_id(h["x-request-id"].to_str().unwrap()));

    // Another field name, or none at all.
    let (up, seen) = recorder().await;
    let yaml = format!("request_id: {{ header: X-Trace-Id }}\n{}", proxy_yaml(up.addr, "", "  - { upstream: up }\n"));
    let tg = Tollgate::start(&yaml).await;
    let (_, h, _) = get(tg.addr, "/").await;
    assert!(h.get("x-request-id").is_none() && is_made_id(h["x-trace-id"].to_str().unwrap()));
    assert_eq!(last(&seen).1["x-trace-id"], h["x-trace-id"]);
    let yaml = format!("request_id: {{ enabled: false }}\n{}", proxy_yaml(up.addr, "", "  - { upstream: up }\n"));
    let tg = Tollgate::start(&yaml).await;
    let (_, h, _) = get_with(tg.addr, "/", &[("x-request-id", "as sent")]).await;
    assert!(h.get("x-request-id").is_none());
    assert_eq!(last(&seen).1["x-request-id"], "as sent", "with ids off the field is the client's business");
}

#[tokio::test]
async fn trace_context_passes_untouched_and_a_malformed_one_is_dropped() {
    let (up, seen) = recorder().await;
    let tg = Tollgate::start(&proxy_yaml(up.addr, "", "  - { upstream: up }\n")).await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    get_with(tg.addr, "/", &[("traceparent", tp), ("tracestate", "congo=t61rcWkgMzE")]).await;
    let h = last(&seen).1;
    assert_eq!(h["traceparent"], tp);
    assert_eq!(h["tracestate"], "congo=t61rcWkgMzE");
    get_with(tg.addr, "/", &[("traceparent", "00-xyz-00f067aa0ba902b7-01"), ("tracestate", "congo=t61rcWkgMzE")]).await;
    let h = last(&seen).1;
    assert!(h.get("traceparent").is_none() && h.get("tracestate").is_none(), "{h:?}");
}

fn refused(yaml: &str) -> String {
    match Config::from_yaml(Path::new("g.yaml"), yaml) {
        Ok(_) => panic!("accepted:\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn check_refuses_rules_on_framing_fields_unknown_variables_and_bad_patterns() {
    let route = |extra: &str| format!("upstreams: {{ d: {{ respond: {{}} }} }}\nroutes:\n  - upstream: d\n{extra}");
    let e = refused(&route("    request_headers:\n      set: { Content-Length: \"5\" }\n"));
    assert!(
        e.starts_with("g.yaml:5:30: routes[0].request_headers.set.Content-Length: `Content-Length` is a framing"),
        "{e}"
    );
    for field in ["connection", "transfer-encoding", "host", "te", "upgrade"] {
        let e = refused(&route(&format!("    response_headers:\n      remove: [x-a, {field}]\n")));
        assert!(e.contains(&format!("g.yaml:5:21: routes[0].response_headers.remove[1]: `{field}`")), "{e}");
    }
    let e = refused(&route("    request_headers:\n      add: { x-a: \"{user}\" }\n"));
    assert!(e.contains("g.yaml:5:19: routes[0].request_headers.add.x-a: unknown variable `{user}`"), "{e}");
    let e = refused(&route("    match: { headers: { x-a: { regex: \"(\" } } }\n"));
    assert!(e.contains("routes[0].match.headers.x-a.regex"), "{e}");
    let e = refused(&route("    match: { headers: { x-a: { present: true, regex: a } } }\n"));
    assert!(e.contains("routes[0].match.headers.x-a"), "{e}");
    let e = refused(&route("    rewrite: { path_regex: { pattern: \"^/(.*)$\", replace: \"/$2\" } }\n"));
    assert!(e.contains("routes[0].rewrite.path_regex.replace: `$2` names no group"), "{e}");
    let e = refused(&route("    match: { path_prefix: /a }\n    strip_prefix: true\n    rewrite: { path_regex: { pattern: a, replace: b } }\n"));
    assert!(e.contains("routes[0].rewrite: give either"), "{e}");
    let e = refused(&format!(
        "request_id: {{ enabled: false }}\n{}",
        route("    request_headers: { set: { x-a: \"{request_id}\" } }\n")
    ));
    assert!(e.contains("needs request ids on"), "{e}");
}
