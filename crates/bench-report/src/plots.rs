//! PNG plots of a report, drawn with `plotters`' bitmap backend into a buffer and encoded with
//! `png`. Text uses DejaVu Sans, embedded in the crate (`assets/`, Bitstream Vera licence) and
//! registered with `ab_glyph`, so no system font or fontconfig is needed.
//!
//! Every plot filters out non-finite and non-positive values before choosing its axes; a report
//! with nothing to draw gives a PNG with the title and "no data" rather than an error.

use std::error::Error;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::report::{BenchReport, DecisionPoint, TransferPoint};
use crate::stats::{SAMPLE_BUCKETS, Winner, error_by_samples, outcome, prediction_errors};

/// DejaVu Sans (see `assets/DejaVuSans-LICENSE.txt`).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// The font family the plots ask for.
const FAMILY: &str = "sans-serif";

const MIB: f64 = 1024.0 * 1024.0;

/// The file names [`write_all`] writes.
pub const GOODPUT_PNG: &str = "goodput.png";
/// See [`GOODPUT_PNG`].
pub const FETCH_TIME_PNG: &str = "fetch-time.png";
/// See [`GOODPUT_PNG`].
pub const DECISION_MAP_PNG: &str = "decision-map.png";
/// See [`GOODPUT_PNG`].
pub const CALIBRATION_PNG: &str = "calibration.png";

/// Why a plot could not be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlotError {
    /// The embedded font could not be parsed (a broken build, not a broken report).
    Font,
    /// Drawing the plot for `path` failed (plotters refused a coordinate or a glyph).
    Draw {
        /// The PNG being drawn.
        path: PathBuf,
        /// What plotters said.
        message: String,
    },
    /// Encoding or writing `path` failed (usually: its directory is missing or not writable).
    Write {
        /// The PNG being written.
        path: PathBuf,
        /// What the file system or the PNG encoder said.
        message: String,
    },
}

impl fmt::Display for PlotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlotError::Font => write!(f, "the embedded plot font could not be loaded"),
            PlotError::Draw { path, message } => {
                write!(f, "drawing {}: {message}", path.display())
            }
            PlotError::Write { path, message } => {
                write!(f, "writing {}: {message}", path.display())
            }
        }
    }
}

impl Error for PlotError {}

type DrawResult = Result<(), Box<dyn Error>>;

fn ensure_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok { Ok(()) } else { Err(PlotError::Font) }
}

fn run(
    path: &Path,
    (w, h): (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> DrawResult,
) -> Result<(), PlotError> {
    ensure_font()?;
    let fail = |e: &dyn fmt::Display| PlotError::Draw { path: path.to_owned(), message: e.to_string() };
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        draw(&root).map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
    }
    write_png(path, (w, h), &rgb)
        .map_err(|e| PlotError::Write { path: path.to_owned(), message: e.to_string() })
}

fn write_png(path: &Path, (w, h): (u32, u32), rgb: &[u8]) -> Result<(), Box<dyn Error>> {
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut enc = png::Encoder::new(file, w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(())
}

/// Colours for series (profiles, baselines), cycled.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];
const FETCH_COLOR: RGBColor = RGBColor(31, 119, 180);
const RECOMPUTE_COLOR: RGBColor = RGBColor(255, 127, 14);
const TIE_COLOR: RGBColor = RGBColor(120, 120, 120);
const GREY: RGBColor = RGBColor(110, 110, 110);

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn font(size: u32) -> TextStyle<'static> {
    (FAMILY, size).into_font().into()
}

