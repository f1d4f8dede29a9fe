//! The limit table at runtime on the admin listener: `/limits`, the most throttled keys after a
//! scripted flood from two clients, a reset that lets one through at once, and the admin token
//! the reset needs; with the local store, a Redis node and a 3-master Redis Cluster.

use std::net::SocketAddr;

use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;

use crate::support::redis::{RedisCluster, RedisNode};
use crate::support::{full, get_with, h1, proxy_yaml, Tollgate, Upstream};

const TOKEN: &str = "s3cret-admin-token-0123456789";

/// Routes `api` (keys shown as digests) and `named` (`show_keys: true`), each keyed on the
/// `x-client` header with a bucket of 2 that refills once a minute; the admin token set.
fn yaml(up: &Upstream, store: &str, redis: &str) -> String {
    let limit = |show: bool| {
        format!(
            "    limits:\n      - {{ name: per-client, algorithm: token_bucket, rate: 1/m, burst: 2, key: header:x-client, store: {store}, show_keys: {show} }}\n"
        )
    };
    let routes = format!(
        "  - name: api\n    match: {{ path_prefix: /api }}\n    upstream: up\n{}  - name: named\n    match: {{ path_prefix: /named }}\n    upstream: up\n{}",
        limit(false),
        limit(true)
    );
    format!("admin: {{ addr: 127.0.0.1:0, token: {TOKEN} }}\n{redis}{}", proxy_yaml(up.addr, "", &routes))
}

/// Sends `n` requests as client `who` to `path`; the statuses.
async fn flood(addr: SocketAddr, path: &str, who: &str, n: usize) -> Vec<StatusCode> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(get_with(addr, path, &[("x-client", who)]).await.0);
    }
    out
}

