//! The server's counters, recorded on the hot path with relaxed atomics and
//! read by exporters (Prometheus, statsd). Hit counters are kept per
//! (rule label, status) in cells that outlive rule reloads, so Prometheus
//! counters never go backwards. Nothing here formats or sends anything: the
//! exporters in [`crate::observability`] read these cells when they run, so
//! the cost on the request path is a few relaxed atomic additions (plus one
//! push onto a per-thread bounded queue per HIT while statsd is on). The
//! HIT duration histogram, recorded on every HIT, is kept in cells of one
//! thread each, added to without a locked instruction and summed when read.

use crate::protocol::ErrorCode;
use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The four outcomes divvy counts per evaluated rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HitStatus {
    Accepted,
    Rejected,
    CanaryAccepted,
    CanaryRejected,
}

impl HitStatus {
    pub const ALL: [HitStatus; 4] = [
        HitStatus::Accepted,
        HitStatus::Rejected,
        HitStatus::CanaryAccepted,
        HitStatus::CanaryRejected,
    ];

    pub fn new(allowed: bool, canary: bool) -> HitStatus {
        match (allowed, canary) {
            (true, false) => HitStatus::Accepted,
            (false, false) => HitStatus::Rejected,
            (true, true) => HitStatus::CanaryAccepted,
            (false, true) => HitStatus::CanaryRejected,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            HitStatus::Accepted => "accepted",
            HitStatus::Rejected => "rejected",
            HitStatus::CanaryAccepted => "canary-accepted",
            HitStatus::CanaryRejected => "canary-rejected",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Hit counts of one rule label, by status: shared cells, and cells of one
/// recording thread each ([`LabelCounters::cells_of_this_thread`]).
#[derive(Debug, Default)]
pub struct LabelCounters {
    by_status: [AtomicU64; 4],
    by_thread: Mutex<Vec<(std::thread::ThreadId, Arc<ThreadLabelCounts>)>>,
}

/// One thread's hit counts of a rule label, by status; only that thread
/// adds to them ([`Metrics::hit_evaluated_alone`]).
#[derive(Debug, Default)]
pub struct ThreadLabelCounts {
    by_status: [AtomicU64; 4],
}

impl LabelCounters {
    pub fn get(&self, status: HitStatus) -> u64 {
        let by_thread: u64 = self
            .by_thread
            .lock()
            .iter()
            .map(|(_, counts)| counts.by_status[status.index()].load(Ordering::Relaxed))
            .sum();
        self.by_status[status.index()].load(Ordering::Relaxed) + by_thread
    }

    /// This thread's cells of the label (made on its first call), for a
    /// thread that records many hits of it: a caller keeps them and counts
    /// with [`Metrics::hit_evaluated_alone`], no locked instruction.
    pub fn cells_of_this_thread(&self) -> Arc<ThreadLabelCounts> {
        cells_of_this_thread(&self.by_thread)
    }
}

/// This thread's cells in a list of cells by thread, added on its first
/// call.
fn cells_of_this_thread<T: Default>(
    by_thread: &Mutex<Vec<(std::thread::ThreadId, Arc<T>)>>,
) -> Arc<T> {
    let thread = std::thread::current().id();
    let mut by_thread = by_thread.lock();
    if let Some((_, mine)) = by_thread.iter().find(|(owner, _)| *owner == thread) {
        return Arc::clone(mine);
    }
    let mine = Arc::new(T::default());
    by_thread.push((thread, Arc::clone(&mine)));
    mine
}

/// Every error code, in the order of [`Metrics::errors`]' cells.
pub const ERROR_CODES: [ErrorCode; 2] = [ErrorCode::UnknownCommand, ErrorCode::Unknown];

/// Upper bounds of divvy's `divvy_hit_duration_seconds` buckets, in seconds.
pub const HIT_DURATION_BUCKETS_SECONDS: [f64; 6] = [0.001, 0.002, 0.005, 0.01, 0.1, 0.5];

/// The same bounds in nanoseconds (integers: no float work per HIT).
const HIT_DURATION_BUCKETS_NS: [u64; 6] = [
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    100_000_000,
    500_000_000,
];

/// Why statsd lines were dropped instead of sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsdDrop {
    /// A HIT's timing did not fit in the bounded queue to the sender thread.
    QueueFull,
    /// The sink refused, was unreachable, or was too slow to take a payload.
    SendFailed,
}

impl StatsdDrop {
    pub const ALL: [StatsdDrop; 2] = [StatsdDrop::QueueFull, StatsdDrop::SendFailed];

    pub fn as_str(self) -> &'static str {
        match self {
            StatsdDrop::QueueFull => "queue_full",
            StatsdDrop::SendFailed => "send_failed",
        }
    }
}

/// HIT durations on their way to the statsd sender. One bounded queue per
/// recording thread (threads take shards in turn on first use), so that the
/// serving cores never contend for a cache line here; a full shard drops the
/// timing and counts it in that shard.
#[derive(Debug)]
pub struct HitTimings {
    shards: Box<[CachePadded<TimingShard>]>,
}

#[derive(Debug)]
struct TimingShard {
    /// Durations in microseconds.
    queue: ArrayQueue<u32>,
    dropped: AtomicU64,
}

/// The shard number the next recording thread takes.
static NEXT_TIMING_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's shard number (before masking), `usize::MAX` until its
    /// first timing.
    static TIMING_SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn timing_shard_of_this_thread() -> usize {
    TIMING_SHARD.with(|shard| {
        if shard.get() == usize::MAX {
            shard.set(NEXT_TIMING_SHARD.fetch_add(1, Ordering::Relaxed) & (usize::MAX >> 1));
        }
        shard.get()
    })
}

impl HitTimings {
    /// `capacity` timings in all, split over `shards` queues (rounded up to
    /// a power of two).
    pub fn new(capacity: usize, shards: usize) -> HitTimings {
        let shards = shards.max(1).next_power_of_two();
        let per_shard = (capacity / shards).max(1);
        HitTimings {
            shards: (0..shards)
                .map(|_| {
                    CachePadded::new(TimingShard {
                        queue: ArrayQueue::new(per_shard),
                        dropped: AtomicU64::new(0),
                    })
                })
                .collect(),
        }
    }

