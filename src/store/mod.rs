//! Counter storage behind one trait, so the request path does not care where
//! counters live: the in-memory striped store (default), Redis (divvy's
//! layout), or a cluster's replicated shards. A backend answers synchronously
//! when it can and with a future when it must wait (network).

mod key;
pub mod memory;
mod packed;
pub mod redis;
mod shared_buckets;
pub(crate) mod table;

use crate::limiter::{
    fixed_window_hit, sliding_window_hit, token_bucket_hit, CounterState, Decision, WindowQuota,
};
use crate::rules::{Algorithm, Rule};
use futures_util::future::BoxFuture;
use smallvec::SmallVec;
use std::sync::Arc;

pub use memory::{MemoryStore, MemoryStoreConfig, StoreFull, StoredState, StripedStore};
pub use shared_buckets::{BucketCall, BucketResults, SharedBuckets};

/// One rule's counter, asked about by one request.
#[derive(Debug, Clone, Copy)]
pub struct CounterOp<'a> {
    pub rule: &'a Rule,
    pub actor: &'a str,
    pub quota: WindowQuota,
    /// Answer what a hit would get, changing nothing (`PEEK`).
    pub peek: bool,
}

/// Why a counter could not be decided. Shown to clients as
/// `ERR unknown "<reason>"` unless the unavailability policy says otherwise.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("{0}")]
    Full(#[from] StoreFull),
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("backend timed out after {0} ms")]
    Timeout(u64),
    /// A cluster shard cannot decide now (`shard N unavailable: …`).
    #[error("{0}")]
    ShardUnavailable(String),
}

/// Decisions for a list of ops, in order.
pub type Decisions = SmallVec<[Result<Decision, BackendError>; 2]>;

/// What a backend returns: decisions now, or a future of them.
pub enum Decided {
    Ready(Decisions),
    Later(BoxFuture<'static, Decisions>),
}

/// The answers of a read batch's deferred ops, by slot (see [`OpBatch`]).
pub type SlotAnswers = Vec<Result<Decision, BackendError>>;

/// How [`OpBatch::decide`] answered one request's ops.
pub enum BatchDecided {
    /// Every op is decided already.
    Ready(Decisions),
    /// The request's ops were given slots `first..first + ops.len()` of the
    /// batch, answered when the batch's future resolves.
    Slots { first: u32 },
}

/// One read batch's ops, gathered by a backend that answers them together
/// (the cluster: one message per peer per read batch, one wake-up when
/// every answer is in). Ops it can decide at once it answers at once;
/// the others get slots. [`OpBatch::submit`] sends what was gathered.
pub trait OpBatch: Send {
    /// Decides one request's ops, in order (see [`Backend::decide`]).
    fn decide(&mut self, ops: &[CounterOp<'_>], now_ms: u64) -> BatchDecided;

    /// Sends what was gathered; the future resolves with every slot's
    /// answer (`None` when no op got a slot).
    fn submit(self: Box<Self>) -> Option<BoxFuture<'static, SlotAnswers>>;
}

pub trait Backend: Send + Sync + 'static {
    /// Decides every op in order. Ops of one request are applied in order, so
    /// a canary rule and the deciding rule sharing a counter see each other.
    fn decide(&self, ops: &[CounterOp<'_>], now_ms: u64) -> Decided;

    /// A batch for the ops of one read of a connection, for backends that
    /// decide many requests' ops together (`None`: decide each request with
    /// [`Backend::decide`]).
    fn begin_batch(&self) -> Option<Box<dyn OpBatch>> {
        None
    }

    /// A short name for logs and metrics ("memory", "redis", "cluster").
    fn name(&self) -> &'static str;

    /// The in-memory store this backend decides in, when it decides on the
    /// serving thread: a read batch's counters are prefetched in it before
    /// any is decided (see [`Engine::prefetch_read`](crate::engine::Engine::prefetch_read)).
    fn prefetch_store(&self) -> Option<&MemoryStore> {
        None
    }

    /// Adds to `hashes` the [`MemoryStore::key_hash`] of the counters of
    /// `ops` worth prefetching in [`Backend::prefetch_store`]: those this
    /// backend decides there (and, when telling them apart costs more than
    /// a prefetch, others it holds there).
    fn counter_hashes(&self, _ops: &[CounterOp<'_>], _hashes: &mut PrefetchHashes) {}

    /// Can this backend count every rule of `rules`? To be checked before a
    /// rule set is served, at start and on reload (the redis backend counts
    /// only fixed windows). The memory backend counts them all.
    fn check_rules(
        &self,
        _rules: &crate::rules::RuleSet,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(())
    }
}

/// Store hashes of one read batch's counters, to prefetch; as many as
/// [`PREFETCH_KEYS_MAX`] are kept on the stack.
pub type PrefetchHashes = smallvec::SmallVec<[u64; PREFETCH_KEYS_MAX]>;

/// Most counters of one read batch prefetched before its requests are
/// decided: about two cache lines each, within what the core can have in
/// flight and far below what its L1 and L2 caches hold.
pub const PREFETCH_KEYS_MAX: usize = 64;

/// The in-memory backend: counters in a [`MemoryStore`], decided inline.
pub struct MemoryBackend {
    pub store: Arc<MemoryStore>,
}

/// The store key of a counter: the rule's counter id, then the actor (the
/// same bytes as the cluster's key for it, so a node's replicas and its own
/// counters share one store).
pub fn memory_key(buf: &mut Vec<u8>, op: &CounterOp<'_>) {
    op.rule.counter_id.write_key(buf, op.actor.as_bytes());
}

/// One hit of a rule's algorithm on its counter (pure; see [`crate::limiter`]).
pub fn algorithm_hit(
    algorithm: Algorithm,
    state: Option<CounterState>,
    quota: WindowQuota,
    now_ms: u64,
) -> (Decision, Option<CounterState>) {
    match algorithm {
        Algorithm::FixedWindow => fixed_window_hit(state, quota, now_ms),
        Algorithm::TokenBucket => token_bucket_hit(state, quota, now_ms),
        Algorithm::SlidingWindow => sliding_window_hit(state, quota, now_ms),
    }
}

impl MemoryBackend {
    /// Decides `op` on its counter, whose key is the rule's counter id (as
    /// [`memory_key`] writes it) and the actor, given as the two parts.
    fn decide_parts(
        &self,
        counter_id: u64,
        actor: &[u8],
        op: &CounterOp<'_>,
        now_ms: u64,
    ) -> Result<Decision, BackendError> {
        if op.peek {
            let state = self.store.get_prefixed(counter_id, actor, now_ms);
            return Ok(algorithm_hit(op.rule.algorithm, state, op.quota, now_ms).0);
        }
        Ok(self
            .store
            .update_prefixed(counter_id, actor, now_ms, |state| {
                algorithm_hit(op.rule.algorithm, state, op.quota, now_ms)
            })?)
    }
}

impl Backend for MemoryBackend {
    fn decide(&self, ops: &[CounterOp<'_>], now_ms: u64) -> Decided {
        Decided::Ready(
            ops.iter()
                .map(|op| self.decide_parts(op.rule.counter_id.0, op.actor.as_bytes(), op, now_ms))
                .collect(),
        )
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn prefetch_store(&self) -> Option<&MemoryStore> {
        Some(&self.store)
    }

    fn counter_hashes(&self, ops: &[CounterOp<'_>], hashes: &mut PrefetchHashes) {
        for op in ops {
            let hash = self
                .store
                .key_hash_prefixed(op.rule.counter_id.0, op.actor.as_bytes());
            hashes.push(hash);
        }
    }
}
