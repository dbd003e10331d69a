//! The cluster file: which nodes make up the cluster, where each listens for
//! clients and for peers, and the shard layout they share. It is an INI file,
//! whose `[cluster]` layout is identical on every node (a fingerprint of it
//! is compared when nodes meet); its node list is the first member list,
//! which `tollgate cluster add-node|remove-node` changes at run time:
//!
//! ```ini
//! [cluster]
//! shards = 64      ; fixed for the cluster's life
//! replicas = 3     ; capped at the number of nodes
//! placement = spread ; or ring (see `placement.rs`)
//!
//! [node 1]
//! client = 127.0.0.1:8321
//! peer = 127.0.0.1:9321
//! ```

use super::placement::{stable_hash, Placement, PlacementKind};
use super::NodeId;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

/// Shards when the file does not say.
pub const DEFAULT_SHARDS: u32 = 64;
/// Replicas per shard when the file does not say.
pub const DEFAULT_REPLICAS: usize = 3;
/// Most shards a cluster may have (each is a Raft group on its replicas).
pub const SHARDS_MAX: u32 = 4096;

/// Seed of the cluster-file fingerprint.
const FINGERPRINT_SEED: u64 = 0x434c_5553_5445_5231; // "CLUSTER1"

#[derive(Debug, thiserror::Error)]
pub enum ClusterFileError {
    #[error("cannot read cluster file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("cluster file syntax error: {0}")]
    Syntax(String),
    #[error("cluster file: section [{section}]: {message}")]
    Section { section: String, message: String },
    #[error("cluster file: unknown section [{0}] (expected [cluster] or [node N])")]
    UnknownSection(String),
    #[error("cluster file lists no nodes")]
    NoNodes,
    #[error("cluster file: node {0} is listed twice")]
    DuplicateNode(NodeId),
    #[error("cluster file: address {addr} is used twice (nodes {first} and {second})")]
    DuplicateAddress {
        addr: SocketAddr,
        first: NodeId,
        second: NodeId,
    },
    #[error("this node's id {0} is not in the cluster file")]
    UnknownSelf(NodeId),
    #[error("--peer-route {0}: {1}")]
    PeerRoute(NodeId, String),
}

/// Parses a `--peer-route` value, `N=HOST:PORT` (a host name is resolved
/// once, here).
pub fn parse_peer_route(text: &str) -> Result<(NodeId, SocketAddr), String> {
    use std::net::ToSocketAddrs;
    let (id, addr) = text
        .split_once('=')
        .ok_or_else(|| format!("expected N=HOST:PORT, got '{text}'"))?;
    let id: NodeId = id
        .trim()
        .parse()
        .ok()
        .filter(|&id| id >= 1)
        .ok_or_else(|| format!("'{id}' is not a node id (an integer ≥ 1)"))?;
    let addr = addr
        .trim()
        .to_socket_addrs()
        .map_err(|error| format!("cannot resolve '{addr}': {error}"))?
        .next()
        .ok_or_else(|| format!("'{addr}' resolves to no address"))?;
    Ok((id, addr))
}

/// One member of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeAddresses {
    /// Where clients speak the divvy protocol.
    pub client: SocketAddr,
    /// Where peers speak the cluster protocol (Raft, forwarded hits).
    pub peer: SocketAddr,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterFile {
    pub shards: u32,
    pub replicas: usize,
    pub placement: PlacementKind,
    pub nodes: BTreeMap<NodeId, NodeAddresses>,
}

