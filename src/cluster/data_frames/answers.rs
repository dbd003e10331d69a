//! The sections that answer forwarded hits, as written and read: a
//! forwarded batch's answers given at once (`BATCH_ANSWERS`, peer protocol
//! 2.2), and the header of the answers that ride with their round
//! (`ROUND_ANSWERS`, 2.1), and of those a follower relays to the node that
//! forwarded the hits (`RELAY_ANSWERS`, 2.4). The older `ANSWERS` section
//! is read by [`Reader::answers_into`].

use super::{begin_counted_fields, end_counted, put_decision, put_varint, tag, FrameError, Reader};
use super::{WireDecision, COUNT_ROOM_BYTES};
use crate::cluster::NodeId;

/// A batch-answers section as it is written ([`tag::BATCH_ANSWERS`]): begun
/// at the batch's first answer, one entry per answer, ended once the batch
/// is read (until then its length is not filled in).
pub struct BatchAnswersWriter {
    /// Where the section begins.
    start: usize,
    /// Where the section's length goes.
    length_at: usize,
    /// The index the next entry would have with a gap of 0.
    next_index: u32,
    /// Entries written.
    count: u32,
}

impl BatchAnswersWriter {
    pub fn begin(out: &mut Vec<u8>, boot: u64, batch: u64) -> BatchAnswersWriter {
        let start = out.len();
        out.push(tag::BATCH_ANSWERS);
        out.extend_from_slice(&boot.to_le_bytes());
        BatchAnswersWriter {
            start,
            length_at: begin_counted_fields(out, &[batch]),
            next_index: 0,
            count: 0,
        }
    }

    /// Appends the answer of the batch's op `index` (indexes rise from
    /// entry to entry).
    pub fn put(&mut self, out: &mut Vec<u8>, index: u32, decision: &WireDecision) {
        debug_assert!(index >= self.next_index, "answers in the batch's order");
        put_varint(out, u64::from(index.saturating_sub(self.next_index)));
        self.next_index = index.saturating_add(1);
        self.count += 1;
        put_decision(out, decision);
    }

    /// Fills in the section's length; returns how many entries it holds.
    pub fn end(self, out: &mut [u8]) -> u32 {
        let entries = out.len() - self.length_at - COUNT_ROOM_BYTES;
        end_counted(out, self.length_at, entries as u32);
        self.count
    }

    /// Drops the section, unfinished, from `out`.
    pub fn abandon(self, out: &mut Vec<u8>) {
        out.truncate(self.start);
    }
}

/// A batch-answers section's header, as read ([`tag::BATCH_ANSWERS`]).
pub struct BatchAnswersHeader<'a> {
    /// The incarnation of the node the answers are for.
    pub boot: u64,
    pub batch: u64,
    /// The entries, `(gap, decision)*`: read with [`BatchAnswers`].
    pub entries: &'a [u8],
}

impl<'a> BatchAnswersHeader<'a> {
    pub fn read(reader: &mut Reader<'a>) -> Result<BatchAnswersHeader<'a>, FrameError> {
        Ok(BatchAnswersHeader {
            boot: reader.fixed_u64()?,
            batch: reader.varint()?,
            entries: reader.bytes()?,
        })
    }
}

/// The entries of a batch-answers section, read one by one: the index of
/// the batch's op each answers, and its decision.
pub struct BatchAnswers<'a> {
    reader: Reader<'a>,
    next_index: u64,
    /// The index of the entry whose decision is next, once read.
    peeked: Option<u64>,
}

impl<'a> BatchAnswers<'a> {
    pub fn new(entries: &'a [u8]) -> BatchAnswers<'a> {
        BatchAnswers {
            reader: Reader::new(entries),
            next_index: 0,
            peeked: None,
        }
    }

    /// The next entry: its op's index and its decision; `None` after the
    /// last entry.
    #[inline(always)]
    pub fn next_entry(&mut self) -> Result<Option<(u64, WireDecision)>, FrameError> {
        let Some(index) = self.peek_index()? else {
            return Ok(None);
        };
        Ok(Some((index, self.take_decision()?)))
    }

    /// The op index of the next entry, its decision not read yet (see
    /// [`BatchAnswers::take_decision`]); `None` after the last entry.
    /// Indices only grow within a section.
    #[inline(always)]
    pub fn peek_index(&mut self) -> Result<Option<u64>, FrameError> {
        if self.peeked.is_none() && !self.reader.is_empty() {
            let index = self
                .next_index
                .checked_add(self.reader.varint()?)
                .ok_or(FrameError::Invalid("answer index"))?;
            self.next_index = index.saturating_add(1);
            self.peeked = Some(index);
        }
        Ok(self.peeked)
    }

    /// The decision of the entry [`BatchAnswers::peek_index`] gave the
    /// index of; an error if it gave none.
    #[inline(always)]
    pub fn take_decision(&mut self) -> Result<WireDecision, FrameError> {
        let mut decision = WireDecision::Full { live_keys_max: 0 };
        self.take_decision_into(&mut decision)?;
        Ok(decision)
    }

    /// [`BatchAnswers::take_decision`] read into `decision`, a decided
    /// hit inlined (see [`Reader::decision_into`]): returned whole from
    /// the reader's out-of-line form, the decision came back through
    /// memory a field at a time and was read back whole, a
    /// store-forwarding stall per forwarded hit (docs/benchmarks.md,
    /// "Twentieth round").
    #[inline(always)]
    pub fn take_decision_into(&mut self, decision: &mut WireDecision) -> Result<(), FrameError> {
        if self.peeked.take().is_none() {
            return Err(FrameError::Invalid("answer without its index"));
        }
        self.reader.decision_into(decision)
    }
}

/// A round-answers section's header, as read.
pub struct RoundAnswersHeader {
    /// The incarnation of the node the answers are for.
    pub boot: u64,
    pub round: u64,
    pub shard: u32,
    pub count: u32,
}

impl RoundAnswersHeader {
    pub fn read(reader: &mut Reader<'_>) -> Result<RoundAnswersHeader, FrameError> {
        Ok(RoundAnswersHeader {
            boot: reader.varint()?,
            round: reader.varint()?,
            shard: reader.u32()?,
            // A batch, an index and a decision: 3 bytes at least.
            count: reader.count(3)?,
        })
    }
}

/// A relay-answers section's header, as read: the node the answers are
/// for, then a round-answers header.
pub struct RelayAnswersHeader {
    pub to: NodeId,
    pub answers: RoundAnswersHeader,
}

impl RelayAnswersHeader {
    pub fn read(reader: &mut Reader<'_>) -> Result<RelayAnswersHeader, FrameError> {
        Ok(RelayAnswersHeader {
            to: reader.varint()?,
            answers: RoundAnswersHeader::read(reader)?,
        })
    }
}
