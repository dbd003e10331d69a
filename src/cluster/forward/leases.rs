//! Quota leases: a shard's leader hands the node that forwards a
//! fixed-window hit a few more of the counter's credits beside its answer,
//! counted as used in the leader's state (and replicated as any state is;
//! in strict mode the lease goes with the answer once that state
//! commits), and that node admits the counter's next hits itself until
//! they run out: one forwarded hit in several, instead of every one.
//!
//! Both sides live here. The leader sizes a lease with [`lease_size`]: at
//! most what was asked, `--lease-credits-max`, and a sixty-fourth of the
//! credit left, and none for a window ending within three seconds. The
//! forwarding node keeps its leases in a [`LeaseCache`] per serving thread
//! and asks for about [`ASK_HORIZON_MS`] of its own demand for the counter
//! (measured from the hits it forwards and the pace it spent its last
//! lease at), only for a counter it forwarded before within that time, so
//! a counter hit once in a while never holds credits it will not use.
//!
//! What it costs in exactness: a lease is never over-admission while its
//! leader lives, since the leader counted its credits before granting it
//! (in fast mode, after a leader's failure, its credits count as hits that
//! leader admitted; in strict mode they were committed before the lease
//! was sent: docs/cluster.md, "Quota leases"); credits a node holds and
//! does not use (its clients stopped hitting the counter) are under-admission
//! until the window resets: at most one lease per counter, node and serving
//! thread, a sixty-fourth of the credit left when it was granted. A held lease
//! is never evicted; when the cache has no room, the node forwards without
//! asking. A node stops using a lease when another node becomes the shard's
//! leader, and a second before the reset the leader announced. The `credit`
//! a lease's hits answer counts down from the leader's answer, as if no
//! other node had hit the counter since.

use super::SlotBoard;
use crate::cluster::data_frames::OpView;
use crate::cluster::dataplane::DataPlane;
use crate::cluster::NodeId;
use crate::limiter::Decision;
use smallvec::SmallVec;

/// A lease is at most this fraction (1 / N) of the credit left after the
/// hit it rides with, so the credits a lease can strand stay small against
/// the quota and a counter near its limit gets none (every hit then goes to
/// the leader and is decided exactly).
pub const LEASE_SHARE_OF_CREDIT_LEFT: u64 = 64;
/// No lease for a window ending within this many milliseconds: the
/// forwarding node stops using a lease a second before the reset it was
/// told, in whole seconds.
pub const LEASE_WINDOW_LEFT_MS_MIN: u64 = 3_000;

/// The credits a leader leases beside a hit it admitted that leaves the
/// window at `used` of `credit_limit` (ending at `end_ms`): at most
/// `lease_max` (what was asked, within `--lease-credits-max`), see
/// [`LEASE_SHARE_OF_CREDIT_LEFT`] and [`LEASE_WINDOW_LEFT_MS_MIN`].
pub fn lease_size(end_ms: u64, used: u64, credit_limit: u64, lease_max: u32, now_ms: u64) -> u32 {
    if end_ms < now_ms.saturating_add(LEASE_WINDOW_LEFT_MS_MIN) {
        return 0;
    }
    let share = credit_limit.saturating_sub(used) / LEASE_SHARE_OF_CREDIT_LEFT;
    share.min(u64::from(lease_max)) as u32
}

/// Whether a forwarded `op` may use a lease: a fixed window's hit or
/// `PEEK` (not a droplet take) whose credit fits an entry (a hit may ask
/// for one, a `PEEK` answers from one).
pub fn leasable(op: &OpView<'_>) -> bool {
    op.bucket.is_none()
        && op.algorithm == crate::rules::Algorithm::FixedWindow
        && op.credit_limit <= u64::from(u32::MAX)
        && op.key.len() <= KEY_BYTES_MAX
}

thread_local! {
    /// The serving thread's quota leases, made at its
    /// first forwarded hit that may ask for one.
    static LEASES: std::cell::RefCell<Option<LeaseCache>> =
        const { std::cell::RefCell::new(None) };
}

/// A forwarded hit on `key`'s counter (of store hash `hash`), whose shard
/// `leader` leads, seen by this thread's leases (a [`leasable`]
/// op).
pub(super) fn lease_use(
    dp: &DataPlane,
    key: &[u8],
    hash: u64,
    leader: NodeId,
    now_ms: u64,
) -> LeaseUse {
    LEASES
        .try_with(|cache| {
            let mut cache = cache.borrow_mut();
            let cache = cache.get_or_insert_with(|| {
                LeaseCache::new(
                    now_ms,
                    dp.settings.forward_timeout_ms,
                    dp.settings.lease_counters_per_thread,
                )
            });
            cache.take(key, hash, leader, now_ms)
        })
        .unwrap_or(LeaseUse::Forward)
}

