//! `http-cost`: server CPU per request over HTTP, ours beside a minimal
//! axum app with tower_governor and a plain axum handler.
//!
//! ```text
//! cargo build --release -p ratelimiter --examples        # the peers
//! cargo build --release -p ratelimiter --bin ratelimiter # ours, last and alone
//! cargo run --release -p loadtest -- http-cost
//! ```
//!
//! It builds nothing: the servers are the `ratelimiter` binary, the one a
//! user runs, found beside this executable (`target/<profile>/`), and the
//! peers `examples/peer_governor.rs` and `examples/peer_plain.rs`, beside
//! it too (`target/<profile>/examples/`; `--server` and `--peers` name
//! others). Not this executable re-run as `loadtest
//! instance`: the same code, but linked into a binary many times the size
//! (goose, reqwest, plotters), whose layout alone changed the per-request
//! CPU by a tenth or more. Ours is built alone, as the Dockerfile builds
//! it: built with the examples (or with this crate), it would get their
//! dependencies' features, tokio's test-util among them.
//!
//! Each server is pinned to `--server-cpu` (taskset) and started fresh for
//! each run; the load generator, this process, is pinned to
//! `--client-cpu`. The variants, every one serving `GET /api/items` with
//! the same body:
//!
//! | variant | what serves it |
//! |---|---|
//! | `unlimited` | our server, the route's policy `unlimited = true` |
//! | `memory` | our server, a memory-backend policy far above the load (every request checked, admitted) |
//! | `lua` | the same policy on the lua backend; a real redis-server, pinned to the server's CPU, whose CPU is read too |
//! | `denied` | our server, 1 token an hour: all but the first request answered 429 |
//! | `governor` | the tower_governor peer, its headers on, a quota far above the load |
//! | `plain` | the plain axum peer |
//!
//! A run: `--connections` closed-loop HTTP/1.1 keep-alive connections,
//! each sending its next request as soon as the last is answered;
//! `--warmup` requests, then `--requests` measured. Server CPU is the
//! utime + stime delta of the server process (and of redis-server) in
//! `/proc/<pid>/stat` over the measured requests, divided by them:
//! microseconds of CPU per request, reported whole and in user space
//! alone (utime: the programs' own code, where they differ; the kernel's
//! TCP path is about the same for every server). Throughput and p50/p99 are the load
//! generator's. The variants run interleaved (each round in a rotated
//! order), `--repeats` rounds; each round's ratios are taken within the
//! round, then min / median / max over the rounds.
//!
//! Written to `--out`: `table.md` and `table.csv` (the summary), and
//! `runs.csv` (every run).

use crate::capacity::{CpuTimes, process_times};
use crate::results::Table;
use anyhow::{Context, ensure};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::Instant;
use testkit::{ChildGuard, RedisServer, TempDir, free_port, wait_for_listener};

/// The http-cost command's options.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpCostArgs {
    /// Measured requests per run (after the warm-up)
    #[arg(long, default_value_t = 60_000)]
    pub requests: usize,
    /// Warm-up requests per run, not measured
    #[arg(long, default_value_t = 5_000)]
    pub warmup: usize,
    /// Rounds; each runs every variant once
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Closed-loop keep-alive connections
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Variants, in the order of the first round
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "unlimited,memory,lua,denied,governor,plain"
    )]
    pub variants: Vec<String>,
    /// The CPU every server (and redis-server) is pinned to
    #[arg(long, default_value_t = 0)]
    pub server_cpu: usize,
    /// The CPU the load generator is pinned to
    #[arg(long, default_value_t = 1)]
    pub client_cpu: usize,
    /// Our server, the `ratelimiter` binary [default: beside this executable]
    #[arg(long)]
    pub server: Option<PathBuf>,
    /// Where peer_governor and peer_plain are [default: examples/ beside this executable]
    #[arg(long)]
    pub peers: Option<PathBuf>,
    /// Where table.md, table.csv and runs.csv go
    #[arg(long, default_value = "docs/load/http-cost")]
    pub out: PathBuf,
}

