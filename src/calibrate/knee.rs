//! The knee of a step table and the limits it suggests: pure functions of the measured steps,
//! so the seed's own table can be replayed in a unit test.
//!
//! A step is good when the server kept up (achieved ≥ [`KEPT_UP`] × offered) and the SLO
//! held (p99 and error rate). The knee is the interval from the last good step to the first
//! bad one; a step where the generator itself fell behind ends the search without a verdict.

use serde::Serialize;

/// A step whose achieved rate is below this share of the offered one did not keep up.
pub const KEPT_UP: f64 = 0.95;

/// Without `--slo-p99`, the p99 target is the first step's p99 times this …
pub const RELATIVE_P99: f64 = 1.5;
/// … or the first step's p99 plus this many ms, whichever is larger (so a 1 ms server is not
/// declared broken by 1 ms of jitter).
pub const RELATIVE_P99_SLACK_MS: f64 = 10.0;

/// The cluster-wide limit keeps this share of the instances' total, room for one to die.
pub const CLUSTER_SHARE: f64 = 0.8;

/// One measured step: offered `rate` per second and what came of it.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Step {
    /// Offered (scheduled) requests per second.
    pub rate: u64,
    /// Answers (any status) completed per second of the measurement window.
    pub achieved: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    /// Share of measured requests that failed: status ≥ 400, transport error or timeout.
    pub errors: f64,
    /// Requests measured.
    pub requests: u64,
    /// `--concurrency-max` bound: requests were sent late (latency still counted from the
    /// scheduled time).
    pub saturated: bool,
    /// The generator could not send on time: this step says nothing about the server.
    pub generator_behind: bool,
    /// Cut short by Ctrl-C or the time bound: reported, not judged.
    pub interrupted: bool,
}

/// The service level a good step must meet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    /// p99 target in ms; `None` derives one from the first step (see [`RELATIVE_P99`]).
    pub p99_ms: Option<f64>,
    /// Largest error share (0.001 = 0.1 %).
    pub errors: f64,
}

/// Where the server stopped keeping up.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Knee {
    /// The highest rate below the first bad step that was good.
    pub last_good: Option<u64>,
    /// The first bad step's rate.
    pub first_bad: Option<u64>,
    /// Why the first bad step is bad, in words.
    pub reason: Option<String>,
    /// The p99 target the steps were judged against (ms).
    pub p99_target_ms: f64,
    /// The first step where the generator fell behind, when that ended the search.
    pub generator_limited_at: Option<u64>,
}

/// What to configure, from the knee (the seed's method).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Suggestion {
    /// Per-instance `rate`: a quarter of the way from the last good to the first bad step.
    pub rate: u64,
    /// `--instances`, when given.
    pub instances: Option<u64>,
    /// Cluster-wide `store: redis` rate: instances × rate × 0.8.
    pub cluster_rate: Option<u64>,
    /// Little's law: `rate` × the last good step's p99, rounded up.
    pub concurrency: u64,
    /// Leaky-bucket `max_delay`: the p99 budget left at the last good step (ms).
    pub max_delay_ms: u64,
}

/// Why `step` is bad against `slo` and `p99_target_ms`, or `None` when it is good.
fn fault(step: &Step, errors_max: f64, p99_target_ms: f64) -> Option<String> {
    let offered = step.rate as f64;
    if step.achieved < KEPT_UP * offered {
        return Some(format!("achieved {:.0}/s is below {:.0} % of {}/s", step.achieved, KEPT_UP * 100.0, step.rate));
    }
    if step.errors > errors_max {
        return Some(format!("errors {} above {}", percent(step.errors), percent(errors_max)));
    }
    if step.p99_ms > p99_target_ms {
        return Some(format!("p99 {} ms above {} ms", ms(step.p99_ms), ms(p99_target_ms)));
    }
    None
}

/// The p99 target: the SLO's, else derived from the first judged step.
pub fn p99_target(steps: &[Step], slo: &Slo) -> f64 {
    if let Some(t) = slo.p99_ms {
        return t;
    }
    let base = judged(steps).next().map_or(0.0, |s| s.p99_ms);
    (base * RELATIVE_P99).max(base + RELATIVE_P99_SLACK_MS)
}

