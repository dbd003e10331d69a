//! The node's counter log (`counters/` in the data dir): every counter state
//! this node decides or applies, appended as it happens, so that a restart
//! finds them again.
//!
//! - **Segments** (`seg-NNNNNNNN.log`): records of states, each the bytes a
//!   round section carries (`count`, then key and state, hand-encoded as in
//!   `data_frames.rs`). A state is appended *after* it was merged into the
//!   store and *before* this node acknowledges it or counts itself in a
//!   majority for it (the caller writes the buffer out first, see
//!   `disk/mod.rs`).
//! - **Snapshots** (`snap-NNNNNNNN.log`): every live counter of the store,
//!   written after segment N was opened. Since a state enters the log only
//!   after it entered the store, snapshot N holds everything of the
//!   segments before N, and those are deleted once it is complete (written
//!   to a temporary file, synced, renamed).
//! - **Loading** merges the newest complete snapshot, then every segment
//!   from its number on, into the store. Merges are idempotent and
//!   order-free, so overlap between a snapshot and a segment is harmless,
//!   and a damaged file's valid prefix is an older state: a floor that
//!   never admits more than the truth.

use super::records;
use crate::cluster::data_frames::{put_bytes, put_state, put_varint, Reader};
use crate::limiter::CounterState;
use crate::store::MemoryStore;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A segment is closed and a snapshot taken once it holds this many bytes.
pub const SEGMENT_BYTES_MAX: u64 = 64 << 20;
/// States per snapshot record.
const SNAPSHOT_STATES_PER_RECORD: usize = 4_096;

fn segment_name(seq: u64) -> String {
    format!("seg-{seq:08}.log")
}

fn snapshot_name(seq: u64) -> String {
    format!("snap-{seq:08}.log")
}

/// `seg-N.log` → `(false, N)`, `snap-N.log` → `(true, N)`.
fn parse_name(name: &str) -> Option<(bool, u64)> {
    let (snapshot, rest) = if let Some(rest) = name.strip_prefix("seg-") {
        (false, rest)
    } else {
        (true, name.strip_prefix("snap-")?)
    };
    let seq = rest.strip_suffix(".log")?.parse().ok()?;
    Some((snapshot, seq))
}

/// Decodes one record's states, calling `visit` with each.
pub fn decode_states(
    payload: &[u8],
    mut visit: impl FnMut(&[u8], CounterState),
) -> Result<(), String> {
    let mut reader = Reader::new(payload);
    let count = reader.varint().map_err(|e| e.to_string())?;
    for _ in 0..count {
        let key = reader.bytes().map_err(|e| e.to_string())?;
        let state = reader.state().map_err(|e| e.to_string())?;
        visit(key, state);
    }
    Ok(())
}

/// What loading the counter log found.
#[derive(Debug, Default)]
pub struct CountersLoad {
    /// States merged into the store.
    pub states: u64,
    /// Files read.
    pub files: usize,
    /// Damage found, one sentence per damaged file, naming it.
    pub damage: Vec<String>,
    /// The number the next segment takes.
    pub next_seq: u64,
    /// Bytes of the segments read (what a start replays beyond a snapshot).
    pub segment_bytes: u64,
}

/// Lists the counter files of `dir`: (snapshots, segments), by number.
fn list(dir: &Path) -> std::io::Result<(Vec<u64>, Vec<u64>)> {
    let mut snapshots = Vec::new();
    let mut segments = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        match parse_name(&name.to_string_lossy()) {
            Some((true, seq)) => snapshots.push(seq),
            Some((false, seq)) => segments.push(seq),
            None => {}
        }
    }
    snapshots.sort_unstable();
    segments.sort_unstable();
    Ok((snapshots, segments))
}

