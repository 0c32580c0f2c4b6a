//! Load scenarios for the rate limiter, built on goose.
//!
//! `cargo run -p loadtest -- smoke -H http://127.0.0.1:8080` drives the
//! sample API with one API key and reports how many requests were admitted
//! (200) and throttled (429). A 429 is an expected answer of a rate limiter,
//! not a failure, so it is recorded as a success; anything else non-2xx is a
//! failure. Every goose option (`-u` users, `-t` run time, `--iterations`,
//! reports) follows the subcommand. Runs are bounded: without `-t` or
//! `--iterations` a scenario stops after 10 s.
//!
//! `cargo run -p loadtest -- race` is the race hammer (see `race.rs`): it
//! starts its own redis-server and API instances (this executable re-run as
//! `loadtest instance`, which runs exactly what the `ratelimiter` binary
//! runs) and measures over-admission per backend.
//!
//! `cargo run -p loadtest -- compare` runs every algorithm (token bucket,
//! GCRA, fixed window, sliding log, sliding-window counter) through its Lua
//! script on the same policy and traffic shapes (see `compare.rs`).
//!
//! `cargo run -p loadtest -- trace-cost` measures what tracing costs a
//! request: off, ratio 0.01 and 1, alternately (see `tracecost.rs`).
//!
//! `cargo run --release -p loadtest -- http-cost` measures server CPU per
//! request over HTTP beside tower_governor and plain axum (see
//! `httpcost/`).
//!
//! `cargo run -p loadtest -- outage` kills, hangs, slows and black-holes
//! Redis under load (see `outage.rs`) and measures what each failure mode
//! admits, how long requests wait and how fast Redis takes over again.

mod capacity;
mod cluster;
mod compare;
mod cpu;
mod drill;
mod hotkey;
mod http1;
mod httpcost;
mod instances;
mod luabench;
mod mitigations;
mod outage;
mod panels;
mod prom;
mod proxy;
mod race;
mod results;
mod scenario;
mod tracecost;
mod traffic;

use clap::{Parser, Subcommand};
use goose::config::GooseConfiguration;
use goose::prelude::*;
use std::sync::OnceLock;

#[derive(Debug, Parser)]
#[command(name = "loadtest", about = "Load scenarios for the rate limiter")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One API key against GET /api/items: admitted vs throttled.
    Smoke {
        /// API key sent as X-Api-Key (must be configured on the server)
        #[arg(long, default_value = "demo-key-a")]
        api_key: String,
        #[command(flatten)]
        goose: Box<GooseConfiguration>,
    },
    /// Steady realistic traffic against the stack: tenants by Zipf
    /// popularity, abusive tenants, anonymous clients; every answer checked.
    Mixed(scenario::TrafficArgs),
    /// The hot-key incident, live: mixed traffic, a paced surge on one
    /// identity (10 minutes unless told), mixed again; with
    /// --mitigate-at, the runbook's mitigation switched on during it.
    Hotkey(hotkey::HotkeyArgs),
    /// The hot-key drill of runbooks/hot-key.md: healthy, incident (the
    /// instances mistrust nginx), mitigated (deny cache), fixed; measured
    /// with the dashboard's own queries.
    Drill(drill::DrillArgs),
    /// The hot-key mitigations on real Redis: false denials, over-admission
    /// and Redis calls per admission against one exact bucket; a sharded
    /// key's throughput on a CPU-capped cluster.
    Mitigations(mitigations::MitigationsArgs),
    /// Where the Redis round trip, not the application, bounds one
    /// instance: offered load stepped up, 0-2 ms added to each round trip,
    /// beside no limiter and the memory limiter.
    Capacity(capacity::CapacityArgs),
    /// Over-admission of one key across K instances: memory vs naive vs lua.
    Race(race::RaceArgs),
    /// Redis CPU per Lua check and checks/s, ours beside redis-benchmark.
    LuaBench(luabench::LuaBenchArgs),
    /// Redis killed, hung, slowed, black-holed under load: each failure mode measured.
    Outage(outage::OutageArgs),
    /// A cluster's master killed (replica promoted), slots resharded and
    /// scripts flushed under load: what each costs the keys it touches
    /// and the others.
    ClusterFaults(cluster::ClusterArgs),
    /// Every algorithm on the same policy: accuracy by traffic shape, memory, cost.
    Compare(compare::CompareArgs),
    /// Throughput and latency with tracing off, at ratio 0.01 and at 1.
    TraceCost(tracecost::TraceCostArgs),
    /// Server CPU per request over HTTP: unlimited, memory, lua and denied
    /// routes beside tower_governor and a plain axum handler, pinned.
    HttpCost(httpcost::HttpCostArgs),
    /// The overview dashboard's panel queries, filled in (no Grafana
    /// needed), and with --eval their values now.
    Panels(panels::PanelsArgs),
    /// Run one API instance (what the `ratelimiter` binary runs); used by
    /// the scenarios that start their own instances.
    #[command(hide = true)]
    Instance(Box<ratelimiter::config::Cli>),
}

