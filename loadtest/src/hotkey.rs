//! `loadtest hotkey`: the hot-key incident of `runbooks/hot-key.md`, live,
//! on a running stack. Healthy traffic (the `mixed` classes), then a surge
//! on one identity at a pace of its own, then healthy traffic again; and,
//! with `--mitigate-at`, the runbook's mitigation switched on during the
//! surge (`scripts/drill`), so the run shows it working while the surge
//! goes on.
//!
//! The surge is paced (`--surge-rate`, over all its connections) rather than
//! flat out: while its node is saturated it goes no faster than its
//! answers, as any client; once a mitigation answers it quickly, it keeps
//! its pace instead of taking every core of the machine, so what the run
//! measures is the node, not the host.
//!
//! Each phase is reported with the overview dashboard's own panel queries
//! (`panels.rs`) averaged over the phase after its first seconds, the
//! alerts that fired in it, what the clients saw, and the CPU the machine
//! and (natively) each of the stack's components used.

use crate::cpu::{self, Snapshot, Usage};
use crate::drill;
use crate::panels::{self, Series, alert_names, mean, over_run};
use crate::prom::Prometheus;
use crate::results::{self, Chart, Table};
use crate::scenario::{self, Cause, Phase, Ran, Report, Surge, Timed, TrafficArgs};
use crate::traffic::{self, PROXY_ADDRESS, Tenant};
use anyhow::Context;
use clap::{Args, ValueEnum};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How fast a surge over its limit goes, unless told: well over what one
/// Redis node capped as in both stacks serves (docs/stack.md, "A twentieth
/// of a core per Redis node"), with room for a faster machine, and within
/// what the load generator, nginx and three instances answer on 2 cores
/// without taking the machine once a mitigation answers the surge in the
/// instances.
pub const DEFAULT_SURGE_RATE: u64 = 8000;
/// The partner's pace, unless told: admitted (its limit is 10,000 a
/// second), more than its one node serves beside the background traffic
/// on the 2-core VM, and a third of it little enough that each node keeps
/// room (runbooks/hot-key.md measures both). A faster machine needs more:
/// the phases table says whether the node reached its cap.
pub const DEFAULT_PARTNER_RATE: u64 = 650;

/// `hotkey`'s own flags.
#[derive(Debug, Args)]
pub struct HotkeyArgs {
    /// What makes the key hot
    #[arg(long, value_enum, default_value_t = Cause::Tenant)]
    pub cause: Cause,
    /// The surge's pace, requests per second over all its connections (it goes
    /// slower only when its answers do) [default: 8000; partner: 650]
    #[arg(long)]
    pub surge_rate: Option<u64>,
    /// Healthy traffic before the surge [default: 1m, or a third of -t]
    #[arg(long, value_parser = span)]
    pub before: Option<Duration>,
    /// How long the surge lasts [default: 10m, or a third of -t]; ctrl-c
    /// ends the run at any time, and reports what ran
    #[arg(long, value_parser = span)]
    pub surge: Option<Duration>,
    /// Healthy traffic after the surge [default: 1m, or a third of -t]
    #[arg(long, value_parser = span)]
    pub after: Option<Duration>,
    /// Switch the runbook's mitigation on this long into the surge (with
    /// scripts/drill), and off again at the end
    #[arg(long, value_parser = span)]
    pub mitigate_at: Option<Duration>,
    /// Which mitigation [default: shard for `--cause partner`, deny-cache
    /// otherwise]
    #[arg(long, value_enum)]
    pub mitigation: Option<Mitigation>,
    /// The stack runs in compose (the mitigation's switch gets --compose)
    #[arg(long)]
    pub compose: bool,
    /// The native stack's state directory, to read its components' CPU
    /// (skipped if absent)
    #[arg(long, default_value = ".stack")]
    pub stack_dir: PathBuf,
    #[command(flatten)]
    pub traffic: TrafficArgs,
}

/// The runbook's mitigations, as `scripts/drill` switches them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mitigation {
    /// `deny_cache = true` on every limited policy: an instance answers a
    /// denied key itself until the denial's Retry-After
    DenyCache,
    /// The hot key split over three sub-buckets, one per node
    Shard,
}

impl Mitigation {
    fn name(self) -> &'static str {
        match self {
            Mitigation::DenyCache => "deny-cache",
            Mitigation::Shard => "shard",
        }
    }
}

