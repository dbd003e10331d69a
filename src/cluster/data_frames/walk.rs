//! Reading a data frame's sections without acting on them: [`walk_keys`]
//! decodes every section as the data plane would (for validation, tests
//! and fuzzing), and [`skim_keys`] steps over what carries no key, for the
//! prefetch that runs before a frame is handled. Both show their visitor
//! the same counter keys in the same order.

use super::{
    tag, Ack, BatchAnswers, BatchAnswersHeader, FrameError, Reader, RelayAnswersHeader,
    RoundAnswersHeader, RoundHeader, BUCKET_OP_CODE, LEASE_FLAG,
};
use crate::limiter::droplet_bucket::PERIOD_COUNT;

/// Reads every section of a data frame's body without acting on it (the
/// readers the data plane uses, in the same order); returns how many
/// sections there were. For the `data_frames` fuzz target and tests.
pub fn validate(body: &[u8]) -> Result<u32, FrameError> {
    walk_keys(body, |_| true)
}

/// Reads a data frame's sections without acting on them, showing `visit`
/// every counter key they carry (forwarded ops' and round states', in
/// order) until it answers `false`; returns how many sections were read.
pub fn walk_keys(body: &[u8], mut visit: impl FnMut(&[u8]) -> bool) -> Result<u32, FrameError> {
    let mut reader = Reader::new(body);
    let mut sections = 0;
    while !reader.is_empty() {
        match reader.u8()? {
            tag::FORWARD => {
                reader.varint()?;
                for _ in 0..reader.count(4)? {
                    if !visit(reader.op()?.key) {
                        return Ok(sections);
                    }
                }
            }
            tag::ANSWERS => {
                reader.varint()?;
                let count = reader.count(3)?;
                reader.answers_span(count)?;
            }
            tag::BATCH_ANSWERS => {
                let header = BatchAnswersHeader::read(&mut reader)?;
                let mut answers = BatchAnswers::new(header.entries);
                while answers.next_entry()?.is_some() {}
            }
            tag::ROUND_ANSWERS => {
                let header = RoundAnswersHeader::read(&mut reader)?;
                reader.answers_span(header.count)?;
            }
            tag::RELAY_ANSWERS => {
                let header = RelayAnswersHeader::read(&mut reader)?;
                reader.answers_span(header.answers.count)?;
            }
            tag::ROUND => {
                let header = RoundHeader::read(&mut reader)?;
                for _ in 0..header.count {
                    let key = reader.bytes()?;
                    reader.state()?;
                    if !visit(key) {
                        return Ok(sections);
                    }
                }
            }
            tag::ACK => {
                Ack::read(&mut reader)?;
            }
            tag::BEAT | tag::ACK_NOW => {}
            other => return Err(FrameError::UnknownTag(other)),
        }
        sections += 1;
    }
    Ok(sections)
}

/// [`walk_keys`] for the prefetch before a frame is handled: it steps over
/// what carries no key (answers, acks, a state's and an op's fields)
/// without decoding it, about twice as fast (its full decode was 76 ns of a
/// strict hit's 2.1 µs; docs/benchmarks.md, "Tenth round"). It checks
/// nothing beyond what it must to find the next key: a malformed frame ends
/// the walk, or shows `visit` bytes that are no key (the handling that
/// follows reports the frame; a prefetch of nothing is harmless), and a
/// frame [`walk_keys`] reads shows `visit` the same keys (the `peer_frames`
/// fuzz target checks both).
pub fn skim_keys(body: &[u8], mut visit: impl FnMut(&[u8]) -> bool) {
    let mut skim = Skim {
        reader: Reader::new(body),
    };
    let _ = skim.sections(&mut visit);
}

/// The reader of [`skim_keys`]: a [`Reader`] that steps over what it
/// need not decode; `None` ends the walk.
struct Skim<'a> {
    reader: Reader<'a>,
}

