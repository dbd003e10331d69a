//! Counter storage behind one trait, so the request path does not care where
//! counters live: the in-memory striped store (default), Redis (divvy's
//! layout), or a cluster's replicated shards. A backend answers synchronously
//! when it can and with a future when it must wait (network).

// Serving code: input never panics the server (see docs/operations.md).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod memory;
pub mod redis;

use crate::limiter::{
    fixed_window_hit, sliding_window_hit, token_bucket_hit, CounterState, Decision, WindowQuota,
};
use crate::rules::{Algorithm, Rule};
use futures_util::future::BoxFuture;
use smallvec::SmallVec;
use std::sync::Arc;

pub use memory::{MemoryStore, MemoryStoreConfig, StoreFull, StoredState, StripedStore};

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

pub trait Backend: Send + Sync + 'static {
    /// Decides every op in order. Ops of one request are applied in order, so
    /// a canary rule and the deciding rule sharing a counter see each other.
    fn decide(&self, ops: &[CounterOp<'_>], now_ms: u64) -> Decided;

    /// A short name for logs and metrics ("memory", "redis", "cluster").
    fn name(&self) -> &'static str;

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

/// The in-memory backend: counters in a [`MemoryStore`], decided inline.
pub struct MemoryBackend {
    pub store: Arc<MemoryStore>,
}

/// The store key of a counter: the rule's counter identity, then the actor.
pub fn memory_key(buf: &mut Vec<u8>, op: &CounterOp<'_>) {
    buf.clear();
    buf.extend_from_slice(&op.rule.counter_identity.to_le_bytes());
    buf.extend_from_slice(op.actor.as_bytes());
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

/// Longest memory key built on the stack (longer ones, rare, in a `Vec`).
const STACK_KEY_BYTES_MAX: usize = 64;

impl MemoryBackend {
    pub fn decide_one(
        &self,
        key_buf: &mut Vec<u8>,
        op: &CounterOp<'_>,
        now_ms: u64,
    ) -> Result<Decision, BackendError> {
        memory_key(key_buf, op);
        self.decide_keyed(key_buf, op, now_ms)
    }

    fn decide_keyed(
        &self,
        key: &[u8],
        op: &CounterOp<'_>,
        now_ms: u64,
    ) -> Result<Decision, BackendError> {
        if op.peek {
            let state = self.store.get(key, now_ms);
            return Ok(algorithm_hit(op.rule.algorithm, state, op.quota, now_ms).0);
        }
        Ok(self.store.update(key, now_ms, |state| {
            algorithm_hit(op.rule.algorithm, state, op.quota, now_ms)
        })?)
    }

    /// [`MemoryBackend::decide_one`] with the key built on the stack.
    fn decide_on_stack(&self, op: &CounterOp<'_>, now_ms: u64) -> Result<Decision, BackendError> {
        let identity = op.rule.counter_identity.to_le_bytes();
        let actor = op.actor.as_bytes();
        let len = identity.len() + actor.len();
        if len > STACK_KEY_BYTES_MAX {
            return self.decide_one(&mut Vec::with_capacity(len), op, now_ms);
        }
        let mut key = [0u8; STACK_KEY_BYTES_MAX];
        key[..identity.len()].copy_from_slice(&identity);
        key[identity.len()..len].copy_from_slice(actor);
        self.decide_keyed(&key[..len], op, now_ms)
    }
}

impl Backend for MemoryBackend {
    fn decide(&self, ops: &[CounterOp<'_>], now_ms: u64) -> Decided {
        Decided::Ready(
            ops.iter()
                .map(|op| self.decide_on_stack(op, now_ms))
                .collect(),
        )
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}
