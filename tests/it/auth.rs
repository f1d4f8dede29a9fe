//! `auth:` (issue 37): JWTs verified against key sets made in the test (RSA, EC P-256,
//! Ed25519), a key set served by a real HTTP server that rotates and goes down, API keys from
//! a file and from a real redis-server, and limits keyed on the verified consumer.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::StatusCode;
use serde_json::{json, Value};

use crate::support::jwt::{self, Signer};
use crate::support::redis::RedisNode;
use crate::support::{full, get, get_with, Tollgate, Upstream};

/// A fresh folder under the temp dir for one test's files.
fn folder() -> PathBuf {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("tollgate-auth-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// An upstream that answers with the fields tollgate forwarded that the tests look at.
async fn echo() -> Upstream {
    Upstream::start(|req| async move {
        let h = |n: &str| req.headers().get(n).map_or("-".to_owned(), |v| v.to_str().unwrap().to_owned());
        let body = format!("consumer={} org={} authorization={}", h("x-consumer"), h("x-org"), h("authorization"));
        http::Response::new(full(body))
    })
    .await
}

fn claims(sub: &str) -> Value {
    json!({"sub": sub, "iss": "https://id.example.com/", "aud": "api", "exp": jwt::now() + 300, "org_id": "acme"})
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

async fn call(tg: &Tollgate, path: &str, token: &str) -> (StatusCode, http::HeaderMap, String) {
    let auth = bearer(token);
    let (s, h, b) = get_with(tg.addr, path, &[("authorization", auth.as_str())]).await;
    (s, h, String::from_utf8_lossy(&b).into_owned())
}

/// A config whose one route, `api`, goes to `upstream` with `auth` (the route's lines after
/// its `auth:`, indented as they stand in it: its fields, then the route's other fields).
fn api_route(upstream: std::net::SocketAddr, auth: &str) -> String {
    format!(
        "listen: 127.0.0.1:0
upstreams:
  up: {{ url: 'http://{upstream}' }}
routes:
  - name: api
    upstream: up
    auth:
{auth}"
    )
}

fn jwt_yaml(upstream: std::net::SocketAddr, jwks: &str, extra: &str) -> String {
    api_route(
        upstream,
        &format!(
            "      jwt:
        jwks: '{jwks}'
        issuers: ['https://id.example.com/']
        audiences: [api]
        leeway: 5s
      claims_to_headers: {{ consumer: x-consumer, org_id: x-org }}
      strip_credentials: true
{extra}"
        ),
    )
}

#[tokio::test]
async fn tokens_are_verified_with_every_key_type_and_refused_for_each_reason() {
    let (rsa, ec, ed) = (Signer::rsa("r1"), Signer::ec("e1"), Signer::ed25519("d1"));
    let dir = folder();
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&rsa, &ec, &ed]));
    let up = echo().await;
    let tg = Tollgate::start(&jwt_yaml(up.addr, &jwks, "")).await;

    for (signer, alg) in [(&rsa, "RS256"), (&rsa, "PS256"), (&ec, "ES256"), (&ed, "EdDSA")] {
        let (status, _, body) = call(&tg, "/", &signer.sign_as(alg, &claims("alice"))).await;
        assert_eq!(status, StatusCode::OK, "{alg}: {body}");
        // The verified claims go upstream; the token does not (strip_credentials).
        assert_eq!(body, "consumer=alice org=acme authorization=-", "{alg}");
    }

    let now = jwt::now();
    let with = |k: &str, v: Value| {
        let mut c = claims("alice");
        c[k] = v;
        ec.sign(&c)
    };
    let refused: Vec<(&str, String, StatusCode, &str)> = vec![
        ("expired", with("exp", json!(now - 60)), StatusCode::UNAUTHORIZED, "the token has expired"),
        ("not yet valid", with("nbf", json!(now + 600)), StatusCode::UNAUTHORIZED, "not valid yet"),
        ("wrong issuer", with("iss", json!("https://evil.example/")), StatusCode::UNAUTHORIZED, "issuer"),
        ("wrong audience", with("aud", json!("billing")), StatusCode::FORBIDDEN, "another audience"),
        ("bad signature", Signer::ec("e1").sign(&claims("alice")), StatusCode::UNAUTHORIZED, "signature"),
        ("alg none", jwt::unsigned(&claims("alice")), StatusCode::UNAUTHORIZED, "algorithm"),
        (
            // Algorithm confusion: HS256 keyed by the RSA key's public JWK.
            "HS256 with an RSA key",
            jwt::hs256_token(rsa.jwk().to_string().as_bytes(), "r1", &claims("alice")),
            StatusCode::UNAUTHORIZED,
            "algorithm",
        ),
        ("garbage", "not.a.token".to_owned(), StatusCode::UNAUTHORIZED, "well-formed"),
    ];
    for (what, token, status, says) in refused {
        let (got, headers, body) = call(&tg, "/", &token).await;
        assert_eq!(got, status, "{what}: {body}");
        assert_eq!(headers["content-type"], "application/problem+json", "{what}");
        let challenge = headers["www-authenticate"].to_str().unwrap();
        assert!(challenge.starts_with("Bearer realm=\"api\", error="), "{what}: {challenge}");
        assert!(challenge.contains(says), "{what}: {challenge}");
        assert!(body.contains(says), "{what}: {body}");
    }

    // No token: a challenge without an error code (RFC 6750 §3.1).
    let (status, headers, _) = get(tg.addr, "/").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(headers["www-authenticate"], "Bearer realm=\"api\"");
}

