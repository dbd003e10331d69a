//! Cluster mode: counters split into consistent-hashed shards, each shard a
//! Raft group (openraft 0.9) replicated on `replicas` nodes, any node
//! answering any hit. This module owns everything cluster-specific and is the
//! only one that names openraft types; the rest of the server sees a
//! [`Backend`](crate::store::Backend) and a `TOPOLOGY` command.
//!
//! Layout:
//! - configuration and membership: [`config`] (the cluster file),
//!   [`members`] (the member list at run time), [`placement`] (key → shard →
//!   replicas);
//! - the data path: `replica` (a shard's fence and commit rule), `rounds`
//!   (replication rounds and their commits), `outbox` (what goes to a peer),
//!   `dataplane` (inbound frames), `replicator` (closing and sending
//!   rounds), `forward` (a connection's read batch: local decisions and
//!   forwarding), `backend` (the `Backend` and `TOPOLOGY`), `buckets`
//!   (droplet's buckets, one key per period, decided by their shard's
//!   leader like hits);
//! - Raft for leadership and membership: [`storage`] (the groups' logs),
//!   `leadership` (preparing leaders, elections, handovers);
//! - the data dir: [`disk`] (Raft state, fences, members and counters on
//!   disk, so that restarts keep them);
//! - the wire: [`wire`] (messages), [`codec`] (control frames, bincode),
//!   [`data_frames`] (data sections, hand-encoded), `links` (outgoing peer
//!   connections), `peer_server` (the peer port), [`auth`] (the handshake);
//! - the node: `node` (replicas, reports, admin), `join`, `moves` (moving
//!   shards, spreading leaders) planned by the pure [`plan`], `scan`
//!   (batched scans of the store by shard for collections and syncs);
//! - the rules: [`committed_rules`] (the rule set the cluster committed,
//!   cluster-wide reloads, nodes behind taking the newest);
//! - tools: [`status`] (topology, `cluster status`), [`admin`]
//!   (`cluster add-node|remove-node|reload`), [`client`] (straight to
//!   leaders).
//!
//! See docs/cluster.md for the model, the data path and the guarantees.

pub mod admin;
pub mod auth;
mod backend;
mod buckets;
mod cadence;
pub mod client;
pub mod codec;
pub mod committed_rules;
pub mod config;
pub mod data_frames;
mod dataplane;
pub mod disk;
mod forward;
mod join;
mod leadership;
mod links;
pub mod members;
mod moves;
mod node;
mod outbox;
mod peer_protocol;
mod peer_server;
pub mod placement;
pub mod plan;
pub mod raft_runtime;
mod replica;
mod replicator;
mod rounds;
mod scan;
mod secrets;
pub mod status;
pub mod storage;
pub mod wire;

pub use client::ClusterClient;
pub use config::ClusterFile;
pub use peer_server::PEER_HANDSHAKES_MAX;
pub use status::Topology;

