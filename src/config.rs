//! YAML → validated, typed configuration.
//!
//! One function ([`Config::from_yaml`]) calls serde_yaml; the serde mirror in `raw` denies
//! unknown fields, and validation turns it into types that cannot hold an invalid value.
//! Every error names the file, line, column, field path and what was expected.
//!
//! The config is data: patterns stay text (checked here with the builders the `route` room
//! compiles them with), header rules are parsed templates, and the TLS files it names are
//! read and checked by [`crate::pki`] into bytes and facts. No other room's compiled state
//! (regexes, rustls configs) is in it: each room builds its own at `Proxy::build`.
//!
//! One concept, though over 600 lines: the validated config's types.

pub mod admin;
pub mod auth;
pub mod cache;
pub mod compression;
pub mod cors;
pub mod edge;
pub mod extension;
mod forms;
pub mod gateway;
pub mod group;
mod guard;
mod limits;
mod locate;
pub mod managed;
mod otel;
pub mod plans;
mod raw;
mod redis;
pub mod respond;
pub mod rules;
pub mod shown;
pub mod split;
pub mod units;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use ipnet::IpNet;

pub use edge::{CertFiles, ClientAuth, Listener, ProxyProtocol, Quic, TlsListener, UpstreamTls};
pub use gateway::{Conditions, PathRewrite, ValueMatch, MAX_CONDITIONS, MAX_RULES};
pub use guard::{Shape, MAX_ALIAS_BYTES, MAX_ALIAS_NODES, MAX_CONFIG_BYTES, MAX_DEPTH};
pub use limits::{algorithm_name, Adaptive, Concurrency, LimitConfig, Mode, StoreKind};
pub use locate::Seg;
pub use managed::{CertSource, Challenge, ManagedCert};
pub use otel::{OtlpProtocol, TracingConfig};
pub use raw::{MAX_LIMITS, MAX_LIMITS_PER_ROUTE, MAX_NAME_BYTES, MAX_ROUTES};
pub use rules::HeaderRules;

/// `problems.type_base` by default: a URN, because the project owns no domain to put
/// problem documents under.
pub const DEFAULT_PROBLEM_TYPE_BASE: &str = "urn:tollgate:problem:";

