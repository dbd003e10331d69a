//! Unit tests of round building, in-flight tracking and acknowledgement.

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
            lease: 0,
        }],
        with_round: SmallVec::new(),
        relay: None,
    }
}

/// A section whose hits forwarded by node 2 (incarnation 7) were
/// answered in the round's frame to node 2, plus one hit of node 3.
fn answered_with_round(shard: u32) -> SentSection {
    let remote = |peer, index| Waiter::Remote {
        peer,
        boot: 7,
        batch: 40,
        index,
        decision: OK.into(),
        lease: 0,
    };
    let mut waiters = vec![remote(2, 0), remote(3, 1), remote(2, 2)];
    let with_round: SmallVec<[RoundAnswered; 2]> = RoundAnswered::take(&mut waiters, 2, 7)
        .into_iter()
        .collect();
    assert_eq!(with_round[0].waiters.len(), 2);
    assert!(RoundAnswered::take(&mut waiters, 2, 7).is_none());
    assert!(
        RoundAnswered::take(&mut waiters, 3, 6).is_none(),
        "another incarnation's"
    );
    SentSection {
        waiters,
        with_round,
        ..section(shard, &[1, 2, 3], &[2, 3])
    }
}

/// `(shard, end, forwarding peers of the waiters)` of what ended,
/// taken (the next step starts from none).
fn take_ends(ended: &mut Vec<Ended>) -> Vec<(u32, SectionEnd, Vec<NodeId>)> {
    ended
        .drain(..)
        .map(|e| {
            let peers = e
                .waiters
                .iter()
                .map(|w| match w {
                    Waiter::Remote { peer, .. } => *peer,
                    Waiter::Local { .. } => 0,
                })
                .collect();
            (e.shard, e.end, peers)
        })
        .collect()
}

#[test]
fn answers_sent_with_the_round_are_done_once_their_replica_applied_it() {
    let mut flight = InFlight::new(1);
    let mut ended = Vec::new();
    flight.record(Instant::now(), vec![answered_with_round(0)], &mut ended);
    // Node 2 applied it: committed (1 and 2 of 1, 2, 3); only node 3's
    // waiter is answered by the leader.
    flight.ack(2, 1, &[], &mut ended);
    assert_eq!(
        take_ends(&mut ended),
        vec![(0, SectionEnd::Committed, vec![3])]
    );
    assert!(flight.is_empty());
}

#[test]
fn answers_sent_with_a_round_their_replica_refused_are_answered_with_the_end() {
    // Refused before the section ended: they join its end.
    let mut flight = InFlight::new(1);
    let mut ended = Vec::new();
    flight.record(Instant::now(), vec![answered_with_round(0)], &mut ended);
    flight.ack(
        2,
        1,
        &[(1, 0, ApplyRefusal::Fenced { term: 6 })],
        &mut ended,
    );
    assert!(ended.is_empty(), "node 3 may still hold it");
    flight.ack(3, 1, &[], &mut ended);
    assert_eq!(
        take_ends(&mut ended),
        vec![(0, SectionEnd::Committed, vec![3, 2, 2])]
    );
    assert!(flight.is_empty());

    // Refused after it committed through node 3: answered at once.
    let mut flight = InFlight::new(1);
    flight.record(Instant::now(), vec![answered_with_round(0)], &mut ended);
    flight.ack(3, 1, &[], &mut ended);
    assert_eq!(
        take_ends(&mut ended),
        vec![(0, SectionEnd::Committed, vec![3])]
    );
    assert!(!flight.is_empty(), "kept until node 2 says how it went");
    assert!(!flight.holds(0), "but no longer waiting for a commit");
    flight.ack(2, 1, &[(1, 0, ApplyRefusal::NotReplica)], &mut ended);
    assert_eq!(
        take_ends(&mut ended),
        vec![(0, SectionEnd::Committed, vec![2, 2])]
    );
    assert!(flight.is_empty());
}