use crate::clock::Clock;
use crate::engine::CommandExtension;
use crate::rules::RuleSet;
use crate::server::host::HostThread;
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
    /// How often a node beats to each peer when it has nothing else to
    /// send, in milliseconds (the liveness signal that replaces per-shard
    /// Raft heartbeats).
    pub raft_heartbeat_ms: u64,
    /// Election timeout, in milliseconds: a peer not heard from for twice
    /// this is down, and the voters of the shards it led stand for
    /// election, the first-ranked at once.
    pub raft_election_timeout_ms: u64,
    /// Fast mode: how long decided states may wait before they are sent to
    /// the replicas, in milliseconds.
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
    /// Threads of the runtime that runs the peer links, the replicator,
    /// the shard groups and the handling of peers' frames; 0: no thread of
    /// its own, the first serving thread runs it beside its clients.
    pub raft_threads: usize,
    /// Fast mode: a replication round leaves at once when it holds this
    /// many states.
    pub batch_ops_max: usize,
    /// Most credits of a quota lease granted at once (0: none; `None`:
    /// [`default_lease_credits_max`] of the consistency).
    pub lease_credits_max: Option<u32>,
    /// Counters this node keeps leases for (0: asks for none).
    pub lease_counters_max: usize,
    /// Raft log entries between snapshots of a shard group (its log holds
    /// membership changes and new leaders' entries only).
    pub snapshot_every_entries: u64,
    /// Dial node N at this address instead of its cluster-file peer address.
    pub peer_routes: Vec<(NodeId, SocketAddr)>,
    /// File of the cluster's shared secret(s), one per line.
    pub cluster_secret_file: Option<PathBuf>,
    /// The cluster's shared secret(s), comma-separated (first signs).
    pub cluster_secret: Option<String>,
    /// Where this node keeps its state (`None`: `tollgate-data/node-<id>`
    /// under the working directory; the path `none`: in memory only).
    pub data_dir: Option<PathBuf>,
    /// When the data dir's writes are synced to the disk.
    pub fsync: disk::FsyncPolicy,
    /// `--fsync interval`: how often, in milliseconds.
    pub fsync_interval_ms: u64,
}

/// Threads of the cluster's own runtime by default: none on a machine of at
/// most two cores (the first serving thread runs the cluster beside its
/// clients: a node is then one thread, and handing a hit between its client
/// and cluster sides costs no cross-thread wake-up; docs/benchmarks.md), one
/// on larger machines.
pub fn default_raft_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    usize::from(cores > 2)
}

/// `--lease-credits-max` by default: leases in fast mode (its answers are
/// the leader's view already), none in strict mode, whose answers count
/// the cluster's hits exactly through any node (docs/cluster.md, "Quota
/// leases").
pub fn default_lease_credits_max(consistency: Consistency) -> u32 {
    match consistency {
        Consistency::Fast => 64,
        Consistency::Strict => 0,
    }
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
            raft_threads: default_raft_threads(),
            batch_ops_max: 4_096,
            lease_credits_max: None,
            lease_counters_max: 262_144,
            snapshot_every_entries: 5_000,
            peer_routes: Vec::new(),
            cluster_secret_file: None,
            cluster_secret: None,
            data_dir: None,
            fsync: disk::FsyncPolicy::Interval,
            fsync_interval_ms: 1_000,
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
    #[error("{0}")]
    Protocol(String),
    #[error(transparent)]
    Disk(#[from] disk::DiskError),
    #[error("{0}")]
    Rules(String),
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

    fn store(&self, shard: u32, leader: Option<NodeId>, term: u64) {
        if let (Some(slot), Some(term_slot)) = (
            self.leader.get(shard as usize),
            self.term.get(shard as usize),
        ) {
            term_slot.store(term, Ordering::Release);
            slot.store(leader.unwrap_or(0), Ordering::Release);
        }
    }

    fn known(&self, shard: u32) -> (Option<NodeId>, u64) {
        let term = self
            .term
            .get(shard as usize)
            .map_or(0, |t| t.load(Ordering::Acquire));
        (self.leader(shard), term)
    }

    /// Sets a shard's leader as this node's replica of it reports it, in
    /// its term. A replica that knows no leader (a new one, not added yet,
    /// or one between elections) does not hide a leader of the same or a
    /// newer term learned from peers.
    pub fn set(&self, shard: u32, leader: Option<NodeId>, term: u64) {
        let (known, known_term) = self.known(shard);
        if term > known_term || (term == known_term && (leader.is_some() || known.is_none())) {
            self.store(shard, leader, term);
        }
    }

    /// Records a leader a peer claims, unless a newer term is known.
    pub fn observe(&self, shard: u32, leader: NodeId, term: u64) {
        let (known, known_term) = self.known(shard);
        if term > known_term || (term == known_term && known.is_none()) {
            self.store(shard, Some(leader), term);
        }
    }
}

/// A cluster node's data-path counters and shard counts, as `/metrics`
/// shows them.
#[derive(Debug, Clone, Default)]
pub struct ClusterSnapshot {
    pub stats: wire::NodeStats,
    /// Shards this node leads and decides.
    pub shards_led: u64,
    /// Shards no hit could be decided for from this node now.
    pub shards_unservable: u64,
    /// Every shard this node holds a replica of, by shard.
    pub shards: Vec<ShardSnapshot>,
    /// Failed writes and syncs of the data dir; `None` without one.
    pub data_dir_write_errors: Option<u64>,
    /// Peer handshakes refused for incompatible protocol versions.
    pub peer_version_refusals: u64,
    /// Forwarded hits answered in the frame carrying their round.
    pub round_answers: u64,
    /// Forwarded hits answered at once in a section of their batch's own.
    pub batch_answers: u64,
    /// Forwarded hits' answers sent on, as a follower, for their leader.
    pub answers_relayed: u64,
    /// Hits answered `false` from a remembered denial, not forwarded.
    pub denials_remembered: u64,
    /// Hits admitted from a quota lease, not forwarded.
    pub lease_hits: u64,
    /// Quota leases granted as a shard's leader, and their credits.
    pub leases_granted: u64,
    pub lease_credits_granted: u64,
}

/// One shard's replica on this node, for the per-shard series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSnapshot {
    pub shard: u32,
    /// This node leads the shard and decides its hits.
    pub leading: bool,
    /// The highest term this replica promised or applied states from.
    pub term: u64,
    /// As its leader: round sections sent, and the states they carried.
    pub sections_sent: u64,
    pub states_sent: u64,
    /// As its leader: sections sent and not yet committed or failed.
    pub sections_in_flight: u64,
    /// A move of the shard (led here) is under way.
    pub moving: bool,
}

