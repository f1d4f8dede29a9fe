//! The `tollgate` command: run the proxy, or check a config file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tollgate::config::{Config, LogFormat, UpstreamKind};
use tollgate::instance::process::Process;
use tollgate::LogSwitch;

// The subcommands that are the binary's own, each in a file of src/main/.
#[path = "main/proxy.rs"]
mod proxy;
#[path = "main/token.rs"]
mod token;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Gives memory freed on this worker thread back to the system when the thread runs out of
/// work, at most once a second: without it, mimalloc purges free pages only while the
/// thread keeps allocating, so a spike of connections left the process at its peak RSS
/// (issue 23). Called by tokio before a worker parks.
///
/// Usually a plain collect, which frees the thread's empty pages and purges what the
/// arenas have held free for mimalloc's purge delay. When the worker's task count (about
/// its connections) has fallen by at least half, and by [`FORCE_AFTER_TASKS`] or more, since
/// the last forced collect, the collect is forced: empty pages mimalloc retires or keeps
/// for reuse are freed too, and free memory is purged at once rather than after the delay.
/// Measured after a spike of 10,000 h2c connections (BENCHMARKS.md, issue 23).
#[cfg(feature = "mimalloc")]
fn give_back_idle_memory() {
    use std::cell::Cell;
    thread_local! {
        static LAST_MS: Cell<u64> = const { Cell::new(0) };
        static PEAK_TASKS: Cell<usize> = const { Cell::new(0) };
    }
    let now = tollgate::coarse_now_ms();
    if now.saturating_sub(LAST_MS.get()) < 1_000 {
        return;
    }
    LAST_MS.set(now);
    let tasks = tokio::runtime::Handle::try_current().map_or(0, |h| h.metrics().num_alive_tasks());
    let peak = PEAK_TASKS.get().max(tasks);
    let force = peak - tasks >= FORCE_AFTER_TASKS && tasks <= peak / 2;
    PEAK_TASKS.set(if force { tasks } else { peak });
    // SAFETY: `mi_collect` only walks the calling thread's own heap (and the arenas, under
    // their own locks); it may be called at any time from any thread that uses mimalloc.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_collect(force);
    }
}

/// How far a worker's task count must fall before its collect is forced
/// ([`give_back_idle_memory`]): a forced collect visits every page of the thread's heap.
#[cfg(feature = "mimalloc")]
const FORCE_AFTER_TASKS: usize = 1_000;

/// mimalloc's `mi_option_arena_eager_commit` (`mimalloc.h`; the crate names no constant).
#[cfg(feature = "mimalloc")]
const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;

/// mimalloc settings, made before the first allocation (Rust's runtime allocates before
/// `main`, and mimalloc reserves its first arena then): arenas (1 GiB reserved at a time)
/// are committed as they are used instead of at once. Measured (BENCHMARKS.md, issue 23):
/// RSS of an idle `tollgate run` 18 → 10 MB, and 30 s after a spike of 10,000 HTTP/1.1
/// connections 280 % → 130 % of that. A value given in `MIMALLOC_ARENA_EAGER_COMMIT` other
/// than mimalloc's default (2) is kept.
///
/// mimalloc's purge delay stays at its default (1 s): at 10 ms, memory freed between two
/// HTTP/2 requests was given back and faulted in again, 0.3 page faults and +0.6–0.8 µs of
/// system time per h2c request (BENCHMARKS.md, issue 23); the forced collect after a spike
/// ([`give_back_idle_memory`]) purges at once where it matters.
#[cfg(feature = "mimalloc")]
extern "C" fn tune_allocator() {
    // SAFETY: a read and a write of mimalloc's option table, which it allows at any time.
    #[allow(unsafe_code)]
    unsafe {
        if libmimalloc_sys::mi_option_get(MI_OPTION_ARENA_EAGER_COMMIT) == 2 {
            libmimalloc_sys::mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0);
        }
    }
}

/// Runs [`tune_allocator`] as the program loads, before Rust's runtime starts.
#[cfg(all(feature = "mimalloc", target_os = "linux"))]
#[allow(unsafe_code)]
#[used]
#[link_section = ".init_array"]
static TUNE_ALLOCATOR: extern "C" fn() = tune_allocator;

