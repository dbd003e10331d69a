//! This node as a cluster member: its replicas (one Raft group each), its
//! links to peers, the data plane, the member list, and what it tells peers
//! and operators about itself (reports, `cluster add-node|remove-node`).
//!
//! The work is split by job: joining at start-up (`join.rs`), leadership
//! and elections (`leadership.rs`), moving shards and spreading leaders
//! (`moves.rs`, planned by the pure `plan.rs`), the peer port
//! (`peer_server.rs`), the data path (`dataplane.rs`, `forward.rs`).

use super::committed_rules::ClusterRules;
use super::config::NodeAddresses;
use super::dataplane::{replicas_held, DataPlane};
use super::disk::meta::{MetaRecord, ShardMeta};
use super::disk::Startup;
use super::leadership::{self, SyncCause};
use super::links::{LinkError, Links, PeerLink};
use super::members::Members;
use super::placement::Placement;
use super::replica::{Recovery, Replica};
use super::scan::ShardScans;
use super::storage::{LogStore, ShardDisk, ShardStateMachine};
use super::wire::{
    AdminRequest, Hello, NodeReport, NodeStats, PeerRequest, PeerResponse, ShardReport,
};
use super::{ClusterError, ClusterFile, LeaderTable, NodeId};
use openraft::{Raft, ServerState};
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// How long a status query to a peer may take.
pub const STATUS_TIMEOUT_MS: u64 = 500;
/// How often peers are polled (leaders, member lists, shard views).
pub const PEER_POLL_INTERVAL_MS: u64 = 250;
/// How long an operator request may wait for each peer to take a member list.
const ADMIN_PUSH_TIMEOUT_MS: u64 = 2_000;

/// What a node needs to start shard groups at any time.
pub struct GroupFactory {
    pub raft_config: Arc<openraft::Config>,
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
    pub dp: Arc<DataPlane>,
    pub links: Arc<Links>,
    pub leaders: Arc<LeaderTable>,
    members: RwLock<Arc<Members>>,
    /// The member list's placement, and each shard's leader order under it
    /// (computed when the list changes).
    target: RwLock<Arc<(Placement, Vec<Vec<NodeId>>)>>,
    factory: GroupFactory,
    pub election_timeout_ms: u64,
    /// Shard moves (and handovers) of shards led here, at most this many.
    pub shard_moves_max: usize,
    pub(super) moving: Mutex<BTreeSet<u32>>,
    /// Each shard's group as its leader last reported it (from polls).
    pub(super) leader_views: Mutex<BTreeMap<u32, ShardReport>>,
    /// The peers' last reports, for the recovery floors of new replicas.
    pub(super) last_reports: Mutex<BTreeMap<NodeId, NodeReport>>,
    /// When each peer's last report arrived.
    pub(super) report_times: Mutex<BTreeMap<NodeId, Instant>>,
    joined: AtomicBool,
    /// Whether leaders are spread by handovers (`--leader-balance`).
    pub leader_balance: bool,
    /// When this node last started a balancing handover.
    pub(super) last_balance: Mutex<Option<Instant>>,
    /// When each shard led here last sent its lagging followers heartbeats.
    pub(super) nudged: Mutex<BTreeMap<u32, Instant>>,
    /// Each shard's Raft state and fence as the data dir held them at
    /// start-up, taken when its replica starts.
    persisted: Mutex<BTreeMap<u32, ShardMeta>>,
    /// Where the member list in force came from, for `cluster status`.
    members_source: Mutex<String>,
    /// Collections and syncs share scans of the store (see `scan.rs`).
    pub(super) scans: Arc<ShardScans>,
    /// The committed rule set this node serves (see `committed_rules.rs`).
    pub rules: Arc<ClusterRules>,
}

/// Settings of a node beyond its data plane.
pub struct NodeSettings {
    pub election_timeout_ms: u64,
    pub shard_moves_max: usize,
    pub leader_balance: bool,
    /// What the data dir held at start-up (`None`: no data dir).
    pub startup: Option<Startup>,
    /// The committed rule set, as the node starts with it.
    pub rules: Arc<ClusterRules>,
}

