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
//! forwarding node keeps its leases in one [`LeaseTable`], shared by its
//! serving threads, and asks for about [`ASK_HORIZON_MS`] of its own
//! demand for the counter (measured from the hits it forwards and the pace
//! it spent its last lease at), only for a counter it forwarded before within that time, so
//! a counter hit once in a while never holds credits it will not use.
//!
//! What it costs in exactness: a lease is never over-admission while its
//! leader lives, since the leader counted its credits before granting it
//! (in fast mode, after a leader's failure, its credits count as hits that
//! leader admitted; in strict mode they were committed before the lease
//! was sent: docs/cluster.md, "Quota leases"); credits a node holds and
//! does not use (its clients stopped hitting the counter) are under-admission
//! until the window resets: at most one lease per counter and node, a
//! sixty-fourth of the credit left when it was granted. A held lease
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
use parking_lot::Mutex;
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

/// A forwarded hit on `key`'s counter (of store hash `hash`), whose shard
/// `leader` leads, seen by this node's leases (a [`leasable`] op).
pub(super) fn lease_use(
    dp: &DataPlane,
    key: &[u8],
    hash: u64,
    leader: NodeId,
    now_ms: u64,
) -> LeaseUse {
    dp.lease_table().take(key, hash, leader, now_ms)
}

/// Prefetches what routing a hit on the counter of store hash `hash` will
/// read of this node's leases, if it has any (see
/// [`LeaseTable::prefetch`]).
#[inline(always)]
pub fn prefetch_lease(dp: &DataPlane, hash: u64) {
    if let Some(table) = dp.lease_table_made() {
        table.prefetch(hash);
    }
}

