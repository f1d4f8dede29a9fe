//! The seed's retry storm, reproduced: a slow upstream at its knee, a population of clients
//! that time out and retry naively through two layers, and whatever stands between them
//! (tollgate, with the config of each mode). `benches/retry-storm.sh` drives it; the model
//! and the figures are in `docs/concepts/retry-storms.md`.
//!
//! ```sh
//! # one mode: the upstream on 18710 and 18711, the clients sending to tollgate on 18720
//! target/release/examples/retry_storm run --mode plain --upstream-port 18710 \
//!     --target http://127.0.0.1:18720/ --out plain.json
//! # the report of several modes: report.md, report.json, chart.svg
//! target/release/examples/retry_storm report --out DIR plain.json limits.json full.json
//! ```

mod client;
mod report;
mod series;
mod upstream;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::{BodyExt, Empty};
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use client::{Outcome, Policy, Profile};
use report::{Mode, Totals};
use series::Series;

#[derive(Parser)]
#[command(about = "A retry storm against a slow upstream, through a proxy")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serves the slow upstream and runs the clients against TARGET once; writes one mode's JSON.
    Run(Run),
    /// Combines the JSON of several modes into report.md, report.json and chart.svg.
    Report {
        #[arg(long)]
        out: PathBuf,
        /// The report's heading and the chart's title.
        #[arg(long, default_value = "Retry storm")]
        title: String,
        files: Vec<PathBuf>,
    },
}

#[derive(Parser)]
struct Run {
    /// The mode's name in the report.
    #[arg(long)]
    mode: String,
    /// What the mode puts in front of the upstream, in a line.
    #[arg(long, default_value = "")]
    describe: String,
    /// The upstream listens here and on the next port (one pool of workers behind both).
    #[arg(long)]
    upstream_port: u16,
    /// Where the clients send (`GET`).
    #[arg(long)]
    target: Uri,
    #[arg(long)]
    out: PathBuf,
    /// The upstream's workers…
    #[arg(long, default_value_t = 10)]
    workers: usize,
    /// …each holding a request this many ms: capacity = workers × 1000 / service_ms a second.
    #[arg(long, default_value_t = 50)]
    service_ms: u64,
    /// Seconds of intended load.
    #[arg(long, default_value_t = 30.0)]
    duration: f64,
    /// The intended rate, as a share of the capacity…
    #[arg(long, default_value_t = 0.9)]
    base: f64,
    /// …and during the spike.
    #[arg(long, default_value_t = 1.5)]
    spike: f64,
    #[arg(long, default_value_t = 5.0)]
    spike_at: f64,
    #[arg(long, default_value_t = 4.0)]
    spike_for: f64,
    /// The upstream's service time is multiplied by `slow_factor` from `slow_at` for
    /// `slow_for` seconds (1: no slowdown).
    #[arg(long, default_value_t = 1.0)]
    slow_factor: f64,
    #[arg(long, default_value_t = 0.0)]
    slow_at: f64,
    #[arg(long, default_value_t = 0.0)]
    slow_for: f64,
    /// Each try's timeout (ms).
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
    /// An intended request's deadline from its scheduled time (ms): no try after it.
    #[arg(long, default_value_t = 10_000)]
    deadline_ms: u64,
    #[arg(long, default_value_t = 3)]
    app_tries: u32,
    #[arg(long, default_value_t = 3)]
    sdk_tries: u32,
    /// The SDK ignores Retry-After (retries a 429 at once).
    #[arg(long)]
    ignore_retry_after: bool,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Run(r) => run(r),
        Cmd::Report { out, title, files } => {
            anyhow::ensure!(!files.is_empty(), "report: no mode's JSON given");
            let mut modes = Vec::new();
            for f in &files {
                let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
                modes.push(serde_json::from_str::<Mode>(&text).with_context(|| format!("parsing {}", f.display()))?);
            }
            report::write(&out, &title, &modes)
        }
    }
}

fn run(r: Run) -> anyhow::Result<()> {
    let capacity = r.workers as f64 * 1000.0 / r.service_ms.max(1) as f64;
    let profile = Profile {
        base: r.base * capacity,
        spike: r.spike * capacity,
        spike_at_s: r.spike_at,
        spike_for_s: r.spike_for,
        duration_s: r.duration,
    };
    let policy = Policy {
        app_tries: r.app_tries,
        sdk_tries: r.sdk_tries,
        timeout: Duration::from_millis(r.timeout_ms),
        deadline: Duration::from_millis(r.deadline_ms),
        honour_retry_after: !r.ignore_retry_after,
    };
    // The run lasts the intended load plus the last request's deadline (and a margin).
    let secs = (r.duration + r.deadline_ms as f64 / 1000.0).ceil() as usize + 3;
    let start = std::time::Instant::now() + Duration::from_millis(500);
    let counts =
        Arc::new(upstream::Counts { arrivals: Series::new(start, secs), completions: Series::new(start, secs) });

    // The upstream on a thread and runtime of its own, so the clients' work does not delay it.
    let up = {
        let counts = counts.clone();
        let ports = [r.upstream_port, r.upstream_port.wrapping_add(1)];
        let workers = r.workers;
        let service = upstream::Service {
            service: Duration::from_millis(r.service_ms),
            start,
            slow_at: Duration::from_secs_f64(r.slow_at.max(0.0)),
            slow_for: Duration::from_secs_f64(r.slow_for.max(0.0)),
            factor: r.slow_factor,
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            rt.block_on(async move {
                let _ = ready_tx.send(upstream::serve(&ports, workers, service, counts).await);
                let _ = stop_rx.await;
            })
        });
        ready_rx.recv().context("the upstream thread ended")?.context("binding the upstream")?;
        (thread, stop_tx)
    };

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let totals = rt.block_on(clients(&r, profile, policy, start, secs))?;
    let _ = up.1.send(());
    let _ = up.0.join();

    let mode = Mode::new(
        r.mode.clone(),
        r.describe.clone(),
        capacity,
        report::Slowdown { at_s: r.slow_at, for_s: r.slow_for, factor: r.slow_factor },
        profile,
        policy,
        totals,
        counts.arrivals.values(),
        counts.completions.values(),
    );
    std::fs::write(&r.out, serde_json::to_string_pretty(&mode)?)
        .with_context(|| format!("writing {}", r.out.display()))?;
    println!("{}", report::line(&mode));
    Ok(())
}

