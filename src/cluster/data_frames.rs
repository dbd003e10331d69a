//! The bytes of the peer *data stream*: the hot messages between two nodes
//! (forwarded hits, their answers, replication rounds, acknowledgements,
//! liveness beats), hand-encoded because they carry every hit. Control
//! messages (Raft RPCs, status, membership) stay in [`codec`](super::codec)
//! with bincode.
//!
//! A data frame is the usual frame header (`u32 LE length`, `u64 LE id` =
//! [`DATA_FRAME_ID`]) followed by *sections*: `tag u8`, then the section's
//! fields. Integers are LEB128 varints (signed ones zigzagged), byte strings
//! are a varint length and the bytes. Everything a reader decodes is
//! bounds-checked: a short or garbled frame is an error, never a panic, and
//! a claimed length larger than what is left is refused before anything is
//! allocated (the `data_frames` fuzz target checks this). Varints are
//! written and read in `varint.rs`, the sections answering forwarded hits in
//! `answers.rs`, and frames walked without acting on them in `walk.rs`.

use super::wire::{ApplyRefusal, ShardRefusal, WireDecision};
use crate::limiter::droplet_bucket::{TakeRequest, PERIOD_COUNT};
use crate::limiter::{CounterState, FullAt, PeriodCell};
use crate::rules::Algorithm;

/// The request id that marks a frame as a data frame (control frames use
/// ids from 0 up, answered in kind).
pub const DATA_FRAME_ID: u64 = u64::MAX;

/// Section tags.
pub mod tag {
    /// Hits for shards the receiver leads: `batch varint, count varint, ops`.
    pub const FORWARD: u8 = 1;
    /// Answers to forwarded hits: `boot varint` (the incarnation of the
    /// node that forwarded them), `count varint, (batch, index, decision)*`.
    pub const ANSWERS: u8 = 2;
    /// Counter states a leader decided: `round varint, stamped_ms varint,
    /// shard varint, term varint, count varint, (key, state)*`.
    pub const ROUND: u8 = 3;
    /// Rounds applied: `boot varint` (the leader incarnation whose rounds
    /// these are), `upto varint, count varint, (round, shard, refusal)*`.
    pub const ACK: u8 = 4;
    /// Nothing to say: the sender is alive.
    pub const BEAT: u8 = 5;
    /// Answers to hits the receiver forwarded, whose states the ROUND
    /// section just before carries: `boot varint` (the receiver's
    /// incarnation), `round varint, shard varint, count varint, (batch,
    /// index, decision)*`. They hold once the receiver has applied that
    /// section: the leader and the receiver then hold the states, a
    /// majority of the shard's voters (the leader sends them only then).
    /// Peer protocol 2.1 (`peer_protocol::ROUND_ANSWERS_MINOR`).
    pub const ROUND_ANSWERS: u8 = 6;
    /// Answers to one forwarded batch's hits: `boot` (the incarnation of
    /// the node that forwarded them, eight bytes little endian: as a varint
    /// it takes nine or ten, one at a time), `batch varint`, then
    /// the entries as a byte string (their length a varint padded to five
    /// bytes, filled in once they are written): `(gap varint, decision)*`,
    /// where `gap` is how many of the batch's ops were passed over since the
    /// previous entry's (its index is the previous one's plus `gap` plus 1,
    /// the first's `gap` itself). Peer protocol 2.2
    /// (`peer_protocol::BATCH_ANSWERS_MINOR`).
    pub const BATCH_ANSWERS: u8 = 7;
    /// Answers for a third node, which forwarded hits whose states the
    /// ROUND section just before carries, for the receiver (a follower of
    /// the shard) to send on as an `ANSWERS` section once it has applied
    /// that section (the leader and it then hold the states, a majority):
    /// `to varint` (the node that forwarded them), then as `ROUND_ANSWERS`:
    /// `boot varint` (its incarnation), `round varint, shard varint, count
    /// varint, (batch, index, decision)*`. Peer protocol 2.4
    /// (`peer_protocol::RELAY_ANSWERS_MINOR`).
    pub const RELAY_ANSWERS: u8 = 8;
    /// No fields: the leader waits on the ROUND section that follows (its
    /// own clients' hits, or answers no follower carries on), so the
    /// receiver acknowledges the frame at once. Without it, a receiver
    /// talking peer protocol 2.5 or later acknowledges with its next frame
    /// to the leader or its link's next beat. Sent alone (a handover
    /// waiting on its shard's last rounds), it asks for the acks the
    /// receiver holds. Peer protocol 2.5 (`peer_protocol::ACK_ON_ASK_MINOR`).
    pub const ACK_NOW: u8 = 9;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("data frame ends inside a section")]
    Truncated,
    #[error("data frame has an unknown section tag {0}")]
    UnknownTag(u8),
    #[error("data frame has an invalid {0}")]
    Invalid(&'static str),
}

