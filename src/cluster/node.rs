//! This node as a cluster member: its shard groups, its links and forwarders
//! to peers, the peer-port server, and joining at startup.
//!
//! Joining: the node asks every peer what it knows (bounded by
//! `join_wait_ms`). A shard that no peer has established yet is new: its
//! first replica initializes it and campaigns; the other replicas wait to
//! follow it (or initialize it themselves after a grace period, when the
//! first replica is down). A shard some peer has established means this
//! node restarted and lost its in-memory log: its replica joins as
//! *recovering* (see `shard.rs`) and catches up from the leader by log
//! replay or snapshot.

use super::auth::{self, PeerSecrets};
use super::links::{LinkError, Links, PeerLink};
use super::placement::Placement;
use super::shard::{Recovery, ShardGroup, WorkItem};
use super::wire::{Hello, NodeReport, PeerRequest, PeerResponse, WireDecision, WireOp};
use super::{codec, ClusterError, ClusterFile, LeaderTable, NodeId};
use crate::store::MemoryStore;
use openraft::BasicNode;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Semaphore};

/// Forwarded batches to one peer awaiting answers at once, at most.
const FORWARDS_IN_FLIGHT_MAX: usize = 64;
/// Queued forward requests per peer, at most; more answer `unavailable`.
const FORWARD_QUEUE_ITEMS_MAX: usize = 65_536;
/// How long a status query to a peer may take.
pub const STATUS_TIMEOUT_MS: u64 = 500;
/// How often leaders of shards this node does not replicate are refreshed.
const LEADER_POLL_INTERVAL_MS: u64 = 250;

pub struct ClusterNode {
    pub id: NodeId,
    pub file: ClusterFile,
    pub placement: Placement,
    pub hello: Hello,
    pub groups: BTreeMap<u32, Arc<ShardGroup>>,
    pub links: Arc<Links>,
    forwarders: BTreeMap<NodeId, mpsc::Sender<WorkItem>>,
    pub leaders: Arc<LeaderTable>,
    pub store: Arc<MemoryStore>,
    pub forward_timeout_ms: u64,
}

