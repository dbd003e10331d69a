//! The cluster's topology as one node sees it, gathered from every member:
//! nodes (up or not), each shard's replicas, leader, term and replication
//! lag. Served as one JSON line by the `TOPOLOGY` command (so cluster-aware
//! clients can go straight to leaders) and printed as tables by
//! `tollgate cluster status`.

use super::committed_rules::RulesTag;
use super::node::{ClusterNode, STATUS_TIMEOUT_MS};
use super::placement::PlacementKind;
use super::wire::NodeReport;
use super::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyNode {
    pub id: NodeId,
    /// Where clients connect (divvy protocol).
    pub client: String,
    pub peer: String,
    /// Answered the status query just now.
    pub up: bool,
    pub live_keys: Option<u64>,
    /// Its data-path counters since it started.
    #[serde(default)]
    pub stats: Option<super::wire::NodeStats>,
    /// The committed rule set it serves (docs/cluster.md, "Cluster-wide
    /// reload").
    #[serde(default)]
    pub rules: Option<RulesTag>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyShard {
    pub shard: u32,
    /// The voters of the shard's group, as its leader has them (the target
    /// while no leader is known).
    pub replicas: Vec<NodeId>,
    /// Where the member list places the shard; differs from `replicas`
    /// while the shard moves.
    pub target: Vec<NodeId>,
    /// Replicas being added (catching up before they vote).
    pub learners: Vec<NodeId>,
    /// What the leader's move of this shard is doing now.
    pub moving: Option<String>,
    pub leader: Option<NodeId>,
    pub term: u64,
    /// Per follower, log entries the leader has not replicated to it yet.
    pub lag: BTreeMap<NodeId, u64>,
    /// Replicas that restarted and are still catching up.
    pub recovering: Vec<NodeId>,
    /// With ring placement, the shard's first replica, which leads it
    /// whenever it is up and caught up; `None` with spread placement (and
    /// from a node of an earlier version).
    #[serde(default)]
    pub preferred_leader: Option<NodeId>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    pub answered_by: NodeId,
    /// The member list's version (raised by every add-node/remove-node).
    pub members_epoch: u64,
    /// Where the answering node's member list came from: its data dir, the
    /// cluster file, or its peers.
    #[serde(default)]
    pub members_source: String,
    pub consistency: String,
    pub shards: u32,
    pub replicas: usize,
    /// How replicas are placed: `spread` or `ring` (the cluster file's
    /// `placement`; empty from a node of an earlier version: `spread`).
    #[serde(default)]
    pub placement_kind: String,
    pub nodes: Vec<TopologyNode>,
    pub placement: Vec<TopologyShard>,
}

impl Topology {
    /// Every node up and every shard led.
    pub fn healthy(&self) -> bool {
        self.nodes.iter().all(|n| n.up) && self.placement.iter().all(|s| s.leader.is_some())
    }

    /// Shards whose replicas differ from the member list's placement.
    pub fn moves_pending(&self) -> usize {
        self.placement
            .iter()
            .filter(|s| s.replicas != s.target || !s.learners.is_empty())
            .count()
    }

    /// Healthy, and every shard on its target replicas, none recovering.
    pub fn settled(&self) -> bool {
        self.healthy()
            && self.moves_pending() == 0
            && self.placement.iter().all(|s| s.recovering.is_empty())
    }

    /// The client address of the node leading `shard`, if known.
    pub fn leader_client(&self, shard: u32) -> Option<&str> {
        let leader = self.placement.get(shard as usize)?.leader?;
        self.nodes
            .iter()
            .find(|n| n.id == leader)
            .map(|n| n.client.as_str())
    }
}

/// Builds the topology from this node's report and its peers'.
pub async fn gather(node: &ClusterNode) -> Topology {
    let mut reports: BTreeMap<NodeId, Option<NodeReport>> =
        node.peer_reports(STATUS_TIMEOUT_MS).await;
    reports.insert(node.id, Some(node.report()));
    let members = node.members();
    let target = node.target_placement();
    let nodes = members
        .nodes
        .iter()
        .map(|(&id, addresses)| {
            let report = reports.get(&id).and_then(|r| r.as_ref());
            TopologyNode {
                id,
                client: addresses.client.to_string(),
                peer: addresses.peer.to_string(),
                up: report.is_some(),
                live_keys: report.map(|r| r.live_keys),
                stats: report.map(|r| r.stats.clone()),
                rules: report.map(|r| r.rules),
            }
        })
        .collect();
    let placement = (0..node.placement.shards())
        .map(|shard| {
            let views: Vec<(NodeId, &super::wire::ShardReport)> = reports
                .iter()
                .filter_map(|(&id, r)| r.as_ref().map(|r| (id, r)))
                .flat_map(|(id, r)| {
                    r.shards
                        .iter()
                        .filter(move |s| s.shard == shard)
                        .map(move |s| (id, s))
                })
                .collect();
            // The leader is a replica that says it leads, in the newest term.
            let leading = views
                .iter()
                .filter(|(id, s)| s.leader == Some(*id))
                .max_by_key(|(_, s)| s.term);
            let target_replicas = target.replicas_of(shard);
            // A ring's run starts at its first replica (spread placement
            // has no leader of choice per shard).
            let preferred_leader = (target.kind() == PlacementKind::Ring)
                .then(|| target_replicas.first().copied())
                .flatten();
            let mut replicas = leading
                .map(|(_, s)| s.voters.clone())
                .unwrap_or_else(|| target_replicas.clone());
            let mut target_sorted = target_replicas;
            // Both sorted, so that a settled shard compares equal.
            replicas.sort_unstable();
            target_sorted.sort_unstable();
            TopologyShard {
                shard,
                replicas,
                target: target_sorted,
                learners: leading.map(|(_, s)| s.learners.clone()).unwrap_or_default(),
                moving: leading.and_then(|(_, s)| s.moving.clone()),
                leader: leading.map(|(id, _)| *id),
                term: views.iter().map(|(_, s)| s.term).max().unwrap_or(0),
                lag: leading
                    .map(|(_, s)| s.lag.iter().copied().collect())
                    .unwrap_or_default(),
                recovering: views
                    .iter()
                    .filter(|(_, s)| s.recovering)
                    .map(|(id, _)| *id)
                    .collect(),
                preferred_leader,
            }
        })
        .collect();
    Topology {
        answered_by: node.id,
        members_epoch: members.epoch,
        members_source: node.members_source(),
        consistency: node.hello.consistency.clone(),
        shards: node.file.shards,
        replicas: target.replicas(),
        placement_kind: node.file.placement.name().to_string(),
        nodes,
        placement,
    }
}

/// Renders the topology as the tables `tollgate cluster status` prints.
/// `rules: version 2 (…) on every node up`, or each node's when they
/// differ (a node behind takes the newest within a poll).
fn render_rules(nodes: &[TopologyNode]) -> String {
    let tags: Vec<(NodeId, RulesTag)> = nodes
        .iter()
        .filter_map(|node| Some((node.id, node.rules?)))
        .collect();
    match tags.first() {
        None => "rules: unknown (no node answered)".to_string(),
        Some((_, first)) if tags.iter().all(|(_, tag)| tag == first) => {
            format!("rules: {} on every node up", first.describe())
        }
        Some(_) => {
            let each: Vec<String> = tags
                .iter()
                .map(|(id, tag)| format!("node {id} {}", tag.describe()))
                .collect();
            format!("rules: switching: {}", each.join("; "))
        }
    }
}

pub fn render(topology: &Topology) -> String {
    let mut out = String::new();
    let ring = if PlacementKind::parse(&topology.placement_kind) == Some(PlacementKind::Ring) {
        " (ring placement)"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "cluster: {} nodes, {} shards x {} replicas{ring}, consistency {} (answered by node {}, members epoch {})",
        topology.nodes.len(),
        topology.shards,
        topology.replicas,
        topology.consistency,
        topology.answered_by,
        topology.members_epoch,
    );
    if !topology.members_source.is_empty() {
        let _ = writeln!(out, "members from {}", topology.members_source);
    }
    let _ = writeln!(out, "{}", render_rules(&topology.nodes));
    let _ = writeln!(
        out,
        "\nNODE  STATE  CLIENT                 PEER                   LIVE_KEYS  LEADS"
    );
    for node in &topology.nodes {
        let leads = topology
            .placement
            .iter()
            .filter(|s| s.leader == Some(node.id))
            .count();
        let _ = writeln!(
            out,
            "{:<5} {:<6} {:<22} {:<22} {:<10} {}",
            node.id,
            if node.up { "up" } else { "DOWN" },
            node.client,
            node.peer,
            node.live_keys.map_or("-".into(), |n| n.to_string()),
            leads
        );
    }
    let _ = writeln!(
        out,
        "\nDATA PATH (since start)  ROUNDS  STATES/SECTION  SECTIONS/ROUND  FORWARDED  HITS/BATCH  WRITES  FRAMES/WRITE"
    );
    let ratio = |a: u64, b: u64| {
        if b == 0 {
            "-".to_string()
        } else {
            format!("{:.1}", a as f64 / b as f64)
        }
    };
    for node in &topology.nodes {
        let Some(stats) = &node.stats else { continue };
        let _ = writeln!(
            out,
            "node {:<19} {:<7} {:<15} {:<15} {:<10} {:<11} {:<7} {}",
            node.id,
            stats.rounds,
            ratio(stats.states_replicated, stats.round_sections),
            ratio(stats.round_sections, stats.rounds),
            stats.forwarded_ops,
            ratio(stats.forwarded_ops, stats.forward_batches),
            stats.writes,
            ratio(stats.frames_written, stats.writes),
        );
    }
    let moving = topology.moves_pending();
    if moving > 0 {
        let _ = writeln!(
            out,
            "\n{moving} shards moving to the member list's placement:"
        );
        for shard in topology
            .placement
            .iter()
            .filter(|s| s.replicas != s.target || !s.learners.is_empty())
        {
            let _ = writeln!(
                out,
                "  shard {}: {} -> {}: {}",
                shard.shard,
                join_ids(&shard.replicas),
                join_ids(&shard.target),
                shard.moving.as_deref().unwrap_or("waiting for its leader")
            );
        }
    }
    let _ = writeln!(
        out,
        "\nSHARD  LEADER  TERM  REPLICAS      LAG (entries behind the leader)"
    );
    for shard in &topology.placement {
        let mut lag: Vec<String> = shard
            .lag
            .iter()
            .map(|(node, behind)| format!("{node}:{behind}"))
            .collect();
        for node in &shard.recovering {
            lag.push(format!("{node}:recovering"));
        }
        let _ = writeln!(
            out,
            "{:<6} {:<7} {:<5} {:<13} {}",
            shard.shard,
            shard.leader.map_or("NONE".into(), |l| l.to_string()),
            shard.term,
            join_ids(&ring_ordered(&shard.replicas, shard.preferred_leader)),
            if lag.is_empty() {
                "-".into()
            } else {
                lag.join(" ")
            }
        );
    }
    out
}

/// A shard's replicas as its ring runs them, from its first replica (by
/// id, wrapping: with five members `5,1,2`), so that a ring-placed shard's
/// table row starts with the node it belongs to; ascending without one.
fn ring_ordered(replicas: &[NodeId], first: Option<NodeId>) -> Vec<NodeId> {
    let mut ordered = replicas.to_vec();
    match first {
        Some(first) => ordered.sort_unstable_by_key(|&id| (id < first, id)),
        None => ordered.sort_unstable(),
    }
    ordered
}

fn join_ids(ids: &[NodeId]) -> String {
    ids.iter()
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Asks a node (its client port) for the topology.
pub fn fetch_topology(addr: &str, timeout: Duration) -> anyhow::Result<Topology> {
    use anyhow::Context;
    let socket = addr
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {addr}"))?
        .next()
        .with_context(|| format!("{addr} resolves to nothing"))?;
    let mut stream = TcpStream::connect_timeout(&socket, timeout)
        .with_context(|| format!("cannot connect to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(b"TOPOLOGY\n")?;
    let mut line = String::new();
    let read = BufReader::new(stream).read_line(&mut line);
    if let Err(error) = &read {
        if matches!(
            error.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            anyhow::bail!("{addr} did not answer TOPOLOGY within {timeout:?}");
        }
    }
    let line = line.trim_end();
    if read.is_err() || line.is_empty() {
        // A peer port closes on anything that is not a peer's handshake.
        anyhow::bail!(
            "{addr} closed the connection without answering TOPOLOGY: a peer port? \
             `cluster status --node` takes a node's client address (its `client =` line)"
        );
    }
    if line.starts_with("ERR ") {
        anyhow::bail!("{addr} answered {line} (is it running in cluster mode?)");
    }
    serde_json::from_str(line).with_context(|| format!("{addr} answered {line:?}"))
}

#[cfg(test)]
mod tests {
    use super::ring_ordered;

    #[test]
    fn a_ring_shards_replicas_read_from_its_first_replica_on() {
        assert_eq!(ring_ordered(&[1, 2, 5], Some(5)), vec![5, 1, 2]);
        assert_eq!(ring_ordered(&[5, 3, 4], Some(3)), vec![3, 4, 5]);
        // Mid-move, a replica outside the run keeps its place by id.
        assert_eq!(ring_ordered(&[4, 1, 2, 5], Some(5)), vec![5, 1, 2, 4]);
        // Spread placement: ascending.
        assert_eq!(ring_ordered(&[3, 1, 2], None), vec![1, 2, 3]);
    }
}
