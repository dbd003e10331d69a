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
    },
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
}

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
        std::mem::take(&mut self.sections)
    }

    /// Gives emptied sections back for their buffers.
    pub fn recycle(&mut self, sections: impl IntoIterator<Item = PendingSection>) {
        for mut section in sections {
            if self.spare.len() >= 64 || section.bytes.capacity() > 1 << 20 {
                continue;
            }
            section.bytes.clear();
            section.waiters.clear();
            section.count = 0;
            self.spare.push(section);
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
        match self {
            SectionEnd::Committed => decision.into(),
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
    done: bool,
}

struct RoundRecord {
    sent_at: Instant,
    sections: Vec<SectionRecord>,
    open: usize,
}

/// A section as sent: the shard's commit rule and who it went to.
pub struct SentSection {
    pub shard: u32,
    pub term: u64,
    pub config: Arc<ShardConfig>,
    pub sent_to: SmallVec<[NodeId; 4]>,
    pub waiters: Vec<Waiter>,
}

/// Rounds sent and not yet ended, oldest first. Round numbers are
/// consecutive.
pub struct InFlight {
    me: NodeId,
    next_round: u64,
    first_round: u64,
    rounds: VecDeque<RoundRecord>,
    acked_upto: HashMap<NodeId, u64>,
}

impl InFlight {
    pub fn new(me: NodeId) -> InFlight {
        InFlight {
            me,
            next_round: 1,
            first_round: 1,
            rounds: VecDeque::new(),
            acked_upto: HashMap::new(),
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
    pub fn record(&mut self, sent_at: Instant, sections: Vec<SentSection>, ended: &mut Vec<Ended>) {
        let round = self.next_round;
        self.next_round += 1;
        let mut record = RoundRecord {
            sent_at,
            open: sections.len(),
            sections: sections
                .into_iter()
                .map(|s| SectionRecord {
                    shard: s.shard,
                    term: s.term,
                    config: s.config,
                    sent_to: s.sent_to,
                    holders: SmallVec::new(),
                    refusers: SmallVec::new(),
                    fenced_by: 0,
                    waiters: s.waiters,
                    done: false,
                })
                .collect(),
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
        section.done = true;
        ended.push(Ended {
            shard: section.shard,
            term: section.term,
            end,
            waiters: std::mem::take(&mut section.waiters),
        });
    }

    fn pop_done(&mut self) {
        while self.rounds.front().is_some_and(|r| r.open == 0) {
            self.rounds.pop_front();
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
            for section in record
                .sections
                .iter_mut()
                .filter(|s| s.shard == shard && !s.done)
            {
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
                for section in record.sections.iter_mut().filter(|s| !s.done) {
                    if !section.sent_to.contains(&peer) || section.refusers.contains(&peer) {
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
            for section in record.sections.iter_mut().filter(|s| !s.done) {
                if section.holders.contains(&peer) {
                    continue;
                }
                section.sent_to.retain(|n| *n != peer);
                if let Some(end) = Self::settle(me, section) {
                    record.open -= 1;
                    Self::end(section, end, ended);
                }
            }
        }
        self.acked_upto
            .insert(peer, self.next_round.saturating_sub(1));
        self.pop_done();
    }

    /// Ends sections sent more than `timeout` before `now`.
    pub fn expire(&mut self, now: Instant, timeout: Duration, ended: &mut Vec<Ended>) {
        let ms = timeout.as_millis() as u64;
        for record in &mut self.rounds {
            if now.saturating_duration_since(record.sent_at) < timeout {
                break;
            }
            for section in record.sections.iter_mut().filter(|s| !s.done) {
                record.open -= 1;
                Self::end(section, SectionEnd::TimedOut(ms), ended);
            }
        }
        self.pop_done();
    }

    /// Does a section of `shard` still wait for its commit?
    pub fn holds(&self, shard: u32) -> bool {
        self.rounds
            .iter()
            .any(|r| r.sections.iter().any(|s| s.shard == shard && !s.done))
    }

    /// When the oldest round still open was sent.
    pub fn oldest(&self) -> Option<Instant> {
        self.rounds.front().map(|r| r.sent_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Decision;
    use smallvec::smallvec;

    const OK: Decision = Decision {
        allowed: true,
        credit: 1,
        next_reset_seconds: 60,
    };

    fn config(voters: &[NodeId]) -> Arc<ShardConfig> {
        Arc::new(ShardConfig {
            voter_sets: smallvec![voters.to_vec()],
            targets: voters.iter().copied().filter(|&n| n != 1).collect(),
        })
    }

    fn section(shard: u32, voters: &[NodeId], sent_to: &[NodeId]) -> SentSection {
        SentSection {
            shard,
            term: 5,
            config: config(voters),
            sent_to: sent_to.iter().copied().collect(),
            waiters: vec![Waiter::Remote {
                peer: 9,
                boot: 1,
                batch: 1,
                index: shard,
                decision: OK.into(),
            }],
        }
    }

    fn ends(ended: &[Ended]) -> Vec<(u32, SectionEnd)> {
        ended.iter().map(|e| (e.shard, e.end.clone())).collect()
    }

    #[test]
    fn a_section_commits_on_a_majority_and_acks_are_cumulative() {
        let mut flight = InFlight::new(1);
        let mut ended = Vec::new();
        flight.record(
            Instant::now(),
            vec![section(0, &[1, 2, 3], &[2, 3])],
            &mut ended,
        );
        flight.record(
            Instant::now(),
            vec![section(1, &[1, 2, 3], &[2, 3])],
            &mut ended,
        );
        assert!(ended.is_empty());
        // Node 2 applied both rounds: each is on 2 of 3.
        flight.ack(2, 2, &[], &mut ended);
        assert_eq!(
            ends(&ended),
            vec![(0, SectionEnd::Committed), (1, SectionEnd::Committed)]
        );
        assert!(flight.is_empty());
        // A late ack changes nothing.
        ended.clear();
        flight.ack(3, 2, &[], &mut ended);
        assert!(ended.is_empty());
    }

    #[test]
    fn a_shard_on_this_node_alone_commits_at_once() {
        let mut flight = InFlight::new(1);
        let mut ended = Vec::new();
        flight.record(Instant::now(), vec![section(4, &[1], &[])], &mut ended);
        assert_eq!(ends(&ended), vec![(4, SectionEnd::Committed)]);
        assert!(flight.is_empty());
    }

    #[test]
    fn refusals_by_a_newer_leaders_voters_supersede_the_section() {
        let mut flight = InFlight::new(1);
        let mut ended = Vec::new();
        flight.record(
            Instant::now(),
            vec![section(0, &[1, 2, 3], &[2, 3])],
            &mut ended,
        );
        flight.ack(
            2,
            1,
            &[(1, 0, ApplyRefusal::Fenced { term: 6 })],
            &mut ended,
        );
        assert!(ended.is_empty(), "node 3 may still hold it");
        flight.ack(
            3,
            1,
            &[(1, 0, ApplyRefusal::Fenced { term: 7 })],
            &mut ended,
        );
        assert_eq!(ends(&ended), vec![(0, SectionEnd::Superseded(7))]);
        assert!(matches!(
            ended[0].end.answer(0, OK.into()),
            WireDecision::Retry {
                shard: 0,
                why: ShardRefusal::Superseded(7)
            }
        ));
    }

    #[test]
    fn a_lost_connection_voids_unacknowledged_rounds_for_that_peer() {
        let mut flight = InFlight::new(1);
        let mut ended = Vec::new();
        flight.record(
            Instant::now(),
            vec![section(0, &[1, 2, 3], &[2, 3])],
            &mut ended,
        );
        flight.disconnected(2, &mut ended);
        assert!(ended.is_empty(), "node 3 may still hold it");
        flight.record(
            Instant::now(),
            vec![section(1, &[1, 2, 3], &[2, 3])],
            &mut ended,
        );
        // Node 2, reconnected, acks round 2 only: round 1 must not count.
        flight.ack(2, 2, &[], &mut ended);
        assert_eq!(ends(&ended), vec![(1, SectionEnd::Committed)]);
        ended.clear();
        flight.disconnected(3, &mut ended);
        assert_eq!(ends(&ended), vec![(0, SectionEnd::Unreachable)]);
        assert!(flight.is_empty());
    }

    #[test]
    fn old_sections_time_out_and_joint_configs_need_both_majorities() {
        let mut flight = InFlight::new(1);
        let mut ended = Vec::new();
        let start = Instant::now();
        let joint = SentSection {
            config: Arc::new(ShardConfig {
                voter_sets: smallvec![vec![1, 2, 3], vec![1, 2, 4]],
                targets: vec![2, 3, 4],
            }),
            ..section(0, &[1], &[2, 3, 4])
        };
        flight.record(start, vec![joint], &mut ended);
        flight.ack(3, 1, &[], &mut ended);
        assert!(ended.is_empty(), "3 is no majority of 1,2,4");
        flight.expire(
            start + Duration::from_millis(50),
            Duration::from_millis(100),
            &mut ended,
        );
        assert!(ended.is_empty());
        flight.expire(
            start + Duration::from_millis(150),
            Duration::from_millis(100),
            &mut ended,
        );
        assert_eq!(ends(&ended), vec![(0, SectionEnd::TimedOut(100))]);
        assert!(flight.is_empty());
    }

    #[test]
    fn the_builder_groups_states_by_shard_and_term() {
        let mut builder = RoundBuilder::default();
        let now = Instant::now();
        let state = CounterState::Window {
            end_ms: 10,
            used: 1,
        };
        builder.push(3, 5, b"a", &state, None, now);
        builder.push(1, 5, b"b", &state, None, now);
        builder.push(3, 5, b"c", &state, None, now);
        builder.push(3, 6, b"d", &state, None, now);
        assert_eq!(builder.states(), 4);
        assert!(builder.holds(1));
        let sections = builder.take();
        let summary: Vec<(u32, u64, u32)> = sections
            .iter()
            .map(|s| (s.shard, s.term, s.count))
            .collect();
        assert_eq!(summary, vec![(3, 5, 2), (1, 5, 1), (3, 6, 1)]);
        assert!(builder.is_empty() && !builder.holds(1));
        builder.recycle(sections);
        builder.push(1, 5, b"e", &state, None, now);
        assert_eq!(builder.take()[0].count, 1);
    }
}
