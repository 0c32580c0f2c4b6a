//! `mixed` and the traffic of `hotkey`: goose traffic against a running
//! stack (nginx on 127.0.0.1:8080 by default, compose or `scripts/stack`),
//! every answer checked, a one-screen summary, and a results folder
//! (goose's HTML report, CSV, Markdown). `hotkey.rs` plans the incident and
//! reports its phases.
//!
//! Users come in classes (see `traffic.rs`): tenants picking API keys by
//! Zipf popularity, a few abusive tenants far over their limits, anonymous
//! clients each connecting from its own loopback address (nginx keys them
//! by it), and for `hotkey` the surge, idle outside its window. Each
//! healthy class has a goose scenario; goose's `-u` splits users across
//! them by the weights here. The surge, most of a run's requests, has a
//! lighter client of its own (`scenario/surge.rs`).

use crate::results::{self, Table};
use crate::traffic::{self, Class, Counts, Latency, Route, Tally, Tenant, Verdict, Zipf};
use anyhow::Context;
use clap::{Args, ValueEnum};
use goose::config::GooseConfiguration;
use goose::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

mod surge;

/// What both scenarios take, besides goose's own flags.
#[derive(Debug, Args)]
pub struct TrafficArgs {
    /// The service config whose plain `api_keys` are the tenants
    #[arg(long, default_value = "config/stack.toml")]
    pub tenants: PathBuf,
    /// Zipf exponent of tenant popularity (1.0: the first tenant is twice
    /// as popular as the second)
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// How many tenants (the least popular) are abusive
    #[arg(long, default_value_t = 2)]
    pub abusive: usize,
    /// Prometheus of the stack, for the check latency the instances saw
    /// (skipped with a note if it does not answer)
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub prometheus: String,
    /// Where the results go [default: results/<scenario>-<UTC time>]
    #[arg(long)]
    pub results: Option<PathBuf>,
    #[command(flatten)]
    pub goose: Box<GooseConfiguration>,
}

/// What concentrates the `hotkey` surge on one identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Cause {
    /// One abusive API key, far over its limit
    Tenant,
    /// Every install of a client release sends the same constant key
    ClientBug,
    /// Clients behind a front proxy nobody trusts: all arrive from its one
    /// address, so they share one anonymous bucket
    Proxy,
    /// A partner tenant within its own large limit: admitted, yet more
    /// checks than one node can serve
    Partner,
}

impl Cause {
    /// Whether the surge's requests are admitted (within the key's limit),
    /// so that a deny cache has nothing to cache.
    pub fn admitted(self) -> bool {
        self == Cause::Partner
    }
}

/// The classes goose drives, each a scenario of its own users (the surge
/// has a client of its own, [`surge::Surging`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Users {
    Tenant,
    Abusive,
    Anonymous,
}

impl Users {
    fn class(self) -> Class {
        match self {
            Users::Tenant => Class::Tenant,
            Users::Abusive => Class::Abusive,
            Users::Anonymous => Class::Anonymous,
        }
    }

    /// Think time between one user's requests: tenants ~10/s each,
    /// abusive tenants ~50/s each (five times their limit, and each a key
    /// over its limit on a node with room: the limiter working, not an
    /// incident), anonymous clients ~1/s (within their per-address limit
    /// of 2/s).
    fn wait_time(self) -> (Duration, Duration) {
        let ms = Duration::from_millis;
        match self {
            Users::Tenant => (ms(50), ms(150)),
            Users::Abusive => (ms(15), ms(25)),
            Users::Anonymous => (ms(500), ms(1500)),
        }
    }
}

/// The user weights per class: goose gives each scenario this share of
/// `-u` (the default `-u` is their sum).
const MIXED_USERS: [(Users, usize); 3] = [
    (Users::Tenant, 12),
    (Users::Abusive, 2),
    (Users::Anonymous, 10),
];
/// The surge's connections (its pace is `--surge-rate`, over them all).
const SURGE_CONNECTIONS: u64 = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Before,
    During,
    /// The surge goes on, the mitigation in force.
    Mitigated,
    After,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Before => "before",
            Phase::During => "surge",
            Phase::Mitigated => "mitigated",
            Phase::After => "after",
        }
    }
}

