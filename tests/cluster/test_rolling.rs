//! A rolling restart of all three nodes, one at a time (SIGTERM, start
//! again, wait until every shard has a leader and no replica is
//! recovering), under continuous load on every node: an actor at its limit
//! stays at its limit, high-limit counters never go backwards, nothing
//! acknowledged is forgotten, and errors happen only around each restart.

use crate::cluster_support::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SHARDS: u32 = 8;
const BIG_LIMIT: i64 = 1_000_000;
/// `[path=/chaos]` in the shared rules.
const LIMIT: i64 = 1_000;
/// Errors are allowed from just before a node is stopped until this long
/// after the cluster is healthy again (clients reconnect, leader tables
/// settle).
const SETTLE: Duration = Duration::from_millis(1_000);

fn big_users() -> Vec<String> {
    (0..12).map(|i| format!("h{i}")).collect()
}

fn sample(addr: std::net::SocketAddr) -> Vec<i64> {
    big_users()
        .iter()
        .map(|u| peek_used(addr, "/big", BIG_LIMIT, u).unwrap_or_else(|| panic!("PEEK {u}")))
        .collect()
}

/// `OK false` for the actor at its limit, through `addr`, with credit 0.
fn at_limit(addr: std::net::SocketAddr) -> bool {
    let answers = converse(addr, &["PEEK path=/chaos user=full".to_string()]);
    answers
        .first()
        .and_then(|a| parse_ok(a))
        .map(|(_, credit, _)| credit)
        == Some(0)
}

#[test]
fn rolling_restart_under_load_preserves_quotas() {
    let mut cluster = TestCluster::start(3, SHARDS, &[]);
    // Drive `full` to its limit first.
    let mut conn = Conn::open(cluster.client(1)).unwrap();
    let mut admitted_first = 0;
    let mut denied = false;
    while !denied {
        let answers = conn.pipeline(&vec!["HIT path=/chaos user=full".to_string(); 50]);
        assert_eq!(answers.len(), 50, "{answers:?}");
        admitted_first += answers.iter().filter(|a| a.starts_with("OK true")).count() as i64;
        denied = answers.iter().any(|a| a.starts_with("OK false"));
        assert!(admitted_first <= LIMIT);
    }
    assert_eq!(admitted_first, LIMIT);
    drop(conn);

    let mut lines: Vec<String> = big_users()
        .iter()
        .map(|u| format!("HIT path=/big user={u}"))
        .collect();
    lines.push("HIT path=/chaos user=full".to_string());
    let full_line = lines.len() - 1;
    let lines = Arc::new(lines);
    let stop = Arc::new(AtomicBool::new(false));
    let log: HitLog = Default::default();
    let threads = spawn_load_on_all(&cluster, &lines, 6, Duration::from_millis(10), &stop, &log);
    std::thread::sleep(Duration::from_millis(1_000));
    let mut samples = vec![sample(cluster.client(1))];
    let mut windows = Vec::new();
    for node in 1..=3 {
        let stopping = Instant::now();
        cluster.stop(node, Duration::from_secs(8));
        cluster.spawn(node, None);
        cluster.wait_healthy(Duration::from_secs(40));
        let healthy = Instant::now();
        windows.push((node, stopping, healthy));
        // The quota did not reset on any node's view.
        for through in 1..=3 {
            assert!(
                at_limit(cluster.client(through)),
                "after restarting node {node}: `full` is no longer at its limit through node {through}"
            );
        }
        samples.push(sample(cluster.client(node % 3 + 1)));
        std::thread::sleep(Duration::from_millis(1_000));
    }
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    samples.push(sample(cluster.client(2)));
    let hits = std::mem::take(&mut *log.lock().unwrap());

    // Quotas: `full` admitted nothing more; big counters never went back,
    // and hold every acknowledged hit.
    let full_admitted = hits
        .iter()
        .filter(|h| h.line == full_line && h.answer == Answered::True)
        .count() as i64;
    assert!(
        admitted_first + full_admitted <= LIMIT,
        "`full` admitted {full_admitted} more after reaching its limit"
    );
    for pair in samples.windows(2) {
        for (i, user) in big_users().iter().enumerate() {
            assert!(
                pair[0][i] <= pair[1][i],
                "{user} went backwards: {samples:?}"
            );
        }
    }
    let last = samples.last().unwrap();
    for (i, user) in big_users().iter().enumerate() {
        let acknowledged = hits
            .iter()
            .filter(|h| h.line == i && h.answer == Answered::True)
            .count() as i64;
        assert!(
            last[i] >= acknowledged,
            "{user}: counted {} < {acknowledged} acknowledged",
            last[i]
        );
    }

    // Errors only around each restart.
    let failed: Vec<&Hit> = hits
        .iter()
        .filter(|h| matches!(h.answer, Answered::Err(_) | Answered::Lost))
        .collect();
    for (node, stopping, healthy) in &windows {
        let around = failed
            .iter()
            .filter(|h| {
                h.sent + Duration::from_millis(100) >= *stopping && h.sent <= *healthy + SETTLE
            })
            .collect::<Vec<_>>();
        let last_error = around
            .iter()
            .map(|h| h.answered.saturating_duration_since(*stopping))
            .max()
            .unwrap_or_default();
        eprintln!(
            "node {node}: stopped, restarted and healthy in {:?}; {} failed hits, the last {last_error:?} after the stop",
            *healthy - *stopping,
            around.len()
        );
    }
    let outside: Vec<&&Hit> = failed
        .iter()
        .filter(|h| {
            !windows.iter().any(|(_, stopping, healthy)| {
                h.sent + Duration::from_millis(100) >= *stopping && h.sent <= *healthy + SETTLE
            })
        })
        .collect();
    assert!(
        outside.is_empty(),
        "{} hits failed away from any restart, e.g. {:?}",
        outside.len(),
        outside.first()
    );
    let answered = hits.iter().filter(|h| h.answer == Answered::True).count();
    eprintln!(
        "{} hits, {answered} admitted, {} failed; `full` admitted {full_admitted} more",
        hits.len(),
        failed.len()
    );
    assert!(answered > 1_000, "too little load: {answered}");
}
