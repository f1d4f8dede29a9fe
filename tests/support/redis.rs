//! Own redis-server processes for tests: a single node or a 3-master cluster, on free loopback
//! ports (never 6379), in temp dirs; killed and removed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A loopback port that is free now, with `port + 10000` (the cluster bus) free as well.
fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if port == 6379 || !(1_024..=55_000).contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// One redis-server child process.
pub struct RedisNode {
    pub port: u16,
    dir: PathBuf,
    cluster: bool,
    child: Option<Child>,
}

impl RedisNode {
    /// A single node, ready for commands.
    pub fn start() -> RedisNode {
        RedisNode::spawn(false)
    }

    fn spawn(cluster: bool) -> RedisNode {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "tollgate-redis-{}-{}-{port}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut node = RedisNode { port, dir, cluster, child: None };
        node.run();
        node
    }

    fn run(&mut self) {
        let port = self.port.to_string();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "2000"]);
        }
        self.child = Some(cmd.spawn().expect("redis-server must be installed"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]).trim() != "PONG" {
            assert!(Instant::now() < deadline, "redis-server on port {} did not start", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli -p <port> args...` → stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli").args(["-p", &self.port.to_string()]).args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// SIGKILL, like a crash: no goodbye to clients.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP, like a stalled host: connections stay open, what is written waits unread.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`RedisNode::pause`]: what waited is read and run now.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let ok = Command::new("kill").args([sig, &c.id().to_string()]).status().is_ok_and(|s| s.success());
            assert!(ok, "kill {sig} {}", c.id());
        }
    }

    /// Starts again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }

    /// Every `tollgate:*` key with its PTTL (ms; -1 = no TTL).
    pub fn tollgate_keys(&self) -> Vec<(String, i64)> {
        self.cli(&["--scan", "--pattern", "tollgate:*"])
            .lines()
            .filter(|k| !k.is_empty())
            .map(|k| (k.to_owned(), self.cli(&["PTTL", k]).trim().parse().unwrap_or(-3)))
            .collect()
    }

    /// Total commands processed (INFO commandstats is per command; this is `total_commands_processed`).
    pub fn calls(&self, command: &str) -> u64 {
        let info = self.cli(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{}:calls=", command.to_lowercase());
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|r| r.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three masters, no replicas, all 16384 slots assigned.
pub struct RedisCluster {
    pub nodes: Vec<RedisNode>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisNode> = (0..3).map(|_| RedisNode::spawn(true)).collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(out.status.success(), "cluster create: {}", String::from_utf8_lossy(&out.stdout));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !nodes.iter().all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")) {
            assert!(Instant::now() < deadline, "cluster did not reach cluster_state:ok");
            std::thread::sleep(Duration::from_millis(50));
        }
        RedisCluster { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisNode::url).collect()
    }

    pub fn tollgate_keys(&self) -> Vec<(String, i64)> {
        self.nodes.iter().flat_map(RedisNode::tollgate_keys).collect()
    }
}

/// A TCP relay in front of a Redis node that can be cut off like a network partition: while
/// cut, it keeps every socket open and accepts what is written, but forwards nothing either
/// way (the bytes are dropped), so a client hears nothing and sees no error.
pub struct Relay {
    pub port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Relays `127.0.0.1:<port>` to `127.0.0.1:<to>` (call from a Tokio runtime).
    pub async fn start(to: u16) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let c = cut.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await else { continue };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(Relay::pipe(cr, sw, c.clone()));
                tokio::spawn(Relay::pipe(sr, cw, c.clone()));
            }
        });
        Relay { port, cut, task }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if !cut.load(Ordering::Relaxed) && to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops (`true`) or resumes forwarding.
    pub fn cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
