//! A cluster node's data dir (`--data-dir`): what it keeps on disk so that
//! a restart, or a whole cluster stopped and started, keeps its counters,
//! its Raft votes and logs, its fences and its member list.
//!
//! Layout (docs/cluster.md, "Data dir"):
//! - `LOCK`: held (`flock`) while a process uses the dir;
//! - `meta.log`: the metadata log ([`meta`]): Raft state of every shard
//!   group, fences, the member list;
//! - `counters/`: the counter log ([`counters`]): segments of states as
//!   they are decided or applied, and snapshots of the whole store.
//!
//! Both are files of checksummed records ([`records`]). The durability rule:
//! a state this node decides or applies is written to the OS (`write(2)`)
//! before this node acknowledges it or counts itself in a majority for it,
//! and a vote, a promise (fence) or a member list before it is acted on;
//! so a process killed with SIGKILL loses nothing it acknowledged. When
//! the disk itself syncs is the `--fsync` policy ([`FsyncPolicy`]): what
//! a power cut can lose depends on it.
//!
//! The hot path only appends framed bytes to a buffer under a lock; the
//! buffer is written out once per round (leader) or per frame read
//! (follower), and by each peer link just before it sends a frame, so no
//! acknowledgement can leave before the states it covers were written.
//! "Written" is a copy into the open segment's shared memory mapping (a
//! preallocated file, see [`counters::Segment`]): in the OS's page cache,
//! as after a `write(2)`, without a system call.

pub mod counters;
pub mod meta;
pub mod records;

use crate::clock::Clock;
use crate::limiter::CounterState;
use crate::store::MemoryStore;
use meta::{MetaLog, MetaRecord, MetaState};
use parking_lot::{Condvar, Mutex};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long after start-up the node folds the files it loaded into one
/// snapshot, in milliseconds.
const STARTUP_SNAPSHOT_DELAY_MS: u64 = 10_000;

/// A clean shutdown takes a snapshot when a start would replay more than
/// this many bytes of counter segments.
const CLOSE_SNAPSHOT_REPLAY_BYTES: u64 = 1 << 20;

/// When the data dir's writes are synced to the disk (`--fsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// Never, but at a clean shutdown and when files are rotated: a power
    /// cut loses what the OS had not written back yet (up to its dirty
    /// page timeout, ~30 s on Linux).
    Never,
    /// Every `--fsync-interval-ms` (and at a clean shutdown): a power cut
    /// loses at most that interval.
    Interval,
    /// Before every acknowledgement (per round or frame): a power cut loses
    /// nothing acknowledged, at the cost of a disk sync per round.
    Batch,
}

impl FsyncPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            FsyncPolicy::Never => "never",
            FsyncPolicy::Interval => "interval",
            FsyncPolicy::Batch => "batch",
        }
    }
}

impl std::str::FromStr for FsyncPolicy {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "never" => Ok(FsyncPolicy::Never),
            "interval" => Ok(FsyncPolicy::Interval),
            "batch" => Ok(FsyncPolicy::Batch),
            other => Err(format!(
                "--fsync: '{other}' is not a flush policy (never, interval or batch)"
            )),
        }
    }
}

/// Settings of a node's data dir.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    pub dir: PathBuf,
    pub fsync: FsyncPolicy,
    /// `--fsync interval`: how often, in milliseconds.
    pub fsync_interval_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("--data-dir {path}: cannot create it: {source}")]
    Create {
        path: String,
        source: std::io::Error,
    },
    #[error("--data-dir {path}: in use by another running process (its LOCK file is held); give each node its own data dir")]
    Locked { path: String },
    #[error("--data-dir {path}: mode {mode:o} lets other users read it, and it cannot be set to 700 ({source}); run `chmod 700 {path}` as its owner, or give a dir this user owns")]
    Permissions {
        path: String,
        mode: u32,
        source: std::io::Error,
    },
    #[error("--data-dir {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// What a node found in its data dir at start-up.
