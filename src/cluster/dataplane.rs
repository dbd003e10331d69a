//! The cluster's data path on one node: where every hit's counter state goes
//! after a decision, and where hits for shards led elsewhere go.
//!
//! - **Outboxes.** For each peer, one buffer of encoded data sections
//!   ([`PeerOut`]): forwarded hits, answers, replication rounds and the
//!   cumulative ack are appended by whoever produces them (serving threads,
//!   the replicator, frames being read) and written by the peer's link in
//!   one frame per wake-up, so a busy node writes one frame per peer however
//!   many hits it carries.
//! - **Rounds.** States decided by this node as a shard's leader collect in
//!   the open round; the replicator (one task) closes it whenever it runs,
//!   sends each shard's section to the shard's other replicas and tracks
//!   the acks ([`rounds`](super::rounds)); committed sections release their
//!   waiting answers (strict mode).
//! - **Inbound frames** are handled inline, in the order they arrive:
//!   forwarded hits are decided on this node's store as their shard's
//!   leader, rounds are applied through the shard's fence, acks and answers
//!   release what waits for them.
//!
//! Everything here is synchronous and short; locks are held for a copy.

use super::data_frames::{
    begin_counted, end_counted, put_decision, put_op, put_varint, tag, walk_keys, Ack, FrameError,
    OpView, Reader, RoundAnswersHeader, RoundHeader,
};
use super::disk::NodeDisk;
use super::forward::{ForwardWait, SlotBoard};
pub use super::outbox::PeerOut;
use super::placement::Placement;
use super::replica::{LocalDecision, Replica};
use super::rounds::{InFlight, RoundBuilder, Waiter};
use super::wire::{ApplyRefusal, CounterList, ShardRefusal, WireDecision};
use super::{Consistency, LeaderTable, NodeId};
use crate::clock::Clock;
use crate::limiter::CounterState;
use crate::store::{MemoryStore, StoreFull};
use arc_swap::ArcSwapOption;
use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Most keys of one inbound frame whose store lines are prefetched before
/// the frame is handled: two lines each, 512 KiB at most, within a core's
/// L2 (2 MiB here), and 32 KiB of hashes in a buffer kept per thread. Fast mode's rounds
/// carry 1 500–2 500 states per frame: 1 024 left the rest unprefetched
/// (follower merges 129 ns per hit with leader-aware clients, 93 ns with
/// 4 096; docs/benchmarks.md, "Sixth round").
const FRAME_PREFETCH_KEYS_MAX: usize = 4096;

/// What handling a frame writes as it goes, kept by each thread from frame
/// to frame so that its buffers grow once, not in every frame (five nodes'
/// many small frames spent 0.08 µs per hit allocating; docs/benchmarks.md,
/// "Seventh round").
#[derive(Default)]
struct FrameScratch {
    /// The frame's answers to forwarded hits: an `ANSWERS` section.
    answers: Vec<u8>,
    /// States decided for forwarded hits, their keys in `keys`.
    decided: Vec<(usize, usize, DecidedState)>,
    keys: Vec<u8>,
    /// Answers of the leader's `ANSWERS` sections, and those of its
    /// `ROUND_ANSWERS` sections whose round section was applied here (the
    /// latter taken once that section is written to the data dir).
    answered: Vec<(u64, u32, WireDecision)>,
    answered_with_rounds: Vec<(u64, u32, WireDecision)>,
}

impl FrameScratch {
    /// Empties every buffer, keeping what each has grown to unless they
    /// hold more than [`FRAME_SCRATCH_KEPT_BYTES_MAX`] together (a burst's
    /// frames are not kept by every thread for ever).
    fn clear(&mut self) {
        use std::mem::size_of;
        let kept = self.answers.capacity()
            + self.keys.capacity()
            + self.decided.capacity() * size_of::<(usize, usize, DecidedState)>()
            + (self.answered.capacity() + self.answered_with_rounds.capacity())
                * size_of::<(u64, u32, WireDecision)>();
        if kept > FRAME_SCRATCH_KEPT_BYTES_MAX {
            *self = FrameScratch::default();
            return;
        }
        self.answers.clear();
        self.decided.clear();
        self.keys.clear();
        self.answered.clear();
        self.answered_with_rounds.clear();
    }
}

