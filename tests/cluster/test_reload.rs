//! Cluster-wide rule changes (docs/cluster.md, "Cluster-wide reload"): a
//! reload taken by any node (`tollgate cluster reload FILE`, SIGHUP,
//! `tollgate reload`) is checked by every node, committed, and served by
//! every node; an invalid file changes nothing anywhere, and neither does a
//! reload that a majority of the members cannot check; a node restarted
//! with a stale rule file, from its data dir or from an empty one, or back
//! after missing a reload, serves the committed rules.

use crate::cluster_support::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tollgate::cluster::status::fetch_topology;

/// `RULES` with the `/big` rule's limit doubled (a changed rule: new
/// counters) and `/limited` raised from 200 to 300; every other rule is
/// unchanged (its counters keep counting).
fn new_rules() -> String {
    let rules = RULES
        .replace("creditLimit = 1000000", "creditLimit = 2000000")
        .replace("creditLimit = 200\n", "creditLimit = 300\n");
    assert_ne!(rules, RULES);
    rules
}

/// The rules version each node reports about itself, asked of node `via`.
fn versions(cluster: &TestCluster, via: u64) -> Vec<(u64, Option<u64>)> {
    let topology =
        fetch_topology(&cluster.client(via).to_string(), Duration::from_secs(3)).expect("topology");
    topology
        .nodes
        .iter()
        .map(|node| (node.id, node.rules.map(|tag| tag.version)))
        .collect()
}

/// Waits until every node, asked of every node, reports rules `version`.
fn wait_version(cluster: &TestCluster, ids: &[u64], version: u64, bound: Duration) {
    let deadline = Instant::now() + bound;
    loop {
        let all = ids.iter().all(|&via| {
            fetch_topology(&cluster.client(via).to_string(), Duration::from_secs(2))
                .map(|t| {
                    t.nodes
                        .iter()
                        .all(|n| n.rules.map(|tag| tag.version) == Some(version))
                })
                .unwrap_or(false)
        });
        if all {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not every node serves rules version {version} within {bound:?}: {:?}",
            versions(cluster, ids[0])
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The credit a first hit of a fresh actor on `/limited` gets from node
/// `id`: 199 under the old rules, 299 under the new ones.
fn first_limited_credit(cluster: &TestCluster, id: u64, user: &str) -> i64 {
    let answers = converse(
        cluster.client(id),
        &[format!("HIT path=/limited user={user}")],
    );
    let (allowed, credit, _) = answers
        .first()
        .and_then(|a| parse_ok(a))
        .unwrap_or_else(|| panic!("node {id}: {answers:?}"));
    assert!(allowed, "{answers:?}");
    credit
}

/// `tollgate reload --pid` of node `id`.
fn tollgate_reload(cluster: &TestCluster, id: u64) -> std::process::Output {
    let pid = cluster.nodes[(id - 1) as usize]
        .pid()
        .expect("the node runs");
    std::process::Command::new(TOLLGATE)
        .args(["reload", "--pid", &pid.to_string()])
        .output()
        .unwrap()
}

/// One answer of the load: when its request left, when it came back, and
/// the credit (`None`: not an `OK true`).
struct Answer {
    sent: Instant,
    answered: Instant,
    credit: Option<i64>,
}

/// A load thread on one node: one shared actor of `/big`, 4 hits per
/// pipelined request, until `stop`.
fn big_load(
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Answer>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let lines = vec!["HIT path=/big user=everyone".to_string(); 4];
        let mut conn = Conn::open(addr).expect("connect");
        while !stop.load(Ordering::Relaxed) {
            let sent = Instant::now();
            let answers = conn.pipeline(&lines);
            let answered = Instant::now();
            let mut log = log.lock().unwrap();
            for index in 0..lines.len() {
                let credit = answers
                    .get(index)
                    .and_then(|a| parse_ok(a))
                    .filter(|(allowed, _, _)| *allowed)
                    .map(|(_, credit, _)| credit);
                log.push(Answer {
                    sent,
                    answered,
                    credit,
                });
            }
            if answers.len() < lines.len() {
                drop(log);
                conn = Conn::open(addr).expect("reconnect");
            }
        }
    })
}

#[test]
fn a_reload_under_load_switches_every_node_once_and_keeps_unchanged_counters() {
    let cluster = TestCluster::start(3, 8, &[]);
    assert_eq!(
        versions(&cluster, 2),
        vec![(1, Some(0)), (2, Some(0)), (3, Some(0))]
    );
    // An unchanged rule's counter, counted before the reload.
    let keep: Vec<String> = (0..10)
        .map(|_| "HIT path=/chaos user=keep".to_string())
        .collect();
    let before = converse(cluster.client(1), &keep);
    assert_eq!(before.last().map(String::as_str), Some("OK true 990 3600"));

    let stop = Arc::new(AtomicBool::new(false));
    let logs: Vec<Arc<Mutex<Vec<Answer>>>> = (0..3).map(|_| Arc::default()).collect();
    let threads: Vec<_> = cluster
        .nodes
        .iter()
        .zip(&logs)
        .map(|(node, log)| big_load(node.client, Arc::clone(&stop), Arc::clone(log)))
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let new_path = cluster.dir.path().join("new-rules.ini");
    std::fs::write(&new_path, new_rules()).unwrap();
    let reload_started = Instant::now();
    let (ok, said) = cluster.admin(1, &["reload", new_path.to_str().unwrap()]);
    let reload_done = Instant::now();
    assert!(ok, "{said}");
    assert!(
        said.contains("committed as version 1") && said.contains("serving them: nodes 1,2,3"),
        "{said}"
    );
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }

    // Old answers come from the counter of limit 1,000,000, new ones from
    // the counter of limit 2,000,000 (fresh: the rule changed).
    let is_new = |credit: i64| credit >= 1_000_000;
    let mut old_credits = Vec::new();
    let mut new_credits = Vec::new();
    let mut errors = 0;
    for (node, log) in (1..=3).zip(&logs) {
        let log = log.lock().unwrap();
        let (mut old, mut new) = (0, 0);
        for answer in log.iter() {
            let Some(credit) = answer.credit else {
                errors += 1;
                continue;
            };
            if is_new(credit) {
                new += 1;
                new_credits.push(credit);
            } else {
                // Never back to the old rules once switched.
                assert_eq!(
                    new, 0,
                    "node {node} answered with the old rules after the new ones"
                );
                old += 1;
                old_credits.push(credit);
                assert!(
                    answer.sent < reload_done,
                    "node {node} answered with the old rules a hit sent after the reload returned"
                );
            }
            if answer.answered < reload_started {
                assert!(!is_new(credit), "node {node} switched before the reload");
            }
        }
        assert!(
            old > 0 && new > 0,
            "node {node}: {old} old and {new} new answers"
        );
    }
    assert_eq!(errors, 0, "no hit fails during a reload");
    eprintln!(
        "reload took {:?}; {} hits answered with the old rules, {} with the new",
        reload_done - reload_started,
        old_credits.len(),
        new_credits.len()
    );
    // Each rule set's counter is one counter shared by every node: every
    // admitted hit took the next credit, none twice, none skipped.
    for (credits, limit) in [(&mut old_credits, 1_000_000), (&mut new_credits, 2_000_000)] {
        credits.sort_unstable_by(|a, b| b.cmp(a));
        let expected: Vec<i64> = (1..=credits.len() as i64).map(|n| limit - n).collect();
        assert_eq!(*credits, expected, "limit {limit}");
    }
    // The unchanged rule kept its counter on every node.
    let after = converse(cluster.client(3), &keep[..1]);
    assert_eq!(
        after
            .first()
            .and_then(|a| parse_ok(a))
            .map(|(_, credit, _)| credit),
        Some(989),
        "{after:?}"
    );
    for id in 1..=3 {
        assert_eq!(
            first_limited_credit(&cluster, id, &format!("fresh{id}")),
            299
        );
        assert_eq!(
            versions(&cluster, id),
            vec![(1, Some(1)), (2, Some(1)), (3, Some(1))]
        );
    }
    let status = std::process::Command::new(TOLLGATE)
        .args(["cluster", "status", "--node"])
        .arg(cluster.client(2).to_string())
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains("rules: version 1 (committed by node 1")
            && status.contains("on every node up"),
        "{status}"
    );
}

