//! The validated config written back in the shape of proxy.yaml, defaults filled in: what the
//! admin listener's `GET /config` serves. One source: [`Config`] is `Serialize` through this
//! module, and a test walks the YAML's own fields (every mapping the deserializer knows) and
//! finds each in a full config's output, so a field added to the YAML and not here fails.
//!
//! Secrets never appear: an inline admin token is `***`, a secret file and a keys file are
//! named by their path (never read back), API key digests and a plan's clients are counted,
//! not listed, and passwords in URLs (Redis, a collector) are `***`, as is a key set URL's
//! query. Durations are written as the YAML takes them (`1s`, `333.333ms`), byte sizes in
//! binary units when whole (`64MiB`), a limit's rate as written with its algorithm's own
//! parameters beside it (`burst: 20`).

use serde::ser::{Serialize, Serializer};
use serde_json::{json, Map, Value};

use super::auth::{ApiKeys, AuthConfig, Credential, Jwks, Method};
use super::edge::{ClientAuth, Listener, ProxyProtocol};
use super::gateway::{Conditions, ValueMatch};
use super::group::{Balance, GroupConfig};
use super::rules::HeaderRules;
use super::units::Dur;
use super::{
    Concurrency, Config, HostMatch, LimitConfig, LogFormat, Mode, OtlpProtocol, PathMatch, Route, StoreKind, Upstream,
    UpstreamKind, UpstreamProtocol, Workers,
};
use crate::limit::plan::{Clients, Plans};
use crate::limit::store::redis::{OnError, Topology};
use crate::limit::Algorithm;

impl Serialize for Config {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        shown(self).serialize(s)
    }
}

fn dur(d: std::time::Duration) -> Value {
    Value::String(Dur(d).to_string())
}

fn span(s: crate::limit::Span) -> Value {
    dur(std::time::Duration::from_micros(s.as_micros()))
}

/// A byte count in the largest binary unit that divides it (`64MiB`), else in bytes.
fn size(n: u64) -> Value {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n != 0 && n % (1 << shift) == 0 {
            return Value::String(format!("{}{unit}", n >> shift));
        }
    }
    Value::from(n)
}

fn path(p: &std::path::Path) -> Value {
    Value::String(p.display().to_string())
}

/// `redis://user:secret@host` → `redis://user:***@host`.
fn url(u: &str) -> Value {
    Value::String(super::redact(u))
}

/// An object of the `(key, value)` pairs whose value is not null.
fn object(pairs: Vec<(&str, Value)>) -> Value {
    Value::Object(pairs.into_iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.to_owned(), v)).collect())
}

fn opt<T>(v: Option<T>, f: impl FnOnce(T) -> Value) -> Value {
    v.map_or(Value::Null, f)
}

/// The whole config.
pub fn shown(c: &Config) -> Value {
    object(vec![
        ("listen", c.listeners.iter().map(listener).collect()),
        ("admin", opt(c.admin, |addr| admin(c, addr))),
        ("trusted_proxies", c.trusted_proxies.iter().map(|n| Value::String(n.to_string())).collect()),
        ("server", server(c)),
        (
            "log",
            json!({
                "format": match c.log.format { LogFormat::Text => "text", LogFormat::Json => "json" },
                "access": c.log.access,
                "access_keys": c.log.access_keys,
            }),
        ),
        (
            "cache",
            json!({
                "max_bytes": size(c.cache.max_bytes),
                "max_entry_bytes": size(c.cache.max_entry_bytes as u64),
                "default": opt(c.cache.default.as_deref(), route_cache),
            }),
        ),
        ("problems", json!({ "type_base": c.problem_type_base })),
        ("redis", opt(c.redis.as_ref(), redis)),
        (
            "request_id",
            json!({ "enabled": c.request_id.is_some(), "header": c.request_id.as_ref().map(|h| h.as_str()) }),
        ),
        ("plans", opt(c.plans.as_deref(), |p| plans(p, c))),
        ("auth", opt(c.auth.as_deref(), auth)),
        ("cors", opt(c.cors.as_deref(), cors)),
        ("compression", opt(c.compression.as_deref(), compression)),
        ("tracing", opt(c.tracing.as_ref(), tracing)),
        (
            "dns",
            json!({
                "nameservers": c.dns.nameservers.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "min_ttl": dur(c.dns.min_ttl),
                "max_ttl": dur(c.dns.max_ttl),
                "timeout": dur(c.dns.timeout),
                "required": c.dns.required,
            }),
        ),
        ("upstreams", Value::Object(c.upstreams.iter().map(|u| (u.name.clone(), upstream(u))).collect())),
        ("routes", c.routes.iter().map(|r| route(c, r)).collect()),
    ])
}

fn admin(c: &Config, addr: std::net::SocketAddr) -> Value {
    use super::admin::TokenSource;
    object(vec![
        ("addr", Value::String(addr.to_string())),
        ("token", opt(c.admin_token_source.as_ref().filter(|t| matches!(t, TokenSource::Inline(_))), |_| "***".into())),
        (
            "token_file",
            opt(c.admin_token_source.as_ref(), |t| match t {
                TokenSource::File(p) => path(p),
                TokenSource::Inline(_) => Value::Null,
            }),
        ),
        ("allowed_hosts", json!(c.admin_hosts)),
    ])
}

/// The certificates a TLS listener obtains itself, as `acme:` and `internal:` write them.
fn managed(certs: &[super::managed::ManagedCert]) -> (Value, Value) {
    use super::managed::CertSource;
    let names = |n: &[String]| if n.len() == 1 { Value::String(n[0].clone()) } else { json!(n) };
    let acme: Vec<_> = certs
        .iter()
        .filter_map(|m| match &m.source {
            CertSource::Acme(a) => Some((m, a)),
            CertSource::Internal(_) => None,
        })
        .collect();
    let acme = acme.first().map_or(Value::Null, |(_, a)| {
        object(vec![
            ("names", acme.iter().map(|(m, _)| names(&m.names)).collect()),
            ("email", opt(a.email.as_ref(), |e| Value::String(e.clone()))),
            ("directory", url(&a.directory)),
            ("challenge", Value::from(a.challenge.as_str())),
            ("storage", path(&a.storage)),
            ("directory_ca", opt(a.directory_ca.as_deref(), path)),
            (
                "eab",
                opt(a.eab.as_ref(), |e| {
                    object(vec![
                        ("kid", Value::String(e.kid.clone())),
                        // Given inline when no file names it: never shown.
                        ("hmac_key", if e.hmac_key_file.is_none() { Value::from("***") } else { Value::Null }),
                        ("hmac_key_file", opt(e.hmac_key_file.as_deref(), path)),
                    ])
                }),
            ),
        ])
    });
    let internal = certs
        .iter()
        .find_map(|m| match &m.source {
            CertSource::Internal(i) => Some((m, i)),
            CertSource::Acme(_) => None,
        })
        .map_or(
            Value::Null,
            |(m, i)| json!({ "names": m.names, "lifetime": dur(i.lifetime), "storage": path(&i.storage) }),
        );
    (acme, internal)
}

