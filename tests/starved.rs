//! Needs root and cgroup v1: the instance is starved by a CPU cap.
//!
//! Late answers vs the breaker: an instance starved of
//! CPU misses its check deadline although Redis answers in its usual time;
//! those misses must not open the breaker and abandon a healthy Redis.
//!
//! The instance is the real binary in a cgroup v1 `cpu` controller capped
//! at 3 % of a core (testkit's `CpuLimit`, as the native stack caps its
//! Redis nodes), Redis a real redis-server outside it. Throttled for most
//! of every 100 ms period, the instance finds the deadline's timer and
//! Redis's answer both ready when it runs again; whichever it polls first
//! decides, so some checks miss the 10 ms deadline. With one failure
//! opening the breaker (and a cooldown of an hour), a single miss counted
//! against Redis would open it for good. Nothing here is a timing
//! threshold: the test asks for misses to have happened (else it proved
//! nothing, and says so) and for the breaker never to have opened.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use testkit::{ChildGuard, CpuLimit, RedisServer, free_port, wait_for_port};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");

/// A process in a CPU-limited cgroup, moved back to the root cgroup on
/// drop (a panic included), so that the cgroup can be removed.
struct Squeezed {
    pid: u32,
    cpu: Option<CpuLimit>,
}

impl Squeezed {
    fn new(pid: u32, cores: f64) -> Self {
        let cpu = CpuLimit::new("starved", cores).unwrap();
        cpu.add(pid).unwrap();
        Self {
            pid,
            cpu: Some(cpu),
        }
    }

    fn throttled(&self) -> u64 {
        self.cpu.as_ref().map_or(0, |c| c.throttled().unwrap())
    }
}

impl Drop for Squeezed {
    fn drop(&mut self) {
        let _ = std::fs::write("/sys/fs/cgroup/cpu/cgroup.procs", self.pid.to_string());
        drop(self.cpu.take());
    }
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starved_instance_does_not_abandon_a_healthy_redis() {
    let redis = RedisServer::start().unwrap();
    let port = free_port().unwrap();
    let child = Command::new(BIN)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--backend", "lua", "--redis-url", &redis.url()])
        .args(["--key-secret", "starved-test-secret-0123"])
        // The defaults' deadline; a response timeout no throttled period
        // comes near, so every late answer has time to arrive.
        .args([
            "--failure-deadline",
            "10ms",
            "--redis-response-timeout",
            "5s",
        ])
        .args(["--breaker-failures", "1", "--breaker-cooldown", "1h"])
        // The local share is half: RateLimit-Limit 50 says who decided.
        .args(["--failure-instances", "2"])
        // Each client its own bucket (X-Forwarded-For believed from here):
        // nothing is throttled.
        .args(["--trusted-proxy", "127.0.0.1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let proc = ChildGuard(child);
    wait_for_port(port, "ratelimiter").unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
    // Decided by Redis (RateLimit-Limit 100, not the share's 50) within a
    // few tries: the first connects and loads the script.
    let from_redis = || async {
        for _ in 0..50 {
            let r = http.get(url("/api/items")).send().await.unwrap();
            if r.headers()["ratelimit-limit"] == "100" {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    };
    assert!(from_redis().await, "never decided through Redis");

    let squeezed = Squeezed::new(proc.pid(), 0.03);

    // Eight clients until enough checks have missed the deadline, or a
    // minute.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut misses = 0.0;
    let mut text = String::new();
    let mut statuses = Vec::new();
    while Instant::now() < deadline {
        let round: Vec<_> = (0..8)
            .map(|i| {
                let http = http.clone();
                let url = url("/api/items");
                tokio::spawn(async move {
                    let mut statuses = Vec::new();
                    for _ in 0..5 {
                        let r = http
                            .get(&url)
                            .header("x-forwarded-for", format!("10.0.0.{i}"))
                            .send()
                            .await
                            .unwrap();
                        statuses.push(r.status().as_u16());
                    }
                    statuses
                })
            })
            .collect();
        for task in round {
            statuses.extend(task.await.unwrap());
        }
        text = http
            .get(url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        misses = metric(
            &text,
            "ratelimit_store_errors_total{backend=\"lua\",kind=\"deadline\"}",
        );
        if misses >= 5.0 {
            break;
        }
    }
    let throttled = squeezed.throttled();
    drop(squeezed);
    assert!(throttled > 0, "the cgroup never throttled the instance");
    assert!(
        misses >= 1.0,
        "no check missed its deadline in a minute at 3 % of a core: the test proved nothing"
    );
    let node = format!("127.0.0.1:{}", redis.port);
    let opened = metric(
        &text,
        &format!(
            "ratelimit_breaker_transitions_total{{node=\"{node}\",from=\"closed\",to=\"open\"}}"
        ),
    );
    assert_eq!(
        opened, 0.0,
        "{misses} deadline misses opened the breaker on a healthy Redis"
    );
    let state = format!("ratelimit_breaker_state{{node=\"{node}\"}}");
    assert!(text.contains(&state), "no {state} in:\n{text}");
    assert_eq!(metric(&text, &state), 0.0);
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    // Every miss was answered, late (the last ones may still be on their
    // way when /metrics was read).
    let answered = metric(&text, "ratelimit_late_answers_total{outcome=\"answered\"}");
    let failed = metric(&text, "ratelimit_late_answers_total{outcome=\"failed\"}");
    eprintln!(
        "{misses} deadline misses, {answered} answered late, {failed} not; throttled {throttled} times"
    );
    assert!(answered >= 1.0, "no late answer counted: {answered}");
    assert_eq!(failed, 0.0, "a late answer not in time: {failed}");

    // Freed, it decides through Redis.
    assert!(from_redis().await, "Redis was abandoned");
}
