//! Raft storage of one shard group, in memory. A group's Raft log carries
//! only what Raft must order: who the shard's replicas are (membership
//! entries) and each new leader's blank entry. Counter states do not travel
//! through the log: a leader streams them to the replicas over the peer data
//! stream, fenced by its term (see `replica.rs` and docs/cluster.md, "The
//! data path"), so a Raft entry costs nothing per hit.
//!
//! The log store keeps entries, the vote and the committed id; the state
//! machine keeps the applied id and the membership; a snapshot is that
//! membership. openraft's storage test suite runs against these types.
//!
//! With a data dir, both write every change through to the node's metadata
//! log (`disk/meta.rs`) before they report it done, and start from what the
//! log holds, so a restarted node keeps its votes, logs and memberships.

use super::disk::meta::{MetaRecord, ShardMeta};
use super::disk::NodeDisk;
use super::NodeId;
use openraft::storage::{LogFlushed, RaftLogStorage, RaftStateMachine};
use openraft::{
    BasicNode, Entry, EntryPayload, LogId, LogState, OptionalSend, RaftLogReader,
    RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageError, StorageIOError, StoredMembership,
    Vote,
};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

openraft::declare_raft_types!(
    /// openraft's types for a Tollgate shard group: its log holds no
    /// application data, only membership and blank entries.
    pub TollgateRaft:
        D = (),
        R = (),
        AsyncRuntime = super::raft_runtime::GroupRuntime,
);

pub type RaftEntry = Entry<TollgateRaft>;

#[derive(Default)]
struct LogInner {
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
    last_purged: Option<LogId<NodeId>>,
    entries: BTreeMap<u64, RaftEntry>,
}

/// Where a shard group's storage writes its changes through to.
#[derive(Clone)]
pub struct ShardDisk {
    pub disk: Arc<NodeDisk>,
    pub shard: u32,
}

impl ShardDisk {
    fn write(&self, record: MetaRecord) -> Result<(), std::io::Error> {
        self.disk.meta_append(record).map_err(|error| {
            std::io::Error::other(format!("{}: {error}", self.disk.meta_path().display()))
        })
    }
}

/// The Raft log of one shard group, in memory and, with a data dir,
/// written through to it; clones share the log (the reader handed to
/// replication streams is a clone).
#[derive(Clone, Default)]
pub struct LogStore {
    inner: Arc<Mutex<LogInner>>,
    disk: Option<ShardDisk>,
}

impl LogStore {
    /// A log store writing through to `disk`, starting from what it holds.
    pub fn persisted(disk: ShardDisk, meta: &ShardMeta) -> LogStore {
        LogStore {
            inner: Arc::new(Mutex::new(LogInner {
                vote: meta.vote,
                committed: meta.committed,
                last_purged: meta.last_purged,
                entries: meta.entries.clone(),
            })),
            disk: Some(disk),
        }
    }

    fn write(&self, record: impl FnOnce(u32) -> MetaRecord) -> Result<(), std::io::Error> {
        match &self.disk {
            Some(disk) => disk.write(record(disk.shard)),
            None => Ok(()),
        }
    }
}

impl RaftLogReader<TollgateRaft> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<RaftEntry>, StorageError<NodeId>> {
        let inner = self.inner.lock();
        Ok(inner
            .entries
            .range(range)
            .map(|(_, entry)| entry.clone())
            .collect())
    }
}

