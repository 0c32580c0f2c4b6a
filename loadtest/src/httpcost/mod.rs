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
//! peers `benches/peers/peer_governor.rs` and `benches/peers/peer_plain.rs`,
//! built as examples beside it too (`target/<profile>/examples/`;
//! `--server` and `--peers` name others). Not this executable re-run as `loadtest instance`: the same
//! code, but linked into a binary many times the size (goose, reqwest,
//! plotters), whose layout alone moves the per-request CPU by as much as
//! the differences being measured. Ours is built alone, as the Dockerfile
//! builds it: built with the examples (or with this crate), it would get
//! their dependencies' features, tokio's test-util among them.
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
//! | `grpc` | our server, the `memory` variant's policy asked over gRPC as Envoy's rate limit service (one descriptor a call) |
//! | `grpc-lua` | the same on the lua backend |
//! | `governor` | the tower_governor peer, its headers on, a quota far above the load |
//! | `plain` | the plain axum peer |
//!
//! A run: `--connections` closed-loop HTTP/1.1 keep-alive connections,
//! each sending its next request as soon as the last is answered;
//! `--warmup` requests, then `--requests` measured. By default one thread
//! drives them all and never sleeps (`--client spin`): over loopback the
//! sender runs the receiver's side of TCP, so a server answering a client
//! asleep in `read` pays for waking it, and the slower the server, the
//! more often the client sleeps. With a thread asleep per connection
//! (`--client threads`; wrk's threads sleep in `epoll_wait`, woken the
//! same way) that wake-up is a large share of every server's CPU, and
//! weighs most on the slowest route, the lua one (docs/performance.md,
//! "Redis checks over HTTP"). Server CPU is the utime + stime delta of the
//! server process (and of redis-server) in `/proc/<pid>/stat` over the
//! measured requests, divided by them: microseconds of CPU per request,
//! reported whole and in user space alone (utime: the programs' own code,
//! where they differ; the kernel's TCP path is about the same for every
//! server). Throughput and p50/p99 are the load generator's. The variants
//! run interleaved (each round in a rotated order), `--repeats` rounds;
//! each round's ratios are taken within the round, then min / median /
//! max over the rounds.
//!
//! Written to `--out`: `table.md` and `table.csv` (the summary), and
//! `runs.csv` (every run).
//!
//! The pieces: [`drive`](mod@drive) is the load generator (a minimal
//! keep-alive client, its connections, the CPU read around them),
//! [`grpc`](mod@grpc) its gRPC twin,
//! [`report`](mod@report) the tables and the goals judged from the runs;
//! this module starts the servers, runs the rounds and writes the files.

mod drive;
mod grpc;
mod report;

use anyhow::{Context, ensure};
pub use drive::Client;
use drive::{drive, fallback_decisions, pin_this_process};
use report::tables;
use std::path::PathBuf;
use std::process::{Command, Stdio};
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
        default_value = "unlimited,memory,lua,grpc,grpc-lua,denied,governor,plain"
    )]
    pub variants: Vec<String>,
    /// The CPU every server (and redis-server) is pinned to
    #[arg(long, default_value_t = 0)]
    pub server_cpu: usize,
    /// The CPU the load generator is pinned to
    #[arg(long, default_value_t = 1)]
    pub client_cpu: usize,
    /// How the load generator waits for answers: spin (never asleep, so
    /// an answer wakes nothing) or threads (one per connection, asleep in
    /// read)
    #[arg(long, value_enum, default_value_t = Client::Spin)]
    pub client: Client,
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
const VARIANTS: [&str; 8] = [
    "unlimited",
    "memory",
    "lua",
    "grpc",
    "grpc-lua",
    "denied",
    "governor",
    "plain",
];

/// Whether `variant` uses Redis.
fn on_redis(variant: &str) -> bool {
    matches!(variant, "lua" | "grpc-lua")
}

/// The policies of our server's variants (the route is the sample API's).
fn policy(variant: &str) -> &'static str {
    match variant {
        "unlimited" => "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nunlimited = true\n",
        // The governor peer's quota: 10^8 a second, a burst of 10^8.
        "memory" | "lua" | "grpc" | "grpc-lua" => {
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
    let grpc = variant.starts_with("grpc");
    let rls_port = free_port()?;
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
            if grpc {
                toml = format!(
                    "{toml}[rls]\nlisten = \"127.0.0.1:{rls_port}\"\n[[rls.domains]]\ndomain = \"{}\"\n\
                     [[rls.domains.descriptors]]\nkey = \"api_key\"\npolicy = \"api\"\n",
                    grpc::DOMAIN
                );
            }
            if on_redis(variant) {
                let redis = redis.context("the lua variants need redis-server")?;
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
    if grpc {
        wait_for_listener(&mut server, rls_port, variant)?;
    }
    let mut pids = vec![server.pid()];
    if on_redis(variant) {
        pids.extend(redis.and_then(RedisServer::pid));
    }
    let (seconds, cpu, tally) = if grpc {
        grpc::drive(rls_port, &pids, args)?
    } else {
        drive(port, &pids, args)?
    };
    let fallback = if on_redis(variant) {
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
        "{variant}: {} answers neither 200 nor 429 (OK nor OVER_LIMIT)",
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
        match variant {
            "denied" => "429",
            "grpc" | "grpc-lua" => "OK",
            _ => "200",
        }
    );
    ensure!(
        run.server_cpu > 0.0,
        "{variant}: no server CPU measured (fewer requests than a clock tick?)"
    );
    Ok(run)
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
    let redis = if args.variants.iter().any(|v| on_redis(v)) {
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
         {} rounds; servers on CPU {}, the load generator on CPU {} ({}). \
         min / median / max over the rounds; the ratios are server CPU (Redis's included) \
         per request within one round.\n\n{}\n\n{}\n",
        command.join(" "),
        args.requests,
        args.warmup,
        args.connections,
        args.repeats,
        args.server_cpu,
        args.client_cpu,
        match args.client {
            Client::Spin => "one thread, never asleep",
            Client::Threads => "a thread per connection, asleep in read",
        },
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