fn put_signed(out: &mut Vec<u8>, value: i64) {
    put_varint(out, ((value << 1) ^ (value >> 63)) as u64);
}

pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_text(out: &mut Vec<u8>, text: &str) {
    put_bytes(out, text.as_bytes());
}

/// Appends a counter state.
pub fn put_state(out: &mut Vec<u8>, state: &CounterState) {
    match *state {
        CounterState::Window { end_ms, used } => {
            out.push(0);
            put_varint(out, end_ms);
            put_varint(out, used);
        }
        CounterState::TokenBucket { full_at } => {
            let (ms, remainder) = full_at.to_parts();
            out.push(1);
            put_varint(out, ms);
            put_varint(out, remainder);
        }
        CounterState::SlidingWindow {
            expires_at_ms,
            current,
            previous,
        } => {
            out.push(2);
            put_varint(out, expires_at_ms);
            put_varint(out, current);
            put_varint(out, previous);
        }
        CounterState::DropletPeriod(cell) => {
            out.push(3);
            put_varint(out, cell.version);
            put_varint(out, cell.forget_at_ms);
            put_varint(out, cell.full_ms);
            put_varint(out, u64::from(cell.remainder));
            put_varint(out, u64::from(cell.limit));
        }
    }
}

fn algorithm_code(algorithm: Algorithm) -> u8 {
    match algorithm {
        Algorithm::FixedWindow => 0,
        Algorithm::TokenBucket => 1,
        Algorithm::SlidingWindow => 2,
    }
}

/// The op code of a droplet bucket's take or query (beside the algorithms').
const BUCKET_OP_CODE: u8 = 3;
/// A rule op's flag: the forwarder asks for a quota lease, whose size
/// follows the quota as a varint ([`OpView::lease_wanted`]; peer protocol
/// 2.3, `peer_protocol::LEASES_MINOR`).
const LEASE_FLAG: u8 = 0x40;
/// The bits of an op's first byte that name its algorithm or op code.
const OP_CODE_MASK: u8 = 0x3f;

/// Appends one forwarded op: key, algorithm and peek in one byte, quota;
/// for a droplet bucket ([`OpView::bucket`]), the code 3 (peek: a query),
/// then the count, the reset flag, the cleanup interval and the six limits.
pub fn put_op(out: &mut Vec<u8>, op: &OpView<'_>) {
    put_bytes(out, op.key);
    put_op_params(out, op);
}

/// Appends what follows an op's key (see [`put_op`]): its flags, then a
/// rule's algorithm and quota or a droplet bucket's take.
pub fn put_op_params(out: &mut Vec<u8>, op: &OpView<'_>) {
    let peek = if op.peek { 0x80 } else { 0 };
    if let Some(bucket) = &op.bucket {
        out.push(BUCKET_OP_CODE | peek);
        put_signed(out, i64::from(bucket.request.count));
        out.push(u8::from(bucket.request.reset));
        put_varint(out, bucket.cleanup_interval_ms);
        for limit in bucket.request.limits {
            put_varint(out, u64::from(limit));
        }
        return;
    }
    let lease = if op.lease_wanted > 0 { LEASE_FLAG } else { 0 };
    out.push(algorithm_code(op.algorithm) | peek | lease);
    put_varint(out, op.credit_limit);
    put_varint(out, op.reset_seconds);
    if op.lease_wanted > 0 {
        put_varint(out, u64::from(op.lease_wanted));
    }
}

