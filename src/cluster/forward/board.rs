//! The answers board of one read batch ([`SlotBoard`]): a slot per op
//! that waits (a forwarded hit, a strict-mode commit, a hit to route
//! again), filled by whoever has the answer (the replicator on commit, the
//! frame reader on a peer's answers) and waking the connection once, when
//! the last one is in; and the record of a batch forwarded to a peer
//! ([`ForwardWait`]), by which a peer's answers find their slots.

use super::AsWanted;
use crate::cluster::data_frames::{BatchAnswers, FrameError, Reader};
use crate::cluster::outbox::FORWARD_SECTION_OPS_MAX;
use crate::cluster::wire::{Answer, ShardRefusal, WireDecision};
use crate::cluster::NodeId;
use crate::limiter::droplet_bucket::{Balances, TakeOutcome};
use crate::limiter::Decision;
use crate::store::{BackendError, StoreFull};
use futures_util::task::AtomicWaker;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

/// Where one slot's answer stands.
#[derive(Debug, Clone)]
pub(super) enum SlotAnswer {
    Pending,
    Done(Result<Answer, BackendError>),
    /// Not decided: to be routed again.
    Retry(ShardRefusal),
    /// A hit on a counter whose lease an earlier hit of the same batch
    /// asked for: held back until that answer is in, then routed again
    /// (admitted from the lease if one came; `forward/leases.rs`), so that
    /// the leader does not count it after the lease's credits.
    AfterLease,
}

#[derive(Debug, Clone)]
pub(super) struct Slot {
    pub(super) answer: SlotAnswer,
    pub(super) shard: u32,
    /// Where the slot's op is encoded in the board's `ops` (deferred ops).
    pub(super) op_at: u32,
}

struct BoardInner {
    slots: Vec<Slot>,
    ops: Vec<u8>,
    /// The slots answered with a quota lease, and its credits.
    leases: Vec<(u32, u32)>,
}

/// The answers of one read batch's deferred ops, filled by whoever has them
/// (the replicator on commit, the frame reader on a peer's answer); the
/// last one wakes the connection.
pub struct SlotBoard {
    inner: Mutex<BoardInner>,
    /// Slots still [`SlotAnswer::Pending`].
    pending: AtomicU32,
    /// Whether a slot was ever answered [`SlotAnswer::Retry`] (else there
    /// is nothing to route again, and the slots are not scanned for it).
    retried: AtomicBool,
    /// Whether a hit waiting here was ever answered `false` (else there is
    /// no denial to remember, and the slots are not scanned for one).
    denied: AtomicBool,
    /// Whether a hit waiting here was answered with a quota lease (else
    /// `leases` is empty and not looked at).
    leased: AtomicBool,
    waker: AtomicWaker,
}

/// A slot's answer from its decision. A rule's decision, the common one,
/// is made inline where the slot is filled; the rest out of line (built
/// there and copied in, the common one cost a call and a copy per
/// forwarded hit).
#[inline(always)]
pub(super) fn result_of(shard: u32, decision: WireDecision) -> SlotAnswer {
    match decision {
        WireDecision::Decided {
            allowed,
            credit,
            next_reset_seconds,
        } => SlotAnswer::Done(Ok(Answer::Hit(Decision {
            allowed,
            credit,
            next_reset_seconds,
        }))),
        WireDecision::Leased {
            credit,
            next_reset_seconds,
            ..
        } => SlotAnswer::Done(Ok(Answer::Hit(Decision {
            allowed: true,
            credit,
            next_reset_seconds,
        }))),
        rare => rare_result_of(shard, rare),
    }
}

