//! For the certificates tollgate gets itself: a whole instance (`instance::run_all`, so the
//! certificate manager runs) on listeners bound first (a test needs their ports before the
//! config is made: Pebble validates on them), and Pebble, Let's Encrypt's ACME test server,
//! with pebble-challtestsrv as its DNS (every name is 127.0.0.1), each on free loopback ports.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tollgate::config::Config;
use tollgate::Proxy;

use super::tls::Dir;

/// Listeners bound before the config that names them is made.
pub struct Bound {
    pub listeners: Vec<TcpListener>,
    pub addrs: Vec<SocketAddr>,
}

impl Bound {
    pub async fn new(n: usize) -> Bound {
        let mut listeners = Vec::new();
        for _ in 0..n {
            listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
        }
        let addrs = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        Bound { listeners, addrs }
    }
}

/// A running instance, as `tollgate run` wires one (the certificate manager included).
pub struct Instance {
    pub addrs: Vec<SocketAddr>,
    pub shared: tollgate::Shared,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Instance {
    /// Serves `yaml` on `bound`'s listeners (in the config's order).
    pub async fn start(bound: Bound, yaml: &str) -> Instance {
        let config = Config::from_yaml(Path::new("test.yaml"), yaml).unwrap_or_else(|e| panic!("test config: {e}"));
        Instance::start_config(bound, config).await
    }

    /// Serves `config` on `bound`'s listeners.
    pub async fn start_config(bound: Bound, config: Config) -> Instance {
        let shared: tollgate::Shared = Arc::new(ArcSwap::from_pointee(Proxy::new(config)));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(tollgate::instance::run_all(shared.clone(), bound.listeners, None, None, async move {
            let _ = rx.await;
        }));
        // Started once every certificate it gets itself is in service (stored, issued or a
        // placeholder), as `tollgate run` is before its first accept.
        let managed: std::collections::HashSet<String> = shared
            .load()
            .config
            .listeners
            .iter()
            .filter_map(|l| l.tls.as_ref())
            .flat_map(|t| t.managed.iter().map(|m| m.id.clone()))
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while shared.load().issued().ids().len() < managed.len() {
            assert!(std::time::Instant::now() < deadline, "certificates not in service within 30 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Instance { addrs: bound.addrs, shared, stop: Some(tx), task: Some(task) }
    }

    /// Stops and waits until it has stopped.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
        }
    }

    /// The Prometheus text of its metrics.
    pub fn metrics(&self) -> String {
        let p = self.shared.load();
        p.metrics().encode(p.redis().map(|r| &**r))
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// The value of the series `name{labels}` (labels as written in the text, in order).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A client config trusting the roots in `pem`, offering `alpn`.
pub fn client_trusting(pem: &str, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut c = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(c)
}

/// A free loopback port (bound and let go: a race with another process is possible, and rare).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Kills the child when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Pebble and its DNS, for one test.
pub struct Pebble {
    /// `https://127.0.0.1:PORT/dir`.
    pub directory: String,
    /// The CA that signs Pebble's own HTTPS certificate (for `directory_ca`).
    pub directory_ca: PathBuf,
    /// Pebble's management port (its issuing roots).
    management: u16,
    /// pebble-challtestsrv's management port (DNS records).
    dns_management: u16,
    _dir: Dir,
    _pebble: Proc,
    _dns: Proc,
}

/// Where Pebble's programs are, or why a test cannot run: the caller prints it and returns.
pub fn pebble_programs() -> Result<(PathBuf, PathBuf), String> {
    let find = |name: &str| {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    };
    match (find("pebble"), find("pebble-challtestsrv")) {
        (Some(p), Some(d)) => Ok((p, d)),
        _ => Err("skipped: Pebble is not installed (`apt-get install pebble`, as scripts/test.sh does)".to_owned()),
    }
}

/// What a Pebble test does when Pebble is missing: says so (CI installs it, so a CI run
/// that skips is a failure unless `TOLLGATE_SKIP_PEBBLE` allows it).
pub fn skip(why: &str) {
    if std::env::var_os("CI").is_some() && std::env::var_os("TOLLGATE_SKIP_PEBBLE").is_none() {
        panic!("{why}; CI installs Pebble (scripts/test.sh), so this run cannot skip it");
    }
    eprintln!("{why}");
}

impl Pebble {
    /// Pebble validating HTTP-01 on `http_port` and TLS-ALPN-01 on `tls_port` (tollgate's
    /// listeners), its certificates valid `validity` seconds, its DNS answering 127.0.0.1
    /// for every name; `eab` keys (kid → base64url MAC key) make binding required.
    pub async fn start(http_port: u16, tls_port: u16, validity: u64, eab: &[(&str, &str)]) -> Result<Pebble, String> {
        let (pebble, challtestsrv) = pebble_programs()?;
        let dir = Dir::new();
        let ca = super::tls::Ca::new("pebble test CA");
        let directory_ca = ca.write(&dir, "ca.pem");
        let (cert, key) = ca.issue(&["localhost", "127.0.0.1"]).write(&dir, "pebble");
        let (listen, management, dns, dns_management) = (free_port(), free_port(), free_port(), free_port());
        let mut keys = serde_json::Map::new();
        for (kid, mac) in eab {
            keys.insert((*kid).to_owned(), serde_json::Value::String((*mac).to_owned()));
        }
        let config = serde_json::json!({
            "pebble": {
                "listenAddress": format!("127.0.0.1:{listen}"),
                "managementListenAddress": format!("127.0.0.1:{management}"),
                "certificate": cert,
                "privateKey": key,
                "httpPort": http_port,
                "tlsPort": tls_port,
                "ocspResponderURL": "",
                "externalAccountBindingRequired": !eab.is_empty(),
                "externalAccountMACKeys": keys,
                "certificateValidityPeriod": validity,
            }
        });
        let config_file = dir.write("pebble.json", &config.to_string());
        let dns_proc = Command::new(challtestsrv)
            .args(["-dns01", &format!("127.0.0.1:{dns}"), "-management", &format!("127.0.0.1:{dns_management}")])
            .args(["-http01", "", "-https01", "", "-tlsalpn01", "", "-defaultIPv4", "127.0.0.1", "-defaultIPv6", ""])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("pebble-challtestsrv: {e}"))?;
        let dns_proc = Proc(dns_proc);
        let log = std::fs::File::create(dir.path("pebble.log")).unwrap();
        let pebble_proc = Command::new(pebble)
            .args(["-config", &config_file.display().to_string(), "-dnsserver", &format!("127.0.0.1:{dns}")])
            .args(["-strict", "false"])
            .env("PEBBLE_VA_NOSLEEP", "1")
            .env("PEBBLE_WFE_NONCEREJECT", "0")
            .env("PEBBLE_AUTHZREUSE", "0")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("pebble: {e}"))?;
        let pebble = Pebble {
            directory: format!("https://127.0.0.1:{listen}/dir"),
            directory_ca,
            management,
            dns_management,
            _dir: dir,
            _pebble: Proc(pebble_proc),
            _dns: dns_proc,
        };
        for port in [listen, management, dns_management] {
            wait_for_port(port).await?;
        }
        Ok(pebble)
    }

    /// Pebble's issuing root (a new one each run), as PEM.
    pub async fn root(&self) -> String {
        self.management_get("/roots/0").await
    }

    async fn management_get(&self, path: &str) -> String {
        // Pebble's management interface is HTTPS with its own certificate: not verified here
        // (what it serves is checked by verifying tollgate's certificates with it).
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.management)).await.unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCert))
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.unwrap();
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await.unwrap();
        tokio::spawn(conn);
        let req = http::Request::get(path).header("host", "localhost").body(super::full("")).unwrap();
        let resp = send.send_request(req).await.unwrap();
        use http_body_util::BodyExt;
        String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
    }

    /// Makes the DNS answer `ip` for `host` (a name whose validation is to fail: nothing
    /// of tollgate's listens there).
    pub async fn dns_a(&self, host: &str, ip: &str) {
        let body = serde_json::json!({ "host": format!("{host}."), "addresses": [ip] }).to_string();
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.dns_management)).await.unwrap();
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await.unwrap();
        tokio::spawn(conn);
        let req = http::Request::post("/add-a").header("host", "localhost").body(super::full(body)).unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert!(resp.status().is_success(), "challtestsrv /add-a: {}", resp.status());
    }
}

async fn wait_for_port(port: u16) -> Result<(), String> {
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("nothing listens on 127.0.0.1:{port} after 10 s"))
}

#[derive(Debug)]
struct AnyCert;

impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider().signature_verification_algorithms.supported_schemes()
    }
}
