//! The load commands end to end, small and bounded: real redis-server, real
//! instance processes, loopback only.

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

/// Runs `loadtest outage` with `args`; returns its CSV rows by "fault:mode".
fn outage(tag: &str, args: &[&str]) -> HashMap<String, HashMap<String, String>> {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("loadtest-outage-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("outage.csv");
    let out = Command::new(BIN)
        .arg("outage")
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
    let text = std::fs::read_to_string(&csv).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    lines
        .map(|line| {
            let row: HashMap<String, String> = header
                .iter()
                .zip(line.split(','))
                .map(|(k, v)| ((*k).to_owned(), v.to_owned()))
                .collect();
            (format!("{}:{}", row["fault"], row["mode"]), row)
        })
        .collect()
}

fn num(row: &HashMap<String, String>, field: &str) -> f64 {
    row[field]
        .parse()
        .unwrap_or_else(|_| panic!("{field} = {:?} in {row:?}", row[field]))
}

/// SIGKILL and restart, SIGSTOP, added latency and a black hole between
/// three instances and Redis, under steady load on one key: the figures
/// the README quotes, asserted.
#[test]
fn redis_faults_under_load_stay_within_the_limit_and_hand_back_fast() {
    let rows = outage(
        "matrix",
        &[
            "--scenarios",
            "kill:local,kill:open,kill:closed,stop:local,latency:local,blackhole:local",
        ],
    );
    assert_eq!(rows.len(), 6);
    for (name, r) in &rows {
        let outage = num(r, "outage_requests");
        assert!(
            outage > 500.0,
            "{name}: only {outage} requests in the outage"
        );
        assert_eq!(
            num(r, "errors"),
            0.0,
            "{name}: no 5xx but fail-closed's 503"
        );
        // Back on Redis within 2 s of the fault ending, every instance.
        let recovery = num(r, "recovery_ms");
        assert!(
            recovery <= 2000.0,
            "{name}: Redis took over after {recovery} ms"
        );
        // No request waited out the outage.
        assert!(num(r, "outage_max_ms") < 1000.0, "{name}: {r:?}");
        match r["mode"].as_str() {
            "local" => {
                assert!(num(r, "outage_local") >= 0.9 * outage, "{name}: {r:?}");
                // Across 3 instances, within 1.1 x what one exact bucket
                // admits for the same requests: during the outage, and over
                // the whole run (no fresh burst on losing or regaining Redis).
                let (a, i) = (num(r, "admitted_outage"), num(r, "ideal_outage"));
                assert!(
                    a <= 1.1 * i && a >= 0.5 * i,
                    "{name}: {a} admitted, ideal {i}"
                );
                let (a, i) = (num(r, "admitted_total"), num(r, "ideal_total"));
                assert!(a <= 1.1 * i, "{name}: {a} admitted in all, ideal {i}");
                assert_eq!(num(r, "failclosed"), 0.0);
            }
            "open" => {
                assert!(num(r, "outage_failopen") >= 0.9 * outage, "{name}: {r:?}");
                assert!(
                    num(r, "admitted_outage") >= 0.9 * outage,
                    "the bypass, measured"
                );
            }
            "closed" => {
                assert!(num(r, "failclosed") >= 0.9 * outage, "{name}: {r:?}");
                assert!(num(r, "admitted_outage") <= 0.05 * outage, "{name}: {r:?}");
            }
            other => panic!("mode {other}"),
        }
    }
}

/// With the Redis client's own timeout at 2 s, a 2 s hang would hold every
/// request for up to 2 s; the failure deadline (10 ms) is what bounds them.
#[test]
fn the_deadline_alone_bounds_the_wait_on_a_hung_redis() {
    let rows = outage(
        "deadline",
        &[
            "--scenarios",
            "stop:local",
            "--response-timeout",
            "2s",
            "--outage",
            "2",
            "--after",
            "1",
        ],
    );
    let r = &rows["stop:local"];
    assert_eq!(num(r, "errors"), 0.0);
    let (p99, max) = (num(r, "outage_p99_ms"), num(r, "outage_max_ms"));
    assert!(max < 1000.0, "a request waited {max} ms on a hung Redis");
    assert!(
        p99 < 250.0,
        "p99 {p99} ms on a hung Redis with a 10 ms deadline"
    );
}