#[inline(never)]
fn rare_result_of(shard: u32, decision: WireDecision) -> SlotAnswer {
    match decision {
        decided @ (WireDecision::Decided { .. } | WireDecision::Leased { .. }) => {
            result_of(shard, decided)
        }
        WireDecision::Bucket { accept, balances } => {
            SlotAnswer::Done(Ok(Answer::bucket(TakeOutcome {
                accept,
                balances: Balances(balances),
            })))
        }
        WireDecision::Unavailable { why, .. } => SlotAnswer::Done(Err(
            BackendError::ShardUnavailable(WireDecision::describe(shard, &why)),
        )),
        WireDecision::Full { live_keys_max } => {
            SlotAnswer::Done(Err(BackendError::Full(StoreFull {
                live_keys_max: usize::try_from(live_keys_max).unwrap_or(usize::MAX),
            })))
        }
        WireDecision::Retry { why, .. } => SlotAnswer::Retry(why),
    }
}

impl SlotBoard {
    /// A board with no slots, for tests of what waits on boards.
    #[cfg(test)]
    pub(in crate::cluster) fn empty() -> SlotBoard {
        SlotBoard::new(Vec::new(), Vec::new())
    }

    pub(super) fn new(slots: Vec<Slot>, ops: Vec<u8>) -> SlotBoard {
        let pending = slots
            .iter()
            .filter(|s| matches!(s.answer, SlotAnswer::Pending))
            .count() as u32;
        let retried = slots
            .iter()
            .any(|s| matches!(s.answer, SlotAnswer::Retry(_) | SlotAnswer::AfterLease));
        SlotBoard {
            inner: Mutex::new(BoardInner {
                slots,
                ops,
                leases: Vec::new(),
            }),
            pending: AtomicU32::new(pending),
            retried: AtomicBool::new(retried),
            denied: AtomicBool::new(false),
            leased: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        }
    }

    /// Answers a pending slot (later answers for it are ignored).
    pub fn fill(&self, slot: u32, decision: WireDecision) {
        self.fill_many(std::iter::once((slot, decision)));
    }

    /// Answers pending slots, under one lock; wakes the connection when
    /// the last one is in. Returns how many slots it answered.
    pub fn fill_many(&self, answers: impl IntoIterator<Item = (u32, WireDecision)>) -> u32 {
        let mut inner = self.inner.lock();
        let mut filled = 0;
        for (slot, decision) in answers {
            filled += u32::from(self.fill_slot(&mut inner, slot, decision));
        }
        drop(inner);
        self.count_filled(filled);
        filled
    }

    /// Answers pending slots from a batch-answers section's entries
    /// (`data_frames::tag::BATCH_ANSWERS`) while they answer this board's
    /// ops: the section's ops `first..first + slots.len()`, `slots` giving
    /// the board slot of each. Under one lock, each decision decoded as it
    /// is filled in; stops at the first entry past those ops (another
    /// board's), left unread. Returns how many slots it answered; on a
    /// malformed entry, the entries before it are answered and the error
    /// returned.
    pub fn fill_entries(
        &self,
        slots: &[u32],
        first: u64,
        answers: &mut BatchAnswers<'_>,
    ) -> Result<u32, FrameError> {
        let mut inner = self.inner.lock();
        let mut filled = 0;
        let end = first + slots.len() as u64;
        let read = loop {
            let index = match answers.peek_index() {
                Ok(Some(index)) if index < end => index,
                Ok(_) => break Ok(()),
                Err(error) => break Err(error),
            };
            let mut decision = WireDecision::Full { live_keys_max: 0 };
            if let Err(error) = answers.take_decision_into(&mut decision) {
                break Err(error);
            }
            // An index before `first` is an earlier board's op: not this
            // board's to fill.
            let Some(&slot) = index
                .checked_sub(first)
                .and_then(|at| slots.get(at as usize))
            else {
                continue;
            };
            filled += u32::from(self.fill_slot(&mut inner, slot, decision));
        };
        drop(inner);
        self.count_filled(filled);
        read.map(|()| filled)
    }

