//! Denials a node remembers for the counters it forwards ([`DenialCache`],
//! one per serving thread): once a shard's leader answers a fixed-window
//! hit `false`, the counter stays exhausted until its window resets (a
//! fixed window's count only grows within the window), so this node
//! answers that counter's later hits `false` itself instead of forwarding
//! each one. Under abusive load, where most hits are denials of a few
//! counters, a denied hit then costs what it costs on one node.
//!
//! It never admits: a remembered denial stands in for the leader's
//! answer only while the leader's would be the same, until a second
//! before the reset the leader announced, reckoned from when the hit was
//! sent (the leader decided after that, and rounds its seconds). A new
//! leader after a failover that has fewer of the window's hits than the
//! old one had may admit some that this node still denies until the
//! reset: under-admission, never over.

use super::SlotBoard;
use crate::cluster::data_frames::OpView;
use crate::cluster::dataplane::DataPlane;
use crate::limiter::Decision;

/// Whether a denial of `op` may be remembered and stand for later hits:
/// a fixed window's hit, not a `PEEK` nor a droplet take (a token
/// bucket's or a sliding window's denial can lift before the reset).
pub fn rememberable(op: &OpView<'_>) -> bool {
    op.bucket.is_none() && !op.peek && op.algorithm == crate::rules::Algorithm::FixedWindow
}

thread_local! {
    /// The serving thread's remembered denials.
    static DENIALS: std::cell::RefCell<DenialCache> =
        std::cell::RefCell::new(DenialCache::default());
}

/// The leader's denial of `op`'s counter, remembered on this thread, if it
/// still stands at `now_ms`: a fixed window's hit (not a `PEEK`, not a
/// droplet take) answered here instead of forwarded again.
pub(super) fn remembered_denial(dp: &DataPlane, op: &OpView<'_>, now_ms: u64) -> Option<Decision> {
    if !rememberable(op) {
        return None;
    }
    DENIALS
        .try_with(|cache| {
            let cache = cache.borrow();
            if !cache.any(now_ms) {
                return None;
            }
            cache.denial(op.key, dp.store.key_hash(op.key), now_ms)
        })
        .ok()
        .flatten()
}

/// Remembers the denials of `board`'s waiting fixed-window hits (its
/// batch sent at `sent_ms`) in this thread's table.
pub(super) fn remember_denied(dp: &DataPlane, board: &SlotBoard, sent_ms: u64) {
    let _ = DENIALS.try_with(|cache| {
        let mut cache = cache.borrow_mut();
        board.denied_window_hits(|key, next_reset_seconds| {
            cache.remember(key, dp.store.key_hash(key), next_reset_seconds, sent_ms);
        });
    });
}

/// Counters remembered per serving thread: 64 bytes each, 256 KiB, in
/// sets of [`WAYS`] (a direct-mapped table of a thousand counters lost
/// half of a thousand hot counters to collisions).
const ENTRIES: usize = 4096;
/// Entries a counter may take, by its hash: the one expiring first is
/// replaced.
const WAYS: usize = 2;
/// Longest counter key remembered (a rule's 8-byte id and an actor of up
/// to 39 bytes); longer ones are forwarded every time.
const KEY_BYTES_MAX: usize = 47;

#[derive(Clone, Copy)]
struct Entry {
    key_len: u8,
    key: [u8; KEY_BYTES_MAX],
    /// Answered `false` here before this instant (ms, this node's clock).
    until_ms: u64,
    /// When the leader's window resets, as this node reckons it.
    reset_at_ms: u64,
}

const EMPTY: Entry = Entry {
    key_len: 0,
    key: [0; KEY_BYTES_MAX],
    until_ms: 0,
    reset_at_ms: 0,
};

/// A two-way set-associative table of recent denials by counter key (see
/// the module doc); a newer denial takes the place of the one in its set
/// that ends first.
pub struct DenialCache {
    entries: Box<[[Entry; WAYS]]>,
    /// The latest `until_ms` of any entry: at or past it, nothing is
    /// remembered and a forwarded hit pays no look-up.
    live_until_ms: u64,
}

impl Default for DenialCache {
    fn default() -> Self {
        DenialCache {
            entries: vec![[EMPTY; WAYS]; ENTRIES / WAYS].into_boxed_slice(),
            live_until_ms: 0,
        }
    }
}

