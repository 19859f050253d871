//! Accuracy and loss per round, drawn as PNG and SVG with plotters.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::run::RoundRecord;

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

/// Writes `accuracy.png` and `accuracy.svg`-style figures to `png` and `svg`.
pub fn write_plots(
    records: &[RoundRecord],
    title: &str,
    png: &Path,
    svg: &Path,
) -> Result<(), String> {
    register_font();
    const SIZE: (u32, u32) = (1100, 440);
    draw(
        BitMapBackend::new(png, SIZE).into_drawing_area(),
        records,
        title,
    )?;
    draw(
        SVGBackend::new(svg, SIZE).into_drawing_area(),
        records,
        title,
    )
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    records: &[RoundRecord],
    title: &str,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("cannot draw plot: {e}");
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(err)?;
    let (left, right) = root.split_horizontally(root.dim_in_pixel().0 / 2);
    let last_round = records.last().map_or(1, |r| r.round).max(2);
    let accuracy: Vec<(u32, f64)> = records.iter().map(|r| (r.round, r.test_accuracy)).collect();
    let loss: Vec<(u32, f64)> = records.iter().map(|r| (r.round, r.test_loss)).collect();
    let train_loss: Vec<(u32, f64)> = records
        .iter()
        .filter_map(|r| r.train_loss.map(|l| (r.round, l)))
        .collect();

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
    chart
        .draw_series(LineSeries::new(
            accuracy.iter().copied(),
            BLUE.stroke_width(2),
        ))
        .map_err(err)?;

    let max_loss = loss
        .iter()
        .chain(&train_loss)
        .map(|&(_, l)| l)
        .filter(|l| l.is_finite())
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
    chart
        .draw_series(LineSeries::new(loss.iter().copied(), RED.stroke_width(2)))
        .map_err(err)?
        .label("test")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    chart
        .draw_series(LineSeries::new(
            train_loss.iter().copied(),
            GREEN.stroke_width(2),
        ))
        .map_err(err)?
        .label("train (clients)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], GREEN));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}
