//! The shared connection to Redis (one per config): a multiplexed, auto-reconnecting
//! `ConnectionManager` for one node or the cluster client, wrapped with the decision deadline,
//! the breaker and the counters. Concurrent calls are pipelined on the one connection.
//!
//! A connection that stops answering (a network partition: the socket stays open, nothing comes
//! back) is not waited for: the breaker's probe drops a connection that has been silent since a
//! call timed out and connects afresh, so decisions are shared again about one probe interval
//! after Redis is reachable, however long the partition lasted (the old socket would wait for
//! the kernel's retransmission backoff). Sockets also carry TCP keepalive and a user timeout, so
//! the kernel gives up on a dead peer by itself.
//!
//! # Deadlines in Redis' clock
//! A call that times out has been written, and Redis runs it whenever it reads it (a paused or
//! overloaded server, a slow link). Meanwhile the decision was made without Redis (`on_error`),
//! so the script must not charge then: each writing call carries its deadline in Redis' `TIME`,
//! and a script run past it changes nothing (it answers "late"). The client learns Redis' clock
//! from the replies themselves (each ends with the script's `TIME`): `offset` is the smallest
//! `redis_time − local_send_time` seen, an upper bound of the true offset (a script runs after it
//! was sent), so a deadline computed with it is never earlier than the true one, and at most the
//! fastest call's one-way delay later. If Redis' clock moves ahead of that estimate (a step, a
//! drift, another cluster node), a call answered "late" within the decision timeout says so: the
//! estimate is raised to that call's own sample and the call is made once more.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::{socket2::TcpKeepalive, TcpSettings};
use redis::{Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture, Value};
use tokio::sync::Notify;

use super::breaker::{Breaker, BreakerState, Pass};
use super::metrics::{FailureKind, RedisMetrics};
use super::script::Invocation;
use super::{RedisConfig, Topology};
use crate::limit::store::StoreError;

/// One node or a cluster, behind one type the scripts can run on.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

enum Builder {
    Single(redis::Client),
    Cluster(ClusterClient),
}

/// The connection shared by every Redis-backed limit of one config.
pub struct RedisClient {
    config: RedisConfig,
    builder: Builder,
    conn: ArcSwapOption<Conn>,
    connecting: AtomicBool,
    epoch: Instant,
    /// Monotonic µs since `epoch` of the last answer on the current connection (or its opening).
    heard: AtomicU64,
    /// Monotonic µs since `epoch` when the latest call that got no answer in time was sent.
    unanswered: AtomicU64,
    /// Woken when a background connect attempt ends, either way.
    attempted: Notify,
    /// Redis' `TIME` minus this client's monotonic µs (see the module's doc), an upper bound;
    /// [`NO_OFFSET`] until a reply taught it.
    offset: AtomicI64,
    breaker: Breaker,
    metrics: RedisMetrics,
}

impl std::fmt::Debug for RedisClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisClient").field("target", &self.config.target).finish_non_exhaustive()
    }
}

/// A failed call: its kind (for counters and the `on_error` policy) and the error text.
#[derive(Debug)]
pub struct Failure {
    pub kind: FailureKind,
    pub retry_in: Duration,
    pub error: Option<RedisError>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.error {
            Some(e) => write!(f, "{}: {e}", self.kind),
            None => write!(f, "{}", self.kind),
        }
    }
}

/// The kind a failed call is counted as: `connection` for anything that says a node could not
/// be reached or serve (I/O, refused or dropped connections, a cluster without a master for
/// the slot, a node loading or failing over, redirects past the store's own), `reply` for an
/// answer about the call itself (a script error, an unreadable reply).
fn classify(e: &RedisError) -> FailureKind {
    if e.is_timeout() {
        return FailureKind::Timeout;
    }
    let unreachable = matches!(
        e.kind(),
        ErrorKind::IoError
            | ErrorKind::ClusterDown
            | ErrorKind::ClusterConnectionNotFound
            | ErrorKind::MasterDown
            | ErrorKind::TryAgain
            | ErrorKind::BusyLoadingError
            | ErrorKind::ReadOnly
            | ErrorKind::Moved
            | ErrorKind::Ask
    );
    if unreachable || e.is_connection_dropped() || e.is_connection_refusal() || e.is_unrecoverable_error() {
        FailureKind::Connection
    } else {
        FailureKind::Reply
    }
}