impl ClusterNode {
    pub fn new(
        id: NodeId,
        file: ClusterFile,
        hello: Hello,
        dp: Arc<DataPlane>,
        links: Arc<Links>,
        factory: GroupFactory,
        settings: NodeSettings,
    ) -> ClusterNode {
        let placement = file.placement();
        let (persisted_members, persisted) = match settings.startup {
            Some(startup) => (startup.meta.members, startup.meta.shards),
            None => (None, BTreeMap::new()),
        };
        let members_source = match (&persisted_members, &dp.disk) {
            (Some(members), Some(disk)) => format!(
                "the data dir ({}, epoch {}; the cluster file only seeded it)",
                disk.meta_path().display(),
                members.epoch
            ),
            (None, Some(_)) => "the cluster file (a new data dir)".to_string(),
            (_, None) => "the cluster file (no data dir: kept in memory)".to_string(),
        };
        let members = persisted_members.unwrap_or_else(|| Members::from_file(&file));
        let target = Self::targets_of(&file, &members);
        let node = ClusterNode {
            target: RwLock::new(target),
            id,
            placement,
            hello,
            leaders: Arc::clone(&dp.leaders),
            dp,
            links,
            members: RwLock::new(Arc::new(members)),
            factory,
            election_timeout_ms: settings.election_timeout_ms,
            shard_moves_max: settings.shard_moves_max.max(1),
            moving: Mutex::default(),
            leader_views: Mutex::default(),
            last_reports: Mutex::default(),
            report_times: Mutex::default(),
            joined: AtomicBool::new(false),
            leader_balance: settings.leader_balance,
            last_balance: Mutex::default(),
            nudged: Mutex::default(),
            persisted: Mutex::new(persisted),
            members_source: Mutex::new(members_source),
            scans: Arc::default(),
            rules: settings.rules,
            file,
        };
        node.ensure_member_links();
        node
    }

    /// The newest member list this node knows.
    pub fn members(&self) -> Arc<Members> {
        Arc::clone(&self.members.read())
    }

    fn targets_of(file: &ClusterFile, members: &Members) -> Arc<(Placement, Vec<Vec<NodeId>>)> {
        let placement = members.placement(file);
        let orders = placement.leader_orders();
        Arc::new((placement, orders))
    }

    pub(super) fn set_members(&self, members: Members) {
        self.persist_members(&members);
        *self.target.write() = Self::targets_of(&self.file, &members);
        *self.members.write() = Arc::new(members);
        self.ensure_member_links();
    }

    /// Writes the member list in force to the data dir, if there is one:
    /// restarts use it rather than the cluster file's.
    fn persist_members(&self, members: &Members) {
        let Some(disk) = &self.dp.disk else {
            *self.members_source.lock() = format!(
                "peers (epoch {}; no data dir: kept in memory)",
                members.epoch
            );
            return;
        };
        match disk.meta_append(MetaRecord::Members(members.clone())) {
            Ok(()) => {
                *self.members_source.lock() = format!(
                    "the data dir ({}, epoch {}; the cluster file only seeded it)",
                    disk.meta_path().display(),
                    members.epoch
                )
            }
            Err(error) => tracing::error!(
                file = %disk.meta_path().display(),
                %error,
                "cannot write the member list to the data dir"
            ),
        }
    }

    /// Where the member list in force came from.
    pub fn members_source(&self) -> String {
        self.members_source.lock().clone()
    }

    /// Does the data dir hold Raft state for `shard` (this node resumes its
    /// replica rather than recovering it from peers)?
    pub(super) fn persisted_shard(&self, shard: u32) -> bool {
        self.persisted
            .lock()
            .get(&shard)
            .is_some_and(ShardMeta::established)
    }

    /// Shards the data dir holds Raft state for.
    pub(super) fn persisted_shards(&self) -> Vec<u32> {
        self.persisted
            .lock()
            .iter()
            .filter(|(_, meta)| meta.established())
            .map(|(&shard, _)| shard)
            .collect()
    }

    /// Where shards should live under the current member list.
    pub fn target_placement(&self) -> Placement {
        self.target.read().0.clone()
    }

    /// The shards the member list places on `node`, read from the leader
    /// orders computed when the member list last changed (not from the
    /// placement's hashes, shard by shard, at every look).
    pub fn shards_placed_on(&self, node: NodeId) -> Vec<u32> {
        let target = self.target();
        (0..self.placement.shards())
            .filter(|&shard| {
                target
                    .1
                    .get(shard as usize)
                    .is_some_and(|o| o.contains(&node))
            })
            .collect()
    }

