//! A connection's read batch in cluster mode ([`ClusterBatch`], the
//! [`OpBatch`] of the cluster backend): every op of the batch is routed by
//! its shard's leader as it is executed: decided inline on this node's
//! store when this node leads the shard, gathered into one message per
//! peer otherwise. One [`SlotBoard`] per batch collects the answers that
//! wait (forwarded hits, strict-mode commits) and wakes the connection once
//! when the last one is in: no task, channel or allocation per hit.
//!
//! Hits that were not decided (no leader known, the leader handing over,
//! a leader fenced by a newer one, a peer unreachable before sending) are
//! routed again every [`RETRY_PAUSE_MS`] until the forward timeout, so a
//! failover or a move shows as latency; hits that may have been counted are
//! never sent twice.
//!
//! A hit for a peer's shard may be answered here instead: `true` from a
//! quota lease the leader granted this node (`forward/leases.rs`), `false`
//! from a denial the thread remembers (`forward/denials.rs`); a read batch's later
//! hits of a counter whose lease it asked for wait for that answer.

use super::data_frames::{put_bytes, put_op, put_op_params, OpView, Reader};
use super::dataplane::{replica_in, DataPlane, DataStats, DecidedState, ReplicaTable};
use super::replica::LocalDecision;
use super::rounds::Waiter;
use super::wire::{Answer, ShardRefusal, WireDecision};
use super::NodeId;
use crate::limiter::{CounterState, Decision};
use crate::store::{BackendError, BatchDecided, CounterOp, Decisions, OpBatch, SlotAnswers};
use futures_util::future::BoxFuture;
use smallvec::SmallVec;
use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pause before a hit that was not decided is routed again.
pub const RETRY_PAUSE_MS: u64 = 25;

mod board;
mod denials;
mod leases;
#[cfg(test)]
mod tests;
use board::{result_of, Slot, SlotAnswer};
pub use board::{ForwardPart, ForwardWait, SlotBoard};
use denials::remembered_denial;
use leases::{lease_peek, lease_use, leases_with, LeaseUse};
pub use leases::{lease_size, lease_table_entries, prefetch_lease, LeaseTable};

/// How [`ClusterBatch::route`] left an op.
enum Routed {
    /// A rule's hit decided here, answered now (nothing waits for it).
    Now(Decision),
    /// Its slot's answer (decided, waiting or to be routed again).
    Slot(SlotAnswer),
}

/// A state decided here while building the batch.
struct LocalState {
    key_at: u32,
    key_len: u32,
    shard: u32,
    term: u64,
    state: CounterState,
    /// Strict mode: the slot that waits for the commit, and its answer.
    wait: Option<(u32, Answer)>,
}

/// The ops of a read batch for one peer: their board slots, and where each
/// is encoded in the batch's `ops` (every waiting op is encoded once there,
/// for the frame and for a retry).
struct PeerForward {
    peer: NodeId,
    slots: SmallVec<[u32; 16]>,
    ops_at: SmallVec<[(u32, u32); 16]>,
}

/// The buffers a batch uses only while it is built, handed to the thread's
/// next batch (a connection reads and submits one batch at a time), so that
/// a read batch does not allocate and grow them again.
#[derive(Default)]
struct BatchBuffers {
    keys: Vec<u8>,
    states: Vec<LocalState>,
    key_buf: Vec<u8>,
}

/// Largest buffers kept for the next batch, in bytes each: a batch of a
/// huge read gives its buffers back to the allocator.
const SPARE_BUFFER_BYTES_MAX: usize = 64 * 1024;

thread_local! {
    static SPARE_BUFFERS: Cell<Option<BatchBuffers>> = const { Cell::new(None) };
}

