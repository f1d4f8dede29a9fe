//! The open-loop generator: one step at a constant arrival rate.
//!
//! Request `i` of a step is due at `start + i / rate`, whatever happened to the ones before
//! it (open loop, as wrk2 and vegeta; wrk waits for answers and so slows down with the
//! server). Latency runs from that due time, not from the moment the request left, so a
//! server that stalls, or a `--concurrency-max` that binds, shows in the percentiles instead
//! of silently lowering the load (coordinated omission).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{HeaderMap, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use tokio::sync::{mpsc, Semaphore};
use tokio::time::Instant;

use super::knee::Step;

/// The pooled HTTP/1.1 client every step shares.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One request in ten dispatched later than this (p90 of the step's dispatch delays, waits
/// for `--concurrency-max` not counted) means the generator could not keep its schedule. A
/// p90, not a p99: the OS stalls a busy machine's threads now and then, which delays a few
/// sends (their latency still counts from the due time); falling behind delays most of them.
pub const MAX_LAG: Duration = Duration::from_millis(10);

/// Latencies are recorded in µs up to an hour, three significant digits.
const HIST_MAX_US: u64 = 3_600_000_000;

/// What every request of the run sends.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub uri: Uri,
    pub method: Method,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// A client with a connection pool of up to `max_idle` kept-alive connections.
pub fn client(max_idle: usize) -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new()).pool_max_idle_per_host(max_idle).build(http)
}

/// One step's schedule.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Requests per second (≥ 1).
    pub rate: u64,
    /// Sent at `rate` first, not measured.
    pub warmup: Duration,
    /// Measured.
    pub measure: Duration,
    /// A request unanswered this long after its due time is an error.
    pub timeout: Duration,
}

/// The counters of a step in progress, read live by the progress line and at the end.
pub struct Recorder {
    latency: Mutex<Histogram<u64>>,
    lag: Mutex<Histogram<u64>>,
    ok: AtomicU64,
    failed: AtomicU64,
    answered_in_window: AtomicU64,
    saturated: AtomicBool,
    /// The measurement window, set when the step starts.
    window: Mutex<Option<(Instant, Instant)>>,
}

fn histogram() -> Result<Histogram<u64>, hdrhistogram::CreationError> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Recorder {
    /// # Errors
    /// Only if hdrhistogram refuses its constant bounds (1 µs to 1 h, 3 digits).
    pub fn new() -> Result<Recorder, hdrhistogram::CreationError> {
        Ok(Recorder {
            latency: Mutex::new(histogram()?),
            lag: Mutex::new(histogram()?),
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            answered_in_window: AtomicU64::new(0),
            saturated: AtomicBool::new(false),
            window: Mutex::new(None),
        })
    }
}

/// A live view for the progress line.
#[derive(Debug, Clone, Copy, Default)]
pub struct Live {
    pub achieved: f64,
    pub p99_ms: f64,
    pub errors: f64,
}

impl Recorder {
    fn record(&self, due: Instant, done: Instant, ok: bool) {
        let us = done.saturating_duration_since(due).as_micros().min(u128::from(HIST_MAX_US)) as u64;
        lock(&self.latency).saturating_record(us.max(1));
        if ok { &self.ok } else { &self.failed }.fetch_add(1, Ordering::Relaxed);
    }

