//! One mode's figures, the table of several, and their chart.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::client::{Policy, Profile};

/// What the clients counted.
pub struct Totals {
    pub intended: u64,
    pub attempts: u64,
    pub ok: u64,
    pub throttled: u64,
    pub failed: u64,
    pub timed_out: u64,
    pub generator_late: u64,
    pub answers: Vec<(String, u64)>,
    pub intended_series: Vec<u64>,
    pub attempts_series: Vec<u64>,
    pub goodput_series: Vec<u64>,
}

/// One mode's run.
#[derive(Serialize, Deserialize)]
pub struct Mode {
    pub mode: String,
    pub describe: String,
    /// The upstream's capacity (workers / service time), requests a second.
    pub capacity: f64,
    pub slowdown: Slowdown,
    pub profile: Profile,
    pub app_tries: u32,
    pub sdk_tries: u32,
    pub timeout_ms: u64,
    pub deadline_ms: u64,
    pub honour_retry_after: bool,
    /// Intended requests (the schedule's), and per second of intended load.
    pub intended: u64,
    pub intended_per_s: f64,
    /// Requests that reached the upstream over the whole run (the deadline's tail included),
    /// per second of intended load.
    pub upstream_arrivals: u64,
    pub offered_per_s: f64,
    /// upstream arrivals ÷ intended requests.
    pub amplification: f64,
    /// The highest second's upstream arrivals ÷ that second's intended requests (seconds with
    /// intended load only).
    pub peak_amplification: f64,
    /// Intended requests answered 2xx before their deadline, and their share.
    pub goodput: u64,
    pub goodput_share: f64,
    /// Tries the clients made, and per intended request.
    pub attempts: u64,
    pub attempts_per_intended: f64,
    pub throttled: u64,
    pub failed: u64,
    pub timed_out: u64,
    /// Work the upstream finished (whether anyone still waited or not).
    pub upstream_completions: u64,
    /// Intended requests sent more than 10 ms after their due time (the generator fell behind).
    pub generator_late: u64,
    /// The clients' tries by what they got (status, no connection, timed out).
    pub answers: std::collections::BTreeMap<String, u64>,
    pub series: SeriesOut,
}

/// The upstream's slowdown: its service time times `factor` from `at_s` for `for_s`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Slowdown {
    pub at_s: f64,
    pub for_s: f64,
    pub factor: f64,
}

impl Slowdown {
    /// The capacity in second `s` (its middle).
    fn capacity(&self, capacity: f64, s: f64) -> f64 {
        if s >= self.at_s && s < self.at_s + self.for_s && self.factor > 0.0 {
            capacity / self.factor
        } else {
            capacity
        }
    }
}

/// Per second since the start.
#[derive(Serialize, Deserialize)]
pub struct SeriesOut {
    pub intended: Vec<u64>,
    pub attempts: Vec<u64>,
    pub upstream_arrivals: Vec<u64>,
    pub upstream_completions: Vec<u64>,
    pub goodput: Vec<u64>,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl Mode {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mode: String,
        describe: String,
        capacity: f64,
        slowdown: Slowdown,
        profile: Profile,
        policy: Policy,
        t: Totals,
        arrivals: Vec<u64>,
        completions: Vec<u64>,
    ) -> Self {
        let upstream_arrivals: u64 = arrivals.iter().sum();
        let peak_amplification = t
            .intended_series
            .iter()
            .zip(&arrivals)
            .filter(|(i, _)| **i > 0)
            .map(|(i, a)| ratio(*a, *i))
            .fold(0.0, f64::max);
        Mode {
            mode,
            describe,
            capacity,
            slowdown,
            profile,
            app_tries: policy.app_tries,
            sdk_tries: policy.sdk_tries,
            timeout_ms: policy.timeout.as_millis() as u64,
            deadline_ms: policy.deadline.as_millis() as u64,
            honour_retry_after: policy.honour_retry_after,
            intended: t.intended,
            intended_per_s: t.intended as f64 / profile.duration_s,
            upstream_arrivals,
            offered_per_s: upstream_arrivals as f64 / profile.duration_s,
            amplification: ratio(upstream_arrivals, t.intended),
            peak_amplification,
            goodput: t.ok,
            goodput_share: ratio(t.ok, t.intended),
            attempts: t.attempts,
            attempts_per_intended: ratio(t.attempts, t.intended),
            throttled: t.throttled,
            failed: t.failed,
            timed_out: t.timed_out,
            upstream_completions: completions.iter().sum(),
            generator_late: t.generator_late,
            answers: t.answers.into_iter().filter(|(_, n)| *n > 0).collect(),
            series: SeriesOut {
                intended: t.intended_series,
                attempts: t.attempts_series,
                upstream_arrivals: arrivals,
                upstream_completions: completions,
                goodput: t.goodput_series,
            },
        }
    }
}