fn put_refusal(out: &mut Vec<u8>, refusal: &ShardRefusal) {
    match refusal {
        ShardRefusal::NoLeader => out.push(0),
        ShardRefusal::NotLeader(node) => {
            out.push(1);
            put_varint(out, *node);
        }
        ShardRefusal::NotReplicated(node) => {
            out.push(2);
            put_varint(out, *node);
        }
        ShardRefusal::HandingOver => out.push(3),
        ShardRefusal::Preparing => out.push(4),
        ShardRefusal::Superseded(term) => {
            out.push(5);
            put_varint(out, *term);
        }
        ShardRefusal::CommitTimeout(ms) => {
            out.push(6);
            put_varint(out, *ms);
        }
        ShardRefusal::InvalidQuota => out.push(7),
        ShardRefusal::Other(text) => {
            out.push(8);
            put_text(out, text);
        }
    }
}

/// Appends one decision.
pub fn put_decision(out: &mut Vec<u8>, decision: &WireDecision) {
    match decision {
        WireDecision::Decided {
            allowed,
            credit,
            next_reset_seconds,
        } => {
            out.push(u8::from(*allowed));
            put_signed(out, *credit);
            put_signed(out, *next_reset_seconds);
        }
        WireDecision::Unavailable { shard, why } => {
            out.push(2);
            put_varint(out, u64::from(*shard));
            put_refusal(out, why);
        }
        WireDecision::Retry { shard, why } => {
            out.push(3);
            put_varint(out, u64::from(*shard));
            put_refusal(out, why);
        }
        WireDecision::Full { live_keys_max } => {
            out.push(4);
            put_varint(out, *live_keys_max);
        }
        WireDecision::Leased {
            credit,
            next_reset_seconds,
            lease,
        } => {
            out.push(6);
            put_signed(out, *credit);
            put_signed(out, *next_reset_seconds);
            put_varint(out, u64::from(*lease));
        }
        WireDecision::Bucket { accept, balances } => {
            out.push(5);
            out.push(u8::from(*accept));
            let mask = balances
                .iter()
                .enumerate()
                .fold(0u8, |mask, (i, b)| mask | u8::from(b.is_some()) << i);
            out.push(mask);
            for balance in balances.iter().flatten() {
                put_signed(out, i64::from(*balance));
            }
        }
    }
}

/// Starts a section that ends with a count: writes the tag and the fixed
/// fields, and reserves room for the count (5 bytes, enough for a u32).
/// [`end_counted`] fills it in.
pub fn begin_counted(out: &mut Vec<u8>, tag: u8, fields: &[u64]) -> usize {
    out.push(tag);
    begin_counted_fields(out, fields)
}

/// [`begin_counted`] after the tag.
fn begin_counted_fields(out: &mut Vec<u8>, fields: &[u64]) -> usize {
    for &field in fields {
        put_varint(out, field);
    }
    let at = out.len();
    out.extend_from_slice(&[0x80, 0x80, 0x80, 0x80, 0x00][..COUNT_ROOM_BYTES]);
    at
}

/// Writes `count` into the room [`begin_counted`] reserved at `at`, as a
/// five-byte varint (padded with continuation bits).
pub fn end_counted(out: &mut [u8], at: usize, count: u32) {
    let mut value = count;
    for i in 0..COUNT_ROOM_BYTES {
        let last = i == COUNT_ROOM_BYTES - 1;
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        out[at + i] = if last { byte } else { byte | 0x80 };
    }
}

/// Bytes of the room [`begin_counted`] reserves for a count or length.
pub const COUNT_ROOM_BYTES: usize = 5;

/// A forwarded op as it is read (borrowing the frame's bytes) or written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpView<'a> {
    pub key: &'a [u8],
    pub algorithm: Algorithm,
    pub credit_limit: u64,
    pub reset_seconds: u64,
    pub peek: bool,
    /// A droplet bucket's take (or, with `peek`, query) instead of a rule's
    /// hit: `key` is then the bucket's first period key
    /// (`cluster::buckets`), and the algorithm and quota are unused.
    pub bucket: Option<BucketOp>,
    /// Credits the forwarding node asks to hold as a quota lease beside
    /// this hit's answer (`forward/leases.rs`); 0: none. Sent only to a
    /// peer that talks peer protocol 2.3 (`peer_protocol::LEASES_MINOR`).
    pub lease_wanted: u32,
}

impl OpView<'_> {
    /// An op of nothing, to be read into ([`Reader::op_into`]).
    pub const EMPTY: OpView<'static> = OpView {
        key: &[],
        algorithm: Algorithm::FixedWindow,
        credit_limit: 0,
        reset_seconds: 0,
        peek: false,
        bucket: None,
        lease_wanted: 0,
    };
}

