//! The chart of a replay: requests admitted and throttled in each second of the log. SVG
//! only, as `calibrate`'s (a PNG needs system font libraries).

use plotters::prelude::*;

use super::Series;

const WIDTH: u32 = 900;
const HEIGHT: u32 = 420;

/// The chart as an SVG document; `title` names the config.
///
/// # Errors
/// Drawing failed (plotters' error, as text).
pub fn svg(series: &Series, title: &str) -> Result<String, String> {
    let mut out = String::new();
    draw(series, title, SVGBackend::with_string(&mut out, (WIDTH, HEIGHT)).into_drawing_area())
        .map_err(|e| format!("chart: {e}"))?;
    Ok(out)
}

fn draw<DB: DrawingBackend>(
    s: &Series,
    title: &str,
    root: DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let first = s.keys().next().copied().unwrap_or(0);
    let last = s.keys().next_back().copied().unwrap_or(0).max(first + 1);
    let top = s.values().map(|(a, t)| a + t).max().unwrap_or(1).max(1) as f64 * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("tollgate replay {title}"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..(last - first) as f64, 0f64..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_desc("seconds into the log")
        .y_desc("requests per second")
        .draw()
        .map_err(err)?;
    for (name, color, pick) in [
        ("admitted", BLUE, (|v: &(u64, u64)| v.0) as fn(&(u64, u64)) -> u64),
        ("throttled (429)", RED, (|v: &(u64, u64)| v.1) as fn(&(u64, u64)) -> u64),
    ] {
        let pts: Vec<(f64, f64)> = s.iter().map(|(sec, v)| ((sec - first) as f64, pick(v) as f64)).collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
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
    #[test]
    fn the_chart_is_an_svg_with_both_series() {
        let s = [(100, (5, 0)), (101, (3, 4)), (103, (1, 9))].into_iter().collect();
        let svg = super::svg(&s, "candidate.yaml").unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("admitted") && svg.contains("throttled (429)"));
    }
}
