//! `tollgate bench`: the candidate of the benchmark harness (`benches/harness/run.sh`). One
//! worker thread, like nginx's `worker_processes 1`; every listener is a normal tollgate
//! config built from the harness's environment, so what is measured is what users run.
//!
//! - `LISTEN_ADDR`: proxy `GET /` to `UPSTREAM_ADDR` with a per-client-IP token bucket on
//!   the path that never rejects.
//! - `REJECT_PORT` (optional): the same, limited to `REJECT_RATE`/s with burst `REJECT_BURST`.
//! - `H2_PORT` (optional): the pass config again; h2c is detected on every port.
//! - `PLAN_PORT` (optional): the pass limit as a `plan: true` limit, clients named by
//!   `x-api-key` from a clients file (`bench-key: pro`): the cost of a plan lookup.
//! - `BENCH_REDIS_URL` (optional): every listener's limit keeps its state in that Redis
//!   (`store: redis`), taking `BENCH_LEASE` tokens per Redis call when that is set.
//! - `BENCH_RATE` / `BENCH_BURST` (optional): the pass limit instead of 1000000/s, burst
//!   100000000 (a slow rate keeps many keys live: the 1M-key scenario).
//! - `BENCH_TRUSTED_PROXIES` (optional, comma-separated CIDRs): `X-Forwarded-For` from these
//!   peers names the client, so one load generator can be a million clients.
//! - `BENCH_ADMIN` (optional address): the admin listener of the pass config (`/metrics`
//!   shows `tollgate_local_store_keys`).
//! - `BENCH_TLS_CERT` and `BENCH_TLS_KEY` (optional PEM files): the pass listener terminates
//!   TLS with them (benches/tls.sh).
//! - `BENCH_GATEWAY=1` (optional): the bench route also has 3 header conditions (that h2load's
//!   requests meet: two regexes and an absence) and 4 header rules (2 request, 2 response), the cost of gateway rules.
//! - `BENCH_REQUEST_ID=off` (optional): no request ids (`request_id: { enabled: false }`).
//! - `BENCH_GROUP=1..3` (optional): the pass upstream is a `servers:` group of that many
//!   servers, all the same upstream under other names (`127.0.0.1`, `localhost`,
//!   `[::ffff:127.0.0.1]`): the cost of balancing (least_request) and the retry budget.
//! - `BENCH_TRACE_SAMPLE` (optional, 0 to 1): `tracing:` on with that `sample`, exporting to
//!   `BENCH_TRACE_ENDPOINT` (default `http://127.0.0.1:1`, a dead collector: every span is
//!   dropped after a refused connection) over `BENCH_TRACE_PROTOCOL` (`grpc`, the default, or
//!   `http`): the cost of traces.
//! - `BENCH_AUTH=es256|rs256|eddsa|api_key` (optional): the bench route has `auth:` (a JWT
//!   verified against a key set file, or an API key from a keys file), made in `BENCH_AUTH_DIR`
//!   (default: the temp dir) with the request's credential in `credential` there, as a
//!   header line; `rs256` signs with the RSA key in `BENCH_AUTH_KEY` (DER, PKCS#8 or #1).
//!   `BENCH_AUTH_BAD=1`: that credential is a bad one (a signature that does not verify, an
//!   unknown key), so every request is verified and refused (401); `BENCH_AUTH_FAILURES=RATE`
//!   (e.g. `1/h`): the route's `auth` has `failures:` at that rate, burst 1, by client IP, so
//!   with a bad credential every request after the first is refused (429) before verification.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use arc_swap::ArcSwap;

use crate::config::Config;
use crate::proxy::Proxy;

mod auth;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Where the bench limit keeps its state.
#[derive(Clone, Debug, Default)]
pub struct BenchStore {
    /// `trusted_proxies:` entries.
    pub trusted: Vec<String>,
    /// `store: redis` on this server; in-process when `None`.
    pub redis_url: Option<String>,
    /// `lease:` of the Redis-backed limit.
    pub lease: Option<u64>,
    /// 3 header conditions and 4 header rules on the route (`BENCH_GATEWAY`).
    pub gateway: bool,
    /// Request ids off (`BENCH_REQUEST_ID=off`).
    pub no_request_id: bool,
    /// The upstream as a group of this many servers (`BENCH_GROUP`, 0: a single `url:`).
    pub group: usize,
    /// `tracing:` as (sample, endpoint, protocol) (`BENCH_TRACE_SAMPLE`).
    pub trace: Option<(String, String, String)>,
    /// The route's `auth:` section, indented for the route (`BENCH_AUTH`).
    pub auth: Option<String>,
}

const GATEWAY: &str = r#"    match:
      headers:
        user-agent: { regex: "h2load .*" }
        host: { regex: "127\\.0\\.0\\.1:[0-9]+" }
        x-debug: { present: false }
    request_headers:
      remove: [x-internal-token]
      set: { x-route: "{route}" }
    response_headers:
      remove: [server]
      set: { strict-transport-security: "max-age=31536000" }
"#;

