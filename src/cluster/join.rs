//! Joining the cluster at start-up.
//!
//! The node asks every member what it knows (bounded by `join_wait_ms`;
//! with `--join`, until one answers). When some peer has established
//! shards, the node adopts the newest member list its peers hold. A shard
//! that no peer has established yet is new: its first replica initializes
//! it and campaigns; the other replicas wait to follow it (or initialize it
//! themselves after a grace period, when the first replica is down). A
//! shard some peer has established means this node restarted and lost its
//! in-memory Raft state (or is new to the shard): its replica joins as
//! *recovering* (see `replica.rs`), and its leader syncs it the shard's
//! counters when the link comes up. A replica whose Raft state the data
//! dir kept (`disk/`) simply resumes.

use super::auth;
use super::links::LinkError;
use super::node::{ClusterNode, STATUS_TIMEOUT_MS};
use super::placement::Placement;
use super::replica::Replica;
use super::wire::{NodeReport, PeerRequest, PeerResponse};
use super::{ClusterError, NodeId};
use openraft::BasicNode;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a node joins: bootstrap with the cluster file, or join an existing
/// cluster (never initializing a shard itself).
#[derive(Debug, Clone, Copy)]
pub struct JoinSettings {
    pub join_wait_ms: u64,
    pub join_existing: bool,
}

impl ClusterNode {
    /// Joins the cluster (see the module doc). Fails when a peer refuses us
    /// (different rules or layout, or secret).
    pub async fn join(self: &Arc<Self>, settings: JoinSettings) -> Result<(), ClusterError> {
        let deadline = Instant::now() + Duration::from_millis(settings.join_wait_ms);
        let mut reports: BTreeMap<NodeId, NodeReport> = BTreeMap::new();
        let mut unauthenticated: BTreeMap<NodeId, String> = BTreeMap::new();
        let mut last_notice = Instant::now();
        loop {
            for (peer, link) in self.ensure_member_links() {
                if reports.contains_key(&peer) || unauthenticated.contains_key(&peer) {
                    continue;
                }
                match link.call(PeerRequest::Status, STATUS_TIMEOUT_MS).await {
                    Ok(PeerResponse::Status(report)) => {
                        reports.insert(peer, report);
                    }
                    Err(LinkError::Refused(_, why)) => {
                        return Err(ClusterError::Refused { peer, why });
                    }
                    Err(LinkError::Unauthenticated(_, why)) => {
                        tracing::error!("{why}");
                        unauthenticated.insert(peer, why);
                    }
                    _ => {}
                }
            }
            let peers = self
                .members()
                .nodes
                .keys()
                .filter(|&&n| n != self.id)
                .count();
            let all_answered = reports.len() + unauthenticated.len() >= peers;
            let done = if settings.join_existing {
                !reports.is_empty() || all_answered
            } else {
                all_answered || Instant::now() >= deadline
            };
            if done {
                break;
            }
            if settings.join_existing && last_notice.elapsed() > Duration::from_secs(5) {
                tracing::warn!(
                    node = self.id,
                    "--join: no member of the cluster file answers yet; still trying"
                );
                last_notice = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        auth::check_join(reports.len(), &unauthenticated)?;
        let established = reports
            .values()
            .any(|report| report.shards.iter().any(|s| s.established));
        if established || settings.join_existing {
            // The cluster runs already: its member list, not our file's, is
            // the truth (our file may list us where theirs does not yet).
            // A list of our own that is newer (from the data dir, made
            // while those peers were down) stays: they adopt it from us.
            if let Some(newest) = reports
                .values()
                .map(|report| &report.members)
                .max_by_key(|members| (members.epoch, members.origin))
            {
                if !self.members().supersedes(newest) {
                    self.set_members(newest.clone());
                }
            }
        }
        // A node behind on the rules (it was down during a reload, or
        // starts from a new data dir) takes the committed set before it
        // serves: it must never decide with another.
        self.learn_rules(&reports).await.map_err(|why| {
            ClusterError::Rules(format!("cannot take the cluster's rules: {why}"))
        })?;
        *self.last_reports.lock() = reports.clone();
        let placement = self.target_placement();
        let mut initialized = 0;
        let mut recovering = 0;
        let mut resumed = 0;
        // The replicas the member list places here, and those the data dir
        // holds (a move may have been under way when the node stopped).
        let mut shards = placement.shards_of_node(self.id);
        shards.extend(self.persisted_shards());
        shards.sort_unstable();
        shards.dedup();
        for shard in shards {
            let replica = self.start_replica(shard).await?;
            if self.persisted_shard(shard) {
                // Its vote, log and fence came back from the data dir: it
                // is the same replica as before, not one restarted empty.
                resumed += 1;
                continue;
            }
            if self.enter_recovery(&replica, &reports) {
                recovering += 1;
                continue;
            }
            if settings.join_existing {
                // Never initialize a shard of a running cluster: its leader
                // adds this replica when the member list places it here.
                continue;
            }
            self.bootstrap_group(&placement, shard, &replica).await;
            initialized += 1;
        }
        self.set_joined();
        tracing::info!(
            node = self.id,
            peers_answered = reports.len(),
            members = %self.members().describe(),
            initialized,
            recovering,
            resumed,
            "joined the cluster"
        );
        Ok(())
    }

    /// Initializes a new shard's group with its placement's replicas.
    async fn bootstrap_group(&self, placement: &Placement, shard: u32, replica: &Arc<Replica>) {
        let members_list = self.members();
        let members: BTreeMap<NodeId, BasicNode> = placement
            .replicas_of(shard)
            .into_iter()
            .filter_map(|id| {
                members_list
                    .nodes
                    .get(&id)
                    .map(|node| (id, BasicNode::new(node.peer.to_string())))
            })
            .collect();
        // Initializing a group makes the replica campaign at once; so only
        // the shard's first replica in leader order initializes at once,
        // which spreads leaders evenly from the start. The others wait
        // until they follow a leader or, if none shows up within a grace
        // period (that replica down), initialize themselves.
        if self.leader_order(shard).first() == Some(&self.id) {
            if let Err(error) = replica.raft.initialize(members).await {
                tracing::debug!(shard, %error, "initialize");
            }
            return;
        }
        let replica = Arc::clone(replica);
        let grace = Duration::from_millis(self.election_timeout_ms.saturating_mul(8));
        tokio::spawn(async move {
            let started = Instant::now();
            let mut metrics = replica.raft.metrics();
            while metrics.borrow_and_update().current_leader.is_none() {
                let left = grace.saturating_sub(started.elapsed());
                if left.is_zero() || tokio::time::timeout(left, metrics.changed()).await.is_err() {
                    break;
                }
            }
            let initialized = {
                let m = replica.raft.metrics().borrow().clone();
                m.current_leader.is_some()
                    || super::leadership::has_voters(m.membership_config.membership())
            };
            if !initialized {
                if let Err(error) = replica.raft.initialize(members).await {
                    tracing::debug!(shard, %error, "initialize");
                }
            }
        });
    }
}