#[tokio::test]
async fn a_limit_keyed_on_the_consumer_cannot_be_escaped_by_changing_headers() {
    let ec = Signer::ec("e1");
    let dir = folder();
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&ec]));
    let up = echo().await;
    let limits = "    limits:\n      - { name: per-consumer, algorithm: fixed_window, rate: 3/h, key: consumer }\n";
    let tg = Tollgate::start(&jwt_yaml(up.addr, &jwks, limits)).await;
    let alice = bearer(&ec.sign(&claims("alice")));
    let mut admitted = 0;
    for i in 0..6 {
        // A fresh API key, a spoofed consumer field and a new token id each time: the same
        // verified subject.
        let key = format!("key-{i}");
        let mut c = claims("alice");
        c["jti"] = json!(i);
        let token = if i % 2 == 0 { alice.clone() } else { bearer(&ec.sign(&c)) };
        let headers = [
            ("authorization", token.as_str()),
            ("x-api-key", key.as_str()),
            ("x-consumer", "mallory"),
            ("x-forwarded-for", "198.51.100.7"),
        ];
        let (status, _, body) = get_with(tg.addr, "/", &headers).await;
        if status == StatusCode::OK {
            admitted += 1;
            // The client's own x-consumer never reaches the upstream.
            assert_eq!(String::from_utf8_lossy(&body), "consumer=alice org=acme authorization=-");
        } else {
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        }
    }
    assert_eq!(admitted, 3);
    // Another consumer has its own count.
    assert_eq!(call(&tg, "/", &ec.sign(&claims("bob"))).await.0, StatusCode::OK);
}

#[tokio::test]
async fn optional_routes_let_anonymous_requests_through_as_one_consumer() {
    let ec = Signer::ec("e1");
    let dir = folder();
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&ec]));
    let up = echo().await;
    let yaml = api_route(
        up.addr,
        &format!(
            "      jwt: {{ jwks: '{jwks}', audiences: [api] }}
      optional: true
      claims_to_headers: {{ consumer: x-consumer }}
    limits:
      - {{ name: per-consumer, algorithm: fixed_window, rate: 2/h, key: consumer }}
"
        ),
    );
    let tg = Tollgate::start(&yaml).await;
    let (status, _, body) = get_with(tg.addr, "/", &[("x-consumer", "admin")]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(String::from_utf8_lossy(&body), "consumer=anonymous org=- authorization=-");
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::OK);
    // Anonymous requests share one count, wherever they come from.
    assert_eq!(get_with(tg.addr, "/", &[("x-forwarded-for", "203.0.113.1")]).await.0, StatusCode::TOO_MANY_REQUESTS);
    // A bad token is still refused; a good one has its own count.
    let mut expired = claims("alice");
    expired["exp"] = json!(jwt::now() - 600);
    assert_eq!(call(&tg, "/", &ec.sign(&expired)).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(call(&tg, "/", &ec.sign(&claims("alice"))).await.0, StatusCode::OK);
}

/// A key set served over HTTP: its document can change, its readings are counted, and it
/// can fail (answer 503) like a server that is down.
struct KeyServer {
    doc: Arc<Mutex<String>>,
    hits: Arc<AtomicUsize>,
    down: Arc<AtomicBool>,
    /// How long each answer takes (ms).
    slow: Arc<AtomicU64>,
    /// The answers' `Cache-Control`.
    cache: Arc<Mutex<&'static str>>,
    server: Upstream,
}

