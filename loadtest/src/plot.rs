//! The `--plot` output: the latency percentile curve of a run as an SVG (plotters' SVG backend), with
//! the percentile on a logarithmic "nines" axis (0%, 90%, 99%, 99.9%, ... equally spaced) and the
//! latency in microseconds.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use hdrhistogram::Histogram;
use plotters::prelude::*;

/// Most nines drawn (99.9999%): beyond that the tail is a handful of samples.
const NINES_MAX: f64 = 6.0;

/// `x` nines as a percentile label: 0 → "0%", 1 → "90%", 3 → "99.9%".
fn percentile_label(x: f64) -> String {
    let p = 100.0 * (1.0 - 10f64.powf(-x));
    if x < 1.0 {
        format!("{p:.0}%")
    } else {
        let decimals = (x.round() as usize).saturating_sub(2);
        format!("{p:.decimals$}%")
    }
}

/// The points of the curve: (nines, latency in µs), up to the last whole nine the sample count
/// supports (10 000 samples: 99.99%).
pub fn curve(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    let nines = (h.len() as f64).log10().floor().clamp(1.0, NINES_MAX);
    let steps = (nines * 100.0) as usize;
    (0..=steps)
        .map(|i| {
            let x = nines * i as f64 / steps as f64;
            let q = 1.0 - 10f64.powf(-x);
            (x, h.value_at_quantile(q) as f64 / 1000.0)
        })
        .collect()
}

/// Draw the percentile curve of `h` (nanoseconds) to `path`.
pub fn write_svg(path: &Path, h: &Histogram<u64>, title: &str) -> Result<()> {
    if h.is_empty() {
        bail!("no latencies recorded: nothing to plot");
    }
    let points = curve(h);
    let x_max = points.last().map_or(1.0, |p| p.0);
    let y_max = points.iter().map(|p| p.1).fold(1.0, f64::max) * 1.05;
    let root = SVGBackend::new(path, (1000, 600)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("plot: {e}");
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_labels(x_max as usize + 1)
        .x_desc("percentile")
        .y_desc("latency (µs)")
        .x_label_formatter(&|x| percentile_label(*x))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(points, &BLUE))
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(percentile_label(0.0), "0%");
        assert_eq!(percentile_label(2f64.log10()), "50%");
        assert_eq!(percentile_label(1.0), "90%");
        assert_eq!(percentile_label(2.0), "99%");
        assert_eq!(percentile_label(3.0), "99.9%");
        assert_eq!(percentile_label(5.0), "99.999%");
    }

    #[test]
    fn writes_an_svg() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).unwrap();
        for i in 1..=10_000u64 {
            h.record(i * 1000).unwrap();
        }
        let pts = curve(&h);
        assert!(pts.windows(2).all(|w| w[0].1 <= w[1].1));
        let path =
            std::env::temp_dir().join(format!("tollgate-loadtest-plot-{}.svg", std::process::id()));
        write_svg(&path, &h, "test").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(text.contains("<svg") && text.contains("99.9%"));
    }
}