    /// Answers `slot` if it is pending (an answer may come twice: sent with
    /// its round, then again after the link broke before the leader heard
    /// that it arrived); says whether it was.
    #[inline(always)]
    fn fill_slot(&self, inner: &mut BoardInner, slot: u32, decision: WireDecision) -> bool {
        let Some(entry) = inner.slots.get_mut(slot as usize) else {
            return false;
        };
        if !matches!(entry.answer, SlotAnswer::Pending) {
            return false;
        }
        if let WireDecision::Leased { lease, .. } = decision {
            inner.leases.push((slot, lease));
            self.leased.store(true, Ordering::Release);
        }
        entry.answer = result_of(entry.shard, decision);
        match entry.answer {
            SlotAnswer::Retry(_) => self.retried.store(true, Ordering::Release),
            SlotAnswer::Done(Ok(Answer::Hit(Decision { allowed: false, .. }))) => {
                self.denied.store(true, Ordering::Release);
            }
            _ => {}
        }
        true
    }

    /// Whether a waiting hit was answered `false` (see
    /// [`SlotBoard::denied_window_hits`]).
    pub(super) fn any_denied(&self) -> bool {
        self.denied.load(Ordering::Acquire)
    }

    /// Calls `denied` with the key and the seconds to its window's reset
    /// of every waiting fixed-window hit (not a `PEEK`) answered `false`:
    /// what the forwarding node may remember (`forward/denials.rs`).
    pub(super) fn denied_window_hits(&self, mut denied: impl FnMut(&[u8], i64)) {
        let inner = self.inner.lock();
        for slot in &inner.slots {
            let SlotAnswer::Done(Ok(Answer::Hit(decision))) = &slot.answer else {
                continue;
            };
            if decision.allowed {
                continue;
            }
            let Some(rest) = inner.ops.get(slot.op_at as usize..) else {
                continue;
            };
            let Ok(op) = Reader::new(rest).op() else {
                continue;
            };
            if super::denials::rememberable(&op) {
                denied(op.key, decision.next_reset_seconds);
            }
        }
    }

    /// Whether a waiting hit was answered with a quota lease (see
    /// [`SlotBoard::take_leases_granted`]).
    pub(super) fn any_leased(&self) -> bool {
        self.leased.load(Ordering::Acquire)
    }

    /// Calls `granted` with the key, the lease's credits and the hit's
    /// decision of every waiting hit answered with a quota lease since the
    /// last call: what the forwarding node keeps (`forward/leases.rs`).
    pub(super) fn take_leases_granted(&self, mut granted: impl FnMut(&[u8], u32, &Decision)) {
        let mut inner = self.inner.lock();
        self.leased.store(false, Ordering::Release);
        let leases = std::mem::take(&mut inner.leases);
        for &(slot, lease) in &leases {
            let Some(slot) = inner.slots.get(slot as usize) else {
                continue;
            };
            let SlotAnswer::Done(Ok(Answer::Hit(decision))) = &slot.answer else {
                continue;
            };
            let Some(rest) = inner.ops.get(slot.op_at as usize..) else {
                continue;
            };
            if let Ok(op) = Reader::new(rest).op() {
                granted(op.key, lease, decision);
            }
        }
    }

    /// Counts `filled` slots answered; wakes the connection when they were
    /// the last pending ones.
    fn count_filled(&self, filled: u32) {
        if filled > 0 && self.pending.fetch_sub(filled, Ordering::AcqRel) == filled {
            self.waker.wake();
        }
    }

    pub(super) fn set(&self, slot: u32, answer: SlotAnswer) {
        if matches!(answer, SlotAnswer::Retry(_) | SlotAnswer::AfterLease) {
            self.retried.store(true, Ordering::Release);
        }
        let mut inner = self.inner.lock();
        if let Some(entry) = inner.slots.get_mut(slot as usize) {
            entry.answer = answer;
        }
    }

    /// Keeps the batch's encoded ops, from which slots to route again are
    /// read ([`SlotBoard::retries`]).
    pub(super) fn keep_ops(&self, ops: Vec<u8>) {
        self.inner.lock().ops = ops;
    }

