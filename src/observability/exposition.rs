//! The Prometheus exposition: divvy's four series under their exact names,
//! labels, help texts and buckets, plus Tollgate's own `tollgate_` series.
//! Values are read from [`Metrics`] (and the stores) at scrape time by
//! a custom [`Collector`]; the `prometheus` crate's [`Registry`] sorts and
//! validates them and its [`TextEncoder`] writes the classic text format
//! 0.0.4, the format of divvy's prom-client. Nothing is recorded here.
//!
//! No series is ever labelled with a user key or an actor value: the only
//! label values are hit statuses, rule labels (from the configuration), error
//! codes, the backend's name, the drop reason and the version.

use super::health::Readiness;
use crate::cluster::{ClusterSnapshot, ShardSnapshot};
use crate::droplet::Buckets;
use crate::engine::Engine;
use crate::metrics::{
    GrpcMethod, HitStatus, Metrics, RequestProtocol, StatsdDrop, ERROR_CODES, GRPC_CODES,
    HIT_DURATION_BUCKETS_SECONDS,
};
use crate::store::MemoryStore;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, Registry, TextEncoder};
use std::collections::HashMap;
use std::sync::Arc;

/// The content type of the text format, as prom-client (divvy's) and
/// docs/observability.md give it; the prometheus crate's `TEXT_FORMAT`
/// lacks the charset.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("cannot describe metric {name}: {source}")]
    Describe {
        name: &'static str,
        source: prometheus::Error,
    },
    #[error("cannot register the metrics collector: {0}")]
    Register(prometheus::Error),
    #[error("cannot encode metrics: {0}")]
    Encode(prometheus::Error),
}

/// What a scrape reads.
pub struct ExportSources {
    pub engine: Arc<Engine>,
    /// The in-memory store, for its live keys and sweeps (absent in Redis
    /// mode, where counters live elsewhere).
    pub store: Option<Arc<MemoryStore>>,
    /// The droplet token buckets, when the server keeps them.
    pub buckets: Option<Arc<Buckets>>,
    /// Says whether the backend can decide hits (`tollgate_backend_healthy`).
    pub readiness: Arc<Readiness>,
    /// The cluster's data-path counters, in cluster mode.
    pub cluster: Option<ClusterSource>,
}

/// Reads a cluster node's data-path counters at scrape time.
pub type ClusterSource = Arc<dyn Fn() -> ClusterSnapshot + Send + Sync>;

/// Renders the exposition text on demand.
pub struct PrometheusExporter {
    registry: Registry,
}

impl PrometheusExporter {
    pub fn new(sources: ExportSources) -> Result<PrometheusExporter, ExportError> {
        let registry = Registry::new();
        registry
            .register(Box::new(ServerCollector::new(sources)?))
            .map_err(ExportError::Register)?;
        Ok(PrometheusExporter { registry })
    }

    /// The exposition text of every series, in the text format 0.0.4.
    pub fn render(&self) -> Result<Vec<u8>, ExportError> {
        let mut out = Vec::with_capacity(4096);
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .map_err(ExportError::Encode)?;
        Ok(out)
    }
}

/// One exported family: its name, help and type, and its label names.
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    labels: &'static [&'static str],
}