/// Merges the counter log of `dir` into `store` (see the module doc).
/// `keep` says which keys to load (the shards replicated here).
pub fn load(
    dir: &Path,
    store: &MemoryStore,
    now_ms: u64,
    keep: &dyn Fn(&[u8]) -> bool,
) -> std::io::Result<CountersLoad> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "tmp") {
            let _ = std::fs::remove_file(&path);
        }
    }
    let (snapshots, segments) = list(dir)?;
    let mut load = CountersLoad {
        next_seq: snapshots
            .iter()
            .chain(&segments)
            .max()
            .map_or(1, |&seq| seq + 1),
        ..CountersLoad::default()
    };
    let from = snapshots.last().copied();
    let mut files: Vec<PathBuf> = Vec::new();
    if let Some(seq) = from {
        files.push(dir.join(snapshot_name(seq)));
    }
    files.extend(
        segments
            .iter()
            .filter(|&&seq| from.is_none_or(|from| seq >= from))
            .map(|&seq| dir.join(segment_name(seq))),
    );
    for path in files {
        let is_segment = path
            .file_name()
            .is_some_and(|name| name.to_string_lossy().starts_with("seg-"));
        let mut undecodable = None;
        let mut states = 0u64;
        let scan = records::scan_file(&path, |payload| {
            if undecodable.is_some() {
                return;
            }
            let decoded = decode_states(payload, |key, state| {
                if keep(key) {
                    // At the live-key cap a state is dropped, as a
                    // replica drops it: the cap is per node.
                    let _ = store.merge(key, state, now_ms);
                    states += 1;
                }
            });
            if let Err(why) = decoded {
                undecodable = Some(why);
            }
        })?;
        load.files += 1;
        load.states += states;
        if is_segment {
            // What a start replays (a crash leaves a segment's preallocated
            // tail of zeros: not counted).
            load.segment_bytes += scan.valid_bytes;
        }
        if scan.records == 0 && scan.end == records::End::Clean {
            // An empty segment (a start that wrote nothing): a new one is
            // opened after loading, so this one only adds a file per start.
            let _ = std::fs::remove_file(&path);
            continue;
        }
        if let Some(why) = undecodable {
            load.damage.push(format!(
                "{}: a record does not decode ({why}); the rest of the file is ignored",
                path.display()
            ));
        } else if let Some(damage) = scan.damage(&path) {
            load.damage.push(damage);
        }
    }
    Ok(load)
}

/// The open segment.
///
/// It is mapped shared into memory at its full size ([`SEGMENT_BYTES_MAX`]),
/// and its disk blocks are reserved ahead of the records, a chunk of
/// [`PREALLOCATE_CHUNK_BYTES`] at a time (`fallocate(2)`): appending
/// records is a copy into the OS's page cache, the same as a `write(2)`
/// for what a killed process leaves behind, without the system call, and
/// without the journal work of a file that grows on every append (the file
/// has its full length from the start). Records that do not fit in the
/// mapping, records beyond a chunk the file system refused to reserve (a
/// full disk), and every record where the file system cannot reserve or map
/// at all, are written with `pwrite(2)`. The unused tail is cut off when the
/// segment is closed ([`Segment::trim`]); after a crash it is still there,
/// as zeros, and reading treats zeros after the last record as the file's
/// end (`records.rs`).
pub struct Segment {
    pub seq: u64,
    pub file: File,
    /// Bytes in use: the magic and the records appended.
    pub bytes: u64,
    map: Option<Mapping>,
}

/// Disk blocks reserved ahead of the records at a time.
pub const PREALLOCATE_CHUNK_BYTES: u64 = 4 << 20;

/// A shared, writable mapping of a whole segment file.
struct Mapping {
    ptr: std::ptr::NonNull<u8>,
    len_bytes: u64,
    /// The file's blocks are reserved up to here (a multiple of the chunk).
    reserved_bytes: u64,
    chunk_bytes: u64,
}

// SAFETY: the mapping is memory of the process, written only through the
// `&mut Segment` that owns it (the data dir's writer, behind its mutex).
unsafe impl Send for Mapping {}

