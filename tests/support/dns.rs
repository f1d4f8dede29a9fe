//! Own dnsmasq processes for tests: an authoritative-only DNS server on a free loopback port,
//! its A/AAAA records in a hosts file of its own (re-read on SIGHUP) and SRV records on its
//! command line; killed and removed on drop. Never the machine's resolver.

use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// One dnsmasq child process.
pub struct Dns {
    pub addr: SocketAddr,
    dir: PathBuf,
    ttl: u32,
    srv: Vec<String>,
    child: Option<Child>,
}

impl Dns {
    /// A server answering `hosts` (`(ip, name)` pairs) and `srv` records (dnsmasq's
    /// `--srv-host` values: `_http._tcp.name,target,port,priority,weight`), every answer with
    /// TTL `ttl` seconds; ready for queries.
    pub fn start(hosts: &[(&str, &str)], srv: &[String], ttl: u32) -> Dns {
        let port = loop {
            let port = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                break port;
            }
        };
        let dir = std::env::temp_dir().join(format!(
            "tollgate-dns-{}-{}-{port}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut dns = Dns { addr: SocketAddr::from(([127, 0, 0, 1], port)), dir, ttl, srv: srv.to_vec(), child: None };
        dns.write_hosts(hosts);
        dns.run();
        dns
    }

    fn write_hosts(&self, hosts: &[(&str, &str)]) {
        let text: String = hosts.iter().map(|(ip, name)| format!("{ip} {name}\n")).collect();
        let tmp = self.dir.join("hosts.new");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.dir.join("hosts")).unwrap();
    }

    fn run(&mut self) {
        // Debian puts it in /usr/sbin, which a user's PATH may lack.
        let bin = if std::path::Path::new("/usr/sbin/dnsmasq").exists() { "/usr/sbin/dnsmasq" } else { "dnsmasq" };
        let mut cmd = Command::new(bin);
        cmd.arg("--keep-in-foreground")
            .arg("--conf-file=/dev/null")
            .args(["--no-resolv", "--no-hosts", "--bind-interfaces", "--listen-address=127.0.0.1"])
            .arg(format!("--port={}", self.addr.port()))
            .arg(format!("--addn-hosts={}", self.dir.join("hosts").display()))
            .arg(format!("--local-ttl={}", self.ttl))
            .arg(format!("--pid-file={}", self.dir.join("pid").display()))
            .arg(format!("--log-facility={}", self.dir.join("log").display()))
            .arg("--log-queries")
            .arg("--user=root");
        for s in &self.srv {
            cmd.arg(format!("--srv-host={s}"));
        }
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("dnsmasq must be installed (apt-get install dnsmasq-base)"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.answers() {
            assert!(Instant::now() < deadline, "dnsmasq on {} did not start", self.addr);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the server answers a query (any answer) now.
    fn answers(&self) -> bool {
        // A query for `. IN A`: id, flags (RD), one question.
        let query = [0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1];
        let Ok(sock) = UdpSocket::bind("127.0.0.1:0") else { return false };
        let _ = sock.set_read_timeout(Some(Duration::from_millis(200)));
        if sock.send_to(&query, self.addr).is_err() {
            return false;
        }
        let mut buf = [0u8; 512];
        matches!(sock.recv_from(&mut buf), Ok((n, _)) if n >= 12 && buf[0] == 0x12 && buf[1] == 0x34)
    }

    /// Replaces the A/AAAA records; dnsmasq re-reads them at once (SIGHUP).
    pub fn set_hosts(&self, hosts: &[(&str, &str)]) {
        self.write_hosts(hosts);
        if let Some(child) = &self.child {
            let status = Command::new("kill").args(["-HUP", &child.id().to_string()]).status().unwrap();
            assert!(status.success());
        }
    }

    /// Kills the server: its port stops answering.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, with `hosts` and `srv` records.
    pub fn restart(&mut self, hosts: &[(&str, &str)], srv: &[String]) {
        self.stop();
        self.srv = srv.to_vec();
        self.write_hosts(hosts);
        self.run();
    }

    /// The queries it logged (lines naming `name`), for a failure's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