fn listener(l: &Listener) -> Value {
    let tls = l.tls.as_ref().map(|t| {
        let served = t.loaded.as_ref().map(|ld| &ld.served);
        let certificates: Vec<Value> = t
            .certificates
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let facts = served.and_then(|s| s.get(i));
                object(vec![
                    ("cert", path(&c.files.cert)),
                    ("key", path(&c.files.key)),
                    ("ocsp", opt(c.ocsp.as_deref(), path)),
                    // What the files were found to serve, when they were read.
                    ("names", opt(facts, |f| json!(f.names))),
                    ("not_after", opt(facts, |f| Value::String(crate::pki::x509::date(f.not_after)))),
                ])
            })
            .collect();
        let (acme, internal) = managed(&t.managed);
        object(vec![
            ("certificates", Value::Array(certificates)),
            ("acme", acme),
            ("internal", internal),
            ("client_ca", opt(t.client_ca.as_deref(), path)),
            (
                "client_auth",
                Value::from(match t.client_auth {
                    ClientAuth::Required => "required",
                    ClientAuth::Optional => "optional",
                }),
            ),
            ("handshake_timeout", dur(t.handshake_timeout)),
        ])
    });
    object(vec![
        ("addr", Value::String(l.addr.to_string())),
        ("tls", tls.unwrap_or(Value::Null)),
        (
            "proxy_protocol",
            opt(l.proxy_protocol, |p| {
                Value::from(match p {
                    ProxyProtocol::V1 => "v1",
                    ProxyProtocol::V2 => "v2",
                    ProxyProtocol::Optional => "optional",
                })
            }),
        ),
        ("redirect_https", Value::Bool(l.redirect_https)),
        ("http3", Value::Bool(l.http3.is_some())),
        (
            "quic",
            opt(l.http3.as_ref(), |q| {
                json!({
                    "max_concurrent_streams": q.max_concurrent_streams,
                    "idle_timeout": dur(q.idle_timeout),
                    "early_data": q.early_data,
                    "retry_above": q.retry_above,
                    "new_connections_per_ip": q.new_connections_per_ip,
                })
            }),
        ),
    ])
}

fn server(c: &Config) -> Value {
    let s = &c.server;
    let h2 = &s.h2;
    json!({
        "header_read_timeout": dur(s.header_read_timeout),
        "keepalive_timeout": dur(s.keepalive_timeout),
        "send_timeout": dur(s.send_timeout),
        "max_header_bytes": s.max_header_bytes,
        "grace_period": dur(s.grace_period),
        "body_read_timeout": dur(s.body_read_timeout),
        "max_connections": s.max_connections,
        "workers": match s.workers { Workers::Auto => Value::from("auto"), Workers::Count(n) => Value::from(n) },
        "h2": {
            "idle_timeout": dur(h2.idle_timeout),
            "ping_interval": dur(h2.ping_interval),
            "ping_timeout": dur(h2.ping_timeout),
            "max_concurrent_streams": h2.max_concurrent_streams,
            "max_header_list_size": size(u64::from(h2.max_header_list_size)),
            "max_pending_accept_reset_streams": h2.max_pending_accept_reset_streams,
            "max_local_error_reset_streams": h2.max_local_error_reset_streams,
            "initial_stream_window": size(u64::from(h2.initial_stream_window)),
            "initial_connection_window": size(u64::from(h2.initial_connection_window)),
            "max_frame_size": size(u64::from(h2.max_frame_size)),
            "max_send_buffer": size(h2.max_send_buffer as u64),
        },
    })
}

fn redis(r: &crate::limit::RedisConfig) -> Value {
    let (url_field, cluster) = match &r.target {
        Topology::Single(u) => (url(u), Value::Null),
        Topology::Cluster(urls) => (Value::Null, urls.iter().map(|u| url(u)).collect()),
    };
    object(vec![
        ("url", url_field),
        ("cluster", cluster),
        ("timeout", dur(r.timeout)),
        (
            "on_error",
            Value::from(match r.on_error {
                OnError::Allow => "allow",
                OnError::Deny => "deny",
                OnError::Local => "local",
            }),
        ),
        ("instances", Value::from(r.instances.get())),
        ("breaker", json!({ "failures": r.breaker_failures.get(), "cooldown": dur(r.breaker_cooldown) })),
        ("lease_ttl", dur(r.lease_ttl)),
        ("memo_keys", Value::from(r.memo_keys)),
        ("connect_timeout", dur(r.connect_timeout)),
    ])
}

fn tracing(t: &super::TracingConfig) -> Value {
    json!({
        "otlp": {
            "endpoint": url(&t.endpoint.to_string()),
            "protocol": match t.protocol { OtlpProtocol::Grpc => "grpc", OtlpProtocol::Http => "http" },
        },
        "sample": t.sample,
        "parent_based": t.parent_based,
        "service_name": t.service_name,
        "queue": t.queue,
        "batch": t.batch,
        "interval": dur(t.interval),
        "timeout": dur(t.timeout),
    })
}

/// `plans:`: the tiers with the parameters of each plan limit (found on the routes' plan
/// limits, by name); the clients map is counted, never listed.
fn plans(p: &Plans, c: &Config) -> Value {
    let mut plan_limits: Vec<&LimitConfig> = Vec::new();
    for l in c.routes.iter().flat_map(|r| &r.limits).filter(|l| l.plan.is_some()) {
        if !plan_limits.iter().any(|k| k.name == l.name) {
            plan_limits.push(l);
        }
    }
    let tiers: Map<String, Value> = p
        .tiers
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let v = if t.deny {
                Value::from("deny")
            } else {
                Value::Object(
                    plan_limits
                        .iter()
                        .filter_map(|l| {
                            let alg = l.plan.as_ref()?.algorithms.get(i)?.as_ref()?;
                            Some((l.name.clone(), params(alg, None)))
                        })
                        .collect(),
                )
            };
            (t.name.clone(), v)
        })
        .collect();
    object(vec![
        ("of", Value::String(p.of.to_string())),
        (
            "clients",
            match &p.clients {
                Clients::File { path: f, map } => json!({ "file": path(f), "clients": map.len() }),
                Clients::Redis { hash, cache } => json!({ "redis_hash": hash, "cache": dur(*cache) }),
            },
        ),
        ("default", opt(p.tiers.get(usize::from(p.default)), |t| Value::String(t.name.clone()))),
        ("tiers", Value::Object(tiers)),
        ("tier_claim", opt(p.tier_claim.as_ref(), |c| Value::String(c.clone()))),
    ])
}

