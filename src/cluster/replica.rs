//! One shard's replica on this node: its Raft group (leadership and
//! membership only), the *fence* that keeps a deposed leader's counter
//! states out, and, while this node leads the shard, the commit rule.
//!
//! Counter states reach replicas outside the Raft log (see `dataplane.rs`),
//! so safety rests on two rules, those of a Paxos prepare:
//! - A replica applies states stamped with term `t` only while its fence is
//!   at most `t` (and raises it to `t`); a new leader of term `t` first makes
//!   a majority of the voters *promise* `t` (raise their fences), collecting
//!   the counters each holds. Any state acknowledged by a majority under an
//!   older term is then in the collection (two majorities share a replica,
//!   which either applied it before promising, or refused it after).
//! - A leader decides only while its own fence equals the term it prepared
//!   for, read before and again after the decision's store update: a
//!   promise raises the fence and only then scans the store, one stripe
//!   lock at a time, so either its scan sees the update (the stripe lock
//!   orders the scan after it), or the second read sees the raised fence and
//!   the decision is refused (its count stays in this store only, which can
//!   only under-admit). Applying a follower's states is checked the same
//!   way. No lock is taken for this: two atomic loads per decision.
//! - With a data dir, a promise is written there before it is given, so a
//!   fence never goes backwards across a restart. A fence raised by
//!   applying a round is not written: safety needs only the promises (a
//!   majority that promised `t` refuses older terms, and any majority of
//!   an older leader's acks would need one of them).

use super::disk::meta::MetaRecord;
use super::storage::{ShardDisk, TollgateRaft};
use super::wire::{ApplyRefusal, ShardRefusal};
use super::NodeId;
use crate::limiter::{CounterState, Decision, WindowQuota};
use crate::store::{algorithm_hit, MemoryStore, StoreFull};
use arc_swap::ArcSwap;
use openraft::raft::VoteRequest;
use openraft::{LogId, Raft};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::data_frames::OpView;

/// What a replica that restarted empty must reach before it votes and
/// stands for election again (learned from its peers when it joined).
#[derive(Debug, Clone, Copy)]
pub struct Recovery {
    /// The highest Raft log id any peer had applied (so it is committed).
    pub applied_floor: Option<LogId<NodeId>>,
    /// The highest term any peer reported.
    pub term_floor: u64,
}

/// While this node leads a shard: who must acknowledge a state before it
/// counts as committed, and who receives the shard's rounds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardConfig {
    /// One voter set, or two during a joint membership change (or while a
    /// move's new replicas catch up): a state is committed once a majority
    /// of every set holds it.
    pub voter_sets: SmallVec<[Vec<NodeId>; 2]>,
    /// Every other node that receives the shard's states (voters, learners,
    /// replicas joining in a move).
    pub targets: Vec<NodeId>,
}

impl ShardConfig {
    /// Is a state held by `holders` (and by `me`) on a majority of every
    /// voter set?
    pub fn committed(&self, me: NodeId, holders: &[NodeId]) -> bool {
        !self.voter_sets.is_empty()
            && self.voter_sets.iter().all(|set| {
                let held = set
                    .iter()
                    .filter(|&&n| n == me || holders.contains(&n))
                    .count();
                held * 2 > set.len()
            })
    }

    /// Can a state still be committed when `refusers` will never hold it?
    pub fn committable(&self, refusers: &[NodeId]) -> bool {
        self.voter_sets.iter().all(|set| {
            let left = set.iter().filter(|n| !refusers.contains(n)).count();
            left * 2 > set.len()
        })
    }
}

/// One hit decided on this replica, as its leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalDecision {
    /// Decided under `term`; `changed` is the counter's new state when the
    /// hit changed it (then it must be replicated, and in strict mode
    /// committed, before the answer goes out).
    Decided {
        decision: Decision,
        changed: Option<CounterState>,
        term: u64,
    },
    /// The node's live-key cap was reached.
    Full(StoreFull),
    /// Not decided, not counted: the hit may go to the shard's leader.
    Refused(ShardRefusal),
    /// Not decided: the op itself is wrong (never retried).
    Invalid(ShardRefusal),
}