/// Most bytes a thread keeps in its [`FrameScratch`] between frames.
const FRAME_SCRATCH_KEPT_BYTES_MAX: usize = 1 << 20;

thread_local! {
    static FRAME_SCRATCH: RefCell<FrameScratch> = RefCell::new(FrameScratch::default());
}

/// Settings of the data path.
#[derive(Debug, Clone)]
pub struct DataSettings {
    pub consistency: Consistency,
    pub commit_timeout_ms: u64,
    pub forward_timeout_ms: u64,
    /// Fast mode: how long a round stays open at most.
    pub replication_interval_ms: u64,
    /// A round is closed at once when it holds this many states.
    pub batch_ops_max: usize,
    /// A peer silent for this long counts as down.
    pub liveness_timeout_ms: u64,
}

/// Counters of the data path, for `/metrics` and `cluster status`.
#[derive(Default)]
pub struct DataStats {
    pub rounds: AtomicU64,
    pub round_sections: AtomicU64,
    pub states_replicated: AtomicU64,
    pub sections_committed: AtomicU64,
    pub sections_failed: AtomicU64,
    pub states_applied: AtomicU64,
    pub states_refused: AtomicU64,
    pub forward_batches: AtomicU64,
    pub forwarded_ops: AtomicU64,
    pub forwards_decided: AtomicU64,
    pub writes: AtomicU64,
    pub frames_written: AtomicU64,
    pub bytes_written: AtomicU64,
    pub dropped_at_cap: AtomicU64,
    /// Forwarded hits this node (as leader) answered in the frame carrying
    /// their round (`rounds.rs`, "Answers that ride with the round").
    pub round_answers: AtomicU64,
    /// Peer connections closed unanswered: too many handshakes in progress.
    pub handshakes_refused: AtomicU64,
}

impl DataStats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// A state decided by a leader, waiting to enter the open round.
pub struct DecidedState {
    pub shard: u32,
    pub term: u64,
    pub state: CounterState,
    pub waiter: Option<Waiter>,
}

pub struct DataPlane {
    pub me: NodeId,
    /// This process's incarnation (see `Hello::boot_id`).
    pub boot: u64,
    pub placement: Placement,
    pub store: Arc<MemoryStore>,
    pub clock: Arc<dyn Clock>,
    pub leaders: Arc<LeaderTable>,
    pub settings: DataSettings,
    pub stats: DataStats,
    /// The data dir, when there is one: states are written there before
    /// they are acknowledged (see `disk/mod.rs`).
    pub disk: Option<Arc<NodeDisk>>,
    replicas: Box<[ArcSwapOption<Replica>]>,
    outs: RwLock<HashMap<NodeId, Arc<PeerOut>, ahash::RandomState>>,
    pub(super) round: Mutex<RoundBuilder>,
    pub(super) in_flight: Mutex<InFlight>,
    forwards: Mutex<HashMap<u64, ForwardWait, ahash::RandomState>>,
    next_batch: AtomicU64,
    /// Wakes the replicator.
    pub(super) replicate: Notify,
    /// Peers whose link (re)connected since the node last looked, and the
    /// signal that there are some (their shards are synced to them).
    connected_peers: Mutex<Vec<NodeId>>,
    pub connect_events: Notify,
    epoch: Instant,
}

