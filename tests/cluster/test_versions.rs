//! The peer protocol's version window, with real processes: a rolling
//! upgrade to the next minor version (each node restarted in turn
//! advertising it, with the test-only `TOLLGATE_TEST_PEER_PROTOCOL`) keeps
//! the cluster serving with its counters, and a node of another major is
//! refused on both sides: it exits naming both versions, the nodes it
//! dialed log the refusal and count it (and their data dirs count no
//! write error).

use crate::cluster_support::*;
use std::time::{Duration, Instant};

const ENV: &str = "TOLLGATE_TEST_PEER_PROTOCOL";

fn advertise(cluster: &mut TestCluster, id: u64, version: &str) {
    cluster
        .env
        .insert(id, vec![(ENV.to_string(), version.to_string())]);
}

/// The `[path=/chaos]` credit (1000 an hour) left to `user` through node
/// `via` after one more hit.
fn hit(cluster: &TestCluster, via: u64, user: &str) -> i64 {
    let answers = converse(
        cluster.client(via),
        &[format!("HIT path=/chaos user={user}")],
    );
    let (_, credit, _) = answers
        .first()
        .and_then(|a| parse_ok(a))
        .unwrap_or_else(|| panic!("node {via}: {answers:?}"));
    credit
}

#[test]
fn a_rolling_upgrade_to_the_next_minor_keeps_serving_and_another_major_is_refused() {
    let mut cluster = TestCluster::start_observed(3, 4, &[], false);
    let mut credit = hit(&cluster, 1, "rolling");
    // One node at a time, as docs/cluster.md's rolling upgrade says: each
    // restarted node of version 2.1 joins the others (2.0, then a mix).
    for id in [3, 2, 1] {
        cluster.stop(id, Duration::from_secs(10));
        advertise(&mut cluster, id, "2.1");
        cluster.spawn(id, None);
        cluster.wait_healthy(Duration::from_secs(30));
        assert!(
            cluster.log(id).contains("advertising peer protocol 2.1"),
            "node {id}: {}",
            cluster.log(id)
        );
        // The counter went on from where it was, through every node.
        for via in [1, 2, 3] {
            let now = hit(&cluster, via, "rolling");
            assert_eq!(now, credit - 1, "node {via} after upgrading node {id}");
            credit = now;
        }
    }

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
            && log.contains("incompatible peer protocol: the peer speaks 2.1")
            && log.contains("this node 3.0"),
        "{log}"
    );
    // The nodes it dialed log and count the refusal (their logs may trail
    // its exit by a moment).
    for id in [1, 2] {
        let refused = |log: &str| {
            log.contains("refused a peer connection from 127.0.0.1:")
                && log.contains(
                    "incompatible peer protocol: the peer speaks major version 3, this node 2.1",
                )
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
    advertise(&mut cluster, 3, "2.1");
    cluster.spawn(3, None);
    cluster.wait_healthy(Duration::from_secs(30));
    assert_eq!(hit(&cluster, 3, "rolling"), credit - 1);
}
