//! The peer protocol's version window, with real processes: a rolling
//! upgrade from minor 2.1 to this build's (each node restarted in turn,
//! advertising 2.1 with the test-only `TOLLGATE_TEST_PEER_PROTOCOL`, then
//! its own) keeps the cluster serving with its counters, and what a newer
//! minor added (a forwarded batch's answers in a section of its own, 2.2)
//! is sent only once both ends speak it, while what 2.1 added (answers
//! that ride with their round) goes on throughout; fast mode's quota leases
//! (2.3) are asked of and granted to peers that talk 2.3 only; strict
//! answers relayed by a follower to a node holding no replica of the shard
//! (2.4) go only through followers that talk 2.4; a node of
//! another major is refused on both sides: it exits naming both versions,
//! the nodes it dialed log the refusal and count it (and their data dirs
//! count no write error).

use crate::cluster_support::*;
use std::time::{Duration, Instant};
use tollgate::cluster::auth::{BATCH_ANSWERS_MINOR, LEASES_MINOR, PROTOCOL, RELAY_ANSWERS_MINOR};

const ENV: &str = "TOLLGATE_TEST_PEER_PROTOCOL";

fn advertise(cluster: &mut TestCluster, id: u64, version: &str) {
    cluster
        .env
        .insert(id, vec![(ENV.to_string(), version.to_string())]);
}

/// The `[path=/chaos]` credit (1000 an hour) left to `user` through node
/// `via` after one more hit.
fn hit(cluster: &TestCluster, via: u64, user: &str) -> i64 {
    credit_of(cluster, via, "HIT", user)
}

/// The `[path=/chaos]` credit `command` (`HIT` or `PEEK`) of `user` answers
/// through node `via`.
fn credit_of(cluster: &TestCluster, via: u64, command: &str, user: &str) -> i64 {
    let answers = converse(
        cluster.client(via),
        &[format!("{command} path=/chaos user={user}")],
    );
    let (_, credit, _) = answers
        .first()
        .and_then(|a| parse_ok(a))
        .unwrap_or_else(|| panic!("node {via}: {answers:?}"));
    credit
}

/// A counter of every node's `/metrics`, all nodes together (each counts
/// from its start).
fn total(cluster: &TestCluster, series: &str) -> f64 {
    [1, 2, 3]
        .iter()
        .map(|&id| {
            metric(cluster.metrics_addr(id), series)
                .unwrap_or_else(|| panic!("node {id} has no {series} series"))
        })
        .sum()
}

/// Forwarded hits the cluster's leaders answered with their round (2.1).
fn round_answers(cluster: &TestCluster) -> f64 {
    total(cluster, "tollgate_cluster_round_answers_total")
}

/// Forwarded hits the cluster's leaders answered at once in a section of
/// their batch's own (2.2).
fn batch_answers(cluster: &TestCluster) -> f64 {
    total(cluster, "tollgate_cluster_batch_answers_total")
}

/// One hit, then one peek, of fresh actors through every node; some are
/// forwarded to their shard's leader, which answers a hit with its round
/// (strict mode, from 2.1 on) and a peek at once (it changes no counter),
/// in a section of the batch's own from 2.2 on.
fn hit_fresh_actors(cluster: &TestCluster, round: &str) {
    for via in [1, 2, 3] {
        for actor in 0..8 {
            let user = format!("{round}-{via}-{actor}");
            assert_eq!(hit(cluster, via, &user), 999, "node {via}");
            // A peek answers as the next hit would, and counts nothing.
            for _ in 0..2 {
                assert_eq!(credit_of(cluster, via, "PEEK", &user), 998, "node {via}");
            }
        }
    }
}

