//! Run-time membership: which nodes the cluster *should* place shards on.
//!
//! The cluster file gives the first member list (epoch 0). `tollgate cluster
//! add-node|remove-node` makes a new list with a higher epoch on the node it
//! talks to, which pushes it to every member; nodes also pass the newest list
//! they know in every status answer, so a node that missed the push (down,
//! cut off) adopts it within a poll interval. The highest `(epoch, origin)`
//! wins everywhere, so every node converges on one list.
//!
//! The list is only a *target*: safety does not rest on it. Each shard's
//! replica set changes through its own Raft group (learner, catch-up, joint
//! consensus), driven by the shard's leader towards the placement this list
//! gives; a stale or conflicting list can only delay or redo a move, never
//! lose a committed counter.

use super::config::{ClusterFile, NodeAddresses};
use super::placement::Placement;
use super::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One version of the member list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Members {
    /// Raised by one on every change; the cluster file's list is epoch 0.
    pub epoch: u64,
    /// The node that made this version (0 for the cluster file), so that
    /// two changes made at once on different nodes still order totally.
    pub origin: NodeId,
    pub nodes: BTreeMap<NodeId, NodeAddresses>,
}

impl Members {
    /// The first list: the cluster file's nodes.
    pub fn from_file(file: &ClusterFile) -> Members {
        Members {
            epoch: 0,
            origin: 0,
            nodes: file.nodes.clone(),
        }
    }

    /// Is this version newer than `other`?
    pub fn supersedes(&self, other: &Members) -> bool {
        (self.epoch, self.origin) > (other.epoch, other.origin)
    }

    /// Where shards should live under this list.
    pub fn placement(&self, layout: &ClusterFile) -> Placement {
        Placement::with_kind(
            layout.shards,
            layout.replicas,
            self.nodes.keys().copied().collect(),
            layout.placement,
        )
    }

    /// The next version with `id` added, made on node `origin`.
    pub fn with_node(
        &self,
        id: NodeId,
        addresses: NodeAddresses,
        origin: NodeId,
    ) -> Result<Members, String> {
        if id == 0 {
            return Err("node ids are integers ≥ 1".into());
        }
        if let Some(existing) = self.nodes.get(&id) {
            return Err(format!(
                "node {id} is already a member (client {}, peer {})",
                existing.client, existing.peer
            ));
        }
        for (&other, known) in &self.nodes {
            for addr in [addresses.client, addresses.peer] {
                if addr == known.client || addr == known.peer {
                    return Err(format!("address {addr} is already used by node {other}"));
                }
            }
        }
        if addresses.client == addresses.peer {
            return Err(format!(
                "the client and peer addresses must differ (both {})",
                addresses.client
            ));
        }
        let mut next = self.clone();
        next.epoch += 1;
        next.origin = origin;
        next.nodes.insert(id, addresses);
        Ok(next)
    }

    /// The next version with `id` removed, made on node `origin`.
    pub fn without_node(&self, id: NodeId, origin: NodeId) -> Result<Members, String> {
        if !self.nodes.contains_key(&id) {
            return Err(format!(
                "node {id} is not a member (members: {})",
                self.describe()
            ));
        }
        if self.nodes.len() == 1 {
            return Err(format!(
                "node {id} is the last member; it cannot be removed"
            ));
        }
        let mut next = self.clone();
        next.epoch += 1;
        next.origin = origin;
        next.nodes.remove(&id);
        Ok(next)
    }

    /// The member ids, comma-separated.
    pub fn describe(&self) -> String {
        let ids: Vec<String> = self.nodes.keys().map(|id| id.to_string()).collect();
        ids.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::placement::PlacementKind;

    fn addresses(port: u16) -> NodeAddresses {
        NodeAddresses {
            client: format!("127.0.0.1:{port}").parse().unwrap(),
            peer: format!("127.0.0.1:{}", port + 1000).parse().unwrap(),
        }
    }

    fn three() -> Members {
        Members {
            epoch: 0,
            origin: 0,
            nodes: (1..=3)
                .map(|id| (id, addresses(8320 + id as u16)))
                .collect(),
        }
    }

    #[test]
    fn newer_epochs_and_then_higher_origins_supersede() {
        let base = three();
        let added = base.with_node(4, addresses(8324), 2).unwrap();
        assert!(added.supersedes(&base));
        assert!(!base.supersedes(&added));
        let concurrent = base.without_node(3, 1).unwrap();
        assert_eq!(concurrent.epoch, added.epoch);
        assert!(
            added.supersedes(&concurrent),
            "same epoch: origin 2 beats 1"
        );
        assert!(!added.supersedes(&added));
    }

    #[test]
    fn changes_are_validated_with_the_offending_input_named() {
        let base = three();
        let error = base.with_node(2, addresses(8330), 1).unwrap_err();
        assert!(error.contains("node 2 is already a member"), "{error}");
        let error = base.with_node(4, addresses(8322), 1).unwrap_err();
        assert!(
            error.contains("127.0.0.1:8322 is already used by node 2"),
            "{error}"
        );
        let error = base.without_node(9, 1).unwrap_err();
        assert!(
            error.contains("node 9 is not a member (members: 1,2,3)"),
            "{error}"
        );
        let single = base.without_node(1, 1).unwrap().without_node(2, 1).unwrap();
        assert!(single
            .without_node(3, 1)
            .unwrap_err()
            .contains("last member"));
    }

    #[test]
    fn placement_follows_the_member_list() {
        let base = three();
        let grown = base.with_node(4, addresses(8324), 1).unwrap();
        for kind in [PlacementKind::Spread, PlacementKind::Ring] {
            let layout = ClusterFile {
                shards: 16,
                replicas: 3,
                placement: kind,
                nodes: BTreeMap::new(),
            };
            assert_eq!(grown.placement(&layout).nodes(), &[1, 2, 3, 4]);
            assert_eq!(grown.placement(&layout).kind(), kind);
            let moved = (0..16)
                .filter(|&s| {
                    base.placement(&layout).replicas_of(s)
                        != grown.placement(&layout).replicas_of(s)
                })
                .count();
            assert!(
                moved > 0 && moved < 16,
                "{kind:?}: {moved} of 16 shards move"
            );
        }
    }
}
