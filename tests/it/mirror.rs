//! Request mirroring (`routes[].mirror`): copies of a route's requests sent to another
//! upstream, fire-and-forget — real hyper upstreams (a slow one, a dead one, one that holds
//! its answers), real clients over loopback sockets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::{full, BoxBody, Tollgate, Upstream};

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, BoxBody>;

fn client() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// What an upstream received.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    target: String,
    headers: HeaderMap,
    body: Bytes,
    /// When it answered (after its delay).
    answered: Instant,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// An upstream that reads each request whole, waits `delay`, keeps what it got and answers
/// `status` with `body` (a mirror's `/status/NNN` answers NNN).
/// tollgate with upstreams `primary` and `shadow` (the mirror) and the given `routes:` entries.
async fn with_mirror(primary: &Upstream, mirror: &Upstream, routes: &str) -> Tollgate {
    let yaml = format!(
        "upstreams:\n  primary: {{ url: \"http://{}\" }}\n  shadow: {{ url: \"http://{}\" }}\nroutes:\n{routes}",
        primary.addr, mirror.addr
    );
    Tollgate::start(&yaml).await
}

async fn recording(status: u16, body: &'static str, delay: Duration) -> (Upstream, Log) {
    let log: Log = Arc::default();
    let kept = log.clone();
    let up = Upstream::start(move |req| {
        let kept = kept.clone();
        async move {
            let (parts, b) = req.into_parts();
            let data = b.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let asked = parts.uri.path().strip_prefix("/status/").and_then(|s| s.parse().ok());
            let status = asked.filter(|_| body == "mirror").unwrap_or(status);
            kept.lock().unwrap().push(Seen {
                method: parts.method,
                target: parts.uri.to_string(),
                headers: parts.headers,
                body: data,
                answered: Instant::now(),
            });
            let mut resp = Response::new(full(body));
            *resp.status_mut() = StatusCode::from_u16(status).unwrap();
            resp
        }
    })
    .await;
    (up, log)
}

fn metric(tg: &Tollgate, line_start: &str) -> f64 {
    let text = tg.shared.load().metrics().encode(None);
    text.lines().find(|l| l.starts_with(line_start)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(0.0)
}

fn mirrored(tg: &Tollgate, route: &str, result: &str) -> usize {
    metric(tg, &format!("tollgate_mirror_requests_total{{route=\"{route}\",result=\"{result}\"}}")) as usize
}

fn answered(tg: &Tollgate, route: &str, class: &str) -> usize {
    metric(tg, &format!("tollgate_mirror_responses_total{{route=\"{route}\",class=\"{class}\"}}")) as usize
}

/// Waits (at most a minute: the machine is loaded) until `done` holds.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn send(c: &Http, req: Request<BoxBody>) -> (StatusCode, Bytes) {
    let resp = c.request(req).await.expect("tollgate answers");
    let status = resp.status();
    (status, resp.into_body().collect().await.expect("the whole answer").to_bytes())
}

fn get(url: &str, n: usize) -> Request<BoxBody> {
    Request::get(url).header("x-n", n.to_string()).body(full("")).unwrap()
}