impl BatchBuffers {
    /// Keeps the buffers for the thread's next batch, emptied, unless one
    /// of them grew past [`SPARE_BUFFER_BYTES_MAX`].
    fn keep(mut self) {
        let bytes = |capacity: usize, size: usize| capacity.saturating_mul(size);
        if bytes(self.keys.capacity(), 1) > SPARE_BUFFER_BYTES_MAX
            || bytes(self.states.capacity(), std::mem::size_of::<LocalState>())
                > SPARE_BUFFER_BYTES_MAX
            || bytes(self.key_buf.capacity(), 1) > SPARE_BUFFER_BYTES_MAX
        {
            return;
        }
        self.keys.clear();
        self.states.clear();
        self.key_buf.clear();
        SPARE_BUFFERS.set(Some(self));
    }
}

thread_local! {
    /// Encoded-ops buffers given back by finished boards, for the thread's
    /// next batches: a buffer recently written is still cached, where a
    /// fresh 2 KiB one from the allocator was written for the first time by
    /// each forwarding batch (about 5 ns per hit of fast mode's time;
    /// docs/benchmarks.md, "Twenty-first round").
    static SPARE_OPS: std::cell::RefCell<Vec<Vec<u8>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Most buffers a thread keeps in `SPARE_OPS` (about one per connection
/// it serves with a batch in flight), and the largest it keeps.
const SPARE_OPS_BUFFERS_MAX: usize = 64;
const SPARE_OPS_BYTES_MAX: usize = 16 * 1024;

/// An empty encoded-ops buffer: a spare one when the thread has one.
fn spare_ops() -> Vec<u8> {
    SPARE_OPS
        .try_with(|spare| spare.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Keeps a finished board's encoded ops for the thread's next batches,
/// emptied, within [`SPARE_OPS_BUFFERS_MAX`] and [`SPARE_OPS_BYTES_MAX`].
fn keep_spare_ops(mut ops: Vec<u8>) {
    if ops.capacity() == 0 || ops.capacity() > SPARE_OPS_BYTES_MAX {
        return;
    }
    ops.clear();
    // A thread being torn down has no spares to keep.
    let _ = SPARE_OPS.try_with(|spare| {
        let mut spare = spare.borrow_mut();
        if spare.len() < SPARE_OPS_BUFFERS_MAX {
            spare.push(ops);
        }
    });
}

/// Capacity of a batch's slot list when its first slot is added (a typical
/// pipelined read), so that it does not grow one reallocation at a time.
const BATCH_SLOTS_INITIAL: usize = 32;
/// Capacity of a batch's encoded ops when its first op waits.
const BATCH_OPS_BYTES_INITIAL: usize = 2048;

/// The cluster backend's batch for one read (see the module doc).
pub struct ClusterBatch {
    dp: Arc<DataPlane>,
    /// The replica table, loaded at the batch's first hit decided here and
    /// kept while the batch is built: one load per read batch.
    replicas: Option<Arc<ReplicaTable>>,
    slots: Vec<Slot>,
    ops: Vec<u8>,
    /// The parameters of the last rule op encoded in `ops`.
    last_params: Option<EncodedParams>,
    keys: Vec<u8>,
    states: Vec<LocalState>,
    forwards: SmallVec<[PeerForward; 2]>,
    key_buf: Vec<u8>,
    /// Whether each peer forwarded to talks the peer protocol of leases,
    /// looked up once per batch.
    lease_peers: SmallVec<[(NodeId, bool); 4]>,
    /// Hits this batch admitted from its node's leases.
    lease_hits: u64,
    /// Store hashes of the counters whose leases this batch asked for:
    /// their next hits wait for the answer ([`SlotAnswer::AfterLease`]).
    asked: SmallVec<[u64; 4]>,
}

impl ClusterBatch {
    pub fn new(dp: Arc<DataPlane>) -> ClusterBatch {
        let BatchBuffers {
            keys,
            states,
            key_buf,
        } = SPARE_BUFFERS.take().unwrap_or_default();
        ClusterBatch {
            dp,
            replicas: None,
            slots: Vec::new(),
            ops: spare_ops(),
            last_params: None,
            keys,
            states,
            forwards: SmallVec::new(),
            key_buf,
            lease_peers: SmallVec::new(),
            lease_hits: 0,
            asked: SmallVec::new(),
        }
    }

    /// Routes one op (see the module doc): a rule's hit decided here and
    /// answered at once, or its slot's answer. A forwarded op is encoded at
    /// the end of the batch's `ops` here.
    fn route(&mut self, slot: u32, shard: u32, op: &OpView<'_>, now_ms: u64) -> Routed {
        if let Some(bucket) = &op.bucket {
            if self.dp.leaders.leader(shard) == Some(self.dp.me) {
                let answer = self.decide_bucket_here(slot, shard, op.key, bucket, op.peek, now_ms);
                return Routed::Slot(answer);
            }
        }
        let dp: &DataPlane = &self.dp;
        Routed::Slot(match dp.leaders.leader(shard) {
            None => SlotAnswer::Retry(ShardRefusal::NoLeader),
            Some(leader) if leader == dp.me => {
                let replicas = self.replicas.get_or_insert_with(|| self.dp.replicas_full());
                let Some(replica) = replica_in(replicas, shard) else {
                    return Routed::Slot(SlotAnswer::Retry(ShardRefusal::NotReplicated(dp.me)));
                };
                match replica.decide(&dp.store, op, now_ms) {
                    LocalDecision::Decided {
                        decision,
                        changed: None,
                        ..
                    } => return Routed::Now(decision),
                    LocalDecision::Decided {
                        decision,
                        changed: Some(state),
                        term,
                    } => {
                        let strict = dp.strict();
                        let key_at = self.keys.len() as u32;
                        self.keys.extend_from_slice(op.key);
                        self.states.push(LocalState {
                            key_at,
                            key_len: op.key.len() as u32,
                            shard,
                            term,
                            state,
                            wait: strict.then_some((slot, decision.into())),
                        });
                        if !strict {
                            return Routed::Now(decision);
                        }
                        SlotAnswer::Pending
                    }
                    LocalDecision::Full(full) => SlotAnswer::Done(Err(BackendError::Full(full))),
                    LocalDecision::Refused(why) => SlotAnswer::Retry(why),
                    LocalDecision::Invalid(why) => SlotAnswer::Done(Err(
                        BackendError::ShardUnavailable(WireDecision::describe(shard, &why)),
                    )),
                }
            }
            Some(peer) => {
                if let Some(denied) = remembered_denial(dp, op, now_ms) {
                    DataStats::add(&dp.stats.denials_remembered, 1);
                    return Routed::Now(denied);
                }
                let mut lease_wanted = 0;
                if dp.asks_leases()
                    && leases::leasable(op)
                    && leases_with(&mut self.lease_peers, dp, peer)
                {
                    let hash = dp.store.key_hash(op.key);
                    if self.asked.contains(&hash) {
                        return Routed::Slot(SlotAnswer::AfterLease);
                    }
                    if op.peek {
                        // As the lease's next hit would be answered, if
                        // this node holds one; else as the leader would.
                        if let Some(peeked) = lease_peek(dp, op.key, hash, peer, now_ms) {
                            return Routed::Now(peeked);
                        }
                    } else {
                        match lease_use(dp, op.key, hash, peer, now_ms) {
                            LeaseUse::Admitted(decision) => {
                                self.lease_hits += 1;
                                return Routed::Now(decision);
                            }
                            LeaseUse::Ask(wanted) => {
                                lease_wanted = wanted;
                                self.asked.push(hash);
                            }
                            LeaseUse::Forward => {}
                        }
                    }
                }
                // Asks for a lease only when this routing decided to; a
                // retried op's earlier ask is not sent again.
                let op = &OpView {
                    lease_wanted,
                    ..*op
                };
                let forward = match self.forwards.iter_mut().position(|f| f.peer == peer) {
                    Some(at) => &mut self.forwards[at],
                    None => {
                        self.forwards.push(PeerForward {
                            peer,
                            slots: SmallVec::new(),
                            ops_at: SmallVec::new(),
                        });
                        let last = self.forwards.len() - 1;
                        &mut self.forwards[last]
                    }
                };
                forward.slots.push(slot);
                forward
                    .ops_at
                    .push(encode_op(&mut self.ops, &mut self.last_params, op));
                SlotAnswer::Pending
            }
        })
    }

    /// Decides a droplet bucket's take or query here, as its shard's
    /// leader (see `cluster::buckets`): a changed bucket's cells go into the
    /// batch's states, the last one carrying the answer's wait.
    fn decide_bucket_here(
        &mut self,
        slot: u32,
        shard: u32,
        key: &[u8],
        bucket: &super::data_frames::BucketOp,
        query: bool,
        now_ms: u64,
    ) -> SlotAnswer {
        let strict = self.dp.strict();
        let decided =
            super::buckets::decide_on_replica(&self.dp, shard, key, bucket, query, now_ms);
        let (answer, written, term) = match decided {
            Ok(decided) => decided,
            Err(answer) => return result_of(shard, answer),
        };
        let Some(cells) = written else {
            return SlotAnswer::Done(Ok(Answer::bucket(answer)));
        };
        let name = super::buckets::bucket_name(key).unwrap_or_default();
        let last = cells.iter().rposition(Option::is_some);
        for (period, cell) in cells.iter().enumerate() {
            let Some(cell) = cell else { continue };
            let key_at = self.keys.len() as u32;
            super::buckets::append_period_key(&mut self.keys, period, name);
            self.states.push(LocalState {
                key_at,
                key_len: self.keys.len() as u32 - key_at,
                shard,
                term,
                state: CounterState::DropletPeriod(*cell),
                wait: (strict && Some(period) == last).then_some((slot, Answer::bucket(answer))),
            });
        }
        if strict {
            SlotAnswer::Pending
        } else {
            SlotAnswer::Done(Ok(Answer::bucket(answer)))
        }
    }

    /// Adds a droplet bucket's take (or, `query`, its read) as the next
    /// slot: decided here when this node leads the bucket's shard, else
    /// forwarded to its leader. [`ClusterBatch::submit_answers`] gives every
    /// slot's answer.
    pub fn add_bucket(
        &mut self,
        name: &[u8],
        bucket: super::data_frames::BucketOp,
        query: bool,
        now_ms: u64,
    ) {
        let mut key = std::mem::take(&mut self.key_buf);
        key.clear();
        super::buckets::append_period_key(&mut key, 0, name);
        let view = OpView {
            key: &key,
            algorithm: crate::rules::Algorithm::FixedWindow,
            credit_limit: 0,
            reset_seconds: 0,
            peek: query,
            bucket: Some(bucket),
            lease_wanted: 0,
        };
        let shard = self.dp.placement.shard_of(&key);
        self.add(shard, &view, now_ms);
        self.key_buf = key;
    }

    /// Sends what was gathered; resolves with every slot's answer, in slot
    /// order (see [`ClusterBatch::add_bucket`]).
    pub fn submit_answers(
        self: Box<Self>,
    ) -> BoxFuture<'static, Vec<Result<Answer, BackendError>>> {
        let now = Instant::now();
        let deadline = now + Duration::from_millis(self.dp.settings.forward_timeout_ms);
        match self.submit_until(now, deadline, std::convert::identity) {
            Some(answers) => answers,
            None => Box::pin(async { Vec::new() }),
        }
    }

    /// Adds one op as the next slot; returns whether it waits.
    fn add(&mut self, shard: u32, op: &OpView<'_>, now_ms: u64) -> bool {
        let slot = self.slots.len() as u32;
        // Where this op is (or will be) encoded: every waiting op once, in
        // order, the forwarded ones by `route`.
        let encoded = self.ops.len();
        let answer = match self.route(slot, shard, op, now_ms) {
            Routed::Now(decision) => SlotAnswer::Done(Ok(Answer::Hit(decision))),
            Routed::Slot(answer) => answer,
        };
        self.push_slot(shard, op, encoded, answer)
    }

    /// Appends a routed op's slot (`encoded`: the batch's `ops` length before
    /// it was routed); returns whether it waits.
    fn push_slot(
        &mut self,
        shard: u32,
        op: &OpView<'_>,
        encoded: usize,
        answer: SlotAnswer,
    ) -> bool {
        if self.slots.capacity() == 0 {
            self.slots.reserve(BATCH_SLOTS_INITIAL);
        }
        let waits = !matches!(answer, SlotAnswer::Done(_));
        let op_at = if waits {
            if encoded == self.ops.len() {
                // Not forwarded (`route` encoded those): kept for a retry.
                encode_op(&mut self.ops, &mut self.last_params, op);
            }
            encoded as u32
        } else {
            u32::MAX
        };
        self.slots.push(Slot {
            answer,
            shard,
            op_at,
        });
        waits
    }

    /// Sends what was gathered at `now` (one clock read for the batch's
    /// states, forwards and deadline); resolves by `deadline`.
    fn submit_until<T: Send + 'static>(
        self: Box<Self>,
        now: Instant,
        deadline: Instant,
        as_wanted: impl AsWanted<T>,
    ) -> Option<BoxFuture<'static, Vec<T>>> {
        let ClusterBatch {
            dp,
            slots,
            ops,
            keys,
            states,
            forwards,
            key_buf,
            lease_hits,
            ..
        } = *self;
        if lease_hits > 0 {
            DataStats::add(&dp.stats.lease_hits, lease_hits);
        }
        if slots.is_empty() {
            if !states.is_empty() {
                dp.push_states(
                    now,
                    states.iter().map(|s| {
                        let key = &keys[s.key_at as usize..(s.key_at + s.key_len) as usize];
                        (key, decided(s, None))
                    }),
                );
            }
            BatchBuffers {
                keys,
                states,
                key_buf,
            }
            .keep();
            keep_spare_ops(ops);
            return None;
        }
        // The ops join the board once the forwards are sent from them.
        let board = Arc::new(SlotBoard::new(slots, Vec::new()));
        if !states.is_empty() {
            dp.push_states(
                now,
                states.iter().map(|s| {
                    let key = &keys[s.key_at as usize..(s.key_at + s.key_len) as usize];
                    (key, decided(s, Some(&board)))
                }),
            );
        }
        BatchBuffers {
            keys,
            states,
            key_buf,
        }
        .keep();
        let sends = forwards.into_iter().map(|forward| {
            let op_bytes = forward
                .ops_at
                .into_iter()
                .map(|(start, end)| &ops[start as usize..end as usize]);
            (forward.peer, forward.slots, op_bytes)
        });
        dp.send_forwards(now, &board, sends, |peer, slots, why| {
            let why = ShardRefusal::Other(format!("forwarding to node {peer}: {why}"));
            board.fill_many(slots.into_iter().map(|slot| {
                let why = why.clone();
                (slot, WireDecision::Retry { shard: 0, why })
            }));
        });
        board.keep_ops(ops);
        Some(Box::pin(wait_for_answers(dp, board, deadline, as_wanted)))
    }
}

/// A rule op's parameters as last encoded in a batch's `ops`, and where
/// their bytes (what follows the op's key) lie there.
#[derive(Clone, Copy)]
struct EncodedParams {
    algorithm: crate::rules::Algorithm,
    credit_limit: u64,
    reset_seconds: u64,
    peek: bool,
    lease_wanted: u32,
    at: (u32, u32),
}

impl EncodedParams {
    fn same_as(&self, op: &OpView<'_>) -> bool {
        (
            self.algorithm,
            self.credit_limit,
            self.reset_seconds,
            self.peek,
            self.lease_wanted,
        ) == (
            op.algorithm,
            op.credit_limit,
            op.reset_seconds,
            op.peek,
            op.lease_wanted,
        )
    }
}

/// Appends `op` to a batch's encoded ops; returns where it lies. A rule
/// op with the parameters of the last one encoded (`last`: a read batch's
/// hits mostly share a few rules) copies their bytes rather than
/// encoding its quota's varints again.
fn encode_op(ops: &mut Vec<u8>, last: &mut Option<EncodedParams>, op: &OpView<'_>) -> (u32, u32) {
    if ops.capacity() == 0 {
        ops.reserve(BATCH_OPS_BYTES_INITIAL);
    }
    let start = ops.len() as u32;
    if op.bucket.is_some() {
        put_op(ops, op);
        return (start, ops.len() as u32);
    }
    put_bytes(ops, op.key);
    match *last {
        Some(params) if params.same_as(op) => {
            ops.extend_from_within(params.at.0 as usize..params.at.1 as usize);
        }
        _ => {
            let from = ops.len() as u32;
            put_op_params(ops, op);
            *last = Some(EncodedParams {
                algorithm: op.algorithm,
                credit_limit: op.credit_limit,
                reset_seconds: op.reset_seconds,
                peek: op.peek,
                lease_wanted: op.lease_wanted,
                at: (from, ops.len() as u32),
            });
        }
    }
    (start, ops.len() as u32)
}

fn decided(state: &LocalState, board: Option<&Arc<SlotBoard>>) -> DecidedState {
    DecidedState {
        shard: state.shard,
        term: state.term,
        state: state.state,
        // Matched by reference: a copy of the whole `wait` first (most
        // often `None`, in fast mode always) was stored in two overlapping
        // halves and read back whole, a store-forwarding stall per state.
        waiter: match (&state.wait, board) {
            (Some((slot, decision)), Some(board)) => Some(Waiter::Local {
                board: Arc::clone(board),
                slot: *slot,
                decision: *decision,
            }),
            _ => None,
        },
    }
}

/// Waits for a board's answers, routing hits that were not decided again
/// until `deadline`.
async fn wait_for_answers<T>(
    dp: Arc<DataPlane>,
    board: Arc<SlotBoard>,
    deadline: Instant,
    as_wanted: impl AsWanted<T>,
) -> Vec<T> {
    let timeout_ms = dp.settings.forward_timeout_ms;
    // When the batch was sent: its leaders decided after it, so their
    // windows reset at least their announced seconds (rounded) from then.
    let sent_ms = || {
        let waited = Duration::from_millis(timeout_ms)
            .saturating_sub(deadline.saturating_duration_since(Instant::now()));
        dp.clock.now_ms().saturating_sub(waited.as_millis() as u64)
    };
    loop {
        let _ = tokio::time::timeout_at(deadline.into(), board.settled()).await;
        if board.any_leased() {
            // Kept before the hits that waited for them are routed again.
            leases::keep_granted(&dp, &board, sent_ms());
        }
        let (retries, refused) = board.retries();
        // Hits refused wait a moment before they are routed again; hits
        // that waited for their counter's lease go at once.
        let pause = Duration::from_millis(if refused { RETRY_PAUSE_MS } else { 0 });
        if retries.is_empty() || Instant::now() + pause >= deadline {
            break;
        }
        if refused {
            tokio::time::sleep(pause).await;
        }
        let mut again = Box::new(ClusterBatch::new(Arc::clone(&dp)));
        let now_ms = dp.clock.now_ms();
        let mut routed = Vec::with_capacity(retries.len());
        for (slot, shard, op_bytes) in &retries {
            let Ok(op) = Reader::new(op_bytes).op() else {
                continue;
            };
            again.add(*shard, &op, now_ms);
            routed.push(*slot);
        }
        let answers = match again.submit_until(Instant::now(), deadline, std::convert::identity) {
            Some(waiting) => waiting.await,
            None => Vec::new(),
        };
        for (slot, answer) in routed.into_iter().zip(answers) {
            board.set(slot, SlotAnswer::Done(answer));
        }
    }
    if board.any_denied() {
        denials::remember_denied(&dp, &board, sent_ms());
    }
    board.finish(timeout_ms, as_wanted)
}

/// How a batch's caller wants each slot's answer: as it is (droplet's
/// buckets) or as a rule's hit ([`hit_result`]); applied as the answers are
/// gathered, so no list is built twice. A function's own type, not a
/// pointer, so that it is inlined there: called through a pointer, each
/// answer came back through memory a field at a time and was read back
/// whole, a store-forwarding stall per hit (docs/benchmarks.md,
/// "Nineteenth round").
trait AsWanted<T>: Fn(Result<Answer, BackendError>) -> T + Copy + Send + 'static {}

impl<T, F> AsWanted<T> for F where F: Fn(Result<Answer, BackendError>) -> T + Copy + Send + 'static {}

/// A slot's answer as a rule's hit gets it (a bucket's answer never
/// reaches a hit's slot; it would read as its accept alone).
fn hit_result(result: Result<Answer, BackendError>) -> Result<Decision, BackendError> {
    result.map(|answer| match answer {
        Answer::Hit(decision) => decision,
        Answer::Bucket(packed) => Decision {
            allowed: packed.outcome().accept,
            credit: 0,
            next_reset_seconds: 0,
        },
    })
}

/// The cluster key of an op: the rule's counter id (computed once, when the
/// rule was validated, the same on every node), then the actor.
fn cluster_key(buf: &mut Vec<u8>, op: &CounterOp<'_>) {
    buf.clear();
    op.rule.counter_id.write_key(buf, op.actor.as_bytes());
}

impl OpBatch for ClusterBatch {
    fn decide(&mut self, ops: &[CounterOp<'_>], now_ms: u64) -> BatchDecided {
        let first = self.slots.len();
        let mut waits = false;
        // While every op of the request is answered at once (a leader-aware
        // client's hits, in fast mode), the answers go straight into the
        // request's decisions: no slot is written and read back.
        let mut ready = Decisions::new();
        let mut key = std::mem::take(&mut self.key_buf);
        for op in ops {
            cluster_key(&mut key, op);
            let view = OpView {
                key: &key,
                algorithm: op.rule.algorithm,
                credit_limit: op.quota.credit_limit(),
                reset_seconds: op.quota.period_ms() / 1000,
                peek: op.peek,
                bucket: None,
                lease_wanted: 0,
            };
            let shard = self.dp.placement.shard_of(&key);
            if self.slots.len() > first {
                waits |= self.add(shard, &view, now_ms);
                continue;
            }
            let encoded = self.ops.len();
            match self.route((first + ready.len()) as u32, shard, &view, now_ms) {
                Routed::Now(decision) => ready.push(Ok(decision)),
                Routed::Slot(answer) => {
                    // This op needs its slot, so the request's earlier ops
                    // take theirs first (a done slot's shard is never read).
                    for decided in ready.drain(..) {
                        let answer = SlotAnswer::Done(decided.map(Answer::Hit));
                        self.push_slot(shard, &view, encoded, answer);
                    }
                    waits |= self.push_slot(shard, &view, encoded, answer);
                }
            }
        }
        self.key_buf = key;
        if waits {
            return BatchDecided::Slots {
                first: first as u32,
            };
        }
        if self.slots.len() == first {
            return BatchDecided::Ready(ready);
        }
        let decisions: Decisions = self
            .slots
            .drain(first..)
            .map(|slot| match slot.answer {
                SlotAnswer::Done(result) => hit_result(result),
                _ => Err(BackendError::ShardUnavailable("not decided".into())),
            })
            .collect();
        BatchDecided::Ready(decisions)
    }

    fn submit(self: Box<Self>) -> Option<BoxFuture<'static, SlotAnswers>> {
        let now = Instant::now();
        let deadline = now + Duration::from_millis(self.dp.settings.forward_timeout_ms);
        self.submit_until(now, deadline, hit_result)
    }
}
