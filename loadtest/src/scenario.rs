//! `mixed` and `hotkey`: goose traffic against a running stack (nginx on
//! 127.0.0.1:8080 by default, compose or `scripts/stack`), every answer
//! checked, a one-screen summary, and a results folder (goose's HTML
//! report, CSV, Markdown, PNG).
//!
//! Users come in classes (see `traffic.rs`): tenants picking API keys by
//! Zipf popularity, a few abusive tenants far over their limits, anonymous
//! clients each connecting from its own loopback address (nginx keys them
//! by it), and for `hotkey` the surge, idle before and after its window in
//! the middle third of the run. Each class has a goose scenario; goose's
//! `-u` splits users across them by the weights here.

use crate::prom::Prometheus;
use crate::results::{self, Table};
use crate::traffic::{
    self, Class, Counts, Latency, PROXY_ADDRESS, Route, Tally, Tenant, Verdict, Zipf,
};
use anyhow::Context;
use clap::{Args, ValueEnum};
use goose::config::GooseConfiguration;
use goose::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

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
    /// One abusive API key, hammered
    Tenant,
    /// Every install of a client release sends the same constant key
    ClientBug,
    /// Clients behind a front proxy nobody trusts: all arrive from its one
    /// address, so they share one anonymous bucket
    Proxy,
}

/// `hotkey`'s own flags.
#[derive(Debug, Args)]
pub struct HotkeyArgs {
    /// What makes the key hot
    #[arg(long, value_enum, default_value_t = Cause::Tenant)]
    pub cause: Cause,
    #[command(flatten)]
    pub traffic: TrafficArgs,
}

/// The user weights per class: goose gives each scenario this share of
/// `-u` (the default `-u` is their sum).
const MIXED_USERS: [(Class, usize); 3] = [
    (Class::Tenant, 12),
    (Class::Abusive, 2),
    (Class::Anonymous, 10),
];
const SURGE_USERS: usize = 24;

/// Think time between one user's requests, per class: tenants ~10/s each,
/// abusive tenants as fast as they get answers, anonymous clients ~1/s
/// (within their per-address limit of 2/s), the surge flat out.
fn wait_time(class: Class) -> (Duration, Duration) {
    let ms = Duration::from_millis;
    match class {
        Class::Tenant => (ms(50), ms(150)),
        Class::Abusive => (ms(0), ms(10)),
        Class::Anonymous => (ms(500), ms(1500)),
        Class::Surge => (ms(0), ms(0)),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Before,
    During,
    After,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Before => "before",
            Phase::During => "surge",
            Phase::After => "after",
        }
    }
}

/// The surge: who it is and when.
#[derive(Debug, Clone)]
pub struct Surge {
    pub cause: Cause,
    /// The API key it sends (none for `proxy`).
    pub key: Option<Tenant>,
    /// Its window, from the start of the run.
    pub from: Duration,
    pub until: Duration,
}

/// Everything the goose users share.
#[derive(Debug)]
struct Run {
    tenants: Vec<Tenant>,
    /// Well-behaved tenants (by popularity) and the abusive ones.
    popular: Zipf,
    abusive: Vec<Tenant>,
    surge: Option<Surge>,
    /// Bind users to their own loopback addresses (the target is local).
    bind: bool,
    start: Instant,
    started_at: SystemTime,
    next_address: AtomicU64,
    tally: Tally,
    /// Request latency by phase: everyone but the surge, and the surge.
    others: [Latency; 3],
    surging: [Latency; 3],
    errors: Mutex<BTreeMap<String, u64>>,
}

static RUN: OnceLock<Arc<Run>> = OnceLock::new();

fn run_state() -> &'static Arc<Run> {
    RUN.get().expect("the run is set before goose starts")
}

