//! A run's report as people read it (the seed's table, the knee, the suggestion) and as files:
//! `report.json`, `chart.svg`, `suggestion.yaml`.

use std::fmt::Write;
use std::path::Path;

use super::knee::{ms, percent};
use super::Report;

/// The table with the knee marked, then the verdict and the suggestion.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    let target = if r.slo.p99_given { "" } else { " (derived from the first step)" };
    let _ = writeln!(
        out,
        "{} {}: open loop, {} ms steps after {} ms warm-up; good = achieved ≥ 95 % of offered, p99 ≤ {} ms{target}, errors ≤ {}\n",
        r.method,
        r.url,
        r.step_duration_ms,
        r.warmup_ms,
        ms(r.slo.p99_ms),
        percent(r.slo.errors)
    );
    let _ = writeln!(
        out,
        "{:>9} {:>10} {:>9} {:>9} {:>9} {:>8}",
        "rate", "achieved", "p50 ms", "p99 ms", "p99.9 ms", "errors"
    );
    for s in &r.steps {
        let mut notes = Vec::new();
        if Some(s.rate) == r.knee.last_good && r.knee.first_bad.is_some() {
            notes.push("last good");
        }
        if Some(s.rate) == r.knee.first_bad {
            notes.push("◀ knee: first bad");
        }
        if s.saturated {
            notes.push("saturated (--concurrency-max bound)");
        }
        if s.generator_behind {
            notes.push("GENERATOR BEHIND: not the server's limit");
        }
        if s.interrupted {
            notes.push("interrupted");
        }
        let row = format!(
            "{:>7}/s {:>8.0}/s {:>9} {:>9} {:>9} {:>8}  {}",
            s.rate,
            s.achieved,
            ms(s.p50_ms),
            ms(s.p99_ms),
            ms(s.p999_ms),
            percent(s.errors),
            notes.join(", ")
        );
        let _ = writeln!(out, "{}", row.trim_end());
    }
    out.push('\n');
    let k = &r.knee;
    match (k.last_good, k.first_bad) {
        (Some(g), Some(b)) => {
            let _ =
                writeln!(out, "knee: between {g}/s (last good) and {b}/s ({})", k.reason.as_deref().unwrap_or("bad"));
        }
        (None, Some(b)) => {
            let _ = writeln!(
                out,
                "knee: below {b}/s, the first step ({}); start lower (--from)",
                k.reason.as_deref().unwrap_or("bad")
            );
        }
        (Some(g), None) => match k.generator_limited_at {
            Some(at) => {
                let _ = writeln!(
                    out,
                    "no knee: good up to {g}/s, then the generator fell behind at {at}/s (give it more cores: --threads, or run it elsewhere)"
                );
            }
            None => {
                let _ = writeln!(out, "no knee: good up to {g}/s; go higher (--to)");
            }
        },
        (None, None) => {
            let _ = writeln!(out, "no knee: no step was judged");
        }
    }
    if let Some(why) = &r.stopped {
        let _ = writeln!(out, "stopped: {why}");
    }
    if let Some(s) = &r.suggestion {
        let _ = writeln!(out, "suggested: rate {}/s per instance (a quarter of the way up the knee)", s.rate);
        if let (Some(n), Some(c)) = (s.instances, s.cluster_rate) {
            let _ = writeln!(
                out,
                "           rate {c}/s for the cluster, store: redis ({n} instances × {}/s × 0.8)",
                s.rate
            );
        }
        let _ = writeln!(
            out,
            "           concurrency {} (Little's law: {}/s × p99 at the last good step)",
            s.concurrency, s.rate
        );
        let _ = writeln!(
            out,
            "           max_delay {}ms for a leaky bucket (p99 budget left at the last good step)",
            s.max_delay_ms
        );
    }
    out
}

/// The suggestion as a config `tollgate check` accepts, or `None` without a suggestion.
pub fn yaml(r: &Report) -> Option<String> {
    let s = r.suggestion.as_ref()?;
    let (good, bad) = (r.knee.last_good?, r.knee.first_bad?);
    let origin = origin(&r.url);
    let mut out = String::new();
    let _ = writeln!(out, "# tollgate calibrate {} {}", r.method, r.url);
    let _ = writeln!(
        out,
        "# knee between {good}/s (last good) and {bad}/s ({})",
        r.knee.reason.as_deref().unwrap_or("bad")
    );
    let _ = writeln!(
        out,
        "upstreams:\n  calibrated:\n    url: {origin}\nroutes:\n  - name: calibrated\n    upstream: calibrated"
    );
    let _ = writeln!(out, "    # Little's law: {}/s × the p99 at {good}/s", s.rate);
    let _ = writeln!(out, "    concurrency: {}", s.concurrency);
    let _ = writeln!(
        out,
        "    limits:\n      # a quarter of the way from {good}/s to {bad}/s; waits up to the p99 budget left"
    );
    let _ = writeln!(
        out,
        "      - {{ name: per-instance, algorithm: leaky_bucket, rate: {}/s, max_delay: {}ms }}",
        s.rate, s.max_delay_ms
    );
    if let (Some(n), Some(c)) = (s.instances, s.cluster_rate) {
        let _ = writeln!(out, "      # {n} instances × {}/s × 0.8: room for one to die", s.rate);
        let _ = writeln!(out, "      - {{ name: cluster, algorithm: token_bucket, rate: {c}/s, store: redis }}");
        let _ = writeln!(out, "redis:\n  url: redis://127.0.0.1:6379\n  instances: {n}");
    }
    Some(out)
}