impl<'a> Skim<'a> {
    fn sections(&mut self, visit: &mut impl FnMut(&[u8]) -> bool) -> Option<()> {
        while !self.reader.is_empty() {
            match self.u8()? {
                tag::FORWARD => {
                    self.varint()?;
                    for _ in 0..self.varint()? {
                        if !visit(self.bytes()?) {
                            return None;
                        }
                        self.op_fields()?;
                    }
                }
                // A header of one varint (boot) or three (boot, round,
                // shard), then the answers.
                tag::ANSWERS => self.answers(1)?,
                tag::ROUND_ANSWERS => self.answers(3)?,
                // The node they are for, then as a round-answers section.
                tag::RELAY_ANSWERS => self.answers(4)?,
                // Boot (eight bytes) and batch, then the entries as one
                // byte string.
                tag::BATCH_ANSWERS => {
                    self.reader.fixed_u64().ok()?;
                    self.skip_varints(1)?;
                    self.bytes()?;
                }
                tag::ROUND => {
                    self.skip_varints(4)?;
                    for _ in 0..self.varint()? {
                        if !visit(self.bytes()?) {
                            return None;
                        }
                        self.state()?;
                    }
                }
                tag::ACK => {
                    self.skip_varints(2)?;
                    for _ in 0..self.varint()? {
                        self.skip_varints(2)?;
                        self.refusal_of_apply()?;
                    }
                }
                tag::BEAT | tag::ACK_NOW => {}
                _ => return None,
            }
        }
        Some(())
    }

    /// An answers section after its tag: `header` varints, the count, then
    /// `(batch, index, decision)` each.
    fn answers(&mut self, header: usize) -> Option<()> {
        self.skip_varints(header)?;
        for _ in 0..self.varint()? {
            self.skip_varints(2)?;
            self.decision()?;
        }
        Some(())
    }

    fn u8(&mut self) -> Option<u8> {
        self.reader.u8().ok()
    }

    fn varint(&mut self) -> Option<u64> {
        self.reader.varint().ok()
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        self.reader.bytes().ok()
    }

    /// Steps over `n` varints: each ends at its first byte under 0x80,
    /// found in one word when it is among the next eight bytes (see
    /// [`Reader::varint`]).
    fn skip_varints(&mut self, n: usize) -> Option<()> {
        for _ in 0..n {
            let bytes = self.reader.bytes;
            let ends = bytes.first_chunk::<8>().map_or(0, |chunk| {
                !u64::from_le_bytes(*chunk) & 0x8080_8080_8080_8080
            });
            let end = if ends != 0 {
                (ends.trailing_zeros() / 8) as usize
            } else {
                bytes.iter().position(|&byte| byte < 0x80)?
            };
            self.reader.bytes = &bytes[end + 1..];
        }
        Some(())
    }

    /// An op's fields after its key (see [`put_op`]).
    fn op_fields(&mut self) -> Option<()> {
        let flags = self.u8()?;
        if flags & 0x7f == BUCKET_OP_CODE {
            self.skip_varints(1)?; // count
            self.u8()?; // reset
            return self.skip_varints(1 + PERIOD_COUNT); // cleanup, limits
        }
        // The quota, and a lease's size when one is asked for.
        self.skip_varints(2 + usize::from(flags & LEASE_FLAG != 0))
    }

    fn state(&mut self) -> Option<()> {
        let fields = match self.u8()? {
            0 | 1 => 2,
            2 => 3,
            3 => 5,
            _ => return None,
        };
        self.skip_varints(fields)
    }

    fn decision(&mut self) -> Option<()> {
        match self.u8()? {
            0 | 1 => self.skip_varints(2),
            6 => self.skip_varints(3),
            2 | 3 => {
                self.skip_varints(1)?;
                self.refusal()
            }
            4 => self.skip_varints(1),
            5 => {
                self.u8()?;
                // A balance per period whose bit is set (the others are not
                // read: see `Reader::decision`).
                let periods = self.u8()? & ((1 << PERIOD_COUNT) - 1);
                self.skip_varints(periods.count_ones() as usize)
            }
            _ => None,
        }
    }

    /// An ack's refusal (see [`put_ack`]).
    fn refusal_of_apply(&mut self) -> Option<()> {
        match self.u8()? {
            0 => self.skip_varints(1),
            1 => Some(()),
            _ => None,
        }
    }

    fn refusal(&mut self) -> Option<()> {
        match self.u8()? {
            0 | 3 | 4 | 7 => Some(()),
            1 | 2 | 5 | 6 => self.skip_varints(1),
            8 => self.bytes().map(drop),
            _ => None,
        }
    }
}
