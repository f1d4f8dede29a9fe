//! CORS on a route: what a page on another origin may do and read, over real sockets, and in
//! a real browser (headless Chromium): a simple GET, a preflighted PUT with a custom field, a
//! credentialed request, a 429 whose Retry-After the page reads, a 401, and an origin the
//! route does not allow, whose answer the page cannot read.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tollgate::config::Config;

use crate::operate::Captured;
use crate::support::browser::{driver, session, webdriver};
use crate::support::{full, h1, Tollgate, Upstream};

const PAGE: &str = "https://app.example.com";

/// One request on a fresh connection: status, fields, body.
async fn send(addr: SocketAddr, method: Method, path: &str, fields: &[(&str, &str)]) -> (StatusCode, HeaderMap, Bytes) {
    let mut conn = h1(addr).await;
    let mut req = Request::builder().method(method).uri(path).header("host", "api.test");
    for (n, v) in fields {
        req = req.header(*n, *v);
    }
    let resp = conn.send_request(req.body(full("")).unwrap()).await.unwrap();
    let (head, body) = resp.into_parts();
    (head.status, head.headers, body.collect().await.unwrap().to_bytes())
}

/// The values of `name`, joined.
fn all(h: &HeaderMap, name: &str) -> String {
    h.get_all(name).iter().map(|v| v.to_str().unwrap()).collect::<Vec<_>>().join(", ")
}

/// An upstream that notes each method it is sent and answers with a CORS field of its own
/// (which tollgate replaces on a route with `cors`).
async fn upstream() -> (Upstream, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let up = Upstream::start(move |req| {
        let log = log.clone();
        async move {
            log.lock().unwrap().push(req.method().to_string());
            let cookie = req.headers().get("cookie").map_or("", |v| v.to_str().unwrap()).to_owned();
            let mut resp = Response::new(full(format!("ok {cookie}")));
            resp.headers_mut().insert("access-control-allow-origin", "https://upstream.example".parse().unwrap());
            resp.headers_mut().insert("set-cookie", "session=s1; Path=/; SameSite=Lax".parse().unwrap());
            resp
        }
    })
    .await;
    (up, seen)
}

fn config(upstream: SocketAddr, top: &str, routes: &str) -> String {
    format!("{top}upstreams:\n  up: {{ url: 'http://{upstream}' }}\nroutes:\n{routes}")
}

/// Route `api` with `cors` and a limit of one request an hour.
fn one_an_hour(upstream: SocketAddr, cors: &str) -> String {
    config(
        upstream,
        "",
        &format!(
            "  - name: api
    upstream: up
    match: {{ methods: [GET, PUT] }}
    cors: {cors}
    limits:
      - {{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 1, key: route }}
"
        ),
    )
}

#[tokio::test]
async fn an_allowed_origin_reads_the_answer_and_the_throttling_fields() {
    let (up, _) = upstream().await;
    let tg = Tollgate::start(&one_an_hour(up.addr, &format!("{{ origins: ['{PAGE}'] }}"))).await;
    let origin = [("origin", PAGE)];

    let (status, h, _) = send(tg.addr, Method::GET, "/", &origin).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE, "the upstream's own is replaced");
    assert!(!h.contains_key("access-control-allow-credentials"));
    assert_eq!(all(&h, "access-control-expose-headers"), "retry-after, ratelimit, ratelimit-policy, x-request-id");
    assert_eq!(all(&h, "vary"), "Origin");

    // tollgate's own 429: the page may read it, and why, and when to come back.
    let (status, h, body) = send(tg.addr, Method::GET, "/", &origin).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
    assert_eq!(all(&h, "access-control-expose-headers"), "retry-after, ratelimit, ratelimit-policy, x-request-id");
    assert!(h.contains_key("retry-after") && h.contains_key("ratelimit") && h.contains_key("x-request-id"));
    assert_eq!(all(&h, "vary"), "Origin");
    assert!(String::from_utf8_lossy(&body).contains("quota-exceeded"));

    // Without `Origin`: no CORS fields, and still `Vary: Origin` for caches.
    let (_, h, _) = send(tg.addr, Method::GET, "/", &[]).await;
    assert!(!h.contains_key("access-control-allow-origin"));
    assert_eq!(all(&h, "vary"), "Origin");
}

