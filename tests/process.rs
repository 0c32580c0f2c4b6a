//! The binary as a user runs it: flags, env, start-up validation, signals.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use testkit::{ChildGuard, RedisCluster, RedisServer, TempDir, free_port, wait_for_port};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");

/// GETs `path` `n` times in a row; returns each status and the last body.
fn get_n(port: u16, path: &str, n: usize) -> (Vec<u16>, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let http = reqwest::Client::new();
        let mut statuses = Vec::with_capacity(n);
        let mut body = String::new();
        for _ in 0..n {
            let r = http
                .get(format!("http://127.0.0.1:{port}{path}"))
                .send()
                .await
                .unwrap();
            statuses.push(r.status().as_u16());
            body = r.text().await.unwrap();
        }
        (statuses, body)
    })
}

#[test]
fn serves_from_env_and_flags_and_stops_cleanly_on_sigterm() {
    let port = free_port().unwrap();
    // One token an hour after the burst, so real time cannot refill any
    // during the test: exactly the burst passes.
    let dir = TempDir::new("serve").unwrap();
    let config = dir.0.join("c.toml");
    std::fs::write(
        &config,
        "instance_id = \"from-file\"\n[[policies]]\nname = \"api\"\nroute = \"/api/items\"\nburst = 100\nrate = 1\nper = \"1h\"\n",
    )
    .unwrap();
    let child = Command::new(BIN)
        .env("RL_LISTEN", format!("127.0.0.1:{port}"))
        .env("RL_INSTANCE_ID", "proc-test")
        .env("RL_CONFIG", &config)
        .args(["--backend", "memory", "--trusted-proxy", "10.0.0.0/8"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut proc = ChildGuard(child);
    wait_for_port(port, "ratelimiter").unwrap();
    // The env var beats the file's instance_id.
    let (status, body) = get_n(port, "/api/status", 1);
    assert_eq!(status, [200]);
    assert!(body.contains("proc-test"), "{body}");
    // The file's policy: 100, then 429.
    let (statuses, _) = get_n(port, "/api/items", 101);
    assert_eq!(statuses, [vec![200; 100], vec![429]].concat());

    stops_cleanly_on(&mut proc, nix::sys::signal::Signal::SIGTERM);
}

/// OpenTelemetry's variables, injected with values the service cannot
/// use, never stop it: it starts, serves, and warns once about each, by
/// name, as the OpenTelemetry SDK specification asks.
#[test]
fn bad_otel_variables_are_warned_about_once_and_never_stop_the_start() {
    let port = free_port().unwrap();
    let bad = [
        ("OTEL_TRACES_SAMPLER", "nope"),
        ("OTEL_TRACES_SAMPLER_ARG", "abc"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317"),
        ("OTEL_SDK_DISABLED", "maybe"),
    ];
    let mut command = Command::new(BIN);
    command
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (name, value) in bad {
        command.env(name, value);
    }
    let mut proc = ChildGuard(command.spawn().unwrap());
    wait_for_port(port, "ratelimiter").unwrap();
    assert_eq!(get_n(port, "/api/items", 1).0, [200]);
    let stderr = stops_cleanly_on(&mut proc, nix::sys::signal::Signal::SIGTERM);
    for (name, value) in bad {
        let line = format!("{name}={value} ignored");
        assert_eq!(stderr.matches(&line).count(), 1, "{line}: {stderr}");
    }
}

/// Sends `signal` to the instance (its stderr piped): it exits with
/// success within 10 s, saying why; its log.
fn stops_cleanly_on(proc: &mut ChildGuard, signal: nix::sys::signal::Signal) -> String {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(proc.0.id()).unwrap());
    nix::sys::signal::kill(pid, signal).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = proc.0.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "no exit 10 s after {signal}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "exit after {signal}: {exit:?}");
    let mut stderr = String::new();
    proc.0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(stderr.contains("shutdown signal received"), "{stderr}");
    stderr
}

/// ctrl-c is SIGINT: the same graceful stop as SIGTERM.
#[test]
fn stops_cleanly_on_sigint_as_on_ctrl_c() {
    let port = free_port().unwrap();
    let child = Command::new(BIN)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut proc = ChildGuard(child);
    wait_for_port(port, "ratelimiter").unwrap();
    stops_cleanly_on(&mut proc, nix::sys::signal::Signal::SIGINT);
}

/// Redis URLs may carry a password and the key secret is one: `--help`
/// names their variables but never shows the values set in them.
#[test]
fn help_never_shows_the_secret_variables_values() {
    let out = Command::new(BIN)
        .arg("--help")
        .env("RL_REDIS_URL", "redis://u:hunter2-url@127.0.0.1:1")
        .env("RL_REDIS_CLUSTER", "redis://u:hunter2-cluster@127.0.0.1:2")
        .env("RL_KEY_SECRET", "hunter2-key-0123456789abcdef0123456789")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for name in ["RL_REDIS_URL", "RL_REDIS_CLUSTER", "RL_KEY_SECRET"] {
        assert!(help.contains(name), "{name} not named in:\n{help}");
    }
    assert!(!help.contains("hunter2"), "{help}");
    // A variable without a secret shows its value: the check above sees.
    let out = Command::new(BIN)
        .arg("--help")
        .env("RL_INSTANCE_ID", "instance-VISIBLE")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("instance-VISIBLE"));
}

#[test]
fn invalid_config_fails_at_startup_naming_the_field() {
    let dir = TempDir::new("bad").unwrap();
    let path = dir.0.join("bad.toml");
    std::fs::write(
        &path,
        "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 0\nrate = 1\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("policies[0].burst"), "{stderr}");

    let out = Command::new(BIN)
        .args(["--trusted-proxy", "not-a-cidr", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("trusted_proxies[0]"));
}

/// An expected start-up error is one line, even with RUST_BACKTRACE set
/// (as on many developer machines), and says each thing once.
#[test]
fn start_up_errors_are_one_line_without_a_backtrace() {
    let dir = TempDir::new("one-line").unwrap();
    let bad = dir.0.join("bad.toml");
    std::fs::write(
        &bad,
        "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 0\nrate = 1\n",
    )
    .unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let missing = dir.0.join("missing.toml");
    let cases: [(Vec<std::ffi::OsString>, &str); 3] = [
        (
            vec!["--config".into(), bad.clone().into()],
            "policies[0].burst",
        ),
        (
            vec!["--config".into(), missing.clone().into()],
            "missing.toml",
        ),
        (vec!["--listen".into(), taken.clone().into()], &taken),
    ];
    for (args, names) in cases {
        let out = Command::new(BIN)
            .args(&args)
            .env("RUST_BACKTRACE", "1")
            // The service's own log lines (a warning about key_secret) are
            // not the error report.
            .env("RUST_LOG", "off")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}:\n{stderr}");
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains(names),
            "{stderr}"
        );
        assert!(
            !stderr.contains("backtrace") && !stderr.contains("Caused by"),
            "{stderr}"
        );
        // The cause once, not twice.
        assert!(stderr.matches("No such file").count() <= 1, "{stderr}");
    }
}

/// GET once: status, `RateLimit-Limit` (if any) and body.
fn probe(port: u16, path: &str) -> (u16, Option<String>, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{port}{path}"))
            .send()
            .await
            .unwrap();
        let limit = r
            .headers()
            .get("ratelimit-limit")
            .map(|v| v.to_str().unwrap().to_owned());
        (r.status().as_u16(), limit, r.text().await.unwrap())
    })
}

