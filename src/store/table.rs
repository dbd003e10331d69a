//! The open-addressing table behind each stripe of the memory store: a
//! power-of-two array of fixed-size slots, linear probing from the slot the
//! hash's low bits name, an empty slot marked inside the slot itself (no
//! separate control bytes), and deletion by backward shift (no tombstones).
//!
//! It exists, instead of `hashbrown`'s table, for one reason: a lookup's
//! first memory access is computable from the hash alone (`base + (hash &
//! mask) * slot size`), so a batch of lookups can prefetch every slot it
//! will read before reading any (see `StripedStore::prefetch`). With the key
//! inline in its slot and no control bytes, the common lookup touches one
//! cache line. The load is kept at most 3/4: linear probing's unsuccessful
//! search (every new key) grows as `1/(1 - load)²`.

/// A slot of a [`SlotTable`]: a small `Copy` value with a reserved empty
/// form.
pub(super) trait TableSlot: Copy {
    /// The empty slot.
    fn empty() -> Self;
    fn is_empty(&self) -> bool;
}

/// Fewest slots a table allocates (a stripe with one key pays for these).
const CAPACITY_MIN: usize = 8;

pub(super) struct SlotTable<T: TableSlot> {
    /// `capacity` slots (0 before the first insert), a power of two.
    slots: Box<[T]>,
    /// `capacity - 1`, or 0 when nothing is allocated.
    mask: usize,
    len: usize,
}

impl<T: TableSlot> Default for SlotTable<T> {
    fn default() -> Self {
        SlotTable {
            slots: Box::new([]),
            mask: 0,
            len: 0,
        }
    }
}

/// Largest number of entries `capacity` slots hold (a load of 3/4).
fn entries_max(capacity: usize) -> usize {
    capacity - capacity / 4
}