async fn json(addr: SocketAddr, path: &str) -> Value {
    let (status, _, body) = get_with(addr, path, &[]).await;
    assert_eq!(status, StatusCode::OK, "{path}: {}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

/// `DELETE path` with an optional `Authorization` value; status and body.
async fn delete(addr: SocketAddr, path: &str, auth: Option<&str>) -> (StatusCode, Value) {
    let mut send = h1(addr).await;
    let mut req = Request::delete(path).header("host", "localhost");
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let resp = send.send_request(req.body(full("")).unwrap()).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

/// The flood, the top keys, the reset and the token, against one store.
async fn scenario(store: &str, redis: &str) {
    let up = Upstream::fixed("ok").await;
    let tg = Tollgate::start(&yaml(&up, store, redis)).await;
    let admin = tg.start_admin().await;

    // Client "mallory" floods, "alice" sends a few: both are throttled past their 2.
    let m = flood(tg.addr, "/api/x", "mallory", 30).await;
    let a = flood(tg.addr, "/api/x", "alice", 5).await;
    assert_eq!(m.iter().filter(|s| **s == StatusCode::OK).count(), 2, "{m:?}");
    assert_eq!(a.iter().filter(|s| **s == StatusCode::TOO_MANY_REQUESTS).count(), 3, "{a:?}");
    flood(tg.addr, "/named/x", "mallory", 12).await;
    flood(tg.addr, "/named/x", "bob \"the\" builder", 4).await;

    // The table: both limits with their config and the metrics' counts.
    let table = json(admin, "/limits").await;
    let api = &table["routes"][0];
    assert_eq!(api["route"], "api");
    let l = &api["limits"][0];
    assert_eq!(
        (l["name"].as_str(), l["algorithm"].as_str(), l["store"].as_str()),
        (Some("per-client"), Some("token_bucket"), Some(store))
    );
    assert_eq!(l["params"]["burst"], 2);
    assert_eq!(l["key"][0], "header:x-client");
    assert_eq!(l["mode"], "enforce");
    assert_eq!((l["counters"]["allowed"].as_u64(), l["counters"]["throttled"].as_u64()), (Some(4), Some(31)));
    if store == "local" {
        assert_eq!(l["live_keys"], 2, "{l}");
    }

    // The flooding key first, with its 28 denials; the other next with its 3.
    let top = json(admin, "/limits/api/per-client/keys?top=5").await;
    let keys = top["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2, "{top}");
    assert_eq!((keys[0]["count"].as_u64(), keys[1]["count"].as_u64()), (Some(28), Some(3)), "{top}");
    let flooder = keys[0]["key"].as_str().unwrap().to_owned();
    assert_eq!(flooder.len(), 32, "a digest, in hex: {flooder}");
    assert_eq!(keys[0]["hash"], flooder.as_str());
    let st = &keys[0]["state"];
    assert_eq!(st["admitted"], false, "{st}");
    assert!(st["retry_after"].as_u64().is_some_and(|s| (1..=60).contains(&s)), "{st}");
    assert_eq!(json(admin, "/limits/api/per-client/keys?top=1").await["keys"].as_array().unwrap().len(), 1);

    // show_keys: the key's text, escaped.
    let named = json(admin, "/limits/named/per-client/keys").await;
    assert_eq!(named["keys"][0]["key"], "header:x-client=mallory", "{named}");
    assert_eq!(named["keys"][0]["count"], 10);
    assert_eq!(named["keys"][1]["key"], "header:x-client=bob \\x22the\\x22 builder", "{named}");

    // Writes need the token.
    let path = format!("/limits/api/per-client/keys/{flooder}");
    assert_eq!(delete(admin, &path, None).await.0, StatusCode::FORBIDDEN);
    assert_eq!(delete(admin, &path, Some("Bearer not-the-token-at-all")).await.0, StatusCode::FORBIDDEN);
    assert_eq!(delete(admin, &path, Some(TOKEN)).await.0, StatusCode::FORBIDDEN, "no Bearer scheme");
    assert_eq!(flood(tg.addr, "/api/x", "mallory", 1).await, [StatusCode::TOO_MANY_REQUESTS], "still throttled");

    // The reset lets the flooder through at once, and only it.
    let (status, body) = delete(admin, &path, Some(&bearer())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["held_state"], true, "{body}");
    assert_eq!(flood(tg.addr, "/api/x", "mallory", 1).await, [StatusCode::OK]);
    assert_eq!(flood(tg.addr, "/api/x", "alice", 1).await, [StatusCode::TOO_MANY_REQUESTS]);
    let top = json(admin, "/limits/api/per-client/keys").await;
    assert!(top["keys"].as_array().unwrap().iter().all(|k| k["key"] != flooder.as_str()), "{top}");

    // A shown key (URL-encoded) resets too.
    let (status, body) =
        delete(admin, "/limits/named/per-client/keys/header:x-client%3Dmallory", Some(&bearer())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(flood(tg.addr, "/named/x", "mallory", 1).await, [StatusCode::OK]);

    // Unknown routes and limits are 404, a malformed key 400.
    assert_eq!(delete(admin, "/limits/nope/per-client/keys/00", Some(&bearer())).await.0, StatusCode::NOT_FOUND);
    assert_eq!(delete(admin, "/limits/api/nope/keys/00", Some(&bearer())).await.0, StatusCode::NOT_FOUND);
    assert_eq!(get_with(admin, "/limits/api/nope/keys", &[]).await.0, StatusCode::NOT_FOUND);
    assert_eq!(delete(admin, "/limits/api/per-client/keys/xyz", Some(&bearer())).await.0, StatusCode::BAD_REQUEST);
    assert_eq!(get_with(admin, "/limits/api/per-client/keys?top=zero", &[]).await.0, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn local_store_top_keys_and_reset() {
    scenario("local", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_node_top_keys_and_reset() {
    let node = RedisNode::start();
    let redis = format!("redis:\n  url: {}\n  timeout: 500ms\n  on_error: deny\n", node.url());
    scenario("redis", &redis).await;
    assert!(node.calls("del") >= 2, "resets are DELs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_top_keys_and_reset() {
    let cluster = RedisCluster::start();
    let redis = format!("redis:\n  cluster: [{}]\n  timeout: 500ms\n  on_error: deny\n", cluster.urls().join(", "));
    scenario("redis", &redis).await;
}

#[tokio::test]
async fn without_a_configured_token_writes_are_refused() {
    let up = Upstream::fixed("ok").await;
    let yaml = yaml(&up, "local", "").replace(&format!("admin: {{ addr: 127.0.0.1:0, token: {TOKEN} }}\n"), "");
    let tg = Tollgate::start(&yaml).await;
    let admin = tg.start_admin().await;
    let path = format!("/limits/api/per-client/keys/{:032x}", 1);
    let (status, body) = delete(admin, &path, Some(&bearer())).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(body["status"], 403, "problem+json: {body}");
    // Reads stay open, and the other admin paths still take GET only.
    assert_eq!(get_with(admin, "/limits", &[]).await.0, StatusCode::OK);
    assert_eq!(delete(admin, "/metrics", Some(&bearer())).await.0, StatusCode::METHOD_NOT_ALLOWED);
}

/// A file removed on drop.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(name: &str, text: &str) -> TempFile {
        let p = std::env::temp_dir().join(format!("tollgate-admin-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        TempFile(p)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const ROUTES: &str = "upstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n";

#[test]
fn check_refuses_an_admin_listener_off_loopback_without_a_token() {
    let bin = env!("CARGO_BIN_EXE_tollgate");
    let check = |text: &str| {
        let f = TempFile::new("check.yaml", text);
        std::process::Command::new(bin).arg("check").arg("-c").arg(&f.0).output().unwrap()
    };
    let out = check(&format!("listen: 127.0.0.1:0\nadmin: 0.0.0.0:9901\n{ROUTES}"));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("check.yaml:2:8: admin.addr: ") && err.contains("without a token"), "{err}");
    let out = check(&format!("listen: 127.0.0.1:0\nadmin:\n  addr: 0.0.0.0:9901\n{ROUTES}"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("check.yaml:3:9: admin.addr: "), "{err}");
    // On loopback, or with a token, it passes.
    assert!(check(&format!("listen: 127.0.0.1:0\nadmin: 127.0.0.1:9901\n{ROUTES}")).status.success());
    let with_token = format!("listen: 127.0.0.1:0\nadmin: {{ addr: 0.0.0.0:9901, token: {TOKEN} }}\n{ROUTES}");
    assert!(check(&with_token).status.success());
}

#[test]
fn the_token_file_wins_over_the_token_and_short_tokens_are_refused() {
    use tollgate::config::Config;
    let file = TempFile::new("token", "file-token-0123456789abcdef\n");
    let name = file.0.file_name().unwrap().to_str().unwrap();
    // A relative token_file is read beside the config.
    let config_path = file.0.with_file_name("config.yaml");
    let text = format!("admin: {{ addr: 127.0.0.1:9901, token: {TOKEN}, token_file: {name} }}\n{ROUTES}");
    let c = Config::from_yaml(&config_path, &text).unwrap();
    let token = c.admin_token.unwrap();
    assert!(token.admits(Some(b"Bearer file-token-0123456789abcdef")));
    assert!(!token.admits(Some(format!("Bearer {TOKEN}").as_bytes())));
    assert!(c.warnings.iter().any(|w| w.contains("token_file")), "{:?}", c.warnings);
    let e = Config::from_yaml(&config_path, &format!("admin: {{ addr: 127.0.0.1:9901, token: short }}\n{ROUTES}"))
        .unwrap_err();
    assert_eq!((e.line, e.path.as_str()), (1, "admin.token"), "{e}");
    let missing = format!("admin: {{ addr: 127.0.0.1:9901, token_file: /nonexistent/token }}\n{ROUTES}");
    let e = Config::from_yaml(&config_path, &missing).unwrap_err();
    assert!(e.to_string().contains("admin.token_file: cannot read /nonexistent/token"), "{e}");
    // The token is never shown.
    assert!(!format!("{:?}", Config::from_yaml(&config_path, &text).unwrap()).contains("file-token"));
}

/// A page of another site whose name was rebound to the admin listener's address (DNS
/// rebinding, in an operator's browser) sends its own name as `Host`: refused, on every
/// endpoint and over HTTP/2 too. The listener's own address, loopback, `localhost` and the
/// names of `admin.allowed_hosts` are answered, with any port (a tunnel's).
#[tokio::test]
async fn the_admin_listener_answers_only_requests_that_name_it() {
    let up = Upstream::fixed("ok").await;
    let yaml = yaml(&up, "local", "")
        .replace(&format!("token: {TOKEN} }}"), &format!("token: {TOKEN}, allowed_hosts: [Admin.Internal.] }}"));
    let tg = Tollgate::start(&yaml).await;
    let admin = tg.start_admin().await;
    assert_eq!(flood(tg.addr, "/named", "k-123", 3).await[2], StatusCode::TOO_MANY_REQUESTS);
    let port = admin.port();
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "LOCALHOST.:8000".to_owned(),
        "[::1]:9901".to_owned(),
        "127.0.0.2".to_owned(),
        "admin.internal:9901".to_owned(),
        "admin.internal.".to_owned(),
    ] {
        let (status, _, body) = get_with(admin, "/limits/named/per-client/keys", &[("host", host.as_str())]).await;
        assert_eq!(status, StatusCode::OK, "{host}: {}", String::from_utf8_lossy(&body));
        assert!(String::from_utf8_lossy(&body).contains("k-123"), "{host}");
    }
    for host in [
        format!("rebind.attacker.example:{port}"),
        "localhost.attacker.example".to_owned(),
        "admin.internal.attacker.example".to_owned(),
        "10.9.8.7:9901".to_owned(),
        "not a host".to_owned(),
    ] {
        for path in ["/limits/named/per-client/keys", "/limits", "/metrics", "/config", "/", "/dashboard.json"] {
            let (status, headers, body) = get_with(admin, path, &[("host", host.as_str())]).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{host} {path}");
            assert_eq!(headers["content-type"], "application/problem+json", "{host} {path}");
            assert!(!String::from_utf8_lossy(&body).contains("k-123"), "{host} {path}");
        }
    }
    // A write is refused for the same reason before its token is looked at.
    let mut send = h1(admin).await;
    let req = Request::delete("/limits/named/per-client/keys/x")
        .header("host", "evil.example")
        .header("authorization", bearer());
    assert_eq!(send.send_request(req.body(full("")).unwrap()).await.unwrap().status(), StatusCode::FORBIDDEN);
    // HTTP/2 names the host in `:authority`.
    let mut h2 = crate::support::h2(admin).await;
    for (authority, want) in [("rebind.attacker.example", StatusCode::FORBIDDEN), ("localhost", StatusCode::OK)] {
        let req = Request::get(format!("http://{authority}:{port}/limits")).body(full("")).unwrap();
        assert_eq!(h2.send_request(req).await.unwrap().status(), want, "{authority}");
    }
}

#[test]
fn allowed_hosts_are_names_without_a_port() {
    for (name, says) in
        [("admin.internal:9901", "without a port"), ("ad min", "not a host name"), ("", "not a host name")]
    {
        let yaml = format!(
            "admin: {{ addr: 127.0.0.1:9901, allowed_hosts: [ok.example, '{name}'] }}\nupstreams: {{ up: {{ respond: {{}} }} }}\nroutes: [{{ upstream: up }}]\n"
        );
        let e = tollgate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).expect_err(name);
        assert_eq!(e.path, "admin.allowed_hosts[1]", "{e}");
        assert!(e.message.contains(says), "{e}");
        assert_eq!(e.line, 1, "{e}");
    }
}