impl ClusterNode {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: NodeId,
        file: ClusterFile,
        hello: Hello,
        groups: BTreeMap<u32, Arc<ShardGroup>>,
        links: Arc<Links>,
        leaders: Arc<LeaderTable>,
        store: Arc<MemoryStore>,
        forward_timeout_ms: u64,
        batch_ops_max: usize,
    ) -> ClusterNode {
        let placement = file.placement();
        let forwarders = links
            .iter()
            .map(|(&peer, link)| {
                let (sender, queue) = mpsc::channel(FORWARD_QUEUE_ITEMS_MAX);
                tokio::spawn(run_forwarder(
                    Arc::clone(link),
                    placement.clone(),
                    queue,
                    forward_timeout_ms,
                    batch_ops_max,
                ));
                (peer, sender)
            })
            .collect();
        ClusterNode {
            id,
            file,
            placement,
            hello,
            groups,
            links,
            forwarders,
            leaders,
            store,
            forward_timeout_ms,
        }
    }

    pub fn report(&self) -> NodeReport {
        NodeReport {
            node_id: self.id,
            live_keys: self.store.live_keys() as u64,
            shards: self.groups.values().map(|group| group.report()).collect(),
        }
    }

    /// Queues ops for a shard led here.
    pub fn submit_local(
        &self,
        shard: u32,
        ops: Vec<WireOp>,
    ) -> Result<oneshot::Receiver<Vec<WireDecision>>, WireDecision> {
        let Some(group) = self.groups.get(&shard) else {
            return Err(WireDecision::Unavailable(format!(
                "shard {shard} unavailable: node {} does not replicate it",
                self.id
            )));
        };
        let (reply, answer) = oneshot::channel();
        group.work.try_send(WorkItem { ops, reply }).map_err(|_| {
            WireDecision::Unavailable(format!("shard {shard} unavailable: its queue is full"))
        })?;
        Ok(answer)
    }

    /// Queues ops for a peer that leads their shards.
    pub fn submit_forward(
        &self,
        peer: NodeId,
        shard: u32,
        ops: Vec<WireOp>,
    ) -> Result<oneshot::Receiver<Vec<WireDecision>>, WireDecision> {
        let Some(forwarder) = self.forwarders.get(&peer) else {
            return Err(WireDecision::Unavailable(format!(
                "shard {shard} unavailable: its leader {peer} is not a known peer"
            )));
        };
        let (reply, answer) = oneshot::channel();
        forwarder.try_send(WorkItem { ops, reply }).map_err(|_| {
            WireDecision::Unavailable(format!(
                "shard {shard} unavailable: the queue to node {peer} is full"
            ))
        })?;
        Ok(answer)
    }

    /// Decides forwarded ops on the shards this node leads, in order. Ops
    /// are never forwarded again (no loops): a stale sender gets
    /// `unavailable` and its next hit follows the new leader.
    pub async fn decide_here(&self, ops: Vec<WireOp>) -> Vec<WireDecision> {
        let count = ops.len();
        let mut by_shard: BTreeMap<u32, (Vec<usize>, Vec<WireOp>)> = BTreeMap::new();
        for (position, op) in ops.into_iter().enumerate() {
            let entry = by_shard
                .entry(self.placement.shard_of(&op.key))
                .or_default();
            entry.0.push(position);
            entry.1.push(op);
        }
        let mut results: Vec<Option<WireDecision>> = vec![None; count];
        let mut waits = Vec::new();
        for (shard, (positions, ops)) in by_shard {
            match self.submit_local(shard, ops) {
                Ok(answer) => waits.push((shard, positions, answer)),
                Err(decision) => {
                    for position in positions {
                        results[position] = Some(decision.clone());
                    }
                }
            }
        }
        for (shard, positions, answer) in waits {
            let decisions = answer.await.unwrap_or_default();
            for (i, position) in positions.into_iter().enumerate() {
                results[position] = Some(decisions.get(i).cloned().unwrap_or_else(|| {
                    WireDecision::Unavailable(format!("shard {shard} unavailable: no answer"))
                }));
            }
        }
        results
            .into_iter()
            .map(|d| d.unwrap_or_else(|| WireDecision::Unavailable("no answer".into())))
            .collect()
    }

    /// Asks every peer for its report, in parallel (unreachable peers: `None`).
    pub async fn peer_reports(&self, timeout_ms: u64) -> BTreeMap<NodeId, Option<NodeReport>> {
        let calls = self.links.iter().map(|(&peer, link)| async move {
            match link.call(PeerRequest::Status, timeout_ms).await {
                Ok(PeerResponse::Status(report)) => (peer, Some(report)),
                _ => (peer, None),
            }
        });
        futures_util::future::join_all(calls)
            .await
            .into_iter()
            .collect()
    }

    /// Joins the cluster (see the module doc). Fails when a peer refuses us
    /// (different rules or cluster file).
    pub async fn join(
        &self,
        join_wait_ms: u64,
        election_timeout_ms: u64,
    ) -> Result<(), ClusterError> {
        let deadline = Instant::now() + Duration::from_millis(join_wait_ms);
        let mut reports: BTreeMap<NodeId, NodeReport> = BTreeMap::new();
        let mut unauthenticated: BTreeMap<NodeId, String> = BTreeMap::new();
        loop {
            for (&peer, link) in self.links.iter() {
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
            if reports.len() + unauthenticated.len() == self.links.len()
                || Instant::now() >= deadline
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        auth::check_join(reports.len(), &unauthenticated)?;
        let mut initialized = 0;
        let mut recovering = 0;
        for (&shard, group) in &self.groups {
            let seen: Vec<_> = reports
                .values()
                .flat_map(|report| report.shards.iter().filter(|s| s.shard == shard))
                .collect();
            if seen.iter().any(|s| s.established) {
                group.set_recovery(Some(Recovery {
                    applied_floor: seen.iter().filter_map(|s| s.applied).max(),
                    term_floor: seen.iter().map(|s| s.term).max().unwrap_or(0),
                }));
                group.check_caught_up_now();
                recovering += 1;
                continue;
            }
            let members: BTreeMap<NodeId, BasicNode> = self
                .placement
                .replicas_of(shard)
                .into_iter()
                .filter_map(|id| {
                    self.file
                        .nodes
                        .get(&id)
                        .map(|node| (id, BasicNode::new(node.peer.to_string())))
                })
                .collect();
            // Initializing a group makes the replica campaign at once, and
            // same-term races favour high node ids; so only the shard's
            // first replica initializes at once, which spreads leaders as
            // the placement spreads first replicas. The others wait until
            // they follow a leader (then their election timer only fires
            // when it goes silent) or, if none shows up within a grace
            // period (first replica down), initialize themselves.
            if self.placement.replicas_of(shard).first() == Some(&self.id) {
                group.raft.runtime_config().elect(true);
                if let Err(error) = group.raft.initialize(members).await {
                    tracing::debug!(shard, %error, "initialize");
                }
            } else {
                let group = Arc::clone(group);
                let grace = Duration::from_millis(election_timeout_ms.saturating_mul(4));
                tokio::spawn(async move {
                    let started = Instant::now();
                    let mut metrics = group.raft.metrics();
                    while metrics.borrow_and_update().current_leader.is_none() {
                        let left = (grace * 2).saturating_sub(started.elapsed());
                        if left.is_zero()
                            || tokio::time::timeout(left, metrics.changed()).await.is_err()
                        {
                            break;
                        }
                    }
                    if group.raft.metrics().borrow().current_leader.is_none() {
                        if let Err(error) = group.raft.initialize(members).await {
                            tracing::debug!(shard, %error, "initialize");
                        }
                    }
                    group.raft.runtime_config().elect(true);
                });
            }
            initialized += 1;
        }
        tracing::info!(
            node = self.id,
            peers_answered = reports.len(),
            peers = self.links.len(),
            initialized,
            recovering,
            "joined the cluster"
        );
        Ok(())
    }

    /// Keeps the leader table current for shards this node does not
    /// replicate (it learns them from the peers that lead them).
    pub async fn poll_remote_leaders(self: Arc<Self>) {
        let remote: Vec<u32> = (0..self.placement.shards())
            .filter(|shard| !self.groups.contains_key(shard))
            .collect();
        if remote.is_empty() {
            return;
        }
        let mut tick = tokio::time::interval(Duration::from_millis(LEADER_POLL_INTERVAL_MS));
        loop {
            tick.tick().await;
            for (peer, report) in self.peer_reports(STATUS_TIMEOUT_MS).await {
                let Some(report) = report else { continue };
                for shard in &report.shards {
                    if shard.leader == Some(peer) && !self.groups.contains_key(&shard.shard) {
                        self.leaders.observe(shard.shard, peer, shard.term);
                    }
                }
            }
        }
    }
}

/// Batches hits queued for one peer into `Hits` messages.
async fn run_forwarder(
    link: Arc<PeerLink>,
    placement: Placement,
    mut queue: mpsc::Receiver<WorkItem>,
    timeout_ms: u64,
    batch_ops_max: usize,
) {
    let in_flight = Arc::new(Semaphore::new(FORWARDS_IN_FLIGHT_MAX));
    while let Some(first) = queue.recv().await {
        let mut ops_count = first.ops.len();
        let mut items = vec![first];
        while ops_count < batch_ops_max {
            match queue.try_recv() {
                Ok(item) => {
                    ops_count += item.ops.len();
                    items.push(item);
                }
                Err(_) => break,
            }
        }
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            return;
        };
        let link = Arc::clone(&link);
        let placement = placement.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut ops = Vec::with_capacity(ops_count);
            let mut replies = Vec::with_capacity(items.len());
            for item in items {
                replies.push((item.reply, item.ops.len()));
                ops.extend(item.ops);
            }
            let failure = |ops: &[WireOp], why: &str| -> Vec<WireDecision> {
                ops.iter()
                    .map(|op| {
                        WireDecision::Unavailable(format!(
                            "shard {} unavailable: forwarding to node {}: {why}",
                            placement.shard_of(&op.key),
                            link.target
                        ))
                    })
                    .collect()
            };
            let decisions = match link.call(PeerRequest::Hits(ops.clone()), timeout_ms).await {
                Ok(PeerResponse::Hits(decisions)) if decisions.len() == ops.len() => decisions,
                Ok(other) => failure(&ops, &format!("unexpected answer {other:?}")),
                Err(error) => failure(&ops, &error.to_string()),
            };
            let mut decisions = decisions.into_iter();
            for (reply, count) in replies {
                let _ = reply.send(decisions.by_ref().take(count).collect());
            }
        });
    }
}