/// The surge: who it is, when, and how fast.
#[derive(Debug, Clone)]
pub struct Surge {
    pub cause: Cause,
    /// The API key it sends (none for `proxy`).
    pub key: Option<Tenant>,
    /// Its window, from the start of the run.
    pub from: Duration,
    pub until: Duration,
    /// When the mitigation takes over, within the window, if it does.
    pub mitigated: Option<Duration>,
    /// Requests per second over all its connections, at most: a client with a
    /// pace of its own, which goes slower only when its answers do.
    pub rate: f64,
}

/// Something done at a time of the run (from its start): `label` is
/// printed, then what `action` says.
pub struct Timed {
    pub at: Duration,
    pub label: String,
    pub action: Option<Box<dyn FnOnce() -> anyhow::Result<String> + Send>>,
}

impl std::fmt::Debug for Timed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timed")
            .field("at", &self.at)
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

/// One schedule of slots for every surge user together: each request
/// waits for the next slot, so the surge keeps its rate whatever the
/// number of users; when answers are slower than the slots, the slots
/// wait for them (no debt is kept, so no catch-up burst follows).
#[derive(Debug)]
struct Pacer {
    period: Duration,
    next: Mutex<Instant>,
}

impl Pacer {
    fn new(rate: f64) -> Self {
        Self {
            period: Duration::from_secs_f64(1.0 / rate.max(1e-3)),
            next: Mutex::new(Instant::now()),
        }
    }

    /// When the caller may send its next request.
    fn slot(&self, now: Instant) -> Instant {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let at = (*next).max(now);
        *next = at + self.period;
        at
    }
}

/// Everything the goose users share.
#[derive(Debug)]
pub struct Run {
    tenants: Vec<Tenant>,
    /// Well-behaved tenants (by popularity) and the abusive ones.
    popular: Zipf,
    abusive: Vec<Tenant>,
    surge: Option<Surge>,
    pacer: Option<Pacer>,
    /// Bind users to their own loopback addresses (the target is local).
    bind: bool,
    start: Instant,
    pub started_at: SystemTime,
    next_address: AtomicU64,
    tally: Tally,
    /// Request latency by phase: everyone but the surge, and the surge.
    pub others: [Latency; 4],
    pub surging: [Latency; 4],
    errors: Mutex<BTreeMap<String, u64>>,
}

static RUN: OnceLock<Arc<Run>> = OnceLock::new();

fn run_state() -> &'static Arc<Run> {
    RUN.get().expect("the run is set before goose starts")
}

impl Run {
    /// The phase of the run `elapsed` into it.
    pub fn phase(&self, elapsed: Duration) -> Phase {
        match &self.surge {
            Some(s) if elapsed < s.from => Phase::Before,
            Some(s) if elapsed < s.until => match s.mitigated {
                Some(m) if elapsed >= m => Phase::Mitigated,
                _ => Phase::During,
            },
            Some(_) => Phase::After,
            None => Phase::Before,
        }
    }

    fn note_error(&self, why: &str) {
        let mut errors = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded: the first 20 kinds, then everything else together.
        let key = if errors.len() < 20 || errors.contains_key(why) {
            why.to_owned()
        } else {
            "(other)".to_owned()
        };
        *errors.entry(key).or_default() += 1;
    }
}

/// Per goose user.
#[derive(Debug, Clone)]
struct UserState {
    rng: SmallRng,
}

/// The host goose will target.
fn target(goose: &GooseConfiguration) -> String {
    goose
        .host
        .clone()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "http://127.0.0.1:8080".into())
}

/// One line, not thousands of connection errors, when nothing listens.
pub fn require_stack(goose: &GooseConfiguration) -> anyhow::Result<SocketAddr> {
    require_target(&target(goose))
}

/// The address of `host` (a URL), if something listens there.
pub fn require_target(host: &str) -> anyhow::Result<SocketAddr> {
    let addr = reqwest::Url::parse(host).ok().and_then(|url| {
        let port = url.port_or_known_default()?;
        (url.host_str()?, port).to_socket_addrs().ok()?.next()
    });
    let addr = addr.with_context(|| format!("cannot resolve the target {host}"))?;
    if std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err() {
        anyhow::bail!(
            "nothing answers at {host}: start the stack first (`docker compose up` or `scripts/stack up`), or point -H at it"
        );
    }
    Ok(addr)
}

