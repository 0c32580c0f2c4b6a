//! The process's own CPU, memory and descriptors, in the names every
//! Prometheus client library gives them, read from `/proc` at scrape time:
//! an instance's CPU beside its request rate is what says whether it, not
//! Redis, is the bottleneck, and its open descriptors against the limit
//! what says whether `accept` is about to fail.

use std::fmt::Write;

/// Counter, seconds of CPU (user and system) the process has used.
pub const PROCESS_CPU_SECONDS_TOTAL: &str = "process_cpu_seconds_total";
/// Gauge, the process's resident memory in bytes.
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "process_resident_memory_bytes";
/// Gauge, the process's open file descriptors (connections included).
pub const PROCESS_OPEN_FDS: &str = "process_open_fds";
/// Gauge, the soft limit on open file descriptors.
pub const PROCESS_MAX_FDS: &str = "process_max_fds";
/// Gauge, when the process started, in seconds since the Unix epoch.
pub const PROCESS_START_TIME_SECONDS: &str = "process_start_time_seconds";

/// `/proc`'s clock ticks a second (`USER_HZ`), fixed at 100 by the kernel's
/// user-space ABI on every architecture Linux runs this service on.
const TICKS_PER_SECOND: f64 = 100.0;

/// The CPU ticks used (user + system) and the start, in ticks since boot,
/// from `/proc/<pid>/stat`. The command name (field 2) may hold spaces and
/// parentheses, so the fields are counted from its last `)`.
pub fn stat_ticks(stat: &str) -> Option<(u64, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, utime 14, stime 15, starttime 22.
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some((field(14)? + field(15)?, field(22)?))
}

/// Resident memory in bytes, from the `VmRSS:` line of `/proc/<pid>/status`.
pub fn resident_bytes(status: &str) -> Option<u64> {
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The soft limit on open files in `/proc/<pid>/limits` text (the line
/// `Max open files  <soft>  <hard>  files`); `None` for "unlimited" or no
/// such line.
pub fn open_files_limit(limits: &str) -> Option<u64> {
    limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The boot time, in seconds since the epoch, from `/proc/stat`'s `btime`.
pub fn boot_time(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// Appends this process's series to `out` (Prometheus text). Whatever
/// `/proc` does not give (another OS, a hardened mount) is left out.
pub fn render(out: &mut String) {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let mut series = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    };
    let ticks = read("/proc/self/stat").as_deref().and_then(stat_ticks);
    if let Some((cpu, _)) = ticks {
        series(
            PROCESS_CPU_SECONDS_TOTAL,
            "counter",
            "Total user and system CPU time spent in seconds.",
            cpu as f64 / TICKS_PER_SECOND,
        );
    }
    if let Some(rss) = read("/proc/self/status")
        .as_deref()
        .and_then(resident_bytes)
    {
        series(
            PROCESS_RESIDENT_MEMORY_BYTES,
            "gauge",
            "Resident memory size in bytes.",
            rss as f64,
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        series(
            PROCESS_OPEN_FDS,
            "gauge",
            "Number of open file descriptors.",
            fds.count() as f64,
        );
    }
    if let Some(max) = read("/proc/self/limits")
        .as_deref()
        .and_then(open_files_limit)
    {
        series(
            PROCESS_MAX_FDS,
            "gauge",
            "Maximum number of open file descriptors.",
            max as f64,
        );
    }
    let boot = read("/proc/stat").as_deref().and_then(boot_time);
    if let (Some((_, start)), Some(boot)) = (ticks, boot) {
        series(
            PROCESS_START_TIME_SECONDS,
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            boot as f64 + start as f64 / TICKS_PER_SECOND,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_name_s_last_parenthesis() {
        // A name with a space and a parenthesis, as a thread may be named.
        let stat = "4242 (tokio (rt) 1) S 1 4242 4242 0 -1 4194560 2183 0 0 0 \
                    250 75 0 0 20 0 3 0 123456 41000000 2500 18446744073709551615";
        assert_eq!(stat_ticks(stat), Some((325, 123456)));
        assert_eq!(stat_ticks("4242 (short) S 1"), None);
    }

    #[test]
    fn memory_limits_and_boot_time_are_read_from_their_lines() {
        assert_eq!(
            resident_bytes("Name:\tratelimiter\nVmRSS:\t   10240 kB\n"),
            Some(10 * 1024 * 1024)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(open_files_limit(limits), Some(1024));
        assert_eq!(
            open_files_limit(
                "Max open files            unlimited            unlimited            files"
            ),
            None
        );
        assert_eq!(open_files_limit(""), None);
        assert_eq!(
            boot_time("cpu  1 2 3\nbtime 1796500000\n"),
            Some(1_796_500_000)
        );
    }

    #[test]
    fn this_process_renders_every_series() {
        let mut out = String::new();
        render(&mut out);
        for name in [
            PROCESS_CPU_SECONDS_TOTAL,
            PROCESS_RESIDENT_MEMORY_BYTES,
            PROCESS_OPEN_FDS,
            PROCESS_MAX_FDS,
            PROCESS_START_TIME_SECONDS,
        ] {
            assert!(out.contains(&format!("\n{name} ")), "{name}: {out}");
        }
    }
}
