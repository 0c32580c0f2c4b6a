//! The load commands end to end, small and bounded: real redis-server, real
//! instance processes, loopback only.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_loadtest");

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