const DIVVY_CONNECTIONS: Family = Family {
    name: "divvy_tcp_connections_total",
    help: "Total number of open TCP connections to Divvy.",
    kind: MetricType::GAUGE,
    labels: &[],
};
const DIVVY_HIT_DURATION: Family = Family {
    name: "divvy_hit_duration_seconds",
    help: "Histogram of Divvy processing time for HITs.",
    kind: MetricType::HISTOGRAM,
    labels: &[],
};
const DIVVY_HITS: Family = Family {
    name: "divvy_hits_total",
    help: "Counter of total HITs to Divvy.",
    kind: MetricType::COUNTER,
    labels: &["status", "rule_label"],
};
const DIVVY_ERRORS: Family = Family {
    name: "divvy_errors_total",
    help: "Counter of total Divvy errors.",
    kind: MetricType::COUNTER,
    labels: &["code"],
};
const GRPC_REQUESTS: Family = Family {
    name: "tollgate_grpc_requests_total",
    help: "gRPC calls answered (Envoy's rate limit service, --grpc-listen), by method and gRPC status code.",
    kind: MetricType::COUNTER,
    labels: &["method", "code"],
};
const REQUESTS: Family = Family {
    name: "tollgate_requests_total",
    help: "Requests read, by wire protocol: divvy (line protocol lines), droplet (WebSocket messages), envoy (ShouldRateLimit calls).",
    kind: MetricType::COUNTER,
    labels: &["protocol"],
};
const BUILD_INFO: Family = Family {
    name: "tollgate_build_info",
    help: "Always 1; the version label says which Tollgate is running.",
    kind: MetricType::GAUGE,
    labels: &["version"],
};
const RULES: Family = Family {
    name: "tollgate_rules",
    help: "Rules in the loaded configuration.",
    kind: MetricType::GAUGE,
    labels: &[],
};
const CONNECTIONS_ACCEPTED: Family = Family {
    name: "tollgate_connections_accepted_total",
    help: "Client connections accepted and served since start.",
    kind: MetricType::COUNTER,
    labels: &[],
};
const CONNECTIONS_REFUSED: Family = Family {
    name: "tollgate_connections_refused_total",
    help: "Client connections refused because the connection limit was reached.",
    kind: MetricType::COUNTER,
    labels: &[],
};
const LIVE_KEYS: Family = Family {
    name: "tollgate_live_keys",
    help: "Counters held in memory (expired ones not yet swept included).",
    kind: MetricType::GAUGE,
    labels: &[],
};
const LIVE_KEYS_MAX: Family = Family {
    name: "tollgate_live_keys_max",
    help: "The cap on counters held in memory.",
    kind: MetricType::GAUGE,
    labels: &[],
};
const SWEEPS: Family = Family {
    name: "tollgate_sweeps_total",
    help: "Sweeper ticks run over the in-memory counters.",
    kind: MetricType::COUNTER,
    labels: &[],
};
const SWEPT_KEYS: Family = Family {
    name: "tollgate_swept_keys_total",
    help: "Expired counters reclaimed from memory.",
    kind: MetricType::COUNTER,
    labels: &[],
};
const DROPLET_BUCKETS: Family = Family {
    name: "tollgate_droplet_buckets",
    help: "Droplet token buckets held in memory (forgotten ones not yet reclaimed included).",
    kind: MetricType::GAUGE,
    labels: &[],
};
const BACKEND_ERRORS: Family = Family {
    name: "tollgate_backend_errors_total",
    help: "Backend requests that failed (error or timeout).",
    kind: MetricType::COUNTER,
    labels: &["backend"],
};
const BACKEND_HEALTHY: Family = Family {
    name: "tollgate_backend_healthy",
    help: "1 while the backend can decide hits, 0 while it cannot.",
    kind: MetricType::GAUGE,
    labels: &["backend"],
};
const STATSD_DROPPED: Family = Family {
    name: "tollgate_statsd_dropped_total",
    help: "Statsd lines dropped instead of sent, by reason.",
    kind: MetricType::COUNTER,
    labels: &["reason"],
};

