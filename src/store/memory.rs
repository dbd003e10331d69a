//! The in-memory counter store: a power-of-two number of cache-padded,
//! `parking_lot`-locked stripes, each a [`SlotTable`] of 32-byte-aligned
//! slots (open addressing, so that a key's slot can be prefetched before its
//! stripe is locked: [`StripedStore::prefetch`]). A key is hashed once; distinct bit ranges of that hash pick the
//! stripe and the slot, so the two are independent. A short key is laid out
//! as its slot's head in three words, read straight from the key's bytes
//! (no copy through memory), hashed from those words by two folded
//! multiplications and compared as three words; a longer key is hashed
//! with ahash. Callers whose key is an 8-byte prefix and a rest (a rule's
//! identity and an actor) pass the two parts, and no key is assembled.
//!
//! A slot holds the key itself when it is short ([`INLINE_KEY_BYTES_MAX`]
//! bytes) and the state in its packed form ([`StoredState::pack`]), so the
//! common lookup reads the table's control bytes and one cache line, and
//! compares the key without following a pointer. A longer key, or a state
//! too large to pack, is *spilled*: the slot then holds the key's full hash
//! (a fingerprint, compared before anything else) and the index of an entry
//! in the stripe's spill slab, which holds the key and the state.
//!
//! Expired entries read as absent. A sweeper thread reclaims them in bounded
//! steps (one stripe at a time), and a cap on live keys bounds memory: when it
//! is reached and no expired entry can be reclaimed in the key's stripe, the
//! update is refused with [`StoreFull`] and nothing is stored.
//!
//! Beside this file: [`SlotTable`] (`table.rs`), the key's layout and
//! short-key hash (`key.rs`), and a counter state's packed form
//! (`packed.rs`).
//!
//! The store is generic over what it keeps ([`StoredState`]: anything that
//! knows when it expires): rule counters ([`MemoryStore`], the
//! [`CounterState`] store) and droplet's buckets share the same stripes,
//! sweeper and cap.

use super::key::{folded_multiply, KeyBytes, HEAD_SEEDS};
pub use super::packed::PackedCounter;
use super::table::{prefetch_line, SlotTable, TableSlot};
use crate::limiter::CounterState;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Bit offset of the stripe index inside the key hash: above the bits a
/// stripe's table uses for slots in any realistic table.
const STRIPE_HASH_SHIFT: u32 = 40;

/// Longest key kept inside its slot. 23 bytes, with the length byte, make the
/// slot's first 24 bytes: an 8-byte rule identity and an IPv4 address as text
/// fit.
pub const INLINE_KEY_BYTES_MAX: usize = 23;

/// How long an empty store's sweeper sleeps between looks: nothing can
/// expire before a key is stored, and the first sweep after that comes at
/// most this late.
pub const IDLE_SWEEP_PAUSE_MS: u64 = 1_000;

/// The first byte of a spilled slot's head (inline keys store their length,
/// at most [`INLINE_KEY_BYTES_MAX`], there).
const SPILLED: u8 = 0xff;

/// The first byte of an empty slot's head.
const EMPTY: u8 = 0xfe;

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
    /// The state's form inside a slot, beside an inline key: 8 bytes keep a
    /// slot at 32 bytes (two per cache line).
    type Packed: Copy + Send + Default + 'static;

    /// From this instant on the state reads as absent and may be reclaimed.
    fn expires_at_ms(&self) -> u64;

    /// The packed form, or `None` when this value does not fit it (the entry
    /// is then spilled: correct, one pointer further away).
    fn pack(&self) -> Option<Self::Packed>;

    /// The inverse of [`StoredState::pack`].
    fn unpack(packed: Self::Packed) -> Self;
}

/// One slot of a stripe's table: 32 bytes (for an 8-byte packed state),
/// aligned so that a slot never straddles two cache lines.
///
/// `head[0]` is the inline key's length and `head[1..]` its bytes, zero
/// padded, so that comparing a key is comparing 24 bytes; for a spilled
/// entry `head[0]` is [`SPILLED`], `head[4..8]` the slab index and
/// `head[8..16]` the key's full hash.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Slot<P> {
    head: [u8; INLINE_KEY_BYTES_MAX + 1],
    packed: P,
}

impl<P: Copy> Slot<P> {
    /// The head as three little-endian words (as [`KeyBytes::head`] lays a key out).
    #[inline(always)]
    fn head_words(&self) -> [u64; 3] {
        let word = |i: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&self.head[8 * i..8 * i + 8]);
            u64::from_le_bytes(bytes)
        };
        [word(0), word(1), word(2)]
    }

    fn inline(head: [u64; 3], packed: P) -> Slot<P> {
        let mut bytes = [0u8; INLINE_KEY_BYTES_MAX + 1];
        for (chunk, word) in bytes.chunks_exact_mut(8).zip(head) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        Slot {
            head: bytes,
            packed,
        }
    }

    fn inline_key(&self) -> Option<&[u8]> {
        let len = usize::from(self.head[0]);
        (len <= INLINE_KEY_BYTES_MAX).then(|| &self.head[1..1 + len])
    }

    fn spilled(index: u32, hash: u64, packed: P) -> Slot<P> {
        let mut head = [0u8; INLINE_KEY_BYTES_MAX + 1];
        head[0] = SPILLED;
        head[4..8].copy_from_slice(&index.to_le_bytes());
        head[8..16].copy_from_slice(&hash.to_le_bytes());
        Slot { head, packed }
    }

    fn spill_index(&self) -> usize {
        let mut index = [0u8; 4];
        index.copy_from_slice(&self.head[4..8]);
        u32::from_le_bytes(index) as usize
    }

    fn spill_hash(&self) -> u64 {
        let mut hash = [0u8; 8];
        hash.copy_from_slice(&self.head[8..16]);
        u64::from_le_bytes(hash)
    }
}