    /// Resolves once no slot is pending.
    pub(super) fn settled(&self) -> Settled<'_> {
        Settled { board: self }
    }

    /// The slots to route again, with their shard and op bytes, and
    /// whether any was refused (else they all waited for a lease's answer,
    /// and are routed again at once).
    pub(super) fn retries(&self) -> (Vec<(u32, u32, Vec<u8>)>, bool) {
        if !self.retried.load(Ordering::Acquire) {
            return (Vec::new(), false);
        }
        let inner = self.inner.lock();
        let mut retries = Vec::new();
        let mut refused = false;
        for (index, slot) in inner.slots.iter().enumerate() {
            refused |= matches!(slot.answer, SlotAnswer::Retry(_));
            if let SlotAnswer::Retry(_) | SlotAnswer::AfterLease = slot.answer {
                let rest = inner.ops.get(slot.op_at as usize..).unwrap_or_default();
                let mut reader = Reader::new(rest);
                if reader.op().is_ok() {
                    let used = rest.len() - reader.remaining();
                    retries.push((index as u32, slot.shard, rest[..used].to_vec()));
                }
            }
        }
        (retries, refused)
    }

    /// Every slot's final answer, taken out of the board (its waiting is
    /// over: an answer filled later finds no slot); pending ones had no
    /// answer in time.
    pub(super) fn finish<T>(&self, timeout_ms: u64, as_wanted: impl AsWanted<T>) -> Vec<T> {
        let slots = std::mem::take(&mut self.inner.lock().slots);
        slots
            .into_iter()
            .map(|slot| match slot.answer {
                SlotAnswer::Done(result) => result,
                SlotAnswer::Pending => Err(BackendError::ShardUnavailable(WireDecision::describe(
                    slot.shard,
                    &ShardRefusal::Other(format!("no answer within {timeout_ms} ms")),
                ))),
                SlotAnswer::Retry(why) => Err(BackendError::ShardUnavailable(
                    WireDecision::describe(slot.shard, &why),
                )),
                SlotAnswer::AfterLease => {
                    Err(BackendError::ShardUnavailable(WireDecision::describe(
                        slot.shard,
                        &ShardRefusal::Other(format!(
                            "no answer to its counter's lease within {timeout_ms} ms"
                        )),
                    )))
                }
            })
            .map(as_wanted)
            .collect()
    }
}

impl Drop for SlotBoard {
    fn drop(&mut self) {
        super::keep_spare_ops(std::mem::take(&mut self.inner.get_mut().ops));
    }
}

pub(super) struct Settled<'a> {
    board: &'a SlotBoard,
}

impl Future for Settled<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.board.pending.load(Ordering::Acquire) == 0 {
            return Poll::Ready(());
        }
        self.board.waker.register(cx.waker());
        if self.board.pending.load(Ordering::Acquire) == 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// The ops one read batch put in a forwarded section: its board, and the
/// board slot of each op, which are the section's ops `first..` on.
pub struct ForwardPart {
    pub board: Arc<SlotBoard>,
    pub first: u32,
    pub slots: SmallVec<[u32; 16]>,
}

/// One read batch's run of ops in a [`ForwardWait`]'s section: its board,
/// and where its ops start (they run to the next part's start).
struct WaitPart {
    board: Arc<SlotBoard>,
    first: u32,
}

/// A `FORWARD` section sent to a peer, waiting for its answers: the ops of
/// every read batch that joined it (a section is extended by the batches a
/// node forwards to the peer until its link takes the frame, so one
/// section, one entry here and one answers section serve them all).
pub struct ForwardWait {
    pub peer: NodeId,
    /// In op order, each starting where the one before ends.
    parts: Vec<WaitPart>,
    /// The board slot of each op of the section from the first part's
    /// first op (`base`) on: one list for every part, so a batch joining
    /// the section appends to it (a list of parts each holding its own
    /// slots grew by copying them all).
    slots: Vec<u32>,
    base: u32,
    pub answered: u32,
    /// The outbox frame the section went in (see `PeerOut`).
    pub frame: u64,
    pub sent_at: Instant,
}

/// Parts a section's wait has room for when it opens: a section is joined
/// by the forwards of many read batches (about twenty under the bench's
/// load, docs/benchmarks.md), and growing from one copied the list each
/// time it doubled.
const WAIT_PARTS_INITIAL: usize = 16;

