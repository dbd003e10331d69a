//! droplet's buckets kept elsewhere than in this node's memory (a
//! cluster's, sharded and replicated): the trait the droplet endpoint and
//! the `TAKE`/`QUERY` lines call in cluster mode, which answers later, and
//! its requests. Here, below both `droplet` and `cluster`, so that neither
//! knows the other.

use crate::limiter::droplet_bucket::{TakeOutcome, TakeRequest};
use futures_util::future::BoxFuture;

/// One droplet request for [`SharedBuckets`].
#[derive(Debug, Clone, Copy)]
pub enum BucketCall<'a> {
    Take {
        bucket: &'a [u8],
        request: TakeRequest,
    },
    /// Answered as a take that is accepted and reports every configured
    /// period (none for a bucket that does not exist).
    Query { bucket: &'a [u8] },
}

/// The answers to a list of [`BucketCall`]s, in order; an error is the
/// reason the bucket could not be reached (`shard N unavailable: …`).
pub type BucketResults = Vec<Result<TakeOutcome, String>>;

/// Buckets kept elsewhere than in this node's memory (the cluster's), which
/// answer later.
pub trait SharedBuckets: Send + Sync + 'static {
    /// Decides `calls` in order; never hangs (a bucket that cannot be
    /// reached is an error within the cluster's forward timeout).
    fn decide(
        &self,
        calls: &[BucketCall<'_>],
        cleanup_interval_ms: u64,
        now_ms: u64,
    ) -> BoxFuture<'static, BucketResults>;
}