pub struct Replica {
    pub shard: u32,
    pub raft: Raft<TollgateRaft>,
    /// The highest term promised or applied from.
    fence: AtomicU64,
    /// The term this node leads the shard in and may decide for (prepared:
    /// leadership confirmed, counters collected); 0 when it may not.
    ready_term: AtomicU64,
    /// Set while this leader hands leadership over: hits are turned away
    /// (to be sent again) rather than decided.
    pub handing_over: AtomicBool,
    /// Fast mode: a round was not committed in time; the leader confirms
    /// its leadership again before deciding more.
    pub replication_failed: AtomicBool,
    /// The commit rule while this node leads.
    config: ArcSwap<ShardConfig>,
    recovery: Mutex<Option<Recovery>>,
    /// What a move of this shard (led here) is doing, for `cluster status`.
    pub moving: Mutex<Option<String>>,
    /// Nodes joining the shard in a move: they receive its states and count
    /// in a second voter set until the move ends (see `moves.rs`).
    joining: Mutex<Option<Vec<NodeId>>>,
    /// Wakes the shard's leadership task (a round failed, a newer leader
    /// was seen): it prepares again or steps aside.
    pub kick: tokio::sync::Notify,
    /// When this node last sent the group's voters a Raft message as its
    /// leader (they refuse other candidates for a lease after it).
    confirmed_at: Mutex<std::time::Instant>,
    /// The data dir, where every promise is written before it is given
    /// (a fence must never go backwards across a restart).
    disk: Option<ShardDisk>,
    /// What this node replicated for the shard as its leader (`/metrics`).
    pub stats: ShardStats,
}

/// One shard's replication counters on its leader, for the per-shard
/// series on `/metrics`.
#[derive(Debug, Default)]
pub struct ShardStats {
    /// Round sections sent (one per round the shard had states in).
    pub sections_sent: AtomicU64,
    /// Counter states those sections carried.
    pub states_sent: AtomicU64,
    /// Sections that ended: committed, or failed (superseded, unreachable
    /// replicas, timed out). Sent minus ended is what awaits its commit.
    pub sections_ended: AtomicU64,
}

impl Replica {
    pub fn new(shard: u32, raft: Raft<TollgateRaft>) -> Replica {
        Replica {
            shard,
            raft,
            fence: AtomicU64::new(0),
            ready_term: AtomicU64::new(0),
            handing_over: AtomicBool::new(false),
            replication_failed: AtomicBool::new(false),
            config: ArcSwap::default(),
            recovery: Mutex::new(None),
            moving: Mutex::new(None),
            joining: Mutex::new(None),
            kick: tokio::sync::Notify::new(),
            confirmed_at: Mutex::new(std::time::Instant::now()),
            disk: None,
            stats: ShardStats::default(),
        }
    }

    /// A replica whose promises are written to `disk`, starting from the
    /// fence it holds.
    pub fn with_disk(mut self, fence: u64, disk: ShardDisk) -> Replica {
        self.fence = AtomicU64::new(fence);
        self.disk = Some(disk);
        self
    }

    /// The term this node may decide for, if it leads and is prepared.
    pub fn ready_term(&self) -> Option<u64> {
        match self.ready_term.load(Ordering::Acquire) {
            0 => None,
            term => Some(term),
        }
    }

    pub fn fence(&self) -> u64 {
        self.fence.load(Ordering::Acquire)
    }

    /// Lets this node decide for `term` (it leads, and has collected the
    /// counters of a majority that promised `term`). Refused when a newer
    /// term was promised meanwhile.
    pub fn set_ready(&self, term: u64) -> bool {
        if self.fence.load(Ordering::Acquire) != term {
            return false;
        }
        self.replication_failed.store(false, Ordering::Release);
        self.ready_term.store(term, Ordering::Release);
        true
    }

    /// Stops deciding (leadership lost, handing over, a round failed).
    pub fn unready(&self) {
        self.ready_term.store(0, Ordering::Release);
    }

    /// Promises `term`: refuses states of older terms from now on. Called by
    /// a new leader on itself and, through `Collect`, on the other voters.
    pub fn promise(&self, term: u64) -> Result<(), ApplyRefusal> {
        let fence = self.fence.fetch_max(term, Ordering::AcqRel);
        if fence > term {
            return Err(ApplyRefusal::Fenced { term: fence });
        }
        if fence < term {
            if let Some(disk) = &self.disk {
                if let Err(error) = disk.disk.meta_append(MetaRecord::Fence {
                    shard: self.shard,
                    term,
                }) {
                    tracing::error!(
                        shard = self.shard,
                        term,
                        file = %disk.disk.meta_path().display(),
                        %error,
                        "cannot write a promise to the data dir; it holds in memory only"
                    );
                }
            }
        }
        if self.ready_term.load(Ordering::Acquire) != term {
            self.ready_term.store(0, Ordering::Release);
        }
        Ok(())
    }

