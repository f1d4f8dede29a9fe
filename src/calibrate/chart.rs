//! The chart of a run: p50 and p99 (ms, left) and the error rate (%, right)
//! against the offered rate, the knee shaded, the p99 target drawn. SVG only: a PNG needs a
//! font engine, which plotters takes from system libraries (fontconfig/freetype).

use plotters::prelude::*;

use super::knee::Step;
use super::Report;

const WIDTH: u32 = 900;
const HEIGHT: u32 = 520;

/// The chart as an SVG document.
///
/// # Errors
/// Drawing failed (plotters' error, as text).
pub fn svg(r: &Report) -> Result<String, String> {
    let mut out = String::new();
    draw(r, SVGBackend::with_string(&mut out, (WIDTH, HEIGHT)).into_drawing_area())
        .map_err(|e| format!("chart: {e}"))?;
    Ok(out)
}

fn draw<DB: DrawingBackend>(r: &Report, root: DrawingArea<DB, plotters::coord::Shift>) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let steps: Vec<&Step> = r.steps.iter().filter(|s| s.requests > 0).collect();
    let top = steps.iter().map(|s| s.rate).max().unwrap_or(1) as f64;
    let bottom = steps.iter().map(|s| s.rate).min().unwrap_or(0) as f64;
    let pad = ((top - bottom) * 0.05).max(1.0);
    let (min_rate, max_rate) = ((bottom - pad).max(0.0), top + pad);
    let max_ms = steps.iter().map(|s| s.p99_ms.max(r.slo.p99_ms)).fold(1.0, f64::max) * 1.1;
    let min_ms = 0.0;
    let max_err = steps.iter().map(|s| s.errors * 100.0).fold(1.0, f64::max) * 1.1;
    let title = format!("tollgate calibrate {} {}", r.method, r.url);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .right_y_label_area_size(60)
        .build_cartesian_2d(min_rate..max_rate, min_ms..max_ms)
        .map_err(err)?
        .set_secondary_coord(min_rate..max_rate, 0f64..max_err);
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_desc("offered rate (requests/s)")
        .y_desc("latency (ms, from the scheduled send time)")
        .draw()
        .map_err(err)?;
    chart
        .configure_secondary_axes()
        .y_desc("errors (%)")
        .y_label_formatter(&|y| format!("{y:.1}"))
        .draw()
        .map_err(err)?;
    if let (Some(good), Some(bad)) = (r.knee.last_good, r.knee.first_bad) {
        let band = [(good as f64, min_ms), (bad as f64, max_ms)];
        chart
            .draw_series(std::iter::once(Rectangle::new(band, RGBColor(255, 200, 120).mix(0.35).filled())))
            .map_err(err)?
            .label(format!("knee {good}–{bad}/s"))
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], RGBColor(255, 200, 120).filled()));
    }
    chart
        .draw_series(LineSeries::new([(min_rate, r.slo.p99_ms), (max_rate, r.slo.p99_ms)], MAGENTA.stroke_width(1)))
        .map_err(err)?
        .label(format!("p99 target {:.0} ms", r.slo.p99_ms))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], MAGENTA.stroke_width(1)));
    for (name, color, pick) in [
        ("p50", BLUE, (|s: &Step| s.p50_ms) as fn(&Step) -> f64),
        ("p99", RED, (|s: &Step| s.p99_ms) as fn(&Step) -> f64),
    ] {
        let pts: Vec<(f64, f64)> = steps.iter().map(|s| (s.rate as f64, pick(s))).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled()))).map_err(err)?;
    }
    let errs: Vec<(f64, f64)> = steps.iter().map(|s| (s.rate as f64, s.errors * 100.0)).collect();
    chart
        .draw_secondary_series(LineSeries::new(errs, GREEN.stroke_width(2)))
        .map_err(err)?
        .label("errors %")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], GREEN.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_chart_is_an_svg_with_the_knee_and_both_percentiles() {
        let svg = super::svg(&super::super::report::tests::seed_report(None)).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for label in ["knee 800–1000/s", "p99 target 72 ms", "p50", "p99", "errors %"] {
            assert!(svg.contains(label), "{label} missing");
        }
    }
}