/// The config path as given, or else relative to the repository (so the
/// default works from any directory).
pub(crate) fn resolve(path: &std::path::Path) -> PathBuf {
    if path.is_relative() && !path.exists() {
        let in_repo = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join(path);
        if in_repo.exists() {
            return in_repo;
        }
    }
    path.to_path_buf()
}

async fn setup(user: &mut GooseUser, users: Users) -> TransactionResult {
    let run = run_state();
    let n = run.next_address.fetch_add(1, Ordering::Relaxed);
    let mut builder = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .user_agent("loadtest");
    // Anonymous clients each have an address.
    if run.bind && users == Users::Anonymous {
        builder = builder.local_address(traffic::client_address(n));
    }
    user.set_client_builder(builder).await?;
    user.set_session_data(UserState {
        rng: SmallRng::seed_from_u64(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
    });
    Ok(())
}

/// A class's next request: its route, and the API key it sends.
fn next_request<'a>(run: &'a Run, class: Class, rng: &mut SmallRng) -> (Route, Option<&'a Tenant>) {
    // A partner's integration reads the catalogue; the others' mix
    // includes orders.
    let partner = class == Class::Surge && run.surge.as_ref().is_some_and(|s| s.cause.admitted());
    let route = Route::pick(rng.random::<f64>() * if partner { 0.9 } else { 1.0 });
    let key = match class {
        Class::Tenant => Some(&run.tenants[run.popular.pick(rng.random())]),
        Class::Abusive => Some(&run.abusive[rng.random_range(0..run.abusive.len())]),
        Class::Anonymous => None,
        Class::Surge => run.surge.as_ref().and_then(|s| s.key.as_ref()),
    };
    (route, key)
}

/// Counts a `class` answer given in `phase`, `micros` after its request.
fn record(run: &Run, class: Class, phase: Phase, micros: u64, verdict: &Verdict) {
    run.tally.record(class, verdict);
    let phase = phase as usize;
    if class == Class::Surge {
        run.surging[phase].record(micros);
    } else {
        run.others[phase].record(micros);
    }
    if let Verdict::Unavailable(why) | Verdict::Broken(why) = verdict {
        run.note_error(why);
    }
}

async fn send(user: &mut GooseUser, users: Users) -> TransactionResult {
    let class = users.class();
    let run = Arc::clone(run_state());
    let phase = run.phase(run.start.elapsed());
    let state = user
        .get_session_data_mut::<UserState>()
        .expect("set on start");
    let (route, key) = next_request(&run, class, &mut state.rng);
    let path = route.path();
    let method = match route {
        Route::Order(_) => GooseMethod::Post,
        _ => GooseMethod::Get,
    };
    let mut builder = user.get_request_builder(&method, &path)?;
    if let Some(tenant) = key {
        builder = builder.header("x-api-key", &tenant.key);
    }
    if let Some(body) = route.body() {
        builder = builder
            .header("content-type", "application/json")
            .body(body);
    }
    let request = GooseRequest::builder()
        .method(method)
        .path(path.as_str())
        .name(route.name())
        .set_request_builder(builder)
        .build();
    let sent = Instant::now();
    let mut goose = user.request(request).await?;
    let micros = sent.elapsed().as_micros() as u64;
    let verdict = match &goose.response {
        Ok(response) => traffic::check(response.status().as_u16(), response.headers()),
        Err(e) => Verdict::Unavailable(format!("transport: {}", short_error(e))),
    };
    record(&run, class, phase, micros, &verdict);
    match verdict {
        Verdict::Admitted => Ok(()),
        Verdict::Throttled => user.set_success(&mut goose.request),
        Verdict::Unavailable(why) | Verdict::Broken(why) => {
            user.set_failure(&why, &mut goose.request, None, None)
        }
    }
}

fn short_error(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else if e.is_body() || e.is_decode() {
        "body"
    } else {
        "request"
    }
}

macro_rules! class_transactions {
    ($($setup:ident, $send:ident => $class:expr;)*) => {$(
        async fn $setup(user: &mut GooseUser) -> TransactionResult {
            setup(user, $class).await
        }
        async fn $send(user: &mut GooseUser) -> TransactionResult {
            send(user, $class).await
        }
    )*};
}

class_transactions! {
    setup_tenant, send_tenant => Users::Tenant;
    setup_abusive, send_abusive => Users::Abusive;
    setup_anonymous, send_anonymous => Users::Anonymous;
}

