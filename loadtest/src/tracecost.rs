//! What tracing costs a request: `cargo run --release -p loadtest --
//! trace-cost`.
//!
//! One API instance on the lua backend and a real redis-server, started
//! fresh for each run; an OTLP receiver in this process that counts the
//! spans it gets (gRPC). Three settings, run alternately `--repeats` times
//! so the machine's drift falls on all of them alike:
//!
//! - `off`: no endpoint (the spans are not even built);
//! - `0.01`: export, parent-based ratio 0.01;
//! - `1`: export every trace.
//!
//! Each run is a closed loop: `--clients` clients each send the next GET as
//! soon as the last answered, for `--seconds`, after a one-second warm-up.
//! Every request passes the limiter (the policy's limit is far above the
//! load) and makes one Redis call, so each carries three spans when
//! sampled. Reported: requests per second and latency p50/p99 per run,
//! with min/median/max over the repeats, and each setting's throughput as
//! a ratio of `off`'s in the same round.

use anyhow::Context;
use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use testkit::{ChildGuard, OtlpReceiver, RedisServer, TempDir, free_port, wait_for_port};

/// The trace-cost command's options.
#[derive(Debug, Clone, clap::Args)]
pub struct TraceCostArgs {
    /// Seconds of load per run (after a one-second warm-up)
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Runs of each setting, alternating
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Concurrent clients (closed loop)
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
}

/// One run's figures.
#[derive(Debug, Clone, Copy)]
struct Run {
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: usize,
}

const SETTINGS: [&str; 3] = ["off", "0.01", "1"];

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

async fn load(
    url: &str,
    clients: usize,
    warmup: Duration,
    measure: Duration,
) -> anyhow::Result<Run> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(clients)
        .build()?;
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (http, url, measuring, stop) = (
            http.clone(),
            url.to_owned(),
            Arc::clone(&measuring),
            Arc::clone(&stop),
        );
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0;
            while !stop.load(Ordering::Relaxed) {
                let sent = Instant::now();
                let ok = matches!(http.get(&url).send().await, Ok(r) if r.status() == 200);
                if measuring.load(Ordering::Relaxed) {
                    latencies.push(sent.elapsed());
                    errors += usize::from(!ok);
                }
            }
            (latencies, errors)
        }));
    }
    tokio::time::sleep(warmup).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(measure).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (latencies, e) = t.await?;
        all.extend(latencies);
        errors += e;
    }
    all.sort();
    Ok(Run {
        per_second: all.len() as f64 / elapsed.as_secs_f64(),
        p50_ms: percentile(&all, 0.5),
        p99_ms: percentile(&all, 0.99),
        errors,
    })
}

async fn run_one(
    setting: &str,
    redis: &RedisServer,
    receiver: &OtlpReceiver,
    config: &std::path::Path,
    args: &TraceCostArgs,
) -> anyhow::Result<Run> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let port = free_port()?;
    let mut command = Command::new(exe);
    command
        .arg("instance")
        .args(["--listen", &format!("127.0.0.1:{port}"), "--backend", "lua"])
        .args(["--redis-url", &redis.url(), "--instance-id", "trace-cost"])
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if setting != "off" {
        command
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.grpc)
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            .env("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
            .env("OTEL_TRACES_SAMPLER_ARG", setting);
    }
    let _instance = ChildGuard(command.spawn().context("cannot start the instance")?);
    wait_for_port(port, "API instance")?;
    load(
        &format!("http://127.0.0.1:{port}/api/items"),
        args.clients,
        Duration::from_secs(1),
        Duration::from_secs_f64(args.seconds),
    )
    .await
}

fn summary(values: &mut [f64]) -> String {
    values.sort_by(f64::total_cmp);
    let median = values[values.len() / 2];
    format!(
        "{:.0} / {:.0} / {:.0}",
        values[0],
        median,
        values[values.len() - 1]
    )
}

fn summary_ms(values: &mut [f64]) -> String {
    values.sort_by(f64::total_cmp);
    format!(
        "{:.2} / {:.2} / {:.2}",
        values[0],
        values[values.len() / 2],
        values[values.len() - 1]
    )
}

/// Runs every setting `repeats` times, alternating, and prints the table.
pub async fn run(args: TraceCostArgs) -> anyhow::Result<String> {
    let redis = RedisServer::start()?;
    let receiver = OtlpReceiver::sink().await?;
    let dir = TempDir::new("trace-cost")?;
    let config = dir.join("trace-cost.toml");
    std::fs::write(
        &config,
        "key_secret = \"trace-cost-shared-secret\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 100000000\nrate = 100000000\n",
    )?;
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); SETTINGS.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); SETTINGS.len()];
    for round in 0..args.repeats {
        let mut off = f64::NAN;
        for (i, setting) in SETTINGS.iter().enumerate() {
            let before = receiver.count();
            let run = run_one(setting, &redis, &receiver, &config, &args).await?;
            // Spans still queued at the instance's exit are lost with it:
            // the count is what arrived.
            eprintln!(
                "trace-cost: round {} {setting}: {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, {} errors, {} spans",
                round + 1,
                run.per_second,
                run.p50_ms,
                run.p99_ms,
                run.errors,
                receiver.count() - before
            );
            anyhow::ensure!(run.errors == 0, "{} requests failed", run.errors);
            if i == 0 {
                off = run.per_second;
            }
            ratios[i].push(run.per_second / off);
            runs[i].push(run);
        }
    }
    let mut out = String::new();
    writeln!(
        out,
        "| tracing | requests/s (min / median / max) | vs off, same round (median) | p50 ms | p99 ms |"
    )?;
    writeln!(out, "|---|---|---|---|---|")?;
    for (i, setting) in SETTINGS.iter().enumerate() {
        let mut rps: Vec<f64> = runs[i].iter().map(|r| r.per_second).collect();
        let mut p50: Vec<f64> = runs[i].iter().map(|r| r.p50_ms).collect();
        let mut p99: Vec<f64> = runs[i].iter().map(|r| r.p99_ms).collect();
        let mut ratio = ratios[i].clone();
        ratio.sort_by(f64::total_cmp);
        let label = match *setting {
            "off" => "off (no endpoint)".to_owned(),
            ratio => format!("ratio {ratio}"),
        };
        writeln!(
            out,
            "| {label} | {} | {:.2} | {} | {} |",
            summary(&mut rps),
            ratio[ratio.len() / 2],
            summary_ms(&mut p50),
            summary_ms(&mut p99),
        )?;
    }
    println!("{out}");
    Ok(out)
}