/// A running cluster member: its runtime and node.
pub struct Cluster {
    node: Arc<node::ClusterNode>,
    client_addr: SocketAddr,
    /// The data dir, synced and closed when the node stops.
    disk: Option<Arc<disk::NodeDisk>>,
    /// Runs every shard group, link and the peer server; dropped last.
    runtime: ClusterRuntime,
}

/// Where the cluster's tasks run.
enum ClusterRuntime {
    /// `--raft-threads N`: a runtime with N threads of its own.
    Own(tokio::runtime::Runtime),
    /// `--raft-threads 0`: a node thread, which also serves the first
    /// listener's clients.
    Node(Arc<HostThread>),
}

impl ClusterRuntime {
    fn start(raft_threads: usize) -> Result<ClusterRuntime, ClusterError> {
        if raft_threads == 0 {
            let host = HostThread::start("tollgate-node").map_err(ClusterError::Runtime)?;
            return Ok(ClusterRuntime::Node(Arc::new(host)));
        }
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(raft_threads)
            .thread_name("tollgate-raft")
            .enable_all()
            .build()
            .map(ClusterRuntime::Own)
            .map_err(ClusterError::Runtime)
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        match self {
            ClusterRuntime::Own(runtime) => runtime,
            ClusterRuntime::Node(host) => host.runtime(),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(disk) = &self.disk {
            disk.close();
        }
    }
}

impl Cluster {
    /// The node thread that should also serve clients, when the cluster has
    /// no thread of its own (`--raft-threads 0`).
    pub fn node_thread(&self) -> Option<Arc<HostThread>> {
        match &self.runtime {
            ClusterRuntime::Node(host) => Some(Arc::clone(host)),
            ClusterRuntime::Own(_) => None,
        }
    }

    pub fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(backend::ClusterBackend {
            dp: Arc::clone(&self.node.dp),
        })
    }

    /// The rules this node must serve from the start when they are not its
    /// rule file's: the set the cluster committed, from the data dir or
    /// taken from peers while joining (`None`: the rule file's).
    pub fn committed_rules(&self) -> Option<RuleSet> {
        self.node.rules.take_undelivered()
    }

