//! Three real nodes on loopback: any node answers as a single node would,
//! `tollgate cluster status` shows the cluster, nodes with different rules
//! refuse each other, many clients on all nodes never over-admit, and a
//! round its leader does not wait on reaches every replica and commits by
//! the followers' beats.

use crate::cluster_support::*;
use std::time::{Duration, Instant};
use tollgate::cluster::wire::NodeStats;

/// Node `id`'s data-path counters, from `cluster status`.
fn node_stats(cluster: &TestCluster, id: u64) -> NodeStats {
    let topology = cluster.topology().expect("status");
    let node = topology.nodes.iter().find(|n| n.id == id).unwrap();
    node.stats
        .clone()
        .unwrap_or_else(|| panic!("node {id}'s stats"))
}

/// A transcript touching several rules (canary included), the three
/// algorithms, actors and limits, including denials.
fn transcript() -> Vec<String> {
    let mut lines = Vec::new();
    for round in 0..8 {
        for user in ["ann", "bob", "cy"] {
            lines.push(format!("HIT path=/limited user={user}"));
            lines.push(format!("HIT path=/canary-{round} user={user}"));
        }
        for ip in 0..4 {
            lines.push(format!("HIT path=/other ip=10.0.0.{ip}"));
        }
        lines.push("PEEK path=/limited user=ann".to_string());
        lines.push("HIT path=/big user=ann".to_string());
        // Token bucket and sliding window, decided by the shard's leader
        // with the rule's algorithm; denials from round 4 on.
        for user in ["ann", "bob"] {
            lines.push(format!("HIT path=/bucket user={user}"));
            lines.push(format!("HIT path=/sliding user={user}"));
        }
        lines.push("PEEK path=/bucket user=ann".to_string());
        lines.push("PEEK path=/sliding user=bob".to_string());
    }
    lines
}

#[test]
fn any_node_answers_as_a_single_node_would() {
    let cluster = TestCluster::start(3, 8, &[]);
    let single = SingleNode::start(&cluster.rules_path);
    let clients = cluster.clients();
    let lines = transcript();
    // One connection per node, lines sent round-robin, one at a time.
    let mut conns: Vec<Conn> = clients.iter().map(|&a| Conn::open(a).unwrap()).collect();
    let mut reference = Conn::open(single.addr).unwrap();
    for (i, line) in lines.iter().enumerate() {
        let got = conns[i % 3].pipeline(std::slice::from_ref(line));
        let want = reference.pipeline(std::slice::from_ref(line));
        let (got, want) = (got.first().cloned(), want.first().cloned());
        let parsed = (
            got.as_deref().and_then(parse_ok),
            want.as_deref().and_then(parse_ok),
        );
        match parsed {
            (Some((g_allowed, g_credit, g_reset)), Some((w_allowed, w_credit, w_reset))) => {
                assert_eq!(
                    (g_allowed, g_credit),
                    (w_allowed, w_credit),
                    "line {i} {line:?}: cluster {got:?}, single {want:?}"
                );
                // Windows opened a few ms apart may round to adjacent seconds.
                assert!(
                    (g_reset - w_reset).abs() <= 1,
                    "line {i}: {got:?} vs {want:?}"
                );
            }
            _ => panic!("line {i} {line:?}: cluster {got:?}, single {want:?}"),
        }
    }
}

