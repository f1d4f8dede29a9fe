//! A minimal pingora proxy: the benchmarks' yardstick for "how does tollgate compare to
//! pingora". It is not part of tollgate (its own cargo project, never built by tollgate's
//! build, lints, tests or CI) and it is not a target: it shows what pingora's framework costs
//! on the harness's paths when a user writes the least code that matches them.
//!
//! It takes the harness candidate's environment (`benchmarks/harness.md`, "Candidate
//! contract") and serves, in one pingora service with one worker thread:
//!
//! - `LISTEN_ADDR`: proxies to `UPSTREAM_ADDR` over pingora's HTTP/1.1 keep-alive pool, with a
//!   per-client-IP `pingora_limits::rate::Rate` on the path that never rejects (1e8 a second,
//!   like nginx's `limit_req` in the harness);
//! - `REJECT_PORT` (same host): the same limit at `REJECT_RATE` a second with `REJECT_BURST`,
//!   answering `429` with `Retry-After`; see [`Limit::rejecting`] for how a windowed counter
//!   stands in for a token bucket;
//! - `H2_PORT` (same host): h2c with prior knowledge (pingora's `h2c` server option), HTTP/1.1
//!   to the upstream.
//!
//! No logging, no TLS.

use std::convert::Infallible;
use std::env;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::apps::HttpServerOptions;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_http::ResponseHeader;
use pingora_limits::rate::Rate;
use pingora_proxy::{ProxyHttp, ProxyServiceBuilder, Session};

/// The allocator of tollgate's release build, so that the two differ in their proxies only.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The pass limit's rate: far above any load one core can offer, as in the harness's nginx.
const PASS_RATE: isize = 100_000_000;

/// What the harness hands every candidate through the environment.
struct Settings {
    upstream: SocketAddr,
    listen: SocketAddr,
    reject_port: Option<u16>,
    h2_port: Option<u16>,
    reject_rate: u32,
    reject_burst: u32,
}

impl Settings {
    /// Reads the harness's variables; the ports are optional (the harness passes them empty
    /// when a scenario is not run), the addresses are not.
    fn from_env() -> Result<Self, String> {
        Ok(Settings {
            upstream: parsed("UPSTREAM_ADDR")?.ok_or("UPSTREAM_ADDR is not set")?,
            listen: parsed("LISTEN_ADDR")?.ok_or("LISTEN_ADDR is not set")?,
            reject_port: parsed("REJECT_PORT")?,
            h2_port: parsed("H2_PORT")?,
            reject_rate: parsed("REJECT_RATE")?.unwrap_or(1000).max(1),
            reject_burst: parsed("REJECT_BURST")?.unwrap_or(100).max(1),
        })
    }

    /// The address of a port on the listen address's host.
    fn on_listen_host(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.listen.ip(), port)
    }
}

/// One environment variable, parsed; unset or empty is `None`, anything unparsable an error
/// (a typo must not silently turn a scenario off).
fn parsed<T: std::str::FromStr>(name: &str) -> Result<Option<T>, String> {
    match env::var(name) {
        Ok(v) if !v.is_empty() => v.parse().map(Some).map_err(|_| format!("{name}={v:?} does not parse")),
        _ => Ok(None),
    }
}

/// A per-client-IP limit over pingora-limits' `Rate`: a count-min sketch of events per fixed
/// window, the building block pingora offers for rate limiting.
struct Limit {
    rate: Rate,
    per_window: isize,
}

impl Limit {
    /// The pass listener's limit: counted on every request, never reached.
    fn never_rejecting() -> Self {
        Limit { rate: Rate::new(Duration::from_secs(1)), per_window: PASS_RATE }
    }

    /// `rate` a second with `burst`, as close as a windowed counter gets to a token bucket:
    /// windows of `burst / rate` seconds (100 ms for 1000/s and 100) that admit `burst` each.
    /// The long-run rate is the same; what differs from nginx's `limit_req ... burst nodelay`
    /// is that a window's `burst` may all come at its start (and two windows' at their
    /// boundary) instead of being refilled one token every `1/rate`. Counting rejected
    /// requests too changes nothing here: a window admits its first `burst` either way.
    fn rejecting(rate: u32, burst: u32) -> Self {
        let window = Duration::from_secs_f64(f64::from(burst) / f64::from(rate));
        Limit {
            // `Rate` counts in whole milliseconds: a shorter window would never reset.
            rate: Rate::new(window.max(Duration::from_millis(1))),
            per_window: isize::try_from(burst).unwrap_or(isize::MAX),
        }
    }