    /// Where the rule sets the cluster commits from now on go (the
    /// engine's rule swap); called once the engine exists.
    pub fn on_rules_committed(&self, sink: committed_rules::RulesSink) {
        self.node.rules.attach(sink);
    }

    /// Commits the rule file `name` (its text) on every node: see
    /// [`committed_rules`]. Blocks until done; `Err` says why nothing
    /// changed (or why the answer did not come).
    pub fn reload_rules(&self, name: String, text: String) -> Result<String, String> {
        let (answer, outcome) = std::sync::mpsc::channel();
        let node = Arc::clone(&self.node);
        self.runtime.runtime().spawn(async move {
            let _ = answer.send(node.reload_rules(name, text).await);
        });
        outcome
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| Err("the cluster-wide reload did not finish within 60 s".into()))
    }

    /// droplet's buckets as this cluster keeps them (sharded, replicated).
    pub fn buckets(&self) -> Arc<dyn crate::store::SharedBuckets> {
        Arc::new(buckets::ClusterBuckets {
            dp: Arc::clone(&self.node.dp),
        })
    }

    pub fn topology_command(&self) -> Arc<dyn CommandExtension> {
        Arc::new(backend::TopologyCommand {
            node: Arc::clone(&self.node),
        })
    }

    /// `/readyz`'s cluster condition: every shard can be decided from this
    /// node now (it leads it, prepared, or a leader it can reach does).
    pub fn readiness_check(&self) -> impl Fn() -> Result<(), String> + Send + Sync + 'static {
        let dp = Arc::clone(&self.node.dp);
        move || {
            let unservable = dp.unservable_shards();
            match unservable.first() {
                None => Ok(()),
                Some((shard, why)) => Err(format!(
                    "{} of {} shards cannot be decided from this node (shard {shard}: {why})",
                    unservable.len(),
                    dp.placement.shards()
                )),
            }
        }
    }

    /// Reads this node's data-path counters (for `/metrics`).
    pub fn stats_source(&self) -> impl Fn() -> ClusterSnapshot + Send + Sync + 'static {
        let dp = Arc::clone(&self.node.dp);
        move || ClusterSnapshot {
            stats: wire::NodeStats::read(&dp.stats),
            shards_led: (0..dp.placement.shards())
                .filter(|&s| dp.replica(s).is_some_and(|r| r.ready_term().is_some()))
                .count() as u64,
            shards_unservable: dp.unservable_shards().len() as u64,
            shards: (0..dp.placement.shards())
                .filter_map(|shard| {
                    let replica = dp.replica(shard)?;
                    let stats = &replica.stats;
                    let sent = stats.sections_sent.load(Ordering::Relaxed);
                    let moving = replica.moving.lock().is_some();
                    Some(ShardSnapshot {
                        shard,
                        leading: replica.ready_term().is_some(),
                        term: replica.fence(),
                        sections_sent: sent,
                        states_sent: stats.states_sent.load(Ordering::Relaxed),
                        sections_in_flight: sent
                            .saturating_sub(stats.sections_ended.load(Ordering::Relaxed)),
                        moving,
                    })
                })
                .collect(),
            data_dir_write_errors: dp
                .disk
                .as_ref()
                .map(|disk| disk.write_errors.load(Ordering::Relaxed)),
            peer_version_refusals: auth::version_refusals(),
            round_answers: dp.stats.round_answers.load(Ordering::Relaxed),
            batch_answers: dp.stats.batch_answers.load(Ordering::Relaxed),
            answers_relayed: dp.stats.answers_relayed.load(Ordering::Relaxed),
            denials_remembered: dp.stats.denials_remembered.load(Ordering::Relaxed),
            lease_hits: dp.stats.lease_hits.load(Ordering::Relaxed),
            leases_granted: dp.stats.leases_granted.load(Ordering::Relaxed),
            lease_credits_granted: dp.stats.lease_credits_granted.load(Ordering::Relaxed),
        }
    }

    /// This node's client address from the cluster file.
    pub fn client_addr(&self) -> SocketAddr {
        self.client_addr
    }

    pub fn node_id(&self) -> NodeId {
        self.node.id
    }

    pub fn describe(&self) -> String {
        let members = self.node.members();
        let membership = if members.nodes.contains_key(&self.node.id) {
            format!("members {}", members.describe())
        } else {
            format!("joining, not a member yet: members {}", members.describe())
        };
        let ring = if self.node.file.placement == placement::PlacementKind::Ring {
            ", ring placement"
        } else {
            ""
        };
        format!(
            "cluster node {} ({membership}), {} shards x {} replicas{ring} ({} here), consistency {}",
            self.node.id,
            self.node.file.shards,
            self.node.file.replicas,
            self.node.replica_count(),
            self.node.hello.consistency
        )
    }
}