/// A config error, positioned in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based; 0 when the error has no place in the file (it cannot be read).
    pub line: usize,
    pub column: usize,
    /// Field path such as `routes[0].upstream`; empty for document-level errors.
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Line 0: the error is about the file as a whole (it cannot be read), no place in it.
        if self.line == 0 {
            write!(f, "{}: ", self.file.display())?;
        } else {
            write!(f, "{}:{}:{}: ", self.file.display(), self.line, self.column)?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

/// The whole validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The first listener's address (the one `--listen` replaces).
    pub listen: SocketAddr,
    /// Every listener, the first at `listen`.
    pub listeners: Vec<Listener>,
    pub admin: Option<SocketAddr>,
    /// `admin.token` or `admin.token_file`, as configured.
    pub admin_token_source: Option<admin::TokenSource>,
    /// The token the admin listener's write endpoints need (read from its file at load).
    pub admin_token: Option<admin::AdminToken>,
    /// `admin.allowed_hosts`: the names a request's `Host` may give the admin listener besides
    /// its own address and `localhost` (lowercase, no final dot).
    pub admin_hosts: Vec<String>,
    /// Set when the admin listener is bound off loopback without a token: `check` refuses the
    /// config with this error, `run` warns.
    pub admin_exposed: Option<ConfigError>,
    pub trusted_proxies: Vec<IpNet>,
    pub server: ServerConfig,
    pub log: LogConfig,
    pub cache: CacheConfig,
    /// Prefix of the `type` of tollgate's own problem answers (IANA-registered types keep theirs).
    pub problem_type_base: String,
    /// Present when the file has a `redis:` section (required by any `store: redis` limit).
    pub redis: Option<crate::limit::RedisConfig>,
    /// The field that carries request ids; `None` when they are off (`request_id.enabled`).
    pub request_id: Option<HeaderName>,
    /// `tracing:`: OpenTelemetry spans of sampled requests; `None` (the default) traces nothing.
    pub tracing: Option<TracingConfig>,
    /// `dns:`: how the servers of groups with `resolve:` are found.
    pub dns: group::DnsConfig,
    /// `auth:` at the top level: the routes without their own use it (files read).
    pub auth: Option<Arc<auth::AuthConfig>>,
    /// `compression:` at the top level: the routes without their own use it.
    pub compression: Option<Arc<compression::CompressionConfig>>,
    /// `cors:` at the top level: the routes without their own use it.
    pub cors: Option<Arc<cors::CorsConfig>>,
    /// The `plans:` section (client tiers), with its clients file read.
    pub plans: Option<std::sync::Arc<crate::limit::plan::Plans>>,
    /// Things `check` reports without refusing the config (e.g. a client with an unknown tier).
    pub warnings: Vec<String>,
    pub upstreams: Vec<Upstream>,
    pub routes: Vec<Route>,
    /// What the text looked like before parsing (nesting, what aliases repeat).
    pub shape: Shape,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// A client must send its whole request head within this: from the accept for the first
    /// request (protocol detection included), from the first byte for later ones.
    pub header_read_timeout: Duration,
    /// An HTTP/1 connection with no request in progress is closed after this; `0` turns
    /// keep-alive off.
    pub keepalive_timeout: Duration,
    /// A connection whose client accepts none of the bytes waiting for it for this long is
    /// closed (nginx `send_timeout`).
    pub send_timeout: Duration,
    /// Larger request heads get 431.
    pub max_header_bytes: usize,
    /// On SIGINT/SIGTERM, in-flight requests get this long to finish.
    pub grace_period: Duration,
    /// A client that pauses mid-body longer than this gets 400 (or its connection closed).
    pub body_read_timeout: Duration,
    /// Connections past this many open ones are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Worker threads of `tollgate run` (read at start only).
    pub workers: Workers,
    pub h2: H2Config,
}

/// How many worker threads `tollgate run` serves with: each runs its own single-threaded
/// runtime and accepts from the shared listeners (see `server.workers` in the README).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workers {
    /// One per core the process may run on.
    Auto,
    Count(usize),
}

impl Workers {
    /// The number of workers to start (at least 1).
    pub fn count(self) -> usize {
        match self {
            Workers::Auto => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            Workers::Count(n) => n.max(1),
        }
    }
}

/// HTTP/2 settings and timers of client connections (`server.h2`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct H2Config {
    /// A connection with no open stream for this long gets a GOAWAY and is closed.
    pub idle_timeout: Duration,
    /// A PING is sent when nothing was received for this long; `0` sends none.
    pub ping_interval: Duration,
    /// The connection is closed when a PING is not answered within this.
    pub ping_timeout: Duration,
    pub max_concurrent_streams: u32,
    pub max_header_list_size: u32,
    /// Streams the client opened and reset before they were served (rapid reset).
    pub max_pending_accept_reset_streams: usize,
    /// Streams the server had to reset for a client's protocol errors.
    pub max_local_error_reset_streams: usize,
    pub initial_stream_window: u32,
    pub initial_connection_window: u32,
    pub max_frame_size: u32,
    /// Per stream: response bytes queued for a client that reads slowly.
    pub max_send_buffer: usize,
}

impl H2Config {
    pub const PING_INTERVAL: Duration = Duration::from_secs(30);
    pub const PING_TIMEOUT: Duration = Duration::from_secs(20);
    pub const MAX_CONCURRENT_STREAMS: u32 = 128;
    pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
    pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;
    pub const WINDOW: u32 = 1 << 20;
    pub const MAX_FRAME_SIZE: u32 = 16_384;
    pub const MAX_SEND_BUFFER: u32 = 400 << 10;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// One line per request.
    pub access: bool,
    /// `access_keys: true`: each access line names, per limit, its key spec and the digest
    /// the limit stored (never the raw key material), for `tollgate replay`.
    pub access_keys: bool,
}

