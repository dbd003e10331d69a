//! The background work that keeps this node in step with the member list:
//! polling peers (member lists, leaders, each shard as its leader sees it),
//! starting replicas the placement puts here, and running what
//! [`plan`](super::plan) decides: moving shards led here (learners, a
//! counter sync, one joint membership change), handing leadership over,
//! retiring replicas that moved away.
//!
//! A move keeps every committed counter: the new replicas receive the
//! shard's rounds from the moment they are added and count in a second
//! majority (the target's) before the sync's snapshot is taken, so a state
//! committed under the old voters alone is in the sync, and one committed
//! later is on a majority of the target too (see docs/cluster.md).

use super::dataplane::replicas_held;
use super::leadership::{self, refresh_config};
use super::node::{ClusterNode, PEER_POLL_INTERVAL_MS, STATUS_TIMEOUT_MS};
use super::placement::PlacementKind;
use super::plan::{plan, ClusterView, FollowedShard, LedShard, ShardWork};
use super::replica::Replica;
use super::NodeId;
use openraft::{BasicNode, ChangeMembers, ServerState};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often shard placement is compared with the member list.
pub const REBALANCE_INTERVAL_MS: u64 = 250;
/// How long a new replica may take to catch up before its move is retried.
const MOVE_CATCH_UP_TIMEOUT_MS: u64 = 60_000;
/// How long one membership change of a shard may take.
const MOVE_CHANGE_TIMEOUT_MS: u64 = 10_000;
/// Least time between two leader-balancing handovers started by one node.
const BALANCE_COOLDOWN_MS: u64 = 1_000;
/// Least time between two catch-up heartbeats of one shard group.
const NUDGE_INTERVAL_MS: u64 = 500;

impl ClusterNode {
    /// Polls every other member: leaders of shards, newer member lists, and
    /// each shard's group as its leader sees it.
    pub async fn poll_peers(self: Arc<Self>) {
        let mut tick = super::cadence::interval(Duration::from_millis(PEER_POLL_INTERVAL_MS));
        loop {
            tick.tick().await;
            let reports = self.peer_reports(STATUS_TIMEOUT_MS).await;
            let mut answered = BTreeMap::new();
            for (peer, report) in reports {
                let Some(report) = report else { continue };
                self.adopt(&report.members);
                let mut views = self.leader_views.lock();
                for shard in &report.shards {
                    if shard.leader != Some(peer) {
                        continue;
                    }
                    self.leaders.observe(shard.shard, peer, shard.term);
                    // Replaced only when it changed: a settled shard's
                    // report is the same poll after poll.
                    let newer = views
                        .get(&shard.shard)
                        .is_none_or(|known| known.term <= shard.term && known != shard);
                    if newer {
                        views.insert(shard.shard, shard.clone());
                    }
                }
                drop(views);
                answered.insert(peer, report);
            }
            let now = Instant::now();
            self.report_times
                .lock()
                .extend(answered.keys().map(|&peer| (peer, now)));
            if let Err(why) = self.learn_rules(&answered).await {
                if self.rules.warn_now() {
                    tracing::warn!("cannot take the cluster's newer rules yet: {why}");
                }
            }
            self.last_reports.lock().extend(answered);
        }
    }

    /// Keeps this node's replicas in step with the member list, every
    /// [`REBALANCE_INTERVAL_MS`].
    pub async fn rebalance(self: Arc<Self>) {
        let mut tick = super::cadence::interval(Duration::from_millis(REBALANCE_INTERVAL_MS));
        loop {
            tick.tick().await;
            if !self.joined() {
                continue;
            }
            self.start_placed_replicas().await;
            self.nudge_lagging_followers();
            let view = self.view();
            for work in plan(&view) {
                self.start_work(work).await;
            }
        }
    }

    /// Groups send no heartbeats, so a follower that missed Raft entries
    /// (it restarted, or a link broke) would wait for the next entry: a
    /// leader whose followers lag sends them one round of heartbeats (which
    /// carries the missing entries), at most once per [`NUDGE_INTERVAL_MS`].
    fn nudge_lagging_followers(&self) {
        let now = Instant::now();
        // Replicas the peers say are recovering: the leader may believe they
        // hold its log (they did, before they restarted empty).
        let recovering = self.recovering_replicas();
        let mut nudged = self.nudged.lock();
        for replica in self.replicas() {
            let lagging = {
                let m = replica.raft.metrics();
                let m = m.borrow();
                m.state == ServerState::Leader
                    && m.replication.as_ref().is_some_and(|r| {
                        r.iter().any(|(&node, matched)| {
                            node != self.id
                                && (matched.map(|m| m.index) < m.last_log_index
                                    || recovering.contains(&(node, replica.shard)))
                        })
                    })
            };
            if !lagging {
                continue;
            }
            let due = nudged.get(&replica.shard).is_none_or(|at| {
                now.saturating_duration_since(*at) >= Duration::from_millis(NUDGE_INTERVAL_MS)
            });
            if due {
                nudged.insert(replica.shard, now);
                replica.note_confirmed();
                let raft = replica.raft.clone();
                tokio::spawn(async move {
                    let _ = raft.trigger().heartbeat().await;
                });
            }
        }
    }

