//! `capacity`: at what rate does the synchronous Redis check, not the
//! application, bound one instance's throughput?
//!
//! Every limited request waits for its check: one Redis round trip. An
//! instance serving `in-flight` requests at once can therefore complete at
//! most `in-flight / RTT` of them per second, however idle its CPU. This
//! command measures where the knee really is.
//!
//! - One instance per variant, started here (this executable re-run as
//!   `loadtest instance`): no limiter (an unlimited route), the memory
//!   limiter, and the Lua limiter on a real redis-server behind the
//!   latency-injecting proxy of the fault scenarios, with 0, 0.5, 1 and
//!   2 ms added to each round trip.
//! - An open-loop load: requests are offered at a fixed rate, stepped up,
//!   with at most `--in-flight` outstanding (the instance's concurrency);
//!   an offer that finds them all busy is not sent. A closed loop (goose's
//!   users) would slow down with the server and never show the knee.
//! - Per step: the offered and achieved rates, request p50/p99 seen here,
//!   check p50/p99 from the instance's own histogram, the mean requests in
//!   flight (Little's law), the machine's and the instance's CPU, and what
//!   bounds the point: nothing (it kept up), the round trip, the requests
//!   in flight, or the CPU.
//!
//! The pieces: [`model`] reads a step (what bounds it, where the knee is,
//! the check quantiles between two scrapes), pure and unit-tested;
//! [`step`] offers one rate to one variant and measures it; this module
//! starts the instances and the proxy, runs every variant's steps and
//! writes the tables and plots.

mod model;
mod step;

pub(crate) use step::{CpuTimes, process_times};

use crate::http1;
use crate::instances;
use crate::proxy::FaultProxy;
use crate::results::{self, Chart, Table};
use anyhow::Context;
use clap::Args;
use model::{KEPT_UP, Point, bound_by, knee, mean_in_flight, rtt_bound};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use step::{Row, Slots, Variant, ping_rtt, step};
use testkit::{Fleet, RedisServer, TempDir};

#[derive(Debug, Args)]
pub struct CapacityArgs {
    /// Round-trip latencies added between the instance and Redis, ms
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,1,2")]
    pub rtts: Vec<f64>,
    /// Offered rates, requests per second, in steps
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "250,500,1000,2000,3000,4000,6000,8000,12000,16000"
    )]
    pub rates: Vec<u64>,
    /// Seconds per step
    #[arg(long, default_value_t = 3.0)]
    pub step: f64,
    /// Most requests outstanding at once (the instance's concurrency)
    #[arg(long, default_value_t = 8)]
    pub in_flight: usize,
    /// Where the results go [default: results/capacity-<UTC time>]
    #[arg(long)]
    pub results: Option<PathBuf>,
}

/// The baseline's config: the same route, unlimited.
fn unlimited_config(dir: &TempDir) -> anyhow::Result<PathBuf> {
    let path = dir.join("unlimited.toml");
    std::fs::write(
        &path,
        "key_secret = \"capacity-scenario-shared-secret\"\n\
         [[api_keys]]\nid = \"tenant\"\nkey = \"capacity-key\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nunlimited = true\n",
    )?;
    Ok(path)
}

fn config(dir: &TempDir) -> anyhow::Result<PathBuf> {
    let path = dir.join("capacity.toml");
    // A limit no step reaches: the cost of checking, never of denying.
    std::fs::write(
        &path,
        "key_secret = \"capacity-scenario-shared-secret\"\n\
         [[api_keys]]\nid = \"tenant\"\nkey = \"capacity-key\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 1000000000\nrate = 1000000000\n\
         [[policies]]\nname = \"status\"\nroute = \"/api/status\"\nunlimited = true\n",
    )?;
    Ok(path)
}