/// A cluster node's counters: `(family, value)`.
fn cluster_counters(snapshot: &ClusterSnapshot) -> [(&'static Family, u64); 14] {
    let s = &snapshot.stats;
    [
        (&CLUSTER_ROUNDS, s.rounds),
        (&CLUSTER_ROUND_SECTIONS, s.round_sections),
        (&CLUSTER_STATES_REPLICATED, s.states_replicated),
        (&CLUSTER_SECTIONS_COMMITTED, s.sections_committed),
        (&CLUSTER_SECTIONS_FAILED, s.sections_failed),
        (&CLUSTER_STATES_APPLIED, s.states_applied),
        (&CLUSTER_STATES_REFUSED, s.states_refused),
        (&CLUSTER_FORWARD_BATCHES, s.forward_batches),
        (&CLUSTER_FORWARDED_HITS, s.forwarded_ops),
        (&CLUSTER_FORWARDS_DECIDED, s.forwards_decided),
        (&CLUSTER_PEER_WRITES, s.writes),
        (&CLUSTER_PEER_FRAMES, s.frames_written),
        (&CLUSTER_PEER_BYTES, s.bytes_written),
        (&CLUSTER_HANDSHAKES_REFUSED, s.handshakes_refused),
    ]
}

/// A cluster family, unlabelled or with the labels given last.
macro_rules! cluster_family {
    ($id:ident, $name:literal, $kind:expr, $help:literal) => {
        cluster_family!($id, $name, $kind, $help, []);
    };
    ($id:ident, $name:literal, $kind:expr, $help:literal, [$($label:literal),*]) => {
        const $id: Family = Family {
            name: $name,
            help: $help,
            kind: $kind,
            labels: &[$($label),*],
        };
    };
}
cluster_family!(
    CLUSTER_ROUNDS,
    "tollgate_cluster_rounds_total",
    MetricType::COUNTER,
    "Replication rounds this node sent as a leader (one frame section per shard and peer)."
);
cluster_family!(
    CLUSTER_ROUND_SECTIONS,
    "tollgate_cluster_round_sections_total",
    MetricType::COUNTER,
    "Shard sections of those rounds."
);
cluster_family!(
    CLUSTER_STATES_REPLICATED,
    "tollgate_cluster_states_replicated_total",
    MetricType::COUNTER,
    "Counter states those rounds carried (one per admitted hit, less those merged in a round)."
);
cluster_family!(
    CLUSTER_SECTIONS_COMMITTED,
    "tollgate_cluster_sections_committed_total",
    MetricType::COUNTER,
    "Round sections held by a majority of their shard's replicas."
);
cluster_family!(CLUSTER_SECTIONS_FAILED, "tollgate_cluster_sections_failed_total", MetricType::COUNTER,
    "Round sections that did not commit (superseded by a newer leader, replicas unreachable, timed out).");
cluster_family!(
    CLUSTER_STATES_APPLIED,
    "tollgate_cluster_states_applied_total",
    MetricType::COUNTER,
    "Counter states applied here as a follower (rounds and syncs)."
);
cluster_family!(
    CLUSTER_STATES_REFUSED,
    "tollgate_cluster_states_refused_total",
    MetricType::COUNTER,
    "Counter states refused here (from a leader of an older term, or for a shard not held here)."
);
cluster_family!(
    CLUSTER_FORWARD_BATCHES,
    "tollgate_cluster_forward_batches_total",
    MetricType::COUNTER,
    "Batches of hits this node forwarded to shard leaders (one per peer per connection read)."
);
cluster_family!(
    CLUSTER_FORWARDED_HITS,
    "tollgate_cluster_forwarded_hits_total",
    MetricType::COUNTER,
    "Hits in those batches."
);
cluster_family!(
    CLUSTER_FORWARDS_DECIDED,
    "tollgate_cluster_forwards_decided_total",
    MetricType::COUNTER,
    "Hits other nodes forwarded that this node decided as their shard's leader."
);
cluster_family!(
    CLUSTER_PEER_WRITES,
    "tollgate_cluster_peer_writes_total",
    MetricType::COUNTER,
    "Writes (system calls) to peer connections."
);
cluster_family!(
    CLUSTER_HANDSHAKES_REFUSED,
    "tollgate_cluster_peer_handshakes_refused_total",
    MetricType::COUNTER,
    "Peer connections closed unanswered because too many handshakes were in progress."
);
cluster_family!(
    CLUSTER_VERSION_REFUSALS,
    "tollgate_cluster_peer_version_refusals_total",
    MetricType::COUNTER,
    "Peer handshakes refused, by this node or by the peer it dialed, because their peer protocol versions are incompatible."
);
cluster_family!(
    CLUSTER_ROUND_ANSWERS,
    "tollgate_cluster_round_answers_total",
    MetricType::COUNTER,
    "Forwarded hits this node, as their shard's leader, answered in the frame carrying their round to the replica that forwarded them (strict mode; that replica answers once it applied the round)."
);
cluster_family!(
    CLUSTER_ANSWERS_RELAYED,
    "tollgate_cluster_relayed_answers_total",
    MetricType::COUNTER,
    "Answers to forwarded hits this node, as a follower, sent on for their shard's leader to the node that forwarded them (strict mode, a node that holds no replica of the shard; peer protocol 2.4), once it applied their round."
);
cluster_family!(
    CLUSTER_BATCH_ANSWERS,
    "tollgate_cluster_batch_answers_total",
    MetricType::COUNTER,
    "Forwarded hits this node, as their shard's leader, answered at once in a section of their forwarded batch's own (peer protocol 2.2; to a peer of 2.1 or older they go in one answers section per frame)."
);
cluster_family!(
    CLUSTER_DENIALS_REMEMBERED,
    "tollgate_cluster_denials_remembered_total",
    MetricType::COUNTER,
    "Hits this node answered false itself, from a denial their counter's leader gave a hit it forwarded earlier in the same window, instead of forwarding them (fixed windows)."
);
cluster_family!(
    CLUSTER_LEASE_HITS,
    "tollgate_cluster_lease_hits_total",
    MetricType::COUNTER,
    "Hits this node admitted itself from a quota lease their counter's leader granted it, instead of forwarding them (fixed windows)."
);
cluster_family!(
    CLUSTER_LEASES_GRANTED,
    "tollgate_cluster_leases_granted_total",
    MetricType::COUNTER,
    "Quota leases this node, as a shard's leader, granted beside forwarded hits."
);
cluster_family!(
    CLUSTER_LEASE_CREDITS_GRANTED,
    "tollgate_cluster_lease_credits_granted_total",
    MetricType::COUNTER,
    "Credits of the quota leases this node granted, counted as used in their counters' windows when granted."
);
cluster_family!(
    CLUSTER_DATA_DIR_WRITE_ERRORS,
    "tollgate_cluster_data_dir_write_errors_total",
    MetricType::COUNTER,
    "Writes and syncs of the data dir that failed (counter log, meta.log, snapshots)."
);
cluster_family!(
    CLUSTER_PEER_FRAMES,
    "tollgate_cluster_peer_frames_total",
    MetricType::COUNTER,
    "Frames those writes carried (data and control)."
);
cluster_family!(
    CLUSTER_PEER_BYTES,
    "tollgate_cluster_peer_bytes_total",
    MetricType::COUNTER,
    "Bytes written to peer connections."
);
cluster_family!(
    CLUSTER_SHARDS_LED,
    "tollgate_cluster_shards_led",
    MetricType::GAUGE,
    "Shards this node leads and decides."
);
cluster_family!(CLUSTER_SHARDS_UNSERVABLE, "tollgate_cluster_shards_unservable", MetricType::GAUGE,
    "Shards a hit sent to this node could not be decided for now (no leader, or the leader unreachable).");

// Families with one series per shard this node holds a replica of.
cluster_family!(
    SHARD_LEADER,
    "tollgate_cluster_shard_leader",
    MetricType::GAUGE,
    "1 while this node leads the shard and decides its hits, 0 while it is a follower.",
    ["shard"]
);
cluster_family!(
    SHARD_TERM,
    "tollgate_cluster_shard_term",
    MetricType::GAUGE,
    "The highest term this replica promised or applied states from.",
    ["shard"]
);
cluster_family!(SHARD_SECTIONS, "tollgate_cluster_shard_round_sections_total", MetricType::COUNTER,
    "Round sections this node sent for the shard as its leader (one per round with states of the shard).", ["shard"]);
cluster_family!(SHARD_STATES, "tollgate_cluster_shard_states_replicated_total", MetricType::COUNTER,
    "Counter states those sections carried: states divided by sections is hits per replication entry.", ["shard"]);
cluster_family!(SHARD_IN_FLIGHT, "tollgate_cluster_shard_sections_in_flight", MetricType::GAUGE,
    "Sections this node sent for the shard as its leader that are not yet committed or failed (the commit lag).", ["shard"]);
cluster_family!(
    SHARD_MOVING,
    "tollgate_cluster_shard_moving",
    MetricType::GAUGE,
    "1 while a move of the shard (led here) is under way.",
    ["shard"]
);

/// The per-shard families and each one's value for a shard.
type ShardValue = fn(&ShardSnapshot) -> f64;
const SHARD_FAMILIES: [(&Family, ShardValue); 6] = [
    (&SHARD_LEADER, |s| f64::from(u8::from(s.leading))),
    (&SHARD_TERM, |s| s.term as f64),
    (&SHARD_SECTIONS, |s| s.sections_sent as f64),
    (&SHARD_STATES, |s| s.states_sent as f64),
    (&SHARD_IN_FLIGHT, |s| s.sections_in_flight as f64),
    (&SHARD_MOVING, |s| f64::from(u8::from(s.moving))),
];

/// One family per per-shard measure, one series per shard held here.
fn shard_families(shards: &[ShardSnapshot]) -> impl Iterator<Item = MetricFamily> + '_ {
    SHARD_FAMILIES.iter().map(move |&(of, value)| {
        let samples = shards
            .iter()
            .map(|shard| {
                let label = shard.shard.to_string();
                if of.kind == MetricType::COUNTER {
                    counter(of, &[&label], value(shard) as u64)
                } else {
                    gauge(of, &[&label], value(shard))
                }
            })
            .collect();
        family(of, samples)
    })
}

