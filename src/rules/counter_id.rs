//! A rule's counter identity: one `u64` computed when the rule is validated,
//! from what identifies a rule's counters (SPEC §4: the canonical operation,
//! the limit, the period and the algorithm). Rules that agree on it share
//! counters, a reload keeps it, and every process and every cluster node
//! computes the same value ([`crate::stable_hash`]), so one id serves the
//! memory store's keys, persistence and the cluster's placement alike.

use crate::stable_hash::stable_hash;

/// Seed of the counter id hash. Changing it orphans every counter persisted
/// or replicated under the old ids.
const COUNTER_SEED: u64 = 0x434f_554e_5445_5231; // "COUNTER1"

/// Identifies one rule's counters (each actor of the rule has one counter,
/// keyed by this id followed by the actor, [`CounterId::write_key`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterId(pub u64);

impl CounterId {
    /// Bytes of the id at the start of a counter key.
    pub const KEY_BYTES: usize = 8;

    /// The id of the counters of a rule with this canonical operation (keys
    /// sorted as divvy sorts them), limit, period in milliseconds and
    /// algorithm name.
    pub fn of(
        canonical_operation: &str,
        credit_limit: u64,
        period_ms: u64,
        algorithm: &str,
    ) -> CounterId {
        let mut bytes = Vec::with_capacity(canonical_operation.len() + 32);
        bytes.extend_from_slice(canonical_operation.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(&credit_limit.to_le_bytes());
        bytes.extend_from_slice(&period_ms.to_le_bytes());
        bytes.extend_from_slice(algorithm.as_bytes());
        CounterId(stable_hash(COUNTER_SEED, &bytes))
    }

    /// Writes the key of one actor's counter into `buf`: the id (8 bytes,
    /// little endian), then the actor's bytes.
    pub fn write_key(self, buf: &mut Vec<u8>, actor: &[u8]) {
        buf.clear();
        buf.extend_from_slice(&self.0.to_le_bytes());
        buf.extend_from_slice(actor);
    }

    /// Splits a counter key back into its id and its actor (the inverse of
    /// [`CounterId::write_key`]); `None` for a key too short to hold an id.
    pub fn split_key(key: &[u8]) -> Option<(CounterId, &[u8])> {
        let (id, actor) = key.split_first_chunk::<{ CounterId::KEY_BYTES }>()?;
        Some((CounterId(u64::from_le_bytes(*id)), actor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_fixed_and_follow_the_rule_identity() {
        // The value every node and every persisted counter relies on.
        let a = CounterId::of("method=GET", 10, 60_000, "fixed-window");
        assert_eq!(a, CounterId(0xec2d_90e8_5ca1_c278));
        assert_ne!(a, CounterId::of("method=GET", 11, 60_000, "fixed-window"));
        assert_ne!(a, CounterId::of("method=GET", 10, 61_000, "fixed-window"));
        assert_ne!(a, CounterId::of("method=PUT", 10, 60_000, "fixed-window"));
        assert_ne!(a, CounterId::of("method=GET", 10, 60_000, "token-bucket"));
    }

    #[test]
    fn keys_split_back_into_id_and_actor() {
        let mut key = Vec::new();
        CounterId(7).write_key(&mut key, b"1.2.3.4");
        assert_eq!(key.len(), CounterId::KEY_BYTES + 7);
        assert_eq!(
            CounterId::split_key(&key),
            Some((CounterId(7), b"1.2.3.4".as_slice()))
        );
        assert_eq!(CounterId::split_key(&key[..7]), None);
    }
}