#[derive(Parser)]
#[command(name = "tollgate", version, about = "A fast HTTP reverse proxy with exact, shared rate limits")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Config file.
    #[arg(short, long, global = true, default_value = "proxy.yaml")]
    config: PathBuf,
    /// Listen address, overriding `listen:` in the config.
    #[arg(long, global = true)]
    listen: Option<SocketAddr>,
    /// Log format, overriding `log.format:` in the config.
    #[arg(long, global = true, value_enum)]
    log_format: Option<Format>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the config (the default).
    Run,
    /// Validate the config and print its routes; exit 2 when it is invalid.
    Check,
    /// Print each route's limits in plain words, with the Retry-After a client will see.
    Explain,
    /// Be the candidate of the benchmark harness (benches/harness/run.sh): one worker thread,
    /// configured from UPSTREAM_ADDR, LISTEN_ADDR, REJECT_PORT, H2_PORT, REJECT_RATE, REJECT_BURST.
    Bench,
    /// Load-test URL step by step at constant arrival rates (open loop), find the knee and
    /// suggest limits for it.
    Calibrate(Box<CalibrateArgs>),
    /// Run access logs through the config's routes and limits on the logs' own clock and
    /// report whom its limits would throttle (nothing is sent anywhere).
    Replay(Box<ReplayArgs>),
    /// Print the SHA-256 (hex) of the API key read from standard input (one line), as a keys
    /// file (`HASH CONSUMER`) or a Redis hash of `auth.api_key` holds it.
    HashKey,
    /// Print the root of tollgate's local development CA (`tls: { internal: true }`) as PEM,
    /// or install it for the system and the browsers; the CA is made if there is none yet.
    Trust(TrustArgs),
    /// A reverse proxy from the command line: `tollgate proxy --to http://localhost:3000
    /// --limit 10/s` (the flags make a config; `--print-config` shows it).
    Proxy(Box<proxy::ProxyArgs>),
    /// Sign a JWT with a private key file, to try a route's `auth.jwt` (`--key
    /// examples/jwt-test-only.pem --sub alice --aud api`).
    Token(Box<token::TokenArgs>),
}