#[test]
fn an_invalid_rule_file_changes_nothing_anywhere() {
    let mut cluster = TestCluster::start(3, 4, &[]);
    // Refused by the command itself, before any node is asked.
    let bad = cluster.dir.path().join("bad.ini");
    std::fs::write(
        &bad,
        "[path=/limited]\ncreditLimit = 9\nresetSeconds = 60\n",
    )
    .unwrap();
    let (ok, said) = cluster.admin(2, &["reload", bad.to_str().unwrap()]);
    assert!(!ok, "{said}");
    assert!(
        said.contains(&bad.display().to_string())
            && said.contains("does not define a default rule")
            && said.contains("nothing changed"),
        "{said}"
    );

    // Refused by a node: node 3 runs with --strict-rules, and the file
    // holds a key divvy would ignore (a warning elsewhere).
    cluster.stop(3, Duration::from_secs(10));
    cluster.args.push("--strict-rules".into());
    cluster.spawn(3, None);
    cluster.args.pop();
    cluster.wait_healthy(Duration::from_secs(20));
    let lax = cluster.dir.path().join("lax.ini");
    std::fs::write(
        &lax,
        new_rules().replace("actorField = user\n", "actorFeild = user\n"),
    )
    .unwrap();
    let (ok, said) = cluster.admin(1, &["reload", lax.to_str().unwrap()]);
    assert!(!ok, "{said}");
    assert!(
        said.contains("node 3 refused the new rules, nothing changed")
            && said.contains("actorFeild")
            && said.contains("lax.ini"),
        "{said}"
    );

    // SIGHUP's twin, `tollgate reload`, on a node whose rule file went bad.
    std::fs::write(&cluster.rules_path, "[default]\ncreditLimit = x\n").unwrap();
    let output = tollgate_reload(&cluster, 2);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("rules.ini"), "{stderr}");

    std::thread::sleep(Duration::from_millis(600)); // more than two polls
    for id in 1..=3 {
        assert_eq!(
            versions(&cluster, id),
            vec![(1, Some(0)), (2, Some(0)), (3, Some(0))]
        );
        assert_eq!(
            first_limited_credit(&cluster, id, &format!("after{id}")),
            199
        );
    }
}

