//! Bar charts as PNG files (plotters, text drawn with a system TrueType font
//! found at run time).
//!
//! Owns chart drawing. Must fail with a clear error, never a panic, when no
//! font can be found.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::Context;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;

/// Fonts tried in order (Debian's fonts-dejavu-core and common others).
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
];

/// Registers a TrueType font for charts (once per process).
///
/// Fails with the fonts tried when none can be read.
pub(crate) fn ensure_font() -> anyhow::Result<()> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            for p in FONT_PATHS {
                if let Ok(bytes) = std::fs::read(p) {
                    // plotters keeps fonts for the life of the process.
                    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                    if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                        .is_ok()
                    {
                        return Ok(());
                    }
                }
            }
            Err(format!(
                "no TrueType font found for the chart (tried {}); install fonts-dejavu-core",
                FONT_PATHS.join(", ")
            ))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Draws a bar chart: one bar per (label, value), titled, with the value
/// written above each bar.
pub fn bar_chart(
    path: &Path,
    title: &str,
    y_label: &str,
    bars: &[(String, f64)],
) -> anyhow::Result<()> {
    ensure_font()?;
    let max = bars.iter().map(|(_, v)| *v).fold(0.0f64, f64::max).max(1.0) * 1.15;
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).context("drawing")?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        // n bars take the segments of 0..n-1 (a single bar: 0..1, as a
        // zero-width range cannot be laid out).
        .build_cartesian_2d((0..bars.len().max(2) - 1).into_segmented(), 0.0..max)
        .context("laying out the chart")?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc(y_label)
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_labels(bars.len())
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => bars.get(*i).map(|(l, _)| l.clone()).unwrap_or_default(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 15))
        .draw()
        .context("drawing the axes")?;
    let colors = [
        RGBColor(52, 101, 164),
        RGBColor(78, 154, 6),
        RGBColor(196, 160, 0),
        RGBColor(204, 0, 0),
    ];
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (label, v))| {
            let color = if label.starts_with("pgbench") || label.starts_with("PG") {
                colors[3]
            } else {
                colors[i % 3]
            };
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), *v),
                ],
                color.filled(),
            );
            bar.set_margin(0, 0, 20, 20);
            bar
        }))
        .context("drawing the bars")?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            Text::new(
                format!("{v:.0}"),
                (SegmentValue::CenterOf(i), *v + max * 0.01),
                TextStyle::from(("sans-serif", 16).into_font())
                    .pos(Pos::new(HPos::Center, VPos::Bottom)),
            )
        }))
        .context("drawing the values")?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_or_says_which_font_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bars.png");
        let bars = vec![
            ("weft 1 site".to_string(), 9349.0),
            ("pgbench".to_string(), 2466.0),
        ];
        match bar_chart(&path, "DebitCredit", "tps", &bars) {
            Ok(()) => {
                let png = std::fs::read(&path).unwrap();
                assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
                assert!(png.len() > 2000, "an image, not an empty file");
            }
            Err(e) => assert!(e.to_string().contains("fonts-dejavu-core"), "{e}"),
        }
    }
}
