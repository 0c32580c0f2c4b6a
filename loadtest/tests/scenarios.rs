//! The goose scenarios against the real native stack (`scripts/stack`:
//! nginx, three instances, a 3-node cluster, Prometheus), briefly and with
//! few users: every answer checked, the surge seen to start and stop, the
//! results written. Never a throughput assertion.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use testkit::{NativeStack, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_loadtest");

/// The instances are this executable's `instance` subcommand (what the
/// `ratelimiter` binary runs), through a one-line wrapper, because the
/// script takes one program.
fn service(dir: &TempDir) -> PathBuf {
    let path = dir.join("ratelimiter");
    std::fs::write(&path, format!("#!/bin/sh\nexec {BIN} instance \"$@\"\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
    /// summary.csv by class: column name -> value.
    summary: HashMap<String, HashMap<String, String>>,
    dir: PathBuf,
}

impl Run {
    fn count(&self, class: &str, column: &str) -> u64 {
        self.summary
            .get(class)
            .unwrap_or_else(|| panic!("no {class} row: {:?}\n{}", self.summary, self.stdout))
            [column]
            .parse()
            .unwrap()
    }
}

fn csv(path: &Path) -> Vec<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let headers: Vec<&str> = lines.next().unwrap().split(',').collect();
    lines
        .map(|l| {
            headers
                .iter()
                .zip(l.split(','))
                .map(|(h, v)| ((*h).to_owned(), v.to_owned()))
                .collect()
        })
        .collect()
}

fn scenario(stack: &NativeStack, results: &Path, args: &[&str]) -> Run {
    let mut command = Command::new(BIN);
    command.args(args);
    if args[0] == "hotkey" {
        // Its components' CPU, from this stack's pid files.
        command.arg("--stack-dir").arg(stack.dir());
    }
    let out = command
        .arg("-H")
        .arg(stack.url(""))
        .arg("--prometheus")
        .arg(format!("http://127.0.0.1:{}", stack.prometheus))
        .arg("--results")
        .arg(results)
        .output()
        .unwrap();
    let summary = if results.join("summary.csv").exists() {
        csv(&results.join("summary.csv"))
            .into_iter()
            .map(|row| (row["class"].clone(), row))
            .collect()
    } else {
        HashMap::new()
    };
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        summary,
        dir: results.to_path_buf(),
    }
}

/// Nothing broke the contract and nothing failed: the stack here is not
/// CPU-capped and its deadline is generous, so even the surge gets answers.
fn clean(run: &Run, classes: &[&str]) {
    assert!(run.ok, "failed:\n{}\n{}", run.stdout, run.stderr);
    for class in classes {
        assert!(
            run.count(class, "requests") > 0,
            "{class} sent nothing\n{}",
            run.stdout
        );
        assert_eq!(run.count(class, "broken"), 0, "{class}\n{}", run.stdout);
        assert_eq!(
            run.count(class, "5xx / no answer"),
            0,
            "{class}\n{}",
            run.stdout
        );
    }
    assert!(run.dir.join("summary.md").exists());
    assert!(run.dir.join("goose.html").exists(), "goose's report");
}

