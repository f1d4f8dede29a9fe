//! The `tollgate` binary in a process of its own, for what cannot be measured in the tests'
//! shared process: its memory (other tests run beside each one there).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// A running `tollgate` child with a client and an admin listener on loopback; killed on
/// drop.
pub struct Process {
    child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    config: PathBuf,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

impl Process {
    /// Starts `tollgate -c` on `yaml` with free loopback ports for its listener (overriding
    /// any `listen`) and its admin listener (`yaml` has no `admin`), and waits until both
    /// accept.
    pub async fn start(yaml: &str) -> Process {
        let (addr, admin) = (free_port(), free_port());
        let config = std::env::temp_dir().join(format!("tollgate-process-{}-{}.yaml", std::process::id(), addr.port()));
        std::fs::write(&config, format!("{yaml}\nadmin: {admin}\n")).unwrap();
        let child = Command::new(BIN)
            .arg("-c")
            .arg(&config)
            .args(["--listen", &addr.to_string()])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let process = Process { child, addr, admin, config };
        let deadline = Instant::now() + Duration::from_secs(10);
        for at in [addr, admin] {
            while tokio::net::TcpStream::connect(at).await.is_err() {
                assert!(Instant::now() < deadline, "tollgate did not start listening on {at}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        process
    }

    /// A field of the child's `/proc/<pid>/status` in KiB.
    fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in {status}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// Resident memory now, in KiB.
    pub fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// Starts a measurement: the high-water mark of [`Process::peak_rss_kib`] is set back to
    /// the resident memory now (what came before, e.g. a warm-up, does not hide what comes
    /// next), which this returns.
    pub fn start_peak_rss(&self) -> u64 {
        let pid = self.child.id();
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
            .unwrap_or_else(|e| panic!("resetting the peak RSS of process {pid}: {e}"));
        self.rss_kib()
    }

    /// The most resident memory since [`Process::start_peak_rss`] (the kernel's high-water
    /// mark), in KiB: what a buffer held for a moment and freed still shows here.
    pub fn peak_rss_kib(&self) -> u64 {
        self.status_kib("VmHWM:")
    }

    /// The value of the Prometheus sample `name` (with its labels, as the admin listener
    /// writes them).
    pub async fn metric(&self, name: &str) -> f64 {
        let (_, _, body) = super::get(self.admin, "/metrics").await;
        let text = String::from_utf8_lossy(&body);
        let line = text.lines().find(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(' ')));
        let line = line.unwrap_or_else(|| panic!("no {name} in {text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }
}