pub struct Startup {
    /// The metadata (Raft state, fences, members) to resume from; empty when
    /// the dir is new or `meta.log` was corrupt.
    pub meta: MetaState,
    /// `meta.log` was corrupt and set aside: the node must recover its
    /// replicas from its peers (as a node restarted empty does).
    pub meta_discarded: bool,
    /// Counter states merged into the store.
    pub counters_loaded: u64,
    /// How long loading took, in milliseconds.
    pub load_ms: u64,
}

struct Writer {
    /// Framed records not written yet.
    pending: Vec<u8>,
    segment: counters::Segment,
}

/// A node's open data dir (see the module doc).
pub struct NodeDisk {
    dir: PathBuf,
    counters_dir: PathBuf,
    policy: FsyncPolicy,
    meta: MetaLog,
    writer: Mutex<Writer>,
    store: Arc<MemoryStore>,
    clock: Arc<dyn Clock>,
    /// Held for the process's life: the dir's lock.
    _lock: File,
    stop: Mutex<bool>,
    stopped: Condvar,
    flusher: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Writes and syncs that failed (counter log, `meta.log`, snapshots):
    /// `tollgate_cluster_data_dir_write_errors_total`.
    pub write_errors: AtomicU64,
    pub snapshots: AtomicU64,
    /// Counter-log bytes a start would replay beyond the newest snapshot.
    replay_bytes: AtomicU64,
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> DiskError + '_ {
    move |source| DiskError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Creates `dir` (and its parents) with mode 0700; an existing `dir` that
/// its group or other users may enter is tightened to 0700, with a
/// warning (its files hold every counter's key: who hit what). A dir whose
/// mode cannot be tightened (this process does not own it) is refused.
fn create_private_dir(dir: &Path) -> Result<(), DiskError> {
    let create_error = |source| DiskError::Create {
        path: dir.display().to_string(),
        source,
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(create_error)?;
        let mode = std::fs::metadata(dir)
            .map_err(io_error(dir))?
            .permissions()
            .mode()
            & 0o777;
        if mode & 0o077 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(
                |source| DiskError::Permissions {
                    path: dir.display().to_string(),
                    mode,
                    source,
                },
            )?;
            tracing::warn!(
                "--data-dir {}: it was mode {mode:o} (other users could read the counters' keys); set to 700",
                dir.display()
            );
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        std::fs::create_dir_all(dir).map_err(create_error)
    }
}

/// Takes the dir's lock, or says who holds it.
fn lock(dir: &Path) -> Result<File, DiskError> {
    let path = dir.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_error(&path))?;
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: flock on a file descriptor this function owns.
        let taken = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if !taken {
            return Err(DiskError::Locked {
                path: dir.display().to_string(),
            });
        }
    }
    Ok(file)
}

