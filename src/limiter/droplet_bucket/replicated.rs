//! droplet buckets as a cluster replicates them: one [`PeriodCell`] per
//! configured period, each kept under its own key (the cluster's store keeps
//! [`CounterState`](crate::limiter::CounterState)s, which must stay small),
//! and a merge that is idempotent, order-free and never refills a bucket.
//!
//! A bucket's cells are only ever written by its shard's leader, all
//! together, each take that changes the bucket writing every cell with one
//! new *version*: `term << 40 | sequence`, larger than the bucket's last
//! version and than any version an older leader can have written (the
//! shard's Raft term is in the high bits). A replica keeps, of two copies of
//! a cell, the one of the later version, so a reset, a negative count or a
//! changed limit (which legitimately add tokens) replicate as decided, while
//! a copy from before them cannot come back. Of two copies of one version
//! (only possible once a term or a sequence saturates), the emptier one (the
//! later full-again instant) wins: a merge never adds tokens that a version
//! did not add. A period a take stops configuring (a `reset` that does not
//! give it again) is written as a *tombstone* (limit 0) of the new version,
//! which lives as long as the copy it replaces, so no replica brings the
//! period back.
//!
//! Everything here is pure: the store reads and writes the cells, the
//! leader supplies its term and clock (see `cluster::buckets`).

use super::{take, BucketState, PeriodState, TakeOutcome, TakeRequest, PERIOD_COUNT};
use crate::limiter::FullAt;

/// Bits of a version below the term: the per-term sequence.
const SEQUENCE_BITS: u32 = 40;
const SEQUENCE_MAX: u64 = (1 << SEQUENCE_BITS) - 1;
const TERM_MAX: u64 = (1 << (64 - SEQUENCE_BITS)) - 1;

/// One period of a replicated bucket (a tombstone when `limit` is 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeriodCell {
    /// Which write of the bucket this is (see the module doc).
    pub version: u64,
    /// The bucket is forgotten (reads as absent) from this instant on.
    pub forget_at_ms: u64,
    /// When this period is full again: whole milliseconds ...
    pub full_ms: u64,
    /// ... and the fraction `remainder / limit` of the next one.
    pub remainder: u32,
    /// The period's limit; 0: a tombstone (the period is not configured).
    pub limit: u32,
}

impl PeriodCell {
    /// The order a merge keeps the larger of: version, then the emptier
    /// copy, then the rest (a total order, so merging is idempotent,
    /// commutative and associative).
    fn rank(&self) -> (u64, u64, u32, u64, u32) {
        (
            self.version,
            self.full_ms,
            self.remainder,
            self.forget_at_ms,
            self.limit,
        )
    }

    /// Merges a replicated copy: the later version wins, then the emptier.
    pub fn merge(self, other: PeriodCell) -> PeriodCell {
        if other.rank() > self.rank() {
            other
        } else {
            self
        }
    }

    fn full_at(&self) -> FullAt {
        FullAt::from_parts(self.full_ms, u64::from(self.remainder))
    }
}

/// A bucket's cells as read from the store, indexed by period (`None`: no
/// live cell under that period's key).
pub type Cells = [Option<PeriodCell>; PERIOD_COUNT];

/// The bucket that `cells` describe (`None`: absent, or every live cell a
/// tombstone, which answers exactly as absent), and the latest version
/// among them (0 when there is none).
pub fn join(cells: &Cells) -> (Option<BucketState>, u64) {
    let version = cells.iter().flatten().map(|c| c.version).max().unwrap_or(0);
    let mut periods = [PeriodState::default(); PERIOD_COUNT];
    let mut forget_at_ms = 0;
    let mut any = false;
    for (slot, cell) in periods.iter_mut().zip(cells) {
        let Some(cell) = cell.filter(|c| c.limit > 0) else {
            continue;
        };
        any = true;
        *slot = PeriodState {
            limit: cell.limit,
            full_at: cell.full_at(),
        };
        forget_at_ms = forget_at_ms.max(cell.forget_at_ms);
    }
    let state = any.then_some(BucketState {
        periods,
        forget_at_ms,
    });
    (state, version)
}