fn credential(c: &Credential) -> Value {
    Value::String(match c {
        Credential::Header(h) => format!("header:{h}"),
        Credential::Query(q) => format!("query:{q}"),
        Credential::Cookie(k) => format!("cookie:{k}"),
    })
}

/// A key set URL with its query hidden (it may carry a token).
fn jwks_url(u: &http::Uri) -> Value {
    let text = u.to_string();
    match text.split_once('?') {
        Some((head, _)) => url(&format!("{head}?***")),
        None => url(&text),
    }
}

fn auth(a: &AuthConfig) -> Value {
    let method = match &a.method {
        Method::Jwt(j) => {
            let algorithms: Vec<&str> = crate::jwt::Alg::ALL
                .into_iter()
                .filter(|x| j.rules.algorithms.contains(*x))
                .map(crate::jwt::Alg::as_str)
                .collect();
            let (jwks, secret_file, min_refresh) = match &j.keys {
                Jwks::File { path: p, .. } => (path(p), Value::Null, Value::Null),
                Jwks::Url { url: u, min_refresh } => (jwks_url(u), Value::Null, dur(*min_refresh)),
                Jwks::Secret { path: p, .. } => (Value::Null, path(p), Value::Null),
            };
            (
                "jwt",
                object(vec![
                    ("jwks", jwks),
                    ("secret_file", secret_file),
                    ("issuers", json!(j.rules.issuers)),
                    ("audiences", json!(j.rules.audiences)),
                    ("algorithms", json!(algorithms)),
                    ("leeway", dur(std::time::Duration::from_secs(j.rules.leeway_secs.unsigned_abs()))),
                    ("min_refresh", min_refresh),
                    ("from", credential(&j.from)),
                    ("consumer_claim", Value::String(j.rules.consumer_claim.clone())),
                    ("cache", Value::from(j.cache)),
                ]),
            )
        }
        Method::ApiKey(k) => (
            "api_key",
            json!({
                "from": credential(&k.from),
                "keys": match &k.keys {
                    ApiKeys::File { path: p, consumers } => json!({ "file": path(p), "keys": consumers.len() }),
                    ApiKeys::Redis { hash, cache } => json!({ "redis_hash": hash, "cache": dur(*cache) }),
                },
            }),
        ),
    };
    let mut out = Map::new();
    out.insert(method.0.to_owned(), method.1);
    out.insert("optional".into(), Value::Bool(a.optional));
    out.insert(
        "claims_to_headers".into(),
        Value::Object(a.claims_to_headers.iter().map(|(c, h)| (c.clone(), Value::from(h.as_str()))).collect()),
    );
    out.insert("strip_credentials".into(), Value::Bool(a.strip_credentials));
    Value::Object(out)
}

fn upstream(u: &Upstream) -> Value {
    match &u.kind {
        UpstreamKind::Respond(r) => {
            let f = r.faults.as_deref();
            let latency = match f.and_then(|f| f.latency) {
                None => dur(r.latency),
                Some(super::respond::Latency::Uniform { min, max }) => {
                    json!({ "distribution": "uniform", "min": dur(min), "max": dur(max) })
                }
                Some(super::respond::Latency::Normal { p50, p99 }) => {
                    json!({ "distribution": "normal", "p50": dur(p50), "p99": dur(p99) })
                }
                Some(super::respond::Latency::LogNormal { p50, p99 }) => {
                    json!({ "distribution": "lognormal", "p50": dur(p50), "p99": dur(p99) })
                }
            };
            json!({ "respond": object(vec![
                ("status", Value::from(r.status.as_u16())),
                ("headers", r.headers.iter().map(|(k, v)| (k.as_str().to_owned(), Value::from(String::from_utf8_lossy(v.as_bytes())))).collect::<Map<_, _>>().into()),
                ("body", Value::from(String::from_utf8_lossy(&r.body))),
                ("latency", latency),
                ("max_body", size(r.max_body)),
                ("errors", opt(f.and_then(|f| f.errors.as_ref()), |e| json!({ "share": e.share, "status": e.status.as_u16() }))),
                ("resets", opt(f.filter(|f| f.resets > 0.0), |f| Value::from(f.resets))),
                ("body_size", opt(f.and_then(|f| f.body_size), size)),
                ("drip", opt(f.and_then(|f| f.drip), |d| json!({ "bytes": size(d.bytes), "every": dur(d.every) }))),
                ("seed", opt(f.and_then(|f| f.seed), Value::from)),
            ])})
        }
        UpstreamKind::Http(h) => {
            let scheme = if h.tls.is_some() { "https" } else { "http" };
            let mut pairs = match &h.group {
                None => vec![("url", Value::String(format!("{scheme}://{}{}", h.authority, h.base_path)))],
                Some(g) => group(g, scheme),
            };
            pairs.extend([
                ("connect_timeout", dur(h.connect_timeout)),
                ("timeout", dur(h.timeout)),
                ("read_timeout", dur(h.read_timeout)),
                ("pool_idle_timeout", dur(h.pool_idle_timeout)),
                ("pool_max_idle", Value::from(h.pool_max_idle)),
                ("preserve_host", Value::Bool(h.preserve_host)),
                (
                    "protocol",
                    Value::from(match h.protocol {
                        UpstreamProtocol::Http1 => "http1",
                        UpstreamProtocol::H2c => "h2c",
                        UpstreamProtocol::H2 => "h2",
                        UpstreamProtocol::Auto => "auto",
                    }),
                ),
                (
                    "h2",
                    json!({
                        "max_connections": h.h2.max_connections,
                        "max_streams_per_connection": h.h2.max_streams_per_connection,
                        "ping_interval": dur(h.h2.ping_interval),
                        "ping_timeout": dur(h.h2.ping_timeout),
                    }),
                ),
            ]);
            if let Some(t) = &h.tls {
                pairs.extend([
                    ("ca_file", opt(t.ca_file.as_deref(), path)),
                    ("server_name", Value::String(t.server_name.clone())),
                    (
                        "client_cert",
                        opt(t.client_cert.as_ref(), |c| json!({ "cert": path(&c.cert), "key": path(&c.key) })),
                    ),
                    ("tls_insecure_skip_verify", Value::Bool(t.insecure_skip_verify)),
                ]);
            }
            object(pairs)
        }
    }
}