#[derive(clap::Args)]
struct TrustArgs {
    /// Install the root into the system's trusted roots (as root) and the browsers' (certutil).
    #[arg(long)]
    install: bool,
    /// The local CA's storage folder (default: the config's `tls.internal.storage`, else
    /// ~/.local/share/tollgate).
    #[arg(long)]
    storage: Option<PathBuf>,
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// Access logs, read in order (decisions follow their timestamps).
    #[arg(required = true)]
    logs: Vec<PathBuf>,
    /// The log format: tollgate's JSON access log, nginx `combined` (with `$msec` appended or
    /// not), JSON lines or CSV with `--columns`.
    #[arg(long, value_enum, default_value = "tollgate")]
    format: LogKind,
    /// Named columns for `json` and `csv`: `ts=time,ip=remote,method=verb,path=uri,host=…,
    /// query=…,status=…,id=…,header:x-api-key=…`.
    #[arg(long)]
    columns: Option<String>,
    /// Compare two configs: CURRENT CANDIDATE (then `-c` is not read).
    #[arg(long, num_args = 2, value_names = ["CURRENT", "CANDIDATE"])]
    compare: Option<Vec<PathBuf>>,
    /// Replay Redis limits as the local fallback of one of `redis.instances` proxies would.
    #[arg(long)]
    fallback: bool,
    /// Keys shown per limit.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Write a chart of admitted and throttled requests per second (SVG).
    #[arg(long)]
    svg: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogKind {
    Tollgate,
    Nginx,
    Json,
    Csv,
}

#[derive(clap::Args)]
struct CalibrateArgs {
    /// The URL to load (plain http://).
    url: String,
    /// First offered rate (requests/s).
    #[arg(long, default_value_t = 100)]
    from: u64,
    /// Rate added at each step.
    #[arg(long, default_value_t = 100)]
    step: u64,
    /// Last offered rate.
    #[arg(long, default_value_t = 5000)]
    to: u64,
    /// Explicit rates instead of --from/--step/--to: `400,800,1000,1200`.
    #[arg(long, conflicts_with_all = ["from", "step", "to"])]
    rates: Option<String>,
    /// Measured time of each step.
    #[arg(long, default_value = "10s", value_parser = duration)]
    step_duration: std::time::Duration,
    /// Unmeasured time at the step's rate before each measurement.
    #[arg(long, default_value = "2s", value_parser = duration)]
    warmup: std::time::Duration,
    /// A request unanswered this long after its scheduled time is an error.
    #[arg(long, default_value = "5s", value_parser = duration)]
    timeout: std::time::Duration,
    /// Requests in flight at most; when it binds, requests go out late and the step is `saturated`.
    #[arg(long, default_value_t = 1000)]
    concurrency_max: usize,
    /// p99 a good step keeps (default: 1.5 × the first step's p99, at least +10 ms).
    #[arg(long, value_parser = duration)]
    slo_p99: Option<std::time::Duration>,
    /// Error share a good step keeps: `0.1%`.
    #[arg(long, default_value = "0.1%")]
    slo_errors: String,
    /// Instances behind the cluster-wide limit, for its suggestion (× rate × 0.8).
    #[arg(long)]
    instances: Option<u64>,
    /// Request method (default GET, POST with -d).
    #[arg(short = 'X', long)]
    method: Option<String>,
    /// Request header `Name: value` (repeatable).
    #[arg(short = 'H', long = "header")]
    headers: Vec<String>,
    /// Request body.
    #[arg(short = 'd', long)]
    data: Option<String>,
    /// Write report.json, chart.svg and suggestion.yaml into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the report as JSON on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// The whole run ends by this, measured or not.
    #[arg(long, default_value = "15m", value_parser = duration)]
    max_duration: std::time::Duration,
    /// Stop after this many bad steps.
    #[arg(long, default_value_t = 2)]
    stop_after_bad: usize,
    /// Worker threads of the generator (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
}

fn duration(s: &str) -> Result<std::time::Duration, String> {
    tollgate::config::units::Dur::parse(s).map(|d| d.0)
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
}

fn main() -> ExitCode {
    // Elsewhere than on Linux, as early as this program can.
    #[cfg(all(feature = "mimalloc", not(target_os = "linux")))]
    tune_allocator();
    let cli = Cli::parse();
    if let Some(Command::Calibrate(args)) = cli.command {
        return calibrate(*args);
    }
    if let Some(Command::Replay(args)) = cli.command {
        return replay(&cli.config, *args);
    }
    if let Some(Command::Trust(args)) = &cli.command {
        return match tollgate::trust::command(&cli.config, args.storage.as_deref(), args.install) {
            Ok((out, note)) => {
                use std::io::Write;
                let _ = std::io::stderr().write_all(note.as_bytes());
                output(&out)
            }
            Err(e) => fail(e.trim_end(), ExitCode::FAILURE),
        };
    }
    if matches!(cli.command, Some(Command::HashKey)) {
        let mut key = String::new();
        if let Err(e) = std::io::stdin().read_line(&mut key) {
            return fail(&format!("reading the key from standard input: {e}"), ExitCode::from(2));
        }
        let key = key.trim_end_matches(['\n', '\r']);
        if key.is_empty() {
            return fail("no key on standard input (e.g. `printf %s \"$KEY\" | tollgate hash-key`)", ExitCode::from(2));
        }
        return output(&format!("{}\n", tollgate::config::auth::hash_key(key.as_bytes())));
    }
    if let Some(Command::Token(args)) = &cli.command {
        return match token::token(args) {
            Ok(t) => output(&format!("{t}\n")),
            Err(e) => fail(&e, ExitCode::from(2)),
        };
    }
    if let Some(Command::Proxy(args)) = &cli.command {
        let text = proxy::config_text(args);
        if args.print_only() {
            return output(&text);
        }
        let path = PathBuf::from("tollgate proxy");
        let config = match Config::from_yaml(&path, &text) {
            Ok(c) => c,
            Err(e) => return fail(&format!("{e}\nthe flags made this config:\n{text}"), ExitCode::from(2)),
        };
        return match run(path, cli.listen, cli.log_format, config) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&format!("{e:#}"), ExitCode::FAILURE),
        };
    }
    if matches!(cli.command, Some(Command::Bench)) {
        return match tollgate::bench::run_from_env() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&format!("{e:#}"), ExitCode::FAILURE),
        };
    }
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => return fail(&e.to_string(), ExitCode::from(2)),
    };
    for w in &config.warnings {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "warning: {w}");
    }
    if let Some(e) = &config.admin_exposed {
        if matches!(cli.command, Some(Command::Check)) {
            return fail(&e.to_string(), ExitCode::from(2));
        }
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "warning: {e}");
    }
    match cli.command.unwrap_or(Command::Run) {
        Command::Check => output(&summary(&config)),
        Command::Explain => output(&tollgate::explain::explain(&config)),
        Command::Bench
        | Command::Calibrate(_)
        | Command::Replay(_)
        | Command::HashKey
        | Command::Trust(_)
        | Command::Proxy(_)
        | Command::Token(_) => ExitCode::FAILURE,
        Command::Run => match run(cli.config, cli.listen, cli.log_format, config) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&format!("{e:#}"), ExitCode::FAILURE),
        },
    }
}

