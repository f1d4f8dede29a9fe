//! Reloading a running proxy (issue 22 §4, issue 13 defect 5, issue 14 "live operations"):
//! the build runs off the async runtime, a build that fails in any way leaves the reloader and
//! the running config alive, restart-only fields keep their running values, `log.format`
//! changes live, and a load loop across ten reloads loses no request and no limiter state.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use http_body_util::BodyExt;
use tollgate::config::Config;
use tollgate::Reloader;

use crate::hostile_config::TempFile;
use crate::support::{full, get, get_with, h1, Tollgate};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

fn body(text: &str) -> String {
    format!("upstreams: {{ d: {{ respond: {{ body: {text} }} }} }}\nroutes: [{{ name: all, upstream: d }}]\n")
}

/// A valid config of about `bytes`: many routes, the last one answering `body`.
fn large(bytes: usize, text: &str) -> String {
    let mut out = format!("upstreams: {{ d: {{ respond: {{ body: {text} }} }} }}\nroutes:\n");
    let mut i = 0;
    while out.len() < bytes && i < tollgate::config::MAX_ROUTES - 1 {
        out.push_str(&format!(
            "  - name: route-{i}\n    match: {{ host: 'tenant-{i}.api.example.com', path_prefix: /v1/tenants/{i}/, methods: [GET, HEAD, POST] }}\n    upstream: d\n    strip_prefix: true\n    ratelimit_headers: false\n"
        ));
        i += 1;
    }
    out.push_str("  - { name: all, upstream: d }\n");
    out
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_during_a_reload_is_answered_while_it_builds() {
    // One runtime thread: if the reload parsed on it, nothing else could run meanwhile.
    let tg = Tollgate::start(&body("v1")).await;
    let file = TempFile::new(&large(2 << 20, "v2"));
    let (release, wait) = std::sync::mpsc::channel::<()>();
    let wait = Mutex::new(wait);
    let released = Arc::new(AtomicBool::new(false));
    let seen = released.clone();
    // The build (it runs `adjust`) waits until the test has had its answer, at most 10 s.
    let adjust = move |_: &mut Config| {
        let ok = wait.lock().unwrap().recv_timeout(Duration::from_secs(10)).is_ok();
        seen.store(ok, Ordering::SeqCst);
    };
    let reloader = Arc::new(Reloader::new(file.0.clone(), tg.shared.clone(), Box::new(adjust)));
    let r = reloader.clone();
    let reload = tokio::spawn(async move { r.reload().await });
    tokio::task::yield_now().await;
    let (status, _, answer) = get(tg.addr, "/").await;
    assert_eq!(
        (status, &answer[..]),
        (StatusCode::OK, &b"v1"[..]),
        "answered by the running config, during the reload"
    );
    let _ = release.send(());
    let done = reload.await.unwrap().unwrap();
    assert_eq!(done.routes, tg.shared.load().config.routes.len());
    assert!(released.load(Ordering::SeqCst), "the build gave up waiting: the request was not answered while it ran");
    assert_eq!(get(tg.addr, "/").await.2, "v2");
}

#[tokio::test]
async fn the_reloader_survives_a_panic_while_building() {
    let file = TempFile::new(&body("v1"));
    let tg = Tollgate::start(&body("v1")).await;
    let panicked = Arc::new(AtomicBool::new(false));
    let flag = panicked.clone();
    let adjust = move |c: &mut Config| {
        if c.routes.iter().any(|r| r.name == "boom") {
            flag.store(true, Ordering::SeqCst);
            panic!("a build that panics");
        }
    };
    let reloader = Reloader::new(file.0.clone(), tg.shared.clone(), Box::new(adjust));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reloader.run(Duration::from_millis(20), async move {
        let _ = stopped.await;
    }));
    // The task may start after a first write (and take that as the known version): rewrite
    // with a new length each time until the reloader has seen it.
    let mut n = 0;
    let mut rewrite = |text: &str| {
        n += 1;
        std::fs::write(&file.0, format!("{text}{}\n", " ".repeat(n))).unwrap();
    };
    let boom = body("v2").replace("name: all", "name: boom");
    let mut built = false;
    for _ in 0..200 {
        rewrite(&boom);
        if eventually_within(Duration::from_millis(50), || async { panicked.load(Ordering::SeqCst) }).await {
            built = true;
            break;
        }
    }
    assert!(built, "the boom file was never built");
    assert_eq!(get(tg.addr, "/").await.2, "v1", "the running config keeps serving");
    // A later good file is still picked up: the reloader lives on.
    rewrite(&body("v3-after-the-panic"));
    let served = eventually(|| async { get(tg.addr, "/").await.2 == "v3-after-the-panic" }).await;
    assert!(served, "the reloader died with the panic");
    assert!(!task.is_finished());
    let _ = stop.send(());
}

