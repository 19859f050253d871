//! Line charts as inline SVG, drawn on the server: they need no script and no library,
//! scale to any width, and stay small (one polyline per series) at thousands of rounds.

use std::fmt::Write;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: &'static str,
    /// CSS class of the line (its colour lives in the stylesheet).
    pub class: &'static str,
    /// (x, y) points; non-finite ones are left out.
    pub points: Vec<(f64, f64)>,
}

/// A chart's axes and size.
#[derive(Debug, Clone)]
pub struct Chart<'a> {
    /// Accessible name, e.g. "Test accuracy per round".
    pub title: &'a str,
    /// X axis label.
    pub x_label: &'a str,
    /// Y axis label.
    pub y_label: &'a str,
    /// Fixed y range, or `None` to fit the data.
    pub y_range: Option<(f64, f64)>,
    /// How y tick labels are written.
    pub y_format: fn(f64) -> String,
}

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 260.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 16.0;
const BOTTOM: f64 = 44.0;

/// Escapes text for SVG/HTML content and attributes.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// About five round tick values covering `lo..=hi`.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(f64::EPSILON);
    let raw = span / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| span / s <= 6.0)
        .unwrap_or(10.0 * magnitude);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 && out.len() < 12 {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

/// The chart as an `<svg>` element. Its `data-points` attribute counts the points drawn,
/// which tests and scripts can read without parsing the drawing.
pub fn render(chart: &Chart<'_>, series: &[Series]) -> String {
    let finite = |&&(x, y): &&(f64, f64)| x.is_finite() && y.is_finite();
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().filter(finite).copied())
        .collect();
    let mut svg = String::with_capacity(2048 + all.len() * 24);
    let _ = write!(
        svg,
        "<svg class=\"chart\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\" \
         aria-labelledby=\"{id}-t\" data-points=\"{n}\" preserveAspectRatio=\"xMidYMid meet\">\
         <title id=\"{id}-t\">{title}</title>",
        id = slug(chart.title),
        n = all.len(),
        title = escape(chart.title),
    );
    if all.is_empty() {
        let _ = write!(
            svg,
            "<text class=\"empty\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">No rounds yet</text></svg>",
            WIDTH / 2.0,
            HEIGHT / 2.0
        );
        return svg;
    }
    let (mut x_lo, mut x_hi) = all
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &(x, _)| {
            (lo.min(x), hi.max(x))
        });
    if x_hi - x_lo < 1.0 {
        x_lo -= 0.5;
        x_hi += 0.5;
    }
    let (y_lo, y_hi) = chart.y_range.unwrap_or_else(|| {
        let (lo, hi) = all
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &(_, y)| {
                (lo.min(y), hi.max(y))
            });
        let pad = ((hi - lo) * 0.08).max(hi.abs() * 0.05).max(1e-6);
        (
            (lo - pad).max(if lo >= 0.0 { 0.0 } else { f64::NEG_INFINITY }),
            hi + pad,
        )
    });
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let sx = |x: f64| LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w;
    let sy = |y: f64| TOP + (1.0 - (y - y_lo) / (y_hi - y_lo)) * plot_h;

    svg.push_str("<g class=\"grid\">");
    for t in ticks(y_lo, y_hi) {
        let y = sy(t);
        let _ = write!(
            svg,
            "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            WIDTH - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            escape(&(chart.y_format)(t))
        );
    }
    for t in ticks(x_lo, x_hi).into_iter().filter(|t| t.fract() == 0.0) {
        let x = sx(t);
        let _ = write!(
            svg,
            "<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{t}</text>",
            HEIGHT - BOTTOM + 16.0
        );
    }
    let _ = write!(
        svg,
        "</g><g class=\"axes\"><line x1=\"{LEFT}\" x2=\"{LEFT}\" y1=\"{TOP}\" y2=\"{b}\"/>\
         <line x1=\"{LEFT}\" x2=\"{r}\" y1=\"{b}\" y2=\"{b}\"/>\
         <text class=\"label\" x=\"{cx}\" y=\"{bl}\" text-anchor=\"middle\">{xl}</text>\
         <text class=\"label\" transform=\"translate(14 {cy}) rotate(-90)\" text-anchor=\"middle\">{yl}</text></g>",
        b = HEIGHT - BOTTOM,
        r = WIDTH - RIGHT,
        cx = LEFT + plot_w / 2.0,
        bl = HEIGHT - 6.0,
        cy = TOP + plot_h / 2.0,
        xl = escape(chart.x_label),
        yl = escape(chart.y_label),
    );
    for s in series {
        let points: Vec<(f64, f64)> = s.points.iter().filter(finite).copied().collect();
        if points.is_empty() {
            continue;
        }
        let _ = write!(
            svg,
            "<g class=\"series {}\"><polyline points=\"",
            escape(s.class)
        );
        for (x, y) in &points {
            let _ = write!(svg, "{:.1},{:.1} ", sx(*x), sy(y.clamp(y_lo, y_hi)));
        }
        svg.push_str("\"/>");
        // Markers only while they stay distinguishable.
        if points.len() <= 60 {
            for (x, y) in &points {
                let _ = write!(
                    svg,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\"><title>{} {x}: {}</title></circle>",
                    sx(*x),
                    sy(y.clamp(y_lo, y_hi)),
                    escape(chart.x_label),
                    escape(&(chart.y_format)(*y))
                );
            }
        }
        svg.push_str("</g>");
    }
    svg.push_str("</svg>");
    svg
}

/// The legend of `series`, as HTML.
pub fn legend(series: &[Series]) -> String {
    let mut html = String::from("<ul class=\"legend\">");
    for s in series {
        let _ = write!(
            html,
            "<li><span class=\"swatch {}\" aria-hidden=\"true\"></span>{}</li>",
            escape(s.class),
            escape(s.name)
        );
    }
    html.push_str("</ul>");
    html
}

fn slug(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart() -> Chart<'static> {
        Chart {
            title: "Accuracy <per> round",
            x_label: "round",
            y_label: "accuracy",
            y_range: Some((0.0, 1.0)),
            y_format: |y| format!("{:.0}%", y * 100.0),
        }
    }

    #[test]
    fn counts_the_points_it_draws_and_skips_non_finite_ones() {
        let series = [Series {
            name: "test",
            class: "a",
            points: vec![(1.0, 0.5), (2.0, f64::NAN), (3.0, 0.9)],
        }];
        let svg = render(&chart(), &series);
        assert!(svg.contains("data-points=\"2\""), "{svg}");
        assert_eq!(svg.matches("<circle").count(), 2);
        assert!(svg.contains("Accuracy &lt;per&gt; round"));
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn an_empty_chart_says_so() {
        let svg = render(&chart(), &[]);
        assert!(svg.contains("data-points=\"0\""));
        assert!(svg.contains("No rounds yet"));
    }

    #[test]
    fn thousands_of_points_stay_one_polyline_without_markers() {
        let points = (1..=1000).map(|r| (r as f64, 1.0 / r as f64)).collect();
        let svg = render(
            &Chart {
                y_range: None,
                ..chart()
            },
            &[Series {
                name: "loss",
                class: "b",
                points,
            }],
        );
        assert!(svg.contains("data-points=\"1000\""));
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert_eq!(svg.matches("<circle").count(), 0);
        assert!(svg.len() < 40_000, "{} bytes", svg.len());
    }

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        let t = ticks(0.0, 1.0);
        assert_eq!(t.first(), Some(&0.0));
        assert!((t.last().unwrap() - 1.0).abs() < 1e-9, "{t:?}");
        assert!(ticks(1.0, 1000.0).len() <= 7);
    }
}