const FAMILIES: [&Family; 40] = [
    &SHARD_LEADER,
    &SHARD_TERM,
    &SHARD_SECTIONS,
    &SHARD_STATES,
    &SHARD_IN_FLIGHT,
    &SHARD_MOVING,
    &CLUSTER_ROUNDS,
    &CLUSTER_ROUND_SECTIONS,
    &CLUSTER_STATES_REPLICATED,
    &CLUSTER_SECTIONS_COMMITTED,
    &CLUSTER_SECTIONS_FAILED,
    &CLUSTER_STATES_APPLIED,
    &CLUSTER_STATES_REFUSED,
    &CLUSTER_FORWARD_BATCHES,
    &CLUSTER_FORWARDED_HITS,
    &CLUSTER_FORWARDS_DECIDED,
    &CLUSTER_PEER_WRITES,
    &CLUSTER_PEER_FRAMES,
    &CLUSTER_PEER_BYTES,
    &CLUSTER_HANDSHAKES_REFUSED,
    &CLUSTER_SHARDS_LED,
    &CLUSTER_SHARDS_UNSERVABLE,
    &DIVVY_CONNECTIONS,
    &DIVVY_HIT_DURATION,
    &DIVVY_HITS,
    &DIVVY_ERRORS,
    &BUILD_INFO,
    &RULES,
    &CONNECTIONS_ACCEPTED,
    &CONNECTIONS_REFUSED,
    &LIVE_KEYS,
    &LIVE_KEYS_MAX,
    &SWEEPS,
    &SWEPT_KEYS,
    &DROPLET_BUCKETS,
    &REQUESTS,
    &BACKEND_ERRORS,
    &BACKEND_HEALTHY,
    &STATSD_DROPPED,
    &GRPC_REQUESTS,
];