/// A forwarded `PEEK` of `key`'s counter answered from this node's lease
/// for it, if it holds one it can use (see [`LeaseTable::peek`]).
pub(super) fn lease_peek(
    dp: &DataPlane,
    key: &[u8],
    hash: u64,
    leader: NodeId,
    now_ms: u64,
) -> Option<Decision> {
    dp.lease_table_made()?.peek(key, hash, leader, now_ms)
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

/// Keeps in this node's table the leases granted to `board`'s waiting
/// hits since it last looked (its batch sent at `sent_ms`).
pub(super) fn keep_granted(dp: &DataPlane, board: &SlotBoard, sent_ms: u64) {
    let Some(table) = dp.lease_table_made() else {
        return;
    };
    board.take_leases_granted(|key, lease, decision| {
        let hash = dp.store.key_hash(key);
        let (credit, reset) = (decision.credit, decision.next_reset_seconds);
        table.granted(key, hash, lease, credit, reset, sent_ms);
    });
}

/// How much of its own demand a node asks for: about this many
/// milliseconds of the counter's hits through this node. A second's
/// worth left the bench's counters (hit two to four times a second per
/// node) forwarding one hit in five; sixteen seconds' worth, within the
/// leader's caps, costs nothing more in what a lease may strand (a
/// sixty-fourth of the credit left) and took five nodes from 1.40× three
/// nodes' CPU per hit to 1.27× (docs/benchmarks.md, "Twenty-fourth
/// round").
const ASK_HORIZON_MS: u32 = 16_000;
/// Most credits asked at once (an entry counts them in 16 bits).
const ASK_MAX: u32 = u16::MAX as u32;

/// Entries of a set: a counter may take any, by its hash. Four rather
/// than two, in the same memory, took the hits five fast nodes forward
/// from 5.2 % to 2.0 % (three nodes' from 3.1 % to 1.4 %): with two, the
/// 3–5 % of the bench's counters whose set held two leases were forwarded
/// every time (docs/benchmarks.md, "Twenty-fifth round").
const WAYS: usize = 4;
/// Fewest entries of a node's table.
const TABLE_ENTRIES_MIN: usize = 1_024;

/// The entries of a node's table for `--lease-counters-max` of
/// `counters_max`: the largest power of two within it, at least
/// [`TABLE_ENTRIES_MIN`]; 0 when `counters_max` is 0 (no leases asked
/// for).
pub fn lease_table_entries(counters_max: usize) -> usize {
    if counters_max == 0 {
        return 0;
    }
    let entries = counters_max.max(TABLE_ENTRIES_MIN);
    1 << (usize::BITS - 1 - entries.leading_zeros())
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

/// Milliseconds in an epoch of a table's time (about 24.8 days): its
/// entries count their times in milliseconds into an epoch, in 32 bits.
const EPOCH_MS: u64 = 1 << 31;

/// A moment of a table's time: the epoch since the table was made
/// (wrapping after 256) and the milliseconds into it.
#[derive(Clone, Copy)]
struct Moment {
    epoch: u8,
    ms: u32,
}

/// One counter's lease or recent forward, 63 bytes (times in ms into the
/// entry's `epoch`, see [`Moment`]); packed, so that a set of four and its
/// lock fit four cache lines.
#[derive(Clone, Copy)]
#[repr(C, packed)]
struct Entry {
    key: [u8; KEY_BYTES_MAX],
    key_len: u8,
    kind: Kind,
    /// The epoch the entry's times are in; an entry of another is free.
    epoch: u8,
    left: u16,
    size: u16,
    leader: u32,
    /// The credit the next hit answered from the lease reports.
    credit: u32,
    stamp: u32,
    since: u32,
}

const EMPTY: Entry = Entry {
    key: [0; KEY_BYTES_MAX],
    key_len: 0,
    kind: Kind::Free,
    epoch: 0,
    left: 0,
    size: 0,
    leader: 0,
    credit: 0,
    stamp: 0,
    since: 0,
};

/// A set's entries behind the lock its node's serving threads take them
/// with: four cache lines, all prefetched before the set is looked at.
#[repr(C, align(64))]
struct Set(Mutex<[Entry; WAYS]>);

const _: () = assert!(std::mem::size_of::<Set>() == 64 * WAYS);

/// What [`LeaseTable::take`] says about a forwarded hit.
#[derive(Debug, PartialEq, Eq)]
pub enum LeaseUse {
    /// Admitted from a lease this node holds: answer it here.
    Admitted(Decision),
    /// Forward it, asking for a lease of this many credits.
    Ask(u32),
    /// Forward it as is.
    Forward,
}

/// A node's leases and recent forwards by counter key (see the module
/// doc), shared by its serving threads: four-way sets by hash, each behind
/// its own lock; a held lease is never replaced.
pub struct LeaseTable {
    /// A power of two of sets, allocated when the table is made (at the
    /// node's first forwarded hit that may ask; 64 bytes an entry).
    sets: Box<[Set]>,
    /// The clock reading (ms) the table's time counts from.
    origin_ms: u64,
    /// How long an ask stands without its answer (the forward timeout).
    ask_hold_ms: u32,
}

impl LeaseTable {
    /// A table of `entries` (a power of two, see [`lease_table_entries`]).
    pub fn new(now_ms: u64, ask_hold_ms: u64, entries: usize) -> LeaseTable {
        let sets = (entries / WAYS).next_power_of_two();
        LeaseTable {
            sets: (0..sets).map(|_| Set(Mutex::new([EMPTY; WAYS]))).collect(),
            origin_ms: now_ms,
            ask_hold_ms: ask_hold_ms.min(u64::from(u32::MAX / 4)) as u32,
        }
    }

    /// Asks the CPU for the lines a [`LeaseTable::take`] of a key of
    /// `hash` will read (a read batch's are asked for before any is routed,
    /// so that their misses overlap: looked up cold, the table cost 0.13 µs
    /// per forwarded hit; docs/benchmarks.md, "Twenty-fourth round").
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        let set: *const Set = self.set_of(hash);
        for line in 0..WAYS {
            crate::store::table::prefetch_line(set.cast::<[u8; 64]>().wrapping_add(line));
        }
    }

    /// The set of a key of `hash` (`sets` has a power of two of them).
    fn set_of(&self, hash: u64) -> &Set {
        &self.sets[(hash >> 32) as usize & (self.sets.len() - 1)]
    }

    /// `now_ms` in the table's time. An entry of an earlier epoch is free:
    /// a lease held across an epoch's end (every 24.8 days) is dropped
    /// (under-admission until its window ends).
    fn at(&self, now_ms: u64) -> Moment {
        let since = now_ms.saturating_sub(self.origin_ms);
        Moment {
            epoch: (since / EPOCH_MS) as u8,
            ms: (since % EPOCH_MS) as u32,
        }
    }

    /// A forwarded hit on `key`'s counter (a [`leasable`] op, `hash` its
    /// key's) whose shard `leader` leads, at `now_ms`: admitted from a
    /// lease, forwarded asking for one, or forwarded as is.
    pub fn take(&self, key: &[u8], hash: u64, leader: NodeId, now_ms: u64) -> LeaseUse {
        let Ok(leader) = u32::try_from(leader) else {
            return LeaseUse::Forward;
        };
        if key.len() > KEY_BYTES_MAX {
            return LeaseUse::Forward;
        }
        let at = self.at(now_ms);
        let now = at.ms;
        let ask_hold_ms = self.ask_hold_ms;
        let mut set = self.set_of(hash).0.lock();
        let Some(way) = set.iter().position(|entry| entry.holds(key, at.epoch)) else {
            // First seen (lately): remembered in a way that holds no lease,
            // to ask for one if the counter comes back within the horizon;
            // a free way first, then the one seen longest ago.
            let free = (0..WAYS)
                .filter(|&way| !set[way].pinned(at, ask_hold_ms))
                .min_by_key(|&way| (set[way].in_use(at.epoch), set[way].stamp));
            if let Some(way) = free {
                let entry = &mut set[way];
                *entry = EMPTY;
                entry.key[..key.len()].copy_from_slice(key);
                entry.key_len = key.len() as u8;
                entry.kind = Kind::Seen;
                entry.epoch = at.epoch;
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
                        let took_ms = u64::from(now.saturating_sub(entry.since)).max(1);
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
    /// `now_ms`, answered from the lease this node holds for it, if one
    /// can be used: as the lease's next hit would be.
    pub fn peek(&self, key: &[u8], hash: u64, leader: NodeId, now_ms: u64) -> Option<Decision> {
        let leader = u32::try_from(leader).ok()?;
        let at = self.at(now_ms);
        let set = self.set_of(hash).0.lock();
        set.iter()
            .find(|entry| entry.holds(key, at.epoch))?
            .next_hit(leader, at.ms)
    }

    /// The leader's answer to an ask for `key`'s counter sent at `sent_ms`:
    /// a lease of `lease` credits beside a hit admitted with `credit` left
    /// (the lease not counted) and `next_reset_seconds` to its window's
    /// reset. Kept while it can be used; a lease this node no longer
    /// waits for (its entry replaced after its ask expired) is not.
    pub fn granted(
        &self,
        key: &[u8],
        hash: u64,
        lease: u32,
        credit: i64,
        next_reset_seconds: i64,
        sent_ms: u64,
    ) {
        let sent = self.at(sent_ms);
        let mut set = self.set_of(hash).0.lock();
        let Some(entry) = set
            .iter_mut()
            .find(|entry| entry.holds(key, sent.epoch) && entry.kind == Kind::Asking)
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
        entry.since = sent.ms;
        entry.stamp = sent.ms.saturating_add(seconds.saturating_mul(1_000));
    }
}

impl Entry {
    /// Whether the entry holds a counter in `epoch` (one of another epoch
    /// is free).
    fn in_use(&self, epoch: u8) -> bool {
        self.kind != Kind::Free && self.epoch == epoch
    }

    /// Whether the lease still has credits it may admit at `now`: until a
    /// second before its reset (whoever leads the shard).
    fn usable(&self, now: u32) -> bool {
        self.kind == Kind::Leased && self.left > 0 && now.saturating_add(1_000) < self.stamp
    }

    /// The answer of the lease's next hit at `now`, if the lease is usable
    /// and `leader` still leads its shard (nothing taken).
    fn next_hit(&self, leader: u32, now: u32) -> Option<Decision> {
        let (stamp, credit) = (self.stamp, self.credit);
        (self.leader == leader && self.usable(now)).then(|| Decision {
            allowed: true,
            credit: i64::from(credit),
            next_reset_seconds: crate::limiter::round_ms_to_seconds(u64::from(stamp - now)),
        })
    }

    fn holds(&self, key: &[u8], epoch: u8) -> bool {
        self.in_use(epoch) && self.key[..usize::from(self.key_len)] == *key
    }

    /// Whether the entry may not be replaced at `at`: a lease that can
    /// still be used, or an ask still waiting for its answer (of `at`'s
    /// epoch).
    fn pinned(&self, at: Moment, ask_hold_ms: u32) -> bool {
        if !self.in_use(at.epoch) {
            return false;
        }
        match self.kind {
            Kind::Leased => self.usable(at.ms),
            Kind::Asking => at.ms < self.stamp.saturating_add(ask_hold_ms),
            Kind::Free | Kind::Seen => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD_MS: u64 = 2_000;

    fn admitted(cache: &LeaseTable, key: &[u8], leader: NodeId, now_ms: u64) -> Decision {
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
    fn a_nodes_table_is_the_largest_power_of_two_within_its_counters() {
        assert_eq!(lease_table_entries(262_144), 262_144);
        assert_eq!(lease_table_entries(100_000), 65_536);
        assert_eq!(lease_table_entries(5), 1_024);
        assert_eq!(lease_table_entries(0), 0);
        assert_eq!(LeaseTable::new(0, HOLD_MS, 65_536).sets.len(), 16_384);
    }

    #[test]
    fn a_counter_forwarded_once_asks_for_a_lease_the_second_time_within_a_second() {
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
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
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
        cache.take(b"k", 7, 2, 1_000);
        assert_eq!(cache.take(b"k", 7, 2, 1_100), LeaseUse::Ask(160));
        // Admitted with 900 left, lease of 3, window resets in 50 s.
        cache.granted(b"k", 7, 3, 900, 50, 1_100);
        for (at, credit) in [(1_200, 899), (1_300, 898), (1_400, 897)] {
            let decision = admitted(&cache, b"k", 2, at);
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
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
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
        assert_eq!(admitted(&cache, b"k", 2, 1_300).credit, 899);
        assert_eq!(admitted(&cache, b"k", 2, 1_300).credit, 898);
        assert_eq!(cache.peek(b"k", 7, 2, 1_300), None, "spent");
    }

    #[test]
    fn a_lease_stops_with_another_leader_and_a_second_before_the_reset() {
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
        cache.take(b"k", 7, 2, 1_000);
        cache.take(b"k", 7, 2, 1_100);
        cache.granted(b"k", 7, 10, 900, 5, 1_100);
        admitted(&cache, b"k", 2, 1_200);
        assert_eq!(cache.take(b"k", 7, 3, 1_300), LeaseUse::Forward);
        assert_eq!(cache.take(b"k", 7, 2, 1_400), LeaseUse::Ask(160));
        cache.granted(b"k", 7, 10, 800, 5, 1_400);
        admitted(&cache, b"k", 2, 5_399);
        // 6 400 is the reset it was told; a second before, it stops.
        assert_eq!(cache.take(b"k", 7, 2, 5_400), LeaseUse::Forward);
    }

    #[test]
    fn a_held_lease_is_never_replaced_and_a_full_set_forwards_without_asking() {
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
        let held: [&[u8]; WAYS] = [b"a", b"b", b"c", b"d"];
        for key in held {
            cache.take(key, 7, 2, 1_000);
            assert_eq!(cache.take(key, 7, 2, 1_010), LeaseUse::Ask(1_600));
            cache.granted(key, 7, 5, 500, 60, 1_010);
        }
        // A fifth counter of the same set finds no room: forwarded, never
        // remembered, so never asking.
        assert_eq!(cache.take(b"e", 7, 2, 1_020), LeaseUse::Forward);
        assert_eq!(cache.take(b"e", 7, 2, 1_030), LeaseUse::Forward);
        for key in held {
            assert_eq!(admitted(&cache, key, 2, 1_040).credit, 499);
        }
        // Spent, a lease's entry may be taken by another counter.
        for _ in 0..4 {
            admitted(&cache, b"a", 2, 1_050);
        }
        assert_eq!(cache.take(b"a", 7, 2, 1_060), LeaseUse::Ask(24));
        cache.granted(b"a", 7, 0, 400, 60, 1_060);
        assert_eq!(cache.take(b"e", 7, 2, 1_070), LeaseUse::Forward);
        assert_eq!(cache.take(b"e", 7, 2, 1_080), LeaseUse::Ask(1_600));
    }

    #[test]
    fn the_serving_threads_share_a_lease_and_admit_exactly_its_credits() {
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
        cache.take(b"k", 7, 2, 1_000);
        assert_eq!(cache.take(b"k", 7, 2, 1_001), LeaseUse::Ask(16_000));
        cache.granted(b"k", 7, 4_000, 10_000, 60, 1_001);
        let credits: Vec<Vec<i64>> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        let mut credits = Vec::new();
                        while let LeaseUse::Admitted(decision) = cache.take(b"k", 7, 2, 1_002) {
                            credits.push(decision.credit);
                        }
                        credits
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|thread| thread.join().unwrap())
                .collect()
        });
        let mut all: Vec<i64> = credits.into_iter().flatten().collect();
        all.sort_unstable();
        // Every credit once, counting down from the leader's answer.
        assert_eq!(all, (6_000..=9_999).collect::<Vec<i64>>());
    }

    #[test]
    fn a_lease_held_across_an_epoch_is_dropped_and_the_counter_starts_over() {
        let start = EPOCH_MS - 5_000;
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
        cache.take(b"k", 7, 2, start);
        assert_eq!(cache.take(b"k", 7, 2, start + 100), LeaseUse::Ask(160));
        cache.granted(b"k", 7, 10, 900, 60, start + 100);
        assert_eq!(admitted(&cache, b"k", 2, start + 200).credit, 899);
        // Into the next epoch: the entry is free, the counter seen anew.
        assert_eq!(cache.take(b"k", 7, 2, EPOCH_MS + 1), LeaseUse::Forward);
        assert_eq!(cache.peek(b"k", 7, 2, EPOCH_MS + 2), None);
        assert_eq!(cache.take(b"k", 7, 2, EPOCH_MS + 101), LeaseUse::Ask(160));
    }

    #[test]
    fn nothing_is_kept_for_an_answer_without_a_lease_or_one_not_asked_for() {
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
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
        // A key too long for an entry is forwarded, never kept.
        let cache = LeaseTable::new(0, HOLD_MS, 4_096);
        for at in [1_000, 1_100] {
            assert_eq!(
                cache.take(&[7; KEY_BYTES_MAX + 1], 7, 2, at),
                LeaseUse::Forward
            );
        }
    }
}
