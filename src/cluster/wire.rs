//! The messages nodes exchange on the peer port. Every connection opens with
//! a [`Hello`] (identity, the rule set in force and fingerprints, so nodes
//! with different rules or cluster files refuse each other), then carries
//! control requests and responses correlated by request id, many in flight
//! at once (Raft RPCs of every shard group, status queries, counter
//! collections and syncs, membership, rule sets), and data frames
//! (forwarded hits, answers, replication rounds, acks). Control messages are
//! encoded by [`codec`](super::codec), data frames by
//! [`data_frames`](super::data_frames); the types both share (decisions,
//! refusals) are defined here.

use super::committed_rules::{RulesRecord, RulesTag};
use super::config::NodeAddresses;
use super::members::Members;
use super::storage::TollgateRaft;
use super::NodeId;
use crate::limiter::droplet_bucket::{Balances, TakeOutcome, PERIOD_COUNT};
use crate::limiter::{CounterState, Decision};
use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::LogId;
use serde::{Deserialize, Serialize};

/// Why a shard could not decide a hit, carried between nodes and shown to
/// clients as `shard N unavailable: <why>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ShardRefusal {
    #[error("no leader (election in progress)")]
    NoLeader,
    #[error("node {0} leads it, not this node")]
    NotLeader(NodeId),
    #[error("node {0} does not replicate it")]
    NotReplicated(NodeId),
    #[error("its leadership is being handed to another replica")]
    HandingOver,
    #[error("its new leader is gathering the replicas' counters")]
    Preparing,
    #[error("a leader of term {0} has taken over")]
    Superseded(u64),
    #[error("not committed within {0} ms")]
    CommitTimeout(u64),
    #[error("a forwarded hit carried an invalid quota")]
    InvalidQuota,
    /// Link failures, timeouts: said as they happened.
    #[error("{0}")]
    Other(String),
}

/// The answer to one forwarded counter op.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireDecision {
    Decided {
        allowed: bool,
        credit: i64,
        next_reset_seconds: i64,
    },
    /// The shard could not decide, and the hit may have been counted (it
    /// reached a leader that lost its leadership, or its commit timed out):
    /// never sent again.
    Unavailable { shard: u32, why: ShardRefusal },
    /// The leader's live-key cap was reached.
    Full { live_keys_max: u64 },
    /// Not decided and not counted (no leader, a leader handing over, a
    /// leader fenced by a newer one, a link down before sending): the
    /// sender may send it again to the shard's leader.
    Retry { shard: u32, why: ShardRefusal },
    /// A droplet bucket's take or query, decided: droplet's answer (each
    /// period's balance, `None` for the periods not reported).
    Bucket {
        accept: bool,
        balances: [Option<i32>; PERIOD_COUNT],
    },
    /// A fixed-window hit admitted, with a quota lease for the node that
    /// forwarded it: `lease` more credits of the counter's window, counted
    /// as used on the leader, which that node may admit itself
    /// (`forward/leases.rs`). `credit` leaves the lease out: it is the
    /// credit left had the lease not been taken. Peer protocol 2.3.
    Leased {
        credit: i64,
        next_reset_seconds: i64,
        lease: u32,
    },
}

/// What a decided op answers, as a waiter keeps it until its commit: a
/// rule's hit or a droplet bucket's take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Hit(Decision),
    Bucket(BucketAnswer),
}

impl Answer {
    pub fn bucket(outcome: TakeOutcome) -> Answer {
        Answer::Bucket(BucketAnswer::pack(outcome))
    }
}

/// A droplet take's answer packed to 28 bytes (a [`TakeOutcome`] is 52), so
/// that a strict hit's waiter grows by 8 bytes, not 32, for buckets to share
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketAnswer {
    accept: bool,
    /// Bit `i`: period `i`'s balance is reported.
    reported: u8,
    balances: [i32; PERIOD_COUNT],
}

impl BucketAnswer {
    pub fn pack(outcome: TakeOutcome) -> BucketAnswer {
        let mut packed = BucketAnswer {
            accept: outcome.accept,
            reported: 0,
            balances: [0; PERIOD_COUNT],
        };
        for (i, balance) in outcome.balances.0.iter().enumerate() {
            if let Some(balance) = balance {
                packed.reported |= 1 << i;
                packed.balances[i] = *balance;
            }
        }
        packed
    }

    pub fn outcome(&self) -> TakeOutcome {
        let mut balances = Balances::default();
        for (i, balance) in balances.0.iter_mut().enumerate() {
            if self.reported & (1 << i) != 0 {
                *balance = Some(self.balances[i]);
            }
        }
        TakeOutcome {
            accept: self.accept,
            balances,
        }
    }
}

impl From<Decision> for Answer {
    fn from(decision: Decision) -> Answer {
        Answer::Hit(decision)
    }
}

impl From<Answer> for WireDecision {
    fn from(answer: Answer) -> WireDecision {
        match answer {
            Answer::Hit(decision) => decision.into(),
            Answer::Bucket(packed) => {
                let outcome = packed.outcome();
                WireDecision::Bucket {
                    accept: outcome.accept,
                    balances: outcome.balances.0,
                }
            }
        }
    }
}

impl WireDecision {
    /// The answer to a forwarded hit decided `decision`, granted a quota
    /// lease of `lease` credits: [`WireDecision::Leased`] for an admitted
    /// hit with a lease, else the decision alone.
    pub fn with_lease(decision: Answer, lease: u32) -> WireDecision {
        match decision {
            Answer::Hit(hit) if hit.allowed && lease > 0 => WireDecision::Leased {
                credit: hit.credit,
                next_reset_seconds: hit.next_reset_seconds,
                lease,
            },
            _ => decision.into(),
        }
    }

