//! Hot reload on SIGHUP and when the config file changes. A new file is parsed and validated
//! first; an invalid one is logged with its position and the running config keeps serving.
//! A good one is compiled (keeping the state of unchanged limits) and swapped in atomically;
//! requests in flight finish on the config they started with.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::config::{Config, ConfigError};
use crate::proxy::Proxy;
use crate::server::Shared;

/// Reloads one config file into a running proxy.
pub struct Reloader {
    path: PathBuf,
    shared: Shared,
    /// Command-line overrides, applied to every reloaded config too.
    adjust: Box<dyn Fn(&mut Config) + Send + Sync>,
}

/// What identifies a version of the file without reading it.
fn stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

impl Reloader {
    pub fn new(path: PathBuf, shared: Shared, adjust: Box<dyn Fn(&mut Config) + Send + Sync>) -> Reloader {
        Reloader { path, shared, adjust }
    }

    /// Reads, validates and swaps in the file now.
    ///
    /// # Errors
    /// The file is invalid; the running config is untouched.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let mut config = Config::load(&self.path)?;
        (self.adjust)(&mut config);
        let old = self.shared.load_full();
        if config.listen != old.config.listen || config.admin != old.config.admin {
            tracing::warn!("`listen` and `admin` changes take effect after a restart; the other changes apply now");
        }
        let routes = config.routes.len();
        let next = Proxy::build(config, old.clock().clone(), old.metrics().clone(), Some(&old));
        self.shared.store(Arc::new(next));
        tracing::info!(file = %self.path.display(), routes, "config reloaded");
        Ok(())
    }

    fn try_reload(&self) {
        if let Err(e) = self.reload() {
            tracing::error!(error = %e, "config reload failed; the running config keeps serving");
        }
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
        let mut last = stamp(&self.path);
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
                    last = stamp(&self.path);
                    self.try_reload();
                }
                _ = tick.tick() => {
                    let now = stamp(&self.path);
                    if now.is_some() && now != last {
                        last = now;
                        self.try_reload();
                    }
                }
            }
        }
    }
}