/// Prefetches what routing a hit on the counter of store hash `hash` will
/// read of this thread's leases, if it has any (see
/// [`LeaseCache::prefetch`]).
#[inline(always)]
pub fn prefetch_lease(dp: &DataPlane, hash: u64) {
    if !dp.asks_leases() {
        return;
    }
    let _ = LEASES.try_with(|cache| {
        if let Some(cache) = cache.borrow().as_ref() {
            cache.prefetch(hash);
        }
    });
}

/// A forwarded `PEEK` of `key`'s counter answered from this thread's lease
/// for it, if it holds one it can use (see [`LeaseCache::peek`]).
pub(super) fn lease_peek(key: &[u8], hash: u64, leader: NodeId, now_ms: u64) -> Option<Decision> {
    LEASES
        .try_with(|cache| cache.borrow_mut().as_mut()?.peek(key, hash, leader, now_ms))
        .ok()
        .flatten()
}

/// Whether `peer` reads a lease's ask and answers with one (`known`: the
/// batch's peers looked up so far).
pub(super) fn leases_with(
    known: &mut SmallVec<[(NodeId, bool); 4]>,
    dp: &DataPlane,
    peer: NodeId,
) -> bool {
    if let Some(&(_, speaks)) = known.iter().find(|(p, _)| *p == peer) {
        return speaks;
    }
    let speaks = dp.peer_speaks(peer, crate::cluster::peer_protocol::LEASES_MINOR);
    known.push((peer, speaks));
    speaks
}

/// Keeps in this thread's table the leases granted to `board`'s waiting
/// hits since it last looked (its batch sent at `sent_ms`).
pub(super) fn keep_granted(dp: &DataPlane, board: &SlotBoard, sent_ms: u64) {
    let _ = LEASES.try_with(|cache| {
        if let Some(cache) = cache.borrow_mut().as_mut() {
            board.take_leases_granted(|key, lease, decision| {
                let hash = dp.store.key_hash(key);
                let (credit, reset) = (decision.credit, decision.next_reset_seconds);
                cache.granted(key, hash, lease, credit, reset, sent_ms);
            });
        }
    });
}

/// How much of its own demand a node asks for: about this many
/// milliseconds of the counter's hits through this thread. A second's
/// worth left the bench's counters (hit two to four times a second per
/// node) forwarding one hit in five; sixteen seconds' worth, within the
/// leader's caps, costs nothing more in what a lease may strand (a
/// sixty-fourth of the credit left) and took five nodes from 1.40× three
/// nodes' CPU per hit to 1.27× (docs/benchmarks.md, "Twenty-fourth
/// round").
const ASK_HORIZON_MS: u32 = 16_000;
/// Most credits asked at once (an entry counts them in 16 bits).
const ASK_MAX: u32 = u16::MAX as u32;

/// Entries of a set: a counter may take either, by its hash.
const WAYS: usize = 2;
/// Fewest entries of a thread's table (when `--lease-counters-max` is
/// shared out among many threads).
const TABLE_ENTRIES_MIN: usize = 1_024;

/// The entries of each serving thread's table: `counters_max` (the node's,
/// `--lease-counters-max`) shared out among `threads`, a power of two of
/// at least [`TABLE_ENTRIES_MIN`]; 0 when `counters_max` is 0 (no leases
/// asked for).
pub fn lease_table_entries(counters_max: usize, threads: usize) -> usize {
    if counters_max == 0 {
        return 0;
    }
    let share = (counters_max / threads.max(1)).max(TABLE_ENTRIES_MIN);
    // The largest power of two within the share.
    1 << (usize::BITS - 1 - share.leading_zeros())
}
/// Longest counter key kept (a rule's 8-byte id and an actor of up to 32
/// bytes); longer ones are forwarded every time.
pub const KEY_BYTES_MAX: usize = 40;

/// What an entry is.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Free,
    /// Forwarded at `stamp` without a lease; `size`: what to ask for next
    /// (0: work it out from the next forward's interval).
    Seen,
    /// A lease of `size` was asked for of `leader` at `stamp`; no other is
    /// asked for until its answer, or until `ask_hold_ms` later.
    Asking,
    /// `left` credits of a lease of `size` from `leader`, asked for at
    /// `since`; usable until a second before `stamp`, the reset.
    Leased,
}