/// `tollgate calibrate`: exit 0 when the run completed, 130 when Ctrl-C cut it short (what was
/// measured is still printed), 2 for bad arguments.
fn calibrate(a: CalibrateArgs) -> ExitCode {
    use std::io::IsTerminal;
    use tollgate::calibrate::{self as cal, Options, Slo};
    let options = (|| -> Result<Options, cal::Error> {
        let rates = match &a.rates {
            Some(list) => cal::listed(list)?,
            None => cal::stepped(a.from, a.step, a.to)?,
        };
        let o = Options {
            target: cal::target(&a.url, a.method.as_deref(), &a.headers, a.data.as_deref())?,
            rates,
            warmup: a.warmup,
            step: a.step_duration,
            timeout: a.timeout,
            concurrency_max: a.concurrency_max,
            slo: Slo { p99_ms: a.slo_p99.map(|d| d.as_secs_f64() * 1000.0), errors: cal::share(&a.slo_errors)? },
            instances: a.instances,
            max_duration: a.max_duration,
            stop_after_bad: a.stop_after_bad.max(1),
        };
        o.check()?;
        Ok(o)
    })();
    let options = match options {
        Ok(o) => o,
        Err(e) => return fail(&e.to_string(), ExitCode::from(2)),
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = a.threads {
        builder.worker_threads(n.max(1));
    }
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => return fail(&format!("starting the runtime: {e}"), ExitCode::FAILURE),
    };
    let progress = (!a.json && std::io::stdout().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new_spinner();
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        bar
    });
    let report = runtime.block_on(cal::run(&options, progress.as_ref(), async {
        let _ = tokio::signal::ctrl_c().await;
    }));
    if let Some(bar) = progress {
        bar.finish_and_clear();
    }
    if let Some(dir) = &a.out {
        match cal::report::write_dir(&report, dir) {
            Ok(files) => {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "wrote {}", files.join(", "));
            }
            Err(e) => return fail(&e, ExitCode::FAILURE),
        }
    }
    let text = if a.json {
        serde_json::to_string_pretty(&report).unwrap_or_default() + "\n"
    } else {
        cal::report::table(&report)
    };
    let code = output(&text);
    if report.stopped.as_deref() == Some("interrupted") {
        return ExitCode::from(130);
    }
    code
}

