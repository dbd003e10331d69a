//! The one on-disk format of a node's data dir: a file of checksummed
//! records, appended and never rewritten in place. Both the node's metadata
//! log (`meta.log`) and its counter segments and snapshots use it, so one
//! reader, with one set of recovery tests, decides what a damaged file
//! still holds.
//!
//! A file starts with the 8-byte magic [`MAGIC`]; each record is
//! `[payload length: u32 LE][CRC-32 of length and payload: u32 LE][payload]`.
//! Reading stops at the first record that does not check out and says why
//! ([`End`]): a record cut short at the end of the file is what a crash in
//! the middle of an append leaves (a *truncated tail*); a checksum that
//! does not match, or a length beyond [`RECORD_BYTES_MAX`], is *corruption*.
//! Everything before that point is returned: the records are independent
//! (counter merges are idempotent, metadata records are replayed in order),
//! so a valid prefix is always a consistent, older state.
//!
//! A counter segment is preallocated and filled through a memory mapping
//! (`counters.rs`), so a segment a crash left behind ends in zeros: zeros
//! from a record boundary to the end of the file are the file's clean end
//! (no record is all zeros: its checksum would not match), and a record
//! that does not check out followed only by zeros is a truncated tail (the
//! process or the machine stopped while it was being copied).

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

/// The first bytes of every record file.
pub const MAGIC: &[u8; 8] = b"TGREC01\n";
/// The largest payload a record may carry.
pub const RECORD_BYTES_MAX: usize = 64 << 20;
/// Bytes before each payload: its length and checksum.
const FRAME_HEADER_BYTES: usize = 8;

/// Where and why reading a record file stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Every byte was read: the file is whole.
    Clean,
    /// The last record is cut short at byte `at` (a crash while appending).
    TruncatedTail { at: u64 },
    /// The record at byte `at` is damaged (checksum, length or magic).
    Corrupt { at: u64, why: String },
}

/// What reading a record file found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// Bytes of the file up to the end of the last good record (the magic
    /// included; 0 for an empty file).
    pub valid_bytes: u64,
    /// Records read.
    pub records: u64,
    pub end: End,
}

impl Scan {
    /// A human sentence for a damaged file, naming it; `None` when whole.
    pub fn damage(&self, path: &Path) -> Option<String> {
        match &self.end {
            End::Clean => None,
            End::TruncatedTail { at } => Some(format!(
                "{}: truncated record at byte {at} (a crash while writing); the {} records before it are kept",
                path.display(),
                self.records
            )),
            End::Corrupt { at, why } => Some(format!(
                "{}: corrupt record at byte {at} ({why}); the {} records before it are kept, the rest of the file is ignored",
                path.display(),
                self.records
            )),
        }
    }
}

fn checksum(len: [u8; 4], payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&len);
    hasher.update(payload);
    hasher.finalize()
}

/// Appends one framed record to `out`.
pub fn frame(out: &mut Vec<u8>, payload: &[u8]) {
    frame_with(out, |out| out.extend_from_slice(payload));
}

/// Appends one framed record to `out`, its payload written in place by
/// `write` (no copy of the payload is made).
pub fn frame_with(out: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>)) {
    let at = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER_BYTES]);
    write(out);
    let len = ((out.len() - at - FRAME_HEADER_BYTES) as u32).to_le_bytes();
    let crc = checksum(len, &out[at + FRAME_HEADER_BYTES..]).to_le_bytes();
    out[at..at + 4].copy_from_slice(&len);
    out[at + 4..at + FRAME_HEADER_BYTES].copy_from_slice(&crc);
}