fn usable(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// A log axis range covering `values` (positive, finite ones), widened by `pad` (a factor) on
/// both sides; `None` when there are none.
fn log_range(values: impl Iterator<Item = f64>, pad: f64) -> Option<(f64, f64)> {
    let (lo, hi) =
        values.filter(|v| usable(*v)).fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    (hi > 0.0).then(|| (lo / pad, hi * pad))
}

fn unique<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for n in names {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

fn no_data(area: &DrawingArea<BitMapBackend<'_>, Shift>, title: &str) -> DrawResult {
    let (w, h) = area.dim_in_pixel();
    area.draw(&Text::new(title.to_owned(), (20, 20), font(28)))?;
    let msg = "no data";
    let style = font(24).pos(plotters::style::text_anchor::Pos::new(
        plotters::style::text_anchor::HPos::Center,
        plotters::style::text_anchor::VPos::Center,
    ));
    area.draw(&Text::new(msg, (w as i32 / 2, h as i32 / 2), style))?;
    Ok(())
}

/// Goodput against session size, one panel per link profile: kvferry (line), the model's goodput
/// (grey line), the link rate (dashed) and each baseline that ran (markers), in Mbit/s.
pub fn goodput_plot(r: &BenchReport, path: &Path) -> Result<(), PlotError> {
    let profiles = unique(
        r.transfers
            .iter()
            .map(|t| t.link.profile.as_str())
            .chain(r.baselines.iter().filter(|b| !b.is_skipped()).map(|b| b.link.profile.as_str())),
    );
    let cols = profiles.len().clamp(1, 2) as u32;
    let rows = (profiles.len() as u32).div_ceil(cols).max(1);
    run(path, (760 * cols, 480 * rows + 50), |root| {
        const TITLE: &str = "Goodput vs session size";
        if profiles.is_empty() {
            return no_data(root, TITLE);
        }
        let (top, body) = root.split_vertically(50);
        top.draw(&Text::new(TITLE, (20, 12), font(28)))?;
        let baseline_names = unique(r.baselines.iter().filter(|b| !b.is_skipped()).map(|b| b.name.as_str()));
        for (panel, prof) in body.split_evenly((rows as usize, cols as usize)).iter().zip(&profiles) {
            goodput_panel(r, prof, &baseline_names, panel)?;
        }
        Ok(())
    })
}

fn goodput_panel(
    r: &BenchReport,
    prof: &str,
    baseline_names: &[&str],
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
) -> DrawResult {
    let ts: Vec<&TransferPoint> = r.transfers.iter().filter(|t| t.link.profile == prof).collect();
    let bs: Vec<_> = r.baselines.iter().filter(|b| b.link.profile == prof && !b.is_skipped()).collect();
    let rate =
        ts.first().map(|t| t.link.rate_bps).or_else(|| bs.first().map(|b| b.link.rate_bps)).unwrap_or(0.0);
    let sizes =
        ts.iter().map(|t| t.session_bytes as f64 / MIB).chain(bs.iter().map(|b| b.bytes as f64 / MIB));
    let Some((x0, x1)) = log_range(sizes, 1.4) else {
        return no_data(area, prof);
    };
    let y_max = ts
        .iter()
        .flat_map(|t| [t.goodput_bps, t.model_goodput_bps])
        .chain(bs.iter().map(|b| b.goodput_bps))
        .chain([rate])
        .filter(|v| usable(*v))
        .fold(0.0f64, f64::max)
        / 1e6;
    let y_max = if y_max > 0.0 { y_max * 1.12 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{prof} ({:.0} Mbit/s)", rate / 1e6), font(20))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d((x0..x1).log_scale(), 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("session size, MiB")
        .y_desc("goodput, Mbit/s")
        .label_style(font(14))
        .axis_desc_style(font(15))
        .x_labels(6)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    if usable(rate) {
        chart
            .draw_series(DashedLineSeries::new(
                [(x0, rate / 1e6), (x1, rate / 1e6)],
                8,
                5,
                BLACK.stroke_width(1),
            ))?
            .label("link rate")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
    }
    let mut pts: Vec<(f64, f64, f64)> = ts
        .iter()
        .map(|t| (t.session_bytes as f64 / MIB, t.goodput_bps / 1e6, t.model_goodput_bps / 1e6))
        .filter(|(x, y, _)| usable(*x) && y.is_finite())
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    if !pts.is_empty() {
        let model: Vec<(f64, f64)> = pts.iter().filter(|p| p.2.is_finite()).map(|p| (p.0, p.2)).collect();
        chart
            .draw_series(LineSeries::new(model, GREY.stroke_width(1)))?
            .label("model")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], GREY));
        let kv = color(0);
        chart
            .draw_series(LineSeries::new(pts.iter().map(|p| (p.0, p.1)), kv.stroke_width(3)).point_size(4))?
            .label("kvferry")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], kv.stroke_width(3)));
    }
    for (i, name) in baseline_names.iter().enumerate() {
        let c = color(i + 1);
        let mut p: Vec<(f64, f64)> = bs
            .iter()
            .filter(|b| b.name == *name)
            .map(|b| (b.bytes as f64 / MIB, b.goodput_bps / 1e6))
            .filter(|(x, y)| usable(*x) && y.is_finite())
            .collect();
        if p.is_empty() {
            continue;
        }
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart.draw_series(LineSeries::new(p.clone(), c.stroke_width(1)))?;
        chart
            .draw_series(p.into_iter().map(|xy| TriangleMarker::new(xy, 7, c.filled())))?
            .label(name.to_string())
            .legend(move |(x, y)| TriangleMarker::new((x + 9, y), 6, c.filled()));
    }
    chart
        .configure_series_labels()
        .label_font(font(14))
        .background_style(WHITE.mix(0.85))
        .border_style(GREY)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    Ok(())
}

