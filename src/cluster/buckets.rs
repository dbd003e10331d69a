//! droplet's buckets in cluster mode (`--droplet-listen`, `TAKE`/`QUERY`
//! lines): sharded, decided and replicated like rule counters, on the same
//! data path (forwards, rounds, commits, syncs, collections, the data dir).
//!
//! A bucket is kept as one [`PeriodCell`] per period it configures, each
//! under its own key in the node's counter store: the 8-byte prefix
//! [`BUCKET_KEY_PREFIX`] with the period's index in its low byte, then the
//! bucket's name. The period byte is left out of the shard hash
//! ([`shard_bytes`]), so all of a bucket's cells live in one shard and are
//! decided by its leader, which reads them, runs droplet's take (SPEC §7,
//! [`crate::limiter::droplet_bucket::replicated`]) and writes every cell of
//! a changed bucket with a new version, under a lock striped by bucket (a
//! take touches several keys). The written cells go into the open round
//! together, the answer waiting on the last one: in strict mode a take is
//! answered once its cells are held by a majority, as a hit is; a query,
//! and a take that changes nothing, answers at once from the leader's
//! state, as `PEEK` and denials do. A forwarded take carries the requesting
//! node's cleanup interval, so the answer is the one its own flags give.

use super::data_frames::BucketOp;
use super::dataplane::{DataPlane, DecidedState};
use super::forward::ClusterBatch;
use super::rounds::Waiter;
use super::wire::{Answer, ShardRefusal, WireDecision};
use super::NodeId;
use crate::limiter::droplet_bucket::replicated::{take_cells, Cells};
use crate::limiter::droplet_bucket::{query, TakeOutcome, TakeRequest, PERIOD_COUNT};
use crate::limiter::CounterState;
use crate::store::{BucketCall, BucketResults, SharedBuckets};
use crate::store::{MemoryStore, StoreFull};
use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::Arc;

/// The key prefix of a bucket's cells ("droplet" and the period index in the
/// low byte), little endian like a rule's counter id.
pub const BUCKET_KEY_PREFIX: u64 = 0x7465_6c70_6f72_6400;

/// Locks serializing the takes of one bucket (striped by its name's hash).
const BUCKET_LOCKS: usize = 64;
static LOCKS: [Mutex<()>; BUCKET_LOCKS] = [const { Mutex::new(()) }; BUCKET_LOCKS];

/// Appends the key of a bucket's period `period` (an index of
/// [`crate::limiter::droplet_bucket::Period`]).
pub fn append_period_key(buf: &mut Vec<u8>, period: usize, name: &[u8]) {
    buf.extend_from_slice(&(BUCKET_KEY_PREFIX | period as u64).to_le_bytes());
    buf.extend_from_slice(name);
}

/// The bucket name of a bucket cell's key; `None` for any other key.
pub fn bucket_name(key: &[u8]) -> Option<&[u8]> {
    let prefix = u64::from_le_bytes(key.get(..8)?.try_into().ok()?);
    (prefix & !0xff == BUCKET_KEY_PREFIX && ((prefix & 0xff) as usize) < PERIOD_COUNT)
        .then(|| &key[8..])
}

/// What a key's shard is hashed from: the key, less the period byte of a
/// bucket's cell (a rule counter whose id happened to look like a bucket's
/// would only be placed by the rest of its key, the same way everywhere).
pub fn shard_bytes(key: &[u8]) -> &[u8] {
    match bucket_name(key) {
        Some(_) => &key[1..],
        None => key,
    }
}

/// Reads a bucket's cells, runs the take or the query, and writes the cells
/// of a changed bucket. Returns the answer and the cells written.
fn decide(
    store: &MemoryStore,
    name: &[u8],
    bucket: &BucketOp,
    is_query: bool,
    now_ms: u64,
    term: u64,
) -> Result<(TakeOutcome, Option<Cells>), StoreFull> {
    let mut key: SmallVec<[u8; 64]> = SmallVec::new();
    key.extend_from_slice(&BUCKET_KEY_PREFIX.to_le_bytes());
    key.extend_from_slice(name);
    let lock = &LOCKS[(store.key_hash(&key) >> 7) as usize % BUCKET_LOCKS];
    let _serialized = lock.lock();
    let mut cells: Cells = [None; PERIOD_COUNT];
    for (period, cell) in cells.iter_mut().enumerate() {
        key[0] = period as u8;
        if let Some(CounterState::DropletPeriod(found)) = store.get(&key, now_ms) {
            *cell = Some(found);
        }
    }
    if is_query {
        let (state, _) = crate::limiter::droplet_bucket::replicated::join(&cells);
        let balances = query(state.as_ref(), now_ms).unwrap_or_default();
        return Ok((
            TakeOutcome {
                accept: true,
                balances,
            },
            None,
        ));
    }
    let (outcome, written) = take_cells(
        &cells,
        &bucket.request,
        now_ms,
        bucket.cleanup_interval_ms,
        term,
    );
    if let Some(written) = &written {
        for (period, cell) in written.iter().enumerate() {
            let Some(cell) = cell else { continue };
            key[0] = period as u8;
            let state = CounterState::DropletPeriod(*cell);
            store.update(&key, now_ms, |_| ((), Some(state)))?;
        }
    }
    Ok((outcome, written))
}