/// Steps that count, in rising rate order.
fn judged(steps: &[Step]) -> impl Iterator<Item = &Step> {
    let mut v: Vec<&Step> = steps.iter().filter(|s| !s.interrupted && s.requests > 0).collect();
    v.sort_by_key(|s| s.rate);
    v.into_iter()
}

/// The knee of `steps` under `slo`.
pub fn find(steps: &[Step], slo: &Slo) -> Knee {
    let p99_target_ms = p99_target(steps, slo);
    let mut knee = Knee { p99_target_ms, ..Knee::default() };
    for s in judged(steps) {
        if s.generator_behind {
            knee.generator_limited_at = Some(s.rate);
            break;
        }
        match fault(s, slo.errors, p99_target_ms) {
            None => knee.last_good = Some(s.rate),
            Some(why) => {
                knee.first_bad = Some(s.rate);
                knee.reason = Some(why);
                break;
            }
        }
    }
    knee
}

/// Whether `step` is bad (for stopping a run early).
pub fn is_bad(step: &Step, steps: &[Step], slo: &Slo) -> bool {
    !step.generator_behind && fault(step, slo.errors, p99_target(steps, slo)).is_some()
}

/// The seed's suggestion from a knee with both ends; `None` when the run did not bracket it.
pub fn suggest(steps: &[Step], knee: &Knee, instances: Option<u64>) -> Option<Suggestion> {
    let (good, bad) = (knee.last_good?, knee.first_bad?);
    let at_good = steps.iter().find(|s| s.rate == good && !s.interrupted)?;
    let rate = good + (bad - good) / 4;
    let concurrency = ((rate as f64) * at_good.p99_ms / 1000.0).ceil().max(1.0) as u64;
    let budget = (knee.p99_target_ms - at_good.p99_ms).max(0.0);
    let cluster_rate = instances.map(|n| ((n * rate) as f64 * CLUSTER_SHARE).floor() as u64);
    Some(Suggestion { rate, instances, cluster_rate, concurrency, max_delay_ms: budget.floor() as u64 })
}

/// `0.018` → `1.8 %`.
pub fn percent(share: f64) -> String {
    let p = share * 100.0;
    if p == 0.0 {
        "0 %".to_owned()
    } else if p < 0.1 {
        format!("{p:.2} %")
    } else {
        format!("{p:.1} %")
    }
}