/// Measured fetch time against the model's (log-log, one colour per profile, `y = x` dashed),
/// with the daemon's own prediction as hollow markers.
pub fn fetch_time_plot(r: &BenchReport, path: &Path) -> Result<(), PlotError> {
    run(path, (1000, 760), |root| {
        const TITLE: &str = "Fetch time: measured vs modeled";
        let pts: Vec<&TransferPoint> =
            r.transfers.iter().filter(|t| usable(t.wall_s) && usable(t.model_fetch_s)).collect();
        let Some((lo, hi)) =
            log_range(pts.iter().flat_map(|t| [t.wall_s, t.model_fetch_s, t.daemon_predicted_s]), 1.5)
        else {
            return no_data(root, TITLE);
        };
        let mut chart = ChartBuilder::on(root)
            .caption(TITLE, font(26))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d((lo..hi).log_scale(), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("modeled fetch time, s (RTT + bytes / rate)")
            .y_desc("measured / predicted, s")
            .label_style(font(15))
            .axis_desc_style(font(16))
            .x_label_formatter(&|v| format!("{v:.3}"))
            .y_label_formatter(&|v| format!("{v:.3}"))
            .draw()?;
        chart
            .draw_series(DashedLineSeries::new([(lo, lo), (hi, hi)], 8, 5, BLACK.stroke_width(1)))?
            .label("y = x")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
        for (i, prof) in unique(pts.iter().map(|t| t.link.profile.as_str())).into_iter().enumerate() {
            let c = color(i);
            let group: Vec<&&TransferPoint> = pts.iter().filter(|t| t.link.profile == prof).collect();
            chart
                .draw_series(group.iter().map(|t| Circle::new((t.model_fetch_s, t.wall_s), 6, c.filled())))?
                .label(format!("{prof} measured"))
                .legend(move |(x, y)| Circle::new((x + 9, y), 5, c.filled()));
            chart
                .draw_series(group.iter().filter(|t| usable(t.daemon_predicted_s)).map(|t| {
                    TriangleMarker::new((t.model_fetch_s, t.daemon_predicted_s), 7, c.stroke_width(2))
                }))?
                .label(format!("{prof} daemon predicted"))
                .legend(move |(x, y)| TriangleMarker::new((x + 9, y), 6, c.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .label_font(font(15))
            .background_style(WHITE.mix(0.85))
            .border_style(GREY)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
        Ok(())
    })
}

/// The decision map: prefix tokens (log x) against link profile (one row each, with its rate
/// and RTT). A point's colour is the action that measured faster; a filled circle means the daemon
/// chose it, a cross means it chose the other. A black tick marks the modeled crossover of the
/// row (labelled; "never" when fetch never pays).
pub fn decision_map(r: &BenchReport, path: &Path) -> Result<(), PlotError> {
    let profiles = unique(r.decisions.iter().map(|d| d.link.profile.as_str()));
    let height = 260 + 110 * profiles.len().max(1) as u32;
    run(path, (1100, height), |root| {
        const TITLE: &str = "Decisions: measured winner and the daemon's choice";
        let Some((x0, x1)) = log_range(r.decisions.iter().map(|d| d.prefix_tokens as f64), 2.0) else {
            return no_data(root, TITLE);
        };
        let labels: Vec<String> = profiles
            .iter()
            .map(|p| {
                let l = &r.decisions.iter().find(|d| d.link.profile == *p).map(|d| &d.link);
                l.map_or_else(
                    || (*p).to_owned(),
                    |l| format!("{p}\n{} Mbit/s, {:.0} ms", fmt_rate(l.rate_bps), l.rtt_s * 1e3),
                )
            })
            .collect();
        let n = profiles.len() as i32;
        let mut chart = ChartBuilder::on(root)
            .caption(TITLE, font(24))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(200)
            // One row per profile plus an empty top row for the legend.
            .build_cartesian_2d((x0..x1).log_scale(), (0..n).into_segmented())?;
        let label_of = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) => labels
                .get(*i as usize)
                .map_or_else(String::new, |l| l.lines().next().unwrap_or_default().to_owned()),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("prefix tokens")
            .label_style(font(15))
            .axis_desc_style(font(16))
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&label_of)
            .y_labels(n as usize + 1)
            .draw()?;
        // Rate and RTT under each row's name, inside the plot at its left edge.
        for (i, l) in labels.iter().enumerate() {
            if let Some(sub) = l.lines().nth(1) {
                chart.draw_series(std::iter::once(
                    EmptyElement::at((x0, SegmentValue::CenterOf(i as i32)))
                        + Text::new(sub.to_owned(), (6, -40), font(13).color(&GREY)),
                ))?;
            }
        }
        let row = |d: &DecisionPoint| {
            SegmentValue::CenterOf(profiles.iter().position(|p| *p == d.link.profile).unwrap_or(0) as i32)
        };
        for (winner, c, name) in [
            (Winner::Fetch, FETCH_COLOR, "fetch faster"),
            (Winner::Recompute, RECOMPUTE_COLOR, "recompute faster"),
            (Winner::Tie, TIE_COLOR, "tie"),
        ] {
            let group: Vec<&DecisionPoint> = r
                .decisions
                .iter()
                .filter(|d| usable(d.prefix_tokens as f64) && outcome(d).winner == winner)
                .collect();
            if group.is_empty() {
                continue;
            }
            chart
                .draw_series(
                    group
                        .iter()
                        .filter(|d| outcome(d).correct)
                        .map(|d| Circle::new((d.prefix_tokens as f64, row(d)), 9, c.filled())),
                )?
                .label(format!("{name}, daemon chose it"))
                .legend(move |(x, y)| Circle::new((x + 9, y), 6, c.filled()));
            chart
                .draw_series(
                    group
                        .iter()
                        .filter(|d| !outcome(d).correct)
                        .map(|d| Cross::new((d.prefix_tokens as f64, row(d)), 10, c.stroke_width(4))),
                )?
                .label(format!("{name}, daemon chose wrong"))
                .legend(move |(x, y)| Cross::new((x + 9, y), 6, c.stroke_width(3)));
        }
        // Modeled crossover per row: a tick at the value (clamped to the axis) and its label.
        let mut first = true;
        for (i, prof) in profiles.iter().enumerate() {
            let Some(d) = r.decisions.iter().find(|d| d.link.profile == *prof) else { continue };
            let y = SegmentValue::CenterOf(i as i32);
            // Off-axis crossovers sit on the edge, their label says which way; labels at the
            // right edge go to the left of the tick.
            let (x, text, dx) = match d.modeled_crossover_tokens {
                Some(c) if c.is_finite() && c >= 0.0 && c < x0 => (x0, format!("◀ crossover ≈ {c:.0}"), 5),
                Some(c) if c.is_finite() && c > x1 => (x1, format!("crossover ≈ {c:.0} ▶"), -150),
                Some(c) if c.is_finite() && c >= 0.0 => (c, format!("crossover ≈ {c:.0}"), 5),
                _ => (x1, "crossover: never ▶".to_owned(), -130),
            };
            let tick = EmptyElement::at((x, y.clone()))
                + PathElement::new(vec![(0, -30), (0, 30)], BLACK.stroke_width(3))
                + Text::new(text, (dx, 18), font(13));
            let drawn = chart.draw_series(std::iter::once(tick))?;
            if first {
                drawn.label("modeled crossover").legend(|(x, y)| {
                    PathElement::new(vec![(x + 9, y - 7), (x + 9, y + 7)], BLACK.stroke_width(3))
                });
                first = false;
            }
        }
        chart
            .configure_series_labels()
            .label_font(font(14))
            .background_style(WHITE.mix(0.9))
            .border_style(GREY)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
        Ok(())
    })
}

/// One action's series: its name, colour and (samples, error) points.
type ErrorSeries<'a> = (&'a str, RGBColor, Vec<(u32, f64)>);

/// Errors below this are drawn at it (the y axis is logarithmic).
const ERROR_FLOOR_PCT: f64 = 0.1;

/// Prediction error against calibration samples: each decision point's |measured ÷ predicted
/// − 1| (%, log y) for fetch (blue) and recompute (orange) at the number of executed
/// migrations its calibration had learnt from (x), with each bucket's median (of
/// [`SAMPLE_BUCKETS`], as in the report's table) as a line across the bucket, and the 10 %
/// target dashed. Error should fall as samples accumulate.
pub fn calibration_plot(r: &BenchReport, path: &Path) -> Result<(), PlotError> {
    run(path, (1000, 700), |root| {
        const TITLE: &str = "Prediction error against calibration samples";
        let series: Vec<ErrorSeries> = [("fetch", FETCH_COLOR), ("recompute", RECOMPUTE_COLOR)]
            .into_iter()
            .map(|(a, c)| (a, c, prediction_errors(&r.decisions, a)))
            .collect();
        let pct = |e: f64| (e * 100.0).max(ERROR_FLOOR_PCT);
        let Some(max_n) = series.iter().flat_map(|(_, _, v)| v.iter().map(|&(n, _)| n)).max() else {
            return no_data(root, TITLE);
        };
        let x1 = f64::from(max_n) + 1.0;
        let hi =
            series.iter().flat_map(|(_, _, v)| v.iter().map(|&(_, e)| pct(e))).fold(20.0f64, f64::max) * 1.5;
        let mut chart = ChartBuilder::on(root)
            .caption(TITLE, font(26))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(-0.5..x1, (ERROR_FLOOR_PCT * 0.8..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("executed migrations the calibration had learnt from")
            .y_desc("|measured / predicted - 1|, %")
            .label_style(font(15))
            .axis_desc_style(font(16))
            // Whole sample counts only.
            .x_labels((max_n as usize + 2).min(24))
            .x_label_formatter(&|v| {
                if (v - v.round()).abs() < 1e-6 { format!("{v:.0}") } else { String::new() }
            })
            .y_label_formatter(&|v| format!("{v:.1}"))
            .draw()?;
        chart
            .draw_series(DashedLineSeries::new([(-0.5, 10.0), (x1, 10.0)], 8, 5, BLACK.stroke_width(1)))?
            .label("10 % target")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
        // Fetch points a little left of their sample count, recompute a little right, so that
        // both stay visible at one count.
        for (i, (action, c, pts)) in series.iter().enumerate() {
            let (c, dx) = (*c, if i == 0 { -0.12 } else { 0.12 });
            if pts.is_empty() {
                continue;
            }
            chart
                .draw_series(
                    pts.iter()
                        .map(|&(n, e)| Circle::new((f64::from(n) + dx, pct(e)), 5, c.mix(0.7).filled())),
                )?
                .label(format!("{action}, one point each"))
                .legend(move |(x, y)| Circle::new((x + 9, y), 5, c.filled()));
        }
        let buckets = error_by_samples(&r.decisions);
        for (action, c, _) in &series {
            let c = *c;
            let mut first = true;
            for b in buckets.iter().filter(|b| b.action == *action) {
                let (lo, hi) = SAMPLE_BUCKETS
                    .iter()
                    .find(|(lo, _)| *lo == b.samples_lo)
                    .map_or((b.samples_lo, b.samples_hi), |&(lo, hi)| (lo, hi));
                let (a, z) = (f64::from(lo) - 0.4, (f64::from(hi.min(max_n)) + 0.4).max(f64::from(lo) + 0.4));
                let y = pct(b.median_abs_error);
                let drawn = chart.draw_series(std::iter::once(PathElement::new(
                    vec![(a, y), (z, y)],
                    c.stroke_width(4),
                )))?;
                if first {
                    drawn
                        .label(format!("{action}, median per bucket"))
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(4)));
                    first = false;
                }
            }
        }
        chart
            .configure_series_labels()
            .label_font(font(15))
            .background_style(WHITE.mix(0.85))
            .border_style(GREY)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        Ok(())
    })
}

fn fmt_rate(bps: f64) -> String {
    format!("{:.0}", bps / 1e6)
}

/// The signature every plot shares.
pub type PlotFn = fn(&BenchReport, &Path) -> Result<(), PlotError>;

/// Writes [`GOODPUT_PNG`], [`FETCH_TIME_PNG`], [`DECISION_MAP_PNG`] and [`CALIBRATION_PNG`]
/// into `dir` (which must exist) and returns their paths in that order.
pub fn write_all(r: &BenchReport, dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    let plots: [(&str, PlotFn); 4] = [
        (GOODPUT_PNG, goodput_plot),
        (FETCH_TIME_PNG, fetch_time_plot),
        (DECISION_MAP_PNG, decision_map),
        (CALIBRATION_PNG, calibration_plot),
    ];
    let mut out = Vec::with_capacity(plots.len());
    for (name, plot) in plots {
        let path = dir.join(name);
        plot(r, &path)?;
        out.push(path);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::sample_report;

    const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];

    fn is_png(p: &Path) -> bool {
        std::fs::read(p).is_ok_and(|b| b.len() > 1000 && b.starts_with(&PNG_SIGNATURE))
    }

    /// With `KVFERRY_PLOTS_DIR` set, copies the plots there to be looked at.
    fn keep(paths: &[PathBuf], prefix: &str) {
        if let Some(dir) = std::env::var_os("KVFERRY_PLOTS_DIR") {
            for p in paths {
                let name = format!("{prefix}{}", p.file_name().unwrap().to_string_lossy());
                std::fs::copy(p, Path::new(&dir).join(name)).unwrap();
            }
        }
    }

    fn empty() -> BenchReport {
        let mut r = sample_report();
        r.transfers.clear();
        r.baselines.clear();
        r.decisions.clear();
        r.decision_summary.clear();
        r.splits.clear();
        r
    }

    #[test]
    fn each_plot_writes_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = sample_report();
        // Calibration samples growing along the sweep, as in a real run.
        for (i, d) in r.decisions.iter_mut().enumerate() {
            (d.fetch_samples, d.recompute_samples) = (i as u32, i as u32 / 2);
        }
        for (name, plot) in [
            ("g.png", goodput_plot as PlotFn),
            ("f.png", fetch_time_plot),
            ("d.png", decision_map),
            ("c.png", calibration_plot),
        ] {
            let p = dir.path().join(name);
            plot(&r, &p).unwrap();
            assert!(is_png(&p), "{name}");
        }
    }

    #[test]
    fn write_all_names_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let paths = write_all(&sample_report(), dir.path()).unwrap();
        let names: Vec<_> = paths.iter().map(|p| p.file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(names, [GOODPUT_PNG, FETCH_TIME_PNG, DECISION_MAP_PNG, CALIBRATION_PNG]);
        assert!(paths.iter().all(|p| is_png(p)));
        keep(&paths, "");
    }

    #[test]
    fn empty_report_writes_no_data_charts() {
        let dir = tempfile::tempdir().unwrap();
        let paths = write_all(&empty(), dir.path()).unwrap();
        assert!(paths.iter().all(|p| is_png(p)));
        keep(&paths, "empty-");
    }

    #[test]
    fn odd_values_do_not_panic() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = sample_report();
        r.transfers[0].wall_s = f64::NAN;
        r.transfers[1].goodput_bps = f64::INFINITY;
        r.transfers[2].model_fetch_s = 0.0;
        r.baselines[0].goodput_bps = -1.0;
        r.decisions[0].modeled_crossover_tokens = Some(f64::NAN);
        r.decisions[1].prefix_tokens = 0;
        r.decisions[2].measured_fetch_s = f64::NAN;
        write_all(&r, dir.path()).unwrap();
        // A single point per plot.
        let mut one = sample_report();
        one.transfers.truncate(1);
        one.baselines.clear();
        one.decisions.truncate(1);
        write_all(&one, dir.path()).unwrap();
    }

    #[test]
    fn missing_directory_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_all(&sample_report(), &dir.path().join("nope")).unwrap_err();
        assert!(matches!(err, PlotError::Write { .. }), "{err}");
    }
}
