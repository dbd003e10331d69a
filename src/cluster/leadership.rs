//! Who leads each shard, and when a leader may decide.
//!
//! - **Following a group** ([`lead`], one task per replica): publishes the
//!   group's leader to the node's table, keeps the replica's commit rule in
//!   step with the group's membership, and when this node becomes the
//!   leader, *prepares* it: confirm the leadership with a majority
//!   (openraft's `ensure_linearizable`), promise the term locally, and
//!   collect the counters of a majority of the voters, each of which
//!   promises the term first (see `replica.rs` for why that is safe), and
//!   of every other voter not known to be down that answers within an
//!   election timeout (a voter that lost the end of its counter file may
//!   be in the first majority). Only then does the replica decide hits.
//!   After preparing, the leader syncs the shard to its other replicas in
//!   the background, so that every replica holds the collected counters
//!   again.
//! - **Elections** ([`watch_elections`]): Raft groups send no heartbeats and
//!   run no election timers (idle groups cost nothing); instead every node
//!   beats to its peers on the data stream, and a voter that has not heard
//!   a shard's leader node for the liveness timeout (or sees no leader)
//!   asks its group to stand, first the voter ranked first by the shard's
//!   placement, the others one election timeout later each.
//! - **Handovers** ([`hand_over`]): a leader that leaves a shard, or spreads
//!   leadership, stops deciding, lets what it decided commit, then asks the
//!   successor to stand; hits meanwhile wait and go to the successor.

use super::dataplane::replicas_held;
use super::node::ClusterNode;
use super::replica::{Replica, ShardConfig};
use super::wire::{ApplyRefusal, PeerRequest, PeerResponse};
use super::NodeId;
use futures_util::stream::{FuturesUnordered, StreamExt};
use openraft::BasicNode;
use openraft::{Membership, ServerState, StoredMembership};
use smallvec::SmallVec;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pause before a leader that failed to prepare tries again.
const PREPARE_RETRY_MS: u64 = 50;
/// How often voters look for shards whose leader is gone.
const ELECTION_CHECK_MS: u64 = 100;
/// How long a successor may take to lead after a handover request.
const HANDOVER_TAKEOVER_MS: u64 = 1_000;
/// Counters per message when syncing a replica.
pub const SYNC_CHUNK_COUNTERS: usize = 20_000;

/// A group's voters, as [`voters_of`] gives them.
pub type Voters = SmallVec<[NodeId; 8]>;

/// The voters of a group's membership (every configuration of a joint
/// one), in order and without repeats, read where the membership keeps
/// them. openraft's `Membership::voter_ids` clones each configuration's
/// set at every call, which the control plane's per-shard scans (the
/// election watch ten times a second, rebalancing, status reports) paid
/// for every shard: a fifth of an idle 1 024-shard node's CPU.
pub fn voters_of(membership: &Membership<NodeId, BasicNode>) -> Voters {
    let mut voters = Voters::new();
    match membership.get_joint_config().as_slice() {
        // One configuration (no change under way): a set, so in order.
        [config] => voters.extend(config.iter().copied()),
        configs => {
            for config in configs {
                voters.extend(config.iter().copied());
            }
            voters.sort_unstable();
            voters.dedup();
        }
    }
    voters
}

/// The commit rule of a shard led here, from its membership and the
/// replicas joining in a move.
pub fn shard_config(
    me: NodeId,
    membership: &Membership<NodeId, BasicNode>,
    joining: Option<&[NodeId]>,
) -> ShardConfig {
    let mut voter_sets: SmallVec<[Vec<NodeId>; 2]> = membership
        .get_joint_config()
        .iter()
        .map(|set| set.iter().copied().collect())
        .collect();
    if let Some(joining) = joining {
        let mut target = joining.to_vec();
        target.sort_unstable();
        if !voter_sets.contains(&target) {
            voter_sets.push(target);
        }
    }
    let mut targets: BTreeSet<NodeId> = voter_sets.iter().flatten().copied().collect();
    targets.extend(membership.learner_ids());
    targets.remove(&me);
    ShardConfig {
        voter_sets,
        targets: targets.into_iter().collect(),
    }
}

