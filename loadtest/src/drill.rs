//! `loadtest drill`: the hot-key incident of `runbooks/hot-key.md`, end to
//! end, on a running stack, measured as the dashboards show it.
//!
//! Four phases of the same steady traffic (well-behaved tenants, and many
//! anonymous clients each under its own limit, each from its own address):
//!
//! 1. **healthy**;
//! 2. **incident**: `scripts/drill mistrust on` (the root cause: the
//!    instances no longer trust nginx, so every anonymous client is keyed by
//!    nginx's address: one bucket, one hot slot, real users throttled);
//! 3. **mitigated**: `scripts/drill deny-cache on` (Redis is spared the
//!    hot key; the users are still throttled, by the root cause);
//! 4. **fixed**: `scripts/drill mistrust off`.
//!
//! At the end `scripts/drill deny-cache off` puts the stack back. Every
//! figure from the stack comes from the overview dashboard's own panel
//! queries (read from its JSON by title, `$__rate_interval` set to 15 s),
//! evaluated every 5 s on the stack's Prometheus and averaged per phase,
//! beside the alerts that fired in each phase: the table and the pictures
//! show what the dashboard and the alerts showed. The client
//! side adds what only it knows: which answers were false denials
//! (every client here stays within its own limit) and how many the one
//! shared bucket admitted against what one exact bucket allows.

use crate::panels::{self, Series, mean, over_run};
use crate::prom::Prometheus;
use crate::results::{self, Chart, Table};
use crate::traffic::{self, Tenant, Verdict};
use anyhow::Context;
use clap::Args;
use rand::Rng;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

#[derive(Debug, Args)]
pub struct DrillArgs {
    /// Seconds per phase (healthy, incident, mitigated, fixed)
    #[arg(long, default_value_t = 60)]
    pub phase_secs: u64,
    /// The API, through nginx
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub target: String,
    /// The stack's Prometheus
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub prometheus: String,
    /// The stack runs in compose (the switches get --compose)
    #[arg(long)]
    pub compose: bool,
    /// Anonymous clients, each about 1 request/s (their limit is 2/s)
    #[arg(long, default_value_t = 200)]
    pub anonymous: u64,
    /// Requests per second of each tenant (their limit is 10/s)
    #[arg(long, default_value_t = 4)]
    pub tenant_rate: u64,
    /// The service config whose plain api_keys are the tenants
    #[arg(long, default_value = "config/stack.toml")]
    pub tenants: PathBuf,
    /// Where the results go [default: results/drill-<UTC time>]
    #[arg(long)]
    pub results: Option<PathBuf>,
}

const PHASES: [&str; 4] = ["healthy", "incident", "mitigated", "fixed"];
/// What starts each phase after the first.
const SWITCHES: [(&str, &str); 3] = [
    ("mistrust", "on"),
    ("deny-cache", "on"),
    ("mistrust", "off"),
];
/// The anonymous limit of config/stack.toml's `api` policy.
const ANONYMOUS_BURST: f64 = 20.0;
const ANONYMOUS_RATE: f64 = 2.0;
/// Seconds at the start of a phase left out of its means: the panels'
/// rates look 15 s back, and the hot-key gauges show the last complete
/// 10 s window.
const SETTLE: f64 = 20.0;

/// Answers per phase: admitted, throttled, other (5xx, none, broken).
#[derive(Debug, Default)]
struct Tally {
    counts: [[AtomicU64; 3]; 4],
}

impl Tally {
    fn record(&self, phase: usize, verdict: &Verdict) {
        let i = match verdict {
            Verdict::Admitted => 0,
            Verdict::Throttled => 1,
            Verdict::Unavailable(_) | Verdict::Broken(_) => 2,
        };
        self.counts[phase][i].fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self, phase: usize) -> [u64; 3] {
        self.counts[phase]
            .each_ref()
            .map(|c| c.load(Ordering::Relaxed))
    }
}

#[derive(Debug)]
struct Shared {
    start: Instant,
    phase: AtomicUsize,
    stop: std::sync::atomic::AtomicBool,
    tenants: Tally,
    anonymous: Tally,
    /// Anonymous answers per 5 s since the start: (admitted, all).
    bins: std::sync::Mutex<BTreeMap<u64, (u64, u64)>>,
    errors: std::sync::Mutex<BTreeMap<String, u64>>,
}

impl Shared {
    fn record(&self, anonymous: bool, verdict: &Verdict) {
        let phase = self.phase.load(Ordering::Relaxed);
        if anonymous {
            self.anonymous.record(phase, verdict);
            let bin = self.start.elapsed().as_secs() / 5;
            let mut bins = self.bins.lock().unwrap_or_else(|e| e.into_inner());
            let entry = bins.entry(bin).or_default();
            entry.0 += u64::from(*verdict == Verdict::Admitted);
            entry.1 += 1;
        } else {
            self.tenants.record(phase, verdict);
        }
        if let Verdict::Unavailable(why) | Verdict::Broken(why) = verdict {
            let mut errors = self.errors.lock().unwrap_or_else(|e| e.into_inner());
            *errors.entry(why.clone()).or_default() += 1;
        }
    }
}