#[test]
fn cluster_status_shows_nodes_shards_leaders_and_lag() {
    let cluster = TestCluster::start(3, 8, &[]);
    // Write something so followers have something to lag behind.
    let lines: Vec<String> = (0..50)
        .map(|i| format!("HIT path=/big user=u{i}"))
        .collect();
    assert_eq!(converse(cluster.client(2), &lines).len(), 50);
    for id in 1..=3 {
        let output = std::process::Command::new(TOLLGATE)
            .args(["cluster", "status", "--check", "--node"])
            .arg(cluster.client(id).to_string())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "node {id}: {text}");
        assert!(
            text.contains("3 nodes, 8 shards x 3 replicas, consistency strict"),
            "{text}"
        );
        assert!(text.contains(&format!("answered by node {id}")), "{text}");
        for node in 1..=3 {
            assert!(text.contains(&cluster.client(node).to_string()), "{text}");
        }
        // Eight shard rows, each with a leader and a lag entry per follower.
        let rows: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("SHARD"))
            .skip(1)
            .collect();
        assert_eq!(rows.len(), 8, "{text}");
        for row in rows {
            let columns: Vec<&str> = row.split_whitespace().collect();
            assert!(columns[1].parse::<u64>().is_ok(), "no leader: {row}");
            assert_eq!(columns[4..].len(), 2, "lag of two followers: {row}");
        }
    }
    // The JSON form names the leaders' client addresses.
    let topology = cluster.topology().unwrap();
    for shard in 0..8 {
        assert!(topology.leader_client(shard).is_some());
    }
    // And every node's data-path counters: the 50 hits sent to node 2 were
    // decided there or forwarded (in batches), and every admitted one was
    // replicated in a round (strict: committed).
    let stats: Vec<_> = topology
        .nodes
        .iter()
        .map(|n| n.stats.clone().expect("every node reports its counters"))
        .collect();
    let forwarded = stats[1].forwarded_ops;
    let decided_elsewhere: u64 = stats.iter().map(|s| s.forwards_decided).sum();
    assert_eq!(decided_elsewhere, forwarded, "{stats:?}");
    assert!(
        forwarded > 0 && stats[1].forward_batches <= forwarded,
        "{stats:?}"
    );
    let replicated: u64 = stats.iter().map(|s| s.states_replicated).sum();
    assert!(replicated >= 50, "{stats:?}");
    let committed: u64 = stats.iter().map(|s| s.sections_committed).sum();
    let sections: u64 = stats.iter().map(|s| s.round_sections).sum();
    assert_eq!(committed, sections, "{stats:?}");
    let text = std::process::Command::new(TOLLGATE)
        .args(["cluster", "status", "--node"])
        .arg(cluster.client(1).to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("DATA PATH (since start)"), "{text}");
}

#[test]
fn a_node_with_different_rules_is_refused_with_a_clear_error() {
    let mut cluster = TestCluster::start(3, 4, &[]);
    cluster.kill(3);
    let other_rules = cluster.dir.path().join("other.ini");
    std::fs::write(
        &other_rules,
        "[default]\ncreditLimit = 7\nresetSeconds = 60\n",
    )
    .unwrap();
    cluster.spawn(3, Some(&other_rules));
    let status = cluster
        .wait_exit(3, Duration::from_secs(15))
        .expect("a node with different rules exits");
    assert!(!status.success());
    let log = cluster.log(3);
    assert!(
        log.contains("rules differ") && log.contains("identical on every node"),
        "{log}"
    );
    // The refusing side says so too.
    assert!(cluster.log(1).contains("rules differ") || cluster.log(2).contains("rules differ"));
}

/// Many clients spread over all nodes hammer one actor with limit L.
fn hammer_one_actor(args: &[&str]) -> (usize, usize) {
    let cluster = TestCluster::start(3, 8, args);
    let clients = cluster.clients();
    let limit = 200;
    let per_client = 150;
    let threads: Vec<_> = (0..9)
        .map(|i| {
            let addr = clients[i % 3];
            std::thread::spawn(move || {
                let mut conn = Conn::open(addr).unwrap();
                let mut allowed = 0;
                let mut answered = 0;
                for _ in 0..per_client / 10 {
                    let lines = vec!["HIT path=/limited user=hot".to_string(); 10];
                    for answer in conn.pipeline(&lines) {
                        answered += 1;
                        if answer.starts_with("OK true") {
                            allowed += 1;
                        }
                    }
                }
                (allowed, answered)
            })
        })
        .collect();
    let (mut allowed, mut answered) = (0, 0);
    for thread in threads {
        let (a, n) = thread.join().unwrap();
        allowed += a;
        answered += n;
    }
    assert_eq!(answered, 9 * per_client, "every hit answered");
    (allowed, limit)
}

