//! The in-memory counter store: a power-of-two number of cache-padded,
//! `parking_lot`-locked stripes, each a `hashbrown` table keyed by the counter
//! key's bytes. A key is hashed once (ahash); distinct bit ranges of that hash
//! pick the stripe and the slot, so the two are independent.
//!
//! Expired entries read as absent. A sweeper thread reclaims them in bounded
//! steps (one stripe at a time), and a cap on live keys bounds memory: when it
//! is reached and no expired entry can be reclaimed in the key's stripe, the
//! update is refused with [`StoreFull`] and nothing is stored.
//!
//! The store is generic over what it keeps ([`StoredState`]: anything that
//! knows when it expires): rule counters ([`MemoryStore`], the
//! [`CounterState`] store) and droplet's buckets share the same stripes,
//! sweeper and cap.

use crate::limiter::CounterState;
use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Bit offset of the stripe index inside the key hash: above the bits
/// hashbrown uses for slots in any realistic table, below its 7 tag bits.
const STRIPE_HASH_SHIFT: u32 = 40;

/// The live-key cap was reached and the key's stripe had nothing expired to
/// reclaim: the update was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("live key limit reached ({live_keys_max} counters)")]
pub struct StoreFull {
    pub live_keys_max: usize,
}

/// What a [`StripedStore`] keeps per key: a small value, copied in and out
/// under the stripe lock, that knows when it stops being worth anything.
pub trait StoredState: Copy + Send + 'static {
    /// From this instant on the state reads as absent and may be reclaimed.
    fn expires_at_ms(&self) -> u64;
}

impl StoredState for CounterState {
    fn expires_at_ms(&self) -> u64 {
        CounterState::expires_at_ms(self)
    }
}

struct Entry<S> {
    key: Box<[u8]>,
    state: S,
}

struct Stripe<S> {
    table: HashTable<Entry<S>>,
}

impl<S> Default for Stripe<S> {
    fn default() -> Self {
        Stripe {
            table: HashTable::new(),
        }
    }
}

/// Sizing and limits of a [`MemoryStore`].
#[derive(Debug, Clone, Copy)]
pub struct MemoryStoreConfig {
    /// Number of stripes; rounded up to a power of two.
    pub stripes: usize,
    /// Most live (unexpired) counters kept at once.
    pub live_keys_max: usize,
}

impl Default for MemoryStoreConfig {
    fn default() -> Self {
        MemoryStoreConfig {
            stripes: 256,
            live_keys_max: 10_000_000,
        }
    }
}

/// Counters the sweeper has seen and reclaimed, for metrics.
#[derive(Debug, Default)]
pub struct SweepStats {
    pub sweeps: AtomicU64,
    pub reclaimed: AtomicU64,
}

/// The rule counters' store.
pub type MemoryStore = StripedStore<CounterState>;

pub struct StripedStore<S> {
    stripes: Box<[CachePadded<Mutex<Stripe<S>>>]>,
    stripe_mask: usize,
    hasher: ahash::RandomState,
    live_keys: AtomicUsize,
    live_keys_max: usize,
    pub sweep_stats: SweepStats,
}

impl<S: StoredState> StripedStore<S> {
    pub fn new(config: MemoryStoreConfig) -> Self {
        let stripes = config.stripes.max(1).next_power_of_two();
        StripedStore {
            stripes: (0..stripes)
                .map(|_| CachePadded::new(Mutex::new(Stripe::default())))
                .collect(),
            stripe_mask: stripes - 1,
            hasher: ahash::RandomState::with_seeds(
                0x7461_6c6c_6761_7465,
                0x0073_7472_6970_6573,
                0x2b7e_1516_28ae_d2a6,
                0xabf7_1588_09cf_4f3c,
            ),
            live_keys: AtomicUsize::new(0),
            live_keys_max: config.live_keys_max,
            sweep_stats: SweepStats::default(),
        }
    }

