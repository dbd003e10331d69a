//! What a server is built from: [`ServeConfig`], plain data with the
//! defaults of `tollgate serve`, one field (or one sub-configuration owned by
//! its subsystem) per setting. The CLI maps flags and environment variables
//! onto it; tests, benches and the load generator's tests fill it in
//! directly. Nothing here starts anything: [`super::App::build`] does.

use crate::cluster::ClusterConfig;
use crate::droplet::DropletConfig;
use crate::engine::UnavailablePolicy;
use crate::envoy::GrpcConfig;
use crate::observability::ObservabilityConfig;
use crate::rules::RuleSet;
use crate::server::Limits;
use crate::store::redis::RedisConfig;
use crate::store::MemoryStoreConfig;
use std::net::SocketAddr;
use std::path::PathBuf;

/// divvy's port, the line protocol's default.
pub const DIVVY_PORT: u16 = 8321;

/// Where the rules come from.
#[derive(Debug, Clone, Default)]
pub enum RuleSource {
    /// divvy's README example (no rule file).
    #[default]
    Embedded,
    /// A `.ini` or `.json` rule file, read again on reload.
    File(PathBuf),
    /// Rules already loaded (tests, benches); nothing to reload from.
    Loaded(RuleSet),
}

/// How the sweepers reclaim expired counters and forgotten buckets.
#[derive(Debug, Clone, Copy)]
pub struct SweepConfig {
    /// How often a sweeper runs, in milliseconds (at least 1).
    pub interval_ms: u64,
    /// Counters a sweeper examines per run at most (bounds its pauses).
    pub entries_per_tick: usize,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            interval_ms: 100,
            entries_per_tick: 20_000,
        }
    }
}

/// Everything `tollgate serve` can be told.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub rules: RuleSource,
    /// Refuse a rule file holding keys divvy would have ignored (at start
    /// and on reload) instead of logging a warning per key.
    pub strict_rules: bool,
    /// Where the line protocol listens; `None`: this node's client address in
    /// cluster mode, else `0.0.0.0:8321`.
    pub listen: Option<SocketAddr>,
    /// Serving threads, each with its own runtime and listener; `None`: one
    /// per core.
    pub threads: Option<usize>,
    pub limits: Limits,
    /// On shutdown, how long connections may finish what they read, in
    /// milliseconds.
    pub drain_timeout_ms: u64,
    /// The counter store; its stripes are raised to at least four per
    /// serving thread.
    pub store: MemoryStoreConfig,
    pub sweep: SweepConfig,
    /// What a hit gets when its counter cannot be decided.
    pub unavailable_policy: UnavailablePolicy,
    /// Log each evaluated rule (divvy's `DEBUG=divvy`).
    pub debug_rules: bool,
    /// Write the process id here while serving (for `tollgate reload`).
    pub pid_file: Option<PathBuf>,
    pub droplet: DropletConfig,
    /// Envoy's rate limit service over gRPC (off unless `listen` is set).
    pub grpc: GrpcConfig,
    pub observability: ObservabilityConfig,
    pub redis: RedisConfig,
    pub cluster: ClusterConfig,
    /// Serve the line protocol on the experimental io_uring loop (Linux,
    /// in-memory backend only).
    pub io_uring: bool,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            rules: RuleSource::Embedded,
            strict_rules: false,
            listen: None,
            threads: None,
            limits: Limits::default(),
            drain_timeout_ms: 5_000,
            store: MemoryStoreConfig::default(),
            sweep: SweepConfig::default(),
            unavailable_policy: UnavailablePolicy::default(),
            debug_rules: false,
            pid_file: None,
            droplet: DropletConfig::default(),
            grpc: GrpcConfig::default(),
            observability: ObservabilityConfig::default(),
            redis: RedisConfig::default(),
            cluster: ClusterConfig::default(),
            io_uring: false,
        }
    }
}
