//! The server's counters, recorded on the hot path with relaxed atomics and
//! read by exporters (Prometheus, statsd). Hit counters are kept per
//! (rule label, status) in cells that outlive rule reloads, so Prometheus
//! counters never go backwards. Nothing here formats or sends anything: the
//! exporters in [`crate::observability`] read these cells when they run, so
//! the cost on the request path is a few uncontended atomic additions (plus
//! one bounded-queue push per HIT while statsd timers are enabled).

use crate::protocol::ErrorCode;
use crossbeam_queue::ArrayQueue;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
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

/// Hit counts of one rule label, by status.
#[derive(Debug, Default)]
pub struct LabelCounters {
    by_status: [AtomicU64; 4],
}

impl LabelCounters {
    pub fn get(&self, status: HitStatus) -> u64 {
        self.by_status[status.index()].load(Ordering::Relaxed)
    }
}

/// Every error code, in the order of [`Metrics::errors`]' cells.
pub const ERROR_CODES: [ErrorCode; 2] = [ErrorCode::UnknownCommand, ErrorCode::Unknown];

/// Upper bounds of divvy's `divvy_hit_duration_seconds` buckets, in seconds.
pub const HIT_DURATION_BUCKETS_SECONDS: [f64; 6] = [0.001, 0.002, 0.005, 0.01, 0.1, 0.5];

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

#[derive(Debug, Default)]
pub struct Metrics {
    connections_open: AtomicI64,
    connections_accepted: AtomicU64,
    connections_refused: AtomicU64,
    errors: [AtomicU64; 2],
    labels: Mutex<HashMap<String, Arc<LabelCounters>>>,
    /// Counts per bucket of [`HIT_DURATION_BUCKETS_SECONDS`], plus one for +Inf.
    hit_duration_buckets: [AtomicU64; 7],
    hit_duration_sum_ns: AtomicU64,
    backend_errors: AtomicU64,
    /// Inverted so that the default (`false`) means healthy.
    backend_unhealthy: AtomicBool,
    /// HIT durations in microseconds on their way to the statsd sender;
    /// set once when statsd is enabled, absent otherwise.
    hit_timings: OnceLock<Arc<ArrayQueue<u32>>>,
    /// Indexed like [`StatsdDrop::ALL`].
    statsd_dropped: [AtomicU64; 2],
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

    pub fn hit_duration(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        let bucket = HIT_DURATION_BUCKETS_SECONDS
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(HIT_DURATION_BUCKETS_SECONDS.len());
        self.hit_duration_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.hit_duration_sum_ns
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        if let Some(timings) = self.hit_timings.get() {
            let micros = u32::try_from(elapsed.as_micros()).unwrap_or(u32::MAX);
            if timings.push(micros).is_err() {
                self.statsd_dropped(StatsdDrop::QueueFull, 1);
            }
        }
    }

    /// Starts copying each HIT's duration (in microseconds) into `queue`, for
    /// the statsd sender to drain. Returns `false` if a queue was already
    /// attached (the first one stays).
    pub fn attach_hit_timings(&self, queue: Arc<ArrayQueue<u32>>) -> bool {
        self.hit_timings.set(queue).is_ok()
    }

    /// Non-cumulative counts per bucket (last is +Inf) and the sum in seconds.
    pub fn hit_durations(&self) -> ([u64; 7], f64) {
        let counts = std::array::from_fn(|i| self.hit_duration_buckets[i].load(Ordering::Relaxed));
        let sum = self.hit_duration_sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (counts, sum)
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

    pub fn statsd_dropped(&self, reason: StatsdDrop, lines: u64) {
        self.statsd_dropped[reason as usize].fetch_add(lines, Ordering::Relaxed);
    }

    /// Statsd lines dropped for `reason` since start.
    pub fn statsd_dropped_total(&self, reason: StatsdDrop) -> u64 {
        self.statsd_dropped[reason as usize].load(Ordering::Relaxed)
    }
}
