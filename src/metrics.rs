//! The server's counters, recorded on the hot path with relaxed atomics and
//! read by exporters (Prometheus, statsd). Hit counters are kept per
//! (rule label, status) in cells that outlive rule reloads, so Prometheus
//! counters never go backwards.

use crate::protocol::ErrorCode;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
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

/// Upper bounds of divvy's `divvy_hit_duration_seconds` buckets, in seconds.
pub const HIT_DURATION_BUCKETS_SECONDS: [f64; 6] = [0.001, 0.002, 0.005, 0.01, 0.1, 0.5];

#[derive(Debug, Default)]
pub struct Metrics {
    connections_open: AtomicI64,
    connections_refused: AtomicU64,
    errors: [AtomicU64; 2],
    labels: Mutex<HashMap<String, Arc<LabelCounters>>>,
    /// Counts per bucket of [`HIT_DURATION_BUCKETS_SECONDS`], plus one for +Inf.
    hit_duration_buckets: [AtomicU64; 7],
    hit_duration_sum_ns: AtomicU64,
    /// Requests a backend (Redis) could not decide: errors and timeouts.
    backend_errors: AtomicU64,
    /// Set while the backend is known to be unreachable (false by default, so
    /// backends that cannot fail read as healthy).
    backend_unavailable: AtomicBool,
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

    /// A backend request failed or timed out.
    pub fn backend_error(&self) {
        self.backend_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn backend_errors(&self) -> u64 {
        self.backend_errors.load(Ordering::Relaxed)
    }

    /// The backend's health as its client sees it (Redis connected or not).
    pub fn set_backend_healthy(&self, healthy: bool) {
        self.backend_unavailable.store(!healthy, Ordering::Relaxed);
    }

    pub fn backend_healthy(&self) -> bool {
        !self.backend_unavailable.load(Ordering::Relaxed)
    }
}
