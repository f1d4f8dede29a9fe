//! `auth.failures` (issue 49): a limit on failed credentials per client, read before each
//! verification and charged after each failure, over real sockets (clients on their own
//! loopback addresses), with the local store on a manual clock and with a real redis-server
//! shared by two tollgates.

use std::net::{IpAddr, SocketAddr};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tollgate::limit::{ManualClock, Span, Timestamp};

use crate::support::jwt::{self, Signer};
use crate::support::redis::RedisNode;
use crate::support::{full, Tollgate, Upstream};

const T0: Timestamp = Timestamp::from_micros(1_900_000_000_000_000);

/// GET `path` from a connection whose client end is bound to `from` (any 127.0.0.0/8 address
/// is this machine's), with `headers`.
async fn get_from(from: &str, addr: SocketAddr, headers: &[(&str, &str)]) -> (StatusCode, http::HeaderMap, Bytes) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from.parse::<IpAddr>().unwrap(), 0)).unwrap();
    let stream = socket.connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::get("/items").header("host", "localhost");
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let resp = send.send_request(req.body(full("")).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    (parts.status, parts.headers, body.collect().await.unwrap().to_bytes())
}

async fn key_from(from: &str, addr: SocketAddr, key: &str) -> (StatusCode, http::HeaderMap, Bytes) {
    get_from(from, addr, &[("x-api-key", key)]).await
}

/// A keys file of its own (tests run at once) with one key, `sk-good`.
fn keys_file() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("tollgate-authfail-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("keys.txt");
    std::fs::write(&path, format!("{} acme\n", tollgate::config::auth::hash_key(b"sk-good"))).unwrap();
    path.display().to_string()
}

async fn ok_upstream() -> Upstream {
    Upstream::start(|_req| async move { http::Response::new(full("ok")) }).await
}

/// Route `api` with API keys from a file and `failures` (its fields), before `extra` lines.
fn api_yaml(up: SocketAddr, failures: &str, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:0
{extra}upstreams:
  up: {{ url: 'http://{up}' }}
routes:
  - name: api
    upstream: up
    auth:
      api_key: {{ keys: '{}' }}
      failures: {{ {failures} }}
",
        keys_file()
    )
}

