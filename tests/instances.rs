//! Multi-instance claims with real processes: three `ratelimiter` binaries
//! on one Redis (standalone or cluster), hammered concurrently.

mod support;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use support::{ChildGuard, RedisCluster, RedisServer, TempDir, free_port, wait_for_port};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");
const BUDGET: usize = 100;

fn config(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.0.join("c.toml");
    // No refill during the test (1 token an hour): the budget is the burst.
    std::fs::write(
        &path,
        format!(
            "key_secret = \"instances-test-secret\"\n[[api_keys]]\nid = \"victim\"\nkey = \"k\"\n\
             [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = {BUDGET}\nrate = 1\nper = \"1h\"\n"
        ),
    )
    .unwrap();
    path
}

struct Fleet {
    urls: Vec<String>,
    _children: Vec<ChildGuard>,
    _dir: TempDir,
}

fn start_fleet(n: usize, flags: &[&str]) -> Fleet {
    let dir = TempDir::new("fleet");
    let config = config(&dir);
    let mut urls = Vec::new();
    let mut children = Vec::new();
    for i in 0..n {
        let port = free_port();
        let child = Command::new(BIN)
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--instance-id",
                &format!("i{i}"),
            ])
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
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        children.push(ChildGuard(child));
        wait_for_port(port, "ratelimiter instance");
        urls.push(format!("http://127.0.0.1:{port}/api/items"));
    }
    Fleet {
        urls,
        _children: children,
        _dir: dir,
    }
}

/// `requests` GETs for one key from 32 concurrent clients, round-robin over
/// the fleet; returns how many were admitted. Anything but 200/429 fails.
async fn hammer(fleet: &Fleet, requests: usize) -> usize {
    let http = reqwest::Client::new();
    let next = Arc::new(AtomicUsize::new(0));
    let admitted = Arc::new(AtomicUsize::new(0));
    let urls = Arc::new(fleet.urls.clone());
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (http, next, admitted, urls) =
            (http.clone(), next.clone(), admitted.clone(), urls.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= requests {
                    break;
                }
                let r = http
                    .get(&urls[n % urls.len()])
                    .header("x-api-key", "k")
                    .send()
                    .await
                    .unwrap();
                match r.status().as_u16() {
                    200 => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    429 => {}
                    other => panic!(
                        "unexpected status {other}: {}",
                        r.text().await.unwrap_or_default()
                    ),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_lua_instances_on_one_redis_admit_exactly_the_budget() {
    let redis = RedisServer::start();
    let fleet = start_fleet(3, &["--backend", "lua", "--redis-url", &redis.url()]);
    assert_eq!(hammer(&fleet, 6 * BUDGET).await, BUDGET);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_lua_instances_on_a_redis_cluster_admit_exactly_the_budget() {
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let mut flags = vec!["--backend", "lua"];
    for url in &urls {
        flags.extend(["--redis-cluster", url.as_str()]);
    }
    let fleet = start_fleet(3, &flags);
    assert_eq!(hammer(&fleet, 6 * BUDGET).await, BUDGET);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_memory_instances_admit_three_times_the_budget() {
    let fleet = start_fleet(3, &["--backend", "memory"]);
    // Each instance has its own bucket: the fleet admits 3 x the limit.
    assert_eq!(hammer(&fleet, 6 * BUDGET).await, 3 * BUDGET);
}