impl KeyServer {
    async fn start(doc: String) -> KeyServer {
        let (doc, hits, down) =
            (Arc::new(Mutex::new(doc)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (slow, cache) = (Arc::new(AtomicU64::new(0)), Arc::new(Mutex::new("max-age=3600")));
        let (d, h, x, w, c) = (doc.clone(), hits.clone(), down.clone(), slow.clone(), cache.clone());
        let server = Upstream::start(move |_req| {
            let (d, h, x, w, c) = (d.clone(), h.clone(), x.clone(), w.clone(), c.clone());
            async move {
                h.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(w.load(Ordering::SeqCst))).await;
                if x.load(Ordering::SeqCst) {
                    let mut r = http::Response::new(full("down"));
                    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    return r;
                }
                let body = d.lock().unwrap().clone();
                let mut r = http::Response::new(full(body));
                let cache = *c.lock().unwrap();
                r.headers_mut().insert("cache-control", cache.parse().unwrap());
                r
            }
        })
        .await;
        KeyServer { doc, hits, down, slow, cache, server }
    }

    fn url(&self) -> String {
        format!("http://{}/.well-known/jwks.json", self.server.addr)
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

#[tokio::test]
async fn a_key_set_url_is_read_again_for_an_unknown_kid_at_most_once_an_interval_and_kept_when_down() {
    let (old, new) = (Signer::ec("old"), Signer::ed25519("new"));
    let keys = KeyServer::start(jwt::jwks(&[&old])).await;
    let up = echo().await;
    let yaml =
        api_route(up.addr, &format!("      jwt: {{ jwks: '{}', audiences: [api], min_refresh: 1s }}\n", keys.url()));
    let tg = Tollgate::start(&yaml).await;
    // Nothing is read before the first token.
    assert_eq!(keys.hits(), 0);
    assert_eq!(call(&tg, "/", &old.sign(&claims("alice"))).await.0, StatusCode::OK);
    assert_eq!(keys.hits(), 1);
    assert_eq!(call(&tg, "/", &old.sign(&claims("alice"))).await.0, StatusCode::OK);
    assert_eq!(keys.hits(), 1, "max-age=3600: the set is not read per request");

    // The issuer rotates to a new key. A token naming it, past the interval, reads the set again.
    *keys.doc.lock().unwrap() = jwt::jwks(&[&old, &new]);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(call(&tg, "/", &new.sign(&claims("alice"))).await.0, StatusCode::OK);
    assert_eq!(keys.hits(), 2);

    // Tokens naming a key nobody has: one reading at most per interval, however many come.
    let stranger = Signer::ec("stranger");
    for _ in 0..5 {
        assert_eq!(call(&tg, "/", &stranger.sign(&claims("alice"))).await.0, StatusCode::UNAUTHORIZED);
    }
    assert!(keys.hits() <= 3, "{} readings for 5 unknown kids within the interval", keys.hits());

    // The server goes down: a reading fails, and the last good set still verifies.
    keys.down.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let before = keys.hits();
    assert_eq!(call(&tg, "/", &stranger.sign(&claims("alice"))).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(keys.hits(), before + 1, "the failed reading was tried");
    assert_eq!(call(&tg, "/", &old.sign(&claims("alice"))).await.0, StatusCode::OK);
    assert_eq!(call(&tg, "/", &new.sign(&claims("alice"))).await.0, StatusCode::OK);

    // Each reading is counted by its result, the URL without its query as the label.
    let admin = tg.start_admin().await;
    let (_, _, body) = get(admin, "/metrics").await;
    let text = String::from_utf8_lossy(&body);
    let url = keys.url();
    let count = |result: &str| -> usize {
        let head = format!("tollgate_auth_key_set_reads_total{{url=\"{url}\",result=\"{result}\"}} ");
        let line = text.lines().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("no {head} in\n{text}"));
        line[head.len()..].parse().unwrap()
    };
    assert_eq!(count("failed"), 1);
    assert_eq!(count("ok") + count("failed"), keys.hits());
}

fn api_key_yaml(upstream: std::net::SocketAddr, keys: &str, redis: &str) -> String {
    api_route(
        upstream,
        &format!(
            "      api_key: {{ from: 'header:x-api-key', keys: {keys} }}
      claims_to_headers: {{ consumer: x-consumer }}
    limits:
      - {{ name: per-consumer, algorithm: fixed_window, rate: 2/h, key: consumer }}
{redis}"
        ),
    )
}

async fn api_keys_work(tg: &Tollgate) {
    let (status, headers, body) = get_with(tg.addr, "/", &[("x-api-key", "sk-acme-1")]).await;
    assert_eq!(status, StatusCode::OK, "{body:?}");
    assert_eq!(String::from_utf8_lossy(&body), "consumer=acme org=- authorization=-");
    assert!(headers.get("www-authenticate").is_none());
    // Another key of the same consumer shares its count.
    assert_eq!(get_with(tg.addr, "/", &[("x-api-key", "sk-acme-2")]).await.0, StatusCode::OK);
    assert_eq!(get_with(tg.addr, "/", &[("x-api-key", "sk-acme-1")]).await.0, StatusCode::TOO_MANY_REQUESTS);
    let (status, headers, _) = get_with(tg.addr, "/", &[("x-api-key", "sk-made-up")]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(headers["www-authenticate"].to_str().unwrap().starts_with("ApiKey realm=\"api\""));
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn api_keys_from_a_file_of_digests() {
    let dir = folder();
    let hash = |k: &str| tollgate::config::auth::hash_key(k.as_bytes());
    let file = format!(
        "# digest consumer\n{} acme\n{} acme\n{} globex\n",
        hash("sk-acme-1"),
        hash("sk-acme-2"),
        hash("sk-globex")
    );
    let keys = write(&dir, "keys.txt", &file);
    let up = echo().await;
    let tg = Tollgate::start(&api_key_yaml(up.addr, &format!("'{keys}'"), "")).await;
    api_keys_work(&tg).await;
    assert_eq!(get_with(tg.addr, "/", &[("x-api-key", "sk-globex")]).await.0, StatusCode::OK);
}

#[tokio::test]
async fn api_keys_from_a_redis_hash() {
    let node = RedisNode::start();
    let hash = |k: &str| tollgate::config::auth::hash_key(k.as_bytes());
    node.cli(&["HSET", "tollgate:keys", &hash("sk-acme-1"), "acme", &hash("sk-acme-2"), "acme"]);
    let up = echo().await;
    let redis = format!("redis: {{ url: '{}' }}\n", node.url());
    let tg = Tollgate::start(&api_key_yaml(up.addr, "{ redis_hash: 'tollgate:keys', cache: 1s }", &redis)).await;
    api_keys_work(&tg).await;
}

#[tokio::test]
async fn refusals_and_results_are_counted_per_route() {
    let ec = Signer::ec("e1");
    let dir = folder();
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&ec]));
    let up = echo().await;
    let tg = Tollgate::start(&jwt_yaml(up.addr, &jwks, "")).await;
    let admin = tg.start_admin().await;
    let mut expired = claims("alice");
    expired["exp"] = json!(jwt::now() - 600);
    assert_eq!(call(&tg, "/", &ec.sign(&claims("alice"))).await.0, StatusCode::OK);
    assert_eq!(call(&tg, "/", &ec.sign(&expired)).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::UNAUTHORIZED);
    let (_, _, body) = get(admin, "/metrics").await;
    let text = String::from_utf8_lossy(&body);
    for line in [
        r#"tollgate_auth_total{route="api",result="authenticated",reason="-"} 1"#,
        r#"tollgate_auth_total{route="api",result="refused",reason="expired"} 1"#,
        r#"tollgate_auth_total{route="api",result="refused",reason="missing"} 1"#,
    ] {
        assert!(text.contains(line), "no `{line}` in\n{text}");
    }
}

#[test]
fn auth_fields_are_refused_with_their_place() {
    let dir = folder();
    let ec = Signer::ec("e1");
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&ec]));
    let short = write(&dir, "short.key", "too short");
    let bad = write(&dir, "bad.json", r#"{"keys": [{"kty": "EC", "crv": "P-256", "x": "AA", "y": "AA"}]}"#);
    let route = |auth: &str, limits: &str| {
        format!(
            "upstreams:\n  up: {{ url: 'http://127.0.0.1:1' }}\nroutes:\n  - name: api\n    upstream: up\n    auth: {auth}\n{limits}"
        )
    };
    let cases = [
        (
            route(&format!("{{ jwt: {{ jwks: '{jwks}', algorithms: [ES256, ES512] }} }}"), ""),
            "routes[0].auth.jwt.algorithms[1]",
            "unknown algorithm `ES512`",
        ),
        (
            route(&format!("{{ jwt: {{ jwks: '{jwks}', algorithms: [HS256] }} }}"), ""),
            "routes[0].auth.jwt.algorithms",
            "secret_file",
        ),
        (route(&format!("{{ jwt: {{ secret_file: '{short}' }} }}"), ""), "routes[0].auth.jwt.algorithms", "HS256"),
        (
            route(&format!("{{ jwt: {{ secret_file: '{short}', algorithms: [HS256] }} }}"), ""),
            "routes[0].auth.jwt.secret_file",
            "at least 32",
        ),
        (route("{ jwt: { jwks: '/nonexistent/jwks.json' } }", ""), "routes[0].auth.jwt.jwks", "cannot read"),
        (route(&format!("{{ jwt: {{ jwks: '{bad}' }} }}"), ""), "routes[0].auth.jwt.jwks", "key 0"),
        (route("{ api_key: { keys: { redis_hash: k } } }", ""), "routes[0].auth.api_key.keys", "redis:"),
        (route("{ jwt: { jwks: 'x' }, api_key: { keys: y } }", ""), "routes[0].auth.api_key", "not both"),
        (route("off", ""), "routes[0].auth", "`none`"),
        (
            route("none", "    limits: [{ name: l, algorithm: fixed_window, rate: 1/s, key: consumer }]\n"),
            "routes[0].limits[0].key",
            "no `auth`",
        ),
    ];
    for (yaml, path, says) in cases {
        let e = tollgate::config::Config::from_yaml(Path::new("t.yaml"), &yaml).expect_err(&yaml);
        assert_eq!(e.path, path, "{e}");
        assert!(e.message.contains(says), "{e}");
        assert!(e.line > 0, "{e}");
    }
}