/// Recomputes a replica's commit rule from its group's current membership.
pub fn refresh_config(me: NodeId, replica: &Replica) {
    let membership = replica
        .raft
        .server_metrics()
        .borrow()
        .membership_config
        .clone();
    let joining = replica.joining();
    replica.set_config(shard_config(
        me,
        membership.membership(),
        joining.as_deref(),
    ));
}

/// Follows one replica's group for as long as it runs (see the module doc).
pub async fn lead(node: Arc<ClusterNode>, replica: Arc<Replica>) {
    let shard = replica.shard;
    let me = node.id;
    let mut server = replica.raft.server_metrics();
    loop {
        let (leading, term, leader, membership) = {
            let m = server.borrow_and_update();
            let term = m.vote.leader_id.term;
            let leading = m.state == ServerState::Leader
                && m.current_leader == Some(me)
                && m.vote.is_committed();
            (leading, term, m.current_leader, m.membership_config.clone())
        };
        node.leaders.set(shard, leader, term);
        let mut retry = false;
        if leading {
            let joining = replica.joining();
            replica.set_config(shard_config(
                me,
                membership.membership(),
                joining.as_deref(),
            ));
            let handing_over = replica.handing_over.load(Ordering::Acquire);
            if replica.ready_term() != Some(term) && !handing_over {
                match prepare(&node, &replica, term).await {
                    Ok(collected) => {
                        tracing::debug!(shard, term, collected, "leading: counters collected");
                        node.sync_replicas(Arc::clone(&replica), term);
                    }
                    Err(why) => {
                        tracing::debug!(shard, term, %why, "not ready to lead yet");
                        retry = true;
                    }
                }
            }
        } else {
            replica.unready();
        }
        let changed = if retry {
            tokio::select! {
                changed = server.changed() => changed.is_ok(),
                _ = tokio::time::sleep(Duration::from_millis(PREPARE_RETRY_MS)) => true,
            }
        } else {
            tokio::select! {
                changed = server.changed() => changed.is_ok(),
                _ = replica.kick.notified() => true,
            }
        };
        if !changed {
            // The group stopped (retired, or a fatal error).
            replica.unready();
            let m = replica.raft.metrics().borrow().clone();
            if let Err(fatal) = &m.running_state {
                if !matches!(fatal, openraft::error::Fatal::Stopped) {
                    tracing::error!(shard, %fatal, "shard group stopped");
                    node.leaders.set(shard, None, m.current_term + 1);
                }
            }
            return;
        }
    }
}

/// Makes this node, the group's leader in `term`, ready to decide: confirm,
/// promise, collect a majority's counters (and those of the voters that
/// answer within an election timeout after it). Returns how many were
/// collected.
async fn prepare(node: &ClusterNode, replica: &Replica, term: u64) -> Result<usize, String> {
    let shard = replica.shard;
    let timeout = Duration::from_millis(node.dp.settings.commit_timeout_ms.max(1));
    match tokio::time::timeout(timeout, replica.raft.ensure_linearizable()).await {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => return Err(format!("leadership not confirmed: {error}")),
        Err(_) => {
            return Err(format!(
                "leadership not confirmed within {} ms",
                timeout.as_millis()
            ))
        }
    }
    replica.note_confirmed();
    if replica.promise(term).is_err() {
        return Err(format!("a newer term than {term} was promised"));
    }
    let config = replica.config();
    let voters: BTreeSet<NodeId> = config.voter_sets.iter().flatten().copied().collect();
    let mut asks = FuturesUnordered::new();
    // The voters asked whose answers are still out.
    let mut outstanding: SmallVec<[NodeId; 4]> = SmallVec::new();
    for &voter in voters.iter().filter(|&&v| v != node.id) {
        let Some(link) = node.links.get(voter).or_else(|| node.link_to_member(voter)) else {
            continue;
        };
        outstanding.push(voter);
        asks.push(async move {
            let answer = link
                .call(
                    PeerRequest::Collect { shard, term },
                    timeout.as_millis() as u64,
                )
                .await;
            (voter, answer)
        });
    }
    let mut holders: SmallVec<[NodeId; 4]> = SmallVec::new();
    let mut collected = 0;
    while !config.committed(node.id, &holders) {
        let Some((voter, answer)) = asks.next().await else {
            return Err(format!(
                "counters collected from {holders:?} only, not a majority of {:?}",
                config.voter_sets
            ));
        };
        outstanding.retain(|v| *v != voter);
        if let Some(count) = take_collected(node, replica, voter, answer).await? {
            collected += count;
            holders.push(voter);
        }
    }
    // A majority holds every committed state, unless one of its members
    // lost the end of its counter file (damage, or a power cut under
    // `--fsync interval`) and came back: then the state may be only on a
    // voter that has not answered yet. So the voters still out are waited
    // for too, for up to an election timeout (one that is up answers within
    // a round trip), except those known to be down (the leader that died,
    // most often). Merging more is always safe: the merge is idempotent.
    let grace = Duration::from_millis(node.election_timeout_ms.max(1));
    let deadline = tokio::time::Instant::now() + grace;
    while outstanding.iter().any(|&v| !node.dp.known_down(v)) {
        let Ok(Some((voter, answer))) = tokio::time::timeout_at(deadline, asks.next()).await else {
            break;
        };
        outstanding.retain(|v| *v != voter);
        if let Some(count) = take_collected(node, replica, voter, answer).await? {
            collected += count;
        }
    }
    if !replica.set_ready(term) {
        return Err(format!("term {term} was superseded while collecting"));
    }
    Ok(collected)
}