impl DenialCache {
    /// The leader's denial of `key`'s counter, with `next_reset_seconds`
    /// left in its window, of a hit sent at `sent_ms` (the leader decided
    /// it later, so its window resets at least that many seconds, less
    /// the half second of rounding, after `sent_ms`): remembered while a
    /// later hit would surely be denied too (a window under two seconds
    /// from its reset is not).
    pub fn remember(&mut self, key: &[u8], hash: u64, next_reset_seconds: i64, sent_ms: u64) {
        let Ok(key_len) = u8::try_from(key.len()) else {
            return;
        };
        if key.len() > KEY_BYTES_MAX || next_reset_seconds < 2 {
            return;
        }
        let seconds = next_reset_seconds as u64;
        let mut entry = Entry {
            key_len,
            key: [0; KEY_BYTES_MAX],
            until_ms: sent_ms.saturating_add((seconds - 1) * 1000),
            reset_at_ms: sent_ms.saturating_add(seconds * 1000),
        };
        entry.key[..key.len()].copy_from_slice(key);
        self.live_until_ms = self.live_until_ms.max(entry.until_ms);
        let set = &mut self.entries[Self::set(hash)];
        // The counter's own entry if it has one, else the one ending first.
        let at = set
            .iter()
            .position(|old| old.holds(key))
            .or_else(|| (0..WAYS).min_by_key(|&way| set[way].until_ms))
            .unwrap_or(0);
        set[at] = entry;
    }

    /// Whether any denial may still stand at `now_ms` (else skip
    /// [`DenialCache::denial`] and the key's hash altogether).
    pub fn any(&self, now_ms: u64) -> bool {
        now_ms < self.live_until_ms
    }

    /// The answer for a hit on `key`'s counter at `now_ms`, if a denial of
    /// it stands.
    pub fn denial(&self, key: &[u8], hash: u64, now_ms: u64) -> Option<Decision> {
        let entry = self.entries[Self::set(hash)]
            .iter()
            .find(|entry| entry.holds(key))?;
        if now_ms >= entry.until_ms {
            return None;
        }
        Some(Decision {
            allowed: false,
            credit: 0,
            next_reset_seconds: crate::limiter::round_ms_to_seconds(entry.reset_at_ms - now_ms),
        })
    }

    fn set(hash: u64) -> usize {
        (hash >> 32) as usize % (ENTRIES / WAYS)
    }
}

impl Entry {
    fn holds(&self, key: &[u8]) -> bool {
        self.key_len != 0 && self.key[..usize::from(self.key_len)] == *key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_denial_stands_until_a_second_before_the_announced_reset() {
        let mut cache = DenialCache::default();
        assert!(!cache.any(0));
        cache.remember(b"counter-a", 7, 10, 1_000);
        assert!(cache.any(1_000));
        let denied = cache.denial(b"counter-a", 7, 4_000).expect("denied");
        assert!(!denied.allowed);
        assert_eq!((denied.credit, denied.next_reset_seconds), (0, 7));
        assert!(cache.denial(b"counter-a", 7, 9_999).is_some());
        assert!(cache.denial(b"counter-a", 7, 10_000).is_none());
        assert!(!cache.any(10_000));
    }

    #[test]
    fn only_the_same_key_is_denied_and_short_or_long_ones_are_not_kept() {
        let mut cache = DenialCache::default();
        cache.remember(b"counter-a", 7, 10, 0);
        // Another key in the same set is not the remembered one.
        assert!(cache.denial(b"counter-b", 7, 1).is_none());
        assert!(cache.denial(b"counter-", 7, 1).is_none());
        // A window about to reset, and a key too long, are not remembered.
        cache.remember(b"counter-c", 1 << 32, 1, 0);
        assert!(cache.denial(b"counter-c", 1 << 32, 1).is_none());
        let long = [b'x'; KEY_BYTES_MAX + 1];
        cache.remember(&long, 2 << 32, 10, 0);
        assert!(cache.denial(&long, 2 << 32, 1).is_none());
        // Two counters share a set; a third takes the place of the one
        // ending first, and a counter denied again keeps its own place.
        cache.remember(b"counter-d", 7, 20, 0);
        assert!(cache.denial(b"counter-a", 7, 1).is_some());
        assert!(cache.denial(b"counter-d", 7, 1).is_some());
        cache.remember(b"counter-e", 7, 30, 0);
        assert!(cache.denial(b"counter-a", 7, 1).is_none());
        assert!(cache.denial(b"counter-d", 7, 1).is_some());
        cache.remember(b"counter-d", 7, 40, 0);
        assert!(cache.denial(b"counter-e", 7, 1).is_some());
        assert_eq!(
            cache.denial(b"counter-d", 7, 1).unwrap().next_reset_seconds,
            40
        );
    }
}