pub async fn run(args: CapacityArgs) -> anyhow::Result<()> {
    // The instances are this executable: a dev build would measure a debug
    // limiter (the dev profile optimises dependencies, not the service).
    anyhow::ensure!(
        !cfg!(debug_assertions) || std::env::var_os("LOADTEST_ALLOW_DEBUG").is_some(),
        "capacity measures the service itself: run it from a release build, `cargo run --release -p loadtest -- capacity`"
    );
    anyhow::ensure!(
        !args.rates.is_empty() && args.in_flight > 0,
        "need --rates and --in-flight"
    );
    let dir = args.results.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(format!(
            "capacity-{}",
            results::timestamp(SystemTime::now())
        ))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let scratch = TempDir::new("capacity")?;
    let config = config(&scratch)?;
    let redis = RedisServer::start()?;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse()?).await?;
    // A generous deadline: every check goes to Redis, however slow, so the
    // measurement is of the synchronous check (the service's default, 10
    // ms, would hand slow checks to the local share).
    let common = |backend: &str, config: &PathBuf| -> Vec<String> {
        let mut flags = vec![
            "--config".into(),
            config.display().to_string(),
            "--backend".into(),
            backend.into(),
            "--failure-deadline".into(),
            "1s".into(),
            "--redis-response-timeout".into(),
            "1s".into(),
        ];
        if backend == "lua" {
            flags.extend(["--redis-url".into(), proxy.redis_url()]);
        }
        flags
    };
    let unlimited = instances::start(1, &common("memory", &unlimited_config(&scratch)?))?;
    let memory = instances::start(1, &common("memory", &config))?;
    let lua = instances::start(1, &common("lua", &config))?;
    let generator = std::process::id();
    let redis_pid = redis.pid().context("redis-server has no pid")?;
    // An instance with no Redis behind it: only it and this generator
    // share the machine.
    let in_process = |name: &str, fleet: &Fleet| -> anyhow::Result<Variant> {
        let addr = address(&fleet.urls[0])?;
        Ok(Variant {
            name: name.into(),
            rtt: Duration::ZERO,
            addr,
            request: request(addr),
            pid: fleet.pids()[0],
            sharing: vec![generator, fleet.pids()[0]],
        })
    };
    let mut variants = vec![
        in_process("no limiter", &unlimited)?,
        in_process("memory", &memory)?,
    ];
    let lua_addr = address(&lua.urls[0])?;
    for rtt in &args.rtts {
        variants.push(Variant {
            name: format!("lua +{rtt} ms"),
            rtt: Duration::from_secs_f64(rtt / 1000.0),
            addr: lua_addr,
            request: request(lua_addr),
            pid: lua.pids()[0],
            sharing: vec![generator, lua.pids()[0], redis_pid],
        });
    }

    let mut table = Table::new(&[
        "variant",
        "added rtt ms",
        "measured rtt ms",
        "offered/s",
        "achieved/s",
        "request p50 ms",
        "request p99 ms",
        "check p50 ms",
        "check p99 ms",
        "mean in flight",
        "turned away %",
        "offer late p99 ms",
        "CPU % (of all cores)",
        "instance cores",
        "instance CPU us per request",
        "generator CPU us per request",
        "errors",
        "bound by",
    ]);
    // The offers and their answers run on a thread of their own, in a
    // single-threaded runtime: an answer or an offer's tick then wakes the
    // thread already waiting for it, where on a shared runtime a worker
    // reading the sockets would wake another thread, a context switch or
    // two a request of the generator's own.
    let series = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(measure(&variants, &args, &proxy, &mut table))
            })
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the load generator's thread panicked")))
    })?;
    drop((unlimited, memory, lua, proxy, redis));
    println!("{}\n", table.markdown());
    table.write(&dir, "capacity")?;
    report(&series, args.in_flight, &dir)
}