impl ForwardWait {
    pub fn new(peer: NodeId, part: ForwardPart, frame: u64, sent_at: Instant) -> ForwardWait {
        let mut wait = ForwardWait {
            peer,
            parts: Vec::with_capacity(WAIT_PARTS_INITIAL),
            // Room for as many parts like this one as a section can join.
            slots: Vec::with_capacity(
                (WAIT_PARTS_INITIAL * part.slots.len())
                    .min(FORWARD_SECTION_OPS_MAX as usize)
                    .max(part.slots.len()),
            ),
            base: part.first,
            answered: 0,
            frame,
            sent_at,
        };
        wait.join(part);
        wait
    }

    /// The section's op index after this wait's last op.
    pub fn ops(&self) -> u32 {
        self.base + self.slots.len() as u32
    }

    /// Whether every op of this wait is answered (counting from `base`: a
    /// wait opened past its section's first op waits for its own ops only).
    fn all_answered(&self) -> bool {
        self.answered as usize >= self.slots.len()
    }

    /// The slots of the ops `first..end` of the section (a part's); none
    /// if they are not this wait's (parts join where the section ended, so
    /// that is a bug, answered by the batch's timeout rather than a panic
    /// of the frame's thread).
    fn slots_of(&self, first: u64, end: u64) -> &[u32] {
        let base = u64::from(self.base);
        let (Some(from), Some(to)) = (first.checked_sub(base), end.checked_sub(base)) else {
            return &[];
        };
        self.slots
            .get(from as usize..to as usize)
            .unwrap_or_default()
    }

    /// Adds a read batch's ops, appended to the section after its others.
    pub fn join(&mut self, part: ForwardPart) {
        debug_assert_eq!(
            part.first,
            self.ops(),
            "a part starts where the section ended"
        );
        self.parts.push(WaitPart {
            board: part.board,
            first: part.first,
        });
        self.slots.extend_from_slice(&part.slots);
    }

    /// The part holding op `index`, and the end of its ops.
    fn part_of(&self, index: u64) -> Option<(&WaitPart, u64)> {
        let after = self
            .parts
            .partition_point(|part| u64::from(part.first) <= index);
        let at = after.checked_sub(1)?;
        let end = self.part_end(at);
        (index < end).then_some((&self.parts[at], end))
    }

    /// Where the ops of part `at` end: where the next part's start.
    fn part_end(&self, at: usize) -> u64 {
        self.parts
            .get(at + 1)
            .map_or(u64::from(self.ops()), |next| u64::from(next.first))
    }

    /// Answers ops of the section (by index, in increasing order: a run of
    /// one part's ops fills its board under one lock); says whether every
    /// op is answered now.
    pub fn answer_many(&mut self, answers: impl IntoIterator<Item = (u32, WireDecision)>) -> bool {
        let mut answers = answers.into_iter().peekable();
        while let Some(&(index, _)) = answers.peek() {
            let Some((part, end)) = self.part_of(u64::from(index)) else {
                answers.next();
                continue;
            };
            let first = u64::from(part.first);
            let run = std::iter::from_fn(|| {
                answers.next_if(|(index, _)| (first..end).contains(&u64::from(*index)))
            });
            let slots = self.slots_of(first, end);
            // Only answers that filled a pending slot count (see
            // `SlotBoard::fill_slot`).
            let filled =
                part.board.fill_many(run.map(|(index, decision)| {
                    (slots[(u64::from(index) - first) as usize], decision)
                }));
            self.answered += filled;
        }
        self.all_answered()
    }

    /// Answers ops of the section from a batch-answers section's entries
    /// (see [`SlotBoard::fill_entries`]), a board at a time; says whether
    /// every op is answered now.
    pub fn answer_entries(&mut self, entries: &[u8]) -> Result<bool, FrameError> {
        let mut answers = BatchAnswers::new(entries);
        while let Some(index) = answers.peek_index()? {
            let Some((part, end)) = self.part_of(index) else {
                answers.take_decision()?;
                continue;
            };
            let slots = self.slots_of(u64::from(part.first), end);
            let filled = part
                .board
                .fill_entries(slots, u64::from(part.first), &mut answers)?;
            self.answered += filled;
        }
        Ok(self.all_answered())
    }

