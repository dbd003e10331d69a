//! The replicator of one node: closes the open round of states this node
//! decided as a shard's leader, sends each shard's section to the shard's
//! other replicas in one frame per peer, times out sections that did not
//! commit, and releases the answers waiting for them (strict mode) once
//! they commit or fail. It is an `impl` block of [`DataPlane`], kept apart
//! from the inbound side (`dataplane.rs`) so each file has one job.

use super::data_frames::{begin_counted, end_counted, put_decision, put_varint, tag};
use super::dataplane::{replica_in, DataPlane, DataStats};
use super::forward::SlotBoard;
use super::outbox::PeerOut;
use super::peer_protocol::{ACK_ON_ASK_MINOR, RELAY_ANSWERS_MINOR, ROUND_ANSWERS_MINOR};
use super::rounds::{Ended, RoundAnswered, SectionEnd, SentSection, Waiter};
use super::wire::WireDecision;
use super::NodeId;
use smallvec::SmallVec;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The answers a release has gathered for one read batch's board (its
/// waiters come together), filled in under one lock of the board.
#[derive(Default)]
struct BoardFill {
    board: Option<Arc<SlotBoard>>,
    answers: SmallVec<[(u32, WireDecision); 16]>,
}

impl BoardFill {
    fn add(&mut self, board: Arc<SlotBoard>, slot: u32, answer: WireDecision) {
        if !self.board.as_ref().is_some_and(|b| Arc::ptr_eq(b, &board)) {
            self.flush();
            self.board = Some(board);
        }
        self.answers.push((slot, answer));
    }

    fn flush(&mut self) {
        if let Some(board) = self.board.take() {
            board.fill_many(self.answers.drain(..));
        }
    }
}

/// What the replicator keeps from round to round: the lists a round is
/// built in, emptied and reused (allocating them for every round cost
/// about 1 % of a node's CPU at small rounds; docs/benchmarks.md,
/// "Thirty-third round").
#[derive(Default)]
pub(super) struct RoundScratch {
    records: Vec<SentSection>,
    sends: Vec<PeerSends>,
    round_answers: Vec<u8>,
    /// Per section: does the leader wait on its acks (see [`acks_awaited`])?
    acks_awaited: Vec<bool>,
    ended: Vec<Ended>,
}

/// Does a leader wait on a follower's ack of a section whose waiters
/// (after those answered with the round were taken out) are `waiters`,
/// relayed by `relay` if any? For its own clients' hits, and for forwarded
/// hits whose answers no follower carries: the section's commit answers
/// them. Hits answered with the round or relayed are not waited on.
fn acks_awaited(waiters: &[Waiter], relay: Option<NodeId>) -> bool {
    waiters
        .iter()
        .any(|w| matches!(w, Waiter::Local { .. }) || relay.is_none())
}

/// Whether a follower's copy of a section must leave at once, or may go
/// with the next frame its link writes anyway (at the latest its next
/// beat). A section whose commit one follower drives (the hits it forwarded
/// ride with the round, or it relays the answers) and that the leader
/// waits on for nothing else reaches its other followers lazily: their
/// copy is the third replica, not part of the commit anyone waits for.
/// Without such a follower (fast mode, or acks waited on) every copy goes
/// at once.
fn copy_urgent(record: &SentSection, acks_awaited: bool, peer: NodeId) -> bool {
    let mut drivers = record
        .with_round
        .iter()
        .map(|a| a.peer)
        .chain(record.relay)
        .peekable();
    acks_awaited || drivers.peek().is_none() || drivers.any(|driver| driver == peer)
}

/// Bytes of lazily sent sections an outbox may hold before its link is
/// woken anyway: a follower that only ever gets lazy copies gets them in
/// frames of about this size, not a beat's worth at once.
const LAZY_OUTBOX_BYTES_MAX: usize = 64 * 1024;

