//! The examples do what their "run with" header says, as built by
//! `cargo test --all-targets` (or built here if a narrower run skipped
//! them).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use testkit::{ChildGuard, free_port, wait_for_listener};

/// The built example `name`, beside this test's executable.
fn example(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let path = deps
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--example", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(status.success(), "cargo build --example {name}");
    }
    path
}

#[tokio::test]
async fn the_axum_example_limits_its_route_with_the_headers() {
    let port = free_port().unwrap();
    let mut child = ChildGuard(
        Command::new(example("axum_service"))
            .arg(format!("127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_listener(&mut child, port, "the axum_service example").unwrap();
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/hello/you");
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let response = client.get(&url).send().await.unwrap();
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        assert!(
            headers.contains_key("ratelimit-policy"),
            "{status}: {headers:?}"
        );
        if status == 200 {
            assert_eq!(response.text().await.unwrap(), "hello, you\n");
        } else {
            assert_eq!(headers["content-type"], "application/problem+json");
            assert!(headers.contains_key("retry-after"));
        }
        statuses.push(status);
    }
    // A burst of 3 for one client; the next token is a second away.
    assert_eq!(statuses, [200, 200, 200, 429]);
}