struct ServerCollector {
    sources: ExportSources,
    descs: Vec<Desc>,
}

impl ServerCollector {
    fn new(sources: ExportSources) -> Result<ServerCollector, ExportError> {
        let descs = FAMILIES
            .iter()
            .map(|family| {
                Desc::new(
                    family.name.to_owned(),
                    family.help.to_owned(),
                    family.labels.iter().map(|l| (*l).to_owned()).collect(),
                    HashMap::new(),
                )
                .map_err(|source| ExportError::Describe {
                    name: family.name,
                    source,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(ServerCollector { sources, descs })
    }

    fn metrics(&self) -> &Metrics {
        &self.sources.engine.metrics
    }
}

impl Collector for ServerCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let metrics = self.metrics();
        let engine = &self.sources.engine;
        let backend = engine.backend().name();
        let errors = ERROR_CODES
            .iter()
            .map(|&code| (code.as_str(), metrics.errors(code)))
            .filter(|&(_, count)| count > 0)
            .map(|(code, count)| counter(&DIVVY_ERRORS, &[code], count))
            .collect();
        let statsd_dropped = StatsdDrop::ALL
            .iter()
            .map(|&reason| {
                let dropped = metrics.statsd_dropped_total(reason);
                counter(&STATSD_DROPPED, &[reason.as_str()], dropped)
            })
            .collect();
        let healthy = f64::from(u8::from(self.sources.readiness.backend_health().is_ok()));
        let mut out = vec![
            plain_gauge(&DIVVY_CONNECTIONS, metrics.connections_open() as f64),
            family(&DIVVY_HIT_DURATION, vec![hit_duration(metrics)]),
            family(&DIVVY_HITS, hits(metrics)),
            family(&DIVVY_ERRORS, errors),
            family(
                &BUILD_INFO,
                vec![gauge(&BUILD_INFO, &[env!("CARGO_PKG_VERSION")], 1.0)],
            ),
            plain_gauge(&RULES, engine.rules().set.rules().len() as f64),
            plain_counter(&CONNECTIONS_ACCEPTED, metrics.connections_accepted()),
            plain_counter(&CONNECTIONS_REFUSED, metrics.connections_refused()),
            family(
                &BACKEND_ERRORS,
                vec![counter(
                    &BACKEND_ERRORS,
                    &[backend],
                    metrics.backend_errors(),
                )],
            ),
            family(
                &BACKEND_HEALTHY,
                vec![gauge(&BACKEND_HEALTHY, &[backend], healthy)],
            ),
            family(&STATSD_DROPPED, statsd_dropped),
            family(&GRPC_REQUESTS, grpc_requests(metrics)),
            family(&REQUESTS, requests(metrics)),
        ];
        if let Some(store) = &self.sources.store {
            use std::sync::atomic::Ordering::Relaxed;
            out.extend([
                plain_gauge(&LIVE_KEYS, store.live_keys() as f64),
                plain_gauge(&LIVE_KEYS_MAX, store.live_keys_max() as f64),
                plain_counter(&SWEEPS, store.sweep_stats.sweeps.load(Relaxed)),
                plain_counter(&SWEPT_KEYS, store.sweep_stats.reclaimed.load(Relaxed)),
            ]);
        }
        if let Some(buckets) = &self.sources.buckets {
            out.push(plain_gauge(&DROPLET_BUCKETS, buckets.len() as f64));
        }
        if let Some(cluster) = &self.sources.cluster {
            let snapshot = cluster();
            for (family, value) in cluster_counters(&snapshot) {
                out.push(plain_counter(family, value));
            }
            out.push(plain_gauge(&CLUSTER_SHARDS_LED, snapshot.shards_led as f64));
            out.push(plain_gauge(
                &CLUSTER_SHARDS_UNSERVABLE,
                snapshot.shards_unservable as f64,
            ));
            out.extend(shard_families(&snapshot.shards));
            out.push(plain_counter(
                &CLUSTER_VERSION_REFUSALS,
                snapshot.peer_version_refusals,
            ));
            out.push(plain_counter(
                &CLUSTER_ROUND_ANSWERS,
                snapshot.round_answers,
            ));
            out.push(plain_counter(
                &CLUSTER_BATCH_ANSWERS,
                snapshot.batch_answers,
            ));
            out.push(plain_counter(
                &CLUSTER_ANSWERS_RELAYED,
                snapshot.answers_relayed,
            ));
            out.push(plain_counter(
                &CLUSTER_DENIALS_REMEMBERED,
                snapshot.denials_remembered,
            ));
            out.push(plain_counter(&CLUSTER_LEASE_HITS, snapshot.lease_hits));
            out.push(plain_counter(
                &CLUSTER_LEASES_GRANTED,
                snapshot.leases_granted,
            ));
            out.push(plain_counter(
                &CLUSTER_LEASE_CREDITS_GRANTED,
                snapshot.lease_credits_granted,
            ));
            if let Some(errors) = snapshot.data_dir_write_errors {
                out.push(plain_counter(&CLUSTER_DATA_DIR_WRITE_ERRORS, errors));
            }
        }
        out
    }
}

/// One sample per (status, label) that has counted at least one hit, as
/// prom-client showed a labelled series only once it was incremented.
fn hits(metrics: &Metrics) -> Vec<Metric> {
    let mut samples = Vec::new();
    for (label, counters) in metrics.labels() {
        for status in HitStatus::ALL {
            let count = counters.get(status);
            if count > 0 {
                samples.push(counter(&DIVVY_HITS, &[status.as_str(), &label], count));
            }
        }
    }
    samples
}

/// One sample per protocol, zeros included. Envoy's calls are the
/// `ShouldRateLimit` calls of `tollgate_grpc_requests_total`, every code.
fn requests(metrics: &Metrics) -> Vec<Metric> {
    let envoy = (0..GRPC_CODES)
        .map(|code| metrics.grpc_responses(GrpcMethod::ShouldRateLimit, code))
        .sum();
    [
        ("divvy", metrics.requests(RequestProtocol::Divvy)),
        ("droplet", metrics.requests(RequestProtocol::Droplet)),
        ("envoy", envoy),
    ]
    .into_iter()
    .map(|(protocol, count)| counter(&REQUESTS, &[protocol], count))
    .collect()
}

/// One sample per (method, code) that has counted at least one call.
fn grpc_requests(metrics: &Metrics) -> Vec<Metric> {
    let mut samples = Vec::new();
    for method in GrpcMethod::ALL {
        for (code, name) in GRPC_CODE_NAMES.iter().enumerate() {
            let count = metrics.grpc_responses(method, code);
            if count > 0 {
                samples.push(counter(&GRPC_REQUESTS, &[method.as_str(), name], count));
            }
        }
    }
    samples
}

/// gRPC status codes by number, as the gRPC specification names them.
const GRPC_CODE_NAMES: [&str; GRPC_CODES] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

fn hit_duration(metrics: &Metrics) -> Metric {
    let (counts, sum_seconds) = metrics.hit_durations();
    let mut cumulative = 0;
    let buckets = HIT_DURATION_BUCKETS_SECONDS
        .iter()
        .zip(counts)
        .map(|(&upper_bound, count)| {
            cumulative += count;
            let mut bucket = Bucket::default();
            bucket.set_upper_bound(upper_bound);
            bucket.set_cumulative_count(cumulative);
            bucket
        })
        .collect();
    // The count includes the +Inf bucket (the encoder writes it from the count).
    let total: u64 = counts.iter().sum();
    let mut histogram = Histogram::default();
    histogram.set_bucket(buckets);
    histogram.set_sample_count(total);
    histogram.set_sample_sum(sum_seconds);
    let mut metric = Metric::default();
    metric.set_histogram(histogram);
    metric
}

fn family(family: &Family, samples: Vec<Metric>) -> MetricFamily {
    let mut out = MetricFamily::default();
    out.set_name(family.name.to_owned());
    out.set_help(family.help.to_owned());
    out.set_field_type(family.kind);
    out.set_metric(samples);
    out
}

/// A family of one unlabelled gauge.
fn plain_gauge(of: &Family, value: f64) -> MetricFamily {
    family(of, vec![gauge(of, &[], value)])
}

/// A family of one unlabelled counter.
fn plain_counter(of: &Family, value: u64) -> MetricFamily {
    family(of, vec![counter(of, &[], value)])
}

/// A sample of `family` with these label values, in the family's label order.
fn labelled(family: &Family, label_values: &[&str]) -> Metric {
    debug_assert_eq!(family.labels.len(), label_values.len(), "{}", family.name);
    let mut metric = Metric::default();
    metric.set_label(
        family
            .labels
            .iter()
            .zip(label_values)
            .map(|(name, value)| {
                let mut pair = LabelPair::default();
                pair.set_name((*name).to_owned());
                pair.set_value((*value).to_owned());
                pair
            })
            .collect(),
    );
    metric
}

fn counter(family: &Family, label_values: &[&str], value: u64) -> Metric {
    let mut metric = labelled(family, label_values);
    let mut counter = Counter::default();
    counter.set_value(value as f64);
    metric.set_counter(counter);
    metric
}

fn gauge(family: &Family, label_values: &[&str], value: f64) -> Metric {
    let mut metric = labelled(family, label_values);
    let mut gauge = Gauge::default();
    gauge.set_value(value);
    metric.set_gauge(gauge);
    metric
}