fn scenario_for(users: Users, weight: usize) -> Result<Scenario, GooseError> {
    let (setup, send) = match users {
        Users::Tenant => (transaction!(setup_tenant), transaction!(send_tenant)),
        Users::Abusive => (transaction!(setup_abusive), transaction!(send_abusive)),
        Users::Anonymous => (transaction!(setup_anonymous), transaction!(send_anonymous)),
    };
    let (min, max) = users.wait_time();
    Ok(Scenario::new(users.class().name())
        .set_weight(weight)?
        .set_wait_time(min, max)?
        .register_transaction(setup.set_on_start())
        .register_transaction(send))
}

/// What a run measured.
#[derive(Debug)]
pub struct Report {
    pub counts: Vec<(Class, Counts)>,
}

impl Report {
    /// 5xx and transport errors.
    pub fn unavailable(&self) -> u64 {
        self.counts.iter().map(|(_, c)| c.unavailable).sum()
    }

    /// Answers that broke the contract.
    pub fn broken(&self) -> u64 {
        self.counts.iter().map(|(_, c)| c.broken).sum()
    }
}

/// `mixed`: steady traffic, every answer checked, a summary.
pub async fn mixed(args: TrafficArgs) -> anyhow::Result<Report> {
    let run_time = run_time(&args.goose)?.unwrap_or(Duration::from_secs(60));
    Ok(run("mixed", args, None, Vec::new(), run_time).await?.report)
}

/// The run time `-t` asks for, if it does.
pub fn run_time(goose: &GooseConfiguration) -> anyhow::Result<Option<Duration>> {
    anyhow::ensure!(
        goose.iterations.is_none(),
        "the scenarios are bounded by time (-t), not --iterations"
    );
    let Some(t) = goose.run_time.as_ref().filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let secs =
        goose::util::parse_timespan(t).with_context(|| format!("-t {t}: not a time span"))?;
    anyhow::ensure!(secs >= 3, "-t must be at least 3s");
    Ok(Some(Duration::from_secs(secs as u64)))
}

/// The tenants of `--tenants`: the well-behaved ones (by popularity), and
/// the `--abusive` least popular.
pub fn cast(args: &TrafficArgs) -> anyhow::Result<(Vec<Tenant>, Vec<Tenant>)> {
    let tenants = traffic::tenants(&resolve(&args.tenants))?;
    anyhow::ensure!(
        args.abusive >= 1 && args.abusive + 2 <= tenants.len(),
        "--abusive {} with {} tenants: at least 1, and leave 2 well-behaved",
        args.abusive,
        tenants.len()
    );
    let (good, bad) = tenants.split_at(tenants.len() - args.abusive);
    Ok((good.to_vec(), bad.to_vec()))
}

/// What a run left: the counts, the latencies by phase, and when it ran.
#[derive(Debug)]
pub struct Ran {
    pub report: Report,
    pub run: Arc<Run>,
    pub started_at: SystemTime,
    pub ended_at: SystemTime,
    /// The results folder.
    pub dir: PathBuf,
}