impl RedisClient {
    /// A client for `config`. Does not connect yet: the first call (or [`RedisClient::connect`])
    /// does, in the background, so a proxy can start while Redis is down.
    ///
    /// # Errors
    /// [`StoreError::Config`] if a URL cannot be used (validation normally catches this).
    pub fn new(config: RedisConfig) -> Result<Arc<RedisClient>, StoreError> {
        // The crate builds its `rediss://` TLS config on the process's default provider: make
        // that tollgate's own before it looks for one.
        crate::pki::provider();
        let bad = |e: RedisError| StoreError::Config(e.to_string());
        let builder = match &config.target {
            Topology::Single(url) => Builder::Single(redis::Client::open(url.as_str()).map_err(bad)?),
            Topology::Cluster(urls) => Builder::Cluster(
                ClusterClient::builder(urls.iter().map(String::as_str))
                    .tcp_settings(tcp_settings())
                    .connection_timeout(config.connect_timeout)
                    .response_timeout(config.connect_timeout)
                    .retries(2)
                    .min_retry_wait(10)
                    .max_retry_wait(100)
                    .build()
                    .map_err(bad)?,
            ),
        };
        let breaker = Breaker::new(config.breaker_failures.get(), config.breaker_cooldown);
        Ok(Arc::new(RedisClient {
            config,
            builder,
            conn: ArcSwapOption::empty(),
            connecting: AtomicBool::new(false),
            epoch: Instant::now(),
            heard: AtomicU64::new(0),
            unanswered: AtomicU64::new(0),
            attempted: Notify::new(),
            offset: AtomicI64::new(NO_OFFSET),
            breaker,
            metrics: RedisMetrics::default(),
        }))
    }

    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    pub fn metrics(&self) -> &RedisMetrics {
        &self.metrics
    }

    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }

    async fn open(&self) -> Result<Conn, RedisError> {
        match &self.builder {
            Builder::Single(client) => {
                // Few, short retries: the breaker and the next call take over from there.
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(self.config.connect_timeout)
                    .set_tcp_settings(tcp_settings())
                    .set_number_of_retries(2)
                    .set_factor(10)
                    .set_max_delay(200);
                Ok(Conn::Single(ConnectionManager::new_with_config(client.clone(), cfg).await?))
            }
            Builder::Cluster(client) => Ok(Conn::Cluster(client.get_async_connection().await?)),
        }
    }

    /// Connects now and waits for it (tests, readiness).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] if Redis cannot be reached.
    pub async fn connect(&self) -> Result<(), StoreError> {
        let unavailable = |e: RedisError| StoreError::Unavailable {
            kind: classify(&e),
            retry_after: self.config.breaker_cooldown,
            message: e.to_string(),
        };
        if self.conn.load().is_some() {
            return Ok(());
        }
        // The whole handshake within the connect timeout (the crate's own retries included).
        let opened = match tokio::time::timeout(self.config.connect_timeout, self.open()).await {
            Ok(r) => r.map_err(unavailable)?,
            Err(_) => {
                return Err(StoreError::Unavailable {
                    kind: FailureKind::Timeout,
                    retry_after: self.config.breaker_cooldown,
                    message: "connecting timed out".into(),
                })
            }
        };
        // Redis' clock, before the first script call needs it (best effort, within one
        // decision's time: a script's reply teaches it too).
        let mut c = opened.clone();
        let sent = self.mono();
        if let Ok(Ok((secs, micros))) =
            tokio::time::timeout(self.config.timeout, redis::cmd("TIME").query_async::<(i64, i64)>(&mut c)).await
        {
            self.learn(secs.saturating_mul(1_000_000).saturating_add(micros), sent, false);
        }
        self.heard.store(self.mono(), Ordering::Relaxed);
        self.conn.store(Some(Arc::new(opened)));
        Ok(())
    }

    /// A reply's Redis time for a call sent at `sent` (monotonic µs): the clock estimate
    /// takes the smaller sample, or this one after a call found late in time (`raise`).
    fn learn(&self, redis_us: i64, sent: u64, raise: bool) {
        let sample = redis_us.saturating_sub(i64::try_from(sent).unwrap_or(i64::MAX));
        if raise {
            self.offset.store(sample, Ordering::Relaxed);
        } else {
            self.offset.fetch_min(sample, Ordering::Relaxed);
        }
    }

    /// The deadline in Redis' clock (µs) of a call that must be answered by `until`
    /// (monotonic µs); 0 (none) while the clock is not known.
    fn redis_deadline(&self, until: u64) -> i64 {
        match self.offset.load(Ordering::Relaxed) {
            NO_OFFSET => 0,
            offset => offset.saturating_add(i64::try_from(until).unwrap_or(i64::MAX)).max(1),
        }
    }

    /// Moves the estimate of Redis' clock by `by_us` (tests only: an estimate that went wrong).
    #[doc(hidden)]
    pub fn skew_clock(&self, by_us: i64) {
        let _ = self
            .offset
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |o| (o != NO_OFFSET).then(|| o.saturating_add(by_us)));
    }

    fn mono(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn current(&self) -> Option<Conn> {
        self.conn.load().as_deref().cloned()
    }

    /// Did a call get no answer in time, and nothing come back on the connection since it was sent?
    fn silent(&self) -> bool {
        self.unanswered.load(Ordering::Relaxed) > self.heard.load(Ordering::Relaxed)
    }

    /// The connection. Without one, connects in a background task (so a decision that gives up
    /// at its deadline does not abort the handshake for the others) and waits for that attempt.
    async fn conn(self: &Arc<Self>) -> Option<Conn> {
        if let Some(c) = self.current() {
            return Some(c);
        }
        let attempt = self.attempted.notified();
        tokio::pin!(attempt);
        // Registered before the re-check, so an attempt ending in between is not missed.
        attempt.as_mut().enable();
        if let Some(c) = self.current() {
            return Some(c);
        }
        if !self.connecting.swap(true, Ordering::AcqRel) {
            let me = Arc::clone(self);
            tokio::spawn(async move {
                let result = me.connect().await;
                me.connecting.store(false, Ordering::Release);
                me.attempted.notify_waiters();
                match result {
                    // Redis answered the handshake: the next call may probe at once.
                    Ok(()) => me.breaker.probe_now(),
                    Err(e) => me.breaker.failure(Pass::Call, &e),
                }
            });
        }
        attempt.await;
        self.current()
    }

    /// `PING` within the connect timeout (readiness checks).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] if Redis does not answer.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let fail = |kind, message: String| StoreError::Unavailable { kind, retry_after: Duration::ZERO, message };
        let attempt = async {
            self.connect().await?;
            let mut c = self.current().ok_or_else(|| fail(FailureKind::Connection, "not connected".into()))?;
            redis::cmd("PING").query_async::<String>(&mut c).await.map_err(|e| fail(classify(&e), e.to_string()))
        };
        match tokio::time::timeout(self.config.connect_timeout, attempt).await {
            Ok(r) => r.map(|_| ()),
            Err(_) => Err(fail(FailureKind::Timeout, "ping timed out".into())),
        }
    }

    /// `HGET hash field` within the decision deadline (a plan's client → tier map). `None` when
    /// Redis gives no answer; `Some(None)` when the field is not there.
    pub async fn hget(self: &Arc<Self>, hash: &str, field: &[u8]) -> Option<Option<String>> {
        let call = async {
            let mut conn = self.conn().await?;
            self.metrics.call();
            redis::cmd("HGET").arg(hash).arg(field).query_async::<Option<String>>(&mut conn).await.ok()
        };
        tokio::time::timeout(self.config.timeout, call).await.ok().flatten()
    }

    /// `DEL key` within the connect timeout (an operator's reset, not a decision: not through
    /// the breaker); whether a key was there.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] if Redis does not answer or answers with an error.
    pub async fn del(self: &Arc<Self>, key: &str) -> Result<bool, StoreError> {
        let fail = |kind, message: String| StoreError::Unavailable { kind, retry_after: Duration::ZERO, message };
        let call = async {
            let mut conn = self.conn().await.ok_or_else(|| fail(FailureKind::Connection, "not connected".into()))?;
            self.metrics.call();
            redis::cmd("DEL")
                .arg(key)
                .query_async::<i64>(&mut conn)
                .await
                .map_err(|e| fail(classify(&e), e.to_string()))
        };
        match tokio::time::timeout(self.config.connect_timeout, call).await {
            Ok(r) => r.map(|n| n > 0),
            Err(_) => Err(fail(FailureKind::Timeout, "DEL timed out".into())),
        }
    }

    /// `SET key value NX PX ttl` within the connect timeout (a lock shared by instances, not
    /// a decision: not through the breaker); whether the key was set, i.e. the lock taken.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] if Redis does not answer or answers with an error.
    pub async fn set_nx(self: &Arc<Self>, key: &str, value: &str, ttl: Duration) -> Result<bool, StoreError> {
        let fail = |kind, message: String| StoreError::Unavailable { kind, retry_after: Duration::ZERO, message };
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let call = async {
            let mut conn = self.conn().await.ok_or_else(|| fail(FailureKind::Connection, "not connected".into()))?;
            self.metrics.call();
            redis::cmd("SET")
                .arg(key)
                .arg(value)
                .arg("NX")
                .arg("PX")
                .arg(ms)
                .query_async::<Option<String>>(&mut conn)
                .await
                .map_err(|e| fail(classify(&e), e.to_string()))
        };
        match tokio::time::timeout(self.config.connect_timeout, call).await {
            Ok(r) => r.map(|ok| ok.is_some()),
            Err(_) => Err(fail(FailureKind::Timeout, "SET timed out".into())),
        }
    }

    /// Deletes `key` if it still holds `value` (a lock released by its holder only, in one
    /// script so another's lock taken meanwhile stays); whether it was deleted.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] if Redis does not answer or answers with an error.
    pub async fn del_if(self: &Arc<Self>, key: &str, value: &str) -> Result<bool, StoreError> {
        const SCRIPT: &str =
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";
        let fail = |kind, message: String| StoreError::Unavailable { kind, retry_after: Duration::ZERO, message };
        let call = async {
            let mut conn = self.conn().await.ok_or_else(|| fail(FailureKind::Connection, "not connected".into()))?;
            self.metrics.call();
            redis::cmd("EVAL")
                .arg(SCRIPT)
                .arg(1)
                .arg(key)
                .arg(value)
                .query_async::<i64>(&mut conn)
                .await
                .map_err(|e| fail(classify(&e), e.to_string()))
        };
        match tokio::time::timeout(self.config.connect_timeout, call).await {
            Ok(r) => r.map(|n| n > 0),
            Err(_) => Err(fail(FailureKind::Timeout, "EVAL timed out".into())),
        }
    }

    /// Runs one script call within the decision deadline, through the breaker. `build` makes
    /// the call for a deadline in Redis' clock (µs, 0: none); `timed`: the script reads Redis'
    /// `TIME` (not a test clock), so a deadline is sent and the reply's time is learnt. The
    /// reply without its final time; a call answered "late" in time is made once more (see the
    /// module's doc).
    pub(super) async fn invoke<'s>(
        self: &Arc<Self>,
        build: impl Fn(i64) -> Invocation<'s>,
        timed: bool,
    ) -> Result<Vec<i64>, Failure> {
        let pass = self.breaker.pass();
        if let Pass::Open(retry_in) = pass {
            self.metrics.failure(FailureKind::BreakerOpen);
            return Err(Failure { kind: FailureKind::BreakerOpen, retry_in, error: None });
        }
        if pass == Pass::Probe && self.silent() {
            // Silent since a call timed out: the probe asks over a fresh connection.
            self.conn.store(None);
        }
        let started = Instant::now();
        let sent = self.mono();
        let timeout_us = u64::try_from(self.config.timeout.as_micros()).unwrap_or(u64::MAX);
        let until = sent.saturating_add(timeout_us);
        let call = async {
            let Some(mut conn) = self.conn().await else {
                return Err(None);
            };
            let mut raised = false;
            loop {
                let deadline = if timed { self.redis_deadline(until) } else { 0 };
                let at = self.mono();
                self.metrics.call();
                let mut reply: Vec<i64> = self.eval(&mut conn, &build(deadline)).await.map_err(Some)?;
                let Some(redis_us) = reply.pop() else { return Ok(reply) };
                let late = reply.as_slice() == [LATE];
                if timed {
                    self.learn(redis_us, at, late);
                }
                if !late {
                    return Ok(reply);
                }
                if raised {
                    return Err(Some(RedisError::from((ErrorKind::ResponseError, "late twice in time"))));
                }
                raised = true;
            }
        };
        let result = tokio::time::timeout(self.config.timeout, call).await;
        self.metrics.latency(started.elapsed());
        let cooldown = self.config.breaker_cooldown;
        let failure = match result {
            Ok(Ok(v)) => {
                self.heard.fetch_max(self.mono(), Ordering::Relaxed);
                self.breaker.success(pass);
                return Ok(v);
            }
            Ok(Err(Some(e))) => {
                if e.kind() != ErrorKind::IoError {
                    // Redis answered, with an error.
                    self.heard.fetch_max(self.mono(), Ordering::Relaxed);
                }
                Failure { kind: classify(&e), retry_in: cooldown, error: Some(e) }
            }
            Ok(Err(None)) => Failure { kind: FailureKind::Connection, retry_in: cooldown, error: None },
            Err(_) => {
                self.unanswered.fetch_max(sent, Ordering::Relaxed);
                Failure { kind: FailureKind::Timeout, retry_in: cooldown, error: None }
            }
        };
        self.metrics.failure(failure.kind);
        self.breaker.failure(pass, &failure);
        Err(failure)
    }

    /// `EVALSHA`, loading the script once on `NOSCRIPT`, and following the cluster's redirects
    /// that reach this far (the cluster client follows MOVED and ASK itself, but sends its
    /// `ASKING` apart from the command on a shared connection, where another caller's command
    /// can take the flag: the call then bounces between the two nodes while a slot migrates).
    /// A redirect is followed with `ASKING` and the call written together in one pipeline,
    /// routed by the key: right after an `ASK` from the slot's owner, or a `MOVED` to the new
    /// owner, whose `ASKING` does nothing. Redirects are the cluster working, not failures.
    async fn eval<T: FromRedisValue>(&self, conn: &mut Conn, inv: &Invocation<'_>) -> Result<T, RedisError> {
        let (mut loaded, mut redirects) = (false, 0);
        // The redirect followed last: the same one again is a node that cannot serve (a master
        // down: the others keep pointing at it), not a slot on the move.
        let mut followed: Option<RedisError> = None;
        loop {
            let result = if redirects == 0 {
                inv.evalsha.query_async::<T>(conn).await
            } else {
                let mut p = redis::pipe();
                p.cmd("ASKING").ignore().add_command(inv.evalsha.clone());
                p.query_async::<(T,)>(conn).await.map(|(v,)| v)
            };
            match result {
                Err(e) if e.kind() == ErrorKind::NoScriptError && !loaded => {
                    loaded = true;
                    inv.script.load_cmd().query_async::<String>(conn).await?;
                }
                Err(e)
                    if is_redirect(&e)
                        && redirects < MAX_REDIRECTS
                        && matches!(conn, Conn::Cluster(_))
                        && !followed.as_ref().is_some_and(|f| same_redirect(f, &e)) =>
                {
                    redirects += 1;
                    self.metrics.redirect();
                    followed = Some(e);
                }
                r => return r,
            }
        }
    }
}

