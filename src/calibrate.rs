//! `tollgate calibrate`: load-test an HTTP endpoint step by step for the knee, then suggest
//! the limits that keep it below the knee (the seed's method, as a tool).
//!
//! - [`load`]: the open-loop generator (constant arrival rate, latency from the due time).
//! - [`knee`]: judging steps, the knee, the suggestion: pure math, unit-tested.
//! - [`report`]: the table, the JSON report, the YAML snippet `tollgate check` accepts.
//! - [`chart`]: p50/p99 and error rate against offered rate, knee marked (SVG).
//!
//! The run is bounded: a rate ceiling, a total duration, a per-request timeout, requests in
//! flight, and it stops after a few bad steps. A stop (Ctrl-C, the time bound) ends it at
//! once with what was measured.

pub mod chart;
pub mod knee;
pub mod load;
pub mod report;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method, Uri};
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::time::Instant;

pub use knee::{Knee, Slo, Step, Suggestion};
pub use load::Endpoint;

/// The highest offered rate a run accepts (requests per second).
pub const MAX_RATE: u64 = 1_000_000;

/// Why a run cannot start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
}

fn usage<T>(msg: impl Into<String>) -> Result<T, Error> {
    Err(Error::Usage(msg.into()))
}

/// Everything a run needs, validated.
#[derive(Debug, Clone)]
pub struct Options {
    pub target: Endpoint,
    /// Offered rates, rising.
    pub rates: Vec<u64>,
    pub warmup: Duration,
    pub step: Duration,
    pub timeout: Duration,
    /// Requests in flight at most.
    pub concurrency_max: usize,
    pub slo: Slo,
    pub instances: Option<u64>,
    /// The whole run, steps and drains, ends by this.
    pub max_duration: Duration,
    /// Stop after this many bad steps (the knee needs one; the chart likes a second).
    pub stop_after_bad: usize,
}

/// What a run measured and concluded (`--json`, `report.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub url: String,
    pub method: String,
    pub step_duration_ms: u64,
    pub warmup_ms: u64,
    pub slo: SloReport,
    pub steps: Vec<Step>,
    pub knee: Knee,
    pub suggestion: Option<Suggestion>,
    /// Why the run ended before its last step, if it did.
    pub stopped: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct SloReport {
    /// The p99 target the steps were judged against, and whether it was given or derived.
    pub p99_ms: f64,
    pub p99_given: bool,
    pub errors: f64,
}

/// `--from/--step/--to` as a list of rates.
///
/// # Errors
/// A zero step or start, `from > to`, or more than 1,000 steps.
pub fn stepped(from: u64, step: u64, to: u64) -> Result<Vec<u64>, Error> {
    if from == 0 || step == 0 {
        return usage("--from and --step must be at least 1");
    }
    if from > to {
        return usage(format!("--from {from} is above --to {to}"));
    }
    if (to - from) / step >= 1000 {
        return usage("more than 1000 steps; use a larger --step");
    }
    Ok((0..).map(|i| from + i * step).take_while(|r| *r <= to).collect())
}

/// `--rates 400,800,1000`.
///
/// # Errors
/// A value that is not a whole number ≥ 1.
pub fn listed(text: &str) -> Result<Vec<u64>, Error> {
    let mut v = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.parse::<u64>() {
            Ok(r) if r >= 1 => v.push(r),
            _ => {
                return usage(format!(
                    "--rates: `{part}` is not a rate; expected whole numbers ≥ 1 such as 400,800,1000"
                ))
            }
        }
    }
    if v.is_empty() {
        return usage("--rates is empty");
    }
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

/// `0.1%` (or `0.001`) as a share.
///
/// # Errors
/// Not a number, or outside 0–100 %.
pub fn share(text: &str) -> Result<f64, Error> {
    let t = text.trim();
    let (num, scale) = match t.strip_suffix('%') {
        Some(n) => (n.trim(), 100.0),
        None => (t, 1.0),
    };
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 && v / scale <= 1.0 => Ok(v / scale),
        _ => usage(format!("`{text}` is not an error share; expected a percentage such as 0.1% (or 0.001)")),
    }
}