/// The variants, by name.
const VARIANTS: [&str; 6] = ["unlimited", "memory", "lua", "denied", "governor", "plain"];

/// The policies of our server's variants (the route is the sample API's).
fn policy(variant: &str) -> &'static str {
    match variant {
        "unlimited" => "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nunlimited = true\n",
        // The governor peer's quota: 10^8 a second, a burst of 10^8.
        "memory" | "lua" => {
            "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 100000000\nrate = 100000000\n"
        }
        _ => "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 1\nrate = 1\nper = \"1h\"\n",
    }
}

/// One run's figures.
#[derive(Debug, Clone, Default)]
struct Run {
    round: usize,
    variant: String,
    seconds: f64,
    server_cpu: f64,
    /// Of `server_cpu`, the time in user space.
    server_user: f64,
    redis_cpu: f64,
    latencies_us: Vec<u32>,
    ok: usize,
    limited: usize,
    other: usize,
    /// Decisions the failure mode made (lua only; warm-up included).
    fallback: f64,
}

impl Run {
    fn requests(&self) -> usize {
        self.latencies_us.len()
    }

    fn server_us(&self) -> f64 {
        self.server_cpu * 1e6 / self.requests() as f64
    }

    fn server_user_us(&self) -> f64 {
        self.server_user * 1e6 / self.requests() as f64
    }

    fn redis_us(&self) -> f64 {
        self.redis_cpu * 1e6 / self.requests() as f64
    }

    fn per_second(&self) -> f64 {
        self.requests() as f64 / self.seconds
    }

    /// The `p` quantile of the latencies (sorted), ms.
    fn quantile_ms(&self, p: f64) -> f64 {
        let n = self.latencies_us.len();
        let i = ((n as f64 * p).ceil() as usize).clamp(1, n) - 1;
        f64::from(self.latencies_us[i]) / 1000.0
    }
}

/// Pins every thread of this process (and so every thread it starts
/// later, which inherits its creator's mask) to `cpu`.
fn pin_this_process(cpu: usize) -> anyhow::Result<()> {
    use nix::sched::{CpuSet, sched_setaffinity};
    use nix::unistd::Pid;
    let mut set = CpuSet::new();
    set.set(cpu)?;
    for task in std::fs::read_dir("/proc/self/task")? {
        let tid: i32 = task?.file_name().to_string_lossy().parse()?;
        sched_setaffinity(Pid::from_raw(tid), &set)
            .with_context(|| format!("cannot pin the load generator to CPU {cpu}"))?;
    }
    Ok(())
}