/// The YAML of one bench listener.
pub fn bench_yaml(listen: &str, upstream: &str, rate: &str, burst: u64, store: &BenchStore) -> String {
    let trusted = if store.trusted.is_empty() {
        String::new()
    } else {
        let quoted: Vec<String> = store.trusted.iter().map(|c| format!("{c:?}")).collect();
        format!("trusted_proxies: [{}]\n", quoted.join(", "))
    };
    let gateway = if store.gateway { GATEWAY } else { "" };
    let auth = store.auth.as_deref().unwrap_or_default();
    let ids = if store.no_request_id { "request_id: { enabled: false }\n" } else { "" };
    let tracing = match &store.trace {
        None => String::new(),
        Some((sample, endpoint, protocol)) => {
            format!("tracing: {{ otlp: {{ endpoint: {endpoint:?}, protocol: {protocol} }}, sample: {sample} }}\n")
        }
    };
    let target = match store.group {
        0 => format!("    url: http://{upstream}\n"),
        n => {
            let port = upstream.rsplit_once(':').map_or("80", |(_, p)| p);
            let hosts = ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"];
            let list: String =
                hosts.iter().take(n.min(3)).map(|h| format!("      - url: http://{h}:{port}\n")).collect();
            format!("    servers:\n{list}")
        }
    };
    let (redis, store) = match &store.redis_url {
        None => (String::new(), String::new()),
        Some(url) => (
            format!("redis:\n  url: {url}\n"),
            match store.lease {
                Some(n) => format!(", store: redis, lease: {n}"),
                None => ", store: redis".to_owned(),
            },
        ),
    };
    format!(
        "listen: {listen}
{trusted}{ids}{tracing}{redis}upstreams:
  up:
{target}routes:
  - name: bench
    upstream: up
{auth}{gateway}    limits:
      - {{ name: per-client, algorithm: token_bucket, rate: {rate}, burst: {burst}, key: client_ip{store} }}
"
    )
}

/// The YAML of the plan listener: the pass limit's parameters in tier `pro`.
pub fn plan_yaml(listen: &str, upstream: &str, clients: &str) -> String {
    format!(
        "listen: {listen}
plans:
  of: header:x-api-key
  clients: '{clients}'
  default: free
  tiers:
    free:
      per-client: {{ rate: 10/s, burst: 10 }}
    pro:
      per-client: {{ rate: 1000000/s, burst: 100000000 }}
upstreams:
  up:
    url: http://{upstream}
routes:
  - name: bench
    upstream: up
    limits:
      - {{ name: per-client, algorithm: token_bucket, plan: true, key: client_ip }}
"
    )
}

