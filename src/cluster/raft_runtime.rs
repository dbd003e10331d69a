//! The async runtime the shard groups' openraft instances run on: tokio's,
//! except for one thing. openraft 0.9 starts a tick loop per group that
//! wakes every 1.5 heartbeat intervals (300 ms by default) even though
//! Tollgate turns ticks off (groups run no election timers and send no
//! heartbeats: `leadership.rs`). Each loop keeps its own phase, so a node's
//! 64 groups woke its thread up to ~200 times a second for nothing, about a
//! third of an idle cluster's CPU (docs/benchmarks.md, "Twelfth round").
//!
//! The loop is openraft's only caller of [`AsyncRuntime::sleep_until`]
//! (its other waits use `sleep` and `timeout`, which are tokio's
//! unchanged), so that is where the runtime differs: a deadline is moved up
//! to the next multiple of [`TICK_GRID_MS`] on the node's cadence grid
//! (`cadence.rs`). Every group's loop then wakes at the same instants, once
//! per grid step, in one turn of the thread, and with the node's other
//! periodic work. Were ticks ever turned on, a tick would come up to one
//! grid step late.

use openraft::async_runtime::TokioOneShotSender;
use openraft::{AsyncRuntime, OptionalSend, TokioRuntime};
use std::future::Future;
use std::time::Duration;

/// The step of the grid openraft's tick-loop deadlines are rounded up to.
pub const TICK_GRID_MS: u64 = 1_000;

/// tokio, with tick deadlines on a shared grid (see the module doc).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct GroupRuntime;

impl AsyncRuntime for GroupRuntime {
    type JoinError = <TokioRuntime as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <TokioRuntime as AsyncRuntime>::JoinHandle<T>;
    type Sleep = <TokioRuntime as AsyncRuntime>::Sleep;
    type Instant = <TokioRuntime as AsyncRuntime>::Instant;
    type TimeoutError = <TokioRuntime as AsyncRuntime>::TimeoutError;
    type Timeout<R, T: Future<Output = R> + OptionalSend> =
        <TokioRuntime as AsyncRuntime>::Timeout<R, T>;
    type ThreadLocalRng = <TokioRuntime as AsyncRuntime>::ThreadLocalRng;
    type OneshotSender<T: OptionalSend> = TokioOneShotSender<T>;
    type OneshotReceiver<T: OptionalSend> = <TokioRuntime as AsyncRuntime>::OneshotReceiver<T>;
    type OneshotReceiverError = <TokioRuntime as AsyncRuntime>::OneshotReceiverError;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        TokioRuntime::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        TokioRuntime::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        TokioRuntime::sleep_until(super::cadence::on_grid(
            deadline,
            Duration::from_millis(TICK_GRID_MS),
        ))
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        TokioRuntime::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        TokioRuntime::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        TokioRuntime::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        TokioRuntime::thread_rng()
    }

    fn oneshot<T>() -> (Self::OneshotSender<T>, Self::OneshotReceiver<T>)
    where
        T: OptionalSend,
    {
        TokioRuntime::oneshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::TokioInstant;

    #[tokio::test]
    async fn a_tick_deadline_sleeps_to_the_cadence_grid_other_waits_do_not() {
        let grid = Duration::from_millis(TICK_GRID_MS);
        let deadline = TokioInstant::now() + Duration::from_millis(30);
        // openraft's tick loop sleeps until a deadline: it ends on the grid
        // (where `cadence::on_grid` puts it, give or take the clock reads
        // placing each), never before the deadline, within a step of it.
        let ends = GroupRuntime::sleep_until(deadline).deadline();
        let aligned = super::super::cadence::on_grid(deadline, grid);
        let apart = ends.max(aligned) - ends.min(aligned);
        assert!(apart <= Duration::from_millis(30), "{apart:?}");
        assert!(ends >= deadline && ends < deadline + grid);
        // Sleeps for a duration are tokio's own.
        let before = TokioInstant::now();
        let plain = GroupRuntime::sleep(Duration::from_millis(30)).deadline();
        let after = TokioInstant::now();
        assert!(plain >= before + Duration::from_millis(30));
        assert!(plain <= after + Duration::from_millis(30));
    }
}