/// A group's fields: its servers (their state now is the admin listener's to add), balancing,
/// retries, checks and ejection.
fn group(g: &GroupConfig, scheme: &str) -> Vec<(&'static str, Value)> {
    let r = &g.retry;
    vec![
        (
            "servers",
            g.servers
                .iter()
                .map(|s| {
                    let resolve = match s.resolve {
                        super::group::Resolve::Fixed => Value::Bool(false),
                        super::group::Resolve::Addresses => Value::Bool(true),
                        super::group::Resolve::Srv => Value::from("srv"),
                    };
                    json!({ "url": format!("{scheme}://{}", s.authority), "weight": s.weight, "resolve": resolve })
                })
                .collect(),
        ),
        (
            "balance",
            match &g.balance {
                Balance::LeastRequest => Value::from("least_request"),
                Balance::RoundRobin => Value::from("round_robin"),
                Balance::Hash(k) => json!({ "hash": k.parts().iter().map(ToString::to_string).collect::<Vec<_>>() }),
            },
        ),
        (
            "retry",
            object(vec![
                ("attempts", Value::from(r.attempts)),
                ("on", json!(r.on.names())),
                ("per_try_timeout", opt(r.per_try_timeout, dur)),
                ("budget", json!({ "ratio": r.ratio, "min_per_s": r.min_per_s })),
            ]),
        ),
        (
            "health",
            opt(g.health.as_ref(), |c| {
                json!({
                    "path": c.path,
                    "interval": dur(c.interval),
                    "timeout": dur(c.timeout),
                    "healthy": c.healthy,
                    "unhealthy": c.unhealthy,
                    "expect": if c.expect.0 == c.expect.1 { Value::from(c.expect.0) } else { Value::from(format!("{}-{}", c.expect.0, c.expect.1)) },
                })
            }),
        ),
        (
            "outlier",
            json!({
                "consecutive_failures": g.outlier.consecutive_failures,
                "base_ejection_time": dur(g.outlier.base_ejection_time),
                "max_ejection_time": dur(g.outlier.max_ejection_time),
                "max_ejected_percent": g.outlier.max_ejected_percent,
            }),
        ),
    ]
}

fn value_match(m: &ValueMatch) -> Value {
    match m {
        ValueMatch::Exact(v) => Value::String(String::from_utf8_lossy(v).into_owned()),
        ValueMatch::Present(p) => json!({ "present": p }),
        ValueMatch::Regex(r) => json!({ "regex": r }),
    }
}

fn conditions(c: Option<&Conditions>) -> (Value, Value) {
    let Some(c) = c else { return (json!({}), json!({})) };
    (
        Value::Object(c.headers.iter().map(|(h, m)| (h.as_str().to_owned(), value_match(m))).collect()),
        Value::Object(c.query.iter().map(|(q, m)| (q.clone(), value_match(m))).collect()),
    )
}

fn rules(r: &HeaderRules) -> Value {
    let list = |l: &[(http::HeaderName, super::rules::Template)]| -> Value {
        Value::Object(l.iter().map(|(h, t)| (h.as_str().to_owned(), Value::String(t.to_string()))).collect())
    };
    json!({
        "remove": r.remove.iter().map(http::HeaderName::as_str).collect::<Vec<_>>(),
        "set": list(&r.set),
        "add": list(&r.add),
    })
}

fn route(c: &Config, r: &Route) -> Value {
    let (headers, query) = conditions(r.conditions.as_deref());
    let matcher = object(vec![
        (
            "host",
            opt(r.host.as_ref(), |h| {
                Value::String(match h {
                    HostMatch::Exact(e) => e.clone(),
                    HostMatch::Suffix(s) => format!("*{s}"),
                })
            }),
        ),
        (
            "path_prefix",
            match &r.path {
                PathMatch::Prefix(p) => Value::String(p.clone()),
                PathMatch::Exact(_) => Value::Null,
            },
        ),
        (
            "path",
            match &r.path {
                PathMatch::Exact(p) => Value::String(p.clone()),
                PathMatch::Prefix(_) => Value::Null,
            },
        ),
        ("methods", opt(r.methods.as_ref(), |m| m.iter().map(|m| Value::from(m.as_str())).collect())),
        ("headers", headers),
        ("query", query),
    ]);
    let stale = |d: Option<std::time::Duration>| opt(d, |d| json!({ "stale": { "max_age": dur(d) } }));
    object(vec![
        ("name", Value::String(r.name.clone())),
        ("match", matcher),
        ("upstream", Value::String(c.upstream(r).name.clone())),
        ("split", opt(r.split.as_deref(), |s| split(c, s))),
        ("strip_prefix", Value::Bool(r.strip_prefix)),
        ("limits", r.limits.iter().map(limit).collect()),
        ("concurrency", opt(r.concurrency.as_ref(), concurrency)),
        ("ratelimit_headers", Value::Bool(r.ratelimit_headers)),
        ("on_limit", stale(r.stale_on_limit)),
        ("on_upstream_error", stale(r.stale_on_upstream_error)),
        ("retry_after_spread", dur(std::time::Duration::from_secs(r.retry_after_spread))),
        (
            "rewrite",
            opt(r.rewrite.as_deref(), |w| json!({ "path_regex": { "pattern": w.pattern, "replace": w.replace } })),
        ),
        ("request_headers", opt(r.request_headers.as_deref(), rules)),
        ("response_headers", opt(r.response_headers.as_deref(), rules)),
        ("upgrades", r.upgrades.iter().map(|u| Value::from(String::from_utf8_lossy(u.as_bytes()))).collect()),
        ("tunnels", json!({ "idle_timeout": dur(r.tunnels.idle_timeout), "max": r.tunnels.max })),
        // The auth in effect: the route's own, the top-level default it inherits, or `none`.
        ("auth", r.auth.as_deref().map_or_else(|| Value::from("none"), auth)),
        // Likewise the CORS in effect.
        ("cors", r.cors.as_deref().map_or_else(|| Value::from("none"), cors)),
        ("compression", r.compression.as_deref().map_or_else(|| Value::from("none"), compression)),
        ("cache", r.cache.as_deref().map_or_else(|| Value::from("none"), route_cache)),
        (
            "extensions",
            if r.extensions.is_empty() {
                Value::Null
            } else {
                Value::Object(
                    r.extensions
                        .iter()
                        .map(|e| (e.name.clone(), serde_json::to_value(&e.value).unwrap_or(Value::Null)))
                        .collect(),
                )
            },
        ),
    ])
}

/// A route's `cache:` in effect, every field with its value (defaults included).
fn route_cache(c: &super::cache::RouteCacheConfig) -> Value {
    json!({
        "hits_spend_limits": c.hits_spend_limits,
        "max_entry_bytes": c.max_entry_bytes.map(size),
        "coalesce_wait": dur(c.coalesce_wait),
        "heuristic": c.heuristic.map(|h| json!({ "percent": h.percent, "max": dur(h.max) })),
        "stale_while_revalidate": dur(c.stale_while_revalidate),
        "key": {
            "query": c.key.query,
            "ignore_query": c.key.ignore_query,
            "headers": c.key.headers.iter().map(http::HeaderName::as_str).collect::<Vec<_>>(),
        },
    })
}

