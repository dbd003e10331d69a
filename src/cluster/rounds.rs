//! Replication rounds of the shards this node leads: what was decided since
//! the last round ([`RoundBuilder`]), and the rounds sent but not yet
//! committed ([`InFlight`]).
//!
//! Every state a leader decides goes into the open round, with the answer
//! waiting for it (strict mode) or without (fast mode). The replicator
//! closes the round whenever it runs (so rounds grow with load: one per
//! wake-up, however many hits arrived meanwhile), sends each shard's section
//! to the shard's other replicas in one frame per peer, and records it here.
//! Peers acknowledge rounds cumulatively (`applied everything up to round
//! r`, plus the sections they refused); a section is committed once a
//! majority of every voter set holds it, and its waiters are released.
//! Sections that can no longer commit (refused by a newer leader's voters,
//! replicas unreachable) or that time out release their waiters with the
//! reason. Nothing here does I/O or reads a clock: time is a parameter.
//!
//! **Answers that ride with the round.** When the leader and one replica
//! are a majority of every voter set (three replicas: always), the hits
//! that replica forwarded are answered in the frame that carries their
//! round ([`RoundAnswered`]): once the replica applied the section, both
//! hold the states, so they are committed, and the replica answers its
//! clients without waiting for the leader's commit and a message of its
//! own. The leader keeps those waiters until the replica's ack says how
//! it went: applied, and they are done; refused (or the link broke, or the
//! section timed out first), and they are answered the usual way, with
//! the section's end.
//!
//! **Answers a follower relays.** The hits of a node that holds no replica
//! of the shard (four nodes and more) cannot ride with the round. Their
//! answers go instead, in the same frame as the section, to one follower
//! that with the leader makes a majority ([`SentSection::relay`]); once it
//! has applied the section it sends them on to that node. The leader still
//! answers those hits itself when the section ends, the fallback should the
//! follower not have applied it or not reach the node (duplicates are
//! dropped: a forwarded op takes its first answer). When the follower
//! holds the section ([`Ended::relayed`]), that fallback goes with the
//! link's next write instead of waking it.

use super::data_frames::{put_bytes, put_state};
use super::replica::ShardConfig;
use super::wire::{Answer, ApplyRefusal, ShardRefusal, WireDecision};
use super::NodeId;
use crate::limiter::CounterState;
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::forward::SlotBoard;

/// Who waits for a state to commit before answering (strict mode).
pub enum Waiter {
    /// A hit of this node's client: slot `slot` of a read batch's board.
    Local {
        board: Arc<SlotBoard>,
        slot: u32,
        decision: Answer,
    },
    /// A hit forwarded by `peer` (incarnation `boot`): op `index` of its
    /// batch `batch`.
    Remote {
        peer: NodeId,
        boot: u64,
        batch: u64,
        index: u32,
        decision: Answer,
        /// Credits of a quota lease granted beside the hit, counted in the
        /// same state (`forward/leases.rs`), sent with its answer once that
        /// state commits; 0: none.
        lease: u32,
    },
}

/// Waiters of a section answered in the frame that carried it to `peer`
/// (the node that forwarded their hits), until `peer` acknowledges the
/// section: applied (they are done) or refused (they are answered with
/// the section's end instead).
pub struct RoundAnswered {
    pub peer: NodeId,
    /// `peer`'s incarnation that forwarded the hits.
    pub boot: u64,
    pub waiters: Vec<Waiter>,
}

impl RoundAnswered {
    /// Takes `peer`'s incarnation `boot`'s remote waiters out of
    /// `waiters`, if there are any.
    pub fn take(waiters: &mut Vec<Waiter>, peer: NodeId, boot: u64) -> Option<RoundAnswered> {
        let taken: Vec<Waiter> = waiters
            .extract_if(.., |w| {
                matches!(w, Waiter::Remote { peer: p, boot: b, .. } if (*p, *b) == (peer, boot))
            })
            .collect();
        (!taken.is_empty()).then_some(RoundAnswered {
            peer,
            boot,
            waiters: taken,
        })
    }
}

/// One shard's states in the open round.
pub struct PendingSection {
    pub shard: u32,
    pub term: u64,
    pub count: u32,
    /// `(key, state)*`, encoded as the data stream carries them.
    pub bytes: Vec<u8>,
    pub waiters: Vec<Waiter>,
}