/// Starts the binary against a Redis that is not there yet (`redis_flags`),
/// checks it serves by its local share, then starts Redis (`start`) and
/// waits for it to decide through Redis. Never a crash, never a 5xx.
fn starts_degraded_then_connects<R>(redis_flags: &[String], start: impl FnOnce() -> R) {
    let port = free_port().unwrap();
    let dir = TempDir::new("no-redis").unwrap();
    let config = dir.0.join("c.toml");
    std::fs::write(
        &config,
        "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 10\nrate = 1\nper = \"1h\"\n",
    )
    .unwrap();
    let child = Command::new(BIN)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--backend", "lua"])
        .arg("--config")
        .arg(&config)
        .args(redis_flags)
        .args(["--failure-instances", "2"])
        .env("RL_KEY_SECRET", "process-test-shared-secret")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut proc = ChildGuard(child);
    wait_for_port(port, "ratelimiter without redis").unwrap();

    let (status, _, body) = probe(port, "/readyz");
    assert_eq!(status, 200, "degraded but serving: {body}");
    assert!(body.contains("\"degraded\""), "{body}");
    // Requests follow the failure mode: the local share, half the burst.
    let (status, limit, _) = probe(port, "/api/items");
    assert_eq!((status, limit.as_deref()), (200, Some("5")));

    let _redis = start();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, limit, _) = probe(port, "/api/items");
        assert!(status == 200 || status == 429, "status {status}");
        let (_, _, ready) = probe(port, "/readyz");
        if limit.as_deref() == Some("10") && ready.contains("\"ready\"") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never connected to Redis: {ready}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(proc.0.try_wait().unwrap().is_none(), "the process is alive");
}

