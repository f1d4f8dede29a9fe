//! TLS listeners: SNI certificate selection, ALPN, X-Forwarded-Proto, the HTTPS redirect,
//! handshake failures by reason, certificate checks at load and reloads that keep
//! connections. Certificates come from a CA made per test (rcgen); clients are rustls.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::config::Config;

use crate::support::tls::{client_config, connect, served_cert, y, Ca, Client, Dir};
use crate::support::{full, Tollgate, Upstream};

/// An upstream that answers with the request's X-Forwarded-Proto and -For.
async fn echo_upstream() -> Upstream {
    Upstream::start(|req| async move {
        let h = |n: &str| req.headers().get(n).and_then(|v| v.to_str().ok()).unwrap_or("-").to_owned();
        Response::new(full(format!("proto={} xff={}", h("x-forwarded-proto"), h("x-forwarded-for"))))
    })
    .await
}

fn config(yaml: &str) -> Config {
    Config::from_yaml(Path::new("test.yaml"), yaml).unwrap_or_else(|e| panic!("{e}"))
}

struct Site {
    dir: Dir,
    ca: Ca,
}

impl Site {
    /// A CA and three certificates: `api.test`, `*.wild.test`, `other.test` (the default first).
    fn new() -> Site {
        let dir = Dir::new();
        let ca = Ca::new("test CA");
        ca.issue(&["api.test"]).write(&dir, "api");
        ca.issue(&["*.wild.test"]).write(&dir, "wild");
        Site { dir, ca }
    }

    /// A TLS listener with the site's certificates in front of an echo upstream.
    async fn serving() -> (Upstream, Site, Tollgate) {
        let up = echo_upstream().await;
        let site = Site::new();
        let yaml = format!(
            "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: {} }}\nupstreams: {{ up: {{ url: 'http://{}' }} }}\nroutes: [{{ upstream: up }}]\n",
            site.certs(),
            up.addr
        );
        let tg = Tollgate::start_config(config(&yaml)).await;
        (up, site, tg)
    }

    fn certs(&self) -> String {
        format!(
            "[{{ cert: {}, key: {} }}, {{ cert: {}, key: {} }}]",
            y(&self.dir.path("api.pem")),
            y(&self.dir.path("api.key")),
            y(&self.dir.path("wild.pem")),
            y(&self.dir.path("wild.key"))
        )
    }
}

fn names_of(der: &[u8]) -> Vec<String> {
    tollgate::x509::parse(der).unwrap().dns_names
}

#[tokio::test]
async fn sni_picks_the_certificate_and_the_first_serves_clients_without_sni() {
    let (_up, site, tg) = Site::serving().await;
    let cfg = client_config(&site.ca, &[b"http/1.1"], None);
    for (sni, want) in [("api.test", "api.test"), ("x.wild.test", "*.wild.test")] {
        let tls = connect(tg.addr, sni, cfg.clone()).await.unwrap();
        assert_eq!(names_of(&served_cert(&tls)), [want], "SNI {sni}");
        let (status, _, body, _) = Client::over(tls).await.get(sni, "/").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(&body[..], b"proto=https xff=127.0.0.1", "X-Forwarded-Proto of a TLS client");
    }
    // No SNI (an IP address is never sent as SNI): the first certificate. The client then
    // refuses it for the name, which is what a client without SNI would see too.
    let no_sni = connect(tg.addr, "127.0.0.1", cfg.clone()).await;
    assert!(no_sni.is_err(), "api.test's certificate does not name 127.0.0.1");
    // A name nobody serves also gets the first one: verified for api.test it passes.
    let insecure = {
        let mut c = (*cfg).clone();
        c.dangerous().set_certificate_verifier(Arc::new(AcceptAny::default()));
        Arc::new(c)
    };
    let tls = connect(tg.addr, "127.0.0.1", insecure.clone()).await.unwrap();
    assert_eq!(names_of(&served_cert(&tls)), ["api.test"]);
    let tls = connect(tg.addr, "unknown.test", insecure).await.unwrap();
    assert_eq!(names_of(&served_cert(&tls)), ["api.test"]);
}

