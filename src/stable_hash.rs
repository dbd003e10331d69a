//! A 64-bit hash that every process computes alike (FNV-1a folded through a
//! splitmix64 finalizer, with a seed per purpose). It names what must agree
//! across restarts and across cluster nodes: a rule's counter id
//! ([`crate::rules::CounterId`]), a key's shard and a shard's replicas
//! (`cluster::placement`). In-memory tables use process-seeded hashers
//! instead; never this one.

/// A fixed 64-bit hash of `bytes` under `seed`, the same in every process.
pub fn stable_hash(seed: u64, bytes: &[u8]) -> u64 {
    stable_hash_finish(stable_hash_continue(stable_hash_start(seed), bytes))
}

/// The state of [`stable_hash`] under `seed` before any byte: with
/// [`stable_hash_continue`] and [`stable_hash_finish`], a hash can resume
/// from the state after a prefix it has seen before.
pub const fn stable_hash_start(seed: u64) -> u64 {
    0xcbf2_9ce4_8422_2325 ^ seed
}

/// [`stable_hash`]'s state after `bytes` more (FNV-1a, a byte at a time).
#[inline]
pub const fn stable_hash_continue(mut state: u64, bytes: &[u8]) -> u64 {
    let mut at = 0;
    while at < bytes.len() {
        state ^= bytes[at] as u64;
        state = state.wrapping_mul(0x0000_0100_0000_01b3);
        at += 1;
    }
    state
}

/// The hash of a [`stable_hash_continue`] state.
#[inline]
pub const fn stable_hash_finish(state: u64) -> u64 {
    splitmix64(state)
}

/// The splitmix64 finalizer: spreads every input bit over every output bit.
const fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_fixed_across_processes() {
        // Changing these values reshuffles every cluster's counters and
        // orphans every counter persisted to Redis: only do it together with
        // a format version bump.
        assert_eq!(stable_hash(0, b""), splitmix64(0xcbf2_9ce4_8422_2325));
        assert_eq!(stable_hash(0, b"abc"), 0x29e3_2c04_ec3f_9c30);
        assert_eq!(stable_hash(1, b"abc"), stable_hash(1, b"abc"));
        assert_ne!(stable_hash(1, b"abc"), stable_hash(2, b"abc"));
    }

    #[test]
    fn a_hash_resumed_after_a_prefix_is_the_whole_hash() {
        let key = b"\x01\x02\x03\x04\x05\x06\x07\x08actor-17";
        for split in 0..=key.len() {
            let (head, tail) = key.split_at(split);
            let state = stable_hash_continue(stable_hash_start(7), head);
            assert_eq!(
                stable_hash_finish(stable_hash_continue(state, tail)),
                stable_hash(7, key)
            );
        }
    }
}
