//! `tls: { internal: true }`: tollgate's local development CA. A root made once per storage
//! folder (0600) and kept; short-lived certificates for the configured names, verified with
//! that root; renewed and swapped in while connections made with the old one go on; reused
//! across restarts; `tollgate trust` prints the root the certificates chain to.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use http::StatusCode;

use crate::support::acme::{client_trusting, metric, Bound, Instance};
use crate::support::tls::{connect, served_cert, y, Client, Dir};

fn yaml(addr: std::net::SocketAddr, storage: &Dir, lifetime: &str) -> String {
    format!(
        "listen:\n  - addr: {addr}\n    tls:\n      internal: {{ names: [localhost, app.localhost, 127.0.0.1], lifetime: {lifetime}, storage: {} }}\nupstreams: {{ d: {{ respond: {{ body: hello }} }} }}\nroutes: [{{ upstream: d }}]\n",
        y(&storage.0)
    )
}

/// The stored root, once the starting instance has made it.
async fn root(storage: &Dir) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match std::fs::read_to_string(storage.path("local-ca/root.pem")) {
            Ok(pem) if pem.contains("END CERTIFICATE") => return pem,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            other => panic!("the local CA's root is not stored: {other:?}"),
        }
    }
}

fn serial(der: &[u8]) -> Vec<u8> {
    tollgate::x509::parse(der).unwrap().serial
}

#[tokio::test]
async fn a_local_ca_serves_https_and_http2_on_localhost_verified_by_its_root() {
    let storage = Dir::new();
    let bound = Bound::new(1).await;
    let addr = bound.addrs[0];
    let tg = Instance::start(bound, &yaml(addr, &storage, "1h")).await;
    let client = client_trusting(&root(&storage).await, &[b"h2", b"http/1.1"]);
    for name in ["localhost", "app.localhost", "127.0.0.1"] {
        let tls = connect(addr, name, client.clone()).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "HTTP/2 by ALPN");
        let (status, _, body, version) = Client::over(tls).await.get(name, "/").await;
        assert_eq!((status, &body[..], version), (StatusCode::OK, &b"hello"[..], http::Version::HTTP_2));
    }
    // Files of keys are private.
    let root_key = std::fs::metadata(storage.path("local-ca/root.key")).unwrap();
    assert_eq!(root_key.permissions().mode() & 0o777, 0o600);
    let leaf_dir = std::fs::read_dir(storage.path("internal")).unwrap().next().unwrap().unwrap().path();
    assert_eq!(std::fs::metadata(leaf_dir.join("key.pem")).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(&leaf_dir).unwrap().permissions().mode() & 0o777, 0o700);
    let text = tg.metrics();
    assert!(
        metric(&text, "tollgate_certificate_expiry_timestamp_seconds{certificate=\"localhost\",origin=\"internal\"}")
            .is_some_and(|v| v > 0.0),
        "{text}"
    );
    tg.stop().await;

    // Another start reuses the stored root and certificate.
    let stored = std::fs::read_to_string(leaf_dir.join("cert.pem")).unwrap();
    let bound = Bound::new(1).await;
    let addr = bound.addrs[0];
    let tg = Instance::start(bound, &yaml(addr, &storage, "1h")).await;
    let tls = connect(addr, "localhost", client_trusting(&root(&storage).await, &[b"http/1.1"])).await.unwrap();
    use rustls::pki_types::pem::PemObject;
    let stored_der = rustls::pki_types::CertificateDer::from_pem_slice(stored.as_bytes()).unwrap();
    assert_eq!(serial(&served_cert(&tls)), serial(&stored_der), "the stored certificate is served again");
    tg.stop().await;
}

/// A renewal swaps the certificate for new handshakes; a connection made before goes on with
/// the one it was made with.
#[tokio::test]
async fn a_renewed_certificate_is_swapped_in_without_dropping_connections() {
    let storage = Dir::new();
    let bound = Bound::new(1).await;
    let addr = bound.addrs[0];
    // Renewed two thirds into 6 s.
    let tg = Instance::start(bound, &yaml(addr, &storage, "6s")).await;
    let client = client_trusting(&root(&storage).await, &[b"http/1.1"]);
    let first = connect(addr, "localhost", client.clone()).await.unwrap();
    let first_serial = serial(&served_cert(&first));
    let mut kept = Client::over(first).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let renewed = loop {
        let tls = connect(addr, "localhost", client.clone()).await.expect("every handshake verifies with the root");
        let s = serial(&served_cert(&tls));
        if s != first_serial {
            break tls;
        }
        assert!(Instant::now() < deadline, "no renewal within 60 s of a 6 s certificate");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (status, _, body, _) = Client::over(renewed).await.get("localhost", "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"hello"[..]));
    let (status, _, body, _) = kept.get("localhost", "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"hello"[..]), "the older connection still serves");
    tg.stop().await;
}

#[test]
fn tollgate_trust_prints_the_root_the_certificates_chain_to() {
    let storage = Dir::new();
    let run = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["trust", "--storage"])
            .arg(&storage.0)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
    };
    let (first, note) = run();
    assert!(first.starts_with("-----BEGIN CERTIFICATE-----"), "{first}");
    assert!(note.contains("--install"), "{note}");
    let stored = std::fs::read_to_string(storage.path("local-ca/root.pem")).unwrap();
    assert_eq!(first, stored, "the stored root");
    assert_eq!(run().0, first, "made once, then kept");
}

/// A reload that names another certificate: it is issued and served without a restart, and
/// the one no longer named goes.
#[tokio::test]
async fn a_reload_brings_new_names_their_certificate() {
    let storage = Dir::new();
    let bound = Bound::new(1).await;
    let addr = bound.addrs[0];
    let config = |names: &str| {
        format!(
            "listen:\n  - addr: {addr}\n    tls:\n      internal: {{ names: [{names}], storage: {} }}\nupstreams: {{ d: {{ respond: {{ body: hello }} }} }}\nroutes: [{{ upstream: d }}]\n",
            y(&storage.0)
        )
    };
    let file = storage.write("proxy.yaml", &config("localhost"));
    let tg = Instance::start(bound, &std::fs::read_to_string(&file).unwrap()).await;
    let client = client_trusting(&root(&storage).await, &[b"http/1.1"]);
    assert!(connect(addr, "new.localhost", client.clone()).await.is_err(), "not named yet");
    storage.write("proxy.yaml", &config("localhost, new.localhost"));
    let reloader = tollgate::Reloader::new(file, tg.shared.clone(), Box::new(|_| {}));
    reloader.reload().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(tls) = connect(addr, "new.localhost", client.clone()).await {
            let (status, _, body, _) = Client::over(tls).await.get("new.localhost", "/").await;
            assert_eq!((status, &body[..]), (StatusCode::OK, &b"hello"[..]));
            break;
        }
        assert!(Instant::now() < deadline, "the reloaded name got no certificate within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(tg.shared.load().issued().ids().len(), 1, "the certificate of the old names is out of service");
    tg.stop().await;
}
