//! What this node has to send one peer on the data stream (its outbox), and
//! what it knows of the peer's link: connected or not, when the peer was
//! last heard from. Producers (serving threads, the replicator, frames
//! being read) append encoded sections; the peer's link takes everything
//! appended so far as one frame whenever it wakes (see `links.rs`).

use super::data_frames::{begin_counted, end_counted, put_ack, tag, DATA_FRAME_ID};
use super::wire::ApplyRefusal;
use super::NodeId;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::Instant;
use tokio::sync::Notify;

/// Bytes a peer's outbox may hold before new data for it is turned away
/// (the peer, or the link to it, is not keeping up).
pub const OUTBOX_BYTES_MAX: usize = 32 * 1024 * 1024;
/// Bytes of a frame header: length and request id.
const FRAME_HEADER_BYTES: usize = 12;

struct OutInner {
    /// The frame being built: a reserved header, then sections.
    body: Vec<u8>,
    spare: Vec<u8>,
    /// The peer incarnation whose rounds are acknowledged, and the highest
    /// of its rounds applied here.
    ack_boot: u64,
    ack_upto: u64,
    ack_refused: Vec<(u64, u32, ApplyRefusal)>,
    ack_dirty: bool,
    /// The `FORWARD` section at the end of `body`, which later forwards
    /// join while nothing else is appended after it.
    open_forward: Option<OpenForward>,
}

/// A `FORWARD` section still open for more ops (see [`PeerOut::append_forward`]).
#[derive(Clone, Copy)]
struct OpenForward {
    batch: u64,
    /// Where its count's room is in the body.
    count_at: usize,
    count: u32,
    /// The body's length when its last op was appended: it is still open
    /// while the body ends there.
    end: usize,
}

/// Most ops one `FORWARD` section carries: the leader decides a section's
/// ops and writes their answers in one go, and a forward joins an open
/// section only below this.
pub const FORWARD_SECTION_OPS_MAX: u32 = 1024;

/// Where [`PeerOut::append_forward`] put a batch's ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardPlaced {
    /// The section's batch id.
    pub batch: u64,
    /// The index of the first of the ops in the section.
    pub first: u32,
    /// Whether they joined a section opened by an earlier forward (whose
    /// appender woke the link already).
    pub joined: bool,
    /// The frame they will go in.
    pub frame: u64,
}

impl OutInner {
    fn is_empty(&self) -> bool {
        self.body.len() <= FRAME_HEADER_BYTES && !self.ack_dirty
    }
}

/// What this node has to send one peer on the data stream, and what it
/// knows of the peer's link.
pub struct PeerOut {
    pub peer: NodeId,
    inner: Mutex<OutInner>,
    /// Wakes the peer's link writer.
    pub wake: Notify,
    pub(super) connected: AtomicBool,
    /// The peer protocol minor the link talks at (`peer_protocol.rs`):
    /// sections a minor added go only to peers that negotiated it.
    pub(super) minor: AtomicU8,
    /// Frames taken by the link so far (forwards appended after the last
    /// take have not left this node).
    taken: AtomicU64,
    /// When something was last heard from the peer (ms since `epoch`).
    heard_ms: AtomicU64,
    /// The newest incarnation of the peer that said hello to this node.
    peer_boot: AtomicU64,
    epoch: Instant,
}

impl PeerOut {
    pub fn new(peer: NodeId, epoch: Instant) -> PeerOut {
        PeerOut {
            peer,
            inner: Mutex::new(OutInner {
                body: vec![0; FRAME_HEADER_BYTES],
                spare: Vec::new(),
                ack_boot: 0,
                ack_upto: 0,
                ack_refused: Vec::new(),
                ack_dirty: false,
                open_forward: None,
            }),
            wake: Notify::new(),
            connected: AtomicBool::new(false),
            minor: AtomicU8::new(0),
            taken: AtomicU64::new(0),
            // A peer learned of just now gets the benefit of the doubt for
            // one liveness timeout.
            heard_ms: AtomicU64::new((epoch.elapsed().as_millis() as u64).max(1)),
            peer_boot: AtomicU64::new(0),
            epoch,
        }
    }

    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Does the link talk peer protocol minor `minor` or later?
    pub fn speaks_minor(&self, minor: u8) -> bool {
        self.minor.load(Ordering::Acquire) >= minor
    }

    /// Records that the peer was heard from just now.
    pub fn heard(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.heard_ms.store(ms.max(1), Ordering::Relaxed);
    }

    /// Notes the incarnation of a connection from the peer; says whether it
    /// is the newest one seen (an older one belongs to a process that
    /// restarted since: what it sends is stale).
    pub fn note_boot(&self, boot: u64) -> bool {
        self.peer_boot.fetch_max(boot, Ordering::AcqRel) <= boot
    }

    /// The newest incarnation of the peer seen.
    pub fn peer_boot(&self) -> u64 {
        self.peer_boot.load(Ordering::Acquire)
    }

    /// Heard from at all, since this process started?
    pub fn heard_ever(&self) -> bool {
        self.heard_ms.load(Ordering::Relaxed) != 0
    }

