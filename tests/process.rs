//! The binary as a user runs it: flags, env, start-up validation, signals.

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");

/// A child process killed on drop, so a failing test leaves nothing behind.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_ready(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("server on port {port} did not come up");
}

fn get(port: u16, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut req = reqwest::Client::new().get(format!("http://127.0.0.1:{port}{path}"));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, text)
    })
}

#[test]
fn serves_from_env_and_flags_and_stops_cleanly_on_sigterm() {
    let port = free_port();
    let child = Command::new(BIN)
        .env("RL_LISTEN", format!("127.0.0.1:{port}"))
        .env("RL_INSTANCE_ID", "proc-test")
        .args(["--backend", "memory", "--trusted-proxy", "10.0.0.0/8"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut proc = Proc(child);
    wait_ready(port);
    let (status, body) = get(port, "/api/status", &[]);
    assert_eq!(status, 200);
    assert!(body.contains("proc-test"), "{body}");
    // The built-in default: 100 per client, then 429.
    let statuses: Vec<u16> = (0..101).map(|_| get(port, "/api/items", &[]).0).collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        100,
        "{statuses:?}"
    );
    assert_eq!(statuses[100], 429);

    let kill = Command::new("kill")
        .args(["-TERM", &proc.0.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = proc.0.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "no exit 10 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "exit after SIGTERM: {exit:?}");
    let mut stderr = String::new();
    proc.0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(stderr.contains("shutdown signal received"), "{stderr}");
}

#[test]
fn invalid_config_fails_at_startup_naming_the_field() {
    let dir = std::env::temp_dir().join(format!("rl-proc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
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
    std::fs::remove_dir_all(dir).unwrap();
}
