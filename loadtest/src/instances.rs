//! API instances for the scenarios that start their own: this executable
//! re-run as `loadtest instance`, which runs exactly what the `ratelimiter`
//! binary runs, as a [`Fleet`] of separate processes.

use anyhow::Context;
use std::process::{Command, Stdio};
use testkit::Fleet;

/// Starts `count` instances with the given service flags, each with its
/// own `--listen` and `--instance-id load-<i>`, and waits until each
/// listens. Their logs go to stderr at `INSTANCE_LOG` (default `warn`).
pub fn start(count: usize, flags: &[String]) -> anyhow::Result<Fleet> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let log = std::env::var("INSTANCE_LOG").unwrap_or_else(|_| "warn".into());
    Fleet::start(count, "load", || {
        let mut command = Command::new(&exe);
        command
            .arg("instance")
            .args(flags)
            .env("RUST_LOG", &log)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        command
    })
}
