//! Hot reload on SIGHUP and when the config file changes. A new file is read, validated and
//! compiled on a blocking thread (a large file takes seconds, and no request may wait for it);
//! an invalid one, or one whose build fails in any way, is logged and the running config keeps
//! serving. A good one is swapped in atomically, keeping the state of unchanged limits;
//! requests in flight finish on the config they started with.
//!
//! What cannot change in a running process keeps its running value, field by field, with a
//! warning: `listen` and `admin` (their sockets are bound once), and `log.format` when no live
//! switch is installed. So the swapped-in config, and `/config`, always say what is in effect.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::config::{Config, ConfigError, LogFormat};
use crate::proxy::Proxy;
use crate::proxy::Shared;

/// Applies a new `log.format` to the running subscriber.
pub type LogSwitch = Box<dyn Fn(LogFormat) -> Result<(), String> + Send + Sync>;

/// Reloads one config file into a running proxy.
pub struct Reloader {
    path: PathBuf,
    shared: Shared,
    /// Command-line overrides, applied to every reloaded config too.
    adjust: Arc<dyn Fn(&mut Config) + Send + Sync>,
    log_switch: Option<LogSwitch>,
}

/// What one successful reload did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reloaded {
    pub routes: usize,
    /// Fields whose new value needs a restart (the running value was kept), e.g. `listen`.
    pub restart_needed: Vec<&'static str>,
}

/// What identifies a version of the file without reading it.
fn stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    // Followed through symlinks: a ConfigMap or certbot swap changes the target.
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// A new config and its compiled proxy, built off the runtime.
struct Built {
    proxy: Proxy,
    restart_needed: Vec<&'static str>,
    format_changed: bool,
}

/// Reads, validates and compiles the file (a blocking thread runs this). Fields that cannot
/// change live are set back to the running values; `live_format` says whether `log.format`
/// can change.
fn build(
    path: &Path,
    adjust: &(dyn Fn(&mut Config) + Send + Sync),
    old: &Proxy,
    live_format: bool,
) -> Result<Built, ConfigError> {
    let mut config = Config::load(path)?;
    for w in &config.warnings {
        tracing::warn!("{w}");
    }
    adjust(&mut config);
    let running = &old.config;
    let mut restart_needed = Vec::new();
    let shapes = |c: &Config| c.listeners.iter().map(crate::config::Listener::shape).collect::<Vec<_>>();
    if config.listen != running.listen || shapes(&config) != shapes(running) {
        restart_needed.push("listen");
        config.listen = running.listen;
        // The sockets stay as they are, and so do their certificates.
        config.listeners.clone_from(&running.listeners);
    }
    if config.server.workers != running.server.workers {
        restart_needed.push("server.workers");
        config.server.workers = running.server.workers;
    }
    if config.admin != running.admin {
        restart_needed.push("admin");
        config.admin = running.admin;
    }
    let format_changed = config.log.format != running.log.format;
    if format_changed && !live_format {
        restart_needed.push("log.format");
        config.log.format = running.log.format;
    }
    let proxy = Proxy::build(config, old.clock().clone(), old.metrics().clone(), Some(old));
    Ok(Built { proxy, restart_needed, format_changed: format_changed && live_format })
}

/// The message of a build that panicked (a bug: validation should have refused the file).
fn panicked(file: &Path, e: tokio::task::JoinError) -> ConfigError {
    let why = match e.try_into_panic() {
        Ok(payload) => payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".to_owned()),
        Err(e) => e.to_string(),
    };
    ConfigError {
        file: file.to_owned(),
        line: 0,
        column: 0,
        path: String::new(),
        message: crate::config::redact(&format!("building the config failed (this is a bug in tollgate: {why})")),
    }
}

impl Reloader {
    pub fn new(path: PathBuf, shared: Shared, adjust: Box<dyn Fn(&mut Config) + Send + Sync>) -> Reloader {
        Reloader { path, shared, adjust: Arc::from(adjust), log_switch: None }
    }

    /// Lets reloads change `log.format` live through `switch` (without one it needs a restart).
    pub fn with_log_switch(mut self, switch: LogSwitch) -> Reloader {
        self.log_switch = Some(switch);
        self
    }

    /// Reads, validates and compiles the file on a blocking thread, then swaps it in.
    ///
    /// # Errors
    /// The file is invalid, or building it failed (even by a panic); the running config is
    /// untouched.
    pub async fn reload(&self) -> Result<Reloaded, ConfigError> {
        let (path, adjust, old) = (self.path.clone(), self.adjust.clone(), self.shared.load_full());
        let live_format = self.log_switch.is_some();
        let built = tokio::task::spawn_blocking(move || build(&path, &*adjust, &old, live_format))
            .await
            .map_err(|e| panicked(&self.path, e))??;
        if built.format_changed {
            if let Some(switch) = &self.log_switch {
                if let Err(e) = switch(built.proxy.config.log.format) {
                    tracing::warn!(error = %e, "cannot switch log.format; it changes after a restart");
                }
            }
        }
        for &field in &built.restart_needed {
            tracing::warn!(
                field,
                "`{field}` changed in the file; it takes effect after a restart (the running value is kept)"
            );
        }
        let routes = built.proxy.config.routes.len();
        self.shared.store(Arc::new(built.proxy));
        tracing::info!(file = %self.path.display(), routes, "config reloaded");
        Ok(Reloaded { routes, restart_needed: built.restart_needed })
    }

    async fn try_reload(&self) {
        if let Err(e) = self.reload().await {
            tracing::error!(error = %e, "config reload failed; the running config keeps serving");
        }
    }

    /// The stamps of the files the running config names (certificates, keys, CAs): a change
    /// to any reloads, as a change of the file itself does.
    fn watched(&self) -> Vec<Option<(SystemTime, u64)>> {
        self.shared.load().config.watched_files().iter().map(stamp).collect()
    }

    /// Reloads on SIGHUP and when the file's modification time or size changes (checked every
    /// `poll`), until `shutdown` resolves. Polling works the same on every filesystem,
    /// bind mounts and ConfigMap symlink swaps included.
    pub async fn run(self, poll: Duration, shutdown: impl Future<Output = ()>) {
        use tokio::signal::unix::{signal, SignalKind};
        tokio::pin!(shutdown);
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; reloading on file changes only");
                None
            }
        };
        // The file's stamp is taken before each reload, so a write during one is seen after it;
        // the named files' after it, since the reload may name others.
        let mut last = (stamp(&self.path), self.watched());
        let mut tick = tokio::time::interval(poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let hup_recv = async {
                match hup.as_mut() {
                    Some(h) => h.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut shutdown => return,
                _ = hup_recv => {
                    tracing::info!("SIGHUP received: reloading");
                    let own = stamp(&self.path);
                    self.try_reload().await;
                    last = (own, self.watched());
                }
                _ = tick.tick() => {
                    let now = (stamp(&self.path), self.watched());
                    if now.0.is_some() && now != last {
                        self.try_reload().await;
                        last = (now.0, self.watched());
                    }
                }
            }
        }
    }
}
