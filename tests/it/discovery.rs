//! Servers found by DNS (`resolve:`): a real dnsmasq on a loopback port answers for the
//! names, real hyper servers on 127.0.0.x listen at the addresses, and records change while
//! traffic flows.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::dns::Dns;
use crate::support::{full, BoxBody, Tollgate, Upstream};

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, BoxBody>;

const NAME: &str = "api.tollgate.test";

fn client() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A server on `addr` answering its own address and counting what it got.
async fn counting(addr: SocketAddr, hits: Arc<AtomicUsize>) -> Upstream {
    let id = addr.to_string();
    Upstream::start_on(addr, move |_req| {
        hits.fetch_add(1, Ordering::Relaxed);
        let id = id.clone();
        async move { Response::new(full(id)) }
    })
    .await
}

/// A port free on 127.0.0.1, .2 and .3 (servers of one name share the URL's port).
async fn shared_port() -> u16 {
    loop {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let free = |ip: &str| std::net::TcpListener::bind((ip, port)).is_ok();
        if free("127.0.0.2") && free("127.0.0.3") {
            return port;
        }
    }
}

async fn send(c: &Http, url: &str) -> (StatusCode, String) {
    let resp = c.get(url.parse().unwrap()).await.expect("tollgate answers");
    let status = resp.status();
    let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn metric(tg: &Tollgate, line_start: &str) -> Option<f64> {
    let text = tg.shared.load().metrics().encode(None);
    text.lines().find(|l| l.starts_with(line_start)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Starts tollgate on `yaml` and waits, as `tollgate run` does, for its names' first answers.
async fn start(yaml: &str) -> Tollgate {
    let tg = Tollgate::start(yaml).await;
    let missing = tg.shared.load().first_answers(Duration::from_secs(10)).await;
    assert!(missing.is_empty(), "{missing:?}");
    tg
}

fn yaml(dns: SocketAddr, servers: &str) -> String {
    format!(
        "dns: {{ nameservers: [\"{dns}\"], min_ttl: 200ms, timeout: 500ms }}
upstreams:
  app:
    servers:
{servers}    balance: round_robin
routes:
  - name: app
    upstream: app
"
    )
}

/// Sends requests until `cond` holds on the bodies seen since the call (bounded: 30 s).
async fn until(c: &Http, url: &str, what: &str, mut cond: impl FnMut(&[String]) -> bool) -> Duration {
    let start = Instant::now();
    let mut seen = Vec::new();
    loop {
        let (s, body) = send(c, url).await;
        assert_eq!(s, StatusCode::OK, "{body}");
        seen.push(body);
        if seen.len() > 20 {
            seen.remove(0);
        }
        if cond(&seen) {
            return start.elapsed();
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{what}: last answers {seen:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Requests sent in a loop on another task; every answer that is not a 200 is counted.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Load {
    fn start(url: String) -> Load {
        let (stop, sent, failed): (_, Arc<AtomicUsize>, Arc<AtomicUsize>) =
            (Arc::new(AtomicBool::new(false)), Arc::default(), Arc::default());
        let (s, n, f) = (Arc::clone(&stop), Arc::clone(&sent), Arc::clone(&failed));
        let task = tokio::spawn(async move {
            let c = client();
            while !s.load(Ordering::Relaxed) {
                let ok = matches!(c.get(url.parse().unwrap()).await, Ok(r) if r.status() == StatusCode::OK);
                n.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    f.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Load { stop, sent, failed, task }
    }

    async fn finish(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        (self.sent.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_gives_a_server_per_address_and_follows_its_records_under_load() {
    let port = shared_port().await;
    let addr = |ip: &str| -> SocketAddr { format!("{ip}:{port}").parse().unwrap() };
    let hits: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
    let _a = counting(addr("127.0.0.1"), hits[0].clone()).await;
    let _b = counting(addr("127.0.0.2"), hits[1].clone()).await;
    let _c = counting(addr("127.0.0.3"), hits[2].clone()).await;
    let dns = Dns::start(&[("127.0.0.1", NAME), ("127.0.0.2", NAME)], &[], 1);
    let tg = start(&yaml(dns.addr, &format!("      - {{ url: \"http://{NAME}:{port}\", resolve: true }}\n"))).await;
    let c = client();
    let url = tg.url("/x");
    let (a, b, cc) = (addr("127.0.0.1").to_string(), addr("127.0.0.2").to_string(), addr("127.0.0.3").to_string());
    // Both addresses serve, in turn.
    until(&c, &url, "both addresses take requests", |s| s.contains(&a) && s.contains(&b)).await;
    assert_eq!(metric(&tg, "tollgate_upstream_dns_servers{upstream=\"app\""), Some(2.0));

    // Under load: .1 leaves, .3 joins; not one request fails.
    let load = Load::start(url.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    dns.set_hosts(&[("127.0.0.2", NAME), ("127.0.0.3", NAME)]);
    let took = until(&c, &url, "the new record set is followed", |s| {
        s.len() >= 10 && s[s.len() - 10..].iter().all(|x| *x != a) && s.contains(&cc)
    })
    .await;
    let (sent, failed) = load.finish().await;
    assert_eq!(failed, 0, "{failed} of {sent} requests failed while the servers changed");
    assert!(sent > 20, "the load ran: {sent} requests");
    // The TTL is 1 s and the change needs one lookup after it: within a few seconds, even on
    // a loaded machine (the exact schedule is unit-tested with the floor and ceiling).
    assert!(took < Duration::from_secs(10), "the change took {took:?}\n{}", dns.log());
    eprintln!("a record change reached the group {took:?} after dnsmasq had it (TTL 1 s)");
    let a_before = hits[0].load(Ordering::Relaxed);
    for _ in 0..20 {
        let (s, body) = send(&c, &url).await;
        assert_eq!(s, StatusCode::OK);
        assert!(body == b || body == cc, "{body}");
    }
    assert_eq!(hits[0].load(Ordering::Relaxed), a_before, "the removed address gets nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srv_records_give_each_server_its_port_and_weight() {
    let hits: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::default()).collect();
    let x = counting("127.0.0.1:0".parse().unwrap(), hits[0].clone()).await;
    let y = counting("127.0.0.1:0".parse().unwrap(), hits[1].clone()).await;
    let srv_name = "_http._tcp.api.tollgate.test";
    let srv = vec![
        format!("{srv_name},x.tollgate.test,{},0,3", x.addr.port()),
        format!("{srv_name},x.tollgate.test,{},0,1", y.addr.port()),
        // A lower-priority (higher value) record is not used while the others exist.
        format!("{srv_name},x.tollgate.test,9,1,50"),
    ];
    let dns = Dns::start(&[("127.0.0.1", "x.tollgate.test")], &srv, 30);
    let tg = start(&yaml(dns.addr, &format!("      - {{ url: \"http://{srv_name}\", resolve: srv }}\n"))).await;
    let c = client();
    let url = tg.url("/x");
    until(&c, &url, "the SRV servers take requests", |s| !s.is_empty()).await;
    for h in &hits {
        h.store(0, Ordering::Relaxed);
    }
    for _ in 0..400 {
        assert_eq!(send(&c, &url).await.0, StatusCode::OK);
    }
    let (nx, ny) = (hits[0].load(Ordering::Relaxed), hits[1].load(Ordering::Relaxed));
    // Weighted round robin over weights 3 and 1: exactly 300 and 100.
    assert_eq!((nx, ny), (300, 100), "{}", dns.log());
    let doc = tg.shared.load();
    let g = doc.groups().next().unwrap();
    let urls: Vec<String> = g.servers().iter().map(|s| s.url.clone()).collect();
    assert_eq!(urls.len(), 2, "{urls:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_dns_server_keeps_the_last_good_servers_across_a_reload() {
    let port = shared_port().await;
    let addr = |ip: &str| -> SocketAddr { format!("{ip}:{port}").parse().unwrap() };
    let hits: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
    let _a = counting(addr("127.0.0.1"), hits[0].clone()).await;
    let _b = counting(addr("127.0.0.2"), hits[1].clone()).await;
    let _c = counting(addr("127.0.0.3"), hits[2].clone()).await;
    let mut dns = Dns::start(&[("127.0.0.1", NAME), ("127.0.0.2", NAME)], &[], 1);
    let text = yaml(dns.addr, &format!("      - {{ url: \"http://{NAME}:{port}\", resolve: true }}\n"));
    let tg = start(&text).await;
    let c = client();
    let url = tg.url("/x");
    let (a, b) = (addr("127.0.0.1").to_string(), addr("127.0.0.2").to_string());
    until(&c, &url, "both addresses take requests", |s| s.contains(&a) && s.contains(&b)).await;

    dns.stop();
    let failed = "tollgate_upstream_dns_resolutions_total{upstream=\"app\",name=\"api.tollgate.test:";
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&tg, failed).is_none_or(|_| {
        let text = tg.shared.load().metrics().encode(None);
        !text.lines().any(|l| l.contains("result=\"failed\"") && !l.ends_with(" 0"))
    }) {
        assert!(Instant::now() < deadline, "no failed lookup was counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The last good set stays, and says so.
    until(&c, &url, "both addresses still serve", |s| s.contains(&a) && s.contains(&b)).await;
    assert_eq!(metric(&tg, "tollgate_upstream_dns_stale{upstream=\"app\""), Some(1.0));

    // A reload while DNS is down starts from the servers the old config had found.
    let old = tg.shared.load_full();
    let config = tollgate::config::Config::from_yaml(std::path::Path::new("test.yaml"), &text).unwrap();
    let new = tollgate::Proxy::build(config, old.clock().clone(), old.metrics().clone(), Some(&old));
    tg.shared.store(Arc::new(new));
    drop(old);
    for _ in 0..10 {
        let (s, body) = send(&c, &url).await;
        assert_eq!(s, StatusCode::OK, "after the reload: {body}");
    }

    // DNS back with another address: the group follows it.
    let cc = addr("127.0.0.3").to_string();
    dns.restart(&[("127.0.0.3", NAME)], &[]);
    until(&c, &url, "the group follows DNS again", |s| s.len() >= 5 && s[s.len() - 5..].iter().all(|x| *x == cc)).await;
    assert_eq!(metric(&tg, "tollgate_upstream_dns_stale{upstream=\"app\""), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_never_resolved_answers_503_and_says_why() {
    let dns = Dns::start(&[("127.0.0.1", "other.tollgate.test")], &[], 1);
    let tg =
        Tollgate::start(&yaml(dns.addr, "      - { url: \"http://missing.tollgate.test:8080\", resolve: true }\n"))
            .await;
    let c = client();
    let url = tg.url("/x");
    let missing = "tollgate_upstream_dns_resolutions_total{upstream=\"app\",name=\"missing.tollgate.test:8080\",result=\"failed\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&tg, missing).unwrap_or(0.0) < 1.0 {
        assert!(Instant::now() < deadline, "the lookup never failed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (s, body) = send(&c, &url).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("no server yet") && body.contains("not resolved"), "{body}");
    let missing = tg.shared.load().first_answers(Duration::from_secs(5)).await;
    assert_eq!(missing, ["upstream `app`: `missing.tollgate.test:8080`"]);
}

/// `tollgate run` waits for the names' first answers; with `dns.required`, a name without
/// one stops the start with a message naming it, and without it the start goes on.
#[test]
fn dns_required_makes_a_name_without_address_fatal_at_start() {
    let dns = Dns::start(&[("127.0.0.1", "other.tollgate.test")], &[], 1);
    let dir = std::env::temp_dir().join(format!("tollgate-dns-required-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |required: bool| {
        let text = format!(
            "listen: 127.0.0.1:0\ndns: {{ nameservers: [\"{}\"], timeout: 300ms, required: {required} }}\nupstreams:\n  app:\n    servers: [{{ url: \"http://missing.tollgate.test:8080\", resolve: true }}]\nroutes:\n  - upstream: app\n",
            dns.addr
        );
        let path = dir.join(format!("required-{required}.yaml"));
        std::fs::write(&path, text).unwrap();
        std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("-c")
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let out = run(true).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("upstream `app`: `missing.tollgate.test:8080` gave no address at start"), "{err}");
    // Without `required`, it serves (and logs the name): still running after its wait.
    let mut child = run(false);
    std::thread::sleep(Duration::from_secs(3));
    assert!(child.try_wait().unwrap().is_none(), "tollgate stopped without dns.required");
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