impl NodeDisk {
    /// Opens (creating it, mode 0700) the data dir, replays `meta.log`,
    /// merges the counter log into `store`, and starts the flusher (fsync
    /// policy, segment rotation and snapshots). Damage is logged as an
    /// error naming the file (the node then recovers from its peers); only
    /// a dir that cannot be used at all is an error.
    pub fn open(
        config: &DiskConfig,
        store: Arc<MemoryStore>,
        clock: Arc<dyn Clock>,
    ) -> Result<(Arc<NodeDisk>, Startup), DiskError> {
        let started = Instant::now();
        let dir = config.dir.clone();
        create_private_dir(&dir)?;
        let lock = lock(&dir)?;
        let counters_dir = dir.join("counters");
        create_private_dir(&counters_dir)?;
        let (meta, meta_load) =
            MetaLog::open(&dir, config.fsync).map_err(io_error(&dir.join("meta.log")))?;
        if let Some(damage) = &meta_load.damage {
            if meta_load.discarded {
                tracing::error!("{damage}");
            } else {
                tracing::warn!("{damage}");
            }
        }
        let now_ms = clock.now_ms();
        let loaded = counters::load(&counters_dir, &store, now_ms, &|_| true)
            .map_err(io_error(&counters_dir))?;
        for damage in &loaded.damage {
            tracing::error!(
                "{damage}; the counters it held come back from this node's peers (their leaders sync them)"
            );
        }
        let segment = counters::Segment::create(&counters_dir, loaded.next_seq)
            .map_err(io_error(&counters_dir))?;
        let disk = Arc::new(NodeDisk {
            dir,
            counters_dir,
            policy: config.fsync,
            meta,
            writer: Mutex::new(Writer {
                pending: Vec::with_capacity(64 * 1024),
                segment,
            }),
            store,
            clock,
            _lock: lock,
            stop: Mutex::new(false),
            stopped: Condvar::new(),
            flusher: Mutex::new(None),
            write_errors: AtomicU64::new(0),
            snapshots: AtomicU64::new(0),
            replay_bytes: AtomicU64::new(loaded.segment_bytes),
        });
        let startup = Startup {
            meta: meta_load.state,
            meta_discarded: meta_load.discarded,
            counters_loaded: loaded.states,
            load_ms: started.elapsed().as_millis() as u64,
        };
        // A snapshot after loading folds the files read (damaged ones
        // included) into one, so the next start reads one file; not needed
        // when a snapshot alone was read (after a clean shutdown).
        let snapshot_first =
            loaded.segment_bytes > CLOSE_SNAPSHOT_REPLAY_BYTES || !loaded.damage.is_empty();
        let interval = Duration::from_millis(config.fsync_interval_ms.max(1));
        let flusher = Arc::clone(&disk);
        let handle = std::thread::Builder::new()
            .name("tollgate-disk".into())
            .spawn(move || flusher.run_flusher(interval, snapshot_first))
            .map_err(io_error(&disk.dir))?;
        *disk.flusher.lock() = Some(handle);
        tracing::info!(
            dir = %disk.dir.display(),
            fsync = config.fsync.as_str(),
            counters = startup.counters_loaded,
            shards = startup.meta.shards.len(),
            load_ms = startup.load_ms,
            "data dir loaded"
        );
        Ok((disk, startup))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn meta_path(&self) -> &Path {
        self.meta.path()
    }

    /// Writes one metadata change before returning (see [`MetaLog::append`]).
    pub fn meta_append(&self, record: MetaRecord) -> std::io::Result<()> {
        let result = self.meta.append(record);
        if result.is_err() {
            self.write_errors.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Queues a round section this node decided as leader: `count` states,
    /// encoded as a round carries them. Written by [`NodeDisk::write_pending`].
    pub fn log_section(&self, count: u32, states: &[u8]) {
        if count == 0 {
            return;
        }
        counters::frame_states(&mut self.writer.lock().pending, count, states);
    }

    /// Queues states this node applied (a round, a sync, a collection).
    pub fn log_states<'a>(&self, states: impl ExactSizeIterator<Item = (&'a [u8], CounterState)>) {
        if states.len() == 0 {
            return;
        }
        counters::frame_state_list(&mut self.writer.lock().pending, states);
    }

    /// The states of `counters` that `store` does not hold as they are.
    /// Every state in the store was written when it entered it, so a sync
    /// that repeats what a replica holds (a leader catching up a replica
    /// that restarted from its data dir) writes only what is new.
    pub fn unseen<'a>(
        store: &MemoryStore,
        now_ms: u64,
        counters: &'a [(Vec<u8>, CounterState)],
    ) -> Vec<(&'a [u8], CounterState)> {
        counters
            .iter()
            .filter(|(key, state)| store.get(key, now_ms) != Some(*state))
            .map(|(key, state)| (key.as_slice(), *state))
            .collect()
    }