#[tokio::test]
async fn alpn_negotiates_h2_or_http1() {
    let (_up, site, tg) = Site::serving().await;
    for (alpn, version) in
        [(&[&b"h2"[..], b"http/1.1"][..], http::Version::HTTP_2), (&[&b"http/1.1"[..]][..], http::Version::HTTP_11)]
    {
        let tls = connect(tg.addr, "api.test", client_config(&site.ca, alpn, None)).await.unwrap();
        let mut client = Client::over(tls).await;
        for _ in 0..3 {
            let (status, _, body, v) = client.get("api.test", "/").await;
            assert_eq!((status, v), (StatusCode::OK, version));
            assert_eq!(&body[..], b"proto=https xff=127.0.0.1");
        }
    }
    // Session tickets: a second connection of the same client resumes without a full handshake.
    let cfg = client_config(&site.ca, &[b"http/1.1"], None);
    for want in [rustls::HandshakeKind::Full, rustls::HandshakeKind::Resumed] {
        let tls = connect(tg.addr, "api.test", cfg.clone()).await.unwrap();
        assert_eq!(tls.get_ref().1.handshake_kind(), Some(want));
        // The ticket comes after the handshake: a request reads it.
        assert_eq!(Client::over(tls).await.get("api.test", "/").await.0, StatusCode::OK);
    }
    // No ALPN at all: HTTP/1.1.
    let tls = connect(tg.addr, "api.test", client_config(&site.ca, &[], None)).await.unwrap();
    let (status, _, _, v) = Client::over(tls).await.get("api.test", "/").await;
    assert_eq!((status, v), (StatusCode::OK, http::Version::HTTP_11));
}