/// Every variant's steps, each a row of `table`.
async fn measure(
    variants: &[Variant],
    args: &CapacityArgs,
    proxy: &FaultProxy,
    table: &mut Table,
) -> anyhow::Result<Series> {
    // For the scrapes of the instance's metrics only; the offers go out on
    // the slots' own connections.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let mut series: Series = Vec::new();
    for v in variants {
        // Half the added round trip each way; then what a round trip to
        // Redis through the proxy really takes (the bound uses this).
        proxy.set_latency(v.rtt / 2);
        let measured = if v.name.starts_with("lua") {
            Some(ping_rtt(proxy.addr).await?)
        } else {
            None
        };
        let mut slots: Slots = (0..args.in_flight)
            .map(|_| http1::Client::new(v.addr, None, Duration::from_secs(5)))
            .collect();
        // Warm up: every slot's connection (a step at a light rate uses
        // one or two of them), then the script cache.
        let connected = futures_util::future::join_all(
            slots
                .iter_mut()
                .map(|slot| slot.exchange(&v.request, |status, _| status)),
        )
        .await;
        anyhow::ensure!(
            connected.iter().all(|answer| answer == &Ok(200)),
            "{} does not answer 200 to every slot: {connected:?}",
            v.name
        );
        step(&http, v, &mut slots, 200, 0.5).await;
        let mut rows = Vec::new();
        for &rate in &args.rates {
            let row = step(&http, v, &mut slots, rate, args.step).await;
            let bound = bound_by(&row.point, measured.unwrap_or_default());
            eprintln!(
                "capacity: {} offered {rate}/s: {:.0}/s, p99 {} ms, {}",
                v.name,
                row.point.achieved,
                results::ms_from_us(row.req_p99),
                bound.name()
            );
            table.row(vec![
                v.name.clone(),
                if measured.is_some() {
                    format!("{}", v.rtt.as_secs_f64() * 1000.0)
                } else {
                    "-".into()
                },
                measured.map_or("-".into(), |m| format!("{:.3}", m.as_secs_f64() * 1000.0)),
                rate.to_string(),
                format!("{:.0}", row.point.achieved),
                results::ms_from_us(row.req_p50),
                results::ms_from_us(row.req_p99),
                results::ms_from_secs(row.check_p50),
                results::ms_from_secs(row.check_p99),
                format!("{:.1}", mean_in_flight(&row.point)),
                format!("{:.0}", row.point.turned_away * 100.0),
                results::ms_from_us(row.late_p99),
                format!("{:.0}", row.point.machine_cpu * 100.0),
                format!("{:.2}", row.instance_cores),
                if row.point.achieved > 0.0 {
                    format!("{:.1}", cpu_per_request(&row))
                } else {
                    "-".into()
                },
                if row.generator_us.is_finite() {
                    format!("{:.1}", row.generator_us)
                } else {
                    "-".into()
                },
                row.errors.to_string(),
                bound.name().into(),
            ]);
            rows.push(row);
        }
        series.push((v.name.clone(), measured, rows));
    }
    Ok(series)
}

/// The socket address of the instance at `base` (`http://<ip>:<port>`).
fn address(base: &str) -> anyhow::Result<SocketAddr> {
    base.trim_start_matches("http://")
        .parse()
        .with_context(|| format!("not an instance's address: {base}"))
}

/// What every offer sends to the instance at `addr`.
fn request(addr: SocketAddr) -> Vec<u8> {
    let (mut request, host) = (Vec::new(), addr.to_string());
    let fields = [("host", host.as_str()), ("x-api-key", "capacity-key")];
    http1::write_request(&mut request, "GET", "/api/items", fields, None);
    request
}

/// The instance's CPU time per request served in a step, microseconds
/// (`instance cores` rounds it away at low rates).
fn cpu_per_request(r: &Row) -> f64 {
    r.instance_cores / r.point.achieved * 1e6
}

/// A variant's steps: its name, the round trip measured to Redis (for the
/// Lua variants), and a row per offered rate.
type Series = Vec<(String, Option<Duration>, Vec<Row>)>;