/// A mode's figures in one line.
pub fn line(m: &Mode) -> String {
    format!(
        "{}: intended {:.0}/s, upstream offered {:.0}/s, amplification {:.2}× (peak second {:.1}×), goodput {:.1} %, \
         client attempts {:.2} per intended request ({} throttled, {} failed, {} timed out), generator late {}",
        m.mode,
        m.intended_per_s,
        m.offered_per_s,
        m.amplification,
        m.peak_amplification,
        m.goodput_share * 100.0,
        m.attempts_per_intended,
        m.throttled,
        m.failed,
        m.timed_out,
        m.generator_late
    )
}

/// The markdown table of `modes`.
pub fn table(modes: &[Mode]) -> String {
    let mut s = String::new();
    s.push_str(
        "| mode | intended/s | upstream offered/s | amplification | peak second | goodput | client attempts per request | throttled | timed out | failed |\n\
         |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
    );
    for m in modes {
        let _ = writeln!(
            s,
            "| {} | {:.0} | {:.0} | **{:.2}×** | {:.1}× | {:.1} % | {:.2} | {} | {} | {} |",
            m.mode,
            m.intended_per_s,
            m.offered_per_s,
            m.amplification,
            m.peak_amplification,
            m.goodput_share * 100.0,
            m.attempts_per_intended,
            m.throttled,
            m.timed_out,
            m.failed
        );
    }
    s
}

/// Writes report.md, report.json and chart.svg into `dir`.
///
/// # Errors
/// Writing failed, or the chart could not be drawn.
pub fn write(dir: &Path, title: &str, modes: &[Mode]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = format!("# {title}\n\n");
    if let Some(m) = modes.first() {
        let p = &m.profile;
        let spike = if p.spike == p.base {
            String::new()
        } else {
            format!(" with {:.0}/s from {:.0} s for {:.0} s", p.spike, p.spike_at_s, p.spike_for_s)
        };
        let _ = writeln!(
            md,
            "Upstream capacity {:.0}/s; intended {:.0}/s{spike}, {:.0} s in all; clients: {} app tries × {} SDK tries, \
             {} ms per try, {} ms deadline, Retry-After {}.\n",
            m.capacity,
            p.base,
            p.duration_s,
            m.app_tries,
            m.sdk_tries,
            m.timeout_ms,
            m.deadline_ms,
            if m.honour_retry_after { "honoured by the SDK" } else { "ignored" }
        );
        if m.slowdown.factor != 1.0 && m.slowdown.for_s > 0.0 {
            let _ = writeln!(
                md,
                "The upstream's service time is {}× from {:.0} s for {:.0} s (capacity {:.0}/s then).\n",
                m.slowdown.factor,
                m.slowdown.at_s,
                m.slowdown.for_s,
                m.capacity / m.slowdown.factor
            );
        }
    }
    md.push_str(&table(modes));
    md.push('\n');
    for m in modes {
        let got: Vec<String> = m.answers.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(md, "- {}: {}. Tries got: {}.", m.mode, m.describe, got.join(", "));
    }
    std::fs::write(dir.join("report.md"), md)?;
    std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(modes)?)?;
    std::fs::write(dir.join("chart.svg"), svg(title, modes)?)?;
    print!("{}", table(modes));
    Ok(())
}

const WIDTH: u32 = 900;
const HEIGHT: u32 = 640;
const COLORS: [RGBColor; 4] =
    [RGBColor(214, 39, 40), RGBColor(255, 127, 14), RGBColor(31, 119, 180), RGBColor(44, 160, 44)];

/// Upstream arrivals a second (top) and goodput a second (bottom) of every mode, over time,
/// with the intended load and the upstream's capacity.
///
/// # Errors
/// Drawing failed (plotters' error, as text).
pub fn svg(title: &str, modes: &[Mode]) -> anyhow::Result<String> {
    let mut out = String::new();
    draw(title, modes, SVGBackend::with_string(&mut out, (WIDTH, HEIGHT)).into_drawing_area())
        .map_err(|e| anyhow::anyhow!("chart: {e}"))?;
    Ok(out)
}