#[test]
fn the_scenarios_run_against_the_native_stack() {
    let scratch = TempDir::new("scenarios").unwrap();
    let stack = NativeStack::new(
        &service(&scratch),
        &[
            ("STACK_REDIS_CPUS", "none"),
            ("STACK_GRAFANA", "off"),
            ("STACK_JAEGER", "off"),
            // Answers, not latency: no deadline misses on a busy machine.
            ("RL_FAILURE_DEADLINE", "2s"),
            ("RL_REDIS_RESPONSE_TIMEOUT", "2s"),
            // Hot keys within a 10 s phase.
            ("RL_HOT_KEYS_WINDOW", "2s"),
            ("INSTANCE_LOG", "error"),
        ],
    )
    .unwrap();
    stack.up().unwrap();

    // mixed: every class sends, every answer is checked.
    let mixed = scenario(
        &stack,
        &scratch.join("mixed"),
        &["mixed", "-u", "6", "-t", "5s"],
    );
    clean(&mixed, &["tenant", "abusive", "anonymous"]);
    // The abusive tenants go over their limits; throttling is an answer.
    assert!(mixed.count("abusive", "throttled") > 0, "{}", mixed.stdout);
    assert!(mixed.count("anonymous", "admitted") > 0, "{}", mixed.stdout);

    // hotkey, one abusive tenant: the surge starts and stops on time, and
    // only inside its window.
    let tenant = scenario(
        &stack,
        &scratch.join("tenant"),
        // Phases of 10 s: two Prometheus scrapes (every 5 s) in each.
        &["hotkey", "--cause", "tenant", "-u", "8", "-t", "30s"],
    );
    clean(&tenant, &["tenant", "abusive", "anonymous", "surge"]);
    let starts = tenant
        .stdout
        .find("surge starts")
        .expect("surge start announced");
    let stops = tenant
        .stdout
        .find("surge stops")
        .expect("surge stop announced");
    assert!(starts < stops);
    assert!(
        tenant.stdout.contains("[  10s] surge starts"),
        "{}",
        tenant.stdout
    );
    assert!(
        tenant.stdout.contains("[  20s] surge stops"),
        "{}",
        tenant.stdout
    );
    assert!(
        tenant.count("surge", "throttled") > 0,
        "one key flat out is throttled"
    );
    let phases = csv(&tenant.dir.join("phases.csv"));
    let names: Vec<&str> = phases.iter().map(|p| p["phase"].as_str()).collect();
    assert_eq!(names, ["before", "surge", "after"]);
    // The surge sends only in its window.
    assert_eq!(phases[0]["surge req/s"], "0");
    assert_ne!(phases[1]["surge req/s"], "0");
    assert_eq!(phases[2]["surge req/s"], "0");
    assert_eq!(phases[0]["surge p99 ms"], "-");
    assert_ne!(phases[1]["surge p99 ms"], "-");
    // Prometheus saw the run, as the dashboard's panels show it: the
    // check latency, the surge key's node and its share of it, and the
    // node's CPU against what it may use (one core: this stack is
    // uncapped, so the cgroup exporter has nothing to say).
    assert_ne!(phases[1]["check p99 ms"], "-", "{}", tenant.stdout);
    assert_ne!(phases[1]["surge node CPU (cores)"], "-", "{:?}", phases[1]);
    assert_ne!(phases[1]["of its cap"], "-", "{:?}", phases[1]);
    assert!(
        phases[1]["surge key's share of its node"].ends_with('%'),
        "{:?}",
        phases[1]
    );
    assert!(
        tenant.stdout.contains("surge: tenant-"),
        "{}",
        tenant.stdout
    );
    // The machine's CPU per phase, and the stack's components' (native).
    assert!(phases[1]["machine busy"].ends_with('%'), "{:?}", phases[1]);
    assert!(
        phases[1]["generator + nginx + instances"].ends_with('%'),
        "{:?}",
        phases[1]
    );
    assert!(tenant.dir.join("timeline.csv").exists());
    assert!(tenant.dir.join("alerts.csv").exists());
    assert!(
        tenant.dir.join("hotkey.png").exists(),
        "the plot (needs fonts-dejavu-core)"
    );

    // client-bug: a release's constant key from many installs.
    let bug = scenario(
        &stack,
        &scratch.join("bug"),
        &["hotkey", "--cause", "client-bug", "-u", "8", "-t", "6s"],
    );
    clean(&bug, &["tenant", "surge"]);
    assert!(
        bug.stdout
            .contains("a client release sends tenant-02's key"),
        "{}",
        bug.stdout
    );
    assert!(bug.count("surge", "throttled") > 0);

    // proxy: clients behind one untrusted address share one anonymous
    // bucket (burst 20 at 2/s), whatever X-Forwarded-For they carry.
    let proxy = scenario(
        &stack,
        &scratch.join("proxy"),
        &["hotkey", "--cause", "proxy", "-u", "8", "-t", "6s"],
    );
    clean(&proxy, &["anonymous", "surge"]);
    let admitted = proxy.count("surge", "admitted");
    assert!(admitted >= 1, "{}", proxy.stdout);
    assert!(
        admitted <= 20 + 2 * 6 + 2,
        "{admitted} surge requests admitted: the proxy's clients did not share one bucket\n{}",
        proxy.stdout
    );
    assert!(proxy.count("surge", "throttled") > 0);

    stack.down().unwrap();
}

/// Against nothing: one line saying so, not a flood of connection errors.
#[test]
fn a_scenario_without_a_stack_says_so_in_one_line() {
    let closed = testkit::free_port().unwrap();
    let host = format!("http://127.0.0.1:{closed}");
    for args in [
        vec!["mixed", "-H", &host],
        vec!["hotkey", "-H", &host],
        vec!["smoke", "-H", &host],
    ] {
        let out = Command::new(BIN).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(all.trim().lines().count(), 1, "{args:?}:\n{all}");
        assert!(all.contains("nothing answers"), "{all}");
        assert!(all.contains("scripts/stack up"), "{all}");
    }
}
