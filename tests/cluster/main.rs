//! Real multi-node clusters of `tollgate` processes on loopback: replication,
//! failover, partitions (through fault-injection proxies), membership changes
//! and moving shards without errors,
//! rolling restarts, full restarts from data dirs, cluster-wide rule reloads, chaos, the peer
//! port's authentication and its protocol versions, and what an
//! operator watches and types (readiness, metrics, the membership commands),
//! Envoy's gRPC calls on any node, droplet's buckets shared by every node
//! (`cluster_support` starts and stops them; every wait is bounded).

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cluster_support;
#[path = "../util/droplet_node.rs"]
mod droplet_node;
#[path = "../util/envoy.rs"]
mod envoy_client;

mod test_auth;
mod test_basic;
mod test_chaos;
mod test_droplet;
mod test_envoy;
mod test_failover;
mod test_leases;
mod test_membership;
mod test_moves;
mod test_operator;
mod test_partition;
mod test_persist;
mod test_reload;
mod test_rolling;
mod test_versions;