    /// The member list's target: its placement and each shard's replicas
    /// in the order they should lead it (see [`Placement::leader_orders`]).
    pub fn target(&self) -> Arc<(Placement, Vec<Vec<NodeId>>)> {
        Arc::clone(&self.target.read())
    }

    /// The replicas of `shard` in the order they should lead it (see
    /// [`Placement::leader_orders`]).
    pub fn leader_order(&self, shard: u32) -> Vec<NodeId> {
        self.target
            .read()
            .1
            .get(shard as usize)
            .cloned()
            .unwrap_or_default()
    }

    pub fn joined(&self) -> bool {
        self.joined.load(Ordering::Acquire)
    }

    pub(super) fn set_joined(&self) {
        self.joined.store(true, Ordering::Release);
    }

    pub fn replica(&self, shard: u32) -> Option<Arc<Replica>> {
        self.dp.replica(shard)
    }

    /// Every replica on this node, by shard.
    pub fn replicas(&self) -> Vec<Arc<Replica>> {
        // One load of the table, not one per shard: the control plane's
        // scans call this several times a second (docs/benchmarks.md,
        // "Fourteenth round": an idle cluster of 1 024 shards).
        replicas_held(&self.dp.replicas_full()).cloned().collect()
    }

    pub fn replica_count(&self) -> usize {
        self.replicas().len()
    }

    /// The followers' leader lease: how long they refuse other candidates
    /// after hearing from a leader.
    pub fn raft_lease_ms(&self) -> u64 {
        self.factory.raft_config.election_timeout_max
    }

    /// Links to every other member (made if missing).
    pub(super) fn ensure_member_links(&self) -> Vec<(NodeId, Arc<PeerLink>)> {
        self.members()
            .nodes
            .iter()
            .filter(|(&peer, _)| peer != self.id)
            .map(|(&peer, addresses)| (peer, self.links.ensure(peer, addresses.peer)))
            .collect()
    }

    /// The link to a member, made if missing.
    pub fn link_to_member(&self, peer: NodeId) -> Option<Arc<PeerLink>> {
        let members = self.members();
        let addresses = members.nodes.get(&peer)?;
        Some(self.links.ensure(peer, addresses.peer))
    }

