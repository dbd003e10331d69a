//! The cluster's data path on one node: where every hit's counter state goes
//! after a decision, and where hits for shards led elsewhere go.
//!
//! - **Outboxes.** For each peer, one buffer of encoded data sections
//!   ([`PeerOut`]): forwarded hits, answers, replication rounds and the
//!   cumulative ack are appended by whoever produces them (serving threads,
//!   the replicator, frames being read) and written by the peer's link in
//!   one frame per wake-up, so a busy node writes one frame per peer however
//!   many hits it carries.
//! - **Rounds.** States decided by this node as a shard's leader collect in
//!   the open round; the replicator (one task) closes it whenever it runs,
//!   sends each shard's section to the shard's other replicas and tracks
//!   the acks ([`rounds`](super::rounds)); committed sections release their
//!   waiting answers (strict mode).
//! - **Inbound frames** (`dataplane/inbound.rs`) are handled inline, in
//!   the order they arrive: forwarded hits are decided on this node's store
//!   as their shard's leader, rounds are applied through the shard's fence,
//!   acks and answers release what waits for them.
//!
//! Everything here is synchronous and short; locks are held for a copy.

mod inbound;

use super::data_frames::{put_op, OpView};
use super::disk::NodeDisk;
use super::forward::{ForwardPart, ForwardWait, LeaseTable, SlotBoard};
pub use super::outbox::PeerOut;
use super::placement::Placement;
use super::replica::Replica;
use super::rounds::{InFlight, RoundBuilder, Waiter};
use super::wire::{ApplyRefusal, CounterList, ShardRefusal, WireDecision};
use super::{Consistency, LeaderTable, NodeId};
use crate::clock::Clock;
use crate::limiter::CounterState;
use crate::store::MemoryStore;
use arc_swap::{ArcSwap, Guard};
use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Settings of the data path.
#[derive(Debug, Clone)]
pub struct DataSettings {
    pub consistency: Consistency,
    pub commit_timeout_ms: u64,
    pub forward_timeout_ms: u64,
    /// Fast mode: how long a round stays open at most.
    pub replication_interval_ms: u64,
    /// A round is closed at once when it holds this many states.
    pub batch_ops_max: usize,
    /// A peer silent for this long counts as down.
    pub liveness_timeout_ms: u64,
    /// How often a link with nothing else to send beats
    /// (`--raft-heartbeat-ms`): the longest a follower holds an ack its
    /// leader did not ask for (`tag::ACK_NOW`).
    pub beat_ms: u64,
    /// Most credits of a quota lease this node grants, as a shard's
    /// leader, beside a forwarded hit (`forward/leases.rs`); 0: none, and
    /// this node asks for none.
    pub lease_credits_max: u32,
    /// Entries of this node's lease table, shared by its serving threads
    /// (a power of two, or 0: this node asks for no lease).
    pub lease_counters: usize,
}

/// Counters of the data path, for `/metrics` and `cluster status`.
#[derive(Default)]
pub struct DataStats {
    pub rounds: AtomicU64,
    pub round_sections: AtomicU64,
    pub states_replicated: AtomicU64,
    pub sections_committed: AtomicU64,
    pub sections_failed: AtomicU64,
    pub states_applied: AtomicU64,
    pub states_refused: AtomicU64,
    pub forward_batches: AtomicU64,
    pub forwarded_ops: AtomicU64,
    pub forwards_decided: AtomicU64,
    pub writes: AtomicU64,
    pub frames_written: AtomicU64,
    pub bytes_written: AtomicU64,
    pub dropped_at_cap: AtomicU64,
    /// Forwarded hits this node (as leader) answered in the frame carrying
    /// their round (`rounds.rs`, "Answers that ride with the round").
    pub round_answers: AtomicU64,
    /// Forwarded hits' answers this node (as a follower) sent on to the
    /// node that forwarded them, for their leader (`rounds.rs`, "Answers a
    /// follower relays").
    pub answers_relayed: AtomicU64,
    /// Forwarded hits this node (as leader) answered at once in a section
    /// of their batch's own (peer protocol 2.2, `tag::BATCH_ANSWERS`).
    pub batch_answers: AtomicU64,
    /// Hits this node answered `false` from a remembered denial instead of
    /// forwarding them (`forward/denials.rs`).
    pub denials_remembered: AtomicU64,
    /// Hits this node admitted from a quota lease instead of forwarding
    /// them (`forward/leases.rs`).
    pub lease_hits: AtomicU64,
    /// Quota leases this node granted as a shard's leader, and their
    /// credits.
    pub leases_granted: AtomicU64,
    pub lease_credits_granted: AtomicU64,
    /// Peer connections closed unanswered: too many handshakes in progress.
    pub handshakes_refused: AtomicU64,
}