/// `http://host:port/path?q` → `http://host:port`.
fn origin(url: &str) -> String {
    match url.parse::<http::Uri>() {
        Ok(u) => format!("http://{}", u.authority().map_or("127.0.0.1", |a| a.as_str())),
        Err(_) => url.to_owned(),
    }
}

/// Writes `report.json`, `chart.svg` and `suggestion.yaml` (when there is one) into `dir`.
///
/// # Errors
/// The directory or a file cannot be written, or the chart cannot be drawn.
pub fn write_dir(r: &Report, dir: &Path) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut written = Vec::new();
    let mut put = |name: &str, text: &str| -> Result<(), String> {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| format!("writing {}: {e}", p.display()))?;
        written.push(p.display().to_string());
        Ok(())
    };
    let json = serde_json::to_string_pretty(r).map_err(|e| e.to_string())?;
    put("report.json", &json)?;
    put("chart.svg", &super::chart::svg(r)?)?;
    if let Some(y) = yaml(r) {
        put("suggestion.yaml", &y)?;
    }
    Ok(written)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::knee::{self, Slo, Step};
    use super::super::{Report, SloReport};
    use super::*;

    pub(crate) fn seed_report(instances: Option<u64>) -> Report {
        let rows =
            [(400, 48.0, 0.0), (800, 61.0, 0.0), (1000, 95.0, 0.0002), (1200, 410.0, 0.018), (1500, 1900.0, 0.12)];
        let steps: Vec<Step> = rows
            .iter()
            .map(|&(rate, p99, errors)| Step {
                rate,
                achieved: rate as f64,
                p50_ms: p99 / 2.0,
                p99_ms: p99,
                p999_ms: p99 * 1.4,
                errors,
                requests: rate * 10,
                ..Step::default()
            })
            .collect();
        let slo = Slo { p99_ms: None, errors: 0.001 };
        let knee = knee::find(&steps, &slo);
        let suggestion = knee::suggest(&steps, &knee, instances);
        Report {
            url: "http://127.0.0.1:9000/items?id=1".into(),
            method: "GET".into(),
            step_duration_ms: 10_000,
            warmup_ms: 2_000,
            slo: SloReport { p99_ms: knee.p99_target_ms, p99_given: false, errors: 0.001 },
            steps,
            knee,
            suggestion,
            stopped: None,
        }
    }

    #[test]
    fn the_table_marks_the_knee_and_says_what_to_set() {
        let t = table(&seed_report(Some(4)));
        assert!(t.contains("   1000/s     1000/s"), "{t}");
        assert!(
            t.lines().any(|l| l.starts_with("   1000/s") && l.contains("knee: first bad") && l.contains("0.02 %")),
            "{t}"
        );
        assert!(t.lines().any(|l| l.starts_with("    800/s") && l.contains("last good")), "{t}");
        assert!(t.contains("knee: between 800/s (last good) and 1000/s (p99 95 ms above 72 ms)"), "{t}");
        assert!(t.contains("rate 850/s per instance") && t.contains("rate 2720/s for the cluster"), "{t}");
    }

    #[test]
    fn the_suggestion_is_a_config_that_check_accepts() {
        for instances in [None, Some(4)] {
            let y = yaml(&seed_report(instances)).unwrap();
            let config = crate::config::Config::from_yaml(Path::new("suggestion.yaml"), &y)
                .unwrap_or_else(|e| panic!("{e}\n{y}"));
            let route = &config.routes[0];
            assert_eq!(route.concurrency.as_ref().unwrap().max, 52);
            assert_eq!(route.limits.len(), if instances.is_some() { 2 } else { 1 });
            assert!(y.contains("url: http://127.0.0.1:9000\n"), "{y}");
            assert!(y.contains("rate: 850/s, max_delay: 11ms"), "{y}");
        }
    }

    #[test]
    fn the_json_report_has_the_documented_shape() {
        let v = serde_json::to_value(seed_report(None)).unwrap();
        let s = &v["steps"][2];
        for f in ["rate", "achieved", "p50_ms", "p99_ms", "p999_ms", "errors", "saturated"] {
            assert!(!s[f].is_null(), "{f} missing: {s}");
        }
        assert_eq!((v["knee"]["last_good"].as_u64(), v["knee"]["first_bad"].as_u64()), (Some(800), Some(1000)));
        assert_eq!(v["suggestion"]["rate"].as_u64(), Some(850));
    }
}
