//! The serde mirror of proxy.yaml: every struct denies unknown fields. `validate` turns it
//! into the typed [`super::Config`].
//!
//! One concept, though over 600 lines: the serde mirror of the YAML and its validation.

use std::collections::BTreeMap;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use ipnet::IpNet;
use serde::Deserialize;

use super::limits::{check_name, limit_path, RawConcurrency, RawLimit};
use super::units::{Dur, Size};
use super::{key, parse_header, parse_upstream_url, Invalid, Seg};

/// Routes in one config (each has a gate, metric series and a line in `/config`).
pub const MAX_ROUTES: usize = 10_000;
/// Limits on one route: every request of the route runs all of them.
pub const MAX_LIMITS_PER_ROUTE: usize = 32;
/// Limits of all routes together (each holds its store's shards and its cached 429s, about
/// 24 KiB before the first key).
pub const MAX_LIMITS: usize = 10_000;
/// Route and limit names: they are metric labels, Redis key parts and RateLimit policy names.
pub const MAX_NAME_BYTES: usize = 128;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    listen: super::edge::RawListen,
    admin: Option<super::admin::RawAdmin>,
    #[serde(default)]
    trusted_proxies: Vec<IpNet>,
    #[serde(default)]
    server: Server,
    #[serde(default)]
    log: Log,
    #[serde(default)]
    cache: Cache,
    #[serde(default)]
    problems: Problems,
    redis: Option<super::redis::RawRedis>,
    #[serde(default)]
    request_id: super::gateway::RawRequestId,
    plans: Option<super::plans::RawPlans>,
    auth: Option<super::auth::RawAuth>,
    compression: Option<super::compression::RawCompression>,
    cors: Option<super::cors::RawCors>,
    tracing: Option<super::otel::RawTracing>,
    dns: Option<super::group::RawDns>,
    upstreams: BTreeMap<String, Upstream>,
    routes: Vec<Route>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Server {
    #[serde(default = "default_header_read_timeout")]
    header_read_timeout: Dur,
    #[serde(default = "default_keepalive_timeout")]
    keepalive_timeout: Dur,
    #[serde(default = "default_send_timeout")]
    send_timeout: Dur,
    #[serde(default = "default_max_header_bytes")]
    max_header_bytes: usize,
    #[serde(default = "default_grace_period")]
    grace_period: Dur,
    #[serde(default = "default_body_read_timeout")]
    body_read_timeout: Dur,
    #[serde(default = "default_max_connections")]
    max_connections: usize,
    #[serde(default)]
    workers: Option<RawWorkers>,
    #[serde(default)]
    h2: H2,
}

/// `server.workers`: `auto` or a count.
enum RawWorkers {
    Count(u64),
    Word(String),
}

impl super::forms::Forms for RawWorkers {
    const EXPECTING: &'static str = "`auto` or a worker count";
    fn text(s: &str) -> Option<Self> {
        Some(RawWorkers::Word(s.to_owned()))
    }
    fn number(n: u64) -> Option<Self> {
        Some(RawWorkers::Count(n))
    }
}
super::forms::by_form!(RawWorkers);

/// More worker threads than this is a typo, not a machine.
const MAX_WORKERS: u64 = 1024;

fn default_header_read_timeout() -> Dur {
    Dur(std::time::Duration::from_secs(10))
}
fn default_keepalive_timeout() -> Dur {
    Dur(std::time::Duration::from_secs(75))
}
fn default_send_timeout() -> Dur {
    Dur(std::time::Duration::from_secs(60))
}
fn default_max_header_bytes() -> usize {
    16 * 1024
}
fn default_body_read_timeout() -> Dur {
    Dur(std::time::Duration::from_secs(60))
}
fn default_grace_period() -> Dur {
    Dur(std::time::Duration::from_secs(10))
}
fn default_max_connections() -> usize {
    10_000
}

impl Default for Server {
    fn default() -> Self {
        Server {
            header_read_timeout: default_header_read_timeout(),
            keepalive_timeout: default_keepalive_timeout(),
            send_timeout: default_send_timeout(),
            max_header_bytes: default_max_header_bytes(),
            grace_period: default_grace_period(),
            body_read_timeout: default_body_read_timeout(),
            max_connections: default_max_connections(),
            workers: None,
            h2: H2::default(),
        }
    }
}

/// `server.h2`: the HTTP/2 settings and timers of client connections.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct H2 {
    /// Defaults to `server.keepalive_timeout` (its default when that is `0`).
    idle_timeout: Option<Dur>,
    ping_interval: Option<Dur>,
    ping_timeout: Option<Dur>,
    max_concurrent_streams: Option<u32>,
    /// Defaults to `server.max_header_bytes`.
    max_header_list_size: Option<Size>,
    max_pending_accept_reset_streams: Option<usize>,
    max_local_error_reset_streams: Option<usize>,
    initial_stream_window: Option<Size>,
    initial_connection_window: Option<Size>,
    max_frame_size: Option<Size>,
    max_send_buffer: Option<Size>,
}