/// The answers one release sends a node that forwarded hits.
struct RemoteAnswers {
    peer: NodeId,
    /// The incarnation of the node that forwarded them.
    boot: u64,
    /// An ANSWERS section, begun at `at`.
    bytes: Vec<u8>,
    at: usize,
    count: u32,
    /// Every answer in it was relayed by a follower that holds its section
    /// (`Ended::relayed`): sent with the link's next write, not waking it.
    relayed: bool,
}

/// A round section's peers, each with where the answers it gets with the
/// section lie in the round's answer bytes (empty: none), and whether its
/// copy must leave at once ([`copy_urgent`]).
type PeerSends = SmallVec<[(NodeId, Range<usize>, bool); 4]>;

/// A leader lets followers hold the acks it does not wait on (until their
/// next frame to it, or their next beat), and queues the copies no commit
/// waits on ([`copy_urgent`]) for its links' next frames, only when its
/// commit timeout is at least this many beats: else a held ack or copy
/// could time its section out.
const LAZY_ACK_TIMEOUT_BEATS: u64 = 4;

/// Room for a release's answers to one node when its first is added.
const REMOTE_ANSWERS_BYTES_INITIAL: usize = 512;

impl DataPlane {
    /// Answers the waiters of sections that ended (`ended` is left empty,
    /// for the caller to reuse); in fast mode a section that failed makes
    /// its leader confirm its leadership again.
    pub fn release(&self, ended: &mut Vec<Ended>) {
        if ended.is_empty() {
            return;
        }
        // Per forwarding node (and its incarnation): its ANSWERS section, the
        // section's start, and how many answers it holds. A few peers: a
        // linear search, starting from the last one found.
        let mut remote: SmallVec<[RemoteAnswers; 4]> = SmallVec::new();
        let mut last_remote = 0;
        let mut local = BoardFill::default();
        // The sections' emptied waiter lists, given back to the round
        // builder for new sections.
        let mut emptied: SmallVec<[Vec<Waiter>; 16]> = SmallVec::new();
        let replicas = self.replicas();
        for mut section in ended.drain(..) {
            if let Some(replica) = replica_in(&replicas, section.shard) {
                DataStats::add(&replica.stats.sections_ended, 1);
            }
            match &section.end {
                SectionEnd::Committed => DataStats::add(&self.stats.sections_committed, 1),
                end => {
                    DataStats::add(&self.stats.sections_failed, 1);
                    if let Some(replica) = replica_in(&replicas, section.shard) {
                        if let SectionEnd::Superseded(_) = end {
                            replica.unready();
                            replica.kick.notify_one();
                        } else if !self.strict() {
                            replica.replication_failed.store(true, Ordering::Release);
                            replica.unready();
                            replica.kick.notify_one();
                        }
                    }
                    tracing::debug!(
                        shard = section.shard,
                        term = section.term,
                        ?end,
                        "round section failed"
                    );
                }
            }
            for waiter in section.waiters.drain(..) {
                match waiter {
                    Waiter::Local {
                        board,
                        slot,
                        decision,
                    } => {
                        // Waiters of one read batch come together: one lock.
                        local.add(board, slot, section.end.answer(section.shard, decision));
                    }
                    Waiter::Remote {
                        peer,
                        boot,
                        batch,
                        index,
                        decision,
                        lease,
                    } => {
                        let found = match remote.get(last_remote) {
                            Some(r) if (r.peer, r.boot) == (peer, boot) => Some(last_remote),
                            _ => remote.iter().position(|r| (r.peer, r.boot) == (peer, boot)),
                        };
                        last_remote = found.unwrap_or_else(|| {
                            let mut bytes = Vec::with_capacity(REMOTE_ANSWERS_BYTES_INITIAL);
                            let at = begin_counted(&mut bytes, tag::ANSWERS, &[boot]);
                            remote.push(RemoteAnswers {
                                peer,
                                boot,
                                bytes,
                                at,
                                count: 0,
                                relayed: true,
                            });
                            remote.len() - 1
                        });
                        let answers = &mut remote[last_remote];
                        answers.relayed &= section.relayed;
                        put_varint(&mut answers.bytes, batch);
                        put_varint(&mut answers.bytes, u64::from(index));
                        put_decision(
                            &mut answers.bytes,
                            &section.end.answer_leased(section.shard, decision, lease),
                        );
                        answers.count += 1;
                    }
                }
            }
            if emptied.len() < emptied.inline_size() {
                emptied.push(section.waiters);
            }
        }
        local.flush();
        if !emptied.is_empty() {
            self.round.lock().give_waiters(emptied);
        }
        for mut answers in remote {
            end_counted(&mut answers.bytes, answers.at, answers.count);
            let out = self.out(answers.peer);
            if out.peer_boot() != answers.boot {
                continue; // The peer restarted since: nobody waits for these.
            }
            if out
                .append(|body| body.extend_from_slice(&answers.bytes))
                .is_some()
                && !answers.relayed
            {
                out.wake.notify_one();
            }
        }
    }