#[tokio::test]
async fn plain_listener_redirects_to_https_on_the_tls_port() {
    let site = Site::new();
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    redirect_https: true\n  - addr: 127.0.0.1:8443\n    tls: {{ certificates: {} }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n",
        site.certs()
    );
    let tg = Tollgate::start_config(config(&yaml)).await;
    let (status, headers, _) = crate::support::get_with(tg.addrs[0], "/a/b?x=1", &[("host", "api.test:8080")]).await;
    assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(headers["location"], "https://api.test:8443/a/b?x=1");
    // A request without a usable host is refused, not redirected somewhere.
    let (status, _, _) = crate::support::get_with(tg.addrs[0], "/", &[("host", "")]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

fn failures(tg: &Tollgate, reason: &str) -> u64 {
    let text = tg.shared.load().metrics().encode(None);
    let line = format!("tollgate_tls_handshake_failures_total{{reason=\"{reason}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(line.as_str())).map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn failed_handshakes_are_counted_by_reason_and_a_silent_client_is_closed() {
    let site = Site::new();
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: {}, handshake_timeout: 300ms }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n",
        site.certs()
    );
    let tg = Tollgate::start_config(config(&yaml)).await;
    // Plain HTTP to the TLS port.
    let mut s = tokio::net::TcpStream::connect(tg.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await.unwrap();
    // A client that opens and says nothing is closed after the handshake timeout.
    let mut silent = tokio::net::TcpStream::connect(tg.addr).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut [0u8; 16])).await.unwrap();
    assert!(matches!(n, Ok(0) | Err(_)), "closed");
    // A client that does not trust the certificate aborts the handshake with an alert.
    let stranger = Ca::new("another CA");
    assert!(connect(tg.addr, "api.test", client_config(&stranger, &[], None)).await.is_err());
    for _ in 0..100 {
        if failures(&tg, "not_tls") == 1 && failures(&tg, "timeout") == 1 && failures(&tg, "alert_received") == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{}", tg.shared.load().metrics().encode(None));
}

#[test]
fn check_refuses_expired_and_mismatched_certificates_with_the_file_name() {
    let site = Site::new();
    site.ca
        .issue_with(&["old.test"], |p| {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        })
        .write(&site.dir, "old");
    let listen = |cert: &str, key: &str| {
        format!(
            "listen:\n  - addr: 127.0.0.1:0\n    tls:\n      certificates:\n        - {{ cert: {}, key: {} }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n",
            y(&site.dir.path(cert)),
            y(&site.dir.path(key))
        )
    };
    let err = Config::from_yaml(Path::new("test.yaml"), &listen("old.pem", "old.key")).unwrap_err();
    assert_eq!((err.line, err.path.as_str()), (5, "listen[0].tls.certificates[0].cert"), "{err}");
    assert!(err.message.contains("old.pem") && err.message.contains("expired on 2021-01-01"), "{err}");
    let err = Config::from_yaml(Path::new("test.yaml"), &listen("api.pem", "wild.key")).unwrap_err();
    assert_eq!(err.path, "listen[0].tls.certificates[0].key", "{err}");
    assert!(err.message.contains("wild.key") && err.message.contains("does not belong"), "{err}");
    let err = Config::from_yaml(Path::new("test.yaml"), &listen("missing.pem", "api.key")).unwrap_err();
    assert!(err.message.contains("missing.pem"), "{err}");
    let err = Config::from_yaml(Path::new("test.yaml"), &listen("api.key", "api.key")).unwrap_err();
    assert!(err.message.contains("no CERTIFICATE"), "{err}");
    // A good one loads, and explain names what it serves.
    let c = config(&listen("api.pem", "api.key"));
    let text = tollgate::explain::explain(&c);
    assert!(text.contains("serves api.test (also for clients without SNI"), "{text}");
    // The same name twice: the second certificate never answers for it, and check says so.
    let twice = listen("api.pem", "api.key").replace(
        "    tls:\n      certificates:\n",
        &format!(
            "    tls:\n      certificates:\n        - {{ cert: {}, key: {} }}\n",
            y(&site.dir.path("api.pem")),
            y(&site.dir.path("api.key"))
        ),
    );
    let text = tollgate::explain::explain(&config(&twice));
    assert!(text.contains("warning: api.test is also named by an earlier certificate"), "{text}");
}

#[tokio::test]
async fn a_reload_swaps_certificates_without_dropping_connections_and_keeps_them_when_broken() {
    let up = echo_upstream().await;
    let site = Site::new();
    let file = site.dir.path("proxy.yaml");
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: [{{ cert: api.pem, key: api.key }}] }}\nupstreams: {{ up: {{ url: 'http://{}' }} }}\nroutes: [{{ upstream: up }}]\n",
        up.addr
    );
    std::fs::write(&file, &yaml).unwrap();
    let tg = Tollgate::start_config(Config::load(&file).unwrap()).await;
    let reloader = tollgate::Reloader::new(file.clone(), tg.shared.clone(), Box::new(|_| {}));
    // A fresh client config per connection: a resumed session would show the first one's
    // certificate again.
    let cfg = || client_config(&site.ca, &[b"http/1.1"], None);
    let tls = connect(tg.addr, "api.test", cfg()).await.unwrap();
    let first = served_cert(&tls);
    let mut kept = Client::over(tls).await;
    assert_eq!(kept.get("api.test", "/").await.0, StatusCode::OK);
    // A new certificate for the same name (relative paths: beside the config file).
    site.ca.issue(&["api.test", "new.test"]).write(&site.dir, "api");
    reloader.reload().await.unwrap();
    let tls = connect(tg.addr, "api.test", cfg()).await.unwrap();
    assert_ne!(served_cert(&tls), first);
    assert_eq!(names_of(&served_cert(&tls)), ["api.test", "new.test"]);
    assert_eq!(kept.get("api.test", "/").await.0, StatusCode::OK, "the open connection goes on");
    // A broken key: the reload fails naming the file; the served certificate stays.
    let now = served_cert(&tls);
    site.dir.write("api.key", "not a key\n");
    let err = reloader.reload().await.unwrap_err();
    assert!(err.to_string().contains("api.key"), "{err}");
    let tls = connect(tg.addr, "api.test", cfg()).await.unwrap();
    assert_eq!(served_cert(&tls), now);
    assert_eq!(kept.get("api.test", "/").await.0, StatusCode::OK);
}