/// Runs the classes (and the surge, if any) for `run_time`, doing each of
/// `timed` at its time; prints and writes the summary.
pub async fn run(
    scenario: &'static str,
    args: TrafficArgs,
    surge: Option<Surge>,
    timed: Vec<Timed>,
    run_time: Duration,
) -> anyhow::Result<Ran> {
    let addr = require_stack(&args.goose)?;
    let (good, bad) = cast(&args)?;
    let dir = args.results.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(format!(
            "{scenario}-{}",
            results::timestamp(SystemTime::now())
        ))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let state = Arc::new(Run {
        popular: Zipf::new(good.len(), args.zipf),
        tenants: good,
        abusive: bad,
        pacer: surge.as_ref().map(|s| Pacer::new(s.rate)),
        surge: surge.clone(),
        bind: addr.ip().is_loopback(),
        start: Instant::now(),
        started_at: SystemTime::now(),
        next_address: AtomicU64::new(0),
        tally: Tally::default(),
        others: Default::default(),
        surging: Default::default(),
        errors: Mutex::new(BTreeMap::new()),
    });
    // goose runs once per process: the state is set once.
    RUN.set(Arc::clone(&state))
        .map_err(|_| anyhow::anyhow!("one scenario per process"))?;

    let classes: Vec<(Users, usize)> = MIXED_USERS.to_vec();
    let users: usize = classes.iter().map(|(_, w)| w).sum();
    let report_file = match args.goose.report_file.first() {
        Some(theirs) => PathBuf::from(theirs),
        None => dir.join("goose.html"),
    };
    // The Host header the surge sends: the target's, as goose's users send it.
    let host = reqwest::Url::parse(&target(&args.goose))
        .ok()
        .and_then(|url| {
            let name = url.host_str()?.to_owned();
            Some(match url.port() {
                Some(port) => format!("{name}:{port}"),
                None => name,
            })
        })
        .unwrap_or_else(|| addr.to_string());
    let mut attack = GooseAttack::initialize_with_config(*args.goose)?;
    for (class, weight) in &classes {
        attack = attack.register_scenario(scenario_for(*class, *weight)?);
    }
    let attack = attack
        .set_default(GooseDefault::Host, "http://127.0.0.1:8080")?
        .set_default(GooseDefault::Users, users)?
        .set_default(GooseDefault::IncreaseRate, users.to_string().as_str())?
        .set_default(GooseDefault::RunTime, run_time.as_secs() as usize)?
        .set_default(GooseDefault::NoResetMetrics, true)?
        .set_default(GooseDefault::NoErrorSummary, true)?
        // Our summary is the one screen; goose's tables are in its report.
        .set_default(GooseDefault::NoPrintMetrics, true)?
        .set_default(GooseDefault::Quiet, 1)?
        .set_default(
            GooseDefault::ReportFile,
            report_file.to_string_lossy().as_ref(),
        )?;

    println!(
        "{scenario}: {users} users by default ({}){} for {}s against {addr}; results in {}",
        classes
            .iter()
            .map(|(c, w)| format!("{w} {}", c.class().name()))
            .collect::<Vec<_>>()
            .join(", "),
        if surge.is_some() {
            format!(", and the surge's {SURGE_CONNECTIONS} connections")
        } else {
            String::new()
        },
        run_time.as_secs(),
        dir.display()
    );
    if !state.bind {
        println!(
            "note: the target is not local, so anonymous users all come from this machine's address"
        );
    }
    let start = state.start;
    let schedule = tokio::spawn(async move {
        for event in timed {
            tokio::time::sleep_until((start + event.at).into()).await;
            if !event.label.is_empty() {
                println!("[{:>4}s] {}", event.at.as_secs(), event.label);
            }
            if let Some(action) = event.action {
                match tokio::task::spawn_blocking(action).await {
                    Ok(Ok(said)) => said.lines().for_each(|l| println!("        {l}")),
                    Ok(Err(e)) => println!("        failed: {e:#}"),
                    Err(e) => println!("        failed: {e}"),
                }
            }
        }
    });
    let surging = match surge {
        Some(_) => Some(
            surge::Surging::start(Arc::clone(&state), addr, host, SURGE_CONNECTIONS)
                .context("cannot start the surge's client")?,
        ),
        None => None,
    };
    let metrics = attack.execute().await;
    schedule.abort();
    if let Some(surging) = surging {
        surging.stop();
    }
    let metrics = metrics?;
    let ended_at = SystemTime::now();
    drop(metrics);

    let counts: Vec<(Class, Counts)> = classes
        .iter()
        .map(|(c, _)| c.class())
        .chain(surge.is_some().then_some(Class::Surge))
        .map(|c| (c, state.tally.get(c)))
        .collect();
    let errors = state
        .errors
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let mut summary = Table::new(&[
        "class",
        "requests",
        "admitted",
        "throttled",
        "5xx / no answer",
        "broken",
        "admitted %",
    ]);
    for (class, c) in &counts {
        summary.row(vec![
            class.name().into(),
            c.total().to_string(),
            c.admitted.to_string(),
            c.throttled.to_string(),
            c.unavailable.to_string(),
            c.broken.to_string(),
            results::percent(c.admitted, c.total()),
        ]);
    }
    println!();
    println!("{}", summary.markdown());
    summary.write(&dir, "summary")?;
    if !errors.is_empty() {
        println!("errors by kind:");
        for (why, n) in &errors {
            println!("  {n:>8}  {why}");
        }
    }
    println!("goose's report: {}", report_file.display());
    Ok(Ran {
        report: Report { counts },
        started_at: state.started_at,
        run: state,
        ended_at,
        dir,
    })
}
