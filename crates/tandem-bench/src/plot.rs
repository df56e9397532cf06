//! PNG charts with `plotters`' bitmap backend. Text is drawn with `ab_glyph` from a font compiled into
//! the binary (Hack, from `epaint_default_fonts`), so no system font or fontconfig is needed.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use crate::error::BenchError;
use crate::metrics::Stats;
use crate::report::RunResult;
use crate::workload::RequestClass;

/// The font family every chart uses; registered once from the embedded font.
const FONT: &str = "sans-serif";

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::HACK_REGULAR)
            .unwrap_or_else(|_| panic!("the embedded font is a valid TrueType font"));
    });
}

/// Distinct, saturated series colours (matplotlib's "tab10"), readable on white.
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// The colour of series `i`.
fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// One line of a latency–throughput chart: an endpoint's runs of one workload, in sweep order.
struct Series {
    name: String,
    runs: Vec<usize>,
}

/// Groups runs by endpoint and workload; names carry the workload only when several are present.
fn series_of(runs: &[RunResult]) -> Vec<Series> {
    let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
    let mut order = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let key = (
            run.config.endpoint.clone(),
            run.config.workload.kind().to_string(),
        );
        if !groups.contains_key(&key) {
            order.push(key.clone());
        }
        groups.entry(key).or_default().push(i);
    }
    let many_workloads = order
        .iter()
        .map(|(_, w)| w)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
        > 1;
    order
        .into_iter()
        .map(|key| {
            let name = if many_workloads {
                format!("{} ({})", key.0, key.1)
            } else {
                key.0.clone()
            };
            Series {
                name,
                runs: groups.remove(&key).unwrap_or_default(),
            }
        })
        .collect()
}

/// The four latency panels: name and how to read the figure from a run.
type Metric = (&'static str, fn(&RunResult) -> f64);

const PANELS: [Metric; 4] = [
    ("TTFT median (ms)", |r| r.summary.ttft_ms.median),
    ("TPOT median (ms)", |r| r.summary.tpot_ms.median),
    ("ITL p99 (ms)", |r| r.summary.itl_ms.p99),
    ("E2E latency median (ms)", |r| r.summary.e2el_ms.median),
];

/// Upper bound of an axis with a little headroom (1 for an all-zero axis).
fn axis_max(values: impl Iterator<Item = f64>) -> f64 {
    let m = values.fold(0.0f64, f64::max);
    if m > 0.0 {
        m * 1.12
    } else {
        1.0
    }
}

/// Latency against output throughput over a sweep, one line per endpoint (and workload), one panel per
/// latency figure, each point labelled with its sweep coordinate. Bursty runs, which have their own
/// chart, are left out when other runs are present. Latency axes are logarithmic: peers can differ by
/// orders of magnitude.
pub fn latency_throughput(runs: &[RunResult], path: &Path) -> Result<(), BenchError> {
    let swept: Vec<RunResult> = runs
        .iter()
        .filter(|r| r.config.workload.kind() != "bursty")
        .cloned()
        .collect();
    let runs = if swept.is_empty() { runs } else { &swept[..] };
    if runs.is_empty() {
        return Err(plot_err(path, "no runs to plot"));
    }
    register_font();
    let series = series_of(runs);
    let root = BitMapBackend::new(path, (1600, 1100)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let root = root
        .titled(
            "latency vs output token throughput (tandem bench)",
            (FONT, 28),
        )
        .map_err(|e| plot_err(path, e))?;
    let x_max = axis_max(runs.iter().map(|r| r.summary.output_throughput));
    for (panel, (title, metric)) in root.split_evenly((2, 2)).iter().zip(PANELS) {
        let y_max = axis_max(runs.iter().map(metric)) * 1.5;
        let y_min = runs
            .iter()
            .map(metric)
            .filter(|v| *v > 0.0)
            .fold(f64::INFINITY, f64::min)
            .min(y_max / 10.0)
            * 0.5;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, (FONT, 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max, (y_min..y_max).log_scale())
            .map_err(|e| plot_err(path, e))?;
        chart
            .configure_mesh()
            .x_desc("output tokens/s")
            .y_desc("ms (log scale)")
            .label_style((FONT, 14))
            .draw()
            .map_err(|e| plot_err(path, e))?;
        for (si, s) in series.iter().enumerate() {
            let color = color(si);
            let points: Vec<(f64, f64)> = s
                .runs
                .iter()
                .map(|&i| {
                    let y = metric(&runs[i]).max(y_min);
                    (runs[i].summary.output_throughput, y)
                })
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| plot_err(path, e))?
                .label(s.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
                });
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(|e| plot_err(path, e))?;
            chart
                .draw_series(s.runs.iter().zip(&points).map(|(&i, &p)| {
                    // Offset so the label does not sit on the marker.
                    EmptyElement::at(p)
                        + Text::new(
                            runs[i].config.point_label(),
                            (6, -16),
                            (FONT, 13).into_font(),
                        )
                }))
                .map_err(|e| plot_err(path, e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FONT, 15))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot_err(path, e))?;
    }
    root.present().map_err(|e| plot_err(path, e))
}