    /// The number of stored counters (expired ones not yet swept included).
    pub fn live_keys(&self) -> usize {
        self.live_keys.load(Ordering::Relaxed)
    }

    pub fn live_keys_max(&self) -> usize {
        self.live_keys_max
    }

    pub fn stripe_count(&self) -> usize {
        self.stripes.len()
    }

    fn stripe_of(&self, hash: u64) -> &Mutex<Stripe<S>> {
        &self.stripes[(hash >> STRIPE_HASH_SHIFT) as usize & self.stripe_mask]
    }

    /// Reads a key's state (`None` when absent or expired).
    pub fn get(&self, key: &[u8], now_ms: u64) -> Option<S> {
        let hash = self.hasher.hash_one(key);
        let stripe = self.stripe_of(hash).lock();
        stripe
            .table
            .find(hash, |e| *e.key == *key)
            .map(|e| e.state)
            .filter(|s| s.expires_at_ms() > now_ms)
    }

    /// Runs `step` on a key's current state (`None` when absent or expired)
    /// under the stripe's lock, and stores the state it returns, if any.
    /// `step` must be short and must not block: it is a pure limiter call.
    pub fn update<R>(
        &self,
        key: &[u8],
        now_ms: u64,
        step: impl FnOnce(Option<S>) -> (R, Option<S>),
    ) -> Result<R, StoreFull> {
        let hash = self.hasher.hash_one(key);
        let mut stripe = self.stripe_of(hash).lock();
        if let Some(entry) = stripe.table.find_mut(hash, |e| *e.key == *key) {
            let current = Some(entry.state).filter(|s| s.expires_at_ms() > now_ms);
            let (result, new_state) = step(current);
            if let Some(state) = new_state {
                entry.state = state;
            }
            return Ok(result);
        }
        let (result, new_state) = step(None);
        let Some(state) = new_state else {
            return Ok(result);
        };
        if !self.reserve_live_key() {
            // Full: reclaim what has expired in this stripe, then try once more.
            self.sweep_locked(&mut stripe, now_ms);
            if !self.reserve_live_key() {
                return Err(StoreFull {
                    live_keys_max: self.live_keys_max,
                });
            }
        }
        let hasher = &self.hasher;
        stripe.table.insert_unique(
            hash,
            Entry {
                key: key.into(),
                state,
            },
            |e| hasher.hash_one(&*e.key),
        );
        Ok(result)
    }