impl<P: Copy + Default> TableSlot for Slot<P> {
    fn empty() -> Self {
        let mut head = [0u8; INLINE_KEY_BYTES_MAX + 1];
        head[0] = EMPTY;
        Slot {
            head,
            packed: P::default(),
        }
    }

    #[inline(always)]
    fn is_empty(&self) -> bool {
        self.head[0] == EMPTY
    }
}

/// A key as a lookup compares it: hashed once, and when short, laid out as
/// a slot's head.
struct Probe<'k> {
    key: KeyBytes<'k>,
    hash: u64,
    head: Option<[u64; 3]>,
}

/// A spilled entry: a key longer than a slot holds, or a state that does not
/// pack.
struct Spilled<S> {
    key: Box<[u8]>,
    state: S,
}

/// A stripe's spilled entries (rare), kept out of line so that the stripe's
/// lock and table header share one cache line.
struct SpillSlab<S> {
    /// Spilled entries, by the index their slot holds; `None` is free.
    spilled: Vec<Option<Spilled<S>>>,
    /// Free indices of `spilled`.
    spilled_free: Vec<u32>,
}

/// In this order, so that what every lookup and write touches (the table's
/// header, the soonest expiry) lies in the first cache line of the stripe's
/// cell, with the lock, and the slab's box (read only for spilled entries)
/// in the second: a field in the second line cost each store operation a
/// cache miss the stripe prefetch did not cover (docs/benchmarks.md,
/// "Thirty-third round").
#[repr(C)]
struct Stripe<S: StoredState> {
    table: SlotTable<Slot<S::Packed>>,
    /// No entry expires before this (ms): lowered by every state written,
    /// set exactly by each sweep. A sweep skips the stripe until then, so
    /// a store of long-lived counters is not scanned for nothing.
    soonest_expiry_ms: u64,
    spill: Box<SpillSlab<S>>,
}

impl<S: StoredState> Default for Stripe<S> {
    fn default() -> Self {
        Stripe {
            soonest_expiry_ms: u64::MAX,
            table: SlotTable::default(),
            spill: Box::new(SpillSlab {
                spilled: Vec::new(),
                spilled_free: Vec::new(),
            }),
        }
    }
}

/// One stripe, alone in its padded cell: its lock, the table's header and
/// its soonest expiry share the cell's first cache line.
#[repr(C)]
struct StripeCell<S: StoredState> {
    stripe: Mutex<Stripe<S>>,
}

/// Where a stripe's slots are, read without the lock to prefetch a key's
/// slot before locking (a stale value only makes the prefetch useless).
/// Kept apart from the stripes' padded cells, four to a cache line (16 KiB
/// for 1 024 stripes against their cells' 128 KiB), so that a batch's
/// prefetch finds them cached and sends for its slots at once, without
/// first waiting for the stripes' lock lines (docs/benchmarks.md,
/// "Thirty-fifth round").
#[repr(C, align(16))]
struct SlotsHint {
    base: AtomicPtr<u8>,
    mask: AtomicUsize,
}

impl SlotsHint {
    /// Publishes where `stripe`'s table has its slots now (under the
    /// stripe's lock, after anything that may have moved them).
    #[inline(always)]
    fn publish<S: StoredState>(&self, stripe: &Stripe<S>) {
        let (base, mask) = stripe.table.base();
        let base = base.cast::<u8>().cast_mut();
        if self.base.load(Ordering::Relaxed) != base {
            self.base.store(base, Ordering::Relaxed);
            self.mask.store(mask, Ordering::Relaxed);
        }
    }
}

/// Does `slot` hold `probe`'s key? Inline keys compare their 24-byte heads;
/// a spilled entry compares its fingerprint first, then its key. The
/// stripe's slab (out of line) is read only for a spilled slot whose
/// fingerprint matches: reading it on every probe cost a cache miss per
/// store operation once the slabs fell out of cache (docs/benchmarks.md,
/// "Thirty-third round").
#[inline(always)]
fn slot_holds<S: StoredState>(
    slot: &Slot<S::Packed>,
    probe: &Probe<'_>,
    spill: &SpillSlab<S>,
) -> bool {
    if let Some(head) = probe.head {
        if slot.head_words() == head {
            return true;
        }
    }
    slot.head[0] == SPILLED
        && slot.spill_hash() == probe.hash
        && spill
            .spilled
            .get(slot.spill_index())
            .and_then(Option::as_ref)
            .is_some_and(|entry| probe.key.eq_bytes(&entry.key))
}

impl<S: StoredState> Stripe<S> {
    fn state_of(&self, slot: &Slot<S::Packed>) -> Option<S> {
        if slot.head[0] == SPILLED {
            self.spill
                .spilled
                .get(slot.spill_index())
                .and_then(Option::as_ref)
                .map(|entry| entry.state)
        } else {
            Some(S::unpack(slot.packed))
        }
    }

