//! A run's results folder: tables as CSV and Markdown, plots as PNG.
//!
//! The plots are drawn with plotters onto a bitmap; text needs a TrueType
//! font, read from the system (Debian `fonts-dejavu-core`). Without one
//! the PNGs are skipped with a note, and the CSV and Markdown still hold
//! every number.

use anyhow::Context;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// A table: written as `<name>.csv` and `<name>.md`, printed as Markdown.
#[derive(Debug, Clone)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Self {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        assert_eq!(cells.len(), self.headers.len(), "a row of the wrong width");
        self.rows.push(cells);
    }

    pub fn markdown(&self) -> String {
        let line = |cells: &[String]| format!("| {} |", cells.join(" | "));
        let mut out = vec![
            line(&self.headers),
            format!("|{}", "---|".repeat(self.headers.len())),
        ];
        out.extend(self.rows.iter().map(|r| line(r)));
        out.join("\n")
    }

    pub fn csv(&self) -> String {
        let field = |c: &String| {
            if c.contains([',', '"', '\n']) {
                format!("\"{}\"", c.replace('"', "\"\""))
            } else {
                c.clone()
            }
        };
        let line = |cells: &[String]| cells.iter().map(field).collect::<Vec<_>>().join(",");
        let mut out = line(&self.headers);
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out.push('\n');
        out
    }

    pub fn write(&self, dir: &Path, name: &str) -> anyhow::Result<()> {
        for (ext, text) in [("csv", self.csv()), ("md", self.markdown() + "\n")] {
            let path = dir.join(format!("{name}.{ext}"));
            std::fs::write(&path, text)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    }
}

/// Microseconds as milliseconds with two decimals, `-` for none.
pub fn ms_from_us(us: Option<u64>) -> String {
    us.map_or("-".into(), |us| format!("{:.2}", us as f64 / 1000.0))
}

/// Seconds as milliseconds with two decimals, `-` for none.
pub fn ms_from_secs(s: Option<f64>) -> String {
    s.map_or("-".into(), |s| format!("{:.2}", s * 1000.0))
}

/// `part` of `whole` as a percentage with one decimal, `-` of nothing.
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1}", part as f64 * 100.0 / whole as f64)
    }
}

/// `20261202T231500Z`: a folder name that sorts by time.
pub fn timestamp(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

const FONT_PATHS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers a system font for plot text, once. `false`: none found.
fn font() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let path = std::env::var("LOADTEST_FONT")
            .ok()
            .into_iter()
            .chain(FONT_PATHS.iter().map(|p| (*p).to_owned()))
            .find(|p| Path::new(p).is_file());
        let Some(bytes) = path.and_then(|p| std::fs::read(p).ok()) else {
            return false;
        };
        // plotters keeps registered fonts for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    })
}

/// A line per series, on one chart.
#[derive(Debug, Clone)]
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    /// Vertical markers (x, label).
    pub marks: Vec<(f64, String)>,
    /// The x axis's span, if not the data's (charts of one run line up).
    pub x_range: Option<(f64, f64)>,
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        (0.0, 1.0)
    } else if hi - lo < 1e-12 {
        (lo.min(0.0), hi + 1.0)
    } else {
        (lo.min(0.0), hi * 1.05)
    }
}

fn draw<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    chart: &Chart,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let points = || chart.series.iter().flat_map(|(_, s)| s.iter());
    let (x0, x1) = chart
        .x_range
        .unwrap_or_else(|| range(points().map(|p| p.0)));
    let (y0, y1) = range(points().map(|p| p.1));
    let mut c = ChartBuilder::on(area)
        .caption(chart.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    c.configure_mesh()
        .x_desc(chart.x_label)
        .y_desc(chart.y_label)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, (x, label)) in chart.marks.iter().enumerate() {
        let colour = if i % 2 == 0 { RED } else { GREEN };
        c.draw_series(LineSeries::new(
            [(*x, y0), (*x, y1)],
            colour.stroke_width(2),
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label(label.clone())
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
    }
    for (i, (name, series)) in chart.series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        c.draw_series(LineSeries::new(
            series.iter().copied(),
            colour.stroke_width(2),
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label(name.clone())
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
        c.draw_series(series.iter().map(|p| Circle::new(*p, 2, colour.filled())))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// Charts stacked in one PNG. Returns the path, or `None` (with a note
/// printed) when no font is installed.
pub fn plot(path: &Path, charts: &[Chart]) -> anyhow::Result<Option<PathBuf>> {
    if !font() {
        println!(
            "note: no TrueType font (apt-get install fonts-dejavu-core, or set LOADTEST_FONT), so no {}",
            path.display()
        );
        return Ok(None);
    }
    {
        let root = BitMapBackend::new(path, (960, 360 * charts.len() as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        for (area, chart) in root.split_evenly((charts.len(), 1)).iter().zip(charts) {
            draw(area, chart)?;
        }
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(Some(path.to_path_buf()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tables_render_as_markdown_and_quoted_csv() {
        let mut t = Table::new(&["a", "b"]);
        t.row(vec!["1".into(), "x,y".into()]);
        assert_eq!(t.markdown(), "| a | b |\n|---|---|\n| 1 | x,y |");
        assert_eq!(t.csv(), "a,b\n1,\"x,y\"\n");
    }

    #[test]
    fn timestamps_are_utc_civil_time() {
        let t = UNIX_EPOCH + Duration::from_secs(1_796_253_300); // 2026-12-02 23:15:00 UTC
        assert_eq!(timestamp(t), "20261202T231500Z");
        assert_eq!(timestamp(UNIX_EPOCH), "19700101T000000Z");
        assert_eq!(
            timestamp(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "20000229T000000Z"
        );
    }
}