/// Decides a bucket op (`key`: its first period key) as the leader of
/// `shard` on this node: the answer, the cells to replicate and the term;
/// or the wire answer of an op that cannot be decided here.
pub fn decide_on_replica(
    dp: &DataPlane,
    shard: u32,
    key: &[u8],
    bucket: &BucketOp,
    is_query: bool,
    now_ms: u64,
) -> Result<(TakeOutcome, Option<Cells>, u64), WireDecision> {
    let Some(name) = bucket_name(key) else {
        return Err(WireDecision::Unavailable {
            shard,
            why: ShardRefusal::Other("a droplet request carried a key that names no bucket".into()),
        });
    };
    let replicas = dp.replicas();
    let Some(replica) = super::dataplane::replica_in(&replicas, shard) else {
        return Err(WireDecision::Retry {
            shard,
            why: ShardRefusal::NotReplicated(dp.me),
        });
    };
    match replica.lead(|term| decide(&dp.store, name, bucket, is_query, now_ms, term)) {
        Ok((Ok((answer, written)), term)) => Ok((answer, written, term)),
        Ok((Err(StoreFull { live_keys_max }), _)) => Err(WireDecision::Full {
            live_keys_max: live_keys_max as u64,
        }),
        Err(why) => Err(WireDecision::Retry { shard, why }),
    }
}

/// Who forwarded a bucket op: node, incarnation, batch and index.
pub type ForwardedBy = (NodeId, u64, u64, u32);

impl DataPlane {
    /// Decides a bucket op `from` forwarded, as its shard's leader (see
    /// `decide_forwarded`): the answer now, or `None` when it waits for its
    /// cells' commit.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decide_forwarded_bucket(
        &self,
        shard: u32,
        key: &[u8],
        bucket: &BucketOp,
        is_query: bool,
        now_ms: u64,
        (peer, boot, batch, index): ForwardedBy,
        keys: &mut Vec<u8>,
        decided: &mut Vec<(usize, usize, DecidedState)>,
    ) -> Option<WireDecision> {
        let (answer, written, term) =
            match decide_on_replica(self, shard, key, bucket, is_query, now_ms) {
                Ok(decided) => decided,
                Err(answer) => return Some(answer),
            };
        let Some(cells) = written else {
            return Some(Answer::bucket(answer).into());
        };
        let strict = self.strict();
        let name = bucket_name(key).unwrap_or_default();
        let last = cells.iter().rposition(Option::is_some);
        for (period, cell) in cells.iter().enumerate() {
            let Some(cell) = cell else { continue };
            let at = keys.len();
            append_period_key(keys, period, name);
            let waiter = (strict && Some(period) == last).then_some(Waiter::Remote {
                peer,
                boot,
                batch,
                index,
                decision: Answer::bucket(answer),
                lease: 0,
            });
            decided.push((
                at,
                keys.len() - at,
                DecidedState {
                    shard,
                    term,
                    state: CounterState::DropletPeriod(*cell),
                    waiter,
                },
            ));
        }
        (!strict).then(|| Answer::bucket(answer).into())
    }
}

/// droplet's buckets as the cluster keeps them (what the droplet endpoint
/// and the `TAKE`/`QUERY` lines call in cluster mode).
pub struct ClusterBuckets {
    pub dp: Arc<DataPlane>,
}

impl SharedBuckets for ClusterBuckets {
    fn decide(
        &self,
        calls: &[BucketCall<'_>],
        cleanup_interval_ms: u64,
        now_ms: u64,
    ) -> BoxFuture<'static, BucketResults> {
        let mut batch = Box::new(ClusterBatch::new(Arc::clone(&self.dp)));
        for call in calls {
            let (name, request, is_query) = match *call {
                BucketCall::Take { bucket, request } => (bucket, request, false),
                BucketCall::Query { bucket } => (bucket, TakeRequest::default(), true),
            };
            let op = BucketOp {
                request,
                cleanup_interval_ms,
            };
            batch.add_bucket(name, op, is_query, now_ms);
        }
        let answers = batch.submit_answers();
        Box::pin(async move {
            answers
                .await
                .into_iter()
                .map(|answer| match answer {
                    Ok(Answer::Bucket(packed)) => Ok(packed.outcome()),
                    Ok(Answer::Hit(_)) => Err("a droplet request got a rule's answer".to_string()),
                    Err(error) => Err(error.to_string()),
                })
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::wire::BucketAnswer;
    use crate::limiter::droplet_bucket::Balances;

    #[test]
    fn a_bucket_answer_packs_whole_and_small() {
        for outcome in [
            TakeOutcome {
                accept: false,
                balances: Balances([Some(-1), None, Some(i32::MAX), None, None, Some(i32::MIN)]),
            },
            TakeOutcome {
                accept: true,
                balances: Balances::default(),
            },
        ] {
            assert_eq!(BucketAnswer::pack(outcome).outcome(), outcome);
        }
        // A strict hit's waiter keeps an Answer: no bigger than 32 bytes.
        assert!(std::mem::size_of::<Answer>() <= 32);
    }

    #[test]
    fn a_buckets_periods_share_a_shard_and_other_keys_keep_theirs() {
        let mut keys = Vec::new();
        for period in 0..PERIOD_COUNT {
            let mut key = Vec::new();
            append_period_key(&mut key, period, b"bucket-a");
            assert_eq!(bucket_name(&key), Some(&b"bucket-a"[..]));
            assert_eq!(shard_bytes(&key), &key[1..]);
            keys.push(key);
        }
        assert!(keys
            .windows(2)
            .all(|w| shard_bytes(&w[0]) == shard_bytes(&w[1])));
        // A rule counter's key, a short key, a seventh "period": not buckets.
        let rule_key = [7u8, 0, 0, 0, 0, 0, 0, 1, b'x'];
        assert_eq!(shard_bytes(&rule_key), &rule_key[..]);
        assert_eq!(bucket_name(b"short"), None);
        let mut seventh = Vec::new();
        append_period_key(&mut seventh, PERIOD_COUNT, b"a");
        assert_eq!(bucket_name(&seventh), None);
    }
}
