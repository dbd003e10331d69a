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
//! Cluster mode does not exist yet: buckets live on the node that serves
//! them, like droplet's singleton server. When shards arrive, a bucket's name
//! should hash to a shard like a counter's key, and its state replicate; the
//! state would then need a merge (as `CounterState::merge`), which the bucket
//! model does not define yet.

// Serving code: input never panics the server (see docs/operations.md).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod lines;
pub mod proto;
pub mod server;

use crate::clock::Clock;
use crate::limiter::droplet_bucket::{self, Balances, BucketState, TakeOutcome, TakeRequest};
use crate::store::{MemoryStoreConfig, StoreFull, StoredState, StripedStore};
use clap::Args;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use lines::LineCommands;
pub use server::{DropletServer, DropletServerConfig, RunningDroplet};

/// droplet's default port.
pub const DROPLET_PORT: u16 = 3000;

/// The flags of the droplet endpoint (flattened into `tollgate serve`).
#[derive(Args, Debug, Clone)]
pub struct DropletArgs {
    /// Serve droplet's WebSocket protocol on ADDR; without a value, on
    /// 0.0.0.0:3000 (droplet's port). Off unless given. `PORT` stays divvy's.
    #[arg(
        long,
        value_name = "ADDR",
        num_args = 0..=1,
        default_missing_value = "0.0.0.0:3000"
    )]
    pub droplet_listen: Option<SocketAddr>,

    /// Largest WebSocket message (and frame) accepted, in bytes; a larger one
    /// closes the connection with code 1009.
    #[arg(long, default_value_t = DropletServerConfig::default().message_bytes_max)]
    pub droplet_message_bytes_max: usize,

    /// droplet's `cleanup_interval`, in milliseconds: a bucket whose every
    /// period is full is forgotten at the next multiple of it (0: never).
    #[arg(long, default_value_t = BucketsConfig::default().cleanup_interval_ms)]
    pub droplet_cleanup_interval_ms: u64,

    /// Most buckets kept in memory; a take that would create one more is
    /// refused (`accept: false` over WebSocket, `ERR` on a line).
    #[arg(long, default_value_t = BucketsConfig::default().buckets_max)]
    pub droplet_buckets_max: usize,
}

impl DropletArgs {
    /// The buckets these flags describe, with a sweeper reclaiming the memory
    /// of forgotten ones every `sweep_interval_ms`.
    pub fn buckets(
        &self,
        stripes: usize,
        clock: &Arc<dyn Clock>,
        sweep_interval_ms: u64,
        sweep_entries_per_tick: usize,
    ) -> std::io::Result<Arc<Buckets>> {
        let buckets = Arc::new(Buckets::new(BucketsConfig {
            stripes,
            buckets_max: self.droplet_buckets_max,
            cleanup_interval_ms: self.droplet_cleanup_interval_ms,
        }));
        buckets.spawn_sweeper(Arc::clone(clock), sweep_interval_ms, sweep_entries_per_tick)?;
        Ok(buckets)
    }

    /// Starts the WebSocket endpoint on `threads` threads when
    /// `--droplet-listen` was given.
    pub fn serve(
        &self,
        buckets: Arc<Buckets>,
        clock: Arc<dyn Clock>,
        threads: usize,
        connections_max: usize,
        drain_timeout_ms: u64,
    ) -> std::io::Result<Option<RunningDroplet>> {
        let Some(listen) = self.droplet_listen else {
            return Ok(None);
        };
        let config = DropletServerConfig {
            listen,
            threads,
            message_bytes_max: self.droplet_message_bytes_max,
            connections_max,
            drain_timeout_ms,
        };
        let server = DropletServer::bind(config, buckets, clock).map_err(|error| {
            std::io::Error::new(error.kind(), format!("cannot listen on {listen}: {error}"))
        })?;
        server.spawn().map(Some)
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
}

impl Buckets {
    pub fn new(config: BucketsConfig) -> Buckets {
        Buckets {
            store: Arc::new(StripedStore::new(MemoryStoreConfig {
                stripes: config.stripes,
                live_keys_max: config.buckets_max,
            })),
            cleanup_interval_ms: config.cleanup_interval_ms,
        }
    }

    /// Starts reclaiming the memory of forgotten buckets (`sweep_entries_per_tick`
    /// examined every `sweep_interval_ms`). Forgetting itself needs no
    /// sweeper: a forgotten bucket already reads as absent.
    pub fn spawn_sweeper(
        &self,
        clock: Arc<dyn Clock>,
        sweep_interval_ms: u64,
        sweep_entries_per_tick: usize,
    ) -> std::io::Result<()> {
        self.store
            .spawn_sweeper(
                clock,
                Duration::from_millis(sweep_interval_ms.max(1)),
                sweep_entries_per_tick.max(1),
            )
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
