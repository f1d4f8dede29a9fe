//! `tls.acme` against Pebble, Let's Encrypt's ACME test server, started per test on free
//! loopback ports with its DNS (pebble-challtestsrv: every name is 127.0.0.1) and its
//! validation ports pointed at tollgate's listeners. Each served certificate is verified with
//! Pebble's own root. Without Pebble installed, each test says it was skipped (scripts/test.sh
//! installs Debian's `pebble`).

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use http::StatusCode;

use crate::support::acme::{client_trusting, metric, skip, Bound, Instance, Pebble};
use crate::support::redis::RedisNode;
use crate::support::tls::{connect, served_cert, y, Client, Dir};

/// The `tls.acme` block of a test, Pebble as its directory.
fn acme_block(pebble: &Pebble, storage: &Dir, names: &str, challenge: &str, extra: &str) -> String {
    format!(
        "{{ directory: '{}', directory_ca: {}, email: ops@example.com, names: {names}, challenge: {challenge}, storage: {}{extra} }}",
        pebble.directory,
        y(&pebble.directory_ca),
        y(&storage.0),
    )
}

/// A TLS listener with `acme` and a plain one that redirects (and answers HTTP-01 first).
fn yaml(tls: std::net::SocketAddr, plain: Option<std::net::SocketAddr>, acme: &str, redis: Option<&str>) -> String {
    let mut out = format!("listen:\n  - addr: {tls}\n    tls:\n      acme: {acme}\n");
    if let Some(p) = plain {
        out.push_str(&format!("  - {{ addr: {p}, redirect_https: true }}\n"));
    }
    if let Some(url) = redis {
        out.push_str(&format!("redis: {{ url: '{url}' }}\n"));
    }
    out.push_str("upstreams: { d: { respond: { body: hello } } }\nroutes: [{ upstream: d }]\n");
    out
}

fn serial(der: &[u8]) -> Vec<u8> {
    tollgate::x509::parse(der).unwrap().serial
}