    /// Does `shard` have states waiting to be sent or committed?
    pub fn replicating(&self, shard: u32) -> bool {
        self.round.lock().holds(shard) || self.in_flight.lock().holds(shard)
    }

    /// Sends `shard`'s followers, now, the copies of its sections queued
    /// for them lazily ([`copy_urgent`]), and asks those that may hold
    /// their acks (peer protocol 2.5) to send them at once: a bare
    /// `ACK_NOW`. So a handover's wait for its last rounds to commit does
    /// not last until the links' next beats.
    pub fn ask_acks(&self, shard: u32) {
        let replicas = self.replicas();
        let Some(replica) = replica_in(&replicas, shard) else {
            return;
        };
        for &peer in &replica.config().targets {
            let Some(out) = self.existing_out(peer).filter(|o| o.connected()) else {
                continue;
            };
            if out.speaks_minor(ACK_ON_ASK_MINOR) {
                // A full outbox wakes its link anyway.
                let _ = out.append(|body| body.push(tag::ACK_NOW));
            }
            out.wake.notify_one();
        }
    }

    /// Closes the open round and sends it: one section per shard to each
    /// of the shard's other replicas.
    fn send_round(&self, scratch: &mut RoundScratch) {
        let mut sections = self.round.lock().take();
        if sections.is_empty() {
            return;
        }
        let stamped_ms = self.clock.now_ms();
        let mut states = 0u64;
        let RoundScratch {
            records,
            sends,
            round_answers,
            acks_awaited: awaited,
            ended,
        } = scratch;
        // A follower may hold an ack the leader does not wait on, and a copy
        // may wait in an outbox, for up to a beat: only while that is well
        // within the commit timeout.
        let lazy_acks =
            self.settings.commit_timeout_ms >= LAZY_ACK_TIMEOUT_BEATS * self.settings.beat_ms;
        // The round's peers, each looked up once, with its outbox if its
        // link is up (a round reaches a few peers in many sections).
        let mut links: SmallVec<[(NodeId, Option<Arc<PeerOut>>); 4]> = SmallVec::new();
        let replicas = self.replicas();
        for section in &mut sections {
            states += u64::from(section.count);
            let config = match replica_in(&replicas, section.shard) {
                Some(replica) => {
                    DataStats::add(&replica.stats.sections_sent, 1);
                    DataStats::add(&replica.stats.states_sent, u64::from(section.count));
                    replica.config()
                }
                None => Arc::default(),
            };
            let mut waiters = std::mem::take(&mut section.waiters);
            let mut sent_to: SmallVec<[NodeId; 4]> = SmallVec::new();
            let mut with_round: SmallVec<[RoundAnswered; 2]> = SmallVec::new();
            let mut relay: Option<NodeId> = None;
            for &peer in &config.targets {
                let at = match links.iter().position(|(p, _)| *p == peer) {
                    Some(at) => at,
                    None => {
                        let out = self.existing_out(peer).filter(|o| o.connected());
                        links.push((peer, out));
                        links.len() - 1
                    }
                };
                let Some(out) = &links[at].1 else {
                    continue;
                };
                sent_to.push(peer);
                if !self.strict() || !config.committed(self.me, &[peer]) {
                    continue;
                }
                // This node and `peer` holding the states commit them: the
                // hits `peer` forwarded are answered with the round, and
                // `peer` may relay the answers of nodes that get no section.
                if !waiters.is_empty() && out.speaks_minor(ROUND_ANSWERS_MINOR) {
                    with_round.extend(RoundAnswered::take(&mut waiters, peer, out.peer_boot()));
                }
                if relay.is_none() && out.speaks_minor(RELAY_ANSWERS_MINOR) {
                    relay = Some(peer);
                }
            }
            // Hits still waiting were forwarded by nodes that got no section
            // (they hold no replica of the shard): their answers go to the
            // relaying follower, to send on once it applied the section.
            if !waiters.iter().any(|w| matches!(w, Waiter::Remote { .. })) {
                relay = None;
            }
            records.push(SentSection {
                shard: section.shard,
                term: section.term,
                config,
                sent_to,
                waiters,
                with_round,
                relay,
            });
        }
        // This node's own states are written before any replica can
        // acknowledge them (the leader counts itself in the majority).
        if let Some(disk) = &self.disk {
            for section in &sections {
                disk.log_section(section.count, &section.bytes);
            }
            disk.write_pending();
        }
        let mut touched: SmallVec<[&PeerOut; 4]> = SmallVec::new();
        {
            // Record before appending: no ack can precede its round.
            let mut flight = self.in_flight.lock();
            let round = flight.next_round();
            // Per section, its peers, and where the answers each one gets
            // with it (a ROUND_ANSWERS section, if any) lie in
            // `round_answers`.
            round_answers.clear();
            awaited.clear();
            awaited.extend(
                records
                    .iter()
                    .map(|r| !lazy_acks || acks_awaited(&r.waiters, r.relay)),
            );
            sends.clear();
            sends.extend(records.iter().zip(awaited.iter()).map(|(r, &awaited)| {
                r.sent_to
                    .iter()
                    .map(|&peer| {
                        let at = round_answers.len();
                        if let Some(answered) = r.with_round.iter().find(|a| a.peer == peer) {
                            self.put_round_answers(round_answers, round, r.shard, answered);
                        }
                        if r.relay == Some(peer) {
                            put_relay_answers(round_answers, round, r.shard, &r.waiters);
                        }
                        // `awaited` holds when acks may not wait (`lazy_acks`
                        // off): every copy is then urgent too.
                        (peer, at..round_answers.len(), copy_urgent(r, awaited, peer))
                    })
                    .collect::<PeerSends>()
            }));
            DataStats::add(&self.stats.round_sections, records.len() as u64);
            flight.record(Instant::now(), records.drain(..), ended);
            drop(flight);
            // Each peer's sections in one append; a peer whose outbox is
            // full does not get the round, and must not count as holding it.
            let mut unsent: SmallVec<[NodeId; 4]> = SmallVec::new();
            for (peer, out) in &links {
                let Some(out) = out else { continue };
                let asks = out.speaks_minor(ACK_ON_ASK_MINOR);
                let mut wake = false;
                let appended = out.append(|body| {
                    let sections = sends.iter().zip(&sections).zip(awaited.iter());
                    for ((peers, section), &awaited) in sections {
                        let Some((_, answers, urgent)) = peers.iter().find(|(p, ..)| p == peer)
                        else {
                            continue;
                        };
                        wake |= *urgent;
                        if awaited && asks {
                            body.push(tag::ACK_NOW);
                        }
                        body.push(tag::ROUND);
                        put_varint(body, round);
                        put_varint(body, stamped_ms);
                        put_varint(body, u64::from(section.shard));
                        put_varint(body, section.term);
                        put_varint(body, u64::from(section.count));
                        body.extend_from_slice(&section.bytes);
                        body.extend_from_slice(&round_answers[answers.clone()]);
                    }
                    wake |= body.len() > LAZY_OUTBOX_BYTES_MAX;
                });
                if appended.is_some() {
                    if wake {
                        touched.push(out);
                    }
                } else {
                    unsent.push(*peer);
                }
            }
            if !unsent.is_empty() {
                let mut flight = self.in_flight.lock();
                for peer in unsent {
                    tracing::debug!(peer, round, "round not queued: the peer's outbox is full");
                    flight.not_sent(round, peer, ended);
                }
            }
        }
        self.round.lock().recycle(sections);
        DataStats::add(&self.stats.rounds, 1);
        DataStats::add(&self.stats.states_replicated, states);
        for out in touched {
            out.wake.notify_one();
        }
        self.release(ended);
    }