/// The knees table (capacity, what bounds it, the limiter's CPU per
/// request against no limiter's) and the three plots, into `dir`.
fn report(series: &Series, in_flight: usize, dir: &Path) -> anyhow::Result<()> {
    let mut knees = Table::new(&[
        "variant",
        "capacity/s",
        "first offer not met",
        "measured rtt ms",
        "in-flight / RTT bound",
        "capacity / bound",
        "bound at the knee",
        "instance CPU us per request",
        "x no limiter",
    ]);
    // The limiter's cost as a ratio: the instance's CPU per request at the
    // highest offer that both this variant and the baseline kept up with.
    let baseline = series.first().map(|(_, _, rows)| rows);
    for (name, rtt, rows) in series {
        let points: Vec<Point> = rows.iter().map(|r| r.point).collect();
        let rtt = rtt.unwrap_or_default();
        let bound = rtt_bound(in_flight, rtt);
        let (first, most) = knee(&points).map_or(
            (
                "kept up".to_owned(),
                points.iter().map(|p| p.achieved).fold(0.0, f64::max),
            ),
            |(f, m)| (format!("{f:.0}"), m),
        );
        let at_knee = points
            .iter()
            .find(|p| p.achieved < KEPT_UP * p.offered)
            .map_or("-", |p| bound_by(p, rtt).name());
        let kept_up = |r: &Row| r.point.achieved >= KEPT_UP * r.point.offered;
        let cost = rows
            .iter()
            .enumerate()
            .rfind(|(i, r)| kept_up(r) && baseline.is_some_and(|b| b.get(*i).is_some_and(kept_up)))
            .map(|(i, r)| {
                let base = baseline.map(|b| cpu_per_request(&b[i]));
                (
                    r.point.offered,
                    cpu_per_request(r),
                    base.map(|b| cpu_per_request(r) / b),
                )
            });
        knees.row(vec![
            name.clone(),
            format!("{most:.0}"),
            first,
            if rtt.is_zero() {
                "-".into()
            } else {
                format!("{:.3}", rtt.as_secs_f64() * 1000.0)
            },
            bound.map_or("-".into(), |b| format!("{b:.0}")),
            bound.map_or("-".into(), |b| format!("{:.2}", most / b)),
            at_knee.into(),
            cost.map_or("-".into(), |(rate, us, _)| {
                format!("{us:.1} (at {rate:.0}/s)")
            }),
            cost.and_then(|(_, _, x)| x)
                .map_or("-".into(), |x| format!("{x:.2}")),
        ]);
    }
    println!("{}", knees.markdown());
    knees.write(dir, "knees")?;

    let line = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(String, Vec<(f64, f64)>)> {
        series
            .iter()
            .map(|(name, _, rows)| {
                (
                    name.clone(),
                    rows.iter()
                        .filter_map(|r| Some((r.point.offered, f(r)?)))
                        .collect(),
                )
            })
            .collect()
    };
    let charts = [
        Chart {
            title: "Throughput vs offered load (one instance)",
            x_label: "offered requests/s",
            y_label: "achieved requests/s",
            series: line(&|r| Some(r.point.achieved)),
            marks: Vec::new(),
            x_range: None,
        },
        Chart {
            title: "Check p99 vs offered load",
            x_label: "offered requests/s",
            y_label: "ms",
            series: line(&|r| r.check_p99.map(|s| s * 1000.0)),
            marks: Vec::new(),
            x_range: None,
        },
        Chart {
            title: "Request p99 vs offered load",
            x_label: "offered requests/s",
            y_label: "ms",
            series: line(&|r| r.req_p99.map(|us| us as f64 / 1000.0)),
            marks: Vec::new(),
            x_range: None,
        },
    ];
    for (file, chart) in ["throughput.png", "check-p99.png", "request-p99.png"]
        .iter()
        .zip(charts)
    {
        if let Some(path) = results::plot(&dir.join(file), std::slice::from_ref(&chart))? {
            println!("plot: {}", path.display());
        }
    }
    println!("results: {}", dir.display());
    Ok(())
}
