//! What this node has to send one peer on the data stream (its outbox), and
//! what it knows of the peer's link: connected or not, when the peer was
//! last heard from. Producers (serving threads, the replicator, frames
//! being read) append encoded sections; the peer's link takes everything
//! appended so far as one frame whenever it wakes (see `links.rs`).

use super::data_frames::{put_ack, tag, DATA_FRAME_ID};
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
        inner.ack_dirty = false;
        inner.ack_refused.clear();
        self.taken.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::data_frames::{Ack, Reader};

    fn ack_in(frame: &[u8]) -> (u64, u64) {
        let mut reader = Reader::new(&frame[FRAME_HEADER_BYTES..]);
        assert_eq!(reader.u8().unwrap(), tag::ACK);
        let ack = Ack::read(&mut reader).unwrap();
        (ack.boot, ack.upto)
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