#[tokio::test]
async fn claims_key_limits_and_name_plan_tiers() {
    let ec = Signer::ec("e1");
    let dir = folder();
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&ec]));
    let clients = write(&dir, "clients.yaml", "globex: pro\n");
    let up = echo().await;
    let yaml = format!(
        "listen: 127.0.0.1:0
auth:
  jwt: {{ jwks: '{jwks}', audiences: [api] }}
plans:
  of: claim:org_id
  tier_claim: plan
  clients: '{clients}'
  default: free
  tiers:
    free: {{ per-org: {{ rate: 1/h }} }}
    pro: {{ per-org: {{ rate: 3/h }} }}
upstreams:
  up: {{ url: 'http://{}' }}
routes:
  - name: api
    upstream: up
    limits:
      - {{ name: per-org, algorithm: fixed_window, plan: true, key: claim:org_id }}
",
        up.addr
    );
    let tg = Tollgate::start(&yaml).await;
    let token = |sub: &str, org: &str, plan: Option<&str>| {
        let mut c = claims(sub);
        c["org_id"] = json!(org);
        if let Some(p) = plan {
            c["plan"] = json!(p);
        }
        ec.sign(&c)
    };
    let admitted = |t: String| {
        let tg = &tg;
        async move {
            let mut n = 0;
            while n < 10 && call(tg, "/", &t).await.0 == StatusCode::OK {
                n += 1;
            }
            n
        }
    };
    // Two users of one organisation share its count; the tier comes from the claim, then the map.
    assert_eq!(admitted(token("alice", "acme", None)).await, 1);
    assert_eq!(call(&tg, "/", &token("bob", "acme", None)).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(admitted(token("carol", "initech", Some("pro"))).await, 3);
    assert_eq!(admitted(token("dave", "globex", None)).await, 3);
}