    /// `(node, shard)` replicas the peers' last reports say are recovering.
    fn recovering_replicas(&self) -> BTreeSet<(NodeId, u32)> {
        self.last_reports
            .lock()
            .values()
            .flat_map(|r| {
                r.shards
                    .iter()
                    .filter(|s| s.recovering)
                    .map(move |s| (r.node_id, s.shard))
            })
            .collect()
    }

    /// Starts replicas the member list places here that do not run yet.
    async fn start_placed_replicas(self: &Arc<Self>) {
        for shard in self.shards_placed_on(self.id) {
            if self.replica(shard).is_some() {
                continue;
            }
            match self.start_replica(shard).await {
                Ok(replica) => {
                    let reports = self.last_reports.lock().clone();
                    self.enter_recovery(&replica, &reports);
                    tracing::info!(
                        node = self.id,
                        shard,
                        "started a replica the member list places here"
                    );
                }
                Err(error) => tracing::warn!(shard, %error, "cannot start a replica"),
            }
        }
    }

    /// What [`plan`] needs, as this node sees it now.
    fn view(&self) -> ClusterView {
        // Each shard's target replicas: the leader orders computed when the
        // member list changed hold them (a permutation of the placement's).
        let target_orders = self.target();
        let moving = self.moving.lock().clone();
        // Read in place (nothing below waits): a copy of every shard's
        // report, at every look, was most of an idle node's rebalancing.
        let views = self.leader_views.lock();
        let mut led = Vec::new();
        let mut followed = Vec::new();
        let table = self.dp.replicas_full();
        for replica in replicas_held(&table) {
            let shard = replica.shard;
            let target: BTreeSet<NodeId> = target_orders
                .1
                .get(shard as usize)
                .into_iter()
                .flatten()
                .copied()
                .collect();
            // Voters and learners as sets only for the shards led here (the
            // plan reads them for those alone).
            let led_sets = {
                let m = replica.raft.server_metrics();
                let m = m.borrow();
                let membership = m.membership_config.membership();
                if !leadership::has_voters(membership) {
                    continue; // Not initialized yet (a new replica waiting to be added).
                }
                (m.state == ServerState::Leader && m.current_leader == Some(self.id)).then(|| {
                    (
                        leadership::voters_of(membership)
                            .into_iter()
                            .collect::<BTreeSet<_>>(),
                        membership.learner_ids().collect::<BTreeSet<_>>(),
                    )
                })
            };
            if let Some((voters, learners)) = led_sets {
                let preferred = target_orders
                    .1
                    .get(shard as usize)
                    .and_then(|order| order.first())
                    .copied();
                led.push(LedShard {
                    shard,
                    voters,
                    learners,
                    target,
                    busy: moving.contains(&shard),
                    preferred,
                });
            } else {
                let listed_by_leader = views
                    .get(&shard)
                    .filter(|v| v.leader.is_some_and(|l| l != self.id) && !v.voters.is_empty())
                    .map(|v| v.voters.iter().chain(&v.learners).copied().collect());
                followed.push(FollowedShard {
                    shard,
                    target,
                    listed_by_leader,
                });
            }
        }
        drop(views);
        let leaders = (0..self.placement.shards())
            .filter_map(|shard| self.leaders.leader(shard).map(|l| (shard, l)))
            .collect();
        let live = self
            .members()
            .nodes
            .keys()
            .copied()
            .filter(|&n| self.dp.alive(n))
            .collect();
        let recovering = self.recovering_replicas();
        let cooled = self
            .last_balance
            .lock()
            .is_none_or(|at| at.elapsed() >= Duration::from_millis(BALANCE_COOLDOWN_MS));
        ClusterView {
            me: self.id,
            shards: self.placement.shards(),
            led,
            followed,
            leaders,
            live,
            recovering,
            free_slots: self.shard_moves_max.saturating_sub(moving.len()),
            may_balance: self.leader_balance && cooled && moving.is_empty(),
            restore_preferred: target_orders.0.kind() == PlacementKind::Ring,
        }
    }

