//! A fraction of a core for a process: the cgroup v1 `cpu` controller's
//! CFS quota, what `cpus: 0.5` does in compose. Needs root and a writable
//! `/sys/fs/cgroup/cpu` (the project's machines have both).

use anyhow::Context;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

const ROOT: &str = "/sys/fs/cgroup/cpu";
/// The CFS period [`CpuLimit::new`] sets (the kernel's default, and what
/// `cpus:` sets in compose): quota is a share of it.
const PERIOD_US: u64 = 100_000;
/// The least quota the kernel takes, per period.
const MIN_QUOTA_US: u64 = 1_000;

/// A cgroup with a CPU quota; removed on drop (its processes must be gone
/// by then, or they stay in it and the directory stays).
#[derive(Debug)]
pub struct CpuLimit {
    dir: PathBuf,
    quota_us: u64,
}

impl CpuLimit {
    /// A new cgroup allowing `cores` of CPU time (at least 1% of one core),
    /// in periods of 100 ms.
    pub fn new(tag: &str, cores: f64) -> anyhow::Result<Self> {
        Self::with_period(tag, cores, PERIOD_US)
    }

    /// A new cgroup allowing `cores` of CPU time in periods of `period_us`
    /// (as compose's `cpu_period` and `cpu_quota`, and `scripts/stack`,
    /// cap the stacks' Redis nodes: 1 ms in every 20 ms); the quota is at
    /// least the kernel's least, 1 ms.
    pub fn with_period(tag: &str, cores: f64, period_us: u64) -> anyhow::Result<Self> {
        anyhow::ensure!(
            cores.is_finite() && cores > 0.0,
            "a CPU limit must be a positive number of cores"
        );
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = PathBuf::from(ROOT).join(format!("rl-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| {
            format!(
                "cannot create {} (needs root and cgroup v1 cpu)",
                dir.display()
            )
        })?;
        let quota_us = ((cores * period_us as f64) as u64).max(MIN_QUOTA_US);
        std::fs::write(dir.join("cpu.cfs_period_us"), period_us.to_string())?;
        std::fs::write(dir.join("cpu.cfs_quota_us"), quota_us.to_string())?;
        Ok(Self { dir, quota_us })
    }

    /// Moves process `pid` (all its threads) into the cgroup.
    pub fn add(&self, pid: u32) -> anyhow::Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("cannot move {pid} into {}", self.dir.display()))
    }

    /// The processes in the cgroup now.
    pub fn pids(&self) -> anyhow::Result<Vec<u32>> {
        let text = std::fs::read_to_string(self.dir.join("cgroup.procs"))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    /// Its directory (what `scripts/stack` records for a node it caps).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// The quota, in microseconds per period.
    pub fn quota_us(&self) -> u64 {
        self.quota_us
    }

    /// Times the cgroup's processes were throttled (`cpu.stat`).
    pub fn throttled(&self) -> anyhow::Result<u64> {
        let stat = std::fs::read_to_string(self.dir.join("cpu.stat"))?;
        stat.lines()
            .find_map(|l| l.strip_prefix("nr_throttled "))
            .and_then(|n| n.trim().parse().ok())
            .context("cpu.stat has no nr_throttled")
    }
}

impl Drop for CpuLimit {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}