/// `compression:` in effect, every field with its value (defaults included).
fn compression(c: &super::compression::CompressionConfig) -> Value {
    let types: Vec<String> = c.types.iter().map(ToString::to_string).collect();
    json!({
        "encodings": c.encodings.iter().map(|e| e.token()).collect::<Vec<_>>(),
        "levels": { "gzip": c.levels.gzip, "br": c.levels.br, "zstd": c.levels.zstd },
        "min_size": size(c.min_size),
        "types": types,
    })
}

/// `cors:` as written: origins in their three forms, `*` for a list that allows any.
fn cors(c: &super::cors::CorsConfig) -> Value {
    use super::cors::{Allow, OriginRule, Origins};
    fn allow<T>(a: &Allow<T>, name: impl Fn(&T) -> &str) -> Value {
        match a {
            Allow::Any => json!(["*"]),
            Allow::List(l) => l.iter().map(|x| Value::from(name(x))).collect(),
        }
    }
    let origins: Value = match &c.origins {
        Origins::Any => json!(["*"]),
        Origins::List(l) => l
            .iter()
            .map(|o| match o {
                OriginRule::Exact(s) => Value::from(s.as_str()),
                OriginRule::Wildcard { scheme, suffix, port } => Value::from(format!(
                    "{}*{suffix}{}",
                    scheme.as_ref().map_or(String::new(), |s| format!("{s}://")),
                    port.map_or(String::new(), |p| format!(":{p}"))
                )),
                OriginRule::Regex(r) => json!({ "regex": r }),
            })
            .collect(),
    };
    json!({
        "origins": origins,
        "methods": allow(&c.methods, http::Method::as_str),
        "headers": allow(&c.headers, http::HeaderName::as_str),
        "expose": allow(&c.expose, http::HeaderName::as_str),
        "credentials": c.credentials,
        "max_age": dur(c.max_age),
        "limit_preflights": c.limit_preflights,
    })
}

/// `split:`: its sides by upstream name, the sticky key and the override header.
fn split(c: &Config, s: &super::split::Split) -> Value {
    object(vec![
        (
            "upstreams",
            s.sides
                .iter()
                .map(|side| json!({ "name": c.upstreams[side.upstream].name, "weight": side.weight }))
                .collect(),
        ),
        ("sticky", opt(s.sticky.as_ref(), |k| k.parts().iter().map(|p| Value::String(p.to_string())).collect())),
        (
            "override",
            opt(s.overrides.as_ref(), |o| {
                let values: Map<String, Value> = o
                    .values
                    .iter()
                    .map(|(v, side)| {
                        let name = s.sides.get(*side).map_or("", |sd| c.upstreams[sd.upstream].name.as_str());
                        (String::from_utf8_lossy(v.as_bytes()).into_owned(), Value::from(name))
                    })
                    .collect();
                json!({ "header": o.header.as_str(), "values": values })
            }),
        ),
    ])
}

fn concurrency(k: &Concurrency) -> Value {
    object(vec![
        ("max", if k.adaptive.is_some() { Value::Null } else { Value::from(k.max) }),
        ("max_wait", dur(k.max_wait)),
        (
            "adaptive",
            opt(k.adaptive.as_ref(), |a| {
                json!({
                    "min": a.min,
                    "max": a.max,
                    "window": dur(a.window),
                    "percentile": a.percentile,
                    "tolerance": a.tolerance,
                    "smoothing": a.smoothing,
                    "relearn": a.relearn,
                })
            }),
        ),
    ])
}

/// A limit as the YAML writes it, its algorithm's parameters in the YAML's own fields.
pub fn limit(l: &LimitConfig) -> Value {
    // A plan limit's parameters are its tiers' (under `plans.tiers`).
    let mut v = match &l.plan {
        Some(_) => json!({ "algorithm": super::algorithm_name(&l.algorithm) }),
        None => params(&l.algorithm, Some(l)),
    };
    if let Value::Object(m) = &mut v {
        let mut out = Map::new();
        out.insert("name".into(), Value::String(l.name.clone()));
        out.append(m);
        out.insert("key".into(), l.key.parts().iter().map(|p| Value::String(p.to_string())).collect());
        out.insert(
            "store".into(),
            Value::from(match l.store {
                StoreKind::Local => "local",
                StoreKind::Redis => "redis",
            }),
        );
        out.insert(
            "cost".into(),
            match &l.response_cost {
                None => Value::from(l.cost),
                Some(h) => json!({ "estimate": l.cost, "response_header": h.as_str() }),
            },
        );
        out.insert(
            "mode".into(),
            Value::from(match l.mode {
                Mode::Enforce => "enforce",
                Mode::Shadow => "shadow",
            }),
        );
        if let Some(n) = l.lease {
            out.insert("lease".into(), Value::from(n.get()));
        }
        if l.store == StoreKind::Local {
            out.insert("max_keys".into(), Value::from(l.max_keys));
        }
        out.insert("plan".into(), Value::Bool(l.plan.is_some()));
        out.insert("show_keys".into(), Value::Bool(l.show_keys));
        out.insert("early_retry".into(), json!({ "penalty": if l.early_penalty { "double" } else { "none" } }));
        return Value::Object(out);
    }
    v
}

/// An algorithm's parameters in the YAML's fields: `algorithm`, `rate` (as written when the
/// limit is given, else from the algorithm's interval or window), and its own (`burst`,
/// `warmup`, `max_delay`, `calendar`).
pub fn params(alg: &Algorithm, written: Option<&LimitConfig>) -> Value {
    let rate = |derived: String| Value::String(written.map_or(derived, |l| l.rate.to_string()));
    let name = super::algorithm_name(alg);
    match alg {
        Algorithm::TokenBucket { interval, burst, warmup } => json!({
            "algorithm": name,
            "rate": rate(rate_of_interval(interval.as_micros())),
            "burst": burst.get(),
            "warmup": span(*warmup),
        }),
        Algorithm::LeakyBucket { interval, max_delay } => json!({
            "algorithm": name,
            "rate": rate(rate_of_interval(interval.as_micros())),
            "max_delay": span(*max_delay),
        }),
        Algorithm::FixedWindow { window, limit, calendar } => json!({
            "algorithm": name,
            "rate": rate(rate_of_window(limit.get(), window.as_micros())),
            "calendar": calendar.as_ref().map(|c| c.zone()),
        }),
        Algorithm::SlidingWindow { window, limit } | Algorithm::SlidingLog { window, limit } => {
            json!({ "algorithm": name, "rate": rate(rate_of_window(limit.get(), window.as_micros())) })
        }
    }
}

