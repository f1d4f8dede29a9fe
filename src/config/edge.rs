//! `listen` as one address or a list of listeners (TLS, PROXY protocol, redirect to HTTPS),
//! and the TLS fields of `https://` upstreams: the serde mirror, its validation, and the
//! loading of the files they name (certificates, keys, CAs), whose errors point at the field.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::units::Dur;
use super::{key, Invalid, Seg};

/// `listen: ADDR` or `listen: [ {addr: …}, … ]`.
pub enum RawListen {
    One(SocketAddr),
    Many(Vec<RawListener>),
}

impl<'de> Deserialize<'de> for RawListen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawListen;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an address such as 127.0.0.1:8080, or a list of listeners")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RawListen, E> {
                s.parse().map(RawListen::One).map_err(|_| E::custom(format!("invalid socket address `{s}`")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<RawListen, A::Error> {
                Vec::deserialize(de::value::SeqAccessDeserializer::new(seq)).map(RawListen::Many)
            }
        }
        d.deserialize_any(V)
    }
}

impl Default for RawListen {
    fn default() -> Self {
        RawListen::One(SocketAddr::from(([127, 0, 0, 1], 8080)))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListener {
    addr: SocketAddr,
    tls: Option<RawTls>,
    proxy_protocol: Option<RawProxyProtocol>,
    #[serde(default)]
    redirect_https: bool,
    #[serde(default)]
    http3: bool,
    quic: Option<RawQuic>,
}

/// The QUIC settings of an `http3: true` listener.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawQuic {
    max_concurrent_streams: Option<u32>,
    idle_timeout: Option<Dur>,
    early_data: Option<bool>,
    retry_above: Option<u32>,
    new_connections_per_ip: Option<u32>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum RawProxyProtocol {
    V1,
    V2,
    Optional,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    #[serde(default)]
    certificates: Vec<RawServedCert>,
    acme: Option<super::managed::RawAcme>,
    internal: Option<super::managed::RawInternal>,
    client_ca: Option<PathBuf>,
    client_auth: Option<RawClientAuth>,
    handshake_timeout: Option<Dur>,
}

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RawCertFiles {
    cert: PathBuf,
    key: PathBuf,
}

/// A listener's certificate: its files, and an OCSP response to staple.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServedCert {
    cert: PathBuf,
    key: PathBuf,
    ocsp: Option<PathBuf>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum RawClientAuth {
    Required,
    Optional,
}

/// One listener.
#[derive(Debug, Clone)]
pub struct Listener {
    pub addr: SocketAddr,
    pub tls: Option<TlsListener>,
    pub proxy_protocol: Option<ProxyProtocol>,
    /// Every request answers 308 to the same URL over HTTPS.
    pub redirect_https: bool,
    /// HTTP/3 on a UDP socket of the same address (`http3: true`, TLS listeners only).
    pub http3: Option<Quic>,
    /// A plain listener that answers ACME HTTP-01 validations before routing (some listener
    /// has a `tls.acme` with `challenge: http-01`).
    pub acme_http: bool,
}

/// A listener's HTTP/3: QUIC's defences, each with its default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quic {
    /// Request streams a connection may have open at once (QUIC's bidirectional streams).
    pub max_concurrent_streams: u32,
    /// A connection with no packet for this long is closed (QUIC's idle timeout).
    pub idle_timeout: std::time::Duration,
    /// 0-RTT: off by default; when on, only safe methods are served from early data.
    pub early_data: bool,
    /// New handshakes a second above which a client must prove its address (a Retry).
    pub retry_above: u32,
    /// New connections a second one client address may open.
    pub new_connections_per_ip: u32,
}

impl Default for Quic {
    fn default() -> Quic {
        Quic {
            max_concurrent_streams: 100,
            idle_timeout: std::time::Duration::from_secs(30),
            early_data: false,
            retry_above: 200,
            new_connections_per_ip: 50,
        }
    }
}

impl Listener {
    /// A plain HTTP listener without a PROXY header nor redirect: served directly by the server.
    pub fn is_plain(&self) -> bool {
        self.tls.is_none() && self.proxy_protocol.is_none() && !self.redirect_https && !self.acme_http
    }

