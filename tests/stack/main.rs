//! The compose stack, checked without a Docker engine (none runs here):
//! `docker-compose config -q`, `nginx -t`, hadolint, and a cross-check that
//! the compose file, nginx, Prometheus and Grafana provisioning agree. Then
//! the same topology run natively (`scripts/stack`), end to end: nginx in
//! front of three instances on a cluster of three masters and three
//! replicas, Prometheus scraping them.
//!
//! `compose.rs` holds the offline checks, `native.rs` the native stack.

mod compose;
mod native;

use serde_yaml::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn run(command: &mut Command) -> (bool, String) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn compose() -> Value {
    serde_yaml::from_str(&read("docker-compose.yml")).unwrap()
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

/// A service's environment, anchors and merge keys resolved.
fn environment(service: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    fn add(env: &Value, out: &mut BTreeMap<String, String>) {
        if let Value::Mapping(map) = env {
            for (k, v) in map {
                let k = text(k);
                if k == "<<" {
                    add(v, out);
                } else {
                    out.entry(k).or_insert_with(|| text(v));
                }
            }
        }
    }
    // Explicit keys win over merged ones: add them first.
    if let Some(env) = service.get("environment") {
        add(env, &mut out);
    }
    if let Some(env) = service.get("<<").and_then(|base| base.get("environment")) {
        add(env, &mut out);
    }
    out
}

/// A service's `key`, its own or from the anchor it merges (`<<: *api`).
fn merged<'a>(service: &'a Value, key: &str) -> Option<&'a Value> {
    service
        .get(key)
        .or_else(|| service.get("<<").and_then(|base| base.get(key)))
}

fn service<'a>(compose: &'a Value, name: &str) -> &'a Value {
    compose["services"]
        .get(name)
        .unwrap_or_else(|| panic!("no service {name}"))
}