/// Polls `check` every 20 ms for up to 10 s.
async fn eventually<F, Fut>(check: F) -> bool
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_within(Duration::from_secs(10), check).await
}

async fn eventually_within<F, Fut>(limit: Duration, check: F) -> bool
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn restart_only_fields_keep_their_running_values_and_config_shows_them() {
    let first = format!("listen: 127.0.0.1:7001\nadmin: 127.0.0.1:7002\n{}", body("v1"));
    let file = TempFile::new(&first);
    let tg = Tollgate::start(&first).await;
    let admin = tg.start_admin().await;
    let reloader = Reloader::new(file.0.clone(), tg.shared.clone(), Box::new(|_| {}));
    let next = format!(
        "listen: 127.0.0.1:7003\nlog: {{ format: json, access: true }}\nserver: {{ header_read_timeout: 5s }}\n{}",
        body("v2")
    );
    std::fs::write(&file.0, next).unwrap();
    let done = reloader.reload().await.unwrap();
    // Without a live log switch (none in-process), the format needs a restart too.
    assert_eq!(done.restart_needed, ["listen", "admin", "log.format"]);
    assert_eq!(get(tg.addr, "/").await.2, "v2", "everything else applies");
    let doc: serde_json::Value = serde_json::from_slice(&get(admin, "/config").await.2).unwrap();
    assert_eq!(doc["listen"][0]["addr"], "127.0.0.1:7001", "{doc}");
    assert_eq!(doc["admin"]["addr"], "127.0.0.1:7002", "{doc}");
    assert_eq!(doc["log"], serde_json::json!({ "format": "text", "access": true, "access_keys": false }), "{doc}");
    assert_eq!(doc["server"]["header_read_timeout"], "5s", "{doc}");
    // The same file again: still only the restart-only fields differ from what runs.
    let again = reloader.reload().await.unwrap();
    assert_eq!(again.restart_needed, ["listen", "admin", "log.format"]);
    // A live switch makes the format apply.
    let switched = Arc::new(Mutex::new(Vec::new()));
    let log = switched.clone();
    let reloader =
        Reloader::new(file.0.clone(), tg.shared.clone(), Box::new(|_| {})).with_log_switch(Box::new(move |f| {
            log.lock().unwrap().push(f);
            Ok(())
        }));
    assert_eq!(reloader.reload().await.unwrap().restart_needed, ["listen", "admin"]);
    assert_eq!(*switched.lock().unwrap(), [tollgate::config::LogFormat::Json]);
    let doc: serde_json::Value = serde_json::from_slice(&get(admin, "/config").await.2).unwrap();
    assert_eq!(doc["log"]["format"], "json", "{doc}");
}

/// The binary on a free port with stderr collected line by line.
struct Running {
    child: Child,
    port: u16,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Running {
    fn start(file: &TempFile) -> Running {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut child = Command::new(BIN)
            .arg("-c")
            .arg(&file.0)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = lines.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let running = Running { child, port, lines };
        assert!(running.wait_for(|_| running.get().is_some()), "tollgate did not start");
        running
    }

    fn get(&self) -> Option<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    }

    fn hup(&self) {
        let _ = Command::new("kill").args(["-HUP", &self.child.id().to_string()]).status();
    }

