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
);

pub type RaftEntry = Entry<TollgateRaft>;

#[derive(Default)]
struct LogInner {
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
    last_purged: Option<LogId<NodeId>>,
    entries: BTreeMap<u64, RaftEntry>,
}

/// The in-memory Raft log of one shard group; clones share the log (the
/// reader handed to replication streams is a clone).
#[derive(Clone, Default)]
pub struct LogStore {
    inner: Arc<Mutex<LogInner>>,
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
        self.inner.lock().vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        Ok(self.inner.lock().vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        self.inner.lock().committed = committed;
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
            for entry in entries {
                inner.entries.insert(entry.log_id.index, entry);
            }
        }
        // In memory, an append is durable as soon as it is done.
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner.lock();
        let _removed = inner.entries.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut inner = self.inner.lock();
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
}

/// Builds a snapshot: the applied id and the membership (the data is empty).
pub struct ShardSnapshotBuilder {
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    current_snapshot: Arc<Mutex<Option<StoredSnapshot>>>,
    snapshots_built: Arc<AtomicU64>,
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
        for entry in entries {
            self.applied = Some(entry.log_id);
            if let EntryPayload::Membership(membership) = entry.payload {
                self.membership = StoredMembership::new(Some(entry.log_id), membership);
            }
            results.push(());
        }
        Ok(results)
    }

    async fn get_snapshot_builder(&mut self) -> ShardSnapshotBuilder {
        ShardSnapshotBuilder {
            applied: self.applied,
            membership: self.membership.clone(),
            current_snapshot: Arc::clone(&self.current_snapshot),
            snapshots_built: Arc::clone(&self.snapshots_built),
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
}
