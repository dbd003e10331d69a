//! Raft storage of one shard group, in memory: the log store (entries, vote,
//! committed id) and the state machine (the shard's counters). What the log
//! carries is counter *state*, never commands: each entry is a batch of
//! `(key, CounterState)` stamped with the leader's clock, applied with
//! [`CounterState::merge`], which is idempotent and commutative, so applying
//! an entry twice, or a snapshot over newer entries, never double-counts.
//!
//! All shard groups of a node share one [`MemoryStore`] (a key belongs to
//! exactly one shard), so the live-key cap, the stripes and the sweeper apply
//! per node. A shard's snapshot is its live counters, filtered out of the
//! shared store by shard, serialized through [`codec`](super::codec).
//! openraft's storage test suite runs against these types (tests below).

use super::codec;
use super::placement::Placement;
use super::NodeId;
use crate::clock::Clock;
use crate::limiter::CounterState;
use crate::store::MemoryStore;
use openraft::storage::{LogFlushed, RaftLogStorage, RaftStateMachine};
use openraft::{
    BasicNode, Entry, EntryPayload, LogId, LogState, OptionalSend, RaftLogReader,
    RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageError, StorageIOError, StoredMembership,
    Vote,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One counter's replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicatedCounter {
    /// The cluster key: stable counter id (8 bytes LE) + actor.
    pub key: Vec<u8>,
    /// The state as the store keeps it, whatever the rule's algorithm.
    pub state: CounterState,
}

impl ReplicatedCounter {
    pub fn new(key: Vec<u8>, state: CounterState) -> ReplicatedCounter {
        ReplicatedCounter { key, state }
    }

    pub fn state(&self) -> CounterState {
        self.state
    }
}

/// The application data of a log entry: the states a leader decided in one
/// batch, stamped with its clock.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterBatch {
    /// The leader's wall clock when it decided the batch; replicas expire
    /// states against it, never against their own clock.
    pub stamped_ms: u64,
    pub counters: Vec<ReplicatedCounter>,
}

/// A snapshot's content: the shard's live counters when it was built.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SnapshotContent {
    pub built_ms: u64,
    pub counters: Vec<ReplicatedCounter>,
}

openraft::declare_raft_types!(
    /// openraft's types for a Tollgate shard group.
    pub TollgateRaft:
        D = CounterBatch,
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

/// A built snapshot kept as the shard's current one.
#[derive(Clone)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    data: Vec<u8>,
}

/// What the state machine and its snapshot builders share.
struct ShardShared {
    shard: u32,
    placement: Placement,
    store: Arc<MemoryStore>,
    clock: Arc<dyn Clock>,
    current_snapshot: Mutex<Option<StoredSnapshot>>,
    snapshots_built: AtomicU64,
    /// Replicated states dropped because the node's live-key cap was reached.
    dropped_at_cap: AtomicU64,
}

/// The state machine of one shard group: its counters live in the node's
/// shared [`MemoryStore`]; this tracks what was applied.
pub struct ShardStateMachine {
    shared: Arc<ShardShared>,
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
}

impl ShardStateMachine {
    pub fn new(
        shard: u32,
        placement: Placement,
        store: Arc<MemoryStore>,
        clock: Arc<dyn Clock>,
    ) -> ShardStateMachine {
        ShardStateMachine {
            shared: Arc::new(ShardShared {
                shard,
                placement,
                store,
                clock,
                current_snapshot: Mutex::new(None),
                snapshots_built: AtomicU64::new(0),
                dropped_at_cap: AtomicU64::new(0),
            }),
            applied: None,
            membership: StoredMembership::default(),
        }
    }

    fn merge_counters(&self, counters: &[ReplicatedCounter], now_ms: u64) {
        for counter in counters {
            if self
                .shared
                .store
                .merge(&counter.key, counter.state(), now_ms)
                .is_err()
            {
                let dropped = self.shared.dropped_at_cap.fetch_add(1, Ordering::Relaxed);
                if dropped.is_multiple_of(10_000) {
                    tracing::warn!(
                        shard = self.shared.shard,
                        dropped = dropped + 1,
                        "live-key cap reached: replicated counters dropped on this replica"
                    );
                }
            }
        }
    }
}

/// Builds a snapshot of one shard's live counters.
pub struct ShardSnapshotBuilder {
    shared: Arc<ShardShared>,
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
}