async fn clients(
    r: &Run,
    profile: Profile,
    policy: Policy,
    start: std::time::Instant,
    secs: usize,
) -> anyhow::Result<Totals> {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let intended = Arc::new(Series::new(start, secs));
    let attempts = Arc::new(Series::new(start, secs));
    let goodput = Arc::new(Series::new(start, secs));
    let sums: Arc<[AtomicU64; 6]> = Arc::new(Default::default());
    let late = Arc::new(AtomicU64::new(0));
    let answers: Arc<[AtomicU64; ANSWERS.len()]> = Arc::new(Default::default());
    let t0 = tokio::time::Instant::from_std(start);
    let mut tasks = tokio::task::JoinSet::new();
    for at in profile.schedule() {
        let due = t0 + Duration::from_secs_f64(at);
        tokio::time::sleep_until(due).await;
        if due.elapsed() > Duration::from_millis(10) {
            late.fetch_add(1, Ordering::Relaxed);
        }
        intended.add_at(due.into_std(), 1);
        let (client, uri) = (client.clone(), r.target.clone());
        let (attempts, goodput, sums, answers) = (attempts.clone(), goodput.clone(), sums.clone(), answers.clone());
        tasks.spawn(async move {
            let t = client::intended(&client::Tokio, &policy, due, |timeout| {
                attempts.add(1);
                try_once(&client, uri.clone(), timeout, &answers)
            })
            .await;
            if t.ok {
                goodput.add(1);
            }
            for (i, n) in [t.attempts, u32::from(t.ok), t.throttled, t.failed, t.timed_out, 1].into_iter().enumerate() {
                sums[i].fetch_add(u64::from(n), Ordering::Relaxed);
            }
        });
        // Finished tasks are reaped as the run goes, so the set holds only those in flight.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let s: Vec<u64> = sums.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    Ok(Totals {
        intended: s[5],
        attempts: s[0],
        ok: s[1],
        throttled: s[2],
        failed: s[3],
        timed_out: s[4],
        generator_late: late.load(Ordering::Relaxed),
        answers: ANSWERS
            .iter()
            .zip(answers.iter())
            .map(|(k, n)| ((*k).to_owned(), n.load(Ordering::Relaxed)))
            .collect(),
        intended_series: intended.values(),
        attempts_series: attempts.values(),
        goodput_series: goodput.values(),
    })
}

/// What the clients' tries got, counted by kind.
const ANSWERS: [&str; 8] = ["2xx", "429", "503", "504", "502", "other status", "no connection", "timed out"];

/// One try: `GET` with the body read, all within `timeout`; dropped (its connection closed)
/// when the timeout passes, as a client that gave up. Its answer is counted in `answers`.
async fn try_once(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    uri: Uri,
    timeout: Duration,
    answers: &[AtomicU64; ANSWERS.len()],
) -> Outcome {
    let call = async {
        let resp = client.get(uri).await.ok()?;
        let status = resp.status();
        let wait = resp
            .headers()
            .get(hyper::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        resp.into_body().collect().await.ok()?;
        Some((status, wait))
    };
    let got = tokio::time::timeout(timeout, call).await;
    let kind = match &got {
        Err(_) => 7,
        Ok(None) => 6,
        Ok(Some((s, _))) if s.is_success() => 0,
        Ok(Some((s, _))) => match s.as_u16() {
            429 => 1,
            503 => 2,
            504 => 3,
            502 => 4,
            _ => 5,
        },
    };
    answers[kind].fetch_add(1, Ordering::Relaxed);
    match got {
        Err(_) => Outcome::TimedOut,
        Ok(None) => Outcome::Failed,
        Ok(Some((status, _))) if status.is_success() => Outcome::Ok,
        Ok(Some((status, Some(wait)))) if status == 429 || status == 503 => {
            Outcome::Throttled(Duration::from_secs(wait))
        }
        Ok(Some(_)) => Outcome::Failed,
    }
}
