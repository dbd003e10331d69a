//! The cluster as a [`Backend`]: a connection's read batch becomes a
//! [`ClusterBatch`] (see `forward.rs`), whose ops are decided inline when
//! this node leads their shard and forwarded, one message per peer, when it
//! does not. Answers that wait (commits, peers) come back as one future per
//! batch, in op order; none ever hangs past `forward_timeout_ms`.
//!
//! Also answers the `TOPOLOGY` command (see [`super::status`]).

use super::dataplane::DataPlane;
use super::forward::ClusterBatch;
use super::node::ClusterNode;
use crate::engine::{CommandExtension, Outcome, Reply};
use crate::protocol::{Pairs, Verb};
use crate::store::{
    Backend, BatchDecided, CounterOp, Decided, MemoryStore, OpBatch, PrefetchHashes,
};
use std::sync::Arc;

pub struct ClusterBackend {
    pub dp: Arc<DataPlane>,
}

impl Backend for ClusterBackend {
    /// One request alone: a batch of one.
    fn decide(&self, ops: &[CounterOp<'_>], now_ms: u64) -> Decided {
        let mut batch = Box::new(ClusterBatch::new(Arc::clone(&self.dp)));
        match batch.decide(ops, now_ms) {
            BatchDecided::Ready(decisions) => {
                // Fast mode may have queued states to replicate.
                let _ = batch.submit();
                Decided::Ready(decisions)
            }
            BatchDecided::Slots { first } => {
                let count = ops.len();
                let Some(answers) = batch.submit() else {
                    return Decided::Ready(Default::default());
                };
                Decided::Later(Box::pin(async move {
                    let answers = answers.await;
                    answers
                        .into_iter()
                        .skip(first as usize)
                        .take(count)
                        .collect()
                }))
            }
        }
    }

    fn begin_batch(&self) -> Option<Box<dyn OpBatch>> {
        Some(Box::new(ClusterBatch::new(Arc::clone(&self.dp))))
    }

    fn name(&self) -> &'static str {
        "cluster"
    }

    fn prefetch_store(&self) -> Option<&MemoryStore> {
        Some(&self.dp.store)
    }

    /// Every counter of `ops`: those of shards this node leads are decided
    /// on this store in a moment; with three replicas the others are held
    /// here too (their states come back in their leader's round). Finding
    /// out which is which (the key assembled, its shard hashed, the leader
    /// looked up) cost more per hit than a prefetch that is not used
    /// (docs/benchmarks.md, "Sixth round").
    fn counter_hashes(&self, ops: &[CounterOp<'_>], hashes: &mut PrefetchHashes) {
        for op in ops {
            let hash = self
                .dp
                .store
                .key_hash_prefixed(op.rule.counter_id.0, op.actor.as_bytes());
            // Its lease too, if it is forwarded: known only once it is
            // routed, and a prefetch costs less than finding out.
            super::forward::prefetch_lease(&self.dp, hash);
            hashes.push(hash);
        }
    }
}

/// Answers `TOPOLOGY` with one JSON line (see [`super::status::Topology`]).
pub struct TopologyCommand {
    pub node: Arc<ClusterNode>,
}

impl CommandExtension for TopologyCommand {
    fn execute(&self, verb: Verb, _pairs: &Pairs<'_>, _now_ms: u64) -> Option<Outcome> {
        if verb != Verb::Topology {
            return None;
        }
        let node = Arc::clone(&self.node);
        Some(Outcome::Later(Box::pin(async move {
            let topology = super::status::gather(&node).await;
            match serde_json::to_string(&topology) {
                Ok(line) => Reply::Line(line),
                Err(error) => Reply::error(format!("cannot encode the topology: {error}")),
            }
        })))
    }
}