/// One counter's lease or recent forward, 64 bytes, one cache line (times
/// in ms from the cache's `base_ms`).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Entry {
    key: [u8; KEY_BYTES_MAX],
    key_len: u8,
    kind: Kind,
    left: u16,
    leader: u32,
    /// The credit the next hit answered from the lease reports.
    credit: u32,
    stamp: u32,
    since: u32,
    size: u16,
}

const EMPTY: Entry = Entry {
    key: [0; KEY_BYTES_MAX],
    key_len: 0,
    kind: Kind::Free,
    left: 0,
    leader: 0,
    credit: 0,
    stamp: 0,
    since: 0,
    size: 0,
};

/// What [`LeaseCache::take`] says about a forwarded hit.
#[derive(Debug, PartialEq, Eq)]
pub enum LeaseUse {
    /// Admitted from a lease this node holds: answer it here.
    Admitted(Decision),
    /// Forward it, asking for a lease of this many credits.
    Ask(u32),
    /// Forward it as is.
    Forward,
}

/// A serving thread's leases and recent forwards by counter key (see the
/// module doc): two-way sets by hash; a held lease is never replaced.
pub struct LeaseCache {
    /// Sets of [`WAYS`] entries, a power of two of them, allocated at the
    /// thread's first forwarded hit that may ask (64 bytes an entry).
    entries: Box<[[Entry; WAYS]]>,
    /// The clock reading (ms) entries' times count from.
    base_ms: u64,
    /// How long an ask stands without its answer (the forward timeout).
    ask_hold_ms: u32,
}

impl LeaseCache {
    /// A table of `entries` (a power of two, see [`lease_table_entries`]).
    pub fn new(now_ms: u64, ask_hold_ms: u64, entries: usize) -> LeaseCache {
        let sets = (entries / WAYS).next_power_of_two();
        LeaseCache {
            entries: vec![[EMPTY; WAYS]; sets].into_boxed_slice(),
            base_ms: now_ms,
            ask_hold_ms: ask_hold_ms.min(u64::from(u32::MAX / 4)) as u32,
        }
    }

