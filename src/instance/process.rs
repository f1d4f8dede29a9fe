//! The process shape of `tollgate run`: `server.workers` threads, each with a single-threaded
//! runtime of its own and its own `SO_REUSEPORT` socket of every listener (nginx's shape: a
//! connection, its requests and the upstream connections it uses stay on one thread); the
//! proxy's state is shared. The first worker also runs the admin listener and the reloader,
//! and a signal (SIGTERM, Ctrl-C) drains every worker within the same grace period.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::config::Config;
use crate::proxy::{Proxy, Shared};
use crate::reload::{LogSwitch, Reloader};

/// What the binary hands the process besides the config.
pub struct Process {
    /// The config file, read again on reloads.
    pub path: PathBuf,
    /// Command-line overrides, applied to the config on every reload too.
    pub adjust: Box<dyn Fn(&mut Config) + Send + Sync>,
    /// Changes the log format of the running process (a reload of `log.format`).
    pub log_switch: Option<LogSwitch>,
    /// Called by each worker before it parks (the binary gives idle memory back there).
    pub on_park: Option<fn()>,
}

/// Runs `config` until SIGTERM or Ctrl-C, then drains.
///
/// # Errors
/// A listener that cannot be bound or registered, a runtime or thread that cannot start, or
/// a config whose build panics (a bug); each names what failed.
pub fn run(config: Config, process: Process) -> io::Result<()> {
    let workers = config.server.workers.count();
    crate::workers::set_count(workers);
    let mut listeners: Vec<Vec<std::net::TcpListener>> = (0..workers).map(|_| Vec::new()).collect();
    for l in &config.listeners {
        let sockets = bind_per_worker(l.addr, workers).map_err(|e| context(e, &format!("binding {}", l.addr)))?;
        if l.http3.is_some() {
            // The first worker binds UDP there (`server::serve_all`); a port taken for UDP
            // fails the start here rather than in a log line.
            let bound = sockets.first().map_or(Ok(l.addr), std::net::TcpListener::local_addr)?;
            drop(std::net::UdpSocket::bind(bound).map_err(|e| context(e, &format!("binding {bound} (UDP, HTTP/3)")))?);
        }
        for (i, socket) in sockets.into_iter().enumerate() {
            listeners[i].push(socket);
        }
    }
    let admin = match config.admin {
        Some(addr) => Some(bind(addr, false).map_err(|e| context(e, &format!("binding the admin listener {addr}")))?),
        None => None,
    };
    let runtime = worker_runtime(process.on_park).map_err(|e| context(e, "starting the runtime"))?;
    // `check` refuses every value known to break the build; should one still panic, the
    // process ends with a message rather than a backtrace. Built inside the first worker's
    // runtime: the proxy's background tasks (sweepers, refreshes) run there.
    let (addr, admin_addr, routes) = (config.listen, config.admin, config.routes.len());
    let proxy = runtime.block_on(async {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Proxy::new(config)))
            .map_err(|_| io::Error::other("building the config failed (this is a bug in tollgate)"))
    })?;
    let shared: Shared = Arc::new(ArcSwap::from_pointee(proxy));
    // Before any worker accepts: the certificates tollgate gets itself (`tls.acme`,
    // `tls.internal`) are in service, at worst as placeholders.
    crate::acme::prime(&shared.load());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut own_sockets = listeners.into_iter();
    let first = own_sockets.next().unwrap_or_default();
    let mut threads = Vec::with_capacity(workers.saturating_sub(1));
    for (i, own) in (1..workers).zip(own_sockets) {
        let (shared, stop, on_park) = (shared.clone(), stop_rx.clone(), process.on_park);
        let thread = std::thread::Builder::new()
            .name(format!("tollgate-worker-{i}"))
            .spawn(move || worker(i, own, shared, stop, on_park))
            .map_err(|e| context(e, "starting a worker thread"))?;
        threads.push(thread);
    }
    let Process { path, adjust, log_switch, .. } = process;
    runtime.block_on(async move {
        let listeners = first.into_iter().map(tokio::net::TcpListener::from_std).collect::<Result<Vec<_>, _>>();
        let listeners = listeners.map_err(|e| context(e, "registering the listeners"))?;
        let admin = admin
            .map(tokio::net::TcpListener::from_std)
            .transpose()
            .map_err(|e| context(e, "registering the admin listener"))?;
        tracing::info!(listen = %addr, admin = ?admin_addr, routes, workers, "tollgate listening");
        let mut reloader = Reloader::new(path, shared.clone(), adjust);
        if let Some(switch) = log_switch {
            reloader = reloader.with_log_switch(switch);
        }
        let shutdown = async move {
            shutdown_signal().await;
            let _ = stop_tx.send(true);
        };
        super::run_all(shared, listeners, admin, Some(reloader), shutdown).await;
        Ok::<(), io::Error>(())
    })?;
    // The other workers drain within the same grace period.
    for t in threads {
        if t.join().is_err() {
            tracing::error!("a worker thread panicked");
        }
    }
    Ok(())
}