    /// Adopts `members` if it is newer than the list held; says whether it was.
    pub fn adopt(&self, members: &Members) -> bool {
        {
            let mut held = self.members.write();
            if !members.supersedes(&held) {
                return false;
            }
            *held = Arc::new(members.clone());
            *self.target.write() = Self::targets_of(&self.file, members);
        }
        self.persist_members(members);
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
        let shards: Vec<ShardReport> = self.replicas().iter().map(|r| shard_report(r)).collect();
        NodeReport {
            node_id: self.id,
            live_keys: self.dp.store.live_keys() as u64,
            shards,
            members: (*self.members()).clone(),
            stats: NodeStats::read(&self.dp.stats),
            rules: self.rules.tag(),
        }
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

    /// Starts a shard's replica here (its group, elections off and ticks
    /// off: `leadership.rs` drives them) and follows it. Returns the
    /// existing one if there is one.
    pub(super) async fn start_replica(
        self: &Arc<Self>,
        shard: u32,
    ) -> Result<Arc<Replica>, ClusterError> {
        if let Some(replica) = self.replica(shard) {
            return Ok(replica);
        }
        let network = super::links::ShardNetworkFactory {
            shard,
            links: Arc::clone(&self.links),
        };
        let (log_store, state_machine, fence) = match &self.dp.disk {
            Some(disk) => {
                let meta = self
                    .persisted
                    .lock()
                    .get(&shard)
                    .cloned()
                    .unwrap_or_default();
                let disk = ShardDisk {
                    disk: Arc::clone(disk),
                    shard,
                };
                (
                    LogStore::persisted(disk.clone(), &meta),
                    ShardStateMachine::persisted(disk.clone(), &meta),
                    Some((meta.fence, disk)),
                )
            }
            None => (LogStore::default(), ShardStateMachine::default(), None),
        };
        let raft = Raft::new(
            self.id,
            Arc::clone(&self.factory.raft_config),
            network,
            log_store,
            state_machine,
        )
        .await
        .map_err(|error| ClusterError::Shard {
            shard,
            why: error.to_string(),
        })?;
        // No timers: no heartbeats, no election timeouts (see leadership.rs).
        raft.runtime_config().tick(false);
        raft.runtime_config().heartbeat(false);
        raft.runtime_config().elect(false);
        let replica = Replica::new(shard, raft);
        let replica = Arc::new(match fence {
            Some((fence, disk)) => replica.with_disk(fence, disk),
            None => replica,
        });
        if let Some(existing) = self.replica(shard) {
            let _ = replica.raft.shutdown().await;
            return Ok(existing);
        }
        self.dp.install_replica(Arc::clone(&replica));
        tokio::spawn(leadership::lead(Arc::clone(self), Arc::clone(&replica)));
        Ok(replica)
    }

    /// Puts a new replica of a shard some peer has established into
    /// recovery (see `replica.rs`), with floors from the peers' last
    /// reports; says whether it did.
    pub(super) fn enter_recovery(
        &self,
        replica: &Arc<Replica>,
        reports: &BTreeMap<NodeId, NodeReport>,
    ) -> bool {
        let seen: Vec<&ShardReport> = reports
            .values()
            .flat_map(|report| report.shards.iter().filter(|s| s.shard == replica.shard))
            .collect();
        if !seen.iter().any(|s| s.established) {
            return false;
        }
        replica.set_recovery(Some(Recovery {
            applied_floor: seen.iter().filter_map(|s| s.applied).max(),
            term_floor: seen.iter().map(|s| s.term).max().unwrap_or(0),
        }));
        tokio::spawn(watch_recovery(Arc::downgrade(replica)));
        true
    }

    /// After this node became ready to lead `replica`'s shard in `term`:
    /// syncs the shard's counters to its other replicas, in the background.
    pub(super) fn sync_replicas(self: &Arc<Self>, replica: Arc<Replica>, term: u64) {
        let targets = replica.config().targets.clone();
        for peer in targets {
            leadership::spawn_sync(self, Arc::clone(&replica), term, peer, SyncCause::Leading);
        }
    }

    /// Syncs every shard led here that `peer` replicates (the link to it
    /// was just made: it may have missed rounds, or restarted empty), and
    /// sends its Raft groups one heartbeat: groups send none on their own,
    /// and a follower that restarted empty learns its log only from one.
    pub(super) fn resync_peer(self: &Arc<Self>, peer: NodeId) {
        for replica in self.replicas() {
            let member = {
                let m = replica.raft.server_metrics();
                let m = m.borrow();
                m.state == ServerState::Leader
                    && m.membership_config.membership().get_node(&peer).is_some()
            };
            if member {
                replica.note_confirmed();
                let raft = replica.raft.clone();
                tokio::spawn(async move {
                    let _ = raft.trigger().heartbeat().await;
                });
            }
        }
        for replica in self.replicas() {
            let Some(term) = replica.ready_term() else {
                continue;
            };
            if !replica.config().targets.contains(&peer) {
                continue;
            }
            leadership::spawn_sync(self, replica, term, peer, SyncCause::Reconnected);
        }
    }

    /// Syncs the shards led here to every peer whose link (re)connects.
    pub(super) async fn resync_on_connect(self: Arc<Self>) {
        loop {
            self.dp.connect_events.notified().await;
            for peer in self.dp.take_connected_peers() {
                self.resync_peer(peer);
            }
        }
    }

    /// Stops a replica the shard's leader no longer lists and drops its
    /// counters (the shard lives on its new replicas).
    pub(super) async fn retire(&self, replica: &Replica, view: &ShardReport) {
        let shard = replica.shard;
        self.dp.remove_replica(shard);
        replica.unready();
        if let Err(error) = replica.raft.shutdown().await {
            tracing::debug!(shard, %error, "shutdown");
        }
        let placement = &self.placement;
        let dropped = self
            .dp
            .store
            .remove_where(|key| placement.shard_of(key) == shard);
        self.persisted.lock().remove(&shard);
        if let Some(disk) = &self.dp.disk {
            if let Err(error) = disk.meta_append(MetaRecord::Retire { shard }) {
                tracing::error!(shard, %error, "cannot record a retired replica in the data dir");
            }
        }
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

    /// This node's hello as it would say it now (the rule set in force
    /// changes on reloads).
    pub fn current_hello(&self) -> Hello {
        Hello {
            rules: self.rules.tag(),
            ..self.hello.clone()
        }
    }

    /// Serves `tollgate cluster add-node|remove-node|reload`.
    pub async fn admin(&self, request: AdminRequest) -> Result<String, String> {
        let current = self.members();
        let (next, what) = match request {
            AdminRequest::AddNode { id, addresses } => {
                let next = current.with_node(id, addresses.clone(), self.id)?;
                self.check_newcomer(id, &addresses).await?;
                (next, format!("node {id} added"))
            }
            AdminRequest::ReloadRules { name, text } => {
                return self.reload_rules(name, text).await;
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
        let before = current.placement(&self.file);
        let after = next.placement(&self.file);
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
            self.shard_moves_max,
            told,
            targets.len(),
            PEER_POLL_INTERVAL_MS,
        ))
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

/// A replica's view of its group.
fn shard_report(replica: &Replica) -> ShardReport {
    let watch = replica.raft.metrics();
    let metrics = watch.borrow();
    let lag = match (&metrics.replication, metrics.state) {
        (Some(replication), ServerState::Leader) => {
            let last = metrics.last_log_index.unwrap_or(0);
            replication
                .iter()
                .filter(|(&node, _)| node != metrics.id)
                .map(|(&node, matched)| (node, last.saturating_sub(matched.map_or(0, |m| m.index))))
                .collect()
        }
        _ => Vec::new(),
    };
    let membership = metrics.membership_config.membership();
    ShardReport {
        voters: super::leadership::voters_of(membership).into_vec(),
        learners: membership.learner_ids().collect(),
        moving: replica.moving.lock().clone(),
        shard: replica.shard,
        established: metrics.last_log_index.unwrap_or(0) >= 1 || metrics.snapshot.is_some(),
        term: metrics.current_term,
        last_log_index: metrics.last_log_index,
        applied: metrics.last_applied,
        leader: metrics.current_leader,
        recovering: replica.recovering(),
        ready: replica.ready_term().is_some(),
        lag,
    }
}

/// Does `leader`'s own latest report (received at `received`), taken after
/// `since`, say it does not lead `shard`? (It restarted, or stepped down,
/// without anyone electing a successor.)
pub(super) fn disowned_by(
    received: Option<Instant>,
    claims: &BTreeMap<NodeId, Vec<bool>>,
    leader: NodeId,
    shard: u32,
    since: Instant,
) -> bool {
    let Some(received) = received else {
        return false;
    };
    // The report was made at most a status timeout before it arrived.
    if received
        .checked_sub(std::time::Duration::from_millis(STATUS_TIMEOUT_MS))
        .is_none_or(|made| made <= since)
    {
        return false;
    }
    match claims.get(&leader) {
        Some(leads) => !leads.get(shard as usize).copied().unwrap_or(false),
        None => false,
    }
}

/// Which shards each peer said it leads in its last report, for the
/// election watcher (computed once per look, not per shard).
pub(super) fn claimed_leads(reports: &BTreeMap<NodeId, NodeReport>) -> BTreeMap<NodeId, Vec<bool>> {
    reports
        .iter()
        .map(|(&node, report)| {
            let mut leads = Vec::new();
            for shard in &report.shards {
                let at = shard.shard as usize;
                if leads.len() <= at {
                    leads.resize(at + 1, false);
                }
                leads[at] = shard.leader == Some(node);
            }
            (node, leads)
        })
        .collect()
}

/// Ends a replica's recovery once it has applied what its peers had:
/// watches what it applies until then (then stops, so it costs nothing).
async fn watch_recovery(replica: std::sync::Weak<Replica>) {
    let Some(mut data) = replica.upgrade().map(|r| r.raft.data_metrics()) else {
        return;
    };
    loop {
        {
            let Some(replica) = replica.upgrade() else {
                return;
            };
            let applied = data.borrow_and_update().last_applied;
            if replica.check_caught_up(applied) {
                tracing::info!(
                    shard = replica.shard,
                    "replica caught up; it votes and stands for election again"
                );
            }
            if !replica.recovering() {
                return;
            }
        }
        if data.changed().await.is_err() {
            return;
        }
    }
}