/// One voter's answer to a leader's `Collect`: its counters merged into
/// this node's store (and data dir), `Some(how many)`; `None` when it
/// refused or could not be asked; an error when it promised a newer term.
async fn take_collected(
    node: &ClusterNode,
    replica: &Replica,
    voter: NodeId,
    answer: Result<PeerResponse, super::links::LinkError>,
) -> Result<Option<usize>, String> {
    match answer {
        Ok(PeerResponse::Collected(Ok(counters))) => {
            let now_ms = node.dp.clock.now_ms();
            for (key, state) in &counters {
                let _ = node.dp.store.merge(key, *state, now_ms);
            }
            if let Some(disk) = &node.dp.disk {
                disk.log_states(counters.iter().map(|(k, s)| (k.as_slice(), *s)));
                disk.write_pending();
            }
            Ok(Some(counters.len()))
        }
        Ok(PeerResponse::Collected(Err(ApplyRefusal::Fenced { term: newer }))) => {
            replica.raft.trigger().heartbeat().await.ok();
            Err(format!("node {voter} promised term {newer} already"))
        }
        Ok(other) => {
            tracing::debug!(shard = replica.shard, voter, ?other, "collect refused");
            Ok(None)
        }
        Err(error) => {
            tracing::debug!(shard = replica.shard, voter, %error, "collect failed");
            Ok(None)
        }
    }
}

/// Why a leader syncs a replica: it became ready to lead the shard, or the
/// replica's node connected again (it may have restarted empty).
#[derive(Clone, Copy)]
pub enum SyncCause {
    Leading,
    Reconnected,
}

/// Pause before a leader's sync of a replica that failed is tried again.
const SYNC_RETRY_PAUSE_MS: u64 = 100;
/// How long a leader keeps trying to sync a replica (see
/// [`spawn_sync`]).
const SYNC_RETRY_WINDOW_MS: u64 = 10_000;