/// The version of a leader of `term` writing over `previous`.
pub fn next_version(previous: u64, term: u64) -> u64 {
    let floor = term.min(TERM_MAX) << SEQUENCE_BITS | 1;
    let next = if previous & SEQUENCE_MAX == SEQUENCE_MAX {
        previous // saturated: ties are settled by the emptier copy
    } else {
        previous + 1
    };
    next.max(floor)
}

/// The cells to write for `state`, the bucket after a take over `old`: a
/// cell per configured period, a tombstone per period `old` had that
/// `state` no longer configures, all of `version`.
pub fn split(state: &BucketState, old: &Cells, version: u64) -> Cells {
    let mut cells: Cells = [None; PERIOD_COUNT];
    for (index, cell) in cells.iter_mut().enumerate() {
        let period = state.periods[index];
        if period.limit > 0 {
            let (full_ms, remainder) = period.full_at.to_parts();
            *cell = Some(PeriodCell {
                version,
                forget_at_ms: state.forget_at_ms,
                full_ms,
                remainder: u32::try_from(remainder).unwrap_or(u32::MAX),
                limit: period.limit,
            });
        } else if let Some(previous) = old[index] {
            *cell = Some(PeriodCell {
                version,
                forget_at_ms: previous.forget_at_ms.max(state.forget_at_ms),
                full_ms: 0,
                remainder: 0,
                limit: 0,
            });
        }
    }
    cells
}

/// A take on a replicated bucket (SPEC §7, exactly as [`take`]): the answer,
/// and the cells to write when the bucket changed (`None`: nothing to write
/// or replicate, as for most rejected takes).
pub fn take_cells(
    old: &Cells,
    request: &TakeRequest,
    now_ms: u64,
    cleanup_interval_ms: u64,
    term: u64,
) -> (TakeOutcome, Option<Cells>) {
    let (state, version) = join(old);
    let (outcome, new_state) = take(state, request, now_ms, cleanup_interval_ms);
    if state == Some(new_state) {
        return (outcome, None);
    }
    let cells = split(&new_state, old, next_version(version, term));
    (outcome, Some(cells))
}

#[cfg(test)]
mod tests {
    use super::super::{query, Balances, Period};
    use super::*;
    use proptest::prelude::*;

    const T0: u64 = 1_700_000_040_000;
    const CLEANUP_MS: u64 = 60_000;

    fn request(count: i32, reset: bool, limits: [u32; PERIOD_COUNT]) -> TakeRequest {
        TakeRequest {
            count,
            reset,
            limits,
        }
    }

    /// Applies written cells to a replica's copy, by merge (expired cells
    /// read as absent, as in the store).
    fn merge_into(replica: &mut Cells, written: &Cells, now_ms: u64) {
        for (mine, theirs) in replica.iter_mut().zip(written) {
            let Some(theirs) = theirs else { continue };
            let live = mine.filter(|c| c.forget_at_ms > now_ms);
            *mine = Some(match live {
                Some(current) => current.merge(*theirs),
                None => *theirs,
            });
        }
    }

    fn live(cells: &Cells, now_ms: u64) -> Cells {
        cells.map(|c| c.filter(|c| c.forget_at_ms > now_ms))
    }

    #[test]
    fn a_replicated_bucket_answers_as_one_kept_whole() {
        let mut whole: Option<BucketState> = None;
        let mut cells: Cells = [None; PERIOD_COUNT];
        let steps = [
            (0, request(1, false, [10, 100, 0, 0, 0, 0])),
            (10, request(9, false, [10, 0, 0, 0, 0, 0])),
            (20, request(1, false, [10, 0, 0, 0, 0, 0])),
            (30, request(-3, false, [0, 100, 0, 0, 0, 0])),
            (40, request(2, true, [2, 0, 0, 0, 0, 0])),
            (50, request(1, false, [0, 0, 5, 0, 0, 0])),
            (500, request(0, false, [4, 0, 0, 0, 0, 0])),
        ];
        for (term, (at, req)) in steps.into_iter().enumerate() {
            let now = T0 + at;
            let live_whole = whole.filter(|s| s.forget_at_ms() > now);
            let (expected, state) = take(live_whole, &req, now, CLEANUP_MS);
            whole = Some(state);
            let (outcome, written) = take_cells(
                &live(&cells, now),
                &req,
                now,
                CLEANUP_MS,
                term as u64 / 3 + 1,
            );
            assert_eq!(outcome, expected, "step {term}");
            if let Some(written) = written {
                merge_into(&mut cells, &written, now);
            }
            assert_eq!(
                query(join(&live(&cells, now)).0.as_ref(), now),
                query(whole.filter(|s| s.forget_at_ms() > now).as_ref(), now),
                "step {term}"
            );
        }
        // The reset took the minute period away for good.
        let balances = query(join(&live(&cells, T0 + 600)).0.as_ref(), T0 + 600).unwrap();
        assert_eq!(balances.get(Period::Minute), None);
        // Forgotten at the cleanup tick once full, like the bucket kept whole.
        let later = T0 + 20 * CLEANUP_MS;
        assert_eq!(query(join(&live(&cells, later)).0.as_ref(), later), None);
    }