#[test]
fn answers_sent_with_a_round_go_again_when_the_link_breaks_or_it_times_out() {
    let mut flight = InFlight::new(1);
    let mut ended = Vec::new();
    let start = Instant::now();
    flight.record(start, vec![answered_with_round(0)], &mut ended);
    flight.record(start, vec![answered_with_round(1)], &mut ended);
    // Round 1 committed through node 3; node 2's link broke before its
    // ack: whether its answers arrived is unknown, so they go again.
    flight.ack(3, 1, &[], &mut ended);
    ended.clear();
    flight.disconnected(2, &mut ended);
    assert_eq!(
        take_ends(&mut ended),
        vec![(0, SectionEnd::Committed, vec![2, 2])]
    );
    // Round 2's answers to node 2 went back to waiting with the rest
    // (the link broke), and it times out: every waiter gets that.
    flight.expire(
        start + Duration::from_millis(150),
        Duration::from_millis(100),
        &mut ended,
    );
    assert_eq!(
        take_ends(&mut ended),
        vec![(1, SectionEnd::TimedOut(100), vec![3, 2, 2])]
    );
    assert!(flight.is_empty());

    // A replica silent past the timeout: its answers go again with the
    // section's end.
    let mut flight = InFlight::new(1);
    flight.record(start, vec![answered_with_round(0)], &mut ended);
    flight.ack(3, 1, &[], &mut ended);
    ended.clear();
    flight.expire(
        start + Duration::from_millis(150),
        Duration::from_millis(100),
        &mut ended,
    );
    assert_eq!(
        take_ends(&mut ended),
        vec![(0, SectionEnd::Committed, vec![2, 2])]
    );
    assert!(flight.is_empty());
}