/// Syncs `replica`'s shard, led here in `term`, to `peer` in the
/// background; again every [`SYNC_RETRY_PAUSE_MS`], for up to
/// [`SYNC_RETRY_WINDOW_MS`], while `peer` refuses it for holding no
/// replica of the shard and this node still leads the shard in `term`
/// with `peer` among its replicas: a peer that just restarted accepts
/// links before its replicas exist, and refused a sync that came first
/// (it then missed the shard's counters until its link broke again).
pub fn spawn_sync(
    node: &Arc<ClusterNode>,
    replica: Arc<Replica>,
    term: u64,
    peer: NodeId,
    cause: SyncCause,
) {
    let node = Arc::clone(node);
    tokio::spawn(async move {
        let shard = replica.shard;
        let deadline = Instant::now() + Duration::from_millis(SYNC_RETRY_WINDOW_MS);
        let mut synced = sync_to(&node, &replica, term, peer).await;
        loop {
            let why = match synced {
                Ok(counters) => {
                    match cause {
                        SyncCause::Reconnected => tracing::info!(
                            shard,
                            peer,
                            counters,
                            "caught a replica up with the leader's counters"
                        ),
                        SyncCause::Leading => {
                            tracing::debug!(shard, peer, counters, "synced a replica")
                        }
                    }
                    return;
                }
                Err(why) => why,
            };
            // Only a replica not made yet is waited for: a link that
            // fails syncs again when it connects, and a newer term's
            // fence stands.
            let still_due = matches!(why, SyncError::Refused(ApplyRefusal::NotReplica))
                && replica.ready_term() == Some(term)
                && replica.config().targets.contains(&peer)
                && Instant::now() < deadline;
            if !still_due {
                tracing::debug!(shard, peer, %why, "sync of a replica did not finish");
                return;
            }
            tracing::debug!(shard, peer, %why, "sync of a replica refused: trying again");
            tokio::time::sleep(Duration::from_millis(SYNC_RETRY_PAUSE_MS)).await;
            // An empty sync asks first whether the replica exists now; the
            // whole sync follows once it does.
            synced = match probe_sync(&node, &replica, term, peer).await {
                Ok(()) => sync_to(&node, &replica, term, peer).await,
                Err(why) => Err(why),
            };
        }
    });
}

/// Why a sync of a replica did not finish.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("no link to node {0}")]
    NoLink(NodeId),
    /// The replica answered, and refused the counters.
    #[error("refused: {0:?}")]
    Refused(ApplyRefusal),
    #[error("leadership moved during the sync")]
    LeadershipMoved,
    /// The call failed (link down, timeout) or was answered oddly.
    #[error("{0}")]
    Call(String),
}

/// Sends `replica`'s counters (led here in `term`) to `peer`, in chunks.
pub async fn sync_to(
    node: &ClusterNode,
    replica: &Replica,
    term: u64,
    peer: NodeId,
) -> Result<usize, SyncError> {
    let shard = replica.shard;
    let link = sync_link(node, peer)?;
    let counters = node.scans.counters_of(&node.dp, shard).await;
    let total = counters.len();
    let stamped_ms = node.dp.clock.now_ms();
    let timeout_ms = sync_timeout_ms(node);
    let mut chunks = counters.chunks(SYNC_CHUNK_COUNTERS).peekable();
    if chunks.peek().is_none() {
        // Nothing to send; still check the replica takes this term.
        return sync_chunk(&link, shard, term, stamped_ms, Vec::new(), timeout_ms)
            .await
            .map(|_| 0);
    }
    for chunk in chunks {
        if replica.ready_term() != Some(term) {
            return Err(SyncError::LeadershipMoved);
        }
        sync_chunk(&link, shard, term, stamped_ms, chunk.to_vec(), timeout_ms).await?;
    }
    Ok(total)
}

/// Asks `peer` whether its replica of `replica`'s shard takes this term's
/// syncs, sending no counters (before a whole sync is sent again to a
/// replica that did not exist yet: the scan and the counters are not
/// repeated for every try).
pub async fn probe_sync(
    node: &ClusterNode,
    replica: &Replica,
    term: u64,
    peer: NodeId,
) -> Result<(), SyncError> {
    let link = sync_link(node, peer)?;
    let stamped_ms = node.dp.clock.now_ms();
    sync_chunk(
        &link,
        replica.shard,
        term,
        stamped_ms,
        Vec::new(),
        sync_timeout_ms(node),
    )
    .await
}

/// The link a sync to `peer` goes over.
fn sync_link(node: &ClusterNode, peer: NodeId) -> Result<Arc<super::links::PeerLink>, SyncError> {
    node.links
        .get(peer)
        .or_else(|| node.link_to_member(peer))
        .ok_or(SyncError::NoLink(peer))
}

/// How long a sync's chunk may take to be answered.
fn sync_timeout_ms(node: &ClusterNode) -> u64 {
    node.dp.settings.commit_timeout_ms.max(1_000) * 5
}