impl RaftLogStorage<TollgateRaft> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TollgateRaft>, StorageError<NodeId>> {
        let inner = self.inner.lock();
        let last = inner
            .entries
            .values()
            .next_back()
            .map(|entry| entry.log_id)
            .or(inner.last_purged);
        Ok(LogState {
            last_purged_log_id: inner.last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> LogStore {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner.lock();
        self.write(|shard| MetaRecord::Vote { shard, vote: *vote })
            .map_err(|e| StorageIOError::write_vote(&e))?;
        inner.vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        Ok(self.inner.lock().vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner.lock();
        self.write(|shard| MetaRecord::Committed { shard, committed })
            .map_err(|e| StorageIOError::write(&e))?;
        inner.committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self.inner.lock().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TollgateRaft>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = RaftEntry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        {
            let mut inner = self.inner.lock();
            let entries: Vec<RaftEntry> = entries.into_iter().collect();
            if !entries.is_empty() {
                self.write(|shard| MetaRecord::Append {
                    shard,
                    entries: entries.clone(),
                })
                .map_err(|e| StorageIOError::write_logs(&e))?;
            }
            for entry in entries {
                inner.entries.insert(entry.log_id.index, entry);
            }
        }
        // Written (to the OS, or synced under `--fsync batch`) before this.
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner.lock();
        self.write(|shard| MetaRecord::Truncate {
            shard,
            from_index: log_id.index,
        })
        .map_err(|e| StorageIOError::write_logs(&e))?;
        let _removed = inner.entries.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner.lock();
        self.write(|shard| MetaRecord::Purge {
            shard,
            upto: log_id,
        })
        .map_err(|e| StorageIOError::write_logs(&e))?;
        inner.last_purged = Some(log_id);
        inner.entries = inner.entries.split_off(&(log_id.index + 1));
        Ok(())
    }
}

/// A built snapshot kept as the group's current one.
#[derive(Clone)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
}

/// The state machine of one shard group: what was applied, and the
/// membership it holds.
#[derive(Default)]
pub struct ShardStateMachine {
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    current_snapshot: Arc<Mutex<Option<StoredSnapshot>>>,
    snapshots_built: Arc<AtomicU64>,
    disk: Option<ShardDisk>,
}

impl ShardStateMachine {
    /// A state machine writing through to `disk`, starting from what it holds.
    pub fn persisted(disk: ShardDisk, meta: &ShardMeta) -> ShardStateMachine {
        ShardStateMachine {
            applied: meta.applied,
            membership: meta.membership.clone(),
            current_snapshot: Arc::new(Mutex::new(
                meta.snapshot.clone().map(|meta| StoredSnapshot { meta }),
            )),
            snapshots_built: Arc::default(),
            disk: Some(disk),
        }
    }

    fn write(&self, record: impl FnOnce(u32) -> MetaRecord) -> Result<(), std::io::Error> {
        match &self.disk {
            Some(disk) => disk.write(record(disk.shard)),
            None => Ok(()),
        }
    }
}

/// Builds a snapshot: the applied id and the membership (the data is empty).
pub struct ShardSnapshotBuilder {
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    current_snapshot: Arc<Mutex<Option<StoredSnapshot>>>,
    snapshots_built: Arc<AtomicU64>,
    disk: Option<ShardDisk>,
}

impl RaftSnapshotBuilder<TollgateRaft> for ShardSnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TollgateRaft>, StorageError<NodeId>> {
        let sequence = self.snapshots_built.fetch_add(1, Ordering::Relaxed) + 1;
        let snapshot_id = match self.applied {
            Some(log_id) => format!("{}-{}-{sequence}", log_id.leader_id.term, log_id.index),
            None => format!("none-{sequence}"),
        };
        let meta = SnapshotMeta {
            last_log_id: self.applied,
            last_membership: self.membership.clone(),
            snapshot_id,
        };
        if let Some(disk) = &self.disk {
            disk.write(MetaRecord::Snapshot {
                shard: disk.shard,
                meta: meta.clone(),
            })
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        }
        *self.current_snapshot.lock() = Some(StoredSnapshot { meta: meta.clone() });
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(Vec::new())),
        })
    }
}