    fn key_of<'a>(&'a self, slot: &'a Slot<S::Packed>) -> &'a [u8] {
        match slot.inline_key() {
            Some(key) => key,
            None => self
                .spill
                .spilled
                .get(slot.spill_index())
                .and_then(Option::as_ref)
                .map_or(&[], |entry| &entry.key),
        }
    }

    /// Puts an entry into the spill slab; returns its index.
    fn spill(
        spilled: &mut Vec<Option<Spilled<S>>>,
        free: &mut Vec<u32>,
        key: KeyBytes<'_>,
        state: S,
    ) -> u32 {
        let entry = Some(Spilled {
            key: key.to_boxed(),
            state,
        });
        match free.pop() {
            Some(index) => {
                spilled[index as usize] = entry;
                index
            }
            None => {
                spilled.push(entry);
                // The cap on live keys is far below 2^32 entries per stripe.
                u32::try_from(spilled.len() - 1).unwrap_or(u32::MAX)
            }
        }
    }

    fn unspill(spilled: &mut [Option<Spilled<S>>], free: &mut Vec<u32>, slot: &Slot<S::Packed>) {
        if slot.head[0] == SPILLED {
            let index = slot.spill_index();
            if let Some(entry) = spilled.get_mut(index) {
                *entry = None;
                free.push(index as u32);
            }
        }
    }

    /// Removes every slot `doomed` selects (given its key and state); returns
    /// how many were removed.
    fn remove_slots(
        &mut self,
        mut doomed: impl FnMut(&[u8], Option<S>) -> bool,
        hash_of: impl Fn(&Slot<S::Packed>) -> u64,
    ) -> usize {
        let before = self.table.len();
        let Stripe { table, spill, .. } = self;
        let SpillSlab {
            spilled,
            spilled_free,
        } = &mut **spill;
        table.retain(
            |slot| {
                let (key, state): (&[u8], Option<S>) = match slot.inline_key() {
                    Some(key) => (key, Some(S::unpack(slot.packed))),
                    None => match spilled.get(slot.spill_index()).and_then(Option::as_ref) {
                        Some(entry) => (&entry.key, Some(entry.state)),
                        None => (&[], None),
                    },
                };
                if doomed(key, state) {
                    Self::unspill(spilled, spilled_free, slot);
                    false
                } else {
                    true
                }
            },
            hash_of,
        );
        if spilled_free.len() == spilled.len() && !spilled.is_empty() {
            // Nothing spilled is left: give the slab's memory back.
            *spilled = Vec::new();
            *spilled_free = Vec::new();
        }
        before - self.table.len()
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
            // Small tables: a table grows (rehashes) under its stripe's lock,
            // and a small one does so in microseconds (256 stripes let inserts
            // wait over a millisecond at 1 M counters; 4096 make the lock
            // lines themselves miss the cache: docs/benchmarks.md).
            stripes: 1024,
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

pub struct StripedStore<S: StoredState> {
    stripes: Box<[CachePadded<StripeCell<S>>]>,
    /// Each stripe's [`SlotsHint`], by the same index.
    hints: Box<[SlotsHint]>,
    stripe_mask: usize,
    hasher: ahash::RandomState,
    live_keys: AtomicUsize,
    live_keys_max: usize,
    pub sweep_stats: SweepStats,
    /// Tests: every key gets this hash (one stripe, one fingerprint).
    #[cfg(test)]
    colliding_hash: Option<u64>,
}

impl<S: StoredState> StripedStore<S> {
    pub fn new(config: MemoryStoreConfig) -> Self {
        let stripes = config.stripes.max(1).next_power_of_two();
        StripedStore {
            stripes: (0..stripes)
                .map(|_| {
                    CachePadded::new(StripeCell {
                        stripe: Mutex::new(Stripe::default()),
                    })
                })
                .collect(),
            hints: (0..stripes)
                .map(|_| SlotsHint {
                    base: AtomicPtr::new(std::ptr::null_mut()),
                    mask: AtomicUsize::new(0),
                })
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
            #[cfg(test)]
            colliding_hash: None,
        }
    }

    /// A key ready to look up: its head (when short) and its hash, from the
    /// head's words when short, else from its bytes.
    #[inline(always)]
    fn probe<'k>(&self, key: KeyBytes<'k>) -> Probe<'k> {
        let head = key.head();
        let hash = match head {
            Some(head) => self.head_hash(head),
            None => self.long_key_hash(key),
        };
        Probe { key, hash, head }
    }

    #[inline(always)]
    fn head_hash(&self, [a, b, c]: [u64; 3]) -> u64 {
        #[cfg(test)]
        if let Some(hash) = self.colliding_hash {
            return hash;
        }
        let [s0, s1, s2, s3] = HEAD_SEEDS;
        folded_multiply(folded_multiply(a ^ s0, b ^ s1) ^ c ^ s2, s3)
    }

    fn long_key_hash(&self, key: KeyBytes<'_>) -> u64 {
        #[cfg(test)]
        if let Some(hash) = self.colliding_hash {
            return hash;
        }
        match key {
            KeyBytes::Whole(key) => self.hasher.hash_one(key),
            KeyBytes::Prefixed(..) => self.hasher.hash_one(&*key.to_boxed()),
        }
    }