/// A minimal HTTP/1.1 keep-alive client: one request, its whole answer
/// (`Content-Length` bodies only, which every server here sends), its
/// status and its body's range in `buf`.
fn exchange(
    stream: &mut TcpStream,
    request: &[u8],
    buf: &mut Vec<u8>,
) -> anyhow::Result<(u16, std::ops::Range<usize>)> {
    stream.write_all(request)?;
    buf.clear();
    let mut read_more = |buf: &mut Vec<u8>| -> anyhow::Result<()> {
        let len = buf.len();
        buf.resize(len + 16 * 1024, 0);
        let n = stream.read(&mut buf[len..])?;
        buf.truncate(len + n);
        ensure!(n > 0, "the server closed the connection");
        Ok(())
    };
    let head_end = loop {
        read_more(buf)?;
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = std::str::from_utf8(&buf[..head_end])?;
    let status: u16 = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP answer: {head:?}"))?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .with_context(|| format!("no Content-Length: {head:?}"))?;
    while buf.len() < head_end + length {
        read_more(buf)?;
    }
    Ok((status, head_end..head_end + length))
}

/// What one connection saw.
#[derive(Debug, Default)]
struct Tally {
    latencies_us: Vec<u32>,
    ok: usize,
    limited: usize,
    other: usize,
}

/// Drives `port` with `args.connections` closed-loop connections: the
/// warm-up, then the measured requests, reading `pids`' CPU (user, kernel)
/// around them.
fn drive(
    port: u16,
    pids: &[u32],
    args: &HttpCostArgs,
) -> anyhow::Result<(f64, Vec<CpuTimes>, Tally)> {
    let connections = args.connections.max(1);
    // Both barriers: every connection warmed up, then all start together.
    let warmed = Arc::new(Barrier::new(connections + 1));
    let start = Arc::new(Barrier::new(connections + 1));
    let request = b"GET /api/items HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    let mut threads = Vec::new();
    for i in 0..connections {
        // The requests shared out, the first connections taking the rest.
        let share = |n: usize| n / connections + usize::from(i < n % connections);
        let (warmup, measured) = (share(args.warmup), share(args.requests));
        let (warmed, start) = (Arc::clone(&warmed), Arc::clone(&start));
        threads.push(std::thread::spawn(move || -> anyhow::Result<Tally> {
            let mut stream = TcpStream::connect(("127.0.0.1", port));
            if let Ok(s) = &stream {
                s.set_nodelay(true)?;
            }
            let mut buf = Vec::with_capacity(16 * 1024);
            let mut warm = || -> anyhow::Result<()> {
                let stream = stream.as_mut().map_err(|e| anyhow::anyhow!("{e}"))?;
                for _ in 0..warmup {
                    exchange(stream, request, &mut buf)?;
                }
                Ok(())
            };
            let warm = warm();
            // Never leave the others waiting at a barrier.
            warmed.wait();
            start.wait();
            warm?;
            let stream = stream.as_mut().map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut tally = Tally {
                latencies_us: Vec::with_capacity(measured),
                ..Tally::default()
            };
            for _ in 0..measured {
                let sent = Instant::now();
                let (status, _) = exchange(stream, request, &mut buf)?;
                let us = sent.elapsed().as_micros();
                tally
                    .latencies_us
                    .push(u32::try_from(us).unwrap_or(u32::MAX));
                match status {
                    200 => tally.ok += 1,
                    429 => tally.limited += 1,
                    _ => tally.other += 1,
                }
            }
            Ok(tally)
        }));
    }
    warmed.wait();
    let cpu = || {
        pids.iter().map(|&p| {
            process_times(p).unwrap_or(CpuTimes {
                user: f64::NAN,
                system: f64::NAN,
            })
        })
    };
    let before: Vec<CpuTimes> = cpu().collect();
    let started = Instant::now();
    start.wait();
    let mut all = Tally::default();
    for t in threads {
        let tally = t
            .join()
            .map_err(|_| anyhow::anyhow!("a connection panicked"))??;
        all.latencies_us.extend(tally.latencies_us);
        all.ok += tally.ok;
        all.limited += tally.limited;
        all.other += tally.other;
    }
    let seconds = started.elapsed().as_secs_f64();
    let used = cpu()
        .zip(before)
        .map(|(after, b)| CpuTimes {
            user: after.user - b.user,
            system: after.system - b.system,
        })
        .collect();
    all.latencies_us.sort_unstable();
    Ok((seconds, used, all))
}

/// Decisions in the instance's `/metrics` that Redis did not make (the
/// failure mode's): the lua variant may have a handful on a loaded
/// machine (reported), no more, or it measured the fallback.
fn fallback_decisions(port: u16) -> anyhow::Result<f64> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut buf = Vec::new();
    let (status, body) = exchange(
        &mut stream,
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        &mut buf,
    )?;
    ensure!(status == 200, "/metrics answered {status}");
    let text = std::str::from_utf8(&buf[body])?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("ratelimit_decisions_total{") && !l.contains("source=\"redis\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// Where the servers are: `--server` and `--peers`, or beside this
/// executable (the peers in its `examples/`).
fn servers(args: &HttpCostArgs) -> anyhow::Result<Servers> {
    let here = || -> anyhow::Result<PathBuf> {
        Ok(std::env::current_exe()?
            .parent()
            .context("this executable has no directory")?
            .to_path_buf())
    };
    let servers = Servers {
        ours: match &args.server {
            Some(path) => path.clone(),
            None => here()?.join("ratelimiter"),
        },
        peers: match &args.peers {
            Some(dir) => dir.clone(),
            None => here()?.join("examples"),
        },
    };
    for server in [
        servers.ours.clone(),
        servers.peers.join("peer_governor"),
        servers.peers.join("peer_plain"),
    ] {
        ensure!(
            server.is_file(),
            "no {}: build it with the same profile first \
             (cargo build --release -p ratelimiter --examples, then --bin ratelimiter)",
            server.display()
        );
    }
    Ok(servers)
}

/// The executables a run starts.
#[derive(Debug)]
struct Servers {
    /// The `ratelimiter` binary.
    ours: PathBuf,
    /// The directory of `peer_governor` and `peer_plain`.
    peers: PathBuf,
}

/// One run of `variant`: its server started fresh and pinned, driven, stopped.
fn run_one(
    variant: &str,
    round: usize,
    redis: Option<&RedisServer>,
    servers: &Servers,
    configs: &TempDir,
    args: &HttpCostArgs,
) -> anyhow::Result<Run> {
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let mut command = Command::new("taskset");
    command.args(["-c", &args.server_cpu.to_string()]);
    match variant {
        "governor" | "plain" => {
            command
                .arg(servers.peers.join(format!("peer_{variant}")))
                .arg(&listen);
        }
        _ => {
            let config = configs.join(&format!("{variant}.toml"));
            let mut toml = format!(
                "key_secret = \"http-cost-shared-secret\"\n{}",
                policy(variant)
            );
            if variant == "lua" {
                let redis = redis.context("the lua variant needs redis-server")?;
                // Deadlines a loaded machine does not miss: a check the
                // failure mode decides would measure the fallback.
                toml = format!(
                    "backend = \"lua\"\n{toml}[redis]\nurl = \"{}\"\nresponse_timeout = \"1s\"\n\
                     [failure]\ndeadline = \"500ms\"\n",
                    redis.url()
                );
            }
            std::fs::write(&config, toml)?;
            command
                .arg(&servers.ours)
                .args(["--listen", &listen, "--instance-id", "http-cost"])
                .arg("--config")
                .arg(&config);
        }
    }
    let mut server = ChildGuard(
        command
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start the server (taskset: Debian util-linux)")?,
    );
    wait_for_listener(&mut server, port, variant)?;
    let mut pids = vec![server.pid()];
    if variant == "lua" {
        pids.extend(redis.and_then(RedisServer::pid));
    }
    let (seconds, cpu, tally) = drive(port, &pids, args)?;
    let fallback = if variant == "lua" {
        fallback_decisions(port)?
    } else {
        0.0
    };
    drop(server);
    let run = Run {
        round,
        variant: variant.to_owned(),
        seconds,
        server_cpu: cpu[0].user + cpu[0].system,
        server_user: cpu[0].user,
        redis_cpu: cpu.get(1).map_or(0.0, |t| t.user + t.system),
        latencies_us: tally.latencies_us,
        ok: tally.ok,
        limited: tally.limited,
        other: tally.other,
        fallback,
    };
    ensure!(
        run.fallback <= 0.001 * (args.requests + args.warmup) as f64,
        "lua: {} decisions were the failure mode's, not Redis's",
        run.fallback
    );
    ensure!(
        run.other == 0,
        "{variant}: {} answers neither 200 nor 429",
        run.other
    );
    let expected = if variant == "denied" {
        run.limited
    } else {
        run.ok
    };
    ensure!(
        expected == run.requests(),
        "{variant}: {} of {} answers were {}",
        expected,
        run.requests(),
        if variant == "denied" { "429" } else { "200" }
    );
    ensure!(
        run.server_cpu > 0.0,
        "{variant}: no server CPU measured (fewer requests than a clock tick?)"
    );
    Ok(run)
}

/// `min / median / max` of `values`, with `decimals`.
fn spread(mut values: Vec<f64>, decimals: usize) -> String {
    if values.is_empty() || values.iter().any(|v| v.is_nan()) {
        return "-".into();
    }
    values.sort_by(f64::total_cmp);
    let median = values[values.len() / 2];
    format!(
        "{:.d$} / {:.d$} / {:.d$}",
        values[0],
        median,
        values[values.len() - 1],
        d = decimals
    )
}

/// The median of `values`.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Each round's `variant` figure over the same round's `peer` figure.
fn ratios(runs: &[Run], variant: &str, peer: &str, figure: fn(&Run) -> f64) -> Vec<f64> {
    runs.iter()
        .filter(|r| r.variant == variant)
        .filter_map(|r| {
            let p = runs
                .iter()
                .find(|p| p.variant == peer && p.round == r.round)?;
            Some(figure(r) / figure(p))
        })
        .collect()
}

fn total_us(r: &Run) -> f64 {
    r.server_us() + r.redis_us()
}

fn tables(runs: &[Run], variants: &[String]) -> (Table, Table, Vec<String>) {
    let mut summary = Table::new(&[
        "variant",
        "server us/request",
        "of which user space",
        "Redis us/request",
        "vs governor (same round)",
        "vs plain (same round)",
        "requests/s",
        "p50 ms",
        "p99 ms",
        "answers",
    ]);
    for v in variants {
        let of = |f: fn(&Run) -> f64| -> Vec<f64> {
            runs.iter().filter(|r| &r.variant == v).map(f).collect()
        };
        let mine: Vec<&Run> = runs.iter().filter(|r| &r.variant == v).collect();
        let answers = if v == "denied" {
            format!("{} x 429", mine.iter().map(|r| r.limited).sum::<usize>())
        } else {
            format!("{} x 200", mine.iter().map(|r| r.ok).sum::<usize>())
        };
        summary.row(vec![
            v.clone(),
            spread(of(Run::server_us), 2),
            spread(of(Run::server_user_us), 2),
            if v == "lua" {
                spread(of(Run::redis_us), 2)
            } else {
                "-".into()
            },
            spread(ratios(runs, v, "governor", total_us), 2),
            spread(ratios(runs, v, "plain", total_us), 2),
            spread(of(Run::per_second), 0),
            spread(of(|r| r.quantile_ms(0.5)), 3),
            spread(of(|r| r.quantile_ms(0.99)), 3),
            answers,
        ]);
    }
    let mut all = Table::new(&[
        "round",
        "variant",
        "requests",
        "seconds",
        "server_cpu_s",
        "server_user_s",
        "redis_cpu_s",
        "server_us_per_request",
        "redis_us_per_request",
        "requests_per_second",
        "p50_ms",
        "p99_ms",
        "ok",
        "limited",
        "other",
        "fallback_decisions",
    ]);
    for r in runs {
        all.row(vec![
            r.round.to_string(),
            r.variant.clone(),
            r.requests().to_string(),
            format!("{:.3}", r.seconds),
            format!("{:.2}", r.server_cpu),
            format!("{:.2}", r.server_user),
            format!("{:.2}", r.redis_cpu),
            format!("{:.2}", r.server_us()),
            format!("{:.2}", r.redis_us()),
            format!("{:.0}", r.per_second()),
            format!("{:.3}", r.quantile_ms(0.5)),
            format!("{:.3}", r.quantile_ms(0.99)),
            r.ok.to_string(),
            r.limited.to_string(),
            r.other.to_string(),
            r.fallback.to_string(),
        ]);
    }
    // The issue's goals, each a median of same-round ratios.
    let goal = |what: &str, variant: &str, peer: &str, bound: f64| {
        let m = median(ratios(runs, variant, peer, total_us));
        if m.is_nan() {
            return format!("- {what}: not measured in this run");
        }
        let verdict = if m <= bound { "met" } else { "not met" };
        format!("- {what}: median {m:.2}x, goal at most {bound:.2}x: {verdict}")
    };
    let mut goals = vec![
        goal(
            "memory-limited route vs tower_governor with headers",
            "memory",
            "governor",
            1.10,
        ),
        goal("unlimited route vs plain axum", "unlimited", "plain", 1.05),
    ];
    // The same pairs in user space alone: the programs' own code, without
    // the kernel's share, which is about the same for every server and
    // most of the CPU. Reported, not judged: the goals are on the whole.
    let user = |what: &str, variant: &str, peer: &str| {
        let m = median(ratios(runs, variant, peer, Run::server_user_us));
        if m.is_nan() {
            return format!("- {what}, user space alone: not measured in this run");
        }
        format!("- {what}, user space alone: median {m:.2}x (reported)")
    };
    goals.push(user(
        "memory-limited route vs tower_governor",
        "memory",
        "governor",
    ));
    goals.push(user("unlimited route vs plain axum", "unlimited", "plain"));
    (summary, all, goals)
}

/// Runs every variant `repeats` times, interleaved, and writes the tables.
pub async fn run(args: HttpCostArgs) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || run_blocking(&args)).await?
}

