//! `http-cost`'s tables: every variant's figures as min / median / max
//! over the rounds, its ratios to the peers taken within each round, and
//! the goals (docs/http-cost.md) judged on the medians of those ratios.

use super::Run;
use crate::results::Table;

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

/// Each round's lua route CPU per request beyond the memory route's, over
/// Redis's CPU per request in that lua run: what a Redis check costs our
/// process against what it costs Redis, the Redis goal judged over HTTP.
/// The two routes run the same policy and differ in the store alone, so
/// the difference is the check through Redis less the in-process one (a
/// small part of a request; the figure is that much low). `figure` is
/// the server's whole CPU or its user space alone. Rounds in
/// which Redis's CPU read as nothing (too short a run) are left out.
fn redis_shares(runs: &[Run], figure: fn(&Run) -> f64) -> Vec<f64> {
    runs.iter()
        .filter(|lua| lua.variant == "lua" && lua.redis_us() > 0.0)
        .filter_map(|lua| {
            let memory = runs
                .iter()
                .find(|m| m.variant == "memory" && m.round == lua.round)?;
            Some((figure(lua) - figure(memory)) / lua.redis_us())
        })
        .collect()
}

/// A goal's line: `median` against `bound`, or not measured (NaN).
fn judged(what: &str, median: f64, bound: f64) -> String {
    if median.is_nan() {
        return format!("- {what}: not measured in this run");
    }
    let verdict = if median <= bound { "met" } else { "not met" };
    format!("- {what}: median {median:.2}x, goal at most {bound:.2}x: {verdict}")
}

/// A reported figure's line: `median`, or not measured (NaN).
fn reported(what: &str, median: f64) -> String {
    if median.is_nan() {
        return format!("- {what}: not measured in this run");
    }
    format!("- {what}: median {median:.2}x (reported)")
}

fn total_us(r: &Run) -> f64 {
    r.server_us() + r.redis_us()
}

pub(super) fn tables(runs: &[Run], variants: &[String]) -> (Table, Table, Vec<String>) {
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
            let ok = if v.starts_with("grpc") { "OK" } else { "200" };
            format!("{} x {ok}", mine.iter().map(|r| r.ok).sum::<usize>())
        };
        summary.row(vec![
            v.clone(),
            spread(of(Run::server_us), 2),
            spread(of(Run::server_user_us), 2),
            if v == "lua" || v == "grpc-lua" {
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
    // The goals, each a median of same-round ratios.
    let goal = |what: &str, variant: &str, peer: &str, bound: f64| {
        judged(what, median(ratios(runs, variant, peer, total_us)), bound)
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
        let what = format!("{what}, user space alone");
        reported(
            &what,
            median(ratios(runs, variant, peer, Run::server_user_us)),
        )
    };
    goals.push(user(
        "memory-limited route vs tower_governor",
        "memory",
        "governor",
    ));
    goals.push(user("unlimited route vs plain axum", "unlimited", "plain"));
    let what = "lua route's server CPU beyond the memory route's vs Redis's CPU";
    goals.push(judged(
        what,
        median(redis_shares(runs, Run::server_us)),
        0.5,
    ));
    let user = median(redis_shares(runs, Run::server_user_us));
    if !user.is_nan() {
        goals.push(reported(&format!("{what}, user space alone"), user));
    }
    (summary, all, goals)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of 1000 requests with these CPU seconds.
    fn run(round: usize, variant: &str, server: f64, user: f64, redis: f64) -> Run {
        Run {
            round,
            variant: variant.into(),
            seconds: 1.0,
            server_cpu: server,
            server_user: user,
            redis_cpu: redis,
            latencies_us: vec![100; 1000],
            ok: 1000,
            limited: 0,
            other: 0,
            fallback: 0.0,
        }
    }

    /// Same-round pairs only, the median of three rounds, Redis's CPU the
    /// denominator, and a round without Redis CPU left out.
    #[test]
    fn the_redis_goal_is_the_lua_routes_extra_cpu_over_redis_s() {
        let runs = vec![
            // Round 1: 6 us beyond memory's 10 against Redis's 8: 0.75.
            run(1, "memory", 0.010, 0.004, 0.0),
            run(1, "lua", 0.016, 0.007, 0.008),
            // Round 2: 4 against 10: 0.40.
            run(2, "memory", 0.010, 0.004, 0.0),
            run(2, "lua", 0.014, 0.006, 0.010),
            // Round 3: 5 against 10: 0.50, the goal exactly.
            run(3, "memory", 0.011, 0.004, 0.0),
            run(3, "lua", 0.016, 0.006, 0.010),
            // Round 4: Redis read as nothing; no memory run in round 5.
            run(4, "memory", 0.010, 0.004, 0.0),
            run(4, "lua", 0.016, 0.006, 0.0),
            run(5, "lua", 0.001, 0.001, 0.010),
        ];
        let mut shares = redis_shares(&runs, Run::server_us);
        shares.sort_by(f64::total_cmp);
        let expected = [0.4, 0.5, 0.75];
        assert_eq!(shares.len(), expected.len(), "{shares:?}");
        for (got, want) in shares.iter().zip(expected) {
            assert!((got - want).abs() < 1e-9, "{shares:?}");
        }
        let (_, _, goals) = tables(&runs, &["memory".into(), "lua".into()]);
        let line = goals
            .iter()
            .find(|g| g.contains("beyond the memory route's vs Redis's CPU:"))
            .expect("the Redis goal's line");
        assert!(
            line.ends_with("median 0.50x, goal at most 0.50x: met"),
            "{line}"
        );
        assert!(
            goals
                .iter()
                .any(|g| g.ends_with("user space alone: median 0.20x (reported)")),
            "{goals:?}"
        );
        // Only a round whose Redis read as nothing, or no lua run at all.
        for some in [&runs[6..8], &runs[..1]] {
            let (_, _, goals) = tables(some, &["memory".into()]);
            assert!(
                goals
                    .iter()
                    .any(|g| g.ends_with("Redis's CPU: not measured in this run")),
                "{goals:?}"
            );
        }
    }
}
