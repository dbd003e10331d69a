//! What an operator of a cluster watches and types. A node cut off from
//! both peers stops being ready at once (`/readyz` 503 naming a shard,
//! `tollgate_backend_healthy{backend="cluster"} 0`), counts the hits it
//! refuses as backend errors, and is ready again soon after the links heal;
//! its log says once which peers were unreachable and holds no error.
//! The membership commands accept a client address for `--node` (they ask
//! it for its peer address), `cluster status` pointed at a peer port says
//! what it takes, and a joining node's banner says it is not a member yet.
//! A node whose client address is taken says so and exits before it joins.
//! Per-shard series show leaders, terms and replication, and the hits a node
//! answered, forwarded or not, count once in their rule's series.

use crate::cluster_support::{converse, http_get, metric, Fault, TestCluster, TOLLGATE};
use std::process::Command;
use std::time::{Duration, Instant};

const HEALTHY: &str = "tollgate_backend_healthy{backend=\"cluster\"}";
const ERRORS: &str = "tollgate_backend_errors_total{backend=\"cluster\"}";

/// Polls `/readyz` until its status is `status`; returns how long that took
/// and the body. Panics after `bound`.
fn wait_readyz(cluster: &TestCluster, id: u64, status: u16, bound: Duration) -> (Duration, String) {
    let addr = cluster.metrics_addr(id);
    let start = Instant::now();
    let mut last = None;
    loop {
        if let Some((got, body)) = http_get(addr, "/readyz") {
            if got == status {
                return (start.elapsed(), body.trim_end().to_string());
            }
            last = Some((got, body));
        }
        assert!(
            start.elapsed() < bound,
            "/readyz of node {id} still {last:?} after {bound:?}, expected {status}\nlog:\n{}",
            cluster.log(id)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_node_cut_off_from_its_peers_is_not_ready_and_recovers() {
    let cluster = TestCluster::start_observed(
        3,
        8,
        &["--forward-timeout-ms", "800", "--commit-timeout-ms", "400"],
        true,
    );
    let (_, body) = wait_readyz(&cluster, 1, 200, Duration::from_secs(20));
    assert_eq!(body, "ready");
    let metrics = cluster.metrics_addr(1);
    assert_eq!(metric(metrics, HEALTHY), Some(1.0));
    let errors_before = metric(metrics, ERRORS).unwrap();

    cluster.isolate(1, Fault::Cut);
    let (took, body) = wait_readyz(&cluster, 1, 503, Duration::from_secs(10));
    eprintln!("/readyz failed {took:?} after the cut: {body}");
    // "Within a second or two"; the bound leaves room for a loaded machine.
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(
        body.starts_with("not ready: backend unavailable: ")
            && body.contains("shards cannot be decided from this node (shard "),
        "{body}"
    );
    assert_eq!(metric(metrics, HEALTHY), Some(0.0));

    // Hits refused while cut off are counted as backend errors.
    let lines: Vec<String> = (0..16)
        .map(|i| format!("HIT path=/big user=cut{i}"))
        .collect();
    let mut refused = 0;
    for line in &lines {
        let answers = converse(cluster.client(1), std::slice::from_ref(line));
        if answers.first().is_some_and(|a| a.contains("unavailable")) {
            refused += 1;
        }
    }
    assert!(refused > 0, "no hit was refused while cut off");
    let errors = metric(metrics, ERRORS).unwrap();
    assert!(
        errors >= errors_before + refused as f64,
        "{errors} backend errors counted for {refused} refused hits (before: {errors_before})"
    );

    cluster.heal_all();
    let (took, body) = wait_readyz(&cluster, 1, 200, Duration::from_secs(20));
    eprintln!("/readyz ready again {took:?} after healing");
    assert_eq!(body, "ready");
    assert_eq!(metric(metrics, HEALTHY), Some(1.0));
    // The other nodes never stopped being ready for long: they are ready now.
    for id in [2, 3] {
        wait_readyz(&cluster, id, 200, Duration::from_secs(20));
    }

    // The logs say which peers were unreachable, once each, and hold no
    // error: nothing here needed an operator.
    let log = cluster.log(1);
    for peer in [2, 3] {
        let addr = cluster.link(1, peer).addr;
        let unreachable = format!("WARN tollgate::cluster::links::reachability: peer node {peer} at {addr} is unreachable: ");
        let again = format!("peer node {peer} at {addr} is reachable again");
        assert_eq!(log.matches(&unreachable).count(), 1, "{log}");
        assert_eq!(log.matches(&again).count(), 1, "{log}");
    }
    for id in 1..=3 {
        let log = cluster.log(id);
        assert!(
            !log.contains(" ERROR "),
            "node {id} logged an error:\n{log}"
        );
    }
}

#[test]
fn membership_commands_take_a_client_address_and_status_names_its_port() {
    let mut cluster = TestCluster::start(3, 4, &[]);
    let client = cluster.client(2).to_string();
    let output = Command::new(TOLLGATE)
        .args(["cluster", "remove-node", "9", "--node", &client])
        .arg("--cluster-secret-file")
        .arg(&cluster.secret_path)
        .env_remove("TOLLGATE_CLUSTER_SECRET")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [
            format!(
                "tollgate: {client} is node 2's client port; sending the request to its peer port {}",
                cluster.nodes[1].peer
            )
            .as_str(),
            "tollgate: refused: node 9 is not a member (members: 1,2,3)",
        ],
        "{stderr}"
    );

    let peer = cluster.nodes[0].peer.to_string();
    let output = Command::new(TOLLGATE)
        .args(["cluster", "status", "--node", &peer])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert_eq!(
        String::from_utf8_lossy(&output.stderr).trim_end(),
        format!("tollgate: {peer} closed the connection without answering TOPOLOGY: a peer port? `cluster status --node` takes a node's client address (its `client =` line)")
    );

    // A member's banner names the members; a joining node's says it is not
    // one yet (it read `cluster node 4 of 3`).
    let banner = |cluster: &TestCluster, id: u64| -> String {
        let start = Instant::now();
        loop {
            let log = cluster.log(id);
            if let Some(line) = log
                .lines()
                .find(|l| l.starts_with("tollgate: listening on "))
            {
                return line.to_string();
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "node {id} did not announce itself:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let member = banner(&cluster, 1);
    assert!(
        member.contains(", backend: cluster node 1 (members 1,2,3), 4 shards x 3 replicas ("),
        "{member}"
    );
    let newcomer = cluster.start_joining_node();
    let joining = banner(&cluster, newcomer);
    assert!(
        joining.contains(", backend: cluster node 4 (joining, not a member yet: members 1,2,3), 4 shards x 3 replicas (0 here), "),
        "{joining}"
    );
}

/// Every `shard="N"` sample of `family` at `addr`'s `/metrics`, by shard.
fn shard_series(addr: std::net::SocketAddr, family: &str) -> std::collections::BTreeMap<u32, f64> {
    let (_, body) = http_get(addr, "/metrics").expect("/metrics answers");
    let prefix = format!("{family}{{shard=\"");
    body.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(&prefix)?;
            let (shard, value) = rest.split_once("\"} ")?;
            Some((shard.parse().ok()?, value.trim().parse().ok()?))
        })
        .collect()
}

#[test]
fn per_shard_series_show_leaders_terms_replication_and_no_lag() {
    const SHARDS: u32 = 8;
    let cluster = TestCluster::start_observed(3, SHARDS, &[], false);
    cluster.wait_leaders_stable(Duration::from_secs(1), Duration::from_secs(30));
    // Distinct actors, one hit each: every admitted hit is one state in one
    // round section of its shard's leader (strict mode answers after the
    // commit; a section whose hits were all answered with the round waits
    // for its acks until the followers' next beats, docs/cluster.md, "The
    // data path", step 6, so nothing is in flight a few beats later).
    let hits = 300;
    let lines: Vec<String> = (0..hits)
        .map(|i| format!("HIT path=/big user=series{i}"))
        .collect();
    let answers = converse(cluster.client(1), &lines);
    assert_eq!(answers.len(), hits);
    assert!(
        answers.iter().all(|a| a.starts_with("OK true ")),
        "{answers:?}"
    );
    // Every hit node 1 answered, decided there or forwarded and finished
    // with its read batch's answers, counts once in its rule's series.
    assert_eq!(
        metric(
            cluster.metrics_addr(1),
            "divvy_hits_total{status=\"accepted\",rule_label=\"\"}"
        ),
        Some(hits as f64)
    );

    let mut leaders = vec![0.0; SHARDS as usize];
    let (mut states, mut sections) = (0.0, 0.0);
    for id in 1..=3 {
        let addr = cluster.metrics_addr(id);
        let leader = shard_series(addr, "tollgate_cluster_shard_leader");
        // Three replicas on three nodes: every node holds every shard.
        assert_eq!(leader.len(), SHARDS as usize, "node {id}: {leader:?}");
        for (shard, value) in &leader {
            assert!(
                *value == 0.0 || *value == 1.0,
                "node {id} shard {shard}: {value}"
            );
            leaders[*shard as usize] += value;
        }
        let terms = shard_series(addr, "tollgate_cluster_shard_term");
        assert!(terms.values().all(|&t| t >= 1.0), "node {id}: {terms:?}");
        // Beats are 100 ms apart: bounded far above that for a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let in_flight = shard_series(addr, "tollgate_cluster_shard_sections_in_flight");
            if in_flight.values().all(|&n| n == 0.0) {
                break;
            }
            assert!(Instant::now() < deadline, "node {id}: {in_flight:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let moving = shard_series(addr, "tollgate_cluster_shard_moving");
        assert!(moving.values().all(|&n| n == 0.0), "node {id}: {moving:?}");
        states += shard_series(addr, "tollgate_cluster_shard_states_replicated_total")
            .values()
            .sum::<f64>();
        sections += shard_series(addr, "tollgate_cluster_shard_round_sections_total")
            .values()
            .sum::<f64>();
    }
    assert!(
        leaders.iter().all(|&n| n == 1.0),
        "leaders per shard: {leaders:?}"
    );
    assert_eq!(states, hits as f64, "one replicated state per admitted hit");
    assert!(
        sections >= 1.0 && sections <= states,
        "{sections} sections for {states} states"
    );
}

#[test]
fn a_node_whose_client_address_is_taken_exits_before_it_joins() {
    let mut cluster = TestCluster::start(3, 8, &[]);
    cluster.stop(3, Duration::from_secs(10));
    let client = cluster.client(3);
    // Something else listens on node 3's client address now.
    let squatter = std::net::TcpListener::bind(client).expect("take node 3's client address");
    cluster.spawn(3, None);
    let status = cluster
        .wait_exit(3, Duration::from_secs(20))
        .expect("node 3 exits when its client address is taken");
    assert!(!status.success(), "{status}");
    let log = cluster.log(3);
    assert!(
        log.contains(&format!("cannot listen on {client}")),
        "the error names the address: {log}"
    );
    assert!(
        !log.contains("joined the cluster"),
        "refused before joining: {log}"
    );
    // Freed, the address serves again.
    drop(squatter);
    cluster.spawn(3, None);
    cluster.wait_healthy(Duration::from_secs(20));
    let replies = converse(client, &["HIT path=/x ip=1.2.3.4".to_string()]);
    assert_eq!(replies, ["OK true 4 60"]);
}