impl ClusterFile {
    pub fn load(path: &Path) -> Result<ClusterFile, ClusterFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClusterFileError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
    }

    pub fn parse(text: &str) -> Result<ClusterFile, ClusterFileError> {
        let ini = ini::Ini::load_from_str(text)
            .map_err(|error| ClusterFileError::Syntax(error.to_string()))?;
        let mut file = ClusterFile {
            shards: DEFAULT_SHARDS,
            replicas: DEFAULT_REPLICAS,
            placement: PlacementKind::default(),
            nodes: BTreeMap::new(),
        };
        let mut seen_addresses: BTreeMap<SocketAddr, NodeId> = BTreeMap::new();
        for (section, properties) in ini.iter() {
            let Some(section) = section else {
                if let Some((key, _)) = properties.iter().next() {
                    return Err(ClusterFileError::Section {
                        section: String::new(),
                        message: format!("key '{key}' is outside any section"),
                    });
                }
                continue;
            };
            let section_error = |message: String| ClusterFileError::Section {
                section: section.to_string(),
                message,
            };
            if section == "cluster" {
                for (key, value) in properties.iter() {
                    match key {
                        "shards" => {
                            file.shards = value
                                .trim()
                                .parse()
                                .ok()
                                .filter(|n| (1..=SHARDS_MAX).contains(n))
                                .ok_or_else(|| {
                                    section_error(format!(
                                        "shards must be 1..={SHARDS_MAX}, got '{value}'"
                                    ))
                                })?;
                        }
                        "replicas" => {
                            file.replicas = value
                                .trim()
                                .parse()
                                .ok()
                                .filter(|&n: &usize| n >= 1)
                                .ok_or_else(|| {
                                section_error(format!("replicas must be ≥ 1, got '{value}'"))
                            })?;
                        }
                        "placement" => {
                            file.placement = PlacementKind::parse(value).ok_or_else(|| {
                                section_error(format!(
                                    "placement must be 'spread' or 'ring', got '{value}'"
                                ))
                            })?;
                        }
                        other => return Err(section_error(format!("unknown key '{other}'"))),
                    }
                }
                continue;
            }
            let Some(id_text) = section.strip_prefix("node ") else {
                return Err(ClusterFileError::UnknownSection(section.to_string()));
            };
            let id: NodeId = id_text
                .trim()
                .parse()
                .ok()
                .filter(|&id| id >= 1)
                .ok_or_else(|| section_error("node ids are integers ≥ 1".to_string()))?;
            let address = |key: &str| -> Result<SocketAddr, ClusterFileError> {
                let value = properties
                    .get(key)
                    .ok_or_else(|| section_error(format!("missing '{key}' (HOST:PORT)")))?;
                value
                    .trim()
                    .parse()
                    .map_err(|_| section_error(format!("'{key}' must be IP:PORT, got '{value}'")))
            };
            for (key, _) in properties.iter() {
                if key != "client" && key != "peer" {
                    return Err(section_error(format!("unknown key '{key}'")));
                }
            }
            let addresses = NodeAddresses {
                client: address("client")?,
                peer: address("peer")?,
            };
            for addr in [addresses.client, addresses.peer] {
                if let Some(&first) = seen_addresses.get(&addr) {
                    return Err(ClusterFileError::DuplicateAddress {
                        addr,
                        first,
                        second: id,
                    });
                }
                seen_addresses.insert(addr, id);
            }
            if file.nodes.insert(id, addresses).is_some() {
                return Err(ClusterFileError::DuplicateNode(id));
            }
        }
        if file.nodes.is_empty() {
            return Err(ClusterFileError::NoNodes);
        }
        Ok(file)
    }

    pub fn placement(&self) -> Placement {
        Placement::with_kind(
            self.shards,
            self.replicas,
            self.nodes.keys().copied().collect(),
            self.placement,
        )
    }

    /// The addresses `--peer-route` gives for dialling peers (node → address),
    /// checked: each names another node of this file, at most once.
    pub fn peer_routes(
        &self,
        self_id: NodeId,
        routes: &[(NodeId, SocketAddr)],
    ) -> Result<BTreeMap<NodeId, SocketAddr>, ClusterFileError> {
        let mut checked = BTreeMap::new();
        for &(node, addr) in routes {
            let why = if node == self_id {
                Some("a node does not dial itself".to_string())
            } else if !self.nodes.contains_key(&node) {
                Some(format!("node {node} is not in the cluster file"))
            } else if checked.insert(node, addr).is_some() {
                Some(format!("node {node} is routed twice"))
            } else {
                None
            };
            if let Some(why) = why {
                return Err(ClusterFileError::PeerRoute(node, why));
            }
        }
        Ok(checked)
    }

    /// A fingerprint of the layout every node must agree on for the
    /// cluster's life (shards, replicas, placement). The member list is not
    /// in it: members change at run time (see `members.rs`), and a node
    /// added later may list itself where the others do not. The default
    /// placement adds nothing, so nodes of earlier versions (which place
    /// shards that way) still agree.
    pub fn layout_fingerprint(&self) -> u64 {
        let mut text = format!("shards={} replicas={}", self.shards, self.replicas);
        if self.placement != PlacementKind::Spread {
            text.push_str(" placement=");
            text.push_str(self.placement.name());
        }
        stable_hash(FINGERPRINT_SEED, text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREE: &str = "\
[cluster]
shards = 8
replicas = 3

[node 1]
client = 127.0.0.1:8321
peer = 127.0.0.1:9321
[node 2]
client = 127.0.0.1:8322
peer = 127.0.0.1:9322   ; comment
[node 3]
client = 127.0.0.1:8323
peer = 127.0.0.1:9323
";

    #[test]
    fn parses_nodes_and_layout() {
        let file = ClusterFile::parse(THREE).unwrap();
        assert_eq!(file.shards, 8);
        assert_eq!(file.replicas, 3);
        assert_eq!(file.nodes.len(), 3);
        assert_eq!(file.nodes[&2].peer, "127.0.0.1:9322".parse().unwrap());
        assert_eq!(file.placement().nodes(), &[1, 2, 3]);
    }

    #[test]
    fn the_shipped_cluster_files_parse() {
        let local = ClusterFile::parse(include_str!("../../cluster/local/cluster.ini")).unwrap();
        assert_eq!(
            (local.nodes.len(), local.shards, local.replicas),
            (3, 64, 3)
        );
        assert_eq!(local.nodes[&1].client, "127.0.0.1:8321".parse().unwrap());
        let deploy = ClusterFile::parse(include_str!("../../cluster/deploy/cluster.ini")).unwrap();
        assert_eq!(deploy.nodes.len(), 3);
    }

    #[test]
    fn defaults_apply_without_a_cluster_section() {
        let file =
            ClusterFile::parse("[node 7]\nclient = 127.0.0.1:1\npeer = 127.0.0.1:2\n").unwrap();
        assert_eq!(
            (file.shards, file.replicas),
            (DEFAULT_SHARDS, DEFAULT_REPLICAS)
        );
        assert_eq!(file.placement().replicas(), 1);
    }

    #[test]
    fn rejects_bad_files_with_clear_errors() {
        let cases = [
            ("", "lists no nodes"),
            ("[cluster]\nshards = 0\n[node 1]\nclient=127.0.0.1:1\npeer=127.0.0.1:2\n", "shards must be"),
            ("[node x]\nclient=127.0.0.1:1\npeer=127.0.0.1:2\n", "integers ≥ 1"),
            ("[node 1]\nclient=127.0.0.1:1\n", "missing 'peer'"),
            ("[node 1]\nclient=localhost:1\npeer=127.0.0.1:2\n", "must be IP:PORT"),
            ("[nodes]\n", "unknown section"),
            (
                "[cluster]\nplacement = rings\n[node 1]\nclient=127.0.0.1:1\npeer=127.0.0.1:2\n",
                "placement must be 'spread' or 'ring', got 'rings'",
            ),
            (
                "[node 1]\nclient=127.0.0.1:1\npeer=127.0.0.1:2\n[node 2]\nclient=127.0.0.1:2\npeer=127.0.0.1:3\n",
                "used twice",
            ),
        ];
        for (text, expected) in cases {
            let error = ClusterFile::parse(text).unwrap_err().to_string();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }

    #[test]
    fn peer_routes_name_other_nodes_once() {
        let file = ClusterFile::parse(THREE).unwrap();
        assert_eq!(
            parse_peer_route("2=127.0.0.1:7000"),
            Ok((2, "127.0.0.1:7000".parse().unwrap()))
        );
        for bad in ["2", "x=127.0.0.1:1", "0=127.0.0.1:1", "2=nowhere"] {
            assert!(parse_peer_route(bad).is_err(), "{bad}");
        }
        let addr: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let routes = file.peer_routes(1, &[(2, addr)]).unwrap();
        assert_eq!(routes.get(&2), Some(&addr));
        for (routes, expected) in [
            (vec![(1, addr)], "does not dial itself"),
            (vec![(9, addr)], "node 9 is not in the cluster file"),
            (vec![(2, addr), (2, addr)], "routed twice"),
        ] {
            let error = file.peer_routes(1, &routes).unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
        }
    }

    #[test]
    fn layout_fingerprint_follows_the_layout_not_the_members() {
        let file = ClusterFile::parse(THREE).unwrap();
        let mut other = file.clone();
        other.shards = 16;
        assert_ne!(file.layout_fingerprint(), other.layout_fingerprint());
        let mut other = file.clone();
        other.replicas = 2;
        assert_ne!(file.layout_fingerprint(), other.layout_fingerprint());
        let mut other = file.clone();
        other.placement = PlacementKind::Ring;
        assert_ne!(file.layout_fingerprint(), other.layout_fingerprint());
        let mut other = file.clone();
        other.nodes.remove(&3);
        assert_eq!(file.layout_fingerprint(), other.layout_fingerprint());
        // The default placement's fingerprint is the one nodes made before
        // placements had a kind, so a rolling upgrade keeps them agreeing.
        assert_eq!(
            file.layout_fingerprint(),
            stable_hash(FINGERPRINT_SEED, b"shards=8 replicas=3")
        );
    }

    #[test]
    fn placement_is_read_from_the_cluster_section() {
        let ring = THREE.replace("replicas = 3", "replicas = 3\nplacement = ring");
        let file = ClusterFile::parse(&ring).unwrap();
        assert_eq!(file.placement, PlacementKind::Ring);
        assert_eq!(file.placement().kind(), PlacementKind::Ring);
        assert_eq!(
            ClusterFile::parse(THREE).unwrap().placement,
            PlacementKind::Spread
        );
    }
}
