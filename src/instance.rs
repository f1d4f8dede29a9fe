//! One running tollgate: the proxy listener, its admin listener, its reloader and the manager
//! of the certificates it gets itself, started and stopped together. `tollgate run` and `tollgate bench` both serve through [`run`], so
//! what the benchmark measures is wired exactly as what users run.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub mod process;

use crate::admin::Readiness;
use crate::proxy::Shared;
use crate::reload::Reloader;

/// How often the reloader looks at the config file.
const RELOAD_POLL: Duration = Duration::from_secs(1);

/// Serves `shared` on `listener` (and the admin endpoints on `admin`) until `shutdown`
/// resolves, reloading through `reloader` meanwhile; then drains as [`crate::server::serve`]
/// does. `/readyz` says ready from the start until the shutdown begins.
pub async fn run(
    shared: Shared,
    listener: TcpListener,
    admin: Option<TcpListener>,
    reloader: Option<Reloader>,
    shutdown: impl Future<Output = ()>,
) {
    run_all(shared, vec![listener], admin, reloader, shutdown).await;
}

/// [`run`] with every listener of `listen:` (in the config's order).
pub async fn run_all(
    shared: Shared,
    listeners: Vec<TcpListener>,
    admin: Option<TcpListener>,
    reloader: Option<Reloader>,
    shutdown: impl Future<Output = ()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    // Every certificate tollgate gets itself is in service before the first accept (stored,
    // from the local CA, or a placeholder); the manager then keeps them renewed.
    let p = shared.load_full();
    let _ = tokio::task::spawn_blocking(move || crate::acme::prime(&p)).await;
    tokio::spawn(crate::acme::run(shared.clone(), stopped()));
    let ready = Arc::new(Readiness::default());
    if let Some(admin) = admin {
        tokio::spawn(crate::admin::serve(admin, shared.clone(), ready.clone(), stopped()));
    }
    if let Some(reloader) = reloader {
        tokio::spawn(reloader.run(RELOAD_POLL, stopped()));
    }
    ready.set_listening(true);
    let signal = async move {
        shutdown.await;
        ready.set_listening(false);
        let _ = stop_tx.send(true);
    };
    crate::server::serve_all(listeners, shared, signal).await;
}
