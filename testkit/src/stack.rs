//! The native stack (`scripts/stack`) for tests: the compose topology on
//! loopback, on a block of free ports, its state in a temporary directory,
//! and stopped (`scripts/stack down`) when dropped.

use crate::process::{TempDir, free_port_block};
use anyhow::{Context, ensure};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A native stack: nginx, three instances, a Redis Cluster of 3 masters
/// and 3 replicas, an exporter per node, the nodes' cgroup counters,
/// Prometheus.
#[derive(Debug)]
pub struct NativeStack {
    dir: TempDir,
    env: Vec<(String, String)>,
    /// nginx: the API.
    pub nginx: u16,
    pub prometheus: u16,
    /// The first instance; the others follow.
    pub api: u16,
    /// The first Redis node; the others follow (the masters first).
    pub redis: u16,
}

/// `scripts/stack`.
pub fn script_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack")
}

impl NativeStack {
    /// Not started yet: `up` starts it. `bin` is the service binary the
    /// instances run; `env` is passed to the script (and so to the
    /// instances: `RL_*`, `OTEL_*`).
    pub fn new(bin: &Path, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let dir = TempDir::new("stack")?;
        // One block, so no two components are handed the same port, and
        // the Redis nodes' cluster bus ports (+10000) free and in range.
        let base = free_port_block(19, true)?;
        let (nginx, prometheus) = (base, base + 1);
        // Three instances, six Redis nodes and their six exporters.
        let (api, redis, exporters) = (base + 2, base + 5, base + 11);
        let mut all = vec![
            ("STACK_DIR".to_owned(), dir.0.display().to_string()),
            ("STACK_NGINX_PORT".to_owned(), nginx.to_string()),
            ("STACK_PROMETHEUS_PORT".to_owned(), prometheus.to_string()),
            ("STACK_API_PORT_BASE".to_owned(), api.to_string()),
            ("STACK_REDIS_PORT_BASE".to_owned(), redis.to_string()),
            ("STACK_EXPORTER_PORT_BASE".to_owned(), exporters.to_string()),
            (
                "STACK_CGROUP_EXPORTER_PORT".to_owned(),
                (base + 17).to_string(),
            ),
            ("STACK_MTAIL_PORT".to_owned(), (base + 18).to_string()),
            ("RATELIMITER_BIN".to_owned(), bin.display().to_string()),
        ];
        all.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        Ok(Self {
            dir,
            env: all,
            nginx,
            prometheus,
            api,
            redis,
        })
    }

    /// Runs `scripts/stack <what>` with `extra` environment; its output,
    /// or an error with the output if it failed.
    pub fn script(&self, what: &str, extra: &[(&str, &str)]) -> anyhow::Result<String> {
        let out = Command::new(script_path())
            .arg(what)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(extra.iter().copied())
            .output()
            .context("cannot run scripts/stack")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(out.status.success(), "scripts/stack {what} failed:\n{text}");
        Ok(text)
    }

    /// `scripts/stack up`.
    pub fn up(&self) -> anyhow::Result<String> {
        self.script("up", &[])
    }

    /// `scripts/stack down`.
    pub fn down(&self) -> anyhow::Result<String> {
        self.script("down", &[])
    }

    /// The pids `up` recorded.
    pub fn pids(&self) -> anyhow::Result<Vec<i32>> {
        let mut pids = Vec::new();
        let run = self.dir.join("run");
        if !run.exists() {
            return Ok(pids);
        }
        for entry in std::fs::read_dir(run)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "pid") {
                // "<pid> <start time>"
                let text = std::fs::read_to_string(&path)?;
                let pid = text.split_whitespace().next().unwrap_or_default();
                pids.push(
                    pid.parse()
                        .with_context(|| format!("{}: {text:?}", path.display()))?,
                );
            }
        }
        Ok(pids)
    }

    /// A URL of the API, through nginx.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.nginx)
    }

    /// Its state directory (logs under `logs/`).
    pub fn dir(&self) -> &Path {
        &self.dir.0
    }
}

impl Drop for NativeStack {
    fn drop(&mut self) {
        // Whatever a test did, leave nothing running.
        let _ = self.down();
    }
}