impl<T: TableSlot> SlotTable<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The first slot and the index mask, for computing where a hash's probe
    /// starts without the table at hand (prefetching). Null before the
    /// first insert.
    pub fn base(&self) -> (*const T, usize) {
        if self.slots.is_empty() {
            (std::ptr::null(), 0)
        } else {
            (self.slots.as_ptr(), self.mask)
        }
    }

    /// Index of the slot `eq` accepts on `hash`'s probe sequence.
    #[inline(always)]
    fn find_index(&self, hash: u64, mut eq: impl FnMut(&T) -> bool) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut index = hash as usize & self.mask;
        loop {
            let slot = &self.slots[index];
            if slot.is_empty() {
                return None;
            }
            if eq(slot) {
                return Some(index);
            }
            // The load is at most 3/4, so an empty slot ends every probe.
            index = (index + 1) & self.mask;
        }
    }

    #[inline(always)]
    pub fn find(&self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<&T> {
        self.find_index(hash, eq).map(|index| &self.slots[index])
    }

    #[inline(always)]
    pub fn find_mut(&mut self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<&mut T> {
        self.find_index(hash, eq)
            .map(|index| &mut self.slots[index])
    }

    /// Inserts a slot whose key is not in the table. `hash_of` gives a
    /// stored slot's hash (to move slots when the table grows).
    pub fn insert_unique(&mut self, hash: u64, slot: T, hash_of: impl Fn(&T) -> u64) {
        if self.len + 1 > entries_max(self.capacity()) {
            let capacity = (self.capacity() * 2).max(CAPACITY_MIN);
            self.rebuild(capacity, &hash_of);
        }
        self.place(hash, slot);
        self.len += 1;
    }

    /// Puts `slot` in the first empty slot of `hash`'s probe sequence.
    fn place(&mut self, hash: u64, slot: T) {
        let mut index = hash as usize & self.mask;
        while !self.slots[index].is_empty() {
            index = (index + 1) & self.mask;
        }
        self.slots[index] = slot;
    }

    /// Moves every entry into a new array of `capacity` slots.
    fn rebuild(&mut self, capacity: usize, hash_of: &impl Fn(&T) -> u64) {
        let old = std::mem::replace(
            &mut self.slots,
            vec![T::empty(); capacity].into_boxed_slice(),
        );
        self.mask = capacity.saturating_sub(1);
        if capacity == 0 {
            return;
        }
        for slot in old.iter().filter(|slot| !slot.is_empty()) {
            self.place(hash_of(slot), *slot);
        }
    }

    /// Shrinks to the smallest capacity holding `entries` entries (never
    /// below the current length).
    pub fn shrink_to(&mut self, entries: usize, hash_of: impl Fn(&T) -> u64) {
        let entries = entries.max(self.len);
        let mut capacity = if entries == 0 { 0 } else { CAPACITY_MIN };
        while capacity > 0 && entries_max(capacity) < entries {
            capacity *= 2;
        }
        if capacity < self.capacity() {
            self.rebuild(capacity, &hash_of);
        }
    }

    /// Empties slot `hole`, moving later slots of its run back so that every
    /// entry stays reachable from the start of its probe sequence.
    fn remove_at(&mut self, mut hole: usize, hash_of: &impl Fn(&T) -> u64) {
        let mask = self.mask;
        let mut next = (hole + 1) & mask;
        while !self.slots[next].is_empty() {
            let home = hash_of(&self.slots[next]) as usize & mask;
            // The entry at `next` may fill the hole when the hole lies on its
            // probe sequence: from `home` up to `next`, cyclically.
            if next.wrapping_sub(home) & mask >= next.wrapping_sub(hole) & mask {
                self.slots[hole] = self.slots[next];
                hole = next;
            }
            next = (next + 1) & mask;
        }
        self.slots[hole] = T::empty();
        self.len -= 1;
    }

    /// Keeps the entries `keep` accepts. An entry may be offered twice (when
    /// a removal moves it back into a slot already visited), so `keep` must
    /// answer the same for the same entry.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool, hash_of: impl Fn(&T) -> u64) {
        let mut index = 0;
        while index < self.slots.len() {
            let slot = &self.slots[index];
            if !slot.is_empty() && !keep(slot) {
                // A later entry may move into `index`: look at it again.
                self.remove_at(index, &hash_of);
            } else {
                index += 1;
            }
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter(|slot| !slot.is_empty())
    }
}

/// Asks the CPU to bring the cache line at `address` closer (a hint: never
/// faults, whatever the address, and does nothing where unsupported).
#[inline(always)]
pub(crate) fn prefetch_line<T>(address: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch hint reads nothing the program can observe and
    // cannot fault, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// A slot holding a key (0 = empty) and a value.
    #[derive(Clone, Copy, Debug)]
    struct Pair(u32, u32);

    impl TableSlot for Pair {
        fn empty() -> Pair {
            Pair(0, 0)
        }
        fn is_empty(&self) -> bool {
            self.0 == 0
        }
    }

    /// Few distinct hashes, so that runs form and wrap around the end.
    fn crowded_hash(key: u32) -> u64 {
        u64::from(key % 7).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 3
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32),
        Remove(u32),
        RetainOdd,
        Shrink,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u32..60).prop_map(Op::Insert),
            2 => (1u32..60).prop_map(Op::Remove),
            1 => Just(Op::RetainOdd),
            1 => Just(Op::Shrink),
        ]
    }

    proptest! {
        #[test]
        fn table_agrees_with_a_map(ops in proptest::collection::vec(op(), 1..200), crowded in any::<bool>()) {
            let hash = |key: u32| if crowded { crowded_hash(key) } else { u64::from(key).wrapping_mul(0x2545_f491_4f6c_dd1d) };
            let hash_of = |slot: &Pair| hash(slot.0);
            let mut table: SlotTable<Pair> = SlotTable::default();
            let mut model: HashMap<u32, u32> = HashMap::new();
            for (step, op) in ops.into_iter().enumerate() {
                let value = step as u32;
                match op {
                    Op::Insert(key) => match table.find_mut(hash(key), |s| s.0 == key) {
                        Some(slot) => {
                            slot.1 = value;
                            model.insert(key, value);
                        }
                        None => {
                            table.insert_unique(hash(key), Pair(key, value), hash_of);
                            model.insert(key, value);
                        }
                    },
                    Op::Remove(key) => {
                        table.retain(|s| s.0 != key, hash_of);
                        model.remove(&key);
                    }
                    Op::RetainOdd => {
                        table.retain(|s| s.0 % 2 == 1, hash_of);
                        model.retain(|k, _| k % 2 == 1);
                    }
                    Op::Shrink => table.shrink_to(0, hash_of),
                }
                prop_assert_eq!(table.len(), model.len());
                prop_assert!(table.len() <= entries_max(table.capacity()));
                for key in 1..60 {
                    let found = table.find(hash(key), |s| s.0 == key).map(|s| s.1);
                    prop_assert_eq!(found, model.get(&key).copied(), "key {}", key);
                }
                prop_assert_eq!(table.iter().count(), model.len());
            }
        }
    }

    #[test]
    fn an_empty_table_finds_nothing_and_has_no_base() {
        let table: SlotTable<Pair> = SlotTable::default();
        assert!(table.find(5, |_| true).is_none());
        assert!(table.base().0.is_null());
        assert_eq!(table.capacity(), 0);
    }

    #[test]
    fn shrinking_to_nothing_frees_the_slots_and_the_table_still_works() {
        let hash_of = |slot: &Pair| u64::from(slot.0);
        let mut table: SlotTable<Pair> = SlotTable::default();
        for key in 1..100 {
            table.insert_unique(u64::from(key), Pair(key, key), hash_of);
        }
        assert!(table.capacity() >= 128);
        table.retain(|_| false, hash_of);
        table.shrink_to(0, hash_of);
        assert_eq!((table.len(), table.capacity()), (0, 0));
        table.insert_unique(7, Pair(7, 1), hash_of);
        assert_eq!(table.find(7, |s| s.0 == 7).map(|s| s.1), Some(1));
    }
}