async fn sync_chunk(
    link: &super::links::PeerLink,
    shard: u32,
    term: u64,
    stamped_ms: u64,
    counters: super::wire::CounterList,
    timeout_ms: u64,
) -> Result<(), SyncError> {
    let request = PeerRequest::Sync {
        shard,
        term,
        stamped_ms,
        counters,
    };
    match link.call(request, timeout_ms).await {
        Ok(PeerResponse::Synced(Ok(()))) => Ok(()),
        Ok(PeerResponse::Synced(Err(refusal))) => Err(SyncError::Refused(refusal)),
        Ok(other) => Err(SyncError::Call(format!("unexpected answer {other:?}"))),
        Err(error) => Err(SyncError::Call(error.to_string())),
    }
}

/// This node's rank among the live voters of a shard for standing: the
/// voter whose log looks freshest first (highest applied log id, then
/// longest log, from the peers' last reports), then the placement's leader
/// order. A voter with a stale log cannot win and must not keep standing in
/// the way of one that can (openraft refuses a candidate of a lower term
/// without raising its own, so two candidates could take turns forever).
fn standing_rank(
    node: &ClusterNode,
    replica: &Replica,
    voters: &[NodeId],
    exclude: Option<NodeId>,
) -> Option<usize> {
    let shard = replica.shard;
    let preferred = node.leader_order(shard);
    let own = {
        let m = replica.raft.metrics();
        let m = m.borrow();
        (m.last_applied, m.last_log_index)
    };
    let reports = node.last_reports.lock();
    let freshness = |voter: NodeId| {
        if voter == node.id {
            return own;
        }
        reports
            .get(&voter)
            .and_then(|r| r.shards.iter().find(|s| s.shard == shard))
            .map_or((None, None), |s| (s.applied, s.last_log_index))
    };
    let mut ranked: Vec<(NodeId, Freshness)> = voters
        .iter()
        .copied()
        .filter(|&v| Some(v) != exclude && node.dp.alive(v))
        .map(|v| (v, freshness(v)))
        .collect();
    drop(reports);
    ranked.sort_by(|(a, a_log), (b, b_log)| {
        let position = |v: &NodeId| preferred.iter().position(|p| p == v).unwrap_or(usize::MAX);
        b_log
            .cmp(a_log)
            .then(position(a).cmp(&position(b)))
            .then(a.cmp(b))
    });
    ranked.iter().position(|(v, _)| *v == node.id)
}

/// How fresh a replica's Raft log looks: its applied log id, its length.
type Freshness = (Option<openraft::LogId<NodeId>>, Option<u64>);

/// A pseudo-random number below `bound` (election jitter; not for secrets).
fn jitter(bound: u64) -> u64 {
    let mut bytes = [0u8; 8];
    if getrandom::fill(&mut bytes).is_err() {
        return bound / 2;
    }
    u64::from_le_bytes(bytes) % bound.max(1)
}

/// Does a group's membership name any voter (a group not initialized yet
/// names none)?
pub fn has_voters(membership: &Membership<NodeId, BasicNode>) -> bool {
    !membership.get_joint_config().iter().all(BTreeSet::is_empty)
}

/// What the election watcher keeps of one shard from look to look.
#[derive(Default)]
struct ShardWatch {
    /// Since when no live leader was seen (`None`: one was).
    suspected: Option<Instant>,
    /// When this node may stand again.
    last_try: Option<Instant>,
    /// The leader and term last seen, and since when.
    leader_since: Option<(NodeId, u64, Instant)>,
    /// The group's voters, with the membership they were read from: read
    /// again only when the membership changes (a pointer compare), not
    /// walked ten times a second for every shard.
    voters: Option<(Arc<StoredMembership<NodeId, BasicNode>>, Voters)>,
}

/// What one look of the election watcher learns about a leader node, once
/// per node rather than once per shard it leads: whether it is heard from,
/// and when its latest report arrived.
#[derive(Default)]
struct LeaderLooks {
    seen: SmallVec<[(NodeId, bool, Option<Instant>); 8]>,
}

