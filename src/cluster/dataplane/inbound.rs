//! Handling a peer's data frame on this node (the "inbound frames" of the
//! data plane, `dataplane.rs`): forwarded hits decided on this node's store
//! as their shard's leader, round sections applied through the shard's
//! fence, acknowledgements and answers releasing what waits for them, all
//! inline and in the order the sections arrive. The store lines a frame will
//! touch are prefetched first, and the buffers handling writes are kept by
//! the thread from frame to frame.

use super::{replica_in, DataPlane, DataStats, DecidedState, ReplicaTable};
use crate::cluster::data_frames::{
    begin_counted, end_counted, put_decision, put_varint, skim_keys, tag, Ack, BatchAnswersHeader,
    BatchAnswersWriter, FrameError, OpView, Reader, RelayAnswersHeader, RoundAnswersHeader,
    RoundHeader,
};
use crate::cluster::outbox::PeerOut;
use crate::cluster::peer_protocol::{ACK_ON_ASK_MINOR, BATCH_ANSWERS_MINOR};
use crate::cluster::replica::LocalDecision;
use crate::cluster::rounds::{Ended, Waiter};
use crate::cluster::wire::{ApplyRefusal, ShardRefusal, WireDecision};
use crate::cluster::NodeId;
use crate::limiter::CounterState;
use crate::store::StoreFull;
use smallvec::SmallVec;
use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::time::Instant;

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
    /// The states of the round section being applied: each key's place in
    /// the frame, and the state (fast mode's sections carry about a
    /// hundred, which a list on the stack held by allocating).
    round_states: Vec<(usize, usize, CounterState)>,
    /// Sections the frame's acks ended, for their waiters to be answered.
    ended: Vec<Ended>,
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
                * size_of::<(u64, u32, WireDecision)>()
            + self.round_states.capacity() * size_of::<(usize, usize, CounterState)>()
            + self.ended.capacity() * size_of::<Ended>();
        if kept > FRAME_SCRATCH_KEPT_BYTES_MAX {
            *self = FrameScratch::default();
            return;
        }
        self.answers.clear();
        self.decided.clear();
        self.keys.clear();
        self.answered.clear();
        self.answered_with_rounds.clear();
        self.round_states.clear();
        self.ended.clear();
    }
}

/// Answers a leader handed this node with a round section it applied, to
/// send on to the node that forwarded their hits (`rounds.rs`, "Answers a
/// follower relays"): that node, its incarnation, and the answers'
/// count and bytes, as the leader wrote them.
#[derive(Clone, Copy)]
struct Relay<'a> {
    to: NodeId,
    boot: u64,
    count: u32,
    entries: &'a [u8],
}

/// Most bytes a thread keeps in its [`FrameScratch`] between frames.
const FRAME_SCRATCH_KEPT_BYTES_MAX: usize = 1 << 20;

thread_local! {
    static FRAME_SCRATCH: RefCell<FrameScratch> = RefCell::new(FrameScratch::default());
}