/// `tollgate replay`: 0 when the report is written (unreadable lines are in it), 2 for bad
/// arguments or configs, 1 when a log cannot be read.
fn replay(config: &std::path::Path, a: ReplayArgs) -> ExitCode {
    use tollgate::replay::{self, Columns, Format, Options};
    let columns = || Columns::parse(a.columns.as_deref().unwrap_or(""));
    let format = match a.format {
        LogKind::Tollgate => Ok(Format::Tollgate),
        LogKind::Nginx => Ok(Format::Nginx),
        LogKind::Json => columns().map(Format::Json),
        LogKind::Csv => columns().map(Format::Csv),
    };
    let format = match format {
        Ok(f) => f,
        Err(e) => return fail(&format!("--columns: {e}"), ExitCode::from(2)),
    };
    let load = |p: &std::path::Path| Config::load(p).map_err(|e| e.to_string());
    let o = Options { format, fallback: a.fallback, top: a.top };
    if let Some(pair) = &a.compare {
        let (current, candidate) = match (load(&pair[0]), load(&pair[1])) {
            (Ok(c), Ok(d)) => (c, d),
            (Err(e), _) | (_, Err(e)) => return fail(&e, ExitCode::from(2)),
        };
        return match replay::compare(&current, &candidate, &a.logs, &o) {
            Ok(c) if a.json => output(&(serde_json::to_string_pretty(&c).unwrap_or_default() + "\n")),
            Ok(c) => output(&c.text()),
            Err(e) => fail(&e, ExitCode::FAILURE),
        };
    }
    let candidate = match load(config) {
        Ok(c) => c,
        Err(e) => return fail(&e, ExitCode::from(2)),
    };
    let report = match replay::run(&candidate, &a.logs, &o) {
        Ok(r) => r,
        Err(e) => return fail(&e, ExitCode::FAILURE),
    };
    if let Some(path) = &a.svg {
        let written = replay::chart::svg(&report.series, &config.display().to_string())
            .and_then(|svg| std::fs::write(path, svg).map_err(|e| format!("{}: {e}", path.display())));
        if let Err(e) = written {
            return fail(&e, ExitCode::FAILURE);
        }
    }
    if a.json {
        output(&(serde_json::to_string_pretty(&report).unwrap_or_default() + "\n"))
    } else {
        output(&report.text())
    }
}

/// Writes `text` to stdout. A reader that went away (`tollgate check | head -1`) ends the
/// program quietly with success, as it would for `cat`; `print!` would panic instead.
fn output(text: &str) -> ExitCode {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => fail(&format!("writing the output: {e}"), ExitCode::FAILURE),
    }
}

/// `error: …` on stderr (never a panic, even when stderr is closed), then `code`.
fn fail(message: &str, code: ExitCode) -> ExitCode {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "error: {message}");
    code
}

type FmtLayer = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

fn fmt_layer(format: LogFormat) -> FmtLayer {
    use std::io::IsTerminal;
    use tracing_subscriber::Layer;
    // Colours for a terminal only: in a file or a pipe they are escape codes a person must read past.
    let layer =
        tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Json => layer.json().boxed(),
        LogFormat::Text => layer.boxed(),
    }
}

/// Installs the subscriber; the returned switch changes the format of a running process
/// (a reload of `log.format`).
fn init_logging(format: LogFormat) -> LogSwitch {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (layer, handle) = tracing_subscriber::reload::Layer::new(fmt_layer(format));
    // The redis crate's own lines at most once a second (a node down warns on every attempt).
    let cap = tollgate::limit::store::redis::ClientLogCap::default();
    let _ = tracing_subscriber::registry().with(layer).with(cap).with(filter).try_init();
    Box::new(move |format| handle.reload(fmt_layer(format)).map_err(|e| e.to_string()))
}

fn run(
    path: PathBuf,
    listen: Option<SocketAddr>,
    log_format: Option<Format>,
    mut config: Config,
) -> anyhow::Result<()> {
    // Command-line overrides win over the file, on reloads too.
    let adjust = move |c: &mut Config| {
        if let Some(addr) = listen {
            c.set_listen(addr);
        }
        if let Some(f) = log_format {
            c.log.format = match f {
                Format::Text => LogFormat::Text,
                Format::Json => LogFormat::Json,
            };
        }
    };
    adjust(&mut config);
    let log_switch = init_logging(config.log.format);
    #[cfg(feature = "mimalloc")]
    let on_park = Some(give_back_idle_memory as fn());
    #[cfg(not(feature = "mimalloc"))]
    let on_park = None;
    let process = Process { path, adjust: Box::new(adjust), log_switch: Some(log_switch), on_park };
    Ok(tollgate::instance::process::run(config, process)?)
}

