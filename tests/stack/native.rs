//! The compose topology run natively by `scripts/stack`, end to end, and
//! its `down`.

use super::{BIN, repo, run};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use testkit::{NativeStack, OtlpReceiver, TempDir, hammer};

/// redis-cli on the stack's node at `port`, as the operators' `default`
/// user (its password from `.env`, as `scripts/stack` reads it).
fn admin_cli(port: u16, args: &[&str]) -> String {
    let env = std::fs::read_to_string(repo(".env")).unwrap();
    let password = env
        .lines()
        .find_map(|l| l.strip_prefix("REDIS_ADMIN_PASSWORD="))
        .expect("REDIS_ADMIN_PASSWORD in .env");
    let mut all = vec!["--no-auth-warning", "-a", password];
    all.extend(args);
    testkit::redis_cli(port, &all).unwrap()
}

fn running(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

/// Admitted of `n` requests for one key from 32 clients through nginx,
/// and the seconds it took. Tenant 3 has the policy's own limit (tenant
/// 1 is the partner, with one of its own).
/// The stack's Prometheus's answer to an instant `query` (the whole JSON).
async fn prometheus(stack: &NativeStack, query: &str) -> serde_json::Value {
    reqwest::get(format!(
        "http://127.0.0.1:{}/api/v1/query?query={query}",
        stack.prometheus
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap()
}

async fn budget(stack: &NativeStack, n: usize) -> (usize, f64) {
    let started = Instant::now();
    let tally = hammer(&[stack.url("/api/items")], n, 32, "demo-key-03")
        .await
        .unwrap();
    assert_eq!(tally.errors, 0, "{:?}", tally.first_error);
    (tally.admitted, started.elapsed().as_secs_f64())
}

/// 60 anonymous requests to `url`, request `i` with `headers(i)`: how many
/// were admitted, and the most one address's limit (burst 20 at 2/s)
/// admits in the time they took.
async fn spoofed(
    http: &reqwest::Client,
    url: &str,
    headers: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> (usize, f64) {
    let started = Instant::now();
    let mut admitted = 0;
    for i in 0..60 {
        let mut request = http.get(url);
        for (name, value) in headers(i) {
            request = request.header(name, value);
        }
        let r = request.send().await.unwrap();
        admitted += usize::from(r.status() == 200);
    }
    (admitted, 20.0 + 2.0 * started.elapsed().as_secs_f64() + 1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_stack_runs_the_compose_topology_end_to_end() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let stack = NativeStack::new(
        Path::new(BIN),
        &[
            // CPU caps are compose's business here: the test is about
            // admission, and capped nodes only slow it down.
            ("STACK_REDIS_CPUS", "none"),
            ("STACK_GRAFANA", "off"),
            ("STACK_JAEGER", "off"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.http),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("RL_TRACE_BATCH_DELAY", "100ms"),
            // Admission, not latency: no deadline misses on a busy machine.
            ("RL_FAILURE_DEADLINE", "2s"),
            ("RL_REDIS_RESPONSE_TIMEOUT", "2s"),
        ],
    )
    .unwrap();
    let out = stack.up().unwrap();
    assert!(out.contains("nginx: started"), "{out}");
    // Idempotent: a second `up` starts nothing new.
    let pids = stack.pids().unwrap();
    let again = stack.up().unwrap();
    assert!(!again.contains(": started"), "{again}");
    assert_eq!(stack.pids().unwrap(), pids);
    assert!(
        stack
            .script("status", &[])
            .unwrap()
            .lines()
            .filter(|l| l.contains(" ok "))
            .count()
            >= 11
    );

    // One key's budget holds across the fleet: burst 100 at 10/s.
    let (lua, seconds) = budget(&stack, 600).await;
    let bound = 100.0 + 10.0 * seconds + 1.0;
    assert!(
        (100..=bound as usize).contains(&lua),
        "{lua} admitted in {seconds:.1} s"
    );

    // A client's own X-Forwarded-For or X-Real-IP buys nothing: anonymous
    // clients share one address's limit (burst 20 at 2/s).
    let http = reqwest::Client::new();
    let (admitted, bound) = spoofed(&http, &stack.url("/api/items/1"), |i| {
        vec![
            ("x-forwarded-for", format!("10.1.{}.{}", i / 250, i % 250)),
            ("x-real-ip", format!("10.2.0.{i}")),
        ]
    })
    .await;
    assert!(
        admitted as f64 <= bound,
        "{admitted} admitted with spoofed headers"
    );
    // Straight at an instance, from 127.0.0.1 (every local client's
    // address): the instances do not trust it, so a spoofed
    // X-Forwarded-For is ignored there too. (Trusting 127.0.0.1, as the
    // old example did, admits all 60.)
    let direct = format!("http://127.0.0.1:{}/api/items/1", stack.api + 1);
    let (admitted, bound) = spoofed(&http, &direct, |i| {
        vec![("x-forwarded-for", format!("10.3.{}.{}", i / 250, i % 250))]
    })
    .await;
    assert!(
        admitted as f64 <= bound,
        "{admitted} admitted by an instance from a spoofed X-Forwarded-For"
    );

    // Keys spread over all three nodes. Tenant 3's key is already there:
    // the budget check above drained it, and its next token may not have
    // come yet (10/s), so it is not asked again.
    for tenant in (1..=16).filter(|t| *t != 3) {
        let r = http
            .get(stack.url("/api/items"))
            .header("x-api-key", format!("demo-key-{tenant:02}"))
            .send()
            .await
            .unwrap();
        let status = r.status();
        assert_eq!(status, 200, "tenant {tenant}: {}", r.text().await.unwrap());
    }
    for node in 0..3 {
        let keys = admin_cli(stack.redis + node, &["dbsize"]);
        assert!(
            keys.trim().parse::<u64>().unwrap() > 0,
            "node {node} holds no key"
        );
    }
    // Three masters, each with a replica in sync; nobody signed in without
    // a password, and no user was refused a command: the instances and
    // the exporters have what they use.
    for node in 0..6 {
        let replication = admin_cli(stack.redis + node, &["info", "replication"]);
        if node < 3 {
            assert!(replication.contains("connected_slaves:1"), "{replication}");
        } else {
            assert!(
                replication.contains("master_link_status:up"),
                "{replication}"
            );
        }
        let refused = admin_cli(stack.redis + node, &["acl", "log"]);
        assert!(refused.trim().is_empty(), "node {node} refused:\n{refused}");
        let anonymous = testkit::redis_cli(stack.redis + node, &["ping"]).unwrap();
        assert!(anonymous.contains("NOAUTH"), "{anonymous}");
    }

    // The reports service, a second upstream nginx protects with
    // auth_request: its answers carry the limiter's fields, and the sixth
    // request of a burst of five is refused by nginx with the limiter's
    // Retry-After, the backend never asked.
    for n in 1..=6 {
        let r = http
            .get(stack.url("/reports/daily"))
            .header("x-api-key", "demo-key-06")
            .send()
            .await
            .unwrap();
        let (status, headers) = (r.status(), r.headers().clone());
        let body = r.text().await.unwrap();
        if n <= 5 {
            assert_eq!(status, 200, "request {n}: {body}");
            assert!(body.contains("\"report\":\"/reports/daily\""), "{body}");
            assert_eq!(headers["ratelimit-limit"], "5");
            assert_eq!(headers["ratelimit-remaining"], (5 - n).to_string());
        } else {
            assert_eq!(status, 429, "{body}");
            assert_eq!(headers["retry-after"], "1");
            assert_eq!(headers["ratelimit-remaining"], "0");
            assert_eq!(headers["content-type"], "application/problem+json");
        }
    }
    let unknown = http
        .get(stack.url("/reports/daily"))
        .header("x-api-key", "no-such-key")
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 401, "an unknown key, refused by nginx");
    let outside = reqwest::get(stack.url("/decide")).await.unwrap();
    assert_eq!(outside.status(), 404, "/decide answers nginx only");

    // A traceparent the client sends comes out in the service's spans.
    let trace = "5cf92f3577b34da6a3ce929d0e0e4736";
    let r = http
        .get(stack.url("/api/items"))
        .header("x-api-key", "demo-key-02")
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let spans = receiver
        .trace(trace, 3, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        spans
            .iter()
            .any(|s| s.name == "EVALSHA" && s.attributes.contains_key("db.redis.slot"))
    );

    // nginx starts no trace: requests without a traceparent are traced as
    // the instances' sampler says (one in twenty in config/stack.toml), not
    // every one, and a traced one carries nginx's request id.
    let mut request_ids = BTreeSet::new();
    for _ in 0..200 {
        let r = http.get(stack.url("/api/items")).send().await.unwrap();
        let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
        request_ids.insert(id);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let traced: BTreeSet<String> = receiver
        .spans()
        .into_iter()
        .filter_map(|s| {
            s.attributes
                .get("http.request.header.x-request-id")
                .cloned()
        })
        .filter(|id| request_ids.contains(id))
        .collect();
    assert_eq!(
        request_ids.len(),
        200,
        "nginx gives each request its own id"
    );
    // About 10 of 200 at 0.05; outside 1..=30 has a chance under 1e-4
    // (binomial), where tracing every request or none is certain to land.
    assert!(
        (1..=30).contains(&traced.len()),
        "{} of 200 requests traced, at a ratio of 0.05",
        traced.len()
    );

    // Prometheus scrapes every target.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let response = prometheus(&stack, "up").await;
        let results = response["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let up = results.iter().filter(|r| r["value"][1] == "1").count();
        // 3 instances, 6 exporters, the cgroup counters, mtail, Prometheus.
        if results.len() == 12 && up == 12 {
            break;
        }
        assert!(Instant::now() < deadline, "targets not all up: {results:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // mtail counted the answers nginx sent it: one in 64 of the thousand
    // and more above (none at all has a chance under 1e-6).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let response = prometheus(&stack, "nginx_http_responses_logged_total").await;
        let logged: f64 = response["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        if logged > 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "mtail counted nothing: {response}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The server errors' counter is there before the first error (it has
    // no labels: a first burst of 5xx is a rise, not a new series).
    let errors = prometheus(&stack, "nginx_http_server_errors_total").await;
    assert_eq!(
        errors["data"]["result"].as_array().map(Vec::len),
        Some(1),
        "{errors}"
    );

    // The alerts' runbook links point at the runbooks nginx serves.
    let config: serde_json::Value = reqwest::get(format!(
        "http://127.0.0.1:{}/api/v1/status/config",
        stack.prometheus
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let base = stack.url("");
    let base = base.trim_end_matches('/');
    assert!(
        config["data"]["yaml"]
            .as_str()
            .unwrap()
            .contains(&format!("runbook_base_url: {base}")),
        "{config}"
    );
    let runbook = reqwest::get(format!("{base}/runbooks/hot-key.md"))
        .await
        .unwrap();
    assert_eq!(runbook.status(), 200);
    assert_eq!(
        runbook.headers()["content-type"],
        "text/plain; charset=utf-8"
    );
    assert!(
        runbook
            .text()
            .await
            .unwrap()
            .starts_with("# Runbook: a hot key")
    );

    // Down stops everything up started.
    let pids = stack.pids().unwrap();
    assert_eq!(
        pids.len(),
        19,
        "6 nodes, 6 exporters, the cgroup exporter, 3 instances, mtail, nginx, Prometheus"
    );
    stack.down().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let left: Vec<i32> = pids.into_iter().filter(|&p| running(p)).collect();
    assert!(left.is_empty(), "still running after down: {left:?}");

    // The memory backend on the same topology: each instance its own
    // bucket, about three times the budget.
    stack.script("up", &[("STACK_BACKEND", "memory")]).unwrap();
    let (memory, _) = budget(&stack, 600).await;
    stack.down().unwrap();
    assert!(
        memory as f64 >= 2.5 * lua as f64 / (1.0 + seconds / 10.0) && memory >= 250,
        "memory admitted {memory}, lua {lua}"
    );
}

/// `scripts/stack down` stops only what `up` started: a pid file names a
/// process by its pid *and* its start time, so a pid now held by another
/// process (reused after a reboot) is left alone, while the recorded
/// process itself is stopped.
#[test]
fn stack_down_never_kills_a_process_that_reused_a_recorded_pid() {
    let dir = TempDir::new("stack-pid").unwrap();
    std::fs::create_dir_all(dir.0.join("run")).unwrap();
    let start_time = |pid: u32| -> String {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // Field 22, counted after the command name's closing parenthesis.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        after.split(' ').nth(19).unwrap().to_owned()
    };
    let mut stranger = Command::new("sleep").arg("60").spawn().unwrap();
    let mut ours = Command::new("sleep").arg("60").spawn().unwrap();
    let started = start_time(stranger.id());
    // The stranger holds a recorded pid, but started at another time.
    let wrong: u64 = started.parse::<u64>().unwrap() + 1;
    std::fs::write(
        dir.0.join("run/nginx.pid"),
        format!("{} {wrong}\n", stranger.id()),
    )
    .unwrap();
    std::fs::write(
        dir.0.join("run/prometheus.pid"),
        format!("{} {}\n", ours.id(), start_time(ours.id())),
    )
    .unwrap();
    let (ok, out) = run(Command::new(repo("scripts/stack"))
        .arg("down")
        .env("STACK_DIR", &dir.0));
    assert!(ok, "{out}");
    let ours_exit = ours.wait().unwrap();
    assert!(!ours_exit.success(), "the recorded process was stopped");
    // Our child: a killed one would be reaped here (a zombie still
    // answers `kill -0`).
    assert!(
        stranger.try_wait().unwrap().is_none(),
        "a process that reused a pid was killed:\n{out}"
    );
    assert!(!dir.0.join("run/nginx.pid").exists());
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}
