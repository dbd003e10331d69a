//! The `sliding-window` rule algorithm: the two-window estimate that
//! Cloudflare describes. Time is cut into windows of `resetSeconds`, aligned
//! on the epoch; the rate over the last `resetSeconds` is estimated as
//! `previous × (1 − elapsed / window) + current`, where `previous` counts the
//! hits admitted in the window before the current one and `elapsed` is how far
//! into the current window we are. A hit is admitted when the estimate with it
//! stays within `creditLimit`. This smooths the fixed window's edge, where a
//! client could pass twice the limit across a window boundary, for the price
//! of three numbers per counter.

use super::{clamp_i64, round_ms_to_seconds, CounterState, Decision, WindowQuota};

/// One hit of a rule with `algorithm = sliding-window`.
///
/// - `currentCredit`: how many more hits the estimate admits right now,
///   rounded down (0 when denied). It grows back as the previous window's
///   weight fades.
/// - `nextResetSeconds`: seconds until the current window ends (rounded half
///   up, as for the fixed window), when its hits start fading out.
///
/// Denied hits change nothing. The state expires two windows after the window
/// it counts in, when neither of its counts can weigh any more.
pub fn sliding_window_hit(
    state: Option<CounterState>,
    quota: WindowQuota,
    now_ms: u64,
) -> (Decision, Option<CounterState>) {
    let period_ms = quota.period_ms();
    let aligned_start = now_ms - now_ms % period_ms;
    let (window_start_ms, current, previous) = match state {
        Some(CounterState::SlidingWindow {
            expires_at_ms,
            current,
            previous,
        }) => {
            let window_start_ms = expires_at_ms.saturating_sub(period_ms.saturating_mul(2));
            if window_start_ms >= aligned_start {
                // Same window (or the clock stepped back: keep counting in it).
                (window_start_ms, current, previous)
            } else if window_start_ms.saturating_add(period_ms) == aligned_start {
                (aligned_start, 0, current)
            } else {
                (aligned_start, 0, 0)
            }
        }
        _ => (aligned_start, 0, 0),
    };
    let window_end_ms = window_start_ms.saturating_add(period_ms);
    let elapsed_ms = now_ms.saturating_sub(window_start_ms).min(period_ms);
    // Everything in hits × period_ms, so the estimate is exact.
    let period = u128::from(period_ms);
    let capacity = u128::from(quota.credit_limit()) * period;
    let estimate =
        u128::from(previous) * (period - u128::from(elapsed_ms)) + u128::from(current) * period;
    let next_reset_seconds = round_ms_to_seconds(window_end_ms.saturating_sub(now_ms));
    let after = estimate + period;
    if after <= capacity {
        let decision = Decision {
            allowed: true,
            credit: clamp_i64(u64::try_from((capacity - after) / period).unwrap_or(u64::MAX)),
            next_reset_seconds,
        };
        let state = CounterState::SlidingWindow {
            expires_at_ms: window_end_ms.saturating_add(period_ms),
            current: current + 1,
            previous,
        };
        (decision, Some(state))
    } else {
        let decision = Decision {
            allowed: false,
            credit: 0,
            next_reset_seconds,
        };
        (decision, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::limiter::test_support::ok;

    fn run(state: &mut Option<CounterState>, quota: WindowQuota, now_ms: u64) -> Decision {
        crate::limiter::test_support::step(sliding_window_hit, state, quota, now_ms)
    }

    #[test]
    fn previous_window_weighs_in_and_fades_linearly() {
        // 10 per 10 s, windows aligned on multiples of 10 s.
        let quota = WindowQuota::new(10, 10).unwrap();
        let mut state = None;
        let w = 1_700_000_000_000; // a window start
        for i in 0..10 {
            assert_eq!(run(&mut state, quota, w + 5_000), ok(true, 9 - i, 5));
        }
        assert_eq!(run(&mut state, quota, w + 9_000), ok(false, 0, 1));
        // New window, 10% in: the previous 10 weigh 9; one more fits.
        assert_eq!(run(&mut state, quota, w + 11_000), ok(true, 0, 9));
        assert_eq!(run(&mut state, quota, w + 11_000), ok(false, 0, 9));
        // 50% in: previous weighs 5, current holds 1: four more fit.
        assert_eq!(run(&mut state, quota, w + 15_000), ok(true, 3, 5));
        // Two windows later both counts are gone.
        assert_eq!(run(&mut state, quota, w + 30_000), ok(true, 9, 10));
    }

    #[test]
    fn state_expires_two_windows_after_its_window() {
        let quota = WindowQuota::new(5, 1).unwrap();
        let (_, state) = sliding_window_hit(None, quota, 12_345);
        assert_eq!(state.unwrap().expires_at_ms(), 14_000);
    }

    #[test]
    fn the_fixed_window_boundary_burst_is_refused() {
        // A fixed window of 4 per second admits 4 at 0.9 s and 4 more at
        // 1.0 s; the sliding estimate admits none at 1.0 s and lets the
        // previous window's hits fade out over the next second.
        let quota = WindowQuota::new(4, 1).unwrap();
        let mut state = None;
        let w = 1_000_000;
        for _ in 0..4 {
            assert!(run(&mut state, quota, w + 900).allowed);
        }
        assert!(!run(&mut state, quota, w + 1_000).allowed);
        assert!(!run(&mut state, quota, w + 1_249).allowed);
        assert_eq!(run(&mut state, quota, w + 1_250), ok(true, 0, 1));
        assert!(!run(&mut state, quota, w + 1_250).allowed);
    }
}