    /// Writes every queued state to the OS (one `write(2)`; synced too under
    /// `--fsync batch`). Called before anything that acknowledges them
    /// leaves this node.
    pub fn write_pending(&self) {
        let mut writer = self.writer.lock();
        if writer.pending.is_empty() {
            return;
        }
        let Writer { pending, segment } = &mut *writer;
        let mut result = segment.write(pending);
        self.replay_bytes
            .fetch_add(pending.len() as u64, Ordering::Relaxed);
        pending.clear();
        if result.is_ok() && self.policy == FsyncPolicy::Batch {
            result = segment.file.sync_data();
        }
        if let Err(error) = result {
            let before = self.write_errors.fetch_add(1, Ordering::Relaxed);
            if before.is_power_of_two() || before == 0 {
                tracing::error!(
                    dir = %self.counters_dir.display(),
                    %error,
                    errors = before + 1,
                    "cannot write the counter log; counters decided now may be lost at a restart"
                );
            }
        }
    }

    /// Logs a failed sync or snapshot (`what`) and counts it in
    /// `write_errors` (`tollgate_cluster_data_dir_write_errors_total`).
    fn write_failed(&self, what: &str, error: std::io::Error) {
        self.write_errors.fetch_add(1, Ordering::Relaxed);
        tracing::error!(dir = %self.dir.display(), %error, "{what}");
    }

    /// Syncs both logs to the disk.
    fn sync(&self) -> std::io::Result<()> {
        let file = {
            let mut writer = self.writer.lock();
            let Writer { pending, segment } = &mut *writer;
            if !pending.is_empty() {
                segment.write(pending)?;
                pending.clear();
            }
            segment.file.try_clone()?
        };
        file.sync_data()?;
        self.meta.sync()
    }

    /// Closes the open segment, opens the next, and writes a snapshot
    /// numbered after it (see `counters.rs`).
    fn rotate_and_snapshot(&self) -> std::io::Result<()> {
        let seq = {
            let mut writer = self.writer.lock();
            let Writer { pending, segment } = &mut *writer;
            segment.write(pending)?;
            pending.clear();
            segment.file.sync_data()?;
            let next = counters::Segment::create(&self.counters_dir, segment.seq + 1)?;
            *segment = next;
            segment.seq
        };
        let started = Instant::now();
        let counters =
            counters::snapshot(&self.counters_dir, seq, &self.store, self.clock.now_ms())?;
        self.snapshots.fetch_add(1, Ordering::Relaxed);
        self.replay_bytes.store(0, Ordering::Relaxed);
        tracing::info!(
            dir = %self.counters_dir.display(),
            counters,
            ms = started.elapsed().as_millis() as u64,
            "counter snapshot written"
        );
        Ok(())
    }

    fn run_flusher(self: Arc<Self>, interval: Duration, snapshot_first: bool) {
        // The start-up snapshot waits until the node has joined and its
        // leaders have collected: it would compete with them for the cores.
        let mut snapshot_at = snapshot_first
            .then(|| Instant::now() + Duration::from_millis(STARTUP_SNAPSHOT_DELAY_MS));
        loop {
            {
                let mut stop = self.stop.lock();
                if !*stop {
                    let _ = self.stopped.wait_for(&mut stop, interval);
                }
                if *stop {
                    return;
                }
            }
            let snapshot_due = snapshot_at.is_some_and(|at| Instant::now() >= at);
            if self.policy == FsyncPolicy::Interval {
                if let Err(error) = self.sync() {
                    self.write_failed("cannot sync the data dir", error);
                }
            } else {
                self.write_pending();
            }
            if snapshot_due || self.writer.lock().segment.bytes > counters::SEGMENT_BYTES_MAX {
                snapshot_at = None;
                if let Err(error) = self.rotate_and_snapshot() {
                    self.write_failed("cannot write a counter snapshot", error);
                }
            }
        }
    }