fn span(text: &str) -> Result<Duration, String> {
    goose::util::parse_timespan(text)
        .map(|s| Duration::from_secs(s as u64))
        .ok_or_else(|| format!("{text:?} is not a time span (90s, 10m, 1h2m)"))
}

/// When the surge starts and stops, from the start of the run, and how
/// long the run is.
fn windows(args: &HotkeyArgs) -> anyhow::Result<(Duration, Duration, Duration)> {
    let explicit = args.before.is_some() || args.surge.is_some() || args.after.is_some();
    let (before, surge, after) = match scenario::run_time(&args.traffic.goose)? {
        Some(_) if explicit => {
            anyhow::bail!(
                "give either -t (the surge in its middle third) or --before/--surge/--after"
            )
        }
        Some(t) => (t / 3, t / 3, t - 2 * (t / 3)),
        None => (
            args.before.unwrap_or(Duration::from_secs(60)),
            args.surge.unwrap_or(Duration::from_secs(600)),
            args.after.unwrap_or(Duration::from_secs(60)),
        ),
    };
    anyhow::ensure!(!surge.is_zero(), "the surge must last at least a second");
    Ok((before, before + surge, before + surge + after))
}

/// Seconds at the start of a phase its means leave out: the panels'
/// rates look 15 s back, the hot-key gauges show the last complete 10 s
/// window, and a mitigation takes a reload.
const SETTLE: Duration = Duration::from_secs(20);

/// The surge's identity as the metrics name it.
fn identity(surge: &Surge) -> String {
    match &surge.key {
        Some(t) => t.id.clone(),
        None => PROXY_ADDRESS.to_string(),
    }
}

fn describe(s: &Surge) -> String {
    let pace = format!("at up to {:.0} requests/s", s.rate);
    match (s.cause, &s.key) {
        (Cause::Tenant, Some(t)) => format!("one abusive tenant ({}) {pace}", t.id),
        (Cause::ClientBug, Some(t)) => {
            format!(
                "a client release sends {}'s key from every install, {pace}",
                t.id
            )
        }
        (Cause::Partner, Some(t)) => {
            format!("the partner ({}) within its own limit, {pace}", t.id)
        }
        _ => format!(
            "clients behind an untrusted proxy ({PROXY_ADDRESS}), one anonymous bucket, {pace}"
        ),
    }
}

/// The phases of the run as planned: (phase, from, until) in seconds
/// from its start, cut at `ended` (a run stopped early), empty ones out.
fn bounds(surge: &Surge, end: Duration, ended: f64) -> Vec<(Phase, f64, f64)> {
    let s = |d: Duration| d.as_secs_f64();
    let mut out = vec![(Phase::Before, 0.0, s(surge.from))];
    match surge.mitigated {
        Some(m) => {
            out.push((Phase::During, s(surge.from), s(m)));
            out.push((Phase::Mitigated, s(m), s(surge.until)));
        }
        None => out.push((Phase::During, s(surge.from), s(surge.until))),
    }
    out.push((Phase::After, s(surge.until), s(end)));
    out.into_iter()
        .map(|(p, from, until)| (p, from, until.min(ended)))
        .filter(|(_, from, until)| until > from)
        .collect()
}

