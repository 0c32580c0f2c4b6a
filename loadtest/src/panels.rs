//! The overview dashboard's panels without Grafana: each panel's queries
//! read from `grafana/dashboards/ratelimiter-overview.json`, its variables
//! filled, evaluated on the stack's Prometheus.
//!
//! `drill` and `hotkey` report what these panels showed, so their tables
//! are the dashboard's, and `loadtest panels` prints them for a native
//! stack that has no Grafana: the queries filled in, ready for Prometheus's
//! own page or `curl`, and with `--eval` their values now.

use crate::prom::Prometheus;
use anyhow::Context;
use clap::Args;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// The window that stands for Grafana's `$__rate_interval` (three scrapes
/// of 5 s: the shortest a `rate` reads reliably).
pub const RATE_INTERVAL: &str = "15s";

/// One panel: its row, its title, and its queries with their legends.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    pub row: String,
    pub title: String,
    /// (query, legend), variables filled.
    pub queries: Vec<(String, String)>,
}

/// Grafana's variables in a query, filled: the rate interval, and every
/// instance and node (the dashboard's "All").
pub fn fill(expr: &str, rate_interval: &str) -> String {
    expr.replace("$__rate_interval", rate_interval)
        .replace("$instance", ".*")
        .replace("$node", ".*")
}

/// The panels of a dashboard's JSON, in order, their queries filled.
pub fn parse(json: &str, rate_interval: &str) -> anyhow::Result<Vec<Panel>> {
    let json: Value = serde_json::from_str(json).context("the dashboard is not JSON")?;
    let mut row = String::new();
    let mut out = Vec::new();
    for panel in json["panels"].as_array().into_iter().flatten() {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        if panel["type"] == "row" {
            row = title;
            continue;
        }
        let queries = panel["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| {
                Some((
                    fill(t["expr"].as_str()?, rate_interval),
                    t["legendFormat"].as_str().unwrap_or_default().to_owned(),
                ))
            })
            .collect();
        out.push(Panel {
            row: row.clone(),
            title,
            queries,
        });
    }
    Ok(out)
}

/// The overview dashboard's panels.
pub fn overview(rate_interval: &str) -> anyhow::Result<Vec<Panel>> {
    let path = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../grafana/dashboards/ratelimiter-overview.json"
    ));
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse(&text, rate_interval)
}

/// Query `i` of the panel titled `title`.
pub fn query<'a>(panels: &'a [Panel], title: &str, i: usize) -> anyhow::Result<&'a str> {
    panels
        .iter()
        .find(|p| p.title == title)
        .and_then(|p| p.queries.get(i))
        .map(|(q, _)| q.as_str())
        .with_context(|| format!("the overview dashboard has no panel {title:?} (query {i})"))
}

/// A panel query over a run: each series (by its labels) and its points
/// (seconds since `start`, value).
pub type Series = Vec<(BTreeMap<String, String>, Vec<(f64, f64)>)>;

/// `expr` every 5 s from `start` to `end`, times in seconds since `start`.
pub async fn over_run(
    prometheus: &Prometheus,
    expr: &str,
    start: SystemTime,
    end: SystemTime,
) -> anyhow::Result<Series> {
    let t0 = start.duration_since(SystemTime::UNIX_EPOCH)?.as_secs_f64();
    Ok(prometheus
        .query_range(expr, start, end, Duration::from_secs(5))
        .await?
        .into_iter()
        .map(|(labels, points)| {
            (
                labels,
                points.into_iter().map(|(t, v)| (t - t0, v)).collect(),
            )
        })
        .collect())
}

/// The mean of `points` within `[from, until)` seconds.
pub fn mean(points: &[(f64, f64)], from: f64, until: f64) -> Option<f64> {
    let inside: Vec<f64> = points
        .iter()
        .filter(|(t, v)| *t >= from && *t < until && v.is_finite())
        .map(|(_, v)| *v)
        .collect();
    (!inside.is_empty()).then(|| inside.iter().sum::<f64>() / inside.len() as f64)
}

/// The points of the series whose label `name` is `value`, together.
pub fn with_label(series: &Series, name: &str, value: &str) -> Vec<(f64, f64)> {
    series
        .iter()
        .filter(|(l, _)| l.get(name).map(String::as_str) == Some(value))
        .flat_map(|(_, p)| p.iter().copied())
        .collect()
}

