//! When a node's periodic work wakes it: on a grid shared by every timer of
//! the node and by every node whose clock agrees (the wall clock's
//! multiples of the period), so that the election watcher, the link beats,
//! the peer polls, the rebalancer and openraft's tick loops wake a node
//! together rather than each at its own phase, and a peer's beat or poll
//! tends to arrive while its receiver is awake for its own. On an idle
//! cluster the wake-ups, not the work done in them, were most of the CPU
//! (docs/benchmarks.md, "Twelfth round").
//!
//! Aligning changes when a timer fires, never how often: a period stays the
//! period, and the first tick comes within one period.

use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::{Instant, Interval, MissedTickBehavior};

/// How far past the last multiple of `period` the wall clock is.
fn past_grid(period: Duration) -> Duration {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let period_ns = period.as_nanos().max(1);
    let into = since_epoch.as_nanos() % period_ns;
    Duration::from_nanos(u64::try_from(into).unwrap_or(0))
}

/// The first instant at or after `at` that falls on a multiple of `step`
/// of the wall clock (`at` itself when it is in the past).
pub fn on_grid(at: Instant, step: Duration) -> Instant {
    let now = Instant::now();
    if at <= now || step.is_zero() {
        return at;
    }
    // The wall clock at `at`, then up to the grid.
    let ahead = at - now;
    let into = (past_grid(step) + ahead).as_nanos() % step.as_nanos();
    if into == 0 {
        return at;
    }
    at + Duration::from_nanos(u64::try_from(step.as_nanos() - into).unwrap_or(0))
}

/// A timer ticking every `period` on the grid (see the module doc): its
/// first tick is the next multiple of `period`; a tick missed while the
/// thread was busy is skipped, not made up, so the ticks stay on the grid.
pub fn interval(period: Duration) -> Interval {
    let period = period.max(Duration::from_millis(1));
    let wait = period - past_grid(period);
    let mut interval = tokio::time::interval_at(Instant::now() + wait, period);
    interval.set_missed_tick_behavior(MissedTickBehavior::Skip);
    interval
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wall_ms_at(at: Instant) -> u128 {
        let now = Instant::now();
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        if at >= now {
            (wall + (at - now)).as_millis()
        } else {
            (wall - (now - at)).as_millis()
        }
    }

    #[test]
    fn deadlines_move_up_to_the_next_multiple_of_the_step_never_down() {
        let step = Duration::from_millis(100);
        for ahead_ms in [1, 37, 99, 100, 101, 250, 999] {
            let at = Instant::now() + Duration::from_millis(ahead_ms);
            let aligned = on_grid(at, step);
            assert!(aligned >= at, "{ahead_ms}");
            assert!(aligned < at + step, "{ahead_ms}");
            // On the grid, give or take the clock reads between the two
            // computations.
            let into = wall_ms_at(aligned) % 100;
            assert!(
                into <= 2 || into >= 98,
                "{ahead_ms}: {into} ms past the grid"
            );
        }
        let past = Instant::now() - Duration::from_millis(5);
        assert_eq!(on_grid(past, step), past);
        let at = Instant::now() + Duration::from_millis(10);
        assert_eq!(on_grid(at, Duration::ZERO), at);
    }

    #[tokio::test]
    async fn two_timers_of_one_period_tick_together_on_the_grid() {
        let period = Duration::from_millis(40);
        let mut first = interval(period);
        tokio::time::sleep(Duration::from_millis(13)).await;
        let mut second = interval(period);
        let (a1, a2) = (first.tick().await, first.tick().await);
        let b = second.tick().await;
        // The second timer, made 13 ms later, ticks on one of the first's
        // instants (give or take the clock reads that placed each).
        let apart = |x: Instant, y: Instant| x.max(y) - x.min(y);
        let nearest = apart(a1, b).min(apart(a2, b));
        assert!(nearest < Duration::from_millis(2), "{nearest:?}");
        let into = wall_ms_at(a2) % 40;
        assert!(into <= 2 || into >= 38, "{into} ms past the grid");
    }
}