/// The store of stale copies (used by routes with `stale:` fallbacks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    pub max_bytes: u64,
    pub max_entry_bytes: usize,
    /// `cache.default`: the HTTP cache of every route without a `cache:` of its own.
    pub default: Option<Arc<cache::RouteCacheConfig>>,
}

#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    pub kind: UpstreamKind,
}

#[derive(Debug, Clone)]
pub enum UpstreamKind {
    Http(HttpUpstream),
    Respond(Responder),
}

#[derive(Debug, Clone)]
pub struct HttpUpstream {
    /// `http://host:port` — no userinfo, no path.
    pub authority: http::uri::Authority,
    /// Path prefix of the URL (`/v1` in `http://api:3000/v1`), without trailing slash; may be empty.
    pub base_path: String,
    pub connect_timeout: Duration,
    /// The whole response head must arrive within this.
    pub timeout: Duration,
    /// After the head, the longest pause between two reads of the body; then the client's
    /// connection is closed and the upstream's dropped.
    pub read_timeout: Duration,
    pub pool_idle_timeout: Duration,
    pub pool_max_idle: usize,
    /// Send the client's Host (default) or the upstream's authority.
    pub preserve_host: bool,
    /// `https://` upstreams: how to verify and what to present.
    pub tls: Option<UpstreamTls>,
    pub protocol: UpstreamProtocol,
    /// The HTTP/2 connections of an `h2c`, `h2` or (https://) `auto` upstream.
    pub h2: UpstreamH2,
    /// `servers:`: a group (its first server is `authority` above); `None` for `url:`.
    pub group: Option<Arc<group::GroupConfig>>,
}

/// How tollgate speaks to an upstream. (`auto` on an `http://` upstream reads as `Http1`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamProtocol {
    Http1,
    /// HTTP/2 with prior knowledge, without TLS.
    H2c,
    /// HTTP/2 over TLS: ALPN offers `h2` only.
    H2,
    /// Over TLS, ALPN offers `h2` and `http/1.1` and each connection speaks what it chose.
    Auto,
}

/// An HTTP/2 upstream's shared connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamH2 {
    /// Connections opened at most; past them, requests share the least busy one.
    pub max_connections: usize,
    /// Streams in flight on one connection before another is opened.
    pub max_streams_per_connection: usize,
    /// A PING after this long without frames (zero: none); no answer within `ping_timeout`
    /// closes the connection.
    pub ping_interval: Duration,
    pub ping_timeout: Duration,
}