/// Reads the records of `bytes` (a whole file), calling `visit` with each
/// payload in order, up to the first damaged one.
pub fn scan_bytes(bytes: &[u8], mut visit: impl FnMut(&[u8])) -> Scan {
    if bytes.is_empty() {
        return Scan {
            valid_bytes: 0,
            records: 0,
            end: End::Clean,
        };
    }
    if bytes.len() < MAGIC.len() {
        return Scan {
            valid_bytes: 0,
            records: 0,
            end: if MAGIC.starts_with(bytes) {
                End::TruncatedTail { at: 0 }
            } else {
                End::Corrupt {
                    at: 0,
                    why: "not a Tollgate record file".into(),
                }
            },
        };
    }
    if &bytes[..MAGIC.len()] != MAGIC {
        return Scan {
            valid_bytes: 0,
            records: 0,
            end: End::Corrupt {
                at: 0,
                why: "not a Tollgate record file (bad magic)".into(),
            },
        };
    }
    let mut at = MAGIC.len();
    let mut records = 0;
    let end = loop {
        let rest = &bytes[at..];
        if rest.is_empty() || (rest[0] == 0 && all_zeros(rest)) {
            // The end, or the unused tail of a preallocated segment.
            break End::Clean;
        }
        if rest.len() < FRAME_HEADER_BYTES {
            break End::TruncatedTail { at: at as u64 };
        }
        let len = [rest[0], rest[1], rest[2], rest[3]];
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        let payload_len = u32::from_le_bytes(len) as usize;
        if payload_len > RECORD_BYTES_MAX {
            break End::Corrupt {
                at: at as u64,
                why: format!("record length {payload_len} is over {RECORD_BYTES_MAX}"),
            };
        }
        let Some(payload) = rest.get(FRAME_HEADER_BYTES..FRAME_HEADER_BYTES + payload_len) else {
            break End::TruncatedTail { at: at as u64 };
        };
        if checksum(len, payload) != crc {
            let after = &rest[FRAME_HEADER_BYTES + payload_len..];
            if !after.is_empty() && all_zeros(after) {
                // Cut short while being copied into a preallocated segment.
                break End::TruncatedTail { at: at as u64 };
            }
            break End::Corrupt {
                at: at as u64,
                why: "checksum mismatch".into(),
            };
        }
        visit(payload);
        records += 1;
        at += FRAME_HEADER_BYTES + payload_len;
    };
    Scan {
        valid_bytes: at as u64,
        records,
        end,
    }
}

fn all_zeros(bytes: &[u8]) -> bool {
    bytes.iter().all(|&b| b == 0)
}

/// Reads the file at `path` (see [`scan_bytes`]).
pub fn scan_file(path: &Path, visit: impl FnMut(&[u8])) -> std::io::Result<Scan> {
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    Ok(scan_bytes(&bytes, visit))
}

/// Creates (or empties) a record file, mode 0600, and writes the magic.
pub fn create(path: &Path) -> std::io::Result<File> {
    let mut options = std::fs::OpenOptions::new();
    // Readable too: a counter segment is mapped shared, which needs both.
    options.create(true).read(true).write(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path)?;
    file.write_all(MAGIC)?;
    Ok(file)
}

/// Opens an existing record file to append after its `valid_bytes` (what
/// follows, a truncated or damaged tail, is cut off first).
pub fn open_append(path: &Path, valid_bytes: u64) -> std::io::Result<File> {
    if valid_bytes < MAGIC.len() as u64 {
        return create(path);
    }
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    file.set_len(valid_bytes)?;
    let mut file = std::fs::OpenOptions::new().append(true).open(path)?;
    file.flush()?;
    Ok(file)
}

