//! A real browser for tests: headless Chromium driven over WebDriver (chromedriver), the way a
//! page uses tollgate (the dashboard, a cross-origin API). CI must have both (`scripts/test.sh`
//! installs them); elsewhere a test that needs them is skipped with the reason.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http::{Method, Request};
use http_body_util::BodyExt;
use serde_json::{json, Value};

use super::{full, h1};

/// The first of `names` found in `PATH`.
fn which(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).flat_map(|dir| names.iter().map(move |n| dir.join(n))).find(|p| p.is_file())
}

/// chromedriver, killed on drop.
pub struct Driver {
    child: Child,
    pub addr: SocketAddr,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One WebDriver command (W3C JSON over HTTP); the reply's `value`.
pub async fn webdriver(addr: SocketAddr, method: Method, path: &str, body: Option<Value>) -> Value {
    let mut send = h1(addr).await;
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(full(body.map(|b| b.to_string()).unwrap_or_default()))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let reply: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}: {bytes:?}"));
    assert!(status.is_success(), "WebDriver {path}: {status} {reply}");
    reply["value"].clone()
}

/// Starts chromedriver on a free port, or says why it cannot: CI must have it
/// (`scripts/test.sh` installs it); elsewhere the test is skipped with the reason.
pub async fn driver() -> Option<(Driver, PathBuf)> {
    let (Some(chromedriver), Some(chromium)) =
        (which(&["chromedriver"]), which(&["chromium", "chromium-browser", "google-chrome"]))
    else {
        let why = "headless Chromium and chromedriver are not installed (apt-get install chromium chromium-driver; scripts/test.sh does it)";
        assert!(std::env::var_os("CI").is_none(), "the browser test cannot run: {why}");
        eprintln!("skipped: {why}");
        return None;
    };
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let child = Command::new(chromedriver)
        .arg(format!("--port={}", addr.port()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let driver = Driver { child, addr };
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(Instant::now() < deadline, "chromedriver did not start listening on {addr}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Some((driver, chromium))
}

/// A headless Chromium session (its id), with the arguments that work in a container.
pub async fn session(driver: SocketAddr, chromium: &std::path::Path) -> String {
    let args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,800"];
    let caps = json!({ "capabilities": { "alwaysMatch": { "goog:chromeOptions": {
        "binary": chromium.to_string_lossy(), "args": args } } } });
    let session = webdriver(driver, Method::POST, "/session", Some(caps)).await;
    session["sessionId"].as_str().expect("a session id").to_owned()
}
