//! Batched scans of the counter store by shard, for collections (a new
//! leader's `Collect`) and syncs. The store is not indexed by shard, so
//! picking one shard's counters means visiting every counter; after a full
//! restart every node answers a collection for most shards at once and
//! syncs the shards it leads, which one scan per shard made a restart of a
//! few hundred thousand counters take tens of seconds of the Raft thread.
//!
//! Here requests queue up, and one scan, off the Raft runtime's threads
//! (`spawn_blocking`), answers every request queued when it started. A
//! request is answered by a scan that began after it was made, so a
//! collection still sees every state applied before its promise (the
//! promise is made before the request is queued; see `replica.rs`).

use super::dataplane::DataPlane;
use super::node::ClusterNode;
use super::wire::{ApplyRefusal, CounterList};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;

/// How long a scan waits for more requests before it starts, in
/// milliseconds.
const SCAN_GATHER_MS: u64 = 2;

type Request = (u32, oneshot::Sender<CounterList>);

/// The queue of shard scans of one node.
#[derive(Default)]
pub struct ShardScans {
    pending: Mutex<Vec<Request>>,
    scanning: AtomicBool,
}

impl ShardScans {
    /// The live counters of `shard` held here, from a scan that starts after
    /// this call.
    pub async fn counters_of(self: &Arc<Self>, dp: &Arc<DataPlane>, shard: u32) -> CounterList {
        let (sender, receiver) = oneshot::channel();
        self.pending.lock().push((shard, sender));
        if !self.scanning.swap(true, Ordering::AcqRel) {
            tokio::spawn(Arc::clone(self).run(Arc::clone(dp)));
        }
        match receiver.await {
            Ok(counters) => counters,
            // The scanner stopped (the runtime is shutting down): scan here.
            Err(_) => dp.counters_of(shard),
        }
    }

    async fn run(self: Arc<Self>, dp: Arc<DataPlane>) {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(SCAN_GATHER_MS)).await;
            let batch = std::mem::take(&mut *self.pending.lock());
            if batch.is_empty() {
                self.scanning.store(false, Ordering::Release);
                // A request queued just now found the flag still set:
                // serve it unless another scanner took over.
                if self.pending.lock().is_empty() || self.scanning.swap(true, Ordering::AcqRel) {
                    return;
                }
                continue;
            }
            let scan_dp = Arc::clone(&dp);
            let shards: Vec<u32> = batch.iter().map(|(shard, _)| *shard).collect();
            let lists = tokio::task::spawn_blocking(move || scan(&scan_dp, &shards)).await;
            match lists {
                Ok(lists) => {
                    for ((_, sender), counters) in batch.into_iter().zip(lists) {
                        let _ = sender.send(counters);
                    }
                }
                Err(_) => {
                    // The scan panicked or was cancelled: the requests fall
                    // back to their own scans (their senders drop here).
                    drop(batch);
                }
            }
        }
    }
}

impl ClusterNode {
    /// A new leader of `term` for `shard` collects this replica's counters:
    /// the replica promises `term`, then answers what it holds.
    pub async fn collect(&self, shard: u32, term: u64) -> Result<CounterList, ApplyRefusal> {
        let replica = self.replica(shard).ok_or(ApplyRefusal::NotReplica)?;
        replica.promise(term)?;
        Ok(self.scans.counters_of(&self.dp, shard).await)
    }
}

/// One pass over the store: the live counters of each of `shards` (a
/// shard asked twice gets its list twice).
fn scan(dp: &DataPlane, shards: &[u32]) -> Vec<CounterList> {
    let mut slot_of: Vec<Option<usize>> = vec![None; dp.placement.shards() as usize];
    for (at, &shard) in shards.iter().enumerate() {
        if let Some(slot) = slot_of.get_mut(shard as usize) {
            slot.get_or_insert(at);
        }
    }
    let mut lists: Vec<CounterList> = vec![Vec::new(); shards.len()];
    let now_ms = dp.clock.now_ms();
    dp.store.for_each_live(now_ms, |key, state| {
        let shard = dp.placement.shard_of(key) as usize;
        if let Some(Some(at)) = slot_of.get(shard) {
            lists[*at].push((key.to_vec(), state));
        }
    });
    for (at, &shard) in shards.iter().enumerate() {
        if let Some(Some(first)) = slot_of.get(shard as usize) {
            if *first != at {
                lists[at] = lists[*first].clone();
            }
        }
    }
    lists
}
