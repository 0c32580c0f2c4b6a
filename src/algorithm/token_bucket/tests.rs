//! Unit and property tests for the token bucket against an exact rational model.

use super::*;
use crate::algorithm::limit::LimitError;
use num_rational::Ratio;
use proptest::prelude::*;

type Q = Ratio<i128>;

/// The reference: the textbook bucket in real numbers (tokens and seconds as
/// exact rationals), written independently of the fixed-point scaling.
#[derive(Debug, Clone)]
struct Reference {
    burst: Q,
    /// tokens per microsecond
    rate: Q,
    tokens: Q,
    last: Option<i128>,
}

#[derive(Debug, PartialEq, Eq)]
struct RefDecision {
    allowed: bool,
    remaining: i128,
    retry_after_us: i128,
    reset_us: i128,
}

fn ceil(q: Q) -> i128 {
    q.ceil().to_integer()
}

impl Reference {
    fn new(burst: u64, rate: u64, period_us: u64) -> Self {
        let burst = Q::from_integer(burst.into());
        Self {
            burst,
            rate: Q::new(rate.into(), period_us.into()),
            tokens: burst,
            last: None,
        }
    }

    fn check(&mut self, cost: u64, now: u64) -> RefDecision {
        let now = i128::from(now);
        let last = self.last.unwrap_or(now);
        let at = now.max(last);
        let before = (self.tokens, self.last);
        self.tokens = (self.tokens + Q::from_integer(at - last) * self.rate).min(self.burst);
        self.last = Some(at);
        let cost = Q::from_integer(cost.into());
        let allowed = self.tokens >= cost;
        let tokens = self.tokens;
        if allowed {
            self.tokens -= cost;
        } else {
            // A denial leaves no trace.
            (self.tokens, self.last) = before;
        }
        let tokens_after = if allowed { self.tokens } else { tokens };
        let wait = |deficit: Q| {
            if deficit <= Q::from_integer(0) {
                0
            } else {
                ceil(deficit / self.rate) + (at - now)
            }
        };
        RefDecision {
            allowed,
            remaining: tokens_after.floor().to_integer(),
            retry_after_us: wait(cost - tokens_after),
            reset_us: wait(self.burst - tokens_after),
        }
    }
}

fn as_ref(d: &Decision) -> RefDecision {
    RefDecision {
        allowed: d.allowed,
        remaining: d.remaining.into(),
        retry_after_us: d.retry_after.as_micros() as i128,
        reset_us: d.reset.as_micros() as i128,
    }
}

/// Applies calls in order to one bucket, returning each decision.
fn run(limit: &Limit, calls: &[(u64, u64)]) -> Vec<(u64, u64, Decision)> {
    let mut state = None;
    calls
        .iter()
        .map(|&(now, cost)| {
            let (d, s) = check(limit, state, cost, now).expect("cost <= burst");
            state = Some(s);
            (now, cost, d)
        })
        .collect()
}

fn limit_strategy() -> impl Strategy<Value = (u64, u64, u64)> {
    // burst, rate, period in microseconds: odd periods and rates that do not
    // divide them are where float implementations drift.
    (
        1u64..=200,
        1u64..=50,
        prop_oneof![
            Just(1_000_000u64),
            Just(60_000_000),
            Just(3_000_000),
            1u64..=5_000_000
        ],
    )
}

