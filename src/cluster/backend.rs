//! The cluster as a [`Backend`]: each counter op is keyed by its rule's
//! stable counter id and actor, hashed to a shard, and sent to the shard's
//! leader: this node's shard worker when it leads, else the leader's
//! forwarder (batched over the persistent peer connection). Answers come
//! back as one future, in op order. With no known leader, or when the leader
//! does not answer within `forward_timeout_ms`, the op answers
//! `shard N unavailable: …`: a hit never hangs. Hits that were not decided
//! (so not counted) are sent again to the shard's new leader until then.
//!
//! Also answers the `TOPOLOGY` command (see [`super::status`]).

use super::node::ClusterNode;
use super::wire::{WireDecision, WireOp};
use crate::engine::{CommandExtension, Outcome, Reply};
use crate::limiter::Decision;
use crate::protocol::{Pairs, Verb};
use crate::rules::CounterId;
use crate::store::{Backend, BackendError, CounterOp, Decided, StoreFull};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

pub struct ClusterBackend {
    pub node: Arc<ClusterNode>,
}

fn to_result(decision: WireDecision) -> Result<Decision, BackendError> {
    match decision {
        WireDecision::Decided {
            allowed,
            credit,
            next_reset_seconds,
        } => Ok(Decision {
            allowed,
            credit,
            next_reset_seconds,
        }),
        WireDecision::Unavailable(why) | WireDecision::Retry(why) => {
            Err(BackendError::ShardUnavailable(why))
        }
        WireDecision::Full { live_keys_max } => Err(BackendError::Full(StoreFull {
            live_keys_max: usize::try_from(live_keys_max).unwrap_or(usize::MAX),
        })),
    }
}

/// The final answer of one op (a `Retry` left at the deadline is an error).
fn finish(decision: Option<WireDecision>) -> Result<Decision, BackendError> {
    to_result(decision.unwrap_or_else(|| WireDecision::Unavailable("not decided".into())))
}

/// The wire form of an op: self-contained, resolvable on any node. Its key
/// is the rule's counter id (computed once, when the rule was validated, the
/// same on every node) followed by the actor.
pub fn wire_op(op: &CounterOp<'_>) -> WireOp {
    let mut key = Vec::with_capacity(CounterId::KEY_BYTES + op.actor.len());
    op.rule.counter_id.write_key(&mut key, op.actor.as_bytes());
    WireOp {
        key,
        algorithm: op.rule.algorithm,
        credit_limit: op.quota.credit_limit(),
        reset_seconds: op.quota.period_ms() / 1000,
        peek: op.peek,
    }
}

type Waiting = (u32, Vec<usize>, oneshot::Receiver<Vec<WireDecision>>);

/// Pause before a hit that was not decided (no leader yet, leader moving) is
/// sent again to whoever leads its shard by then.
const RETRY_PAUSE_MS: u64 = 25;

/// Sends the ops at `positions` to their shards' leaders (ops of one shard
/// travel together, in order). Ops that cannot be sent get their answer in
/// `results` at once; the others are returned to wait for.
fn route(
    node: &ClusterNode,
    ops: &[WireOp],
    shards: &[u32],
    positions: &[usize],
    results: &mut [Option<WireDecision>],
) -> Vec<Waiting> {
    let mut groups: Vec<(u32, Vec<usize>, Vec<WireOp>)> = Vec::new();
    for &position in positions {
        let shard = shards[position];
        let op = ops[position].clone();
        match groups.iter_mut().find(|(s, _, _)| *s == shard) {
            Some((_, positions, group)) => {
                positions.push(position);
                group.push(op);
            }
            None => groups.push((shard, vec![position], vec![op])),
        }
    }
    let mut waiting = Vec::new();
    for (shard, positions, group) in groups {
        let submitted = match node.leaders.leader(shard) {
            None => Err(WireDecision::Retry(format!(
                "shard {shard} unavailable: no leader (election in progress)"
            ))),
            Some(leader) if leader == node.id => node.submit_local(shard, group),
            Some(leader) => node.submit_forward(leader, shard, group),
        };
        match submitted {
            Ok(answer) => waiting.push((shard, positions, answer)),
            Err(decision) => {
                for position in positions {
                    results[position] = Some(decision.clone());
                }
            }
        }
    }
    waiting
}

impl Backend for ClusterBackend {
    /// Hits that were not decided and so not counted (`WireDecision::Retry`:
    /// no leader known, a leader handing over, a leader that could not be
    /// reached) are sent again, every [`RETRY_PAUSE_MS`], to whoever leads
    /// their shard then, until `forward_timeout_ms` is spent: a failover or a
    /// handover shows as latency rather than errors when it ends in time.
    fn decide(&self, ops: &[CounterOp<'_>], _now_ms: u64) -> Decided {
        let node = Arc::clone(&self.node);
        let wire: Vec<WireOp> = ops.iter().map(wire_op).collect();
        let shards: Vec<u32> = wire
            .iter()
            .map(|op| node.placement.shard_of(&op.key))
            .collect();
        let all: Vec<usize> = (0..wire.len()).collect();
        let mut results: Vec<Option<WireDecision>> = vec![None; wire.len()];
        let waiting = route(&node, &wire, &shards, &all, &mut results);
        let retrying = results
            .iter()
            .any(|r| matches!(r, Some(WireDecision::Retry(_))));
        if waiting.is_empty() && !retrying {
            return Decided::Ready(results.into_iter().map(finish).collect());
        }
        let timeout_ms = node.forward_timeout_ms;
        Decided::Later(Box::pin(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
            let mut waiting = waiting;
            loop {
                for (shard, positions, answer) in waiting {
                    let decisions = match tokio::time::timeout_at(deadline, answer).await {
                        Ok(Ok(decisions)) => decisions,
                        Ok(Err(_)) => Vec::new(),
                        Err(_) => vec![
                            WireDecision::Unavailable(format!(
                                "shard {shard} unavailable: no answer within {timeout_ms} ms"
                            ));
                            positions.len()
                        ],
                    };
                    let mut decisions = decisions.into_iter();
                    for position in positions {
                        results[position] = Some(decisions.next().unwrap_or_else(|| {
                            WireDecision::Unavailable(format!(
                                "shard {shard} unavailable: the request was dropped"
                            ))
                        }));
                    }
                }
                let again: Vec<usize> = (0..results.len())
                    .filter(|&i| matches!(results[i], Some(WireDecision::Retry(_))))
                    .collect();
                let pause = Duration::from_millis(RETRY_PAUSE_MS);
                if again.is_empty() || tokio::time::Instant::now() + pause >= deadline {
                    break;
                }
                tokio::time::sleep(pause).await;
                waiting = route(&node, &wire, &shards, &again, &mut results);
            }
            results.into_iter().map(finish).collect()
        }))
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
        check_rules_fingerprint(self.node.hello.rules_fingerprint, rules.fingerprint())
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
