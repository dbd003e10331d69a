//! Leader-aware routing (`--leader-aware`): which cluster node each actor's
//! hits go to. The topology comes from the target (`TOPOLOGY`); the shard of
//! an actor's request is computed with the cluster's own rules and
//! placement code ([`tollgate::cluster::ClusterClient`]), so every hit lands
//! on its shard's leader and none is forwarded.

use crate::config::Args;
use crate::workload::actor_name;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;
use tollgate::cluster::status::fetch_topology;
use tollgate::cluster::ClusterClient;
use tollgate::rules::RuleSet;

/// Where each connection sends, and which actors it draws.
#[derive(Debug, Clone)]
pub struct LeaderRoutes {
    /// The leaders' client addresses.
    pub addrs: Vec<SocketAddr>,
    /// The actors whose shard each address leads.
    pub actors: Vec<Vec<u32>>,
    /// The route (index into `addrs`) of each global connection.
    pub conn_route: Vec<usize>,
}

impl LeaderRoutes {
    /// Asks `args.target` for the topology and routes every actor.
    pub fn build(args: &Args) -> Result<LeaderRoutes> {
        let rules = match &args.rules {
            Some(path) => {
                RuleSet::load_file(path).with_context(|| format!("--rules {}", path.display()))?
            }
            None => RuleSet::embedded_default(),
        };
        let topology = fetch_topology(args.first_target(), Duration::from_secs(5))
            .with_context(|| format!("--leader-aware: TOPOLOGY from {}", args.first_target()))?;
        let client = ClusterClient::with_topology(rules, topology);
        let template = args.template();
        let mut by_addr: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for i in 0..u32::try_from(args.actors)? {
            let request =
                template.replace("{actor}", &actor_name(&args.actor_prefix, u64::from(i)));
            let pairs: Vec<(&str, &str)> = request
                .split_whitespace()
                .filter_map(|word| word.split_once('='))
                .collect();
            let Some(addr) = client.route(&pairs) else {
                bail!("--leader-aware: no node to send {request:?} to");
            };
            by_addr.entry(addr).or_default().push(i);
        }
        let mut addrs = Vec::new();
        let mut actors = Vec::new();
        for (addr, list) in by_addr {
            let resolved = addr
                .to_socket_addrs()
                .with_context(|| format!("leader address {addr}"))?
                .next()
                .with_context(|| format!("leader address {addr} resolves to nothing"))?;
            addrs.push(resolved);
            actors.push(list);
        }
        let conn_route = spread(args.connections, &actors);
        Ok(LeaderRoutes {
            addrs,
            actors,
            conn_route,
        })
    }
}

/// Assigns `connections` to routes in proportion to their actors, at least
/// one each while connections last (largest remainder).
fn spread(connections: usize, actors: &[Vec<u32>]) -> Vec<usize> {
    let total: usize = actors.iter().map(Vec::len).sum::<usize>().max(1);
    let mut counts: Vec<usize> = actors
        .iter()
        .map(|a| (connections * a.len() / total).max(1))
        .collect();
    while counts.iter().sum::<usize>() > connections {
        if let Some(max) = counts.iter_mut().max() {
            *max -= 1;
        }
    }
    let routes = counts.len();
    let mut i = 0;
    while counts.iter().sum::<usize>() < connections {
        counts[i % routes] += 1;
        i += 1;
    }
    // Interleave, so that threads (connections round-robin) get every route.
    let mut route = Vec::with_capacity(connections);
    let mut left = counts.clone();
    while route.len() < connections {
        for (r, n) in left.iter_mut().enumerate() {
            if *n > 0 {
                *n -= 1;
                route.push(r);
            }
        }
    }
    route
}

#[cfg(test)]
mod tests {
    use super::spread;

    #[test]
    fn connections_follow_the_actors() {
        let actors = vec![vec![0; 300], vec![0; 600], vec![0; 100]];
        let routes = spread(10, &actors);
        assert_eq!(routes.len(), 10);
        let count = |r| routes.iter().filter(|&&x| x == r).count();
        assert_eq!((count(0), count(1), count(2)), (3, 6, 1));
        // Fewer connections than routes: the first routes get one each.
        assert_eq!(spread(2, &actors).len(), 2);
    }
}