    /// A clean shutdown: writes and syncs everything, stops the flusher,
    /// and folds the counter log into one snapshot when a start would
    /// otherwise replay more than [`CLOSE_SNAPSHOT_REPLAY_BYTES`] of it (so
    /// the next start reads each live counter once).
    pub fn close(&self) {
        *self.stop.lock() = true;
        self.stopped.notify_all();
        if let Some(handle) = self.flusher.lock().take() {
            let _ = handle.join();
        }
        if self.replay_bytes.load(Ordering::Relaxed) > CLOSE_SNAPSHOT_REPLAY_BYTES {
            if let Err(error) = self.rotate_and_snapshot() {
                self.write_failed("cannot write a counter snapshot", error);
            }
        }
        // The open segment's preallocated tail is given back.
        if let Err(error) = self.writer.lock().segment.trim() {
            self.write_failed("cannot trim the open counter segment", error);
        }
        match self.sync() {
            Ok(()) => tracing::info!(dir = %self.dir.display(), "data dir synced"),
            Err(error) => self.write_failed("cannot sync the data dir", error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &Path) -> Result<(Arc<NodeDisk>, Startup), DiskError> {
        let store = Arc::new(MemoryStore::new(crate::store::MemoryStoreConfig {
            stripes: 4,
            live_keys_max: 1_000,
        }));
        NodeDisk::open(
            &DiskConfig {
                dir: dir.to_path_buf(),
                fsync: FsyncPolicy::Never,
                fsync_interval_ms: 1_000,
            },
            store,
            Arc::new(crate::clock::SystemClock),
        )
    }

    #[cfg(unix)]
    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[cfg(unix)]
    #[test]
    fn a_new_data_dir_is_private_and_a_loose_one_is_tightened() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        // New: the dir, its counters dir and its files are this user's only.
        let new = root.path().join("new/node-1");
        let (disk, _) = open(&new).unwrap();
        disk.meta_append(MetaRecord::Fence { shard: 0, term: 1 })
            .unwrap();
        disk.close();
        assert_eq!(mode(&new), 0o700);
        assert_eq!(mode(&new.join("counters")), 0o700);
        assert_eq!(mode(&new.join("meta.log")), 0o600);
        let segment = std::fs::read_dir(new.join("counters"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        assert_eq!(mode(&segment), 0o600, "{}", segment.display());
        drop(disk);
        // Existing and readable by others (a dir made by hand, mode 755,
        // or one from an older version): tightened to 700, both levels.
        let loose = root.path().join("loose");
        std::fs::create_dir_all(loose.join("counters")).unwrap();
        for dir in [&loose, &loose.join("counters")] {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let (disk, _) = open(&loose).unwrap();
        disk.close();
        assert_eq!(mode(&loose), 0o700);
        assert_eq!(mode(&loose.join("counters")), 0o700);
    }

    #[test]
    fn write_errors_are_counted() {
        let root = tempfile::tempdir().unwrap();
        let (disk, _) = open(&root.path().join("node")).unwrap();
        assert_eq!(disk.write_errors.load(Ordering::Relaxed), 0);
        // The open segment, unmapped, becomes a file opened for reading
        // only: its next write fails as a full or broken disk would make it.
        disk.writer.lock().segment.trim().unwrap();
        let segment = disk.writer.lock().segment.file.try_clone().unwrap();
        disk.writer.lock().segment.file = File::open(root.path()).unwrap();
        let mut states = Vec::new();
        crate::cluster::data_frames::put_bytes(&mut states, b"k");
        crate::cluster::data_frames::put_state(
            &mut states,
            &CounterState::Window {
                end_ms: u64::MAX / 2,
                used: 1,
            },
        );
        disk.log_section(1, &states);
        disk.write_pending();
        assert_eq!(disk.write_errors.load(Ordering::Relaxed), 1);
        disk.write_failed("a test failure", std::io::Error::other("disk full"));
        assert_eq!(disk.write_errors.load(Ordering::Relaxed), 2);
        disk.writer.lock().segment.file = segment;
        disk.close();
    }
}