/// Nagle's algorithm off, keepalive probes on an idle connection and a bound on
/// unacknowledged data, on every connection (the node's, or each cluster node's). Without
/// `TCP_NODELAY` (the crate's default), a call written while the previous segment waits for its
/// acknowledgement waits too: concurrent decisions behind a 20 ms link took twice the round
/// trip, past the default decision timeout. With keepalive and the user timeout the kernel
/// drops a connection to a peer that went away, and the next call reconnects.
fn tcp_settings() -> TcpSettings {
    let keepalive = TcpKeepalive::new().with_time(Duration::from_secs(5)).with_interval(Duration::from_secs(1));
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let keepalive = keepalive.with_retries(3);
    let settings = TcpSettings::default().set_nodelay(true).set_keepalive(keepalive);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let settings = settings.set_user_timeout(Duration::from_secs(5));
    settings
}

/// A script's reply to a writing call that Redis ran past its deadline (`{3, now}`).
const LATE: i64 = 3;

/// The clock estimate before anything taught it (above any sample, so the first one is taken).
const NO_OFFSET: i64 = i64::MAX;

/// Redirects one call follows itself (each after the cluster client's own).
const MAX_REDIRECTS: u32 = 3;

fn is_redirect(e: &RedisError) -> bool {
    matches!(e.kind(), ErrorKind::Moved | ErrorKind::Ask)
}

