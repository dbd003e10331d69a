//! Cluster mode: counters split into consistent-hashed shards, each shard a
//! Raft group (openraft 0.9) replicated on `replicas` nodes, any node
//! answering any hit. This module owns everything cluster-specific and is the
//! only one that names openraft types; the rest of the server sees a
//! [`Backend`](crate::store::Backend) and a `TOPOLOGY` command.
//!
//! Layout: [`config`] (the cluster file), [`members`] (the member list at
//! run time), `auth` (the shared secret and the peer-port handshake),
//! [`placement`] (key → shard → replicas), [`storage`] (Raft log
//! and state machine in memory), [`wire`] + [`codec`] (peer messages and
//! their bytes), `links` (outgoing multiplexed peer connections, openraft's
//! network), `shard` (a group's leader-side batching), `node` (joining,
//! forwarding, moving shards, the peer server), `backend` (the `Backend` and
//! `TOPOLOGY`), [`status`] (topology, `cluster status`), [`admin`]
//! (`cluster add-node|remove-node`), [`client`] (a client that goes
//! straight to leaders). See docs/cluster.md for the model and its
//! guarantees.

pub mod admin;
pub mod auth;
mod backend;
pub mod client;
pub mod codec;
pub mod config;
mod links;
pub mod members;
mod node;
pub mod placement;
mod shard;
pub mod status;
pub mod storage;
pub mod wire;

pub use client::ClusterClient;
pub use config::ClusterFile;
pub use status::Topology;

use crate::clock::Clock;
use crate::engine::CommandExtension;
use crate::rules::RuleSet;
use crate::store::{Backend, MemoryStore};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A node's id, as the cluster file numbers it (≥ 1).
pub type NodeId = u64;

/// When a hit is answered (see docs/cluster.md for the exact guarantees).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consistency {
    /// After the shard's entry is committed by a majority of its replicas.
    Strict,
    /// At once from the leader's state; replicated in the background.
    Fast,
}

impl Consistency {
    pub fn as_str(self) -> &'static str {
        match self {
            Consistency::Strict => "strict",
            Consistency::Fast => "fast",
        }
    }
}

