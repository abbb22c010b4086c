//! `tollgate simulate --plot FILE`: per (name, key), the value over the simulated time as an
//! SVG: the tokens the limit holds (drawn with the algebra between requests), each request
//! marked granted, refused or reserved, and the capacity line. Black on white, so that it
//! reads when printed.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use tollgate::Config;
use tollgate::core::{State, evaluate};

use crate::stats::Taken;

/// One request of a series: when, how many, what became of it, and the state after it.
#[derive(Clone, Debug)]
pub struct Point {
    /// Simulated time (ms).
    pub at: f64,
    /// Tokens asked for.
    pub count: f64,
    /// The decision.
    pub outcome: Taken,
    /// The operation (`limit`, `check`, `transaction`).
    pub op: &'static str,
    /// The state right after the request (as stored, or as it stands when refused): the
    /// value at any later time follows from it by the algebra.
    pub state: State,
}

/// The requests of each (name, key), in the order they came, with the config of its states
/// (one shard's, for a sharded limit).
#[derive(Default)]
pub struct Recording {
    series: BTreeMap<(String, String), (Config, Vec<Point>)>,
}

/// At most this many series are drawn (the first in name order); the rest are counted.
pub const MAX_SERIES: usize = 24;

impl Recording {
    /// Records a request of (name, key).
    pub fn record(&mut self, name: &str, key: &str, config: Config, point: Point) {
        self.series
            .entry((name.to_owned(), key.to_owned()))
            .or_insert_with(|| (config, Vec::new()))
            .1
            .push(point);
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.series.is_empty()
    }