fn metric(text: &str, needle: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(needle))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[tokio::test(flavor = "current_thread")]
async fn a_hundred_guesses_from_one_address_are_refused_after_five_before_any_lookup() {
    let (logs, _guard) = crate::operate::Captured::json_logs();
    let up = ok_upstream().await;
    let clock = ManualClock::new(T0);
    let yaml = api_yaml(up.addr, "algorithm: token_bucket, rate: 5/m, burst: 5", "log: { access: true }\n");
    let tg = Tollgate::start_with_clock(&yaml, clock.clone()).await;
    let mut statuses = Vec::new();
    for i in 0..100 {
        let (status, h, body) = key_from("127.0.0.1", tg.addr, &format!("sk-guess-{i}")).await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            // One token a 12 s: the sixth failure is admitted 12 s after the fifth.
            assert_eq!(h["retry-after"], "12");
            assert_eq!(h["ratelimit-policy"], r#""auth-failures";q=5;w=60"#);
            assert_eq!(h["ratelimit"], r#""auth-failures";r=0;t=12"#);
            let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(doc["violated-policies"], serde_json::json!(["auth-failures"]), "{doc}");
        }
        statuses.push(status.as_u16());
    }
    assert_eq!(statuses[..5], [401; 5]);
    assert_eq!(statuses[5..], [429; 95]);
    // Only the first five keys were looked up; the other 95 were refused before.
    let text = tg.shared.load().metrics().encode(None);
    let looked_up = r#"tollgate_auth_total{route="api",result="refused",reason="unknown_api_key"}"#;
    assert_eq!(metric(&text, looked_up), 5, "{text}");
    let throttled = r#"tollgate_limiter_decisions_total{route="api",limit="auth-failures",result="throttled"}"#;
    assert_eq!(metric(&text, throttled), 95, "{text}");
    let counted = r#"tollgate_limiter_decisions_total{route="api",limit="auth-failures",result="allowed"}"#;
    assert_eq!(metric(&text, counted), 5, "{text}");
    // The log line of a refused guess names the limit.
    let (lines, text) = logs.access_lines();
    let last = &lines.last().unwrap()["fields"];
    assert_eq!((last["status"].as_u64(), last["limit"].as_str()), (Some(429), Some("auth-failures")), "{text}");
    assert_eq!(last["retry_after"].as_u64(), Some(12), "{text}");

    // A good key from another address is not affected; from the guessing one, it waits too.
    assert_eq!(key_from("127.0.0.2", tg.addr, "sk-good").await.0, StatusCode::OK);
    assert_eq!(key_from("127.0.0.1", tg.addr, "sk-good").await.0, StatusCode::TOO_MANY_REQUESTS);

    // Honest: one second before the wait it named, still refused; at it, verified again.
    clock.set(T0 + Span::from_secs(11));
    let (status, h, _) = key_from("127.0.0.1", tg.addr, "sk-guess-x").await;
    assert_eq!((status, h["retry-after"].to_str().unwrap()), (StatusCode::TOO_MANY_REQUESTS, "1"));
    clock.set(T0 + Span::from_secs(12));
    assert_eq!(key_from("127.0.0.1", tg.addr, "sk-guess-y").await.0, StatusCode::UNAUTHORIZED);
    let (status, h, _) = key_from("127.0.0.1", tg.addr, "sk-guess-z").await;
    assert_eq!((status, h["retry-after"].to_str().unwrap()), (StatusCode::TOO_MANY_REQUESTS, "12"));

    // A client that stops failing has its budget back once the period passes, and its
    // successes are never counted: 20 good requests, then five failures again before a 429.
    clock.set(T0 + Span::from_secs(12 + 60));
    for _ in 0..20 {
        assert_eq!(key_from("127.0.0.1", tg.addr, "sk-good").await.0, StatusCode::OK);
    }
    for i in 0..5 {
        assert_eq!(key_from("127.0.0.1", tg.addr, &format!("sk-again-{i}")).await.0, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(key_from("127.0.0.1", tg.addr, "sk-again-5").await.0, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn a_missing_credential_is_no_failure_and_a_bad_token_is_one() {
    let ec = Signer::ec("e1");
    let dir = std::env::temp_dir().join(format!("tollgate-authfail-jwt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let jwks = dir.join("jwks.json");
    std::fs::write(&jwks, jwt::jwks(&[&ec])).unwrap();
    let up = ok_upstream().await;
    let yaml = format!(
        "listen: 127.0.0.1:0
upstreams:
  up: {{ url: 'http://{}' }}
routes:
  - name: api
    upstream: up
    auth:
      jwt: {{ jwks: '{}', issuers: ['https://id.example.com/'], audiences: [api] }}
      failures: {{ algorithm: fixed_window, rate: 2/h }}
",
        up.addr,
        jwks.display()
    );
    let tg = Tollgate::start_with_clock(&yaml, ManualClock::new(T0)).await;
    let c = |exp: u64| serde_json::json!({"sub": "alice", "iss": "https://id.example.com/", "aud": "api", "exp": exp});
    let now = T0.as_micros() / 1_000_000;
    let good = format!("Bearer {}", ec.sign(&c(now + 300)));
    let mut bad = ec.sign(&c(now + 300));
    bad.truncate(bad.len() - 4);
    bad.push_str("AAAA");
    let bad = format!("Bearer {bad}");
    for _ in 0..5 {
        assert_eq!(get_from("127.0.0.3", tg.addr, &[]).await.0, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(get_from("127.0.0.3", tg.addr, &[("authorization", &good)]).await.0, StatusCode::OK);
    for _ in 0..2 {
        assert_eq!(get_from("127.0.0.3", tg.addr, &[("authorization", &bad)]).await.0, StatusCode::UNAUTHORIZED);
    }
    let (status, h, _) = get_from("127.0.0.3", tg.addr, &[("authorization", &good)]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // The rest of the hour: the window started at T0's hour.
    let left = 3_600 - (now % 3_600);
    assert_eq!(h["retry-after"].to_str().unwrap(), left.to_string());
    let text = tg.shared.load().metrics().encode(None);
    let bad_signature = r#"tollgate_auth_total{route="api",result="refused",reason="bad_signature"}"#;
    assert_eq!(metric(&text, bad_signature), 2, "{text}");
}

#[tokio::test]
async fn two_instances_share_the_failures_of_a_client_through_redis() {
    let redis = RedisNode::start();
    let up = ok_upstream().await;
    let yaml = api_yaml(
        up.addr,
        "algorithm: token_bucket, rate: 3/h, burst: 3, store: redis",
        // Time enough for a loaded machine: a call that timed out would not count.
        &format!("redis: {{ url: '{}', timeout: 2s, on_error: deny }}\n", redis.url()),
    );
    let a = Tollgate::start(&yaml).await;
    let b = Tollgate::start(&yaml).await;
    assert_eq!(key_from("127.0.0.4", a.addr, "sk-1").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(key_from("127.0.0.4", b.addr, "sk-2").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(key_from("127.0.0.4", a.addr, "sk-3").await.0, StatusCode::UNAUTHORIZED);
    // Three failures over two instances: both refuse the fourth guess before looking it up.
    for tg in [&a, &b, &a, &b] {
        let (status, h, _) = key_from("127.0.0.4", tg.addr, "sk-4").await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        let secs: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
        // One failure a 20 minutes: the next is admitted within that.
        assert!((1..=1_200).contains(&secs), "{secs}");
    }
    for tg in [&a, &b] {
        let text = tg.shared.load().metrics().encode(None);
        let looked_up = r#"tollgate_auth_total{route="api",result="refused",reason="unknown_api_key"}"#;
        let n = metric(&text, looked_up);
        assert!(n == 1 || n == 2, "{n}: {text}");
    }
    // Another address, with a good key, on either instance: through.
    assert_eq!(key_from("127.0.0.5", b.addr, "sk-good").await.0, StatusCode::OK);
    assert_eq!(key_from("127.0.0.5", a.addr, "sk-good").await.0, StatusCode::OK);
    // The count is in Redis, under the route's failure limit.
    assert!(redis.tollgate_keys().iter().any(|(k, _)| k.contains("api/auth-failures")), "{:?}", redis.tollgate_keys());
}

#[test]
fn a_failure_limit_keyed_on_the_identity_or_the_credential_is_refused_at_load() {
    let up: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let load = |failures: &str| {
        let yaml = api_yaml(up, failures, "");
        match tollgate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    };
    let e = load("algorithm: fixed_window, rate: 5/m, key: consumer");
    assert!(e.contains("routes[0].auth.failures.key") && e.contains("known only once a credential is verified"), "{e}");
    let e = load("algorithm: fixed_window, rate: 5/m, key: [client_ip, 'claim:org']");
    assert!(e.contains("routes[0].auth.failures.key"), "{e}");
    let e = load("algorithm: fixed_window, rate: 5/m, key: 'header:x-api-key'");
    assert!(e.contains("reads the credential itself"), "{e}");
    let e = load("algorithm: fixed_window, rate: 5/m, cost: { estimate: 1, response_header: x-cost }");
    assert!(e.contains("routes[0].auth.failures.cost"), "{e}");
    let e = load("algorithm: fixed_window, rate: 5/m, store: redis");
    assert!(e.contains("routes[0].auth.failures.store") && e.contains("redis:"), "{e}");
    let e = load("algorithm: fixed_window, rate: 5/m, key: tls_client");
    assert!(e.contains("routes[0].auth.failures.key") && e.contains("client_ca"), "{e}");
    let e = load("algorithm: fixed_window, rate: 5/m, lease: 10");
    assert!(e.contains("routes[0].auth.failures.lease"), "{e}");
    assert_eq!(load("algorithm: fixed_window, rate: 5/m, key: [client_ip, 'header:user-agent']"), "");
}

#[test]
fn explain_says_where_failures_are_counted() {
    let yaml = api_yaml("127.0.0.1:9".parse().unwrap(), "algorithm: token_bucket, rate: 5/m, burst: 5", "");
    let config = tollgate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
    let text = tollgate::explain::explain(&config);
    let want = "; failed credentials limited by `auth-failures` (token_bucket, 5 per 60s by client_ip, in this \
                instance): a client over it gets 429 before its credential is read, and its successes are not counted";
    assert!(text.contains(want), "{text}");
}