impl Default for UpstreamH2 {
    fn default() -> Self {
        UpstreamH2 {
            max_connections: 4,
            max_streams_per_connection: 100,
            ping_interval: Duration::from_secs(30),
            ping_timeout: Duration::from_secs(20),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Responder {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub latency: Duration,
    /// The longest request body read before answering; longer gets `413`.
    pub max_body: u64,
    /// A load-test target's faults (`None`: the fixed answer above, nothing drawn).
    pub faults: Option<Box<respond::Faults>>,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub host: Option<HostMatch>,
    pub path: PathMatch,
    /// `None` matches every method.
    pub methods: Option<Vec<Method>>,
    /// Index into [`Config::upstreams`].
    pub upstream: usize,
    pub strip_prefix: bool,
    /// Every limit must admit a request.
    pub limits: Vec<LimitConfig>,
    pub concurrency: Option<Concurrency>,
    /// Send `RateLimit-Policy` / `RateLimit` on answers of this route.
    pub ratelimit_headers: bool,
    /// Serve a stale copy up to this old instead of a 429/503 from the gate.
    pub stale_on_limit: Option<Duration>,
    /// Serve a stale copy up to this old when the upstream fails (stale-if-error).
    pub stale_on_upstream_error: Option<Duration>,
    /// A 429's Retry-After gets 0 to this many extra seconds, spread evenly over denials.
    pub retry_after_spread: u64,
    /// `match.headers` / `match.query`; `None` when the route has neither.
    pub conditions: Option<Box<Conditions>>,
    /// `rewrite.path_regex` (never together with `strip_prefix`).
    pub rewrite: Option<Box<PathRewrite>>,
    /// `request_headers`: applied to the request forwarded upstream.
    pub request_headers: Option<Arc<HeaderRules>>,
    /// `response_headers`: applied to every answer of the route, tollgate's own included.
    pub response_headers: Option<Arc<HeaderRules>>,
    /// `Upgrade` protocols passed on to the upstream (lower case, `h2c` never); empty: none.
    pub upgrades: Vec<http::HeaderValue>,
    pub tunnels: Tunnels,
    /// `auth:`, the route's own or the top-level default (`None`: no credentials asked).
    pub auth: Option<Arc<auth::AuthConfig>>,
    /// Whether `auth` is the route's own (its files are read at its own path).
    pub auth_own: bool,
    /// `split:`: several upstreams by weight (`upstream` is then the first of them).
    pub split: Option<Arc<split::Split>>,
    /// `compression:`, the route's own or the top-level default (`None`: answers pass as they are).
    pub compression: Option<Arc<compression::CompressionConfig>>,
    /// `cors:`, the route's own or the top-level default (`None`: no CORS fields).
    pub cors: Option<Arc<cors::CorsConfig>>,
    /// `extensions:`: steps registered by the program that embeds tollgate, in file order.
    pub extensions: Vec<extension::Extension>,
    /// `cache:`, the route's own or `cache.default` (`None`: answers are not served from the store).
    pub cache: Option<Arc<cache::RouteCacheConfig>>,
}

/// What bounds a route's tunnels (the connections an upgrade turned into byte streams).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tunnels {
    /// A tunnel that carries no byte either way for this long is closed.
    pub idle_timeout: Duration,
    /// Open tunnels at most; an upgrade beyond them is answered `503`.
    pub max: usize,
}

impl Tunnels {
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
    pub const MAX: usize = 10_000;
}

/// An `upgrades:` entry: a protocol name (RFC 9110 §7.8 token, without a version), lower case.
/// `h2c` is refused: forwarded, it would let a client speak HTTP/2 to the upstream past every
/// route and limit (h2c smuggling).
pub(crate) fn upgrade_token(token: &str) -> Result<http::HeaderValue, String> {
    let lower = token.trim().to_ascii_lowercase();
    if lower == "h2c" || lower.starts_with("h2c/") {
        return Err("`h2c` is never forwarded: an upgrade to it would carry requests past every route and \
                    limit (h2c smuggling)"
            .to_owned());
    }
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if lower.is_empty() || !lower.bytes().all(tchar) {
        return Err(format!("`{}` is not a protocol name; expected e.g. websocket", token.escape_debug()));
    }
    http::HeaderValue::from_str(&lower).map_err(|e| e.to_string())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    /// Lower-case host without port.
    Exact(String),
    /// `*.example.com` stored as `.example.com`: matches `a.example.com`, not `example.com`.
    Suffix(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Prefix(String),
    Exact(String),
}

impl Config {
    /// Reads and validates a config file; a file larger than [`MAX_CONFIG_BYTES`] is refused
    /// without reading it all.
    ///
    /// # Errors
    /// The file cannot be read, or its content is invalid (see [`Config::from_yaml`]).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        use std::io::Read;
        let fail = |message: String| ConfigError {
            file: path.to_owned(),
            line: 0,
            column: 0,
            path: String::new(),
            message: redact(&message),
        };
        let file = std::fs::File::open(path).map_err(|e| fail(unreadable(&e)))?;
        let mut text = String::new();
        // One byte more than the bound tells a file that is too large from one that fits.
        file.take(MAX_CONFIG_BYTES as u64 + 1).read_to_string(&mut text).map_err(|e| fail(unreadable(&e)))?;
        Config::from_yaml(path, &text)
    }

    /// Parses and validates YAML text; `file` is only used in error messages. The text is
    /// first held to the bounds of size, nesting and alias repetition (see `guard`), so
    /// nothing unbounded reaches the YAML parser.
    ///
    /// # Errors
    /// The first problem found, with its position. Passwords in URLs are redacted.
    pub fn from_yaml(file: &Path, text: &str) -> Result<Config, ConfigError> {
        let shape = guard::check(text).map_err(|r| {
            let (line, column) = inside(text, r.line, r.column);
            ConfigError { file: file.to_owned(), line, column, path: String::new(), message: redact(&r.message) }
        })?;
        if let Some(d) = locate::duplicate_key(text) {
            let (line, column) = inside(text, d.line, d.column);
            let key = match d.path.last() {
                Some(Seg::Key(k)) => k.as_str(),
                _ => "",
            };
            return Err(ConfigError {
                file: file.to_owned(),
                line,
                column,
                path: locate::render(&d.path),
                message: redact(&format!(
                    "`{key}` is given twice in this mapping (first on line {}); a key may appear only once",
                    d.first_line
                )),
            });
        }
        let de = serde_yaml::Deserializer::from_str(text);
        let raw: raw::Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let segs = segments(e.path());
            let inner = e.into_inner();
            let path = locate::render(&segs);
            // serde_yaml places custom errors at the enclosing mapping; the path is exact.
            let (line, column) = match locate::locate(text, &segs) {
                Some(pos) if !segs.is_empty() => pos,
                _ => inner.location().map_or((1, 1), |l| (l.line(), l.column())),
            };
            let (line, column) = inside(text, line, column);
            ConfigError { file: file.to_owned(), line, column, message: redact(&clean_message(&inner, &path)), path }
        })?;
        let mut config = raw.validate().map_err(|(segs, message)| {
            let (line, column) = locate::locate(text, &segs).map_or((1, 1), |(l, c)| inside(text, l, c));
            ConfigError { file: file.to_owned(), line, column, path: locate::render(&segs), message: redact(&message) }
        })?;
        config.shape = shape;
        let base = file.parent().unwrap_or(Path::new(""));
        edge::load_files(&mut config, base).map_err(|(segs, message)| {
            let (line, column) = locate::locate(text, &segs).map_or((1, 1), |(l, c)| inside(text, l, c));
            ConfigError { file: file.to_owned(), line, column, path: locate::render(&segs), message: redact(&message) }
        })?;
        auth::load_all(&mut config, base).map_err(|(segs, message)| {
            let (line, column) = locate::locate(text, &segs).map_or((1, 1), |(l, c)| inside(text, l, c));
            ConfigError { file: file.to_owned(), line, column, path: locate::render(&segs), message: redact(&message) }
        })?;
        if let Some(plans) = config.plans.as_mut() {
            let plans = std::sync::Arc::make_mut(plans);
            let warnings = plans::load_clients(plans, file).map_err(|message| {
                let segs = [key("plans"), key("clients")];
                let (line, column) = locate::locate(text, &segs).map_or((1, 1), |(l, c)| inside(text, l, c));
                ConfigError {
                    file: file.to_owned(),
                    line,
                    column,
                    path: locate::render(&segs),
                    message: redact(&message),
                }
            })?;
            config.warnings.extend(warnings);
        }
        let located = |segs: &[Seg], message: String| {
            let (line, column) = locate::locate(text, segs).map_or((1, 1), |(l, c)| inside(text, l, c));
            ConfigError { file: file.to_owned(), line, column, path: locate::render(segs), message: redact(&message) }
        };
        if let Some(source) = &config.admin_token_source {
            let token = admin::load_token(source, base).map_err(|(segs, message)| located(&segs, message))?;
            config.admin_token = Some(token);
        }
        if let Some(message) = admin::exposure(config.admin, config.admin_token.as_ref()) {
            // The address's own position, in either form (`admin: ADDR`, `admin: { addr: ADDR }`).
            config.admin_exposed = Some(located(&[key("admin"), key("addr")], message));
        }
        Ok(config)
    }

