//! Quota leases with real processes, in fast mode (where they are on by
//! default) and strict mode (`--lease-credits-max 64`)
//! (src/cluster/forward/leases.rs): a node that forwards a counter's hits to its leader gets a
//! few of the counter's credits beside an answer and admits the next hits
//! itself; one client sees the same credits, counting down one by one, as
//! without leases; every hit is either forwarded or admitted from a lease;
//! and clients on every node together are admitted exactly the limit, no
//! more (a lease's credits are counted on the leader when it is granted)
//! and no less (a node that keeps hitting uses up what it holds).

use crate::cluster_support::*;
use std::net::SocketAddr;
use std::time::Duration;

/// A `/metrics` counter of node `id`.
fn counter(cluster: &TestCluster, id: u64, series: &str) -> u64 {
    metric(cluster.metrics_addr(id), series)
        .unwrap_or_else(|| panic!("node {id} has no {series} series")) as u64
}

/// Hits `[path=/chaos] user=USER` (1 000 an hour) through `via`, in
/// pipelines of ten, until `denials` answers in a row were `false`; returns
/// the hits admitted.
fn hit_until_denied(via: SocketAddr, user: &str, denials: usize) -> usize {
    let mut conn = Conn::open(via).unwrap();
    let line = format!("HIT path=/chaos user={user}");
    let (mut admitted, mut denied_in_a_row) = (0, 0);
    for _ in 0..1_000 {
        for answer in conn.pipeline(&vec![line.clone(); 10]) {
            let (allowed, _, _) =
                parse_ok(&answer).unwrap_or_else(|| panic!("node {via}: {answer}"));
            if allowed {
                admitted += 1;
                denied_in_a_row = 0;
            } else {
                denied_in_a_row += 1;
            }
        }
        if denied_in_a_row >= denials {
            return admitted;
        }
    }
    panic!("node {via}: no run of {denials} denials in 10 000 hits");
}

#[test]
fn a_forwarding_node_admits_from_leases_with_exact_credits_and_the_cluster_admits_the_limit() {
    for mode in ["strict", "fast"] {
        leases_in(mode);
    }
}

fn leases_in(mode: &str) {
    // Fast mode leases by default; strict mode when asked to.
    let args: &[&str] = match mode {
        "strict" => &["--consistency", "strict", "--lease-credits-max", "64"],
        _ => &["--consistency", "fast"],
    };
    let cluster = TestCluster::start_observed(3, 8, args, false);
    let topology = cluster.wait_leaders_stable(Duration::from_secs(2), Duration::from_secs(60));
    // A user whose counter node 1 does not lead: its hits through node 1
    // are forwarded, or admitted from a lease.
    let (user, leader) = (0..)
        .map(|n| format!("leased{n}"))
        .find_map(|user| {
            let shard = shard_of_user(8, "path=/chaos", 1_000, 3_600, &user);
            let leader = topology.placement[shard as usize].leader?;
            (leader != 1).then_some((user, leader))
        })
        .unwrap();
    let forwarded =
        |cluster: &TestCluster| counter(cluster, 1, "tollgate_cluster_forwarded_hits_total");
    let forwarded_before = forwarded(&cluster);

    // One client through node 1: credits count down one by one, as the
    // leader alone would answer them.
    let mut conn = Conn::open(cluster.client(1)).unwrap();
    let line = format!("HIT path=/chaos user={user}");
    let mut expected_credit = 999;
    for _ in 0..30 {
        for answer in conn.pipeline(&vec![line.clone(); 10]) {
            let (allowed, credit, reset) = parse_ok(&answer).expect("OK");
            assert!(allowed, "{mode}: {answer}");
            assert_eq!(credit, expected_credit, "{mode}: {answer}");
            assert!((3_500..=3_600).contains(&reset), "{mode}: {answer}");
            expected_credit -= 1;
        }
    }
    let lease_hits = counter(&cluster, 1, "tollgate_cluster_lease_hits_total");
    let forwarded_hits = forwarded(&cluster) - forwarded_before;
    assert_eq!(
        lease_hits + forwarded_hits,
        300,
        "{mode}: every hit forwarded or admitted from a lease"
    );
    assert!(
        lease_hits >= 200,
        "{mode}: most hits admitted by node 1 itself: {lease_hits} of 300 ({forwarded_hits} forwarded)"
    );
    assert!(
        counter(&cluster, leader, "tollgate_cluster_leases_granted_total") > 0,
        "{mode}"
    );
    // A PEEK through node 1 answers as its lease's next hit would.
    let peeked = parse_ok(&conn.pipeline(&[format!("PEEK path=/chaos user={user}")])[0]);
    assert_eq!(
        peeked.map(|(allowed, credit, _)| (allowed, credit)),
        Some((true, 699)),
        "{mode}"
    );

    // Clients on every node hit the counter until each is denied: exactly
    // the limit is admitted, all told.
    let threads: Vec<_> = cluster
        .clients()
        .into_iter()
        .map(|via| {
            let user = user.clone();
            std::thread::spawn(move || hit_until_denied(via, &user, 20))
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(
        300 + admitted,
        1_000,
        "{mode}: no more and no fewer than the limit"
    );
    // Every credit leased was used, by the node that held it.
    let leased: u64 = [1, 2, 3]
        .iter()
        .map(|&id| counter(&cluster, id, "tollgate_cluster_lease_credits_granted_total"))
        .sum();
    let used: u64 = [1, 2, 3]
        .iter()
        .map(|&id| counter(&cluster, id, "tollgate_cluster_lease_hits_total"))
        .sum();
    assert_eq!(leased, used, "{mode}: no credit left unused in a lease");
}
