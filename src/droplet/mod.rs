//! droplet compatibility: the token buckets of SPEC §7 kept in memory and
//! served two ways, droplet's protobuf-over-WebSocket protocol
//! ([`server`], `--droplet-listen`) and `TAKE`/`QUERY` lines on the divvy port
//! ([`lines`]). Both reach the same [`Buckets`], so a bucket taken over one is
//! seen by the other.
//!
//! The model itself is pure ([`crate::limiter::droplet_bucket`]); this module
//! owns where buckets live (a [`StripedStore`] of their own, with its own
//! cap and sweeper) and the flags.
//!
//! In cluster mode the buckets are the cluster's ([`SharedBuckets`],
//! `cluster::buckets`): sharded, decided by their shard's leader and
//! replicated like rule counters, so every node answers from the same
//! buckets. The callers then hand a read's requests over together and write
//! the answers when they are in (see [`Buckets::shared`]).

pub mod lines;
pub mod proto;
pub mod server;

use crate::clock::Clock;
use crate::limiter::droplet_bucket::{self, Balances, BucketState, TakeOutcome, TakeRequest};
use crate::store::{MemoryStoreConfig, StoreFull, StoredState, StripedStore};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use crate::store::{BucketCall, BucketResults, SharedBuckets};
pub use lines::LineCommands;
pub use server::{DropletProtocol, DropletServer, DropletServerConfig, RunningDroplet};

/// droplet's default port.
pub const DROPLET_PORT: u16 = 3000;

/// The droplet endpoint and its buckets, as `tollgate serve` configures them
/// (the serving threads, connection limit and drain are the line protocol's).
#[derive(Debug, Clone)]
pub struct DropletConfig {
    /// Serve droplet's WebSocket protocol here; `None`: not served (the
    /// buckets still answer `TAKE`/`QUERY` lines).
    pub listen: Option<SocketAddr>,
    /// Largest WebSocket message (and frame) accepted, in bytes.
    pub message_bytes_max: usize,
    /// droplet's `cleanup_interval`, in milliseconds: a bucket whose every
    /// period is full is forgotten at the next multiple of it (0: never).
    pub cleanup_interval_ms: u64,
    /// Most buckets kept in memory.
    pub buckets_max: usize,
}

impl Default for DropletConfig {
    fn default() -> Self {
        DropletConfig {
            listen: None,
            message_bytes_max: DropletServerConfig::default().message_bytes_max,
            cleanup_interval_ms: BucketsConfig::default().cleanup_interval_ms,
            buckets_max: BucketsConfig::default().buckets_max,
        }
    }
}

impl StoredState for BucketState {
    /// Buckets are kept whole in their slots (inline keys still save a
    /// pointer per lookup).
    type Packed = BucketState;

    fn expires_at_ms(&self) -> u64 {
        self.forget_at_ms()
    }

    fn pack(&self) -> Option<BucketState> {
        Some(*self)
    }

    fn unpack(packed: BucketState) -> BucketState {
        packed
    }
}

/// Sizing of [`Buckets`].
#[derive(Debug, Clone, Copy)]
pub struct BucketsConfig {
    /// Lock stripes (rounded up to a power of two).
    pub stripes: usize,
    /// Most buckets kept at once.
    pub buckets_max: usize,
    /// A full bucket is forgotten at the next multiple of this (0: never).
    pub cleanup_interval_ms: u64,
}

impl Default for BucketsConfig {
    fn default() -> Self {
        BucketsConfig {
            stripes: MemoryStoreConfig::default().stripes,
            buckets_max: MemoryStoreConfig::default().live_keys_max,
            cleanup_interval_ms: 60_000,
        }
    }
}

/// The bucket cap was reached: the take that would create a bucket was not
/// applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("bucket limit reached ({buckets_max} buckets)")]
pub struct BucketsFull {
    pub buckets_max: usize,
}

impl From<StoreFull> for BucketsFull {
    fn from(full: StoreFull) -> Self {
        BucketsFull {
            buckets_max: full.live_keys_max,
        }
    }
}

/// Every bucket, keyed by its name's bytes.
pub struct Buckets {
    store: Arc<StripedStore<BucketState>>,
    cleanup_interval_ms: u64,
    /// Cluster mode: the buckets are the cluster's, not `store`'s.
    shared: OnceLock<Arc<dyn SharedBuckets>>,
}

impl Buckets {
    pub fn new(config: BucketsConfig) -> Buckets {
        Buckets {
            store: Arc::new(StripedStore::new(MemoryStoreConfig {
                stripes: config.stripes,
                live_keys_max: config.buckets_max,
            })),
            cleanup_interval_ms: config.cleanup_interval_ms,
            shared: OnceLock::new(),
        }
    }

    /// From now on the buckets are kept by `shared` (cluster mode), not in
    /// this node's memory; set once, before serving (later calls are
    /// ignored).
    pub fn share(&self, shared: Arc<dyn SharedBuckets>) {
        let _ = self.shared.set(shared);
    }

    /// Cluster mode: the buckets' keeper, to which requests go (with
    /// [`Buckets::cleanup_interval_ms`]) instead of [`Buckets::take`] and
    /// [`Buckets::query`].
    pub fn shared(&self) -> Option<&Arc<dyn SharedBuckets>> {
        self.shared.get()
    }

    /// droplet's `cleanup_interval` in milliseconds.
    pub fn cleanup_interval_ms(&self) -> u64 {
        self.cleanup_interval_ms
    }

    /// Starts reclaiming the memory of forgotten buckets (`entries_per_tick`
    /// examined every `tick`), until the buckets are dropped. Forgetting
    /// itself needs no sweeper: a forgotten bucket already reads as absent.
    pub fn spawn_sweeper(
        &self,
        clock: Arc<dyn Clock>,
        tick: Duration,
        entries_per_tick: usize,
    ) -> std::io::Result<()> {
        self.store
            .spawn_sweeper(clock, tick, entries_per_tick)
            .map(drop)
    }

    /// A take (SPEC §7). Always leaves the bucket behind, unless the cap
    /// refuses to create it.
    pub fn take(
        &self,
        bucket: &[u8],
        request: &TakeRequest,
        now_ms: u64,
    ) -> Result<TakeOutcome, BucketsFull> {
        let outcome = self.store.update(bucket, now_ms, |state| {
            let (outcome, state) =
                droplet_bucket::take(state, request, now_ms, self.cleanup_interval_ms);
            (outcome, Some(state))
        })?;
        Ok(outcome)
    }

    /// Every configured period's balance; `None` when the bucket does not
    /// exist. Never creates one.
    pub fn query(&self, bucket: &[u8], now_ms: u64) -> Option<Balances> {
        droplet_bucket::query(self.store.get(bucket, now_ms).as_ref(), now_ms)
    }

    /// Buckets in memory (forgotten ones not yet reclaimed included).
    pub fn len(&self) -> usize {
        self.store.live_keys()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