    /// Heard from within `ms`?
    pub fn heard_within(&self, ms: u64) -> bool {
        let at = self.heard_ms.load(Ordering::Relaxed);
        at != 0 && (self.epoch.elapsed().as_millis() as u64).saturating_sub(at) < ms
    }

    /// Appends sections with `write`, unless the outbox is full; returns
    /// the number of the frame they will go in.
    pub fn append(&self, write: impl FnOnce(&mut Vec<u8>)) -> Option<u64> {
        let mut inner = self.inner.lock();
        if inner.body.len() > OUTBOX_BYTES_MAX {
            return None;
        }
        write(&mut inner.body);
        Some(self.taken.load(Ordering::Acquire) + 1)
    }

    /// Appends `count` encoded ops forwarded to the peer (see
    /// [`ForwardPlaced`]): to the `FORWARD` section at the body's end when
    /// there is one, `may_join` accepts its batch and it has room for them,
    /// else in a new section of batch `new_batch()`. `None` when the outbox
    /// is full.
    pub fn append_forward<'a>(
        &self,
        new_batch: impl FnOnce() -> u64,
        may_join: impl FnOnce(u64) -> bool,
        count: u32,
        ops: impl Iterator<Item = &'a [u8]>,
    ) -> Option<ForwardPlaced> {
        let mut inner = self.inner.lock();
        if inner.body.len() > OUTBOX_BYTES_MAX {
            return None;
        }
        let frame = self.taken.load(Ordering::Acquire) + 1;
        let open = inner.open_forward.filter(|open| {
            open.end == inner.body.len()
                && open.count.saturating_add(count) <= FORWARD_SECTION_OPS_MAX
                && may_join(open.batch)
        });
        let inner = &mut *inner;
        let body = &mut inner.body;
        let (mut section, joined) = match open {
            Some(open) => (open, true),
            None => {
                let batch = new_batch();
                let count_at = begin_counted(body, tag::FORWARD, &[batch]);
                let section = OpenForward {
                    batch,
                    count_at,
                    count: 0,
                    end: 0,
                };
                (section, false)
            }
        };
        let first = section.count;
        for op in ops {
            body.extend_from_slice(op);
        }
        section.count += count;
        end_counted(body, section.count_at, section.count);
        section.end = body.len();
        inner.open_forward = Some(section);
        Some(ForwardPlaced {
            batch: section.batch,
            first,
            joined,
            frame,
        })
    }

    /// Records that the rounds up to `round` of the peer's incarnation
    /// `boot` were applied here, except the sections `refused` lists
    /// (`(round, shard, why)`). Rounds of an older incarnation than one
    /// already acknowledged are not acknowledged: that leader is gone, and
    /// its round numbers mean nothing to its successor.
    pub fn record_ack(&self, boot: u64, round: u64, refused: &[(u64, u32, ApplyRefusal)]) {
        let mut inner = self.inner.lock();
        if boot != inner.ack_boot {
            if boot < inner.ack_boot {
                return;
            }
            inner.ack_boot = boot;
            inner.ack_upto = 0;
            inner.ack_refused.clear();
        }
        inner.ack_upto = inner.ack_upto.max(round);
        let room = 65_536usize.saturating_sub(inner.ack_refused.len());
        inner.ack_refused.extend(refused.iter().copied().take(room));
        inner.ack_dirty = true;
    }

    /// Takes the frame built so far (header filled in), if there is
    /// anything to send. Give the buffer back with [`PeerOut::give_back`].
    pub fn take_frame(&self) -> Option<Vec<u8>> {
        let mut inner = self.inner.lock();
        if inner.is_empty() {
            return None;
        }
        if inner.ack_dirty {
            let (boot, upto) = (inner.ack_boot, inner.ack_upto);
            let refused = std::mem::take(&mut inner.ack_refused);
            put_ack(&mut inner.body, boot, upto, &refused);
            inner.ack_dirty = false;
        }
        let mut next = std::mem::take(&mut inner.spare);
        next.clear();
        next.resize(FRAME_HEADER_BYTES, 0);
        let mut frame = std::mem::replace(&mut inner.body, next);
        inner.open_forward = None;
        self.taken.fetch_add(1, Ordering::AcqRel);
        drop(inner);
        let length = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&length.to_le_bytes());
        frame[4..FRAME_HEADER_BYTES].copy_from_slice(&DATA_FRAME_ID.to_le_bytes());
        Some(frame)
    }

    /// Returns a frame's buffer for reuse.
    pub fn give_back(&self, frame: Vec<u8>) {
        if frame.capacity() <= 4 * 1024 * 1024 {
            self.inner.lock().spare = frame;
        }
    }

    /// A frame with only a liveness beat.
    pub fn beat_frame() -> Vec<u8> {
        let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES + 1);
        frame.extend_from_slice(&((8 + 1) as u32).to_le_bytes());
        frame.extend_from_slice(&DATA_FRAME_ID.to_le_bytes());
        frame.push(tag::BEAT);
        frame
    }

    /// Drops what was queued (the connection broke); returns the number of
    /// frames taken, to tell sent forwards from unsent ones.
    pub fn reset(&self) -> u64 {
        let mut inner = self.inner.lock();
        inner.body.truncate(FRAME_HEADER_BYTES);
        inner.open_forward = None;
        inner.ack_dirty = false;
        inner.ack_refused.clear();
        self.taken.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::data_frames::{put_op, Ack, OpView, Reader};

    fn ack_in(frame: &[u8]) -> (u64, u64) {
        let mut reader = Reader::new(&frame[FRAME_HEADER_BYTES..]);
        assert_eq!(reader.u8().unwrap(), tag::ACK);
        let ack = Ack::read(&mut reader).unwrap();
        (ack.boot, ack.upto)
    }

    /// The sections of a frame: each `FORWARD` as `(batch, its ops)`, a
    /// `BEAT` as `(0, [])`.
    fn forwards_in(frame: &[u8]) -> Vec<(u64, Vec<Vec<u8>>)> {
        let mut reader = Reader::new(&frame[FRAME_HEADER_BYTES..]);
        let mut sections = Vec::new();
        while !reader.is_empty() {
            match reader.u8().unwrap() {
                tag::FORWARD => {
                    let batch = reader.varint().unwrap();
                    let count = reader.count(4).unwrap();
                    let ops = (0..count)
                        .map(|_| {
                            let op = reader.op().unwrap();
                            let mut bytes = Vec::new();
                            put_op(&mut bytes, &op);
                            bytes
                        })
                        .collect();
                    sections.push((batch, ops));
                }
                tag::BEAT => sections.push((0, Vec::new())),
                other => panic!("unexpected section {other}"),
            }
        }
        sections
    }

    fn op(key: &str) -> Vec<u8> {
        let mut bytes = Vec::new();
        let view = OpView {
            key: key.as_bytes(),
            algorithm: crate::rules::Algorithm::FixedWindow,
            credit_limit: 10,
            reset_seconds: 60,
            peek: false,
            bucket: None,
            lease_wanted: 0,
        };
        put_op(&mut bytes, &view);
        bytes
    }

    #[test]
    fn forwards_join_the_open_section_until_something_else_follows_or_the_frame_leaves() {
        let out = PeerOut::new(2, Instant::now());
        let mut next = 10;
        let mut forward = |keys: &[&str], may_join: bool| {
            let ops: Vec<Vec<u8>> = keys.iter().map(|k| op(k)).collect();
            let batch = || {
                next += 1;
                next
            };
            out.append_forward(
                batch,
                |_| may_join,
                ops.len() as u32,
                ops.iter().map(Vec::as_slice),
            )
            .unwrap()
        };
        let placed = |batch, first, joined| ForwardPlaced {
            batch,
            first,
            joined,
            frame: 1,
        };
        assert_eq!(forward(&["a", "b"], true), placed(11, 0, false));
        assert_eq!(forward(&["c"], true), placed(11, 2, true));
        // The wait of section 11 is gone (say, failed): a new section.
        assert_eq!(forward(&["d"], false), placed(12, 0, false));
        // Another section after it closes it.
        out.append(|body| body.push(tag::BEAT));
        assert_eq!(forward(&["e"], true), placed(13, 0, false));
        assert_eq!(
            forwards_in(&out.take_frame().unwrap()),
            [
                (11, vec![op("a"), op("b"), op("c")]),
                (12, vec![op("d")]),
                (0, vec![]),
                (13, vec![op("e")]),
            ]
        );
        // The frame left: the next forward opens a section in the next one.
        let first = forward(&["f"], true);
        assert_eq!((first.batch, first.joined, first.frame), (14, false, 2));
        // A full section takes no more.
        let many: Vec<String> = (0..FORWARD_SECTION_OPS_MAX - 1)
            .map(|i| i.to_string())
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(forward(&many, true).joined);
        assert!(!forward(&["g"], true).joined);
        let sections = forwards_in(&out.take_frame().unwrap());
        assert_eq!(sections.len(), 2);
        assert_eq!(sections[0].1.len() as u32, FORWARD_SECTION_OPS_MAX);
        assert_eq!(sections[1], (15, vec![op("g")]));
    }

    #[test]
    fn acks_follow_the_newest_incarnation_of_the_leader() {
        let out = PeerOut::new(2, Instant::now());
        out.record_ack(100, 5_000, &[]);
        assert_eq!(ack_in(&out.take_frame().unwrap()), (100, 5_000));
        // The leader restarted: its rounds count from 1 again, and the old
        // life's high-water mark must not acknowledge them.
        out.record_ack(200, 1, &[]);
        assert_eq!(ack_in(&out.take_frame().unwrap()), (200, 1));
        // A late round of the old life is not acknowledged at all.
        out.record_ack(100, 5_001, &[]);
        assert!(out.take_frame().is_none());
        assert!(out.note_boot(200) && !out.note_boot(100) && out.peer_boot() == 200);
    }
}
