//! Data dirs (`--data-dir`): a whole cluster stopped with SIGTERM and
//! started again keeps every counter exactly; SIGKILLed all at once under
//! strict load, it keeps every acknowledged hit and admits no actor past
//! its limit across the restart; a node whose data dir is damaged says
//! which file, recovers from its peers and keeps the counters; a leader
//! back with the end of its counter file lost, in a first majority that
//! lacks a committed state, still collects it from the voter that has it;
//! and after `add-node`/`remove-node` a full restart uses the member list
//! from the data dirs, not the cluster file.

use crate::cluster_support::*;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SHARDS: u32 = 8;
/// `/limited`'s limit in `RULES`.
const LIMIT: i64 = 200;

/// Each node's counters as `PEEK` through node `via` shows them.
fn credits(cluster: &TestCluster, via: u64, path: &str, users: &[String]) -> Vec<i64> {
    users
        .iter()
        .map(|user| peek_credit(cluster.client(via), path, user).1)
        .collect()
}

/// A cluster of three nodes (`args`), `count` users named `{prefix}N`
/// holding `/big` counters, and those counters as node 1 reads them.
fn cluster_with_counters(
    args: &[&str],
    prefix: &str,
    count: usize,
) -> (TestCluster, Vec<String>, Vec<i64>) {
    let cluster = TestCluster::start(3, SHARDS, args);
    let users: Vec<String> = (0..count).map(|i| format!("{prefix}{i}")).collect();
    spread_hits(&cluster, &users);
    let before = credits(&cluster, 1, "/big", &users);
    (cluster, users, before)
}

/// Hits `/big` for every user a different number of times, spread over
/// every node.
fn spread_hits(cluster: &TestCluster, users: &[String]) {
    for (i, user) in users.iter().enumerate() {
        let via = (i % cluster.nodes.len()) as u64 + 1;
        let hits: Vec<String> = (0..=i % 7)
            .map(|_| format!("HIT path=/big user={user}"))
            .collect();
        let answers = converse(cluster.client(via), &hits);
        assert!(
            answers.iter().all(|a| a.starts_with("OK true")),
            "{answers:?}"
        );
    }
}

/// Sends `signal` to every running node at once (one `kill`).
fn signal_all(cluster: &TestCluster, signal: &str) {
    let mut kill = std::process::Command::new("kill");
    kill.arg(format!("-{signal}"));
    for pid in cluster.nodes.iter().filter_map(|n| n.pid()) {
        kill.arg(pid.to_string());
    }
    assert!(kill.status().unwrap().success());
}

/// SIGTERM to every node at once, then waits for each to exit.
fn stop_all(cluster: &mut TestCluster) {
    signal_all(cluster, "TERM");
    let ids: Vec<u64> = cluster.nodes.iter().map(|n| n.id).collect();
    for id in ids {
        cluster.stop(id, Duration::from_secs(15));
    }
}

#[test]
fn a_full_restart_after_sigterm_keeps_every_counter_exactly() {
    let (mut cluster, users, before) = cluster_with_counters(&[], "term", 60);
    assert!(before.iter().all(|&c| c < 1_000_000 - 1), "{before:?}");
    stop_all(&mut cluster);
    let started = Instant::now();
    for id in 1..=3 {
        cluster.spawn(id, None);
    }
    cluster.wait_healthy(Duration::from_secs(30));
    eprintln!(
        "three nodes serving again {:?} after the start",
        started.elapsed()
    );
    for via in 1..=3 {
        assert_eq!(
            credits(&cluster, via, "/big", &users),
            before,
            "counters via node {via} differ after the restart"
        );
    }
    let log = cluster.log(1);
    assert!(log.contains("data dir loaded"), "{log}");
}

/// What strict load saw: per user, `true` answers before and after the
/// kill, and answers that were not `OK`.
#[derive(Default)]
struct Seen {
    admitted: BTreeMap<String, [i64; 2]>,
    errors: usize,
}

