//! Weighted splits (`routes[].split`): a share of a route's traffic to another upstream,
//! sticky by a key, chosen by testers with a header, changed by a reload under load — real
//! hyper upstreams and clients.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::{full, BoxBody, Tollgate, Upstream};

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, BoxBody>;

fn client() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A server answering `id`; `/slow` after 30 ms (so that requests are in flight).
async fn version(id: &'static str) -> Upstream {
    Upstream::start(move |req| async move {
        if req.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        Response::new(full(id))
    })
    .await
}

async fn send(c: &Http, url: &str, headers: &[(&str, &str)]) -> (StatusCode, String) {
    let mut req = Request::builder().uri(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let resp = c.request(req.body(full("")).unwrap()).await.expect("tollgate answers");
    let status = resp.status();
    let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn yaml(v1: &Upstream, v2: &Upstream, split: &str) -> String {
    format!(
        "upstreams:
  v1: {{ url: \"http://{}\" }}
  v2: {{ url: \"http://{}\" }}
routes:
  - name: api
    split:
{split}",
        v1.addr, v2.addr
    )
}

fn weights(a: u32, b: u32) -> String {
    format!("      upstreams: [{{ name: v1, weight: {a} }}, {{ name: v2, weight: {b} }}]\n")
}

fn metric(tg: &Tollgate, line_start: &str) -> f64 {
    let text = tg.shared.load().metrics().encode(None);
    text.lines().find(|l| l.starts_with(line_start)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(0.0)
}

/// Sends `n` requests (8 at a time) and counts the answers from `v2`.
async fn share_of_v2(c: &Http, url: &str, n: usize) -> usize {
    let v2 = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (c, url, v2) = (c.clone(), url.to_owned(), v2.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..n / 8 {
                let (s, body) = send(&c, &url, &[]).await;
                assert_eq!(s, StatusCode::OK, "{body}");
                if body == "v2" {
                    v2.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    v2.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_90_10_split_lands_within_three_percent_and_is_counted_per_side() {
    let (v1, v2) = (version("v1").await, version("v2").await);
    let tg = Tollgate::start(&yaml(&v1, &v2, &weights(90, 10))).await;
    let c = client();
    let canary = share_of_v2(&c, &tg.url("/x"), 2000).await;
    // 10 % of 2,000 is 200; ±3 % of the requests is ±60.
    assert!((140..=260).contains(&canary), "{canary} of 2000 went to the 10 % side");
    let by = |up: &str| {
        metric(&tg, &format!("tollgate_route_split_requests_total{{route=\"api\",upstream=\"{up}\",by=\"weight\"}}"))
    };
    assert_eq!((by("v1") as usize, by("v2") as usize), (2000 - canary, canary));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_key_stays_on_one_side_for_every_request() {
    let (v1, v2) = (version("v1").await, version("v2").await);
    let split = format!("{}      sticky: header:x-user\n", weights(50, 50));
    let tg = Tollgate::start(&yaml(&v1, &v2, &split)).await;
    let c = client();
    let url = tg.url("/x");
    let mut sides = std::collections::BTreeSet::new();
    for user in 0..20 {
        let user = format!("user-{user}");
        let (_, first) = send(&c, &url, &[("x-user", &user)]).await;
        for i in 1..100 {
            let (s, body) = send(&c, &url, &[("x-user", &user)]).await;
            assert_eq!(s, StatusCode::OK);
            assert_eq!(body, first, "{user} moved at request {i}");
        }
        sides.insert(first);
    }
    assert_eq!(sides.len(), 2, "20 keys at 50/50 use both sides: {sides:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_cookie_keeps_its_client_on_one_side() {
    let (v1, v2) = (version("v1").await, version("v2").await);
    let split = format!("{}      sticky: cookie:session\n", weights(50, 50));
    let tg = Tollgate::start(&yaml(&v1, &v2, &split)).await;
    let c = client();
    let url = tg.url("/x");
    let mut sides = std::collections::BTreeSet::new();
    for session in 0..20 {
        // Other cookies around it, in another order each time, change nothing.
        let cookie = |i: usize| {
            if i % 2 == 0 {
                format!("theme=dark; session=s{session}; n={i}")
            } else {
                format!("n={i}; session=s{session}")
            }
        };
        let (_, first) = send(&c, &url, &[("cookie", &cookie(0))]).await;
        for i in 1..100 {
            assert_eq!(send(&c, &url, &[("cookie", &cookie(i))]).await.1, first, "session {session} moved at {i}");
        }
        sides.insert(first);
    }
    assert_eq!(sides.len(), 2, "20 sessions at 50/50 use both sides: {sides:?}");
    let by = metric(&tg, "tollgate_route_split_requests_total{route=\"api\",upstream=\"v1\",by=\"sticky\"}")
        + metric(&tg, "tollgate_route_split_requests_total{route=\"api\",upstream=\"v2\",by=\"sticky\"}");
    assert_eq!(by, 2000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_override_header_sends_testers_to_their_side() {
    let (v1, v2) = (version("v1").await, version("v2").await);
    // The canary takes no share by weight: only testers reach it.
    let split =
        format!("{}      override: {{ header: x-canary, values: {{ always: v2, never: v1 }} }}\n", weights(100, 0));
    let tg = Tollgate::start(&yaml(&v1, &v2, &split)).await;
    let c = client();
    let url = tg.url("/x");
    for _ in 0..50 {
        assert_eq!(send(&c, &url, &[]).await.1, "v1");
        assert_eq!(send(&c, &url, &[("x-canary", "always")]).await.1, "v2");
        assert_eq!(send(&c, &url, &[("x-canary", "never")]).await.1, "v1");
        // A side's upstream name works too.
        assert_eq!(send(&c, &url, &[("x-canary", "v2")]).await.1, "v2");
    }
    let by = metric(&tg, "tollgate_route_split_requests_total{route=\"api\",upstream=\"v2\",by=\"override\"}");
    assert_eq!(by, 100.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_from_90_10_to_50_50_under_load_loses_nothing() {
    let (v1, v2) = (version("v1").await, version("v2").await);
    let tg = Tollgate::start(&yaml(&v1, &v2, &weights(90, 10))).await;
    let (stop, sent, failed) =
        (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut load = Vec::new();
    for _ in 0..8 {
        let (stop, sent, failed, url) = (stop.clone(), sent.clone(), failed.clone(), tg.url("/slow"));
        load.push(tokio::spawn(async move {
            let c = client();
            while !stop.load(Ordering::Relaxed) {
                let ok = matches!(c.get(url.parse().unwrap()).await, Ok(r) if r.status() == StatusCode::OK);
                sent.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    // Requests in flight (each takes 30 ms) when the new weights come in.
    while sent.load(Ordering::Relaxed) < 50 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let old = tg.shared.load_full();
    let text = yaml(&v1, &v2, &weights(50, 50));
    let config = tollgate::config::Config::from_yaml(std::path::Path::new("test.yaml"), &text).unwrap();
    tg.shared.store(Arc::new(tollgate::Proxy::build(config, old.clock().clone(), old.metrics().clone(), Some(&old))));
    drop(old);
    let at_reload = sent.load(Ordering::Relaxed);
    while sent.load(Ordering::Relaxed) < at_reload + 50 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    let (sent, failed) = (sent.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert_eq!(failed, 0, "{failed} of {sent} requests failed across the reload");
    let half = share_of_v2(&client(), &tg.url("/x"), 2000).await;
    assert!((940..=1060).contains(&half), "{half} of 2000 went to v2 after the reload to 50/50");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_consumer_stays_on_one_side_whichever_of_its_keys_it_sends() {
    let (v1, v2) = (version("v1").await, version("v2").await);
    let dir = std::env::temp_dir().join(format!("tollgate-split-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hash = |k: &str| tollgate::config::auth::hash_key(k.as_bytes());
    let mut file = String::new();
    for c in 0..20 {
        file.push_str(&format!("{} c{c}\n{} c{c}\n", hash(&format!("k{c}-a")), hash(&format!("k{c}-b"))));
    }
    let keys = dir.join("keys.txt");
    std::fs::write(&keys, file).unwrap();
    let text = format!(
        "upstreams:
  v1: {{ url: \"http://{}\" }}
  v2: {{ url: \"http://{}\" }}
routes:
  - name: api
    auth:
      api_key: {{ from: 'header:x-api-key', keys: '{}' }}
    split:
{}      sticky: consumer
",
        v1.addr,
        v2.addr,
        keys.display(),
        weights(50, 50)
    );
    let tg = Tollgate::start(&text).await;
    let c = client();
    let url = tg.url("/x");
    let mut sides = std::collections::BTreeSet::new();
    for consumer in 0..20 {
        let (s, first) = send(&c, &url, &[("x-api-key", &format!("k{consumer}-a"))]).await;
        assert_eq!(s, StatusCode::OK, "{first}");
        for i in 0..50 {
            // Either of the consumer's keys: the consumer, not the key, is sticky.
            let key = if i % 2 == 0 { format!("k{consumer}-b") } else { format!("k{consumer}-a") };
            assert_eq!(send(&c, &url, &[("x-api-key", &key)]).await.1, first, "consumer {consumer} moved at {i}");
        }
        sides.insert(first);
    }
    assert_eq!(sides.len(), 2, "20 consumers at 50/50 use both sides: {sides:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