/// A body sent in `chunks` pieces with a pause between them, without a `Content-Length`.
fn streamed(chunks: usize, each: usize) -> BoxBody {
    let frames = futures_util::StreamExt::then(futures_util::stream::iter(0..chunks), move |i| async move {
        tokio::time::sleep(Duration::from_millis(2)).await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(hyper::body::Frame::data(Bytes::from(vec![
            b'a' + (i % 26)
                as u8;
            each
        ])))
    });
    BodyExt::boxed(http_body_util::StreamBody::new(frames))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mirror_gets_the_same_method_path_fields_and_body_with_the_marker() {
    let (primary, primary_log) = recording(200, "primary", Duration::ZERO).await;
    let (mirror, mirror_log) = recording(200, "mirror", Duration::ZERO).await;
    let tg = with_mirror(
        &primary,
        &mirror,
        "  - name: api
    match: { path_prefix: /api }
    strip_prefix: true
    upstream: primary
    request_headers: { set: { x-from: edge } }
    mirror: { upstream: shadow, max_body: 100KiB }
",
    )
    .await;
    let c = client();

    // A POST whose body comes in 40 pieces of 2 KiB, without a length (chunked).
    let req = Request::post(tg.url("/api/v1/items?q=1"))
        .header("x-test", "yes")
        .header("content-type", "application/json")
        .body(streamed(40, 2048))
        .unwrap();
    let (status, body) = send(&c, req).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"primary"[..]), "the client gets the primary's answer");
    // A GET without a body, and a PUT with a fixed body.
    assert_eq!(send(&c, get(&tg.url("/api/v1/items/7"), 1)).await.0, StatusCode::OK);
    let req = Request::put(tg.url("/api/v1/items/7")).body(full("{\"a\":1}")).unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::OK);

    until("three copies answered", || mirror_log.lock().unwrap().len() == 3).await;
    let primary = primary_log.lock().unwrap().clone();
    let mut copies = mirror_log.lock().unwrap().clone();
    copies.sort_by_key(|s| s.method.to_string());
    let mut originals = primary.clone();
    originals.sort_by_key(|s| s.method.to_string());
    for (original, copy) in originals.iter().zip(&copies) {
        assert_eq!(copy.method, original.method);
        assert_eq!(copy.target, original.target, "the path after strip_prefix, and the query");
        assert_eq!(copy.body, original.body, "{} body", copy.method);
        assert_eq!(copy.headers.get("x-tollgate-mirror").unwrap(), "1", "the marker");
        assert!(!original.headers.contains_key("x-tollgate-mirror"), "the primary gets no marker");
        for (name, value) in &original.headers {
            // Framing may differ (a chunked body is copied with its length); the `Host` is
            // each upstream's own, as for any forwarded request.
            if [http::header::HOST, http::header::CONTENT_LENGTH, http::header::TRANSFER_ENCODING].contains(name) {
                continue;
            }
            let theirs: Vec<_> = copy.headers.get_all(name).iter().collect();
            let ours: Vec<_> = original.headers.get_all(name).iter().collect();
            assert_eq!(theirs, ours, "{} {name}: {value:?}", copy.method);
        }
    }
    let post = copies.iter().find(|s| s.method == Method::POST).unwrap();
    assert_eq!(post.target, "/v1/items?q=1");
    assert_eq!(post.body.len(), 40 * 2048);
    assert_eq!(post.headers.get("x-test").unwrap(), "yes");
    assert_eq!(post.headers.get("x-from").unwrap(), "edge", "the route's request_headers rules");
    assert_eq!(mirrored(&tg, "api", "sent"), 3);
    assert_eq!(answered(&tg, "api", "2xx"), 3);
    until("no copy in flight", || metric(&tg, "tollgate_mirror_in_flight{route=\"api\"}") == 0.0).await;
}

/// An HTTP/2 client's body (no `Content-Length`, in DATA frames) is copied as an HTTP/1.1
/// one's is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_clients_body_is_copied_too() {
    let (primary, primary_log) = recording(200, "primary", Duration::ZERO).await;
    let (mirror, mirror_log) = recording(200, "mirror", Duration::ZERO).await;
    let tg = with_mirror(
        &primary,
        &mirror,
        "  - { name: api, upstream: primary, mirror: { upstream: shadow } }
",
    )
    .await;
    let mut h2 = crate::support::h2(tg.addr).await;
    let req = Request::post(format!("http://{}/h2?x=1", tg.addr)).body(streamed(10, 1000)).unwrap();
    let resp = h2.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "primary");
    until("the copy answered", || mirror_log.lock().unwrap().len() == 1).await;
    let (original, copy) = (primary_log.lock().unwrap()[0].clone(), mirror_log.lock().unwrap()[0].clone());
    assert_eq!((copy.method.as_str(), copy.target.as_str()), ("POST", "/h2?x=1"));
    assert_eq!(copy.body.len(), 10 * 1000);
    assert_eq!(copy.body, original.body);
    assert_eq!(copy.headers["content-length"], "10000", "a copy's body leaves whole, with its length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_max_body_streams_whole_to_the_primary_and_its_copy_is_dropped() {
    let (primary, primary_log) = recording(200, "primary", Duration::ZERO).await;
    let (mirror, mirror_log) = recording(200, "mirror", Duration::ZERO).await;
    let tg = with_mirror(
        &primary,
        &mirror,
        "  - { name: api, upstream: primary, mirror: { upstream: shadow, max_body: 10KiB } }
",
    )
    .await;
    let c = client();
    // Known too large from its Content-Length: never kept.
    let req = Request::post(tg.url("/known")).body(full(vec![b'k'; 20 * 1024])).unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::OK);
    // Found too large as it streams (no length): kept until it passes the bound, then let go.
    let req = Request::post(tg.url("/streamed")).body(streamed(20, 1024)).unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::OK);
    // One that fits.
    let req = Request::post(tg.url("/fits")).body(streamed(5, 1024)).unwrap();
    assert_eq!(send(&c, req).await.0, StatusCode::OK);

    let bodies: Vec<usize> = primary_log.lock().unwrap().iter().map(|s| s.body.len()).collect();
    assert_eq!(bodies, [20 * 1024, 20 * 1024, 5 * 1024], "the primary gets every body whole");
    until("the fitting copy answered", || mirror_log.lock().unwrap().len() == 1).await;
    assert_eq!(mirrored(&tg, "api", "body_too_large"), 2);
    assert_eq!(mirrored(&tg, "api", "sent"), 1);
    let copy = mirror_log.lock().unwrap()[0].clone();
    assert_eq!((copy.target.as_str(), copy.body.len()), ("/fits", 5 * 1024));
}