fn run_blocking(args: &HttpCostArgs) -> anyhow::Result<()> {
    for v in &args.variants {
        ensure!(
            VARIANTS.contains(&v.as_str()),
            "unknown variant {v:?}; known: {}",
            VARIANTS.join(", ")
        );
    }
    ensure!(
        args.server_cpu != args.client_cpu,
        "the server and the load generator need CPUs of their own"
    );
    ensure!(args.repeats > 0 && args.requests > 0, "nothing to measure");
    let servers = servers(args)?;
    pin_this_process(args.client_cpu)?;
    let redis = if args.variants.iter().any(|v| v == "lua") {
        Some(RedisServer::start_pinned(args.server_cpu)?)
    } else {
        None
    };
    let configs = TempDir::new("http-cost")?;
    let mut runs = Vec::new();
    for round in 1..=args.repeats {
        // Rotated each round: no variant always runs first, or last.
        let n = args.variants.len();
        for i in 0..n {
            let variant = &args.variants[(i + round - 1) % n];
            let run = run_one(variant, round, redis.as_ref(), &servers, &configs, args)?;
            eprintln!(
                "http-cost: round {round} {variant}: {:.2} us server + {:.2} us redis per request, {:.0} req/s, p99 {:.3} ms",
                run.server_us(),
                run.redis_us(),
                run.per_second(),
                run.quantile_ms(0.99),
            );
            runs.push(run);
        }
    }
    let (summary, all, goals) = tables(&runs, &args.variants);
    let command: Vec<String> = std::env::args().skip(1).collect();
    let text = format!(
        "Command: `loadtest {}`\n\n{} requests per run after {} of warm-up, {} connections, \
         {} rounds; servers on CPU {}, the load generator on CPU {}. \
         min / median / max over the rounds; the ratios are server CPU (Redis's included) \
         per request within one round.\n\n{}\n\n{}\n",
        command.join(" "),
        args.requests,
        args.warmup,
        args.connections,
        args.repeats,
        args.server_cpu,
        args.client_cpu,
        summary.markdown(),
        goals.join("\n"),
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    std::fs::write(args.out.join("table.md"), &text)?;
    std::fs::write(args.out.join("table.csv"), summary.csv())?;
    std::fs::write(args.out.join("runs.csv"), all.csv())?;
    println!("{text}");
    Ok(())
}