/// The open round: states decided since the last round was closed.
#[derive(Default)]
pub struct RoundBuilder {
    sections: Vec<PendingSection>,
    /// Section index by shard (`u32::MAX`: none), for the common case of
    /// one term per shard.
    by_shard: Vec<u32>,
    states: usize,
    /// When the first state of this round arrived (fast mode closes a
    /// round once it is `replication_interval_ms` old).
    pub opened_at: Option<Instant>,
    /// Emptied sections kept for their buffers' capacity.
    spare: Vec<PendingSection>,
    /// The list of the round taken last, emptied, for the next round.
    spare_list: Vec<PendingSection>,
    /// Emptied waiter lists given back once their section ended
    /// ([`RoundBuilder::give_waiters`]), for new sections: a section's
    /// list leaves with it, so without these every round allocated anew.
    waiter_spares: Vec<Vec<Waiter>>,
}

/// Most emptied sections the round builder keeps for their buffers.
const SPARE_SECTIONS_MAX: usize = 64;
/// Most emptied waiter lists kept, and the most waiters a kept one may
/// have room for (a strict section holds a few: a burst's are not kept).
const SPARE_WAITER_LISTS_MAX: usize = 64;
const SPARE_WAITERS_CAPACITY_MAX: usize = 256;
/// Most emptied lists of a round's sections kept (rounds in flight at
/// once are few), and the most sections a kept one may have room for.
const SPARE_SECTION_LISTS_MAX: usize = 8;
const SPARE_SECTION_LIST_CAPACITY_MAX: usize = 1024;

impl RoundBuilder {
    pub fn is_empty(&self) -> bool {
        self.states == 0
    }

    pub fn states(&self) -> usize {
        self.states
    }

    /// Adds a decided state (and who waits for it) to the open round.
    pub fn push(
        &mut self,
        shard: u32,
        term: u64,
        key: &[u8],
        state: &CounterState,
        waiter: Option<Waiter>,
        now: Instant,
    ) {
        let index = self.section(shard, term);
        let section = &mut self.sections[index];
        put_bytes(&mut section.bytes, key);
        put_state(&mut section.bytes, state);
        section.count += 1;
        if let Some(waiter) = waiter {
            section.waiters.push(waiter);
        }
        self.states += 1;
        self.opened_at.get_or_insert(now);
    }

    fn section(&mut self, shard: u32, term: u64) -> usize {
        let slot = shard as usize;
        if self.by_shard.len() <= slot {
            self.by_shard.resize(slot + 1, u32::MAX);
        }
        let at = self.by_shard[slot];
        if at != u32::MAX {
            let section = &self.sections[at as usize];
            if section.term == term {
                return at as usize;
            }
        }
        let mut section = self.spare.pop().unwrap_or_else(|| PendingSection {
            shard,
            term,
            count: 0,
            bytes: Vec::new(),
            waiters: Vec::new(),
        });
        section.shard = shard;
        section.term = term;
        if section.waiters.capacity() == 0 {
            if let Some(waiters) = self.waiter_spares.pop() {
                section.waiters = waiters;
            }
        }
        self.sections.push(section);
        let index = self.sections.len() - 1;
        self.by_shard[slot] = index as u32;
        index
    }

    /// Closes the round: its sections, in the order they were opened.
    pub fn take(&mut self) -> Vec<PendingSection> {
        for section in &self.sections {
            if let Some(slot) = self.by_shard.get_mut(section.shard as usize) {
                *slot = u32::MAX;
            }
        }
        self.states = 0;
        self.opened_at = None;
        let next = std::mem::take(&mut self.spare_list);
        std::mem::replace(&mut self.sections, next)
    }

    /// Gives a taken round's sections back for their buffers, and its list.
    pub fn recycle(&mut self, mut sections: Vec<PendingSection>) {
        for mut section in sections.drain(..) {
            if self.spare.len() >= SPARE_SECTIONS_MAX || section.bytes.capacity() > 1 << 20 {
                continue;
            }
            section.bytes.clear();
            section.waiters.clear();
            section.count = 0;
            self.spare.push(section);
        }
        if sections.capacity() <= SPARE_SECTION_LIST_CAPACITY_MAX {
            self.spare_list = sections;
        }
    }

    /// Gives back waiter lists emptied after their section ended.
    pub fn give_waiters(&mut self, lists: impl IntoIterator<Item = Vec<Waiter>>) {
        for mut waiters in lists {
            if self.waiter_spares.len() >= SPARE_WAITER_LISTS_MAX {
                return;
            }
            if waiters.capacity() == 0 || waiters.capacity() > SPARE_WAITERS_CAPACITY_MAX {
                continue;
            }
            waiters.clear();
            self.waiter_spares.push(waiters);
        }
    }