    /// Appends the ROUND_ANSWERS section of `answered` (the hits its
    /// peer forwarded, in `shard`'s section of round `round`).
    fn put_round_answers(
        &self,
        out: &mut Vec<u8>,
        round: u64,
        shard: u32,
        answered: &RoundAnswered,
    ) {
        let count = put_committed_answers(
            out,
            tag::ROUND_ANSWERS,
            &[answered.boot, round, u64::from(shard)],
            shard,
            answered.waiters.iter(),
        );
        DataStats::add(&self.stats.round_answers, u64::from(count));
    }

    /// The replicator: closes and sends rounds (at once in strict mode;
    /// in fast mode once the open round is `replication_interval_ms` old or
    /// full), and times out sections not committed in time.
    pub async fn run_replicator(self: Arc<Self>) {
        let commit_timeout = Duration::from_millis(self.settings.commit_timeout_ms.max(1));
        let interval = Duration::from_millis(self.settings.replication_interval_ms.max(1));
        let mut last_forward_sweep = Instant::now();
        let mut scratch = RoundScratch::default();
        loop {
            let now = Instant::now();
            let mut wake_at: Option<Instant> = None;
            let ready = {
                let round = self.round.lock();
                match round.opened_at {
                    None => false,
                    Some(_) if self.strict() => true,
                    Some(_) if round.states() >= self.settings.batch_ops_max => true,
                    Some(opened) => {
                        let due = opened + interval;
                        if due <= now {
                            true
                        } else {
                            wake_at = Some(due);
                            false
                        }
                    }
                }
            };
            if ready {
                // Let the tasks woken with this one (frame readers deciding
                // forwarded hits) add their states first: one round, one
                // frame per peer, carries them all.
                super::cadence::behind_woken_tasks().await;
                self.send_round(&mut scratch);
            }
            let ended = &mut scratch.ended;
            let oldest = {
                let mut flight = self.in_flight.lock();
                flight.expire(now, commit_timeout, ended);
                flight.oldest()
            };
            self.release(ended);
            if let Some(oldest) = oldest {
                let due = oldest + commit_timeout;
                wake_at = Some(wake_at.map_or(due, |w| w.min(due)));
            }
            if now.saturating_duration_since(last_forward_sweep) > Duration::from_secs(1) {
                self.expire_forwards(now);
                last_forward_sweep = now;
            }
            if ready {
                continue; // More may have arrived while sending: look again.
            }
            match wake_at {
                Some(at) => {
                    let _ = tokio::time::timeout_at(at.into(), self.replicate.notified()).await;
                }
                None => self.replicate.notified().await,
            }
        }
    }
}