#[tokio::test]
async fn client_certificates_are_required_against_the_listeners_ca() {
    let up = echo_upstream().await;
    let site = Site::new();
    let clients = Ca::new("clients");
    clients.write(&site.dir, "clients.pem");
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: {}, client_ca: {} }}\nupstreams: {{ up: {{ url: 'http://{}' }} }}\nroutes: [{{ upstream: up }}]\n",
        site.certs(),
        y(&site.dir.path("clients.pem")),
        up.addr
    );
    let tg = Tollgate::start_config(config(&yaml)).await;
    let alice = clients.issue_with(&[], |p| {
        p.distinguished_name.push(rcgen::DnType::CommonName, "alice");
    });
    let tls = connect(tg.addr, "api.test", client_config(&site.ca, &[b"http/1.1"], Some(&alice))).await.unwrap();
    assert_eq!(Client::over(tls).await.get("api.test", "/").await.0, StatusCode::OK);
    // Without a certificate, or with one of another CA: no HTTP at all. In TLS 1.3 the
    // client learns it on its first read.
    let mallory = site.ca.issue(&["mallory.test"]);
    for client in [None, Some(&mallory)] {
        let refused = async {
            let mut tls = connect(tg.addr, "api.test", client_config(&site.ca, &[b"http/1.1"], client)).await?;
            tls.write_all(b"GET / HTTP/1.1\r\nhost: api.test\r\n\r\n").await?;
            let mut buf = [0u8; 64];
            tls.read(&mut buf).await
        };
        assert!(!matches!(refused.await, Ok(n) if n > 0), "refused");
    }
    for reason in ["client_certificate_missing", "client_certificate_invalid"] {
        let mut n = 0;
        for _ in 0..100 {
            n = failures(&tg, reason);
            if n == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(n, 1, "{reason}");
    }
}

/// Accepts any server certificate (to look at what a server sends to any name), and keeps
/// every stapled OCSP response it is shown.
#[derive(Debug, Default)]
struct AcceptAny(std::sync::Mutex<Vec<Vec<u8>>>);

impl rustls::client::danger::ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        ocsp: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.0.lock().unwrap().push(ocsp.to_vec());
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

#[tokio::test]
async fn limits_can_key_on_the_client_certificate() {
    let site = Site::new();
    let clients = Ca::new("clients");
    clients.write(&site.dir, "clients.pem");
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: {}, client_ca: {}, client_auth: optional }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes:\n  - upstream: d\n    limits: [{{ name: per-cert, algorithm: fixed_window, rate: 1/h, key: tls_client }}]\n",
        site.certs(),
        y(&site.dir.path("clients.pem")),
    );
    let tg = Tollgate::start_config(config(&yaml)).await;
    let alice = clients.issue(&["alice.clients.test"]);
    let bob = clients.issue(&["bob.clients.test"]);
    let status = |client: Option<&crate::support::tls::Issued>| {
        let cfg = client_config(&site.ca, &[b"h2"], client);
        async move {
            let tls = connect(tg.addr, "api.test", cfg).await.unwrap();
            Client::over(tls).await.get("api.test", "/").await.0
        }
    };
    // Every client's own window of one, whatever connection it comes on.
    assert_eq!(status(Some(&alice)).await, StatusCode::OK);
    assert_eq!(status(Some(&alice)).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status(Some(&bob)).await, StatusCode::OK);
    // Without a certificate (optional): one shared key.
    assert_eq!(status(None).await, StatusCode::OK);
    assert_eq!(status(None).await, StatusCode::TOO_MANY_REQUESTS);
    // Keying on certificates no listener asks for is refused.
    let err = Config::from_yaml(
        Path::new("test.yaml"),
        "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    limits: [{ algorithm: fixed_window, rate: 1/h, key: tls_client }]\n",
    )
    .unwrap_err();
    assert!(err.message.contains("client_ca"), "{err}");
}