/// One request, checked.
async fn send(client: &reqwest::Client, url: &str, key: Option<&str>) -> Verdict {
    let mut request = client.get(url);
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    match request.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            let verdict = traffic::check(status, r.headers());
            let _ = r.bytes().await;
            verdict
        }
        Err(e) => Verdict::Unavailable(if e.is_timeout() {
            "timeout".into()
        } else {
            "transport".into()
        }),
    }
}

/// Requests at `per_second` (±30 % jitter) until told to stop.
async fn client_loop(
    shared: Arc<Shared>,
    client: reqwest::Client,
    url: String,
    key: Option<String>,
    per_second: f64,
    seed: u64,
) {
    use rand::SeedableRng;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let period = 1.0 / per_second;
    // Spread the clients' first requests over one period.
    tokio::time::sleep(Duration::from_secs_f64(rng.random_range(0.0..period))).await;
    while !shared.stop.load(Ordering::Relaxed) {
        let next = Instant::now() + Duration::from_secs_f64(period * rng.random_range(0.7..1.3));
        let verdict = send(&client, &url, key.as_deref()).await;
        shared.record(key.is_none(), &verdict);
        tokio::time::sleep_until(next.into()).await;
    }
}

/// `scripts/drill NAME STATE [ARGS] [--compose]`: what it said, or why it failed.
pub fn switch(compose: bool, name: &str, state: &str, args: &[&str]) -> anyhow::Result<String> {
    let script = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/drill"));
    let mut command = std::process::Command::new(script);
    command.args([name, state]).args(args);
    if compose {
        command.arg("--compose");
    }
    let out = command
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.success(),
        "scripts/drill {name} {state} {} failed: {text}",
        args.join(" ")
    );
    Ok(text)
}

