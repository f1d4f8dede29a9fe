//! The `tollgate` binary: check, version, and a clean exit on SIGTERM.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

fn write_config(text: &str) -> tempfile_path::TempPath {
    tempfile_path::TempPath::new(text)
}

/// A file removed on drop (no extra crate needed for one temp file).
mod tempfile_path {
    pub struct TempPath(pub std::path::PathBuf);
    impl TempPath {
        pub fn new(text: &str) -> TempPath {
            use std::sync::atomic::{AtomicU32, Ordering};
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::env::temp_dir().join(format!(
                "tollgate-test-{}-{}.yaml",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&p, text).unwrap();
            TempPath(p)
        }
    }
    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

#[test]
fn check_accepts_the_shipped_config_and_lists_routes() {
    let out =
        Command::new(BIN).args(["check", "-c", concat!(env!("CARGO_MANIFEST_DIR"), "/proxy.yaml")]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("config ok") && text.contains("everything-else"), "{text}");
}

#[test]
fn check_rejects_a_broken_config_with_exit_2_and_position() {
    let f = write_config("upstreams:\n  demo: { respond: {} }\nroutes:\n  - upstream: dmeo\n");
    let out = Command::new(BIN).arg("check").arg("-c").arg(&f.0).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(":4:15: routes[0].upstream: unknown upstream `dmeo`"), "{err}");
}

#[test]
fn check_rejects_a_key_given_twice_with_exit_2_and_its_position() {
    // Issue 31 (6): the second `ok` used to win, and a field given twice was put at 1:1.
    for (text, want) in [
        (
            "upstreams: { ok: { respond: {} }, ok: { url: http://x:1 } }\nroutes: [{ upstream: ok }]\n",
            ":1:35: upstreams.ok: `ok` is given twice in this mapping (first on line 1)",
        ),
        (
            "upstreams:\n  ok: { respond: {} }\nroutes: [{ upstream: ok }]\nroutes: []\n",
            ":4:1: routes: `routes` is given twice in this mapping (first on line 3)",
        ),
    ] {
        let f = write_config(text);
        let out = Command::new(BIN).arg("check").arg("-c").arg(&f.0).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{err}");
    }
}

#[test]
fn version_flag_prints_version() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn exits_zero_on_sigterm() {
    let f = write_config("upstreams: { d: { respond: { body: up } } }\nroutes: [{ upstream: d }]\n");
    let (mut child, _port, first) = serve(&f);
    assert!(first.ends_with("up"), "{first}");
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let mut status = None;
    for _ in 0..200 {
        if let Some(s) = child.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = status.unwrap_or_else(|| {
        let _ = child.kill();
        panic!("tollgate did not exit within 10 s of SIGTERM");
    });
    assert!(status.success(), "{status:?}");
}

/// Starts the binary on a free port with config `f`; returns it once it answers, with the port
/// and its first answer.
fn serve(f: &tempfile_path::TempPath) -> (std::process::Child, u16, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(BIN)
        .arg("-c")
        .arg(&f.0)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    for _ in 0..100 {
        if let Some(body) = http_get(port) {
            return (child, port, body);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("tollgate did not start within 5 s");
}

fn http_get(port: u16) -> Option<String> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

#[test]
fn sighup_reloads_the_file() {
    let f = write_config("upstreams: { d: { respond: { body: first } } }\nroutes: [{ upstream: d }]\n");
    let (mut child, port, first) = serve(&f);
    assert!(first.ends_with("first"), "{first}");
    std::fs::write(&f.0, "upstreams: { d: { respond: { body: second } } }\nroutes: [{ upstream: d }]\n").unwrap();
    let _ = Command::new("kill").args(["-HUP", &child.id().to_string()]).status();
    let mut reloaded = false;
    for _ in 0..100 {
        if http_get(port).is_some_and(|b| b.ends_with("second")) {
            reloaded = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(reloaded, "the new body was not served within 5 s of SIGHUP");
}

#[test]
fn check_lists_served_names_warns_on_insecure_upstreams_and_refuses_expired_certificates() {
    let dir = crate::support::tls::Dir::new();
    let ca = crate::support::tls::Ca::new("ca");
    let (cert, key) = ca.issue(&["api.test", "*.api.test"]).write(&dir, "api");
    let (old_cert, old_key) = ca
        .issue_with(&["old.test"], |p| {
            p.not_before = rcgen::date_time_ymd(2019, 1, 1);
            p.not_after = rcgen::date_time_ymd(2020, 6, 30);
        })
        .write(&dir, "old");
    let yaml = |cert: &std::path::Path, key: &std::path::Path| {
        format!(
            "listen:\n  - addr: 127.0.0.1:8443\n    tls:\n      certificates: [{{ cert: '{}', key: '{}' }}]\n  - {{ addr: 127.0.0.1:8080, redirect_https: true }}\nupstreams:\n  up: {{ url: 'https://10.0.0.1', tls_insecure_skip_verify: true }}\nroutes: [{{ upstream: up }}]\n",
            cert.display(),
            key.display()
        )
    };
    let f = write_config(&yaml(&cert, &key));
    let out = Command::new(BIN).arg("check").arg("-c").arg(&f.0).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(text.contains("serves api.test, *.api.test"), "{text}");
    assert!(text.contains("listener 127.0.0.1:8080: HTTP, every request redirected to HTTPS"), "{text}");
    assert!(text.contains("warning: upstream `up`: tls_insecure_skip_verify"), "{text}");
    assert!(text.contains("-> up (https://10.0.0.1:443)"), "{text}");
    let f = write_config(&yaml(&old_cert, &old_key));
    let out = Command::new(BIN).arg("check").arg("-c").arg(&f.0).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("old.pem: the certificate expired on 2020-06-30"), "{err}");
    assert!(err.contains(":4:"), "the line of the certificates: {err}");
}

#[test]
fn check_refuses_a_header_rule_on_a_framing_field_with_exit_2_and_position() {
    let f = write_config(
        "upstreams:\n  d: { respond: {} }\nroutes:\n  - upstream: d\n    request_headers:\n      set: { transfer-encoding: chunked }\n",
    );
    let out = Command::new(BIN).arg("check").arg("-c").arg(&f.0).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(":6:33: routes[0].request_headers.set.transfer-encoding: `transfer-encoding` is a framing"),
        "{err}"
    );
}

/// The answer to `GET path` on `port`, as text.
fn http_get_path(port: u16, path: &str) -> String {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The value of metric line `name` on the admin port.
fn metric(admin: u16, name: &str) -> Option<i64> {
    let text = http_get_path(admin, "/metrics");
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn workers_share_the_listener_and_bound_connections_exactly() {
    let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let f = write_config(&format!(
        "admin: 127.0.0.1:{admin}\nserver: {{ workers: 3, max_connections: 4, header_read_timeout: 30s }}\nupstreams: {{ d: {{ respond: {{ body: up }} }} }}\nroutes: [{{ upstream: d }}]\n"
    ));
    let (mut child, port, first) = serve(&f);
    assert!(first.ends_with("up"), "{first}");
    let workers = std::fs::read_dir(format!("/proc/{}/task", child.id()))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("tollgate-worker"))
        .count();
    assert_eq!(workers, 2, "worker threads besides the main one");
    let settle = |open: i64| {
        for _ in 0..200 {
            if metric(admin, "tollgate_connections_open") == Some(open) {
                return;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("tollgate_connections_open never reached {open}");
    };
    settle(0);
    // Twelve connections at once, over three workers accepting side by side: exactly four are
    // kept (they wait for a head), the rest are closed at once.
    let idle: Vec<_> = (0..12).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    settle(4);
    let mut kept = 0;
    for mut s in &idle {
        use std::io::Read;
        s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        match s.read(&mut [0u8; 16]) {
            Ok(0) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => kept += 1,
            other => panic!("an idle connection read {other:?}"),
        }
    }
    assert_eq!(kept, 4, "connections kept open past max_connections: 4 over three workers");
    assert_eq!(metric(admin, "tollgate_connections_refused_total"), Some(8));
    drop(idle);
    settle(0);
    // Whichever worker takes a connection answers it.
    for _ in 0..30 {
        let answer = http_get_path(port, "/");
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("up"), "{answer}");
    }
    // The workers' sockets share the port with SO_REUSEPORT, but a second tollgate started on
    // it by mistake is refused rather than silently given a share of the connections.
    let second =
        Command::new(BIN).arg("-c").arg(&f.0).args(["--listen", &format!("127.0.0.1:{port}")]).output().unwrap();
    assert!(!second.status.success(), "a second instance started on a port in use");
    assert!(String::from_utf8_lossy(&second.stderr).contains(&format!("binding 127.0.0.1:{port}")), "{second:?}");
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}