impl Server {
    fn validate(self) -> Result<super::ServerConfig, Invalid> {
        use super::H2Config as D;
        let at = |field: &str| vec![key("server"), key(field)];
        let h2_at = |field: &str| vec![key("server"), key("h2"), key(field)];
        if self.max_header_bytes < 8192 {
            return Err((
                at("max_header_bytes"),
                format!("{} is too small; expected at least 8192 bytes", self.max_header_bytes),
            ));
        }
        for (field, d) in [("header_read_timeout", self.header_read_timeout), ("send_timeout", self.send_timeout)] {
            if d.0.is_zero() {
                return Err((at(field), "expected a duration above 0".to_owned()));
            }
        }
        if self.max_connections == 0 {
            return Err((at("max_connections"), "expected at least 1".to_owned()));
        }
        let workers = match self.workers {
            None => super::Workers::Auto,
            Some(RawWorkers::Word(w)) if w == "auto" => super::Workers::Auto,
            Some(RawWorkers::Count(n)) if (1..=MAX_WORKERS).contains(&n) => {
                super::Workers::Count(usize::try_from(n).unwrap_or(1))
            }
            Some(RawWorkers::Count(n)) => {
                return Err((at("workers"), format!("{n} is out of range; expected `auto` or 1 to {MAX_WORKERS}")))
            }
            Some(RawWorkers::Word(w)) => {
                return Err((
                    at("workers"),
                    format!("`{w}` is not a worker count; expected `auto` or 1 to {MAX_WORKERS}"),
                ))
            }
        };
        let h2 = self.h2;
        // hyper and h2 take these as u32; the protocol bounds them further (RFC 9113 §6.5.2).
        let size = |field: &str, v: Option<Size>, default: u32, min: u32, max: u32| -> Result<u32, Invalid> {
            let Some(Size(n)) = v else { return Ok(default) };
            match u32::try_from(n) {
                Ok(n) if (min..=max).contains(&n) => Ok(n),
                _ => Err((h2_at(field), format!("{n} is out of range; expected {min} to {max} bytes"))),
            }
        };
        let window_max = (1 << 31) - 1;
        let header_default = u32::try_from(self.max_header_bytes).unwrap_or(u32::MAX);
        let ping_timeout = h2.ping_timeout.map_or(D::PING_TIMEOUT, |d| d.0);
        if ping_timeout.is_zero() {
            return Err((h2_at("ping_timeout"), "expected a duration above 0".to_owned()));
        }
        let max_concurrent_streams = h2.max_concurrent_streams.unwrap_or(D::MAX_CONCURRENT_STREAMS);
        if max_concurrent_streams == 0 {
            return Err((h2_at("max_concurrent_streams"), "expected at least 1".to_owned()));
        }
        // `keepalive_timeout: 0` turns HTTP/1 keep-alive off; an HTTP/2 connection is kept
        // alive by its nature, so it then idles for the default instead.
        let inherited = match self.keepalive_timeout.0 {
            d if d.is_zero() => default_keepalive_timeout().0,
            d => d,
        };
        let idle_timeout = h2.idle_timeout.map_or(inherited, |d| d.0);
        if idle_timeout.is_zero() {
            return Err((h2_at("idle_timeout"), "expected a duration above 0".to_owned()));
        }
        Ok(super::ServerConfig {
            header_read_timeout: self.header_read_timeout.0,
            keepalive_timeout: self.keepalive_timeout.0,
            send_timeout: self.send_timeout.0,
            max_header_bytes: self.max_header_bytes,
            grace_period: self.grace_period.0,
            body_read_timeout: self.body_read_timeout.0,
            max_connections: self.max_connections,
            workers,
            h2: D {
                idle_timeout,
                ping_interval: h2.ping_interval.map_or(D::PING_INTERVAL, |d| d.0),
                ping_timeout,
                max_concurrent_streams,
                max_header_list_size: size(
                    "max_header_list_size",
                    h2.max_header_list_size,
                    header_default,
                    1024,
                    u32::MAX,
                )?,
                max_pending_accept_reset_streams: h2
                    .max_pending_accept_reset_streams
                    .unwrap_or(D::MAX_PENDING_ACCEPT_RESET_STREAMS),
                max_local_error_reset_streams: h2
                    .max_local_error_reset_streams
                    .unwrap_or(D::MAX_LOCAL_ERROR_RESET_STREAMS),
                initial_stream_window: size(
                    "initial_stream_window",
                    h2.initial_stream_window,
                    D::WINDOW,
                    1,
                    window_max,
                )?,
                initial_connection_window: size(
                    "initial_connection_window",
                    h2.initial_connection_window,
                    D::WINDOW,
                    65_535,
                    window_max,
                )?,
                max_frame_size: size("max_frame_size", h2.max_frame_size, D::MAX_FRAME_SIZE, 16_384, 16_777_215)?,
                max_send_buffer: size("max_send_buffer", h2.max_send_buffer, D::MAX_SEND_BUFFER, 16_384, u32::MAX)?
                    as usize,
            },
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Cache {
    #[serde(default = "default_cache_bytes")]
    max_bytes: Size,
    #[serde(default = "default_entry_bytes")]
    max_entry_bytes: Size,
    default: Option<super::cache::RawRouteCacheMap>,
}

fn default_cache_bytes() -> Size {
    Size(64 << 20)
}
fn default_entry_bytes() -> Size {
    Size(1 << 20)
}

impl Default for Cache {
    fn default() -> Self {
        Cache { max_bytes: default_cache_bytes(), max_entry_bytes: default_entry_bytes(), default: None }
    }
}

/// `problems:`: how tollgate's own problem answers name their types.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Problems {
    #[serde(default = "default_type_base")]
    type_base: String,
}

fn default_type_base() -> String {
    super::DEFAULT_PROBLEM_TYPE_BASE.to_owned()
}

impl Default for Problems {
    fn default() -> Self {
        Problems { type_base: default_type_base() }
    }
}

/// `on_limit:` / `on_upstream_error:` of a route.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fallback {
    stale: Option<Stale>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Stale {
    max_age: Dur,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Log {
    #[serde(default)]
    format: RawLogFormat,
    #[serde(default)]
    access: bool,
    #[serde(default)]
    access_keys: bool,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum RawLogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Upstream {
    url: Option<String>,
    respond: Option<Respond>,
    connect_timeout: Option<Dur>,
    timeout: Option<Dur>,
    read_timeout: Option<Dur>,
    pool_idle_timeout: Option<Dur>,
    pool_max_idle: Option<usize>,
    preserve_host: Option<bool>,
    ca_file: Option<std::path::PathBuf>,
    server_name: Option<String>,
    client_cert: Option<super::edge::RawCertFiles>,
    tls_insecure_skip_verify: Option<bool>,
    protocol: Option<Protocol>,
    h2: Option<UpstreamH2>,
    servers: Option<Vec<super::group::RawServer>>,
    balance: Option<super::group::RawBalance>,
    retry: Option<super::group::RawRetry>,
    health: Option<super::group::RawHealth>,
    outlier: Option<super::group::RawOutlier>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Protocol {
    Http1,
    H2c,
    H2,
    Auto,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamH2 {
    max_connections: Option<usize>,
    max_streams_per_connection: Option<usize>,
    ping_interval: Option<Dur>,
    ping_timeout: Option<Dur>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Respond {
    #[serde(default = "default_status")]
    status: u16,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body: String,
    /// A duration, or a distribution (`super::respond`).
    #[serde(default)]
    latency: Option<super::respond::RawLatency>,
    /// The longest request body the responder reads before answering (`413` past it).
    max_body: Option<Size>,
    /// The faults of a load-test target (`super::respond`).
    errors: Option<super::respond::RawErrors>,
    resets: Option<super::respond::Share>,
    body_size: Option<Size>,
    drip: Option<super::respond::RawDrip>,
    seed: Option<u64>,
}

/// As nginx's `client_max_body_size`.
const DEFAULT_RESPOND_MAX_BODY: u64 = 1 << 20;

fn default_status() -> u16 {
    200
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Route {
    name: Option<String>,
    #[serde(default, rename = "match")]
    matcher: Match,
    upstream: Option<String>,
    split: Option<super::split::RawSplit>,
    #[serde(default)]
    strip_prefix: bool,
    #[serde(default)]
    limits: Vec<RawLimit>,
    concurrency: Option<RawConcurrency>,
    #[serde(default = "yes")]
    ratelimit_headers: bool,
    on_limit: Option<Fallback>,
    on_upstream_error: Option<Fallback>,
    retry_after_spread: Option<Dur>,
    rewrite: Option<super::gateway::RawRewrite>,
    request_headers: Option<super::gateway::RawRules>,
    response_headers: Option<super::gateway::RawRules>,
    upgrades: Option<Vec<String>>,
    #[serde(default)]
    tunnels: Tunnels,
    auth: Option<super::auth::RawRouteAuth>,
    compression: Option<super::compression::RawRouteCompression>,
    cors: Option<super::cors::RawRouteCors>,
    cache: Option<super::cache::RawRouteCache>,
    extensions: Option<serde_yaml::Mapping>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Tunnels {
    idle_timeout: Option<Dur>,
    max: Option<usize>,
}

/// The longest `retry_after_spread`: an hour of extra waiting is already a long way from honest.
const MAX_RETRY_AFTER_SPREAD: u64 = 3600;

fn yes() -> bool {
    true
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Match {
    host: Option<String>,
    path_prefix: Option<String>,
    path: Option<String>,
    methods: Option<Vec<String>>,
    #[serde(default)]
    headers: BTreeMap<String, super::gateway::RawValueMatch>,
    #[serde(default)]
    query: BTreeMap<String, super::gateway::RawValueMatch>,
}

impl Config {
    pub fn validate(mut self) -> Result<super::Config, Invalid> {
        let server = self.server.validate()?;
        let mut warnings = Vec::new();
        let listeners = super::edge::validate(self.listen, !self.trusted_proxies.is_empty(), &mut warnings)?;
        let type_base = self.problems.type_base;
        let absolute = type_base.split_once(':').is_some_and(|(scheme, rest)| {
            !rest.is_empty()
                && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        });
        if !absolute || type_base.contains(|c: char| c.is_ascii_whitespace() || c == '"' || c.is_control()) {
            return Err((
                vec![key("problems"), key("type_base")],
                format!("`{type_base}` is not an absolute URI; expected e.g. https://api.example.com/problems/"),
            ));
        }
        let redis = self.redis.map(|r| r.validate()).transpose()?;
        let request_id = self.request_id.validate()?;
        let tracing = self.tracing.map(super::otel::RawTracing::validate).transpose()?;
        let dns = self.dns.map(super::group::RawDns::validate).transpose()?.unwrap_or_default();
        let mut plans = self.plans.map(|p| p.validate(redis.is_some())).transpose()?;
        let default_auth =
            self.auth.map(|a| a.validate(&[key("auth")], redis.is_some())).transpose()?.map(std::sync::Arc::new);
        let default_compression =
            self.compression.map(|c| c.validate(&[key("compression")])).transpose()?.map(std::sync::Arc::new);
        let default_cors = self.cors.map(|c| c.validate(&[key("cors")])).transpose()?.map(std::sync::Arc::new);
        let default_cache = match self.cache.default.take() {
            Some(c) => Some(std::sync::Arc::new(c.validate(&[key("cache"), key("default")])?)),
            None => None,
        };
        let mut upstreams = Vec::with_capacity(self.upstreams.len());
        for (name, up) in self.upstreams {
            let at = |field: &str| vec![key("upstreams"), key(&name), key(field)];
            let kind = up.validate(&name, &at)?;
            upstreams.push(super::Upstream { name, kind });
        }
        if self.routes.is_empty() {
            return Err((vec![key("routes")], "expected at least one route".to_owned()));
        }
        if self.routes.len() > MAX_ROUTES {
            return Err((
                vec![key("routes"), Seg::Index(MAX_ROUTES)],
                format!("{} routes (aliases expanded); at most {MAX_ROUTES} are accepted", self.routes.len()),
            ));
        }
        let on_error_local = redis.as_ref().filter(|r| r.on_error == crate::limit::store::redis::OnError::Local);
        let mut total_limits = 0usize;
        let mut routes = Vec::with_capacity(self.routes.len());
        for (i, route) in self.routes.into_iter().enumerate() {
            let at = |field: &[&str]| {
                let mut p = vec![key("routes"), Seg::Index(i)];
                p.extend(field.iter().map(|f| key(f)));
                p
            };
            let name = route.name.unwrap_or_else(|| format!("route-{i}"));
            check_name(&name).map_err(|e| (at(&["name"]), e))?;
            if routes.iter().any(|r: &super::Route| r.name == name) {
                return Err((at(&["name"]), format!("route name `{name}` is used twice; names must be unique")));
            }
            let known: Vec<&str> = upstreams.iter().map(|u| u.name.as_str()).collect();
            let upstream = match (&route.upstream, &route.split) {
                (Some(_), Some(_)) => {
                    return Err((at(&["split"]), "give either `upstream` or `split`, not both".to_owned()))
                }
                (None, None) => {
                    return Err((
                        vec![key("routes"), Seg::Index(i)],
                        "expected `upstream: <name>` or a `split:` between upstreams".to_owned(),
                    ))
                }
                (Some(name), None) => upstreams.iter().position(|u| u.name == *name).ok_or_else(|| {
                    (at(&["upstream"]), format!("unknown upstream `{name}`; expected one of: {}", known.join(", ")))
                })?,
                // Set from the split's first side once it is checked (below, with `auth`).
                (None, Some(_)) => 0,
            };
            let m = route.matcher;
            let conditions = super::gateway::conditions(m.headers, m.query, &|f: &[&str]| {
                let mut p = at(&["match"]);
                p.extend(f.iter().map(|f| key(f)));
                p
            })?;
            let rewrite = super::gateway::rewrite(route.rewrite, route.strip_prefix, &at)?;
            let request_headers =
                super::gateway::rules(route.request_headers, "request_headers", request_id.is_some(), &at)?;
            let response_headers =
                super::gateway::rules(route.response_headers, "response_headers", request_id.is_some(), &at)?;
            let host = m.host.map(|h| parse_host(&h)).transpose().map_err(|e| (at(&["match", "host"]), e))?;
            let path = match (m.path_prefix, m.path) {
                (Some(_), Some(_)) => {
                    return Err((at(&["match", "path"]), "give either `path` or `path_prefix`, not both".to_owned()))
                }
                (Some(p), None) => {
                    super::PathMatch::Prefix(check_path(&p).map_err(|e| (at(&["match", "path_prefix"]), e))?)
                }
                (None, Some(p)) => super::PathMatch::Exact(check_path(&p).map_err(|e| (at(&["match", "path"]), e))?),
                (None, None) => super::PathMatch::Prefix("/".to_owned()),
            };
            let methods = match m.methods {
                None => None,
                Some(list) => {
                    let mut out = Vec::with_capacity(list.len());
                    for (j, name) in list.iter().enumerate() {
                        let method = Method::from_bytes(name.to_ascii_uppercase().as_bytes()).map_err(|_| {
                            let mut p = at(&["match", "methods"]);
                            p.push(Seg::Index(j));
                            (p, format!("`{name}` is not an HTTP method"))
                        })?;
                        out.push(method);
                    }
                    Some(out)
                }
            };
            if route.strip_prefix && !matches!(path, super::PathMatch::Prefix(_)) {
                return Err((at(&["strip_prefix"]), "strip_prefix needs `match.path_prefix`".to_owned()));
            }
            if route.limits.len() > MAX_LIMITS_PER_ROUTE {
                return Err((
                    at(&["limits"]),
                    format!(
                        "{} limits on one route (aliases expanded); at most {MAX_LIMITS_PER_ROUTE} are accepted",
                        route.limits.len()
                    ),
                ));
            }
            total_limits += route.limits.len();
            if total_limits > MAX_LIMITS {
                return Err((
                    at(&["limits"]),
                    format!(
                        "this route brings the limits of all routes to {total_limits} (aliases expanded); at most \
                         {MAX_LIMITS} are accepted"
                    ),
                ));
            }
            let mut limits = Vec::with_capacity(route.limits.len());
            for (j, raw) in route.limits.into_iter().enumerate() {
                let limit = super::plans::Validated::limit(plans.as_mut(), raw, j, &|field| limit_path(i, j, field))?;
                if limit.store == super::StoreKind::Redis {
                    super::redis::check_limit(&limit, redis.is_some(), &|field| limit_path(i, j, field))?;
                    if let Some(r) = on_error_local {
                        super::redis::check_fallback(&limit, r.instances, &|field| limit_path(i, j, field))?;
                    }
                }
                if limits.iter().any(|l: &super::LimitConfig| l.name == limit.name) {
                    return Err((
                        limit_path(i, j, "name"),
                        format!("limit name `{}` is used twice in this route", limit.name),
                    ));
                }
                limits.push(limit);
            }
            let concurrency = route.concurrency.map(|c| c.validate(at(&["concurrency"]))).transpose()?;
            let retry_after_spread = match route.retry_after_spread {
                None => 0,
                Some(d) if d.0.subsec_nanos() == 0 && d.0.as_secs() <= MAX_RETRY_AFTER_SPREAD => d.0.as_secs(),
                Some(_) => {
                    return Err((
                        at(&["retry_after_spread"]),
                        format!(
                            "expected whole seconds from 0 to {MAX_RETRY_AFTER_SPREAD}s (Retry-After counts seconds)"
                        ),
                    ))
                }
            };
            let upgrades = match route.upgrades {
                None => vec![http::HeaderValue::from_static("websocket")],
                Some(list) => {
                    let mut out = Vec::with_capacity(list.len());
                    for (j, token) in list.iter().enumerate() {
                        let mut p = at(&["upgrades"]);
                        p.push(Seg::Index(j));
                        out.push(super::upgrade_token(token).map_err(|e| (p, e))?);
                    }
                    out
                }
            };
            let tunnels = super::Tunnels {
                idle_timeout: route.tunnels.idle_timeout.map_or(super::Tunnels::IDLE_TIMEOUT, |d| d.0),
                max: match route.tunnels.max {
                    Some(0) => return Err((at(&["tunnels", "max"]), "tunnels.max must be at least 1".to_owned())),
                    Some(m) if m > tokio::sync::Semaphore::MAX_PERMITS => {
                        return Err((
                            at(&["tunnels", "max"]),
                            format!("tunnels.max {m} is more than {} tunnels", tokio::sync::Semaphore::MAX_PERMITS),
                        ))
                    }
                    Some(m) => m,
                    None => super::Tunnels::MAX,
                },
            };
            let (auth, auth_own) = match route.auth {
                None => (default_auth.clone(), false),
                Some(a) => (a.validate(&at(&["auth"]), redis.is_some())?.map(std::sync::Arc::new), true),
            };
            let split = match route.split {
                None => None,
                Some(raw) => {
                    let at_split = |f: &[&str]| {
                        let mut p = at(&["split"]);
                        p.extend(f.iter().map(|f| key(f)));
                        p
                    };
                    let find = |name: &str| upstreams.iter().position(|u| u.name == name);
                    Some(std::sync::Arc::new(raw.validate(&at_split, &find, &known, auth.is_some())?))
                }
            };
            let upstream = split.as_ref().map_or(upstream, |s| s.sides[0].upstream);
            let compression = match route.compression {
                None => default_compression.clone(),
                Some(c) => c.validate(&at(&["compression"]))?.map(std::sync::Arc::new),
            };
            let cors = match route.cors {
                None => default_cors.clone(),
                Some(c) => c.validate(&at(&["cors"]))?.map(std::sync::Arc::new),
            };
            let cache = match route.cache {
                None => default_cache.clone(),
                Some(c) => c.validate(&at(&["cache"]))?.map(std::sync::Arc::new),
            };
            let extensions = match route.extensions {
                None => Vec::new(),
                Some(map) => super::extension::validate(map, &at(&["extensions"]))?,
            };
            for (j, l) in limits.iter().enumerate() {
                let identity = l.key.parts().iter().find(|p| p.needs_identity());
                if let (Some(part), None) = (identity, &auth) {
                    return Err((
                        limit_path(i, j, "key"),
                        format!("`{part}` keys on a verified identity, and this route has no `auth`"),
                    ));
                }
            }
            routes.push(super::Route {
                name,
                host,
                path,
                methods,
                upstream,
                strip_prefix: route.strip_prefix,
                limits,
                concurrency,
                ratelimit_headers: route.ratelimit_headers,
                stale_on_limit: route.on_limit.and_then(|f| f.stale).map(|s| s.max_age.0),
                stale_on_upstream_error: route.on_upstream_error.and_then(|f| f.stale).map(|s| s.max_age.0),
                retry_after_spread,
                conditions,
                rewrite,
                request_headers,
                response_headers,
                upgrades,
                tunnels,
                auth,
                auth_own,
                split,
                compression,
                cors,
                extensions,
                cache,
            });
        }
        let mtls = listeners.iter().any(|l| l.tls.as_ref().is_some_and(|t| t.client_ca.is_some()));
        for (i, r) in routes.iter().enumerate() {
            for (j, l) in r.limits.iter().enumerate() {
                if !mtls && l.key.parts().contains(&crate::limit::KeyPart::TlsClient) {
                    return Err((
                        limit_path(i, j, "key"),
                        "`tls_client` keys on client certificates, and no listener asks for them; give a TLS \
                         listener `client_ca`"
                            .to_owned(),
                    ));
                }
            }
        }
        let (admin, admin_token_source, admin_hosts) = match self.admin {
            Some(a) => {
                let a = a.validate(&mut warnings)?;
                (Some(a.addr), a.token, a.hosts)
            }
            None => (None, None, Vec::new()),
        };
        warnings.extend(super::auth::plain_http_warnings(default_auth.as_deref(), &routes));
        Ok(super::Config {
            listen: listeners[0].addr,
            listeners,
            admin,
            admin_token_source,
            admin_token: None,
            admin_hosts,
            admin_exposed: None,
            trusted_proxies: self.trusted_proxies,
            server,
            log: super::LogConfig {
                format: match self.log.format {
                    RawLogFormat::Text => super::LogFormat::Text,
                    RawLogFormat::Json => super::LogFormat::Json,
                },
                access: self.log.access,
                access_keys: self.log.access_keys,
            },
            cache: super::CacheConfig {
                max_bytes: self.cache.max_bytes.0,
                max_entry_bytes: usize::try_from(self.cache.max_entry_bytes.0).unwrap_or(usize::MAX),
                default: default_cache,
            },
            problem_type_base: type_base,
            redis,
            request_id,
            tracing,
            dns,
            auth: default_auth,
            compression: default_compression,
            cors: default_cors,
            plans: plans.map(super::plans::Validated::finish).transpose()?.map(std::sync::Arc::new),
            warnings,
            upstreams,
            routes,
            shape: super::Shape::default(),
        })
    }
}

impl Upstream {
    fn validate(self, name: &str, at: &dyn Fn(&str) -> Vec<Seg>) -> Result<super::UpstreamKind, Invalid> {
        let tls = super::edge::RawUpstreamTls {
            ca_file: self.ca_file,
            server_name: self.server_name,
            client_cert: self.client_cert,
            tls_insecure_skip_verify: self.tls_insecure_skip_verify,
        };
        let group_fields = [
            ("balance", self.balance.is_some()),
            ("retry", self.retry.is_some()),
            ("health", self.health.is_some()),
            ("outlier", self.outlier.is_some()),
        ];
        if self.servers.is_none() {
            if let Some((field, _)) = group_fields.iter().find(|(_, set)| *set) {
                return Err((at(field), format!("`{field}` applies to groups: list the servers under `servers:`")));
            }
        }
        let target = match (self.url, self.servers) {
            (Some(_), Some(_)) => {
                return Err((
                    at("servers"),
                    "give either `url` (one server) or `servers` (a group), not both".to_owned(),
                ))
            }
            (Some(url), None) => Some((url, None)),
            (None, Some(servers)) => Some((String::new(), Some(servers))),
            (None, None) => None,
        };
        match (target, self.respond) {
            (Some(_), Some(_)) => Err((at("respond"), "give either `url` or `respond`, not both".to_owned())),
            (None, None) => Err((
                vec![key("upstreams"), key(name)],
                "expected `url: http://host:port`, `servers:` or a built-in `respond:` block".to_owned(),
            )),
            (Some((url, servers)), None) => {
                let (authority, base_path, https, group) = match servers {
                    None => {
                        let (authority, base_path, https) = parse_upstream_url(&url).map_err(|e| (at("url"), e))?;
                        (authority, base_path, https, None)
                    }
                    Some(servers) => {
                        let raw = super::group::RawGroup {
                            servers,
                            balance: self.balance,
                            retry: self.retry,
                            health: self.health,
                            outlier: self.outlier,
                        };
                        let (group, base_path, https) = raw.validate(at)?;
                        let authority = group.servers[0].authority.clone();
                        let srv = group.servers.iter().any(|s| s.resolve == super::group::Resolve::Srv);
                        if https && srv && tls.server_name.is_none() {
                            return Err((
                                at("server_name"),
                                "https:// servers found by SRV records are verified under one name: set `server_name` \
                                 (the name their certificates carry; the SRV name is not one)"
                                    .to_owned(),
                            ));
                        }
                        let one_host = group.servers.iter().all(|s| s.authority.host() == authority.host());
                        if https && !one_host && tls.server_name.is_none() {
                            return Err((
                                at("servers"),
                                "the https:// servers of a group are verified under one name: set `server_name` \
                                 (the name their certificates carry)"
                                    .to_owned(),
                            ));
                        }
                        (authority, base_path, https, Some(std::sync::Arc::new(group)))
                    }
                };
                let tls = if https {
                    Some(tls.validate(authority.host(), at)?)
                } else if let Some(field) = tls.any() {
                    return Err((at(field), format!("`{field}` applies to https:// upstreams; this one is http://")));
                } else {
                    None
                };
                let protocol = match (self.protocol, https) {
                    (None | Some(Protocol::Http1), _) | (Some(Protocol::Auto), false) => super::UpstreamProtocol::Http1,
                    (Some(Protocol::Auto), true) => super::UpstreamProtocol::Auto,
                    (Some(Protocol::H2c), false) => super::UpstreamProtocol::H2c,
                    (Some(Protocol::H2), true) => super::UpstreamProtocol::H2,
                    (Some(Protocol::H2c), true) => {
                        return Err((
                            at("protocol"),
                            "`h2c` is HTTP/2 without TLS; this upstream is https:// (use `h2` for HTTP/2 over TLS, \
                             or `auto` to let ALPN choose)"
                                .to_owned(),
                        ))
                    }
                    (Some(Protocol::H2), false) => {
                        return Err((
                            at("protocol"),
                            "`h2` is HTTP/2 over TLS (chosen by ALPN); this upstream is http:// (use `h2c` for \
                             HTTP/2 without TLS, with prior knowledge)"
                                .to_owned(),
                        ))
                    }
                };
                let h2 = match self.h2 {
                    None => super::UpstreamH2::default(),
                    Some(_) if protocol == super::UpstreamProtocol::Http1 => {
                        return Err((
                            at("h2"),
                            "`h2` settings apply to HTTP/2 upstreams: `protocol: h2c`, `h2`, or `auto` on https://"
                                .to_owned(),
                        ))
                    }
                    Some(h) => {
                        let d = super::UpstreamH2::default();
                        let at_h2 = |f: &str| {
                            let mut p = at("h2");
                            p.push(key(f));
                            p
                        };
                        let positive = |v: Option<usize>, dflt: usize, f: &str| match v {
                            Some(0) => Err((at_h2(f), format!("`{f}` must be at least 1"))),
                            Some(n) => Ok(n),
                            None => Ok(dflt),
                        };
                        super::UpstreamH2 {
                            max_connections: positive(h.max_connections, d.max_connections, "max_connections")?,
                            max_streams_per_connection: positive(
                                h.max_streams_per_connection,
                                d.max_streams_per_connection,
                                "max_streams_per_connection",
                            )?,
                            ping_interval: h.ping_interval.map_or(d.ping_interval, |v| v.0),
                            ping_timeout: h.ping_timeout.map_or(d.ping_timeout, |v| v.0),
                        }
                    }
                };
                Ok(super::UpstreamKind::Http(super::HttpUpstream {
                    authority,
                    base_path,
                    connect_timeout: self.connect_timeout.map_or(std::time::Duration::from_secs(5), |d| d.0),
                    timeout: self.timeout.map_or(std::time::Duration::from_secs(30), |d| d.0),
                    read_timeout: self.read_timeout.map_or(std::time::Duration::from_secs(60), |d| d.0),
                    pool_idle_timeout: self.pool_idle_timeout.map_or(std::time::Duration::from_secs(90), |d| d.0),
                    pool_max_idle: self.pool_max_idle.unwrap_or(1024),
                    preserve_host: self.preserve_host.unwrap_or(true),
                    tls,
                    protocol,
                    h2,
                    group,
                }))
            }
            (None, Some(r)) => {
                for (field, set) in [
                    ("connect_timeout", self.connect_timeout.is_some()),
                    ("timeout", self.timeout.is_some()),
                    ("read_timeout", self.read_timeout.is_some()),
                    ("pool_idle_timeout", self.pool_idle_timeout.is_some()),
                    ("pool_max_idle", self.pool_max_idle.is_some()),
                    ("preserve_host", self.preserve_host.is_some()),
                    ("ca_file", tls.ca_file.is_some()),
                    ("server_name", tls.server_name.is_some()),
                    ("client_cert", tls.client_cert.is_some()),
                    ("tls_insecure_skip_verify", tls.tls_insecure_skip_verify.is_some()),
                    ("protocol", self.protocol.is_some()),
                    ("h2", self.h2.is_some()),
                ] {
                    if set {
                        return Err((at(field), format!("`{field}` applies to `url` upstreams, not to `respond`")));
                    }
                }
                let at_respond = |f: &str| {
                    let mut p = at("respond");
                    p.push(key(f));
                    p
                };
                let status = StatusCode::from_u16(r.status).ok().filter(|s| s.as_u16() >= 200).ok_or_else(|| {
                    (at_respond("status"), format!("{} is not a status code; expected 200-999", r.status))
                })?;
                let mut headers = HeaderMap::with_capacity(r.headers.len());
                for (n, v) in &r.headers {
                    let (n, v) = parse_header(
                        || {
                            let mut p = at_respond("headers");
                            p.push(key(n));
                            p
                        },
                        n,
                        v,
                    )?;
                    headers.append(n, v);
                }
                if r.body_size.is_some() && !r.body.is_empty() {
                    return Err((at_respond("body_size"), "give either `body` or `body_size`, not both".to_owned()));
                }
                let base = at("respond");
                let raw = super::respond::RawFaults {
                    latency: r.latency,
                    errors: r.errors,
                    resets: r.resets,
                    body_size: r.body_size,
                    drip: r.drip,
                    seed: r.seed,
                };
                let (latency, faults) = super::respond::validate(raw, &|f| super::respond::path(&base, f))?;
                Ok(super::UpstreamKind::Respond(super::Responder {
                    status,
                    headers,
                    body: Bytes::from(r.body),
                    latency,
                    max_body: r.max_body.map_or(DEFAULT_RESPOND_MAX_BODY, |s| s.0),
                    faults: faults.map(Box::new),
                }))
            }
        }
    }
}

fn parse_host(h: &str) -> Result<super::HostMatch, String> {
    let h = h.trim().to_ascii_lowercase();
    let valid = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if let Some(rest) = h.strip_prefix("*.") {
        if valid(rest) {
            return Ok(super::HostMatch::Suffix(format!(".{rest}")));
        }
    } else if valid(&h) {
        return Ok(super::HostMatch::Exact(h));
    }
    Err(format!("`{h}` is not a host name; expected e.g. api.example.com or *.example.com (no port)"))
}

fn check_path(p: &str) -> Result<String, String> {
    if p.starts_with('/') {
        Ok(p.to_owned())
    } else {
        Err(format!("`{p}` must start with `/`"))
    }
}