impl DataPlane {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        me: NodeId,
        boot: u64,
        placement: Placement,
        store: Arc<MemoryStore>,
        clock: Arc<dyn Clock>,
        leaders: Arc<LeaderTable>,
        disk: Option<Arc<NodeDisk>>,
        settings: DataSettings,
    ) -> DataPlane {
        DataPlane {
            me,
            boot,
            replicas: (0..placement.shards())
                .map(|_| ArcSwapOption::empty())
                .collect(),
            placement,
            store,
            clock,
            leaders,
            settings,
            disk,
            stats: DataStats::default(),
            outs: RwLock::default(),
            round: Mutex::default(),
            in_flight: Mutex::new(InFlight::new(me)),
            forwards: Mutex::default(),
            next_batch: AtomicU64::new(1),
            replicate: Notify::new(),
            connected_peers: Mutex::default(),
            connect_events: Notify::new(),
            epoch: Instant::now(),
        }
    }

    pub fn strict(&self) -> bool {
        self.settings.consistency == Consistency::Strict
    }

    pub fn replica(&self, shard: u32) -> Option<Arc<Replica>> {
        self.replicas.get(shard as usize)?.load_full()
    }

    /// The replica of `shard`, borrowed for a moment (no reference count
    /// touched: the hot path's lookup).
    pub fn replica_ref(&self, shard: u32) -> Option<arc_swap::Guard<Option<Arc<Replica>>>> {
        Some(self.replicas.get(shard as usize)?.load())
    }

    pub fn install_replica(&self, replica: Arc<Replica>) {
        if let Some(slot) = self.replicas.get(replica.shard as usize) {
            slot.store(Some(replica));
        }
    }

    pub fn remove_replica(&self, shard: u32) {
        if let Some(slot) = self.replicas.get(shard as usize) {
            slot.store(None);
        }
    }

    /// The outbox for `peer`, made on first use.
    pub fn out(&self, peer: NodeId) -> Arc<PeerOut> {
        if let Some(out) = self.outs.read().get(&peer) {
            return Arc::clone(out);
        }
        let mut outs = self.outs.write();
        Arc::clone(
            outs.entry(peer)
                .or_insert_with(|| Arc::new(PeerOut::new(peer, self.epoch))),
        )
    }

    pub(super) fn existing_out(&self, peer: NodeId) -> Option<Arc<PeerOut>> {
        self.outs.read().get(&peer).cloned()
    }

    /// Is `peer` up, as far as this node can tell (heard from recently)?
    pub fn alive(&self, peer: NodeId) -> bool {
        peer == self.me
            || self
                .existing_out(peer)
                .is_some_and(|out| out.heard_within(self.settings.liveness_timeout_ms))
    }

    /// The shards no hit sent to this node could be decided for now, with
    /// why: no leader known, this node leads but is not prepared, or the
    /// leader cannot be reached.
    pub fn unservable_shards(&self) -> Vec<(u32, ShardRefusal)> {
        (0..self.placement.shards())
            .filter_map(|shard| {
                let why = match self.leaders.leader(shard) {
                    None => ShardRefusal::NoLeader,
                    Some(leader) if leader == self.me => {
                        match self.replica(shard).and_then(|r| r.ready_term()) {
                            Some(_) => return None,
                            None => ShardRefusal::Preparing,
                        }
                    }
                    Some(leader) => {
                        if self.alive(leader) && self.out(leader).connected() {
                            return None;
                        }
                        ShardRefusal::Other(format!("its leader, node {leader}, is unreachable"))
                    }
                };
                Some((shard, why))
            })
            .collect()
    }

    /// The link to `peer` connected, talking peer protocol minor `minor`.
    pub fn peer_connected(&self, peer: NodeId, minor: u8) {
        let out = self.out(peer);
        out.minor.store(minor, Ordering::Release);
        out.connected.store(true, Ordering::Release);
        self.connected_peers.lock().push(peer);
        self.connect_events.notify_one();
    }

    /// Peers whose link connected since the last call.
    pub fn take_connected_peers(&self) -> Vec<NodeId> {
        std::mem::take(&mut *self.connected_peers.lock())
    }

    /// The link to `peer` broke: what was queued for it is dropped,
    /// forwarded hits waiting on it are answered (sent ones may have been
    /// counted: `unavailable`; unsent ones may go elsewhere: retried), and
    /// its later acks no longer count for rounds sent before.
    pub fn peer_disconnected(&self, peer: NodeId, why: &str) {
        let out = self.out(peer);
        out.connected.store(false, Ordering::Release);
        let taken = out.reset();
        let waits: Vec<ForwardWait> = {
            let mut forwards = self.forwards.lock();
            let ids: Vec<u64> = forwards
                .iter()
                .filter(|(_, w)| w.peer == peer)
                .map(|(&id, _)| id)
                .collect();
            ids.into_iter()
                .filter_map(|id| forwards.remove(&id))
                .collect()
        };
        for wait in waits {
            let sent = wait.frame <= taken;
            let text = format!("forwarding to node {peer}: {why}");
            wait.fail(if sent {
                WireDecision::Unavailable {
                    shard: u32::MAX,
                    why: ShardRefusal::Other(text),
                }
            } else {
                WireDecision::Retry {
                    shard: u32::MAX,
                    why: ShardRefusal::Other(text),
                }
            });
        }
        let mut ended = Vec::new();
        self.in_flight.lock().disconnected(peer, &mut ended);
        self.release(ended);
    }

    /// Queues decided states for the next round and wakes the replicator.
    /// The replicator is woken only by the first states of a round (it
    /// takes everything queued when it runs) or, in fast mode, by a round
    /// that is full: waking a parked thread costs a system call.
    pub fn push_states<'a>(
        &self,
        now: Instant,
        states: impl IntoIterator<Item = (&'a [u8], DecidedState)>,
    ) {
        let wake = {
            let mut round = self.round.lock();
            let was_empty = round.is_empty();
            for (key, s) in states {
                round.push(s.shard, s.term, key, &s.state, s.waiter, now);
            }
            !round.is_empty() && (was_empty || round.states() >= self.settings.batch_ops_max)
        };
        if wake {
            self.replicate.notify_one();
        }
    }

    /// Sends a batch of ops to `peer`, the leader of their shards; their
    /// answers fill `slots` of `board`. Returns false (nothing sent) when
    /// the peer is unreachable or its outbox full.
    pub fn send_forward<'a>(
        &self,
        now: Instant,
        peer: NodeId,
        board: &Arc<SlotBoard>,
        slots: SmallVec<[u32; 16]>,
        ops: impl Iterator<Item = &'a [u8]>,
    ) -> bool {
        let out = self.out(peer);
        if !out.connected() {
            out.wake.notify_one(); // let the link try to connect
            return false;
        }
        let batch = self.next_batch.fetch_add(1, Ordering::Relaxed);
        let count = slots.len() as u32;
        // Register before the frame can leave, so that no answer is missed.
        let mut forwards = self.forwards.lock();
        let frame = out.append(|body| {
            let at = begin_counted(body, tag::FORWARD, &[batch]);
            for op in ops {
                body.extend_from_slice(op);
            }
            end_counted(body, at, count);
        });
        let Some(frame) = frame else {
            return false;
        };
        forwards.insert(
            batch,
            ForwardWait {
                peer,
                board: Arc::clone(board),
                slots,
                answered: 0,
                frame,
                sent_at: now,
            },
        );
        drop(forwards);
        DataStats::add(&self.stats.forward_batches, 1);
        DataStats::add(&self.stats.forwarded_ops, u64::from(count));
        out.wake.notify_one();
        true
    }

    /// Answers forwarded waits older than the forward timeout (their
    /// boards gave up already); keeps the table bounded.
    pub fn expire_forwards(&self, now: Instant) {
        let timeout = Duration::from_millis(self.settings.forward_timeout_ms);
        let mut forwards = self.forwards.lock();
        forwards.retain(|_, wait| now.saturating_duration_since(wait.sent_at) < timeout * 2);
    }

    /// Handles one data frame from `from`'s incarnation `from_boot`, inline.
    /// A frame from an incarnation older than one already seen is stale
    /// (the process restarted since) and is dropped whole.
    pub fn on_data_frame(
        &self,
        from: NodeId,
        from_boot: u64,
        body: &[u8],
    ) -> Result<(), FrameError> {
        if from_boot < self.out(from).peer_boot() {
            return Ok(());
        }
        self.prefetch_frame(body);
        let mut reader = Reader::new(body);
        // Buffers kept by the thread from frame to frame (taken, so that a
        // frame handled within this one would start with empty ones).
        let mut scratch = FRAME_SCRATCH.with_borrow_mut(std::mem::take);
        let FrameScratch {
            answers,
            decided,
            keys,
            answered,
            answered_with_rounds,
        } = &mut scratch;
        let mut answer_count = 0u32;
        let mut answers_at = None;
        let mut ended = Vec::new();
        // The round section just read, `(round, shard)`, if it was applied.
        let mut applied: Option<(u64, u32)> = None;
        // What this frame's round sections tell their leader: the highest
        // round, and the sections refused (one ack for the frame).
        let mut acked_upto: Option<u64> = None;
        let mut refused: SmallVec<[(u64, u32, ApplyRefusal); 2]> = SmallVec::new();
        let now_ms = self.clock.now_ms();
        let result = (|| -> Result<(), FrameError> {
            while !reader.is_empty() {
                let applied_before = applied.take();
                match reader.u8()? {
                    tag::FORWARD => {
                        let batch = reader.varint()?;
                        let count = reader.count(4)?;
                        DataStats::add(&self.stats.forwards_decided, u64::from(count));
                        for index in 0..count {
                            let op = reader.op()?;
                            let answer = self.decide_forwarded(
                                (from, from_boot),
                                batch,
                                index,
                                &op,
                                now_ms,
                                keys,
                                decided,
                            );
                            if let Some(answer) = answer {
                                answers_at.get_or_insert_with(|| {
                                    begin_counted(answers, tag::ANSWERS, &[from_boot])
                                });
                                put_varint(answers, batch);
                                put_varint(answers, u64::from(index));
                                put_decision(answers, &answer);
                                answer_count += 1;
                            }
                        }
                    }
                    tag::ANSWERS => {
                        // Answers meant for this node's previous life are
                        // read past, never taken.
                        let mine = reader.varint()? == self.boot;
                        let count = reader.count(3)?;
                        for _ in 0..count {
                            let answer = (reader.varint()?, reader.u32()?, reader.decision()?);
                            if mine {
                                answered.push(answer);
                            }
                        }
                        self.take_answers(answered);
                    }
                    tag::ROUND => {
                        let (round, shard, refusal) = self.apply_round(&mut reader)?;
                        acked_upto = acked_upto.max(Some(round));
                        match refusal {
                            None => applied = Some((round, shard)),
                            Some(why) => refused.push((round, shard, why)),
                        }
                    }
                    tag::ROUND_ANSWERS => {
                        let header = RoundAnswersHeader::read(&mut reader)?;
                        let holds = header.boot == self.boot
                            && applied_before == Some((header.round, header.shard));
                        for _ in 0..header.count {
                            let answer = (reader.varint()?, reader.u32()?, reader.decision()?);
                            if holds {
                                answered_with_rounds.push(answer);
                            }
                        }
                    }
                    tag::ACK => {
                        let ack = Ack::read(&mut reader)?;
                        if ack.boot == self.boot {
                            self.in_flight
                                .lock()
                                .ack(from, ack.upto, &ack.refused, &mut ended);
                        }
                    }
                    tag::BEAT => {}
                    other => return Err(FrameError::UnknownTag(other)),
                }
            }
            Ok(())
        })();
        // What this frame applied is written before any ack of it leaves,
        // and before the answers that hold because it was applied.
        if let Some(disk) = &self.disk {
            disk.write_pending();
        }
        self.take_answers(answered_with_rounds);
        if let Some(upto) = acked_upto {
            let out = self.out(from);
            out.record_ack(from_boot, upto, &refused);
            out.wake.notify_one();
        }
        if !decided.is_empty() {
            self.push_states(
                Instant::now(),
                decided
                    .drain(..)
                    .map(|(at, len, state)| (&keys[at..at + len], state)),
            );
        }
        if let Some(at) = answers_at {
            end_counted(answers, at, answer_count);
            let out = self.out(from);
            if out.append(|body| body.extend_from_slice(answers)).is_some() {
                out.wake.notify_one();
            }
        }
        self.release(ended);
        scratch.clear();
        FRAME_SCRATCH.with_borrow_mut(|kept| *kept = scratch);
        result
    }

    /// Fills the boards of forwarded batches with their answers, `(batch,
    /// index, decision)`, and empties `answers`: consecutive answers of one
    /// batch under one lock, read from `answers` itself (no list per batch).
    fn take_answers(&self, answers: &mut Vec<(u64, u32, WireDecision)>) {
        if answers.is_empty() {
            return;
        }
        let mut forwards = self.forwards.lock();
        let mut rest = answers.drain(..).peekable();
        while let Some(&(batch, _, _)) = rest.peek() {
            let run = std::iter::from_fn(|| {
                rest.next_if(|(of, _, _)| *of == batch)
                    .map(|(_, index, decision)| (index, decision))
            });
            match forwards.get_mut(&batch) {
                Some(wait) => {
                    if wait.answer_many(run) {
                        forwards.remove(&batch);
                    }
                }
                None => run.for_each(drop),
            }
        }
    }

    /// Prefetches the store lines of the first [`FRAME_PREFETCH_KEYS_MAX`]
    /// keys a frame's forwarded hits and round sections will touch, so that
    /// their cache misses overlap instead of stalling one decision or merge
    /// after another (docs/benchmarks.md, "Cluster data path"). Reads the
    /// frame without acting on it; a malformed frame only ends the look-ahead
    /// (handling it reports the error).
    fn prefetch_frame(&self, body: &[u8]) {
        // Two passes: every key's stripe line first (an address computed
        // from the hash alone, so no pass waits), then every key's slot,
        // whose address is read from the stripe line fetched meanwhile.
        // The hashes go in a buffer kept by the thread: no allocation per
        // frame, and nothing to clear (zeroing a 32 KiB array on the stack
        // for each frame cost five nodes' small frames 66 ns per hit).
        thread_local! {
            static HASHES: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
        }
        HASHES.with_borrow_mut(|hashes| {
            hashes.clear();
            let _ = walk_keys(body, |key| {
                let hash = self.store.key_hash(key);
                self.store.prefetch_stripe(hash);
                hashes.push(hash);
                hashes.len() < FRAME_PREFETCH_KEYS_MAX
            });
            for &hash in hashes.iter() {
                self.store.prefetch_slot(hash);
            }
        });
    }

    /// Decides a hit `from` forwarded, as the shard's leader: the answer
    /// now, or `None` when it waits for its state's commit.
    #[allow(clippy::too_many_arguments)]
    fn decide_forwarded(
        &self,
        (from, from_boot): (NodeId, u64),
        batch: u64,
        index: u32,
        op: &OpView<'_>,
        now_ms: u64,
        keys: &mut Vec<u8>,
        decided: &mut Vec<(usize, usize, DecidedState)>,
    ) -> Option<WireDecision> {
        let shard = self.placement.shard_of(op.key);
        if let Some(bucket) = &op.bucket {
            let by = (from, from_boot, batch, index);
            let (key, query) = (op.key, op.peek);
            return self
                .decide_forwarded_bucket(shard, key, bucket, query, now_ms, by, keys, decided);
        }
        let guard = self.replica_ref(shard);
        let Some(replica) = guard.as_deref().and_then(Option::as_ref) else {
            return Some(WireDecision::Retry {
                shard,
                why: ShardRefusal::NotReplicated(self.me),
            });
        };
        match replica.decide(&self.store, op, now_ms) {
            LocalDecision::Decided {
                decision,
                changed,
                term,
            } => {
                let Some(state) = changed else {
                    return Some(decision.into());
                };
                let waiter = self.strict().then_some(Waiter::Remote {
                    peer: from,
                    boot: from_boot,
                    batch,
                    index,
                    decision: decision.into(),
                });
                let answer_now = waiter.is_none();
                let at = keys.len();
                keys.extend_from_slice(op.key);
                decided.push((
                    at,
                    op.key.len(),
                    DecidedState {
                        shard,
                        term,
                        state,
                        waiter,
                    },
                ));
                answer_now.then(|| decision.into())
            }
            LocalDecision::Full(StoreFull { live_keys_max }) => Some(WireDecision::Full {
                live_keys_max: live_keys_max as u64,
            }),
            LocalDecision::Refused(why) => Some(WireDecision::Retry { shard, why }),
            LocalDecision::Invalid(why) => Some(WireDecision::Unavailable { shard, why }),
        }
    }

    /// Applies one round section; returns its round and shard, and why it
    /// was refused if it was.
    fn apply_round(
        &self,
        reader: &mut Reader<'_>,
    ) -> Result<(u64, u32, Option<ApplyRefusal>), FrameError> {
        let header = RoundHeader::read(reader)?;
        let mut states: SmallVec<[(&[u8], CounterState); 32]> = SmallVec::new();
        for _ in 0..header.count {
            let key = reader.bytes()?;
            states.push((key, reader.state()?));
        }
        let guard = self.replica_ref(header.shard);
        let refused = match guard.as_deref().and_then(Option::as_ref) {
            None => Some(ApplyRefusal::NotReplica),
            Some(replica) => {
                match replica.apply(
                    &self.store,
                    header.term,
                    header.stamped_ms,
                    states.iter().copied(),
                ) {
                    Ok(dropped) => {
                        if let Some(disk) = &self.disk {
                            disk.log_states(states.iter().copied());
                        }
                        DataStats::add(&self.stats.states_applied, u64::from(header.count));
                        if dropped > 0 {
                            self.note_dropped_at_cap(header.shard, dropped);
                        }
                        None
                    }
                    Err(refusal) => Some(refusal),
                }
            }
        };
        if refused.is_some() {
            DataStats::add(&self.stats.states_refused, u64::from(header.count));
        }
        Ok((header.round, header.shard, refused))
    }

    fn note_dropped_at_cap(&self, shard: u32, dropped: usize) {
        let before = self
            .stats
            .dropped_at_cap
            .fetch_add(dropped as u64, Ordering::Relaxed);
        if before / 10_000 != (before + dropped as u64) / 10_000 || before == 0 {
            tracing::warn!(
                shard,
                dropped = before + dropped as u64,
                "live-key cap reached: replicated counters dropped on this replica"
            );
        }
    }

    /// The live counters of `shard` held here.
    pub fn counters_of(&self, shard: u32) -> CounterList {
        let mut counters = Vec::new();
        let now_ms = self.clock.now_ms();
        self.store.for_each_live(now_ms, |key, state| {
            if self.placement.shard_of(key) == shard {
                counters.push((key.to_vec(), state));
            }
        });
        counters
    }

    /// Merges counters a leader of `term` sent to catch this replica up.
    pub fn apply_sync(
        &self,
        shard: u32,
        term: u64,
        stamped_ms: u64,
        counters: &CounterList,
    ) -> Result<(), ApplyRefusal> {
        let replica = self.replica(shard).ok_or(ApplyRefusal::NotReplica)?;
        let unseen = self
            .disk
            .as_ref()
            .map(|_| NodeDisk::unseen(&self.store, self.clock.now_ms(), counters));
        let dropped = replica.apply(
            &self.store,
            term,
            stamped_ms,
            counters.iter().map(|(key, state)| (key.as_slice(), *state)),
        )?;
        if dropped > 0 {
            self.note_dropped_at_cap(shard, dropped);
        }
        if let (Some(disk), Some(unseen)) = (&self.disk, unseen) {
            disk.log_states(unseen.into_iter());
            disk.write_pending();
        }
        DataStats::add(&self.stats.states_applied, counters.len() as u64);
        Ok(())
    }

    /// Appends a forwarded op's wire form (for batches being built).
    pub fn encode_op(out: &mut Vec<u8>, op: &OpView<'_>) {
        put_op(out, op);
    }

    /// Milliseconds since this data plane started (for liveness math).
    pub fn uptime_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frames_scratch_keeps_what_it_grew_to_up_to_its_bound() {
        let mut scratch = FrameScratch::default();
        scratch.answers.extend_from_slice(&[1; 1000]);
        scratch.keys.extend_from_slice(&[2; 100]);
        scratch
            .answered
            .push((1, 2, WireDecision::Full { live_keys_max: 3 }));
        scratch.clear();
        assert!(scratch.answers.is_empty() && scratch.keys.is_empty());
        assert!(scratch.answered.is_empty());
        assert!(
            scratch.answers.capacity() >= 1000,
            "kept for the next frame"
        );
        // A burst's frame: given back rather than kept by the thread.
        scratch.answers.reserve(FRAME_SCRATCH_KEPT_BYTES_MAX + 1);
        scratch.clear();
        assert_eq!(scratch.answers.capacity(), 0);
        assert_eq!(scratch.keys.capacity(), 0);
    }
}