fn strict_load(
    addr: SocketAddr,
    users: Vec<String>,
    phase: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
) {
    let mut conn: Option<Conn> = None;
    let mut round = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let Some(open) = conn.as_mut() else {
            conn = Conn::open(addr).ok();
            if conn.is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
            continue;
        };
        // The phase is read before the hits leave: a hit answered after
        // the kill was sent after it.
        let at = phase.load(Ordering::SeqCst).min(1);
        let batch: Vec<String> = (0..8)
            .map(|i| users[(round + i) % users.len()].clone())
            .collect();
        round += 8;
        let lines: Vec<String> = batch
            .iter()
            .map(|u| format!("HIT path=/limited user={u}"))
            .collect();
        let answers = open.pipeline(&lines);
        let mut seen = seen.lock().unwrap();
        for (user, answer) in batch.iter().zip(&answers) {
            match parse_ok(answer) {
                Some((true, _, _)) => seen.admitted.entry(user.clone()).or_default()[at] += 1,
                Some((false, _, _)) => {}
                None => seen.errors += 1,
            }
        }
        if answers.len() < lines.len() {
            seen.errors += lines.len() - answers.len();
            conn = None;
        }
    }
}

#[test]
fn sigkill_of_every_node_under_strict_load_keeps_every_acknowledged_hit() {
    let mut cluster = TestCluster::start(3, SHARDS, &[]);
    let users: Vec<String> = (0..6).map(|i| format!("killed{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let phase = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let threads: Vec<_> = cluster
        .clients()
        .into_iter()
        .map(|addr| {
            let (users, phase, stop, seen) = (
                users.clone(),
                Arc::clone(&phase),
                Arc::clone(&stop),
                Arc::clone(&seen),
            );
            std::thread::spawn(move || strict_load(addr, users, phase, stop, seen))
        })
        .collect();
    // Load until about half of the quota is used, then kill every node.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let admitted: i64 = seen.lock().unwrap().admitted.values().map(|a| a[0]).sum();
        if admitted >= LIMIT * users.len() as i64 / 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the load admitted {admitted} hits only"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    phase.store(1, Ordering::SeqCst);
    signal_all(&cluster, "KILL");
    for id in 1..=3 {
        let _ = cluster.wait_exit(id, Duration::from_secs(5));
        cluster.kill(id);
    }
    let acknowledged: BTreeMap<String, i64> = seen
        .lock()
        .unwrap()
        .admitted
        .iter()
        .map(|(user, a)| (user.clone(), a[0]))
        .collect();
    for id in 1..=3 {
        cluster.spawn(id, None);
    }
    cluster.wait_healthy(Duration::from_secs(30));
    // Every hit acknowledged before the kill is still counted.
    for (user, &count) in &acknowledged {
        let used = peek_used(cluster.client(1), "/limited", LIMIT, user).unwrap();
        // (`PEEK` of a counter at its limit reads one below it.)
        assert!(
            used >= count.min(LIMIT - 1),
            "{user}: {count} hits were admitted before the kill, the restarted cluster counts {used}"
        );
    }
    // Load on until every actor is at its limit.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let full = {
            let seen = seen.lock().unwrap();
            users
                .iter()
                .all(|u| seen.admitted.get(u).is_some_and(|a| a[0] + a[1] >= LIMIT))
        };
        if full || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    let seen = seen.lock().unwrap();
    let mut total = 0;
    for user in &users {
        let [before, after] = seen.admitted.get(user).copied().unwrap_or_default();
        assert!(
            before + after <= LIMIT,
            "{user}: {before} admitted before the kill and {after} after, over the limit of {LIMIT}"
        );
        total += before + after;
    }
    assert!(
        total >= LIMIT * users.len() as i64 * 9 / 10,
        "the load reached {total} admissions only: {:?}",
        seen.admitted
    );
    eprintln!(
        "admitted per user: {:?}; {} hits failed around the kill",
        seen.admitted, seen.errors
    );
}

#[test]
fn a_damaged_data_dir_names_the_file_and_the_node_recovers_from_its_peers() {
    let (mut cluster, users, before) = cluster_with_counters(&[], "damaged", 40);
    cluster.stop(3, Duration::from_secs(15));
    // Flip a byte in the payload of the record in the middle of node 3's
    // metadata log (a byte of a record's length could instead claim more
    // than the file holds, which reads as a cut tail), and cut its newest
    // counter segment short.
    let dir = cluster.data_dir(3);
    let meta = dir.join("meta.log");
    let mut bytes = std::fs::read(&meta).unwrap();
    let flipped = payload_byte_near_middle(&bytes);
    bytes[flipped] ^= 0x5a;
    std::fs::write(&meta, &bytes).unwrap();
    let counters = dir.join("counters");
    let mut segments: Vec<_> = std::fs::read_dir(&counters)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.metadata().unwrap().len() > 20)
        .collect();
    segments.sort();
    let segment = segments.pop().expect("a counter file with records");
    let len = segment.metadata().unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    cluster.spawn(3, None);
    cluster.wait_healthy(Duration::from_secs(30));
    let log = cluster.log(3);
    assert!(
        log.contains(&format!("{}: corrupt record", meta.display())),
        "the error names the metadata log: {log}"
    );
    assert!(
        log.contains(&format!("{}: truncated record", segment.display())),
        "the error names the counter file: {log}"
    );
    assert!(log.contains("recover"), "{log}");
    // Node 3 holds every counter again: with node 1 gone, shards fail over
    // to nodes 2 and 3, and the counters are those from before.
    std::thread::sleep(Duration::from_millis(1_000));
    cluster.kill(1);
    cluster.wait_healthy(Duration::from_secs(30));
    assert_eq!(credits(&cluster, 3, "/big", &users), before);
    assert_eq!(credits(&cluster, 2, "/big", &users), before);
}