    /// What a reload cannot change without a restart: the sockets and what they speak.
    pub fn shape(&self) -> (SocketAddr, bool, Option<ProxyProtocol>, bool, bool) {
        (self.addr, self.tls.is_some(), self.proxy_protocol, self.redirect_https, self.http3.is_some())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyProtocol {
    V1,
    V2,
    Optional,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    Required,
    Optional,
}

/// A listener's TLS section.
#[derive(Debug, Clone)]
pub struct TlsListener {
    pub certificates: Vec<ServedCert>,
    /// Certificates tollgate obtains itself (`acme`, `internal`), served after the files'.
    pub managed: Vec<super::managed::ManagedCert>,
    pub client_ca: Option<PathBuf>,
    pub client_auth: ClientAuth,
    pub handshake_timeout: std::time::Duration,
    /// The files, read and checked (set by [`load_files`]).
    pub loaded: Option<Arc<LoadedListener>>,
}

/// A listener's TLS files, read and checked: what its rustls config is built from.
#[derive(Debug)]
pub struct LoadedListener {
    /// In the order of `certificates`.
    pub certificates: Vec<LoadedCert>,
    pub client_ca: Option<crate::pki::Roots>,
    /// What each certificate serves, as `check`, `explain` and `/config` show it.
    pub served: Vec<Served>,
}

/// One served certificate's files: the chain and key, and its OCSP response (DER).
#[derive(Debug)]
pub struct LoadedCert {
    pub pair: crate::pki::KeyPair,
    pub ocsp: Option<Vec<u8>>,
}

/// One certificate as `check`, `explain` and `/config` show it (never key material).
#[derive(Debug, Clone)]
pub struct Served {
    pub cert: PathBuf,
    pub names: Vec<String>,
    /// Unix seconds.
    pub not_after: i64,
}

/// A certificate chain and its private key, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A certificate a listener serves, and the OCSP response (DER) stapled to its handshakes,
/// read with it (and again on reload), as nginx's `ssl_stapling_file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedCert {
    pub files: CertFiles,
    pub ocsp: Option<PathBuf>,
}

impl From<RawCertFiles> for CertFiles {
    fn from(r: RawCertFiles) -> Self {
        CertFiles { cert: r.cert, key: r.key }
    }
}

/// The TLS of an `https://` upstream.
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    pub ca_file: Option<PathBuf>,
    /// SNI and the name verified; the URL's host by default.
    pub server_name: String,
    pub client_cert: Option<CertFiles>,
    pub insecure_skip_verify: bool,
    /// The files, read and checked (set by [`load_files`]).
    pub loaded: Option<Arc<LoadedUpstream>>,
}

/// An upstream's TLS files, read and checked: what its rustls client configs are built from.
#[derive(Debug)]
pub struct LoadedUpstream {
    /// `ca_file`; `None`: the system's roots.
    pub roots: Option<crate::pki::Roots>,
    pub client_cert: Option<crate::pki::KeyPair>,
}

/// The TLS fields of an upstream, before validation.
#[derive(Default)]
pub struct RawUpstreamTls {
    pub ca_file: Option<PathBuf>,
    pub server_name: Option<String>,
    pub client_cert: Option<RawCertFiles>,
    pub tls_insecure_skip_verify: Option<bool>,
}

impl RawUpstreamTls {
    pub fn any(&self) -> Option<&'static str> {
        if self.ca_file.is_some() {
            Some("ca_file")
        } else if self.server_name.is_some() {
            Some("server_name")
        } else if self.client_cert.is_some() {
            Some("client_cert")
        } else if self.tls_insecure_skip_verify.is_some() {
            Some("tls_insecure_skip_verify")
        } else {
            None
        }
    }

    pub fn validate(self, host: &str, at: &dyn Fn(&str) -> Vec<Seg>) -> Result<UpstreamTls, Invalid> {
        let server_name =
            self.server_name.unwrap_or_else(|| host.trim_start_matches('[').trim_end_matches(']').to_owned());
        rustls::pki_types::ServerName::try_from(server_name.as_str())
            .map_err(|_| (at("server_name"), format!("`{server_name}` is not a DNS name or IP address")))?;
        let insecure = self.tls_insecure_skip_verify.unwrap_or(false);
        if insecure && self.ca_file.is_some() {
            return Err((at("ca_file"), "`ca_file` has no use with `tls_insecure_skip_verify: true`".to_owned()));
        }
        Ok(UpstreamTls {
            ca_file: self.ca_file,
            server_name,
            client_cert: self.client_cert.map(CertFiles::from),
            insecure_skip_verify: insecure,
            loaded: None,
        })
    }
}