    /// Queues one duration, or drops and counts it when this thread's shard
    /// is full. Never blocks.
    pub fn push(&self, micros: u32) {
        let shard = &self.shards[timing_shard_of_this_thread() & (self.shards.len() - 1)];
        // `is_full` first: a push into a full queue pays for a full fence.
        if shard.queue.is_full() || shard.queue.push(micros).is_err() {
            shard.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Timings queued now, over all shards.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.queue.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes at most what each shard holds when reached, so a flood of new
    /// timings cannot keep the caller here.
    pub fn drain(&self, mut take: impl FnMut(u32)) {
        for shard in self.shards.iter() {
            for _ in 0..shard.queue.len() {
                match shard.queue.pop() {
                    Some(micros) => take(micros),
                    None => break,
                }
            }
        }
    }

    /// Timings dropped because their shard was full, since start.
    pub fn dropped(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.dropped.load(Ordering::Relaxed))
            .sum()
    }
}

/// `divvy_hit_duration_seconds` as one thread counts it.
#[derive(Debug, Default)]
struct HitDurationCells {
    /// Counts per bucket of [`HIT_DURATION_BUCKETS_SECONDS`], plus one for +Inf.
    buckets: [AtomicU64; 7],
    sum_ns: AtomicU64,
}

/// Adds to a cell that only this thread writes: a plain load and store, not
/// an atomic read-modify-write (a locked instruction, about 6 ns here), and
/// readers on other threads still see whole values.
#[inline(always)]
fn add_alone(cell: &AtomicU64, n: u64) {
    cell.store(
        cell.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

/// Distinguishes [`HitDurationsByThread`] in threads' caches.
static NEXT_HIT_DURATIONS_ID: AtomicU64 = AtomicU64::new(0);

/// A histogram kept in one set of cells per recording thread, which only
/// that thread writes ([`add_alone`]); readers add up every thread's. A
/// thread finds its cells through a one-entry thread-local cache, and
/// registers new ones (under a lock, once per thread and histogram) when
/// the cache holds another histogram's.
#[derive(Debug)]
struct HitDurationsByThread {
    id: u64,
    cells: Mutex<Vec<(std::thread::ThreadId, Arc<HitDurationCells>)>>,
}

impl Default for HitDurationsByThread {
    fn default() -> Self {
        HitDurationsByThread {
            id: NEXT_HIT_DURATIONS_ID.fetch_add(1, Ordering::Relaxed),
            cells: Mutex::new(Vec::new()),
        }
    }
}

thread_local! {
    /// This thread's cells of the histogram it recorded in last, by id.
    static MY_HIT_DURATION_CELLS: Cell<Option<(u64, Arc<HitDurationCells>)>> =
        const { Cell::new(None) };
}

impl HitDurationsByThread {
    /// Calls `record` with this thread's cells.
    #[inline]
    fn with_mine(&self, record: impl FnOnce(&HitDurationCells)) {
        // (`try_with`: a thread's destructors may still record.)
        let cached = MY_HIT_DURATION_CELLS.try_with(Cell::take).ok().flatten();
        let mine = match cached {
            Some((id, cells)) if id == self.id => cells,
            _ => self.register(),
        };
        record(&mine);
        let _ = MY_HIT_DURATION_CELLS.try_with(|cell| cell.set(Some((self.id, mine))));
    }

    /// This thread's cells, made on its first record.
    #[cold]
    fn register(&self) -> Arc<HitDurationCells> {
        cells_of_this_thread(&self.cells)
    }

    fn for_each(&self, mut read: impl FnMut(&HitDurationCells)) {
        for (_, cells) in self.cells.lock().iter() {
            read(cells);
        }
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    connections_open: AtomicI64,
    connections_accepted: AtomicU64,
    connections_refused: AtomicU64,
    errors: [AtomicU64; 2],
    labels: Mutex<HashMap<String, Arc<LabelCounters>>>,
    /// `divvy_hit_duration_seconds`, in cells of one recording thread each.
    hit_durations: HitDurationsByThread,
    backend_errors: AtomicU64,
    /// Inverted so that the default (`false`) means healthy.
    backend_unhealthy: AtomicBool,
    /// Set once when statsd is enabled, absent otherwise.
    hit_timings: OnceLock<Arc<HitTimings>>,
    statsd_send_failed: AtomicU64,
    /// gRPC responses by method and status code (Envoy's rate limit service).
    grpc_responses: [[AtomicU64; GRPC_CODES]; 2],
    /// Requests of the line protocol and droplet's WebSocket, by protocol,
    /// in one cache line per recording thread.
    requests: [CachePadded<[AtomicU64; 2]>; REQUEST_SHARDS],
}

/// Cache lines the per-protocol request counts are spread over (threads
/// take them in turn, as they take statsd timing shards).
const REQUEST_SHARDS: usize = 16;

/// The wire protocols counted in `tollgate_requests_total` (gRPC calls are
/// counted by [`Metrics::grpc_response`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestProtocol {
    /// divvy's line protocol: every line read (`HIT`, `PEEK`, `TAKE`, …),
    /// refused ones included.
    Divvy,
    /// droplet's WebSocket: every data message read.
    Droplet,
}

/// gRPC status codes, 0 (`OK`) to 16 (`UNAUTHENTICATED`).
pub const GRPC_CODES: usize = 17;

/// The gRPC methods the server answers, as counted in
/// `tollgate_grpc_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcMethod {
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
    ShouldRateLimit,
    /// `grpc.health.v1.Health/Check` (`Watch` is not served).
    Health,
}

impl GrpcMethod {
    pub const ALL: [GrpcMethod; 2] = [GrpcMethod::ShouldRateLimit, GrpcMethod::Health];

    pub fn as_str(self) -> &'static str {
        match self {
            GrpcMethod::ShouldRateLimit => "ShouldRateLimit",
            GrpcMethod::Health => "Health",
        }
    }
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        Arc::new(Metrics::default())
    }