#[test]
fn a_round_that_could_not_be_queued_for_a_peer_is_not_held_by_it() {
    let mut flight = InFlight::new(1);
    let mut ended = Vec::new();
    flight.record(Instant::now(), vec![answered_with_round(0)], &mut ended);
    // Node 2's outbox was full: its answers go the usual way, and its
    // cumulative ack of a later round does not make it a holder.
    flight.not_sent(1, 2, &mut ended);
    assert!(ended.is_empty(), "node 3 may still hold it");
    flight.record(
        Instant::now(),
        vec![section(1, &[1, 2, 3], &[2, 3])],
        &mut ended,
    );
    flight.ack(2, 2, &[], &mut ended);
    assert_eq!(ends(&ended), vec![(1, SectionEnd::Committed)]);
    ended.clear();
    flight.ack(3, 1, &[], &mut ended);
    assert_eq!(
        take_ends(&mut ended),
        vec![(0, SectionEnd::Committed, vec![3, 2, 2])]
    );
    // Queued for nobody else who could make a majority: it cannot commit.
    let mut flight = InFlight::new(1);
    flight.record(
        Instant::now(),
        vec![section(0, &[1, 2, 3], &[2, 3])],
        &mut ended,
    );
    flight.not_sent(1, 2, &mut ended);
    flight.not_sent(1, 3, &mut ended);
    assert_eq!(ends(&ended), vec![(0, SectionEnd::Unreachable)]);
    assert!(flight.is_empty());
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

/// An empty round builder, the time, and a state to push.
fn builder_now_and_state() -> (RoundBuilder, Instant, CounterState) {
    let state = CounterState::Window {
        end_ms: 10,
        used: 1,
    };
    (RoundBuilder::default(), Instant::now(), state)
}

#[test]
fn the_builder_groups_states_by_shard_and_term() {
    let (mut builder, now, state) = builder_now_and_state();
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

/// Waiter lists given back after their sections ended are reused by new
/// sections, and only as many as the builder keeps, none too large.
#[test]
fn the_builder_reuses_waiter_lists_within_its_bounds() {
    let (mut builder, now, state) = builder_now_and_state();
    let given: Vec<Vec<Waiter>> = (0..SPARE_WAITER_LISTS_MAX + 5)
        .map(|_| Vec::with_capacity(8))
        .chain([
            Vec::with_capacity(SPARE_WAITERS_CAPACITY_MAX + 1),
            Vec::new(),
        ])
        .collect();
    builder.give_waiters(given);
    assert_eq!(builder.waiter_spares.len(), SPARE_WAITER_LISTS_MAX);
    builder.push(3, 5, b"a", &state, None, now);
    let sections = builder.take();
    assert_eq!(
        sections[0].waiters.capacity(),
        8,
        "a kept list, not a new one"
    );
    assert_eq!(builder.waiter_spares.len(), SPARE_WAITER_LISTS_MAX - 1);
    // Oversized and empty lists are not kept.
    let mut builder = RoundBuilder::default();
    builder.give_waiters([
        Vec::with_capacity(SPARE_WAITERS_CAPACITY_MAX + 1),
        Vec::new(),
    ]);
    assert!(builder.waiter_spares.is_empty());
}

/// Finished rounds' section lists are kept for the next rounds, a few.
#[test]
fn finished_rounds_give_their_section_lists_back() {
    let mut flight = InFlight::new(1);
    let mut ended = Vec::new();
    for shard in 0..(SPARE_SECTION_LISTS_MAX as u32 + 3) {
        // Replicated here alone: the round ends and is finished at once.
        flight.record(Instant::now(), [section(shard, &[1], &[])], &mut ended);
    }
    assert!(flight.is_empty());
    assert_eq!(ended.len(), SPARE_SECTION_LISTS_MAX + 3);
    assert_eq!(
        flight.spare_sections.len(),
        1,
        "each round reuses the last's list"
    );
    assert!(flight.spare_sections[0].capacity() >= 1);
}

/// A section of shard 0 (voters 1, 2, 3) sent to 2 and 3 at `sent_at`,
/// with a hit of node 9 (no replica) whose answers node 2 relays.
fn relayed_by_2(sent_at: Instant) -> (InFlight, Vec<Ended>) {
    let mut flight = InFlight::new(1);
    let mut ended = Vec::new();
    let sent = SentSection {
        relay: Some(2),
        ..section(0, &[1, 2, 3], &[2, 3])
    };
    flight.record(sent_at, vec![sent], &mut ended);
    assert!(ended.is_empty());
    (flight, ended)
}

#[test]
fn a_section_ends_relayed_only_when_committed_with_its_relaying_follower() {
    // Committed by the relaying follower's ack: it applied the section and
    // sent the answers on, so the leader's own may wait for a write.
    let (mut flight, mut ended) = relayed_by_2(Instant::now());
    flight.ack(2, 1, &[], &mut ended);
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].end, SectionEnd::Committed);
    assert!(ended[0].relayed);
    assert_eq!(ended[0].waiters.len(), 1, "the leader still answers them");

    // Committed by the other follower's: node 2 may never have applied it.
    let (mut flight, mut ended) = relayed_by_2(Instant::now());
    flight.ack(3, 1, &[], &mut ended);
    assert_eq!(ended[0].end, SectionEnd::Committed);
    assert!(!ended[0].relayed);

    // The relaying follower refused it: committed by node 3, not relayed.
    let (mut flight, mut ended) = relayed_by_2(Instant::now());
    flight.ack(
        2,
        1,
        &[(1, 0, ApplyRefusal::Fenced { term: 4 })],
        &mut ended,
    );
    flight.ack(3, 1, &[], &mut ended);
    assert_eq!(
        take_ends(&mut ended),
        vec![(0, SectionEnd::Committed, vec![9])]
    );

    // Timed out: never relayed.
    let start = Instant::now();
    let (mut flight, mut ended) = relayed_by_2(start);
    flight.expire(
        start + Duration::from_millis(150),
        Duration::from_millis(100),
        &mut ended,
    );
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].end, SectionEnd::TimedOut(100));
    assert!(!ended[0].relayed);
}
