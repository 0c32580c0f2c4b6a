//! `http-cost`: server CPU per request, ours against the peers'.

use super::*;

/// The servers `http-cost` runs (the `ratelimiter` binary and the peers),
/// built beside this test's loadtest binary (`cargo test --workspace
/// --all-targets` builds them; alone, this test builds them).
fn servers_built() {
    let dir = std::path::Path::new(BIN).parent().unwrap();
    if [
        "ratelimiter",
        "examples/peer_governor",
        "examples/peer_plain",
    ]
    .iter()
    .all(|p| dir.join(p).is_file())
    {
        return;
    }
    let status = Command::new(env!("CARGO"))
        .args(["build", "-p", "ratelimiter", "--bins", "--examples"])
        .status()
        .unwrap();
    assert!(status.success(), "cannot build the servers");
}

/// Runs `loadtest http-cost` with `args` and `--out` a fresh folder named
/// by `tag`: the folder and its table.md.
fn http_cost(tag: &str, args: &[&str]) -> (std::path::PathBuf, String) {
    servers_built();
    let dir = std::env::temp_dir().join(format!("loadtest-{tag}-{}", std::process::id()));
    let out = Command::new(BIN)
        .arg("http-cost")
        .args(args)
        .arg("--out")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = std::fs::read_to_string(dir.join("table.md")).unwrap();
    (dir, table)
}

/// `variant`'s row of an http-cost table.
fn variant_row<'a>(table: &'a str, variant: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.starts_with(&format!("| {variant} |")))
        .unwrap_or_else(|| panic!("no {variant} row in:\n{table}"))
}

/// A short http-cost run: every variant measured, the tables written, the
/// figures sane (CPU per request above zero and below a millisecond, each
/// answer as the variant promises, the ratios within the same round).
#[test]
fn http_cost_writes_its_tables() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // 7 connections: uneven shares of the requests and the warm-up.
    let (dir, table) = http_cost(
        "http-cost",
        &[
            "--requests",
            "3000",
            "--warmup",
            "300",
            "--repeats",
            "2",
            "--connections",
            "7",
        ],
    );
    println!("{table}");
    assert!(table.contains("Command: `loadtest http-cost --requests 3000"));
    assert!(table.contains("the load generator on CPU 1 (one thread, never asleep)"));
    for variant in [
        "unlimited",
        "memory",
        "lua",
        "grpc",
        "grpc-lua",
        "denied",
        "governor",
        "plain",
    ] {
        let cells: Vec<&str> = variant_row(&table, variant)
            .split('|')
            .map(str::trim)
            .collect();
        // | variant | server us | of which user | Redis us | vs governor | vs plain | req/s | p50 | p99 | answers |
        let median = |cell: &str| -> f64 { cell.split(" / ").nth(1).unwrap().parse().unwrap() };
        let us = median(cells[2]);
        assert!(us > 0.0 && us < 1000.0, "{variant}: {us} us per request");
        let user = median(cells[3]);
        assert!(
            (0.0..=us).contains(&user),
            "{variant}: {user} us of {us} in user space"
        );
        assert!(median(cells[5]) > 0.0, "{variant}: ratio {}", cells[5]);
        let answers = match variant {
            "denied" => "6000 x 429",
            "grpc" | "grpc-lua" => "6000 x OK",
            _ => "6000 x 200",
        };
        assert_eq!(cells[10], answers, "{variant}");
        if variant == "lua" || variant == "grpc-lua" {
            assert!(median(cells[4]) > 0.0, "Redis CPU read");
        }
    }
    assert!(table.contains("- memory-limited route vs tower_governor with headers: median "));
    assert!(table.contains("- memory-limited route vs tower_governor, user space alone: "));
    assert!(table.contains("- lua route's server CPU beyond the memory route's vs Redis's CPU: "));
    let runs = csv_rows(&dir.join("runs.csv"));
    assert_eq!(runs.len(), 16, "8 variants x 2 rounds");
    assert!(runs.iter().all(|r| r["other"] == "0"));
    let seconds = |r: &HashMap<String, String>, column: &str| -> f64 { r[column].parse().unwrap() };
    assert!(
        runs.iter()
            .all(|r| seconds(r, "server_user_s") <= seconds(r, "server_cpu_s")),
        "user time above the whole"
    );
    assert!(
        std::fs::read_to_string(dir.join("table.csv"))
            .unwrap()
            .starts_with("variant,")
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// The load generator with a thread asleep per connection (`--client
/// threads`) counts the same answers as the spinning one, and says which
/// it was.
#[test]
fn http_cost_drives_with_sleeping_threads_too() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, table) = http_cost(
        "http-threads",
        &[
            "--client",
            "threads",
            "--variants",
            "denied,plain",
            "--requests",
            "2000",
            "--warmup",
            "200",
            "--repeats",
            "1",
            "--connections",
            "3",
        ],
    );
    assert!(table.contains("(a thread per connection, asleep in read)"));
    for (variant, answers) in [("denied", "2000 x 429"), ("plain", "2000 x 200")] {
        let row = variant_row(&table, variant);
        assert!(row.ends_with(&format!("| {answers} |")), "{row}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
