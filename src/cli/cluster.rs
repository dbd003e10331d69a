//! `tollgate cluster status|add-node|remove-node|reload` and the cluster
//! flags of `tollgate serve`: flags and environment variables mapped onto
//! [`ClusterConfig`], and the operator commands, which ask a running node
//! ([`fetch_topology`], [`admin::send`]) and turn its answer into output
//! and an exit status.

use crate::cluster::admin;
use crate::cluster::auth::PeerSecrets;
use crate::cluster::config::{parse_peer_route, NodeAddresses};
use crate::cluster::disk::FsyncPolicy;
use crate::cluster::status::{fetch_topology, render};
use crate::cluster::wire::AdminRequest;
use crate::cluster::{ClusterConfig, Consistency, NodeId};
use clap::{ArgAction, Args};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Most `--lease-counters-max` (64 bytes each: 1 GiB), so that a typo
/// cannot ask for more memory than a machine has.
const LEASE_COUNTERS_MAX_MAX: u64 = 1 << 24;

/// Flags of `tollgate serve` for cluster mode.
#[derive(Debug, Clone, Args)]
pub struct ClusterArgs {
    /// Run as a member of the cluster this file describes (INI: [cluster]
    /// shards/replicas, [node N] client/peer addresses). See docs/cluster.md.
    #[arg(long = "cluster", value_name = "FILE")]
    pub cluster_file: Option<PathBuf>,

    /// This node's id in the cluster file.
    #[arg(long, requires = "cluster_file")]
    pub node_id: Option<NodeId>,

    /// strict: answer after a majority commit; fast: answer from the
    /// leader's state and replicate in the background.
    #[arg(long, value_enum, default_value_t = ClusterConfig::default().consistency)]
    pub consistency: Consistency,

    /// How often a node beats to each peer when it has nothing else to
    /// send, in milliseconds: the liveness signal that replaces per-shard
    /// Raft heartbeats.
    #[arg(long, default_value_t = ClusterConfig::default().raft_heartbeat_ms)]
    pub raft_heartbeat_ms: u64,

    /// Election timeout, in milliseconds. A peer not heard from for twice
    /// this (0.6 s by default) is down: the voters of the shards it led
    /// stand for election, the first-ranked at once, the others later.
    #[arg(long, default_value_t = ClusterConfig::default().raft_election_timeout_ms)]
    pub raft_election_timeout_ms: u64,

    /// Fast mode: how long decided states may wait before they are sent to
    /// the replicas, in milliseconds.
    #[arg(long, default_value_t = ClusterConfig::default().replication_interval_ms)]
    pub replication_interval_ms: u64,

    /// How long a proposal may wait for its commit, in milliseconds: in
    /// strict mode its hits then answer `unavailable`; in fast mode the
    /// leader re-confirms its leadership before deciding more. Also bounds
    /// a new leader's confirmation.
    #[arg(long, default_value_t = ClusterConfig::default().commit_timeout_ms)]
    pub commit_timeout_ms: u64,

    /// How long a hit may wait for its shard's leader, in milliseconds.
    #[arg(long, default_value_t = ClusterConfig::default().forward_timeout_ms)]
    pub forward_timeout_ms: u64,

    /// At startup, how long to wait for peers to answer, in milliseconds.
    #[arg(long, default_value_t = ClusterConfig::default().join_wait_ms)]
    pub join_wait_ms: u64,

    /// Join a running cluster as a new node: wait (without limit) until a
    /// member listed in the cluster file answers, take the cluster's member
    /// list, and never initialize a shard; `tollgate cluster add-node` then
    /// moves shards here. See docs/cluster.md.
    #[arg(long = "join")]
    pub join_existing: bool,

    /// Shards this node may be moving at once (as their leader) while the
    /// cluster grows or shrinks; each move copies the shard's counters to a
    /// new replica.
    #[arg(long, default_value_t = ClusterConfig::default().shard_moves_max)]
    pub shard_moves_max: usize,

    /// Spread shard leadership over the nodes that are up: a node leading
    /// more than its share hands shards over to replicas that lead fewer
    /// (one at a time; hits of that shard wait well under a second).
    /// `--leader-balance false` leaves leaders where elections put them.
    #[arg(long, default_value_t = ClusterConfig::default().leader_balance, action = ArgAction::Set)]
    pub leader_balance: bool,

    /// Threads of the runtime that runs the peer links, the replicator,
    /// the shard groups and the handling of peers' frames; 0: none, the
    /// first serving thread runs them beside its clients [default: 0 on
    /// machines of at most 2 cores, else 1].
    #[arg(long, default_value_t = ClusterConfig::default().raft_threads, hide_default_value = true)]
    pub raft_threads: usize,

