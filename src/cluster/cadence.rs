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

/// Lets every task already woken on this thread run before the caller
/// goes on: the caller goes to the back of the run queue. Unlike
/// `tokio::task::yield_now`, which waits for the next poll of the I/O
/// driver (on a node thread, one `epoll_wait` per peer write: 0.02 per hit
/// in fast mode, docs/benchmarks.md, "Sixteenth round"), this polls
/// nothing: the tasks that the caller's own wake-up came with (frame
/// readers, connections deciding their read batches) add to what it is
/// about to send, and new input waits for the queue to drain as it would
/// anyway.
pub fn behind_woken_tasks() -> impl std::future::Future<Output = ()> {
    let mut requeued = false;
    std::future::poll_fn(move |cx| {
        if requeued {
            return std::task::Poll::Ready(());
        }
        requeued = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
}

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

    /// How far past a multiple of `step` the wall clock is at `at` (`at`
    /// is placed on the wall clock with a fresh pair of clock reads).
    fn past_grid_at(at: Instant, step: Duration) -> Duration {
        let now = Instant::now();
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let wall_at = if at >= now {
            wall + (at - now)
        } else {
            wall - (now - at)
        };
        Duration::from_nanos((wall_at.as_nanos() % step.as_nanos()) as u64)
    }

    /// Within `slack` of the grid, on either side: the two clock reads
    /// that place an instant on the wall clock may be a preemption apart
    /// on a loaded machine.
    fn near_grid(at: Instant, step: Duration, slack: Duration) -> bool {
        let past = past_grid_at(at, step);
        past <= slack || step - past <= slack
    }

    const SLACK: Duration = Duration::from_millis(30);

    #[test]
    fn deadlines_move_up_to_the_next_multiple_of_the_step_never_down() {
        let step = Duration::from_millis(1000);
        for ahead_ms in [1, 37, 999, 1000, 1001, 2500, 9999] {
            let at = Instant::now() + Duration::from_millis(ahead_ms);
            let aligned = on_grid(at, step);
            assert!(aligned >= at, "{ahead_ms}");
            assert!(aligned < at + step, "{ahead_ms}");
            assert!(near_grid(aligned, step, SLACK), "{ahead_ms}");
        }
        let past = Instant::now() - Duration::from_millis(5);
        assert_eq!(on_grid(past, step), past);
        let at = Instant::now() + Duration::from_millis(10);
        assert_eq!(on_grid(at, Duration::ZERO), at);
    }

    #[tokio::test]
    async fn two_timers_of_one_period_tick_together_on_the_grid() {
        let period = Duration::from_millis(200);
        let mut first = interval(period);
        tokio::time::sleep(Duration::from_millis(70)).await;
        let mut second = interval(period);
        let (a1, a2) = (first.tick().await, first.tick().await);
        let b = second.tick().await;
        // The second timer, made 70 ms later, ticks on the first's grid: a
        // whole number of periods from its ticks (a tick the test thread
        // was too late for is skipped, not made up).
        let off = |x: Instant, y: Instant| {
            let apart = (x.max(y) - x.min(y)).as_nanos() % period.as_nanos();
            Duration::from_nanos(apart.min(period.as_nanos() - apart) as u64)
        };
        assert!(off(a1, b) <= SLACK, "{:?}", off(a1, b));
        assert!(near_grid(a2, period, SLACK));
        // Ticks stay a whole number of periods apart.
        assert!(a2 > a1 && off(a1, a2).is_zero());
    }
}