/// A sequence of (now, cost): gaps from "same instant" to "long idle", with
/// occasional steps backwards.
fn calls_strategy(burst: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
    let step = prop_oneof![
        6 => 0i64..=2_000,
        3 => 0i64..=2_000_000,
        1 => 0i64..=120_000_000,
        1 => -3_000_000i64..=0,
    ];
    prop::collection::vec((step, 0..=burst.min(5)), 1..300).prop_map(|steps| {
        let mut now: i64 = 1_700_000_000_000_000;
        steps
            .into_iter()
            .map(|(dt, cost)| {
                now += dt;
                (now as u64, cost)
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Arbitrary call spacing gives exactly the rational model's answers.
    #[test]
    fn matches_rational_reference(
        (calls, (burst, rate, period)) in limit_strategy()
            .prop_flat_map(|l| (calls_strategy(l.0), Just(l)))
    ) {
        let limit = Limit::new(burst, rate, Duration::from_micros(period)).unwrap();
        let mut reference = Reference::new(burst, rate, period);
        for (now, cost, d) in run(&limit, &calls) {
            prop_assert_eq!(as_ref(&d), reference.check(cost, now), "at now={} cost={}", now, cost);
        }
    }

    /// Over any interval [t0, t1] (of a non-decreasing clock) the admitted
    /// cost is at most burst + rate × (t1 - t0).
    #[test]
    fn admitted_cost_is_bounded_on_every_interval(
        (calls, (burst, rate, period)) in limit_strategy()
            .prop_flat_map(|l| (calls_strategy(l.0), Just(l)))
    ) {
        let mut calls = calls;
        calls.sort_by_key(|c| c.0);
        let limit = Limit::new(burst, rate, Duration::from_micros(period)).unwrap();
        let admitted: Vec<(u64, u64)> = run(&limit, &calls)
            .into_iter()
            .filter(|(_, _, d)| d.allowed)
            .map(|(t, c, _)| (t, c))
            .collect();
        let rate_q = Q::new(rate.into(), period.into());
        for i in 0..admitted.len() {
            let mut sum = 0u64;
            for j in i..admitted.len() {
                sum += admitted[j].1;
                let span = Q::from_integer((admitted[j].0 - admitted[i].0).into());
                prop_assert!(
                    Q::from_integer(sum.into()) <= Q::from_integer(burst.into()) + rate_q * span,
                    "admitted {} in [{}, {}]", sum, admitted[i].0, admitted[j].0
                );
            }
        }
    }

    /// retry_after is exact: at now + retry_after the same request passes, a
    /// microsecond earlier it does not.
    #[test]
    fn retry_after_is_exact(
        (calls, (burst, rate, period)) in limit_strategy()
            .prop_flat_map(|l| (calls_strategy(l.0), Just(l))),
        probe_cost in 1u64..=5,
    ) {
        let limit = Limit::new(burst, rate, Duration::from_micros(period)).unwrap();
        let probe_cost = probe_cost.min(burst);
        let mut state = None;
        for &(now, cost) in &calls {
            state = Some(check(&limit, state, cost, now).unwrap().1);
        }
        let now = calls.last().unwrap().0;
        let (d, after) = check(&limit, state, probe_cost, now).unwrap();
        // retry_after speaks of the next request of this cost, after this one.
        let wait = d.retry_after.as_micros() as u64;
        prop_assert!(d.allowed || wait > 0, "a denial must ask the client to wait");
        if wait == 0 {
            prop_assert!(check(&limit, Some(after), probe_cost, now).unwrap().0.allowed);
        } else {
            let (early, _) = check(&limit, Some(after), probe_cost, now + wait - 1).unwrap();
            prop_assert!(!early.allowed, "admitted 1us before retry_after");
            let (on_time, _) = check(&limit, Some(after), probe_cost, now + wait).unwrap();
            prop_assert!(on_time.allowed, "denied at retry_after");
        }
    }

    /// A state whose `reset` has elapsed is indistinguishable from no state:
    /// this is what makes evicting idle entries (and Redis TTLs) lossless.
    #[test]
    fn full_again_equals_absent(
        (calls, (burst, rate, period)) in limit_strategy()
            .prop_flat_map(|l| (calls_strategy(l.0), Just(l))),
        extra in 0u64..1_000_000,
        cost in 0u64..=5,
    ) {
        let limit = Limit::new(burst, rate, Duration::from_micros(period)).unwrap();
        let cost = cost.min(burst);
        let mut state = None;
        let mut full_at = 0;
        for &(now, c) in &calls {
            let (d, s) = check(&limit, state, c, now).unwrap();
            state = Some(s);
            full_at = now + d.reset.as_micros() as u64;
        }
        let later = full_at.max(state.unwrap().last) + extra;
        let kept = check(&limit, state, cost, later).unwrap();
        let fresh = check(&limit, None, cost, later).unwrap();
        prop_assert_eq!(kept, fresh);
    }

    /// A ceiling clamps the refilled bucket: the decision is exactly that of
    /// a bucket really holding min(refilled, ceiling), a ceiling at or above
    /// the capacity changes nothing, and it never admits what the uncapped
    /// bucket would refuse.
    #[test]
    fn ceiling_clamps_after_refill_and_never_raises(
        (calls, (burst, rate, period)) in limit_strategy()
            .prop_flat_map(|l| (calls_strategy(l.0), Just(l))),
        percent in 0u64..=110,
        cost in 0u64..=5,
        later in 0u64..5_000_000,
    ) {
        let limit = Limit::new(burst, rate, Duration::from_micros(period)).unwrap();
        let cost = cost.min(burst);
        let mut state = None;
        for &(now, c) in &calls {
            state = Some(check(&limit, state, c, now).unwrap().1);
        }
        let state = state.unwrap();
        let now = calls.last().unwrap().0 + later;
        let cap = limit.capacity_units();
        let ceiling = (u128::from(cap) * u128::from(percent) / 100) as u64;
        let at = now.max(state.last);
        let refilled = (u128::from(state.tokens)
            + u128::from(at - state.last) * u128::from(limit.rate_units_per_us()))
            .min(u128::from(cap)) as u64;
        let clamped = BucketState { tokens: refilled.min(ceiling), last: at };

        let (capped, stored) = check_within(&limit, Some(state), cost, now, ceiling).unwrap();
        let (expected, expected_state) = check(&limit, Some(clamped), cost, now).unwrap();
        prop_assert_eq!(capped, expected);
        if capped.allowed {
            prop_assert_eq!(stored, expected_state);
        } else {
            prop_assert_eq!(stored, state, "a denial stores nothing, ceiling or not");
        }
        let (free, _) = check(&limit, Some(state), cost, now).unwrap();
        prop_assert!(!capped.allowed || free.allowed);
        if ceiling >= cap {
            prop_assert_eq!(capped, free);
        }
    }

    /// A take beyond the cost is the largest whole number of tokens, at most
    /// `extra`, that leaves at most `leave`, else none: granted, it is
    /// exactly a check of the cost plus the grant (same bucket after, same
    /// remaining and reset), with `retry_after` still for the cost alone;
    /// not granted, it is exactly the plain check.
    #[test]
    fn a_take_grants_what_is_there_at_most_its_extra_or_nothing(
        (calls, (burst, rate, period)) in limit_strategy()
            .prop_flat_map(|l| (calls_strategy(l.0), Just(l))),
        cost in 0u64..=5,
        extra in 0u64..=40,
        leave in 0u64..=200,
        percent in prop::option::of(0u64..=110),
        later in 0u64..5_000_000,
    ) {
        let limit = Limit::new(burst, rate, Duration::from_micros(period)).unwrap();
        let cost = cost.min(burst);
        let mut state = None;
        for &(now, c) in &calls {
            state = Some(check(&limit, state, c, now).unwrap().1);
        }
        let now = calls.last().unwrap().0 + later;
        let ceiling = percent.map_or(u64::MAX, |p| limit.capacity_units() / 100 * p);
        let take = TakeUpTo { extra, leave };
        let (taken, stored, granted) =
            check_up_to(&limit, state, cost, now, ceiling, take).unwrap();
        let (plain, plain_state) = check_within(&limit, state, cost, now, ceiling).unwrap();
        // What the plain check leaves, in whole tokens, is what a take can have.
        let whole = plain.remaining;
        let expected = if !plain.allowed || whole.saturating_sub(extra) > leave {
            0
        } else {
            extra.min(whole)
        };
        prop_assert_eq!(granted, expected);
        if granted == 0 {
            prop_assert_eq!((taken, stored), (plain, plain_state));
        } else {
            let (both, both_state) =
                check_within(&limit, state, cost + granted, now, ceiling).unwrap();
            prop_assert!(both.allowed && taken.allowed);
            prop_assert_eq!(stored, both_state);
            prop_assert_eq!(taken.remaining, both.remaining);
            prop_assert!(taken.remaining <= leave);
            prop_assert_eq!(taken.reset, both.reset);
            // The wait until another request of `cost` passes, after the take.
            let wait = taken.retry_after.as_micros() as u64;
            let passes = |at| check(&limit, Some(stored), cost, at).unwrap().0.allowed;
            prop_assert!(passes(now + wait));
            prop_assert!(wait == 0 || !passes(now + wait - 1));
        }
    }

    /// A clock stepping backwards refills nothing and leaves the state as it was.
    #[test]
    fn backwards_clock_refills_nothing(
        tokens_spent in 1u64..=100,
        back in 1u64..10_000_000,
    ) {
        let limit = Limit::per_second(100, 10).unwrap();
        let t0 = 1_000_000_000;
        let mut state = None;
        for _ in 0..tokens_spent {
            state = Some(check(&limit, state, 1, t0).unwrap().1);
        }
        let (d, s) = check(&limit, state, 0, t0 - back).unwrap();
        prop_assert_eq!(d.remaining, 100 - tokens_spent);
        prop_assert_eq!(Some(s), state);
        // And the waits are measured from the real (earlier) now.
        prop_assert_eq!(d.reset.as_micros() as u64, back + tokens_spent * 100_000);
    }
}

#[test]
fn idle_full_bucket_spends_whole_burst_at_once_then_rate() {
    let limit = Limit::per_second(100, 10).unwrap();
    let t0 = 1_700_000_000_000_000;
    let mut state = None;
    for i in 0..100 {
        let (d, s) = check(&limit, state, 1, t0).unwrap();
        assert!(d.allowed, "request {i} of the burst was denied");
        assert_eq!(d.remaining, 99 - i);
        state = Some(s);
    }
    let (d, s) = check(&limit, state, 1, t0).unwrap();
    assert!(!d.allowed);
    assert_eq!(d.retry_after, Duration::from_millis(100));
    assert_eq!(d.reset, Duration::from_secs(10));
    state = Some(s);
    // One second later: exactly 10 more.
    let t1 = t0 + 1_000_000;
    let admitted = (0..20)
        .filter(|_| {
            let (d, s) = check(&limit, state, 1, t1).unwrap();
            state = Some(s);
            d.allowed
        })
        .count();
    assert_eq!(admitted, 10);
}

#[test]
fn no_drift_over_a_million_odd_intervals() {
    // 3 tokens per 7 s: 1 token every 2.333.. s, no finite binary float.
    let limit = Limit::new(1, 3, Duration::from_secs(7)).unwrap();
    let mut state = None;
    let mut now = 0u64;
    let mut admitted = 0u64;
    // Poll every 1 ms for 7000 s: exactly 3000 refills, plus the initial token.
    for _ in 0..7_000_000 {
        let (d, s) = check(&limit, state, 1, now).unwrap();
        admitted += u64::from(d.allowed);
        state = Some(s);
        now += 1_000;
    }
    // The 7,000,000th poll is at t = 6999.999 s: 2999 full refills + 1 initial.
    assert_eq!(admitted, 3000);
}

#[test]
fn cost_larger_than_burst_is_an_error_not_a_wait() {
    let limit = Limit::per_second(5, 1).unwrap();
    assert_eq!(
        check(&limit, None, 6, 0).unwrap_err(),
        CostExceedsBurst { cost: 6, burst: 5 }
    );
    assert!(check(&limit, None, 5, 0).unwrap().0.allowed);
}

#[test]
fn zero_cost_peeks_without_spending() {
    let limit = Limit::per_second(2, 1).unwrap();
    let (d, s) = check(&limit, None, 0, 10).unwrap();
    assert!(d.allowed);
    assert_eq!(d.remaining, 2);
    assert_eq!(s.tokens, limit.capacity_units());
}

#[test]
fn limit_validation_names_the_problem() {
    assert_eq!(Limit::per_second(0, 1), Err(LimitError::ZeroBurst));
    assert_eq!(Limit::per_second(1, 0), Err(LimitError::ZeroRate));
    assert_eq!(
        Limit::new(1, 1, Duration::from_nanos(10)),
        Err(LimitError::ZeroPeriod)
    );
    assert_eq!(
        Limit::new(u64::MAX / 2, 1, Duration::from_secs(1)),
        Err(LimitError::TooLarge)
    );
    // 100/min and 5/3s reduce to the same shape.
    let a = Limit::new(10, 100, Duration::from_secs(60)).unwrap();
    let b = Limit::new(10, 5, Duration::from_secs(3)).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.refill_time(), Duration::from_secs(6));
}

#[test]
fn corrupt_state_cannot_exceed_capacity() {
    let limit = Limit::per_second(3, 1).unwrap();
    let bogus = BucketState {
        tokens: u64::MAX,
        last: 0,
    };
    let (d, s) = check(&limit, Some(bogus), 1, 0).unwrap();
    assert_eq!(d.remaining, 2);
    assert_eq!(s.tokens, 2 * limit.units_per_token());
}