    #[test]
    fn a_stale_copy_never_refills_or_undoes_a_reset() {
        let take10 = request(10, false, [10, 0, 0, 0, 0, 0]);
        let (_, emptied) = take_cells(&[None; PERIOD_COUNT], &take10, T0, CLEANUP_MS, 1);
        let emptied = emptied.unwrap();
        // A stale full copy (an older version) merged after: still empty.
        let (_, full) = take_cells(
            &[None; PERIOD_COUNT],
            &request(0, false, [10, 0, 0, 0, 0, 0]),
            T0,
            CLEANUP_MS,
            1,
        );
        let mut replica = emptied;
        merge_into(&mut replica, &full.unwrap(), T0);
        assert_eq!(replica, emptied);
        // A reset by a later leader wins over the emptied copy, in any order.
        let (_, reset) = take_cells(
            &emptied,
            &request(1, true, [10, 0, 0, 0, 0, 0]),
            T0 + 1,
            CLEANUP_MS,
            2,
        );
        let reset = reset.unwrap();
        let mut a = emptied;
        merge_into(&mut a, &reset, T0 + 1);
        let mut b = reset;
        merge_into(&mut b, &emptied, T0 + 1);
        assert_eq!(a, b);
        assert_eq!(
            query(join(&a).0.as_ref(), T0 + 1),
            Some(Balances([Some(9), None, None, None, None, None]))
        );
    }

    #[test]
    fn versions_grow_within_and_across_terms() {
        assert_eq!(next_version(0, 1), 1 << SEQUENCE_BITS | 1);
        let v = next_version(1 << SEQUENCE_BITS | 1, 1);
        assert_eq!(v, 1 << SEQUENCE_BITS | 2);
        assert!(next_version(v, 2) > v);
        assert_eq!(next_version(v, 2), 2 << SEQUENCE_BITS | 1);
        // A huge term saturates instead of overflowing.
        assert!(next_version(v, u64::MAX) > v);
        let top = next_version(0, u64::MAX) | SEQUENCE_MAX;
        assert_eq!(next_version(top, u64::MAX), top);
    }

    #[test]
    fn a_rejected_take_writes_nothing() {
        let req = request(5, false, [4, 0, 0, 0, 0, 0]);
        let (_, first) = take_cells(
            &[None; PERIOD_COUNT],
            &request(4, false, [4, 0, 0, 0, 0, 0]),
            T0,
            CLEANUP_MS,
            1,
        );
        let cells = first.unwrap();
        let (outcome, written) = take_cells(&cells, &req, T0 + 1, CLEANUP_MS, 1);
        assert!(!outcome.accept);
        assert_eq!(written, None);
    }

    fn cell() -> impl Strategy<Value = PeriodCell> {
        (0u64..4, 0u64..4, 0u32..3, 0u64..4, 0u32..3).prop_map(
            |(version, full_ms, remainder, forget_at_ms, limit)| PeriodCell {
                version,
                forget_at_ms,
                full_ms,
                remainder,
                limit,
            },
        )
    }

    proptest! {
        #[test]
        fn merge_is_idempotent_commutative_associative(a in cell(), b in cell(), c in cell()) {
            prop_assert_eq!(a.merge(a), a);
            prop_assert_eq!(a.merge(b), b.merge(a));
            prop_assert_eq!(a.merge(b).merge(c), a.merge(b.merge(c)));
            // Of one version, never the fuller copy.
            let m = a.merge(b);
            if a.version == b.version {
                prop_assert!(m.full_at() >= a.full_at() && m.full_at() >= b.full_at());
            }
        }
    }
}