fn draw<DB: DrawingBackend>(
    title: &str,
    modes: &[Mode],
    root: DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let (top, bottom) = root.split_vertically(HEIGHT * 3 / 5);
    let secs = modes.iter().map(|m| m.series.upstream_arrivals.len()).max().unwrap_or(1) as f64;
    let capacity = modes.first().map_or(0.0, |m| m.capacity);
    let intended: Vec<u64> = modes.first().map(|m| m.series.intended.clone()).unwrap_or_default();
    let max_arr = modes
        .iter()
        .flat_map(|m| m.series.upstream_arrivals.iter().chain(&m.series.intended))
        .copied()
        .max()
        .unwrap_or(1) as f64;
    // A logarithmic axis: a storm is ten times the load, a protected run stays at capacity.
    let floor = 10.0;
    let pts = |v: &[u64]| -> Vec<(f64, f64)> {
        v.iter().enumerate().map(|(i, n)| (i as f64 + 0.5, (*n as f64).max(floor))).collect()
    };
    let lin =
        |v: &[u64]| -> Vec<(f64, f64)> { v.iter().enumerate().map(|(i, n)| (i as f64 + 0.5, *n as f64)).collect() };

    let mut chart = ChartBuilder::on(&top)
        .caption(format!("{title}: requests reaching the upstream each second"), ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..secs, (floor..max_arr.max(capacity * 2.0).max(floor * 10.0) * 1.5).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_desc("seconds")
        .y_desc("requests/s (log scale)")
        .draw()
        .map_err(err)?;
    let slowdown = modes.first().map_or(Slowdown { at_s: 0.0, for_s: 0.0, factor: 1.0 }, |m| m.slowdown);
    let cap_line: Vec<(f64, f64)> = (0..secs as usize)
        .flat_map(|s| {
            let c = slowdown.capacity(capacity, s as f64 + 0.5);
            [(s as f64, c), (s as f64 + 1.0, c)]
        })
        .collect();
    chart
        .draw_series(LineSeries::new(cap_line, BLACK.stroke_width(1)))
        .map_err(err)?
        .label(format!("upstream capacity ({capacity:.0}/s)"))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.stroke_width(1)));
    chart
        .draw_series(LineSeries::new(pts(&intended), RGBColor(120, 120, 120).stroke_width(3)))
        .map_err(err)?
        .label("intended (scheduled)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RGBColor(120, 120, 120).stroke_width(3)));
    for (i, m) in modes.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts(&m.series.upstream_arrivals), c.stroke_width(2)))
            .map_err(err)?
            .label(format!("{}: {:.2}×", m.mode, m.amplification))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;

    let max_good = modes.iter().flat_map(|m| m.series.goodput.iter()).copied().max().unwrap_or(1) as f64 * 1.15;
    let mut chart = ChartBuilder::on(&bottom)
        .caption("Intended requests answered in time (goodput) each second", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..secs, 0f64..max_good.max(capacity * 1.2))
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_desc("seconds")
        .y_desc("requests/s")
        .draw()
        .map_err(err)?;
    for (i, m) in modes.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(lin(&m.series.goodput), c.stroke_width(2)))
            .map_err(err)?
            .label(format!("{}: {:.0} %", m.mode, m.goodput_share * 100.0))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn mode(name: &str, intended: Vec<u64>, arrivals: Vec<u64>, ok: u64) -> Mode {
        let policy = Policy {
            app_tries: 3,
            sdk_tries: 3,
            timeout: Duration::from_secs(1),
            deadline: Duration::from_secs(10),
            honour_retry_after: true,
        };
        let profile = Profile { base: 100.0, spike: 150.0, spike_at_s: 1.0, spike_for_s: 1.0, duration_s: 3.0 };
        let n: u64 = intended.iter().sum();
        let totals = Totals {
            intended: n,
            attempts: 2 * n,
            ok,
            throttled: n,
            failed: 0,
            timed_out: 0,
            generator_late: 0,
            answers: vec![("2xx".to_owned(), ok), ("503".to_owned(), 0)],
            intended_series: intended.clone(),
            attempts_series: intended.iter().map(|i| 2 * i).collect(),
            goodput_series: intended,
        };
        let slow = Slowdown { at_s: 1.0, for_s: 1.0, factor: 2.0 };
        Mode::new(name.to_owned(), String::new(), 120.0, slow, profile, policy, totals, arrivals.clone(), arrivals)
    }

    #[test]
    fn amplification_is_every_arrival_over_the_intended_requests() {
        // The tail (seconds without intended load) counts in the total, not in the peak second.
        let m = mode("plain", vec![100, 150, 100, 0], vec![100, 300, 200, 50], 280);
        assert_eq!((m.intended, m.upstream_arrivals), (350, 650));
        assert!((m.amplification - 650.0 / 350.0).abs() < 1e-9);
        assert!((m.peak_amplification - 2.0).abs() < 1e-9);
        assert!((m.goodput_share - 0.8).abs() < 1e-9);
        assert!((m.attempts_per_intended - 2.0).abs() < 1e-9);
        assert_eq!(m.answers.keys().collect::<Vec<_>>(), ["2xx"], "kinds never seen are left out");
    }

    #[test]
    fn the_table_and_the_chart_name_every_mode() {
        let modes =
            [mode("plain", vec![100, 100], vec![300, 300], 50), mode("full", vec![100, 100], vec![90, 100], 190)];
        let t = table(&modes);
        assert!(t.contains("| plain | 67 | 200 | **3.00×** |"), "{t}");
        assert!(t.contains("| full | 67 | 63 | **0.95×** |"), "{t}");
        let svg = svg("spike", &modes).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for label in [
            "spike: requests reaching",
            "plain: 3.00×",
            "full: 0.95×",
            "plain: 25 %",
            "full: 95 %",
            "upstream capacity (120/s)",
            "intended (scheduled)",
        ] {
            assert!(svg.contains(label), "{label} missing");
        }
    }
}
