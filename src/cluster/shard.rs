//! One shard group on this node: its Raft instance, the leader-side worker
//! that decides the shard's hits, and the watcher that publishes who leads.
//!
//! The worker drains every queued hit (local or forwarded) into one batch,
//! decides them in order on the node's store with the pure limiter, and
//! proposes the resulting counter states as one Raft entry:
//! - `strict`: the batch is answered after the entry commits; a commit that
//!   fails or times out answers every hit of the batch `unavailable` (never
//!   `true` without a commit). One batch is in flight at a time; the next
//!   gathers every hit that arrived meanwhile (group commit).
//! - `fast`: the batch is answered at once; states accumulate and are
//!   proposed every `replication_interval_ms` in the background.
//!
//! A new leader first confirms its leadership and waits until it has applied
//! everything committed before it (`ensure_linearizable`), so it never
//! decides on a stale state. A replica that restarted empty is *recovering*:
//! it does not stand for election, and declines votes for candidates that
//! may lack committed entries, until it has applied what its peers had.

use super::storage::{CounterBatch, LogStore, ReplicatedCounter, ShardStateMachine, TollgateRaft};
use super::wire::{ShardReport, WireDecision, WireOp};
use super::{Consistency, LeaderTable, NodeId};
use crate::clock::Clock;
use crate::limiter::{CounterState, WindowQuota};
use crate::store::algorithm_hit;
use crate::store::MemoryStore;
use openraft::raft::VoteRequest;
use openraft::{LogId, Raft, ServerState};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, Semaphore};

/// Hits queued for one shard's worker, at most (in ops-carrying items).
pub const WORK_QUEUE_ITEMS_MAX: usize = 65_536;
/// Proposals of one shard awaiting commit at once, at most (group commit).
/// One on purpose: while it is in flight, hits queue up and the next
/// proposal carries them all, so entries stay few and large under load.
const PROPOSALS_IN_FLIGHT_MAX: usize = 1;
/// Strict mode: how often an idle worker checks for a handover, in ms.
const STRICT_TICK_MS: u64 = 20;

/// Hits for one shard, answered per op in order.
pub struct WorkItem {
    pub ops: Vec<WireOp>,
    pub reply: oneshot::Sender<Vec<WireDecision>>,
}

/// What a replica that restarted empty must reach before it votes and
/// stands for election again (learned from its peers when it joined).
#[derive(Debug, Clone, Copy)]
pub struct Recovery {
    /// The highest log id any peer had applied (so it is committed).
    pub applied_floor: Option<LogId<NodeId>>,
    /// The highest term any peer reported.
    pub term_floor: u64,
}

/// Settings a shard worker needs.
#[derive(Clone)]
pub struct WorkerSettings {
    pub node_id: NodeId,
    pub consistency: Consistency,
    pub commit_timeout_ms: u64,
    pub replication_interval_ms: u64,
    pub batch_ops_max: usize,
}

pub struct ShardGroup {
    pub shard: u32,
    pub raft: Raft<TollgateRaft>,
    pub work: mpsc::Sender<WorkItem>,
    recovery: Mutex<Option<Recovery>>,
    /// Set while this leader hands leadership to another replica.
    pub handover: Arc<Handover>,
    /// What a move of this shard (led here) is doing, for `cluster status`.
    pub moving: Mutex<Option<String>>,
}

/// A leader handing its leadership over: it stops deciding, finishes
/// replicating what it decided, then lets the successor stand.
#[derive(Default)]
pub struct Handover {
    /// Hits answer `unavailable` (the client retries on the new leader).
    pub active: std::sync::atomic::AtomicBool,
    /// Everything decided here has been committed; nothing is in flight.
    pub quiesced: std::sync::atomic::AtomicBool,
}