fn raft_config(args: &ClusterConfig) -> Result<Arc<openraft::Config>, ClusterError> {
    let election_ms = args.raft_election_timeout_ms.max(3);
    // Groups send no heartbeats and run no election timers (see
    // leadership.rs): the heartbeat interval only bounds how long a leader
    // waits for its voters when it confirms itself, and the election
    // timeouts only set the leader lease (a voter refuses other candidates
    // for `election_timeout_max` after a message from its leader), which a
    // handover must wait out: keep it just above that bound.
    let confirm_ms = (election_ms * 2 / 3).max(1);
    let config = openraft::Config {
        cluster_name: "tollgate".into(),
        heartbeat_interval: confirm_ms,
        election_timeout_min: confirm_ms + 1,
        election_timeout_max: confirm_ms + 2,
        install_snapshot_timeout: 2_000,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(
            args.snapshot_every_entries.max(1),
        ),
        max_in_snapshot_log_to_keep: (args.snapshot_every_entries / 2).clamp(1, 100),
        purge_batch_size: 64,
        enable_tick: false,
        enable_heartbeat: false,
        enable_elect: false,
        ..Default::default()
    };
    config
        .validate()
        .map(Arc::new)
        .map_err(|error| ClusterError::RaftConfig(error.to_string()))
}

/// Starts this node's part of the cluster when `--cluster` is given:
/// links to peers, the data plane, one Raft group per shard it replicates,
/// the peer server, then joins. Returns `None` without `--cluster`.
/// The client address the cluster file gives this node (`None` outside
/// cluster mode), known before the node starts or joins.
pub fn client_addr_of(args: &ClusterConfig) -> Result<Option<SocketAddr>, ClusterError> {
    let Some(path) = &args.cluster_file else {
        return Ok(None);
    };
    let file = ClusterFile::load(path)?;
    let id = args.node_id.ok_or(ClusterError::NoNodeId)?;
    let me = file
        .nodes
        .get(&id)
        .ok_or(config::ClusterFileError::UnknownSelf(id))?;
    Ok(Some(me.client))
}

