//! `tollgate bench`: the candidate of the benchmark harness (`shared/bench/run.sh`). One
//! worker thread, like nginx's `worker_processes 1`; every listener is a normal tollgate
//! config built from the harness's environment, so what is measured is what users run.
//!
//! - `LISTEN_ADDR`: proxy `GET /` to `UPSTREAM_ADDR` with a per-client-IP token bucket on
//!   the path that never rejects.
//! - `REJECT_PORT` (optional): the same, limited to `REJECT_RATE`/s with burst `REJECT_BURST`.
//! - `H2_PORT` (optional): the pass config again; h2c is detected on every port.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use arc_swap::ArcSwap;

use crate::config::Config;
use crate::proxy::Proxy;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The YAML of one bench listener.
pub fn bench_yaml(listen: &str, upstream: &str, rate: &str, burst: u64) -> String {
    format!(
        "listen: {listen}
upstreams:
  up:
    url: http://{upstream}
routes:
  - name: bench
    upstream: up
    limits:
      - {{ name: per-client, algorithm: token_bucket, rate: {rate}, burst: {burst}, key: client_ip }}
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
    let mut yamls = vec![bench_yaml(&listen, &upstream, "1000000/s", 100_000_000)];
    if let Some(port) = env("REJECT_PORT") {
        let rate = env("REJECT_RATE").unwrap_or_else(|| "1000".into());
        let burst: u64 = env("REJECT_BURST").unwrap_or_else(|| "100".into()).parse().context("REJECT_BURST")?;
        yamls.push(bench_yaml(&format!("{host}:{port}"), &upstream, &format!("{rate}/s"), burst));
    }
    if let Some(port) = env("H2_PORT") {
        yamls.push(bench_yaml(&format!("{host}:{port}"), &upstream, "1000000/s", 100_000_000));
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
            let shared = Arc::new(ArcSwap::from_pointee(Proxy::new(config)));
            let mut rx = stop_rx.clone();
            servers.push(tokio::spawn(crate::server::serve(listener, shared, async move {
                let _ = rx.wait_for(|s| *s).await;
            })));
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
        for (rate, burst) in [("1000000/s", 100_000_000), ("1000/s", 100)] {
            let yaml = bench_yaml("127.0.0.1:18020", "127.0.0.1:18000", rate, burst);
            Config::from_yaml(Path::new("bench.yaml"), &yaml).unwrap();
        }
    }
}