/// The typed listeners; the first is the one `--listen` replaces.
pub fn validate(raw: RawListen, trusted_proxies: bool, warnings: &mut Vec<String>) -> Result<Vec<Listener>, Invalid> {
    let list = match raw {
        RawListen::One(addr) => {
            return Ok(vec![Listener {
                addr,
                tls: None,
                proxy_protocol: None,
                redirect_https: false,
                http3: None,
                acme_http: false,
            }])
        }
        RawListen::Many(list) => list,
    };
    if list.is_empty() {
        return Err((vec![key("listen")], "expected an address or at least one listener".to_owned()));
    }
    let mut out: Vec<Listener> = Vec::with_capacity(list.len());
    for (i, l) in list.into_iter().enumerate() {
        let at = |field: &[&str]| {
            let mut p = vec![key("listen"), Seg::Index(i)];
            p.extend(field.iter().map(|f| key(f)));
            p
        };
        if l.addr.port() != 0 && out.iter().any(|o| o.addr == l.addr) {
            return Err((at(&["addr"]), format!("{} is listed twice", l.addr)));
        }
        if l.redirect_https && l.tls.is_some() {
            return Err((at(&["redirect_https"]), "a TLS listener cannot redirect to HTTPS; it is HTTPS".to_owned()));
        }
        if l.proxy_protocol.is_some() && !trusted_proxies {
            return Err((
                at(&["proxy_protocol"]),
                "a PROXY header is read only from `trusted_proxies`, which is empty; list the balancers' addresses"
                    .to_owned(),
            ));
        }
        let http3 = quic(l.http3, l.quic, l.tls.is_some(), l.proxy_protocol.is_some(), &at)?;
        let tls = match l.tls {
            None => None,
            Some(t) => {
                let mut managed = Vec::new();
                if let Some(a) = t.acme {
                    managed.extend(a.validate(&|f: &[&str]| {
                        let mut p = at(&["tls", "acme"]);
                        p.extend(f.iter().map(|f| key(f)));
                        p
                    })?);
                }
                if let Some(internal) = t.internal {
                    managed.push(internal.validate(&|f: &[&str]| {
                        let mut p = at(&["tls", "internal"]);
                        p.extend(f.iter().map(|f| key(f)));
                        p
                    })?);
                }
                if t.certificates.is_empty() && managed.is_empty() {
                    return Err((
                        at(&["tls", "certificates"]),
                        "expected at least one { cert, key }, or `acme` or `internal: true`".to_owned(),
                    ));
                }
                let mut names: Vec<&str> = Vec::new();
                for m in &managed {
                    for n in &m.names {
                        if names.contains(&n.as_str()) {
                            let field = match m.source {
                                super::managed::CertSource::Acme(_) => ["tls", "acme", "names"],
                                super::managed::CertSource::Internal(_) => ["tls", "internal", "names"],
                            };
                            return Err((at(&field), format!("`{n}` is named twice; a name has one certificate")));
                        }
                        names.push(n);
                    }
                }
                if t.client_auth.is_some() && t.client_ca.is_none() {
                    return Err((at(&["tls", "client_auth"]), "`client_auth` needs `client_ca`".to_owned()));
                }
                let handshake_timeout = t.handshake_timeout.map_or(std::time::Duration::from_secs(10), |d| d.0);
                if handshake_timeout.is_zero() {
                    return Err((at(&["tls", "handshake_timeout"]), "expected a duration above 0".to_owned()));
                }
                Some(TlsListener {
                    certificates: t
                        .certificates
                        .into_iter()
                        .map(|c| ServedCert { files: CertFiles { cert: c.cert, key: c.key }, ocsp: c.ocsp })
                        .collect(),
                    managed,
                    client_ca: t.client_ca,
                    client_auth: match t.client_auth {
                        Some(RawClientAuth::Optional) => ClientAuth::Optional,
                        _ => ClientAuth::Required,
                    },
                    handshake_timeout,
                    loaded: None,
                })
            }
        };
        out.push(Listener {
            addr: l.addr,
            tls,
            proxy_protocol: l.proxy_protocol.map(|p| match p {
                RawProxyProtocol::V1 => ProxyProtocol::V1,
                RawProxyProtocol::V2 => ProxyProtocol::V2,
                RawProxyProtocol::Optional => ProxyProtocol::Optional,
            }),
            redirect_https: l.redirect_https,
            http3,
            acme_http: false,
        });
    }
    acme_challenges(&mut out, warnings)?;
    Ok(out)
}

