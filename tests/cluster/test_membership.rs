//! Run-time membership on real processes: a fourth node joins a serving
//! three-node cluster with `tollgate cluster add-node`, then a node that leads
//! shards is removed with `remove-node`, all under load. Counters survive
//! both moves, and clients see no error: hits on a shard whose leader hands
//! it over wait for the successor.

use crate::cluster_support::*;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the load threads saw.
#[derive(Default, Debug)]
struct Seen {
    ok: u64,
    /// Error answers: (when, text).
    errors: Vec<(Instant, String)>,
    /// `OK true` answers per load actor.
    admitted: std::collections::HashMap<String, u64>,
}

/// Hits `/big` for `actors` through `addr` until `stop`, 16 at a time.
fn load(addr: SocketAddr, actors: Vec<String>, stop: Arc<AtomicBool>, seen: Arc<Mutex<Seen>>) {
    let mut conn = None;
    let mut next = 0;
    while !stop.load(Ordering::Relaxed) {
        if conn.is_none() {
            conn = Conn::open(addr).ok();
        }
        let Some(c) = conn.as_mut() else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let batch: Vec<String> = (0..16)
            .map(|i| format!("HIT path=/big user={}", actors[(next + i) % actors.len()]))
            .collect();
        let answers = c.pipeline(&batch);
        let mut seen = seen.lock().unwrap();
        for (i, answer) in answers.iter().enumerate() {
            match parse_ok(answer) {
                Some((true, _, _)) => {
                    seen.ok += 1;
                    *seen
                        .admitted
                        .entry(actors[(next + i) % actors.len()].clone())
                        .or_default() += 1;
                }
                Some((false, _, _)) => panic!("a /big hit was denied: {answer}"),
                None => seen.errors.push((Instant::now(), answer.clone())),
            }
        }
        if answers.len() < batch.len() {
            conn = None; // The server closed after an ERR; reconnect.
        }
        next += 16;
    }
}