/// Reads the harness's environment and serves until SIGTERM.
///
/// # Errors
/// A missing variable, a bad address or a port that cannot be bound.
pub fn run_from_env() -> anyhow::Result<()> {
    let upstream = env("UPSTREAM_ADDR").context("UPSTREAM_ADDR is not set")?;
    let listen = env("LISTEN_ADDR").context("LISTEN_ADDR is not set")?;
    let host = listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h).to_owned();
    let store = BenchStore {
        trusted: env("BENCH_TRUSTED_PROXIES")
            .map(|t| t.split(',').map(|c| c.trim().to_owned()).filter(|c| !c.is_empty()).collect())
            .unwrap_or_default(),
        redis_url: env("BENCH_REDIS_URL"),
        lease: env("BENCH_LEASE").map(|n| n.parse()).transpose().context("BENCH_LEASE")?,
        gateway: env("BENCH_GATEWAY").is_some_and(|v| v != "0"),
        no_request_id: env("BENCH_REQUEST_ID").is_some_and(|v| v == "off"),
        group: env("BENCH_GROUP").map(|n| n.parse()).transpose().context("BENCH_GROUP")?.unwrap_or(0),
        trace: env("BENCH_TRACE_SAMPLE").map(|sample| {
            let endpoint = env("BENCH_TRACE_ENDPOINT").unwrap_or_else(|| "http://127.0.0.1:1".into());
            (sample, endpoint, env("BENCH_TRACE_PROTOCOL").unwrap_or_else(|| "grpc".into()))
        }),
        auth: match env("BENCH_AUTH") {
            None => None,
            Some(kind) => {
                let dir = env("BENCH_AUTH_DIR").map_or_else(std::env::temp_dir, Into::into);
                let (key, failures) = (env("BENCH_AUTH_KEY"), env("BENCH_AUTH_FAILURES"));
                let options = auth::Options {
                    rsa_key: key.as_deref(),
                    bad: env("BENCH_AUTH_BAD").is_some_and(|v| v != "0"),
                    failures: failures.as_deref(),
                };
                Some(auth::prepare(&kind, &dir, &options)?)
            }
        },
    };
    let rate = env("BENCH_RATE").unwrap_or_else(|| "1000000/s".into());
    let burst = env("BENCH_BURST").map(|b| b.parse()).transpose().context("BENCH_BURST")?.unwrap_or(100_000_000);
    let mut pass = bench_yaml(&listen, &upstream, &rate, burst, &store);
    if let (Some(cert), Some(key)) = (env("BENCH_TLS_CERT"), env("BENCH_TLS_KEY")) {
        pass = pass.replacen(
            &format!("listen: {listen}\n"),
            &format!(
                "listen:\n  - addr: {listen}\n    tls: {{ certificates: [{{ cert: {cert:?}, key: {key:?} }}] }}\n"
            ),
            1,
        );
    }
    if let Some(admin) = env("BENCH_ADMIN") {
        pass.push_str(&format!("admin: {admin}\n"));
    }
    let mut yamls = vec![pass];
    if let Some(port) = env("REJECT_PORT") {
        let rate = env("REJECT_RATE").unwrap_or_else(|| "1000".into());
        let burst: u64 = env("REJECT_BURST").unwrap_or_else(|| "100".into()).parse().context("REJECT_BURST")?;
        yamls.push(bench_yaml(&format!("{host}:{port}"), &upstream, &format!("{rate}/s"), burst, &store));
    }
    if let Some(port) = env("PLAN_PORT") {
        let clients = std::env::temp_dir().join(format!("tollgate-bench-clients-{}.yaml", std::process::id()));
        std::fs::write(&clients, "bench-key: pro\n").context("writing the bench clients file")?;
        yamls.push(plan_yaml(&format!("{host}:{port}"), &upstream, &clients.display().to_string()));
    }
    if let Some(port) = env("H2_PORT") {
        yamls.push(bench_yaml(&format!("{host}:{port}"), &upstream, "1000000/s", 100_000_000, &store));
    }
    let configs = yamls
        .iter()
        .map(|y| Config::from_yaml(Path::new("bench.yaml"), y).map_err(|e| anyhow::anyhow!("{e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut servers = Vec::new();
        for config in configs {
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("binding {}", config.listen))?;
            let admin = match config.admin {
                Some(addr) => {
                    Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?)
                }
                None => None,
            };
            let shared = Arc::new(ArcSwap::from_pointee(Proxy::new(config)));
            let mut rx = stop_rx.clone();
            let stop = async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            servers.push(tokio::spawn(crate::instance::run(shared, listener, admin, None, stop)));
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        let _ = stop_tx.send(true);
        for s in servers {
            let _ = s.await;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_configs_are_valid() {
        let stores = [
            BenchStore::default(),
            BenchStore { redis_url: Some("redis://127.0.0.1:16379".into()), ..BenchStore::default() },
            BenchStore { redis_url: Some("redis://127.0.0.1:16379".into()), lease: Some(100), ..BenchStore::default() },
            BenchStore { trusted: vec!["127.0.0.1/32".into(), "::1/128".into()], ..BenchStore::default() },
            BenchStore { gateway: true, no_request_id: true, ..BenchStore::default() },
            BenchStore { group: 3, ..BenchStore::default() },
            BenchStore {
                trace: Some(("0.01".into(), "http://127.0.0.1:1".into(), "grpc".into())),
                ..BenchStore::default()
            },
        ];
        for store in &stores {
            for (rate, burst) in [("1000000/s", 100_000_000), ("1000/s", 100)] {
                let yaml = bench_yaml("127.0.0.1:18020", "127.0.0.1:18000", rate, burst, store);
                let config = Config::from_yaml(Path::new("bench.yaml"), &yaml).unwrap();
                let limit = &config.routes[0].limits[0];
                assert_eq!(limit.store == crate::config::StoreKind::Redis, store.redis_url.is_some(), "{yaml}");
                assert_eq!(limit.lease.map(std::num::NonZeroU64::get), store.lease, "{yaml}");
                assert_eq!(config.trusted_proxies.len(), store.trusted.len(), "{yaml}");
                assert_eq!(config.routes[0].conditions.is_some(), store.gateway, "{yaml}");
                if let Some(c) = &config.routes[0].conditions {
                    let c = crate::route::Conditions::compile(c, "bench");
                    let mut h = http::HeaderMap::new();
                    h.insert("user-agent", http::HeaderValue::from_static("h2load nghttp2/1.52.0"));
                    h.insert("host", http::HeaderValue::from_static("127.0.0.1:18020"));
                    assert!(c.matches(&h, None), "h2load's requests meet the bench conditions");
                }
                assert_eq!(config.request_id.is_none(), store.no_request_id, "{yaml}");
                assert_eq!(config.tracing.is_some(), store.trace.is_some(), "{yaml}");
            }
        }
    }

    #[test]
    fn the_plan_config_is_valid() {
        let clients = std::env::temp_dir().join(format!("tollgate-bench-test-clients-{}.yaml", std::process::id()));
        std::fs::write(&clients, "bench-key: pro\n").unwrap();
        let yaml = plan_yaml("127.0.0.1:18020", "127.0.0.1:18000", &clients.display().to_string());
        let config = Config::from_yaml(Path::new("bench.yaml"), &yaml).unwrap();
        assert!(config.warnings.is_empty() && config.routes[0].limits[0].plan.is_some());
    }
}