    /// Does the open round hold states of `shard`?
    pub fn holds(&self, shard: u32) -> bool {
        self.sections.iter().any(|s| s.shard == shard)
    }
}

/// How a section ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SectionEnd {
    Committed,
    /// Cannot commit: voters promised a newer leader (nothing committed;
    /// the hits may be sent to the new leader).
    Superseded(u64),
    /// Cannot commit: too few replicas can be reached.
    Unreachable,
    /// Not committed within the commit timeout (it may still commit).
    TimedOut(u64),
}

impl SectionEnd {
    /// The answer a waiter gets for a section that ended this way.
    pub fn answer(&self, shard: u32, decision: Answer) -> WireDecision {
        self.answer_leased(shard, decision, 0)
    }

    /// [`SectionEnd::answer`] for a forwarded hit granted a quota lease of
    /// `lease` credits: the lease goes with the answer only if the state
    /// counting it committed.
    pub fn answer_leased(&self, shard: u32, decision: Answer, lease: u32) -> WireDecision {
        match self {
            SectionEnd::Committed => WireDecision::with_lease(decision, lease),
            SectionEnd::Superseded(term) => WireDecision::Retry {
                shard,
                why: ShardRefusal::Superseded(*term),
            },
            SectionEnd::Unreachable => WireDecision::Unavailable {
                shard,
                why: ShardRefusal::Other("too few replicas reachable to commit".into()),
            },
            SectionEnd::TimedOut(ms) => WireDecision::Unavailable {
                shard,
                why: ShardRefusal::CommitTimeout(*ms),
            },
        }
    }
}

/// A section that ended, with its waiters, for the caller to answer.
pub struct Ended {
    pub shard: u32,
    pub term: u64,
    pub end: SectionEnd,
    pub waiters: Vec<Waiter>,
    /// Committed, and held by the follower that relays the answers of its
    /// forwarded hits (see [`SentSection::relay`]): the leader's own
    /// answers to those nodes are a fallback, sent with the link's next
    /// write rather than waking it.
    pub relayed: bool,
}

struct SectionRecord {
    shard: u32,
    term: u64,
    config: Arc<ShardConfig>,
    sent_to: SmallVec<[NodeId; 4]>,
    holders: SmallVec<[NodeId; 4]>,
    refusers: SmallVec<[NodeId; 4]>,
    fenced_by: u64,
    waiters: Vec<Waiter>,
    /// Waiters answered with the round, until their replica's verdict.
    with_round: SmallVec<[RoundAnswered; 2]>,
    /// The follower relaying the answers of its forwarded hits.
    relay: Option<NodeId>,
    /// How the section ended, once it did.
    ended_as: Option<SectionEnd>,
}

impl SectionRecord {
    fn done(&self) -> bool {
        self.ended_as.is_some()
    }
}

struct RoundRecord {
    sent_at: Instant,
    sections: Vec<SectionRecord>,
    /// Sections not ended yet.
    open: usize,
}

impl RoundRecord {
    /// Ended, and every answer sent with it settled by its replica.
    fn finished(&self) -> bool {
        self.open == 0 && self.sections.iter().all(|s| s.with_round.is_empty())
    }
}

/// A section as sent: the shard's commit rule and who it went to.
pub struct SentSection {
    pub shard: u32,
    pub term: u64,
    pub config: Arc<ShardConfig>,
    pub sent_to: SmallVec<[NodeId; 4]>,
    pub waiters: Vec<Waiter>,
    /// Waiters answered in the frames that carry the section (see the
    /// module doc); each peer is one of `sent_to`.
    pub with_round: SmallVec<[RoundAnswered; 2]>,
    /// The follower (one of `sent_to`, with this node a majority) that got
    /// the answers of the hits in `waiters` forwarded by nodes holding no
    /// replica of the shard, to send them on once it has applied the
    /// section (see the module doc).
    pub relay: Option<NodeId>,
}

/// Rounds sent and not yet ended, oldest first. Round numbers are
/// consecutive.
pub struct InFlight {
    me: NodeId,
    next_round: u64,
    first_round: u64,
    rounds: VecDeque<RoundRecord>,
    acked_upto: HashMap<NodeId, u64>,
    /// Section lists of finished rounds, emptied, for the next rounds.
    spare_sections: Vec<Vec<SectionRecord>>,
}

impl InFlight {
    pub fn new(me: NodeId) -> InFlight {
        InFlight {
            me,
            next_round: 1,
            first_round: 1,
            rounds: VecDeque::new(),
            acked_upto: HashMap::new(),
            spare_sections: Vec::new(),
        }
    }