impl LeaderLooks {
    fn look(&mut self, node: &ClusterNode, leader: NodeId) -> (bool, Option<Instant>) {
        if let Some(&(_, heard, report)) = self.seen.iter().find(|(id, ..)| *id == leader) {
            return (heard, report);
        }
        let heard = node.dp.alive(leader);
        let report = node.report_times.lock().get(&leader).copied();
        self.seen.push((leader, heard, report));
        (heard, report)
    }

    fn heard(&mut self, node: &ClusterNode, leader: NodeId) -> bool {
        self.look(node, leader).0
    }

    fn disowned(
        &mut self,
        node: &ClusterNode,
        claims: &BTreeMap<NodeId, Vec<bool>>,
        leader: NodeId,
        shard: u32,
        since: Instant,
    ) -> bool {
        let received = self.look(node, leader).1;
        super::node::disowned_by(received, claims, leader, shard, since)
    }
}

/// Stands for election in shards whose leader this node cannot hear (see
/// the module doc). Runs until the process ends.
pub async fn watch_elections(node: Arc<ClusterNode>) {
    let election_ms = node.election_timeout_ms.max(1);
    // What the watcher keeps of each shard from look to look, by shard.
    let mut watched: Vec<ShardWatch> = Vec::new();
    let mut tick = super::cadence::interval(Duration::from_millis(ELECTION_CHECK_MS));
    loop {
        tick.tick().await;
        if !node.joined() {
            continue;
        }
        let now = Instant::now();
        let claims = super::node::claimed_leads(&node.last_reports.lock());
        let mut leaders = LeaderLooks::default();
        // The table itself, not a list of its replicas: no reference count
        // taken and dropped per shard.
        let table = node.dp.replicas_full();
        watched.resize_with(node.placement.shards() as usize, ShardWatch::default);
        for replica in replicas_held(&table) {
            let shard = replica.shard;
            let Some(watch) = watched.get_mut(shard as usize) else {
                continue;
            };
            if replica.recovering() || replica.handing_over.load(Ordering::Acquire) {
                watch.suspected = None;
                continue;
            }
            let (state, leader, term, voters) = {
                let m = replica.raft.server_metrics();
                let m = m.borrow();
                if m.state == ServerState::Leader {
                    watch.suspected = None;
                    continue;
                }
                let voters = match &watch.voters {
                    Some((seen, voters)) if Arc::ptr_eq(seen, &m.membership_config) => {
                        voters.clone()
                    }
                    _ => {
                        let voters = voters_of(m.membership_config.membership());
                        let seen = Arc::clone(&m.membership_config);
                        watch.voters = Some((seen, voters.clone()));
                        voters
                    }
                };
                (m.state, m.current_leader, m.vote.leader_id.term, voters)
            };
            if state == ServerState::Leader || !voters.contains(&node.id) {
                watch.suspected = None;
                continue;
            }
            // A leader outside the voters (removed by a membership change)
            // leads no more.
            let leader = leader.filter(|&l| l != node.id && voters.contains(&l));
            let since = match (leader, watch.leader_since) {
                (Some(l), Some((known, known_term, at))) if known == l && known_term == term => at,
                (Some(l), _) => {
                    watch.leader_since = Some((l, term, now));
                    now
                }
                (None, _) => now,
            };
            let (dead, delay_rounds) = match leader {
                Some(l)
                    if leaders.heard(&node, l)
                        && !leaders.disowned(&node, &claims, l, shard, since) =>
                {
                    watch.suspected = None;
                    continue;
                }
                Some(l) => (Some(l), 0),
                None => (None, 1),
            };
            let since = *watch.suspected.get_or_insert(now);
            let Some(rank) = standing_rank(&node, replica, &voters, dead) else {
                continue;
            };
            // The first-ranked voter stands first and again every two to
            // three election timeouts (at random); the others leave it four
            // election timeouts per rank before standing themselves, so
            // that a voter with a stale log does not keep raising the term
            // over the one that can win.
            let rank = rank as u64;
            let delay = Duration::from_millis(election_ms * (rank * 4 + delay_rounds));
            let again = watch.last_try.is_none_or(|at| now >= at);
            if now.saturating_duration_since(since) >= delay && again {
                let pause = election_ms * (2 + rank * 4) + jitter(election_ms);
                watch.last_try = Some(now + Duration::from_millis(pause));
                let (applied, last_log) = {
                    let m = replica.raft.metrics();
                    let m = m.borrow();
                    (m.last_applied, m.last_log_index)
                };
                tracing::debug!(
                    shard,
                    ?dead,
                    rank,
                    term,
                    ?applied,
                    ?last_log,
                    "standing for election"
                );
                let raft = replica.raft.clone();
                tokio::spawn(async move {
                    let _ = raft.trigger().elect().await;
                });
            }
        }
    }
}