    fn answered(&self, done: Instant, window: (Instant, Instant)) {
        if done >= window.0 && done <= window.1 {
            self.answered_in_window.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What the step looks like so far.
    pub fn live(&self) -> Live {
        let Some((from, to)) = *lock(&self.window) else { return Live::default() };
        let now = Instant::now().min(to);
        let secs = now.saturating_duration_since(from).as_secs_f64();
        let (ok, failed) = (self.ok.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed));
        Live {
            achieved: if secs > 0.0 { self.answered_in_window.load(Ordering::Relaxed) as f64 / secs } else { 0.0 },
            p99_ms: lock(&self.latency).value_at_quantile(0.99) as f64 / 1000.0,
            errors: if ok + failed > 0 { failed as f64 / (ok + failed) as f64 } else { 0.0 },
        }
    }

    /// The step's row; `interrupted` when it was cut short.
    pub fn step(&self, rate: u64, interrupted: bool) -> Step {
        let hist = lock(&self.latency);
        let q = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
        let (ok, failed) = (self.ok.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed));
        let requests = ok + failed;
        let window = *lock(&self.window);
        let secs = window.map_or(0.0, |(from, to)| {
            let end = if interrupted { Instant::now().min(to) } else { to };
            end.saturating_duration_since(from).as_secs_f64()
        });
        let lag_p90 = lock(&self.lag).value_at_quantile(0.9);
        Step {
            rate,
            achieved: if secs > 0.0 { self.answered_in_window.load(Ordering::Relaxed) as f64 / secs } else { 0.0 },
            p50_ms: q(0.5),
            p99_ms: q(0.99),
            p999_ms: q(0.999),
            errors: if requests > 0 { failed as f64 / requests as f64 } else { 0.0 },
            requests,
            saturated: self.saturated.load(Ordering::Relaxed),
            generator_behind: lag_p90 > MAX_LAG.as_micros() as u64,
            interrupted,
        }
    }
}

/// Runs one step: sends `plan.rate` requests a second for `warmup + measure`, then waits for
/// every answer (or its timeout). `limit` bounds requests in flight: when it binds, the
/// schedule slips, late requests are sent late, and the step is marked saturated.
pub async fn step(
    client: &HttpClient,
    target: &Endpoint,
    plan: Plan,
    limit: Option<&Arc<Semaphore>>,
    rec: &Arc<Recorder>,
) {
    let rate = u128::from(plan.rate.max(1));
    let start = Instant::now() + Duration::from_millis(1);
    let from = start + plan.warmup;
    let to = from + plan.measure;
    *lock(&rec.window) = Some((from, to));
    let total = (plan.warmup + plan.measure).as_nanos();
    let count = total * rate / 1_000_000_000;
    // Every request task holds a sender; when the last one is gone, the step is over.
    let (done, mut all_done) = mpsc::channel::<()>(1);
    for i in 0..count {
        let due = start + Duration::from_nanos(u64::try_from(i * 1_000_000_000 / rate).unwrap_or(u64::MAX));
        if Instant::now() < due {
            tokio::time::sleep_until(due).await;
        }
        let measured = due >= from;
        let mut waited = false;
        let permit = match limit {
            None => None,
            Some(sem) => match sem.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    waited = true;
                    if measured {
                        rec.saturated.store(true, Ordering::Relaxed);
                    }
                    sem.clone().acquire_owned().await.ok()
                }
            },
        };
        let (client, rec, done) = (client.clone(), rec.clone(), done.clone());
        let mut req = Request::new(Full::new(target.body.clone()));
        *req.method_mut() = target.method.clone();
        *req.uri_mut() = target.uri.clone();
        req.headers_mut().clone_from(&target.headers);
        let deadline = due + plan.timeout;
        tokio::spawn(async move {
            let _done = done;
            let _permit = permit;
            if measured && !waited {
                let lag = Instant::now().saturating_duration_since(due).as_micros();
                lock(&rec.lag).saturating_record(u64::try_from(lag).unwrap_or(u64::MAX));
            }
            let answer = tokio::time::timeout_at(deadline, async {
                let resp = client.request(req).await.ok()?;
                let status = resp.status();
                resp.into_body().collect().await.ok()?;
                Some(status)
            })
            .await;
            let now = Instant::now();
            let status = answer.ok().flatten();
            if status.is_some() {
                rec.answered(now, (from, to));
            }
            if measured {
                rec.record(due, now, status.is_some_and(|s| s.as_u16() < 400));
            }
        });
    }
    drop(done);
    let _ = all_done.recv().await;
}