/// Worker `i` (of the second on): serves its own sockets until the first worker says stop.
fn worker(
    i: usize,
    own: Vec<std::net::TcpListener>,
    shared: Shared,
    mut stop: tokio::sync::watch::Receiver<bool>,
    on_park: Option<fn()>,
) {
    crate::workers::set_index(i);
    let runtime = match worker_runtime(on_park) {
        Ok(r) => r,
        Err(e) => return tracing::error!(worker = i, error = %e, "cannot start a worker's runtime"),
    };
    runtime.block_on(async move {
        let listeners = match own.into_iter().map(tokio::net::TcpListener::from_std).collect() {
            Ok(l) => l,
            Err(e) => return tracing::error!(worker = i, error = %e, "cannot register the listeners"),
        };
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        crate::server::serve_all(listeners, shared, stopped).await;
    });
}

fn context(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A listening socket, non-blocking; with `reuse_port`, others may bind the same address.
fn bind(addr: SocketAddr, reuse_port: bool) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// `workers` sockets listening on `addr` (port 0: the port the first one got), one per worker.
///
/// One socket per worker rather than one shared socket: tokio cannot ask epoll to wake a
/// single waiter (`EPOLLEXCLUSIVE`), so every worker woke for each connection and the first
/// to run took it; measured with two workers under `wrk -c100`, one worker took two to three
/// times the other's share. With `SO_REUSEPORT` the kernel spreads connections by their
/// addresses and ports.
///
/// A socket bound without the option first proves the address free: another process of the
/// same user that listens there with `SO_REUSEPORT` (a second tollgate started by mistake)
/// would otherwise be joined silently and take a share of the connections.
fn bind_per_worker(addr: SocketAddr, workers: usize) -> io::Result<Vec<std::net::TcpListener>> {
    if workers > 1 && addr.port() != 0 {
        drop(bind(addr, false)?);
    }
    let first = bind(addr, workers > 1)?;
    let bound = first.local_addr()?;
    let mut all = vec![first];
    for _ in 1..workers {
        all.push(bind(bound, true)?);
    }
    Ok(all)
}

/// One worker's runtime: single-threaded, with every driver. With `on_park`, it is called
/// when the worker runs out of work, and a heartbeat wakes the worker every 500 ms, so that
/// memory freed in a last burst (a spike of connections closing) is given back within a
/// second or two even if nothing else happens (each worker collects its own heap).
fn worker_runtime(on_park: Option<fn()>) -> io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    if let Some(f) = on_park {
        builder.on_thread_park(f);
    }
    let runtime = builder.enable_all().build()?;
    if on_park.is_some() {
        runtime.spawn(async {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        });
    }
    Ok(runtime)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops tollgate");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
        _ = term.recv() => tracing::info!("SIGTERM received"),
    }
}