    fn reserve_live_key(&self) -> bool {
        self.live_keys
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.live_keys_max).then_some(n + 1)
            })
            .is_ok()
    }

    fn sweep_locked(&self, stripe: &mut Stripe<S>, now_ms: u64) -> usize {
        let before = stripe.table.len();
        stripe.table.retain(|e| e.state.expires_at_ms() > now_ms);
        let reclaimed = before - stripe.table.len();
        if reclaimed > 0 {
            self.live_keys.fetch_sub(reclaimed, Ordering::AcqRel);
            self.sweep_stats
                .reclaimed
                .fetch_add(reclaimed as u64, Ordering::Relaxed);
        }
        // Give memory back after a burst of keys, but never churn small tables.
        let len = stripe.table.len();
        if stripe.table.capacity() > 64 && stripe.table.capacity() > len * 4 {
            stripe
                .table
                .shrink_to(len * 2, |e| self.hasher.hash_one(&*e.key));
        }
        reclaimed
    }

    /// Sweeps stripes starting at `first`, until at least `entries_budget`
    /// entries were examined or every stripe was visited once. Returns the
    /// stripe to start from next time. Each stripe is locked only while it is
    /// swept, so a sweep never pauses the whole store.
    pub fn sweep_step(&self, first: usize, entries_budget: usize, now_ms: u64) -> usize {
        let mut index = first & self.stripe_mask;
        let mut examined = 0;
        for _ in 0..self.stripes.len() {
            let mut stripe = self.stripes[index].lock();
            examined += stripe.table.len();
            self.sweep_locked(&mut stripe, now_ms);
            drop(stripe);
            index = (index + 1) & self.stripe_mask;
            if examined >= entries_budget {
                break;
            }
        }
        self.sweep_stats.sweeps.fetch_add(1, Ordering::Relaxed);
        index
    }

    /// Removes every counter whose key `doomed` selects (a cluster replica
    /// handing a shard to other nodes), one stripe at a time. Returns how
    /// many were removed.
    pub fn remove_where(&self, mut doomed: impl FnMut(&[u8]) -> bool) -> usize {
        let mut removed = 0;
        for stripe in self.stripes.iter() {
            let mut stripe = stripe.lock();
            let before = stripe.table.len();
            stripe.table.retain(|e| !doomed(&e.key));
            let gone = before - stripe.table.len();
            if gone > 0 {
                self.live_keys.fetch_sub(gone, Ordering::AcqRel);
                removed += gone;
            }
        }
        removed
    }

    /// Visits every live counter (for snapshots and persistence), one stripe
    /// at a time.
    pub fn for_each_live(&self, now_ms: u64, mut visit: impl FnMut(&[u8], S)) {
        for stripe in self.stripes.iter() {
            let stripe = stripe.lock();
            for entry in stripe.table.iter() {
                if entry.state.expires_at_ms() > now_ms {
                    visit(&entry.key, entry.state);
                }
            }
        }
    }

    /// Visits the live counters of whole stripes starting at `first`, until at
    /// least `entries_budget` counters were visited or every stripe was visited
    /// once (bounded work per call, for periodic persistence). Each stripe is
    /// locked only while it is read, so `visit` must be short: copy, don't
    /// format. Returns the stripe to start from next time and how many stripes
    /// were visited.
    pub fn visit_live_step(
        &self,
        first: usize,
        entries_budget: usize,
        now_ms: u64,
        mut visit: impl FnMut(&[u8], S),
    ) -> (usize, usize) {
        let mut index = first & self.stripe_mask;
        let mut visited_entries = 0;
        let mut visited_stripes = 0;
        while visited_stripes < self.stripes.len() {
            let stripe = self.stripes[index].lock();
            for entry in stripe.table.iter() {
                if entry.state.expires_at_ms() > now_ms {
                    visit(&entry.key, entry.state);
                    visited_entries += 1;
                }
            }
            drop(stripe);
            index = (index + 1) & self.stripe_mask;
            visited_stripes += 1;
            if visited_entries >= entries_budget {
                break;
            }
        }
        (index, visited_stripes)
    }

    /// Starts a thread that sweeps `entries_per_tick` entries every `tick`,
    /// until the store is dropped.
    pub fn spawn_sweeper(
        self: &Arc<Self>,
        clock: Arc<dyn crate::clock::Clock>,
        tick: Duration,
        entries_per_tick: usize,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let store: Weak<StripedStore<S>> = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("tollgate-sweeper".into())
            .spawn(move || {
                let mut next = 0;
                loop {
                    std::thread::sleep(tick);
                    let Some(store) = store.upgrade() else { return };
                    next = store.sweep_step(next, entries_per_tick, clock.now_ms());
                }
            })
    }
}