#[test]
fn a_sighup_on_one_node_commits_everywhere_and_restarted_nodes_keep_the_new_rules() {
    let mut cluster = TestCluster::start(3, 4, &[]);
    let old_path = cluster.dir.path().join("old-rules.ini");
    std::fs::write(&old_path, RULES).unwrap();
    // Node 2's rule file changes, and node 2 alone is told.
    std::fs::write(&cluster.rules_path, new_rules()).unwrap();
    let pid = cluster.nodes[1].pid().unwrap();
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    wait_version(&cluster, &[1, 2, 3], 1, Duration::from_secs(10));
    for id in 1..=3 {
        assert_eq!(first_limited_credit(&cluster, id, &format!("hup{id}")), 299);
    }
    assert!(
        cluster.log(2).contains("committed as version 1"),
        "{}",
        cluster.log(2)
    );
    // The same file again: nothing to commit.
    let output = tollgate_reload(&cluster, 3);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("rules in force already"), "{stdout}");

    // Node 3 restarts from its data dir with the old rule file: it serves
    // the committed rules, and says its file differs.
    cluster.stop(3, Duration::from_secs(10));
    cluster.spawn(3, Some(&old_path));
    cluster.wait_healthy(Duration::from_secs(20));
    assert_eq!(first_limited_credit(&cluster, 3, "restarted"), 299);
    let log = cluster.log(3);
    assert!(
        log.contains("differs from the cluster's committed rules"),
        "{log}"
    );

    // Node 1 loses its data dir and restarts with the old rule file: it
    // takes the committed rules from its peers before it serves.
    cluster.kill(1);
    std::fs::remove_dir_all(cluster.data_dir(1)).unwrap();
    cluster.spawn(1, Some(&old_path));
    cluster.wait_healthy(Duration::from_secs(20));
    assert_eq!(first_limited_credit(&cluster, 1, "emptied"), 299);
    assert!(
        cluster.log(1).contains("took the cluster's newer rules"),
        "{}",
        cluster.log(1)
    );
    wait_version(&cluster, &[1, 2, 3], 1, Duration::from_secs(5));

    // A full stop and start with the old files everywhere keeps version 1.
    for id in 1..=3 {
        cluster.stop(id, Duration::from_secs(10));
    }
    for id in 1..=3 {
        cluster.spawn(id, Some(&old_path));
    }
    cluster.wait_healthy(Duration::from_secs(30));
    for id in 1..=3 {
        assert_eq!(
            first_limited_credit(&cluster, id, &format!("full{id}")),
            299
        );
    }
    wait_version(&cluster, &[1, 2, 3], 1, Duration::from_secs(5));
}

#[test]
fn a_reload_needs_a_majority_and_a_node_that_was_down_takes_it_when_it_returns() {
    let mut cluster = TestCluster::start(3, 4, &[]);
    let old_path = cluster.dir.path().join("old-rules.ini");
    std::fs::write(&old_path, RULES).unwrap();
    let new_path = cluster.dir.path().join("new-rules.ini");
    std::fs::write(&new_path, new_rules()).unwrap();
    // Node 3 down: nodes 1 and 2 are a majority of the members.
    cluster.kill(3);
    let (ok, said) = cluster.admin(1, &["reload", new_path.to_str().unwrap()]);
    assert!(ok, "{said}");
    assert!(
        said.contains("serving them: nodes 1,2")
            && said.contains("nodes 3 take them from their peers"),
        "{said}"
    );
    for id in 1..=2 {
        assert_eq!(first_limited_credit(&cluster, id, &format!("two{id}")), 299);
    }
    // Node 2 down too: node 1 alone is no majority, and nothing changes.
    cluster.kill(2);
    let newer = cluster.dir.path().join("newer-rules.ini");
    std::fs::write(
        &newer,
        new_rules().replace("creditLimit = 300\n", "creditLimit = 400\n"),
    )
    .unwrap();
    let (ok, said) = cluster.admin(1, &["reload", newer.to_str().unwrap()]);
    assert!(!ok, "{said}");
    assert!(
        said.contains("only 1 of the 3 members checked the new rules")
            && said.contains("nothing changed"),
        "{said}"
    );
    // Both come back with the old rule file: they serve version 1.
    cluster.spawn(2, Some(&old_path));
    cluster.spawn(3, Some(&old_path));
    cluster.wait_healthy(Duration::from_secs(30));
    wait_version(&cluster, &[1, 2, 3], 1, Duration::from_secs(5));
    for id in 1..=3 {
        assert_eq!(
            first_limited_credit(&cluster, id, &format!("back{id}")),
            299
        );
    }
}