    /// The number the next round gets.
    pub fn next_round(&self) -> u64 {
        self.next_round
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.rounds.is_empty()
    }

    /// Records round [`InFlight::next_round`] as sent; sections that need no
    /// other replica (a shard replicated here alone) end at once.
    pub fn record(
        &mut self,
        sent_at: Instant,
        sections: impl IntoIterator<Item = SentSection>,
        ended: &mut Vec<Ended>,
    ) {
        let round = self.next_round;
        self.next_round += 1;
        let mut records = self.spare_sections.pop().unwrap_or_default();
        records.extend(sections.into_iter().map(|s| SectionRecord {
            shard: s.shard,
            term: s.term,
            config: s.config,
            sent_to: s.sent_to,
            holders: SmallVec::new(),
            refusers: SmallVec::new(),
            fenced_by: 0,
            waiters: s.waiters,
            with_round: s.with_round,
            relay: s.relay,
            ended_as: None,
        }));
        let mut record = RoundRecord {
            sent_at,
            open: records.len(),
            sections: records,
        };
        for section in &mut record.sections {
            if let Some(end) = Self::settle(self.me, section) {
                record.open -= 1;
                Self::end(section, end, ended);
            }
        }
        if self.rounds.is_empty() {
            self.first_round = round;
        }
        self.rounds.push_back(record);
        self.pop_done();
    }

    /// The end a section has reached, if any.
    fn settle(me: NodeId, section: &SectionRecord) -> Option<SectionEnd> {
        if section.config.committed(me, &section.holders) {
            return Some(SectionEnd::Committed);
        }
        // Replicas it was not sent to, or that refused it, will not hold it.
        let mut lost: SmallVec<[NodeId; 4]> = section.refusers.clone();
        for set in &section.config.voter_sets {
            for &node in set {
                if node != me && !section.sent_to.contains(&node) && !lost.contains(&node) {
                    lost.push(node);
                }
            }
        }
        if section.config.committable(&lost) {
            return None;
        }
        Some(if section.fenced_by > 0 {
            SectionEnd::Superseded(section.fenced_by)
        } else {
            SectionEnd::Unreachable
        })
    }

    fn end(section: &mut SectionRecord, end: SectionEnd, ended: &mut Vec<Ended>) {
        section.ended_as = Some(end.clone());
        let relayed = end == SectionEnd::Committed
            && section
                .relay
                .is_some_and(|relay| section.holders.contains(&relay));
        ended.push(Ended {
            shard: section.shard,
            term: section.term,
            end,
            waiters: std::mem::take(&mut section.waiters),
            relayed,
        });
    }

    /// `peer` said whether it applied `section`, whose waiters it was
    /// answered for in the round's frame: applied, and they are done;
    /// not, and they are answered as the section ends (now, if it ended
    /// already).
    fn resolve(section: &mut SectionRecord, peer: NodeId, applied: bool, ended: &mut Vec<Ended>) {
        let Some(at) = section.with_round.iter().position(|a| a.peer == peer) else {
            return;
        };
        let answered = section.with_round.swap_remove(at);
        if applied {
            return;
        }
        match &section.ended_as {
            Some(end) => ended.push(Ended {
                shard: section.shard,
                term: section.term,
                end: end.clone(),
                waiters: answered.waiters,
                relayed: false,
            }),
            None => section.waiters.extend(answered.waiters),
        }
    }

    /// `peer` will not hold `section` (the link broke before it acked, or
    /// the round never left): its answers go the usual way, and the section
    /// ends if it cannot commit without it. Returns whether it ended now.
    fn lost(me: NodeId, section: &mut SectionRecord, peer: NodeId, ended: &mut Vec<Ended>) -> bool {
        Self::resolve(section, peer, false, ended);
        section.sent_to.retain(|n| *n != peer);
        if section.done() {
            return false;
        }
        match Self::settle(me, section) {
            Some(end) => {
                Self::end(section, end, ended);
                true
            }
            None => false,
        }
    }

    fn pop_done(&mut self) {
        while self.rounds.front().is_some_and(RoundRecord::finished) {
            if let Some(done) = self.rounds.pop_front() {
                let mut sections = done.sections;
                if self.spare_sections.len() < SPARE_SECTION_LISTS_MAX
                    && sections.capacity() <= SPARE_SECTION_LIST_CAPACITY_MAX
                {
                    sections.clear();
                    self.spare_sections.push(sections);
                }
            }
            self.first_round += 1;
        }
        if self.rounds.is_empty() {
            self.first_round = self.next_round;
        }
    }