    /// Fast mode: a replication round leaves at once when it holds this
    /// many states.
    #[arg(long, default_value_t = ClusterConfig::default().batch_ops_max)]
    pub batch_ops_max: usize,

    /// Most credits of a quota lease this node grants, as a shard's
    /// leader, to a node that forwards it a fixed-window hit; that node
    /// then admits the counter's next hits itself until they run out. 0:
    /// no leases granted, none asked for. In strict mode a lease is sent
    /// once the state counting it commits (never over-admission), but a
    /// node's answers then count down its own lease rather than the
    /// cluster's count. See docs/cluster.md, "Quota leases" [default: 64 in
    /// fast mode, 0 in strict mode].
    #[arg(long)]
    pub lease_credits_max: Option<u32>,

    /// Counters this node keeps quota leases for (64 bytes
    /// each, in one table its serving threads share); a counter it forwards
    /// while every place it could take holds a lease is forwarded without
    /// asking for one. 0: this node asks for no lease. At most 16777216
    /// (1 GiB).
    #[arg(
        long,
        default_value_t = ClusterConfig::default().lease_counters_max as u64,
        value_parser = clap::value_parser!(u64).range(0..=LEASE_COUNTERS_MAX_MAX)
    )]
    pub lease_counters_max: u64,

    /// Raft log entries between snapshots of a shard group (its log holds
    /// membership changes and new leaders' entries only).
    #[arg(long, default_value_t = ClusterConfig::default().snapshot_every_entries)]
    pub snapshot_every_entries: u64,

    /// Dial node N at this address instead of its cluster-file peer address
    /// (NAT, SSH tunnels, fault-injection proxies). Repeatable: N=HOST:PORT.
    #[arg(long = "peer-route", value_name = "N=HOST:PORT", value_parser = parse_peer_route)]
    pub peer_routes: Vec<(NodeId, SocketAddr)>,

    /// File of the cluster's shared secret(s), one per line (blank lines and
    /// # comments ignored): the first signs, all are accepted (rotation).
    /// Peers must prove they hold it. Required in cluster mode (or
    /// --cluster-secret). See docs/cluster.md, "Security of the peer port".
    #[arg(long, value_name = "PATH")]
    pub cluster_secret_file: Option<PathBuf>,

    /// The cluster's shared secret(s), comma-separated (first signs);
    /// prefer --cluster-secret-file (command lines are visible to others).
    #[arg(
        long,
        value_name = "SECRET",
        env = "TOLLGATE_CLUSTER_SECRET",
        hide_env_values = true
    )]
    pub cluster_secret: Option<String>,

    /// Where this node keeps its Raft state, fences, member list and
    /// counters, so that restarts keep them (created with mode 0700;
    /// default `tollgate-data/node-<id>` under the working directory;
    /// `none`: in memory only). See docs/cluster.md, "Data dir".
    #[arg(long, value_name = "PATH")]
    pub data_dir: Option<PathBuf>,

    /// When the data dir's writes are synced to the disk: never (the OS
    /// decides), interval (every --fsync-interval-ms), batch (before every
    /// acknowledgement). Every write reaches the OS before it is
    /// acknowledged, so a killed process loses nothing either way; this
    /// sets what a power cut can lose (docs/cluster.md).
    #[arg(long, value_name = "POLICY", default_value = "interval", value_parser = parse_fsync)]
    pub fsync: FsyncPolicy,

    /// `--fsync interval`: how often the data dir is synced, in milliseconds.
    #[arg(long, default_value_t = ClusterConfig::default().fsync_interval_ms)]
    pub fsync_interval_ms: u64,
}

fn parse_fsync(text: &str) -> Result<FsyncPolicy, String> {
    text.parse()
}

/// No secret file and no (non-empty) secret value.
fn no_secret(file: Option<&std::path::Path>, value: Option<&str>) -> bool {
    file.is_none() && value.is_none_or(|v| v.trim().is_empty())
}

/// Cluster mode without a secret: where the secret comes from, made once
/// for a new cluster, copied from a member when `joining` one (a new secret
/// would fail authentication).
pub fn missing_secret(joining: bool) -> anyhow::Error {
    if joining {
        return anyhow::anyhow!(
            "a node joining a running cluster needs that cluster's secret: copy the secret \
             file from a member and give --cluster-secret-file PATH (or --cluster-secret / \
             TOLLGATE_CLUSTER_SECRET); a newly made secret would fail authentication"
        );
    }
    anyhow::Error::new(crate::cluster::auth::SecretError::Missing)
}