#[test]
fn a_node_joins_and_a_leading_node_leaves_under_load_with_counters_intact() {
    let mut cluster = TestCluster::start(3, 8, MOVE_TIME_BUDGETS);
    // A limited actor at 150 of 200, before any move.
    let hits: Vec<String> = (0..150)
        .map(|_| "HIT path=/limited user=keeper".to_string())
        .collect();
    let answers = converse(cluster.client(1), &hits);
    assert_eq!(
        answers.iter().filter(|a| a.starts_with("OK true")).count(),
        150,
        "{answers:?}"
    );

    // Load through nodes 2 and 3, which stay members throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let actors: Vec<String> = (0..64).map(|i| format!("load{i}")).collect();
    let threads: Vec<_> = [2, 3]
        .iter()
        .map(|&id| {
            let (addr, actors) = (cluster.client(id), actors.clone());
            let (stop, seen) = (Arc::clone(&stop), Arc::clone(&seen));
            std::thread::spawn(move || load(addr, actors, stop, seen))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));

    // Add node 4.
    let newcomer = cluster.start_joining_node();
    cluster.wait_serving(newcomer, Duration::from_secs(20));
    let errors_before_add = seen.lock().unwrap().errors.len();
    let (ok, text) = cluster.add_node(1, newcomer);
    assert!(ok, "add-node failed: {text}");
    assert!(
        text.contains("node 4 added: members 1,2,3,4 (epoch 1)"),
        "{text}"
    );
    let added_at = Instant::now();
    let topology = cluster.wait_settled(2, &[1, 2, 3, 4], Duration::from_secs(60));
    let add_took = added_at.elapsed();
    let on_new = topology
        .placement
        .iter()
        .filter(|s| s.replicas.contains(&4))
        .count();
    assert!(
        on_new > 0,
        "no shard moved to node 4: {}",
        tollgate::cluster::status::render(&topology)
    );
    // Leader balancing hands node 4 its share of leaderships (8 shards on
    // 4 nodes: 2 each at most), with no error either.
    let deadline = Instant::now() + Duration::from_secs(20);
    let topology = loop {
        let topology = cluster.wait_settled(2, &[1, 2, 3, 4], Duration::from_secs(20));
        let leads_4 = topology
            .placement
            .iter()
            .filter(|s| s.leader == Some(4))
            .count();
        if leads_4 > 0 {
            break topology;
        }
        assert!(
            Instant::now() < deadline,
            "node 4 was given no leadership: {}",
            tollgate::cluster::status::render(&topology)
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let errors_during_add = seen.lock().unwrap().errors.len() - errors_before_add;
    assert_eq!(
        errors_during_add,
        0,
        "adding a node is not a documented error moment: {:?}",
        &seen.lock().unwrap().errors[errors_before_add..]
    );
    for id in 1..=4 {
        assert_eq!(
            peek_credit(cluster.client(id), "/limited", "keeper"),
            (true, 49),
            "node {id} after the add"
        );
    }
    assert!(
        cluster
            .log(4)
            .contains("started a replica the member list places here"),
        "{}",
        cluster.log(4)
    );

    // Remove node 1, which leads shards: it hands them over first.
    let leads_1 = topology
        .placement
        .iter()
        .filter(|s| s.leader == Some(1))
        .count();
    let errors_before_remove = seen.lock().unwrap().errors.len();
    let (ok, text) = cluster.admin(2, &["remove-node", "1"]);
    assert!(ok, "remove-node failed: {text}");
    assert!(text.contains("node 1 removed"), "{text}");
    let removed_at = Instant::now();
    let topology = cluster.wait_settled(2, &[2, 3, 4], Duration::from_secs(60));
    let remove_took = removed_at.elapsed();
    assert!(topology
        .placement
        .iter()
        .all(|s| !s.replicas.contains(&1) && s.leader != Some(1)));
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    let seen = seen.lock().unwrap();
    let removal_errors = &seen.errors[errors_before_remove..];
    // Hits on a shard whose leader hands it over wait for the successor (they
    // were not counted, so they are sent again) instead of failing.
    assert!(
        removal_errors.is_empty(),
        "errors during the removal: {removal_errors:?}"
    );
    eprintln!(
        "add settled in {add_took:?}, {on_new} shards gained node 4; removal settled in {remove_took:?}; node 1 led {leads_1} shards; {} errors during the removal, {} hits admitted in all",
        removal_errors.len(),
        seen.ok
    );
    assert!(
        cluster.log(1).contains("leadership handed to node") || leads_1 == 0,
        "{}",
        cluster.log(1)
    );
    assert!(cluster.log(1).contains("retired this replica"));

    // Counters intact: the keeper still has 50 left (PEEK answers as the
    // next hit would: 49 after it), on every member.
    for id in 2..=4 {
        assert_eq!(
            peek_credit(cluster.client(id), "/limited", "keeper"),
            (true, 49),
            "node {id} after the removal"
        );
    }
    let more: Vec<String> = (0..60)
        .map(|_| "HIT path=/limited user=keeper".to_string())
        .collect();
    let answers = converse(cluster.client(4), &more);
    assert_eq!(
        answers.iter().filter(|a| a.starts_with("OK true")).count(),
        50,
        "{answers:?}"
    );
    // Load actors: every admitted hit is still counted (errors may or may
    // not have been counted: under-admission, never over).
    for (actor, admitted) in &seen.admitted {
        let (_, credit) = peek_credit(cluster.client(3), "/big", actor);
        let used = 1_000_000 - 1 - credit; // PEEK answers as a hit would.
        assert!(
            used as u64 >= *admitted,
            "{actor}: {admitted} admitted but only {used} counted"
        );
    }
}

#[test]
fn membership_requests_are_validated_with_clear_errors() {
    let cluster = TestCluster::start(3, 4, &[]);
    let (ok, text) = cluster.admin(1, &["remove-node", "9"]);
    assert!(!ok);
    assert!(
        text.contains("node 9 is not a member (members: 1,2,3)"),
        "{text}"
    );
    let client2 = cluster.client(2).to_string();
    let (ok, text) = cluster.admin(
        1,
        &[
            "add-node",
            "2",
            "--client",
            &client2,
            "--peer",
            "127.0.0.1:1",
        ],
    );
    assert!(!ok);
    assert!(text.contains("node 2 is already a member"), "{text}");
    // Nothing listens there: the node must be started first.
    let free = free_ports(2);
    let (ok, text) = cluster.admin(
        1,
        &[
            "add-node",
            "5",
            "--client",
            &format!("127.0.0.1:{}", free[0]),
            "--peer",
            &format!("127.0.0.1:{}", free[1]),
        ],
    );
    assert!(!ok);
    assert!(
        text.contains("node 5 does not answer") && text.contains("--join"),
        "{text}"
    );
    // Without the cluster secret, the request is not even heard.
    let wrong = cluster.dir.path().join("wrong.secret");
    write_secret_file(&wrong, &["not-the-cluster-secret-0123456789"]);
    let output = std::process::Command::new(TOLLGATE)
        .args(["cluster", "remove-node", "3", "--node"])
        .arg(cluster.nodes[0].peer.to_string())
        .arg("--cluster-secret-file")
        .arg(&wrong)
        .env_remove("TOLLGATE_CLUSTER_SECRET")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(text.contains("did not accept the cluster secret"), "{text}");
    // Refused requests leave the member list alone.
    let topology = cluster.topology().unwrap();
    assert_eq!(topology.members_epoch, 0);
    assert_eq!(topology.nodes.len(), 3);
}
