//! Needs root and cgroup v1: the Redis it scrapes is CPU-capped as in the stacks.
//!
//! The dashboards and alerts, checked without Grafana: promtool on the
//! config and rules (and every alert's unit test), the dashboards' JSON,
//! every alert's runbook link, and every panel's query evaluated by a real
//! Prometheus that scraped a real instance, a real Redis (CPU-capped by a
//! cgroup, as in both stacks), its redis_exporter and the stack's cgroup
//! exporter under load, with the repository's relabelling. (Grafana cannot
//! be installed here; Prometheus, promtool and the exporter are Debian
//! packages, which `scripts/test` installs.) The files are checked here;
//! what runs on a real Prometheus is in `live.rs`.

mod live;

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn dashboards() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(repo("grafana/dashboards")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let json: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()));
        out.push((
            path.file_name().unwrap().to_string_lossy().into_owned(),
            json,
        ));
    }
    assert!(out.len() >= 2, "the overview and Redis dashboards");
    out
}

/// Every (dashboard, panel title, expr) of every panel, rows included.
fn panel_queries() -> Vec<(String, String, String)> {
    fn walk(file: &str, panels: &[Value], out: &mut Vec<(String, String, String)>) {
        for panel in panels {
            let title = panel["title"].as_str().unwrap_or_default().to_owned();
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"].as_str().unwrap_or_default().to_owned();
                out.push((file.to_owned(), title.clone(), expr));
            }
            walk(file, panel["panels"].as_array().map_or(&[], |v| v), out);
        }
    }
    let mut out = Vec::new();
    for (file, json) in dashboards() {
        walk(&file, json["panels"].as_array().unwrap(), &mut out);
    }
    out
}

fn rule_exprs() -> Vec<String> {
    // `expr:` is a one-liner or a `|` block indented below it.
    let text = read("prometheus/rules/ratelimiter.yml");
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim().strip_prefix("expr:") else {
            continue;
        };
        if rest.trim() == "|" {
            let indent = line.len() - line.trim_start().len();
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .copied()
                .collect();
            out.push(block.join("\n"));
        } else {
            out.push(rest.trim().to_owned());
        }
    }
    assert!(out.len() >= 5, "{out:?}");
    out
}

fn promtool(args: &[&str]) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(repo(""))
        .output()
        .expect("promtool is installed (Debian package prometheus)");
    assert!(
        out.status.success(),
        "promtool {args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn promtool_accepts_the_config_and_rules_and_every_alert_test_passes() {
    promtool(&["check", "config", "prometheus/prometheus.yml"]);
    promtool(&["check", "rules", "prometheus/rules/ratelimiter.yml"]);
    promtool(&["test", "rules", "prometheus/tests/ratelimiter.yml"]);
}

/// GitHub's anchor for a heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Where the Prometheus these tests start says the runbooks are.
const SERVED_RUNBOOKS: &str = "http://runbooks.test:8080";

/// How every alert's runbook link starts: the base Prometheus is given
/// (prometheus.yml's `runbook_base_url`), then the repository path.
const RUNBOOK_BASE: &str = "{{ $externalLabels.runbook_base_url }}/";

#[test]
fn every_alert_links_to_its_runbook_section_and_has_a_test() {
    let rules = read("prometheus/rules/ratelimiter.yml");
    let tests = read("prometheus/tests/ratelimiter.yml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(str::trim)
        .collect();
    let links: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("runbook_url:"))
        .map(|l| l.trim().trim_matches('"'))
        .collect();
    assert_eq!(alerts.len(), links.len(), "an alert without a runbook link");
    for (alert, link) in alerts.iter().zip(&links) {
        // Absolute: the served runbooks' base, then the page's path.
        let path = link
            .strip_prefix(RUNBOOK_BASE)
            .unwrap_or_else(|| panic!("{alert}: {link} is not under {RUNBOOK_BASE}"));
        let (file, section) = path.split_once('#').expect("a link to a section");
        let text = read(file);
        assert!(
            text.lines()
                .filter_map(|l| l
                    .trim_start_matches('#')
                    .strip_prefix(' ')
                    .filter(|_| l.starts_with('#')))
                .any(|h| anchor(h) == section),
            "{alert}: {file} has no heading for #{section}"
        );
        assert!(
            tests.contains(&format!("alertname: {alert}")),
            "{alert} has no promtool test"
        );
    }
}

