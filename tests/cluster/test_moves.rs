//! Shards moving under load cost latency, never errors, on real processes:
//! with 64 shards and fresh actors in every request (so every shard is hit,
//! including shards whose new replica has not caught up yet), a fourth node
//! joins and a node leaves while clients talk to every node, the new one
//! included; and a handover whose successor is killed before it can take
//! over ends with the old leader leading on, then handing over elsewhere.
//! Also: one read batch whose hits span every shard (some decided on the
//! receiving node, the others forwarded to each peer) is answered hit by
//! hit, in request order; a read batch of hits decided at once and hits
//! forwarded is answered in one write; and read batches that arrive while
//! one waits for its answers, a `TOPOLOGY` among them, keep request order.
//! And ring placement: each node's led shards stay on its next two members
//! through a node's kill and return.

use crate::cluster_support::*;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the load threads saw.
#[derive(Default, Debug)]
struct Seen {
    ok: u64,
    /// Error answers and lost connections: (entry node, text).
    errors: Vec<(u64, String)>,
}

/// Hits `/big` through `addr` until `stop`, 16 pipelined requests at a
/// time, each for an actor never used before (from `pick`), so that over
/// time every shard is hit.
fn load(
    node: u64,
    addr: SocketAddr,
    pick: Arc<dyn Fn(u64) -> String + Send + Sync>,
    counter: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
) {
    let mut conn: Option<Conn> = None;
    while !stop.load(Ordering::Relaxed) {
        if conn.is_none() {
            conn = Conn::open(addr).ok();
        }
        let Some(c) = conn.as_mut() else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let batch: Vec<String> = (0..16)
            .map(|_| {
                format!(
                    "HIT path=/big user={}",
                    pick(counter.fetch_add(1, Ordering::Relaxed))
                )
            })
            .collect();
        let answers = c.pipeline(&batch);
        let mut seen = seen.lock().unwrap();
        for answer in &answers {
            match parse_ok(answer) {
                Some((true, _, _)) => seen.ok += 1,
                Some((false, _, _)) => panic!("a /big hit was denied: {answer}"),
                None => seen.errors.push((node, answer.clone())),
            }
        }
        if answers.len() < batch.len() {
            seen.errors.push((node, "connection closed".into()));
            conn = None;
        }
        drop(seen);
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn spawn_load(
    node: u64,
    addr: SocketAddr,
    pick: Arc<dyn Fn(u64) -> String + Send + Sync>,
    counter: &Arc<AtomicU64>,
    stop: &Arc<AtomicBool>,
    seen: &Arc<Mutex<Seen>>,
) -> std::thread::JoinHandle<()> {
    let (counter, stop, seen) = (Arc::clone(counter), Arc::clone(stop), Arc::clone(seen));
    std::thread::spawn(move || load(node, addr, pick, counter, stop, seen))
}

#[test]
fn no_errors_while_a_node_joins_and_another_leaves_under_load_on_every_node() {
    let mut cluster = TestCluster::start(3, 64, MOVE_TIME_BUDGETS);
    cluster.wait_healthy(Duration::from_secs(20));
    let keeper: Vec<String> = (0..150)
        .map(|_| "HIT path=/limited user=keeper".to_string())
        .collect();
    let answers = converse(cluster.client(1), &keeper);
    assert_eq!(
        answers.iter().filter(|a| a.starts_with("OK true")).count(),
        150
    );

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let counter = Arc::new(AtomicU64::new(0));
    let fresh: Arc<dyn Fn(u64) -> String + Send + Sync> = Arc::new(|n| format!("fresh{n}"));
    let mut threads: Vec<_> = (1..=3)
        .map(|id| {
            spawn_load(
                id,
                cluster.client(id),
                Arc::clone(&fresh),
                &counter,
                &stop,
                &seen,
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));

    // Node 4 joins; clients use it as soon as it serves (before any shard
    // moved to it, and while its new replicas catch up).
    let newcomer = cluster.start_joining_node();
    cluster.wait_serving(newcomer, Duration::from_secs(20));
    threads.push(spawn_load(
        newcomer,
        cluster.client(newcomer),
        Arc::clone(&fresh),
        &counter,
        &stop,
        &seen,
    ));
    std::thread::sleep(Duration::from_millis(300));
    let (ok, text) = cluster.add_node(1, newcomer);
    assert!(ok, "add-node failed: {text}");
    let topology = cluster.wait_settled(2, &[1, 2, 3, 4], Duration::from_secs(90));
    let on_new = topology
        .placement
        .iter()
        .filter(|s| s.replicas.contains(&4))
        .count();
    assert!(on_new > 20, "only {on_new} of 64 shards moved to node 4");
    let after_add = seen.lock().unwrap().ok;

    // Node 2 leaves; it keeps serving its clients until it is stopped.
    let (ok, text) = cluster.admin(3, &["remove-node", "2"]);
    assert!(ok, "remove-node failed: {text}");
    let topology = cluster.wait_settled(3, &[1, 3, 4], Duration::from_secs(90));
    assert!(topology
        .placement
        .iter()
        .all(|s| !s.replicas.contains(&2) && s.leader != Some(2)));
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    let seen = seen.lock().unwrap();
    assert!(
        seen.errors.is_empty(),
        "{} errors while shards moved: {:?}",
        seen.errors.len(),
        &seen.errors[..seen.errors.len().min(20)]
    );
    assert!(
        after_add > 1_000 && seen.ok > after_add,
        "too little load: {seen:?}"
    );
    for id in [1, 3, 4] {
        assert_eq!(
            peek_credit(cluster.client(id), "/limited", "keeper"),
            (true, 49),
            "node {id}"
        );
    }
    eprintln!(
        "{} hits, 0 errors; {on_new} shards moved to node 4",
        seen.ok
    );
}

/// How the successor of the handovers is lost.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// SIGKILL: its links break, the handover fails at once.
    Kill,
    /// Blackholed links: it looks up (connected) until the liveness
    /// timeout, so the handover stops deciding, asks it to stand, and
    /// waits for an answer that never comes.
    Blackhole,
}

fn handover_to_a_lost_successor(loss: Loss) {
    let mut cluster = match loss {
        Loss::Kill => TestCluster::start(4, 16, &[]),
        Loss::Blackhole => TestCluster::start_proxied(4, 16, &[]),
    };
    // Leader balancing may still be handing shards over after the start:
    // wait until it is done, so that the shards chosen below stay node 1's.
    let topology = cluster.wait_leaders_stable(Duration::from_secs(3), Duration::from_secs(40));
    // Actors of the shards node 1 leads, so that losing node 2 breaks no
    // hit in flight: every hit goes to node 1, or to its successor.
    let actors = users_led_by(&topology, 16, 1, "h", 400);
    let actors = Arc::new(actors);
    let pick: Arc<dyn Fn(u64) -> String + Send + Sync> = {
        let actors = Arc::clone(&actors);
        Arc::new(move |n| actors[n as usize % actors.len()].clone())
    };
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let counter = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = [3, 4]
        .iter()
        .map(|&id| {
            spawn_load(
                id,
                cluster.client(id),
                Arc::clone(&pick),
                &counter,
                &stop,
                &seen,
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // Node 2 is lost just as node 1 leaves: node 1 hands each shard to the
    // lowest-numbered target voter, node 2 where it is one.
    match loss {
        Loss::Kill => cluster.kill(2),
        Loss::Blackhole => cluster.isolate(2, Fault::Blackhole),
    }
    let (ok, text) = cluster.admin(3, &["remove-node", "1"]);
    assert!(ok, "remove-node failed: {text}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let led = tollgate::cluster::status::fetch_topology(
            &cluster.client(3).to_string(),
            Duration::from_secs(2),
        )
        .map(|t| t.placement.iter().filter(|s| s.leader == Some(1)).count())
        .unwrap_or(usize::MAX);
        if led == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node 1 still leads {led} shards: {}",
            cluster.log(1)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    let seen = seen.lock().unwrap();
    let log = cluster.log(1);
    assert!(
        seen.errors.is_empty(),
        "{loss:?}: {} errors: {:?}\n{log}",
        seen.errors.len(),
        &seen.errors[..seen.errors.len().min(20)]
    );
    assert!(seen.ok > 500, "too little load: {seen:?}");
    let failed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("leaving: did not finish"))
        .collect();
    eprintln!(
        "{loss:?}: {} hits through the handovers, 0 errors; failed handovers: {failed:#?}",
        seen.ok
    );
}

#[test]
fn a_handover_whose_successor_is_killed_costs_latency_not_errors() {
    handover_to_a_lost_successor(Loss::Kill);
}

#[test]
fn a_handover_whose_successor_goes_silent_costs_latency_not_errors() {
    handover_to_a_lost_successor(Loss::Blackhole);
}

#[test]
fn one_read_batch_across_every_shard_is_answered_in_request_order() {
    for consistency in ["strict", "fast"] {
        let cluster = TestCluster::start(3, 64, &["--consistency", consistency]);
        cluster.wait_healthy(Duration::from_secs(20));
        // One user per shard, hit three times each, interleaved, with a
        // PEEK and a denied default-rule hit in between.
        let users = probe_users(64);
        let mut lines = Vec::new();
        let mut expected = Vec::new();
        for round in 0..3 {
            for (i, user) in users.iter().enumerate() {
                lines.push(format!("HIT path=/limited user={user}-{consistency}"));
                expected.push(format!("OK true {} 60", 199 - round));
                if i % 16 == 0 {
                    lines.push(format!("PEEK path=/limited user={user}-{consistency}"));
                    expected.push(format!("OK true {} 60", 198 - round));
                }
            }
            lines.push("HIT path=/never/matched ip=1.2.3.4".to_string());
            expected.push(format!("OK true {} 60", 4 - round));
        }
        for via in 1..=3 {
            // Fresh counters per entry node: the last word gets a suffix.
            let sent: Vec<String> = lines.iter().map(|l| format!("{l}-{via}")).collect();
            let answers = Conn::open(cluster.client(via)).unwrap().pipeline(&sent);
            assert_eq!(
                answers.len(),
                sent.len(),
                "{consistency} via node {via}: {answers:?}"
            );
            for (i, (answer, want)) in answers.iter().zip(&expected).enumerate() {
                assert_eq!(
                    answer.trim_end(),
                    want,
                    "{consistency} via node {via}, request {i}: {}",
                    sent[i]
                );
            }
        }
    }
}

/// Fast mode: hits the entry node decides at once and hits it forwards,
/// pipelined in one read, are answered in *one* write, not the ready ones
/// first and the forwarded ones a round trip later (the client, whose
/// requests were pipelined together, waits for them all anyway; a write
/// costs a system call on both sides). Seen from the client: the first
/// read returns every reply.
#[test]
fn a_read_batch_of_local_and_forwarded_hits_is_answered_in_one_write() {
    use std::io::{Read, Write};
    let cluster = TestCluster::start(3, 64, &["--consistency", "fast"]);
    let topology = cluster.wait_leaders_stable(Duration::from_secs(3), Duration::from_secs(60));
    let leader_of = |shard: u32| {
        topology
            .placement
            .iter()
            .find(|s| s.shard == shard)
            .and_then(|s| s.leader)
    };
    // Eight actors node 1 leads, then eight it must forward.
    let (mut local, mut forwarded) = (Vec::new(), Vec::new());
    for i in 0.. {
        let user = format!("onewrite{i}");
        let shard = shard_of_user(64, "path=/limited", 200, 60, &user);
        match leader_of(shard) {
            Some(1) if local.len() < 8 => local.push(user),
            Some(leader) if leader != 1 && forwarded.len() < 8 => forwarded.push(user),
            _ => {}
        }
        if local.len() == 8 && forwarded.len() == 8 {
            break;
        }
    }
    let batch: String = local
        .iter()
        .chain(&forwarded)
        .map(|user| format!("HIT path=/limited user={user}\n"))
        .collect();
    for attempt in 0..3 {
        // The same actors each time: every count goes down by one.
        let mut stream = std::net::TcpStream::connect(cluster.client(1)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(batch.as_bytes()).unwrap();
        let mut first = vec![0u8; 64 * 1024];
        let n = stream.read(&mut first).unwrap();
        let text = String::from_utf8_lossy(&first[..n]);
        let replies: Vec<&str> = text.lines().collect();
        assert_eq!(
            replies.len(),
            16,
            "attempt {attempt}: the first read held {} of 16 replies: {text:?}",
            replies.len()
        );
        for (i, reply) in replies.iter().enumerate() {
            assert_eq!(*reply, format!("OK true {} 60", 199 - attempt), "reply {i}");
        }
    }
}

/// Read batches that arrive while earlier ones wait for their forwarded
/// answers queue behind them, with a command answered later (`TOPOLOGY`)
/// among them: every reply comes back, in request order, whether the
/// server read the writes one at a time or together.
#[test]
fn read_batches_behind_one_waiting_for_its_answers_keep_request_order() {
    use std::io::{BufRead, BufReader, Write};
    let cluster = TestCluster::start(3, 64, &["--consistency", "fast"]);
    cluster.wait_healthy(Duration::from_secs(20));
    let stream = std::net::TcpStream::connect(cluster.client(1)).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    for attempt in 0..5 {
        let mut expected = Vec::new();
        for write in 0..4 {
            // Fresh actors over many shards: most are forwarded.
            let mut batch = String::new();
            for i in 0..16 {
                if write % 2 == 1 && i == 8 {
                    batch.push_str("TOPOLOGY\n");
                    expected.push("{");
                }
                batch.push_str(&format!(
                    "HIT path=/limited user=queued{attempt}-{write}-{i}\n"
                ));
                expected.push("OK true 199 60");
            }
            writer.write_all(batch.as_bytes()).unwrap();
        }
        for (i, want) in expected.iter().enumerate() {
            let mut reply = String::new();
            reader.read_line(&mut reply).unwrap();
            let shown: String = reply.chars().take(100).collect();
            assert!(
                reply.starts_with(want),
                "attempt {attempt}, reply {i}: {shown:?}…, expected {want:?}"
            );
        }
    }
}

/// Ring placement (`placement = ring`) on five nodes: each shard's replicas
/// are its leader and the two members after it, so a node's rounds go to
/// two peers; a killed node's shards are led by those two members, and its
/// leadership comes back once it is back and caught up. Hits through every
/// node count on one counter throughout.
#[test]
fn a_ring_cluster_keeps_each_nodes_led_shards_on_its_next_two_members() {
    const SHARDS: u32 = 10;
    let mut cluster = TestCluster::start_ring(5, SHARDS, &[]);
    let run = |first: u64| -> Vec<u64> {
        let mut run: Vec<u64> = (0..3).map(|step| (first - 1 + step) % 5 + 1).collect();
        run.sort_unstable();
        run
    };
    let assert_ring = |topology: &tollgate::cluster::status::Topology| {
        let mut led: std::collections::BTreeMap<u64, u32> = Default::default();
        for shard in &topology.placement {
            let leader = shard.leader.expect("every shard led");
            let mut replicas = shard.replicas.clone();
            replicas.sort_unstable();
            assert_eq!(
                replicas,
                run(leader),
                "shard {} is not led by its first replica: {}",
                shard.shard,
                tollgate::cluster::status::render(topology)
            );
            assert_eq!(
                shard.preferred_leader,
                Some(leader),
                "shard {}'s first replica as status names it",
                shard.shard
            );
            *led.entry(leader).or_default() += 1;
        }
        assert!(
            led.len() == 5 && led.values().all(|&count| count == 2),
            "every node leads two shards: {led:?}"
        );
    };
    let topology = cluster.wait_leaders_stable(Duration::from_secs(3), Duration::from_secs(60));
    assert_eq!(topology.placement_kind, "ring");
    let rendered = tollgate::cluster::status::render(&topology);
    assert!(
        rendered.contains("5 nodes, 10 shards x 3 replicas (ring placement), consistency strict"),
        "{rendered}"
    );
    assert_ring(&topology);
    // The table lists a shard's replicas from its first replica on: node
    // 5's runs wrap to nodes 1 and 2.
    let of_5 = topology
        .placement
        .iter()
        .find(|s| s.leader == Some(5))
        .expect("node 5 leads shards");
    let row = format!("{:<6} {:<7} {:<5} 5,1,2", of_5.shard, 5, of_5.term);
    assert!(rendered.contains(&row), "no row `{row}` in {rendered}");
    let firsts_of_3: Vec<u32> = topology
        .placement
        .iter()
        .filter(|s| s.leader == Some(3))
        .map(|s| s.shard)
        .collect();

    // One counter, hit through every node.
    let mut used = 0;
    let mut hit_everywhere = |cluster: &TestCluster, live: &[u64]| {
        for &node in live {
            let answers = converse(
                cluster.client(node),
                &["HIT path=/limited user=ring".to_string()],
            );
            used += 1;
            assert_eq!(
                parse_ok(&answers[0]).map(|(allowed, credit, _)| (allowed, credit)),
                Some((true, 200 - used)),
                "hit {used} through node {node}: {answers:?}"
            );
        }
    };
    hit_everywhere(&cluster, &[1, 2, 3, 4, 5]);

    cluster.kill(3);
    let topology = cluster.wait_healthy(Duration::from_secs(30));
    for shard in &firsts_of_3 {
        let leader = topology.placement[*shard as usize].leader;
        assert!(
            matches!(leader, Some(4 | 5)),
            "shard {shard} of node 3 is led by {leader:?}, not by node 4 or 5"
        );
    }
    hit_everywhere(&cluster, &[1, 2, 4, 5]);

    cluster.spawn(3, None);
    let topology = cluster.wait_leaders_stable(Duration::from_secs(3), Duration::from_secs(60));
    assert_ring(&topology);
    hit_everywhere(&cluster, &[1, 2, 3, 4, 5]);
}
