//! Needs root and cgroup v1: `mitigations` caps its cluster's masters.
//!
//! The hot-key mitigations against one exact bucket.

use super::*;

/// `loadtest mitigations`, tiny: one load step of one second, one repeat,
/// and a one-second throughput run on the capped cluster. Every mitigation
/// admits at most what one exact bucket admits (over-admission 0, the
/// property docs/hot-keys.md's table shows), and sharding spreads the hot key's
/// calls over the three nodes.
#[test]
fn mitigations_never_over_admit_and_sharding_spreads_the_calls() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("loadtest-mitigations-{}", std::process::id()));
    let out = Command::new(BIN)
        .args(["mitigations", "--seconds", "1", "--repeats", "1"])
        // Three times a small limit, so the bucket empties within the second.
        .args(["--burst", "30", "--rate", "30", "--loads", "3"])
        .args(["--cap-seconds", "1", "--results"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let accuracy = csv_rows(&dir.join("accuracy.csv"));
    let mitigations: Vec<&str> = accuracy.iter().map(|r| r["mitigation"].as_str()).collect();
    assert_eq!(
        mitigations,
        [
            "none",
            "deny_cache",
            "lease = 5",
            "lease = 20",
            "lease = 20, deny_cache",
            "shards = 3"
        ]
    );
    for row in &accuracy {
        assert_eq!(row["over-admission"], "0", "{row:?}");
        // Offered 90 a second against 30 + 30 a second: some denied.
        let (requests, admitted): (u64, u64) = (
            row["requests"].parse().unwrap(),
            row["admitted"].parse().unwrap(),
        );
        assert!(admitted < requests, "{row:?}");
    }
    let throughput = csv_rows(&dir.join("throughput.csv"));
    assert_eq!(throughput.len(), 2);
    assert_eq!(throughput[0]["hottest node's share of calls"], "100 %");
    assert_eq!(throughput[1]["hottest node's share of calls"], "33 %");
    // Unsharded, one node does the work, whichever it is: it comes first.
    let cpu: Vec<f64> =
        throughput[0]["CPU per node, busiest first, cores (each capped at the quota)"]
            .split(" / ")
            .map(|c| c.parse().unwrap())
            .collect();
    assert!(
        cpu.len() == 3 && cpu[0] > cpu[1] && cpu[1] >= cpu[2],
        "{cpu:?}"
    );
    let summary = std::fs::read_to_string(dir.join("summary.md")).unwrap();
    assert!(summary.contains("## Throughput cap"));
    assert!(
        summary.contains("over the unsharded key's, within each repeat"),
        "{summary}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// No repeats or nothing in flight measures nothing: refused at once, by
/// name, rather than a panic over an empty table.
#[test]
fn mitigations_refuses_zero_repeats_or_concurrency() {
    for flag in ["--repeats", "--concurrency"] {
        let out = Command::new(BIN)
            .args(["mitigations", flag, "0", "--results"])
            .arg(
                std::env::temp_dir()
                    .join(format!("loadtest-mitigations-zero-{}", std::process::id())),
            )
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} 0 was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("must be at least 1"), "{flag}: {stderr}");
    }
}