impl DataStats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// A state decided by a leader, waiting to enter the open round.
pub struct DecidedState {
    pub shard: u32,
    pub term: u64,
    pub state: CounterState,
    pub waiter: Option<Waiter>,
}

/// Every shard's replica on this node, indexed by shard. Replaced whole when
/// a replica is installed or removed (a move, a join: rare), so that the hot
/// path reads it with one load per read batch or frame instead of one per hit
/// (an `ArcSwap` per shard cost two atomic read-modify-writes per hit).
pub type ReplicaTable = Vec<Option<Arc<Replica>>>;

/// The replica of `shard` in `table`, if this node has one.
pub fn replica_in(table: &ReplicaTable, shard: u32) -> Option<&Replica> {
    table.get(shard as usize)?.as_deref()
}

/// Every replica `table` holds, by shard (the table has one slot per
/// shard of the layout).
pub fn replicas_held(table: &ReplicaTable) -> impl Iterator<Item = &Arc<Replica>> {
    table.iter().flatten()
}

pub struct DataPlane {
    pub me: NodeId,
    /// This process's incarnation (see `Hello::boot_id`).
    pub boot: u64,
    pub placement: Placement,
    pub store: Arc<MemoryStore>,
    pub clock: Arc<dyn Clock>,
    pub leaders: Arc<LeaderTable>,
    pub settings: DataSettings,
    pub stats: DataStats,
    /// The data dir, when there is one: states are written there before
    /// they are acknowledged (see `disk/mod.rs`).
    pub disk: Option<Arc<NodeDisk>>,
    /// Every shard's replica on this node, by shard (see [`ReplicaTable`]).
    replicas: ArcSwap<ReplicaTable>,
    outs: RwLock<HashMap<NodeId, Arc<PeerOut>, ahash::RandomState>>,
    pub(super) round: Mutex<RoundBuilder>,
    pub(super) in_flight: Mutex<InFlight>,
    forwards: Mutex<HashMap<u64, ForwardWait, ahash::RandomState>>,
    next_batch: AtomicU64,
    /// Wakes the replicator.
    pub(super) replicate: Notify,
    /// Peers whose link (re)connected since the node last looked, and the
    /// signal that there are some (their shards are synced to them).
    connected_peers: Mutex<Vec<NodeId>>,
    pub connect_events: Notify,
    epoch: Instant,
    /// The quota leases this node holds (`forward/leases.rs`), made at its
    /// first forwarded hit that may ask for one.
    leases: OnceLock<LeaseTable>,
}

