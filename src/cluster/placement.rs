//! Placement: which shard a counter belongs to and which nodes replicate each
//! shard. Every node must compute the same answers, so the hashes here are
//! fixed (FNV-1a folded through a splitmix64 finalizer, with a distinct seed
//! per purpose), never the process-seeded hashers used for in-memory tables.
//!
//! A counter's key hashes to one of a fixed number of shards. Each shard's
//! replicas are chosen by rendezvous (highest-random-weight) hashing: every
//! node gets a score per shard and the `replicas` best-scoring nodes replicate
//! it. Adding or removing a node only changes the shards whose top scores it
//! enters or leaves, which is the consistent-hashing property. The shard hash,
//! the node scores and the memory store's stripe hash (ahash, in
//! `store::memory`) use independent seeds, so their distributions do not
//! correlate.
//!
//! With `placement = ring` ([`PlacementKind::Ring`]) a shard's replicas are
//! instead a run of consecutive members (by id, wrapping) from its *first*
//! replica, which leads it; first replicas are chosen by the same scores,
//! each node taking its share (shards ÷ members, or one more). A node's led
//! shards then replicate to its next `replicas - 1` members only, so its
//! rounds and the acks they bring go to that many peers (two with three
//! replicas) whatever the cluster's size (docs/cluster.md, "Placement:
//! spread or ring").

use super::NodeId;
use crate::rules::CounterId;
pub use crate::stable_hash::stable_hash;
use crate::stable_hash::{stable_hash_continue, stable_hash_finish, stable_hash_start};
use std::cell::Cell;

/// Seed of the key → shard hash.
const SHARD_SEED: u64 = 0x5348_4152_445f_7631; // "SHARD_v1"
/// Seed of the (shard, node) → score hash.
const NODE_SEED: u64 = 0x4e4f_4445_5f5f_7631; // "NODE__v1"

/// A rule's counter id as a `u64` (the rule's [`CounterId`] computes it at
/// validation; this is for callers holding only the rule's parts).
pub fn stable_counter_id(
    canonical_operation: &str,
    credit_limit: u64,
    period_ms: u64,
    algorithm: &str,
) -> u64 {
    CounterId::of(canonical_operation, credit_limit, period_ms, algorithm).0
}

/// Writes a counter's cluster key: the stable counter id (8 bytes, little
/// endian), then the actor's bytes (the memory store's key, the same bytes).
pub fn counter_key(buf: &mut Vec<u8>, counter_id: u64, actor: &str) {
    CounterId(counter_id).write_key(buf, actor.as_bytes());
}

/// Writes the key a droplet bucket is placed by (its first period's cell,
/// see `cluster::buckets`): [`Placement::shard_of`] of it is the bucket's
/// shard.
pub fn bucket_key(buf: &mut Vec<u8>, bucket: &str) {
    buf.clear();
    super::buckets::append_period_key(buf, 0, bucket.as_bytes());
}

/// Entries of each thread's cache of shard-hash states after a key's first
/// eight bytes (see [`shard_hash`]); a power of two.
const SHARD_PREFIX_STATES: usize = 16;

/// The shard hash's state after eight zero bytes: what every cache entry
/// holds before it is first used (its prefix reads as 0).
const ZERO_PREFIX_STATE: u64 = stable_hash_continue(stable_hash_start(SHARD_SEED), &[0; 8]);

thread_local! {
    /// `(first eight bytes, hash state after them)` of recent keys, by a
    /// hash of the eight bytes.
    static SHARD_PREFIX_CACHE: [Cell<(u64, u64)>; SHARD_PREFIX_STATES] =
        const { [const { Cell::new((0, ZERO_PREFIX_STATE)) }; SHARD_PREFIX_STATES] };
}

/// `stable_hash(SHARD_SEED, key)`. A counter key starts with its rule's
/// eight-byte counter id, the same for every actor of the rule, and the
/// hash goes a byte at a time (it must never change, see the module doc):
/// so the state after those eight bytes is kept per thread, and a hit
/// hashes only its actor's bytes (about half the work of the bench's keys).
#[inline]
fn shard_hash(key: &[u8]) -> u64 {
    let Some((prefix, rest)) = key.split_first_chunk::<8>() else {
        return stable_hash(SHARD_SEED, key);
    };
    let prefix_word = u64::from_le_bytes(*prefix);
    let index = (prefix_word.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 60) as usize
        & (SHARD_PREFIX_STATES - 1);
    let state = SHARD_PREFIX_CACHE.with(|cache| {
        let entry = &cache[index];
        let (cached_word, cached_state) = entry.get();
        if cached_word == prefix_word {
            return cached_state;
        }
        let state = stable_hash_continue(stable_hash_start(SHARD_SEED), prefix);
        entry.set((prefix_word, state));
        state
    });
    stable_hash_finish(stable_hash_continue(state, rest))
}

