//! The loss curves as a PNG a person reads at a glance: axes with tick numbers and labels, a title
//! with the run's configuration, a legend. Text comes from an embedded font (DejaVu Sans,
//! `assets/DejaVuSans.ttf`, licence beside it): no system font lookup, works on a fresh machine.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn register() -> Result<(), String> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the embedded font does not parse".to_string());
    });
    result
}

/// What the plot shows.
pub struct LossCurves<'a> {
    /// Title: the run's configuration.
    pub title: &'a str,
    /// The step of `train[0]` (after a resume, the steps done before).
    pub first_step: usize,
    /// Training loss of every step.
    pub train: &'a [f64],
    /// `(step, loss)` on the held-out split.
    pub held_out: &'a [(usize, f64)],
    /// The unigram entropy of the text (a model that learnt only letter frequencies).
    pub reference: f64,
}

/// Draws the curves into `path`.
///
/// # Errors
/// The drawing or file error, as text.
pub fn loss_png(path: &Path, curves: &LossCurves) -> Result<(), String> {
    register()?;
    let err = |e: &dyn std::fmt::Display| format!("plotting {}: {e}", path.display());
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let x0 = curves.first_step as f64;
    let steps = x0 + curves.train.len().max(2) as f64 - 1.0;
    let max = curves
        .train
        .iter()
        .chain(curves.held_out.iter().map(|(_, l)| l))
        .copied()
        .filter(|l| l.is_finite())
        .fold(curves.reference, f64::max)
        * 1.05;
    // The title wrapped at word boundaries (an imported model's description is long), one line
    // per 24 pixels above the chart.
    let lines = wrap(curves.title, 84);
    let (top, area) = root.split_vertically(16 + 24 * lines.len() as u32);
    for (i, line) in lines.iter().enumerate() {
        let at = (20, 12 + 24 * i as i32);
        top.draw(&Text::new(
            line.as_str(),
            at,
            ("sans-serif", 19).into_font(),
        ))
        .map_err(|e| err(&e))?;
    }
    let mut chart = ChartBuilder::on(&area)
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..steps, 0f64..max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats)")
        .axis_desc_style(("sans-serif", 18))
        .label_style(("sans-serif", 15))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(
            curves
                .train
                .iter()
                .enumerate()
                .map(|(i, l)| (x0 + i as f64, *l)),
            BLUE.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label("train loss")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLUE.stroke_width(2)));
    let held = RGBColor(230, 120, 0);
    chart
        .draw_series(LineSeries::new(
            curves.held_out.iter().map(|&(s, l)| (s as f64, l)),
            held.stroke_width(3),
        ))
        .map_err(|e| err(&e))?
        .label("held-out loss")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], held.stroke_width(3)));
    chart
        .draw_series(
            curves
                .held_out
                .iter()
                .map(|&(s, l)| Circle::new((s as f64, l), 4, held.filled())),
        )
        .map_err(|e| err(&e))?;
    chart
        .draw_series(DashedLineSeries::new(
            [(x0, curves.reference), (steps, curves.reference)],
            8,
            6,
            RED.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label(format!("unigram entropy ({:.2})", curves.reference))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], RED.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// `text` cut at spaces into lines of at most `width` characters (a longer word alone).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split(' ') {
        match lines.last_mut() {
            Some(line) if line.chars().count() + 1 + word.chars().count() <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::wrap;

    #[test]
    fn a_title_wraps_at_spaces_within_the_width() {
        assert_eq!(wrap("ab cd ef", 5), vec!["ab cd", "ef"]);
        assert_eq!(wrap("abcdefgh ij", 4), vec!["abcdefgh", "ij"]);
        assert_eq!(wrap("short", 80), vec!["short"]);
    }
}