/// A droplet take or query as it is forwarded to the bucket's leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketOp {
    pub request: TakeRequest,
    /// The requesting node's `--droplet-cleanup-interval-ms`.
    pub cleanup_interval_ms: u64,
}

/// A bounds-checked reader over a frame's body.
pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes }
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.bytes.len()
    }

    pub fn u8(&mut self) -> Result<u8, FrameError> {
        let (&first, rest) = self.bytes.split_first().ok_or(FrameError::Truncated)?;
        self.bytes = rest;
        Ok(first)
    }

    pub fn u32(&mut self) -> Result<u32, FrameError> {
        u32::try_from(self.varint()?).map_err(|_| FrameError::Invalid("32-bit number"))
    }

    fn signed(&mut self) -> Result<i64, FrameError> {
        let raw = self.varint()?;
        Ok(((raw >> 1) as i64) ^ -((raw & 1) as i64))
    }

    pub fn bytes(&mut self) -> Result<&'a [u8], FrameError> {
        let length = self.varint()?;
        let length = usize::try_from(length).map_err(|_| FrameError::Truncated)?;
        if length > self.bytes.len() {
            return Err(FrameError::Truncated);
        }
        let (taken, rest) = self.bytes.split_at(length);
        self.bytes = rest;
        Ok(taken)
    }

    fn text(&mut self) -> Result<String, FrameError> {
        let bytes = self.bytes()?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// Reads a counter state: inlined into the round loops (see
    /// [`Reader::op`]), a droplet period out of line.
    #[inline(always)]
    pub fn state(&mut self) -> Result<CounterState, FrameError> {
        Ok(match self.u8()? {
            0 => CounterState::Window {
                end_ms: self.varint()?,
                used: self.varint()?,
            },
            1 => {
                let ms = self.varint()?;
                let remainder = self.varint()?;
                CounterState::TokenBucket {
                    full_at: FullAt::from_parts(ms, remainder),
                }
            }
            2 => CounterState::SlidingWindow {
                expires_at_ms: self.varint()?,
                current: self.varint()?,
                previous: self.varint()?,
            },
            3 => self.period_state()?,
            _ => return Err(FrameError::Invalid("counter state")),
        })
    }

    /// The rest of a droplet period's state (see [`Reader::state`]).
    #[inline(never)]
    fn period_state(&mut self) -> Result<CounterState, FrameError> {
        Ok(CounterState::DropletPeriod(PeriodCell {
            version: self.varint()?,
            forget_at_ms: self.varint()?,
            full_ms: self.varint()?,
            remainder: self.u32()?,
            limit: self.u32()?,
        }))
    }

    /// Reads a forwarded op.
    pub fn op(&mut self) -> Result<OpView<'a>, FrameError> {
        let mut op = OpView::EMPTY;
        self.op_into(&mut op)?;
        Ok(op)
    }

    /// Reads a forwarded op into `op`, field by field (the frame loop's
    /// form, inlined; a droplet bucket's form out of line). An op returned
    /// whole went through memory: its fields stored one by one, then read
    /// back 16 bytes at a time, which the store buffer cannot forward, a
    /// stall on every forwarded hit (docs/benchmarks.md, "Fifteenth
    /// round").
    #[inline(always)]
    pub fn op_into(&mut self, op: &mut OpView<'a>) -> Result<(), FrameError> {
        let key = self.bytes()?;
        let flags = self.u8()?;
        if flags & 0x7f == BUCKET_OP_CODE {
            *op = self.bucket_op(key, flags)?;
            return Ok(());
        }
        op.algorithm = match flags & OP_CODE_MASK {
            0 => Algorithm::FixedWindow,
            1 => Algorithm::TokenBucket,
            2 => Algorithm::SlidingWindow,
            _ => return Err(FrameError::Invalid("algorithm")),
        };
        op.key = key;
        op.peek = flags & 0x80 != 0;
        op.credit_limit = self.varint()?;
        op.reset_seconds = self.varint()?;
        op.bucket = None;
        op.lease_wanted = if flags & LEASE_FLAG != 0 {
            u32::try_from(self.varint()?).map_err(|_| FrameError::Invalid("lease size"))?
        } else {
            0
        };
        Ok(())
    }

    /// The rest of a droplet bucket's op (see [`Reader::op_into`]).
    #[inline(never)]
    fn bucket_op(&mut self, key: &'a [u8], flags: u8) -> Result<OpView<'a>, FrameError> {
        let count =
            i32::try_from(self.signed()?).map_err(|_| FrameError::Invalid("bucket count"))?;
        let reset = match self.u8()? {
            0 => false,
            1 => true,
            _ => return Err(FrameError::Invalid("bucket reset flag")),
        };
        let cleanup_interval_ms = self.varint()?;
        let mut limits = [0; PERIOD_COUNT];
        for limit in &mut limits {
            *limit = self.u32()?;
        }
        Ok(OpView {
            key,
            algorithm: Algorithm::FixedWindow,
            credit_limit: 0,
            reset_seconds: 0,
            peek: flags & 0x80 != 0,
            bucket: Some(BucketOp {
                request: TakeRequest {
                    count,
                    reset,
                    limits,
                },
                cleanup_interval_ms,
            }),
            lease_wanted: 0,
        })
    }

    fn refusal(&mut self) -> Result<ShardRefusal, FrameError> {
        Ok(match self.u8()? {
            0 => ShardRefusal::NoLeader,
            1 => ShardRefusal::NotLeader(self.varint()?),
            2 => ShardRefusal::NotReplicated(self.varint()?),
            3 => ShardRefusal::HandingOver,
            4 => ShardRefusal::Preparing,
            5 => ShardRefusal::Superseded(self.varint()?),
            6 => ShardRefusal::CommitTimeout(self.varint()?),
            7 => ShardRefusal::InvalidQuota,
            8 => ShardRefusal::Other(self.text()?),
            _ => return Err(FrameError::Invalid("refusal")),
        })
    }

    /// Reads an answer's decision.
    pub fn decision(&mut self) -> Result<WireDecision, FrameError> {
        let mut decision = WireDecision::Full { live_keys_max: 0 };
        self.decision_into(&mut decision)?;
        Ok(decision)
    }

    /// Reads an answer's decision into `decision` (see
    /// [`Reader::op_into`]): a decided hit inlined, the others (refusals,
    /// droplet answers) out of line.
    #[inline(always)]
    pub fn decision_into(&mut self, decision: &mut WireDecision) -> Result<(), FrameError> {
        match self.u8()? {
            code @ (0 | 1) => {
                let credit = self.signed()?;
                let next_reset_seconds = self.signed()?;
                *decision = WireDecision::Decided {
                    allowed: code == 1,
                    credit,
                    next_reset_seconds,
                };
            }
            6 => {
                let credit = self.signed()?;
                let next_reset_seconds = self.signed()?;
                let lease = self.u32()?;
                *decision = WireDecision::Leased {
                    credit,
                    next_reset_seconds,
                    lease,
                };
            }
            code => *decision = self.rare_decision(code)?,
        }
        Ok(())
    }

    /// Reads past `count` answers, `(batch, index, decision)`, checking
    /// each, and returns their bytes as they are (a relayed section's
    /// entries, sent on unchanged).
    pub fn answers_span(&mut self, count: u32) -> Result<&'a [u8], FrameError> {
        let start = self.bytes;
        let mut skipped = WireDecision::Full { live_keys_max: 0 };
        for _ in 0..count {
            self.varint()?;
            self.u32()?;
            self.decision_into(&mut skipped)?;
        }
        Ok(&start[..start.len() - self.bytes.len()])
    }

    /// Reads `count` answers, `(batch, index, decision)`, appending them to
    /// `into` when `keep` (else reading past them). Each is decoded where
    /// it will stay, not built and then copied (see [`Reader::op_into`]).
    #[inline(always)]
    pub fn answers_into(
        &mut self,
        count: u32,
        keep: bool,
        into: &mut Vec<(u64, u32, WireDecision)>,
    ) -> Result<(), FrameError> {
        if !keep {
            return self.answers_span(count).map(|_| ());
        }
        let placeholder = (0, 0, WireDecision::Full { live_keys_max: 0 });
        // The section's entries made first, then each filled in where it
        // lies; an answer takes three bytes at least, so a count the frame
        // cannot hold is refused before anything is made.
        if (count as usize).saturating_mul(3) > self.remaining() {
            return Err(FrameError::Truncated);
        }
        let start = into.len();
        into.resize(start + count as usize, placeholder);
        for entry in &mut into[start..] {
            let read = (|| {
                entry.0 = self.varint()?;
                entry.1 = self.u32()?;
                self.decision_into(&mut entry.2)
            })();
            if let Err(error) = read {
                into.truncate(start);
                return Err(error);
            }
        }
        Ok(())
    }

    /// The decisions other than a decided hit (see [`Reader::decision_into`]).
    #[inline(never)]
    fn rare_decision(&mut self, code: u8) -> Result<WireDecision, FrameError> {
        Ok(match code {
            2 => WireDecision::Unavailable {
                shard: self.u32()?,
                why: self.refusal()?,
            },
            3 => WireDecision::Retry {
                shard: self.u32()?,
                why: self.refusal()?,
            },
            4 => WireDecision::Full {
                live_keys_max: self.varint()?,
            },
            5 => {
                let accept = self.u8()? != 0;
                let mask = self.u8()?;
                let mut balances = [None; PERIOD_COUNT];
                for (i, balance) in balances.iter_mut().enumerate() {
                    if mask & (1 << i) != 0 {
                        let value = i32::try_from(self.signed()?)
                            .map_err(|_| FrameError::Invalid("bucket balance"))?;
                        *balance = Some(value);
                    }
                }
                WireDecision::Bucket { accept, balances }
            }
            _ => return Err(FrameError::Invalid("decision")),
        })
    }

    /// A count of items each at least `min_bytes` long, checked against
    /// what is left (so a garbled count cannot make a reader reserve much).
    pub fn count(&mut self, min_bytes: usize) -> Result<u32, FrameError> {
        let count = self.u32()?;
        if (count as usize).saturating_mul(min_bytes.max(1)) > self.bytes.len() {
            return Err(FrameError::Truncated);
        }
        Ok(count)
    }
}

