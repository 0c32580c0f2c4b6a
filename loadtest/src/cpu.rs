//! CPU time from `/proc`: the machine's, this process's, and the native
//! stack's components' (from `scripts/stack`'s pid files, children
//! included), so that a run shows whether the host kept headroom while a
//! Redis node was meant to be the bottleneck.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// `/proc` counts CPU time in USER_HZ ticks, 100 a second on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

/// Cumulative CPU ticks at one moment.
#[derive(Debug, Clone)]
pub struct Snapshot {
    at: Instant,
    /// The machine: busy ticks, and all ticks, summed over its CPUs.
    host_busy: u64,
    host_all: u64,
    /// This process (the load generator).
    own: u64,
    /// By component group (`nginx`, `instances`, `redis`, `others`).
    groups: BTreeMap<&'static str, u64>,
}

/// CPU used between two snapshots, in cores.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// The machine's CPUs.
    pub cores: f64,
    /// Busy, all processes.
    pub host: f64,
    /// The load generator.
    pub generator: f64,
    /// The stack's components by group (empty without a native stack).
    pub groups: BTreeMap<&'static str, f64>,
}

impl Usage {
    /// The load generator, nginx and the instances together, as a share of
    /// the machine (`None` without a native stack to read them from).
    pub fn front_share(&self) -> Option<f64> {
        let nginx = self.groups.get("nginx")?;
        let instances = self.groups.get("instances")?;
        Some((self.generator + nginx + instances) / self.cores.max(1.0))
    }
}

/// busy and all ticks from `/proc/stat`'s first line.
fn host_ticks(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    let all: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).unwrap_or(&0);
    Some((all - idle, all))
}

/// (parent pid, utime + stime) from a `/proc/<pid>/stat` line.
fn process_ticks(stat: &str) -> Option<(i32, u64)> {
    // The command may hold spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state(0) ppid(1) ... utime(11) stime(12)
    Some((
        f.get(1)?.parse().ok()?,
        f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?,
    ))
}

fn group_of(name: &str) -> &'static str {
    if name == "nginx" {
        "nginx"
    } else if name.starts_with("api-") {
        "instances"
    } else if name.starts_with("redis-") && !name.starts_with("redis-exporter") {
        "redis"
    } else {
        "others"
    }
}

/// Every process's (parent, ticks).
fn processes() -> BTreeMap<i32, (i32, u64)> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(t) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| process_ticks(&s))
        {
            out.insert(pid, t);
        }
    }
    out
}

/// The machine, this process, and the components whose pid files are in
/// `stack_dir/run` (if given and there).
pub fn snapshot(stack_dir: Option<&Path>) -> Snapshot {
    let (host_busy, host_all) = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| host_ticks(&s))
        .unwrap_or_default();
    let all = processes();
    let own = all.get(&(std::process::id() as i32)).map_or(0, |p| p.1);
    let mut groups = BTreeMap::new();
    let pid_files = stack_dir
        .and_then(|d| std::fs::read_dir(d.join("run")).ok())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "pid"));
    for entry in pid_files {
        let path = entry.path();
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_owned();
        let Some(pid) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| t.split_whitespace().next()?.parse::<i32>().ok())
        else {
            continue;
        };
        // The process and its children (nginx's workers).
        let ticks: u64 = all
            .iter()
            .filter(|(p, (parent, _))| **p == pid || *parent == pid)
            .map(|(_, (_, t))| t)
            .sum();
        *groups.entry(group_of(&name)).or_default() += ticks;
    }
    Snapshot {
        at: Instant::now(),
        host_busy,
        host_all,
        own,
        groups,
    }
}

/// What was used from `a` to `b`.
pub fn between(a: &Snapshot, b: &Snapshot) -> Usage {
    let seconds = b.at.duration_since(a.at).as_secs_f64().max(1e-3);
    let cores = |ticks: u64| ticks as f64 / TICKS_PER_SECOND / seconds;
    let all = b.host_all.saturating_sub(a.host_all) as f64;
    let busy = b.host_busy.saturating_sub(a.host_busy) as f64;
    let machine = std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
    Usage {
        cores: machine,
        host: if all > 0.0 { machine * busy / all } else { 0.0 },
        generator: cores(b.own.saturating_sub(a.own)),
        groups: b
            .groups
            .iter()
            .map(|(g, t)| (*g, cores(t.saturating_sub(*a.groups.get(g).unwrap_or(&0)))))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_lines_are_read_field_by_field() {
        let stat = "cpu  100 5 50 800 20 1 2 3 0 0\ncpu0 1 2 3\n";
        // busy = all - idle - iowait over the first eight fields
        assert_eq!(host_ticks(stat), Some((161, 981)));
        let line = "4242 (nginx: worker (a) b) S 4240 4242 4242 0 -1 4194560 10 0 0 0 7 5 0 0 20 0 1 0 99 0";
        assert_eq!(process_ticks(line), Some((4240, 12)));
        assert_eq!(group_of("api-2"), "instances");
        assert_eq!(group_of("redis-3"), "redis");
        assert_eq!(group_of("redis-exporter-3"), "others");
        assert_eq!(group_of("nginx"), "nginx");
    }

    #[test]
    fn this_process_is_measured_busy() {
        let a = snapshot(None);
        let until = Instant::now() + std::time::Duration::from_millis(300);
        let mut x = 0u64;
        while Instant::now() < until {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        let usage = between(&a, &snapshot(None));
        assert!(x > 0);
        // Some CPU, however busy the machine: not a figure.
        assert!(usage.generator > 0.0, "{usage:?}");
        assert!(usage.host > 0.0, "{usage:?}");
        assert_eq!(usage.front_share(), None);
    }
}