#[tokio::test]
async fn a_remembered_token_still_expires() {
    // The limits' clock is the one tokens are checked against: moved by hand here.
    let ec = Signer::ec("e1");
    let dir = folder();
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&ec]));
    let up = echo().await;
    let start = 1_900_000_000u64;
    let clock = tollgate::limit::ManualClock::new(tollgate::limit::Timestamp::from_micros(start * 1_000_000));
    let yaml = jwt_yaml(up.addr, &jwks, "");
    let tg = Tollgate::start_with_clock(&yaml, clock.clone()).await;
    let mut c = claims("alice");
    c["exp"] = json!(start + 60);
    c["iat"] = json!(start);
    let token = ec.sign(&c);
    for _ in 0..3 {
        assert_eq!(call(&tg, "/", &token).await.0, StatusCode::OK);
    }
    // Within the leeway (5 s) past `exp`: still good; past it, refused although remembered.
    clock.advance(tollgate::limit::Span::from_secs(64));
    assert_eq!(call(&tg, "/", &token).await.0, StatusCode::OK);
    clock.advance(tollgate::limit::Span::from_secs(2));
    let (status, headers, _) = call(&tg, "/", &token).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(headers["www-authenticate"].to_str().unwrap().contains("expired"));
}

#[tokio::test(flavor = "current_thread")]
async fn the_access_log_names_the_consumer_never_the_token() {
    let (logs, _guard) = crate::operate::Captured::json_logs();
    let ec = Signer::ec("e1");
    let dir = folder();
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&ec]));
    let up = echo().await;
    let yaml =
        jwt_yaml(up.addr, &jwks, "").replace("listen: 127.0.0.1:0\n", "listen: 127.0.0.1:0\nlog: { access: true }\n");
    let tg = Tollgate::start(&yaml).await;
    let token = ec.sign(&claims("alice"));
    assert_eq!(call(&tg, "/", &token).await.0, StatusCode::OK);
    assert_eq!(get(tg.addr, "/").await.0, StatusCode::UNAUTHORIZED);
    let (lines, text) = logs.access_lines();
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(lines[0]["fields"]["consumer"], "alice", "{text}");
    assert_eq!(lines[1]["fields"]["error"], "unauthenticated", "{text}");
    assert!(lines[1]["fields"].get("consumer").is_none(), "{text}");
    let signature = token.rsplit('.').next().unwrap();
    assert!(!text.contains(signature), "the token reached the log");
}

