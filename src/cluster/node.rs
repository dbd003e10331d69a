//! This node as a cluster member: its shard groups, its links and forwarders
//! to peers, the peer-port server, joining at startup, and the background
//! work that keeps the node in step with the member list (polling peers,
//! moving shards, retiring replicas it no longer holds).
//!
//! Joining: the node asks every member what it knows (bounded by
//! `join_wait_ms`; with `--join`, until one answers). When some peer has
//! established shards, the node adopts the newest member list its peers
//! hold. A shard that no peer has established yet is new: its first replica
//! initializes it and campaigns; the other replicas wait to follow it (or
//! initialize it themselves after a grace period, when the first replica is
//! down). A shard some peer has established means this node restarted and
//! lost its in-memory log (or is new to the shard): its replica joins as
//! *recovering* (see `shard.rs`) and catches up from the leader by log
//! replay or snapshot.
//!
//! Moving shards (see docs/cluster.md, "Adding and removing nodes"): every
//! [`REBALANCE_INTERVAL_MS`], each shard this node leads whose voters differ
//! from the member list's placement is moved, at most `shard_moves_max` at a
//! time: the new replicas join as learners, catch up, then one joint-consensus
//! membership change makes the target the voters (the old replicas leave).
//! A leader that is itself leaving first hands leadership to a caught-up
//! replica that stays. A replica the shard's leader no longer lists is
//! retired: its group stops and its counters are dropped.

use super::auth::{self, PeerSecrets};
use super::config::NodeAddresses;
use super::links::{LinkError, Links, PeerLink};
use super::members::Members;
use super::placement::Placement;
use super::shard::{Recovery, ShardGroup, WorkItem, WorkerSettings};
use super::storage::ShardStateMachine;
use super::wire::{
    AdminRequest, Hello, NodeReport, PeerRequest, PeerResponse, ShardReport, WireDecision, WireOp,
};
use super::{codec, ClusterError, ClusterFile, LeaderTable, NodeId};
use crate::clock::Clock;
use crate::store::MemoryStore;
use openraft::{BasicNode, ChangeMembers, ServerState};
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
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
/// How often peers are polled (leaders, member lists, shard views).
const PEER_POLL_INTERVAL_MS: u64 = 250;
/// How often shard placement is compared with the member list.
pub const REBALANCE_INTERVAL_MS: u64 = 250;
/// How long a new replica may take to catch up before its move is retried.
const MOVE_CATCH_UP_TIMEOUT_MS: u64 = 60_000;
/// A learner this many entries or fewer behind the leader counts as caught up.
const MOVE_CATCH_UP_SLACK_ENTRIES: u64 = 64;
/// How long one membership change of a shard may take.
const MOVE_CHANGE_TIMEOUT_MS: u64 = 10_000;
/// How long a new leader may take to appear after a handover.
const HANDOVER_ELECTION_TIMEOUT_MS: u64 = 3_000;
/// How long an operator request may wait for each peer to take a member list.
const ADMIN_PUSH_TIMEOUT_MS: u64 = 2_000;
/// Least time between two leader-balancing handovers started by one node.
const BALANCE_COOLDOWN_MS: u64 = 1_000;
/// A peer that answered a poll this recently counts as up for balancing.
const PEER_LIVE_MS: u64 = 1_000;

/// What a node needs to start shard groups at any time.
pub struct GroupFactory {
    pub raft_config: Arc<openraft::Config>,
    pub store: Arc<MemoryStore>,
    pub clock: Arc<dyn Clock>,
    pub settings: WorkerSettings,
}

pub struct ClusterNode {
    pub id: NodeId,
    /// The cluster file this node started with: its own addresses and the
    /// layout; its node list was only the first member list.
    pub file: ClusterFile,
    /// Key → shard (fixed for the cluster's life; replicas come from
    /// [`ClusterNode::target_placement`]).
    pub placement: Placement,
    pub hello: Hello,
    groups: RwLock<BTreeMap<u32, Arc<ShardGroup>>>,
    pub links: Arc<Links>,
    forwarders: Mutex<BTreeMap<NodeId, mpsc::Sender<WorkItem>>>,
    members: RwLock<Arc<Members>>,
    pub leaders: Arc<LeaderTable>,
    pub store: Arc<MemoryStore>,
    pub forward_timeout_ms: u64,
    batch_ops_max: usize,
    factory: GroupFactory,
    election_timeout_ms: u64,
    /// Moves (and handovers) of shards led here, at most `shard_moves_max`.
    move_slots: Arc<Semaphore>,
    shard_moves_max: usize,
    moving: Mutex<BTreeSet<u32>>,
    /// Each shard's group as its leader last reported it (from polls).
    leader_views: Mutex<BTreeMap<u32, ShardReport>>,
    /// The peers' last reports, for the recovery floors of new replicas.
    last_reports: Mutex<BTreeMap<NodeId, NodeReport>>,
    joined: AtomicBool,
    /// When each peer last answered a poll (liveness for leader balancing).
    last_seen: Mutex<BTreeMap<NodeId, Instant>>,
    /// Whether leaders are spread by handovers (`--leader-balance`).
    leader_balance: bool,
    /// When this node last started a balancing handover.
    last_balance: Mutex<Option<Instant>>,
}