impl DataPlane {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        me: NodeId,
        boot: u64,
        placement: Placement,
        store: Arc<MemoryStore>,
        clock: Arc<dyn Clock>,
        leaders: Arc<LeaderTable>,
        disk: Option<Arc<NodeDisk>>,
        settings: DataSettings,
    ) -> DataPlane {
        DataPlane {
            me,
            boot,
            replicas: ArcSwap::from_pointee(vec![None; placement.shards() as usize]),
            placement,
            store,
            clock,
            leaders,
            settings,
            disk,
            stats: DataStats::default(),
            outs: RwLock::default(),
            round: Mutex::default(),
            in_flight: Mutex::new(InFlight::new(me)),
            forwards: Mutex::default(),
            next_batch: AtomicU64::new(1),
            replicate: Notify::new(),
            connected_peers: Mutex::default(),
            connect_events: Notify::new(),
            epoch: Instant::now(),
            leases: OnceLock::new(),
        }
    }

    pub fn strict(&self) -> bool {
        self.settings.consistency == Consistency::Strict
    }

    /// Whether quota leases are asked for and granted: with
    /// `--lease-credits-max` above 0.
    pub fn leasing(&self) -> bool {
        self.settings.lease_credits_max > 0
    }

    /// Whether this node asks for quota leases for the hits it forwards:
    /// [`DataPlane::leasing`], with room for them (`--lease-counters-max`).
    pub fn asks_leases(&self) -> bool {
        self.leasing() && self.settings.lease_counters > 0
    }

    /// This node's lease table, made now if it was not yet (see
    /// [`DataPlane::asks_leases`]).
    pub fn lease_table(&self) -> &LeaseTable {
        self.leases.get_or_init(|| {
            LeaseTable::new(
                self.clock.now_ms(),
                self.settings.forward_timeout_ms,
                self.settings.lease_counters,
            )
        })
    }

    /// This node's lease table if it was made (nothing is made).
    pub fn lease_table_made(&self) -> Option<&LeaseTable> {
        self.leases.get()
    }

    /// Whether the link to `peer` talks peer protocol minor `minor` or
    /// later (false for a peer without a link).
    pub fn peer_speaks(&self, peer: NodeId, minor: u8) -> bool {
        self.outs
            .read()
            .get(&peer)
            .is_some_and(|out| out.speaks_minor(minor))
    }

    pub fn replica(&self, shard: u32) -> Option<Arc<Replica>> {
        self.replicas.load().get(shard as usize)?.clone()
    }

    /// Every shard's replica, borrowed for a moment: the hot path loads the
    /// table once for a read batch or a peer's frame, then indexes it (no
    /// reference count touched per hit).
    pub fn replicas(&self) -> Guard<Arc<ReplicaTable>> {
        self.replicas.load()
    }

    /// The table, held for longer than a moment (a read batch while it is
    /// built).
    pub fn replicas_full(&self) -> Arc<ReplicaTable> {
        self.replicas.load_full()
    }

    pub fn install_replica(&self, replica: Arc<Replica>) {
        let shard = replica.shard as usize;
        self.replicas.rcu(|table| {
            let mut table = ReplicaTable::clone(table);
            if let Some(slot) = table.get_mut(shard) {
                *slot = Some(Arc::clone(&replica));
            }
            table
        });
    }

    pub fn remove_replica(&self, shard: u32) {
        self.replicas.rcu(|table| {
            let mut table = ReplicaTable::clone(table);
            if let Some(slot) = table.get_mut(shard as usize) {
                *slot = None;
            }
            table
        });
    }

    /// The outbox for `peer`, made on first use.
    pub fn out(&self, peer: NodeId) -> Arc<PeerOut> {
        if let Some(out) = self.outs.read().get(&peer) {
            return Arc::clone(out);
        }
        let mut outs = self.outs.write();
        Arc::clone(
            outs.entry(peer)
                .or_insert_with(|| Arc::new(PeerOut::new(peer, self.epoch))),
        )
    }

    pub(super) fn existing_out(&self, peer: NodeId) -> Option<Arc<PeerOut>> {
        self.outs.read().get(&peer).cloned()
    }

    /// Is `peer` known to be down: heard from since this process started,
    /// but not within the liveness timeout? (A peer not heard from yet, as
    /// after this node restarted, is not known either way.)
    pub fn known_down(&self, peer: NodeId) -> bool {
        peer != self.me
            && self.existing_out(peer).is_some_and(|out| {
                out.heard_ever() && !out.heard_within(self.settings.liveness_timeout_ms)
            })
    }

    /// Is `peer` up, as far as this node can tell (heard from recently)?
    pub fn alive(&self, peer: NodeId) -> bool {
        peer == self.me
            || self
                .existing_out(peer)
                .is_some_and(|out| out.heard_within(self.settings.liveness_timeout_ms))
    }

    /// The shards no hit sent to this node could be decided for now, with
    /// why: no leader known, this node leads but is not prepared, or the
    /// leader cannot be reached.
    pub fn unservable_shards(&self) -> Vec<(u32, ShardRefusal)> {
        (0..self.placement.shards())
            .filter_map(|shard| {
                let why = match self.leaders.leader(shard) {
                    None => ShardRefusal::NoLeader,
                    Some(leader) if leader == self.me => {
                        match self.replica(shard).and_then(|r| r.ready_term()) {
                            Some(_) => return None,
                            None => ShardRefusal::Preparing,
                        }
                    }
                    Some(leader) => {
                        if self.alive(leader) && self.out(leader).connected() {
                            return None;
                        }
                        ShardRefusal::Other(format!("its leader, node {leader}, is unreachable"))
                    }
                };
                Some((shard, why))
            })
            .collect()
    }

    /// The link to `peer` connected, talking peer protocol minor `minor`.
    pub fn peer_connected(&self, peer: NodeId, minor: u8) {
        let out = self.out(peer);
        out.minor.store(minor, Ordering::Release);
        out.connected.store(true, Ordering::Release);
        self.connected_peers.lock().push(peer);
        self.connect_events.notify_one();
    }

    /// Peers whose link connected since the last call.
    pub fn take_connected_peers(&self) -> Vec<NodeId> {
        std::mem::take(&mut *self.connected_peers.lock())
    }

    /// The link to `peer` broke: what was queued for it is dropped,
    /// forwarded hits waiting on it are answered (sent ones may have been
    /// counted: `unavailable`; unsent ones may go elsewhere: retried), and
    /// its later acks no longer count for rounds sent before.
    pub fn peer_disconnected(&self, peer: NodeId, why: &str) {
        let out = self.out(peer);
        out.connected.store(false, Ordering::Release);
        // Until the link connects again and negotiates, what is queued for
        // the peer is written in the oldest minor's form, which every minor
        // reads: the peer may come back as an older build.
        out.minor.store(0, Ordering::Release);
        let taken = out.reset();
        let waits: Vec<ForwardWait> = {
            let mut forwards = self.forwards.lock();
            let ids: Vec<u64> = forwards
                .iter()
                .filter(|(_, w)| w.peer == peer)
                .map(|(&id, _)| id)
                .collect();
            ids.into_iter()
                .filter_map(|id| forwards.remove(&id))
                .collect()
        };
        for wait in waits {
            let sent = wait.frame <= taken;
            let text = format!("forwarding to node {peer}: {why}");
            wait.fail(if sent {
                WireDecision::Unavailable {
                    shard: u32::MAX,
                    why: ShardRefusal::Other(text),
                }
            } else {
                WireDecision::Retry {
                    shard: u32::MAX,
                    why: ShardRefusal::Other(text),
                }
            });
        }
        let mut ended = Vec::new();
        self.in_flight.lock().disconnected(peer, &mut ended);
        self.release(&mut ended);
    }

    /// Queues decided states for the next round and wakes the replicator.
    /// The replicator is woken only by the first states of a round (it
    /// takes everything queued when it runs) or, in fast mode, by a round
    /// that is full: waking a parked thread costs a system call.
    pub fn push_states<'a>(
        &self,
        now: Instant,
        states: impl IntoIterator<Item = (&'a [u8], DecidedState)>,
    ) {
        let wake = {
            let mut round = self.round.lock();
            let was_empty = round.is_empty();
            for (key, s) in states {
                round.push(s.shard, s.term, key, &s.state, s.waiter, now);
            }
            !round.is_empty() && (was_empty || round.states() >= self.settings.batch_ops_max)
        };
        if wake {
            self.replicate.notify_one();
        }
    }

    /// Sends a read batch's ops to the leaders of their shards: for each
    /// `(peer, slots, ops)`, the ops whose answers fill `slots` of `board`,
    /// into the peer's open `FORWARD` section or a new one (see
    /// [`PeerOut::append_forward`]). The batch's peers share one look-up of
    /// the outboxes and one lock of the waits. Slots of a peer unreachable
    /// or whose outbox is full go to `unsent`, with why (nothing was sent
    /// for them).
    pub fn send_forwards<'a, Ops: Iterator<Item = &'a [u8]>>(
        &self,
        now: Instant,
        board: &Arc<SlotBoard>,
        forwards: impl IntoIterator<Item = (NodeId, SmallVec<[u32; 16]>, Ops)>,
        mut unsent: impl FnMut(NodeId, SmallVec<[u32; 16]>, &'static str),
    ) {
        let (mut batches, mut sent_ops) = (0u64, 0u64);
        let mut wake: SmallVec<[NodeId; 4]> = SmallVec::new();
        let mut unknown: SmallVec<[NodeId; 2]> = SmallVec::new();
        // Outboxes are borrowed from the table while the ops go in (a
        // peer's outbox is made once and kept: no count touched per send);
        // the waits are registered before a frame can leave, so that no
        // answer is missed.
        let outs = self.outs.read();
        {
            let mut waits = self.forwards.lock();
            for (peer, slots, ops) in forwards {
                let Some(out) = outs.get(&peer) else {
                    unknown.push(peer);
                    unsent(peer, slots, "not connected");
                    continue;
                };
                if !out.connected() {
                    wake.push(peer); // let the link try to connect
                    unsent(peer, slots, "not connected");
                    continue;
                }
                let count = slots.len() as u32;
                let placed = out.append_forward(
                    || self.next_batch.fetch_add(1, Ordering::Relaxed),
                    |batch| waits.contains_key(&batch),
                    count,
                    ops,
                );
                let Some(placed) = placed else {
                    unsent(
                        peer,
                        slots,
                        "its outbox is full (the peer is not keeping up)",
                    );
                    continue;
                };
                let part = ForwardPart {
                    board: Arc::clone(board),
                    first: placed.first,
                    slots,
                };
                match waits.get_mut(&placed.batch) {
                    Some(wait) if placed.joined => wait.join(part),
                    _ => {
                        waits.insert(
                            placed.batch,
                            ForwardWait::new(peer, part, placed.frame, now),
                        );
                    }
                }
                batches += 1;
                sent_ops += u64::from(count);
                // A forward that joined an open section was preceded by
                // one that opened it and wakes the link after it, and the
                // link has not taken the frame yet (taking it closes the
                // section).
                if !placed.joined {
                    wake.push(peer);
                }
            }
        }
        for peer in wake {
            if let Some(out) = outs.get(&peer) {
                out.wake.notify_one();
            }
        }
        drop(outs);
        for peer in unknown {
            self.out(peer).wake.notify_one(); // made now: let the link connect
        }
        if batches > 0 {
            DataStats::add(&self.stats.forward_batches, batches);
            DataStats::add(&self.stats.forwarded_ops, sent_ops);
        }
    }

    /// Answers forwarded waits older than the forward timeout (their
    /// boards gave up already); keeps the table bounded.
    pub fn expire_forwards(&self, now: Instant) {
        let timeout = Duration::from_millis(self.settings.forward_timeout_ms);
        let mut forwards = self.forwards.lock();
        forwards.retain(|_, wait| now.saturating_duration_since(wait.sent_at) < timeout * 2);
    }

    /// The live counters of `shard` held here.
    pub fn counters_of(&self, shard: u32) -> CounterList {
        let mut counters = Vec::new();
        let now_ms = self.clock.now_ms();
        self.store.for_each_live(now_ms, |key, state| {
            if self.placement.shard_of(key) == shard {
                counters.push((key.to_vec(), state));
            }
        });
        counters
    }

    /// Merges counters a leader of `term` sent to catch this replica up.
    pub fn apply_sync(
        &self,
        shard: u32,
        term: u64,
        stamped_ms: u64,
        counters: &CounterList,
    ) -> Result<(), ApplyRefusal> {
        let replica = self.replica(shard).ok_or(ApplyRefusal::NotReplica)?;
        let unseen = self
            .disk
            .as_ref()
            .map(|_| NodeDisk::unseen(&self.store, self.clock.now_ms(), counters));
        let dropped = replica.apply(
            &self.store,
            term,
            stamped_ms,
            counters.iter().map(|(key, state)| (key.as_slice(), *state)),
        )?;
        if dropped > 0 {
            self.note_dropped_at_cap(shard, dropped);
        }
        if let (Some(disk), Some(unseen)) = (&self.disk, unseen) {
            disk.log_states(unseen.into_iter());
            disk.write_pending();
        }
        DataStats::add(&self.stats.states_applied, counters.len() as u64);
        Ok(())
    }

    /// Appends a forwarded op's wire form (for batches being built).
    pub fn encode_op(out: &mut Vec<u8>, op: &OpView<'_>) {
        put_op(out, op);
    }

    /// Milliseconds since this data plane started (for liveness math).
    pub fn uptime_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}
