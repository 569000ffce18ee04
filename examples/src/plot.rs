//! The loss curve as a PNG (plotters, bitmap backend; no fonts needed, so no text).

use std::path::Path;

use plotters::prelude::*;

/// Draws `losses` (one per step) with the unigram entropy as a dashed reference line.
///
/// # Errors
/// The drawing or file error, as text.
pub fn loss_png(path: &Path, losses: &[f64], reference: f64) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("plotting {}: {e}", path.display());
    let root = BitMapBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let max = losses.iter().copied().fold(reference, f64::max) * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .margin(20)
        .build_cartesian_2d(0f64..losses.len().max(2) as f64 - 1.0, 0f64..max)
        .map_err(|e| err(&e))?;
    let axes = [
        (0.0, 0.0),
        (0.0, max),
        (0.0, 0.0),
        ((losses.len().max(2) - 1) as f64, 0.0),
    ];
    chart
        .draw_series(LineSeries::new(axes[..2].to_vec(), BLACK.stroke_width(2)))
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(axes[2..].to_vec(), BLACK.stroke_width(2)))
        .map_err(|e| err(&e))?;
    let n = losses.len() as f64;
    let dashes = (0..40).map(|i| {
        let x0 = n * i as f64 / 40.0;
        PathElement::new(
            vec![(x0, reference), (x0 + n / 80.0, reference)],
            RED.stroke_width(1),
        )
    });
    chart.draw_series(dashes).map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(
            losses.iter().enumerate().map(|(i, l)| (i as f64, *l)),
            BLUE.stroke_width(2),
        ))
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
