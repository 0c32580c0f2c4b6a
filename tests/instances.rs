//! Multi-instance claims with real processes: three `ratelimiter` binaries
//! on one Redis (standalone or cluster), hammered concurrently.

use std::process::{Command, Stdio};
use testkit::{Fleet, RedisCluster, RedisServer, TempDir, hammer};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");
const BUDGET: usize = 100;

/// Three instances with `flags`, sharing one config (and its directory).
fn start_fleet(flags: &[&str]) -> (Fleet, TempDir) {
    start_fleet_with(flags, "")
}

/// The same, with `policy` added to the policy's lines.
fn start_fleet_with(flags: &[&str], policy: &str) -> (Fleet, TempDir) {
    let dir = TempDir::new("fleet").unwrap();
    let config = dir.join("c.toml");
    // No refill during the test (1 token an hour): the budget is the burst.
    std::fs::write(
        &config,
        format!(
            "key_secret = \"instances-test-secret\"\n[[api_keys]]\nid = \"victim\"\nkey = \"k\"\n\
             [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = {BUDGET}\nrate = 1\nper = \"1h\"\n{policy}\n"
        ),
    )
    .unwrap();
    let fleet = Fleet::start(3, "i", || {
        let mut command = Command::new(BIN);
        command
            .arg("--config")
            .arg(&config)
            .args(flags)
            // These tests are about admission, not latency: a 2-core CI
            // machine running three debug instances and 32 clients may
            // starve a task past the 10 ms deadline, which would hand the
            // request to a failure mode. Failing closed makes any such
            // hand-off a visible 503 instead of a quiet local decision.
            .args([
                "--redis-response-timeout",
                "2s",
                "--redis-connect-timeout",
                "2s",
                "--failure-deadline",
                "2s",
                "--failure-mode",
                "closed",
            ])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null());
        command
    })
    .unwrap();
    (fleet, dir)
}

/// `requests` GETs for one key from 32 concurrent clients, round-robin over
/// the fleet; returns how many were admitted. Anything but 200/429 fails.
async fn admitted(fleet: &Fleet, requests: usize) -> usize {
    let urls: Vec<String> = fleet
        .urls
        .iter()
        .map(|u| format!("{u}/api/items"))
        .collect();
    let tally = hammer(&urls, requests, 32, "k").await.unwrap();
    assert_eq!(tally.errors, 0, "first error: {:?}", tally.first_error);
    assert_eq!(tally.admitted + tally.throttled, requests);
    tally.admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_lua_instances_on_one_redis_admit_exactly_the_budget() {
    let redis = RedisServer::start().unwrap();
    let (fleet, _dir) = start_fleet(&["--backend", "lua", "--redis-url", &redis.url()]);
    assert_eq!(admitted(&fleet, 6 * BUDGET).await, BUDGET);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_lua_instances_on_a_redis_cluster_admit_exactly_the_budget() {
    let cluster = RedisCluster::start().unwrap();
    let urls = cluster.urls();
    let mut flags = vec!["--backend", "lua"];
    for url in &urls {
        flags.extend(["--redis-cluster", url.as_str()]);
    }
    let (fleet, _dir) = start_fleet(&flags);
    assert_eq!(admitted(&fleet, 6 * BUDGET).await, BUDGET);
}

/// Token leases across real processes: each instance takes up to 10
/// tokens with a request's call and spends them locally; whatever the
/// interleaving of 32 clients over three instances, the fleet never admits
/// more than the one bucket holds, it leaves at most each instance's
/// unspent lease unused, and admissions are spent from leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_lua_instances_with_leases_never_admit_more_than_the_budget() {
    let redis = RedisServer::start().unwrap();
    let (fleet, _dir) = start_fleet_with(
        &[
            "--backend",
            "lua",
            "--redis-url",
            &redis.url(),
            "--failure-instances",
            "3",
        ],
        "lease = 10",
    );
    // As many requests as the budget: some spent from leases (how many
    // depends on the interleaving: a request that arrives while its
    // instance is taking a lease goes without a take).
    let first = admitted(&fleet, BUDGET).await;
    let mut from_leases = 0.0;
    for url in &fleet.urls {
        let text = reqwest::get(format!("{url}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        from_leases += text
            .lines()
            .filter(|l| {
                l.starts_with("ratelimit_decisions_total{") && l.contains("source=\"lease\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    assert!(
        from_leases > 0.0,
        "no admission of {first} was spent from a lease"
    );
    // Then far more than the budget.
    let admitted = first + admitted(&fleet, 5 * BUDGET).await;
    assert!(
        admitted <= BUDGET,
        "{admitted} admitted of a bucket of {BUDGET}"
    );
    assert!(
        admitted >= BUDGET - 3 * 9,
        "{admitted}: more left unused than three unspent leases"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_memory_instances_admit_three_times_the_budget() {
    let (fleet, _dir) = start_fleet(&["--backend", "memory"]);
    // Each instance has its own bucket: the fleet admits 3 x the limit.
    assert_eq!(admitted(&fleet, 6 * BUDGET).await, 3 * BUDGET);
}