    /// Asks the CPU for the lines a [`LeaseCache::take`] of a key of
    /// `hash` will read (a read batch's are asked for before any is routed,
    /// so that their misses overlap: looked up cold, the table cost 0.13 µs
    /// per forwarded hit; docs/benchmarks.md, "Twenty-fourth round").
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        let set = &self.entries[self.set_of(hash)];
        crate::store::table::prefetch_line(&set[0]);
        crate::store::table::prefetch_line(&set[WAYS - 1]);
    }

    /// The set of a key of `hash` (`entries` has a power of two of them).
    fn set_of(&self, hash: u64) -> usize {
        (hash >> 32) as usize & (self.entries.len() - 1)
    }

    /// `now_ms` in the entries' time; past a few weeks the cache starts
    /// over (dropping its leases: under-admission until their windows end).
    fn at(&mut self, now_ms: u64) -> u32 {
        let since_base = now_ms.saturating_sub(self.base_ms);
        if since_base >= u64::from(u32::MAX / 2) {
            self.entries.iter_mut().for_each(|set| *set = [EMPTY; WAYS]);
            self.base_ms = now_ms;
            return 0;
        }
        since_base as u32
    }

    /// A forwarded hit on `key`'s counter (a [`leasable`] op, `hash` its
    /// key's) whose shard `leader` leads, at `now_ms`: admitted from a
    /// lease, forwarded asking for one, or forwarded as is.
    pub fn take(&mut self, key: &[u8], hash: u64, leader: NodeId, now_ms: u64) -> LeaseUse {
        let Ok(leader) = u32::try_from(leader) else {
            return LeaseUse::Forward;
        };
        let now = self.at(now_ms);
        let ask_hold_ms = self.ask_hold_ms;
        let set = &mut self.entries[self.set_of(hash)];
        let Some(way) = set.iter().position(|entry| entry.holds(key)) else {
            // First seen (lately): remembered in a way that holds no lease,
            // to ask for one if the counter comes back within the horizon.
            let free = (0..WAYS)
                .filter(|&way| !set[way].pinned(now, ask_hold_ms))
                .min_by_key(|&way| (set[way].kind != Kind::Free, set[way].stamp));
            if let Some(way) = free {
                let entry = &mut set[way];
                *entry = EMPTY;
                entry.key[..key.len()].copy_from_slice(key);
                entry.key_len = key.len() as u8;
                entry.kind = Kind::Seen;
                entry.stamp = now;
            }
            return LeaseUse::Forward;
        };
        let entry = &mut set[way];
        match entry.kind {
            Kind::Leased => {
                if let Some(decision) = entry.next_hit(leader, now) {
                    entry.left -= 1;
                    entry.credit = entry.credit.saturating_sub(1);
                    if entry.left == 0 {
                        // Spent: the next ask is for the pace it was spent
                        // at (its hits and the forwarded one), at most four
                        // times this one.
                        let hits = u64::from(entry.size) + 1;
                        let took_ms = u64::from(now - entry.since).max(1);
                        let wanted = (hits * u64::from(ASK_HORIZON_MS) / took_ms)
                            .clamp(1, hits * 4)
                            .min(u64::from(ASK_MAX));
                        entry.kind = Kind::Seen;
                        entry.stamp = now;
                        entry.size = wanted as u16;
                    }
                    return LeaseUse::Admitted(decision);
                }
                // Another leader now, or the window's end: what is left of
                // it is not used (under-admission until the reset).
                entry.kind = Kind::Seen;
                entry.stamp = now;
                entry.size = 0;
                LeaseUse::Forward
            }
            Kind::Asking if now < entry.stamp.saturating_add(ask_hold_ms) => LeaseUse::Forward,
            Kind::Asking | Kind::Seen | Kind::Free => {
                let interval = now.saturating_sub(entry.stamp);
                entry.stamp = now;
                if interval > ASK_HORIZON_MS {
                    entry.kind = Kind::Seen;
                    entry.size = 0;
                    return LeaseUse::Forward;
                }
                let wanted = if entry.kind == Kind::Seen && entry.size > 0 {
                    u32::from(entry.size)
                } else {
                    (ASK_HORIZON_MS / interval.max(1)).clamp(1, ASK_MAX)
                };
                entry.kind = Kind::Asking;
                entry.leader = leader;
                entry.since = now;
                entry.size = wanted as u16;
                LeaseUse::Ask(wanted)
            }
        }
    }

    /// A `PEEK` of `key`'s counter whose shard `leader` leads, at
    /// `now_ms`, answered from the lease this thread holds for it, if one
    /// can be used: as the lease's next hit would be.
    pub fn peek(&mut self, key: &[u8], hash: u64, leader: NodeId, now_ms: u64) -> Option<Decision> {
        let leader = u32::try_from(leader).ok()?;
        let now = self.at(now_ms);
        self.entries[self.set_of(hash)]
            .iter()
            .find(|entry| entry.holds(key))?
            .next_hit(leader, now)
    }

    /// The leader's answer to an ask for `key`'s counter sent at `sent_ms`:
    /// a lease of `lease` credits beside a hit admitted with `credit` left
    /// (the lease not counted) and `next_reset_seconds` to its window's
    /// reset. Kept while it can be used; a lease this cache no longer
    /// waits for (its entry replaced after its ask expired) is not.
    pub fn granted(
        &mut self,
        key: &[u8],
        hash: u64,
        lease: u32,
        credit: i64,
        next_reset_seconds: i64,
        sent_ms: u64,
    ) {
        let sent = self.at(sent_ms);
        let set = &mut self.entries[self.set_of(hash)];
        let Some(entry) = set
            .iter_mut()
            .find(|entry| entry.holds(key) && entry.kind == Kind::Asking)
        else {
            return;
        };
        let (Ok(left), Ok(credit), Ok(seconds)) = (
            u16::try_from(lease),
            u32::try_from(credit.saturating_sub(1)),
            u32::try_from(next_reset_seconds),
        ) else {
            entry.kind = Kind::Seen;
            return;
        };
        if left == 0 || seconds < 2 {
            entry.kind = Kind::Seen;
            return;
        }
        entry.kind = Kind::Leased;
        entry.left = left;
        entry.size = left;
        entry.credit = credit;
        entry.since = sent;
        entry.stamp = sent.saturating_add(seconds.saturating_mul(1_000));
    }
}

impl Entry {
    /// Whether the lease still has credits it may admit at `now`: until a
    /// second before its reset (whoever leads the shard).
    fn usable(&self, now: u32) -> bool {
        self.kind == Kind::Leased && self.left > 0 && now.saturating_add(1_000) < self.stamp
    }