/// A leader's counter file that lost its end (here: put back as it was
/// before the hits) while the round carrying those hits had reached only
/// the node that forwarded them. Node 3 leads the counter's shard, node 2
/// next in line; node 3's rounds to node 2 are dropped, so the hits commit
/// through node 1. Node 3 is killed, its counter file rolled back, and it
/// comes back before its peers give up on it (an election timeout of 3 s),
/// while node 2 cannot reach it to learn that it restarted (so node 2 does
/// not stand for the shard). Node 3 leads the shard again and prepares:
/// node 2's counters come at once, node 1's 80 ms later through a
/// delayed link, and the first majority (nodes 3 and 2) lacks the hits.
/// They must still be counted: the new leader collects every voter not
/// known to be down, not only the first majority.
#[test]
fn a_new_leader_collects_every_voter_it_hears_not_only_the_first_majority() {
    let mut cluster = TestCluster::start_proxied(
        3,
        SHARDS,
        &[
            "--raft-election-timeout-ms",
            "3000",
            "--leader-balance",
            "false",
        ],
    );
    let topology = cluster.wait_healthy(Duration::from_secs(30));
    let orders =
        tollgate::cluster::placement::Placement::new(SHARDS, 3, vec![1, 2, 3]).leader_orders();
    let (user, shard, term) = (0..10_000)
        .map(|n| format!("rollback{n}"))
        .find_map(|user| {
            let shard = shard_of_user(SHARDS, "path=/big", 1_000_000, 600, &user);
            let placed = topology.placement.iter().find(|s| s.shard == shard)?;
            (orders[shard as usize] == [3, 2, 1] && placed.leader == Some(3)).then_some((
                user,
                shard,
                placed.term,
            ))
        })
        .expect("a counter of a shard node 3 leads, node 2 next in line");
    let counters = cluster.data_dir(3).join("counters");
    let saved: Vec<(std::path::PathBuf, Vec<u8>)> = std::fs::read_dir(&counters)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|path| (path.clone(), std::fs::read(&path).unwrap()))
        .collect();
    cluster.link(3, 2).blackhole();
    let hits: Vec<String> = (0..5)
        .map(|_| format!("HIT path=/big user={user}"))
        .collect();
    let answers = converse(cluster.client(1), &hits);
    assert!(
        answers.iter().all(|a| a.starts_with("OK true")),
        "{answers:?}"
    );
    assert_eq!(
        parse_ok(answers.last().unwrap()).unwrap().1,
        1_000_000 - 5,
        "{answers:?}"
    );
    let before = peek_credit(cluster.client(1), "/big", &user);
    // Node 2's copy of a section node 1 commits leaves with node 3's next
    // write to node 2, at the latest its next beat (docs/cluster.md, "The
    // data path", step 5).
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster.link(3, 2).stats().bytes_dropped == 0 {
        assert!(
            Instant::now() < deadline,
            "node 3's round to node 2 was dropped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.kill(3);
    for entry in std::fs::read_dir(&counters).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    for (path, bytes) in &saved {
        std::fs::write(path, bytes).unwrap();
    }
    cluster.link(3, 2).heal();
    cluster.link(2, 3).blackhole();
    cluster.link(3, 1).set_delay(40);
    cluster.spawn(3, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = tollgate::cluster::status::fetch_topology(
            &cluster.client(3).to_string(),
            Duration::from_secs(2),
        )
        .ok();
        let led = seen
            .as_ref()
            .and_then(|t| t.placement.iter().find(|s| s.shard == shard))
            // Node 3 leads again (at once, its vote restored); or, on a
            // machine so slow that its peers gave up on it first, another
            // voter was elected. The hits must be counted either way (only
            // the first shows the first majority lacking them).
            .is_some_and(|s| s.leader == Some(3) || (s.leader.is_some() && s.term > term));
        if led {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no leader of shard {shard} after node 3's restart: {:?}",
            seen.as_ref().map(tollgate::cluster::status::render)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    cluster.link(2, 3).heal();
    cluster.wait_healthy(Duration::from_secs(30));
    for via in [3, 1, 2] {
        assert_eq!(
            peek_credit(cluster.client(via), "/big", &user),
            before,
            "{user} via node {via}: the hits only node 1 held were collected"
        );
    }
}

#[test]
fn a_full_restart_after_add_and_remove_uses_the_members_from_the_data_dirs() {
    let (mut cluster, users, _) = cluster_with_counters(MOVE_TIME_BUDGETS, "member", 40);
    let newcomer = cluster.start_joining_node();
    cluster.wait_serving(newcomer, Duration::from_secs(20));
    let (ok, text) = cluster.add_node(1, newcomer);
    assert!(ok, "{text}");
    cluster.wait_settled(1, &[1, 2, 3, 4], Duration::from_secs(60));
    let (ok, text) = cluster.admin(1, &["remove-node", "2"]);
    assert!(ok, "{text}");
    cluster.wait_settled(1, &[1, 3, 4], Duration::from_secs(60));
    cluster.stop(2, Duration::from_secs(15));
    let before = credits(&cluster, 1, "/big", &users);
    stop_all(&mut cluster);
    // No file edited: nodes 1 and 3 start from the original cluster file
    // (nodes 1, 2, 3), node 4 from the one it joined with, without --join.
    cluster.spawn(1, None);
    cluster.spawn(3, None);
    cluster.spawn_member(4);
    let topology = cluster.wait_settled(1, &[1, 3, 4], Duration::from_secs(60));
    assert!(
        topology.members_source.contains("data dir"),
        "{}",
        topology.members_source
    );
    assert_eq!(topology.members_epoch, 2);
    for via in [1, 3, 4] {
        assert_eq!(credits(&cluster, via, "/big", &users), before, "via {via}");
    }
    assert!(!cluster.running(2));
}

/// A byte inside the payload of the record that holds the middle of a
/// record file (`[magic: 8 bytes]`, then `[length u32 LE][crc u32 LE]
/// [payload]` per record: src/cluster/disk/records.rs).
fn payload_byte_near_middle(file: &[u8]) -> usize {
    let middle = file.len() / 2;
    let mut at = 8;
    loop {
        let length = u32::from_le_bytes(file[at..at + 4].try_into().unwrap()) as usize;
        let end = at + 8 + length;
        if end > middle || end >= file.len() {
            assert!(length > 0, "an empty record at {at}");
            return at + 8 + length / 2;
        }
        at = end;
    }
}