    /// `peer` applied every round up to `upto` sent to it, except the
    /// sections it refused.
    pub fn ack(
        &mut self,
        peer: NodeId,
        upto: u64,
        refused: &[(u64, u32, ApplyRefusal)],
        ended: &mut Vec<Ended>,
    ) {
        let me = self.me;
        for &(round, shard, refusal) in refused {
            let Some(record) = round
                .checked_sub(self.first_round)
                .and_then(|i| self.rounds.get_mut(i as usize))
            else {
                continue;
            };
            for section in record.sections.iter_mut().filter(|s| s.shard == shard) {
                Self::resolve(section, peer, false, ended);
                if section.done() {
                    continue;
                }
                if !section.refusers.contains(&peer) {
                    section.refusers.push(peer);
                }
                if let ApplyRefusal::Fenced { term } = refusal {
                    section.fenced_by = section.fenced_by.max(term);
                }
                if let Some(end) = Self::settle(me, section) {
                    record.open -= 1;
                    Self::end(section, end, ended);
                }
            }
        }
        let from = self
            .acked_upto
            .get(&peer)
            .map_or(self.first_round, |&a| (a + 1).max(self.first_round));
        if upto >= from {
            for round in from..=upto.min(self.next_round.saturating_sub(1)) {
                let Some(record) = self.rounds.get_mut((round - self.first_round) as usize) else {
                    break;
                };
                for section in &mut record.sections {
                    if !section.sent_to.contains(&peer) || section.refusers.contains(&peer) {
                        continue;
                    }
                    Self::resolve(section, peer, true, ended);
                    if section.done() {
                        continue;
                    }
                    if !section.holders.contains(&peer) {
                        section.holders.push(peer);
                    }
                    if let Some(end) = Self::settle(me, section) {
                        record.open -= 1;
                        Self::end(section, end, ended);
                    }
                }
            }
        }
        let acked = self.acked_upto.entry(peer).or_insert(0);
        *acked = (*acked).max(upto);
        self.pop_done();
    }

    /// The connection to `peer` broke: rounds sent to it before now may
    /// never have arrived, so its later acks must not count for them.
    pub fn disconnected(&mut self, peer: NodeId, ended: &mut Vec<Ended>) {
        let me = self.me;
        for record in &mut self.rounds {
            for section in &mut record.sections {
                // Whether the answers sent with the round arrived is not
                // known: they go again (a node ignores answers it has).
                if section.holders.contains(&peer) {
                    continue;
                }
                if Self::lost(me, section, peer, ended) {
                    record.open -= 1;
                }
            }
        }
        self.acked_upto
            .insert(peer, self.next_round.saturating_sub(1));
        self.pop_done();
    }

    /// Round `round` could not be queued for `peer` (its outbox was full):
    /// `peer` does not hold its sections, whatever its later cumulative acks
    /// say, and the answers meant to ride with them go the usual way.
    pub fn not_sent(&mut self, round: u64, peer: NodeId, ended: &mut Vec<Ended>) {
        let me = self.me;
        let Some(record) = round
            .checked_sub(self.first_round)
            .and_then(|i| self.rounds.get_mut(i as usize))
        else {
            return;
        };
        for section in &mut record.sections {
            if section.sent_to.contains(&peer) && Self::lost(me, section, peer, ended) {
                record.open -= 1;
            }
        }
        self.pop_done();
    }

    /// Ends sections sent more than `timeout` before `now`.
    pub fn expire(&mut self, now: Instant, timeout: Duration, ended: &mut Vec<Ended>) {
        let ms = timeout.as_millis() as u64;
        for record in &mut self.rounds {
            if now.saturating_duration_since(record.sent_at) < timeout {
                break;
            }
            for section in &mut record.sections {
                if !section.done() {
                    record.open -= 1;
                    Self::end(section, SectionEnd::TimedOut(ms), ended);
                }
                // Replicas silent this long: their answers go again, with
                // the section's end (a node ignores answers it has).
                while let Some(peer) = section.with_round.first().map(|a| a.peer) {
                    Self::resolve(section, peer, false, ended);
                }
            }
        }
        self.pop_done();
    }

    /// Does a section of `shard` still wait for its commit?
    pub fn holds(&self, shard: u32) -> bool {
        self.rounds
            .iter()
            .any(|r| r.sections.iter().any(|s| s.shard == shard && !s.done()))
    }

    /// When the oldest round still open was sent.
    pub fn oldest(&self) -> Option<Instant> {
        self.rounds.front().map(|r| r.sent_at)
    }
}

#[cfg(test)]
mod tests;
