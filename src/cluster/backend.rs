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
use crate::store::{Backend, BatchDecided, CounterOp, Decided, OpBatch};
use std::sync::Arc;

pub struct ClusterBackend {
    pub dp: Arc<DataPlane>,
    /// The rules every node of the cluster serves.
    pub rules_fingerprint: u64,
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

    /// Every node must serve the same rules (peers compare fingerprints when
    /// they connect), so a reload that would change this node's rules alone
    /// is refused. Coordinated reload is future work (docs/cluster.md).
    fn check_rules(
        &self,
        rules: &crate::rules::RuleSet,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        check_rules_fingerprint(self.rules_fingerprint, rules.fingerprint())
    }
}

/// Refuses a rule set whose fingerprint is not the cluster's.
pub fn check_rules_fingerprint(
    cluster: u64,
    reloaded: u64,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if cluster == reloaded {
        return Ok(());
    }
    Err(format!(
        "cluster mode: the new rules (fingerprint {reloaded:016x}) differ from the rules the cluster runs with ({cluster:016x}); every node must serve identical rules and reloading them across the cluster is not supported yet: stop the nodes, change the rule file on every node, then start them again"
    )
    .into())
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

#[cfg(test)]
mod tests {
    use super::check_rules_fingerprint;

    #[test]
    fn a_reload_must_keep_the_cluster_rules() {
        assert!(check_rules_fingerprint(0xabc, 0xabc).is_ok());
        let error = check_rules_fingerprint(0xabc, 0xdef)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("differ from the rules the cluster runs with"),
            "{error}"
        );
        assert!(error.contains("not supported yet"), "{error}");
    }
}