    /// The answer of the lease's next hit at `now`, if the lease is usable
    /// and `leader` still leads its shard (nothing taken).
    fn next_hit(&self, leader: u32, now: u32) -> Option<Decision> {
        (self.leader == leader && self.usable(now)).then(|| Decision {
            allowed: true,
            credit: i64::from(self.credit),
            next_reset_seconds: crate::limiter::round_ms_to_seconds(u64::from(self.stamp - now)),
        })
    }

    fn holds(&self, key: &[u8]) -> bool {
        self.kind != Kind::Free && self.key[..usize::from(self.key_len)] == *key
    }

    /// Whether the entry may not be replaced at `now`: a lease that can
    /// still be used, or an ask still waiting for its answer.
    fn pinned(&self, now: u32, ask_hold_ms: u32) -> bool {
        match self.kind {
            Kind::Leased => self.usable(now),
            Kind::Asking => now < self.stamp.saturating_add(ask_hold_ms),
            Kind::Free | Kind::Seen => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD_MS: u64 = 2_000;

    fn admitted(cache: &mut LeaseCache, key: &[u8], leader: NodeId, now_ms: u64) -> Decision {
        match cache.take(key, 7, leader, now_ms) {
            LeaseUse::Admitted(decision) => decision,
            other => panic!("{other:?} at {now_ms}"),
        }
    }

    #[test]
    fn a_leader_leases_a_sixty_fourth_of_the_credit_left_and_nothing_near_the_reset() {
        // 1 000 left after the hit: 15 credits, within what was asked.
        assert_eq!(lease_size(60_000, 0, 1_000, 64, 0), 15);
        assert_eq!(lease_size(60_000, 0, 1_000, 4, 0), 4);
        assert_eq!(lease_size(60_000, 937, 1_000, 64, 0), 0);
        assert_eq!(lease_size(60_000, 1_000, 1_000, 64, 0), 0);
        // A window ending within three seconds gets none.
        assert_eq!(lease_size(60_000, 0, 1_000, 64, 57_001), 0);
        assert_eq!(lease_size(60_000, 0, 1_000, 64, 57_000), 15);
    }

    #[test]
    fn a_nodes_lease_counters_are_shared_out_among_its_threads() {
        assert_eq!(lease_table_entries(262_144, 1), 262_144);
        assert_eq!(lease_table_entries(262_144, 3), 65_536);
        assert_eq!(lease_table_entries(100_000, 1), 65_536);
        assert_eq!(lease_table_entries(5_000, 64), 1_024);
        assert_eq!(lease_table_entries(0, 4), 0);
    }

    #[test]
    fn a_counter_forwarded_once_asks_for_a_lease_the_second_time_within_a_second() {
        let mut cache = LeaseCache::new(0, HOLD_MS, 4_096);
        assert_eq!(cache.take(b"k", 7, 2, 1_000), LeaseUse::Forward);
        // Back 100 ms later: ten a second, so about sixteen seconds' worth.
        assert_eq!(cache.take(b"k", 7, 2, 1_100), LeaseUse::Ask(160));
        // One ask at a time.
        assert_eq!(cache.take(b"k", 7, 2, 1_101), LeaseUse::Forward);
        // A counter back after more than sixteen seconds asks for none.
        assert_eq!(cache.take(b"slow", 7, 2, 1_000), LeaseUse::Forward);
        assert_eq!(cache.take(b"slow", 7, 2, 17_001), LeaseUse::Forward);
    }

    #[test]
    fn a_lease_admits_its_credits_counting_down_then_asks_again_at_its_pace() {
        let mut cache = LeaseCache::new(0, HOLD_MS, 4_096);
        cache.take(b"k", 7, 2, 1_000);
        assert_eq!(cache.take(b"k", 7, 2, 1_100), LeaseUse::Ask(160));
        // Admitted with 900 left, lease of 3, window resets in 50 s.
        cache.granted(b"k", 7, 3, 900, 50, 1_100);
        for (at, credit) in [(1_200, 899), (1_300, 898), (1_400, 897)] {
            let decision = admitted(&mut cache, b"k", 2, at);
            assert!(decision.allowed);
            assert_eq!(decision.credit, credit);
            assert_eq!(
                decision.next_reset_seconds,
                (51_100 - at as i64 + 500) / 1000
            );
        }
        // Spent 4 hits in 300 ms: asks for about 213, at most four times 4.
        assert_eq!(cache.take(b"k", 7, 2, 1_400), LeaseUse::Ask(16));
    }

    #[test]
    fn a_peek_answers_as_the_leases_next_hit_would_without_taking_it() {
        let mut cache = LeaseCache::new(0, HOLD_MS, 4_096);
        assert_eq!(cache.peek(b"k", 7, 2, 1_000), None);
        cache.take(b"k", 7, 2, 1_000);
        cache.take(b"k", 7, 2, 1_100);
        assert_eq!(cache.peek(b"k", 7, 2, 1_150), None, "asked, not granted");
        cache.granted(b"k", 7, 2, 900, 50, 1_100);
        for _ in 0..2 {
            let peeked = cache.peek(b"k", 7, 2, 1_200).expect("held");
            assert_eq!((peeked.allowed, peeked.credit), (true, 899));
        }
        assert_eq!(cache.peek(b"k", 7, 3, 1_200), None, "another leader");
        assert_eq!(admitted(&mut cache, b"k", 2, 1_300).credit, 899);
        assert_eq!(admitted(&mut cache, b"k", 2, 1_300).credit, 898);
        assert_eq!(cache.peek(b"k", 7, 2, 1_300), None, "spent");
    }

    #[test]
    fn a_lease_stops_with_another_leader_and_a_second_before_the_reset() {
        let mut cache = LeaseCache::new(0, HOLD_MS, 4_096);
        cache.take(b"k", 7, 2, 1_000);
        cache.take(b"k", 7, 2, 1_100);
        cache.granted(b"k", 7, 10, 900, 5, 1_100);
        admitted(&mut cache, b"k", 2, 1_200);
        assert_eq!(cache.take(b"k", 7, 3, 1_300), LeaseUse::Forward);
        assert_eq!(cache.take(b"k", 7, 2, 1_400), LeaseUse::Ask(160));
        cache.granted(b"k", 7, 10, 800, 5, 1_400);
        admitted(&mut cache, b"k", 2, 5_399);
        // 6 400 is the reset it was told; a second before, it stops.
        assert_eq!(cache.take(b"k", 7, 2, 5_400), LeaseUse::Forward);
    }

    #[test]
    fn a_held_lease_is_never_replaced_and_a_full_set_forwards_without_asking() {
        let mut cache = LeaseCache::new(0, HOLD_MS, 4_096);
        for key in [b"a", b"b"] {
            cache.take(key, 7, 2, 1_000);
            assert_eq!(cache.take(key, 7, 2, 1_010), LeaseUse::Ask(1_600));
            cache.granted(key, 7, 5, 500, 60, 1_010);
        }
        // A third counter of the same set finds no room: forwarded, never
        // remembered, so never asking.
        assert_eq!(cache.take(b"c", 7, 2, 1_020), LeaseUse::Forward);
        assert_eq!(cache.take(b"c", 7, 2, 1_030), LeaseUse::Forward);
        for key in [b"a", b"b"] {
            assert_eq!(admitted(&mut cache, key, 2, 1_040).credit, 499);
        }
    }

    #[test]
    fn nothing_is_kept_for_an_answer_without_a_lease_or_one_not_asked_for() {
        let mut cache = LeaseCache::new(0, HOLD_MS, 4_096);
        // Not asked for: ignored.
        cache.granted(b"k", 7, 5, 500, 60, 1_000);
        assert_eq!(cache.take(b"k", 7, 2, 1_000), LeaseUse::Forward);
        assert_eq!(cache.take(b"k", 7, 2, 1_500), LeaseUse::Ask(32));
        // Declined (no lease): forwarded again, asking for as much again.
        cache.granted(b"k", 7, 0, 500, 60, 1_500);
        assert_eq!(cache.take(b"k", 7, 2, 1_600), LeaseUse::Ask(32));
        // Too near the reset to be used.
        cache.granted(b"k", 7, 5, 500, 1, 1_600);
        assert_eq!(cache.take(b"k", 7, 2, 1_700), LeaseUse::Ask(32));
    }

    #[test]
    fn only_fixed_window_hits_with_short_keys_may_ask() {
        let hit = OpView {
            key: b"counter",
            credit_limit: 100,
            reset_seconds: 60,
            ..OpView::EMPTY
        };
        assert!(leasable(&hit));
        assert!(leasable(&OpView { peek: true, ..hit }));
        assert!(!leasable(&OpView {
            algorithm: crate::rules::Algorithm::TokenBucket,
            ..hit
        }));
        assert!(!leasable(&OpView {
            credit_limit: u64::from(u32::MAX) + 1,
            ..hit
        }));
        assert!(!leasable(&OpView {
            key: &[0; KEY_BYTES_MAX + 1],
            ..hit
        }));
    }
}