impl RaftSnapshotBuilder<TollgateRaft> for ShardSnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TollgateRaft>, StorageError<NodeId>> {
        let shared = &self.shared;
        let built_ms = shared.clock.now_ms();
        let mut content = SnapshotContent {
            built_ms,
            counters: Vec::new(),
        };
        shared.store.for_each_live(built_ms, |key, state| {
            if shared.placement.shard_of(key) == shared.shard {
                content
                    .counters
                    .push(ReplicatedCounter::new(key.to_vec(), state));
            }
        });
        let data = codec::encode_snapshot(&content)
            .map_err(|error| StorageIOError::write_snapshot(None, &error))?;
        let sequence = shared.snapshots_built.fetch_add(1, Ordering::Relaxed) + 1;
        let snapshot_id = match self.applied {
            Some(log_id) => format!("{}-{}-{sequence}", log_id.leader_id.term, log_id.index),
            None => format!("none-{sequence}"),
        };
        let meta = SnapshotMeta {
            last_log_id: self.applied,
            last_membership: self.membership.clone(),
            snapshot_id,
        };
        *shared.current_snapshot.lock() = Some(StoredSnapshot {
            meta: meta.clone(),
            data: data.clone(),
        });
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
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
            match entry.payload {
                EntryPayload::Blank => {}
                EntryPayload::Normal(batch) => {
                    self.merge_counters(&batch.counters, batch.stamped_ms)
                }
                EntryPayload::Membership(membership) => {
                    self.membership = StoredMembership::new(Some(entry.log_id), membership);
                }
            }
            results.push(());
        }
        Ok(results)
    }

    async fn get_snapshot_builder(&mut self) -> ShardSnapshotBuilder {
        ShardSnapshotBuilder {
            shared: Arc::clone(&self.shared),
            applied: self.applied,
            membership: self.membership.clone(),
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
        let data = snapshot.into_inner();
        let content = codec::decode_snapshot(&data)
            .map_err(|error| StorageIOError::read_snapshot(Some(meta.signature()), &error))?;
        // Counters merge into what this replica holds: merging is monotone,
        // so the result is at least the snapshot's state.
        let now_ms = self.shared.clock.now_ms().max(content.built_ms);
        self.merge_counters(&content.counters, now_ms);
        tracing::info!(
            shard = self.shared.shard,
            counters = content.counters.len(),
            "installed a snapshot from the leader"
        );
        self.applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        *self.shared.current_snapshot.lock() = Some(StoredSnapshot {
            meta: meta.clone(),
            data,
        });
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TollgateRaft>>, StorageError<NodeId>> {
        Ok(self
            .shared
            .current_snapshot
            .lock()
            .as_ref()
            .map(|stored| Snapshot {
                meta: stored.meta.clone(),
                snapshot: Box::new(Cursor::new(stored.data.clone())),
            }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::store::MemoryStoreConfig;
    use openraft::testing::{StoreBuilder, Suite};

    struct MemoryBuilder;

    impl StoreBuilder<TollgateRaft, LogStore, ShardStateMachine, ()> for MemoryBuilder {
        async fn build(&self) -> Result<((), LogStore, ShardStateMachine), StorageError<NodeId>> {
            let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
            let clock = Arc::new(ManualClock::new(1_700_000_000_000));
            let sm = ShardStateMachine::new(0, Placement::new(1, 1, vec![1]), store, clock);
            Ok(((), LogStore::default(), sm))
        }
    }

    #[test]
    fn openraft_storage_suite() {
        Suite::test_all(MemoryBuilder).expect("openraft's storage suite passes");
    }

    #[test]
    fn snapshot_holds_only_the_shards_live_counters_and_restores_them() {
        let placement = Placement::new(4, 1, vec![1]);
        let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
        let clock = Arc::new(ManualClock::new(1_000_000));
        let now = clock.now_ms();
        let mut keys_of_shard_1 = 0;
        for actor in 0..200u32 {
            let key = actor.to_le_bytes().to_vec();
            let end_ms = if actor % 2 == 0 {
                now + 60_000
            } else {
                now - 1
            };
            let state = CounterState::Window { end_ms, used: 3 };
            // Expired states are never stored; count the live ones of shard 1.
            if store.merge(&key, state, now - 10).is_ok()
                && placement.shard_of(&key) == 1
                && actor % 2 == 0
            {
                keys_of_shard_1 += 1;
            }
        }
        assert!(keys_of_shard_1 > 0);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut sm =
                ShardStateMachine::new(1, placement.clone(), Arc::clone(&store), clock.clone());
            let mut builder = sm.get_snapshot_builder().await;
            let snapshot = builder.build_snapshot().await.unwrap();
            let content = codec::decode_snapshot(snapshot.snapshot.get_ref()).unwrap();
            assert_eq!(content.counters.len(), keys_of_shard_1);
            assert!(content
                .counters
                .iter()
                .all(|c| placement.shard_of(&c.key) == 1 && c.state.expires_at_ms() > now));

            let fresh = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
            let mut replica =
                ShardStateMachine::new(1, placement.clone(), Arc::clone(&fresh), clock);
            replica
                .install_snapshot(&snapshot.meta, snapshot.snapshot)
                .await
                .unwrap();
            assert_eq!(fresh.live_keys(), keys_of_shard_1);
            for counter in &content.counters {
                assert_eq!(fresh.get(&counter.key, now), Some(counter.state()));
            }
        });
    }
}