fn summary(config: &Config) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    // Counts after aliases are expanded: what `run` will build.
    let _ = write!(
        out,
        "config ok: listen {}, {} upstream(s), {} route(s), {} limit(s)",
        config.listen,
        config.upstreams.len(),
        config.routes.len(),
        config.limit_count()
    );
    if config.shape.alias_nodes > 0 {
        let _ = write!(out, "; aliases repeat {} YAML nodes", config.shape.alias_nodes);
    }
    out.push('\n');
    if config.listeners.len() > 1 || config.listeners.iter().any(|l| !l.is_plain()) {
        out.push_str(&tollgate::explain::listeners(config));
    }
    for u in &config.upstreams {
        if let UpstreamKind::Http(h) = &u.kind {
            if h.tls.as_ref().is_some_and(|t| t.insecure_skip_verify) {
                let _ = writeln!(
                    out,
                    "warning: upstream `{}`: tls_insecure_skip_verify is on: its certificate is not verified (for \
                     development only)",
                    u.name
                );
            }
        }
    }
    for (i, r) in config.routes.iter().enumerate() {
        let host = match &r.host {
            None => "*".to_owned(),
            Some(tollgate::config::HostMatch::Exact(h)) => h.clone(),
            Some(tollgate::config::HostMatch::Suffix(s)) => format!("*{s}"),
        };
        let path = match &r.path {
            tollgate::config::PathMatch::Prefix(p) => format!("{p}*"),
            tollgate::config::PathMatch::Exact(p) => p.clone(),
        };
        let methods = r
            .methods
            .as_ref()
            .map_or("any method".to_owned(), |m| m.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(","));
        let up = config.upstream(r);
        let target = match &up.kind {
            UpstreamKind::Http(h) => {
                let scheme = if h.tls.is_some() { "https" } else { "http" };
                match &h.group {
                    None => format!("{} ({scheme}://{}{})", up.name, h.authority, h.base_path),
                    Some(g) => {
                        let servers: Vec<String> =
                            g.servers.iter().map(|s| format!("{scheme}://{}{}", s.authority, h.base_path)).collect();
                        format!(
                            "{} (group of {}: {}; {})",
                            up.name,
                            servers.len(),
                            servers.join(", "),
                            tollgate::config::group::describe_balance(&g.balance)
                        )
                    }
                }
            }
            UpstreamKind::Respond(resp) => format!("{} (built-in responder, status {})", up.name, resp.status.as_u16()),
        };
        let _ = writeln!(out, "  {}. {}: {} {} [{}] -> {}", i + 1, r.name, host, path, methods, target);
        if let Some(m) = r.mirror.as_deref() {
            let share = if m.sample >= 1.0 {
                "every request".to_owned()
            } else {
                format!("{} % of requests", (m.sample * 1000.0).round() / 10.0)
            };
            let name = config.upstreams.get(m.upstream).map_or("?", |u| u.name.as_str());
            let _ = writeln!(out, "       mirror: {share} copied to {name}, at most {} at once", m.max_in_flight);
        }
        for line in tollgate::explain::describe_gateway(r) {
            let _ = writeln!(out, "       {line}");
        }
        for l in &r.limits {
            let key: Vec<String> = l.key.parts().iter().map(ToString::to_string).collect();
            let store = match l.store {
                tollgate::config::StoreKind::Local => "local",
                tollgate::config::StoreKind::Redis => "redis",
            };
            let _ = writeln!(
                out,
                "       limit {}: {} {} key [{}] store {store}",
                l.name,
                tollgate::config::algorithm_name(&l.algorithm),
                if l.plan.is_some() { "(rate by plan tier)".to_owned() } else { l.rate.to_string() },
                key.join(", ")
            );
        }
    }
    out
}