/// Background work on a shard led here, one move slot each.
enum ShardWork {
    /// Make `target` the voters (learners first).
    Move {
        voters: BTreeSet<NodeId>,
        learners: BTreeSet<NodeId>,
        target: BTreeSet<NodeId>,
    },
    /// Hand leadership to `successor` (leaving the shard, or balancing).
    HandOver { successor: NodeId, balancing: bool },
}

/// How a node joins: bootstrap with the cluster file, or join an existing
/// cluster (never initializing a shard itself).
#[derive(Debug, Clone, Copy)]
pub struct JoinSettings {
    pub join_wait_ms: u64,
    pub join_existing: bool,
}

impl ClusterNode {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: NodeId,
        file: ClusterFile,
        hello: Hello,
        links: Arc<Links>,
        leaders: Arc<LeaderTable>,
        factory: GroupFactory,
        forward_timeout_ms: u64,
        election_timeout_ms: u64,
        shard_moves_max: usize,
        leader_balance: bool,
    ) -> ClusterNode {
        let placement = file.placement();
        let members = Members::from_file(&file);
        let node = ClusterNode {
            id,
            placement,
            hello,
            groups: RwLock::default(),
            links,
            forwarders: Mutex::default(),
            members: RwLock::new(Arc::new(members)),
            leaders,
            store: Arc::clone(&factory.store),
            forward_timeout_ms,
            batch_ops_max: factory.settings.batch_ops_max,
            factory,
            election_timeout_ms,
            move_slots: Arc::new(Semaphore::new(shard_moves_max.max(1))),
            shard_moves_max: shard_moves_max.max(1),
            moving: Mutex::default(),
            leader_views: Mutex::default(),
            last_reports: Mutex::default(),
            joined: AtomicBool::new(false),
            last_seen: Mutex::default(),
            leader_balance,
            last_balance: Mutex::default(),
            file,
        };
        node.ensure_member_links();
        node
    }

    /// The newest member list this node knows.
    pub fn members(&self) -> Arc<Members> {
        Arc::clone(&self.members.read())
    }

    /// Where shards should live under the current member list.
    pub fn target_placement(&self) -> Placement {
        self.members()
            .placement(self.file.shards, self.file.replicas)
    }

    pub fn group(&self, shard: u32) -> Option<Arc<ShardGroup>> {
        self.groups.read().get(&shard).cloned()
    }

    pub fn groups(&self) -> Vec<Arc<ShardGroup>> {
        self.groups.read().values().cloned().collect()
    }

    pub fn group_count(&self) -> usize {
        self.groups.read().len()
    }

    /// Links to every other member (made if missing).
    fn ensure_member_links(&self) -> Vec<(NodeId, Arc<PeerLink>)> {
        self.members()
            .nodes
            .iter()
            .filter(|(&peer, _)| peer != self.id)
            .map(|(&peer, addresses)| (peer, self.links.ensure(peer, addresses.peer)))
            .collect()
    }

    /// Adopts `members` if it is newer than the list held; says whether it was.
    pub fn adopt(&self, members: &Members) -> bool {
        {
            let mut held = self.members.write();
            if !members.supersedes(&held) {
                return false;
            }
            *held = Arc::new(members.clone());
        }
        self.ensure_member_links();
        tracing::info!(
            node = self.id,
            epoch = members.epoch,
            origin = members.origin,
            members = %members.describe(),
            "adopted a new member list"
        );
        true
    }

    pub fn report(&self) -> NodeReport {
        let mut shards: Vec<ShardReport> = self.groups().iter().map(|g| g.report()).collect();
        shards.sort_by_key(|s| s.shard);
        NodeReport {
            node_id: self.id,
            live_keys: self.store.live_keys() as u64,
            shards,
            members: (*self.members()).clone(),
        }
    }

    /// Queues ops for a shard led here.
    pub fn submit_local(
        &self,
        shard: u32,
        ops: Vec<WireOp>,
    ) -> Result<oneshot::Receiver<Vec<WireDecision>>, WireDecision> {
        let Some(group) = self.group(shard) else {
            return Err(WireDecision::Retry(format!(
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

    /// The forwarder to `peer`, started on first use.
    fn forwarder(&self, peer: NodeId) -> Option<mpsc::Sender<WorkItem>> {
        let mut forwarders = self.forwarders.lock();
        if let Some(sender) = forwarders.get(&peer) {
            return Some(sender.clone());
        }
        let link = self.links.get(peer)?;
        let (sender, queue) = mpsc::channel(FORWARD_QUEUE_ITEMS_MAX);
        tokio::spawn(run_forwarder(
            link,
            self.placement.clone(),
            queue,
            self.forward_timeout_ms,
            self.batch_ops_max,
        ));
        forwarders.insert(peer, sender.clone());
        Some(sender)
    }

    /// Queues ops for a peer that leads their shards.
    pub fn submit_forward(
        &self,
        peer: NodeId,
        shard: u32,
        ops: Vec<WireOp>,
    ) -> Result<oneshot::Receiver<Vec<WireDecision>>, WireDecision> {
        let Some(forwarder) = self.forwarder(peer) else {
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

    /// Asks every other member for its report, in parallel (unreachable
    /// peers: `None`).
    pub async fn peer_reports(&self, timeout_ms: u64) -> BTreeMap<NodeId, Option<NodeReport>> {
        let calls = self
            .ensure_member_links()
            .into_iter()
            .map(|(peer, link)| async move {
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

    /// Starts a shard group here and registers it (unless one exists).
    async fn start_group(&self, shard: u32) -> Result<Arc<ShardGroup>, ClusterError> {
        if let Some(group) = self.group(shard) {
            return Ok(group);
        }
        let factory = &self.factory;
        let state_machine = ShardStateMachine::new(
            shard,
            self.placement.clone(),
            Arc::clone(&factory.store),
            Arc::clone(&factory.clock),
        );
        let network = super::links::ShardNetworkFactory {
            shard,
            links: Arc::clone(&self.links),
        };
        let group = ShardGroup::start(
            shard,
            Arc::clone(&factory.raft_config),
            network,
            state_machine,
            Arc::clone(&factory.store),
            Arc::clone(&factory.clock),
            factory.settings.clone(),
            Arc::clone(&self.leaders),
        )
        .await
        .map_err(|error| ClusterError::Shard {
            shard,
            why: error.to_string(),
        })?;
        let mut groups = self.groups.write();
        Ok(Arc::clone(groups.entry(shard).or_insert(group)))
    }

    /// Puts a new replica of a shard some peer has established into
    /// recovery (see `shard.rs`), with floors from the peers' last reports;
    /// says whether it did.
    fn enter_recovery(
        &self,
        group: &Arc<ShardGroup>,
        reports: &BTreeMap<NodeId, NodeReport>,
    ) -> bool {
        let seen: Vec<&ShardReport> = reports
            .values()
            .flat_map(|report| report.shards.iter().filter(|s| s.shard == group.shard))
            .collect();
        if !seen.iter().any(|s| s.established) {
            return false;
        }
        group.set_recovery(Some(Recovery {
            applied_floor: seen.iter().filter_map(|s| s.applied).max(),
            term_floor: seen.iter().map(|s| s.term).max().unwrap_or(0),
        }));
        group.check_caught_up_now();
        true
    }

    /// Joins the cluster (see the module doc). Fails when a peer refuses us
    /// (different rules or layout).
    pub async fn join(&self, settings: JoinSettings) -> Result<(), ClusterError> {
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
            if let Some(newest) = reports
                .values()
                .map(|report| &report.members)
                .max_by_key(|members| (members.epoch, members.origin))
            {
                *self.members.write() = Arc::new(newest.clone());
                self.ensure_member_links();
            }
        }
        *self.last_reports.lock() = reports.clone();
        let placement = self.target_placement();
        let mut initialized = 0;
        let mut recovering = 0;
        for shard in placement.shards_of_node(self.id) {
            let group = self.start_group(shard).await?;
            if self.enter_recovery(&group, &reports) {
                recovering += 1;
                continue;
            }
            if settings.join_existing {
                // Never initialize a shard of a running cluster: its leader
                // adds this replica when the member list places it here.
                group.raft.runtime_config().elect(true);
                continue;
            }
            self.bootstrap_group(&placement, shard, &group).await;
            initialized += 1;
        }
        self.joined.store(true, Ordering::Release);
        tracing::info!(
            node = self.id,
            peers_answered = reports.len(),
            members = %self.members().describe(),
            initialized,
            recovering,
            "joined the cluster"
        );
        Ok(())
    }

    /// Initializes a new shard's group with its placement's replicas.
    async fn bootstrap_group(&self, placement: &Placement, shard: u32, group: &Arc<ShardGroup>) {
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
        // Initializing a group makes the replica campaign at once, and
        // same-term races favour high node ids; so only the shard's
        // first replica initializes at once, which spreads leaders as
        // the placement spreads first replicas. The others wait until
        // they follow a leader (then their election timer only fires
        // when it goes silent) or, if none shows up within a grace
        // period (first replica down), initialize themselves.
        if placement.replicas_of(shard).first() == Some(&self.id) {
            group.raft.runtime_config().elect(true);
            if let Err(error) = group.raft.initialize(members).await {
                tracing::debug!(shard, %error, "initialize");
            }
        } else {
            let group = Arc::clone(group);
            let grace = Duration::from_millis(self.election_timeout_ms.saturating_mul(4));
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
    }

    /// Polls every other member: leaders of shards not replicated here,
    /// newer member lists, and each shard's group as its leader sees it.
    pub async fn poll_peers(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(PEER_POLL_INTERVAL_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let reports = self.peer_reports(STATUS_TIMEOUT_MS).await;
            let mut answered = BTreeMap::new();
            for (peer, report) in reports {
                let Some(report) = report else { continue };
                self.last_seen.lock().insert(peer, Instant::now());
                self.adopt(&report.members);
                let mut views = self.leader_views.lock();
                for shard in &report.shards {
                    if shard.leader != Some(peer) {
                        continue;
                    }
                    if self.group(shard.shard).is_none() {
                        self.leaders.observe(shard.shard, peer, shard.term);
                    }
                    let newer = views
                        .get(&shard.shard)
                        .is_none_or(|known| known.term <= shard.term);
                    if newer {
                        views.insert(shard.shard, shard.clone());
                    }
                }
                drop(views);
                answered.insert(peer, report);
            }
            self.last_reports.lock().extend(answered);
        }
    }

    /// Keeps this node's replicas in step with the member list (see the
    /// module doc), every [`REBALANCE_INTERVAL_MS`].
    pub async fn rebalance(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(REBALANCE_INTERVAL_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !self.joined.load(Ordering::Acquire) {
                continue;
            }
            let placement = self.target_placement();
            for shard in placement.shards_of_node(self.id) {
                if self.group(shard).is_some() {
                    continue;
                }
                match self.start_group(shard).await {
                    Ok(group) => {
                        let reports = self.last_reports.lock().clone();
                        if !self.enter_recovery(&group, &reports) {
                            group.raft.runtime_config().elect(true);
                        }
                        tracing::info!(
                            node = self.id,
                            shard,
                            "started a replica the member list places here"
                        );
                    }
                    Err(error) => tracing::warn!(shard, %error, "cannot start a replica"),
                }
            }
            for group in self.groups() {
                self.rebalance_group(&placement, group).await;
            }
            if self.leader_balance {
                self.balance_leaders(&placement);
            }
        }
    }

    /// Spreads leadership: when this node leads more than its fair share of
    /// the shards (shards ÷ nodes up, rounded up) and a caught-up replica of
    /// one of them on a node that is up leads at least two fewer, hands that
    /// shard over (one at a time, [`BALANCE_COOLDOWN_MS`] apart, only while
    /// every shard has a leader and no shard of this node is moving). A
    /// handover's hits wait for the successor rather than fail, so this
    /// costs clients a short latency on one shard, never an error.
    fn balance_leaders(self: &Arc<Self>, placement: &Placement) {
        if !self.moving.lock().is_empty() {
            return;
        }
        if self
            .last_balance
            .lock()
            .is_some_and(|at| at.elapsed() < Duration::from_millis(BALANCE_COOLDOWN_MS))
        {
            return;
        }
        let mut leads: BTreeMap<NodeId, usize> = BTreeMap::new();
        for shard in 0..self.placement.shards() {
            match self.leaders.leader(shard) {
                Some(leader) => *leads.entry(leader).or_default() += 1,
                None => return, // An election is under way: wait.
            }
        }
        let live: BTreeSet<NodeId> = {
            let seen = self.last_seen.lock();
            self.members()
                .nodes
                .keys()
                .copied()
                .filter(|&n| {
                    n == self.id
                        || seen
                            .get(&n)
                            .is_some_and(|at| at.elapsed() < Duration::from_millis(PEER_LIVE_MS))
                })
                .collect()
        };
        if live.len() < 2 || !live.contains(&self.id) {
            return;
        }
        let fair = (self.placement.shards() as usize).div_ceil(live.len());
        let mine = leads.get(&self.id).copied().unwrap_or(0);
        if mine <= fair {
            return;
        }
        let reports = self.last_reports.lock().clone();
        let recovering = |node: NodeId, shard: u32| {
            reports.get(&node).is_none_or(|report| {
                report
                    .shards
                    .iter()
                    .find(|s| s.shard == shard)
                    .is_none_or(|s| s.recovering)
            })
        };
        let mut best: Option<(usize, NodeId, Arc<ShardGroup>)> = None;
        for group in self.groups() {
            let metrics = group.raft.metrics().borrow().clone();
            if metrics.current_leader != Some(self.id) || metrics.state != ServerState::Leader {
                continue;
            }
            let membership = metrics.membership_config.membership();
            let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
            let target: BTreeSet<NodeId> = placement.replicas_of(group.shard).into_iter().collect();
            if voters != target || membership.learner_ids().next().is_some() {
                continue; // Moving: the move comes first.
            }
            for &voter in voters.iter().filter(|v| **v != self.id && live.contains(v)) {
                let theirs = leads.get(&voter).copied().unwrap_or(0);
                if theirs + 2 > mine || recovering(voter, group.shard) {
                    continue;
                }
                if best.as_ref().is_none_or(|(least, ..)| theirs < *least) {
                    best = Some((theirs, voter, Arc::clone(&group)));
                }
            }
        }
        let Some((_, successor, group)) = best else {
            return;
        };
        if self.start_shard_work(
            group,
            ShardWork::HandOver {
                successor,
                balancing: true,
            },
        ) {
            *self.last_balance.lock() = Some(Instant::now());
        }
    }

    /// Runs a move or a handover of `group`'s shard (led here) in the
    /// background, if a move slot is free; says whether it started.
    fn start_shard_work(self: &Arc<Self>, group: Arc<ShardGroup>, work: ShardWork) -> bool {
        let shard = group.shard;
        let Ok(permit) = Arc::clone(&self.move_slots).try_acquire_owned() else {
            return false; // As many moves as allowed are running.
        };
        self.moving.lock().insert(shard);
        let node = Arc::clone(self);
        tokio::spawn(async move {
            let started = Instant::now();
            let (outcome, what) = match work {
                ShardWork::HandOver {
                    successor,
                    balancing,
                } => (
                    node.hand_over(&group, successor).await,
                    if balancing {
                        "balancing leaders"
                    } else {
                        "leaving"
                    },
                ),
                ShardWork::Move {
                    voters,
                    learners,
                    target,
                } => (
                    node.move_shard(&group, &voters, &learners, &target).await,
                    "moving",
                ),
            };
            *group.moving.lock() = None;
            node.moving.lock().remove(&shard);
            drop(permit);
            match outcome {
                Ok(done) => tracing::info!(
                    node = node.id,
                    shard,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "{what}: {done}"
                ),
                Err(why) => tracing::warn!(
                    node = node.id,
                    shard,
                    "{what}: did not finish (retried): {why}"
                ),
            }
        });
        true
    }

    async fn rebalance_group(self: &Arc<Self>, placement: &Placement, group: Arc<ShardGroup>) {
        let shard = group.shard;
        let metrics = group.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let learners: BTreeSet<NodeId> = membership.learner_ids().collect();
        let target: BTreeSet<NodeId> = placement.replicas_of(shard).into_iter().collect();
        if voters.is_empty() {
            return; // Not initialized yet (a new replica waiting to be added).
        }
        let leading =
            metrics.state == ServerState::Leader && metrics.current_leader == Some(self.id);
        if leading {
            let settled = voters == target && learners.iter().all(|l| target.contains(l));
            if settled || self.moving.lock().contains(&shard) {
                return;
            }
            let successor = (!target.contains(&self.id))
                .then(|| {
                    voters
                        .iter()
                        .copied()
                        .filter(|v| *v != self.id && target.contains(v))
                        .min_by_key(|v| {
                            metrics
                                .replication
                                .as_ref()
                                .and_then(|r| r.get(v).copied().flatten())
                                .map_or(u64::MAX, |m| u64::MAX - m.index)
                        })
                })
                .flatten();
            let work = match successor {
                Some(successor) => ShardWork::HandOver {
                    successor,
                    balancing: false,
                },
                None => ShardWork::Move {
                    voters,
                    learners,
                    target,
                },
            };
            self.start_shard_work(group, work);
            return;
        }
        if target.contains(&self.id) {
            return;
        }
        // Not a target replica and not leading: retire once the shard's
        // leader no longer lists this node.
        let view = self.leader_views.lock().get(&shard).cloned();
        let Some(view) = view else { return };
        let listed = view.voters.contains(&self.id) || view.learners.contains(&self.id);
        if view.leader.is_some_and(|l| l != self.id) && !view.voters.is_empty() && !listed {
            self.retire(&group, &view).await;
        }
    }

    /// Moves `group` (led here) to the `target` replicas: learners first,
    /// then one membership change.
    async fn move_shard(
        &self,
        group: &ShardGroup,
        voters: &BTreeSet<NodeId>,
        learners: &BTreeSet<NodeId>,
        target: &BTreeSet<NodeId>,
    ) -> Result<String, String> {
        let list = |set: &BTreeSet<NodeId>| {
            set.iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let set_progress = |text: String| *group.moving.lock() = Some(text);
        let members = self.members();
        let mut joining = Vec::new();
        for &node in target.difference(voters) {
            let Some(addresses) = members.nodes.get(&node) else {
                return Err(format!("node {node} is not in the member list any more"));
            };
            joining.push(node);
            if learners.contains(&node) {
                continue;
            }
            set_progress(format!("adding node {node} as a learner"));
            let added = tokio::time::timeout(
                Duration::from_millis(MOVE_CHANGE_TIMEOUT_MS),
                group
                    .raft
                    .add_learner(node, BasicNode::new(addresses.peer.to_string()), false),
            )
            .await;
            match added {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => return Err(format!("adding learner {node}: {error}")),
                Err(_) => return Err(format!("adding learner {node} timed out")),
            }
        }
        let deadline = Instant::now() + Duration::from_millis(MOVE_CATCH_UP_TIMEOUT_MS);
        loop {
            let metrics = group.raft.metrics().borrow().clone();
            if metrics.current_leader != Some(self.id) {
                return Err("leadership moved during the move".into());
            }
            let last = metrics.last_log_index.unwrap_or(0);
            let behind: Vec<(NodeId, u64)> = joining
                .iter()
                .map(|node| {
                    let matched = metrics
                        .replication
                        .as_ref()
                        .and_then(|r| r.get(node).copied().flatten())
                        .map(|m| m.index);
                    (*node, matched.map_or(u64::MAX, |m| last.saturating_sub(m)))
                })
                .filter(|(_, behind)| *behind > MOVE_CATCH_UP_SLACK_ENTRIES)
                .collect();
            if behind.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!("new replicas did not catch up: {behind:?}"));
            }
            let text: Vec<String> = behind
                .iter()
                .map(|(node, n)| {
                    if *n == u64::MAX {
                        format!("node {node} catching up (snapshot)")
                    } else {
                        format!("node {node} catching up ({n} entries behind)")
                    }
                })
                .collect();
            set_progress(text.join(", "));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        set_progress(format!("replicas {} -> {}", list(voters), list(target)));
        let changed = tokio::time::timeout(
            Duration::from_millis(MOVE_CHANGE_TIMEOUT_MS),
            group.raft.change_membership(target.clone(), false),
        )
        .await;
        match changed {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => return Err(format!("membership change: {error}")),
            Err(_) => return Err("membership change timed out".into()),
        }
        let extra: BTreeSet<NodeId> = group
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .learner_ids()
            .filter(|l| !target.contains(l))
            .collect();
        if !extra.is_empty() {
            let _ = tokio::time::timeout(
                Duration::from_millis(MOVE_CHANGE_TIMEOUT_MS),
                group
                    .raft
                    .change_membership(ChangeMembers::RemoveNodes(extra), false),
            )
            .await;
        }
        Ok(format!(
            "shard {} moved: replicas {} -> {}",
            group.shard,
            list(voters),
            list(target)
        ))
    }

    /// Hands the leadership of `group` (led here, this node leaving it) to
    /// `successor`: stop deciding, let everything decided commit, let the
    /// successor catch up, stop heartbeats for the leader lease, then ask
    /// the successor to stand. The successor's leader then moves the shard.
    async fn hand_over(&self, group: &ShardGroup, successor: NodeId) -> Result<String, String> {
        let shard = group.shard;
        *group.moving.lock() = Some(format!("handing leadership to node {successor}"));
        group.handover.quiesced.store(false, Ordering::Release);
        group.handover.active.store(true, Ordering::Release);
        let outcome = self.hand_over_steps(group, successor).await;
        group.raft.runtime_config().heartbeat(true);
        group.handover.active.store(false, Ordering::Release);
        outcome.map(|()| format!("shard {shard}: leadership handed to node {successor}"))
    }

    async fn hand_over_steps(&self, group: &ShardGroup, successor: NodeId) -> Result<(), String> {
        let settle = Duration::from_millis(self.factory.settings.commit_timeout_ms * 2 + 500);
        let deadline = Instant::now() + settle;
        while !group.handover.quiesced.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return Err("decided hits did not commit in time".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        loop {
            let metrics = group.raft.metrics().borrow().clone();
            if metrics.current_leader != Some(self.id) {
                return Err("leadership was lost before the handover".into());
            }
            let matched = metrics
                .replication
                .as_ref()
                .and_then(|r| r.get(&successor).copied().flatten());
            if matched.map(|m| m.index) >= metrics.last_log_index {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!("node {successor} did not catch up in time"));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Followers refuse to vote while they hear a leader (the lease,
        // election_timeout_max); going quiet for it lets the successor win.
        group.raft.runtime_config().heartbeat(false);
        tokio::time::sleep(Duration::from_millis(
            self.factory.raft_config.election_timeout_max + 20,
        ))
        .await;
        let Some(link) = self.links.get(successor) else {
            return Err(format!("no link to node {successor}"));
        };
        match link
            .call(PeerRequest::Elect { shard: group.shard }, STATUS_TIMEOUT_MS)
            .await
        {
            Ok(PeerResponse::Electing) => {}
            Ok(other) => return Err(format!("node {successor} answered {other:?}")),
            Err(error) => return Err(error.to_string()),
        }
        let deadline = Instant::now() + Duration::from_millis(HANDOVER_ELECTION_TIMEOUT_MS);
        let mut metrics = group.raft.metrics();
        while metrics.borrow_and_update().current_leader == Some(self.id) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, metrics.changed()).await.is_err() {
                return Err(format!("node {successor} did not take over in time"));
            }
        }
        Ok(())
    }

    /// Stops a replica the shard's leader no longer lists and drops its
    /// counters (the shard lives on its new replicas).
    async fn retire(&self, group: &ShardGroup, view: &ShardReport) {
        let shard = group.shard;
        self.groups.write().remove(&shard);
        if let Err(error) = group.raft.shutdown().await {
            tracing::debug!(shard, %error, "shutdown");
        }
        let placement = &self.placement;
        let dropped = self
            .store
            .remove_where(|key| placement.shard_of(key) == shard);
        if let Some(leader) = view.leader {
            self.leaders.set(shard, Some(leader), view.term);
        }
        tracing::info!(
            node = self.id,
            shard,
            dropped,
            "retired this replica: the shard moved to other nodes"
        );
    }

    /// Serves `tollgate cluster add-node|remove-node`.
    pub async fn admin(&self, request: AdminRequest) -> Result<String, String> {
        let current = self.members();
        let (next, what) = match request {
            AdminRequest::AddNode { id, addresses } => {
                let next = current.with_node(id, addresses.clone(), self.id)?;
                self.check_newcomer(id, &addresses).await?;
                (next, format!("node {id} added"))
            }
            AdminRequest::RemoveNode { id } => {
                let next = current.without_node(id, self.id)?;
                (
                    next,
                    format!(
                        "node {id} removed; it keeps serving until its replicas have moved (stop it once `tollgate cluster status` shows it holds none)"
                    ),
                )
            }
        };
        let before = current.placement(self.file.shards, self.file.replicas);
        let after = next.placement(self.file.shards, self.file.replicas);
        let moves = (0..self.file.shards)
            .filter(|&s| before.replicas_of(s) != after.replicas_of(s))
            .count();
        self.adopt(&next);
        // Tell every node of the old and new lists (a removed node learns
        // it is leaving); nodes missed now learn it from their next poll.
        let mut told = 0;
        let mut targets: BTreeMap<NodeId, NodeAddresses> = current.nodes.clone();
        targets.extend(next.nodes.clone());
        targets.remove(&self.id);
        let pushes = targets.iter().map(|(&peer, addresses)| {
            let link = self.links.ensure(peer, addresses.peer);
            let next = next.clone();
            async move {
                link.call(PeerRequest::Members(next), ADMIN_PUSH_TIMEOUT_MS)
                    .await
                    .is_ok()
            }
        });
        for ok in futures_util::future::join_all(pushes).await {
            told += usize::from(ok);
        }
        Ok(format!(
            "{what}: members {} (epoch {}); {moves} of {} shards change replicas, at most {} at a time per leader; {} of {} other nodes have the new list (the rest learn it within {} ms of answering); follow the moves with `tollgate cluster status`",
            next.describe(),
            next.epoch,
            self.file.shards,
            self.move_slots_max(),
            told,
            targets.len(),
            PEER_POLL_INTERVAL_MS,
        ))
    }

    fn move_slots_max(&self) -> usize {
        self.shard_moves_max
    }

    /// A node being added must be running and accept us (same rules,
    /// layout and secret).
    async fn check_newcomer(&self, id: NodeId, addresses: &NodeAddresses) -> Result<(), String> {
        let link = self.links.ensure(id, addresses.peer);
        match link.call(PeerRequest::Status, ADMIN_PUSH_TIMEOUT_MS).await {
            Ok(PeerResponse::Status(report)) if report.node_id == id => Ok(()),
            Ok(PeerResponse::Status(report)) => Err(format!(
                "{} answers as node {}, not node {id}",
                addresses.peer, report.node_id
            )),
            Ok(other) => Err(format!("{} answered {other:?}", addresses.peer)),
            Err(LinkError::Refused(_, why)) => Err(format!(
                "node {id} at {} refused this cluster: {why}",
                addresses.peer
            )),
            Err(error) => Err(format!(
                "node {id} does not answer at {} ({error}); start it first with `tollgate serve --cluster FILE --node-id {id} --join …`",
                addresses.peer
            )),
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
            // `retry`: the request never reached the peer, so nothing was
            // counted and the sender may try the shard's leader again.
            let failure = |ops: &[WireOp], why: &str, retry: bool| -> Vec<WireDecision> {
                ops.iter()
                    .map(|op| {
                        let text = format!(
                            "shard {} unavailable: forwarding to node {}: {why}",
                            placement.shard_of(&op.key),
                            link.target
                        );
                        if retry {
                            WireDecision::Retry(text)
                        } else {
                            WireDecision::Unavailable(text)
                        }
                    })
                    .collect()
            };
            let decisions = match link.call(PeerRequest::Hits(ops.clone()), timeout_ms).await {
                Ok(PeerResponse::Hits(decisions)) if decisions.len() == ops.len() => decisions,
                Ok(other) => failure(&ops, &format!("unexpected answer {other:?}"), false),
                Err(error @ (LinkError::Unreachable(..) | LinkError::Unauthenticated(..))) => {
                    failure(&ops, &error.to_string(), true)
                }
                Err(error) => failure(&ops, &error.to_string(), false),
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
    if theirs.layout_fingerprint != ours.layout_fingerprint {
        return Err(format!(
            "cluster layouts differ between node {} and node {}; the [cluster] section (shards, replicas) must be identical on every node",
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
        PeerRequest::Admin(request) => {
            let outcome = node.admin(request).await;
            match &outcome {
                Ok(done) => tracing::info!(node = node.id, "{done}"),
                Err(why) => tracing::warn!(node = node.id, "refused an operator request: {why}"),
            }
            if codec::encode_frame(&mut out, id, &PeerResponse::Admin(outcome)).is_ok() {
                let _ = write_half.write_all(&out).await;
            }
            return;
        }
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
            // As on the dialling side: gather the answers finished meanwhile.
            tokio::task::yield_now().await;
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
        node.group(shard)
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
        PeerRequest::Members(members) => {
            node.adopt(&members);
            PeerResponse::Members((*node.members()).clone())
        }
        PeerRequest::Elect { shard } => match group(shard) {
            Err(why) => PeerResponse::Refused(why),
            Ok(group) if group.recovering() => {
                PeerResponse::Refused(format!("shard {shard}: this replica is recovering"))
            }
            Ok(group) => match group.raft.trigger().elect().await {
                Ok(()) => PeerResponse::Electing,
                Err(error) => PeerResponse::Refused(error.to_string()),
            },
        },
        PeerRequest::Admin(request) => PeerResponse::Admin(node.admin(request).await),
    }
}