/// The labels of the series whose label `name` is `value` with the
/// highest mean within `[from, until)` seconds.
pub fn highest<'a>(
    series: &'a Series,
    name: &str,
    value: &str,
    from: f64,
    until: f64,
) -> Option<&'a BTreeMap<String, String>> {
    let m = |p: &[(f64, f64)]| mean(p, from, until).unwrap_or(0.0);
    series
        .iter()
        .filter(|(l, _)| l.get(name).map(String::as_str) == Some(value))
        .max_by(|a, b| m(&a.1).total_cmp(&m(&b.1)))
        .map(|(l, _)| l)
}

/// Every series' points together.
pub fn all(series: &Series) -> Vec<(f64, f64)> {
    series.iter().flat_map(|(_, p)| p.iter().copied()).collect()
}

/// The alerts firing over a run: each series (alert name and its labels)
/// and the seconds at which it was firing.
pub type Firing = Vec<(BTreeMap<String, String>, Vec<f64>)>;

/// `RateLimitHotKey (tenant-08 api)`, or the alert and how many series.
pub fn alert_names(firing: &Firing, from: f64, until: f64) -> String {
    let mut by_name: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (labels, times) in firing {
        if !times.iter().any(|t| *t >= from && *t < until) {
            continue;
        }
        let name = labels.get("alertname").map_or("?", String::as_str);
        let what = match (labels.get("key"), labels.get("policy")) {
            (Some(k), Some(p)) => format!("{k} {p}"),
            _ => String::new(),
        };
        by_name.entry(name).or_default().push(what);
    }
    if by_name.is_empty() {
        return "none".into();
    }
    by_name
        .into_iter()
        .map(|(name, whats)| {
            let mut keys: Vec<String> = whats.into_iter().filter(|w| !w.is_empty()).collect();
            keys.sort();
            keys.dedup();
            if keys.is_empty() {
                name.to_owned()
            } else {
                format!("{name} ({})", keys.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The alerts that fired from `start` to `end`, every 5 s.
pub async fn firing(
    prometheus: &Prometheus,
    start: SystemTime,
    end: SystemTime,
) -> anyhow::Result<Firing> {
    Ok(
        over_run(prometheus, "ALERTS{alertstate=\"firing\"}", start, end)
            .await?
            .into_iter()
            .map(|(labels, points)| (labels, points.into_iter().map(|(t, _)| t).collect()))
            .collect(),
    )
}

#[derive(Debug, Args)]
pub struct PanelsArgs {
    /// Only the panels of rows whose title contains this (e.g. "Hot keys")
    #[arg(long)]
    pub row: Option<String>,
    /// Evaluate each query on Prometheus now and print its series
    #[arg(long)]
    pub eval: bool,
    /// What stands for Grafana's $__rate_interval
    #[arg(long, default_value = "1m")]
    pub rate_interval: String,
    /// The stack's Prometheus (for --eval)
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub prometheus: String,
}

/// `loadtest panels`: the overview dashboard in a terminal.
pub async fn print(args: PanelsArgs) -> anyhow::Result<()> {
    let panels = overview(&args.rate_interval)?;
    let prometheus = Prometheus::new(&args.prometheus);
    if args.eval {
        anyhow::ensure!(
            prometheus.ready().await,
            "no Prometheus at {}: start the stack, or point --prometheus at it",
            args.prometheus
        );
    }
    let mut shown = 0;
    let mut row = None;
    for panel in &panels {
        if args
            .row
            .as_ref()
            .is_some_and(|r| !panel.row.contains(r.as_str()))
        {
            continue;
        }
        if row != Some(&panel.row) {
            println!("## {}\n", panel.row);
            row = Some(&panel.row);
        }
        println!("### {}", panel.title);
        for (expr, legend) in &panel.queries {
            println!("{expr}");
            if args.eval {
                let mut samples = prometheus.query(expr, SystemTime::now()).await?;
                samples.sort_by(|a, b| b.1.total_cmp(&a.1));
                if samples.is_empty() {
                    println!("    (no data)");
                }
                for (labels, value) in samples.iter().take(10) {
                    println!(
                        "    {:>12}  {}",
                        format!("{value:.4}"),
                        legend_of(legend, labels)
                    );
                }
            }
        }
        println!();
        shown += 1;
    }
    anyhow::ensure!(shown > 0, "no panel in a row matching {:?}", args.row);
    Ok(())
}

/// A Grafana legend (`{{node}} ...`) with the series' labels put in.
pub fn legend_of(legend: &str, labels: &BTreeMap<String, String>) -> String {
    let mut out = legend.to_owned();
    for (k, v) in labels {
        out = out.replace(&format!("{{{{{k}}}}}"), v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_come_with_their_row_and_their_queries_filled() {
        let json = r#"{"panels": [
            {"type": "row", "title": "Hot keys"},
            {"type": "timeseries", "title": "Calls", "targets": [
                {"expr": "sum by (node) (rate(x{node=~\"$node\", instance=~\"$instance\"}[$__rate_interval]))", "legendFormat": "{{node}}"}
            ]}
        ]}"#;
        let panels = parse(json, "1m").unwrap();
        assert_eq!(panels.len(), 1);
        assert_eq!(panels[0].row, "Hot keys");
        assert_eq!(
            panels[0].queries[0].0,
            "sum by (node) (rate(x{node=~\".*\", instance=~\".*\"}[1m]))"
        );
        assert_eq!(query(&panels, "Calls", 0).unwrap(), panels[0].queries[0].0);
        assert!(query(&panels, "Calls", 1).is_err());
        let labels = BTreeMap::from([("node".to_owned(), "127.0.0.1:7001".to_owned())]);
        assert_eq!(legend_of("{{node}} calls", &labels), "127.0.0.1:7001 calls");
    }

    #[test]
    fn the_overview_dashboard_has_no_variable_left_once_filled() {
        for panel in overview("1m").unwrap() {
            for (expr, _) in &panel.queries {
                assert!(!expr.contains('$'), "{}: {expr}", panel.title);
            }
        }
    }

    #[test]
    fn a_mean_covers_its_interval_only() {
        let points = [(0.0, 1.0), (5.0, 3.0), (10.0, 100.0), (7.0, f64::NAN)];
        assert_eq!(mean(&points, 0.0, 10.0), Some(2.0));
        assert_eq!(mean(&points, 20.0, 30.0), None);
    }

    #[test]
    fn the_highest_series_is_the_highest_within_the_interval() {
        let series = |key: &str, kind: &str, points: Vec<(f64, f64)>| {
            let l = BTreeMap::from([
                ("key".to_owned(), key.to_owned()),
                ("key_kind".to_owned(), kind.to_owned()),
            ]);
            (l, points)
        };
        let share: Series = vec![
            series("h:0a1b2c3d", "ip", vec![(10.0, 0.9), (50.0, 0.1)]),
            series("h:ffee0011", "ip", vec![(10.0, 0.2), (50.0, 0.8)]),
            series("tenant-08", "api_key", vec![(10.0, 1.0), (50.0, 1.0)]),
        ];
        let key = |from, until| highest(&share, "key_kind", "ip", from, until).map(|l| &l["key"]);
        assert_eq!(key(0.0, 20.0).unwrap(), "h:0a1b2c3d");
        assert_eq!(key(40.0, 60.0).unwrap(), "h:ffee0011");
        assert!(highest(&share, "key_kind", "unknown_api_key", 0.0, 60.0).is_none());
    }

    #[test]
    fn alerts_are_named_with_their_keys_once() {
        let series = |name: &str, key: Option<&str>, times: Vec<f64>| {
            let mut l = BTreeMap::from([("alertname".to_owned(), name.to_owned())]);
            if let Some(k) = key {
                l.insert("key".into(), k.into());
                l.insert("policy".into(), "api".into());
            }
            (l, times)
        };
        let firing = vec![
            series("RateLimitHotKey", Some("tenant-08"), vec![100.0, 105.0]),
            series("RateLimitCheckSlow", None, vec![110.0]),
            series("RateLimitCheckSlow", None, vec![110.0]),
            series("RateLimitHotKey", Some("tenant-15"), vec![10.0]),
        ];
        assert_eq!(
            alert_names(&firing, 60.0, 200.0),
            "RateLimitCheckSlow; RateLimitHotKey (tenant-08 api)"
        );
        assert_eq!(alert_names(&firing, 200.0, 300.0), "none");
    }
}