impl ClusterArgs {
    pub fn into_config(self) -> ClusterConfig {
        ClusterConfig {
            cluster_file: self.cluster_file,
            node_id: self.node_id,
            consistency: self.consistency,
            raft_heartbeat_ms: self.raft_heartbeat_ms,
            raft_election_timeout_ms: self.raft_election_timeout_ms,
            replication_interval_ms: self.replication_interval_ms,
            commit_timeout_ms: self.commit_timeout_ms,
            forward_timeout_ms: self.forward_timeout_ms,
            join_wait_ms: self.join_wait_ms,
            join_existing: self.join_existing,
            shard_moves_max: self.shard_moves_max,
            leader_balance: self.leader_balance,
            raft_threads: self.raft_threads,
            batch_ops_max: self.batch_ops_max,
            lease_credits_max: self.lease_credits_max,
            lease_counters_max: self.lease_counters_max as usize,
            snapshot_every_entries: self.snapshot_every_entries,
            peer_routes: self.peer_routes,
            cluster_secret_file: self.cluster_secret_file,
            cluster_secret: self.cluster_secret,
            data_dir: self.data_dir,
            fsync: self.fsync,
            fsync_interval_ms: self.fsync_interval_ms.max(1),
        }
    }
}

/// Flags of `tollgate cluster status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// Any node's client address (HOST:PORT of a `client =` line; not its
    /// peer port).
    #[arg(long, default_value = "127.0.0.1:8321")]
    pub node: String,
    /// Print the JSON topology instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 unless every node is up and every shard has a leader.
    #[arg(long)]
    pub check: bool,
    /// With --check: also exit 1 while shards are moving (after add-node or
    /// remove-node) or a replica is recovering.
    #[arg(long, requires = "check")]
    pub settled: bool,
    /// How long to wait for the answer, in milliseconds.
    #[arg(long, default_value_t = 3_000)]
    pub timeout_ms: u64,
}

/// Flags shared by the membership commands.
#[derive(Debug, Clone, Args)]
pub struct AdminTarget {
    /// Any member's peer address (HOST:PORT of a `peer =` line); a client
    /// address works too (its node's peer address is asked for).
    #[arg(long, default_value = "127.0.0.1:9321")]
    pub node: String,
    /// How long to wait for the answer, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// The cluster's secret file (as given to `serve`).
    #[arg(long, value_name = "PATH")]
    pub cluster_secret_file: Option<PathBuf>,
    /// The cluster's secret(s), comma-separated; prefer the file.
    #[arg(
        long,
        value_name = "SECRET",
        env = "TOLLGATE_CLUSTER_SECRET",
        hide_env_values = true
    )]
    pub cluster_secret: Option<String>,
}

/// `tollgate cluster add-node`.
#[derive(Debug, Clone, Args)]
pub struct AddNodeArgs {
    /// The new node's id (its `--node-id`).
    pub id: NodeId,
    /// Where the new node serves clients (IP:PORT).
    #[arg(long)]
    pub client: SocketAddr,
    /// Where the new node listens for peers (IP:PORT).
    #[arg(long)]
    pub peer: SocketAddr,
    #[command(flatten)]
    pub target: AdminTarget,
}

/// `tollgate cluster remove-node`.
#[derive(Debug, Clone, Args)]
pub struct RemoveNodeArgs {
    /// The id of the node to remove.
    pub id: NodeId,
    #[command(flatten)]
    pub target: AdminTarget,
}

/// `tollgate cluster reload`.
#[derive(Debug, Clone, Args)]
pub struct ReloadArgs {
    /// The new rule file (`.ini` or `.json`); its text is sent to the node,
    /// so it need not exist on the nodes.
    pub file: PathBuf,
    #[command(flatten)]
    pub target: AdminTarget,
}