/// Where ACME validations are answered: HTTP-01 on every plain listener (one is needed), and
/// a warning when no listener is on the port a CA connects to (80 for HTTP-01, 443 for
/// TLS-ALPN-01: fine behind a port forward, a mistake otherwise).
fn acme_challenges(listeners: &mut [Listener], warnings: &mut Vec<String>) -> Result<(), Invalid> {
    use super::managed::{CertSource, Challenge};
    let mut http = None;
    let mut alpn = false;
    for (i, l) in listeners.iter().enumerate() {
        for m in l.tls.iter().flat_map(|t| &t.managed) {
            if let CertSource::Acme(a) = &m.source {
                match a.challenge {
                    Challenge::Http01 => http = http.or(Some(i)),
                    Challenge::TlsAlpn01 => alpn = true,
                }
            }
        }
    }
    if let Some(i) = http {
        if !listeners.iter().any(|l| l.tls.is_none()) {
            return Err((
                super::managed::path(i, &["acme", "challenge"]),
                "http-01 is answered on a plain listener, and there is none: add one on port 80 (e.g. \
                 `{ addr: 0.0.0.0:80, redirect_https: true }`), or use `challenge: tls-alpn-01`"
                    .to_owned(),
            ));
        }
        for l in listeners.iter_mut().filter(|l| l.tls.is_none()) {
            l.acme_http = true;
        }
        if !listeners.iter().any(|l| l.tls.is_none() && l.addr.port() == 80) {
            warnings.push(
                "tls.acme: http-01 validations come to port 80, and no plain listener is on it; fine behind a \
                 port forward to one, otherwise the CA cannot validate"
                    .to_owned(),
            );
        }
    }
    if alpn && !listeners.iter().any(|l| l.tls.is_some() && l.addr.port() == 443) {
        warnings.push(
            "tls.acme: tls-alpn-01 validations come to port 443, and no TLS listener is on it; fine behind a port \
             forward, otherwise the CA cannot validate"
                .to_owned(),
        );
    }
    Ok(())
}

/// `http3` and `quic` of one listener: HTTP/3 needs TLS (QUIC is TLS 1.3), and a PROXY
/// header has no place on UDP.
fn quic(
    on: bool,
    raw: Option<RawQuic>,
    tls: bool,
    proxy_protocol: bool,
    at: &dyn Fn(&[&str]) -> Vec<Seg>,
) -> Result<Option<Quic>, Invalid> {
    if !on {
        return match raw {
            Some(_) => Err((at(&["quic"]), "`quic` has no use without `http3: true`".to_owned())),
            None => Ok(None),
        };
    }
    if !tls {
        return Err((at(&["http3"]), "HTTP/3 needs `tls` on the same listener (QUIC runs TLS 1.3)".to_owned()));
    }
    if proxy_protocol {
        return Err((
            at(&["http3"]),
            "HTTP/3 cannot sit behind a PROXY header (it is UDP); use a listener without `proxy_protocol`".to_owned(),
        ));
    }
    let raw = raw.unwrap_or_default();
    let d = Quic::default();
    let q = Quic {
        max_concurrent_streams: raw.max_concurrent_streams.unwrap_or(d.max_concurrent_streams),
        idle_timeout: raw.idle_timeout.map_or(d.idle_timeout, |t| t.0),
        early_data: raw.early_data.unwrap_or(d.early_data),
        retry_above: raw.retry_above.unwrap_or(d.retry_above),
        new_connections_per_ip: raw.new_connections_per_ip.unwrap_or(d.new_connections_per_ip),
    };
    if q.max_concurrent_streams == 0 || q.max_concurrent_streams > 10_000 {
        return Err((at(&["quic", "max_concurrent_streams"]), "expected 1 to 10000".to_owned()));
    }
    // QUIC's idle timeout travels as milliseconds below 2^62; a day is plenty.
    if q.idle_timeout.is_zero() || q.idle_timeout > std::time::Duration::from_secs(86_400) {
        return Err((at(&["quic", "idle_timeout"]), "expected a duration above 0 and at most 24h".to_owned()));
    }
    if q.new_connections_per_ip == 0 {
        return Err((at(&["quic", "new_connections_per_ip"]), "expected at least 1".to_owned()));
    }
    Ok(Some(q))
}