    /// Limits of all routes together.
    pub fn limit_count(&self) -> usize {
        self.routes.iter().map(|r| r.limits.len()).sum()
    }

    pub fn upstream(&self, route: &Route) -> &Upstream {
        &self.upstreams[route.upstream]
    }

    /// Moves the first listener to `addr` (`--listen`).
    pub fn set_listen(&mut self, addr: SocketAddr) {
        self.listen = addr;
        if let Some(l) = self.listeners.first_mut() {
            l.addr = addr;
        }
    }

    /// The files the config reads besides itself (certificates, keys, CAs, key sets, API
    /// keys files).
    pub fn watched_files(&self) -> Vec<PathBuf> {
        let mut files = edge::watched_files(self);
        files.extend(auth::files(self));
        files
    }
}

/// Why a config file cannot be read, in words (the OS's own text for the rare cases).
fn unreadable(e: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::NotFound => "no such file".to_owned(),
        K::PermissionDenied => "cannot read the file: permission denied".to_owned(),
        K::IsADirectory => "this is a directory, not a config file".to_owned(),
        K::InvalidData => "the file is not UTF-8 text".to_owned(),
        _ => format!("cannot read the file: {e}"),
    }
}

/// `line`:`column` moved inside `text`: libyaml reports the end of a text without a final
/// line break on a line after the last, which no editor can jump to. Lines are counted as
/// libyaml counts them (CR, LF, CRLF, NEL, LS and PS each end one), the widest reading, so a
/// position inside by it is inside by any.
fn inside(text: &str, line: usize, column: usize) -> (usize, usize) {
    let mut lines = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(['\n', '\r', '\u{85}', '\u{2028}', '\u{2029}']) {
        lines.push(&rest[..i]);
        let skip = if rest[i..].starts_with("\r\n") { 2 } else { rest[i..].chars().next().map_or(1, char::len_utf8) };
        rest = &rest[i + skip..];
    }
    lines.push(rest);
    let last = lines.len();
    if line > last {
        // Past the last line: the end of the text.
        return (last, lines[last - 1].chars().count() + 1);
    }
    let line = line.max(1);
    (line, column.clamp(1, lines[line - 1].chars().count() + 1))
}