/// The request to send: `-X`, `-H 'Name: value'`, `-d body`, like curl.
///
/// # Errors
/// A URL that is not `http://host[:port]/…`, a bad method or header.
pub fn target(url: &str, method: Option<&str>, headers: &[String], data: Option<&str>) -> Result<Endpoint, Error> {
    let uri: Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => return usage(format!("`{url}` is not a URL: {e}")),
    };
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => return usage(format!("`{other}://` is not supported; calibrate speaks plain http://")),
        None => return usage(format!("`{url}` has no scheme; expected http://host:port/path")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return usage(format!("`{url}` has no host"));
    }
    let default = if data.is_some() { "POST" } else { "GET" };
    let method = match Method::from_bytes(method.unwrap_or(default).as_bytes()) {
        Ok(m) => m,
        Err(_) => return usage(format!("`{}` is not an HTTP method", method.unwrap_or_default())),
    };
    let mut map = HeaderMap::new();
    for h in headers {
        let Some((name, value)) = h.split_once(':') else {
            return usage(format!("-H `{h}`: expected `Name: value`"));
        };
        let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(name.trim().as_bytes()), HeaderValue::from_str(value.trim()))
        else {
            return usage(format!("-H `{h}` is not a valid header"));
        };
        map.append(name, value);
    }
    Ok(Endpoint {
        uri,
        method,
        headers: map,
        body: data.map_or_else(Bytes::new, |d| Bytes::copy_from_slice(d.as_bytes())),
    })
}

impl Options {
    /// Checks the bounds: rates up to [`MAX_RATE`], and the planned steps within
    /// `max_duration`.
    ///
    /// # Errors
    /// A rate or a plan out of bounds.
    pub fn check(&self) -> Result<(), Error> {
        if let Some(r) = self.rates.iter().find(|r| **r > MAX_RATE) {
            return usage(format!("rate {r}/s is above the {MAX_RATE}/s calibrate sends at most"));
        }
        if self.step.is_zero() {
            return usage("--step-duration must be above 0");
        }
        if self.concurrency_max == 0 {
            return usage("--concurrency-max must be at least 1");
        }
        let planned = (self.warmup + self.step) * u32::try_from(self.rates.len()).unwrap_or(u32::MAX);
        if planned > self.max_duration {
            return usage(format!(
                "{} steps of {:?} (+{:?} warm-up) take {:?}, more than --max-duration {:?}",
                self.rates.len(),
                self.step,
                self.warmup,
                planned,
                self.max_duration
            ));
        }
        Ok(())
    }
}