#[test]
fn starts_without_redis_and_connects_when_it_appears() {
    let redis_port = free_port().unwrap();
    starts_degraded_then_connects(
        &[
            "--redis-url".into(),
            format!("redis://127.0.0.1:{redis_port}"),
        ],
        || RedisServer::start_on(redis_port, &[]).unwrap(),
    );
}

#[test]
fn starts_without_a_redis_cluster_and_connects_when_it_appears() {
    let base = testkit::free_port_block(3, true).unwrap();
    let ports = [base, base + 1, base + 2];
    let flags: Vec<String> = ports
        .iter()
        .flat_map(|p| ["--redis-cluster".into(), format!("redis://127.0.0.1:{p}")])
        .collect();
    starts_degraded_then_connects(&flags, || RedisCluster::start_on(ports).unwrap());
}

/// A trusted range wider than the threshold is warned about at start-up,
/// naming the range (here before the bind fails on a taken port).
#[test]
fn a_wide_trusted_range_is_warned_about() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let out = Command::new(BIN)
        .args([
            "--trusted-proxy",
            "10.0.0.0/8",
            "--trusted-proxy",
            "10.9.9.1",
        ])
        .args(["--listen", &taken])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("trusted proxy range holds more than 256 addresses")
            && stderr.contains("10.0.0.0/8"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("10.9.9.1/32"),
        "a single proxy is not wide: {stderr}"
    );
}

/// A connection cap the descriptor limit cannot hold is warned about at
/// start-up: at 300 open files, the default cap of 512 connections would
/// never apply (accept fails first).
#[test]
fn a_connection_cap_over_the_descriptor_limit_is_warned_about() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let run = |max: &str| {
        let out = Command::new("sh")
            .args(["-c", "ulimit -n 300 && exec \"$0\" \"$@\""])
            .arg(BIN)
            .args(["--listen", &taken, "--http-max-connections", max])
            .args(["--http-max-connections-per-address", "1"])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let stderr = run("512");
    assert!(
        stderr.contains("over the process's open-files limit") && stderr.contains("300"),
        "{stderr}"
    );
    let stderr = run("200");
    assert!(
        !stderr.contains("open-files limit"),
        "200 + 64 fits in 300: {stderr}"
    );
}

/// `rediss://` without a CA file trusts the system's roots, as a managed
/// Redis with a public certificate needs: here the test CA, made a system
/// root by `SSL_CERT_FILE` (what rustls-native-certs reads, as OpenSSL
/// does). Without it the same server is refused (`tls` in `/readyz`), and
/// the instance serves by its local share meanwhile.
#[test]
fn a_rediss_url_trusts_the_system_roots() {
    let certs = testkit::TestCerts::generate().unwrap();
    let redis = RedisServer::start_tls(&certs, false, &[]).unwrap();
    let dir = TempDir::new("tls-roots").unwrap();
    let config = dir.0.join("c.toml");
    std::fs::write(
        &config,
        "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 10\nrate = 1\nper = \"1h\"\n",
    )
    .unwrap();
    let start = |ca: Option<&std::path::Path>| {
        let port = free_port().unwrap();
        let mut command = Command::new(BIN);
        command
            .args(["--listen", &format!("127.0.0.1:{port}"), "--backend", "lua"])
            .args(["--redis-url", &redis.url(), "--failure-instances", "2"])
            .arg("--config")
            .arg(&config)
            .env("RL_KEY_SECRET", "process-test-shared-secret")
            .env_remove("SSL_CERT_FILE")
            .env_remove("SSL_CERT_DIR")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(ca) = ca {
            command.env("SSL_CERT_FILE", ca);
        }
        let child = ChildGuard(command.spawn().unwrap());
        wait_for_port(port, "ratelimiter over TLS").unwrap();
        (child, port)
    };

    let (_untrusting, port) = start(None);
    let (status, _, body) = probe(port, "/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"error\":\"tls\""), "{body}");
    let (status, limit, _) = probe(port, "/api/items");
    assert_eq!(
        (status, limit.as_deref()),
        (200, Some("5")),
        "the local share"
    );

    let (_trusting, port) = start(Some(&certs.ca));
    let (_, _, body) = probe(port, "/readyz");
    assert!(body.contains("\"ready\""), "{body}");
    let (status, limit, _) = probe(port, "/api/items");
    assert_eq!(
        (status, limit.as_deref()),
        (200, Some("10")),
        "Redis decides"
    );
}