pub fn start(
    args: &ClusterConfig,
    rules: &RuleSet,
    strict_rules: bool,
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
    let protocol = auth::local_protocol().map_err(ClusterError::Protocol)?;
    if protocol != auth::PROTOCOL {
        tracing::warn!(
            "{}: advertising peer protocol {protocol} instead of {} (for tests only)",
            auth::TEST_PROTOCOL_ENV,
            auth::PROTOCOL
        );
    }
    let me = file
        .nodes
        .get(&id)
        .cloned()
        .ok_or(config::ClusterFileError::UnknownSelf(id))?;
    let routes = file.peer_routes(id, &args.peer_routes)?;
    let placement = file.placement();
    let raft_config = raft_config(args)?;
    let cluster_runtime = ClusterRuntime::start(args.raft_threads)?;
    let runtime = cluster_runtime.runtime();
    let hello = wire::Hello {
        node_id: id,
        rules: committed_rules::RulesTag::initial(rules),
        layout_fingerprint: file.layout_fingerprint(),
        consistency: args.consistency.as_str().to_string(),
        boot_id: wire::new_boot_id(),
    };
    let leaders = Arc::new(LeaderTable::new(placement.shards()));
    let (disk, startup) = match data_dir_of(args, id) {
        Some(dir) => {
            let config = disk::DiskConfig {
                dir,
                fsync: args.fsync,
                fsync_interval_ms: args.fsync_interval_ms,
            };
            let (disk, startup) =
                disk::NodeDisk::open(&config, Arc::clone(&store), Arc::clone(&clock))?;
            (Some(disk), Some(startup))
        }
        None => (None, None),
    };
    let persisted_rules = startup.as_ref().and_then(|s| s.meta.rules.clone());
    let cluster_rules = Arc::new(
        committed_rules::ClusterRules::new(rules, persisted_rules, strict_rules, disk.clone())
            .map_err(ClusterError::Rules)?,
    );
    let dp = Arc::new(dataplane::DataPlane::new(
        id,
        hello.boot_id,
        placement,
        store,
        clock,
        leaders,
        disk.clone(),
        dataplane::DataSettings {
            consistency: args.consistency,
            commit_timeout_ms: args.commit_timeout_ms.max(1),
            forward_timeout_ms: args.forward_timeout_ms.max(1),
            replication_interval_ms: args.replication_interval_ms.max(1),
            batch_ops_max: args.batch_ops_max.max(1),
            liveness_timeout_ms: args.raft_election_timeout_ms.max(3) * 2,
            beat_ms: args.raft_heartbeat_ms.max(1),
            lease_credits_max: args
                .lease_credits_max
                .unwrap_or(default_lease_credits_max(args.consistency)),
            lease_counters: forward::lease_table_entries(args.lease_counters_max),
        },
    ));
    let links = Arc::new(links::Links::new(
        links::Greeting {
            hello: hello.clone(),
            rules: Arc::clone(&cluster_rules),
        },
        runtime.handle().clone(),
        routes,
        Arc::clone(&secrets),
        Arc::clone(&dp),
        args.raft_heartbeat_ms.max(1),
    ));
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
            Arc::clone(&dp),
            links,
            node::GroupFactory { raft_config },
            node::NodeSettings {
                election_timeout_ms: args.raft_election_timeout_ms.max(3),
                shard_moves_max: args.shard_moves_max,
                leader_balance: args.leader_balance,
                startup,
                rules: cluster_rules,
            },
        ));
        tokio::spawn(Arc::clone(&dp).run_replicator());
        tokio::spawn(peer_server::serve_peers(
            listener,
            Arc::clone(&node),
            secrets,
        ));
        tokio::spawn(Arc::clone(&node).resync_on_connect());
        node.join(join::JoinSettings {
            join_wait_ms: args.join_wait_ms,
            join_existing: args.join_existing,
        })
        .await?;
        tokio::spawn(Arc::clone(&node).poll_peers());
        tokio::spawn(Arc::clone(&node).rebalance());
        tokio::spawn(leadership::watch_elections(Arc::clone(&node)));
        Ok::<_, ClusterError>(node)
    })?;
    Ok(Some(Cluster {
        node,
        client_addr: me.client,
        disk,
        runtime: cluster_runtime,
    }))
}

/// The data dir `--data-dir` names for node `id` (`none`: no data dir).
fn data_dir_of(args: &ClusterConfig, id: NodeId) -> Option<PathBuf> {
    match args.data_dir.as_deref() {
        Some(path) if path == std::path::Path::new("none") => None,
        Some(path) => Some(path.to_path_buf()),
        None => Some(PathBuf::from("tollgate-data").join(format!("node-{id}"))),
    }
}