/// A replication round section, as read.
pub struct RoundHeader {
    pub round: u64,
    pub stamped_ms: u64,
    pub shard: u32,
    pub term: u64,
    pub count: u32,
}

impl RoundHeader {
    pub fn read(reader: &mut Reader<'_>) -> Result<RoundHeader, FrameError> {
        Ok(RoundHeader {
            round: reader.varint()?,
            stamped_ms: reader.varint()?,
            shard: reader.u32()?,
            term: reader.varint()?,
            // A key (1 byte at least) and a state (3 bytes at least).
            count: reader.count(4)?,
        })
    }
}

/// Appends an ack section: every round up to `upto` of the leader's
/// incarnation `boot` was applied, except the listed sections.
pub fn put_ack(out: &mut Vec<u8>, boot: u64, upto: u64, refused: &[(u64, u32, ApplyRefusal)]) {
    out.push(tag::ACK);
    put_varint(out, boot);
    put_varint(out, upto);
    put_varint(out, refused.len() as u64);
    for &(round, shard, refusal) in refused {
        put_varint(out, round);
        put_varint(out, u64::from(shard));
        match refusal {
            ApplyRefusal::Fenced { term } => {
                out.push(0);
                put_varint(out, term);
            }
            ApplyRefusal::NotReplica => out.push(1),
        }
    }
}

/// An ack section, as read.
pub struct Ack {
    pub boot: u64,
    pub upto: u64,
    pub refused: Vec<(u64, u32, ApplyRefusal)>,
}

impl Ack {
    pub fn read(reader: &mut Reader<'_>) -> Result<Ack, FrameError> {
        let boot = reader.varint()?;
        let upto = reader.varint()?;
        let count = reader.count(3)?;
        let mut refused = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let round = reader.varint()?;
            let shard = reader.u32()?;
            let refusal = match reader.u8()? {
                0 => ApplyRefusal::Fenced {
                    term: reader.varint()?,
                },
                1 => ApplyRefusal::NotReplica,
                _ => return Err(FrameError::Invalid("apply refusal")),
            };
            refused.push((round, shard, refusal));
        }
        Ok(Ack {
            boot,
            upto,
            refused,
        })
    }
}

mod answers;
mod varint;
mod walk;
pub use answers::{
    BatchAnswers, BatchAnswersHeader, BatchAnswersWriter, RelayAnswersHeader, RoundAnswersHeader,
};
pub use varint::put_varint;
pub use walk::{skim_keys, validate, walk_keys};

#[cfg(test)]
mod tests;
