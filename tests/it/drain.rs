//! SIGTERM under load, with the binary: requests in flight finish, connections the kernel
//! had already accepted are served, new ones are refused once the listener closes, nothing
//! is reset, and the process exits 0.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{full, Upstream};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// One request on a fresh connection; `Err` describes a connection that was accepted and
/// then failed, `Ok(None)` a refused connect.
async fn request(port: u16) -> Result<Option<String>, String> {
    let s = match TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Ok(None),
        Err(e) => return Err(format!("connect: {e}")),
    };
    request_on(s).await.map(Some)
}

/// One request with `Connection: close` on `s`.
async fn request_on(mut s: TcpStream) -> Result<String, String> {
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.map_err(|e| format!("write: {e}"))?;
    let mut out = Vec::new();
    match tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut out)).await {
        Err(_) => Err("no answer within 15 s".to_owned()),
        Ok(Err(e)) => Err(format!("read: {e} after {} bytes", out.len())),
        Ok(Ok(_)) => {
            let text = String::from_utf8_lossy(&out).into_owned();
            if text.starts_with("HTTP/1.1 200") && text.ends_with("done") {
                Ok(text)
            } else {
                Err(format!("unexpected answer: {text:?}"))
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_finishes_every_request_and_resets_none() {
    let up = Upstream::start(|_req| async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        Response::new(full("done"))
    })
    .await;
    let path = std::env::temp_dir().join(format!("tollgate-drain-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        format!("server: {{ grace_period: 10s }}\nupstreams: {{ up: {{ url: http://{} }} }}\nroutes: [{{ upstream: up }}]\n", up.addr),
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(BIN)
        .arg("-c")
        .arg(&path)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let up_at = Instant::now() + Duration::from_secs(10);
    while !matches!(request(port).await, Ok(Some(_))) {
        assert!(Instant::now() < up_at, "tollgate did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let termed = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let spanning = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..32)
        .map(|_| {
            let (termed, served, spanning, failures) =
                (termed.clone(), served.clone(), spanning.clone(), failures.clone());
            tokio::spawn(async move {
                // Each client sends requests until its connect is refused.
                loop {
                    let before_term = !termed.load(Ordering::SeqCst);
                    match request(port).await {
                        Ok(None) => return,
                        Ok(Some(_)) => {
                            served.fetch_add(1, Ordering::SeqCst);
                            if before_term && termed.load(Ordering::SeqCst) {
                                spanning.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        Err(e) => failures.lock().unwrap().push(e),
                    }
                }
            })
        })
        .collect();
    // Connections open before the signal whose request comes after it: the listener had
    // accepted them, so they are served, not reset.
    let mut early = Vec::new();
    for _ in 0..8 {
        early.push(TcpStream::connect(("127.0.0.1", port)).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    termed.store(true, Ordering::SeqCst);
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let early: Vec<_> = early.into_iter().map(|s| tokio::spawn(request_on(s))).collect();
    for e in early {
        let answer = e.await.unwrap();
        assert!(answer.is_ok(), "a connection accepted before SIGTERM was not served: {answer:?}");
    }

    for c in clients {
        tokio::time::timeout(Duration::from_secs(20), c).await.expect("every client sees the listener close").unwrap();
    }
    let exit_by = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > exit_by {
            let _ = child.kill();
            panic!("tollgate did not exit within 15 s of SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = std::fs::remove_file(&path);
    let failures = failures.lock().unwrap();
    assert!(failures.is_empty(), "{} requests failed: {:?}", failures.len(), &failures[..failures.len().min(5)]);
    assert!(spanning.load(Ordering::SeqCst) > 0, "no request was in flight across the signal");
    assert!(served.load(Ordering::SeqCst) > 32, "hardly any load: {}", served.load(Ordering::SeqCst));
    assert!(status.success(), "{status:?}");
}