    /// The SVG.
    pub fn svg(&self) -> String {
        const WIDTH: f64 = 960.0;
        const PANEL: f64 = 230.0;
        const LEFT: f64 = 70.0;
        const RIGHT: f64 = 20.0;
        const TOP: f64 = 60.0;
        let shown: Vec<_> = self.series.iter().take(MAX_SERIES).collect();
        let (t0, t1) = self
            .series
            .values()
            .flat_map(|(_, points)| points.iter().map(|p| p.at))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), t| (lo.min(t), hi.max(t)));
        let (t0, t1) = if t0.is_finite() { (t0, t1.max(t0 + 1.0)) } else { (0.0, 1.0) };
        let height = TOP + PANEL * shown.len().max(1) as f64 + 20.0;
        let x = |t: f64| LEFT + (t - t0) / (t1 - t0) * (WIDTH - LEFT - RIGHT);
        let mut svg = String::new();
        let _ = write!(
            svg,
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">
<style>
.granted {{ fill: #1a7f37; }} .refused {{ fill: #fff; stroke: #cf222e; stroke-width: 2; }} .reserved {{ fill: #bc4c00; }}
.value {{ fill: none; stroke: #000; stroke-width: 1.5; }} .capacity {{ stroke: #555; stroke-dasharray: 6 4; }}
.axis {{ stroke: #000; }} .grid {{ stroke: #ddd; }} text {{ fill: #000; }}
</style>
<rect width="100%" height="100%" fill="#fff"/>
<text x="{LEFT}" y="20" font-size="15">tollgate simulate: tokens per (name, key) over simulated time</text>
<circle cx="{lx1}" cy="40" r="5" class="granted"/><text x="{lt1}" y="44">granted</text>
<circle cx="{lx2}" cy="40" r="5" class="refused"/><text x="{lt2}" y="44">refused</text>
<circle cx="{lx3}" cy="40" r="5" class="reserved"/><text x="{lt3}" y="44">reserved (booked ahead)</text>
<line x1="{lx4}" y1="40" x2="{lx4e}" y2="40" class="capacity"/><text x="{lt4}" y="44">capacity</text>
"##,
            lx1 = LEFT + 5.0,
            lt1 = LEFT + 14.0,
            lx2 = LEFT + 95.0,
            lt2 = LEFT + 104.0,
            lx3 = LEFT + 180.0,
            lt3 = LEFT + 189.0,
            lx4 = LEFT + 360.0,
            lx4e = LEFT + 390.0,
            lt4 = LEFT + 396.0,
        );
        for (i, ((name, key), (config, points))) in shown.iter().enumerate() {
            let top = TOP + PANEL * i as f64 + 20.0;
            let bottom = top + PANEL - 60.0;
            // A sharded limit's states are one shard's.
            let whole = *config;
            let config = &if whole.shards() > 1 { whole.per_shard() } else { whole };
            let capacity = config.capacity();
            let at = |p: &Point| evaluate(config, Some(p.state), 0.0, p.at, 0.0, false).state.value;
            let lowest = points.iter().map(at).fold(0.0_f64, f64::min);
            let span = (capacity - lowest).max(1e-9);
            let y = |v: f64| bottom - (v - lowest) / span * (bottom - top);
            let title = if key.is_empty() { name.clone() } else { format!("{name} / {key}") };
            let _ = writeln!(
                svg,
                r#"<g class="series" data-name="{}" data-key="{}">"#,
                escape(name),
                escape(key)
            );
            let _ = writeln!(
                svg,
                r#"<text x="{LEFT}" y="{}" font-size="13" font-weight="bold">{}</text><text x="{}" y="{}" text-anchor="end">{}</text>"#,
                top - 6.0,
                escape(&title),
                WIDTH - RIGHT,
                top - 6.0,
                escape(&describe(&whole))
            );
            // Axes, zero, capacity.
            let _ = writeln!(
                svg,
                r#"<line x1="{LEFT}" y1="{bottom}" x2="{}" y2="{bottom}" class="axis"/><line x1="{LEFT}" y1="{top}" x2="{LEFT}" y2="{bottom}" class="axis"/>"#,
                WIDTH - RIGHT
            );
            if lowest < 0.0 {
                let _ = writeln!(
                    svg,
                    r#"<line x1="{LEFT}" y1="{0}" x2="{1}" y2="{0}" class="grid"/><text x="{2}" y="{3}" text-anchor="end">0</text>"#,
                    y(0.0),
                    WIDTH - RIGHT,
                    LEFT - 6.0,
                    y(0.0) + 4.0
                );
                let _ = writeln!(
                    svg,
                    r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
                    LEFT - 6.0,
                    bottom + 4.0,
                    tollgate::core::fmt_number((lowest * 100.0).round() / 100.0)
                );
            } else {
                let _ = writeln!(
                    svg,
                    r#"<text x="{}" y="{}" text-anchor="end">0</text>"#,
                    LEFT - 6.0,
                    bottom + 4.0
                );
            }
            let _ = writeln!(
                svg,
                r#"<line x1="{LEFT}" y1="{0}" x2="{1}" y2="{0}" class="capacity"/><text x="{2}" y="{3}" text-anchor="end">{4}</text>"#,
                y(capacity),
                WIDTH - RIGHT,
                LEFT - 6.0,
                y(capacity) + 4.0,
                tollgate::core::fmt_number(capacity)
            );
            // Time ticks: start, middle, end, in seconds.
            for t in [t0, (t0 + t1) / 2.0, t1] {
                let _ = writeln!(
                    svg,
                    r#"<text x="{}" y="{}" text-anchor="middle">{} s</text>"#,
                    x(t),
                    bottom + 18.0,
                    tollgate::core::fmt_number(((t - t0) / 10.0).round() / 100.0)
                );
            }
            // The value: after each request, refilling by the algebra until the next.
            let mut path = String::new();
            for (j, p) in points.iter().enumerate() {
                let end = points.get(j + 1).map_or(t1, |next| next.at);
                let _ = write!(
                    path,
                    "{}{:.1},{:.1}",
                    if j == 0 { "M" } else { " L" },
                    x(p.at),
                    y(at(p))
                );
                const STEPS: usize = 40;
                for step in 1..=STEPS {
                    let t = p.at + (end - p.at) * step as f64 / STEPS as f64;
                    let v = evaluate(config, Some(p.state), 0.0, t, 0.0, false).state.value;
                    let _ = write!(path, " L{:.1},{:.1}", x(t), y(v));
                }
            }
            let _ = writeln!(svg, r#"<path class="value" d="{path}"/>"#);
            for p in points.iter() {
                let _ = writeln!(
                    svg,
                    r#"<circle class="{}" cx="{:.1}" cy="{:.1}" r="4"><title>{} {} at {} ms: {}, {} left</title></circle>"#,
                    p.outcome.name(),
                    x(p.at),
                    y(at(p)),
                    p.op,
                    tollgate::core::fmt_number(p.count),
                    tollgate::core::fmt_number(p.at),
                    p.outcome.name(),
                    tollgate::core::fmt_number(at(p))
                );
            }
            svg.push_str("</g>\n");
        }
        if self.series.len() > shown.len() {
            let _ = writeln!(
                svg,
                r#"<text x="{LEFT}" y="{}">and {} more (name, key) not drawn</text>"#,
                height - 6.0,
                self.series.len() - shown.len()
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// A config in words: "10 a minute, bursts of 3".
pub fn describe(config: &Config) -> String {
    let fmt = tollgate::core::fmt_number;
    let period = config.period();
    let per = [
        (86_400_000.0, "a day"),
        (3_600_000.0, "an hour"),
        (60_000.0, "a minute"),
        (1_000.0, "a second"),
    ]
    .iter()
    .find(|(ms, _)| period == *ms)
    .map_or_else(|| format!("per {} ms", fmt(period)), |(_, per)| (*per).to_owned());
    let kind = match config.kind() {
        tollgate::Kind::TokenBucket => "token bucket",
        tollgate::Kind::FixedWindow => "fixed window",
    };
    let mut text = format!("{kind}: {} {per}", fmt(config.rate()));
    if config.capacity() != config.rate() {
        let _ = write!(text, ", bursts of {}", fmt(config.capacity()));
    }
    if config.shards() > 1 {
        let _ = write!(text, " ({} shards; one shown)", config.shards());
    }
    text
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}
