//! Memory per idle connection (issue 23), measured from outside as `benches/conns.sh` does:
//! the `tollgate` binary's RSS before and while it holds 1,000 idle keep-alive connections
//! that each made one request, and after they close. The bounds sit 1.5–2 times above
//! today's figures and below those of the code before issue 23's second pass. Nothing is
//! timed: the test waits as long as it takes for idle connections to be parked and for
//! memory to come back, up to a limit that only a broken build reaches. Also the RSS over a
//! churn of rate-limit keys, one new key per request (issue 31).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");
const CONNS: usize = 1_000;

struct Server {
    child: Child,
    port: u16,
    _config: std::path::PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self._config);
    }
}

impl Server {
    fn start(name: &str) -> Server {
        Server::start_with(
            name,
            "listen: 127.0.0.1:0
server: { keepalive_timeout: 600s, h2: { idle_timeout: 600s, ping_interval: 600s } }
upstreams: { ok: { respond: { status: 200, body: \"ok\\n\" } } }
routes: [{ name: all, upstream: ok }]
",
        )
    }

    fn start_with(name: &str, yaml: &str) -> Server {
        let config = std::env::temp_dir().join(format!("tollgate-memory-{name}-{}.yaml", std::process::id()));
        std::fs::write(&config, yaml).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(BIN)
            .arg("-c")
            .arg(&config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = Server { child, port, _config: config };
        for _ in 0..200 {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("tollgate did not start");
    }

    fn rss_kb(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

/// Sends `request` and reads until the answer's body (`ok\n`) has arrived.
fn ask(s: &mut TcpStream, request: &[u8], done: impl Fn(&[u8]) -> bool) {
    s.write_all(request).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !done(&got) {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed early: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
}

const H1: &[u8] = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n";

fn h1_done(got: &[u8]) -> bool {
    got.ends_with(b"ok\n")
}

fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = u32::try_from(payload.len()).unwrap().to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Preface, SETTINGS, and GET / on stream 1 (HPACK: indexed :method GET, :scheme http,
/// :path /, and :authority as a literal).
fn h2_request() -> Vec<u8> {
    let mut r = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    r.extend(h2_frame(4, 0, 0, &[]));
    r.extend(h2_frame(1, 0x5, 1, b"\x82\x86\x84\x01\x01x"));
    r
}

/// The answer's DATA frame (`ok\n`, the last one the server sends) has arrived.
fn h2_done(got: &[u8]) -> bool {
    got.ends_with(b"ok\n")
}

/// Holds `CONNS` idle connections and returns the RSS growth per connection in bytes, the
/// lowest seen while waiting (idle HTTP/1 connections are parked after a second); then
/// closes them and checks that the RSS comes back within half of its figure before them.
fn growth_per_conn(name: &str, request: &[u8], done: fn(&[u8]) -> bool) -> u64 {
    let server = Server::start(name);
    // What the first requests allocate once is not per connection.
    for _ in 0..20 {
        let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        ask(&mut s, request, done);
    }
    std::thread::sleep(Duration::from_millis(1500));
    let before = server.rss_kb();
    let mut held = Vec::with_capacity(CONNS);
    for _ in 0..CONNS {
        let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        ask(&mut s, request, done);
        if request.starts_with(b"PRI") {
            // The server's SETTINGS, acknowledged as a client does.
            s.write_all(&h2_frame(4, 1, 0, &[])).unwrap();
        }
        held.push(s);
    }
    let mut lowest = u64::MAX;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(500));
        lowest = lowest.min(server.rss_kb().saturating_sub(before) * 1024 / CONNS as u64);
    }
    // Every connection is still open: a closed one would make the figure meaningless.
    for s in &mut held {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("an idle connection was closed or sent bytes: {other:?}"),
        }
    }
    eprintln!("{name}: {lowest} bytes of RSS per idle connection");
    // Closed, they give their memory back: the RSS comes back near where it was (before
    // issue 23's second pass, an HTTP/1 spike left it ~1.6 times that figure here).
    drop(held);
    let bound = before * 3 / 2;
    let mut after = u64::MAX;
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(500));
        after = after.min(server.rss_kb());
        if after <= bound {
            break;
        }
    }
    eprintln!("{name}: RSS {before} kB before, {after} kB after the connections closed");
    assert!(after <= bound, "RSS {after} kB after the connections closed, {before} kB before them");
    lowest
}

#[test]
fn an_idle_http1_connection_costs_under_5_kib() {
    let per_conn = growth_per_conn("h1", H1, h1_done);
    // Before issue 23: ~34 kB (hyper's buffers held while idle); parked: ~7 kB; with a
    // small parked task and mimalloc's arenas committed as used: ~2.4 kB (debug build).
    assert!(per_conn < 5 * 1024, "{per_conn} bytes of RSS per idle HTTP/1 connection");
}

#[test]
fn an_idle_h2c_connection_costs_under_36_kib() {
    let per_conn = growth_per_conn("h2", &h2_request(), h2_done);
    // ~40 kB before mimalloc's arenas were committed as used, ~23 kB since; most of it h2's
    // codec buffers (see BENCHMARKS.md, issue 23).
    assert!(per_conn < 36 * 1024, "{per_conn} bytes of RSS per idle h2c connection");
}

/// Sends `n` requests pipelined on `s`, each with a key of its own (`x-k: {first + i}`), and
/// reads their `n` answers.
fn churn(s: &mut TcpStream, first: u64, n: u64) {
    let mut batch = Vec::with_capacity(64 * n as usize);
    for k in first..first + n {
        batch.extend_from_slice(format!("GET / HTTP/1.1\r\nhost: x\r\nx-k: {k}\r\n\r\n").as_bytes());
    }
    let answers = |got: &[u8]| got.windows(7).filter(|w| w == b"\r\n\r\nok\n").count() as u64;
    ask(s, &batch, |got| answers(got) >= n);
}

/// Issue 31 (4): a new key per request, each idle 100 ms later. The in-process store forgets
/// the idle ones, so the RSS stays level instead of growing with every key ever seen (before,
/// each key left its entry and its log behind: 24 -> 43 MB over these 108,000 keys), and the
/// key gauge counts only the keys that still hold state. Level means within a few hundred kB
/// now, on a loaded machine too: the 4 MB bound is ten times that. (Under load this test
/// used to grow 3-8 MB: a pause longer than the window left a shard swept empty, and such a
/// shard never swept again; see `limit::store::local`.)
#[test]
fn a_churn_of_new_keys_does_not_grow_the_rss() {
    let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server = Server::start_with(
        "churn",
        &format!(
            "listen: 127.0.0.1:0
admin: 127.0.0.1:{admin}
upstreams: {{ ok: {{ respond: {{ status: 200, body: \"ok\\n\" }} }} }}
routes:
  - name: all
    upstream: ok
    limits: [{{ name: k, algorithm: sliding_log, rate: 1/100ms, key: \"header:x-k\" }}]
"
        ),
    );
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    let mut next = 0;
    let mut keys = |s: &mut TcpStream, batches: u64| {
        for _ in 0..batches {
            churn(s, next, 200);
            next += 200;
        }
    };
    // Warm-up (buffers, the allocator's pages), then a run long enough for the RSS to level.
    keys(&mut s, 10);
    let early = server.rss_kb();
    keys(&mut s, 290);
    let level = server.rss_kb();
    keys(&mut s, 250);
    let after = server.rss_kb();
    eprintln!("churn: RSS {early} kB after 2,000 keys, {level} kB after 60,000, {after} kB after 110,000");
    assert!(after <= early + 4 * 1024, "RSS grew from {early} kB to {after} kB over 108,000 keys");
    // Every key is idle 100 ms after its request: none still holds state.
    std::thread::sleep(Duration::from_millis(500));
    let mut m = TcpStream::connect(("127.0.0.1", admin)).unwrap();
    m.write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    m.read_to_string(&mut text).unwrap();
    let gauge: Vec<&str> = text.lines().filter(|l| l.starts_with("tollgate_local_store_keys{")).collect();
    assert_eq!(gauge.len(), 1, "{text}");
    assert!(gauge[0].ends_with(" 0"), "{}", gauge[0]);
}

/// Issue 46: 100,000 distinct cached URLs through a route's HTTP cache, each answer about
/// 1.2 KiB stored (a few hundred bytes of fields and bookkeeping beyond its 1 KiB body), so
/// about 150 MiB if nothing were evicted. The store holds at most `max_bytes` (16 MiB) by its
/// own weights, and the process's RSS grows by no more than twice that from its level after
/// the first 2,000 URLs: the weights err high, and the margin covers the allocator on a
/// loaded machine.
#[test]
fn a_hundred_thousand_cached_urls_stay_within_the_stores_bound() {
    let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let body = format!("ok\\n{}", "z".repeat(1024));
    let server = Server::start_with(
        "cache",
        &format!(
            "listen: 127.0.0.1:0
admin: 127.0.0.1:{admin}
cache: {{ max_bytes: 16MiB, max_entry_bytes: 64KiB }}
upstreams: {{ ok: {{ respond: {{ status: 200, headers: {{ cache-control: max-age=600 }}, body: \"{body}\" }} }} }}
routes:
  - name: all
    upstream: ok
    cache: {{ coalesce_wait: 0s }}
"
        ),
    );
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    let mut next = 0u64;
    let mut urls = |s: &mut TcpStream, batches: u64| {
        for _ in 0..batches {
            let mut batch = Vec::with_capacity(64 * 200);
            for k in next..next + 200 {
                batch.extend_from_slice(format!("GET /item/{k} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes());
            }
            let answers = |got: &[u8]| got.windows(7).filter(|w| w == b"\r\n\r\nok\n").count() as u64;
            ask(s, &batch, |got| answers(got) >= 200);
            next += 200;
        }
    };
    urls(&mut s, 10);
    let early = server.rss_kb();
    urls(&mut s, 490);
    let after = server.rss_kb();
    eprintln!("cache: RSS {early} kB after 2,000 URLs, {after} kB after 100,000");
    let mut m = TcpStream::connect(("127.0.0.1", admin)).unwrap();
    m.write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    m.read_to_string(&mut text).unwrap();
    let held = |name: &str| -> u64 {
        let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {text}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let (bytes, entries) = (held("tollgate_cache_bytes "), held("tollgate_cache_entries "));
    eprintln!("cache: the store holds {bytes} bytes in {entries} URLs");
    assert!(bytes <= 16 << 20, "the store weighs {bytes} bytes, over its 16 MiB");
    assert!(entries > 5_000, "the store keeps what fits: {entries} URLs");
    assert!(after <= early + 32 * 1024, "RSS grew from {early} kB to {after} kB over 98,000 cached URLs");
}