#[test]
fn the_dashboards_are_grafana_json_on_the_provisioned_datasources() {
    let datasources = read("grafana/provisioning/datasources/datasources.yml");
    let provisioned: BTreeSet<&str> = datasources
        .lines()
        .filter_map(|l| l.trim().strip_prefix("uid:"))
        .map(str::trim)
        .collect();
    assert_eq!(provisioned, BTreeSet::from(["jaeger", "prometheus"]));
    let types = BTreeSet::from([
        "row",
        "timeseries",
        "stat",
        "gauge",
        "table",
        "text",
        "bargauge",
    ]);
    for (file, json) in dashboards() {
        assert!(
            json["uid"].is_string() && json["title"].is_string(),
            "{file}"
        );
        assert!(
            json["schemaVersion"].as_u64().unwrap_or(0) >= 36,
            "{file}: schemaVersion"
        );
        let mut ids = BTreeSet::new();
        let mut panels: Vec<&Value> = json["panels"].as_array().unwrap().iter().collect();
        let mut i = 0;
        while i < panels.len() {
            let panel = panels[i];
            i += 1;
            let title = panel["title"].as_str().unwrap_or_default();
            assert!(
                ids.insert(panel["id"].as_u64().unwrap()),
                "{file}: duplicate id at {title}"
            );
            let kind = panel["type"].as_str().unwrap();
            assert!(types.contains(kind), "{file}: {title}: panel type {kind}");
            let grid = &panel["gridPos"];
            assert!(
                grid["w"].as_u64().unwrap() <= 24 && grid["h"].as_u64().is_some(),
                "{file}: {title}"
            );
            if let Some(inner) = panel["panels"].as_array() {
                panels.extend(inner);
            }
            if kind == "row" {
                continue;
            }
            let uid = panel["datasource"]["uid"].as_str().unwrap_or_default();
            assert!(
                provisioned.contains(uid),
                "{file}: {title}: datasource {uid}"
            );
            let targets = panel["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{file}: {title} has no query");
            for t in targets {
                assert!(
                    !t["expr"].as_str().unwrap_or_default().is_empty(),
                    "{file}: {title}"
                );
                assert!(t["refId"].is_string(), "{file}: {title}");
            }
        }
        for variable in json["templating"]["list"].as_array().unwrap() {
            let uid = variable["datasource"]["uid"].as_str().unwrap_or_default();
            assert!(
                provisioned.contains(uid),
                "{file}: variable {}",
                variable["name"]
            );
        }
    }
    // The overview keeps a row for the hot keys.
    let overview = read("grafana/dashboards/ratelimiter-overview.json");
    assert!(overview.contains("\"title\": \"Hot keys\""));
}

/// Metric names in PromQL: ours, the exporter's, and Prometheus's `up`.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_alphabetic() || bytes[i] == '_' {
            let start = i;
            // A recording rule's name holds colons.
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_' || bytes[i] == ':')
            {
                i += 1;
            }
            let word: String = bytes[start..i].iter().collect();
            // Skip label values and names inside selectors' quotes.
            let quoted = bytes[..start].iter().filter(|&&c| c == '"').count() % 2 == 1;
            if !quoted
                && (word.starts_with("ratelimit_")
                    || word.starts_with("http_server_")
                    || word.starts_with("redis_")
                    || word.starts_with("container_")
                    || word.starts_with("process_")
                    || word.starts_with("nginx_")
                    || word.contains(':')
                    || word == "up")
                && bytes.get(i) != Some(&'=')
            {
                out.insert(word);
            }
        } else if bytes[i].is_ascii_digit() {
            // A number or a duration ("5m:1m" in a subquery) is no name.
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == ':' || bytes[i] == '.')
            {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out
}