/// Hands the leadership of `replica` (led here) to `successor`: stop
/// deciding, let everything decided commit, wait out the followers' leader
/// lease, then ask the successor to stand. On failure this node leads on.
pub async fn hand_over(
    node: &ClusterNode,
    replica: &Replica,
    successor: NodeId,
) -> Result<String, String> {
    let shard = replica.shard;
    // Never stop deciding for a successor that cannot take over.
    if !node.dp.alive(successor) || !node.dp.out(successor).connected() {
        return Err(format!("node {successor} is not reachable"));
    }
    *replica.moving.lock() = Some(format!("handing leadership to node {successor}"));
    replica.handing_over.store(true, Ordering::Release);
    replica.unready();
    let outcome = hand_over_steps(node, replica, successor).await;
    replica.handing_over.store(false, Ordering::Release);
    replica.kick.notify_one();
    outcome.map(|()| format!("shard {shard}: leadership handed to node {successor}"))
}

async fn hand_over_steps(
    node: &ClusterNode,
    replica: &Replica,
    successor: NodeId,
) -> Result<(), String> {
    let shard = replica.shard;
    let settle = Duration::from_millis(node.dp.settings.commit_timeout_ms * 2 + 500);
    let deadline = Instant::now() + settle;
    // Followers may hold the acks of rounds this node did not wait on.
    node.dp.ask_acks(shard);
    while node.dp.replicating(shard) {
        if Instant::now() >= deadline {
            return Err("decided hits did not commit in time".into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Followers refuse to vote within the leader lease of the last Raft
    // message from this leader: wait it out.
    let lease = Duration::from_millis(node.raft_lease_ms() + 20);
    let quiet_until = replica.confirmed_at() + lease;
    while Instant::now() < quiet_until {
        if !node.dp.out(successor).connected() {
            return Err(format!("node {successor} became unreachable"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let Some(link) = node.links.get(successor) else {
        return Err(format!("no link to node {successor}"));
    };
    match link
        .call(PeerRequest::Elect { shard }, super::node::STATUS_TIMEOUT_MS)
        .await
    {
        Ok(PeerResponse::Electing) => {}
        Ok(other) => return Err(format!("node {successor} answered {other:?}")),
        Err(error) => return Err(error.to_string()),
    }
    let deadline = Instant::now() + Duration::from_millis(HANDOVER_TAKEOVER_MS);
    let mut metrics = replica.raft.server_metrics();
    while metrics.borrow_and_update().current_leader == Some(node.id) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || tokio::time::timeout(left, metrics.changed()).await.is_err() {
            return Err(format!("node {successor} did not take over in time"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn voters_are_read_in_order_without_repeats_as_openraft_lists_them() {
        use std::collections::BTreeSet;
        let sets = |configs: &[&[NodeId]]| -> Vec<BTreeSet<NodeId>> {
            configs
                .iter()
                .map(|c| c.iter().copied().collect())
                .collect()
        };
        for configs in [
            sets(&[&[3, 1, 2]]),
            sets(&[&[1, 2, 3], &[2, 3, 4]]),
            sets(&[&[5, 4], &[1], &[4, 1, 6]]),
            sets(&[&[]]),
        ] {
            let membership: Membership<NodeId, BasicNode> = Membership::new(configs, ());
            let expected: Vec<NodeId> = membership.voter_ids().collect();
            assert_eq!(voters_of(&membership).to_vec(), expected);
        }
    }
}