impl StripedStore<CounterState> {
    /// Merges a state into a key (replication): `merge` keeps the later window.
    pub fn merge(&self, key: &[u8], state: CounterState, now_ms: u64) -> Result<(), StoreFull> {
        self.update(key, now_ms, |current| {
            let merged = match current {
                Some(current) => current.merge(state),
                None => state,
            };
            ((), (merged.expires_at_ms() > now_ms).then_some(merged))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{fixed_window_hit, WindowQuota};

    fn hit(store: &MemoryStore, key: &[u8], now_ms: u64) -> Result<bool, StoreFull> {
        let quota = WindowQuota::new(2, 1).unwrap();
        store.update(key, now_ms, |s| {
            let (d, new) = fixed_window_hit(s, quota, now_ms);
            (d.allowed, new)
        })
    }

    #[test]
    fn counts_per_key_and_expired_reads_as_absent() {
        let store = MemoryStore::new(MemoryStoreConfig::default());
        assert_eq!(hit(&store, b"a", 0), Ok(true));
        assert_eq!(hit(&store, b"a", 10), Ok(true));
        assert_eq!(hit(&store, b"a", 20), Ok(false));
        assert_eq!(hit(&store, b"b", 20), Ok(true));
        assert!(store.get(b"a", 999).is_some());
        assert!(store.get(b"a", 1000).is_none());
        assert_eq!(hit(&store, b"a", 1000), Ok(true));
        assert_eq!(store.live_keys(), 2);
    }

    #[test]
    fn cap_reclaims_expired_keys_then_refuses() {
        let store = MemoryStore::new(MemoryStoreConfig {
            stripes: 1,
            live_keys_max: 2,
        });
        assert_eq!(hit(&store, b"a", 0), Ok(true));
        assert_eq!(hit(&store, b"b", 0), Ok(true));
        assert_eq!(hit(&store, b"c", 500), Err(StoreFull { live_keys_max: 2 }));
        // Existing keys keep counting at the cap.
        assert_eq!(hit(&store, b"a", 500), Ok(true));
        // Once a and b expire, c fits.
        assert_eq!(hit(&store, b"c", 1000), Ok(true));
        assert_eq!(store.live_keys(), 1);
    }

    #[test]
    fn remove_where_drops_only_the_selected_keys_and_frees_their_slots() {
        let store = MemoryStore::new(MemoryStoreConfig {
            stripes: 4,
            live_keys_max: 10,
        });
        for key in [&b"a1"[..], b"a2", b"b1"] {
            assert!(hit(&store, key, 1_000).unwrap());
        }
        assert_eq!(store.remove_where(|key| key.starts_with(b"a")), 2);
        assert_eq!(store.live_keys(), 1);
        assert!(store.get(b"a1", 1_000).is_none());
        assert!(store.get(b"b1", 1_000).is_some());
    }

    #[test]
    fn visit_live_steps_cover_every_live_counter_once_per_cycle() {
        let store = MemoryStore::new(MemoryStoreConfig {
            stripes: 8,
            live_keys_max: 1000,
        });
        for i in 0..100u32 {
            hit(&store, &i.to_le_bytes(), 0).unwrap();
        }
        store
            .merge(
                b"expired",
                CounterState::Window {
                    end_ms: 400,
                    used: 1,
                },
                0,
            )
            .unwrap();
        let mut seen = Vec::new();
        let (mut next, mut stripes) = (0, 0);
        while stripes < store.stripe_count() {
            let (after, visited) =
                store.visit_live_step(next, 10, 500, |key, _| seen.push(key.to_vec()));
            assert!(visited >= 1);
            next = after;
            stripes += visited;
        }
        assert_eq!(stripes, store.stripe_count(), "whole stripes, each once");
        assert_eq!(next, 0, "a full cycle ends where it started");
        seen.sort();
        let mut expected: Vec<Vec<u8>> = (0..100u32).map(|i| i.to_le_bytes().to_vec()).collect();
        expected.sort();
        assert_eq!(seen, expected, "every live counter once, nothing expired");
    }

    #[test]
    fn sweep_steps_reclaim_everything_expired() {
        let store = MemoryStore::new(MemoryStoreConfig {
            stripes: 8,
            live_keys_max: 1000,
        });
        for i in 0..100u32 {
            hit(&store, &i.to_le_bytes(), 0).unwrap();
        }
        assert_eq!(store.live_keys(), 100);
        let mut next = 0;
        for _ in 0..8 {
            next = store.sweep_step(next, 1, 999);
        }
        assert_eq!(store.live_keys(), 100, "nothing expired yet");
        for _ in 0..8 {
            next = store.sweep_step(next, 1, 1000);
        }
        assert_eq!(store.live_keys(), 0);
        assert_eq!(store.sweep_stats.reclaimed.load(Ordering::Relaxed), 100);
    }
}