#[tokio::test]
async fn a_stripped_query_credential_never_reaches_the_upstream() {
    let dir = folder();
    let keys = write(&dir, "keys.txt", &format!("{} acme\n", tollgate::config::auth::hash_key(b"sk-acme-1")));
    let up = Upstream::start(|req| async move {
        http::Response::new(full(req.uri().path_and_query().map_or("-".to_owned(), |pq| pq.to_string())))
    })
    .await;
    let auth = format!("      api_key: {{ from: 'query:api_key', keys: '{keys}' }}\n      strip_credentials: true\n");
    let yaml = api_route(up.addr, &auth);
    let tg = Tollgate::start(&yaml).await;
    let (status, _, body) = get(tg.addr, "/items?page=2&api_key=sk-acme-1&sort=asc").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(String::from_utf8_lossy(&body), "/items?page=2&sort=asc");
    let (status, _, body) = get(tg.addr, "/items?api_key=sk-acme-1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(String::from_utf8_lossy(&body), "/items");
    assert_eq!(get(tg.addr, "/items?api_key=sk-other").await.0, StatusCode::UNAUTHORIZED);
}

/// `n` requests with `token` at once, each on its own connection; their statuses.
async fn at_once(tg: &Tollgate, token: &str, n: usize) -> Vec<StatusCode> {
    let calls = (0..n).map(|_| {
        let (addr, auth) = (tg.addr, bearer(token));
        tokio::spawn(async move { get_with(addr, "/", &[("authorization", auth.as_str())]).await.0 })
    });
    let mut out = Vec::with_capacity(n);
    for c in calls.collect::<Vec<_>>() {
        out.push(c.await.unwrap());
    }
    out
}

#[tokio::test]
async fn good_tokens_wait_for_the_key_set_being_read() {
    let (first, next) = (Signer::ec("first"), Signer::ed25519("next"));
    let keys = KeyServer::start(jwt::jwks(&[&first])).await;
    // Each reading takes a while: every request that needs the set meanwhile waits for it.
    keys.slow.store(700, Ordering::SeqCst);
    let up = echo().await;
    let yaml =
        api_route(up.addr, &format!("      jwt: {{ jwks: '{}', audiences: [api], min_refresh: 1s }}\n", keys.url()));
    let tg = Tollgate::start(&yaml).await;
    // A fresh proxy: 20 good tokens at once, one reading.
    let got = at_once(&tg, &first.sign(&claims("alice")), 20).await;
    assert!(got.iter().all(|s| *s == StatusCode::OK), "a fresh proxy: {got:?}");
    assert_eq!(keys.hits(), 1);

    // A rotation: tokens of the new key, at once, wait for the one reading they start.
    *keys.doc.lock().unwrap() = jwt::jwks(&[&first, &next]);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let got = at_once(&tg, &next.sign(&claims("bob")), 20).await;
    assert!(got.iter().all(|s| *s == StatusCode::OK), "a rotation: {got:?}");
    assert_eq!(keys.hits(), 2);
}

#[tokio::test]
async fn a_key_set_never_read_answers_503_not_401() {
    let ec = Signer::ec("e1");
    let keys = KeyServer::start(jwt::jwks(&[&ec])).await;
    keys.down.store(true, Ordering::SeqCst);
    let up = echo().await;
    let yaml =
        api_route(up.addr, &format!("      jwt: {{ jwks: '{}', audiences: [api], min_refresh: 1s }}\n", keys.url()));
    let tg = Tollgate::start(&yaml).await;
    // The key set's server answers 503: a good token cannot be checked.
    let (status, headers, body) = call(&tg, "/", &ec.sign(&claims("alice"))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(headers.contains_key("retry-after"), "{headers:?}");
    // A token that is not one at all is still the client's fault.
    assert_eq!(call(&tg, "/", "not.a.token").await.0, StatusCode::UNAUTHORIZED);

    // Nothing listens at the URL at all: the same.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let yaml = api_route(
        up.addr,
        &format!("      jwt: {{ jwks: 'http://{closed}/jwks.json', audiences: [api], min_refresh: 1s }}\n"),
    );
    let tg2 = Tollgate::start(&yaml).await;
    assert_eq!(call(&tg2, "/", &ec.sign(&claims("alice"))).await.0, StatusCode::SERVICE_UNAVAILABLE);

    // The server comes back: past the interval, the set is read and the token passes.
    keys.down.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(call(&tg, "/", &ec.sign(&claims("alice"))).await.0, StatusCode::OK);
    let admin = tg.start_admin().await;
    let (_, _, body) = get(admin, "/metrics").await;
    let text = String::from_utf8_lossy(&body);
    let line = r#"tollgate_auth_total{route="api",result="refused",reason="unavailable"} 1"#;
    assert!(text.contains(line), "no `{line}` in\n{text}");
}

#[tokio::test]
async fn a_removed_key_stays_refused_as_the_set_is_read_again() {
    let (old, new) = (Signer::ec("old"), Signer::ec("new"));
    let keys = KeyServer::start(jwt::jwks(&[&old, &new])).await;
    // Every answer is stale at once: the set is read again (in the background) every second.
    *keys.cache.lock().unwrap() = "no-store";
    let up = echo().await;
    let yaml =
        api_route(up.addr, &format!("      jwt: {{ jwks: '{}', audiences: [api], min_refresh: 1s }}\n", keys.url()));
    let tg = Tollgate::start(&yaml).await;
    let revoked = old.sign(&claims("alice"));
    assert_eq!(call(&tg, "/", &revoked).await.0, StatusCode::OK);
    *keys.doc.lock().unwrap() = jwt::jwks(&[&new]);
    let good = new.sign(&claims("bob"));
    for reading in 0..4 {
        // Past the interval, a request reads the set again; wait until that reading is done.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let before = keys.hits();
        assert_eq!(call(&tg, "/", &good).await.0, StatusCode::OK);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while keys.hits() == before {
            assert!(std::time::Instant::now() < deadline, "no reading");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(call(&tg, "/", &revoked).await.0, StatusCode::UNAUTHORIZED, "after reading {reading}");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_query_credential_never_reaches_the_access_log() {
    let (logs, _guard) = crate::operate::Captured::json_logs();
    let dir = folder();
    let keys = write(&dir, "keys.txt", &format!("{} acme\n", tollgate::config::auth::hash_key(b"sk-acme-1")));
    let up = Upstream::start(|req| async move {
        http::Response::new(full(req.uri().path_and_query().map_or("-".to_owned(), |pq| pq.to_string())))
    })
    .await;
    let auth = format!("      api_key: {{ from: 'query:api_key', keys: '{keys}' }}\n      strip_credentials: true\n");
    let yaml =
        api_route(up.addr, &auth).replace("listen: 127.0.0.1:0\n", "listen: 127.0.0.1:0\nlog: { access: true }\n");
    let tg = Tollgate::start(&yaml).await;
    let (status, _, body) = get(tg.addr, "/v1/x?a=1&api_key=sk-acme-1&b=2&api_key=sk-acme-1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(String::from_utf8_lossy(&body), "/v1/x?a=1&b=2");
    // Refused keys are not logged either.
    assert_eq!(get(tg.addr, "/v1/x?a=1&api_key=sk-guessed-9").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(get(tg.addr, "/v1/x?api_key=sk-acme-1").await.0, StatusCode::OK);
    let (lines, text) = logs.access_lines();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[0]["fields"]["query"], "a=1&b=2", "{text}");
    assert_eq!(lines[1]["fields"]["query"], "a=1", "{text}");
    assert!(lines[2]["fields"].get("query").is_none(), "{text}");
    for secret in ["sk-acme-1", "sk-guessed-9", "api_key"] {
        assert!(!text.contains(secret), "`{secret}` reached the log: {text}");
    }
}

/// An upstream that answers with every field it got whose name is a claim field's once `_`
/// is read as `-` (what a WSGI server would merge into one variable), sorted.
async fn field_echo() -> Upstream {
    Upstream::start(|req| async move {
        let mut got: Vec<String> = req
            .headers()
            .iter()
            .filter(|(n, _)| matches!(n.as_str().replace('_', "-").as_str(), "x-consumer-id" | "x-org"))
            .map(|(n, v)| format!("{n}={}", v.to_str().unwrap()))
            .collect();
        got.sort();
        http::Response::new(full(got.join(" ")))
    })
    .await
}

const FORGED: [(&str, &str); 4] =
    [("x_consumer_id", "admin"), ("x-consumer_id", "admin"), ("x_org", "evil"), ("x-consumer-id", "admin")];

#[tokio::test]
async fn forged_identity_fields_spelt_with_underscores_never_reach_the_upstream() {
    let ec = Signer::ec("e1");
    let dir = folder();
    let jwks = write(&dir, "jwks.json", &jwt::jwks(&[&ec]));
    let up = field_echo().await;
    let yaml = api_route(
        up.addr,
        &format!(
            "      jwt: {{ jwks: '{jwks}', audiences: [api] }}\n      optional: true\n      claims_to_headers: {{ consumer: x-consumer-id, org_id: x-org }}\n"
        ),
    );
    let tg = Tollgate::start(&yaml).await;
    let auth = bearer(&ec.sign(&claims("alice")));
    let mut headers = vec![("authorization", auth.as_str())];
    headers.extend(FORGED);
    // HTTP/1.1.
    let (status, _, body) = get_with(tg.addr, "/", &headers).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(String::from_utf8_lossy(&body), "x-consumer-id=alice x-org=acme");
    // An anonymous request on the optional route: none of them either.
    let (_, _, body) = get_with(tg.addr, "/", &FORGED).await;
    assert_eq!(String::from_utf8_lossy(&body), "x-consumer-id=anonymous");
    // HTTP/2.
    let mut h2 = crate::support::h2(tg.addr).await;
    let mut req = http::Request::get("http://localhost/");
    for (n, v) in &headers {
        req = req.header(*n, *v);
    }
    let resp = h2.send_request(req.body(full("")).unwrap()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
    assert_eq!(String::from_utf8_lossy(&body), "x-consumer-id=alice x-org=acme");
}

#[tokio::test]
async fn forged_identity_fields_spelt_with_underscores_never_reach_the_upstream_over_http3() {
    use crate::support::tls::{client_config, Ca, Dir};
    let ec = Signer::ec("e1");
    let dir = Dir::new();
    let jwks = dir.write("jwks.json", &jwt::jwks(&[&ec]));
    let ca = Ca::new("test CA");
    ca.issue(&["api.test"]).write(&dir, "api");
    let up = field_echo().await;
    let file = dir.path("proxy.yaml");
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: [{{ cert: api.pem, key: api.key }}] }}\n    http3: true\nupstreams: {{ up: {{ url: 'http://{}' }} }}\nroutes:\n  - upstream: up\n    auth:\n      jwt: {{ jwks: '{}', audiences: [api] }}\n      claims_to_headers: {{ consumer: x-consumer-id, org_id: x-org }}\n",
        up.addr,
        jwks.display()
    );
    std::fs::write(&file, yaml).unwrap();
    let tg = Tollgate::start_config(tollgate::config::Config::load(&file).unwrap()).await;
    let tls = client_config(&ca, &[b"h3"], None);
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
    let conn = endpoint.connect(tg.addr, "api.test").unwrap().await.unwrap();
    let (mut driver, mut send) = h3::client::new(h3_quinn::Connection::new(conn)).await.unwrap();
    tokio::spawn(async move { std::future::poll_fn(|cx| driver.poll_close(cx)).await });
    let auth = bearer(&ec.sign(&claims("alice")));
    let mut req = http::Request::get("https://api.test/").header("authorization", auth.as_str());
    for (n, v) in FORGED {
        req = req.header(n, v);
    }
    let mut stream = send.send_request(req.body(()).unwrap()).await.unwrap();
    stream.finish().await.unwrap();
    let resp = stream.recv_response().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = Vec::new();
    while let Some(mut chunk) = stream.recv_data().await.unwrap() {
        use bytes::Buf;
        body.extend_from_slice(&chunk.copy_to_bytes(chunk.remaining()));
    }
    assert_eq!(String::from_utf8_lossy(&body), "x-consumer-id=alice x-org=acme");
}

#[test]
fn check_warns_of_a_key_set_read_over_plain_http_from_another_host() {
    let dir = folder();
    let file = write(
        &dir,
        "proxy.yaml",
        "upstreams: { up: { url: 'http://127.0.0.1:1' } }
auth: { jwt: { jwks: 'http://[::1]:9/jwks.json' } }
routes:
  - { name: plain, upstream: up, auth: { jwt: { jwks: 'http://id.example.com/jwks.json' } } }
  - { name: sidecar, upstream: up, auth: { jwt: { jwks: 'http://127.0.0.1:9/jwks.json' } } }
  - { name: local, upstream: up, auth: { jwt: { jwks: 'http://localhost:9/jwks.json' } } }
  - { name: tls, upstream: up, auth: { jwt: { jwks: 'https://id.example.com/jwks.json' } } }
  - { name: default, upstream: up }
",
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate")).args(["check", "-c", &file]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    let warned: Vec<&str> = err.lines().filter(|l| l.contains("plain HTTP")).collect();
    assert_eq!(
        warned,
        ["warning: routes[0].auth.jwt.jwks: `http://id.example.com/jwks.json` is read over plain HTTP: anyone on the \
          path can swap the key set (and sign tokens that pass); use https://"],
        "{err}"
    );
}