/// Cluster mode's settings (`tollgate serve --cluster FILE` and the flags
/// beside it; docs/cluster.md). Without a cluster file the node runs alone.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Run as a member of the cluster this file describes; `None`: single node.
    pub cluster_file: Option<PathBuf>,
    /// This node's id in the cluster file.
    pub node_id: Option<NodeId>,
    /// When a hit is answered.
    pub consistency: Consistency,
    /// Raft heartbeat interval, in milliseconds.
    pub raft_heartbeat_ms: u64,
    /// Raft election timeout, in milliseconds (the minimum; the maximum is
    /// twice it).
    pub raft_election_timeout_ms: u64,
    /// Fast mode: how often decided states are proposed, in milliseconds.
    pub replication_interval_ms: u64,
    /// How long a proposal may wait for its commit, in milliseconds.
    pub commit_timeout_ms: u64,
    /// How long a hit may wait for its shard's leader, in milliseconds.
    pub forward_timeout_ms: u64,
    /// At startup, how long to wait for peers to answer, in milliseconds.
    pub join_wait_ms: u64,
    /// Join a running cluster as a new node (never initialize a shard).
    pub join_existing: bool,
    /// Shards this node may be moving at once (as their leader).
    pub shard_moves_max: usize,
    /// Spread shard leadership over the nodes that are up.
    pub leader_balance: bool,
    /// Threads of the runtime that runs every Raft group of this node.
    pub raft_threads: usize,
    /// Most hits decided in one batch (one Raft entry, one peer message).
    pub batch_ops_max: usize,
    /// Raft log entries between snapshots of a shard.
    pub snapshot_every_entries: u64,
    /// Dial node N at this address instead of its cluster-file peer address.
    pub peer_routes: Vec<(NodeId, SocketAddr)>,
    /// File of the cluster's shared secret(s), one per line.
    pub cluster_secret_file: Option<PathBuf>,
    /// The cluster's shared secret(s), comma-separated (first signs).
    pub cluster_secret: Option<String>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            cluster_file: None,
            node_id: None,
            consistency: Consistency::Strict,
            raft_heartbeat_ms: 100,
            raft_election_timeout_ms: 300,
            replication_interval_ms: 5,
            commit_timeout_ms: 1_000,
            forward_timeout_ms: 2_000,
            join_wait_ms: 3_000,
            join_existing: false,
            shard_moves_max: 2,
            leader_balance: true,
            raft_threads: 2,
            batch_ops_max: 4_096,
            snapshot_every_entries: 5_000,
            peer_routes: Vec::new(),
            cluster_secret_file: None,
            cluster_secret: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    File(#[from] config::ClusterFileError),
    #[error("--cluster needs --node-id")]
    NoNodeId,
    #[error("invalid Raft settings: {0}")]
    RaftConfig(String),
    #[error("cannot start the Raft runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot listen for peers on {addr}: {source}")]
    PeerListen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start shard {shard}: {why}")]
    Shard { shard: u32, why: String },
    #[error("node {peer} refused this node: {why}")]
    Refused { peer: NodeId, why: String },
    #[error(transparent)]
    Secret(#[from] auth::SecretError),
    #[error("no peer accepted this node: {0}")]
    Unauthenticated(String),
}

/// Who leads each shard, as far as this node knows: written by the shard
/// watchers (and by polling peers for shards not replicated here), read on
/// every hit. 0 means no known leader.
pub struct LeaderTable {
    leader: Vec<AtomicU64>,
    term: Vec<AtomicU64>,
}

impl LeaderTable {
    pub fn new(shards: u32) -> LeaderTable {
        LeaderTable {
            leader: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            term: (0..shards).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn leader(&self, shard: u32) -> Option<NodeId> {
        let leader = self.leader.get(shard as usize)?.load(Ordering::Acquire);
        (leader != 0).then_some(leader)
    }

    /// Sets a shard's leader as its own Raft group reports it.
    pub fn set(&self, shard: u32, leader: Option<NodeId>, term: u64) {
        if let (Some(slot), Some(term_slot)) = (
            self.leader.get(shard as usize),
            self.term.get(shard as usize),
        ) {
            term_slot.store(term, Ordering::Release);
            slot.store(leader.unwrap_or(0), Ordering::Release);
        }
    }

    /// Records a leader a peer claims, unless a newer term is known.
    pub fn observe(&self, shard: u32, leader: NodeId, term: u64) {
        if let Some(term_slot) = self.term.get(shard as usize) {
            if term >= term_slot.load(Ordering::Acquire) {
                self.set(shard, Some(leader), term);
            }
        }
    }
}

/// A running cluster member: its Raft runtime and node.
pub struct Cluster {
    node: Arc<node::ClusterNode>,
    client_addr: SocketAddr,
    /// Runs every shard group, link and the peer server; dropped last.
    _runtime: tokio::runtime::Runtime,
}

impl Cluster {
    pub fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(backend::ClusterBackend {
            node: Arc::clone(&self.node),
        })
    }

    pub fn topology_command(&self) -> Arc<dyn CommandExtension> {
        Arc::new(backend::TopologyCommand {
            node: Arc::clone(&self.node),
        })
    }

    /// This node's client address from the cluster file.
    pub fn client_addr(&self) -> SocketAddr {
        self.client_addr
    }

    pub fn node_id(&self) -> NodeId {
        self.node.id
    }

    pub fn describe(&self) -> String {
        format!(
            "cluster node {} of {}, {} shards x {} replicas ({} here), consistency {}",
            self.node.id,
            self.node.members().nodes.len(),
            self.node.file.shards,
            self.node.file.replicas,
            self.node.group_count(),
            self.node.hello.consistency
        )
    }
}

fn raft_config(args: &ClusterConfig) -> Result<Arc<openraft::Config>, ClusterError> {
    let election_ms = args.raft_election_timeout_ms.max(2);
    let config = openraft::Config {
        cluster_name: "tollgate".into(),
        heartbeat_interval: args.raft_heartbeat_ms.max(1),
        election_timeout_min: election_ms,
        election_timeout_max: election_ms * 2,
        install_snapshot_timeout: 2_000,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(
            args.snapshot_every_entries.max(1),
        ),
        // Entries kept after a snapshot, for followers slightly behind;
        // one further behind catches up from the snapshot.
        max_in_snapshot_log_to_keep: (args.snapshot_every_entries / 2).clamp(1, 100),
        purge_batch_size: 64,
        // Elections start once the node has joined (see node.rs).
        enable_elect: false,
        ..Default::default()
    };
    config
        .validate()
        .map(Arc::new)
        .map_err(|error| ClusterError::RaftConfig(error.to_string()))
}

/// Starts this node's part of the cluster when `--cluster` is given:
/// links to peers, one Raft group per shard it replicates, the peer server,
/// then joins. Returns `None` without `--cluster`.
pub fn start(
    args: &ClusterConfig,
    rules: &RuleSet,
    store: Arc<MemoryStore>,
    clock: Arc<dyn Clock>,
) -> Result<Option<Cluster>, ClusterError> {
    let Some(path) = &args.cluster_file else {
        return Ok(None);
    };
    let file = ClusterFile::load(path)?;
    let id = args.node_id.ok_or(ClusterError::NoNodeId)?;
    let secrets = Arc::new(auth::PeerSecrets::from_flags(
        args.cluster_secret_file.as_deref(),
        args.cluster_secret.as_deref(),
    )?);
    let me = file
        .nodes
        .get(&id)
        .cloned()
        .ok_or(config::ClusterFileError::UnknownSelf(id))?;
    let routes = file.peer_routes(id, &args.peer_routes)?;
    let placement = file.placement();
    let raft_config = raft_config(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.raft_threads.max(1))
        .thread_name("tollgate-raft")
        .enable_all()
        .build()
        .map_err(ClusterError::Runtime)?;
    let hello = wire::Hello {
        node_id: id,
        rules_fingerprint: rules.fingerprint(),
        layout_fingerprint: file.layout_fingerprint(),
        consistency: args.consistency.as_str().to_string(),
    };
    let links = Arc::new(links::Links::new(
        hello.clone(),
        runtime.handle().clone(),
        routes,
        Arc::clone(&secrets),
    ));
    let leaders = Arc::new(LeaderTable::new(placement.shards()));
    let factory = node::GroupFactory {
        raft_config,
        store,
        clock,
        settings: shard::WorkerSettings {
            node_id: id,
            consistency: args.consistency,
            commit_timeout_ms: args.commit_timeout_ms.max(1),
            replication_interval_ms: args.replication_interval_ms.max(1),
            batch_ops_max: args.batch_ops_max.max(1),
        },
    };
    let node = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(me.peer)
            .await
            .map_err(|source| ClusterError::PeerListen {
                addr: me.peer,
                source,
            })?;
        let node = Arc::new(node::ClusterNode::new(
            id,
            file,
            hello,
            links,
            leaders,
            factory,
            args.forward_timeout_ms.max(1),
            args.raft_election_timeout_ms,
            args.shard_moves_max,
            args.leader_balance,
        ));
        tokio::spawn(node::serve_peers(listener, Arc::clone(&node), secrets));
        node.join(node::JoinSettings {
            join_wait_ms: args.join_wait_ms,
            join_existing: args.join_existing,
        })
        .await?;
        tokio::spawn(Arc::clone(&node).poll_peers());
        tokio::spawn(Arc::clone(&node).rebalance());
        Ok::<_, ClusterError>(node)
    })?;
    Ok(Some(Cluster {
        node,
        client_addr: me.client,
        _runtime: runtime,
    }))
}