pub async fn run(args: HotkeyArgs) -> anyhow::Result<Report> {
    scenario::require_stack(&args.traffic.goose)?;
    let (from, until, end) = windows(&args)?;
    let (good, _) = scenario::cast(&args.traffic)?;
    let key = match args.cause {
        // The hot tenant: one of the well-behaved ones, turned abusive.
        Cause::Tenant => Some(good[good.len() / 2].clone()),
        // A popular tenant whose app shipped with its key built in.
        Cause::ClientBug => Some(good[1].clone()),
        Cause::Proxy => None,
        Cause::Partner => Some(partner(&args.traffic.tenants, &good)?),
    };
    let mitigation = args.mitigate_at.map(|at| {
        let which = args.mitigation.unwrap_or(if args.cause.admitted() {
            Mitigation::Shard
        } else {
            Mitigation::DenyCache
        });
        (from + at, which)
    });
    if let Some((at, _)) = mitigation {
        anyhow::ensure!(at < until, "--mitigate-at must fall within the surge");
    }
    let rate = args.surge_rate.unwrap_or(if args.cause == Cause::Partner {
        DEFAULT_PARTNER_RATE
    } else {
        DEFAULT_SURGE_RATE
    });
    anyhow::ensure!(rate >= 1, "--surge-rate must be at least 1");
    let surge = Surge {
        cause: args.cause,
        key,
        from,
        until,
        mitigated: mitigation.map(|(at, _)| at),
        rate: rate as f64,
    };
    let who = identity(&surge);
    let stack_dir = Some(scenario::resolve(&args.stack_dir)).filter(|d| d.join("run").is_dir());

    // The CPU each phase used, from its settling to its end.
    let snapshots: Arc<Mutex<Vec<(f64, Snapshot)>>> = Arc::default();
    let mut timed = Vec::new();
    for (_, phase_from, phase_until) in bounds(&surge, end, f64::MAX) {
        for at in [
            phase_from + SETTLE.as_secs_f64().min((phase_until - phase_from) / 2.0),
            phase_until - 0.5,
        ] {
            let (snapshots, dir) = (Arc::clone(&snapshots), stack_dir.clone());
            timed.push(Timed {
                at: Duration::from_secs_f64(at.max(0.0)),
                label: String::new(),
                action: Some(Box::new(move || {
                    let snapshot = cpu::snapshot(dir.as_deref());
                    snapshots
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((at, snapshot));
                    Ok(String::new())
                })),
            });
        }
    }
    timed.push(Timed {
        at: from,
        label: format!("surge starts: {}", describe(&surge)),
        action: None,
    });
    if let Some((at, which)) = mitigation {
        let (compose, key) = (args.compose, who.clone());
        timed.push(Timed {
            at,
            label: format!("mitigation: scripts/drill {} on", which.name()),
            action: Some(Box::new(move || switch(compose, which, "on", &key))),
        });
    }
    timed.push(Timed {
        at: until,
        label: "surge stops".into(),
        action: None,
    });
    timed.sort_by_key(|t| t.at);

    let prometheus = Prometheus::new(&args.traffic.prometheus);
    let ran = scenario::run("hotkey", args.traffic, Some(surge.clone()), timed, end).await;
    // Put the stack back whatever happened.
    if let Some((_, which)) = mitigation {
        match switch(args.compose, which, "off", &who) {
            Ok(_) => println!("mitigation off again: scripts/drill {} off", which.name()),
            Err(e) => println!("could not switch the mitigation off: {e:#}"),
        }
    }
    let ran = ran?;
    if prometheus.ready().await {
        // One more scrape after the end (every 5 s), so the last phase counts.
        tokio::time::sleep(Duration::from_secs(6)).await;
        let snapshots = std::mem::take(&mut *snapshots.lock().unwrap_or_else(|e| e.into_inner()));
        report(
            &ran,
            &surge,
            end,
            &prometheus,
            &snapshots,
            stack_dir.is_some(),
        )
        .await?;
    } else {
        println!(
            "note: no Prometheus at {}: the phases' panels and alerts are left out",
            prometheus.url()
        );
    }
    Ok(ran.report)
}

/// The surge's node: where `who` made the most store calls from `from`
/// to `until` (the surge before any mitigation moved it). Not where its
/// share of a node's calls was highest: a tenant's other bucket (its
/// orders) can hold most of a quiet node's few calls, as much of them as
/// the surge holds of the node it saturates.
fn surge_node(calls: &panels::Series, who: &str, from: f64, until: f64) -> String {
    panels::highest(calls, "key", who, from, until)
        .and_then(|l| l.get("node").cloned())
        .unwrap_or_default()
}

/// `scripts/drill`'s switch for `which`.
fn switch(compose: bool, which: Mitigation, state: &str, key: &str) -> anyhow::Result<String> {
    match which {
        Mitigation::DenyCache => drill::switch(compose, "deny-cache", state, &[]),
        Mitigation::Shard if state == "on" => drill::switch(compose, "shard", state, &[key]),
        Mitigation::Shard => drill::switch(compose, "shard", state, &[]),
    }
}

/// The partner: the tenant with a limit of its own in the config.
fn partner(config: &Path, good: &[Tenant]) -> anyhow::Result<Tenant> {
    let path = scenario::resolve(config);
    let id = traffic::partner(&path)?.with_context(|| {
        format!(
            "--cause partner needs a tenant with a limit of its own ([[policies.overrides]] in {})",
            path.display()
        )
    })?;
    good.iter()
        .find(|t| t.id == id)
        .cloned()
        .with_context(|| format!("the partner {id} is not among the well-behaved tenants"))
}

fn fmt(v: Option<f64>, scale: f64, digits: usize) -> String {
    v.map_or("-".to_owned(), |v| format!("{:.*}", digits, v * scale))
}