#[tokio::test]
async fn a_changed_certificate_file_alone_reloads_it() {
    let site = Site::new();
    let file = site.dir.path("proxy.yaml");
    std::fs::write(
        &file,
        "listen:\n  - addr: 127.0.0.1:0\n    tls: { certificates: [{ cert: api.pem, key: api.key }] }\nupstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n",
    )
    .unwrap();
    let tg = Tollgate::start_config(Config::load(&file).unwrap()).await;
    let reloader = tollgate::Reloader::new(file, tg.shared.clone(), Box::new(|_| {}));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reloader.run(Duration::from_millis(50), async move {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Only the PEM files change (as certbot renews them); the config file stays as it was.
    site.ca.issue(&["api.test", "renewed.test"]).write(&site.dir, "api");
    let mut names = Vec::new();
    for _ in 0..200 {
        let tls = connect(tg.addr, "api.test", client_config(&site.ca, &[], None)).await.unwrap();
        names = names_of(&served_cert(&tls));
        if names.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(names, ["api.test", "renewed.test"]);
    let _ = stop.send(());
    task.await.unwrap();
}

#[tokio::test]
async fn curl_with_the_ca_file_gets_through_on_http1_and_h2() {
    if std::process::Command::new("curl").arg("--version").output().is_err() {
        eprintln!("curl is not installed; skipped");
        return;
    }
    let site = Site::new();
    let ca = site.ca.write(&site.dir, "ca.pem");
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: {} }}\nupstreams: {{ d: {{ respond: {{ body: hi }} }} }}\nroutes: [{{ upstream: d }}]\n",
        site.certs()
    );
    let tg = Tollgate::start_config(config(&yaml)).await;
    let port = tg.addr.port();
    for proto in ["--http1.1", "--http2"] {
        let out = tokio::process::Command::new("curl")
            .args(["-sS", proto, "--cacert"])
            .arg(&ca)
            .args(["--resolve", &format!("x.wild.test:{port}:127.0.0.1")])
            .args(["-o", "/dev/null", "-w", "%{http_code} %{http_version}"])
            .arg(format!("https://x.wild.test:{port}/"))
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let want = if proto == "--http2" { "200 2" } else { "200 1.1" };
        assert_eq!(text, want, "{proto}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[tokio::test]
async fn rsa_and_sec1_keys_from_openssl_work_too() {
    let dir = Dir::new();
    let openssl = |args: &[&str]| std::process::Command::new("openssl").args(args).current_dir(&dir.0).output();
    if openssl(&["version"]).is_err() {
        eprintln!("openssl is not installed; skipped");
        return;
    }
    let make = |alg: &[&str], name: &str| {
        let mut args = vec!["req", "-x509", "-newkey"];
        args.extend_from_slice(alg);
        let (key, cert, san) = (format!("{name}.p8"), format!("{name}.pem"), format!("subjectAltName=DNS:{name}.test"));
        args.extend_from_slice(&[
            "-nodes", "-days", "2", "-subj", "/CN=x", "-keyout", &key, "-out", &cert, "-addext", &san,
        ]);
        assert!(openssl(&args).unwrap().status.success());
    };
    make(&["rsa:2048"], "rsa");
    make(&["ec", "-pkeyopt", "ec_paramgen_curve:P-256"], "ec");
    // The traditional encodings: PKCS#1 for RSA, SEC1 for EC.
    assert!(openssl(&["rsa", "-in", "rsa.p8", "-traditional", "-out", "rsa.key"]).unwrap().status.success());
    assert!(openssl(&["ec", "-in", "ec.p8", "-out", "ec.key"]).unwrap().status.success());
    assert!(std::fs::read_to_string(dir.path("rsa.key")).unwrap().contains("BEGIN RSA PRIVATE KEY"));
    assert!(std::fs::read_to_string(dir.path("ec.key")).unwrap().contains("BEGIN EC PRIVATE KEY"));
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: [{{ cert: {}, key: {} }}, {{ cert: {}, key: {} }}] }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n",
        y(&dir.path("rsa.pem")),
        y(&dir.path("rsa.key")),
        y(&dir.path("ec.pem")),
        y(&dir.path("ec.key"))
    );
    let tg = Tollgate::start_config(config(&yaml)).await;
    let mut any = (*client_config(&Ca::new("unused"), &[b"h2"], None)).clone();
    any.dangerous().set_certificate_verifier(Arc::new(AcceptAny::default()));
    let any = Arc::new(any);
    for name in ["rsa.test", "ec.test"] {
        let tls = connect(tg.addr, name, any.clone()).await.unwrap();
        assert_eq!(names_of(&served_cert(&tls)), [name]);
        assert_eq!(Client::over(tls).await.get(name, "/").await.0, StatusCode::OK);
    }
}

#[test]
fn certificate_paths_that_are_not_files_are_refused_without_reading() {
    for path in ["/dev/zero", "/dev/stdin", "/tmp"] {
        let yaml = format!(
            "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: [{{ cert: {path}, key: {path} }}] }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n"
        );
        let err = Config::from_yaml(Path::new("test.yaml"), &yaml).unwrap_err();
        assert!(err.message.contains(path), "{err}");
    }
}

#[tokio::test]
async fn a_proxy_header_comes_before_the_tls_handshake_and_tls12_clients_are_served() {
    let up = echo_upstream().await;
    let site = Site::new();
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    proxy_protocol: v1\n    tls: {{ certificates: {} }}\ntrusted_proxies: [127.0.0.1/32]\nupstreams: {{ up: {{ url: 'http://{}' }} }}\nroutes: [{{ upstream: up }}]\n",
        site.certs(),
        up.addr
    );
    let tg = Tollgate::start_config(config(&yaml)).await;
    let mut tcp = tokio::net::TcpStream::connect(tg.addr).await.unwrap();
    tcp.write_all(b"PROXY TCP4 192.0.2.44 127.0.0.1 1234 443\r\n").await.unwrap();
    let tls12 = {
        let b = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS12])
            .unwrap()
            .with_root_certificates(site.ca.roots());
        Arc::new(b.with_no_client_auth())
    };
    let name = rustls::pki_types::ServerName::try_from("api.test").unwrap();
    let tls = tokio_rustls::TlsConnector::from(tls12).connect(name, tcp).await.unwrap();
    assert_eq!(tls.get_ref().1.protocol_version(), Some(rustls::ProtocolVersion::TLSv1_2));
    let (status, _, body, _) = Client::over(tls).await.get("api.test", "/").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(&body[..], b"proto=https xff=192.0.2.44");
}