impl Run {
    fn phase(&self, elapsed: Duration) -> Phase {
        match &self.surge {
            Some(s) if elapsed < s.from => Phase::Before,
            Some(s) if elapsed < s.until => Phase::During,
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
    /// The surge's stand-in for its users' own addresses (`proxy` cause):
    /// what a front proxy would forward, and nginx discards.
    forwarded_for: Option<IpAddr>,
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

async fn setup(user: &mut GooseUser, class: Class) -> TransactionResult {
    let run = run_state();
    let n = run.next_address.fetch_add(1, Ordering::Relaxed);
    let mut builder = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .user_agent(match class {
            Class::Surge => "demo-app/2.3.0",
            _ => "loadtest",
        });
    let proxy_surge =
        class == Class::Surge && run.surge.as_ref().is_some_and(|s| s.cause == Cause::Proxy);
    if run.bind {
        // Anonymous clients and the client-bug's installs each have an
        // address; the proxy surge all comes from the proxy's.
        if proxy_surge {
            builder = builder.local_address(PROXY_ADDRESS);
        } else if matches!(class, Class::Anonymous | Class::Surge) {
            builder = builder.local_address(traffic::client_address(n));
        }
    }
    user.set_client_builder(builder).await?;
    user.set_session_data(UserState {
        rng: SmallRng::seed_from_u64(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        forwarded_for: proxy_surge.then(|| traffic::client_address(n)),
    });
    Ok(())
}

async fn send(user: &mut GooseUser, class: Class) -> TransactionResult {
    let run = Arc::clone(run_state());
    let phase = run.phase(run.start.elapsed());
    if class == Class::Surge && phase != Phase::During {
        tokio::time::sleep(Duration::from_millis(50)).await;
        return Ok(());
    }
    let state = user
        .get_session_data_mut::<UserState>()
        .expect("set on start");
    let route = Route::pick(state.rng.random());
    let key = match class {
        Class::Tenant => Some(&run.tenants[run.popular.pick(state.rng.random())]),
        Class::Abusive => Some(&run.abusive[state.rng.random_range(0..run.abusive.len())]),
        Class::Anonymous => None,
        Class::Surge => run.surge.as_ref().and_then(|s| s.key.as_ref()),
    };
    let forwarded_for = state.forwarded_for;
    let path = route.path();
    let method = match route {
        Route::Order(_) => GooseMethod::Post,
        _ => GooseMethod::Get,
    };
    let mut builder = user.get_request_builder(&method, &path)?;
    if let Some(tenant) = key {
        builder = builder.header("x-api-key", &tenant.key);
    }
    if let Some(addr) = forwarded_for {
        builder = builder.header("x-forwarded-for", addr.to_string());
    }
    if let Route::Order(item) = route {
        builder = builder
            .header("content-type", "application/json")
            .body(format!("{{\"item_id\":{item},\"quantity\":1}}"));
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
    run.tally.record(class, &verdict);
    let phase = phase as usize;
    if class == Class::Surge {
        run.surging[phase].record(micros);
    } else {
        run.others[phase].record(micros);
    }
    match verdict {
        Verdict::Admitted => Ok(()),
        Verdict::Throttled => user.set_success(&mut goose.request),
        Verdict::Unavailable(why) | Verdict::Broken(why) => {
            run.note_error(&why);
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
    setup_tenant, send_tenant => Class::Tenant;
    setup_abusive, send_abusive => Class::Abusive;
    setup_anonymous, send_anonymous => Class::Anonymous;
    setup_surge, send_surge => Class::Surge;
}

fn scenario_for(class: Class, weight: usize) -> Result<Scenario, GooseError> {
    let (setup, send) = match class {
        Class::Tenant => (transaction!(setup_tenant), transaction!(send_tenant)),
        Class::Abusive => (transaction!(setup_abusive), transaction!(send_abusive)),
        Class::Anonymous => (transaction!(setup_anonymous), transaction!(send_anonymous)),
        Class::Surge => (transaction!(setup_surge), transaction!(send_surge)),
    };
    let (min, max) = wait_time(class);
    Ok(Scenario::new(class.name())
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
    run("mixed", args, None, Duration::from_secs(60)).await
}

/// `hotkey`: mixed traffic, then the surge, then mixed again.
pub async fn hotkey(args: HotkeyArgs) -> anyhow::Result<Report> {
    run(
        "hotkey",
        args.traffic,
        Some(args.cause),
        Duration::from_secs(180),
    )
    .await
}

async fn run(
    scenario: &'static str,
    args: TrafficArgs,
    cause: Option<Cause>,
    default_run_time: Duration,
) -> anyhow::Result<Report> {
    let addr = require_stack(&args.goose)?;
    anyhow::ensure!(
        args.goose.iterations.is_none(),
        "{scenario} is bounded by time (-t), not --iterations"
    );
    let run_time = match &args.goose.run_time {
        Some(t) if !t.is_empty() => Duration::from_secs(
            goose::util::parse_timespan(t).with_context(|| format!("-t {t}: not a time span"))?
                as u64,
        ),
        _ => default_run_time,
    };
    anyhow::ensure!(run_time >= Duration::from_secs(3), "-t must be at least 3s");
    let tenants = traffic::tenants(&resolve(&args.tenants))?;
    anyhow::ensure!(
        args.abusive >= 1 && args.abusive + 2 <= tenants.len(),
        "--abusive {} with {} tenants: at least 1, and leave 2 well-behaved",
        args.abusive,
        tenants.len()
    );
    let (good, bad) = tenants.split_at(tenants.len() - args.abusive);
    let surge = cause.map(|cause| Surge {
        cause,
        key: match cause {
            // The hot tenant: one of the well-behaved ones, turned abusive.
            Cause::Tenant => Some(good[good.len() / 2].clone()),
            // A popular tenant whose app shipped with its key built in.
            Cause::ClientBug => Some(good[1].clone()),
            Cause::Proxy => None,
        },
        from: run_time / 3,
        until: run_time * 2 / 3,
    });
    let dir = args.results.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(format!(
            "{scenario}-{}",
            results::timestamp(SystemTime::now())
        ))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let state = Arc::new(Run {
        popular: Zipf::new(good.len(), args.zipf),
        tenants: good.to_vec(),
        abusive: bad.to_vec(),
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

    let mut classes: Vec<(Class, usize)> = MIXED_USERS.to_vec();
    if surge.is_some() {
        classes.push((Class::Surge, SURGE_USERS));
    }
    let users: usize = classes.iter().map(|(_, w)| w).sum();
    let report_file = match args.goose.report_file.first() {
        Some(theirs) => PathBuf::from(theirs),
        None => dir.join("goose.html"),
    };
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
        "{scenario}: {users} users by default ({}) for {}s against {addr}; results in {}",
        classes
            .iter()
            .map(|(c, w)| format!("{w} {}", c.name()))
            .collect::<Vec<_>>()
            .join(", "),
        run_time.as_secs(),
        dir.display()
    );
    if !state.bind {
        println!(
            "note: the target is not local, so anonymous users all come from this machine's address"
        );
    }
    let announcer = surge.clone().map(|s| {
        let start = state.start;
        tokio::spawn(async move {
            tokio::time::sleep_until((start + s.from).into()).await;
            println!("[{:>4}s] surge starts: {}", s.from.as_secs(), describe(&s));
            tokio::time::sleep_until((start + s.until).into()).await;
            println!("[{:>4}s] surge stops", s.until.as_secs());
        })
    });
    let metrics = attack.execute().await?;
    if let Some(a) = announcer {
        a.abort();
    }
    let ended_at = SystemTime::now();
    drop(metrics);

    let counts: Vec<(Class, Counts)> = classes
        .iter()
        .map(|(c, _)| (*c, state.tally.get(*c)))
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

    if let Some(s) = &surge {
        let prometheus = Prometheus::new(&args.prometheus);
        phases(&state, s, &prometheus, ended_at, &dir).await?;
    }
    println!("goose's report: {}", report_file.display());
    Ok(Report { counts })
}

fn describe(s: &Surge) -> String {
    match (s.cause, &s.key) {
        (Cause::Tenant, Some(t)) => format!("one abusive tenant ({}) flat out", t.id),
        (Cause::ClientBug, Some(t)) => {
            format!("a client release sends {}'s key from every install", t.id)
        }
        _ => format!("clients behind an untrusted proxy ({PROXY_ADDRESS}), one anonymous bucket"),
    }
}

/// The before / surge / after table: request latency seen here, check
/// latency and the hot node's share seen by the instances (Prometheus).
async fn phases(
    state: &Run,
    surge: &Surge,
    prometheus: &Prometheus,
    ended_at: SystemTime,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    let start = state.started_at;
    let bounds = [
        (Phase::Before, start, start + surge.from),
        (Phase::During, start + surge.from, start + surge.until),
        (Phase::After, start + surge.until, ended_at),
    ];
    let up = prometheus.ready().await;
    if up {
        // One more scrape after the end (every 5 s), so the last phase counts.
        tokio::time::sleep(Duration::from_secs(6)).await;
    } else {
        println!(
            "note: no Prometheus at {}: check latency and node share are left out",
            prometheus.url()
        );
    }
    let mut table = Table::new(&[
        "phase",
        "seconds",
        "others p50 ms",
        "others p99 ms",
        "surge p99 ms",
        "check p50 ms",
        "check p99 ms",
        "hot node share",
    ]);
    for (phase, from, until) in bounds {
        let i = phase as usize;
        let seconds = until.duration_since(from).unwrap_or_default().as_secs();
        let (check50, check99, share) = if up {
            // rate() needs two scrapes (every 5 s) inside its window:
            // a phase shorter than 15 s reads the 15 s before its end.
            let window = seconds.max(15);
            (
                prometheus.check_quantile(0.5, window, until).await,
                prometheus.check_quantile(0.99, window, until).await,
                prometheus.hot_node_share(window, until).await,
            )
        } else {
            (None, None, None)
        };
        table.row(vec![
            phase.name().into(),
            seconds.to_string(),
            results::ms_from_us(state.others[i].quantile(0.5)),
            results::ms_from_us(state.others[i].quantile(0.99)),
            results::ms_from_us(state.surging[i].quantile(0.99)),
            results::ms_from_secs(check50),
            results::ms_from_secs(check99),
            share.map_or("-".into(), |(node, s)| {
                format!("{:.0} % ({node})", s * 100.0)
            }),
        ]);
    }
    println!("{}", table.markdown());
    table.write(dir, "phases")?;
    if up {
        let timeline = prometheus.timeline(start, ended_at).await?;
        results::write_timeline(dir, &timeline, surge.from, surge.until)?;
    }
    Ok(())
}