/// Runs the steps in order until the last, `stop_after_bad` bad ones, the time bound or
/// `stop`; `progress` shows each step live.
pub async fn run(opts: &Options, progress: Option<&indicatif::ProgressBar>, stop: impl Future<Output = ()>) -> Report {
    let client = load::client(opts.concurrency_max);
    let limit = Arc::new(Semaphore::new(opts.concurrency_max.min(Semaphore::MAX_PERMITS)));
    let started = Instant::now();
    let deadline = started + opts.max_duration;
    let mut steps = Vec::new();
    let mut stopped = None;
    let mut bad = 0;
    tokio::pin!(stop);
    for (i, &rate) in opts.rates.iter().enumerate() {
        let plan = load::Plan { rate, warmup: opts.warmup, measure: opts.step, timeout: opts.timeout };
        let rec = match load::Recorder::new() {
            Ok(r) => Arc::new(r),
            Err(e) => {
                stopped = Some(format!("cannot record latencies: {e}"));
                break;
            }
        };
        let run = load::step(&client, &opts.target, plan, Some(&limit), &rec);
        tokio::pin!(run);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let cut = loop {
            tokio::select! {
                () = &mut run => break None,
                () = &mut stop => break Some("interrupted"),
                () = tokio::time::sleep_until(deadline) => break Some("--max-duration reached"),
                _ = tick.tick() => if let Some(bar) = progress {
                    let live = rec.live();
                    bar.set_message(format!(
                        "step {}/{}: offered {rate}/s, achieved {:.0}/s, p99 {} ms, errors {}",
                        i + 1,
                        opts.rates.len(),
                        live.achieved,
                        knee::ms(live.p99_ms),
                        knee::percent(live.errors)
                    ));
                },
            }
        };
        let step = rec.step(rate, cut.is_some());
        if let Some(why) = cut {
            if step.requests > 0 {
                steps.push(step);
            }
            stopped = Some(why.to_owned());
            break;
        }
        steps.push(step);
        // Past the knee, a step where the generator fell behind counts too: the server
        // already broke, and more load only measures the generator.
        if steps.last().is_some_and(|s| knee::is_bad(s, &steps, &opts.slo) || (bad > 0 && s.generator_behind)) {
            bad += 1;
        }
        if bad >= opts.stop_after_bad && i + 1 < opts.rates.len() {
            stopped = Some(format!("{bad} bad step(s): past the knee"));
            break;
        }
    }
    let knee = knee::find(&steps, &opts.slo);
    let suggestion = knee::suggest(&steps, &knee, opts.instances);
    Report {
        url: opts.target.uri.to_string(),
        method: opts.target.method.to_string(),
        step_duration_ms: opts.step.as_millis() as u64,
        warmup_ms: opts.warmup.as_millis() as u64,
        slo: SloReport { p99_ms: knee.p99_target_ms, p99_given: opts.slo.p99_ms.is_some(), errors: opts.slo.errors },
        steps,
        knee,
        suggestion,
        stopped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_from_steps_and_lists() {
        assert_eq!(stepped(100, 100, 450).unwrap(), vec![100, 200, 300, 400]);
        assert!(stepped(0, 100, 100).is_err());
        assert!(stepped(100, 1, 5000).is_err());
        assert_eq!(listed("1000, 400,800,400").unwrap(), vec![400, 800, 1000]);
        assert!(listed("400,fast").is_err());
        assert!(listed("0").is_err());
    }

    #[test]
    fn shares_take_percent_or_fraction() {
        assert_eq!(share("0.1%").unwrap(), 0.001);
        assert_eq!(share("0.02").unwrap(), 0.02);
        assert!(share("150%").is_err());
        assert!(share("-1%").is_err());
        assert!(share("lots").is_err());
    }

    #[test]
    fn targets_are_http_with_curl_style_parts() {
        let t = target("http://127.0.0.1:8080/x", None, &["X-Key: a".into()], Some("{}")).unwrap();
        assert_eq!((t.method.as_str(), t.headers["x-key"].to_str().unwrap(), &t.body[..]), ("POST", "a", &b"{}"[..]));
        assert!(target("https://a/", None, &[], None).is_err());
        assert!(target("/path", None, &[], None).is_err());
        assert!(target("http://a/", None, &["nocolon".into()], None).is_err());
        assert!(target("http://a/", Some("G ET"), &[], None).is_err());
    }

    #[test]
    fn the_plan_must_fit_its_bounds() {
        let opts = Options {
            target: target("http://a/", None, &[], None).unwrap(),
            rates: vec![100, 200],
            warmup: Duration::from_secs(2),
            step: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            concurrency_max: 100,
            slo: Slo { p99_ms: None, errors: 0.001 },
            instances: None,
            max_duration: Duration::from_secs(24),
            stop_after_bad: 2,
        };
        assert!(opts.check().is_ok());
        assert!(Options { max_duration: Duration::from_secs(23), ..opts.clone() }.check().is_err());
        assert!(Options { rates: vec![MAX_RATE + 1], ..opts.clone() }.check().is_err());
    }
}
