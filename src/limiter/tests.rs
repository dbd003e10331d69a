//! Fixed-window tests with exact times, and a property test against a naive
//! model that remembers every admitted hit.

use super::*;
use proptest::prelude::*;

use crate::limiter::test_support::ok;

fn run(state: &mut Option<CounterState>, quota: WindowQuota, now_ms: u64) -> Decision {
    crate::limiter::test_support::step(fixed_window_hit, state, quota, now_ms)
}

#[test]
fn window_opens_counts_down_denies_and_reopens() {
    let quota = WindowQuota::new(3, 3600).unwrap();
    let mut state = None;
    let t0 = 1_000_000;
    assert_eq!(run(&mut state, quota, t0), ok(true, 2, 3600));
    assert_eq!(run(&mut state, quota, t0 + 1_000), ok(true, 1, 3599));
    assert_eq!(run(&mut state, quota, t0 + 2_000), ok(true, 0, 3598));
    assert_eq!(run(&mut state, quota, t0 + 3_000), ok(false, 0, 3597));
    // Denied hits change nothing, and later hits never extend the window.
    assert_eq!(
        state,
        Some(CounterState::Window {
            end_ms: t0 + 3_600_000,
            used: 3
        })
    );
    assert_eq!(run(&mut state, quota, t0 + 3_599_999), ok(false, 0, 0));
    // At the end of the window the next hit opens a new one.
    assert_eq!(run(&mut state, quota, t0 + 3_600_000), ok(true, 2, 3600));
}

#[test]
fn next_reset_rounds_half_up_from_milliseconds() {
    let quota = WindowQuota::new(100, 2).unwrap();
    let mut state = None;
    assert_eq!(run(&mut state, quota, 0).next_reset_seconds, 2);
    assert_eq!(run(&mut state, quota, 300).next_reset_seconds, 2);
    assert_eq!(run(&mut state, quota, 610).next_reset_seconds, 1);
    assert_eq!(run(&mut state, quota, 1_499).next_reset_seconds, 1);
    assert_eq!(run(&mut state, quota, 1_500).next_reset_seconds, 1);
    assert_eq!(run(&mut state, quota, 1_510).next_reset_seconds, 0);
    assert_eq!(round_ms_to_seconds(500), 1);
    assert_eq!(round_ms_to_seconds(499), 0);
}

#[test]
fn zero_limits_are_not_window_quotas() {
    assert!(WindowQuota::new(0, 60).is_none());
    assert!(WindowQuota::new(5, 0).is_none());
    assert_eq!(Decision::ALWAYS_DENY, ok(false, 0, -1));
    assert_eq!(Decision::always_allow(7), ok(true, 7, 0));
}

#[test]
fn merge_is_idempotent_commutative_and_keeps_the_later_window() {
    let a = CounterState::Window {
        end_ms: 10,
        used: 3,
    };
    let b = CounterState::Window {
        end_ms: 10,
        used: 5,
    };
    let c = CounterState::Window {
        end_ms: 20,
        used: 1,
    };
    assert_eq!(a.merge(b), b);
    assert_eq!(b.merge(a), b);
    assert_eq!(a.merge(a), a);
    assert_eq!(b.merge(c), c);
    assert_eq!(c.merge(b), c);
}

proptest! {
    /// Against a naive model: within every window (opened by the first hit
    /// after the previous one ended) exactly min(hits, limit) are admitted, and
    /// the credit reported is the limit minus those admitted so far.
    #[test]
    fn matches_naive_model(limit in 1u64..8, period_s in 1u64..5, gaps in proptest::collection::vec(0u64..2_500, 1..60)) {
        let quota = WindowQuota::new(limit, period_s).unwrap();
        let mut state = None;
        let mut now = 5_000u64;
        let mut window_start: Option<u64> = None;
        let mut admitted_in_window = 0u64;
        for gap in gaps {
            now += gap;
            let decision = run(&mut state, quota, now);
            if window_start.is_none_or(|start| now >= start + period_s * 1000) {
                window_start = Some(now);
                admitted_in_window = 0;
            }
            let start = window_start.unwrap();
            let expected_allowed = admitted_in_window < limit;
            if expected_allowed {
                admitted_in_window += 1;
            }
            prop_assert_eq!(decision.allowed, expected_allowed);
            prop_assert_eq!(decision.credit, (limit - admitted_in_window) as i64);
            let ms_left = start + period_s * 1000 - now;
            prop_assert_eq!(decision.next_reset_seconds, ((ms_left + 500) / 1000) as i64);
        }
    }
}

fn any_counter_state() -> impl Strategy<Value = CounterState> {
    // Small ranges so that equal windows and instants (the tie cases) are common.
    prop_oneof![
        (0u64..4, 0u64..4).prop_map(|(end_ms, used)| CounterState::Window { end_ms, used }),
        (0u64..4, 0u64..3).prop_map(|(ms, shortfall)| {
            let rate = Refill::new(3, 10).unwrap();
            CounterState::TokenBucket {
                full_at: FullAt::from_shortfall(rate, ms, i128::from(shortfall)),
            }
        }),
        (0u64..4, 0u64..4, 0u64..4).prop_map(|(expires_at_ms, current, previous)| {
            CounterState::SlidingWindow {
                expires_at_ms,
                current,
                previous,
            }
        }),
    ]
}

proptest! {
    /// Replication applies merged states in any order, any number of times.
    #[test]
    fn merge_is_idempotent_commutative_and_associative_for_every_algorithm(
        a in any_counter_state(),
        b in any_counter_state(),
        c in any_counter_state(),
    ) {
        prop_assert_eq!(a.merge(a), a);
        prop_assert_eq!(a.merge(b), b.merge(a));
        prop_assert_eq!(a.merge(b).merge(c), a.merge(b.merge(c)));
    }
}

#[test]
fn merge_keeps_the_emptier_token_bucket_and_the_later_sliding_window() {
    let rate = Refill::new(10, 1_000).unwrap();
    let fuller = CounterState::TokenBucket {
        full_at: FullAt::from_shortfall(rate, 100, 1_000),
    };
    let emptier = CounterState::TokenBucket {
        full_at: FullAt::from_shortfall(rate, 100, 5_000),
    };
    assert_eq!(fuller.merge(emptier), emptier);
    assert_eq!(emptier.merge(fuller), emptier);
    let old = CounterState::SlidingWindow {
        expires_at_ms: 2_000,
        current: 9,
        previous: 0,
    };
    let new = CounterState::SlidingWindow {
        expires_at_ms: 3_000,
        current: 1,
        previous: 9,
    };
    let same_window = CounterState::SlidingWindow {
        expires_at_ms: 3_000,
        current: 4,
        previous: 7,
    };
    assert_eq!(old.merge(new), new);
    assert_eq!(
        new.merge(same_window),
        CounterState::SlidingWindow {
            expires_at_ms: 3_000,
            current: 4,
            previous: 9,
        }
    );
}