#[test]
fn config_endpoint_shows_served_names_and_no_key_material() {
    let site = Site::new();
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: {} }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n",
        site.certs()
    );
    let doc = tollgate::effective_config(&config(&yaml));
    let tls = &doc["listen"][0]["tls"];
    assert_eq!(tls["certificates"][0]["names"][0], "api.test", "{doc}");
    assert_eq!(tls["certificates"][1]["names"][0], "*.wild.test", "{doc}");
    let text = doc.to_string();
    let key = std::fs::read_to_string(site.dir.path("api.key")).unwrap();
    let body = key.lines().nth(1).unwrap();
    assert!(!text.contains("PRIVATE") && !text.contains(body), "{text}");
}

#[tokio::test]
async fn shutdown_lets_tls_requests_in_flight_finish_on_h1_and_h2() {
    let site = Site::new();
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: {} }}\nupstreams: {{ d: {{ respond: {{ body: done, latency: 300ms }} }} }}\nroutes: [{{ upstream: d }}]\n",
        site.certs()
    );
    let mut tg = Tollgate::start_config(config(&yaml)).await;
    let mut in_flight = Vec::new();
    for alpn in [&b"http/1.1"[..], b"h2"] {
        let tls = connect(tg.addr, "api.test", client_config(&site.ca, &[alpn], None)).await.unwrap();
        let mut client = Client::over(tls).await;
        in_flight.push(tokio::spawn(async move { client.get("api.test", "/").await }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let server = tg.shutdown();
    for (r, version) in in_flight.into_iter().zip([http::Version::HTTP_11, http::Version::HTTP_2]) {
        let (status, _, body, v) = r.await.unwrap();
        assert_eq!((status, &body[..], v), (StatusCode::OK, &b"done"[..], version));
    }
    tokio::time::timeout(Duration::from_secs(10), server).await.unwrap().unwrap();
}

/// The OCSP response a TLS 1.3 or 1.2 handshake with `addr` staples (empty: none).
async fn stapled(addr: std::net::SocketAddr, tls12: bool) -> Vec<u8> {
    let verifier = Arc::new(AcceptAny::default());
    let versions: &[&rustls::SupportedProtocolVersion] =
        if tls12 { &[&rustls::version::TLS12] } else { &[&rustls::version::TLS13] };
    let c = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(versions)
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(verifier.clone())
        .with_no_client_auth();
    connect(addr, "api.test", Arc::new(c)).await.unwrap();
    let seen = verifier.0.lock().unwrap();
    assert_eq!(seen.len(), 1);
    seen[0].clone()
}

#[tokio::test]
async fn an_ocsp_response_is_stapled_and_reloaded_with_its_file() {
    let site = Site::new();
    // A DER OCSPResponse: SEQUENCE { responseStatus ENUMERATED } (its framing is all tollgate
    // reads; rustls staples the bytes as they are).
    let first = [0x30, 0x03, 0x0a, 0x01, 0x00];
    std::fs::write(site.dir.path("api.ocsp"), first).unwrap();
    let file = site.dir.path("proxy.yaml");
    let yaml = |ocsp: &str| {
        format!(
            "listen:\n  - addr: 127.0.0.1:0\n    tls:\n      certificates:\n        - {{ cert: api.pem, key: api.key{ocsp} }}\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n"
        )
    };
    std::fs::write(&file, yaml(", ocsp: api.ocsp")).unwrap();
    let tg = Tollgate::start_config(Config::load(&file).unwrap()).await;
    assert_eq!(stapled(tg.addr, false).await, first);
    assert_eq!(stapled(tg.addr, true).await, first);

    // A renewed response alone reloads, as a renewed certificate does.
    let reloader = tollgate::Reloader::new(file.clone(), tg.shared.clone(), Box::new(|_| {}));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reloader.run(Duration::from_millis(50), async move {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = [0x30, 0x03, 0x0a, 0x01, 0x01];
    std::fs::write(site.dir.path("api.ocsp"), second).unwrap();
    let mut seen = Vec::new();
    for _ in 0..200 {
        seen = stapled(tg.addr, false).await;
        if seen == second {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seen, second);
    let _ = stop.send(());
    task.await.unwrap();

    // Without `ocsp`, nothing is stapled; a file that is not one DER response is refused
    // with its field.
    let plain =
        Tollgate::start_config(config(&yaml("").replace("api.", &format!("{}/api.", site.dir.0.display())))).await;
    assert!(stapled(plain.addr, false).await.is_empty());
    std::fs::write(site.dir.path("bad.ocsp"), "-----BEGIN OCSP-----").unwrap();
    std::fs::write(&file, yaml(", ocsp: bad.ocsp")).unwrap();
    let err = Config::load(&file).unwrap_err();
    assert_eq!((err.line, err.path.as_str()), (5, "listen[0].tls.certificates[0].ocsp"), "{err}");
    assert!(err.message.contains("bad.ocsp") && err.message.contains("not an OCSP response"), "{err}");
}

/// Reads `tls` until the server closes it (a close_notify or the socket's end), within a
/// generous bound.
async fn read_until_closed(tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let read_all = async {
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read_all).await.expect("the server closed the connection");
    String::from_utf8_lossy(&got).into_owned()
}

/// The server reads TLS one record's plaintext at a time and asks the socket only when rustls
/// holds no plaintext: requests that share a record, a request in one-byte records, a body of
/// many records and a client's close must all be read, none left waiting for bytes that
/// already came.
#[tokio::test]
async fn tls_reads_take_every_record_whatever_its_shape() {
    let up = Upstream::start(|req| async move {
        let len = http_body_util::BodyExt::collect(req.into_body()).await.map_or(0, |b| b.to_bytes().len());
        Response::new(full(format!("got={len}")))
    })
    .await;
    let site = Site::new();
    let yaml = format!(
        "listen:\n  - addr: 127.0.0.1:0\n    tls: {{ certificates: {} }}\nupstreams: {{ up: {{ url: 'http://{}' }} }}\nroutes: [{{ upstream: up }}]\n",
        site.certs(),
        up.addr
    );
    let tg = Tollgate::start_config(config(&yaml)).await;
    let cfg = client_config(&site.ca, &[b"http/1.1"], None);

    // Three pipelined requests in one write: one TLS record holds them all, and the server
    // answers the second and third from plaintext rustls already decrypted.
    let mut tls = connect(tg.addr, "api.test", cfg.clone()).await.unwrap();
    let get = "GET / HTTP/1.1\r\nhost: api.test\r\n\r\n";
    tls.write_all(format!("{get}{get}GET / HTTP/1.1\r\nhost: api.test\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    tls.flush().await.unwrap();
    let answers = read_until_closed(&mut tls).await;
    assert_eq!(answers.matches("HTTP/1.1 200 OK").count(), 3, "{answers}");
    assert_eq!(answers.matches("got=0").count(), 3, "{answers}");

    // One request written a byte at a time: each byte its own record, each waited for.
    let mut tls = connect(tg.addr, "api.test", cfg.clone()).await.unwrap();
    for b in "POST / HTTP/1.1\r\nhost: api.test\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello".bytes() {
        tls.write_all(&[b]).await.unwrap();
        tls.flush().await.unwrap();
    }
    let answer = read_until_closed(&mut tls).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with("got=5"), "{answer}");

    // A 1 MiB body: 64 full records and more, in writes larger than one record.
    let mut tls = connect(tg.addr, "api.test", cfg.clone()).await.unwrap();
    let body = vec![b'x'; 1 << 20];
    let head =
        format!("POST / HTTP/1.1\r\nhost: api.test\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
    tls.write_all(head.as_bytes()).await.unwrap();
    for chunk in body.chunks(100_000) {
        tls.write_all(chunk).await.unwrap();
    }
    tls.flush().await.unwrap();
    let answer = read_until_closed(&mut tls).await;
    assert!(answer.ends_with(&format!("got={}", 1 << 20)), "{answer}");

    // A client's close_notify after an answer ends the connection (not a wait for more bytes).
    let mut tls = connect(tg.addr, "api.test", cfg).await.unwrap();
    tls.write_all(get.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.ends_with(b"got=0") {
        let n = tokio::time::timeout(Duration::from_secs(20), tls.read(&mut buf)).await.unwrap().unwrap();
        assert_ne!(n, 0, "{}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buf[..n]);
    }
    tls.shutdown().await.unwrap();
    assert_eq!(read_until_closed(&mut tls).await, "");
}