/// How a shard's replicas are chosen (the cluster file's `placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlacementKind {
    /// The `replicas` best-scoring nodes (rendezvous hashing): a node shares
    /// its shards with every other node, so a failed node's leadership
    /// spreads over all of them.
    #[default]
    Spread,
    /// A run of consecutive members from the shard's first replica (see the
    /// module doc): a node's led shards replicate to its next
    /// `replicas - 1` members only, so each of its rounds fans out to that
    /// many peers at any cluster size; a failed node's leadership goes to
    /// those members.
    Ring,
}

impl PlacementKind {
    /// The name the cluster file uses.
    pub fn name(self) -> &'static str {
        match self {
            PlacementKind::Spread => "spread",
            PlacementKind::Ring => "ring",
        }
    }

    /// Parses a cluster file's `placement` value.
    pub fn parse(text: &str) -> Option<PlacementKind> {
        match text.trim() {
            "spread" => Some(PlacementKind::Spread),
            "ring" => Some(PlacementKind::Ring),
            _ => None,
        }
    }
}

/// The shard map of one cluster: shard count, replication factor, members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    shards: u32,
    replicas: usize,
    /// Member node ids, sorted.
    nodes: Vec<NodeId>,
    kind: PlacementKind,
    /// Ring placement: each shard's replicas, its first replica first
    /// (computed once: the first replicas depend on every shard's choice).
    ring: Vec<Vec<NodeId>>,
}

impl Placement {
    /// `shards` ≥ 1; `replicas` is capped at the number of nodes.
    pub fn new(shards: u32, replicas: usize, nodes: Vec<NodeId>) -> Placement {
        Placement::with_kind(shards, replicas, nodes, PlacementKind::Spread)
    }

    /// A placement of `kind` (see [`PlacementKind`]).
    pub fn with_kind(
        shards: u32,
        replicas: usize,
        mut nodes: Vec<NodeId>,
        kind: PlacementKind,
    ) -> Placement {
        nodes.sort_unstable();
        nodes.dedup();
        let mut placement = Placement {
            shards: shards.max(1),
            replicas: replicas.clamp(1, nodes.len().max(1)),
            nodes,
            kind,
            ring: Vec::new(),
        };
        if kind == PlacementKind::Ring {
            placement.ring = placement.ring_replicas();
        }
        placement
    }

    pub fn kind(&self) -> PlacementKind {
        self.kind
    }

    /// Ring placement's replicas of every shard: shard by shard, the
    /// best-scoring member still below its share is first (shares are
    /// shards ÷ members, the remainder's members one more), then the
    /// members after it by id, wrapping.
    fn ring_replicas(&self) -> Vec<Vec<NodeId>> {
        let members = self.nodes.len();
        if members == 0 {
            return vec![Vec::new(); self.shards as usize];
        }
        let (share, mut larger_shares) = (
            self.shards as usize / members,
            self.shards as usize % members,
        );
        let mut firsts = vec![0usize; members];
        let mut ranked: Vec<(u64, usize)> = Vec::with_capacity(members);
        (0..self.shards)
            .map(|shard| {
                ranked.clear();
                ranked.extend(
                    (0..members).map(|at| (u64::MAX - Self::score(shard, self.nodes[at]), at)),
                );
                ranked.sort_unstable();
                // The shares add up to the shards, so some member has room.
                let room = |count: usize| count < share || (count == share && larger_shares > 0);
                let first = ranked
                    .iter()
                    .map(|&(_, at)| at)
                    .find(|&at| room(firsts[at]))
                    .unwrap_or(ranked[0].1);
                if firsts[first] == share {
                    larger_shares -= 1;
                }
                firsts[first] += 1;
                (0..self.replicas)
                    .map(|step| self.nodes[(first + step) % members])
                    .collect()
            })
            .collect()
    }

    pub fn shards(&self) -> u32 {
        self.shards
    }