impl Mapping {
    /// Sizes `file` to `len_bytes`, reserves its first chunk and maps it;
    /// `None` when the file system cannot (the segment then appends with
    /// `pwrite(2)`, and the file keeps only what is written).
    #[cfg(target_os = "linux")]
    fn new(file: &File, len_bytes: u64, chunk_bytes: u64) -> Option<Mapping> {
        use std::os::unix::io::AsRawFd;
        let fd = file.as_raw_fd();
        let first_chunk = chunk_bytes.min(len_bytes);
        if file.set_len(len_bytes).is_err() || !fallocate(file, 0, first_chunk) {
            let _ = file.set_len(records::MAGIC.len() as u64);
            return None;
        }
        // SAFETY: maps `len_bytes` of a file descriptor `file` owns, sized to
        // that length above; the result is checked before use and unmapped
        // in `Drop`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let _ = file.set_len(records::MAGIC.len() as u64);
            return None;
        }
        Some(Mapping {
            ptr: std::ptr::NonNull::new(ptr.cast::<u8>())?,
            len_bytes,
            reserved_bytes: first_chunk,
            chunk_bytes,
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn new(_file: &File, _len_bytes: u64, _chunk_bytes: u64) -> Option<Mapping> {
        None
    }

    /// Reserves the file's blocks up to `end` (whole chunks, within the
    /// mapping); false when the file system refuses (a full disk) or `end`
    /// is beyond the mapping.
    fn reserve(&mut self, file: &File, end: u64) -> bool {
        if end <= self.reserved_bytes {
            return true;
        }
        let upto = (end.div_ceil(self.chunk_bytes) * self.chunk_bytes).min(self.len_bytes);
        if end > upto || !fallocate(file, self.reserved_bytes, upto) {
            return false;
        }
        self.reserved_bytes = upto;
        true
    }
}

/// Reserves the blocks of `file` from `from` to `to` (`fallocate(2)`,
/// keeping its length); false when the file system cannot.
#[cfg(target_os = "linux")]
fn fallocate(file: &File, from: u64, to: u64) -> bool {
    use std::os::unix::io::AsRawFd;
    // SAFETY: a plain system call on a file descriptor `file` owns.
    unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            0,
            from as libc::off_t,
            (to - from) as libc::off_t,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn fallocate(_file: &File, _from: u64, _to: u64) -> bool {
    false
}

impl Drop for Mapping {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        // SAFETY: unmaps exactly what `Mapping::new` mapped, once.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len_bytes as usize);
        }
    }
}

impl Segment {
    pub fn create(dir: &Path, seq: u64) -> std::io::Result<Segment> {
        Segment::create_sized(dir, seq, SEGMENT_BYTES_MAX, PREALLOCATE_CHUNK_BYTES)
    }

    fn create_sized(
        dir: &Path,
        seq: u64,
        len_bytes: u64,
        chunk_bytes: u64,
    ) -> std::io::Result<Segment> {
        let file = records::create(&dir.join(segment_name(seq)))?;
        let map = Mapping::new(&file, len_bytes, chunk_bytes);
        records::sync_dir(dir)?;
        Ok(Segment {
            seq,
            file,
            bytes: records::MAGIC.len() as u64,
            map,
        })
    }

    /// True while appends are copies into the mapping.
    pub fn mapped(&self) -> bool {
        self.map.is_some()
    }

    /// Appends framed records: a copy into the mapping, or one `pwrite(2)`
    /// where they do not fit in it.
    pub fn write(&mut self, framed: &[u8]) -> std::io::Result<()> {
        let end = self.bytes + framed.len() as u64;
        let mut copied = false;
        if let Some(map) = &mut self.map {
            if map.reserve(&self.file, end) {
                // SAFETY: `self.bytes..end` is within the mapping (`reserve`
                // is true only up to its length), which nothing else writes
                // or reads while `self` is borrowed.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        framed.as_ptr(),
                        map.ptr.as_ptr().add(self.bytes as usize),
                        framed.len(),
                    );
                }
                copied = true;
            }
        }
        if !copied {
            use std::os::unix::fs::FileExt;
            self.file.write_all_at(framed, self.bytes)?;
        }
        self.bytes = end;
        Ok(())
    }

    /// Unmaps the segment and cuts its unused tail off (a segment being
    /// closed: rotated, or at a clean shutdown). Later appends use
    /// `pwrite(2)`.
    pub fn trim(&mut self) -> std::io::Result<()> {
        if self.map.take().is_some() {
            self.file.set_len(self.bytes)?;
        }
        Ok(())
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        let _ = self.trim();
    }
}

/// Appends one record of `count` states already encoded (`states`) to
/// `out`, framed.
pub fn frame_states(out: &mut Vec<u8>, count: u32, states: &[u8]) {
    records::frame_with(out, |out| {
        put_varint(out, u64::from(count));
        out.extend_from_slice(states);
    });
}

/// Appends one record of `states` to `out`, framed, encoding them in place.
pub fn frame_state_list<'a>(
    out: &mut Vec<u8>,
    states: impl ExactSizeIterator<Item = (&'a [u8], CounterState)>,
) {
    records::frame_with(out, |out| {
        put_varint(out, states.len() as u64);
        for (key, state) in states {
            put_bytes(out, key);
            put_state(out, &state);
        }
    });
}

