//! The messages nodes exchange on the peer port. Every connection opens with
//! a [`Hello`] (identity and fingerprints, so nodes with different rules or
//! cluster files refuse each other), then carries requests and responses
//! correlated by request id, many in flight at once: Raft RPCs of every shard
//! group, batches of forwarded hits, and status queries. The byte encoding is
//! [`codec`](super::codec)'s business alone.

use super::config::NodeAddresses;
use super::members::Members;
use super::storage::TollgateRaft;
use super::NodeId;
use crate::limiter::Decision;
use crate::rules::Algorithm;
use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::LogId;
use serde::{Deserialize, Serialize};

/// One counter operation as it travels between nodes. It is self-contained:
/// the leader needs no rule lookup, only the key and the quota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireOp {
    /// The cluster key: stable counter id (8 bytes LE) + actor.
    pub key: Vec<u8>,
    /// The rule's algorithm: the leader decides with it.
    pub algorithm: Algorithm,
    pub credit_limit: u64,
    pub reset_seconds: u64,
    /// Answer without counting (`PEEK`).
    pub peek: bool,
}

/// The answer to one [`WireOp`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireDecision {
    Decided {
        allowed: bool,
        credit: i64,
        next_reset_seconds: i64,
    },
    /// The shard cannot decide now (no leader, lost leadership, commit timed
    /// out); the text is shown to the client.
    Unavailable(String),
    /// The leader's live-key cap was reached.
    Full { live_keys_max: u64 },
    /// Not decided and not counted (no leader, the leader is handing over or
    /// unreachable): the sender may send it again to the shard's leader.
    Retry(String),
}

impl From<Decision> for WireDecision {
    fn from(d: Decision) -> WireDecision {
        WireDecision::Decided {
            allowed: d.allowed,
            credit: d.credit,
            next_reset_seconds: d.next_reset_seconds,
        }
    }
}

/// The first message of every peer connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub node_id: NodeId,
    pub rules_fingerprint: u64,
    /// The `[cluster]` layout's fingerprint (shards, replicas).
    pub layout_fingerprint: u64,
    pub consistency: String,
}

/// What a node knows about one shard group it replicates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardReport {
    pub shard: u32,
    /// The group has had a leader (its log goes beyond initialization).
    pub established: bool,
    pub term: u64,
    pub last_log_index: Option<u64>,
    /// The last log id applied here (so committed).
    pub applied: Option<LogId<NodeId>>,
    pub leader: Option<NodeId>,
    /// This replica restarted empty and has not caught up yet.
    pub recovering: bool,
    /// When this node leads: per follower, entries not yet replicated to it.
    pub lag: Vec<(NodeId, u64)>,
    /// The group's voters and learners, as this replica's log has them.
    pub voters: Vec<NodeId>,
    pub learners: Vec<NodeId>,
    /// When this node leads and is moving the shard: what the move is doing.
    pub moving: Option<String>,
}

/// A node's view of itself, answered to `Hello` and `Status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    pub node_id: NodeId,
    pub live_keys: u64,
    pub shards: Vec<ShardReport>,
    /// The newest member list this node knows.
    pub members: Members,
}

/// Operator requests (`tollgate cluster add-node|remove-node`), accepted on
/// the peer port only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdminRequest {
    AddNode {
        id: NodeId,
        addresses: NodeAddresses,
    },
    RemoveNode {
        id: NodeId,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    Hello(Hello),
    Vote {
        shard: u32,
        rpc: VoteRequest<NodeId>,
    },
    Append {
        shard: u32,
        rpc: AppendEntriesRequest<TollgateRaft>,
    },
    Snapshot {
        shard: u32,
        rpc: InstallSnapshotRequest<TollgateRaft>,
    },
    /// Forwarded hits, answered per op in order.
    Hits(Vec<WireOp>),
    Status,
    /// A newer member list (answered with the list the node then holds).
    Members(Members),
    /// The shard's leader hands leadership over: stand for election now.
    Elect {
        shard: u32,
    },
    /// An operator request; may open a connection instead of a hello.
    Admin(AdminRequest),
}

#[derive(Debug, Serialize, Deserialize)]
pub enum PeerResponse {
    Hello(NodeReport),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    Append(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Snapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>),
    Hits(Vec<WireDecision>),
    Status(NodeReport),
    Members(Members),
    /// `Elect` was started.
    Electing,
    /// The outcome of an operator request, said for the operator.
    Admin(Result<String, String>),
    /// The request was not served (mismatched hello, unknown shard, a
    /// recovering replica declining a vote); the text says why.
    Refused(String),
}