impl DataPlane {
    /// Handles one data frame from the peer of `out` (its outbox, which its
    /// connection looks up once), incarnation `from_boot`, inline. A frame
    /// from an incarnation older than one already seen is stale (the
    /// process restarted since) and is dropped whole.
    pub fn on_data_frame(
        &self,
        out: &PeerOut,
        from_boot: u64,
        body: &[u8],
    ) -> Result<(), FrameError> {
        let from = out.peer;
        if from_boot < out.peer_boot() {
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
            round_states,
            ended,
        } = &mut scratch;
        // Answers go back a section per batch to a peer that reads them so
        // (peer protocol 2.2), else in one `ANSWERS` section for the frame.
        let per_batch = out.speaks_minor(BATCH_ANSWERS_MINOR);
        let mut answer_count = 0u32;
        // The frame's forwarded hits, and those answered in batch-answers
        // sections: counted once for the frame, not per section.
        let (mut forwarded_here, mut batch_answered) = (0u64, 0u64);
        let mut answers_at = None;
        // The batch-answers section being written, if a batch's reading
        // stopped inside it (a malformed frame): dropped unfinished.
        let mut open_batch: Option<BatchAnswersWriter> = None;
        // The round section just read, `(round, shard)`, if it was applied.
        let mut applied: Option<(u64, u32)> = None;
        // What this frame's round sections tell their leader: the highest
        // round, and the sections refused (one ack for the frame).
        let mut acked_upto: Option<u64> = None;
        let mut refused: SmallVec<[(u64, u32, ApplyRefusal); 2]> = SmallVec::new();
        // Whether the leader asked for the ack at once (`tag::ACK_NOW`); one
        // that talks a minor without asks gets every ack at once.
        let acks_at_once = !out.speaks_minor(ACK_ON_ASK_MINOR);
        let mut asked = false;
        // Answers to relay, once what this frame applied is written: the
        // node they are for, its incarnation, their count and bytes.
        let mut relays: SmallVec<[Relay<'_>; 2]> = SmallVec::new();
        let now_ms = self.clock.now_ms();
        let replicas = self.replicas();
        let result = (|| -> Result<(), FrameError> {
            while !reader.is_empty() {
                let applied_before = applied.take();
                match reader.u8()? {
                    tag::FORWARD => {
                        let batch = reader.varint()?;
                        let count = reader.count(4)?;
                        forwarded_here += u64::from(count);
                        let mut op = OpView::EMPTY;
                        for index in 0..count {
                            reader.op_into(&mut op)?;
                            let answer = self.decide_forwarded(
                                &replicas,
                                (from, from_boot),
                                batch,
                                index,
                                &op,
                                now_ms,
                                keys,
                                decided,
                            );
                            let Some(answer) = answer else { continue };
                            if per_batch {
                                open_batch
                                    .get_or_insert_with(|| {
                                        BatchAnswersWriter::begin(answers, from_boot, batch)
                                    })
                                    .put(answers, index, &answer);
                                continue;
                            }
                            answers_at.get_or_insert_with(|| {
                                begin_counted(answers, tag::ANSWERS, &[from_boot])
                            });
                            put_varint(answers, batch);
                            put_varint(answers, u64::from(index));
                            put_decision(answers, &answer);
                            answer_count += 1;
                        }
                        if let Some(section) = open_batch.take() {
                            batch_answered += u64::from(section.end(answers));
                        }
                    }
                    tag::BATCH_ANSWERS => {
                        let header = BatchAnswersHeader::read(&mut reader)?;
                        // Answers meant for this node's previous life are
                        // stepped over, never taken.
                        if header.boot == self.boot {
                            self.take_batch_answers(from, header.batch, header.entries)?;
                        }
                    }
                    tag::ANSWERS => {
                        // Answers meant for this node's previous life are
                        // read past, never taken.
                        let mine = reader.varint()? == self.boot;
                        let count = reader.count(3)?;
                        reader.answers_into(count, mine, answered)?;
                        self.take_answers(answered);
                    }
                    tag::ROUND => {
                        let (round, shard, refusal) =
                            self.apply_round(&replicas, body, &mut reader, round_states)?;
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
                        reader.answers_into(header.count, holds, answered_with_rounds)?;
                        // Answers to relay may follow for the same section.
                        applied = applied_before;
                    }
                    tag::RELAY_ANSWERS => {
                        let RelayAnswersHeader { to, answers } =
                            RelayAnswersHeader::read(&mut reader)?;
                        let entries = reader.answers_span(answers.count)?;
                        if applied_before == Some((answers.round, answers.shard)) && to != self.me {
                            relays.push(Relay {
                                to,
                                boot: answers.boot,
                                count: answers.count,
                                entries,
                            });
                        }
                        applied = applied_before;
                    }
                    tag::ACK => {
                        let ack = Ack::read(&mut reader)?;
                        if ack.boot == self.boot {
                            self.in_flight
                                .lock()
                                .ack(from, ack.upto, &ack.refused, ended);
                        }
                    }
                    tag::BEAT => {}
                    tag::ACK_NOW => asked = true,
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
        self.relay_answers(&relays);
        if let Some(upto) = acked_upto {
            out.record_ack(from_boot, upto, &refused);
            // An ack not asked for goes with the next frame to the leader,
            // or the link's next beat; a refusal the leader hears at once.
            if acks_at_once || asked || !refused.is_empty() {
                out.wake.notify_one();
            }
        } else if asked {
            // A bare ask (a handover waiting on its last rounds): the acks
            // this link holds go now.
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
        if let Some(section) = open_batch {
            section.abandon(answers);
        }
        if forwarded_here > 0 {
            DataStats::add(&self.stats.forwards_decided, forwarded_here);
            DataStats::add(&self.stats.batch_answers, batch_answered);
        }
        if let Some(at) = answers_at {
            end_counted(answers, at, answer_count);
        }
        if !answers.is_empty() && out.append(|body| body.extend_from_slice(answers)).is_some() {
            out.wake.notify_one();
        }
        self.release(ended);
        scratch.clear();
        FRAME_SCRATCH.with_borrow_mut(|kept| *kept = scratch);
        result
    }

    /// Sends on the answers a leader relayed through this node (`rounds.rs`,
    /// "Answers a follower relays"), each as an `ANSWERS` section to the
    /// node that forwarded the hits, if its link is up (else that node gets
    /// the leader's own answers).
    fn relay_answers(&self, relays: &[Relay<'_>]) {
        let mut woken: SmallVec<[NodeId; 4]> = SmallVec::new();
        for &Relay {
            to,
            boot,
            count,
            entries,
        } in relays
        {
            let Some(out) = self.existing_out(to).filter(|out| out.connected()) else {
                continue;
            };
            let appended = out.append(|body| {
                let at = begin_counted(body, tag::ANSWERS, &[boot]);
                body.extend_from_slice(entries);
                end_counted(body, at, count);
            });
            if appended.is_some() {
                DataStats::add(&self.stats.answers_relayed, u64::from(count));
                if !woken.contains(&to) {
                    woken.push(to);
                    out.wake.notify_one();
                }
            }
        }
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

    /// Fills the board of forwarded batch `batch` with a batch-answers
    /// section's entries from `from` (see [`DataPlane::take_answers`]); a
    /// batch no longer waiting (answered, timed out), or not forwarded to
    /// `from`, is stepped over undecoded.
    fn take_batch_answers(
        &self,
        from: NodeId,
        batch: u64,
        entries: &[u8],
    ) -> Result<(), FrameError> {
        let mut forwards = self.forwards.lock();
        let Some(wait) = forwards.get_mut(&batch).filter(|wait| wait.peer == from) else {
            return Ok(());
        };
        if wait.answer_entries(entries)? {
            forwards.remove(&batch);
        }
        Ok(())
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
        // whose address is read from its stripe's slot hint (a dense array
        // that is usually cached).
        // The hashes go in a buffer kept by the thread: no allocation per
        // frame, and nothing to clear (zeroing a 32 KiB array on the stack
        // for each frame cost five nodes' small frames 66 ns per hit).
        thread_local! {
            static HASHES: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
        }
        HASHES.with_borrow_mut(|hashes| {
            hashes.clear();
            skim_keys(body, |key| {
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
        replicas: &ReplicaTable,
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
        let Some(replica) = replica_in(replicas, shard) else {
            return Some(WireDecision::Retry {
                shard,
                why: ShardRefusal::NotReplicated(self.me),
            });
        };
        // A lease within this node's cap (an ask is sent only to a node
        // that talks the protocol of leases); in strict mode it goes with
        // the answer once the state counting it commits.
        let lease_max = if op.lease_wanted > 0 && self.leasing() {
            op.lease_wanted.min(self.settings.lease_credits_max)
        } else {
            0
        };
        let (decision, lease) = replica.decide_leasing(&self.store, op, lease_max, now_ms);
        if lease > 0 {
            // Counted when granted (in strict mode its answer waits for the
            // commit); one in many forwarded hits.
            DataStats::add(&self.stats.leases_granted, 1);
            DataStats::add(&self.stats.lease_credits_granted, u64::from(lease));
        }
        match decision {
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
                    lease,
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
                answer_now.then(|| WireDecision::with_lease(decision.into(), lease))
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
        replicas: &ReplicaTable,
        body: &[u8],
        reader: &mut Reader<'_>,
        states: &mut Vec<(usize, usize, CounterState)>,
    ) -> Result<(u64, u32, Option<ApplyRefusal>), FrameError> {
        let header = RoundHeader::read(reader)?;
        states.clear();
        for _ in 0..header.count {
            let key = reader.bytes()?;
            // Where the key lies in the frame: just before what is left.
            let at = body.len() - reader.remaining() - key.len();
            states.push((at, key.len(), reader.state()?));
        }
        let states = || {
            states
                .iter()
                .map(|&(at, len, state)| (&body[at..at + len], state))
        };
        let refused = match replica_in(replicas, header.shard) {
            None => Some(ApplyRefusal::NotReplica),
            Some(replica) => {
                match replica.apply(&self.store, header.term, header.stamped_ms, states()) {
                    Ok(dropped) => {
                        if let Some(disk) = &self.disk {
                            disk.log_states(states());
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

    pub(super) fn note_dropped_at_cap(&self, shard: u32, dropped: usize) {
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