/// Milliseconds for a table: whole above 10, one decimal below.
pub fn ms(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(rate: u64, p99_ms: f64, errors: f64) -> Step {
        Step {
            rate,
            achieved: rate as f64 * (1.0 - errors / 2.0),
            p50_ms: p99_ms / 2.0,
            p99_ms,
            p999_ms: p99_ms * 1.5,
            errors,
            requests: rate * 10,
            ..Step::default()
        }
    }

    /// The seed's table: a read API on an 8-core box.
    fn seed() -> Vec<Step> {
        vec![
            step(400, 48.0, 0.0),
            step(800, 61.0, 0.0),
            step(1000, 95.0, 0.0002),
            step(1200, 410.0, 0.018),
            step(1500, 1900.0, 0.12),
        ]
    }

    const DEFAULT: Slo = Slo { p99_ms: None, errors: 0.001 };

    #[test]
    fn the_seed_table_has_its_knee_between_800_and_1000_and_suggests_850() {
        let steps = seed();
        let knee = find(&steps, &DEFAULT);
        assert_eq!((knee.last_good, knee.first_bad), (Some(800), Some(1000)));
        // 48 ms × 1.5 = 72 ms: 95 ms at 1000/s is past it, though its errors (0.02 %) are not.
        assert_eq!(knee.p99_target_ms, 72.0);
        assert_eq!(knee.reason.as_deref(), Some("p99 95 ms above 72 ms"));
        // While the run goes: the first step alone sets its own target, and is good.
        assert!(!is_bad(&steps[0], &steps[..1], &DEFAULT));
        assert!(is_bad(&steps[2], &steps[..3], &DEFAULT));
        let s = suggest(&steps, &knee, Some(4)).unwrap();
        assert_eq!(s.rate, 850);
        // 4 × 850 × 0.8
        assert_eq!(s.cluster_rate, Some(2720));
        // 850/s × 61 ms = 51.85 in flight
        assert_eq!(s.concurrency, 52);
        // 72 ms target − 61 ms at the last good step
        assert_eq!(s.max_delay_ms, 11);
    }

    #[test]
    fn an_explicit_slo_moves_the_knee() {
        let steps = seed();
        // A 100 ms p99 with 0.01 % errors: 1000/s fails on errors, not latency.
        let knee = find(&steps, &Slo { p99_ms: Some(100.0), errors: 0.0001 });
        assert_eq!((knee.last_good, knee.first_bad), (Some(800), Some(1000)));
        assert_eq!(knee.reason.as_deref(), Some("errors 0.02 % above 0.01 %"));
        // A 500 ms p99 with 2 % errors: good up to 1200/s.
        let knee = find(&steps, &Slo { p99_ms: Some(500.0), errors: 0.02 });
        assert_eq!((knee.last_good, knee.first_bad), (Some(1200), Some(1500)));
        let s = suggest(&steps, &knee, None).unwrap();
        assert_eq!((s.rate, s.cluster_rate, s.max_delay_ms), (1275, None, 90));
    }

    #[test]
    fn a_server_that_does_not_keep_up_is_bad_even_with_fast_answers() {
        let mut steps = seed();
        steps[1].achieved = 700.0;
        let knee = find(&steps, &DEFAULT);
        assert_eq!((knee.last_good, knee.first_bad), (Some(400), Some(800)));
        assert!(knee.reason.unwrap().starts_with("achieved 700/s"));
    }

    #[test]
    fn a_generator_that_falls_behind_ends_the_search_without_a_knee() {
        let mut steps = seed();
        steps[2].generator_behind = true;
        let knee = find(&steps, &DEFAULT);
        assert_eq!((knee.last_good, knee.first_bad, knee.generator_limited_at), (Some(800), None, Some(1000)));
        assert_eq!(suggest(&steps, &knee, None), None);
        assert!(!is_bad(&steps[2], &steps, &DEFAULT));
    }

    #[test]
    fn interrupted_steps_and_order_do_not_matter() {
        let mut steps = seed();
        steps.reverse();
        steps.push(Step { rate: 900, interrupted: true, requests: 5, p99_ms: 5000.0, ..Step::default() });
        let knee = find(&steps, &DEFAULT);
        assert_eq!((knee.last_good, knee.first_bad), (Some(800), Some(1000)));
    }

    #[test]
    fn no_bracket_no_suggestion() {
        // Bad from the first step: nothing good to start from.
        let steps = vec![step(100, 10.0, 0.5)];
        let knee = find(&steps, &DEFAULT);
        assert_eq!((knee.last_good, knee.first_bad), (None, Some(100)));
        assert_eq!(suggest(&steps, &knee, None), None);
        // Good all the way: the run never found the knee.
        let steps = vec![step(100, 10.0, 0.0), step(200, 11.0, 0.0)];
        let knee = find(&steps, &DEFAULT);
        assert_eq!((knee.last_good, knee.first_bad), (Some(200), None));
        assert_eq!(suggest(&steps, &knee, None), None);
    }

    #[test]
    fn a_fast_server_gets_absolute_slack() {
        // 1 ms p99 at first: the target is 11 ms, not 1.5 ms.
        let steps = vec![step(1000, 1.0, 0.0), step(2000, 3.0, 0.0), step(3000, 30.0, 0.0)];
        let knee = find(&steps, &DEFAULT);
        assert_eq!(knee.p99_target_ms, 11.0);
        assert_eq!((knee.last_good, knee.first_bad), (Some(2000), Some(3000)));
        let s = suggest(&steps, &knee, Some(1)).unwrap();
        // 2000 + 1000/4; one instance still keeps 80 %.
        assert_eq!((s.rate, s.cluster_rate, s.concurrency, s.max_delay_ms), (2250, Some(1800), 7, 8));
    }

    #[test]
    fn percent_and_ms_read_like_the_seed() {
        assert_eq!(percent(0.0002), "0.02 %");
        assert_eq!(percent(0.018), "1.8 %");
        assert_eq!(percent(0.12), "12.0 %");
        assert_eq!(percent(0.0), "0 %");
        assert_eq!(ms(1900.0), "1900");
        assert_eq!(ms(2.25), "2.2");
    }
}