/// Writes every live counter of `store` as snapshot `seq` of `dir` (a
/// temporary file, synced, then renamed), then deletes the files it makes
/// redundant: segments and snapshots numbered below `seq`. Returns how many
/// counters it holds.
pub fn snapshot(dir: &Path, seq: u64, store: &MemoryStore, now_ms: u64) -> std::io::Result<u64> {
    let tmp = dir.join(format!("{}.tmp", snapshot_name(seq)));
    let mut file = std::io::BufWriter::with_capacity(1 << 20, records::create(&tmp)?);
    let mut states = Vec::new();
    let mut count = 0u32;
    let mut total = 0u64;
    let mut framed = Vec::new();
    let mut failed = None;
    store.for_each_live(now_ms, |key, state: CounterState| {
        if failed.is_some() {
            return;
        }
        put_bytes(&mut states, key);
        put_state(&mut states, &state);
        count += 1;
        total += 1;
        if count as usize >= SNAPSHOT_STATES_PER_RECORD {
            framed.clear();
            frame_states(&mut framed, count, &states);
            if let Err(error) = file.write_all(&framed) {
                failed = Some(error);
            }
            states.clear();
            count = 0;
        }
    });
    if let Some(error) = failed {
        return Err(error);
    }
    if count > 0 {
        framed.clear();
        frame_states(&mut framed, count, &states);
        file.write_all(&framed)?;
    }
    let file = file.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    std::fs::rename(&tmp, dir.join(snapshot_name(seq)))?;
    records::sync_dir(dir)?;
    let (snapshots, segments) = list(dir)?;
    for old in snapshots.into_iter().filter(|&s| s < seq) {
        std::fs::remove_file(dir.join(snapshot_name(old)))?;
    }
    for old in segments.into_iter().filter(|&s| s < seq) {
        std::fs::remove_file(dir.join(segment_name(old)))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(used: u64) -> CounterState {
        CounterState::Window {
            end_ms: 10_000_000_000_000,
            used,
        }
    }

    fn new_store() -> MemoryStore {
        MemoryStore::new(crate::store::memory::MemoryStoreConfig {
            stripes: 4,
            live_keys_max: 1_000,
        })
    }

    fn encoded(states: &[(&[u8], CounterState)]) -> (u32, Vec<u8>) {
        let mut bytes = Vec::new();
        for (key, state) in states {
            put_bytes(&mut bytes, key);
            put_state(&mut bytes, state);
        }
        (states.len() as u32, bytes)
    }

    fn count_of(store: &MemoryStore, key: &[u8]) -> Option<u64> {
        match store.get(key, 1_000) {
            Some(CounterState::Window { used, .. }) => Some(used),
            _ => None,
        }
    }

    fn write_segment(dir: &Path, seq: u64, sections: &[Vec<(&[u8], CounterState)>]) {
        let mut segment = Segment::create(dir, seq).unwrap();
        let mut framed = Vec::new();
        for section in sections {
            let (count, bytes) = encoded(section);
            frame_states(&mut framed, count, &bytes);
        }
        segment.write(&framed).unwrap();
    }

    #[test]
    fn segments_and_snapshots_load_back_and_a_snapshot_retires_older_files() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(
            dir.path(),
            1,
            &[
                vec![(b"a", state(1)), (b"b", state(5))],
                vec![(b"a", state(2))],
            ],
        );
        let store = new_store();
        let load = load(dir.path(), &store, 1_000, &|_| true).unwrap();
        assert!(load.damage.is_empty(), "{:?}", load.damage);
        assert_eq!(load.next_seq, 2);
        assert_eq!(count_of(&store, b"a"), Some(2));
        assert_eq!(count_of(&store, b"b"), Some(5));
        // A newer segment, then a snapshot of the store numbered after it.
        write_segment(dir.path(), 2, &[vec![(b"b", state(6))]]);
        store.merge(b"b", state(6), 1_000).unwrap();
        assert_eq!(snapshot(dir.path(), 3, &store, 1_000).unwrap(), 2);
        let (snapshots, segments) = list(dir.path()).unwrap();
        assert_eq!((snapshots, segments), (vec![3], vec![]));
        write_segment(dir.path(), 3, &[vec![(b"c", state(1))]]);
        let fresh = new_store();
        let load = super::load(dir.path(), &fresh, 1_000, &|key| key != b"x").unwrap();
        assert_eq!(load.files, 2);
        assert_eq!(load.next_seq, 4);
        assert_eq!(count_of(&fresh, b"a"), Some(2));
        assert_eq!(count_of(&fresh, b"b"), Some(6));
        assert_eq!(count_of(&fresh, b"c"), Some(1));
    }

    #[test]
    fn a_damaged_segment_keeps_its_valid_prefix_and_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(
            dir.path(),
            1,
            &[vec![(b"a", state(1))], vec![(b"a", state(9))]],
        );
        write_segment(dir.path(), 2, &[vec![(b"z", state(4))]]);
        let path = dir.path().join(segment_name(1));
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let store = new_store();
        let load = load(dir.path(), &store, 1_000, &|_| true).unwrap();
        assert_eq!(load.damage.len(), 1);
        assert!(load.damage[0].contains(&path.display().to_string()));
        assert!(load.damage[0].contains("corrupt"), "{}", load.damage[0]);
        assert_eq!(count_of(&store, b"a"), Some(1), "the valid prefix only");
        assert_eq!(count_of(&store, b"z"), Some(4), "later files still load");
        // Truncated: the second record is cut short.
        let mut cut = std::fs::read(dir.path().join(segment_name(2))).unwrap();
        cut.truncate(cut.len() - 2);
        std::fs::write(&path, &cut).unwrap();
        let store = new_store();
        let load = super::load(dir.path(), &store, 1_000, &|_| true).unwrap();
        assert!(load.damage[0].contains("truncated"), "{:?}", load.damage);
    }

    #[test]
    fn a_mapped_segment_grows_by_chunks_spills_past_its_mapping_and_is_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(segment_name(1));
        // 64 KiB mapped, reserved 16 KiB at a time; ~95 KiB of records.
        let mut segment = Segment::create_sized(dir.path(), 1, 64 << 10, 16 << 10).unwrap();
        // Linux file systems for temporary dirs (ext4, xfs, tmpfs, overlay)
        // preallocate and map: a segment that silently fell back to
        // pwrite(2) would lose what this is for.
        #[cfg(target_os = "linux")]
        assert!(segment.mapped(), "the segment is mapped");
        let keys: Vec<String> = (0..5_000).map(|i| format!("key-{i:05}")).collect();
        for chunk in keys.chunks(50) {
            let states: Vec<(&[u8], CounterState)> =
                chunk.iter().map(|k| (k.as_bytes(), state(7))).collect();
            let (count, bytes) = encoded(&states);
            let mut framed = Vec::new();
            frame_states(&mut framed, count, &bytes);
            segment.write(&framed).unwrap();
        }
        let written = segment.bytes;
        assert!(written > 64 << 10, "past the mapping: {written}");
        drop(segment);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), written, "trimmed");
        let store = new_store();
        let load = load(dir.path(), &store, 1_000, &|_| true).unwrap();
        assert!(load.damage.is_empty(), "{:?}", load.damage);
        assert_eq!(load.states, 5_000);
        assert_eq!(load.segment_bytes, written);
        // (The test store keeps 1,000 keys: the first ones.)
        assert_eq!(count_of(&store, b"key-00999"), Some(7));
    }

    #[test]
    fn a_segment_left_by_a_killed_process_loads_up_to_its_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let mut segment = Segment::create_sized(dir.path(), 1, 64 << 10, 16 << 10).unwrap();
        let (count, bytes) = encoded(&[(b"a", state(3)), (b"b", state(4))]);
        let mut framed = Vec::new();
        frame_states(&mut framed, count, &bytes);
        segment.write(&framed).unwrap();
        let mapped = segment.mapped();
        // Killed: no trim; what was copied into the mapping is in the page
        // cache, the rest of the file is zeros.
        std::mem::forget(segment);
        let len = std::fs::metadata(dir.path().join(segment_name(1)))
            .unwrap()
            .len();
        if mapped {
            assert_eq!(len, 64 << 10, "full length while open");
        }
        let store = new_store();
        let load = load(dir.path(), &store, 1_000, &|_| true).unwrap();
        assert!(load.damage.is_empty(), "{:?}", load.damage);
        assert_eq!((load.states, load.next_seq), (2, 2));
        assert_eq!(count_of(&store, b"b"), Some(4));
        assert_eq!(
            load.segment_bytes,
            (records::MAGIC.len() + framed.len()) as u64
        );
    }

    #[test]
    fn an_empty_directory_or_file_loads_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = new_store();
        let load = load(dir.path(), &store, 1_000, &|_| true).unwrap();
        assert_eq!((load.files, load.states, load.next_seq), (0, 0, 1));
        std::fs::write(dir.path().join(segment_name(1)), b"").unwrap();
        let load = super::load(dir.path(), &store, 1_000, &|_| true).unwrap();
        assert_eq!((load.files, load.states, load.next_seq), (1, 0, 2));
        assert!(load.damage.is_empty());
        assert_eq!(
            list(dir.path()).unwrap(),
            (vec![], vec![]),
            "empty files go"
        );
    }
}
