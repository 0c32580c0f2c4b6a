//! What a step's figures say: what bounds it, where a series' knee is,
//! and the check latency quantiles between two scrapes of an instance's
//! histogram. Pure functions, unit-tested below.

use std::time::Duration;

/// What bounds a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// It kept up with the offered rate.
    Offered,
    /// Requests waited on the Redis round trip with every slot in flight.
    RoundTrip,
    /// The machine's CPU was saturated.
    Cpu,
    /// Every slot was in flight, and neither the round trip nor the CPU
    /// explains it.
    InFlight,
    /// Neither the slots nor the CPU were full, yet the offer was not met:
    /// the load generator could not send it (or something unmeasured).
    Generator,
}

impl Bound {
    pub fn name(self) -> &'static str {
        match self {
            Bound::Offered => "-",
            Bound::RoundTrip => "round trip",
            Bound::Cpu => "CPU",
            Bound::InFlight => "in flight",
            Bound::Generator => "generator?",
        }
    }
}

/// One step's measurements.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Point {
    pub offered: f64,
    pub achieved: f64,
    /// Mean request latency, seconds.
    pub mean_latency: f64,
    /// Busy fraction of all the machine's cores, from the processes in the
    /// measurement (generator, instance, redis-server).
    pub machine_cpu: f64,
    /// Share of the offers that found every slot in flight (not sent).
    pub turned_away: f64,
}

/// A point kept up when it achieved this share of the offer.
pub(super) const KEPT_UP: f64 = 0.95;

/// Mean requests in flight (Little's law: rate times time in the system).
pub fn mean_in_flight(p: &Point) -> f64 {
    p.achieved * p.mean_latency
}

/// The throughput bound the round trip sets: `in_flight / rtt`.
pub fn rtt_bound(in_flight: usize, rtt: Duration) -> Option<f64> {
    (!rtt.is_zero()).then(|| in_flight as f64 / rtt.as_secs_f64())
}

/// What bounds `p`, for an instance whose checks each wait `rtt` on Redis.
/// The slots were full if offers were turned away for want of one (the
/// mean in flight stays below the cap: offers come in bursts).
pub fn bound_by(p: &Point, rtt: Duration) -> Bound {
    if p.achieved >= KEPT_UP * p.offered {
        return Bound::Offered;
    }
    let saturated = p.turned_away >= 0.05;
    if saturated && !rtt.is_zero() && rtt.as_secs_f64() >= 0.5 * p.mean_latency {
        Bound::RoundTrip
    } else if p.machine_cpu >= 0.85 {
        Bound::Cpu
    } else if saturated {
        Bound::InFlight
    } else {
        Bound::Generator
    }
}

/// The knee of a series: the first offer it did not keep up with, and the
/// most it achieved (its capacity). `None` if it kept up throughout.
pub fn knee(points: &[Point]) -> Option<(f64, f64)> {
    let first = points.iter().find(|p| p.achieved < KEPT_UP * p.offered)?;
    let most = points.iter().map(|p| p.achieved).fold(0.0, f64::max);
    Some((first.offered, most))
}

