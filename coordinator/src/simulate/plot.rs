//! Accuracy and loss per round, drawn as PNG and SVG with plotters.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::record::RoundRecord;

/// DejaVu Sans, shipped in the repository (its licence is beside it) so the PNG has text
/// on a machine with no fonts installed.
static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");
static REGISTER: Once = Once::new();

fn register_font() {
    REGISTER.call_once(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .unwrap_or_else(|_| panic!("the shipped DejaVu Sans font is valid"));
    });
}

/// One line per panel: a labelled run's history.
#[derive(Debug, Clone, Copy)]
pub struct Series<'a> {
    /// Legend text (the strategy).
    pub label: &'a str,
    /// The run's rounds.
    pub records: &'a [RoundRecord],
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
];

/// Draws test accuracy (left) and loss (right) per round into a PNG and an SVG file. A
/// single series also shows the clients' training loss; several series (a comparison)
/// are overlaid, one colour each.
pub fn write_plots(
    series: &[Series<'_>],
    title: &str,
    png: &Path,
    svg: &Path,
) -> Result<(), String> {
    register_font();
    const SIZE: (u32, u32) = (1100, 440);
    draw(
        BitMapBackend::new(png, SIZE).into_drawing_area(),
        series,
        title,
    )?;
    draw(
        SVGBackend::new(svg, SIZE).into_drawing_area(),
        series,
        title,
    )
}

fn points(records: &[RoundRecord], value: impl Fn(&RoundRecord) -> Option<f64>) -> Vec<(u32, f64)> {
    records
        .iter()
        .filter_map(|r| value(r).filter(|v| v.is_finite()).map(|v| (r.round, v)))
        .collect()
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    series: &[Series<'_>],
    title: &str,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("cannot draw plot: {e}");
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(err)?;
    let (left, right) = root.split_horizontally(root.dim_in_pixel().0 / 2);
    let last_round = series
        .iter()
        .filter_map(|s| s.records.last().map(|r| r.round))
        .max()
        .unwrap_or(1)
        .max(2);
    let single = series.len() == 1;
    let accuracy: Vec<_> = series
        .iter()
        .map(|s| points(s.records, |r| Some(r.test_accuracy)))
        .collect();
    let test_loss: Vec<_> = series
        .iter()
        .map(|s| points(s.records, |r| Some(r.test_loss)))
        .collect();
    // The clients' own loss is telling for one run; with several it only clutters.
    let train_loss = if single {
        points(series[0].records, |r| r.train_loss)
    } else {
        Vec::new()
    };

    let mut chart = ChartBuilder::on(&left)
        .caption("test accuracy", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(1u32..last_round, 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("round")
        .y_desc("accuracy")
        .draw()
        .map_err(err)?;
    for (i, (s, pts)) in series.iter().zip(&accuracy).enumerate() {
        let c = colour(i);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(s.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(err)?;

    let max_loss = test_loss
        .iter()
        .flatten()
        .chain(&train_loss)
        .map(|&(_, l)| l)
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05;
    let mut chart = ChartBuilder::on(&right)
        .caption("loss", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(1u32..last_round, 0f64..max_loss)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("round")
        .y_desc("cross-entropy")
        .draw()
        .map_err(err)?;
    for (i, (s, pts)) in series.iter().zip(&test_loss).enumerate() {
        let c = colour(i);
        let label = if single {
            "test".to_string()
        } else {
            format!("{} (test)", s.label)
        };
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    if single {
        let c = colour(2);
        chart
            .draw_series(LineSeries::new(
                train_loss.iter().copied(),
                c.stroke_width(2),
            ))
            .map_err(err)?
            .label("train (clients)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// One run for [`write_privacy_plot`]: per round, the epsilon spent so far (`None`
/// without differential privacy), the test accuracy and the round number.
#[derive(Debug, Clone)]
pub struct PrivacyRun {
    /// Legend text.
    pub label: String,
    /// `(epsilon, test_accuracy, round)` per round.
    pub points: Vec<(Option<f64>, f64, u32)>,
}

/// Draws test accuracy against epsilon spent (left: one line per run as its budget is
/// spent; right: each run's final accuracy at its final epsilon) into a PNG and an SVG
/// file. Runs without differential privacy appear as a dashed reference level.
pub fn write_privacy_plot(
    runs: &[PrivacyRun],
    title: &str,
    png: &Path,
    svg: &Path,
) -> Result<(), String> {
    register_font();
    const SIZE: (u32, u32) = (1100, 440);
    draw_privacy(
        BitMapBackend::new(png, SIZE).into_drawing_area(),
        runs,
        title,
    )?;
    draw_privacy(SVGBackend::new(svg, SIZE).into_drawing_area(), runs, title)
}

/// One panel of the privacy plot: test accuracy (0 to 1) against epsilon (0 to
/// `max_eps`), with its caption and mesh drawn.
fn accuracy_panel<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    caption: &str,
    x_desc: &str,
    max_eps: f64,
) -> Result<ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>, String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("cannot draw plot: {e}");
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..max_eps, 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("test accuracy")
        .draw()
        .map_err(err)?;
    Ok(chart)
}

/// The colour of run `i`, the same in every panel.
fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// The left panel: each private run's accuracy as its epsilon grows, and the runs
/// without privacy as dashed reference levels.
fn draw_budget_spent<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    runs: &[PrivacyRun],
    max_eps: f64,
    references: &[(usize, &PrivacyRun, f64)],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("cannot draw plot: {e}");
    let mut chart = accuracy_panel(
        area,
        "accuracy as the budget is spent",
        "epsilon spent",
        max_eps,
    )?;
    for (i, run) in runs.iter().enumerate() {
        let c = colour(i);
        let pts: Vec<(f64, f64)> = run
            .points
            .iter()
            .filter_map(|&(e, a, _)| e.filter(|e| e.is_finite()).map(|e| (e, a)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?
            .label(run.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    for &(i, run, level) in references {
        let c = colour(i);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, level), (max_eps, level)],
                8,
                5,
                c.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("{} ({level:.3})", run.label))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(err)?;

    Ok(())
}

/// The right panel: each private run's final accuracy at its final epsilon, joined in
/// epsilon order, with the references' levels.
fn draw_final_accuracy<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    runs: &[PrivacyRun],
    max_eps: f64,
    references: &[(usize, &PrivacyRun, f64)],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("cannot draw plot: {e}");
    let mut chart = accuracy_panel(
        area,
        "final accuracy against final epsilon",
        "epsilon",
        max_eps,
    )?;
    let finals: Vec<(usize, f64, f64)> = runs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            let last = r.points.last()?;
            last.0.filter(|e| e.is_finite()).map(|e| (i, e, last.1))
        })
        .collect();
    let mut line: Vec<(f64, f64)> = finals.iter().map(|&(_, e, a)| (e, a)).collect();
    line.sort_by(|a, b| a.0.total_cmp(&b.0));
    chart
        .draw_series(LineSeries::new(line, BLACK.mix(0.4).stroke_width(1)))
        .map_err(err)?;
    for &(i, e, a) in &finals {
        let c = colour(i);
        chart
            .draw_series(std::iter::once(Circle::new((e, a), 5, c.filled())))
            .map_err(err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{a:.3}"),
                (e, (a - 0.06).max(0.0)),
                ("sans-serif", 13),
            )))
            .map_err(err)?;
    }
    for &(i, _, level) in references {
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, level), (max_eps, level)],
                8,
                5,
                colour(i).stroke_width(2),
            ))
            .map_err(err)?;
    }
    Ok(())
}

fn draw_privacy<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    runs: &[PrivacyRun],
    title: &str,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("cannot draw plot: {e}");
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(err)?;
    let (left, right) = root.split_horizontally(root.dim_in_pixel().0 / 2);
    let max_eps = runs
        .iter()
        .flat_map(|r| r.points.iter().filter_map(|p| p.0))
        .filter(|e| e.is_finite())
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.05;
    let references: Vec<(usize, &PrivacyRun, f64)> = runs
        .iter()
        .enumerate()
        .filter(|(_, r)| r.points.iter().all(|p| p.0.is_none()))
        .filter_map(|(i, r)| r.points.last().map(|p| (i, r, p.1)))
        .collect();

    draw_budget_spent(&left, runs, max_eps, &references)?;
    draw_final_accuracy(&right, runs, max_eps, &references)?;
    root.present().map_err(err)
}

