//! The answers board of one read batch ([`SlotBoard`]): a slot per op
//! that waits (a forwarded hit, a strict-mode commit, a hit to route
//! again), filled by whoever has the answer (the replicator on commit, the
//! frame reader on a peer's answers) and waking the connection once, when
//! the last one is in; and the record of a batch forwarded to a peer
//! ([`ForwardWait`]), by which a peer's answers find their slots.

use super::AsWanted;
use crate::cluster::data_frames::{BatchAnswers, FrameError, Reader};
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
    waker: AtomicWaker,
}

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
    pub(super) fn new(slots: Vec<Slot>, ops: Vec<u8>) -> SlotBoard {
        let pending = slots
            .iter()
            .filter(|s| matches!(s.answer, SlotAnswer::Pending))
            .count() as u32;
        let retried = slots
            .iter()
            .any(|s| matches!(s.answer, SlotAnswer::Retry(_)));
        SlotBoard {
            inner: Mutex::new(BoardInner { slots, ops }),
            pending: AtomicU32::new(pending),
            retried: AtomicBool::new(retried),
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
            filled += u32::from(self.fill_slot(&mut inner.slots, slot, decision));
        }
        drop(inner);
        self.count_filled(filled);
        filled
    }

    /// Answers pending slots from a batch-answers section's entries
    /// (`data_frames::tag::BATCH_ANSWERS`), `slots` giving the board slot of
    /// each of the batch's ops: under one lock, each decision decoded as it
    /// is filled in. Returns how many slots it answered; on a malformed
    /// entry, the entries before it are answered and the error returned.
    pub fn fill_entries(&self, slots: &[u32], entries: &[u8]) -> Result<u32, FrameError> {
        let mut inner = self.inner.lock();
        let mut filled = 0;
        let mut answers = BatchAnswers::new(entries);
        let read = loop {
            match answers.next_entry() {
                Ok(Some((index, decision))) => {
                    let Some(&slot) = usize::try_from(index).ok().and_then(|i| slots.get(i)) else {
                        continue;
                    };
                    filled += u32::from(self.fill_slot(&mut inner.slots, slot, decision));
                }
                Ok(None) => break Ok(()),
                Err(error) => break Err(error),
            }
        };
        drop(inner);
        self.count_filled(filled);
        read.map(|()| filled)
    }

    /// Answers `slot` if it is pending (an answer may come twice: sent with
    /// its round, then again after the link broke before the leader heard
    /// that it arrived); says whether it was.
    #[inline(always)]
    fn fill_slot(&self, slots: &mut [Slot], slot: u32, decision: WireDecision) -> bool {
        let Some(entry) = slots.get_mut(slot as usize) else {
            return false;
        };
        if !matches!(entry.answer, SlotAnswer::Pending) {
            return false;
        }
        entry.answer = result_of(entry.shard, decision);
        if matches!(entry.answer, SlotAnswer::Retry(_)) {
            self.retried.store(true, Ordering::Release);
        }
        true
    }

    /// Counts `filled` slots answered; wakes the connection when they were
    /// the last pending ones.
    fn count_filled(&self, filled: u32) {
        if filled > 0 && self.pending.fetch_sub(filled, Ordering::AcqRel) == filled {
            self.waker.wake();
        }
    }

    pub(super) fn set(&self, slot: u32, answer: SlotAnswer) {
        if matches!(answer, SlotAnswer::Retry(_)) {
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

    /// The slots to route again, with their shard and op bytes.
    pub(super) fn retries(&self) -> Vec<(u32, u32, Vec<u8>)> {
        if !self.retried.load(Ordering::Acquire) {
            return Vec::new();
        }
        let inner = self.inner.lock();
        let mut retries = Vec::new();
        for (index, slot) in inner.slots.iter().enumerate() {
            if let SlotAnswer::Retry(_) = slot.answer {
                let rest = inner.ops.get(slot.op_at as usize..).unwrap_or_default();
                let mut reader = Reader::new(rest);
                if reader.op().is_ok() {
                    let used = rest.len() - reader.remaining();
                    retries.push((index as u32, slot.shard, rest[..used].to_vec()));
                }
            }
        }
        retries
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
            })
            .map(as_wanted)
            .collect()
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

/// A batch forwarded to a peer, waiting for its answers.
pub struct ForwardWait {
    pub peer: NodeId,
    pub board: Arc<SlotBoard>,
    /// The board slot of each op of the batch, in order.
    pub slots: SmallVec<[u32; 16]>,
    pub answered: u32,
    /// The outbox frame the batch went in (see `PeerOut`).
    pub frame: u64,
    pub sent_at: Instant,
}

impl ForwardWait {
    /// Answers ops of the batch (by index); says whether every op is
    /// answered now.
    pub fn answer_many(&mut self, answers: impl IntoIterator<Item = (u32, WireDecision)>) -> bool {
        let slots = &self.slots;
        // Only answers that filled a pending slot count (see
        // `SlotBoard::fill_slot`).
        self.answered += self.board.fill_many(
            answers
                .into_iter()
                .filter_map(|(index, decision)| Some((*slots.get(index as usize)?, decision))),
        );
        self.answered as usize >= self.slots.len()
    }

    /// Answers ops of the batch from a batch-answers section's entries
    /// (see [`SlotBoard::fill_entries`]); says whether every op is answered
    /// now.
    pub fn answer_entries(&mut self, entries: &[u8]) -> Result<bool, FrameError> {
        self.answered += self.board.fill_entries(&self.slots, entries)?;
        Ok(self.answered as usize >= self.slots.len())
    }

    /// Answers every op still waiting.
    pub fn fail(self, decision: WireDecision) {
        for &slot in &self.slots {
            self.board.fill(slot, decision.clone());
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
        let mut wait = ForwardWait {
            peer: 2,
            board: Arc::clone(&board),
            slots: SmallVec::from_slice(&[3, 0, 2]),
            answered: 0,
            frame: 1,
            sent_at: Instant::now(),
        };
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

    #[test]
    fn a_malformed_entry_keeps_the_answers_before_it() {
        let board = Arc::new(SlotBoard::new(vec![pending(1), pending(1)], Vec::new()));
        let mut bytes = entries(&[(0, decided(4)), (1, decided(5))]);
        bytes.truncate(bytes.len() - 1);
        assert!(board.fill_entries(&[0, 1], &bytes).is_err());
        assert_eq!(board.pending.load(Ordering::Acquire), 1);
    }
}