    /// Answers every op still waiting.
    pub fn fail(self, decision: WireDecision) {
        for (at, part) in self.parts.iter().enumerate() {
            let slots = self.slots_of(u64::from(part.first), self.part_end(at));
            part.board
                .fill_many(slots.iter().map(|&slot| (slot, decision.clone())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::data_frames::{BatchAnswersHeader, BatchAnswersWriter};

    fn pending(shard: u32) -> Slot {
        Slot {
            answer: SlotAnswer::Pending,
            shard,
            op_at: 0,
        }
    }

    fn decided(credit: i64) -> WireDecision {
        WireDecision::Decided {
            allowed: true,
            credit,
            next_reset_seconds: 60,
        }
    }

    fn entries(answers: &[(u32, WireDecision)]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut section = BatchAnswersWriter::begin(&mut out, 1, 1);
        for (index, decision) in answers {
            section.put(&mut out, *index, decision);
        }
        section.end(&mut out);
        let mut reader = Reader::new(&out[1..]);
        BatchAnswersHeader::read(&mut reader)
            .unwrap()
            .entries
            .to_vec()
    }

    #[test]
    fn a_batchs_answers_fill_their_slots_once_and_the_last_settles_the_board() {
        // Four slots; the batch forwarded ops 0, 1 and 2 of it as slots 3,
        // 0 and 2 (slot 1 was decided here).
        let board = Arc::new(SlotBoard::new(
            vec![pending(5), pending(6), pending(7), pending(8)],
            Vec::new(),
        ));
        board.fill(1, decided(1));
        let mut wait = ForwardWait::new(2, part(&board, 0, &[3, 0, 2]), 1, Instant::now());
        // Op 1, then op 9 (no such op: ignored).
        let first = entries(&[(1, decided(10)), (9, decided(90))]);
        assert_eq!(wait.answer_entries(&first), Ok(false));
        assert_eq!(wait.answered, 1);
        // Op 1 again (an answer sent twice counts once), op 0, and op 2
        // refused: to be routed again.
        let retry = WireDecision::Retry {
            shard: 7,
            why: ShardRefusal::HandingOver,
        };
        let rest = entries(&[(0, decided(30)), (1, decided(11)), (2, retry)]);
        assert_eq!(wait.answer_entries(&rest), Ok(true));
        assert_eq!(wait.answered, 3);
        assert_eq!(board.pending.load(Ordering::Acquire), 0);
        assert!(board.retried.load(Ordering::Acquire));
        let answers = board.finish(100, |answer| answer.map(|a| format!("{a:?}")));
        let credit = |credit| {
            Ok(format!(
                "{:?}",
                Answer::Hit(Decision {
                    allowed: true,
                    credit,
                    next_reset_seconds: 60,
                })
            ))
        };
        assert_eq!(answers[0], credit(10));
        assert_eq!(answers[1], credit(1));
        assert_eq!(answers[3], credit(30));
        assert!(
            matches!(&answers[2], Err(BackendError::ShardUnavailable(why)) if why.contains("shard 7")),
            "{:?}",
            answers[2]
        );
    }

    fn part(board: &Arc<SlotBoard>, first: u32, slots: &[u32]) -> ForwardPart {
        ForwardPart {
            board: Arc::clone(board),
            first,
            slots: SmallVec::from_slice(slots),
        }
    }

    fn credits(board: &SlotBoard) -> Vec<Option<i64>> {
        board.finish(100, |answer| match answer {
            Ok(Answer::Hit(decision)) => Some(decision.credit),
            _ => None,
        })
    }

    #[test]
    fn a_malformed_entry_keeps_the_answers_before_it() {
        let board = Arc::new(SlotBoard::new(vec![pending(1), pending(1)], Vec::new()));
        let mut bytes = entries(&[(0, decided(4)), (1, decided(5))]);
        bytes.truncate(bytes.len() - 1);
        let mut answers = BatchAnswers::new(&bytes);
        assert!(board.fill_entries(&[0, 1], 0, &mut answers).is_err());
        assert_eq!(board.pending.load(Ordering::Acquire), 1);
    }

    #[test]
    fn a_section_joined_by_three_batches_answers_each_board_its_own_ops() {
        // Three read batches forwarded to one peer before its link took
        // the frame: one section of six ops, 0-1 from the first board
        // (its slots 1, 0), 2 from the second (slot 0), 3-5 from the third
        // (slots 2, 0, 1).
        let boards: Vec<Arc<SlotBoard>> = [2, 1, 3]
            .iter()
            .map(|&n| Arc::new(SlotBoard::new(vec![pending(4); n], Vec::new())))
            .collect();
        let mut wait = ForwardWait::new(3, part(&boards[0], 0, &[1, 0]), 1, Instant::now());
        wait.join(part(&boards[1], 2, &[0]));
        wait.join(part(&boards[2], 3, &[2, 0, 1]));
        assert_eq!(wait.ops(), 6);
        // One answers section spanning the first two boards and the third's
        // first op, then the third's others in old peers' form (`ANSWERS`:
        // each answer with its index; op 9 is no op of the section).
        let first = entries(&[
            (0, decided(100)),
            (1, decided(101)),
            (2, decided(102)),
            (3, decided(103)),
        ]);
        assert_eq!(wait.answer_entries(&first), Ok(false));
        assert_eq!(wait.answered, 4);
        assert_eq!(boards[0].pending.load(Ordering::Acquire), 0);
        assert_eq!(boards[1].pending.load(Ordering::Acquire), 0);
        assert_eq!(boards[2].pending.load(Ordering::Acquire), 2);
        let rest = [(4, decided(104)), (5, decided(105)), (9, decided(109))];
        assert!(wait.answer_many(rest));
        assert_eq!(wait.answered, 6);
        assert_eq!(credits(&boards[0]), [Some(101), Some(100)]);
        assert_eq!(credits(&boards[1]), [Some(102)]);
        assert_eq!(credits(&boards[2]), [Some(104), Some(105), Some(103)]);
    }

    #[test]
    fn a_wait_opened_past_its_sections_first_op_finds_each_ops_slot() {
        // A wait that starts at op 5 of its section (the ops before it are
        // not this wait's): ops 5-6 from the first board (slots 1, 0), 7
        // from the second; op 2 and op 8 are no ops of the wait.
        let boards: Vec<Arc<SlotBoard>> = [2, 1]
            .iter()
            .map(|&n| Arc::new(SlotBoard::new(vec![pending(4); n], Vec::new())))
            .collect();
        let mut wait = ForwardWait::new(3, part(&boards[0], 5, &[1, 0]), 1, Instant::now());
        wait.join(part(&boards[1], 7, &[0]));
        assert_eq!(wait.ops(), 8);
        let answers = entries(&[(2, decided(2)), (5, decided(105)), (7, decided(107))]);
        assert_eq!(wait.answer_entries(&answers), Ok(false));
        assert!(wait.answer_many([(6, decided(106)), (8, decided(108))]));
        assert_eq!(wait.answered, 3);
        assert_eq!(credits(&boards[0]), [Some(106), Some(105)]);
        assert_eq!(credits(&boards[1]), [Some(107)]);
    }

    #[test]
    fn a_failed_section_answers_every_board() {
        let boards: Vec<Arc<SlotBoard>> = (0..2)
            .map(|_| Arc::new(SlotBoard::new(vec![pending(4); 2], Vec::new())))
            .collect();
        let mut wait = ForwardWait::new(3, part(&boards[0], 0, &[0, 1]), 1, Instant::now());
        wait.join(part(&boards[1], 2, &[1, 0]));
        wait.fail(decided(7));
        for board in &boards {
            assert_eq!(credits(board), [Some(7), Some(7)]);
        }
    }
}