fn percent(v: Option<f64>) -> String {
    v.map_or("-".to_owned(), |v| format!("{:.0} %", v * 100.0))
}

/// The phases table, the alerts table and the pictures.
async fn report(
    ran: &Ran,
    surge: &Surge,
    end: Duration,
    prometheus: &Prometheus,
    snapshots: &[(f64, Snapshot)],
    native: bool,
) -> anyhow::Result<()> {
    let (start, stop) = (ran.started_at, ran.ended_at);
    let ended = stop.duration_since(start).unwrap_or_default().as_secs_f64();
    let phases = bounds(surge, end, ended);
    let panels = panels::overview(panels::RATE_INTERVAL)?;
    let q = |title: &str, i: usize| panels::query(&panels, title, i).map(str::to_owned);
    let over = |expr: String| async move { over_run(prometheus, &expr, start, stop).await };
    let check_p99 = over(q("Check p99: what every limited request waits", 0)?).await?;
    let node_cpu = over(q("Node CPU and its cap (cores)", 0)?).await?;
    let node_cap = over(q("Node CPU and its cap (cores)", 1)?).await?;
    let throttled = over(q("Node CPU throttled by its cap", 0)?).await?;
    let share = over(q("Hot keys: share of their node's calls", 0)?).await?;
    let calls = over(q("Hot keys: checks and store calls per second", 1)?).await?;
    let firing = panels::firing(prometheus, start, stop).await?;

    let surge_secs = (surge.from.as_secs_f64(), surge.until.as_secs_f64());
    let unmitigated = surge.mitigated.map_or(surge_secs.1, |m| m.as_secs_f64());
    let busiest =
        |name: &str, value: &str| panels::highest(&calls, name, value, surge_secs.0, unmitigated);
    let mut who = identity(surge);
    if surge.key.is_none() && busiest("key", &who).is_none() {
        // Addresses are hashed in the labels (the default): the proxy's is
        // the anonymous key with the most store calls in the surge.
        who = busiest("key_kind", "ip")
            .and_then(|l| l.get("key").cloned())
            .unwrap_or(who);
    }
    let node = surge_node(&calls, &who, surge_secs.0, unmitigated);
    let of_node = |s: &Series| panels::with_label(s, "node", &node);
    // The key's share: its highest on any node, each moment.
    let key_share: Vec<(f64, f64)> = {
        let mut by_time: BTreeMap<i64, f64> = BTreeMap::new();
        for (t, v) in panels::with_label(&share, "key", &who) {
            let e = by_time.entry((t * 10.0).round() as i64).or_insert(0.0);
            *e = e.max(v);
        }
        by_time
            .into_iter()
            .map(|(t, v)| (t as f64 / 10.0, v))
            .collect()
    };

    let mut table = Table::new(&[
        "phase",
        "seconds",
        "surge req/s",
        "surge p99 ms",
        "others p99 ms",
        "check p99 ms",
        "surge node CPU (cores)",
        "of its cap",
        "periods throttled",
        "surge key's share of its node",
        "alerts firing at its end",
        "machine busy",
        "generator + nginx + instances",
    ]);
    let settle = SETTLE.as_secs_f64();
    for (phase, from, until) in &phases {
        let i = *phase as usize;
        let settled = from + settle.min((until - from) / 2.0);
        let cpu_used = cpu_between(snapshots, settled, *until);
        let cores = mean(&of_node(&node_cpu), settled, *until);
        let cap = mean(&of_node(&node_cap), settled, *until);
        table.row(vec![
            phase.name().into(),
            format!("{:.0}", until - from),
            format!("{:.0}", ran.run.surging[i].count() as f64 / (until - from)),
            results::ms_from_us(ran.run.surging[i].quantile(0.99)),
            results::ms_from_us(ran.run.others[i].quantile(0.99)),
            fmt(mean(&panels::all(&check_p99), settled, *until), 1000.0, 2),
            fmt(cores, 1.0, 3),
            match (cores, cap) {
                (Some(c), Some(cap)) if cap > 0.0 => percent(Some(c / cap)),
                _ => "-".into(),
            },
            percent(mean(&of_node(&throttled), settled, *until)),
            percent(mean(&key_share, settled, *until)),
            // Its last 10 s: two evaluations of every rule.
            alert_names(&firing, (until - 10.0).max(*from), *until),
            cpu_used
                .as_ref()
                .map_or("-".into(), |u| percent(Some(u.host / u.cores))),
            cpu_used
                .as_ref()
                .and_then(Usage::front_share)
                .map_or("-".into(), |s| percent(Some(s))),
        ]);
    }
    println!();
    println!(
        "surge: {who}, its node {}; phases averaged from {} s into each{}",
        if node.is_empty() {
            "unknown"
        } else {
            node.as_str()
        },
        SETTLE.as_secs(),
        if native {
            ""
        } else {
            " (no native stack: the components' CPU is left out)"
        }
    );
    println!("{}", table.markdown());
    table.write(&ran.dir, "phases")?;

    // When each alert fired and stopped, from the surge's start.
    let mut alerts = Table::new(&["alert", "labels", "firing from (s into the surge)", "until"]);
    for (labels, times) in &firing {
        let (Some(first), Some(last)) = (times.first(), times.last()) else {
            continue;
        };
        let what: Vec<String> = labels
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "alertname" | "alertstate" | "severity" | "__name__" | "job"
                )
            })
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        alerts.row(vec![
            labels.get("alertname").cloned().unwrap_or_default(),
            what.join(" "),
            format!("{:.0}", first - surge_secs.0),
            if *last + 6.0 >= ended {
                "the end".into()
            } else {
                format!("{:.0}", last - surge_secs.0)
            },
        ]);
    }
    println!("{}", alerts.markdown());
    alerts.write(&ran.dir, "alerts")?;

    // Every 5 s: what the dashboard showed of the surge's node and key.
    let mut timeline = Table::new(&[
        "seconds",
        "check p99 ms",
        "surge node CPU (cores)",
        "its cap",
        "periods throttled",
        "surge key's share",
        "alerts firing",
    ]);
    let at = |points: &[(f64, f64)], t: f64| {
        points
            .iter()
            .find(|(s, _)| (s - t).abs() < 0.5)
            .map(|(_, v)| *v)
    };
    let (p99, cpu_pts, cap_pts, thr_pts) = (
        panels::all(&check_p99),
        of_node(&node_cpu),
        of_node(&node_cap),
        of_node(&throttled),
    );
    let mut t = 0.0;
    while t <= ended {
        let firing_now = firing
            .iter()
            .filter(|(_, times)| times.iter().any(|x| (x - t).abs() < 0.5))
            .count();
        timeline.row(vec![
            format!("{t:.0}"),
            fmt(at(&p99, t), 1000.0, 3),
            fmt(at(&cpu_pts, t), 1.0, 4),
            fmt(at(&cap_pts, t), 1.0, 3),
            fmt(at(&thr_pts, t), 1.0, 3),
            fmt(at(&key_share, t), 1.0, 3),
            firing_now.to_string(),
        ]);
        t += 5.0;
    }
    timeline.write(&ran.dir, "timeline")?;

    let mut marks = vec![(surge_secs.0, "surge starts".to_owned())];
    if let Some(m) = surge.mitigated {
        marks.push((m.as_secs_f64(), "mitigation on".to_owned()));
    }
    marks.push((surge_secs.1, "surge stops".to_owned()));
    let marks: Vec<(f64, String)> = marks.into_iter().filter(|(t, _)| *t < ended).collect();
    let per_node = |s: &Series| -> Vec<(String, Vec<(f64, f64)>)> {
        s.iter()
            .map(|(l, p)| (l.get("node").cloned().unwrap_or_default(), p.clone()))
            .collect()
    };
    // Each node's CPU as a share of what it may use, every 5 s.
    let of_cap: Vec<(String, Vec<(f64, f64)>)> = per_node(&node_cpu)
        .into_iter()
        .map(|(node, used)| {
            let cap = panels::with_label(&node_cap, "node", &node);
            let points = used
                .into_iter()
                .filter_map(|(t, v)| Some((t, 100.0 * v / at(&cap, t).filter(|c| *c > 0.0)?)))
                .collect();
            (node, points)
        })
        .collect();
    let span = Some((0.0, ended));
    let charts = [
        Chart {
            title: "Check p99: what every limited request waits (ms)",
            x_label: "seconds since start",
            y_label: "ms",
            series: vec![(
                "check p99".into(),
                panels::all(&check_p99)
                    .into_iter()
                    .map(|(t, v)| (t, v * 1000.0))
                    .collect(),
            )],
            marks: marks.clone(),
            x_range: span,
        },
        Chart {
            title: "Redis nodes' CPU, % of what each may use (its cap)",
            x_label: "seconds since start",
            y_label: "%",
            series: of_cap,
            marks: marks.clone(),
            x_range: span,
        },
        Chart {
            title: "Periods the nodes' cap held them back in (%)",
            x_label: "seconds since start",
            y_label: "%",
            series: per_node(&throttled)
                .into_iter()
                .map(|(n, p)| (n, p.into_iter().map(|(t, v)| (t, v * 100.0)).collect()))
                .collect(),
            marks: marks.clone(),
            x_range: span,
        },
        Chart {
            title: "The surge key's share of its node's calls (%)",
            x_label: "seconds since start",
            y_label: "%",
            series: vec![(
                who.clone(),
                key_share.iter().map(|(t, v)| (*t, v * 100.0)).collect(),
            )],
            marks,
            x_range: span,
        },
    ];
    if let Some(path) = results::plot(&ran.dir.join("hotkey.png"), &charts)? {
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// The CPU used between the snapshots taken at `from` and at `until`.
fn cpu_between(snapshots: &[(f64, Snapshot)], from: f64, until: f64) -> Option<Usage> {
    let near = |t: f64| {
        snapshots
            .iter()
            .filter(|(at, _)| (at - t).abs() < 1.0)
            .map(|(_, s)| s)
            .next()
    };
    Some(cpu::between(near(from)?, near(until - 0.5)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn surge(mitigated: Option<u64>) -> Surge {
        Surge {
            cause: Cause::Tenant,
            key: None,
            from: Duration::from_secs(60),
            until: Duration::from_secs(660),
            mitigated: mitigated.map(Duration::from_secs),
            rate: 100.0,
        }
    }

    /// Every 5 s from `from`, tenant-08's value on `node`.
    fn series(
        node: &str,
        from: f64,
        values: &[f64],
    ) -> (BTreeMap<String, String>, Vec<(f64, f64)>) {
        let labels = [("key", "tenant-08"), ("node", node)]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .into();
        let points = values
            .iter()
            .enumerate()
            .map(|(i, v)| (from + 5.0 * i as f64, *v));
        (labels, points.collect())
    }

    /// A run's own figures (2026-12-07, surge from 20 s, deny cache at
    /// 50 s): tenant-08's `api` bucket on :7001 (1,500 store calls a
    /// second from 30 s), its `orders` bucket on the quiet :7002 (300).
    /// By mean share :7002 came first (0.81 against 0.78: the first
    /// figures in the surge were still the last interval's before it); by
    /// store calls :7001 is five times ahead.
    #[test]
    fn the_surge_node_is_where_its_key_makes_the_most_calls() {
        let share = vec![
            series(
                "127.0.0.1:7001",
                20.0,
                &[0.37, 0.37, 0.98, 0.98, 0.98, 0.98, 0.98],
            ),
            series("127.0.0.1:7002", 30.0, &[0.82, 0.82, 0.80, 0.80, 0.79]),
        ];
        let calls = vec![
            series(
                "127.0.0.1:7001",
                20.0,
                &[23.8, 23.8, 1506.0, 1506.0, 1488.9, 1488.9, 1603.9],
            ),
            series("127.0.0.1:7002", 30.0, &[335.2, 335.2, 297.2, 297.2, 313.5]),
        ];
        let by_share = panels::highest(&share, "key", "tenant-08", 20.0, 50.0);
        assert_eq!(by_share.unwrap()["node"], "127.0.0.1:7002", "the trap");
        assert_eq!(
            surge_node(&calls, "tenant-08", 20.0, 50.0),
            "127.0.0.1:7001"
        );
    }

    #[test]
    fn phases_follow_the_plan_and_stop_where_the_run_did() {
        let end = Duration::from_secs(720);
        let names = |b: Vec<(Phase, f64, f64)>| b.iter().map(|p| p.0.name()).collect::<Vec<_>>();
        assert_eq!(
            names(bounds(&surge(None), end, 720.0)),
            ["before", "surge", "after"]
        );
        let mitigated = bounds(&surge(Some(300)), end, 720.0);
        assert_eq!(
            names(mitigated.clone()),
            ["before", "surge", "mitigated", "after"]
        );
        assert_eq!(mitigated[2], (Phase::Mitigated, 300.0, 660.0));
        // Stopped with ctrl-c two minutes into the surge.
        let cut = bounds(&surge(Some(300)), end, 180.0);
        assert_eq!(names(cut.clone()), ["before", "surge"]);
        assert_eq!(cut[1].2, 180.0);
    }
}