    /// Runs one piece of planned work (moves and handovers in the
    /// background, holding a move slot).
    async fn start_work(self: &Arc<Self>, work: ShardWork) {
        let shard = match &work {
            ShardWork::Move { shard, .. } | ShardWork::HandOver { shard, .. } => *shard,
            ShardWork::Retire { shard } => {
                let view = self.leader_views.lock().get(shard).cloned();
                if let (Some(replica), Some(view)) = (self.replica(*shard), view) {
                    self.retire(&replica, &view).await;
                }
                return;
            }
        };
        let Some(replica) = self.replica(shard) else {
            return;
        };
        if !self.moving.lock().insert(shard) {
            return;
        }
        if matches!(
            work,
            ShardWork::HandOver {
                balancing: true,
                ..
            }
        ) {
            *self.last_balance.lock() = Some(Instant::now());
        }
        let node = Arc::clone(self);
        tokio::spawn(async move {
            let started = Instant::now();
            let (outcome, what) = match work {
                ShardWork::HandOver {
                    successor,
                    balancing,
                    ..
                } => (
                    leadership::hand_over(&node, &replica, successor).await,
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
                    ..
                } => (
                    node.move_shard(&replica, &voters, &learners, &target).await,
                    "moving",
                ),
                ShardWork::Retire { .. } => (Ok(String::new()), "retiring"),
            };
            *replica.moving.lock() = None;
            node.moving.lock().remove(&shard);
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
    }

    /// Moves `replica`'s shard (led here) to the `target` replicas.
    async fn move_shard(
        &self,
        replica: &Replica,
        voters: &BTreeSet<NodeId>,
        learners: &BTreeSet<NodeId>,
        target: &BTreeSet<NodeId>,
    ) -> Result<String, String> {
        let outcome = self.move_steps(replica, voters, learners, target).await;
        replica.set_joining(None);
        refresh_config(self.id, replica);
        outcome
    }

    async fn move_steps(
        &self,
        replica: &Replica,
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
        let set_progress = |text: String| *replica.moving.lock() = Some(text);
        let term = replica
            .ready_term()
            .ok_or_else(|| "this node is not ready to lead the shard".to_string())?;
        let members = self.members();
        let joining: Vec<NodeId> = target.difference(voters).copied().collect();
        for &node in &joining {
            let Some(addresses) = members.nodes.get(&node) else {
                return Err(format!("node {node} is not in the member list any more"));
            };
            if learners.contains(&node) {
                continue;
            }
            set_progress(format!("adding node {node} as a learner"));
            let added = tokio::time::timeout(
                Duration::from_millis(MOVE_CHANGE_TIMEOUT_MS),
                replica
                    .raft
                    .add_learner(node, BasicNode::new(addresses.peer.to_string()), false),
            )
            .await;
            match added {
                Ok(Ok(_)) => replica.note_confirmed(),
                Ok(Err(error)) => return Err(format!("adding learner {node}: {error}")),
                Err(_) => return Err(format!("adding learner {node} timed out")),
            }
        }
        // From here on the new replicas receive the shard's rounds and a
        // state commits only on a majority of the target as well; the sync
        // below then holds everything committed before.
        replica.set_joining(Some(target.iter().copied().collect()));
        refresh_config(self.id, replica);
        let deadline = Instant::now() + Duration::from_millis(MOVE_CATCH_UP_TIMEOUT_MS);
        for &node in &joining {
            loop {
                set_progress(format!("node {node} catching up (syncing counters)"));
                match leadership::sync_to(self, replica, term, node).await {
                    Ok(_) => break,
                    Err(why) if Instant::now() < deadline => {
                        tracing::debug!(shard = replica.shard, node, %why, "sync to a new replica");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(why) => return Err(format!("node {node} did not catch up: {why}")),
                }
                if replica.ready_term() != Some(term) {
                    return Err("leadership moved during the move".into());
                }
            }
        }
        set_progress(format!("replicas {} -> {}", list(voters), list(target)));
        let changed = tokio::time::timeout(
            Duration::from_millis(MOVE_CHANGE_TIMEOUT_MS),
            replica.raft.change_membership(target.clone(), false),
        )
        .await;
        replica.note_confirmed();
        match changed {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => return Err(format!("membership change: {error}")),
            Err(_) => return Err("membership change timed out".into()),
        }
        let extra: BTreeSet<NodeId> = replica
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
                replica
                    .raft
                    .change_membership(ChangeMembers::RemoveNodes(extra), false),
            )
            .await;
        }
        Ok(format!(
            "shard {} moved: replicas {} -> {}",
            replica.shard,
            list(voters),
            list(target)
        ))
    }
}
