//! Needs root and cgroup v1 for `mitigations.rs`, which caps its cluster's
//! masters; the rest runs as any user.
//!
//! The load commands end to end, small and bounded: real redis-server, real
//! instance processes, loopback only. One binary, so that they run one at
//! a time (`ONE_AT_A_TIME`): the race hammer, `compare`, `capacity` and
//! `lua-bench` here; Redis's and a cluster's faults in `faults.rs`; the
//! hot-key mitigations, which need root, in `mitigations.rs`; `http-cost`
//! in `httpcost.rs`.

mod faults;
mod httpcost;
mod mitigations;

use std::collections::HashMap;
use std::process::Command;
use std::sync::Mutex;

const BIN: &str = env!("CARGO_BIN_EXE_loadtest");

/// The load commands run one at a time: each starts its own processes, and
/// two at once on a 2-core machine would measure each other.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn row<'a>(table: &'a str, backend: &str, k: usize, c: usize) -> Vec<&'a str> {
    table
        .lines()
        .find(|l| l.starts_with(&format!("| {backend} | {k} | {c} |")))
        .unwrap_or_else(|| panic!("no row for {backend} K={k} C={c} in:\n{table}"))
        .split('|')
        .map(str::trim)
        .filter(|f| !f.is_empty())
        .collect()
}