pub async fn run(args: DrillArgs) -> anyhow::Result<()> {
    let tenants: Vec<Tenant> = traffic::tenants(&crate::scenario::resolve(&args.tenants))?;
    let target = args.target.trim_end_matches('/').to_owned();
    let addr = crate::scenario::require_target(&target)?;
    let prometheus = Prometheus::new(&args.prometheus);
    anyhow::ensure!(
        prometheus.ready().await,
        "no Prometheus at {}: the drill reads the dashboards' queries from it",
        args.prometheus
    );
    anyhow::ensure!(
        args.phase_secs >= 30,
        "--phase-secs must be at least 30 (a phase's first 20 s are the panels catching up)"
    );
    let panels = panels::overview(panels::RATE_INTERVAL)?;
    let dir = args.results.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(format!("drill-{}", results::timestamp(SystemTime::now())))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    println!(
        "drill: {} anonymous clients at ~1/s and {} tenants at {}/s against {target}, {} s per phase ({}); results in {}",
        args.anonymous,
        tenants.len(),
        args.tenant_rate,
        args.phase_secs,
        PHASES.join(", "),
        dir.display()
    );

    let shared = Arc::new(Shared {
        start: Instant::now(),
        phase: AtomicUsize::new(0),
        stop: false.into(),
        tenants: Tally::default(),
        anonymous: Tally::default(),
        bins: Default::default(),
        errors: Default::default(),
    });
    let started_at = SystemTime::now();
    let url = format!("{target}/api/items");
    let mut tasks = Vec::new();
    let shared_client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    for (i, tenant) in tenants.iter().enumerate() {
        tasks.push(tokio::spawn(client_loop(
            Arc::clone(&shared),
            shared_client.clone(),
            url.clone(),
            Some(tenant.key.clone()),
            args.tenant_rate as f64,
            i as u64,
        )));
    }
    for n in 0..args.anonymous {
        let mut builder = reqwest::Client::builder().timeout(Duration::from_secs(10));
        // Each its own address, as nginx sees clients (loopback targets only).
        if addr.ip().is_loopback() {
            builder = builder.local_address(traffic::client_address(n));
        }
        tasks.push(tokio::spawn(client_loop(
            Arc::clone(&shared),
            builder.build()?,
            url.clone(),
            None,
            1.0,
            1000 + n,
        )));
    }

    let phase = Duration::from_secs(args.phase_secs);
    let mut marks = Vec::new();
    for (i, (name, state)) in SWITCHES.iter().enumerate() {
        tokio::time::sleep_until((shared.start + phase * (i as u32 + 1)).into()).await;
        let said = switch(args.compose, name, state, &[])?;
        shared.phase.store(i + 1, Ordering::Relaxed);
        let at = shared.start.elapsed().as_secs_f64();
        println!(
            "[{at:>5.0}s] {} begins: scripts/drill {name} {state}",
            PHASES[i + 1]
        );
        for line in said.lines() {
            println!("         {line}");
        }
        marks.push((at, format!("{name} {state}")));
    }
    tokio::time::sleep_until((shared.start + phase * 4).into()).await;
    shared.stop.store(true, Ordering::Relaxed);
    let ended_at = SystemTime::now();
    for task in tasks {
        let _ = task.await;
    }
    switch(args.compose, "deny-cache", "off", &[])?;
    println!(
        "[{:>5.0}s] done; deny-cache off again",
        shared.start.elapsed().as_secs_f64()
    );
    // One more scrape after the end, so the last phase is whole.
    tokio::time::sleep(Duration::from_secs(6)).await;

    // The dashboard's panels over the run.
    let q = |title: &str, i: usize| panels::query(&panels, title, i).map(str::to_owned);
    let check_p99 = over_run(
        &prometheus,
        &q("Check p99: what every limited request waits", 0)?,
        started_at,
        ended_at,
    )
    .await?;
    let hot_checks = over_run(
        &prometheus,
        &q("Hot keys: checks and store calls per second", 0)?,
        started_at,
        ended_at,
    )
    .await?;
    let hot_calls = over_run(
        &prometheus,
        &q("Hot keys: checks and store calls per second", 1)?,
        started_at,
        ended_at,
    )
    .await?;
    let hot_share = over_run(
        &prometheus,
        &q("Hot keys: share of their node's calls", 0)?,
        started_at,
        ended_at,
    )
    .await?;
    let cpu = over_run(
        &prometheus,
        &q("Node CPU and its cap (cores)", 0)?,
        started_at,
        ended_at,
    )
    .await?;
    let ops = over_run(
        &prometheus,
        &q("Node commands per second (Redis's own view)", 0)?,
        started_at,
        ended_at,
    )
    .await?;
    let untrusted = over_run(
        &prometheus,
        &q("X-Forwarded-For from untrusted peers", 0)?,
        started_at,
        ended_at,
    )
    .await?;
    let firing = panels::firing(&prometheus, started_at, ended_at).await?;

    // The hot key: the one with the most checks during the incident.
    let bounds: Vec<(f64, f64)> = (0..4)
        .map(|i| {
            (
                i as f64 * args.phase_secs as f64,
                (i + 1) as f64 * args.phase_secs as f64,
            )
        })
        .collect();
    let (incident_from, incident_until) = bounds[1];
    let hot = panels::highest(&hot_checks, "key_kind", "ip", incident_from, incident_until);
    let key = hot.and_then(|l| l.get("key").cloned()).unwrap_or_default();
    let node = hot.and_then(|l| l.get("node").cloned()).unwrap_or_default();
    let of_key = |series: &Series| -> Vec<(f64, f64)> {
        series
            .iter()
            .filter(|(l, _)| l.get("key") == Some(&key) && !key.is_empty())
            .flat_map(|(_, p)| p.clone())
            .collect()
    };
    let of_node = |series: &Series| -> Vec<(f64, f64)> {
        series
            .iter()
            .filter(|(l, _)| l.get("node") == Some(&node))
            .flat_map(|(_, p)| p.clone())
            .collect()
    };
    let all = |series: &Series| -> Vec<(f64, f64)> {
        series.iter().flat_map(|(_, p)| p.clone()).collect()
    };
    let fmt = |v: Option<f64>, scale: f64, digits: usize| {
        v.map_or("-".to_owned(), |v| format!("{:.*}", digits, v * scale))
    };
    let percent = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{:.0} %", v * 100.0));

    let mut table = Table::new(&[
        "phase",
        "check p99 ms",
        "hot node CPU (cores)",
        "hot node ops/s",
        "hot key checks/s",
        "hot key Redis calls/s",
        "hot key share of node",
        "XFF untrusted share",
        "tenants throttled",
        "anonymous admitted",
        "anonymous throttled",
        "5xx / errors",
        "alerts firing at its end",
    ]);
    for (i, (start, until)) in bounds.iter().copied().enumerate() {
        // Skip the first 20 s of a phase: the rates look 15 s back, and the
        // hot-key gauges show the last complete 10 s window.
        let from = start + SETTLE;
        let t = shared.tenants.get(i);
        let a = shared.anonymous.get(i);
        table.row(vec![
            PHASES[i].into(),
            fmt(mean(&all(&check_p99), from, until), 1000.0, 2),
            fmt(mean(&of_node(&cpu), from, until), 1.0, 3),
            fmt(mean(&of_node(&ops), from, until), 1.0, 0),
            fmt(mean(&of_key(&hot_checks), from, until), 1.0, 1),
            fmt(mean(&of_key(&hot_calls), from, until), 1.0, 1),
            percent(mean(&of_key(&hot_share), from, until)),
            percent(mean(&all(&untrusted), from, until)),
            format!("{} of {}", t[1], t.iter().sum::<u64>()),
            a[0].to_string(),
            format!("{} of {}", a[1], a.iter().sum::<u64>()),
            (t[2] + a[2]).to_string(),
            panels::alert_names(&firing, (until - 10.0).max(start), until),
        ]);
    }
    println!();
    println!(
        "hot key: {key:?} on {node} (the instances key every anonymous client by it while they mistrust nginx)"
    );
    println!("{}", table.markdown());
    table.write(&dir, "phases")?;

    // Over-admission: while mistrusted, every anonymous client shares one
    // bucket (burst 20, 2/s): it may admit at most that over the time.
    let mistrusted_secs = 2.0 * args.phase_secs as f64;
    let admitted: u64 = (1..=2).map(|i| shared.anonymous.get(i)[0]).sum();
    let allowed = ANONYMOUS_BURST + ANONYMOUS_RATE * mistrusted_secs;
    let over = (admitted as f64 - allowed).max(0.0);
    let false_denials: u64 = (0..4)
        .map(|i| shared.tenants.get(i)[1] + shared.anonymous.get(i)[1])
        .sum();
    let mut summary = Table::new(&["measure", "value"]);
    summary.row(vec![
        "anonymous admitted while mistrusted".into(),
        admitted.to_string(),
    ]);
    summary.row(vec![
        "one exact bucket allows (20 + 2/s)".into(),
        format!("{allowed:.0}"),
    ]);
    summary.row(vec!["over-admission".into(), format!("{over:.0}")]);
    summary.row(vec![
        "false denials (every client is within its own limit)".into(),
        false_denials.to_string(),
    ]);
    let calls = |i: usize| mean(&of_key(&hot_calls), bounds[i].0 + SETTLE, bounds[i].1);
    if let (Some(before), Some(after)) = (calls(1), calls(2)) {
        summary.row(vec![
            "hot key Redis calls, mitigated vs incident".into(),
            format!("{:.1} %", 100.0 * after / before.max(f64::MIN_POSITIVE)),
        ]);
    }
    println!("{}", summary.markdown());
    summary.write(&dir, "summary")?;
    let errors = shared
        .errors
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    for (why, n) in &errors {
        println!("  {n:>8}  {why}");
    }

    // The pictures: the same panels over the run, the switches marked.
    let bins = shared
        .bins
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let anon_admitted: Vec<(f64, f64)> = bins
        .iter()
        .filter(|(_, (_, n))| *n > 0)
        .map(|(bin, (ok, n))| (*bin as f64 * 5.0 + 2.5, 100.0 * *ok as f64 / *n as f64))
        .collect();
    let per_node = |series: &Series| -> Vec<(String, Vec<(f64, f64)>)> {
        series
            .iter()
            .map(|(l, p)| (l.get("node").cloned().unwrap_or_default(), p.clone()))
            .collect()
    };
    let charts = [
        Chart {
            title: "Check p99: what every limited request waits (ms)",
            x_label: "seconds since start",
            y_label: "ms",
            series: vec![(
                "check p99".into(),
                all(&check_p99)
                    .into_iter()
                    .map(|(t, v)| (t, v * 1000.0))
                    .collect(),
            )],
            marks: marks.clone(),
            x_range: None,
        },
        Chart {
            title: "Hot key: checks and Redis calls per second",
            x_label: "seconds since start",
            y_label: "per second",
            series: vec![
                (format!("{key} checks"), of_key(&hot_checks)),
                (format!("{key} Redis calls"), of_key(&hot_calls)),
            ],
            marks: marks.clone(),
            x_range: None,
        },
        Chart {
            title: "Node CPU (Redis's own view, against its cap), cores",
            x_label: "seconds since start",
            y_label: "cores",
            series: per_node(&cpu),
            marks: marks.clone(),
            x_range: None,
        },
        Chart {
            title: "Anonymous clients' requests admitted (client side), %",
            x_label: "seconds since start",
            y_label: "%",
            series: vec![("admitted".into(), anon_admitted)],
            marks,
            x_range: None,
        },
    ];
    if let Some(path) = results::plot(&dir.join("drill.png"), &charts)? {
        println!("plot: {}", path.display());
    }
    let broken: u64 = errors
        .iter()
        .filter(|(w, _)| !w.starts_with("status 5") && *w != "timeout" && *w != "transport")
        .map(|(_, n)| n)
        .sum();
    anyhow::ensure!(broken == 0, "{broken} answers broke the contract");
    Ok(())
}