fn segments(path: &serde_path_to_error::Path) -> Vec<Seg> {
    use serde_path_to_error::Segment;
    path.iter()
        .filter_map(|s| match s {
            Segment::Seq { index } => Some(Seg::Index(*index)),
            Segment::Map { key } => Some(Seg::Key(key.clone())),
            Segment::Enum { variant } => Some(Seg::Key(variant.clone())),
            Segment::Unknown => None,
        })
        .collect()
}

/// serde_yaml's message carries the path and the position, which we report separately.
fn clean_message(err: &serde_yaml::Error, path: &str) -> String {
    let mut msg = err.to_string();
    if let Some(loc) = err.location() {
        msg = msg.replace(&format!(" at line {} column {}", loc.line(), loc.column()), "");
    }
    // serde_yaml prefixes the path of the enclosing value, ours may be one field deeper.
    if let Some((prefix, rest)) = msg.split_once(": ") {
        if !prefix.contains(' ') && path.starts_with(prefix) {
            msg = rest.to_owned();
        }
    }
    msg
}

/// `scheme://user:secret@host` → `scheme://user:***@host`, wherever a URL with credentials
/// appears in `text` (a message may quote a value that was not meant to be a URL). Everything
/// from `://` to the last `@` of the same word is credentials, so a password with a raw `/`
/// or `@` is hidden too; a quoted URL's word runs to its closing quote.
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let scheme = rest[..at].trim_end_matches(|c: char| c.is_ascii_alphanumeric() || "+-.".contains(c));
        let quote = scheme.chars().next_back().filter(|c| matches!(c, '`' | '"' | '\''));
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = match quote {
            Some(q) => tail.find(q),
            None => tail.find(|c: char| c.is_whitespace() || matches!(c, '`' | '"' | '\'' | ',' | ';')),
        }
        .unwrap_or(tail.len());
        let word = &tail[..end];
        match word.rfind('@') {
            Some(a) => {
                match word[..a].split_once(':') {
                    Some((user, _)) if !user.is_empty() && !user.contains(char::is_whitespace) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    _ => out.push_str("***"),
                }
                out.push_str(&word[a..]);
            }
            None => out.push_str(word),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Errors found after parsing, with the path of the offending field.
pub(crate) type Invalid = (Vec<Seg>, String);

pub(crate) fn key(k: &str) -> Seg {
    Seg::Key(k.to_owned())
}

pub(crate) fn parse_header(
    at: impl Fn() -> Vec<Seg>,
    name: &str,
    value: &str,
) -> Result<(HeaderName, HeaderValue), Invalid> {
    let n =
        HeaderName::from_bytes(name.as_bytes()).map_err(|_| (at(), format!("`{name}` is not a valid header name")))?;
    let v = HeaderValue::from_str(value)
        .map_err(|_| (at(), format!("the value of `{name}` is not a valid header value")))?;
    Ok((n, v))
}

/// `http[s]://host[:port][/base]` → the authority with its port made explicit (80, or 443
/// for https, when none is written, as everywhere else), the base path, and whether it is
/// https. The host must be there, the port a number 1–65535.
pub(crate) fn parse_upstream_url(url: &str) -> Result<(http::uri::Authority, String, bool), String> {
    let uri: Uri = url.parse().map_err(|e| format!("`{url}` is not a URL ({e}); expected http://host:port"))?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(format!("`{url}` has no http:// scheme; expected http://host:port or https://host:port")),
    };
    let authority =
        uri.authority().cloned().ok_or_else(|| format!("`{url}` has no host; expected http://host:port"))?;
    if authority.as_str().contains('@') {
        return Err("credentials in an upstream URL are not supported; remove the user:password@ part".to_owned());
    }
    if uri.query().is_some() {
        return Err(format!("`{url}` has a query string; an upstream URL is a scheme, host, port and optional path"));
    }
    let host = authority.host();
    if host.is_empty() {
        return Err(format!("`{url}` has no host; expected http://host:port"));
    }
    // `http` keeps an unparsable port in the authority text but reports none: read it here.
    let port = match authority.as_str()[host.len()..].strip_prefix(':') {
        None if https => 443,
        None => 80,
        Some(p) => p
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| p.parse::<u16>().ok())
            .flatten()
            .filter(|&n| n != 0)
            .ok_or_else(|| format!("`{url}` has port `{p}`; expected a port from 1 to 65535"))?,
    };
    let authority: http::uri::Authority = format!("{host}:{port}")
        .parse()
        .map_err(|e| format!("`{url}` is not a URL ({e}); expected http://host:port"))?;
    let base = uri.path().trim_end_matches('/').to_owned();
    Ok((authority, base, https))
}

impl HostMatch {
    /// `host` is without port, in any case (the pattern is stored lower-case).
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostMatch::Exact(h) => h.eq_ignore_ascii_case(host),
            HostMatch::Suffix(s) => {
                host.len() > s.len() && host.as_bytes()[host.len() - s.len()..].eq_ignore_ascii_case(s.as_bytes())
            }
        }
    }
}

impl PathMatch {
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
            PathMatch::Exact(p) => path == p,
        }
    }
}

#[cfg(test)]
mod tests;
