use super::*;
use proptest::prelude::*;
use std::time::Duration;

const T0: Micros = 1_800_000_000_000_000;

fn limit_strategy() -> impl Strategy<Value = Limit> {
    (
        1u64..=60,
        1u64..=20,
        prop_oneof![Just(1_000_000u64), Just(60_000_000), 1u64..=5_000_000],
    )
        .prop_map(|(b, r, p)| Limit::new(b, r, Duration::from_micros(p)).unwrap())
}

/// Forward-only steps: bunched, spread and idle.
fn calls(burst: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
    let step = prop_oneof![
        5 => 0u64..=3_000,
        3 => 0u64..=3_000_000,
        1 => 0u64..=200_000_000,
    ];
    prop::collection::vec((step, 0..=burst.min(4)), 1..200).prop_map(|steps| {
        let mut now = T0;
        steps
            .into_iter()
            .map(|(dt, cost)| {
                now += dt;
                (now, cost)
            })
            .collect()
    })
}

fn case() -> impl Strategy<Value = (Limit, Vec<(u64, u64)>)> {
    limit_strategy().prop_flat_map(|l| (Just(l), calls(l.burst())))
}

/// Runs calls through one algorithm: each call's decision, and the final state.
fn run(limit: &Limit, calls: &[(u64, u64)]) -> (Vec<Decision>, Option<State>) {
    let mut state = None;
    let decisions = calls
        .iter()
        .map(|&(now, cost)| {
            let (d, s) = check(limit, state.take(), cost, now).unwrap();
            state = s;
            d
        })
        .collect();
    (decisions, state)
}

/// Admitted (time, cost) pairs.
fn admitted(calls: &[(u64, u64)], decisions: &[Decision]) -> Vec<(u64, u64)> {
    calls
        .iter()
        .zip(decisions)
        .filter(|(_, d)| d.allowed)
        .map(|(c, _)| *c)
        .collect()
}

