//! A cluster-aware client: it asks any node for the topology (`TOPOLOGY`),
//! computes each request's shard itself from the same rules the nodes run,
//! and sends the request straight to that shard's leader, saving the
//! forwarding hop. When a leader fails or moves, the answer is an error or a
//! lost connection: the client refreshes the topology and retries once.
//! Any node would answer correctly anyway; this only saves a hop.

use super::placement::{counter_key, stable_counter_id, Placement};
use super::status::Topology;
use crate::client::{format_request, Client, ClientError, Response};
use crate::protocol::Pairs;
use crate::rules::{Quota, RuleSet};
use std::collections::HashMap;

#[derive(Debug, thiserror::Error)]
pub enum ClusterClientError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{addr} answered TOPOLOGY with {answer:?} (is it a cluster node?)")]
    NotACluster { addr: String, answer: String },
    #[error("no node answered TOPOLOGY (tried {0:?})")]
    NoNode(Vec<String>),
}

pub struct ClusterClient {
    rules: RuleSet,
    topology: Topology,
    placement: Placement,
    connections: HashMap<String, Client>,
}

async fn fetch(addr: &str) -> Result<Topology, ClusterClientError> {
    let mut client = Client::connect(addr).await?;
    let answer = client.send("TOPOLOGY").await?;
    let text = match answer {
        Response::Other(text) => text,
        other => format!("{other:?}"),
    };
    serde_json::from_str(&text).map_err(|_| ClusterClientError::NotACluster {
        addr: addr.to_string(),
        answer: text,
    })
}

impl ClusterClient {
    /// Connects through any node; `rules` must be the nodes' rules.
    pub async fn connect(seed: &str, rules: RuleSet) -> Result<ClusterClient, ClusterClientError> {
        let topology = fetch(seed).await?;
        Ok(Self::with_topology(rules, topology))
    }

    /// A client for a topology fetched some other way (no connection made
    /// until a request is sent).
    pub fn with_topology(rules: RuleSet, topology: Topology) -> ClusterClient {
        let placement = Placement::new(
            topology.shards,
            topology.replicas,
            topology.nodes.iter().map(|n| n.id).collect(),
        );
        ClusterClient {
            rules,
            topology,
            placement,
            connections: HashMap::new(),
        }
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Re-reads the topology from any node that answers.
    pub async fn refresh(&mut self) -> Result<(), ClusterClientError> {
        let addresses: Vec<String> = self
            .topology
            .nodes
            .iter()
            .map(|n| n.client.clone())
            .collect();
        for addr in &addresses {
            if let Ok(topology) = fetch(addr).await {
                *self = Self::with_topology(self.rules.clone(), topology);
                return Ok(());
            }
        }
        Err(ClusterClientError::NoNode(addresses))
    }

    /// The shard deciding a request: that of its last evaluated rule with a
    /// counter (`None` when no counter is involved).
    pub fn shard_of(&self, pairs: &[(&str, &str)]) -> Option<u32> {
        let request = Pairs::from_slice(pairs);
        let rule = self.rules.evaluate(&request).last()?;
        let Quota::Limited {
            credit_limit,
            reset_seconds,
        } = rule.quota
        else {
            return None;
        };
        let counter = stable_counter_id(
            &rule.canonical_operation,
            credit_limit,
            reset_seconds.saturating_mul(1000),
            rule.algorithm.as_str(),
        );
        let mut key = Vec::new();
        counter_key(&mut key, counter, rule.actor(&request));
        Some(self.placement.shard_of(&key))
    }

    /// Where a request goes: its shard's leader, else any live node.
    pub fn route(&self, pairs: &[(&str, &str)]) -> Option<String> {
        let leader = self
            .shard_of(pairs)
            .and_then(|shard| self.topology.leader_client(shard));
        leader
            .or_else(|| {
                self.topology
                    .nodes
                    .iter()
                    .find(|n| n.up)
                    .map(|n| n.client.as_str())
            })
            .map(str::to_string)
    }

    async fn send_to(&mut self, addr: &str, line: &str) -> Result<Response, ClientError> {
        if !self.connections.contains_key(addr) {
            let client = Client::connect(addr).await?;
            self.connections.insert(addr.to_string(), client);
        }
        let Some(client) = self.connections.get_mut(addr) else {
            return Err(ClientError::Closed);
        };
        let result = client.send(line).await;
        if !matches!(result, Ok(Response::Ok { .. }) | Ok(Response::Other(_))) {
            // The server closes after an ERR; so do we after a failure.
            self.connections.remove(addr);
        }
        result
    }

    /// `HIT` at the leader of the request's shard; after an error or a lost
    /// connection, refreshes the topology and tries once more.
    pub async fn hit(&mut self, pairs: &[(&str, &str)]) -> Result<Response, ClusterClientError> {
        let line = format_request("HIT", pairs)?;
        let first = match self.route(pairs) {
            Some(addr) => self.send_to(&addr, &line).await,
            None => Err(ClientError::Closed),
        };
        match first {
            Ok(response @ Response::Ok { .. }) => Ok(response),
            _ => {
                self.refresh().await?;
                let addr = self
                    .route(pairs)
                    .ok_or_else(|| ClusterClientError::NoNode(Vec::new()))?;
                Ok(self.send_to(&addr, &line).await?)
            }
        }
    }
}
