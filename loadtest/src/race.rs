//! The race hammer: how many requests does one key get through, against a
//! known budget, when K instances share (or fail to share) its bucket?
//!
//! For each backend, instance count K and concurrency C, it starts K API
//! instances (separate processes) on one Redis, gives one API key a budget of
//! `burst` tokens that cannot refill during the run (1 token per hour), fires
//! `requests` requests from C concurrent clients spread round-robin over the
//! instances, and counts the 200s. Anything above the budget is
//! over-admission: memory admits about K x the budget (each instance has its
//! own bucket), naive more than the budget and more with concurrency (two
//! instances read the same last token and both spend it), lua exactly the
//! budget.

use anyhow::{Context, bail};
use std::fmt::Write as _;
use std::time::Instant;
use testkit::{RedisServer, TempDir};

/// The race command's options.
#[derive(Debug, Clone, clap::Args)]
pub struct RaceArgs {
    /// Backends to compare (memory, naive, lua)
    #[arg(long, value_delimiter = ',', default_value = "memory,naive,lua")]
    pub backends: Vec<String>,
    /// Instance counts K to try
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    pub instances: Vec<usize>,
    /// Concurrent clients C to try
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    pub concurrency: Vec<usize>,
    /// The key's budget: its bucket's burst (no refill during the run)
    #[arg(long, default_value_t = 200)]
    pub budget: u64,
    /// Requests per run (should exceed K x budget to show memory's K x)
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// Use this Redis instead of starting a redis-server
    #[arg(long)]
    pub redis_url: Option<String>,
    /// Also write the table as CSV to this file
    #[arg(long)]
    pub csv: Option<std::path::PathBuf>,
}

/// One run's result.
#[derive(Debug, Clone)]
pub struct RaceResult {
    /// Backend name.
    pub backend: String,
    /// Instances K.
    pub instances: usize,
    /// Concurrent clients C.
    pub concurrency: usize,
    /// Requests sent.
    pub requests: usize,
    /// The budget.
    pub budget: u64,
    /// 200 responses.
    pub admitted: usize,
    /// Responses other than 200 and 429.
    pub errors: usize,
    /// Wall time of the run, seconds.
    pub seconds: f64,
}

impl RaceResult {
    /// Admitted beyond the budget.
    pub fn over(&self) -> i64 {
        self.admitted as i64 - self.budget as i64
    }
}

fn config_file(dir: &TempDir, budget: u64) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.0.join("race.toml");
    std::fs::write(
        &path,
        format!(
            "key_secret = \"race-hammer-shared-secret\"\n\
             [[api_keys]]\nid = \"victim\"\nkey = \"race-key\"\n\
             [[policies]]\nname = \"race\"\nroute = \"/api/\"\nburst = {budget}\nrate = 1\nper = \"1h\"\n"
        ),
    )?;
    Ok(path)
}

/// Runs the whole matrix and prints (and optionally saves) the table.
pub async fn run(args: RaceArgs) -> anyhow::Result<Vec<RaceResult>> {
    for b in &args.backends {
        if !["memory", "naive", "lua"].contains(&b.as_str()) {
            bail!("unknown backend {b:?} (memory, naive, lua)");
        }
    }
    let own_redis;
    let redis_url = match &args.redis_url {
        Some(url) => url.clone(),
        None => {
            own_redis = RedisServer::start()?;
            own_redis.url()
        }
    };
    let dir = TempDir::new("race")?;
    let config = config_file(&dir, args.budget)?;
    let mut results = Vec::new();
    let mut run_id = 0;
    for backend in &args.backends {
        for &k in &args.instances {
            for &c in &args.concurrency {
                run_id += 1;
                let flags = vec![
                    "--config".to_owned(),
                    config.display().to_string(),
                    "--backend".to_owned(),
                    backend.clone(),
                    "--redis-url".to_owned(),
                    redis_url.clone(),
                    // The race measures admission, not latency: generous
                    // timeouts keep a starved core from turning into 503s.
                    "--redis-response-timeout".to_owned(),
                    "2s".to_owned(),
                    "--redis-connect-timeout".to_owned(),
                    "2s".to_owned(),
                    // ... and a failure that still happens is an error
                    // (503), never a quiet local decision in the count.
                    "--failure-deadline".to_owned(),
                    "2s".to_owned(),
                    "--failure-mode".to_owned(),
                    "closed".to_owned(),
                    // A fresh bucket per run: a new key prefix.
                    "--redis-prefix".to_owned(),
                    format!("race:{}:{run_id}:", std::process::id()),
                ];
                let instances = crate::instances::start(k, &flags).context("starting instances")?;
                let started = Instant::now();
                let urls: Vec<String> = instances
                    .urls
                    .iter()
                    .map(|u| format!("{u}/api/items"))
                    .collect();
                let tally = testkit::hammer(&urls, args.requests, c, "race-key").await?;
                let (admitted, errors) = (tally.admitted, tally.errors);
                let result = RaceResult {
                    backend: backend.clone(),
                    instances: k,
                    concurrency: c,
                    requests: args.requests,
                    budget: args.budget,
                    admitted,
                    errors,
                    seconds: started.elapsed().as_secs_f64(),
                };
                eprintln!(
                    "race: {backend} K={k} C={c}: admitted {admitted} of budget {} (over {}), errors {errors}",
                    args.budget,
                    result.over()
                );
                results.push(result);
                drop(instances);
            }
        }
    }
    println!("{}", markdown(&results));
    if let Some(path) = &args.csv {
        std::fs::write(path, csv(&results))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(results)
}

/// The results as a markdown table.
pub fn markdown(results: &[RaceResult]) -> String {
    let mut out = String::from(
        "| backend | instances K | clients C | requests | budget | admitted | over-admitted | admitted / budget | errors |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {} |",
            r.backend,
            r.instances,
            r.concurrency,
            r.requests,
            r.budget,
            r.admitted,
            r.over(),
            r.admitted as f64 / r.budget as f64,
            r.errors
        );
    }
    out
}

/// The results as CSV.
pub fn csv(results: &[RaceResult]) -> String {
    let mut out = String::from(
        "backend,instances,concurrency,requests,budget,admitted,over,errors,seconds\n",
    );
    for r in results {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{},{:.3}",
            r.backend,
            r.instances,
            r.concurrency,
            r.requests,
            r.budget,
            r.admitted,
            r.over(),
            r.errors,
            r.seconds
        );
    }
    out
}