/// `tollgate cluster status`: exit 1 with `--check` when the cluster is not
/// healthy (or, with `--settled`, still moving shards).
pub fn status_command(args: &StatusArgs) -> anyhow::Result<ExitCode> {
    let topology = fetch_topology(&args.node, Duration::from_millis(args.timeout_ms.max(1)))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&topology)?);
    } else {
        print!("{}", render(&topology));
    }
    let ok = if args.settled {
        topology.settled()
    } else {
        topology.healthy()
    };
    if args.check && !ok {
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// `tollgate cluster add-node`.
pub fn add_node_command(args: &AddNodeArgs) -> anyhow::Result<ExitCode> {
    let request = AdminRequest::AddNode {
        id: args.id,
        addresses: NodeAddresses {
            client: args.client,
            peer: args.peer,
        },
    };
    run_admin(&args.target, request)
}

/// `tollgate cluster remove-node`.
pub fn remove_node_command(args: &RemoveNodeArgs) -> anyhow::Result<ExitCode> {
    run_admin(&args.target, AdminRequest::RemoveNode { id: args.id })
}

/// `tollgate cluster reload FILE`: checks the file here (so that a bad one
/// is named at once), then asks a node to commit it on every node.
pub fn reload_command(args: &ReloadArgs) -> anyhow::Result<ExitCode> {
    let name = args.file.display().to_string();
    let text = match std::fs::read_to_string(&args.file) {
        Ok(text) => text,
        Err(reason) => {
            let error = crate::rules::ConfigError::Io { path: name, reason };
            eprintln!("tollgate: refused: {error}; nothing changed");
            return Ok(ExitCode::FAILURE);
        }
    };
    match crate::rules::diagnostics::load_text(&name, &text, false) {
        Ok(loaded) => {
            // Nodes running --strict-rules refuse the file for these.
            for warning in &loaded.warnings {
                eprintln!("tollgate: warning: {name}: {warning}");
            }
        }
        Err(error) => {
            eprintln!(
                "tollgate: refused: {}; nothing changed",
                error.in_file(&args.file)
            );
            return Ok(ExitCode::FAILURE);
        }
    }
    run_admin(&args.target, AdminRequest::ReloadRules { name, text })
}

/// Sends an operator request and prints the answer: exit 1 when the node
/// refused it. `--node` may name a client port: when the peer handshake
/// fails there and the address answers `TOPOLOGY`, the request goes to
/// that node's peer port instead.
fn run_admin(target: &AdminTarget, request: AdminRequest) -> anyhow::Result<ExitCode> {
    if no_secret(
        target.cluster_secret_file.as_deref(),
        target.cluster_secret.as_deref(),
    ) {
        anyhow::bail!(
            "operator requests (add-node, remove-node, reload) must prove the cluster's \
             secret: give the secret file the nodes were started with, --cluster-secret-file PATH (or --cluster-secret / \
             TOLLGATE_CLUSTER_SECRET)"
        );
    }
    let secrets = PeerSecrets::from_flags(
        target.cluster_secret_file.as_deref(),
        target.cluster_secret.as_deref(),
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let timeout = Duration::from_millis(target.timeout_ms.max(1));
    let send = |node: &str| {
        runtime.block_on(async {
            tokio::time::timeout(timeout, admin::send(node, &secrets, request.clone()))
                .await
                .map_err(|_| {
                    anyhow::anyhow!("{node} did not answer within {} ms", timeout.as_millis())
                })?
        })
    };
    let answer = match send(&target.node) {
        Ok(answer) => answer,
        Err(error) => match probe_client_port(&target.node) {
            ClientPort::OfNode { id, peer } => {
                eprintln!(
                    "tollgate: {} is node {id}'s client port; sending the request to its peer port {peer}",
                    target.node
                );
                send(&peer)?
            }
            ClientPort::NotClustered => anyhow::bail!(
                "{} is the client port of a Tollgate that does not run in cluster mode; --node takes a cluster member's peer address (its `peer =` line)",
                target.node
            ),
            ClientPort::No => return Err(error),
        },
    };
    match answer {
        Ok(done) => {
            println!("{done}");
            Ok(ExitCode::SUCCESS)
        }
        Err(why) => {
            eprintln!("tollgate: refused: {why}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// What answers at an address that refused the peer handshake.
enum ClientPort {
    /// A cluster node's client port: that node's id and peer address.
    OfNode { id: NodeId, peer: String },
    /// A Tollgate client port outside cluster mode (`TOPOLOGY` is unknown).
    NotClustered,
    /// Something else, or nothing.
    No,
}

/// Asks `addr` for `TOPOLOGY`, as a client would.
fn probe_client_port(addr: &str) -> ClientPort {
    use std::io::{BufRead, BufReader, Write};
    let timeout = Duration::from_secs(2);
    let Some(socket) = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .ok()
        .and_then(|mut addrs| addrs.next())
    else {
        return ClientPort::No;
    };
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&socket, timeout) else {
        return ClientPort::No;
    };
    let _ = stream.set_read_timeout(Some(timeout));
    if stream.write_all(b"TOPOLOGY\n").is_err() {
        return ClientPort::No;
    }
    let mut line = String::new();
    let mut reader = BufReader::new(std::io::Read::take(stream, 1 << 20));
    if reader.read_line(&mut line).is_err() {
        return ClientPort::No;
    }
    if line.starts_with("ERR ") {
        return ClientPort::NotClustered;
    }
    let Ok(topology) = serde_json::from_str::<crate::cluster::Topology>(line.trim_end()) else {
        return ClientPort::No;
    };
    topology
        .nodes
        .iter()
        .find(|node| node.id == topology.answered_by)
        .map_or(ClientPort::No, |node| ClientPort::OfNode {
            id: node.id,
            peer: node.peer.clone(),
        })
}