static API_KEY: OnceLock<String> = OnceLock::new();

/// Records 200 and 429 as expected outcomes, anything else as a failure.
async fn get_items(user: &mut GooseUser) -> TransactionResult {
    let key = API_KEY.get().map(String::as_str).unwrap_or_default();
    let builder = user
        .get_request_builder(&GooseMethod::Get, "/api/items")?
        .header("x-api-key", key);
    let request = GooseRequest::builder()
        .path("/api/items")
        .set_request_builder(builder)
        .build();
    let mut goose = user.request(request).await?;
    if let Ok(response) = &goose.response
        && response.status().as_u16() == 429
    {
        return user.set_success(&mut goose.request);
    }
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // The error and its causes on one line, without a backtrace: these
    // are a tool's messages (nothing listening, a broken contract), not
    // crashes.
    match run(Cli::parse().command).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Smoke { api_key, goose } => {
            scenario::require_stack(&goose)?;
            API_KEY.set(api_key).ok();
            let bounded = goose.run_time.is_some() || goose.iterations.is_some();
            let mut attack = GooseAttack::initialize_with_config(*goose)?
                .register_scenario(scenario!("smoke").register_transaction(transaction!(get_items)))
                .set_default(GooseDefault::Host, "http://127.0.0.1:8080")?
                // Every user at once, so the run time is the time the
                // bucket refills for (a slow ramp-up would add to it).
                .set_default(GooseDefault::IncreaseRate, "1000")?
                // Count the whole run, ramp-up included: the burst is spent then.
                .set_default(GooseDefault::NoResetMetrics, true)?
                // goose lists each 429 as an error before `set_success`
                // reclassifies it; our own tally below reports real failures.
                .set_default(GooseDefault::NoErrorSummary, true)?;
            if !bounded {
                attack = attack.set_default(GooseDefault::RunTime, 10)?;
            }
            let metrics = attack.execute().await?;
            let mut admitted = 0;
            let mut throttled = 0;
            let mut other = 0;
            for aggregate in metrics.requests.values() {
                for (status, count) in &aggregate.status_code_counts {
                    match status {
                        200 => admitted += count,
                        429 => throttled += count,
                        _ => other += count,
                    }
                }
            }
            println!(
                "smoke: admitted {admitted}, throttled {throttled}, other {other} in {} s",
                metrics.duration
            );
            anyhow::ensure!(other == 0, "{other} responses were neither 200 nor 429");
        }
        Command::Mixed(args) => {
            // Steady traffic: any error fails the run.
            let report = scenario::mixed(args).await?;
            anyhow::ensure!(
                report.broken() + report.unavailable() == 0,
                "{} answers broke the contract, {} were 5xx or none",
                report.broken(),
                report.unavailable()
            );
        }
        Command::Hotkey(args) => {
            // 5xx under the surge are the incident, reported above; an
            // answer that breaks the contract is a bug.
            let report = hotkey::run(args).await?;
            anyhow::ensure!(
                report.broken() == 0,
                "{} answers broke the contract",
                report.broken()
            );
        }
        Command::Capacity(args) => capacity::run(args).await?,
        Command::Drill(args) => drill::run(args).await?,
        Command::Panels(args) => panels::print(args).await?,
        Command::Race(args) => {
            let results = race::run(args).await?;
            let errors: usize = results.iter().map(|r| r.errors).sum();
            anyhow::ensure!(
                errors == 0,
                "{errors} requests failed (neither 200 nor 429)"
            );
        }
        Command::LuaBench(args) => luabench::run(args).await?,
        Command::Mitigations(args) => mitigations::run(args).await?,
        Command::Compare(args) => {
            compare::run(args).await?;
        }
        Command::TraceCost(args) => {
            tracecost::run(args).await?;
        }
        Command::HttpCost(args) => httpcost::run(args).await?,
        Command::Outage(args) => {
            let results = outage::run(args).await?;
            let errors: usize = results.iter().map(|r| r.errors).sum();
            anyhow::ensure!(
                errors == 0,
                "{errors} requests failed (transport error or unexpected 5xx)"
            );
        }
        Command::ClusterFaults(args) => {
            let results = cluster::run(args).await?;
            let errors: usize = results
                .iter()
                .map(|r| r.touched.errors + r.untouched.errors)
                .sum();
            anyhow::ensure!(
                errors == 0,
                "{errors} requests failed (transport error or 5xx)"
            );
        }
        Command::Instance(cli) => {
            // As the binary: SIGHUP reloads from the same flags and file.
            let config = ratelimiter::config::Config::load((*cli).clone())?;
            ratelimiter::server::run(config, Some(*cli)).await?;
        }
    }
    Ok(())
}