    pub fn config(&self) -> Arc<ShardConfig> {
        self.config.load_full()
    }

    pub fn set_config(&self, config: ShardConfig) {
        if *self.config.load_full() != config {
            self.config.store(Arc::new(config));
        }
    }

    /// Nodes joining the shard in a move led here (see [`ShardConfig`]).
    pub fn joining(&self) -> Option<Vec<NodeId>> {
        self.joining.lock().clone()
    }

    pub fn set_joining(&self, joining: Option<Vec<NodeId>>) {
        *self.joining.lock() = joining;
    }

    /// Decides one hit as the shard's leader, on `store`.
    pub fn decide(&self, store: &MemoryStore, op: &OpView<'_>, now_ms: u64) -> LocalDecision {
        self.decide_leasing(store, op, 0, now_ms).0
    }

    /// [`Replica::decide`], and for an admitted fixed-window hit a quota
    /// lease of at most `lease_max` credits for the node that forwarded it,
    /// counted as used in the same update (`forward/leases.rs` sizes it):
    /// the decision, and the lease granted (0: none). The decision's credit
    /// leaves the lease out.
    pub fn decide_leasing(
        &self,
        store: &MemoryStore,
        op: &OpView<'_>,
        lease_max: u32,
        now_ms: u64,
    ) -> (LocalDecision, u32) {
        let mut leased = 0;
        let decision = self.decide_inner(store, op, now_ms, |decision, state| {
            if lease_max == 0 || !decision.allowed {
                return;
            }
            if let Some(CounterState::Window { end_ms, used }) = state {
                let lease = crate::cluster::forward::lease_size(
                    *end_ms,
                    *used,
                    op.credit_limit,
                    lease_max,
                    now_ms,
                );
                *used += u64::from(lease);
                leased = lease;
            }
        });
        // A decision fenced off after the update never happened, nor did
        // its lease.
        match decision {
            LocalDecision::Decided { .. } => (decision, leased),
            _ => (decision, 0),
        }
    }

    #[inline(always)]
    fn decide_inner(
        &self,
        store: &MemoryStore,
        op: &OpView<'_>,
        now_ms: u64,
        mut lease: impl FnMut(&Decision, &mut Option<CounterState>),
    ) -> LocalDecision {
        let Some(term) = self.ready_term() else {
            return LocalDecision::Refused(if self.handing_over.load(Ordering::Acquire) {
                ShardRefusal::HandingOver
            } else {
                ShardRefusal::Preparing
            });
        };
        let Some(quota) = WindowQuota::new(op.credit_limit, op.reset_seconds) else {
            return LocalDecision::Invalid(ShardRefusal::InvalidQuota);
        };
        if let Err(refused) = self.check_fence(term) {
            return refused;
        }
        if op.peek {
            let state = store.get(op.key, now_ms);
            let decision = algorithm_hit(op.algorithm, state, quota, now_ms).0;
            return LocalDecision::Decided {
                decision,
                changed: None,
                term,
            };
        }
        let mut changed = None;
        let result = store.update(op.key, now_ms, |state| {
            let (decision, mut new_state) = algorithm_hit(op.algorithm, state, quota, now_ms);
            if op.algorithm == crate::rules::Algorithm::FixedWindow {
                lease(&decision, &mut new_state);
            }
            changed = new_state;
            (decision, new_state)
        });
        // A promise of a newer term may have scanned the store before this
        // update: then this decision never happened, as far as anyone knows.
        if let Err(refused) = self.check_fence(term) {
            return refused;
        }
        match result {
            Ok(decision) => LocalDecision::Decided {
                decision,
                changed,
                term,
            },
            Err(full) => LocalDecision::Full(full),
        }
    }

    /// Runs `decide` with this replica's term, as the shard's leader, fenced
    /// as [`Replica::decide`] is: refused when not ready or when a newer
    /// term was promised before or while it ran (then it never happened, as
    /// far as anyone knows). For decisions that touch several keys
    /// (droplet buckets, `cluster::buckets`).
    pub fn lead<R>(&self, decide: impl FnOnce(u64) -> R) -> Result<(R, u64), ShardRefusal> {
        let refused = |decision: LocalDecision| match decision {
            LocalDecision::Refused(why) => why,
            _ => ShardRefusal::Preparing,
        };
        let Some(term) = self.ready_term() else {
            return Err(if self.handing_over.load(Ordering::Acquire) {
                ShardRefusal::HandingOver
            } else {
                ShardRefusal::Preparing
            });
        };
        self.check_fence(term).map_err(refused)?;
        let result = decide(term);
        self.check_fence(term).map_err(refused)?;
        Ok((result, term))
    }