/// The check latency histogram of an instance's `/metrics`, summed over
/// labels: (upper bound, cumulative count) pairs.
pub fn check_buckets(metrics: &str) -> Vec<(f64, f64)> {
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("ratelimit_check_duration_seconds_bucket{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Some(le) = labels
            .split(',')
            .find_map(|l| l.strip_prefix("le=\""))
            .map(|l| l.trim_end_matches('"'))
        else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::NAN)
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        match buckets.iter_mut().find(|(b, _)| *b == le) {
            Some((_, v)) => *v += value,
            None => buckets.push((le, value)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets
}

/// The `q` quantile of the observations between two scrapes of the same
/// histogram, interpolated within a bucket as Prometheus's
/// `histogram_quantile` does. `None` without observations.
pub fn quantile_between(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, v)| {
            let was = before
                .iter()
                .find(|(b, _)| b == le)
                .map_or(0.0, |(_, v)| *v);
            (*le, v - was)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in &delta {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let in_bucket = count - lower.1;
            let fraction = if in_bucket > 0.0 {
                (rank - lower.1) / in_bucket
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * fraction);
        }
        lower = (le, count);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(offered: f64, achieved: f64, latency_ms: f64, cpu: f64) -> Point {
        Point {
            offered,
            achieved,
            mean_latency: latency_ms / 1000.0,
            machine_cpu: cpu,
            // Offers turned away (slots full) when requests take 2 ms or
            // more; none when faster.
            turned_away: if latency_ms >= 2.0 { 0.2 } else { 0.0 },
        }
    }

    #[test]
    fn the_knee_is_the_first_offer_not_met_and_capacity_the_most_achieved() {
        let series = [
            p(1000.0, 1000.0, 1.0, 0.2),
            p(2000.0, 1990.0, 1.2, 0.4),
            p(4000.0, 3100.0, 2.5, 0.5),
            p(8000.0, 3050.0, 2.6, 0.5),
        ];
        assert_eq!(knee(&series), Some((4000.0, 3100.0)));
        assert_eq!(knee(&series[..2]), None, "kept up throughout");
    }

    #[test]
    fn the_round_trip_bound_is_in_flight_over_rtt() {
        assert_eq!(rtt_bound(8, Duration::from_millis(2)), Some(4000.0));
        assert_eq!(rtt_bound(8, Duration::from_micros(500)), Some(16000.0));
        assert_eq!(rtt_bound(8, Duration::ZERO), None);
    }

    #[test]
    fn each_point_names_what_bounds_it() {
        let rtt = Duration::from_millis(2);
        // Kept up.
        assert_eq!(bound_by(&p(1000.0, 990.0, 2.3, 0.3), rtt), Bound::Offered);
        // Slots full (offers turned away), most of each request the 2 ms
        // round trip.
        assert_eq!(
            bound_by(&p(4000.0, 3450.0, 2.3, 0.4), rtt),
            Bound::RoundTrip
        );
        // Slots full, requests much longer than the round trip: the CPU.
        assert_eq!(bound_by(&p(4000.0, 1000.0, 8.0, 0.9), rtt), Bound::Cpu);
        assert_eq!(
            bound_by(&p(8000.0, 3000.0, 2.7, 0.95), Duration::ZERO),
            Bound::Cpu
        );
        // Slots full, CPU not saturated, no round trip to blame.
        assert_eq!(
            bound_by(&p(8000.0, 3000.0, 2.7, 0.5), Duration::ZERO),
            Bound::InFlight
        );
        // No offer turned away and the CPU not busy, yet the offer not
        // met: the generator could not send it, not the instance's limit.
        assert_eq!(
            bound_by(&p(8000.0, 3000.0, 1.0, 0.5), Duration::ZERO),
            Bound::Generator
        );
        assert!((mean_in_flight(&p(4000.0, 3450.0, 2.3, 0.4)) - 7.935).abs() < 1e-9);
    }

    #[test]
    fn check_quantiles_come_from_the_histogram_between_two_scrapes() {
        let scrape = |a: u64, b: u64, c: u64| {
            format!(
                "# TYPE ratelimit_check_duration_seconds histogram\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"api\",source=\"redis\",le=\"0.001\"}} {a}\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"api\",source=\"redis\",le=\"0.002\"}} {b}\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"api\",source=\"redis\",le=\"+Inf\"}} {c}\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"x\",source=\"local\",le=\"0.001\"}} 1\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"x\",source=\"local\",le=\"0.002\"}} 1\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"x\",source=\"local\",le=\"+Inf\"}} 1\n\
                 ratelimit_check_duration_seconds_count 5\n"
            )
        };
        let before = check_buckets(&scrape(10, 10, 10));
        assert_eq!(
            before,
            vec![(0.001, 11.0), (0.002, 11.0), (f64::INFINITY, 11.0)]
        );
        // 100 new checks: 50 under 1 ms, 50 between 1 and 2 ms.
        let after = check_buckets(&scrape(60, 110, 110));
        let p50 = quantile_between(&before, &after, 0.5).unwrap();
        assert!((p50 - 0.001).abs() < 1e-12, "{p50}");
        let p99 = quantile_between(&before, &after, 0.99).unwrap();
        assert!((p99 - 0.00198).abs() < 1e-9, "{p99}");
        assert_eq!(quantile_between(&before, &before, 0.5), None);
    }
}