impl RaftStateMachine<TollgateRaft> for ShardStateMachine {
    type SnapshotBuilder = ShardSnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError<NodeId>>
    {
        Ok((self.applied, self.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<()>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = RaftEntry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut results = Vec::new();
        let mut applied = self.applied;
        let mut membership = self.membership.clone();
        for entry in entries {
            applied = Some(entry.log_id);
            if let EntryPayload::Membership(changed) = entry.payload {
                membership = StoredMembership::new(Some(entry.log_id), changed);
            }
            results.push(());
        }
        if applied != self.applied {
            self.write(|shard| MetaRecord::Applied {
                shard,
                applied,
                membership: membership.clone(),
            })
            .map_err(|e| StorageIOError::write_state_machine(&e))?;
        }
        self.applied = applied;
        self.membership = membership;
        Ok(results)
    }

    async fn get_snapshot_builder(&mut self) -> ShardSnapshotBuilder {
        ShardSnapshotBuilder {
            applied: self.applied,
            membership: self.membership.clone(),
            current_snapshot: Arc::clone(&self.current_snapshot),
            snapshots_built: Arc::clone(&self.snapshots_built),
            disk: self.disk.clone(),
        }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        if !snapshot.get_ref().is_empty() {
            return Err(StorageIOError::read_snapshot(
                Some(meta.signature()),
                &std::io::Error::other("a shard group's snapshot carries no data"),
            )
            .into());
        }
        self.write(|shard| MetaRecord::Snapshot {
            shard,
            meta: meta.clone(),
        })
        .and_then(|()| {
            self.write(|shard| MetaRecord::Applied {
                shard,
                applied: meta.last_log_id,
                membership: meta.last_membership.clone(),
            })
        })
        .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        self.applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        *self.current_snapshot.lock() = Some(StoredSnapshot { meta: meta.clone() });
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TollgateRaft>>, StorageError<NodeId>> {
        Ok(self
            .current_snapshot
            .lock()
            .as_ref()
            .map(|stored| Snapshot {
                meta: stored.meta.clone(),
                snapshot: Box::new(Cursor::new(Vec::new())),
            }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::testing::{StoreBuilder, Suite};

    struct MemoryBuilder;

    impl StoreBuilder<TollgateRaft, LogStore, ShardStateMachine, ()> for MemoryBuilder {
        async fn build(&self) -> Result<((), LogStore, ShardStateMachine), StorageError<NodeId>> {
            Ok(((), LogStore::default(), ShardStateMachine::default()))
        }
    }

    #[test]
    fn openraft_storage_suite() {
        Suite::test_all(MemoryBuilder).expect("openraft's storage suite passes");
    }

    /// A data dir for one test; closed (flusher stopped) when dropped.
    struct TestDisk {
        disk: Arc<NodeDisk>,
        _dir: tempfile::TempDir,
    }

    impl Drop for TestDisk {
        fn drop(&mut self) {
            self.disk.close();
        }
    }

    fn open_disk(dir: &std::path::Path) -> (Arc<NodeDisk>, crate::cluster::disk::Startup) {
        let store = Arc::new(crate::store::MemoryStore::new(
            crate::store::MemoryStoreConfig {
                stripes: 4,
                live_keys_max: 1_000,
            },
        ));
        NodeDisk::open(
            &crate::cluster::disk::DiskConfig {
                dir: dir.to_path_buf(),
                fsync: crate::cluster::disk::FsyncPolicy::Never,
                fsync_interval_ms: 1_000,
            },
            store,
            Arc::new(crate::clock::SystemClock),
        )
        .expect("open the data dir")
    }

    struct PersistedBuilder;

    impl StoreBuilder<TollgateRaft, LogStore, ShardStateMachine, TestDisk> for PersistedBuilder {
        async fn build(
            &self,
        ) -> Result<(TestDisk, LogStore, ShardStateMachine), StorageError<NodeId>> {
            let dir = tempfile::tempdir().expect("temp dir");
            let (disk, _) = open_disk(&dir.path().join("data"));
            let shard = ShardDisk {
                disk: Arc::clone(&disk),
                shard: 0,
            };
            let meta = ShardMeta::default();
            Ok((
                TestDisk { disk, _dir: dir },
                LogStore::persisted(shard.clone(), &meta),
                ShardStateMachine::persisted(shard, &meta),
            ))
        }
    }

    #[test]
    fn openraft_storage_suite_with_a_data_dir() {
        Suite::test_all(PersistedBuilder).expect("openraft's storage suite passes");
    }

    #[test]
    fn a_group_resumes_its_vote_log_and_membership_from_the_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let vote = Vote::new_committed(3, 2);
        let entry = |index: u64| RaftEntry {
            log_id: LogId::new(openraft::CommittedLeaderId::new(3, 2), index),
            payload: EntryPayload::Blank,
        };
        {
            let (disk, _) = open_disk(&path);
            let shard = ShardDisk {
                disk: Arc::clone(&disk),
                shard: 5,
            };
            let mut log = LogStore::persisted(shard.clone(), &ShardMeta::default());
            let mut machine = ShardStateMachine::persisted(shard, &ShardMeta::default());
            runtime.block_on(async {
                log.save_vote(&vote).await.unwrap();
                // (`append` needs openraft's flush callback: the records
                // it writes, written directly.)
                let entries = vec![entry(1), entry(2), entry(3)];
                for e in &entries {
                    log.write(|shard| MetaRecord::Append {
                        shard,
                        entries: vec![e.clone()],
                    })
                    .unwrap();
                }
                log.truncate(LogId::new(openraft::CommittedLeaderId::new(3, 2), 3))
                    .await
                    .unwrap();
                log.save_committed(Some(entries[1].log_id)).await.unwrap();
                machine.apply(entries[..2].to_vec()).await.unwrap();
            });
            disk.close();
        }
        let (disk, startup) = open_disk(&path);
        let meta = &startup.meta.shards[&5];
        assert!(meta.established());
        assert_eq!(meta.vote, Some(vote));
        assert_eq!(meta.entries.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
        let shard = ShardDisk {
            disk: Arc::clone(&disk),
            shard: 5,
        };
        let mut log = LogStore::persisted(shard.clone(), meta);
        let mut machine = ShardStateMachine::persisted(shard, meta);
        runtime.block_on(async {
            assert_eq!(log.read_vote().await.unwrap(), Some(vote));
            assert_eq!(log.read_committed().await.unwrap(), Some(entry(2).log_id));
            assert_eq!(
                log.get_log_state().await.unwrap().last_log_id,
                Some(entry(2).log_id)
            );
            assert_eq!(
                machine.applied_state().await.unwrap().0,
                Some(entry(2).log_id)
            );
        });
        disk.close();
    }
}