const UNITS: [(&str, u64); 4] = [("s", 1_000_000), ("m", 60_000_000), ("h", 3_600_000_000), ("d", 86_400_000_000)];

/// One unit every `us` µs as a rate, in the shortest unit that makes it a whole number (`10/s`
/// for one every 100 ms, `1000/h` for one every 3.6 s), else `1/333.333ms`.
fn rate_of_interval(us: u64) -> String {
    match UNITS.iter().find(|(_, unit)| us > 0 && unit % us == 0) {
        Some((name, unit)) => format!("{}/{name}", unit / us),
        None => format!("1/{}", Dur(std::time::Duration::from_micros(us))),
    }
}

/// `limit` per window of `us` µs (a window's length is part of what it means: 5/90s is not
/// 200/h).
fn rate_of_window(limit: u64, us: u64) -> String {
    match UNITS.iter().find(|(_, unit)| *unit == us) {
        Some((name, _)) => format!("{limit}/{name}"),
        None => format!("{limit}/{}", Dur(std::time::Duration::from_micros(us))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_written_in_whole_units_where_they_can_be() {
        assert_eq!(rate_of_interval(100_000), "10/s");
        assert_eq!(rate_of_interval(3_600_000), "1000/h");
        assert_eq!(rate_of_interval(333_333), "1/333.333ms");
        assert_eq!(rate_of_window(100, 60_000_000), "100/m");
        assert_eq!(rate_of_window(5, 90_000_000), "5/90s");
    }

    #[test]
    fn sizes_are_written_in_whole_binary_units() {
        assert_eq!(size(64 << 20), "64MiB");
        assert_eq!(size(1 << 10), "1KiB");
        assert_eq!(size(1000), 1000);
    }
}

/// Three configs that write every field the YAML has between them (one form each where the
/// forms exclude each other), and the proof: every mapping's fields, as the deserializer
/// itself lists them, are written; and each field appears in the output at its own path.
#[cfg(test)]
mod every_field {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};

    use serde_yaml::Value as Yaml;

    use crate::config::Config;

    /// Every file the two configs name, written into a fresh folder.
    fn files() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tollgate-shown-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
        for (from, to) in [
            ("certs/demo-localhost.pem", "cert.pem"),
            ("certs/demo-localhost.pem", "ca.pem"),
            ("certs/demo-localhost.key", "key.pem"),
            ("jwks.json", "jwks.json"),
            ("api-keys.txt", "keys.txt"),
            ("clients.yaml", "clients.yaml"),
        ] {
            std::fs::copy(examples.join(from), dir.join(to)).unwrap();
        }
        // One DER SEQUENCE: what an OCSP response file must at least be.
        std::fs::write(dir.join("ocsp.der"), [0x30, 0x03, 0x0a, 0x01, 0x00]).unwrap();
        std::fs::write(dir.join("secret"), "a shared secret of forty bytes, or more\n").unwrap();
        std::fs::write(dir.join("token"), "an-admin-token-from-its-file\n").unwrap();
        std::fs::write(dir.join("eab.key"), "c2l4dGVlbi1ieXRlcy1vZi1tYWMtZmlsZQ\n").unwrap();
        dir
    }

    const A: &str = r#"
listen:
  - addr: 127.0.0.1:8443
    tls:
      certificates: [{ cert: cert.pem, key: key.pem, ocsp: ocsp.der }]
      acme: { names: [api.example.com], challenge: tls-alpn-01, eab: { kid: k1, hmac_key_file: eab.key } }
      client_ca: ca.pem
      client_auth: optional
      handshake_timeout: 5s
    http3: true
    quic: { max_concurrent_streams: 50, idle_timeout: 20s, early_data: true, retry_above: 100, new_connections_per_ip: 20 }
  - { addr: 127.0.0.1:8080, redirect_https: true }
  - { addr: 127.0.0.1:8081, proxy_protocol: v2 }
admin: { addr: 127.0.0.1:9901, token: an-inline-admin-token-of-enough-bytes, allowed_hosts: [admin.internal] }
trusted_proxies: [10.0.0.0/8]
server:
  header_read_timeout: 5s
  keepalive_timeout: 30s
  send_timeout: 30s
  max_header_bytes: 32768
  grace_period: 5s
  body_read_timeout: 30s
  max_connections: 5000
  workers: 2
  h2:
    idle_timeout: 1m
    ping_interval: 10s
    ping_timeout: 5s
    max_concurrent_streams: 64
    max_header_list_size: 32KiB
    max_pending_accept_reset_streams: 10
    max_local_error_reset_streams: 100
    initial_stream_window: 512KiB
    initial_connection_window: 2MiB
    max_frame_size: 32KiB
    max_send_buffer: 256KiB
log: { format: json, access: true, access_keys: true }
cache:
  max_bytes: 32MiB
  max_entry_bytes: 512KiB
  default: { hits_spend_limits: true, max_entry_bytes: 64KiB, coalesce_wait: 2s, heuristic: { percent: 10, max: 1h }, stale_while_revalidate: 30s, key: { query: true, ignore_query: [utm_source], headers: [accept-language] } }
problems: { type_base: "https://api.example.com/problems/" }
redis:
  url: "redis://app:hunter2@127.0.0.1:6390/0"
  timeout: 30ms
  on_error: deny
  instances: 3
  breaker: { failures: 3, cooldown: 2s }
  lease_ttl: 2s
  memo_keys: 1000
  connect_timeout: 1s
request_id: { enabled: true, header: x-trace-id }
plans:
  of: header:x-api-key
  clients: clients.yaml
  default: free
  tier_claim: tier
  tiers:
    free: { per-second: { rate: 5/s, burst: 10 } }
    pro: { per-second: { rate: 100/s, burst: 200 } }
    blocked: deny
auth:
  jwt:
    jwks: jwks.json
    issuers: [https://issuer.example]
    audiences: [api]
    algorithms: [ES256]
    leeway: 10s
    from: header:authorization
    consumer_claim: sub
    cache: 100
  optional: true
  claims_to_headers: { sub: x-user }
  strip_credentials: true
cors:
  origins: [https://app.example.com, "*.example.org", { regex: "^https://[a-z]+[.]example[.]net$" }]
  methods: [PUT, DELETE]
  headers: [x-token]
  expose: [x-cost]
  credentials: true
  max_age: 5m
  limit_preflights: true
compression: { encodings: [gzip, br, zstd], levels: { gzip: 6, br: 5, zstd: 3 }, min_size: 2KiB, types: [text/html, "application/*+json"] }
dns: { nameservers: ["127.0.0.1:53"], min_ttl: 2s, max_ttl: 1m, timeout: 1s, required: false }
tracing:
  otlp: { endpoint: "http://127.0.0.1:4317", protocol: grpc }
  sample: 0.5
  parent_based: false
  service_name: edge
  queue: 100
  batch: 10
  interval: 1s
  timeout: 2s
upstreams:
  app:
    url: https://app.internal:8443/v1
    connect_timeout: 1s
    timeout: 5s
    read_timeout: 5s
    pool_idle_timeout: 30s
    pool_max_idle: 10
    preserve_host: false
    ca_file: ca.pem
    server_name: app.internal
    client_cert: { cert: cert.pem, key: key.pem }
    tls_insecure_skip_verify: false
    protocol: auto
    h2: { max_connections: 2, max_streams_per_connection: 50, ping_interval: 10s, ping_timeout: 5s }
  group:
    servers: [{ url: "http://10.0.0.1:3000", weight: 2 }, { url: "http://10.0.0.2:3000" }, { url: "http://app.internal:3000", resolve: true }]
    balance: { hash: [client_ip] }
    retry: { attempts: 2, on: [connect_failure, 502], per_try_timeout: 1s, budget: { ratio: 0.2, min_per_s: 5 } }
    health: { path: /health, interval: 2s, timeout: 1s, healthy: 2, unhealthy: 3, expect: 200-299 }
    outlier: { consecutive_failures: 3, base_ejection_time: 10s, max_ejection_time: 1m, max_ejected_percent: 50 }
  canned:
    respond: { status: 418, headers: { x-canned: "yes" }, body: short and stout, latency: 10ms, max_body: 4KiB }
routes:
  - name: api
    match:
      host: "*.example.com"
      path_prefix: /api/
      methods: [GET, POST]
      headers: { x-tenant: acme, x-debug: { present: false }, x-build: { regex: "[0-9]+" } }
      query: { version: { regex: "v[0-9]+" }, trace: { present: true } }
    upstream: app
    strip_prefix: true
    limits:
      - name: per-user
        algorithm: token_bucket
        rate: 10/s
        burst: 20
        warmup: 30s
        key: [route, consumer]
        store: redis
        cost: { estimate: 2, response_header: x-cost }
        mode: shadow
        lease: 5
        show_keys: true
        early_retry: { penalty: double }
      - { name: smooth, algorithm: leaky_bucket, rate: 5/s, max_delay: 1s, key: client_ip, max_keys: 1000, cost: 1 }
      - { name: per-second, algorithm: token_bucket, key: header:x-api-key, plan: true }
    concurrency: { max: 100, max_wait: 100ms }
    ratelimit_headers: false
    on_limit: { stale: { max_age: 1m } }
    on_upstream_error: { stale: { max_age: 5m } }
    retry_after_spread: 5s
    request_headers: { remove: [x-internal], set: { x-from: "{route}" }, add: { x-via: edge } }
    response_headers: { remove: [server], set: { x-served-by: tollgate }, add: { x-note: "hi" } }
    upgrades: [websocket]
    tunnels: { idle_timeout: 10m, max: 100 }
  - name: monthly
    match: { path: /exact }
    upstream: group
    limits:
      - { name: calendar, algorithm: fixed_window, rate: 1000/month, calendar: Europe/Paris }
      - { name: window, algorithm: sliding_window, rate: 100/m }
      - { name: log, algorithm: sliding_log, rate: 10/s }
    concurrency: { adaptive: { min: 2, max: 50, window: 200ms, percentile: 90, tolerance: 1.5, smoothing: 0.3, relearn: 10 }, max_wait: 50ms }
    rewrite: { path_regex: { pattern: "^/exact$", replace: /other } }
    auth: none
  - name: keyed
    upstream: canned
    auth:
      api_key: { from: "query:key", keys: keys.txt }
    cors: { origins: ["*"] }
    compression: { encodings: [gzip] }
    cache: { hits_spend_limits: false }
    extensions: { shown-test: { stamp: x-edge } }
  - name: secret
    upstream: canned
    auth:
      jwt: { secret_file: secret, algorithms: [HS256] }
  - name: remote
    upstream: canned
    auth:
      jwt: { jwks: "https://keys.example/jwks.json?key=s3cret", min_refresh: 30s }
"#;

    const B: &str = r#"
listen: 127.0.0.1:8080
admin: { addr: 127.0.0.1:9901, token_file: token }
redis:
  cluster: ["redis://:pw@127.0.0.1:7000", "redis://127.0.0.1:7001"]
plans:
  of: header:x-api-key
  clients: { redis_hash: "tollgate:clients", cache: 30s }
  default: free
  tiers: { free: { per-second: { rate: 5/s } } }
upstreams:
  canned: { respond: {} }
  faulty:
    respond:
      latency: { distribution: uniform, min: 1ms, max: 5ms }
      errors: { share: 1%, status: 503 }
      resets: 0.5%
      body_size: 1KiB
      drip: { bytes: 100, every: 10ms }
      seed: 7
  skewed: { respond: { latency: { distribution: lognormal, p50: 10ms, p99: 80ms } } }
routes:
  - name: canary
    split:
      upstreams: [{ name: faulty, weight: 90 }, { name: skewed, weight: 10 }]
      sticky: client_ip
      override: { header: x-canary, values: { always: skewed } }
  - name: keyed
    upstream: canned
    auth:
      api_key: { keys: { redis_hash: "tollgate:keys", cache: 10s } }
    limits:
      - { name: per-second, algorithm: token_bucket, key: header:x-api-key, plan: true }
"#;

    const C: &str = r#"
listen:
  - addr: 127.0.0.1:8443
    tls:
      acme:
        names: [a.example, [b.example, c.example]]
        email: ops@example.com
        directory: https://ca.example/directory
        challenge: http-01
        storage: acme-store
        directory_ca: ca.pem
        eab: { kid: k2, hmac_key: c2l4dGVlbi1ieXRlcy1vZi1tYWM }
      internal: { names: [app.localhost], lifetime: 1d, storage: local-ca }
  - { addr: 127.0.0.1:8080, redirect_https: true }
upstreams: { canned: { respond: {} } }
routes: [{ upstream: canned }]
"#;

    fn load(dir: &Path, name: &str, text: &str) -> Config {
        Config::from_yaml(&dir.join(name), text).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// A path with sequence indices and the keys of data mappings (names the user chose) made
    /// general, so the fields of every route (or upstream) are counted together.
    /// A route's own `auth` (`cors`, `compression`) is the same mapping as the top-level one: counted together.
    fn general(path: &[String], data: &BTreeSet<String>) -> String {
        let mut out = String::new();
        for (i, seg) in path.iter().enumerate() {
            let parent = path[..i].join(".");
            let seg = if seg.starts_with('[') || data.contains(&general_key(&parent)) { "*" } else { seg.as_str() };
            out.push_str(if out.is_empty() { "" } else { "." });
            out.push_str(seg);
        }
        for own in ["auth", "cors", "compression"] {
            match out.strip_prefix(&format!("routes.*.{own}")) {
                Some(rest) if rest.is_empty() || rest.starts_with('.') => return format!("{own}{rest}"),
                _ => {}
            }
        }
        // A route's own `cache` is the same mapping as `cache.default`.
        match out.strip_prefix("routes.*.cache") {
            Some(rest) if rest.is_empty() || rest.starts_with('.') => return format!("cache.default{rest}"),
            _ => {}
        }
        out
    }

    fn general_key(concrete: &str) -> String {
        concrete.split('.').map(|s| if s.starts_with('[') { "*" } else { s }).collect::<Vec<_>>().join(".")
    }

    const PROBE: &str = "zz_not_a_field";

    /// The fields the deserializer takes in the mapping at `path` of `doc`, or `None` if that
    /// mapping's keys are names (upstreams, tiers, header rules).
    fn fields_at(dir: &Path, doc: &Yaml, path: &[String]) -> Option<BTreeSet<String>> {
        let mut probed = doc.clone();
        let mut node = &mut probed;
        for seg in path {
            node = match seg.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
                Some(i) => &mut node.as_sequence_mut().unwrap()[i.parse::<usize>().unwrap()],
                None => node.get_mut(seg.as_str()).unwrap(),
            };
        }
        node.as_mapping_mut().unwrap().insert(Yaml::from(PROBE), Yaml::from(1));
        let text = serde_yaml::to_string(&probed).unwrap();
        let e = match Config::from_yaml(&dir.join("probe.yaml"), &text) {
            Ok(_) => return None,
            Err(e) => e,
        };
        let (_, expected) = e.message.split_once(&format!("unknown field `{PROBE}`, expected "))?;
        Some(expected.split('`').skip(1).step_by(2).map(str::to_owned).collect())
    }

    /// Every mapping of `node` (at `path`), in order.
    fn mappings(node: &Yaml, path: &mut Vec<String>, out: &mut Vec<(Vec<String>, BTreeSet<String>)>) {
        match node {
            Yaml::Mapping(m) => {
                let keys = m.keys().filter_map(|k| k.as_str().map(str::to_owned)).collect();
                out.push((path.clone(), keys));
                for (k, v) in m {
                    path.push(k.as_str().unwrap().to_owned());
                    mappings(v, path, out);
                    path.pop();
                }
            }
            Yaml::Sequence(s) => {
                for (i, v) in s.iter().enumerate() {
                    path.push(format!("[{i}]"));
                    mappings(v, path, out);
                    path.pop();
                }
            }
            _ => {}
        }
    }

    /// The paths of `yaml` that `json` lacks (both walked together; a scalar written where the
    /// output has a mapping, or the other way round, counts as present).
    fn absent(yaml: &Yaml, json: &serde_json::Value, at: &str, out: &mut Vec<String>) {
        match (yaml, json) {
            (Yaml::Mapping(m), serde_json::Value::Object(o)) => {
                for (k, v) in m {
                    let k = k.as_str().unwrap();
                    let here = format!("{at}.{k}");
                    match o.get(k) {
                        None | Some(serde_json::Value::Null) => out.push(here),
                        Some(j) => absent(v, j, &here, out),
                    }
                }
            }
            (Yaml::Sequence(s), serde_json::Value::Array(a)) => {
                for (i, v) in s.iter().enumerate() {
                    match a.get(i) {
                        None => out.push(format!("{at}[{i}]")),
                        Some(j) => absent(v, j, &format!("{at}[{i}]"), out),
                    }
                }
            }
            _ => {}
        }
    }

    #[test]
    fn the_output_names_every_field_the_yaml_has() {
        // A program's own step, so a route can list `extensions:` (its value is taken as is).
        let check: crate::config::extension::Check = std::sync::Arc::new(|_| Ok(()));
        let _ = crate::config::extension::register("shown-test", check, std::sync::Arc::new(()));
        let dir = files();
        let docs: Vec<(&str, Yaml, Config)> = [("a.yaml", A), ("b.yaml", B), ("c.yaml", C)]
            .into_iter()
            .map(|(name, text)| (name, serde_yaml::from_str(text).unwrap(), load(&dir, name, text)))
            .collect();
        // The fields of each mapping, as the deserializer lists them, against those written.
        let mut known: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut written: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut data: BTreeSet<String> = BTreeSet::new();
        for (_, doc, _) in &docs {
            let mut all = Vec::new();
            mappings(doc, &mut Vec::new(), &mut all);
            for (path, keys) in all {
                let g = general(&path, &data);
                match fields_at(&dir, doc, &path) {
                    Some(fields) => {
                        known.entry(g.clone()).or_default().extend(fields);
                        written.entry(g).or_default().extend(keys);
                    }
                    None => {
                        data.insert(general_key(&path.join(".")));
                    }
                }
            }
        }
        let unwritten: Vec<String> = known
            .iter()
            .flat_map(|(g, fields)| fields.difference(&written[g]).map(move |f| format!("{g}.{f}")))
            .collect();
        assert!(unwritten.is_empty(), "fields the configs do not write: {unwritten:?}");
        assert!(known.len() > 40, "{known:?}");
        // Each written field is in the output, at its own path.
        for (name, doc, config) in &docs {
            let json = serde_json::to_value(config).unwrap();
            let mut missing = Vec::new();
            absent(doc, &json, "", &mut missing);
            assert!(missing.is_empty(), "{name}: /config lacks {missing:?}\n{json:#}");
            // Secrets stay out.
            let text = json.to_string();
            let secrets =
                ["hunter2", "an-inline-admin-token", "an-admin-token-from", "shared secret", "s3cret", ":pw@", "c2l4"];
            for secret in secrets {
                assert!(!text.contains(secret), "{name} shows `{secret}`: {text}");
            }
        }
        let json = serde_json::to_value(&docs[0].2).unwrap();
        let api = &json["routes"][0]["limits"][0];
        assert_eq!(
            (api["rate"].as_str(), api["burst"].as_u64(), api["warmup"].as_str()),
            (Some("10/s"), Some(20), Some("30s"))
        );
        assert_eq!(json["plans"]["tiers"]["pro"]["per-second"]["rate"], "100/s");
        assert_eq!(json["cache"]["max_bytes"], "32MiB");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