    /// The text a client sees for a shard that could not decide.
    pub fn describe(shard: u32, why: &ShardRefusal) -> String {
        format!("shard {shard} unavailable: {why}")
    }
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

/// Why a replica did not apply counter states a leader sent (a round, a
/// sync) or did not answer a new leader's collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApplyRefusal {
    /// The replica promised a leader of this newer term.
    Fenced { term: u64 },
    /// The node holds no replica of the shard.
    NotReplica,
}

/// Counter states as control messages carry them (collections, syncs).
pub type CounterList = Vec<(Vec<u8>, CounterState)>;

/// The first message of every peer connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub node_id: NodeId,
    /// The committed rule set this node serves (see `committed_rules.rs`).
    pub rules: RulesTag,
    /// The `[cluster]` layout's fingerprint (shards, replicas, placement).
    pub layout_fingerprint: u64,
    pub consistency: String,
    /// This process's incarnation: larger after every restart (start time
    /// in microseconds, plus random low bits). Acks and answers name the
    /// incarnation they address, so nothing meant for a node's previous
    /// life is taken by its next one.
    pub boot_id: u64,
}

/// A new incarnation id (see [`Hello::boot_id`]).
pub fn new_boot_id() -> u64 {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let mut noise = [0u8; 2];
    let _ = getrandom::fill(&mut noise);
    (micros << 8) ^ u64::from(noise[0])
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
    /// This node leads the shard and decides its hits (prepared).
    pub ready: bool,
}

/// A node's data-path counters since it started (see docs/cluster.md).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStats {
    /// Replication rounds sent, their shard sections, and the counter
    /// states they carried (one per admitted hit, less what merged).
    pub rounds: u64,
    pub round_sections: u64,
    pub states_replicated: u64,
    pub sections_committed: u64,
    pub sections_failed: u64,
    /// States applied here as a follower, and refused (fenced).
    pub states_applied: u64,
    pub states_refused: u64,
    /// Batches of hits forwarded to leaders, and the hits in them.
    pub forward_batches: u64,
    pub forwarded_ops: u64,
    /// Forwarded hits decided here as leader.
    pub forwards_decided: u64,
    /// Writes to peer connections, the frames they carried, their bytes.
    pub writes: u64,
    pub frames_written: u64,
    pub bytes_written: u64,
    /// Peer connections closed at once: too many handshakes in progress.
    pub handshakes_refused: u64,
}

impl NodeStats {
    pub fn read(stats: &super::dataplane::DataStats) -> NodeStats {
        use std::sync::atomic::Ordering::Relaxed;
        NodeStats {
            rounds: stats.rounds.load(Relaxed),
            round_sections: stats.round_sections.load(Relaxed),
            states_replicated: stats.states_replicated.load(Relaxed),
            sections_committed: stats.sections_committed.load(Relaxed),
            sections_failed: stats.sections_failed.load(Relaxed),
            states_applied: stats.states_applied.load(Relaxed),
            states_refused: stats.states_refused.load(Relaxed),
            forward_batches: stats.forward_batches.load(Relaxed),
            forwarded_ops: stats.forwarded_ops.load(Relaxed),
            forwards_decided: stats.forwards_decided.load(Relaxed),
            writes: stats.writes.load(Relaxed),
            frames_written: stats.frames_written.load(Relaxed),
            bytes_written: stats.bytes_written.load(Relaxed),
            handshakes_refused: stats.handshakes_refused.load(Relaxed),
        }
    }
}

/// A node's view of itself, answered to `Hello` and `Status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    pub node_id: NodeId,
    pub live_keys: u64,
    pub shards: Vec<ShardReport>,
    /// The newest member list this node knows.
    pub members: Members,
    pub stats: NodeStats,
    /// The committed rule set this node serves.
    pub rules: RulesTag,
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
    /// `tollgate cluster reload FILE`: commit this rule file's text on
    /// every node (`name` is the file's name; its extension says the format).
    ReloadRules {
        name: String,
        text: String,
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
    /// A new leader of `term` gathers the shard's counters: the replica
    /// promises to refuse states of older terms, then answers what it holds.
    Collect {
        shard: u32,
        term: u64,
    },
    /// Part of a shard's counters from its leader of `term` (catching a
    /// replica up); answered once merged.
    Sync {
        shard: u32,
        term: u64,
        stamped_ms: u64,
        counters: CounterList,
    },
    Status,
    /// A newer member list (answered with the list the node then holds).
    Members(Members),
    /// The shard's leader hands leadership over: stand for election now.
    Elect {
        shard: u32,
    },
    /// An operator request; may open a connection instead of a hello.
    Admin(AdminRequest),
    /// A reload's first step: could this node serve these rules?
    RulesPrepare(RulesRecord),
    /// A reload's second step: the rules are committed, serve them.
    RulesCommit(RulesRecord),
    /// The committed rule set this node serves (for a node behind).
    Rules,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum PeerResponse {
    Hello(NodeReport),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    Append(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Snapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>),
    Collected(Result<CounterList, ApplyRefusal>),
    Synced(Result<(), ApplyRefusal>),
    Status(NodeReport),
    Members(Members),
    /// `Elect` was started.
    Electing,
    /// The outcome of an operator request, said for the operator.
    Admin(Result<String, String>),
    /// The answer to `RulesPrepare` or `RulesCommit` (`Err`: why not).
    RulesChecked(Result<(), String>),
    /// The answer to `Rules` (`None`: version 0, the rule files).
    Rules(Option<RulesRecord>),
    /// The request was not served (mismatched hello, unknown shard, a
    /// recovering replica declining a vote); the text says why.
    Refused(String),
}