/// Serves the peer port until the process ends.
pub async fn serve_peers(listener: TcpListener, node: Arc<ClusterNode>, secrets: Arc<PeerSecrets>) {
    loop {
        match listener.accept().await {
            Ok((stream, remote)) => {
                let secrets = Arc::clone(&secrets);
                tokio::spawn(serve_peer(stream, remote, Arc::clone(&node), secrets));
            }
            Err(error) => {
                tracing::warn!(%error, "peer accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Checks a peer's hello against ours; `Err` says why it is refused.
fn check_hello(ours: &Hello, theirs: &Hello) -> Result<(), String> {
    if theirs.rules_fingerprint != ours.rules_fingerprint {
        return Err(format!(
            "rules differ: node {} has rules fingerprint {:016x}, node {} has {:016x}; the rule file must be identical on every node",
            theirs.node_id, theirs.rules_fingerprint, ours.node_id, ours.rules_fingerprint
        ));
    }
    if theirs.cluster_fingerprint != ours.cluster_fingerprint {
        return Err(format!(
            "cluster files differ between node {} and node {}; the cluster file must be identical on every node",
            theirs.node_id, ours.node_id
        ));
    }
    if theirs.consistency != ours.consistency {
        return Err(format!(
            "consistency differs: node {} runs {}, node {} runs {}",
            theirs.node_id, theirs.consistency, ours.node_id, ours.consistency
        ));
    }
    if theirs.node_id == ours.node_id {
        return Err(format!("two nodes claim id {}", ours.node_id));
    }
    Ok(())
}

async fn serve_peer(
    mut stream: TcpStream,
    remote: std::net::SocketAddr,
    node: Arc<ClusterNode>,
    secrets: Arc<PeerSecrets>,
) {
    let _ = stream.set_nodelay(true);
    if !auth::accept_peer(&mut stream, Some(remote), &secrets).await {
        return;
    }
    let (mut read_half, mut write_half) = stream.into_split();
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let Ok((id, first)) = codec::read_frame::<PeerRequest>(&mut read_half, &mut buf).await else {
        return;
    };
    let answer = match first {
        PeerRequest::Hello(hello) => match check_hello(&node.hello, &hello) {
            Ok(()) => Ok(PeerResponse::Hello(node.report())),
            Err(why) => {
                tracing::error!("refusing a peer connection: {why}");
                Err(PeerResponse::Refused(why))
            }
        },
        _ => Err(PeerResponse::Refused("expected a hello first".into())),
    };
    let (response, accepted) = match answer {
        Ok(response) => (response, true),
        Err(response) => (response, false),
    };
    if codec::encode_frame(&mut out, id, &response).is_err()
        || write_half.write_all(&out).await.is_err()
        || !accepted
    {
        return;
    }
    let (answers, mut to_write) = mpsc::unbounded_channel::<(u64, PeerResponse)>();
    let writer = tokio::spawn(async move {
        let mut out = Vec::new();
        while let Some((id, response)) = to_write.recv().await {
            out.clear();
            let mut next = Some((id, response));
            while let Some((id, response)) = next.take() {
                if let Err(error) = codec::encode_frame(&mut out, id, &response) {
                    tracing::warn!(%error, "cannot encode a peer answer");
                }
                if out.len() < 1024 * 1024 {
                    next = to_write.try_recv().ok();
                }
            }
            if write_half.write_all(&out).await.is_err() {
                return;
            }
        }
    });
    loop {
        let (id, request) = match codec::read_frame::<PeerRequest>(&mut read_half, &mut buf).await {
            Ok(frame) => frame,
            Err(error) => {
                tracing::debug!(%error, "peer connection ended");
                break;
            }
        };
        let node = Arc::clone(&node);
        let answers = answers.clone();
        tokio::spawn(async move {
            let response = handle(&node, request).await;
            let _ = answers.send((id, response));
        });
    }
    drop(answers);
    writer.abort();
}

async fn handle(node: &ClusterNode, request: PeerRequest) -> PeerResponse {
    let group = |shard: u32| {
        node.groups
            .get(&shard)
            .ok_or_else(|| format!("shard {shard} is not replicated on node {}", node.id))
    };
    match request {
        PeerRequest::Hello(_) => PeerResponse::Refused("hello sent twice".into()),
        PeerRequest::Vote { shard, rpc } => match group(shard) {
            Err(why) => PeerResponse::Refused(why),
            Ok(group) => match group.may_vote(&rpc) {
                Err(why) => PeerResponse::Refused(why),
                Ok(()) => PeerResponse::Vote(group.raft.vote(rpc).await),
            },
        },
        PeerRequest::Append { shard, rpc } => match group(shard) {
            Err(why) => PeerResponse::Refused(why),
            Ok(group) => PeerResponse::Append(group.raft.append_entries(rpc).await),
        },
        PeerRequest::Snapshot { shard, rpc } => match group(shard) {
            Err(why) => PeerResponse::Refused(why),
            Ok(group) => PeerResponse::Snapshot(group.raft.install_snapshot(rpc).await),
        },
        PeerRequest::Hits(ops) => PeerResponse::Hits(node.decide_here(ops).await),
        PeerRequest::Status => PeerResponse::Status(node.report()),
    }
}