    fn stderr(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Polls `check` (given the stderr lines) every 50 ms for up to 10 s.
    fn wait_for(&self, check: impl Fn(&[String]) -> bool) -> bool {
        for _ in 0..200 {
            if check(&self.stderr()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn failures(lines: &[String]) -> usize {
    lines.iter().filter(|l| l.contains("config reload failed")).count()
}

#[test]
fn refused_reloads_are_logged_without_secrets_and_the_reloader_lives_on() {
    let f = TempFile::new(&body("first"));
    let tg = Running::start(&f);
    assert!(tg.get().is_some_and(|b| b.ends_with("first")));
    // A Redis URL that fails validation: the log line must not carry its password.
    std::fs::write(&f.0, format!("redis: {{ url: 'redis://app:hunter2@' }}\n{}", body("bad"))).unwrap();
    tg.hup();
    assert!(tg.wait_for(|l| failures(l) >= 1), "{:?}", tg.stderr());
    // A value that panicked while building (and killed the reloader for good).
    let panicking =
        "upstreams: { d: { respond: { body: worse } } }\nroutes: [{ upstream: d, concurrency: 2305843009213693952 }]\n";
    std::fs::write(&f.0, panicking).unwrap();
    tg.hup();
    assert!(tg.wait_for(|l| failures(l) >= 2), "{:?}", tg.stderr());
    assert!(tg.get().is_some_and(|b| b.ends_with("first")), "the running config keeps serving");
    std::fs::write(&f.0, body("second")).unwrap();
    tg.hup();
    let mut reloaded = false;
    for _ in 0..200 {
        if tg.get().is_some_and(|b| b.ends_with("second")) {
            reloaded = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let lines = tg.stderr();
    assert!(reloaded, "the later good file was not served: {lines:?}");
    assert!(lines.iter().all(|l| !l.contains("hunter2")), "{lines:?}");
    assert!(lines.iter().any(|l| l.contains("redis://app:***@")), "{lines:?}");
    assert!(lines.iter().all(|l| !l.contains("panicked")), "{lines:?}");
}

#[test]
fn log_format_changes_on_reload() {
    let text = |format: &str| format!("log: {{ format: {format}, access: true }}\n{}", body("hi"));
    let f = TempFile::new(&text("text"));
    let tg = Running::start(&f);
    let access = |l: &String| l.contains("tollgate::access");
    assert!(tg.wait_for(|l| l.iter().any(access)), "{:?}", tg.stderr());
    assert!(serde_json::from_str::<serde_json::Value>(tg.stderr().iter().find(|l| access(l)).unwrap()).is_err());
    std::fs::write(&f.0, text("json")).unwrap();
    tg.hup();
    assert!(tg.wait_for(|l| l.iter().any(|l| l.contains("config reloaded"))), "{:?}", tg.stderr());
    let before = tg.stderr().len();
    assert!(tg.get().is_some());
    let json_access =
        |l: &String| serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| v["target"] == "tollgate::access");
    assert!(tg.wait_for(|l| l[before..].iter().any(json_access)), "still not JSON: {:?}", &tg.stderr()[before..]);
    let lines = tg.stderr();
    assert!(!lines.iter().any(|l| l.contains("log.format")), "no restart warning when it applied: {lines:?}");
}

const UNDER_LOAD: &str = "
upstreams:
  d: { respond: { body: v0 } }
routes:
  - name: load
    match: { path_prefix: /load }
    upstream: d
  - name: api
    upstream: d
    limits:
      - { name: per-user, algorithm: token_bucket, rate: 1/h, burst: 3, key: header:x-user }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_reloads_under_load_lose_no_request_and_no_limit_state() {
    let file = TempFile::new(UNDER_LOAD);
    let tg = Tollgate::start(UNDER_LOAD).await;
    let reloader = Reloader::new(file.0.clone(), tg.shared.clone(), Box::new(|_| {}));
    let ann = [("x-user", "ann")];
    for expected in [StatusCode::OK, StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        assert_eq!(get_with(tg.addr, "/", &ann).await.0, expected);
    }
    // Four keep-alive connections, one request each every 10 ms: about 400 requests/s.
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut loops = Vec::new();
    for _ in 0..4 {
        let (addr, stop, sent, failed) = (tg.addr, stop.clone(), sent.clone(), failed.clone());
        loops.push(tokio::spawn(async move {
            let mut conn = h1(addr).await;
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                sent.fetch_add(1, Ordering::SeqCst);
                let req = http::Request::get("/load").header("host", "x").body(full("")).unwrap();
                let ok = match conn.send_request(req).await {
                    Ok(resp) => {
                        let status = resp.status();
                        let body = resp.into_body().collect().await.map(|b| b.to_bytes());
                        status == StatusCode::OK && body.is_ok_and(|b| b.starts_with(b"v"))
                    }
                    Err(_) => false,
                };
                if !ok {
                    failed.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    let invalid = [
        "routes: [}\n".to_owned(),
        format!("routes: {}\n", "[".repeat(10_000)),
        UNDER_LOAD.replace("upstream: d\n    limits", "upstream: nowhere\n    limits"),
        UNDER_LOAD.replace(
            "    match: { path_prefix: /load }",
            "    concurrency: 2305843009213693952\n    match: { path_prefix: /load }",
        ),
        UNDER_LOAD.replace("burst: 3,", "burst: 250000000000, cost: 250000000000,").replace("1/h", "1/d"),
    ];
    for (i, bad) in invalid.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::fs::write(&file.0, bad).unwrap();
        assert!(reloader.reload().await.is_err(), "invalid file {i} was accepted");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let good = UNDER_LOAD.replace("body: v0", &format!("body: v{}", i + 1));
        std::fs::write(&file.0, good).unwrap();
        reloader.reload().await.unwrap();
        assert_eq!(get_with(tg.addr, "/", &ann).await.0, StatusCode::TOO_MANY_REQUESTS, "ann got a fresh bucket");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    for l in loops {
        l.await.unwrap();
    }
    let (sent, failed) = (sent.load(Ordering::SeqCst), failed.load(Ordering::SeqCst));
    assert_eq!(failed, 0, "{failed} of {sent} requests failed");
    assert!(sent >= 100, "the load loop ran: {sent} requests");
    assert_eq!(get(tg.addr, "/load").await.2, "v5");
    assert_eq!(get_with(tg.addr, "/", &[("x-user", "bob")]).await.0, StatusCode::OK, "the limit itself still admits");
}