/// Makes a rename or a new file in `dir` durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn file_of(payloads: &[Vec<u8>]) -> Vec<u8> {
        let mut bytes = MAGIC.to_vec();
        for payload in payloads {
            frame(&mut bytes, payload);
        }
        bytes
    }

    fn read(bytes: &[u8]) -> (Vec<Vec<u8>>, Scan) {
        let mut seen = Vec::new();
        let scan = scan_bytes(bytes, |p| seen.push(p.to_vec()));
        (seen, scan)
    }

    #[test]
    fn an_empty_file_holds_nothing_and_is_whole() {
        let (seen, scan) = read(&[]);
        assert!(seen.is_empty());
        assert_eq!(scan.end, End::Clean);
        let (seen, scan) = read(MAGIC);
        assert!(seen.is_empty());
        assert_eq!(scan.end, End::Clean);
        assert_eq!(scan.valid_bytes, MAGIC.len() as u64);
        // A crash while writing the magic.
        assert_eq!(read(&MAGIC[..3]).1.end, End::TruncatedTail { at: 0 });
    }

    #[test]
    fn records_read_back_in_order() {
        let payloads = vec![b"one".to_vec(), Vec::new(), vec![7u8; 100_000]];
        let (seen, scan) = read(&file_of(&payloads));
        assert_eq!(seen, payloads);
        assert_eq!(scan.end, End::Clean);
        assert_eq!(scan.records, 3);
    }

    #[test]
    fn a_truncated_tail_keeps_every_whole_record() {
        let payloads = vec![b"first".to_vec(), b"second".to_vec()];
        let bytes = file_of(&payloads);
        let whole_first = MAGIC.len() + 8 + 5;
        for cut in whole_first + 1..bytes.len() {
            let (seen, scan) = read(&bytes[..cut]);
            assert_eq!(seen, vec![b"first".to_vec()], "cut at {cut}");
            assert_eq!(
                scan.end,
                End::TruncatedTail {
                    at: whole_first as u64
                }
            );
            assert_eq!(scan.valid_bytes, whole_first as u64);
        }
    }

    #[test]
    fn a_flipped_byte_is_corruption_and_stops_the_read_there() {
        let payloads = vec![b"first".to_vec(), b"second".to_vec(), b"third".to_vec()];
        let bytes = file_of(&payloads);
        let second_at = MAGIC.len() + 8 + 5;
        // Flip each byte of the second record in turn.
        for at in second_at..second_at + 8 + 6 {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x40;
            let (seen, scan) = read(&damaged);
            assert_eq!(seen, vec![b"first".to_vec()], "flip at {at}");
            match scan.end {
                End::Corrupt { at: bad, .. } => assert_eq!(bad, second_at as u64),
                // A flipped length can make the record run past the end.
                End::TruncatedTail { at: bad } => assert_eq!(bad, second_at as u64),
                End::Clean => panic!("flip at {at} went unnoticed"),
            }
        }
        let mut bad_magic = bytes.clone();
        bad_magic[0] = b'X';
        let (seen, scan) = read(&bad_magic);
        assert!(seen.is_empty());
        assert!(matches!(scan.end, End::Corrupt { at: 0, .. }));
        let message = scan.damage(Path::new("/data/seg-000001.log")).unwrap();
        assert!(message.contains("/data/seg-000001.log"), "{message}");
    }

    #[test]
    fn appending_after_a_damaged_tail_cuts_it_off() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.log");
        let mut bytes = file_of(&[b"kept".to_vec(), b"lost".to_vec()]);
        bytes.truncate(bytes.len() - 2);
        std::fs::write(&path, &bytes).unwrap();
        let scan = scan_file(&path, |_| {}).unwrap();
        let mut file = open_append(&path, scan.valid_bytes).unwrap();
        let mut more = Vec::new();
        frame(&mut more, b"after");
        file.write_all(&more).unwrap();
        let mut seen = Vec::new();
        let scan = scan_file(&path, |p| seen.push(p.to_vec())).unwrap();
        assert_eq!(seen, vec![b"kept".to_vec(), b"after".to_vec()]);
        assert_eq!(scan.end, End::Clean);
    }

    #[test]
    fn a_preallocated_tail_of_zeros_is_the_end_and_a_half_copied_record_a_truncated_tail() {
        let whole = file_of(&[b"one".to_vec(), b"two".to_vec()]);
        let mut padded = whole.clone();
        padded.resize(whole.len() + 4096, 0);
        let (seen, scan) = read(&padded);
        assert_eq!(seen, vec![b"one".to_vec(), b"two".to_vec()]);
        assert_eq!(scan.end, End::Clean);
        assert_eq!(scan.valid_bytes, whole.len() as u64);
        // The last record's payload only partly copied, zeros after it.
        let mut torn = padded.clone();
        let last = whole.len() - 2;
        torn[last..whole.len()].fill(0);
        let (seen, scan) = read(&torn);
        assert_eq!(seen, vec![b"one".to_vec()]);
        assert!(matches!(scan.end, End::TruncatedTail { .. }), "{scan:?}");
        // A damaged record with more records after it is still corruption.
        let mut flipped = file_of(&[b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]);
        flipped[MAGIC.len() + FRAME_HEADER_BYTES] ^= 1;
        flipped.resize(flipped.len() + 64, 0);
        let (seen, scan) = read(&flipped);
        assert!(seen.is_empty());
        assert!(matches!(scan.end, End::Corrupt { .. }), "{scan:?}");
    }

    proptest! {
        /// Whatever happens to a file's bytes (cut anywhere, any byte
        /// flipped), reading it never panics and returns a prefix of what
        /// was written, in order.
        #[test]
        fn damage_only_ever_loses_a_suffix(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..12),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            flip_bits in 1u8..=255,
            do_flip in any::<bool>(),
            zeros in 0usize..48,
        ) {
            // Some files end in zeros, as a preallocated segment does.
            let mut bytes = file_of(&payloads);
            bytes.resize(bytes.len() + zeros, 0);
            let len = cut.index(bytes.len() + 1);
            bytes.truncate(len);
            if do_flip && !bytes.is_empty() {
                let at = flip.index(bytes.len());
                bytes[at] ^= flip_bits;
            }
            let (seen, scan) = read(&bytes);
            prop_assert!(seen.len() <= payloads.len());
            prop_assert_eq!(&payloads[..seen.len()], &seen[..]);
            prop_assert!(scan.valid_bytes <= bytes.len() as u64);
            if !do_flip && len >= file_of(&payloads).len() {
                prop_assert_eq!(scan.end, End::Clean);
                prop_assert_eq!(seen.len(), payloads.len());
            }
        }
    }
}