    /// Still leading in `term` (no newer term promised)?
    fn check_fence(&self, term: u64) -> Result<(), LocalDecision> {
        let fence = self.fence.load(Ordering::Acquire);
        if fence == term {
            return Ok(());
        }
        let _ = self
            .ready_term
            .compare_exchange(term, 0, Ordering::AcqRel, Ordering::Acquire);
        Err(LocalDecision::Refused(ShardRefusal::Superseded(fence)))
    }

    /// Applies states a leader of `term` sent (a round, a sync), unless a
    /// newer term was promised (before, or while they were applied: then a
    /// promise's scan may have missed them, so they do not count as held
    /// here). Returns how many the live-key cap dropped.
    pub fn apply<'a>(
        &self,
        store: &MemoryStore,
        term: u64,
        stamped_ms: u64,
        states: impl IntoIterator<Item = (&'a [u8], CounterState)>,
    ) -> Result<usize, ApplyRefusal> {
        let fence = self.fence.fetch_max(term, Ordering::AcqRel);
        if fence > term {
            return Err(ApplyRefusal::Fenced { term: fence });
        }
        let mut dropped = 0;
        for (key, state) in states {
            if store.merge(key, state, stamped_ms).is_err() {
                dropped += 1;
            }
        }
        let fence = self.fence.load(Ordering::Acquire);
        if fence > term {
            return Err(ApplyRefusal::Fenced { term: fence });
        }
        Ok(dropped)
    }

    /// Records that the leader just reached its voters (see `confirmed_at`).
    pub fn note_confirmed(&self) {
        *self.confirmed_at.lock() = std::time::Instant::now();
    }

    pub fn confirmed_at(&self) -> std::time::Instant {
        *self.confirmed_at.lock()
    }

    pub fn set_recovery(&self, recovery: Option<Recovery>) {
        *self.recovery.lock() = recovery;
    }

    pub fn recovering(&self) -> bool {
        self.recovery.lock().is_some()
    }

    /// A recovering replica grants votes only to candidates of a newer term
    /// than any it heard of, holding at least the log its peers had applied:
    /// having forgotten its own vote and log, it must not help elect a
    /// leader that lacks committed membership changes.
    pub fn may_vote(&self, rpc: &VoteRequest<NodeId>) -> Result<(), String> {
        let Some(recovery) = *self.recovery.lock() else {
            return Ok(());
        };
        if rpc.vote.leader_id.term <= recovery.term_floor {
            return Err(format!(
                "shard {}: recovering replica declines a vote for term {} (terms up to {} were in use before it restarted)",
                self.shard, rpc.vote.leader_id.term, recovery.term_floor
            ));
        }
        if rpc.last_log_id < recovery.applied_floor {
            return Err(format!(
                "shard {}: recovering replica declines a candidate whose log ends before the committed log it must hold",
                self.shard
            ));
        }
        Ok(())
    }

    /// Ends recovery once the replica applied what its peers had; says
    /// whether it did just now.
    pub fn check_caught_up(&self, applied: Option<LogId<NodeId>>) -> bool {
        let mut recovery = self.recovery.lock();
        match *recovery {
            Some(r) if applied >= r.applied_floor => {
                *recovery = None;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smallvec::smallvec;

    #[test]
    fn commit_needs_a_majority_of_every_voter_set() {
        let single = ShardConfig {
            voter_sets: smallvec![vec![1, 2, 3]],
            targets: vec![2, 3],
        };
        assert!(!single.committed(1, &[]));
        assert!(single.committed(1, &[2]));
        assert!(single.committed(1, &[3, 2]));
        // A holder outside the voters does not count.
        assert!(!single.committed(1, &[4]));
        let joint = ShardConfig {
            voter_sets: smallvec![vec![1, 2, 3], vec![1, 2, 4]],
            targets: vec![2, 3, 4],
        };
        assert!(joint.committed(1, &[2]));
        assert!(!joint.committed(1, &[3]));
        assert!(joint.committed(1, &[3, 4]));
        assert!(joint.committable(&[3]));
        assert!(!joint.committable(&[2, 3]));
        let alone = ShardConfig {
            voter_sets: smallvec![vec![1]],
            targets: vec![],
        };
        assert!(alone.committed(1, &[]));
        assert!(!ShardConfig::default().committed(1, &[2, 3]));
    }
}