/// Every inter-token gap of the steady requests as (time after the run's start, gap) in seconds and
/// milliseconds.
pub fn itl_points(run: &RunResult) -> Vec<(f64, f64)> {
    let mut points = Vec::new();
    for r in run
        .requests
        .iter()
        .filter(|r| r.success && r.class != RequestClass::Burst)
    {
        let mut t = r.start_s + r.ttft_s;
        for gap in &r.itl_s {
            t += gap;
            points.push((t, gap * 1e3));
        }
    }
    points
}

/// ITL of the steady requests over time for each bursty run, one panel per run with a common scale,
/// bursts marked by vertical lines. Fails when no run is of the bursty workload.
pub fn itl_over_time(runs: &[RunResult], path: &Path) -> Result<(), BenchError> {
    let bursty: Vec<&RunResult> = runs
        .iter()
        .filter(|r| r.config.workload.kind() == "bursty")
        .collect();
    if bursty.is_empty() {
        return Err(plot_err(path, "no bursty runs to plot"));
    }
    register_font();
    let points: Vec<Vec<(f64, f64)>> = bursty.iter().map(|r| itl_points(r)).collect();
    let x_max = axis_max(
        points
            .iter()
            .flatten()
            .map(|p| p.0)
            .chain(bursty.iter().flat_map(|r| r.burst_times_s.iter().copied())),
    );
    // A log scale keeps both a few-ms steady ITL and multi-second stalls readable on one shared axis;
    // gaps below 0.1 ms (events that arrived in one read) sit on the floor.
    let y_min = 0.1;
    let y_max = axis_max(points.iter().flatten().map(|p| p.1)).max(10.0);
    let height = 120 + 320 * bursty.len() as u32;
    let root = BitMapBackend::new(path, (1600, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let root = root
        .titled(
            "inter-token latency of steady requests over time; red lines: bursts of long prompts",
            (FONT, 24),
        )
        .map_err(|e| plot_err(path, e))?;
    for (i, (panel, run)) in root
        .split_evenly((bursty.len(), 1))
        .iter()
        .zip(&bursty)
        .enumerate()
    {
        let itl = Stats::of_seconds(points[i].iter().map(|p| p.1 / 1e3));
        let caption = format!(
            "{} {}: steady requests' ITL median {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            run.config.endpoint,
            run.config.point_label(),
            itl.median,
            itl.p99,
            itl.max
        );
        let mut chart = ChartBuilder::on(panel)
            .caption(caption, (FONT, 18))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max, (y_min..y_max).log_scale())
            .map_err(|e| plot_err(path, e))?;
        chart
            .configure_mesh()
            .x_desc("seconds since start")
            .y_desc("ITL (ms, log scale)")
            .label_style((FONT, 14))
            .draw()
            .map_err(|e| plot_err(path, e))?;
        for &t in &run.burst_times_s {
            chart
                .draw_series(LineSeries::new(
                    [(t, y_min), (t, y_max)],
                    RED.mix(0.6).stroke_width(2),
                ))
                .map_err(|e| plot_err(path, e))?;
        }
        let color = color(i);
        chart
            .draw_series(
                points[i]
                    .iter()
                    .map(|&(t, ms)| Circle::new((t, ms.max(y_min)), 2, color.mix(0.8).filled())),
            )
            .map_err(|e| plot_err(path, e))?;
    }
    root.present().map_err(|e| plot_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{BurstySpec, LengthSpec, WorkloadSpec};

    #[test]
    fn charts_are_drawn_from_runs() {
        let dir = std::env::temp_dir().join(format!("tandem-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = crate::report::tests::run();
        let mut b = a.clone();
        b.config.max_concurrency = Some(16);
        b.summary.output_throughput *= 3.0;
        let path = dir.join("lt.png");
        latency_throughput(&[a.clone(), b], &path).unwrap();
        assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"));

        // The bursty chart needs a bursty run; its points are the steady requests' token times.
        let path = dir.join("itl.png");
        assert!(itl_over_time(std::slice::from_ref(&a), &path).is_err());
        let mut bursty = a;
        bursty.config.workload = WorkloadSpec::Bursty(BurstySpec {
            steady_input: LengthSpec::fixed(8),
            steady_output: LengthSpec::fixed(3),
            steady_rate: 1.0,
            burst_input: 64,
            burst_output: 2,
            burst_size: 2,
            burst_interval_s: 1.0,
        });
        bursty.burst_times_s = vec![0.05];
        let points = itl_points(&bursty);
        assert_eq!(points.len(), 2);
        assert!((points[0].0 - 0.11).abs() < 1e-9 && (points[0].1 - 10.0).abs() < 1e-9);
        assert!((points[1].0 - 0.14).abs() < 1e-9 && (points[1].1 - 30.0).abs() < 1e-9);
        itl_over_time(&[bursty], &path).unwrap();
        assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
