//! API instances as separate processes, and the hammer.

use crate::process::{ChildGuard, free_port, wait_for_listener};
use anyhow::Context;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// N API instances, each its own process on its own free port; killed on
/// drop.
#[derive(Debug)]
pub struct Fleet {
    /// Base URLs, `http://127.0.0.1:<port>`, in instance order.
    pub urls: Vec<String>,
    children: Vec<ChildGuard>,
}

impl Fleet {
    /// Starts `count` instances, each from `command()` (the program, its
    /// flags and environment) plus `--listen 127.0.0.1:<port>` and
    /// `--instance-id <id_prefix>-<i>`, and waits until each listens.
    pub fn start(
        count: usize,
        id_prefix: &str,
        command: impl Fn() -> Command,
    ) -> anyhow::Result<Self> {
        let mut urls = Vec::with_capacity(count);
        let mut children = Vec::with_capacity(count);
        for i in 0..count {
            let port = free_port()?;
            let child = command()
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--instance-id", &format!("{id_prefix}-{i}")])
                .spawn()
                .context("cannot start an API instance")?;
            let mut child = ChildGuard(child);
            wait_for_listener(&mut child, port, "API instance")?;
            children.push(child);
            urls.push(format!("http://127.0.0.1:{port}"));
        }
        Ok(Self { urls, children })
    }

    /// The instances' process ids, in instance order.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(ChildGuard::pid).collect()
    }
}

/// What the hammer saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// 200 answers.
    pub admitted: usize,
    /// 429 answers.
    pub throttled: usize,
    /// Anything else: other statuses and transport errors.
    pub errors: usize,
    /// The first error, described (status and body, or the transport error).
    pub first_error: Option<String>,
}

/// Sends `requests` GETs carrying `X-Api-Key: api_key` from `concurrency`
/// concurrent clients, round-robin over `urls` (full URLs), and counts the
/// answers.
pub async fn hammer(
    urls: &[String],
    requests: usize,
    concurrency: usize,
    api_key: &str,
) -> anyhow::Result<Tally> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let next = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let urls: Arc<Vec<String>> = Arc::new(urls.to_vec());
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let (http, next, tally, urls) = (
            http.clone(),
            Arc::clone(&next),
            Arc::clone(&tally),
            Arc::clone(&urls),
        );
        let api_key = api_key.to_owned();
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= requests {
                    break;
                }
                let url = &urls[n % urls.len()];
                let answer = match http.get(url).header("x-api-key", &api_key).send().await {
                    Ok(r) if r.status() == 200 => Ok(true),
                    Ok(r) if r.status() == 429 => Ok(false),
                    Ok(r) => Err(format!(
                        "{url}: status {}: {}",
                        r.status(),
                        r.text().await.unwrap_or_default()
                    )),
                    Err(e) => Err(format!("{url}: {e}")),
                };
                let mut tally = tally.lock().unwrap_or_else(PoisonError::into_inner);
                match answer {
                    Ok(true) => tally.admitted += 1,
                    Ok(false) => tally.throttled += 1,
                    Err(e) => {
                        tally.errors += 1;
                        tally.first_error.get_or_insert(e);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let tally = tally.lock().unwrap_or_else(PoisonError::into_inner).clone();
    Ok(tally)
}