    pub fn replicas(&self) -> usize {
        self.replicas
    }

    pub fn nodes(&self) -> &[NodeId] {
        &self.nodes
    }

    /// The shard of a counter key.
    pub fn shard_of(&self, key: &[u8]) -> u32 {
        // Multiply-shift on the high bits: unbiased for any shard count.
        // A droplet bucket's period keys hash without their period byte, so
        // a bucket's periods share a shard (see `cluster::buckets`).
        let key = super::buckets::shard_bytes(key);
        ((u128::from(shard_hash(key)) * u128::from(self.shards)) >> 64) as u32
    }

    fn score(shard: u32, node: NodeId) -> u64 {
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&shard.to_le_bytes());
        bytes[4..].copy_from_slice(&node.to_le_bytes());
        stable_hash(NODE_SEED, &bytes)
    }

    /// The nodes replicating `shard`: best score first (ties by id), or
    /// with ring placement its first replica, then the members after it.
    pub fn replicas_of(&self, shard: u32) -> Vec<NodeId> {
        if self.kind == PlacementKind::Ring {
            return self.ring.get(shard as usize).cloned().unwrap_or_default();
        }
        let mut scored: Vec<(u64, NodeId)> = self
            .nodes
            .iter()
            .map(|&node| (Self::score(shard, node), node))
            .collect();
        scored.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        scored
            .into_iter()
            .take(self.replicas)
            .map(|(_, node)| node)
            .collect()
    }

    /// For every shard, its replicas in the order they should lead it: the
    /// first is chosen so that first choices spread evenly over the nodes
    /// (shard by shard, the replica first for the fewest shards so far),
    /// the rest follow in replica order. With ring placement, the replicas
    /// in ring order: each shard's first replica leads it (first replicas
    /// are spread evenly by construction). Every node computes the same.
    pub fn leader_orders(&self) -> Vec<Vec<NodeId>> {
        if self.kind == PlacementKind::Ring {
            return self.ring.clone();
        }
        let mut firsts: std::collections::BTreeMap<NodeId, usize> =
            std::collections::BTreeMap::new();
        (0..self.shards)
            .map(|shard| {
                let mut replicas = self.replicas_of(shard);
                let best = replicas
                    .iter()
                    .enumerate()
                    .min_by_key(|(i, node)| (firsts.get(node).copied().unwrap_or(0), *i))
                    .map(|(i, _)| i);
                if let Some(best) = best {
                    let first = replicas.remove(best);
                    *firsts.entry(first).or_default() += 1;
                    replicas.insert(0, first);
                }
                replicas
            })
            .collect()
    }

    /// The shards `node` replicates.
    pub fn shards_of_node(&self, node: NodeId) -> Vec<u32> {
        (0..self.shards)
            .filter(|&shard| self.replicas_of(shard).contains(&node))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn hashes_are_fixed_across_processes() {
        // Changing these values reshuffles every cluster's counters: only do
        // it together with a cluster-format version bump.
        assert_eq!(stable_hash(1, b"abc"), stable_hash(1, b"abc"));
        assert_ne!(stable_hash(1, b"abc"), stable_hash(2, b"abc"));
        let placement = Placement::new(64, 3, vec![1, 2, 3, 4, 5]);
        let again = Placement::new(64, 3, vec![5, 4, 3, 2, 1]);
        for shard in 0..64 {
            assert_eq!(placement.replicas_of(shard), again.replicas_of(shard));
        }
    }

    #[test]
    fn the_cached_prefix_hash_is_the_whole_keys_hash() {
        // Many prefixes, so cache entries are replaced and reused; keys
        // shorter than a prefix; a prefix of zeros (the entries' first state).
        let mut key = Vec::new();
        for round in 0..3 {
            for id in 0..40u64 {
                for actor in ["", "a", "user-12345", "\u{e9}t\u{e9}"] {
                    counter_key(&mut key, id * 0x0101_0101_0101 + round, actor);
                    assert_eq!(shard_hash(&key), stable_hash(SHARD_SEED, &key));
                }
            }
        }
        for short in [&b""[..], b"x", b"1234567"] {
            assert_eq!(shard_hash(short), stable_hash(SHARD_SEED, short));
        }
        assert_eq!(shard_hash(&[0; 12]), stable_hash(SHARD_SEED, &[0; 12]));
    }

    #[test]
    fn keys_spread_evenly_over_shards() {
        let placement = Placement::new(64, 3, vec![1, 2, 3]);
        let mut counts = vec![0u32; 64];
        let mut key = Vec::new();
        for actor in 0..64_000 {
            counter_key(
                &mut key,
                42,
                &format!("10.0.{}.{}", actor / 256, actor % 256),
            );
            counts[placement.shard_of(&key) as usize] += 1;
        }
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        // 1000 expected per shard; a fair hash stays well within ±15%.
        assert!(*min > 850 && *max < 1150, "min {min}, max {max}");
    }

    #[test]
    fn first_leaders_spread_evenly() {
        let placement = Placement::new(64, 3, vec![1, 2, 3]);
        let mut firsts: HashMap<NodeId, usize> = HashMap::new();
        let orders = placement.leader_orders();
        for shard in 0..64 {
            let order = orders[shard as usize].clone();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            let mut replicas = placement.replicas_of(shard);
            replicas.sort_unstable();
            assert_eq!(sorted, replicas, "a rotation of the replicas");
            *firsts.entry(order[0]).or_default() += 1;
        }
        for count in firsts.values() {
            assert!((20..=23).contains(count), "{firsts:?}");
        }
    }

    #[test]
    fn replicas_are_distinct_and_capped_by_the_node_count() {
        let placement = Placement::new(16, 3, vec![1, 2]);
        assert_eq!(placement.replicas(), 2);
        for shard in 0..16 {
            let mut replicas = placement.replicas_of(shard);
            replicas.sort_unstable();
            assert_eq!(replicas, vec![1, 2]);
        }
        let placement = Placement::new(16, 3, vec![1, 2, 3, 4, 5]);
        for shard in 0..16 {
            let mut replicas = placement.replicas_of(shard);
            assert_eq!(replicas.len(), 3);
            replicas.dedup();
            assert_eq!(replicas.len(), 3);
        }
    }

    #[test]
    fn replicas_balance_across_nodes() {
        let nodes: Vec<NodeId> = (1..=6).collect();
        let placement = Placement::new(1024, 3, nodes.clone());
        let mut load: HashMap<NodeId, usize> = HashMap::new();
        let mut first: HashMap<NodeId, usize> = HashMap::new();
        for shard in 0..1024 {
            let replicas = placement.replicas_of(shard);
            *first.entry(replicas[0]).or_default() += 1;
            for node in replicas {
                *load.entry(node).or_default() += 1;
            }
        }
        // 1024 × 3 / 6 = 512 replicas per node; 1024 / 6 ≈ 171 first choices.
        for node in nodes {
            let replicas = load[&node];
            assert!((430..=594).contains(&replicas), "node {node}: {replicas}");
            let firsts = first[&node];
            assert!((120..=222).contains(&firsts), "node {node}: {firsts}");
        }
    }

    #[test]
    fn adding_a_node_moves_only_the_replicas_it_takes() {
        let before = Placement::new(1024, 3, vec![1, 2, 3, 4, 5]);
        let after = Placement::new(1024, 3, vec![1, 2, 3, 4, 5, 6]);
        let mut moved = 0;
        for shard in 0..1024 {
            let old = before.replicas_of(shard);
            let new = after.replicas_of(shard);
            let gained: Vec<_> = new.iter().filter(|n| !old.contains(n)).collect();
            // Only the new node can gain a replica, and it displaces one old one.
            assert!(
                gained.iter().all(|&&n| n == 6),
                "shard {shard}: {old:?} → {new:?}"
            );
            assert!(gained.len() <= 1);
            moved += gained.len();
        }
        // The new node should take about its fair share: 3/6 of the shards.
        assert!((430..=594).contains(&moved), "moved {moved} of 1024");
    }

    #[test]
    fn removing_a_node_moves_only_its_replicas() {
        let before = Placement::new(1024, 3, vec![1, 2, 3, 4, 5]);
        let after = Placement::new(1024, 3, vec![1, 2, 3, 5]);
        for shard in 0..1024 {
            let old = before.replicas_of(shard);
            let new = after.replicas_of(shard);
            if !old.contains(&4) {
                assert_eq!(
                    old, new,
                    "shard {shard} moved though node 4 did not hold it"
                );
            } else {
                let kept: Vec<_> = old.iter().filter(|&&n| n != 4).collect();
                assert!(kept.iter().all(|n| new.contains(n)));
            }
        }
    }

    fn ring(shards: u32, nodes: &[NodeId]) -> Placement {
        Placement::with_kind(shards, 3, nodes.to_vec(), PlacementKind::Ring)
    }

    #[test]
    fn ring_replicas_are_consecutive_members_led_by_the_first_spread_evenly() {
        for nodes in [
            vec![1, 2, 3],
            vec![1, 2, 3, 4, 5],
            vec![2, 3, 5, 8, 13, 21, 34],
        ] {
            let placement = ring(64, &nodes);
            let orders = placement.leader_orders();
            let share = 64 / nodes.len();
            let mut firsts: HashMap<NodeId, usize> = HashMap::new();
            for shard in 0..64 {
                let replicas = placement.replicas_of(shard);
                assert_eq!(orders[shard as usize], replicas, "led by its first replica");
                let at = nodes.iter().position(|&n| n == replicas[0]).unwrap();
                let run: Vec<NodeId> = (0..3).map(|k| nodes[(at + k) % nodes.len()]).collect();
                assert_eq!(replicas, run, "shard {shard}: consecutive members");
                *firsts.entry(replicas[0]).or_default() += 1;
            }
            // Every member leads its share (shards ÷ members, or one more).
            assert_eq!(firsts.len(), nodes.len(), "{firsts:?}");
            assert!(
                firsts.values().all(|&c| c == share || c == share + 1),
                "{firsts:?}"
            );
            // A member's led shards replicate to its next two members only.
            for (at, &node) in nodes.iter().enumerate() {
                let peers: std::collections::BTreeSet<NodeId> = (0..64)
                    .filter(|&s| placement.replicas_of(s)[0] == node)
                    .flat_map(|s| placement.replicas_of(s).into_iter().skip(1))
                    .collect();
                let next: std::collections::BTreeSet<NodeId> =
                    (1..3).map(|k| nodes[(at + k) % nodes.len()]).collect();
                assert_eq!(peers, next, "node {node}");
            }
        }
    }

    #[test]
    fn ring_placement_is_the_same_on_every_node_and_capped_by_the_member_count() {
        assert_eq!(ring(64, &[5, 1, 3, 2, 4]), ring(64, &[1, 2, 3, 4, 5]));
        let two = ring(16, &[1, 2]);
        for shard in 0..16 {
            let mut replicas = two.replicas_of(shard);
            replicas.sort_unstable();
            assert_eq!(replicas, vec![1, 2]);
        }
        assert!(ring(4, &[]).replicas_of(0).is_empty());
    }

    #[test]
    fn ring_placement_moves_a_bounded_part_of_the_replicas_when_a_node_joins() {
        // Rendezvous moves a new node's share (3/6 of 1 024 shards gain it,
        // about 512 replicas); the ring also changes the runs around the new
        // member and the first replicas whose share shrank (670 here).
        let before = ring(1024, &[1, 2, 3, 4, 5]);
        let after = ring(1024, &[1, 2, 3, 4, 5, 6]);
        let mut moved = 0;
        for shard in 0..1024 {
            let old = before.replicas_of(shard);
            moved += after
                .replicas_of(shard)
                .iter()
                .filter(|n| !old.contains(n))
                .count();
        }
        assert!(moved <= 900, "moved {moved} replicas of 3 072");
    }

    #[test]
    fn placement_kinds_parse_by_name() {
        for kind in [PlacementKind::Spread, PlacementKind::Ring] {
            assert_eq!(PlacementKind::parse(kind.name()), Some(kind));
        }
        assert_eq!(PlacementKind::parse(" ring "), Some(PlacementKind::Ring));
        assert_eq!(PlacementKind::parse("rings"), None);
    }

    #[test]
    fn counter_ids_follow_the_rule_identity() {
        let a = stable_counter_id("method=GET", 10, 60_000, "fixed-window");
        assert_eq!(
            a,
            stable_counter_id("method=GET", 10, 60_000, "fixed-window")
        );
        assert_ne!(
            a,
            stable_counter_id("method=GET", 11, 60_000, "fixed-window")
        );
        assert_ne!(
            a,
            stable_counter_id("method=GET", 10, 61_000, "fixed-window")
        );
        assert_ne!(
            a,
            stable_counter_id("method=PUT", 10, 60_000, "fixed-window")
        );
    }
}