/// Reads every file the config names (paths relative to the config file's folder), checks
/// it and keeps what was built from it in the config.
pub fn load_files(config: &mut super::Config, base: &Path) -> Result<(), Invalid> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let resolve = |p: &mut PathBuf| {
        if p.is_relative() {
            *p = base.join(&*p);
        }
    };
    for (i, l) in config.listeners.iter_mut().enumerate() {
        let Some(tls) = &mut l.tls else { continue };
        for c in &mut tls.certificates {
            resolve(&mut c.files.cert);
            resolve(&mut c.files.key);
            if let Some(ocsp) = &mut c.ocsp {
                resolve(ocsp);
            }
        }
        if let Some(ca) = &mut tls.client_ca {
            resolve(ca);
        }
        super::managed::load(&mut tls.managed, base, &|f| super::managed::path(i, f))?;
        let loaded = load_listener(tls, now).map_err(|(field, message)| {
            let mut p = vec![key("listen"), Seg::Index(i), key("tls")];
            p.extend(field);
            (p, message)
        })?;
        tls.loaded = Some(Arc::new(loaded));
    }
    for u in &mut config.upstreams {
        let super::UpstreamKind::Http(h) = &mut u.kind else { continue };
        let Some(tls) = &mut h.tls else { continue };
        if let Some(ca) = &mut tls.ca_file {
            resolve(ca);
        }
        if let Some(c) = &mut tls.client_cert {
            resolve(&mut c.cert);
            resolve(&mut c.key);
        }
        let roots = match &tls.ca_file {
            Some(ca) if !tls.insecure_skip_verify => Some(
                crate::pki::Roots::read(ca).map_err(|e| (vec![key("upstreams"), key(&u.name), key("ca_file")], e))?,
            ),
            _ => None,
        };
        let client_cert = match &tls.client_cert {
            None => None,
            Some(c) => Some(
                crate::pki::KeyPair::client(&c.cert, &c.key, now)
                    .map_err(|e| (vec![key("upstreams"), key(&u.name), key("client_cert")], e))?,
            ),
        };
        let loaded = LoadedUpstream { roots, client_cert };
        tls.loaded = Some(Arc::new(loaded));
    }
    Ok(())
}

/// Reads and checks a listener's files; a problem comes with the path of its field under `tls`.
fn load_listener(tls: &TlsListener, now: i64) -> Result<LoadedListener, (Vec<Seg>, String)> {
    use crate::pki::{KeyPair, PairFile};
    let mut certificates = Vec::with_capacity(tls.certificates.len());
    let mut served = Vec::with_capacity(tls.certificates.len());
    for (j, c) in tls.certificates.iter().enumerate() {
        let at = |field: &str| vec![key("certificates"), Seg::Index(j), key(field)];
        let pair = KeyPair::served(&c.files.cert, &c.files.key, now).map_err(|(file, e)| match file {
            PairFile::Cert => (at("cert"), e),
            PairFile::Key => (at("key"), e),
        })?;
        let ocsp = match &c.ocsp {
            None => None,
            Some(path) => Some(crate::pki::read_ocsp(path).map_err(|e| (at("ocsp"), e))?),
        };
        let facts = pair.facts.clone().unwrap_or_default();
        served.push(Served { cert: c.files.cert.clone(), names: facts.served_names(), not_after: facts.not_after });
        certificates.push(LoadedCert { pair, ocsp });
    }
    let client_ca = match &tls.client_ca {
        None => None,
        Some(ca) => Some(crate::pki::Roots::read(ca).map_err(|e| (vec![key("client_ca")], e))?),
    };
    Ok(LoadedListener { certificates, client_ca, served })
}

/// The files a config reads besides itself: a change to one reloads it like the file does.
pub fn watched_files(config: &super::Config) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for l in &config.listeners {
        if let Some(t) = &l.tls {
            for c in &t.certificates {
                out.push(c.files.cert.clone());
                out.push(c.files.key.clone());
                out.extend(c.ocsp.clone());
            }
            out.extend(t.client_ca.clone());
            out.extend(super::managed::files(&t.managed));
        }
    }
    for u in &config.upstreams {
        if let super::UpstreamKind::Http(h) = &u.kind {
            if let Some(t) = &h.tls {
                out.extend(t.ca_file.clone());
                if let Some(c) = &t.client_cert {
                    out.push(c.cert.clone());
                    out.push(c.key.clone());
                }
            }
        }
    }
    out
}