#[test]
fn race_shows_memory_multiplying_and_lua_holding_the_budget() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("loadtest-race-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("race.csv");
    let out = Command::new(BIN)
        .args([
            "race",
            "--backends",
            "memory,lua",
            "--instances",
            "2",
            "--concurrency",
            "8",
        ])
        .args(["--budget", "20", "--requests", "120", "--csv"])
        .arg(&csv)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    // | backend | K | C | requests | budget | admitted | over | ratio | errors |
    assert_eq!(
        row(&table, "memory", 2, 8)[5],
        "40",
        "2 instances, 2 buckets"
    );
    assert_eq!(row(&table, "lua", 2, 8)[5], "20", "one shared bucket");
    assert_eq!(row(&table, "lua", 2, 8)[8], "0");
    let csv = std::fs::read_to_string(&csv).unwrap();
    assert!(csv.starts_with(
        "backend,instances,concurrency,requests,budget,admitted,over,errors,seconds\n"
    ));
    assert_eq!(csv.lines().count(), 3);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn race_rejects_an_unknown_backend() {
    let out = Command::new(BIN)
        .args(["race", "--backends", "carrier-pigeon"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown backend"));
}

/// Runs `loadtest <command>` with `args` and `--csv`, one command at a
/// time; prints its table and returns its CSV rows.
fn csv_command(command: &str, tag: &str, args: &[&str]) -> Vec<HashMap<String, String>> {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("loadtest-{command}-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join(format!("{command}.csv"));
    let out = Command::new(BIN)
        .arg(command)
        .args(args)
        .arg("--csv")
        .arg(&csv)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{table}");
    let rows = csv_rows(&csv);
    std::fs::remove_dir_all(dir).unwrap();
    rows
}

fn num(row: &HashMap<String, String>, field: &str) -> f64 {
    row[field]
        .parse()
        .unwrap_or_else(|_| panic!("{field} = {:?} in {row:?}", row[field]))
}

fn csv_rows(path: &std::path::Path) -> Vec<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines().map(csv_fields);
    let header = lines.next().unwrap();
    lines
        .map(|fields| header.iter().cloned().zip(fields).collect())
        .collect()
}

/// One CSV line's fields: a field in double quotes may hold commas, and a
/// doubled quote inside it is one quote (as `results.rs` writes them).
fn csv_fields(line: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(std::mem::take(&mut field)),
            _ => field.push(c),
        }
    }
    fields.push(field);
    fields
}

/// The comparison on the documented policy (100 at 10/s, W = 10 s; fewer keys
/// for the memory and cost runs): each algorithm keeps (or breaks) the
/// promise it makes, measured through its script on a real Redis, and the
/// accuracy columns of docs/algorithms.md are exactly what it measures (the traffic is
/// seeded and the time simulated, so they reproduce).
#[test]
fn compare_shows_each_algorithm_keeping_its_promise() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("loadtest-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("cmp");
    let out = Command::new(BIN)
        .args(["compare", "--burst", "100", "--rate", "10", "--keys", "40"])
        .arg("--csv")
        .arg(&prefix)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let csv = |part: &str| csv_rows(&dir.join(format!("cmp-{part}.csv")));
    let accuracy = csv("accuracy");
    assert_eq!(accuracy.len(), 4 * 5);
    let get = |shape: &str, algorithm: &str| {
        accuracy
            .iter()
            .find(|r| r["shape"] == shape && r["algorithm"] == algorithm)
            .unwrap_or_else(|| panic!("no row {shape}/{algorithm}"))
            .clone()
    };
    // docs/algorithms.md's table: most admitted in any window over the limit, by
    // shape (boundary, idle-burst, steady, poisson).
    let readme = [
        ("token_bucket", ["1.01", "1.99", "1.99", "1.94"]),
        ("gcra", ["1.01", "1.99", "1.99", "1.94"]),
        ("fixed_window", ["2.00", "1.66", "1.00", "1.56"]),
        ("sliding_log", ["1.00", "1.00", "1.00", "1.00"]),
        ("sliding_window", ["1.00", "1.32", "1.00", "1.03"]),
    ];
    for (algorithm, ratios) in readme {
        for (shape, ratio) in ["boundary", "idle-burst", "steady", "poisson"]
            .into_iter()
            .zip(ratios)
        {
            let worst: f64 = get(shape, algorithm)["worst_in_window"].parse().unwrap();
            assert_eq!(
                format!("{:.2}", worst / 100.0),
                ratio,
                "{algorithm} on {shape}"
            );
        }
    }
    for r in &accuracy {
        let excess: f64 = r["excess_over_bucket"].parse().unwrap();
        match r["algorithm"].as_str() {
            // Exact: never above the limit in any window, the reference.
            "sliding_log" => {
                assert_eq!(r["false_denials"], "0");
                assert_eq!(r["extra_admissions"], "0");
            }
            // Bounded by burst + rate x t, in every interval.
            "token_bucket" | "gcra" | "sliding_window" => assert_eq!(excess, 0.0, "{r:?}"),
            "fixed_window" => {}
            other => panic!("{other}"),
        }
        // GCRA is the token bucket.
        if r["algorithm"] == "gcra" {
            let bucket = get(&r["shape"], "token_bucket");
            assert_eq!(r["admitted"], bucket["admitted"]);
            assert_eq!(r["worst_in_window"], bucket["worst_in_window"]);
        }
    }
    // The fixed window's failure, measured: exactly 2x at the boundary,
    // 98.5 requests beyond what one bucket allows (docs/algorithms.md's figure).
    assert_eq!(get("boundary", "fixed_window")["worst_in_window"], "200");
    assert_eq!(
        get("boundary", "fixed_window")["excess_over_bucket"],
        "98.505"
    );
    // Memory: the log grows with the rate; the others are one small value.
    let memory = csv("memory");
    let bytes = |algorithm: &str, rate: &str| -> u64 {
        memory
            .iter()
            .find(|r| r["algorithm"] == algorithm && r["rate_multiple"] == rate)
            .unwrap()["bytes"]
            .parse()
            .unwrap()
    };
    assert!(bytes("sliding_log", "0.5") < bytes("sliding_log", "1"));
    assert!(bytes("sliding_log", "0.5") > bytes("token_bucket", "0.5"));
    assert_eq!(bytes("token_bucket", "10"), bytes("token_bucket", "0.5"));
    // Cost: every check counted by Redis itself.
    let cost = csv("cost");
    assert_eq!(cost.len(), 5);
    // (What each costs, µs per call, is a timing: reported, not asserted.)
    for r in &cost {
        // 40 keys x 1.5 x the burst, every one counted by Redis itself.
        assert_eq!(r["checks"], (40 * 150).to_string(), "{r:?}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// `capacity`, tiny: every variant and step is measured and written, and
/// nothing fails. (What bounds each point is unit-tested on synthetic
/// series; a timing assertion here would only measure the machine.)
#[test]
fn capacity_measures_every_variant_and_writes_its_results() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("loadtest-capacity-{}", std::process::id()));
    // Tests run a debug build, which capacity refuses unless told: its
    // figures would be a debug service's.
    let refused = Command::new(BIN)
        .arg("capacity")
        .env_remove("LOADTEST_ALLOW_DEBUG")
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--release"));
    let out = Command::new(BIN)
        .args([
            "capacity", "--rtts", "0,1", "--rates", "100,300", "--step", "0.5",
        ])
        .arg("--results")
        .arg(&dir)
        .env("LOADTEST_ALLOW_DEBUG", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let csv = std::fs::read_to_string(dir.join("capacity.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    // no limiter, memory, lua +0 and +1 ms; two steps each.
    assert_eq!(rows.len(), 8, "{csv}");
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    for row in &rows {
        assert_eq!(row[col("errors")], "0", "{csv}");
        assert!(
            row[col("achieved/s")].parse::<f64>().unwrap() > 0.0,
            "{csv}"
        );
        // How late the offers went out after their instants.
        assert!(
            row[col("offer late p99 ms")].parse::<f64>().is_ok(),
            "{csv}"
        );
    }
    // The generator's own CPU a request, read in clock ticks: a short step
    // may read none, the whole run cannot.
    let generator: Vec<f64> = rows
        .iter()
        .map(|row| row[col("generator CPU us per request")].parse().unwrap())
        .collect();
    assert!(generator.iter().all(|us| *us >= 0.0), "{csv}");
    assert!(generator.iter().sum::<f64>() > 0.0, "{csv}");
    let lua: Vec<&Vec<&str>> = rows.iter().filter(|r| r[0].starts_with("lua")).collect();
    assert_eq!(lua.len(), 4);
    for row in &lua {
        // The instance's own check histogram and the measured round trip.
        assert_ne!(row[col("check p50 ms")], "-", "{csv}");
        assert!(row[col("measured rtt ms")].parse::<f64>().unwrap() > 0.0);
    }
    // The +1 ms proxy really adds a millisecond: it never forwards before
    // half of it has passed, each way (a lower bound only).
    let rtt = |added: &str| -> f64 {
        lua.iter()
            .find(|r| r[col("added rtt ms")] == added)
            .unwrap()[col("measured rtt ms")]
        .parse()
        .unwrap()
    };
    assert!(rtt("1") >= 1.0, "{csv}");
    let knees = std::fs::read_to_string(dir.join("knees.md")).unwrap();
    assert!(knees.contains("| lua +1 ms |"), "{knees}");
    for png in ["throughput.png", "check-p99.png", "request-p99.png"] {
        assert!(dir.join(png).exists(), "{png} (needs fonts-dejavu-core)");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// `lua-bench`, tiny: every mix runs through both scripts, which decide
/// alike (the baseline is the same bucket, so the comparison is like for
/// like), and each path does what it is named for.
#[test]
fn lua_bench_runs_every_script_on_every_path_and_they_agree() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(BIN)
        .args([
            "lua-bench",
            "--checks",
            "2000",
            "--keys",
            "100",
            "--depth",
            "4",
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // | mix | script | checks/s | denied | usec/call | server CPU |
    let denied = |mix: &str, script: &str| -> u64 {
        let line = table
            .lines()
            .find(|l| l.starts_with(&format!("| {mix} | {script}")))
            .unwrap_or_else(|| panic!("no {mix} / {script} row in:\n{table}"));
        let fields: Vec<&str> = line.split('|').map(str::trim).collect();
        let usec: f64 = fields[5].parse().unwrap();
        assert!(usec > 0.0, "{line}");
        fields[4].parse().unwrap()
    };
    for script in ["token_bucket.lua", "gcra.lua", "straightforward"] {
        assert_eq!(denied("refill", script), 0, "refill is admitted");
        assert_eq!(denied("new keys", script), 0, "a new key is full");
        // 16 keys of 10 an hour: all but their first 10 are denied.
        assert_eq!(denied("denied", script), 2000 - 160, "{script}");
        // Of 2000, 400 go to the drained keys.
        assert_eq!(denied("mix 70/20/10", script), 400 - 160, "{script}");
    }
    // The floor of each mix, and each script read against it: a row of
    // four ratios per mix.
    let ratios = table
        .split("| mix | token_bucket.lua / straightforward")
        .nth(1)
        .unwrap_or_else(|| panic!("no ratios in:\n{table}"));
    for mix in ["refill", "denied", "new keys", "mix 70/20/10"] {
        assert_eq!(denied(mix, "empty script"), 0, "{mix}");
        let row = ratios
            .lines()
            .find(|l| l.starts_with(&format!("| {mix} |")))
            .unwrap_or_else(|| panic!("no {mix} ratios in:\n{ratios}"));
        let values: Vec<f64> = row
            .split('|')
            .skip(2)
            .filter_map(|f| f.trim().parse().ok())
            .collect();
        assert!(
            values.len() == 4 && values.iter().all(|&v| v > 0.0),
            "{row}"
        );
    }
    assert!(table.contains("| redis-benchmark, straightforward script |"));
    assert!(table.contains("| redis-benchmark, token_bucket.lua |"));
}