#[test]
fn strict_mode_admits_exactly_the_limit() {
    let (allowed, limit) = hammer_one_actor(&[]);
    assert_eq!(allowed, limit);
}

#[test]
fn fast_mode_admits_exactly_the_limit_without_failures() {
    let (allowed, limit) = hammer_one_actor(&["--consistency", "fast"]);
    assert_eq!(allowed, limit);
}

#[test]
fn the_cluster_client_goes_straight_to_each_shards_leader() {
    let cluster = TestCluster::start(3, 8, &[]);
    let rules = tollgate::rules::RuleSet::from_ini(RULES).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let seed = cluster.client(3).to_string();
        let mut client = tollgate::cluster::ClusterClient::connect(&seed, rules)
            .await
            .unwrap();
        let topology = client.topology().clone();
        let mut shards_seen = std::collections::BTreeSet::new();
        for i in 0..40 {
            let user = format!("c{i}");
            let pairs = [("path", "/limited"), ("user", user.as_str())];
            let shard = client.shard_of(&pairs).unwrap();
            shards_seen.insert(shard);
            assert_eq!(
                client.route(&pairs).as_deref(),
                topology.leader_client(shard),
                "user {user}"
            );
            for expected_credit in [199, 198] {
                match client.hit(&pairs).await.unwrap() {
                    tollgate::client::Response::Ok {
                        allowed, credit, ..
                    } => {
                        assert!(allowed);
                        assert_eq!(credit, expected_credit);
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
        assert!(shards_seen.len() >= 6, "40 users cover most of 8 shards");
        // The default rule (5 per minute per ip) has a counter too.
        assert!(client.shard_of(&[("ip", "1.2.3.4")]).is_some());
    });
}

/// A node that forwarded a hit its leader denied answers the counter's
/// later hits `false` itself until about a second before the window
/// resets (src/cluster/forward/denials.rs), in both modes: the same
/// answers as the leader's, fewer forwarded hits, and the counter admits
/// again once its window has reset.
#[test]
fn a_forwarding_node_answers_a_denied_counter_itself_until_its_window_resets() {
    for mode in ["strict", "fast"] {
        let cluster = TestCluster::start_observed(3, 8, &["--consistency", mode], false);
        let topology = cluster.wait_leaders_stable(Duration::from_secs(2), Duration::from_secs(60));
        // A user whose counter node 1 does not lead: its hits through
        // node 1 are forwarded.
        let user = (0..)
            .map(|n| format!("denied{n}"))
            .find(|user| {
                let shard = shard_of_user(8, "path=/brief", 3, 4, user);
                topology.placement[shard as usize].leader != Some(1)
            })
            .unwrap();
        let forwarded = |cluster: &TestCluster| node_stats(cluster, 1).forwarded_ops;
        let before = forwarded(&cluster);
        let line = format!("HIT path=/brief user={user}");
        let mut conn = Conn::open(cluster.client(1)).unwrap();
        let started = Instant::now();
        let answers = conn.pipeline(&vec![line.clone(); 4]);
        let answers: Vec<_> = answers.iter().map(|a| parse_ok(a)).collect();
        assert_eq!(
            answers
                .iter()
                .map(|a| a.map(|(allowed, credit, _)| (allowed, credit)))
                .collect::<Vec<_>>(),
            vec![
                Some((true, 2)),
                Some((true, 1)),
                Some((true, 0)),
                Some((false, 0))
            ],
            "{mode}: the limit, then the leader's denial"
        );
        // The next hits are denied here, with the leader's reset, counting
        // down.
        for _ in 0..5 {
            let answer = parse_ok(&conn.pipeline(&vec![line.clone(); 1])[0]);
            let (allowed, credit, reset) = answer.expect("OK");
            assert!(!allowed && credit == 0, "{mode}: {answer:?}");
            assert!((1..=4).contains(&reset), "{mode}: reset {reset}");
        }
        assert_eq!(
            forwarded(&cluster) - before,
            4,
            "{mode}: only the hits up to the first denial were forwarded"
        );
        assert_eq!(
            metric(
                cluster.metrics_addr(1),
                "tollgate_cluster_denials_remembered_total"
            ),
            Some(5.0),
            "{mode}: the hits node 1 denied itself, on /metrics"
        );
        // Past the window's end, the counter admits again (through the
        // leader).
        let reset_at = started + Duration::from_millis(4_600);
        std::thread::sleep(reset_at.saturating_duration_since(Instant::now()));
        let answer = parse_ok(&conn.pipeline(&vec![line.clone(); 1])[0]);
        assert_eq!(
            answer.map(|(allowed, credit, _)| (allowed, credit)),
            Some((true, 2)),
            "{mode}: a new window"
        );
        assert_eq!(forwarded(&cluster) - before, 5, "{mode}");
    }
}

/// A leader asks its followers to acknowledge at once only the rounds it
/// waits on (`tag::ACK_NOW`, peer protocol 2.5), and sends a section at
/// once only to the follower whose hits ride with it; hits a follower
/// forwarded are answered with the round, so their sections wait on no
/// one: the follower's ack, and the other follower's copy, go with the
/// next frame on their link or its next beat. With nothing else flowing
/// they ride the beats: every such section still commits, none times out,
/// and the other follower holds every state.
#[test]
fn sections_no_one_waits_on_reach_every_replica_and_commit_by_the_next_beats() {
    // Beats far apart, and a commit timeout that lets acks wait for them
    // (lazy acks and copies need at least four beats).
    let cluster = TestCluster::start(
        3,
        4,
        &[
            "--raft-heartbeat-ms",
            "400",
            "--raft-election-timeout-ms",
            "2000",
            "--commit-timeout-ms",
            "8000",
        ],
    );
    let topology = cluster.wait_leaders_stable(Duration::from_secs(2), Duration::from_secs(60));
    let leader = topology
        .placement
        .iter()
        .filter_map(|s| s.leader)
        .next()
        .expect("a leader");
    let mut followers = [1, 2, 3].into_iter().filter(|&id| id != leader);
    let (via, other) = (followers.next().unwrap(), followers.next().unwrap());
    let before = node_stats(&cluster, leader);
    let other_before = node_stats(&cluster, other);
    let users = users_led_by(&topology, 4, leader, "unasked", 24);
    let lines: Vec<String> = users
        .iter()
        .map(|u| format!("HIT path=/big user={u}"))
        .collect();
    let mut conn = Conn::open(cluster.client(via)).unwrap();
    let answers = conn.pipeline(&lines);
    for (user, answer) in users.iter().zip(&answers) {
        assert_eq!(
            parse_ok(answer).map(|(allowed, credit, _)| (allowed, credit)),
            Some((true, 999_999)),
            "{user} through node {via}: {answer}"
        );
    }
    // Every section the leader sent ends, committed, and the other
    // follower applies every state, within a few beats (bounded far above
    // that here for a loaded machine; the commit timeout is 8 s, so a
    // section whose acks never came would count as failed).
    let deadline = Instant::now() + Duration::from_secs(30);
    let after = loop {
        let now = node_stats(&cluster, leader);
        let applied = node_stats(&cluster, other).states_applied - other_before.states_applied;
        let ended = now.sections_committed + now.sections_failed;
        if ended - (before.sections_committed + before.sections_failed)
            >= now.round_sections - before.round_sections
            && applied >= users.len() as u64
        {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "sections still open, or node {other} applied {applied} states: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        after.round_sections > before.round_sections,
        "the hits went out in rounds: {after:?}"
    );
    assert_eq!(
        after.sections_failed, before.sections_failed,
        "no section timed out waiting for an unasked ack: {after:?}"
    );
    assert_eq!(
        node_stats(&cluster, other).states_applied - other_before.states_applied,
        users.len() as u64,
        "node {other} holds each hit's state once"
    );
}