/// Waits until `name` is served a certificate Pebble's root verifies (other than `not`, when
/// given); returns its serial. The first handshakes may meet the placeholder.
async fn verified(addr: std::net::SocketAddr, name: &str, root: &str, not: Option<&[u8]>, within: Duration) -> Vec<u8> {
    let client = client_trusting(root, &[b"http/1.1"]);
    let deadline = Instant::now() + within;
    loop {
        let last = match connect(addr, name, client.clone()).await {
            Ok(tls) => {
                let s = serial(&served_cert(&tls));
                if not != Some(s.as_slice()) {
                    let (status, _, body, _) = Client::over(tls).await.get(name, "/").await;
                    assert_eq!((status, &body[..]), (StatusCode::OK, &b"hello"[..]));
                    return s;
                }
                "the same certificate as before".to_owned()
            }
            Err(e) => e.to_string(),
        };
        assert!(Instant::now() < deadline, "{name}: no verified certificate within {within:?} ({last})");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn orders(tg: &Instance, name: &str, result: &str) -> f64 {
    let series = format!("tollgate_acme_orders_total{{certificate=\"{name}\",result=\"{result}\"}}");
    metric(&tg.metrics(), &series).unwrap_or(0.0)
}

/// A plain GET on `addr` of `path` with `host`: status and body.
async fn plain_get(addr: std::net::SocketAddr, host: &str, path: &str) -> (StatusCode, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(path).header("host", host).body(crate::support::full("")).unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    use http_body_util::BodyExt;
    (status, String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes()).into_owned())
}

#[tokio::test]
async fn http01_gets_a_certificate_stores_it_private_and_reuses_it_after_a_restart() {
    let bound = Bound::new(2).await;
    let (tls, plain) = (bound.addrs[0], bound.addrs[1]);
    let pebble = match Pebble::start(plain.port(), tls.port(), 3600, &[]).await {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    let storage = Dir::new();
    let config = yaml(tls, Some(plain), &acme_block(&pebble, &storage, "[shop.example.com]", "http-01", ""), None);
    let tg = Instance::start(bound, &config).await;
    let root = pebble.root().await;
    let first = verified(tls, "shop.example.com", &root, None, Duration::from_secs(60)).await;
    assert_eq!(orders(&tg, "shop.example.com", "issued"), 1.0);
    let text = tg.metrics();
    assert!(
        metric(
            &text,
            "tollgate_certificate_expiry_timestamp_seconds{certificate=\"shop.example.com\",origin=\"acme\"}"
        )
        .is_some(),
        "{text}"
    );
    // The plain listener still redirects everything else; an unknown token is a 404.
    let (status, _) = plain_get(plain, "shop.example.com", "/cart").await;
    assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
    let (status, _) =
        plain_get(plain, "shop.example.com", "/.well-known/acme-challenge/AAAAAAAAAAAAAAAAAAAAAAAA").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // Account and certificate keys are stored private.
    let mut keys = Vec::new();
    let mut stack = vec![storage.0.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.ends_with("account.json") || p.ends_with("key.pem") {
                keys.push(p);
            }
        }
    }
    assert_eq!(keys.len(), 2, "{keys:?}");
    for k in keys {
        assert_eq!(std::fs::metadata(&k).unwrap().permissions().mode() & 0o777, 0o600, "{}", k.display());
    }
    tg.stop().await;

    // A restart serves the stored certificate at once and orders nothing.
    let bound = Bound::new(2).await;
    let (tls, plain) = (bound.addrs[0], bound.addrs[1]);
    let config = yaml(tls, Some(plain), &acme_block(&pebble, &storage, "[shop.example.com]", "http-01", ""), None);
    let tg = Instance::start(bound, &config).await;
    let again = verified(tls, "shop.example.com", &root, None, Duration::from_secs(10)).await;
    assert_eq!(again, first);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(orders(&tg, "shop.example.com", "issued"), 0.0);
    tg.stop().await;
}

/// TLS-ALPN-01 on the TLS listener itself (no plain listener at all), with external account
/// binding required by the CA.
#[tokio::test]
async fn tls_alpn01_with_external_account_binding_gets_a_certificate() {
    let bound = Bound::new(1).await;
    let tls = bound.addrs[0];
    let mac = "zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W";
    let pebble = match Pebble::start(crate::support::acme::free_port(), tls.port(), 3600, &[("kid-1", mac)]).await {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    let storage = Dir::new();
    let eab = format!(", eab: {{ kid: kid-1, hmac_key: {mac} }}");
    let names = "[api.example.com, [www.example.com, example.com]]";
    let config = yaml(tls, None, &acme_block(&pebble, &storage, names, "tls-alpn-01", &eab), None);
    let tg = Instance::start(bound, &config).await;
    let root = pebble.root().await;
    verified(tls, "api.example.com", &root, None, Duration::from_secs(60)).await;
    // One certificate for the two names listed together.
    let www = verified(tls, "www.example.com", &root, None, Duration::from_secs(60)).await;
    assert_eq!(verified(tls, "example.com", &root, None, Duration::from_secs(10)).await, www);
    assert_eq!(orders(&tg, "api.example.com", "issued"), 1.0);
    assert_eq!(orders(&tg, "www.example.com", "issued"), 1.0);
    tg.stop().await;
}

/// A certificate valid 15 s is renewed at about 10 s, and the new one served; when the
/// renewal cannot be validated, the one in service stays and the failure is counted.
#[tokio::test]
async fn a_short_lived_certificate_is_renewed_and_a_failed_renewal_keeps_the_old_one() {
    let bound = Bound::new(2).await;
    let (tls, plain) = (bound.addrs[0], bound.addrs[1]);
    let pebble = match Pebble::start(plain.port(), tls.port(), 15, &[]).await {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    let storage = Dir::new();
    let config = yaml(tls, Some(plain), &acme_block(&pebble, &storage, "[renew.example.com]", "http-01", ""), None);
    let tg = Instance::start(bound, &config).await;
    let root = pebble.root().await;
    let first = verified(tls, "renew.example.com", &root, None, Duration::from_secs(60)).await;
    let second = verified(tls, "renew.example.com", &root, Some(&first), Duration::from_secs(60)).await;
    assert!(orders(&tg, "renew.example.com", "issued") >= 2.0);
    // From now on the CA reaches nothing of tollgate's for this name.
    pebble.dns_a("renew.example.com", "127.0.0.2").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while orders(&tg, "renew.example.com", "failed") < 1.0 {
        assert!(Instant::now() < deadline, "no failed renewal within 60 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let client = client_trusting(&root, &[b"http/1.1"]);
    let tls_conn = connect(tls, "renew.example.com", client).await;
    // The last good certificate is still the one served (it may have expired by now on a
    // slow machine: then the handshake fails verification, but the serial is the same).
    match tls_conn {
        Ok(c) => assert!([first.clone(), second.clone()].contains(&serial(&served_cert(&c)))),
        Err(e) => assert!(e.to_string().contains("expired"), "{e}"),
    }
    tg.stop().await;
}

/// A name the CA cannot validate at a first start: a self-signed placeholder is served for
/// it (with a metric saying so), nothing crashes, other names are unaffected.
#[tokio::test]
async fn a_name_that_cannot_be_validated_gets_a_placeholder_and_a_failed_order() {
    let bound = Bound::new(2).await;
    let (tls, plain) = (bound.addrs[0], bound.addrs[1]);
    let pebble = match Pebble::start(plain.port(), tls.port(), 3600, &[]).await {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    pebble.dns_a("broken.example.com", "127.0.0.2").await;
    let storage = Dir::new();
    let names = "[broken.example.com, fine.example.com]";
    let config = yaml(tls, Some(plain), &acme_block(&pebble, &storage, names, "http-01", ""), None);
    let tg = Instance::start(bound, &config).await;
    let root = pebble.root().await;
    verified(tls, "fine.example.com", &root, None, Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while orders(&tg, "broken.example.com", "failed") < 1.0 {
        assert!(Instant::now() < deadline, "the order for the broken name did not fail within 60 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let text = tg.metrics();
    assert!(
        metric(
            &text,
            "tollgate_certificate_expiry_timestamp_seconds{certificate=\"broken.example.com\",origin=\"placeholder\"}"
        )
        .is_some(),
        "{text}"
    );
    // The placeholder names the name, and no client trusts it.
    let err = connect(tls, "broken.example.com", client_trusting(&root, &[b"http/1.1"])).await.unwrap_err();
    assert!(err.to_string().contains("invalid peer certificate"), "{err}");
    tg.stop().await;
}

/// Two instances behind one address share a storage folder and a Redis: the one that takes
/// the lock orders, the other answers the CA's HTTP-01 request from the shared storage (the CA
/// validates on its port), and both serve the one certificate.
#[tokio::test]
async fn two_instances_sharing_redis_order_once_and_serve_the_same_certificate() {
    let redis = RedisNode::start();
    two_instances(Some(&redis)).await;
}

/// The same without Redis: the lock is a file in the shared storage.
#[tokio::test]
async fn two_instances_sharing_a_storage_folder_order_once() {
    two_instances(None).await;
}

/// Whether an instance holds the certificate's lock (the Redis key, or the lock file).
fn locked(redis: Option<&RedisNode>, storage: &Dir) -> bool {
    match redis {
        Some(r) => r.cli(&["KEYS", "tollgate:acme:*"]).contains(":lock"),
        None => {
            let mut stack = vec![storage.0.clone()];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                    let p = e.path();
                    if p.ends_with("order.lock") {
                        return true;
                    }
                    if p.is_dir() {
                        stack.push(p);
                    }
                }
            }
            false
        }
    }
}

async fn two_instances(redis: Option<&RedisNode>) {
    let (a, b) = (Bound::new(2).await, Bound::new(2).await);
    let (a_tls, a_plain, b_tls, b_plain) = (a.addrs[0], a.addrs[1], b.addrs[0], b.addrs[1]);
    // The CA validates on instance A's ports only.
    let pebble = match Pebble::start(a_plain.port(), a_tls.port(), 3600, &[]).await {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    let storage = Dir::new();
    let block = acme_block(&pebble, &storage, "[shared.example.com]", "http-01", "");
    let url = redis.map(RedisNode::url);
    // B first: it takes the lock and orders; A, started once the lock is taken, waits.
    let tb = Instance::start(b, &yaml(b_tls, Some(b_plain), &block, url.as_deref())).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !locked(redis, &storage) {
        assert!(Instant::now() < deadline, "instance B took no lock");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ta = Instance::start(a, &yaml(a_tls, Some(a_plain), &block, url.as_deref())).await;
    let root = pebble.root().await;
    let sa = verified(a_tls, "shared.example.com", &root, None, Duration::from_secs(60)).await;
    let sb = verified(b_tls, "shared.example.com", &root, None, Duration::from_secs(60)).await;
    assert_eq!(sa, sb, "one certificate");
    assert_eq!(orders(&ta, "shared.example.com", "issued") + orders(&tb, "shared.example.com", "issued"), 1.0);
    assert_eq!(orders(&tb, "shared.example.com", "issued"), 1.0, "B held the lock");
    ta.stop().await;
    tb.stop().await;
}

/// With Redis configured and down, the order lock falls back to the storage's lock file: the
/// certificate is still ordered.
#[tokio::test]
async fn an_order_goes_on_when_the_redis_of_its_lock_is_down() {
    let mut redis = RedisNode::start();
    let url = redis.url();
    redis.kill();
    let bound = Bound::new(2).await;
    let (tls, plain) = (bound.addrs[0], bound.addrs[1]);
    let pebble = match Pebble::start(plain.port(), tls.port(), 3600, &[]).await {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    let storage = Dir::new();
    let config =
        yaml(tls, Some(plain), &acme_block(&pebble, &storage, "[lock.example.com]", "http-01", ""), Some(&url));
    let tg = Instance::start(bound, &config).await;
    let root = pebble.root().await;
    verified(tls, "lock.example.com", &root, None, Duration::from_secs(60)).await;
    assert_eq!(orders(&tg, "lock.example.com", "issued"), 1.0);
    tg.stop().await;
}