/// Appends a section of `tag` with the fields `header`, then `waiters`'
/// answers as committed (`(batch, index, decision)*`, counted); returns
/// how many.
fn put_committed_answers<'a>(
    out: &mut Vec<u8>,
    tag: u8,
    header: &[u64],
    shard: u32,
    waiters: impl Iterator<Item = &'a Waiter>,
) -> u32 {
    let at = begin_counted(out, tag, header);
    let mut count = 0u32;
    for waiter in waiters {
        if let Waiter::Remote {
            batch,
            index,
            decision,
            lease,
            ..
        } = waiter
        {
            put_varint(out, *batch);
            put_varint(out, u64::from(*index));
            let answer = SectionEnd::Committed.answer_leased(shard, *decision, *lease);
            put_decision(out, &answer);
            count += 1;
        }
    }
    end_counted(out, at, count);
    count
}

/// Appends a RELAY_ANSWERS section per node (and incarnation) that
/// forwarded hits among `waiters`, for the follower that gets it to send
/// on (`rounds.rs`, "Answers a follower relays").
fn put_relay_answers(out: &mut Vec<u8>, round: u64, shard: u32, waiters: &[Waiter]) {
    let mut forwarders: SmallVec<[(NodeId, u64); 4]> = SmallVec::new();
    for waiter in waiters {
        if let Waiter::Remote { peer, boot, .. } = waiter {
            if !forwarders.contains(&(*peer, *boot)) {
                forwarders.push((*peer, *boot));
            }
        }
    }
    for (to, boot) in forwarders {
        put_committed_answers(
            out,
            tag::RELAY_ANSWERS,
            &[to, boot, round, u64::from(shard)],
            shard,
            waiters.iter().filter(
                |w| matches!(w, Waiter::Remote { peer, boot: b, .. } if (*peer, *b) == (to, boot)),
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Decision;

    const OK: Decision = Decision {
        allowed: true,
        credit: 1,
        next_reset_seconds: 60,
    };

    fn forwarded_by(peer: NodeId) -> Waiter {
        Waiter::Remote {
            peer,
            boot: 1,
            batch: 1,
            index: 0,
            decision: OK.into(),
            lease: 0,
        }
    }

    #[test]
    fn a_leader_asks_for_acks_at_once_only_for_the_hits_it_answers_on_commit() {
        // Nothing left to answer (every forwarded hit rode with the round).
        assert!(!acks_awaited(&[], None));
        // Forwarded hits whose answers a follower relays: not waited on.
        assert!(!acks_awaited(&[forwarded_by(4)], Some(3)));
        // Forwarded hits the leader answers once the section commits.
        assert!(acks_awaited(&[forwarded_by(4)], None));
        // Its own clients' hits, relay or not.
        let local = Waiter::Local {
            board: Arc::new(SlotBoard::empty()),
            slot: 0,
            decision: OK.into(),
        };
        assert!(acks_awaited(&[forwarded_by(4), local], Some(3)));
    }

    /// A section sent to followers 2 and 3, answered with the round to
    /// `answered_by`, relayed by `relay`.
    fn sent(answered_by: &[NodeId], relay: Option<NodeId>) -> SentSection {
        SentSection {
            shard: 0,
            term: 1,
            config: Arc::default(),
            sent_to: smallvec::smallvec![2, 3],
            waiters: Vec::new(),
            with_round: answered_by
                .iter()
                .map(|&peer| RoundAnswered {
                    peer,
                    boot: 1,
                    waiters: vec![forwarded_by(peer)],
                })
                .collect(),
            relay,
        }
    }

    #[test]
    fn only_the_follower_that_drives_a_commit_gets_its_copy_at_once() {
        // Node 2's forwarded hits ride with the round: node 2 applying it
        // commits it, and node 3's copy may wait for its link's next write.
        let answered_by_2 = sent(&[2], None);
        assert!(copy_urgent(&answered_by_2, false, 2));
        assert!(!copy_urgent(&answered_by_2, false, 3));
        // Both forwarded hits of the shard: both drive it.
        let answered_by_both = sent(&[2, 3], None);
        assert!(copy_urgent(&answered_by_both, false, 2));
        assert!(copy_urgent(&answered_by_both, false, 3));
        // Node 3 relays the answers of a node without a replica.
        let relayed_by_3 = sent(&[], Some(3));
        assert!(copy_urgent(&relayed_by_3, false, 3));
        assert!(!copy_urgent(&relayed_by_3, false, 2));
        // The leader waits on acks (its own clients' hits): every copy.
        assert!(copy_urgent(&answered_by_2, true, 3));
        // No follower drives it (fast mode): every copy, as before.
        let undriven = sent(&[], None);
        assert!(copy_urgent(&undriven, false, 2));
        assert!(copy_urgent(&undriven, false, 3));
    }
}