/// One run for [`write_bytes_plot`]: per round, the bytes uploaded so far and the test
/// accuracy.
#[derive(Debug, Clone)]
pub struct BytesRun {
    /// Legend text (the compression).
    pub label: String,
    /// `(cumulative bytes uploaded, test_accuracy, round)` per round.
    pub points: Vec<(u64, f64, u32)>,
}

/// Draws test accuracy against the megabytes uploaded so far (left, log scale: schemes
/// differ by tens of times) and against rounds (right), one line per run, into a PNG and
/// an SVG file.
pub fn write_bytes_plot(
    runs: &[BytesRun],
    title: &str,
    png: &Path,
    svg: &Path,
) -> Result<(), String> {
    register_font();
    const SIZE: (u32, u32) = (1100, 440);
    draw_bytes(
        BitMapBackend::new(png, SIZE).into_drawing_area(),
        runs,
        title,
    )?;
    draw_bytes(SVGBackend::new(svg, SIZE).into_drawing_area(), runs, title)
}

fn draw_bytes<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    runs: &[BytesRun],
    title: &str,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("cannot draw plot: {e}");
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(err)?;
    let (left, right) = root.split_horizontally(root.dim_in_pixel().0 / 2);
    let mb = |b: u64| b as f64 / 1e6;
    let all = || runs.iter().flat_map(|r| r.points.iter());
    let low = all()
        .map(|p| mb(p.0))
        .filter(|v| *v > 0.0)
        .fold(f64::INFINITY, f64::min);
    let high = all().map(|p| mb(p.0)).fold(0.0, f64::max);
    let (low, high) = if low.is_finite() && high > low {
        (low / 1.5, high * 1.5)
    } else {
        (0.01, 1.0)
    };
    let last_round = all().map(|p| p.2).max().unwrap_or(1).max(2);
    let mut by_bytes = ChartBuilder::on(&left)
        .caption("test accuracy against data uploaded", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d((low..high).log_scale(), 0f64..1f64)
        .map_err(err)?;
    by_bytes
        .configure_mesh()
        .x_desc("MB uploaded by all clients (log scale)")
        .y_desc("test accuracy")
        .draw()
        .map_err(err)?;
    let mut by_round = ChartBuilder::on(&right)
        .caption("test accuracy per round", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(1u32..last_round, 0f64..1f64)
        .map_err(err)?;
    by_round
        .configure_mesh()
        .x_desc("round")
        .y_desc("test accuracy")
        .draw()
        .map_err(err)?;
    for (i, run) in runs.iter().enumerate() {
        let c = colour(i);
        let label = run.label.clone();
        by_bytes
            .draw_series(LineSeries::new(
                run.points
                    .iter()
                    .filter(|p| p.0 > 0)
                    .map(|p| (mb(p.0), p.1)),
                // One pixel: on a log axis a dip is a needle, and a wider line's mitred
                // corner would shoot past the frame.
                c.stroke_width(1),
            ))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
        by_round
            .draw_series(LineSeries::new(
                run.points.iter().map(|p| (p.2, p.1)),
                c.stroke_width(1),
            ))
            .map_err(err)?;
    }
    by_bytes
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}