    fn slot_hash(&self, slot: &Slot<S::Packed>) -> u64 {
        if slot.head[0] == SPILLED {
            slot.spill_hash()
        } else {
            self.head_hash(slot.head_words())
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

    #[inline(always)]
    fn stripe_of(&self, hash: u64) -> &StripeCell<S> {
        &self.stripes[self.stripe_index(hash)]
    }

    #[inline(always)]
    fn stripe_index(&self, hash: u64) -> usize {
        (hash >> STRIPE_HASH_SHIFT) as usize & self.stripe_mask
    }

    #[inline(always)]
    fn hint_of(&self, hash: u64) -> &SlotsHint {
        &self.hints[self.stripe_index(hash)]
    }

    /// Asks the CPU to fetch what a lookup of `key` will read first (its
    /// stripe's lock line and the first slot of its probe), so that a batch
    /// that prefetches all its keys before deciding any waits for their
    /// cache misses together rather than one after another.
    #[inline(always)]
    pub fn prefetch(&self, key: &[u8]) {
        self.prefetch_probe(&self.probe(KeyBytes::Whole(key)));
    }

    /// [`StripedStore::prefetch`] of the key `prefix` followed by `rest`.
    #[inline(always)]
    pub fn prefetch_prefixed(&self, prefix: u64, rest: &[u8]) {
        self.prefetch_probe(&self.probe(KeyBytes::Prefixed(prefix, rest)));
    }

    #[inline(always)]
    fn prefetch_probe(&self, probe: &Probe<'_>) {
        self.prefetch_stripe(probe.hash);
        self.prefetch_slot(probe.hash);
    }

    /// The hash a lookup of `key` uses, for [`StripedStore::prefetch_stripe`]
    /// and [`StripedStore::prefetch_slot`].
    #[inline(always)]
    pub fn key_hash(&self, key: &[u8]) -> u64 {
        self.probe(KeyBytes::Whole(key)).hash
    }

    /// [`StripedStore::key_hash`] of the key `prefix` followed by `rest`.
    #[inline(always)]
    pub fn key_hash_prefixed(&self, prefix: u64, rest: &[u8]) -> u64 {
        self.probe(KeyBytes::Prefixed(prefix, rest)).hash
    }

    /// Prefetches the stripes, then the first slots, of the keys whose
    /// [`StripedStore::key_hash`]es are `hashes`: every miss of the batch
    /// is sent for before any is waited on (a slot's address comes from its
    /// stripe's [`SlotsHint`], which is usually cached).
    pub fn prefetch_hashes(&self, hashes: &[u64]) {
        for &hash in hashes {
            self.prefetch_stripe(hash);
        }
        for &hash in hashes {
            self.prefetch_slot(hash);
        }
    }

    /// The first half of a prefetch in two passes: the stripe's lock line
    /// (with the table's header). Computing the address reads nothing, so a
    /// batch can issue this for every key without waiting.
    #[inline(always)]
    pub fn prefetch_stripe(&self, hash: u64) {
        prefetch_line(self.stripe_of(hash));
    }

    /// The second half: the key's first slot, whose address is read from the
    /// stripe's [`SlotsHint`] (a small array that stays cached).
    #[inline(always)]
    pub fn prefetch_slot(&self, hash: u64) {
        let hint = self.hint_of(hash);
        let base = hint.base.load(Ordering::Relaxed);
        if !base.is_null() {
            let mask = hint.mask.load(Ordering::Relaxed);
            let offset = (hash as usize & mask) * std::mem::size_of::<Slot<S::Packed>>();
            prefetch_line(base.wrapping_add(offset));
        }
    }

    /// Reads a key's state (`None` when absent or expired).
    pub fn get(&self, key: &[u8], now_ms: u64) -> Option<S> {
        self.get_probe(&self.probe(KeyBytes::Whole(key)), now_ms)
    }

    /// [`StripedStore::get`] of the key `prefix` (8 bytes, little endian)
    /// followed by `rest`, without assembling it.
    pub fn get_prefixed(&self, prefix: u64, rest: &[u8], now_ms: u64) -> Option<S> {
        self.get_probe(&self.probe(KeyBytes::Prefixed(prefix, rest)), now_ms)
    }

    fn get_probe(&self, probe: &Probe<'_>, now_ms: u64) -> Option<S> {
        let hash = probe.hash;
        let stripe = self.stripe_of(hash).stripe.lock();
        let slot = stripe
            .table
            .find(hash, |slot| slot_holds(slot, probe, &stripe.spill))?;
        stripe.state_of(slot).filter(|s| s.expires_at_ms() > now_ms)
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
        self.update_probe(&self.probe(KeyBytes::Whole(key)), now_ms, step)
    }

    /// [`StripedStore::update`] of the key `prefix` (8 bytes, little endian)
    /// followed by `rest`, without assembling it.
    pub fn update_prefixed<R>(
        &self,
        prefix: u64,
        rest: &[u8],
        now_ms: u64,
        step: impl FnOnce(Option<S>) -> (R, Option<S>),
    ) -> Result<R, StoreFull> {
        self.update_probe(&self.probe(KeyBytes::Prefixed(prefix, rest)), now_ms, step)
    }

    #[inline(always)]
    fn update_probe<R>(
        &self,
        probe: &Probe<'_>,
        now_ms: u64,
        step: impl FnOnce(Option<S>) -> (R, Option<S>),
    ) -> Result<R, StoreFull> {
        let (key, hash) = (probe.key, probe.hash);
        let index = self.stripe_index(hash);
        let (cell, hint) = (&self.stripes[index], &self.hints[index]);
        let mut guard = cell.stripe.lock();
        let stripe = &mut *guard;
        let Stripe {
            table,
            spill,
            soonest_expiry_ms,
        } = stripe;
        if let Some(slot) = table.find_mut(hash, |slot| slot_holds(slot, probe, spill)) {
            // The slab is reached through its box only for a spilled entry.
            let SpillSlab {
                spilled,
                spilled_free,
            } = &mut **spill;
            if slot.head[0] == SPILLED {
                let Some(entry) = spilled.get_mut(slot.spill_index()).and_then(Option::as_mut)
                else {
                    unreachable!("a spilled slot points at its entry");
                };
                let current = Some(entry.state).filter(|s| s.expires_at_ms() > now_ms);
                let (result, new_state) = step(current);
                if let Some(state) = new_state {
                    *soonest_expiry_ms = (*soonest_expiry_ms).min(state.expires_at_ms());
                    entry.state = state;
                }
                return Ok(result);
            }
            let current = Some(S::unpack(slot.packed)).filter(|s| s.expires_at_ms() > now_ms);
            let (result, new_state) = step(current);
            if let Some(state) = new_state {
                *soonest_expiry_ms = (*soonest_expiry_ms).min(state.expires_at_ms());
                match state.pack() {
                    Some(packed) => slot.packed = packed,
                    None => {
                        // The state outgrew its packed form: move it to the slab.
                        let index = Stripe::spill(spilled, spilled_free, key, state);
                        *slot = Slot::spilled(index, hash, S::Packed::default());
                    }
                }
            }
            return Ok(result);
        }
        let (result, new_state) = step(None);
        let Some(state) = new_state else {
            return Ok(result);
        };
        stripe.soonest_expiry_ms = stripe.soonest_expiry_ms.min(state.expires_at_ms());
        if !self.reserve_live_key() {
            // Full: reclaim what has expired in this stripe, then try once more.
            self.sweep_locked(stripe, now_ms);
            hint.publish(stripe);
            if !self.reserve_live_key() {
                return Err(StoreFull {
                    live_keys_max: self.live_keys_max,
                });
            }
        }
        let slot = match (probe.head, state.pack()) {
            (Some(head), Some(packed)) => Slot::inline(head, packed),
            _ => {
                let spill = &mut *stripe.spill;
                let index = Stripe::spill(&mut spill.spilled, &mut spill.spilled_free, key, state);
                Slot::spilled(index, hash, S::Packed::default())
            }
        };
        stripe
            .table
            .insert_unique(hash, slot, |slot| self.slot_hash(slot));
        hint.publish(stripe);
        Ok(result)
    }

    fn reserve_live_key(&self) -> bool {
        self.live_keys
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.live_keys_max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Reclaims the stripe's expired entries, unless none can have expired
    /// yet; returns how many.
    fn sweep_locked(&self, stripe: &mut Stripe<S>, now_ms: u64) -> usize {
        let reclaimed = if now_ms < stripe.soonest_expiry_ms {
            0
        } else {
            let mut soonest = u64::MAX;
            let reclaimed = stripe.remove_slots(
                |_, state| {
                    let expires_at_ms = state.map_or(0, |s| s.expires_at_ms());
                    if expires_at_ms > now_ms {
                        soonest = soonest.min(expires_at_ms);
                        return false;
                    }
                    true
                },
                |slot| self.slot_hash(slot),
            );
            stripe.soonest_expiry_ms = soonest;
            reclaimed
        };
        if reclaimed > 0 {
            self.live_keys.fetch_sub(reclaimed, Ordering::AcqRel);
            self.sweep_stats
                .reclaimed
                .fetch_add(reclaimed as u64, Ordering::Relaxed);
        }
        // Give memory back after a burst of keys, but never churn small tables.
        let len = stripe.table.len();
        if stripe.table.capacity() > 64 && stripe.table.capacity() > len * 4 {
            stripe.table.shrink_to(len * 2, |slot| self.slot_hash(slot));
        }
        reclaimed
    }

    /// Sweeps stripes starting at `first`, until at least `entries_budget`
    /// entries were examined (a stripe none of whose entries can have
    /// expired yet is passed over, examining none) or every stripe was
    /// visited once. Returns the
    /// stripe to start from next time. Each stripe is locked only while it is
    /// swept, so a sweep never pauses the whole store.
    pub fn sweep_step(&self, first: usize, entries_budget: usize, now_ms: u64) -> usize {
        let mut index = first & self.stripe_mask;
        let mut examined = 0;
        for _ in 0..self.stripes.len() {
            let cell = &self.stripes[index];
            let mut stripe = cell.stripe.lock();
            if now_ms >= stripe.soonest_expiry_ms {
                examined += stripe.table.len();
            }
            self.sweep_locked(&mut stripe, now_ms);
            self.hints[index].publish(&stripe);
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
            let mut stripe = stripe.stripe.lock();
            let gone = stripe.remove_slots(|key, _| doomed(key), |slot| self.slot_hash(slot));
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
            let stripe = stripe.stripe.lock();
            Self::visit_stripe(&stripe, now_ms, &mut visit);
        }
    }

    /// Visits the live entries of one locked stripe; returns how many.
    fn visit_stripe(stripe: &Stripe<S>, now_ms: u64, visit: &mut impl FnMut(&[u8], S)) -> usize {
        let mut visited = 0;
        for slot in stripe.table.iter() {
            if let Some(state) = stripe.state_of(slot) {
                if state.expires_at_ms() > now_ms {
                    visit(stripe.key_of(slot), state);
                    visited += 1;
                }
            }
        }
        visited
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
            let stripe = self.stripes[index].stripe.lock();
            visited_entries += Self::visit_stripe(&stripe, now_ms, &mut visit);
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
    /// until the store is dropped. While the store holds nothing, it looks
    /// only every [`IDLE_SWEEP_PAUSE_MS`] (an idle server wakes less).
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
                let idle_pause = tick.max(Duration::from_millis(IDLE_SWEEP_PAUSE_MS));
                let mut next = 0;
                let mut pause = tick;
                loop {
                    std::thread::sleep(pause);
                    let Some(store) = store.upgrade() else { return };
                    if store.live_keys() == 0 {
                        pause = idle_pause;
                        continue;
                    }
                    pause = tick;
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
    use super::super::packed::PACK_COUNT_BITS;
    use super::*;
    use crate::limiter::FullAt;
    use crate::limiter::{fixed_window_hit, WindowQuota};

    fn hit(store: &MemoryStore, key: &[u8], now_ms: u64) -> Result<bool, StoreFull> {
        let quota = WindowQuota::new(2, 1).unwrap();
        store.update(key, now_ms, |s| {
            let (d, new) = fixed_window_hit(s, quota, now_ms);
            (d.allowed, new)
        })
    }

    /// What every operation reads of a stripe (its lock, the table's
    /// header, the soonest expiry) lies in the one cache line the stripe
    /// prefetch fetches: the cell's first.
    #[test]
    fn a_stripes_hot_fields_share_the_cells_first_line() {
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let cell: &StripeCell<CounterState> = &store.stripes[0];
        let base = std::ptr::from_ref(cell) as usize;
        assert_eq!(base % 64, 0, "cells start on a line");
        let stripe = cell.stripe.lock();
        let end = |field: usize, size: usize| field + size - base;
        let table = std::ptr::from_ref(&stripe.table) as usize;
        let soonest = std::ptr::from_ref(&stripe.soonest_expiry_ms) as usize;
        assert!(end(table, std::mem::size_of_val(&stripe.table)) <= 64);
        assert!(end(soonest, 8) <= 64);
    }

    /// The slot hints a prefetch reads first are packed four to a line,
    /// apart from the padded cells, and follow each table as it moves.
    #[test]
    fn slot_hints_are_packed_and_follow_their_tables() {
        assert_eq!(std::mem::size_of::<SlotsHint>(), 16);
        let store = MemoryStore::new(MemoryStoreConfig::default());
        assert_eq!(store.hints.len(), store.stripes.len());
        let quota = WindowQuota::new(1_000, 60).unwrap();
        for n in 0..20_000u32 {
            let key = format!("k{n}");
            store
                .update(key.as_bytes(), 0, |s| {
                    let (d, new) = fixed_window_hit(s, quota, 0);
                    (d.allowed, new)
                })
                .unwrap();
        }
        for (cell, hint) in store.stripes.iter().zip(store.hints.iter()) {
            let stripe = cell.stripe.lock();
            let (base, mask) = stripe.table.base();
            assert_eq!(
                hint.base.load(Ordering::Relaxed),
                base.cast::<u8>().cast_mut()
            );
            assert_eq!(hint.mask.load(Ordering::Relaxed), mask);
        }
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

    fn colliding_store(live_keys_max: usize) -> MemoryStore {
        let mut store = MemoryStore::new(MemoryStoreConfig {
            stripes: 4,
            live_keys_max,
        });
        store.colliding_hash = Some(0x5a5a_5a5a_5a5a_5a5a);
        store
    }

    #[test]
    fn slots_are_32_bytes_and_aligned() {
        assert_eq!(std::mem::size_of::<Slot<PackedCounter>>(), 32);
        assert_eq!(std::mem::align_of::<Slot<PackedCounter>>(), 32);
    }

    #[test]
    fn long_keys_and_keys_colliding_on_the_fingerprint_are_kept_apart() {
        // Every key has the same hash: same stripe, same tag, same fingerprint.
        let store = colliding_store(1000);
        let long_a = [b'a'; INLINE_KEY_BYTES_MAX + 1];
        let mut long_b = long_a;
        long_b[INLINE_KEY_BYTES_MAX] = b'b';
        let inline_max = [b'a'; INLINE_KEY_BYTES_MAX];
        let keys: [&[u8]; 7] = [
            b"",
            b"a",
            b"a\0",
            &inline_max,
            &long_a,
            &long_b,
            &[b'x'; 200],
        ];
        for (i, key) in keys.iter().enumerate() {
            for _ in 0..=i {
                hit_many(&store, key, 0);
            }
        }
        assert_eq!(store.live_keys(), keys.len());
        for (i, key) in keys.iter().enumerate() {
            assert_eq!(
                store.get(key, 0),
                Some(CounterState::Window {
                    end_ms: 1000,
                    used: i as u64 + 1
                }),
                "key {i}"
            );
        }
        assert!(store.get(b"b", 0).is_none());
        assert!(store.get(&[b'a'; 30], 0).is_none());
        let mut seen: Vec<Vec<u8>> = Vec::new();
        store.for_each_live(0, |key, _| seen.push(key.to_vec()));
        seen.sort();
        let mut expected: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
        expected.sort();
        assert_eq!(seen, expected);
        assert_eq!(
            store.remove_where(|key| key.len() > INLINE_KEY_BYTES_MAX),
            3
        );
        assert!(store.get(&long_a, 0).is_none());
        assert!(store.get(&inline_max, 0).is_some());
        assert_eq!(store.live_keys(), 4);
    }

    /// A fixed-window hit with a large limit, so counts can outgrow the
    /// packed form.
    fn hit_many(store: &MemoryStore, key: &[u8], now_ms: u64) {
        let quota = WindowQuota::new(u64::MAX / 2, 1).unwrap();
        store
            .update(key, now_ms, |s| fixed_window_hit(s, quota, now_ms))
            .unwrap();
    }

    #[test]
    fn a_count_that_outgrows_its_packed_form_spills_and_keeps_counting() {
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let big = CounterState::Window {
            end_ms: 1000,
            used: (1 << PACK_COUNT_BITS) - 1,
        };
        store.merge(b"k", big, 0).unwrap();
        assert_eq!(store.get(b"k", 0), Some(big));
        hit_many(&store, b"k", 1);
        assert_eq!(
            store.get(b"k", 1),
            Some(CounterState::Window {
                end_ms: 1000,
                used: 1 << PACK_COUNT_BITS
            })
        );
        hit_many(&store, b"k", 2);
        assert_eq!(store.live_keys(), 1);
        assert_eq!(store.sweep_step(0, usize::MAX, 1000), 0);
        assert_eq!(store.live_keys(), 0);
        assert!(store.get(b"k", 0).is_none());
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;
        use std::collections::HashMap;

        fn counter_state() -> impl Strategy<Value = CounterState> {
            let n = prop_oneof![0u64..4, 0u64..(1 << 21), any::<u64>()];
            let ms = prop_oneof![0u64..3000, 0u64..(1 << 43), any::<u64>()];
            prop_oneof![
                (ms.clone(), n.clone())
                    .prop_map(|(end_ms, used)| CounterState::Window { end_ms, used }),
                (ms.clone(), n.clone()).prop_map(|(ms, r)| CounterState::TokenBucket {
                    full_at: FullAt::from_parts(ms, r)
                }),
                (ms, n.clone(), n).prop_map(|(expires_at_ms, current, previous)| {
                    CounterState::SlidingWindow {
                        expires_at_ms,
                        current,
                        previous,
                    }
                }),
            ]
        }

        #[derive(Debug, Clone)]
        enum Op {
            Merge(Vec<u8>, CounterState),
            Hit(Vec<u8>),
            Get(Vec<u8>),
            Sweep,
            RemoveLong,
            Tick,
        }

        fn key() -> impl Strategy<Value = Vec<u8>> {
            // Few distinct keys of every length around the inline limit.
            (0usize..6, prop_oneof![0usize..3, 20usize..27, 40usize..45])
                .prop_map(|(c, len)| vec![b'a' + c as u8; len])
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                2 => (key(), counter_state()).prop_map(|(k, s)| Op::Merge(k, s)),
                4 => key().prop_map(Op::Hit),
                2 => key().prop_map(Op::Get),
                1 => Just(Op::Sweep),
                1 => Just(Op::RemoveLong),
                1 => Just(Op::Tick),
            ]
        }

        proptest! {
            #[test]
            fn packing_round_trips_or_declines(state in counter_state()) {
                if let Some(packed) = state.pack() {
                    prop_assert_eq!(CounterState::unpack(packed), state);
                }
            }

            /// The store agrees with a plain map, with real and with
            /// colliding hashes, whatever the keys' lengths and states.
            #[test]
            fn store_agrees_with_a_map(ops in proptest::collection::vec(op(), 1..120), collide in any::<bool>()) {
                let store = if collide {
                    colliding_store(usize::MAX)
                } else {
                    MemoryStore::new(MemoryStoreConfig { stripes: 2, live_keys_max: usize::MAX })
                };
                let mut model: HashMap<Vec<u8>, CounterState> = HashMap::new();
                let mut now = 0u64;
                let quota = WindowQuota::new(1 << 21, 2).unwrap();
                for op in ops {
                    let live = |m: &HashMap<Vec<u8>, CounterState>, k: &[u8], now: u64| {
                        m.get(k).copied().filter(|s| s.expires_at_ms() > now)
                    };
                    match op {
                        Op::Merge(k, s) => {
                            let merged = match live(&model, &k, now) {
                                Some(current) => current.merge(s),
                                None => s,
                            };
                            if merged.expires_at_ms() > now {
                                model.insert(k.clone(), merged);
                            }
                            store.merge(&k, s, now).unwrap();
                        }
                        Op::Hit(k) => {
                            let (expected, new) = fixed_window_hit(live(&model, &k, now), quota, now);
                            if let Some(new) = new {
                                model.insert(k.clone(), new);
                            }
                            let got = store.update(&k, now, |s| fixed_window_hit(s, quota, now)).unwrap();
                            prop_assert_eq!(got, expected);
                        }
                        Op::Get(k) => prop_assert_eq!(store.get(&k, now), live(&model, &k, now)),
                        Op::Sweep => {
                            store.sweep_step(0, usize::MAX, now);
                            model.retain(|_, s| s.expires_at_ms() > now);
                        }
                        Op::RemoveLong => {
                            let before = model.len();
                            model.retain(|k, _| k.len() <= INLINE_KEY_BYTES_MAX);
                            prop_assert_eq!(store.remove_where(|k| k.len() > INLINE_KEY_BYTES_MAX), before - model.len());
                        }
                        Op::Tick => now += 700,
                    }
                    prop_assert_eq!(store.live_keys(), model.len());
                }
                let mut seen = Vec::new();
                store.for_each_live(now, |k, s| seen.push((k.to_vec(), s)));
                seen.sort_by(|a, b| a.0.cmp(&b.0));
                let mut expected: Vec<(Vec<u8>, CounterState)> = model
                    .into_iter()
                    .filter(|(_, s)| s.expires_at_ms() > now)
                    .collect();
                expected.sort_by(|a, b| a.0.cmp(&b.0));
                prop_assert_eq!(seen, expected);
            }
        }
    }

    /// A key's head words are its slot's bytes (length, key, zeros), for
    /// every inline length, whole or as prefix and rest.
    #[test]
    fn heads_lay_keys_out_as_slots_hold_them() {
        let bytes: Vec<u8> = (1..=40).collect();
        for len in 0..=INLINE_KEY_BYTES_MAX + 1 {
            let key = &bytes[..len];
            let head = KeyBytes::Whole(key).head();
            if len > INLINE_KEY_BYTES_MAX {
                assert!(head.is_none());
                continue;
            }
            let slot = Slot::inline(head.unwrap(), PackedCounter::default());
            let mut expected = [0u8; INLINE_KEY_BYTES_MAX + 1];
            expected[0] = len as u8;
            expected[1..1 + len].copy_from_slice(key);
            assert_eq!(slot.head, expected, "len {len}");
            assert_eq!(slot.head_words(), head.unwrap());
            assert_eq!(slot.inline_key(), Some(key));
            if len >= 8 {
                let prefix = u64::from_le_bytes(key[..8].try_into().unwrap());
                let parts = KeyBytes::Prefixed(prefix, &key[8..]);
                assert_eq!(parts.head(), head, "len {len}");
                assert!(parts.eq_bytes(key));
                assert_eq!(&*parts.to_boxed(), key);
            }
        }
        let prefix = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        let long = KeyBytes::Prefixed(prefix, &bytes[8..30]);
        assert!(long.head().is_none());
        assert!(long.eq_bytes(&bytes[..30]) && !long.eq_bytes(&bytes[..29]));
    }

    /// A key given as prefix and rest is the same counter as the assembled
    /// key, inline or spilled.
    #[test]
    fn prefixed_keys_are_the_assembled_keys() {
        for collide in [false, true] {
            let store = if collide {
                colliding_store(usize::MAX)
            } else {
                MemoryStore::new(MemoryStoreConfig::default())
            };
            for rest_len in [0usize, 7, 15, 16, 30] {
                let rest = vec![b'r'; rest_len];
                let prefix = 0x0102_0304_0506_0708_u64 + rest_len as u64;
                let mut key = prefix.to_le_bytes().to_vec();
                key.extend_from_slice(&rest);
                let quota = WindowQuota::new(3, 1).unwrap();
                let hit_prefixed = || {
                    store
                        .update_prefixed(prefix, &rest, 0, |s| {
                            let (d, new) = fixed_window_hit(s, quota, 0);
                            (d.credit, new)
                        })
                        .unwrap()
                };
                assert_eq!(hit_prefixed(), 2);
                assert_eq!(
                    store
                        .update(&key, 0, |s| fixed_window_hit(s, quota, 0))
                        .unwrap()
                        .credit,
                    1
                );
                assert_eq!(hit_prefixed(), 0);
                assert_eq!(store.get(&key, 0), store.get_prefixed(prefix, &rest, 0));
                assert!(store.get(&key, 0).is_some());
            }
            assert_eq!(store.live_keys(), 5);
        }
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

    #[test]
    fn a_sweep_passes_over_stripes_with_nothing_due_yet_misses_nothing_due() {
        let store = MemoryStore::new(MemoryStoreConfig {
            stripes: 1,
            live_keys_max: 1000,
        });
        let window = |seconds| WindowQuota::new(100, seconds).unwrap();
        let hit_for = |key: &[u8], seconds, now_ms| {
            store
                .update(key, now_ms, |s| {
                    let (d, new) = fixed_window_hit(s, window(seconds), now_ms);
                    (d.allowed, new)
                })
                .unwrap()
        };
        // An hour-long counter: a sweep finds nothing due until it ends, and
        // a budget of one entry is spent on nothing.
        hit_for(b"hour", 3600, 0);
        assert_eq!(store.sweep_step(0, 1, 10), 0);
        assert_eq!(store.live_keys(), 1);
        // A minute-long counter written after that sweep is reclaimed once
        // it ends, though the sweep before had seen only the hour.
        hit_for(b"minute", 60, 20);
        store.sweep_step(0, 1, 59_000);
        assert_eq!(store.live_keys(), 2, "nothing ended yet");
        store.sweep_step(0, 1, 61_000);
        assert_eq!(store.live_keys(), 1);
        assert!(store.get(b"hour", 61_000).is_some());
        // Updating a counter can only keep its stripe due no later.
        hit_for(b"hour", 3600, 61_000);
        store.sweep_step(0, 1, 3_599_000);
        assert_eq!(store.live_keys(), 1);
        store.sweep_step(0, 1, 3_601_000);
        assert_eq!(store.live_keys(), 0);
        assert_eq!(store.sweep_stats.reclaimed.load(Ordering::Relaxed), 2);
    }
}