#[tokio::test(flavor = "current_thread")]
async fn an_origin_not_allowed_gets_no_cors_fields_and_is_named_in_the_log() {
    let (logs, _guard) = Captured::json_logs();
    let (up, seen) = upstream().await;
    let yaml = format!("log: {{ access: true }}\n{}", one_an_hour(up.addr, &format!("{{ origins: ['{PAGE}'] }}")));
    let tg = Tollgate::start(&yaml).await;
    let admin = tg.start_admin().await;
    let (status, h, _) = send(tg.addr, Method::GET, "/", &[("origin", "https://evil.example")]).await;
    // Forwarded (the browser, not tollgate, keeps the page from reading it) but not readable.
    assert_eq!(status, StatusCode::OK);
    assert_eq!(seen.lock().unwrap().as_slice(), ["GET"]);
    for name in ["access-control-allow-origin", "access-control-expose-headers", "access-control-allow-credentials"] {
        assert!(!h.contains_key(name), "{name}");
    }
    assert_eq!(all(&h, "vary"), "Origin");
    let (lines, text) = logs.access_lines();
    assert_eq!(lines.len(), 1, "{text}");
    assert_eq!(lines[0]["fields"]["steps"], "cors=origin_refused");
    let metrics = String::from_utf8_lossy(&crate::support::get(admin, "/metrics").await.2).into_owned();
    assert!(metrics.contains(r#"tollgate_steps_total{route="api",step="cors",result="refused"} 1"#), "{metrics}");
}

#[tokio::test]
async fn a_preflight_is_answered_here_never_forwarded_and_spends_no_quota() {
    let (up, seen) = upstream().await;
    let cors = format!("{{ origins: ['{PAGE}'], methods: [PUT], headers: [x-custom], max_age: 1h }}");
    let tg = Tollgate::start(&one_an_hour(up.addr, &cors)).await;
    let preflight =
        [("origin", PAGE), ("access-control-request-method", "PUT"), ("access-control-request-headers", "X-Custom")];
    for _ in 0..3 {
        let (status, h, body) = send(tg.addr, Method::OPTIONS, "/items/1", &preflight).await;
        assert_eq!(status, StatusCode::NO_CONTENT, "the route's methods need not list OPTIONS");
        assert!(body.is_empty());
        assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
        assert_eq!(all(&h, "access-control-allow-methods"), "PUT");
        assert_eq!(all(&h, "access-control-allow-headers"), "x-custom");
        assert_eq!(all(&h, "access-control-max-age"), "3600");
        assert_eq!(all(&h, "vary"), "Origin");
    }
    assert!(seen.lock().unwrap().is_empty(), "a preflight never reaches the upstream");
    // Three preflights, and the hour's one request is still there.
    assert_eq!(send(tg.addr, Method::PUT, "/items/1", &[("origin", PAGE), ("x-custom", "1")]).await.0, StatusCode::OK);
    assert_eq!(send(tg.addr, Method::PUT, "/items/1", &[("origin", PAGE)]).await.0, StatusCode::TOO_MANY_REQUESTS);
    // An OPTIONS that is no preflight (no Access-Control-Request-Method) is an ordinary request.
    let (status, _, _) = send(tg.addr, Method::OPTIONS, "/", &[("origin", PAGE)]).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "the route takes GET and PUT only");
}

#[tokio::test]
async fn a_preflight_for_what_the_route_does_not_allow_is_refused_without_cors_fields() {
    let (up, seen) = upstream().await;
    let cors = format!("{{ origins: ['{PAGE}'], methods: [PUT], headers: [x-custom] }}");
    let yaml = one_an_hour(up.addr, &cors).replace("methods: [GET, PUT]", "methods: [GET, PUT, DELETE]");
    let tg = Tollgate::start(&yaml).await;
    let cases: [(&str, &str, Option<&str>, &str); 3] = [
        ("https://evil.example", "PUT", None, "origin may not call"),
        (PAGE, "DELETE", None, "method the page asks for"),
        (PAGE, "PUT", Some("x-custom, x-other"), "field the page asks to send"),
    ];
    for (origin, method, fields, why) in cases {
        let mut asked = vec![("origin", origin), ("access-control-request-method", method)];
        asked.extend(fields.map(|f| ("access-control-request-headers", f)));
        let (status, h, body) = send(tg.addr, Method::OPTIONS, "/", &asked).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{origin} {method}");
        assert!(!h.keys().any(|k| k.as_str().starts_with("access-control-")), "{h:?}");
        let doc: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(doc["type"], "urn:tollgate:problem:cors-refused");
        assert!(doc["detail"].as_str().unwrap().contains(why), "{doc}");
        assert_eq!(all(&h, "vary"), "Origin");
    }
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn limit_preflights_makes_a_preflight_spend_quota() {
    let (up, seen) = upstream().await;
    let cors = format!("{{ origins: ['{PAGE}'], methods: [PUT], limit_preflights: true }}");
    let tg = Tollgate::start(&one_an_hour(up.addr, &cors)).await;
    let preflight = [("origin", PAGE), ("access-control-request-method", "PUT")];
    let (status, h, _) = send(tg.addr, Method::OPTIONS, "/", &preflight).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
    assert!(!h.contains_key("ratelimit"), "a preflight's answer is no place for the limits' fields");
    // The preflight took the hour's request.
    let (status, h, _) = send(tg.addr, Method::OPTIONS, "/", &preflight).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
    let (status, h, _) = send(tg.addr, Method::PUT, "/", &[("origin", PAGE)]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
    assert!(seen.lock().unwrap().is_empty());
}

fn folder() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-cors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn a_401_and_a_503_from_tollgate_carry_the_cors_fields() {
    // An upstream that holds `/slow` until told, so that it holds the route's only slot.
    let (arrived, release) = (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Semaphore::new(0)));
    let (a, r) = (arrived.clone(), release.clone());
    let up = Upstream::start(move |req| {
        let (a, r) = (a.clone(), r.clone());
        async move {
            if req.uri().path() == "/slow" {
                a.notify_one();
                let _held = r.acquire().await.unwrap();
            }
            Response::new(full("ok"))
        }
    })
    .await;
    let keys = folder().join("keys.txt");
    std::fs::write(&keys, format!("{} acme\n", tollgate::config::auth::hash_key(b"sk-acme"))).unwrap();
    let yaml = config(
        up.addr,
        &format!("cors: {{ origins: ['{PAGE}'], headers: [x-api-key] }}\n"),
        &format!(
            "  - name: keyed
    match: {{ path_prefix: /keyed/ }}
    upstream: up
    auth: {{ api_key: {{ from: 'header:x-api-key', keys: '{}' }} }}
  - name: capped
    upstream: up
    concurrency: 1
",
            keys.display()
        ),
    );
    let tg = Tollgate::start(&yaml).await;
    let origin = [("origin", PAGE)];

    let (status, h, _) = send(tg.addr, Method::GET, "/keyed/x", &origin).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
    assert!(h.contains_key("www-authenticate"));
    // Its preflight carries no key, and is answered before the credentials are asked for.
    let preflight =
        [("origin", PAGE), ("access-control-request-method", "GET"), ("access-control-request-headers", "x-api-key")];
    assert_eq!(send(tg.addr, Method::OPTIONS, "/keyed/x", &preflight).await.0, StatusCode::NO_CONTENT);
    let keyed = [("origin", PAGE), ("x-api-key", "sk-acme")];
    assert_eq!(send(tg.addr, Method::GET, "/keyed/x", &keyed).await.0, StatusCode::OK);

    let addr = tg.addr;
    let slow = tokio::spawn(async move { send(addr, Method::GET, "/slow", &[]).await.0 });
    arrived.notified().await;
    let (status, h, _) = send(tg.addr, Method::GET, "/", &origin).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
    assert!(all(&h, "access-control-expose-headers").contains("retry-after"));
    release.add_permits(1);
    assert_eq!(slow.await.unwrap(), StatusCode::OK);
}

#[tokio::test]
async fn credentials_echo_the_origin_and_star_serves_everyone_without_them() {
    let (up, _) = upstream().await;
    let yaml = config(
        up.addr,
        "",
        "  - name: app
    match: { path_prefix: /app/ }
    upstream: up
    cors: { origins: ['*.example.com'], credentials: true, expose: [set-cookie, etag] }
  - name: open
    upstream: up
    cors: { origins: ['*'] }
",
    );
    let tg = Tollgate::start(&yaml).await;
    let (_, h, _) = send(tg.addr, Method::GET, "/app/x", &[("origin", PAGE)]).await;
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
    assert_eq!(all(&h, "access-control-allow-credentials"), "true");
    assert_eq!(
        all(&h, "access-control-expose-headers"),
        "retry-after, ratelimit, ratelimit-policy, x-request-id, set-cookie, etag"
    );
    let (_, h, _) = send(tg.addr, Method::GET, "/app/x", &[("origin", "https://example.com")]).await;
    assert!(!h.contains_key("access-control-allow-origin"), "*.example.com is the hosts below it");

    let (_, h, _) = send(tg.addr, Method::GET, "/x", &[("origin", "https://anyone.example")]).await;
    assert_eq!(all(&h, "access-control-allow-origin"), "*");
    assert!(!h.contains_key("access-control-allow-credentials"));
    assert!(!h.contains_key("vary"), "the same answer for every origin");

    let bad = config(up.addr, "", "  - { name: r, upstream: up, cors: { origins: ['*'], credentials: true } }\n");
    let e = Config::from_yaml(Path::new("t.yaml"), &bad).unwrap_err();
    assert_eq!(e.path, "routes[0].cors.origins[0]");
    assert!(e.message.contains("cannot go with `credentials: true`"), "{e}");
}

#[tokio::test]
async fn the_top_level_cors_is_every_routes_default_and_none_opts_out() {
    let (up, _) = upstream().await;
    let yaml = config(
        up.addr,
        &format!("cors: {{ origins: ['{PAGE}'] }}\n"),
        "  - { name: internal, match: { path_prefix: /internal/ }, upstream: up, cors: none }
  - { name: api, upstream: up }
",
    );
    let tg = Tollgate::start(&yaml).await;
    let (_, h, _) = send(tg.addr, Method::GET, "/x", &[("origin", PAGE)]).await;
    assert_eq!(all(&h, "access-control-allow-origin"), PAGE);
    let (_, h, _) = send(tg.addr, Method::GET, "/internal/x", &[("origin", PAGE)]).await;
    // `cors: none`: the upstream's own fields pass as they are.
    assert_eq!(all(&h, "access-control-allow-origin"), "https://upstream.example");
    assert!(!h.contains_key("vary"));
}

#[tokio::test]
async fn the_opaque_origin_null_is_allowed_only_by_name() {
    let (up, _) = upstream().await;
    let yaml = config(
        up.addr,
        "",
        "  - { name: patterns, match: { path_prefix: /p/ }, upstream: up, cors: { origins: ['*.example.com', { regex: '.*' }] } }
  - { name: named, upstream: up, cors: { origins: ['null'] } }
",
    );
    let tg = Tollgate::start(&yaml).await;
    let (_, h, _) = send(tg.addr, Method::GET, "/p/x", &[("origin", "null")]).await;
    assert!(!h.contains_key("access-control-allow-origin"), "no pattern allows `null`");
    let (_, h, _) = send(tg.addr, Method::GET, "/p/x", &[("origin", "https://anything.test")]).await;
    assert_eq!(all(&h, "access-control-allow-origin"), "https://anything.test");
    let (_, h, _) = send(tg.addr, Method::GET, "/x", &[("origin", "null")]).await;
    assert_eq!(all(&h, "access-control-allow-origin"), "null");
}

#[test]
fn explain_says_who_may_call_and_read() {
    let yaml = "upstreams: { up: { url: 'http://127.0.0.1:9' } }
routes:
  - name: api
    upstream: up
    cors: { origins: ['https://app.example.com', '*.example.org'], methods: [PUT], headers: [x-custom], credentials: true }
";
    let text = tollgate::explain::explain(&Config::from_yaml(Path::new("t.yaml"), yaml).unwrap());
    assert!(
        text.contains(
            "cors: pages of https://app.example.com, http(s)://*.example.org may call it with GET, HEAD, POST, PUT, \
             sending x-custom, and read retry-after, ratelimit, ratelimit-policy, x-request-id, with credentials \
             (cookies, HTTP authentication); a preflight is answered here (kept 600s by the browser), not counted \
             by the route's limits; other origins get no CORS fields"
        ),
        "{text}"
    );
}

/// The page: on load, it calls the API on tollgate's origin in every way the browser test
/// names, and leaves what it could read in `window.results`.
const PAGE_HTML: &str = r#"<!doctype html><meta charset="utf-8"><title>cors</title><script>
const api = new URL(location.href).searchParams.get('api');
async function run() {
  const out = {};
  const read = async (name, url, init) => {
    try {
      const r = await fetch(api + url, init);
      out[name] = { status: r.status, body: await r.text(), retryAfter: r.headers.get('retry-after'),
        requestId: r.headers.get('x-request-id'), rateLimit: r.headers.get('ratelimit') };
    } catch (e) {
      out[name] = { blocked: String(e) };
    }
  };
  await read('simple', '/api/simple');
  await read('preflighted', '/api/items/1', { method: 'PUT', headers: { 'x-custom': 'yes' }, body: 'x' });
  await read('login', '/api/login', { credentials: 'include' });
  await read('credentialed', '/api/me', { credentials: 'include' });
  await read('first', '/limited/a');
  await read('throttled', '/limited/a');
  await read('unauthenticated', '/keyed/a');
  await read('refused', '/other/a');
  window.results = out;
}
run();
</script>"#;

/// The page's origin and tollgate's are two ports of 127.0.0.1: two origins to a browser.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_on_another_origin_reads_what_tollgate_lets_it_read() {
    let Some((driver, chromium)) = driver().await else { return };
    let site = Upstream::start(|_req| async move {
        let mut resp = Response::new(full(PAGE_HTML));
        resp.headers_mut().insert("content-type", "text/html; charset=utf-8".parse().unwrap());
        resp
    })
    .await;
    let page_origin = format!("http://127.0.0.1:{}", site.addr.port());
    let (up, seen) = upstream().await;
    let keys = folder().join("browser-keys.txt");
    std::fs::write(&keys, format!("{} acme\n", tollgate::config::auth::hash_key(b"sk-acme"))).unwrap();
    let cors = format!("{{ origins: ['{page_origin}'], methods: [PUT], headers: [x-custom], credentials: true }}");
    let yaml = config(
        up.addr,
        "",
        &format!(
            "  - name: api
    match: {{ path_prefix: /api/ }}
    upstream: up
    cors: {cors}
  - name: limited
    match: {{ path_prefix: /limited/ }}
    upstream: up
    cors: {cors}
    limits:
      - {{ name: hourly, algorithm: token_bucket, rate: 1/h, burst: 1, key: route }}
  - name: keyed
    match: {{ path_prefix: /keyed/ }}
    upstream: up
    cors: {cors}
    auth: {{ api_key: {{ from: 'header:x-api-key', keys: '{}' }} }}
  - name: other
    match: {{ path_prefix: /other/ }}
    upstream: up
    cors: {{ origins: ['https://somewhere-else.example'] }}
",
            keys.display()
        ),
    );
    let tg = Tollgate::start(&yaml).await;
    let api = format!("http://127.0.0.1:{}", tg.addr.port());

    let session = session(driver.addr, &chromium).await;
    let url = format!("{page_origin}/?api={api}");
    webdriver(driver.addr, Method::POST, &format!("/session/{session}/url"), Some(json!({ "url": url }))).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let results = loop {
        let script = json!({ "script": "return window.results || null;", "args": [] });
        let v = webdriver(driver.addr, Method::POST, &format!("/session/{session}/execute/sync"), Some(script)).await;
        if !v.is_null() {
            break v;
        }
        assert!(Instant::now() < deadline, "the page never finished its calls");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    webdriver(driver.addr, Method::DELETE, &format!("/session/{session}"), None).await;

    // A simple GET: read, with the request id the page may quote.
    assert_eq!(results["simple"]["status"], 200, "{results}");
    assert!(results["simple"]["body"].as_str().unwrap().starts_with("ok"), "{results}");
    assert_eq!(results["simple"]["requestId"].as_str().map(str::len), Some(32), "{results}");
    // A PUT with a custom field: preflighted, answered by tollgate, then sent.
    assert_eq!(results["preflighted"]["status"], 200, "{results}");
    // Credentialed: the cookie the first answer set goes with the second.
    assert_eq!(results["login"]["status"], 200, "{results}");
    assert_eq!(results["credentialed"]["body"], "ok session=s1", "{results}");
    // The 429: the page reads its Retry-After (a browser hides it unless exposed).
    assert_eq!(results["first"]["status"], 200, "{results}");
    assert_eq!(results["throttled"]["status"], 429, "{results}");
    let wait: u64 = results["throttled"]["retryAfter"].as_str().unwrap().parse().unwrap();
    assert!(wait >= 1, "{results}");
    assert!(results["throttled"]["rateLimit"].as_str().unwrap().contains("hourly"), "{results}");
    // tollgate's 401, readable too.
    assert_eq!(results["unauthenticated"]["status"], 401, "{results}");
    // An origin the route does not allow: the browser keeps the answer from the page.
    assert!(results["refused"]["blocked"].as_str().unwrap().contains("TypeError"), "{results}");

    let methods = seen.lock().unwrap().clone();
    assert!(!methods.iter().any(|m| m == "OPTIONS"), "a preflight was forwarded: {methods:?}");
    assert!(methods.iter().any(|m| m == "PUT"), "{methods:?}");
}