/// Most cost admitted in any interval `(t - w, t]` (ending at an admission).
fn worst_window(admitted: &[(u64, u64)], w: u64) -> u64 {
    admitted
        .iter()
        .map(|&(t, _)| {
            admitted
                .iter()
                .filter(|&&(u, _)| u <= t && u + w > t)
                .map(|&(_, c)| c)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// On a forward clock GCRA is the token bucket, decision for decision.
    #[test]
    fn gcra_is_the_token_bucket_on_a_forward_clock((limit, calls) in case()) {
        let (bucket, _) = run(&limit, &calls);
        let (gcra, _) = run(&limit.with_algorithm(Algorithm::Gcra), &calls);
        prop_assert_eq!(bucket, gcra);
    }

    /// For every algorithm, `Retry-After` and `Reset` are exact to the
    /// microsecond: the same request is refused a microsecond before
    /// `retry_after` and admitted at it; the key is back to its full limit
    /// at `reset` and not a microsecond before.
    #[test]
    fn retry_after_and_reset_are_exact_for_every_algorithm(
        (limit, calls) in case(),
        cost in 1u64..=4,
    ) {
        for algorithm in Algorithm::ALL {
            let limit = limit.with_algorithm(algorithm);
            let cost = cost.min(limit.burst());
            let (decisions, state) = run(&limit, &calls);
            let now = calls.last().unwrap().0;
            // The wait for `cost` measured from the final state.
            let (d, _) = check(&limit, state.clone(), cost, now).unwrap();
            let state_before = state.clone();
            let retry = d.retry_after.as_micros() as u64;
            if !d.allowed {
                prop_assert!(retry > 0, "{:?}: denied with no wait", algorithm);
                let (early, _) = check(&limit, state_before.clone(), cost, now + retry - 1).unwrap();
                prop_assert!(!early.allowed, "{:?}: admitted 1us early", algorithm);
                let (on_time, _) = check(&limit, state_before.clone(), cost, now + retry).unwrap();
                prop_assert!(on_time.allowed, "{:?}: refused at retry_after", algorithm);
            }
            let last = decisions.last().unwrap();
            let reset = last.reset.as_micros() as u64;
            let (full, _) = check(&limit, state_before.clone(), 0, now + reset).unwrap();
            prop_assert_eq!(full.remaining, limit.burst(), "{:?}: not full at reset", algorithm);
            if reset > 0 {
                let (almost, _) = check(&limit, state_before, 0, now + reset - 1).unwrap();
                prop_assert!(almost.remaining < limit.burst(), "{:?}: full before reset", algorithm);
            }
        }
    }

    /// The log is exact: never more than the limit in any window, and every
    /// refusal was required by that rule.
    #[test]
    fn sliding_log_admits_exactly_what_the_window_allows((limit, calls) in case()) {
        let limit = limit.with_algorithm(Algorithm::SlidingLog);
        let w = limit.window().window_us;
        let (decisions, _) = run(&limit, &calls);
        let ok = admitted(&calls, &decisions);
        prop_assert!(worst_window(&ok, w) <= limit.burst());
        for (&(t, cost), d) in calls.iter().zip(&decisions) {
            if !d.allowed {
                let in_window: u64 = ok.iter().filter(|&&(u, _)| u <= t && u + w > t).map(|&(_, c)| c).sum();
                prop_assert!(in_window + cost > limit.burst(), "refused at {} with room", t);
            }
        }
    }

    /// Fixed windows: at most the limit per aligned window, hence at most 2x
    /// in any interval of one window's length.
    #[test]
    fn fixed_window_holds_each_window_and_at_most_twice_across_one((limit, calls) in case()) {
        let limit = limit.with_algorithm(Algorithm::FixedWindow);
        let w = limit.window().window_us;
        let (decisions, _) = run(&limit, &calls);
        let ok = admitted(&calls, &decisions);
        for &(t, _) in &ok {
            let aligned: u64 = ok.iter().filter(|&&(u, _)| u / w == t / w).map(|&(_, c)| c).sum();
            prop_assert!(aligned <= limit.burst());
        }
        prop_assert!(worst_window(&ok, w) <= 2 * limit.burst());
        // Every refusal was needed: the window's count had no room.
        for (&(t, cost), d) in calls.iter().zip(&decisions) {
            if !d.allowed {
                let aligned: u64 = ok.iter().filter(|&&(u, _)| u / w == t / w && u <= t).map(|&(_, c)| c).sum();
                prop_assert!(aligned + cost > limit.burst(), "refused at {} with room", t);
            }
        }
    }

    /// The sliding-window counter never passes the limit within one aligned
    /// window (its estimate includes the whole current count), and every
    /// admission kept the weighted estimate within the limit.
    #[test]
    fn sliding_window_counter_keeps_its_estimate((limit, calls) in case()) {
        let limit = limit.with_algorithm(Algorithm::SlidingWindow);
        let w = limit.window().window_us;
        let (decisions, _) = run(&limit, &calls);
        let ok = admitted(&calls, &decisions);
        for &(t, _) in &ok {
            let index = t / w;
            let cur: u64 = ok.iter().filter(|&&(u, _)| u / w == index && u <= t).map(|&(_, c)| c).sum();
            let prev: u64 = ok.iter().filter(|&&(u, _)| u / w + 1 == index).map(|&(_, c)| c).sum();
            let e = t - index * w;
            prop_assert!(cur <= limit.burst());
            prop_assert!(
                u128::from(prev) * u128::from(w - e) + u128::from(cur) * u128::from(w)
                    <= u128::from(limit.burst()) * u128::from(w)
            );
        }
        prop_assert!(worst_window(&ok, w) <= 2 * limit.burst());
        // Every refusal was needed: the estimate with this request in it
        // would have passed the limit.
        for (&(t, cost), d) in calls.iter().zip(&decisions) {
            if !d.allowed {
                let index = t / w;
                let cur: u64 = ok.iter().filter(|&&(u, _)| u / w == index && u <= t).map(|&(_, c)| c).sum();
                let prev: u64 = ok.iter().filter(|&&(u, _)| u / w + 1 == index).map(|&(_, c)| c).sum();
                let e = t - index * w;
                prop_assert!(
                    u128::from(prev) * u128::from(w - e) + u128::from(cur + cost) * u128::from(w)
                        > u128::from(limit.burst()) * u128::from(w),
                    "refused at {} with room", t
                );
            }
        }
    }

    /// A clock that steps backwards refills nothing and changes nothing
    /// (the token bucket's promise): a call at an instant before the one
    /// the stored bucket was last computed for is decided exactly as at
    /// that instant, admitted or not, with the same remaining tokens and
    /// the same state kept, and the stored instant never moves back.
    /// Calls step back by up to 5 s among forward steps.
    #[test]
    fn a_clock_stepping_back_refills_nothing_and_changes_nothing(
        limit in limit_strategy(),
        steps in prop::collection::vec(
            (prop_oneof![4 => 0i64..=3_000_000, 1 => -5_000_000i64..=0], 0u64..=4),
            1..200,
        ),
    ) {
        let mut now = T0 as i64;
        let mut state: Option<State> = None;
        for &(dt, cost) in &steps {
            now += dt;
            let cost = cost.min(limit.burst());
            let (d, next) = check(&limit, state.clone(), cost, now as u64).unwrap();
            if let Some(State::Bucket(before)) = &state
                && (now as u64) < before.last
            {
                let (at_last, next_at_last) = check(&limit, state.clone(), cost, before.last).unwrap();
                prop_assert_eq!((d.allowed, d.remaining), (at_last.allowed, at_last.remaining));
                prop_assert_eq!(&next, &next_at_last);
            }
            if let (Some(State::Bucket(before)), Some(State::Bucket(after))) = (&state, &next) {
                prop_assert!(after.last >= before.last, "the stored instant moved back");
            }
            state = next;
        }
    }
}

/// The fixed window's failure, reproduced: the limit at the end of one
/// window and again at the start of the next, 2 us apart.
#[test]
fn fixed_window_passes_twice_the_limit_across_a_boundary() {
    let limit = Limit::per_second(10, 1)
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow);
    let w = limit.window().window_us;
    assert_eq!(w, 10_000_000);
    let boundary = (T0 / w + 1) * w;
    let mut state = None;
    let mut passed = 0;
    for now in [boundary - 1, boundary] {
        for _ in 0..15 {
            let (d, s) = check(&limit, state.take(), 1, now).unwrap();
            state = s;
            passed += u32::from(d.allowed);
        }
    }
    assert_eq!(passed, 20, "2x the limit within 2 microseconds");
    // The log, fed the same, passes the limit and no more.
    let log = limit.with_algorithm(Algorithm::SlidingLog);
    let (mut state, mut passed) = (None, 0);
    for now in [boundary - 1, boundary] {
        for _ in 0..15 {
            let (d, s) = check(&log, state.take(), 1, now).unwrap();
            state = s;
            passed += u32::from(d.allowed);
        }
    }
    assert_eq!(passed, 10);
}

/// The counter's two errors: requests bunched at the end of the previous
/// window are under-counted (over-admission in a true sliding window), and
/// bunched at its start over-counted (a refusal the log would not make).
#[test]
fn sliding_window_counter_errs_both_ways_when_traffic_is_bunched() {
    let limit = Limit::per_second(10, 1)
        .unwrap()
        .with_algorithm(Algorithm::SlidingWindow);
    let w = limit.window().window_us;
    let start = (T0 / w + 1) * w;
    let spend = |times: &[(u64, u32)]| {
        let mut state = None;
        let mut passed = vec![];
        for &(now, n) in times {
            let mut p = 0;
            for _ in 0..n {
                let (d, s) = check(&limit, state.take(), 1, now).unwrap();
                state = s;
                p += u32::from(d.allowed);
            }
            passed.push(p);
        }
        passed
    };
    // 10 at the very end of a window, then at 10% into the next the counter
    // weighs them at 90%, so 1 more passes; the log would pass none
    // (all 10 are inside the last W).
    assert_eq!(spend(&[(start - 1, 10), (start + w / 10, 10)]), vec![10, 1]);
    // 10 at the very start of a window; at 90% into the next, the log has
    // room for all 10 again (they left the window long ago), but the
    // counter still weighs them at 10%: 9 pass.
    assert_eq!(
        spend(&[(start, 10), (start + w + 9 * w / 10, 10)]),
        vec![10, 9]
    );
}
