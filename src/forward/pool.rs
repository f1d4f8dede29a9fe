//! Upstream HTTP/1.1 connections, one request at a time each, kept in a small per-upstream
//! pool. A connection goes back to the pool only when the response body it carried has
//! ended, so whatever is taken from the pool is idle. Connections older than the idle
//! timeout, or closed by the upstream, are dropped on the way out.
//!
//! This replaces hyper-util's legacy pooled client on the hot path: checkout is a mutex-held
//! `Vec::pop`, and the connection task is spawned once. Each worker thread has its own shard of
//! the pool ([`crate::workers`]): a connection's task runs on the worker that opened
//! it, and the worker's requests find it there, so the lock is never contended and no request
//! wakes another thread.

use std::sync::Mutex;

use prometheus_client::metrics::counter::Counter;

pub use super::connector::ConnectError;
use super::connector::Connector;
use crate::body::{Home, UpstreamConn as Conn};

pub struct Pool {
    /// Idle connections with when they went idle, on the coarse clock (ms): one shard per
    /// worker thread.
    shards: Box<[Shard]>,
    /// Per shard.
    max_idle: usize,
    /// Milliseconds an idle connection may wait to be reused.
    idle_timeout_ms: u64,
    /// Opens new connections (TCP, TLS for https://, the HTTP/1.1 handshake).
    connector: Connector,
    /// Responses cut off by the idle-read timeout.
    read_timeouts: Counter,
}

impl Pool {
    pub fn new(
        connector: Connector,
        idle_timeout: std::time::Duration,
        max_idle: usize,
        read_timeouts: Counter,
        workers: usize,
    ) -> Pool {
        let idle_timeout_ms = u64::try_from(idle_timeout.as_millis()).unwrap_or(u64::MAX);
        let workers = workers.max(1);
        let shards = (0..workers).map(|_| Shard::default()).collect();
        // `pool_max_idle` is the upstream's: each worker keeps its share, rounded up.
        let max_idle = max_idle.div_ceil(workers);
        Pool { shards, max_idle, idle_timeout_ms, connector, read_timeouts }
    }

    /// The calling worker's idle connections.
    fn shard(&self) -> std::sync::MutexGuard<'_, Vec<(Conn, u64)>> {
        let shard = match self.shards.len() {
            1 => &self.shards[0],
            n => &self.shards[crate::workers::index() % n],
        };
        shard.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An idle connection that can take a request right now, if the newest one can; else
    /// [`Pool::checkout`] waits for it or connects.
    pub fn take_ready(&self) -> Option<Conn> {
        let mut idle = self.shard();
        let now = crate::timer::now_ms();
        while let Some((conn, since)) = idle.pop() {
            if conn.send.is_closed() || now.saturating_sub(since) >= self.idle_timeout_ms {
                continue;
            }
            if conn.send.is_ready() {
                return Some(conn);
            }
            // Its task has not yet run since its last answer ended: wait for it elsewhere.
            idle.push((conn, since));
            return None;
        }
        None
    }

    /// An idle connection from the pool, or a new one.
    pub async fn checkout(&self) -> Result<Conn, ConnectError> {
        while let Some(mut conn) = self.pop() {
            // Returned only after its body ended, so this completes at once; an error means
            // the upstream closed it meanwhile.
            if conn.send.ready().await.is_ok() {
                return Ok(conn);
            }
        }
        // Boxed: connecting is rare, and its future would otherwise enlarge every request's.
        Box::pin(self.connect()).await
    }

    /// An idle connection from the pool, ready for a request; none is opened (`auto`: a new
    /// connection is opened by the forwarder, and ALPN says which pool it joins).
    pub async fn idle(&self) -> Option<Conn> {
        while let Some(mut conn) = self.pop() {
            if conn.send.ready().await.is_ok() {
                return Some(conn);
            }
        }
        None
    }

    /// A new connection of its own for an upgrade request: after a `101` its socket becomes
    /// the upstream end of a tunnel, so it is never taken from, nor given back to, the pool.
    pub async fn connect_for_upgrade(&self) -> Result<Conn, ConnectError> {
        let send = self.connector.http1_for_upgrade().await?;
        Ok(Conn { send, deadline: crate::timer::Deadline::new() })
    }

    /// Opens this upstream's connections (health checks open their own).
    pub fn connector(&self) -> &Connector {
        &self.connector
    }

    fn pop(&self) -> Option<Conn> {
        let mut idle = self.shard();
        let now = crate::timer::now_ms();
        while let Some((conn, since)) = idle.pop() {
            if !conn.send.is_closed() && now.saturating_sub(since) < self.idle_timeout_ms {
                return Some(conn);
            }
        }
        None
    }

    async fn connect(&self) -> Result<Conn, ConnectError> {
        let send = self.connector.http1().await?;
        Ok(Conn { send, deadline: crate::timer::Deadline::new() })
    }
}

/// One worker's idle connections, on a cache line of their own.
#[derive(Default)]
#[repr(align(64))]
struct Shard(Mutex<Vec<(Conn, u64)>>);

impl Home for Pool {
    /// Takes back a connection whose response has ended.
    fn put(&self, conn: Conn) {
        if conn.send.is_closed() {
            return;
        }
        let mut idle = self.shard();
        if idle.len() < self.max_idle {
            idle.push((conn, crate::timer::now_ms()));
        }
    }

    fn read_timed_out(&self) {
        self.read_timeouts.inc();
        tracing::debug!(upstream = %self.connector.addr(), "upstream response idle past its read timeout; connection dropped");
    }
}
