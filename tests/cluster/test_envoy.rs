//! Envoy's rate limit service on a three-node cluster: any node answers a
//! gRPC call (forwarding to the shard's leader, as for `HIT` lines), calls
//! and lines count one replicated counter, and when the leader is killed the
//! survivors answer gRPC again once the shard has a new leader, with every
//! acknowledged hit still counted (strict consistency).

use crate::cluster_support::*;
use crate::envoy_client::{descriptor, request, GrpcClient};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::time::Duration;

const SHARDS: u32 = 8;
const LIMIT: u32 = 1_000_000;

#[test]
fn any_node_answers_grpc_and_a_killed_leader_loses_no_acknowledged_hit() {
    let mut cluster = TestCluster::start_grpc(3, SHARDS, &[]);
    let topology = cluster.wait_leaders_stable(Duration::from_secs(3), Duration::from_secs(30));
    // A user whose shard node 1 leads: node 1 is the one killed.
    let user = users_led_by(&topology, SHARDS, 1, "envoy", 1).remove(0);
    let big = || request(vec![descriptor(&[("path", "/big"), ("user", &user)])]);
    let mut used = 0;
    for node in [2, 3, 1] {
        let mut client = GrpcClient::connect(cluster.grpc_addr(node));
        for _ in 0..5 {
            let response = client.call(big()).unwrap();
            used += 1;
            assert_eq!(response.overall_code, Code::Ok as i32);
            assert_eq!(response.statuses[0].limit_remaining, LIMIT - used);
        }
    }
    // The same counter as the line protocol's (the domain is a key the
    // cluster's `path=/big` rule does not name).
    let answers = converse(cluster.client(3), &[format!("HIT path=/big user={user}")]);
    used += 1;
    assert_eq!(
        parse_ok(&answers[0]).map(|(allowed, credit, _)| (allowed, credit)),
        Some((true, i64::from(LIMIT - used)))
    );

    cluster.kill(1);
    wait_shards_serve(cluster.client(2), SHARDS, Duration::from_secs(15));
    for node in [2, 3] {
        let mut client = GrpcClient::connect(cluster.grpc_addr(node));
        let response = client.call(big()).unwrap();
        used += 1;
        assert_eq!(response.overall_code, Code::Ok as i32);
        assert_eq!(
            response.statuses[0].limit_remaining,
            LIMIT - used,
            "through node {node} after the leader died"
        );
    }
}