/// Client-side latencies, sorted.
fn p99(mut took: Vec<Duration>) -> Duration {
    took.sort();
    took[(took.len() * 99 / 100).min(took.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_or_dead_mirror_changes_nothing_for_the_client() {
    let (primary, _) = recording(200, "primary", Duration::ZERO).await;
    // Answers each copy 2 s after it arrived, with a status the client must never see.
    let (slow, slow_log) = recording(503, "slow mirror", Duration::from_secs(2)).await;
    // Nothing listens there: each copy's connection is refused.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let yaml = format!(
        "upstreams:
  primary: {{ url: \"http://{}\" }}
  slow: {{ url: \"http://{}\" }}
  dead: {{ url: \"http://{dead}\", connect_timeout: 1s }}
routes:
  - {{ name: plain, match: {{ path_prefix: /plain }}, upstream: primary }}
  - {{ name: slow, match: {{ path_prefix: /slow }}, upstream: primary, mirror: {{ upstream: slow, max_in_flight: 1000 }} }}
  - {{ name: dead, match: {{ path_prefix: /dead }}, upstream: primary, mirror: {{ upstream: dead, max_in_flight: 1000 }} }}
",
        primary.addr, slow.addr
    );
    let tg = Tollgate::start(&yaml).await;
    let c = client();
    const N: usize = 300;
    let mut took: HashMap<&str, Vec<Duration>> = HashMap::new();
    let mut done_at = Vec::with_capacity(N);
    // Interleaved, so the three routes share whatever the machine does meanwhile.
    for i in 0..N {
        for route in ["plain", "slow", "dead"] {
            let start = Instant::now();
            let (status, body) = send(&c, get(&tg.url(&format!("/{route}/{i}")), i)).await;
            took.entry(route).or_default().push(start.elapsed());
            assert_eq!((status, &body[..]), (StatusCode::OK, &b"primary"[..]), "{route} {i}");
            if route == "slow" {
                done_at.push(Instant::now());
            }
        }
    }
    let (plain, slow_p99, dead_p99) =
        (p99(took["plain"].clone()), p99(took["slow"].clone()), p99(took["dead"].clone()));
    eprintln!(
        "client p99 over {N} requests each: no mirror {plain:?}, slow mirror {slow_p99:?}, dead mirror {dead_p99:?}"
    );

    // Every copy reached the slow mirror; each client request had its whole answer before the
    // mirror answered its copy (which it did 2 s after the copy arrived): had the client waited
    // for the mirror, its request would have ended after the mirror's answer.
    until("every copy answered", || slow_log.lock().unwrap().len() == N).await;
    for copy in slow_log.lock().unwrap().iter() {
        let i: usize = copy.headers["x-n"].to_str().unwrap().parse().unwrap();
        assert!(done_at[i] < copy.answered, "request {i} ended after the slow mirror answered its copy");
    }
    until("every copy failed on the dead mirror", || answered(&tg, "dead", "failed") == N).await;
    assert_eq!(mirrored(&tg, "slow", "sent"), N);
    assert_eq!(answered(&tg, "slow", "5xx"), N);
    assert_eq!(mirrored(&tg, "dead", "sent"), N);
    // The client got 200 each time; the slow mirror's 503s are counted as differences.
    until("the differences counted", || metric(&tg, "tollgate_mirror_differences_total{route=\"slow\"}") as usize == N)
        .await;
    assert_eq!(metric(&tg, "tollgate_mirror_differences_total{route=\"dead\"}"), 0.0, "no answer, no difference");
    assert_eq!(metric(&tg, "tollgate_requests_total{route=\"dead\",class=\"2xx\"}") as usize, N);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_max_in_flight_a_copy_is_dropped_and_counted() {
    let (primary, _) = recording(200, "primary", Duration::ZERO).await;
    // A mirror that holds every answer until released.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let arrived = Arc::new(AtomicUsize::new(0));
    let (g, a) = (gate.clone(), arrived.clone());
    let mirror = Upstream::start(move |_req| {
        let (g, a) = (g.clone(), a.clone());
        async move {
            a.fetch_add(1, Ordering::SeqCst);
            g.acquire().await.unwrap().forget();
            Response::new(full("mirror"))
        }
    })
    .await;
    let tg = with_mirror(
        &primary,
        &mirror,
        "  - { name: api, upstream: primary, mirror: { upstream: shadow, max_in_flight: 4 } }
",
    )
    .await;
    let c = client();
    // 40 requests from 8 clients at once: 4 copies go out and wait; every other copy finds
    // 4 on their way and is dropped, and no client waits for any of them.
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (c, url) = (c.clone(), tg.url("/x"));
        tasks.push(tokio::spawn(async move {
            for i in 0..5 {
                let (status, body) = send(&c, get(&url, t * 5 + i)).await;
                assert_eq!((status, &body[..]), (StatusCode::OK, &b"primary"[..]));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(mirrored(&tg, "api", "sent") + mirrored(&tg, "api", "in_flight"), 40);
    assert_eq!(mirrored(&tg, "api", "sent"), 4);
    assert_eq!(mirrored(&tg, "api", "in_flight"), 36);
    assert_eq!(metric(&tg, "tollgate_mirror_in_flight{route=\"api\"}"), 4.0);
    until("the 4 copies arrived", || arrived.load(Ordering::SeqCst) == 4).await;
    gate.add_permits(4);
    until("the 4 copies answered", || answered(&tg, "api", "2xx") == 4).await;
    until("no copy in flight", || metric(&tg, "tollgate_mirror_in_flight{route=\"api\"}") == 0.0).await;
    // Room again: the next copy goes.
    gate.add_permits(1);
    assert_eq!(send(&c, get(&tg.url("/x"), 40)).await.0, StatusCode::OK);
    until("the next copy answered", || answered(&tg, "api", "2xx") == 5).await;
    assert_eq!(arrived.load(Ordering::SeqCst), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampled_share_is_copied_within_tolerance() {
    let (primary, _) = recording(200, "primary", Duration::ZERO).await;
    let (mirror, mirror_log) = recording(200, "mirror", Duration::ZERO).await;
    let tg = with_mirror(
        &primary,
        &mirror,
        "  - { name: api, upstream: primary, mirror: { upstream: shadow, sample: 25%, max_in_flight: 10000 } }
",
    )
    .await;
    let c = client();
    const N: usize = 2000;
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (c, url) = (c.clone(), tg.url("/x"));
        tasks.push(tokio::spawn(async move {
            for i in 0..N / 8 {
                assert_eq!(send(&c, get(&url, t * N / 8 + i)).await.0, StatusCode::OK);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let sent = mirrored(&tg, "api", "sent");
    // 25 % of 2,000 is 500, with a standard deviation of 19: ±3 % of the requests is ±60.
    assert!((440..=560).contains(&sent), "{sent} of {N} copied at 25 %");
    assert_eq!(mirrored(&tg, "api", "in_flight"), 0);
    until("every copy answered", || mirror_log.lock().unwrap().len() == sent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_differences_are_counted_and_compare_can_be_off() {
    let (primary, _) = recording(200, "primary", Duration::ZERO).await;
    let (mirror, mirror_log) = recording(200, "mirror", Duration::ZERO).await;
    let tg = with_mirror(&primary, &mirror, "  - { name: on, match: { path_prefix: /on }, strip_prefix: true, upstream: primary, mirror: { upstream: shadow } }
  - { name: off, match: { path_prefix: /off }, strip_prefix: true, upstream: primary, mirror: { upstream: shadow, compare: false, header: x-shadow } }
").await;
    let c = client();
    for i in 0..10 {
        // The mirror answers `/status/503` with 503, the primary with 200.
        for path in ["/on/same", "/on/status/503", "/off/status/503"] {
            assert_eq!(send(&c, get(&tg.url(path), i)).await.0, StatusCode::OK);
        }
    }
    until("every copy answered", || mirror_log.lock().unwrap().len() == 30).await;
    until("on: the differences", || metric(&tg, "tollgate_mirror_differences_total{route=\"on\"}") == 10.0).await;
    assert_eq!(answered(&tg, "on", "2xx"), 10);
    assert_eq!(answered(&tg, "on", "5xx"), 10);
    assert_eq!(metric(&tg, "tollgate_mirror_differences_total{route=\"off\"}"), 0.0);
    let marked =
        mirror_log.lock().unwrap().iter().filter(|s| s.headers.get("x-shadow").is_some_and(|v| v == "1")).count();
    assert_eq!(marked, 10, "the marker field is the route's own");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_split_a_request_sent_to_the_mirrors_side_is_not_copied() {
    let (stable, _) = recording(200, "stable", Duration::ZERO).await;
    let (next, next_log) = recording(200, "mirror", Duration::ZERO).await;
    let yaml = format!(
        "upstreams:
  stable: {{ url: \"http://{}\" }}
  next: {{ url: \"http://{}\" }}
routes:
  - name: api
    split:
      upstreams: [{{ name: stable, weight: 100 }}, {{ name: next, weight: 0 }}]
      override: {{ header: x-canary, values: {{ always: next }} }}
    mirror: {{ upstream: next }}
",
        stable.addr, next.addr
    );
    let tg = Tollgate::start(&yaml).await;
    let c = client();
    for i in 0..10 {
        assert_eq!(send(&c, get(&tg.url("/copied"), i)).await.1, "stable");
        let req = Request::get(tg.url("/tester")).header("x-canary", "always").body(full("")).unwrap();
        assert_eq!(send(&c, req).await.1, "mirror");
    }
    until("the copies answered", || answered(&tg, "api", "2xx") == 10).await;
    let log = next_log.lock().unwrap().clone();
    let copies = log.iter().filter(|s| s.headers.contains_key("x-tollgate-mirror")).count();
    let testers = log.iter().filter(|s| s.target == "/tester").count();
    assert_eq!((copies, testers, log.len()), (10, 10, 20), "testers' requests reach `next` once, uncopied");
    assert_eq!(mirrored(&tg, "api", "sent"), 10);
}

#[test]
fn a_mirror_is_an_http_upstream_other_than_the_routes_own() {
    let load = |mirror: &str| {
        let yaml = format!(
            "upstreams:
  a: {{ url: \"http://127.0.0.1:1\" }}
  b: {{ url: \"http://127.0.0.1:2\" }}
  canned: {{ respond: {{}} }}
routes:
  - {{ name: api, upstream: a, mirror: {mirror} }}
"
        );
        tollgate::config::Config::from_yaml(std::path::Path::new("m.yaml"), &yaml)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(load("{ upstream: b }"), Ok(()));
    for (mirror, field, says) in [
        ("{ upstream: nope }", "routes[0].mirror.upstream", "unknown upstream `nope`"),
        ("{ upstream: a }", "routes[0].mirror.upstream", "the route's own upstream"),
        ("{ upstream: canned }", "routes[0].mirror.upstream", "built-in responder"),
        ("{ upstream: b, sample: 2 }", "routes[0].mirror.sample", "not a share"),
        ("{ upstream: b, max_in_flight: 0 }", "routes[0].mirror.max_in_flight", "expected 1 to"),
        ("{ upstream: b, max_body: 1GiB }", "routes[0].mirror.max_body", "at most 16 MiB"),
        ("{ upstream: b, header: connection }", "routes[0].mirror.header", "hop-by-hop"),
        ("{ upstream: b, every: 1 }", "routes[0].mirror", "unknown field `every`"),
    ] {
        let e = load(mirror).unwrap_err();
        assert!(e.contains(field) && e.contains(says), "{mirror}: {e}");
    }
}

#[test]
fn explain_says_what_the_mirror_does() {
    let yaml = "upstreams:
  a: { url: \"http://127.0.0.1:1\" }
  b: { url: \"http://127.0.0.1:2\" }
routes:
  - { name: api, upstream: a, mirror: { upstream: b, sample: 10%, max_in_flight: 50 } }
";
    let config = tollgate::config::Config::from_yaml(std::path::Path::new("m.yaml"), yaml).unwrap();
    let text = tollgate::explain::explain(&config);
    let line = text.lines().find(|l| l.contains("mirror:")).unwrap_or_else(|| panic!("{text}"));
    for words in [
        "copies 10 % (drawn at random) of the requests",
        "`b`",
        "x-tollgate-mirror: 1",
        "at most 50 at once",
        "never waits",
    ] {
        assert!(line.contains(words), "no `{words}` in: {line}");
    }
}

/// With the access log on, each copy's answer is a line of its own (target `tollgate::mirror`)
/// that shares the request id of the client's line: the `tollgate` binary, its JSON log (on
/// stderr) read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_copy_is_logged_with_its_status_time_and_the_clients_request_id() {
    let (primary, _) = recording(200, "primary", Duration::ZERO).await;
    let (mirror, _) = recording(200, "mirror", Duration::ZERO).await;
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let (addr, dead) = (free(), free());
    let dir = crate::support::tls::Dir::new();
    let config = dir.path("mirror.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: {addr}
log: {{ access: true, format: json }}
upstreams:
  primary: {{ url: \"http://{}\" }}
  shadow: {{ url: \"http://{}\" }}
  dead: {{ url: \"http://{dead}\" }}
routes:
  - {{ name: live, match: {{ path_prefix: /live }}, upstream: primary, mirror: {{ upstream: shadow }} }}
  - {{ name: gone, match: {{ path_prefix: /gone }}, upstream: primary, mirror: {{ upstream: dead }} }}
",
            primary.addr, mirror.addr
        ),
    )
    .unwrap();
    let out = dir.path("out.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("-c")
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&out).unwrap())
        .spawn()
        .unwrap();
    let c = client();
    let url = |p: &str| format!("http://{addr}{p}");
    until("tollgate listens", || std::net::TcpStream::connect(addr).is_ok()).await;
    assert_eq!(send(&c, get(&url("/live/a?b=1"), 0)).await.0, StatusCode::OK);
    assert_eq!(send(&c, get(&url("/gone/c"), 1)).await.0, StatusCode::OK);
    let lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&out).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    };
    let of = |target: &str, route: &str| {
        lines()
            .into_iter()
            .find(|l| l["target"] == target && l["fields"]["route"] == route)
            .map(|l| l["fields"].clone())
    };
    until("both copies logged", || {
        of("tollgate::mirror", "live").is_some() && of("tollgate::mirror", "gone").is_some()
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let (live, access) = (of("tollgate::mirror", "live").unwrap(), of("tollgate::access", "live").unwrap());
    assert_eq!((live["upstream"].as_str(), live["method"].as_str()), (Some("shadow"), Some("GET")), "{live}");
    assert_eq!(live["path"], "/live/a");
    assert_eq!(live["status"], 200);
    assert!(live["duration_ms"].as_f64().is_some(), "{live}");
    assert_eq!(live["request_id"], access["request_id"], "the copy's line names the client's request");
    assert_eq!(access["steps"], "mirror=copied");
    let gone = of("tollgate::mirror", "gone").unwrap();
    assert_eq!((gone["status"].is_null(), gone["error"].as_str()), (true, Some("upstream_connect")), "{gone}");
    // `client_status` is there when the client's answer was known first: not asserted (a
    // refused connection may fail before the primary answers).
}