#[test]
fn a_rolling_upgrade_to_the_next_minor_keeps_serving_and_another_major_is_refused() {
    let mut cluster = TestCluster::start_observed(3, 4, &[], false);
    let mut credit = hit(&cluster, 1, "rolling");
    let own = PROTOCOL.to_string();
    // The minor before batch answers: this build still talks it.
    let previous = format!("{}.{}", PROTOCOL.major, BATCH_ANSWERS_MINOR - 1);
    // One node at a time, as docs/cluster.md's rolling upgrade says: first
    // every node goes back to 2.1, then each is upgraded to this build's;
    // the counter goes on through every node at each step.
    for (step, id) in [3, 2, 1, 3, 2, 1].into_iter().enumerate() {
        let version = if step < 3 { &previous } else { &own };
        cluster.stop(id, Duration::from_secs(10));
        if step < 3 {
            advertise(&mut cluster, id, version);
        } else {
            cluster.env.remove(&id);
        }
        cluster.spawn(id, None);
        cluster.wait_healthy(Duration::from_secs(30));
        assert_eq!(
            cluster.log(id).contains(&format!(
                "advertising peer protocol {previous} instead of {own}"
            )),
            step < 3,
            "node {id} at step {step}: {}",
            cluster.log(id)
        );
        for via in [1, 2, 3] {
            let now = hit(&cluster, via, "rolling");
            assert_eq!(
                now,
                credit - 1,
                "node {via} after restarting node {id} as {version}"
            );
            credit = now;
        }
        if step == 2 {
            // Every node speaks 2.1: no leader answers a
            // batch in a section of its own (an older node could not read
            // it), and hits still ride with their round.
            hit_fresh_actors(&cluster, "previous");
            assert_eq!(batch_answers(&cluster), 0.0);
            assert!(round_answers(&cluster) > 0.0);
        }
    }
    // Every node speaks this build's minor: forwarded peeks are answered
    // in their batch's own section, and hits still with their round.
    let rounds_before = round_answers(&cluster);
    hit_fresh_actors(&cluster, "own");
    assert!(batch_answers(&cluster) > 0.0);
    assert!(round_answers(&cluster) > rounds_before);

    // Node 3 of major 3 cannot join: it exits naming both versions.
    cluster.kill(3);
    advertise(&mut cluster, 3, "3.0");
    cluster.spawn(3, None);
    let status = cluster
        .wait_exit(3, Duration::from_secs(20))
        .expect("a node of another major exits");
    assert!(!status.success());
    let log = cluster.log(3);
    assert!(
        log.contains("no peer accepted this node")
            && log.contains(&format!(
                "incompatible peer protocol: the peer speaks {own}"
            ))
            && log.contains("this node 3.0"),
        "{log}"
    );
    // The nodes it dialed log and count the refusal (their logs may trail
    // its exit by a moment).
    for id in [1, 2] {
        let refused = |log: &str| {
            log.contains("refused a peer connection from 127.0.0.1:")
                && log.contains(&format!(
                    "incompatible peer protocol: the peer speaks major version 3, this node {own}"
                ))
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !refused(&cluster.log(id)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(refused(&cluster.log(id)), "node {id}: {}", cluster.log(id));
        let refusals = metric(
            cluster.metrics_addr(id),
            "tollgate_cluster_peer_version_refusals_total",
        )
        .unwrap_or(0.0);
        assert!(refusals >= 1.0, "node {id}: {refusals} refusals counted");
        // Its data dir wrote without an error (the series is there, at 0).
        assert_eq!(
            metric(
                cluster.metrics_addr(id),
                "tollgate_cluster_data_dir_write_errors_total"
            ),
            Some(0.0),
            "node {id}"
        );
    }
    // Back on a compatible version, it rejoins with the counters.
    cluster.env.remove(&3);
    cluster.spawn(3, None);
    cluster.wait_healthy(Duration::from_secs(30));
    assert_eq!(hit(&cluster, 3, "rolling"), credit - 1);
}

/// Fast mode with node 3 advertising 2.2, the minor before quota leases:
/// nodes 1 and 2 lease each other credits of the counters they forward,
/// and node 3 neither asks for a lease nor is asked for one (its frames
/// would read an ask; its peers, having agreed on 2.2 with it, send none).
#[test]
fn quota_leases_pass_only_between_nodes_that_talk_their_minor() {
    let mut cluster = TestCluster::start_observed(3, 8, &["--consistency", "fast"], false);
    let before_leases = format!("{}.{}", PROTOCOL.major, LEASES_MINOR - 1);
    cluster.stop(3, Duration::from_secs(10));
    advertise(&mut cluster, 3, &before_leases);
    cluster.spawn(3, None);
    cluster.wait_leaders_stable(Duration::from_secs(2), Duration::from_secs(60));
    // Forty counters hit twenty times each through every node: each node
    // forwards the hits of the counters it does not lead.
    let clients = cluster.clients();
    for (via, addr) in clients.iter().enumerate() {
        let mut conn = Conn::open(*addr).unwrap();
        for actor in 0..40 {
            let line = format!("HIT path=/chaos user=lease{actor}");
            for answer in conn.pipeline(&vec![line; 20]) {
                let (allowed, _, _) = parse_ok(&answer).unwrap_or_else(|| panic!("{answer}"));
                assert!(allowed, "node {}: {answer}", via + 1);
            }
        }
    }
    let counter = |id: u64, series: &str| {
        metric(cluster.metrics_addr(id), series)
            .unwrap_or_else(|| panic!("node {id} has no {series} series"))
    };
    for id in [1, 2] {
        assert!(
            counter(id, "tollgate_cluster_lease_hits_total") > 0.0,
            "node {id} admitted hits from leases node {} granted",
            3 - id
        );
        assert!(
            counter(id, "tollgate_cluster_leases_granted_total") > 0.0,
            "node {id}"
        );
    }
    assert_eq!(counter(3, "tollgate_cluster_lease_hits_total"), 0.0);
    assert_eq!(counter(3, "tollgate_cluster_leases_granted_total"), 0.0);
}

/// Waits up to 10 s for the answers `nodes` relayed to exceed `floor`
/// (a follower relays as it applies a round, which may be after the hits
/// were answered another way); returns what they relayed.
fn relayed_past(cluster: &TestCluster, nodes: &[u64], floor: f64) -> f64 {
    let total = || nodes.iter().map(|&id| relayed_by(cluster, id)).sum::<f64>();
    let deadline = Instant::now() + Duration::from_secs(10);
    while total() <= floor && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    total()
}

/// Answers node `id` relayed, as a follower, to nodes that forwarded hits.
fn relayed_by(cluster: &TestCluster, id: u64) -> f64 {
    metric(
        cluster.metrics_addr(id),
        "tollgate_cluster_relayed_answers_total",
    )
    .unwrap_or_else(|| panic!("node {id} has no relayed answers series"))
}

/// Through every node of four, two pipelined hits of each of 24 fresh
/// actors (spread over every shard: some led there, some forwarded by a
/// replica, some by the one node of the four holding no replica of their
/// shard): each answered in request order, counting down.
fn hit_fresh_actors_pipelined(cluster: &TestCluster, round: &str) {
    for via in 1..=4 {
        let users: Vec<String> = (0..24).map(|a| format!("{round}-{via}-{a}")).collect();
        let lines: Vec<String> = users
            .iter()
            .flat_map(|u| {
                [
                    format!("HIT path=/chaos user={u}"),
                    format!("HIT path=/chaos user={u}"),
                ]
            })
            .collect();
        let answers = converse(cluster.client(via), &lines);
        assert_eq!(answers.len(), lines.len(), "node {via}: {answers:?}");
        for (i, answer) in answers.iter().enumerate() {
            let expected = if i % 2 == 0 { 999 } else { 998 };
            assert_eq!(
                parse_ok(answer).map(|(_, credit, _)| credit),
                Some(expected),
                "node {via}, {}: {answer}",
                lines[i]
            );
        }
    }
}

/// Strict mode on four nodes (three replicas a shard): the hits a node
/// holding no replica of their shard forwards are answered by a follower
/// that relays the leader's answers; a node advertising 2.3, the minor
/// before relayed answers, is never asked to relay, and every answer
/// through every node stays right and in order.
#[test]
fn relayed_answers_pass_only_through_followers_that_talk_their_minor() {
    let mut cluster = TestCluster::start_observed(4, 8, &[], false);
    hit_fresh_actors_pipelined(&cluster, "own");
    assert!(
        relayed_past(&cluster, &[1, 2, 3, 4], 0.0) > 0.0,
        "no answer relayed"
    );

    let before_relays = format!("{}.{}", PROTOCOL.major, RELAY_ANSWERS_MINOR - 1);
    cluster.stop(2, Duration::from_secs(10));
    advertise(&mut cluster, 2, &before_relays);
    cluster.spawn(2, None);
    cluster.wait_healthy(Duration::from_secs(30));
    let others_before: f64 = [1, 3, 4].iter().map(|&id| relayed_by(&cluster, id)).sum();
    hit_fresh_actors_pipelined(&cluster, "mixed");
    let others_after = relayed_past(&cluster, &[1, 3, 4], others_before);
    assert_eq!(relayed_by(&cluster, 2), 0.0, "node 2 talks {before_relays}");
    assert!(
        others_after > others_before,
        "the other followers relay on: {others_before} then {others_after}"
    );
}