    /// The counters of a rule label (`""` for unlabelled rules); rules keep
    /// the returned cell so that recording a hit takes no lock.
    pub fn label_counters(&self, label: &str) -> Arc<LabelCounters> {
        self.labels
            .lock()
            .entry(label.to_owned())
            .or_default()
            .clone()
    }

    /// Every label seen so far with its counters, sorted by label.
    pub fn labels(&self) -> Vec<(String, Arc<LabelCounters>)> {
        let mut all: Vec<_> = self
            .labels
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    pub fn hit_evaluated(&self, counters: &LabelCounters, status: HitStatus) {
        counters.by_status[status.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// [`Metrics::hit_evaluated`] in cells that only this thread writes
    /// ([`LabelCounters::cells_of_this_thread`], taken on this thread).
    #[inline]
    pub fn hit_evaluated_alone(&self, counts: &ThreadLabelCounts, status: HitStatus) {
        add_alone(&counts.by_status[status.index()], 1);
    }

    pub fn hit_duration(&self, elapsed: Duration) {
        self.hit_duration_ns(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
    }

    /// [`Metrics::hit_duration`] in nanoseconds.
    #[inline]
    pub fn hit_duration_ns(&self, nanos: u64) {
        let bucket = HIT_DURATION_BUCKETS_NS
            .iter()
            .position(|&bound| nanos <= bound)
            .unwrap_or(HIT_DURATION_BUCKETS_NS.len());
        self.hit_durations.with_mine(|cells| {
            add_alone(&cells.buckets[bucket], 1);
            add_alone(&cells.sum_ns, nanos);
        });
        if let Some(timings) = self.hit_timings.get() {
            timings.push(u32::try_from(nanos / 1_000).unwrap_or(u32::MAX));
        }
    }

    /// Starts copying each HIT's duration into `timings`, for the statsd
    /// sender to drain. Returns `false` if some were already attached (the
    /// first stay).
    pub fn attach_hit_timings(&self, timings: Arc<HitTimings>) -> bool {
        self.hit_timings.set(timings).is_ok()
    }

    /// Non-cumulative counts per bucket (last is +Inf) and the sum in seconds.
    pub fn hit_durations(&self) -> ([u64; 7], f64) {
        let (mut counts, mut sum_ns) = ([0; 7], 0u64);
        self.hit_durations.for_each(|cells| {
            for (count, cell) in counts.iter_mut().zip(&cells.buckets) {
                *count += cell.load(Ordering::Relaxed);
            }
            sum_ns = sum_ns.wrapping_add(cells.sum_ns.load(Ordering::Relaxed));
        });
        (counts, sum_ns as f64 / 1e9)
    }

    /// A gRPC call of `method` ended with status `code` (0 to 16; larger
    /// codes, which no server should send, count as 2, `UNKNOWN`).
    pub fn grpc_response(&self, method: GrpcMethod, code: usize) {
        let code = if code < GRPC_CODES { code } else { 2 };
        self.grpc_responses[method as usize][code].fetch_add(1, Ordering::Relaxed);
    }

    /// gRPC calls of `method` that ended with status `code`, since start.
    pub fn grpc_responses(&self, method: GrpcMethod, code: usize) -> u64 {
        self.grpc_responses[method as usize]
            .get(code)
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    /// `count` requests of `protocol` were read (counted once per read batch
    /// by the caller: one relaxed addition to this thread's own cache line).
    pub fn requests_read(&self, protocol: RequestProtocol, count: u64) {
        let shard = timing_shard_of_this_thread() & (REQUEST_SHARDS - 1);
        self.requests[shard][protocol as usize].fetch_add(count, Ordering::Relaxed);
    }

    /// Requests of `protocol` read since start.
    pub fn requests(&self, protocol: RequestProtocol) -> u64 {
        self.requests
            .iter()
            .map(|shard| shard[protocol as usize].load(Ordering::Relaxed))
            .sum()
    }

    pub fn error(&self, code: ErrorCode) {
        self.errors[code as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn errors(&self, code: ErrorCode) -> u64 {
        self.errors[code as usize].load(Ordering::Relaxed)
    }

    pub fn connection_opened(&self) {
        self.connections_open.fetch_add(1, Ordering::Relaxed);
        self.connections_accepted.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections served since start (refused ones not included).
    pub fn connections_accepted(&self) -> u64 {
        self.connections_accepted.load(Ordering::Relaxed)
    }

    pub fn connection_closed(&self) {
        self.connections_open.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn connections_open(&self) -> i64 {
        self.connections_open.load(Ordering::Relaxed)
    }

    pub fn connection_refused(&self) {
        self.connections_refused.fetch_add(1, Ordering::Relaxed);
    }

    pub fn connections_refused(&self) -> u64 {
        self.connections_refused.load(Ordering::Relaxed)
    }

    /// A backend request failed (Redis error or timeout; the cluster's
    /// forwarding failures once it exists).
    pub fn backend_error(&self) {
        self.backend_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn backend_errors(&self) -> u64 {
        self.backend_errors.load(Ordering::Relaxed)
    }

    /// The backend says whether it can currently decide hits (Redis
    /// reachable). `/readyz` fails while it is unhealthy.
    pub fn set_backend_healthy(&self, healthy: bool) {
        self.backend_unhealthy.store(!healthy, Ordering::Relaxed);
    }

    pub fn backend_healthy(&self) -> bool {
        !self.backend_unhealthy.load(Ordering::Relaxed)
    }

    /// The statsd sink did not take `lines` lines.
    pub fn statsd_send_failed(&self, lines: u64) {
        self.statsd_send_failed.fetch_add(lines, Ordering::Relaxed);
    }

    /// Statsd lines dropped for `reason` since start.
    pub fn statsd_dropped_total(&self, reason: StatsdDrop) -> u64 {
        match reason {
            StatsdDrop::QueueFull => self.hit_timings.get().map_or(0, |t| t.dropped()),
            StatsdDrop::SendFailed => self.statsd_send_failed.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_buckets_in_nanoseconds_are_the_seconds_buckets() {
        for (seconds, nanos) in HIT_DURATION_BUCKETS_SECONDS
            .iter()
            .zip(HIT_DURATION_BUCKETS_NS)
        {
            assert_eq!((seconds * 1e9).round() as u64, nanos);
        }
        let metrics = Metrics::new();
        metrics.hit_duration(Duration::from_millis(1));
        metrics.hit_duration(Duration::from_nanos(1_000_001));
        metrics.hit_duration(Duration::from_secs(1));
        assert_eq!(metrics.hit_durations().0, [1, 1, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn timings_are_bounded_and_every_drop_is_counted() {
        let timings = Arc::new(HitTimings::new(8, 2));
        std::thread::scope(|scope| {
            for thread in 0..2u32 {
                let timings = &timings;
                scope.spawn(move || (0..6).for_each(|i| timings.push(thread * 100 + i)));
            }
        });
        // Two shards of 4; which thread lands on which shard depends on the
        // other threads of the process, so only the totals are fixed.
        assert!(timings.len() <= 8);
        assert_eq!(timings.len() as u64 + timings.dropped(), 12);
        let mut drained = Vec::new();
        timings.drain(|micros| drained.push(micros));
        assert_eq!(drained.len() as u64 + timings.dropped(), 12);
        // Within a thread, the first timings are kept and the overflow dropped.
        for thread in 0..2u32 {
            let kept: Vec<u32> = drained
                .iter()
                .copied()
                .filter(|m| m / 100 == thread)
                .collect();
            let expected: Vec<u32> = (0..kept.len() as u32).map(|i| thread * 100 + i).collect();
            assert_eq!(kept, expected);
        }
        assert!(timings.is_empty());
    }

    #[test]
    fn request_counts_add_up_over_threads_by_protocol() {
        let metrics = Metrics::new();
        std::thread::scope(|scope| {
            for _ in 0..(REQUEST_SHARDS + 3) {
                let metrics = &metrics;
                scope.spawn(move || {
                    metrics.requests_read(RequestProtocol::Divvy, 32);
                    metrics.requests_read(RequestProtocol::Droplet, 1);
                });
            }
        });
        let threads = REQUEST_SHARDS as u64 + 3;
        assert_eq!(metrics.requests(RequestProtocol::Divvy), 32 * threads);
        assert_eq!(metrics.requests(RequestProtocol::Droplet), threads);
    }

    #[test]
    fn label_counts_add_up_over_shared_and_per_thread_cells() {
        let metrics = Metrics::new();
        let counters = metrics.label_counters("cookies");
        std::thread::scope(|scope| {
            for _ in 0..3 {
                let (metrics, counters) = (&metrics, &counters);
                scope.spawn(move || {
                    let mine = counters.cells_of_this_thread();
                    assert!(Arc::ptr_eq(&mine, &counters.cells_of_this_thread()));
                    for _ in 0..10 {
                        metrics.hit_evaluated_alone(&mine, HitStatus::Accepted);
                    }
                    metrics.hit_evaluated(counters, HitStatus::Rejected);
                    metrics.hit_evaluated(counters, HitStatus::Accepted);
                });
            }
        });
        // The label's counters outlive the threads that counted.
        let counters = metrics.label_counters("cookies");
        assert_eq!(counters.get(HitStatus::Accepted), 33);
        assert_eq!(counters.get(HitStatus::Rejected), 3);
        assert_eq!(counters.get(HitStatus::CanaryAccepted), 0);
    }

    #[test]
    fn hit_durations_add_up_over_threads_and_histograms() {
        let (first, second) = (Metrics::new(), Metrics::new());
        std::thread::scope(|scope| {
            for thread in 0..4u64 {
                let (first, second) = (&first, &second);
                scope.spawn(move || {
                    // Alternating histograms: each registers this thread's
                    // cells once and finds them again.
                    for i in 0..100 {
                        first.hit_duration_ns(1_500_000);
                        if i % 10 == 0 {
                            second.hit_duration_ns(thread);
                        }
                    }
                });
            }
        });
        let (counts, sum) = first.hit_durations();
        assert_eq!(counts, [0, 400, 0, 0, 0, 0, 0]);
        assert!((sum - 0.6).abs() < 1e-9, "{sum}");
        let (counts, sum) = second.hit_durations();
        assert_eq!(counts, [40, 0, 0, 0, 0, 0, 0]);
        assert!((sum - 60e-9).abs() < 1e-15, "{sum}");
        assert_eq!(first.hit_durations.cells.lock().len(), 4);
    }

    #[test]
    fn hit_durations_reach_attached_timings_and_the_histogram() {
        let metrics = Metrics::new();
        metrics.hit_duration(Duration::from_micros(1_500));
        let timings = Arc::new(HitTimings::new(4, 1));
        assert!(metrics.attach_hit_timings(Arc::clone(&timings)));
        assert!(!metrics.attach_hit_timings(Arc::new(HitTimings::new(4, 1))));
        metrics.hit_duration(Duration::from_micros(250));
        let mut drained = Vec::new();
        timings.drain(|micros| drained.push(micros));
        assert_eq!(drained, [250], "only durations after attaching");
        let (counts, _) = metrics.hit_durations();
        assert_eq!(counts, [1, 1, 0, 0, 0, 0, 0]);
        assert_eq!(metrics.statsd_dropped_total(StatsdDrop::QueueFull), 0);
    }
}