impl ShardGroup {
    /// Creates the group's Raft instance (elections off until the node has
    /// joined) and starts its worker and watcher on the current runtime.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        shard: u32,
        config: Arc<openraft::Config>,
        network: super::links::ShardNetworkFactory,
        state_machine: ShardStateMachine,
        store: Arc<MemoryStore>,
        clock: Arc<dyn Clock>,
        settings: WorkerSettings,
        leaders: Arc<LeaderTable>,
    ) -> Result<Arc<ShardGroup>, openraft::error::Fatal<NodeId>> {
        let raft = Raft::new(
            settings.node_id,
            config,
            network,
            LogStore::default(),
            state_machine,
        )
        .await?;
        let (work, queue) = mpsc::channel(WORK_QUEUE_ITEMS_MAX);
        let group = Arc::new(ShardGroup {
            shard,
            raft: raft.clone(),
            work,
            recovery: Mutex::new(None),
            handover: Arc::default(),
            moving: Mutex::new(None),
        });
        let worker = Worker {
            shard,
            raft: raft.clone(),
            store,
            clock,
            settings,
            ready_term: None,
            proposals: Arc::new(Semaphore::new(PROPOSALS_IN_FLIGHT_MAX)),
            unreplicated: HashMap::new(),
            replication_failed: Arc::default(),
            requeued: Arc::default(),
            handover: Arc::clone(&group.handover),
        };
        tokio::spawn(worker.run(queue));
        tokio::spawn(watch_leadership(Arc::downgrade(&group), leaders));
        Ok(group)
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
    /// leader that lacks committed counters.
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

    /// Ends recovery as soon as the replica has applied what its peers had
    /// (at once when they had nothing applied).
    pub fn check_caught_up_now(self: &Arc<Self>) {
        tokio::spawn(watch_recovery(Arc::downgrade(self)));
    }

    /// Ends recovery once everything the peers had applied is applied here.
    fn check_caught_up(&self, applied: Option<LogId<NodeId>>) {
        let mut recovery = self.recovery.lock();
        if let Some(r) = *recovery {
            if applied >= r.applied_floor {
                *recovery = None;
                drop(recovery);
                self.raft.runtime_config().elect(true);
                tracing::info!(
                    shard = self.shard,
                    "replica caught up; it votes and stands for election again"
                );
            }
        }
    }

    /// This replica's view of the group.
    pub fn report(&self) -> ShardReport {
        let metrics = self.raft.metrics().borrow().clone();
        let lag = match (&metrics.replication, metrics.state) {
            (Some(replication), ServerState::Leader) => {
                let last = metrics.last_log_index.unwrap_or(0);
                replication
                    .iter()
                    .filter(|(&node, _)| node != metrics.id)
                    .map(|(&node, matched)| {
                        (node, last.saturating_sub(matched.map_or(0, |m| m.index)))
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        let membership = metrics.membership_config.membership();
        ShardReport {
            voters: membership.voter_ids().collect(),
            learners: membership.learner_ids().collect(),
            moving: self.moving.lock().clone(),
            shard: self.shard,
            established: metrics.last_log_index.unwrap_or(0) >= 1 || metrics.snapshot.is_some(),
            term: metrics.current_term,
            last_log_index: metrics.last_log_index,
            applied: metrics.last_applied,
            leader: metrics.current_leader,
            recovering: self.recovering(),
            lag,
        }
    }
}

/// Publishes the group's leader to the node's table. It watches the
/// server metrics, which change with leadership and membership only (not on
/// every commit, as the full metrics do), so it wakes rarely under load.
async fn watch_leadership(group: std::sync::Weak<ShardGroup>, leaders: Arc<LeaderTable>) {
    let Some(mut server) = group.upgrade().map(|g| g.raft.server_metrics()) else {
        return;
    };
    loop {
        {
            let Some(group) = group.upgrade() else { return };
            let m = server.borrow_and_update();
            leaders.set(group.shard, m.current_leader, m.vote.leader_id.term);
        }
        if server.changed().await.is_err() {
            // The group stopped. Shut down on purpose (a retired replica):
            // the node already points the shard elsewhere. A fatal error:
            // the group cannot serve again in this process; its peers still
            // can (the node is one replica of three).
            let Some(group) = group.upgrade() else { return };
            let m = group.raft.metrics().borrow().clone();
            if let Err(fatal) = &m.running_state {
                if !matches!(fatal, openraft::error::Fatal::Stopped) {
                    tracing::error!(shard = group.shard, %fatal, "shard group stopped");
                    leaders.set(group.shard, None, m.current_term);
                }
            }
            return;
        }
    }
}

/// Ends a replica's recovery once it has applied what its peers had: watches
/// what it applies until then (then stops, so it costs nothing later).
async fn watch_recovery(group: std::sync::Weak<ShardGroup>) {
    let Some(mut data) = group.upgrade().map(|g| g.raft.data_metrics()) else {
        return;
    };
    loop {
        {
            let Some(group) = group.upgrade() else { return };
            let applied = data.borrow_and_update().last_applied;
            group.check_caught_up(applied);
            if !group.recovering() {
                return;
            }
        }
        if data.changed().await.is_err() {
            return;
        }
    }
}

struct Worker {
    shard: u32,
    raft: Raft<TollgateRaft>,
    store: Arc<MemoryStore>,
    clock: Arc<dyn Clock>,
    settings: WorkerSettings,
    /// The term in which this node confirmed its leadership and caught up.
    ready_term: Option<u64>,
    proposals: Arc<Semaphore>,
    /// Fast mode: states decided but not yet proposed.
    unreplicated: HashMap<Vec<u8>, CounterState>,
    /// Fast mode: a background proposal failed (leadership lost, or no
    /// majority within `commit_timeout_ms`); leadership is re-confirmed
    /// with a majority before anything more is decided.
    replication_failed: Arc<std::sync::atomic::AtomicBool>,
    /// Fast mode: states of background proposals that failed, to propose
    /// again (a failed proposal may still commit; merging twice is harmless).
    requeued: Arc<Mutex<Vec<ReplicatedCounter>>>,
    handover: Arc<Handover>,
}

impl Worker {
    async fn run(mut self, mut queue: mpsc::Receiver<WorkItem>) {
        // Fast mode proposes what it decided every tick; strict mode only
        // needs the tick to notice a handover's quiet point.
        let tick_ms = match self.settings.consistency {
            Consistency::Fast => self.settings.replication_interval_ms.max(1),
            Consistency::Strict => STRICT_TICK_MS,
        };
        let mut tick = tokio::time::interval(Duration::from_millis(tick_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                item = queue.recv() => {
                    let Some(item) = item else { return };
                    let mut ops = item.ops.len();
                    let mut items = vec![item];
                    while ops < self.settings.batch_ops_max {
                        match queue.try_recv() {
                            Ok(item) => {
                                ops += item.ops.len();
                                items.push(item);
                            }
                            Err(_) => break,
                        }
                    }
                    self.decide_batch(items).await;
                }
                _ = tick.tick() => {
                    let requeued = std::mem::take(&mut *self.requeued.lock());
                    for counter in requeued {
                        self.queue_for_replication(counter.key.clone(), counter.state());
                    }
                    if !self.unreplicated.is_empty() {
                        self.replicate_in_background();
                    }
                    if self.handover.active.load(std::sync::atomic::Ordering::Acquire) {
                        let idle = self.unreplicated.is_empty()
                            && self.requeued.lock().is_empty()
                            && self.proposals.available_permits() == PROPOSALS_IN_FLIGHT_MAX;
                        self.handover
                            .quiesced
                            .store(idle, std::sync::atomic::Ordering::Release);
                    }
                }
            }
        }
    }

    fn unavailable(&self, why: &str) -> WireDecision {
        WireDecision::Unavailable(format!("shard {} unavailable: {why}", self.shard))
    }

    /// For hits turned away before anything was decided (so not counted):
    /// the sender may try the shard's leader again.
    fn not_decided(&self, why: &str) -> WireDecision {
        WireDecision::Retry(format!("shard {} unavailable: {why}", self.shard))
    }

    fn answer_all(items: Vec<WorkItem>, decision: &WireDecision) {
        for item in items {
            let _ = item.reply.send(vec![decision.clone(); item.ops.len()]);
        }
    }

    /// Is this node the group's leader, caught up for its term?
    async fn ensure_ready(&mut self) -> Result<(), String> {
        let (leader, term) = {
            let metrics = self.raft.server_metrics();
            let m = metrics.borrow();
            (m.current_leader, m.vote.leader_id.term)
        };
        match leader {
            Some(leader) if leader == self.settings.node_id => {}
            Some(leader) => return Err(format!("node {leader} leads it, not this node")),
            None => return Err("no leader (election in progress)".into()),
        }
        let failed = self
            .replication_failed
            .swap(false, std::sync::atomic::Ordering::AcqRel);
        if self.ready_term == Some(term) && !failed {
            return Ok(());
        }
        // States admitted but not yet proposed stay queued: proposing them
        // later only merges counts that were really admitted.
        self.ready_term = None;
        let confirm = tokio::time::timeout(
            Duration::from_millis(self.settings.commit_timeout_ms),
            self.raft.ensure_linearizable(),
        )
        .await;
        match confirm {
            Ok(Ok(_)) => {
                self.ready_term = Some(term);
                Ok(())
            }
            Ok(Err(error)) => Err(format!("leadership not confirmed: {error}")),
            Err(_) => Err(format!(
                "leadership not confirmed within {} ms",
                self.settings.commit_timeout_ms
            )),
        }
    }

    async fn decide_batch(&mut self, items: Vec<WorkItem>) {
        if self
            .handover
            .active
            .load(std::sync::atomic::Ordering::Acquire)
        {
            let decision = self.not_decided("its leadership is being handed to another replica");
            Self::answer_all(items, &decision);
            return;
        }
        if let Err(why) = self.ensure_ready().await {
            let decision = self.not_decided(&why);
            Self::answer_all(items, &decision);
            return;
        }
        let now_ms = self.clock.now_ms();
        let mut changed: HashMap<Vec<u8>, CounterState> = HashMap::new();
        let mut answers: Vec<(oneshot::Sender<Vec<WireDecision>>, Vec<WireDecision>)> =
            Vec::with_capacity(items.len());
        for item in items {
            let decisions = item
                .ops
                .iter()
                .map(|op| self.decide_op(op, now_ms, &mut changed))
                .collect();
            answers.push((item.reply, decisions));
        }
        match self.settings.consistency {
            Consistency::Fast => {
                for (reply, decisions) in answers {
                    let _ = reply.send(decisions);
                }
                for (key, state) in changed {
                    self.queue_for_replication(key, state);
                }
            }
            Consistency::Strict if changed.is_empty() => {
                // Only denials and peeks: nothing to commit.
                for (reply, decisions) in answers {
                    let _ = reply.send(decisions);
                }
            }
            Consistency::Strict => {
                let batch = CounterBatch {
                    stamped_ms: now_ms,
                    counters: changed
                        .into_iter()
                        .map(|(key, state)| ReplicatedCounter::new(key, state))
                        .collect(),
                };
                let raft = self.raft.clone();
                let timeout_ms = self.settings.commit_timeout_ms;
                let shard = self.shard;
                // Waiting here (not in the task) lets the queue fill up.
                let permit = Arc::clone(&self.proposals).acquire_owned().await;
                tokio::spawn(async move {
                    let committed = async {
                        let _permit = permit;
                        raft.client_write(batch).await
                    };
                    let failure =
                        match tokio::time::timeout(Duration::from_millis(timeout_ms), committed)
                            .await
                        {
                            Ok(Ok(_)) => None,
                            Ok(Err(error)) => Some(format!("not committed: {error}")),
                            Err(_) => Some(format!("not committed within {timeout_ms} ms")),
                        };
                    match failure {
                        None => {
                            for (reply, decisions) in answers {
                                let _ = reply.send(decisions);
                            }
                        }
                        Some(why) => {
                            let decision = WireDecision::Unavailable(format!(
                                "shard {shard} unavailable: {why}"
                            ));
                            for (reply, decisions) in answers {
                                let _ = reply.send(vec![decision.clone(); decisions.len()]);
                            }
                        }
                    }
                });
            }
        }
    }

    fn decide_op(
        &self,
        op: &WireOp,
        now_ms: u64,
        changed: &mut HashMap<Vec<u8>, CounterState>,
    ) -> WireDecision {
        let Some(quota) = WindowQuota::new(op.credit_limit, op.reset_seconds) else {
            return self.unavailable("a forwarded hit carried an invalid quota");
        };
        if op.peek {
            let state = self.store.get(&op.key, now_ms);
            return algorithm_hit(op.algorithm, state, quota, now_ms).0.into();
        }
        let mut stored = None;
        let result = self.store.update(&op.key, now_ms, |state| {
            let (decision, new_state) = algorithm_hit(op.algorithm, state, quota, now_ms);
            stored = new_state;
            (decision, new_state)
        });
        match result {
            Ok(decision) => {
                if let Some(state) = stored {
                    changed.insert(op.key.clone(), state);
                }
                decision.into()
            }
            Err(full) => WireDecision::Full {
                live_keys_max: full.live_keys_max as u64,
            },
        }
    }

    fn queue_for_replication(&mut self, key: Vec<u8>, state: CounterState) {
        let merged = match self.unreplicated.get(&key) {
            Some(old) => old.merge(state),
            None => state,
        };
        self.unreplicated.insert(key, merged);
    }

    /// Fast mode: proposes the accumulated states without waiting for them.
    fn replicate_in_background(&mut self) {
        let Ok(permit) = Arc::clone(&self.proposals).try_acquire_owned() else {
            return; // Proposals are backed up: keep accumulating.
        };
        let batch = CounterBatch {
            stamped_ms: self.clock.now_ms(),
            counters: self
                .unreplicated
                .drain()
                .map(|(key, state)| ReplicatedCounter::new(key, state))
                .collect(),
        };
        let raft = self.raft.clone();
        let timeout_ms = self.settings.commit_timeout_ms;
        let shard = self.shard;
        let failed = Arc::clone(&self.replication_failed);
        let requeued = Arc::clone(&self.requeued);
        tokio::spawn(async move {
            let _permit = permit;
            let counters = batch.counters.clone();
            let result =
                tokio::time::timeout(Duration::from_millis(timeout_ms), raft.client_write(batch))
                    .await;
            if !matches!(result, Ok(Ok(_))) {
                tracing::debug!(shard, "background replication of a batch failed");
                requeued.lock().extend(counters);
                failed.store(true, std::sync::atomic::Ordering::Release);
            }
        });
    }
}