    /// Counts one request of `ip`; whether it is within the window's allowance.
    fn admit(&self, ip: &IpAddr) -> bool {
        self.rate.observe(ip, 1) <= self.per_window
    }
}

/// The proxy: which limit a request meets (by the port it came in on), and the upstream.
struct Yardstick {
    upstream: HttpPeer,
    pass: Limit,
    reject: Limit,
    reject_port: Option<u16>,
    /// Seconds until a rejecting window has surely ended, rounded up.
    retry_after: String,
}

impl Yardstick {
    /// The limit of the listener the request arrived on.
    fn limit_for(&self, session: &Session) -> &Limit {
        let port = session.server_addr().and_then(|a| a.as_inet()).map(|a| a.port());
        if port.is_some() && port == self.reject_port {
            &self.reject
        } else {
            &self.pass
        }
    }

    /// Answers `429` with `Retry-After` and an empty body; the connection stays open, as
    /// nginx's and HAProxy's do.
    async fn refuse(&self, session: &mut Session) -> pingora_core::Result<()> {
        let mut header = ResponseHeader::build(429, Some(2))?;
        header.insert_header("retry-after", self.retry_after.as_str())?;
        header.insert_header("content-length", "0")?;
        session.write_response_header(Box::new(header), true).await
    }
}

#[async_trait]
impl ProxyHttp for Yardstick {
    type CTX = ();

    fn new_ctx(&self) {}

    /// The limit, keyed by the client's IP (a request with no IP peer is let through: there
    /// are none on TCP listeners).
    async fn request_filter(&self, session: &mut Session, _ctx: &mut Self::CTX) -> pingora_core::Result<bool> {
        let ip = session.client_addr().and_then(|a| a.as_inet()).map(|a| a.ip());
        let Some(ip) = ip else { return Ok(false) };
        if self.limit_for(session).admit(&ip) {
            return Ok(false);
        }
        self.refuse(session).await?;
        Ok(true)
    }

    /// The one upstream; pingora pools its connections by the peer's hash.
    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut Self::CTX) -> pingora_core::Result<Box<HttpPeer>> {
        Ok(Box::new(self.upstream.clone()))
    }
}

/// The server's settings: one worker thread on a current-thread runtime (like tollgate
/// bench's and nginx's one worker), an upstream pool as large as nginx's in the harness (h2c
/// brings 500 streams in flight), and a quick exit on SIGTERM (the harness's stop).
fn server_conf() -> ServerConf {
    let scratch = env::temp_dir().join(format!("pingora-yardstick-{}", std::process::id()));
    ServerConf {
        threads: 1,
        work_stealing: false,
        upstream_keepalive_pool_size: 1024,
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        pid_file: scratch.with_extension("pid").display().to_string(),
        upgrade_sock: scratch.with_extension("sock").display().to_string(),
        ..ServerConf::default()
    }
}

/// Builds the service on its listeners and runs it until a signal ends the process.
fn run(settings: Settings) -> Result<Infallible, String> {
    let mut server = Server::new_with_opt_and_conf(None, server_conf());
    server.bootstrap();

    let reject = Limit::rejecting(settings.reject_rate, settings.reject_burst);
    let window_secs = f64::from(settings.reject_burst) / f64::from(settings.reject_rate);
    let app = Yardstick {
        upstream: HttpPeer::new(settings.upstream, false, String::new()),
        pass: Limit::never_rejecting(),
        reject,
        reject_port: settings.reject_port,
        retry_after: format!("{}", window_secs.ceil().max(1.0)),
    };
    let mut options = HttpServerOptions::default();
    // h2c is peeked for once per connection, on every listener of the service.
    options.h2c = settings.h2_port.is_some();
    let mut service =
        ProxyServiceBuilder::new(&server.configuration, app).name("pingora yardstick").server_options(options).build();
    service.add_tcp(&settings.listen.to_string());
    for port in [settings.reject_port, settings.h2_port].into_iter().flatten() {
        service.add_tcp(&settings.on_listen_host(port).to_string());
    }
    server.add_service(service);
    server.run_forever()
}

fn main() -> ExitCode {
    let outcome = Settings::from_env().and_then(run);
    match outcome {
        Ok(never) => match never {},
        Err(e) => {
            eprintln!("pingora-yardstick: {e}");
            ExitCode::from(2)
        }
    }
}