fn same_redirect(a: &RedisError, b: &RedisError) -> bool {
    a.kind() == b.kind() && a.redirect_node() == b.redirect_node()
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[test]
    fn failures_are_counted_by_what_went_wrong() {
        let io = |k: io::ErrorKind| RedisError::from(io::Error::from(k));
        let server = |k: ErrorKind, code: &'static str| RedisError::from((k, code, "detail".to_owned()));
        let cases = [
            (io(io::ErrorKind::TimedOut), FailureKind::Timeout),
            (io(io::ErrorKind::ConnectionRefused), FailureKind::Connection),
            (io(io::ErrorKind::ConnectionReset), FailureKind::Connection),
            (io(io::ErrorKind::BrokenPipe), FailureKind::Connection),
            (io(io::ErrorKind::UnexpectedEof), FailureKind::Connection),
            (io(io::ErrorKind::HostUnreachable), FailureKind::Connection),
            // A master down: the cluster says so, or the client has no connection to ask.
            (server(ErrorKind::ClusterDown, "CLUSTERDOWN"), FailureKind::Connection),
            (server(ErrorKind::MasterDown, "MASTERDOWN"), FailureKind::Connection),
            (server(ErrorKind::TryAgain, "TRYAGAIN"), FailureKind::Connection),
            (server(ErrorKind::BusyLoadingError, "LOADING"), FailureKind::Connection),
            (server(ErrorKind::ReadOnly, "READONLY"), FailureKind::Connection),
            (server(ErrorKind::Moved, "MOVED"), FailureKind::Connection),
            (server(ErrorKind::Ask, "ASK"), FailureKind::Connection),
            (RedisError::from((ErrorKind::ClusterConnectionNotFound, "No connections found")), FailureKind::Connection),
            // An answer about the call itself.
            (server(ErrorKind::ResponseError, "ERR"), FailureKind::Reply),
            (server(ErrorKind::NoScriptError, "NOSCRIPT"), FailureKind::Reply),
            (RedisError::from((ErrorKind::TypeError, "not a number")), FailureKind::Reply),
        ];
        for (e, want) in cases {
            assert_eq!(classify(&e), want, "{e:?}");
        }
    }
}
