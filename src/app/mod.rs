//! The one way to start a server: [`App::build`] turns a [`ServeConfig`]
//! into every running part (store and sweepers, droplet buckets, cluster or
//! Redis backend, engine, persistence, exporters, bound listeners: the line
//! protocol, droplet's WebSocket and Envoy's gRPC), and
//! [`App::run_until`] serves until told to stop, then shuts the parts down in
//! order. The binary, the tests, the benches and the load generator's tests
//! all start servers here (mini-redis's `server::run(listener, shutdown)`),
//! so the in-process tests exercise the real startup.

pub mod config;

pub use config::{RuleSource, ServeConfig, SweepConfig, DIVVY_PORT};

use crate::droplet::DropletConfig;

use crate::clock::{Clock, SystemClock};
use crate::cluster::{Cluster, ClusterError};
use crate::droplet::{Buckets, BucketsConfig, DropletServer, DropletServerConfig, LineCommands};
use crate::engine::{CommandExtension, Engine};
use crate::envoy::{GrpcConfig, GrpcServer, GrpcServerConfig};
use crate::metrics::Metrics;
use crate::observability::health::Readiness;
use crate::observability::{Observability, ObservabilityError, Observed};
use crate::rules::{diagnostics, ConfigError, CurrentRules, RuleSet};
use crate::server::{Limits, LineEndpoint, ServerConfig, Serving};
use crate::store::redis::{BackendKind, Persistence, RedisBackend, RedisSetupError};
use crate::store::{Backend, MemoryBackend, MemoryStore, MemoryStoreConfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Lock stripes per serving thread, at least, so threads rarely contend.
const STRIPES_PER_THREAD_MIN: usize = 4;

/// Why a server could not be built or started. Each names what it was given.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("--persist-redis cannot be used with --cluster: in cluster mode the counters are replicated by Raft, not persisted to Redis")]
    PersistenceInCluster,
    #[error("--backend redis cannot be used with --cluster: the cluster keeps its counters in memory on each node")]
    RedisBackendInCluster,
    #[error("{}", error.in_file(path))]
    Rules { path: PathBuf, error: ConfigError },
    #[error("cannot start the {what} thread")]
    Sweeper {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("--io-uring serves the in-memory backend only: not --backend redis, not --cluster")]
    IoUringBackend,
    #[error("cannot join the cluster")]
    Cluster(#[source] ClusterError),
    #[error(transparent)]
    Redis(#[from] RedisSetupError),
    #[error(transparent)]
    Observability(#[from] ObservabilityError),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the droplet endpoint: cannot listen on {addr}")]
    DropletListen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the gRPC endpoint: cannot listen on {addr}")]
    GrpcListen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start serving threads")]
    Spawn(#[source] std::io::Error),
    #[error("cannot write the pid file {}", path.display())]
    PidFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Cluster mode keeps its counters in memory and replicates them itself.
fn check_modes(config: &ServeConfig) -> Result<(), AppError> {
    if config.cluster.cluster_file.is_some() {
        if config.redis.persist_redis.is_some() {
            return Err(AppError::PersistenceInCluster);
        }
        if config.redis.backend != BackendKind::Memory {
            return Err(AppError::RedisBackendInCluster);
        }
    }
    if config.io_uring
        && (config.cluster.cluster_file.is_some() || config.redis.backend != BackendKind::Memory)
    {
        return Err(AppError::IoUringBackend);
    }
    Ok(())
}

/// The rules to serve, and the file to read again on reload (if any).
fn load_rules(source: RuleSource, strict: bool) -> Result<(RuleSet, Option<PathBuf>), AppError> {
    match source {
        RuleSource::Embedded => Ok((RuleSet::embedded_default(), None)),
        RuleSource::Loaded(rules) => Ok((rules, None)),
        RuleSource::File(path) => match load_rule_file(&path, strict) {
            Ok(rules) => Ok((rules, Some(path))),
            Err(error) => Err(AppError::Rules { path, error }),
        },
    }
}

/// Reads a rule file: logs a warning per key divvy would have ignored, or,
/// with `strict` (`--strict-rules`), refuses the file for them.
fn load_rule_file(path: &Path, strict: bool) -> Result<RuleSet, ConfigError> {
    let loaded = diagnostics::load_file(path)?;
    if strict {
        return loaded.strict();
    }
    for warning in &loaded.warnings {
        tracing::warn!(path = %path.display(), "rule file: {warning}");
    }
    Ok(loaded.rules)
}

/// The counter store and droplet's buckets, each with its sweeper running.
fn start_stores(
    store: &MemoryStoreConfig,
    stripes: usize,
    sweep: &SweepConfig,
    droplet: &DropletConfig,
    clock: &Arc<dyn Clock>,
) -> Result<(Arc<MemoryStore>, Arc<Buckets>), AppError> {
    let tick = Duration::from_millis(sweep.interval_ms.max(1));
    let entries_per_tick = sweep.entries_per_tick.max(1);
    let sweeper_failed = |what| move |source| AppError::Sweeper { what, source };
    let counters = Arc::new(MemoryStore::new(MemoryStoreConfig {
        stripes,
        live_keys_max: store.live_keys_max,
    }));
    counters
        .spawn_sweeper(Arc::clone(clock), tick, entries_per_tick)
        .map_err(sweeper_failed("sweeper"))?;
    let buckets = Arc::new(Buckets::new(BucketsConfig {
        stripes,
        buckets_max: droplet.buckets_max,
        cleanup_interval_ms: droplet.cleanup_interval_ms,
    }));
    buckets
        .spawn_sweeper(Arc::clone(clock), tick, entries_per_tick)
        .map_err(sweeper_failed("bucket sweeper"))?;
    Ok((counters, buckets))
}

/// Where and how the TCP endpoints serve.
struct Endpoints {
    listen: SocketAddr,
    droplet_listen: Option<SocketAddr>,
    threads: usize,
    limits: Limits,
    drain_timeout_ms: u64,
    message_bytes_max: usize,
    grpc: GrpcConfig,
    /// Serve the line protocol on the io_uring loop (`--io-uring`).
    io_uring: bool,
}

/// The bound endpoints: the line protocol always, the others when asked for.
struct Bound {
    line: LineEndpoint,
    droplet: Option<DropletServer>,
    grpc: Option<GrpcServer>,
}

impl Endpoints {
    /// Binds the line protocol and, when asked for, droplet's and the gRPC
    /// endpoints.
    fn bind(
        self,
        engine: &Arc<Engine>,
        buckets: &Arc<Buckets>,
        clock: Arc<dyn Clock>,
    ) -> Result<Bound, AppError> {
        let limits = Limits {
            line_bytes_max: self.limits.line_bytes_max.max(1),
            connections_max: self.limits.connections_max.max(1),
            pipeline_max: self.limits.pipeline_max.max(1),
            ..self.limits
        };
        let server_config = ServerConfig {
            listen: self.listen,
            threads: self.threads,
            limits,
            drain_timeout_ms: self.drain_timeout_ms,
        };
        let line = if self.io_uring {
            crate::server::bind_io_uring(server_config, Arc::clone(engine))
        } else {
            crate::server::bind(server_config, Arc::clone(engine)).map(LineEndpoint::Epoll)
        }
        .map_err(|source| AppError::Listen {
            addr: self.listen,
            source,
        })?;
        let grpc = match self.grpc.listen {
            Some(addr) => Some(
                crate::envoy::bind(
                    GrpcServerConfig {
                        listen: addr,
                        threads: self.threads,
                        connections_max: limits.connections_max,
                        drain_timeout_ms: self.drain_timeout_ms,
                        message_bytes_max: self.grpc.message_bytes_max,
                        streams_per_connection_max: self.grpc.streams_per_connection_max,
                        first_byte_timeout_ms: self.grpc.first_byte_timeout_ms,
                        keep_alive_ms: self.grpc.keep_alive_ms,
                        limits: self.grpc.limits,
                    },
                    Arc::clone(engine),
                    Arc::clone(&engine.metrics),
                )
                .map_err(|source| AppError::GrpcListen { addr, source })?,
            ),
            None => None,
        };
        let Some(addr) = self.droplet_listen else {
            return Ok(Bound {
                line,
                droplet: None,
                grpc,
            });
        };
        let droplet = crate::droplet::server::bind(
            DropletServerConfig {
                listen: addr,
                threads: self.threads,
                message_bytes_max: self.message_bytes_max,
                connections_max: limits.connections_max,
                drain_timeout_ms: self.drain_timeout_ms,
            },
            Arc::clone(buckets),
            clock,
            Arc::clone(&engine.metrics),
        )
        .map_err(|source| AppError::DropletListen { addr, source })?;
        Ok(Bound {
            line,
            droplet: Some(droplet),
            grpc,
        })
    }
}

/// What a caller plugs into a server besides its configuration.
#[derive(Default)]
pub struct Hooks {
    /// The clock every decision reads; `None`: the system clock. Tests pass
    /// a manual clock.
    pub clock: Option<Arc<dyn Clock>>,
    /// More line commands, tried before the built-in ones (so that a test
    /// can stand in for one).
    pub extensions: Vec<Arc<dyn CommandExtension>>,
}

/// What the process is told while it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Drain and stop (SIGINT, SIGTERM).
    Stop,
    /// Read the rule file again (SIGHUP).
    ReloadRules,
}

/// A server built and bound (its addresses are known, port 0 included), not
/// serving yet.
pub struct App {
    parts: Parts,
    line: LineEndpoint,
    droplet: Option<DropletServer>,
    grpc: Option<GrpcServer>,
}

/// What a server is made of, built or serving.
struct Parts {
    engine: Arc<Engine>,
    store: Arc<MemoryStore>,
    buckets: Arc<Buckets>,
    /// The rule file, when there is one to reload.
    rule_file: Option<PathBuf>,
    /// Refuse rule files with unknown keys (`--strict-rules`).
    strict_rules: bool,
    threads: usize,
    backend_name: String,
    persistence: Option<Persistence>,
    observability: Option<Observability>,
    pid_file: Option<PathBuf>,
    /// The cluster's runtime runs every shard group; dropped last.
    cluster: Option<Cluster>,
}

impl App {
    /// Builds the server `config` describes on the system clock.
    pub fn build(config: ServeConfig) -> Result<App, AppError> {
        App::build_with(config, Hooks::default())
    }

    /// Builds the server `config` describes, with `hooks` plugged in. Loads
    /// persisted counters and joins the cluster before returning.
    pub fn build_with(config: ServeConfig, hooks: Hooks) -> Result<App, AppError> {
        check_modes(&config)?;
        let (rules, rule_file) = load_rules(config.rules, config.strict_rules)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // A cluster node shares the cores with its Raft thread(s): half each.
        let default_threads = if config.cluster.cluster_file.is_some() {
            (cores / 2).max(1)
        } else {
            cores
        };
        let threads = config.threads.unwrap_or(default_threads).max(1);
        let clock = hooks.clock.unwrap_or_else(|| Arc::new(SystemClock));
        let stripes = config.store.stripes.max(STRIPES_PER_THREAD_MIN * threads);
        let (store, buckets) = start_stores(
            &config.store,
            stripes,
            &config.sweep,
            &config.droplet,
            &clock,
        )?;
        let metrics = Metrics::new();
        let persist_config = config.redis.persist_config()?;
        // A cluster node holds its client address while it joins, which
        // takes a while: an address in use is refused before the node
        // joins (and is given replicas), and nothing else on the machine (an
        // outgoing connection's source port) is given the port meanwhile.
        let client_addr_hold =
            match crate::cluster::client_addr_of(&config.cluster).map_err(AppError::Cluster)? {
                Some(file_addr) => {
                    let addr = config.listen.unwrap_or(file_addr);
                    crate::server::thread_per_core::hold_address(addr)
                        .map_err(|source| AppError::Listen { addr, source })?
                }
                None => None,
            };
        let cluster = crate::cluster::start(
            &config.cluster,
            &rules,
            config.strict_rules,
            Arc::clone(&store),
            Arc::clone(&clock),
        )
        .map_err(AppError::Cluster)?;
        if let Some(cluster) = &cluster {
            buckets.share(cluster.buckets());
            if config.droplet.buckets_max != crate::droplet::DropletConfig::default().buckets_max {
                // Said once at start rather than ignored silently.
                tracing::warn!(
                    "--droplet-buckets-max {} has no effect in cluster mode: buckets are counters there, capped with the others by --live-keys-max ({})",
                    config.droplet.buckets_max,
                    config.store.live_keys_max
                );
            }
        }
        let backend: Arc<dyn Backend> = match (&cluster, config.redis.backend) {
            (Some(cluster), _) => cluster.backend(),
            (None, BackendKind::Memory) => Arc::new(MemoryBackend {
                store: Arc::clone(&store),
            }),
            (None, BackendKind::Redis) => Arc::new(RedisBackend::start(
                &config.redis,
                &rules,
                Arc::clone(&metrics),
            )?),
        };
        // A cluster node serves the rule set the cluster committed, which
        // a data dir or the peers may hold in place of the rule file's.
        let rules = cluster
            .as_ref()
            .and_then(Cluster::committed_rules)
            .unwrap_or(rules);
        let backend_name = match &cluster {
            Some(cluster) => cluster.describe(),
            None => backend.name().to_string(),
        };
        // Extensions of the caller first (a test may stand in for a built-in
        // command), then the cluster's TOPOLOGY, then droplet's TAKE and QUERY.
        let mut extensions = hooks.extensions;
        extensions.extend(cluster.as_ref().map(Cluster::topology_command));
        extensions.push(Arc::new(LineCommands::new(Arc::clone(&buckets))));
        let engine = extensions.into_iter().fold(
            Engine::new(
                rules,
                backend,
                Arc::clone(&clock),
                metrics,
                config.unavailable_policy,
            )
            .with_debug_rules(config.debug_rules),
            Engine::with_extension,
        );
        let engine = Arc::new(engine);
        if let Some(cluster) = &cluster {
            let engine = Arc::downgrade(&engine);
            cluster.on_rules_committed(Box::new(move |rules| {
                if let Some(engine) = engine.upgrade() {
                    engine.replace_rules(rules);
                }
            }));
        }
        // Loads the persisted counters before serving.
        let persistence = match persist_config {
            Some(persist) => {
                let rules: Arc<dyn CurrentRules> = engine.clone();
                let store = Arc::clone(&store);
                Some(Persistence::start(
                    persist,
                    store,
                    rules,
                    Arc::clone(&clock),
                )?)
            }
            None => None,
        };
        let mut readiness = Readiness::new(Arc::clone(&engine.metrics));
        if let Some(cluster) = &cluster {
            readiness = readiness.with_backend_check(Arc::new(cluster.readiness_check()));
        }
        let observability = Observability::start(
            &config.observability,
            Observed {
                engine: Arc::clone(&engine),
                store: Some(Arc::clone(&store)),
                buckets: Some(Arc::clone(&buckets)),
                readiness: Arc::new(readiness),
                cluster: cluster.as_ref().map(|c| {
                    let source: crate::observability::exposition::ClusterSource =
                        Arc::new(c.stats_source());
                    source
                }),
            },
        )?;
        let endpoints = Endpoints {
            listen: config
                .listen
                .or(cluster.as_ref().map(Cluster::client_addr))
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], DIVVY_PORT))),
            droplet_listen: config.droplet.listen,
            threads,
            limits: config.limits,
            drain_timeout_ms: config.drain_timeout_ms,
            message_bytes_max: config.droplet.message_bytes_max,
            grpc: config.grpc,
            io_uring: config.io_uring,
        };
        drop(client_addr_hold);
        let Bound {
            line,
            droplet,
            grpc,
        } = endpoints.bind(&engine, &buckets, clock)?;
        let line = match cluster.as_ref().and_then(Cluster::node_thread) {
            Some(node_thread) => line.host_first_on(node_thread),
            None => line,
        };
        Ok(App {
            parts: Parts {
                engine,
                store,
                buckets,
                rule_file,
                strict_rules: config.strict_rules,
                threads,
                backend_name,
                persistence,
                observability: Some(observability),
                pid_file: config.pid_file,
                cluster,
            },
            line,
            droplet,
            grpc,
        })
    }

    /// Where the line protocol listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.line.local_addr()
    }

    /// Starts serving on every endpoint, marks the server ready and writes
    /// the pid file; returns at once.
    pub fn spawn(self) -> Result<RunningApp, AppError> {
        let App {
            parts,
            line,
            droplet,
            grpc,
        } = self;
        let line = line.spawn().map_err(AppError::Spawn)?;
        let droplet = droplet
            .map(DropletServer::spawn)
            .transpose()
            .map_err(AppError::Spawn)?;
        let grpc = grpc
            .map(GrpcServer::spawn)
            .transpose()
            .map_err(AppError::Spawn)?;
        if let Some(observability) = &parts.observability {
            observability.readiness().set_serving(true);
        }
        if let Some(path) = &parts.pid_file {
            std::fs::write(path, format!("{}\n", std::process::id())).map_err(|source| {
                AppError::PidFile {
                    path: path.clone(),
                    source,
                }
            })?;
        }
        Ok(RunningApp {
            local_addr: line.local_addr,
            droplet_addr: droplet.as_ref().map(|droplet| droplet.local_addr),
            grpc_addr: grpc.as_ref().map(|grpc| grpc.local_addr),
            parts,
            line: Some(line),
            droplet,
            grpc,
        })
    }

    /// Serves until `control` says stop, reloading the rules whenever it says
    /// so, then drains and stops every part. `serving` is called once, when
    /// every endpoint serves (the binary announces itself there); `control`
    /// may also act on the running server itself (the binary answers its
    /// control socket's reload requests there).
    pub fn run_until(
        self,
        serving: impl FnOnce(&RunningApp),
        mut control: impl FnMut(&RunningApp) -> Control,
    ) -> Result<(), AppError> {
        let running = self.spawn()?;
        serving(&running);
        loop {
            match control(&running) {
                Control::Stop => break,
                Control::ReloadRules => {
                    let _ = running.reload_rules();
                }
            }
        }
        tracing::info!("shutting down: draining connections");
        running.stop();
        tracing::info!("stopped");
        Ok(())
    }
}

/// A serving server. Dropping it stops it (as [`RunningApp::stop`]).
pub struct RunningApp {
    local_addr: SocketAddr,
    droplet_addr: Option<SocketAddr>,
    grpc_addr: Option<SocketAddr>,
    parts: Parts,
    line: Option<Serving>,
    droplet: Option<Serving>,
    grpc: Option<Serving>,
}

impl RunningApp {
    /// Where the line protocol listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where droplet's WebSocket endpoint listens, when it is served.
    pub fn droplet_addr(&self) -> Option<SocketAddr> {
        self.droplet_addr
    }

    /// Where Envoy's rate limit service (gRPC) listens, when it is served.
    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc_addr
    }

    /// `http://<addr><metrics path>`, when metrics are served over HTTP.
    pub fn metrics_url(&self) -> Option<String> {
        self.parts.observability.as_ref()?.metrics_url()
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.parts.engine
    }

    pub fn store(&self) -> &Arc<MemoryStore> {
        &self.parts.store
    }

    pub fn buckets(&self) -> &Arc<Buckets> {
        &self.parts.buckets
    }

    /// Redis persistence, when it runs.
    pub fn persistence(&self) -> Option<&Persistence> {
        self.parts.persistence.as_ref()
    }

    /// `rules: <source> (<n> rules), backend: <backend>, threads: <n>`.
    pub fn describe(&self) -> String {
        let rules = self.parts.engine.rule_set();
        format!(
            "rules: {} ({} rules), backend: {}, threads: {}",
            rules.source,
            rules.rules().len(),
            self.parts.backend_name,
            self.parts.threads
        )
    }

    /// Re-reads the rule file: a valid file replaces the rules without
    /// dropping connections (counters of unchanged rules keep counting); an
    /// invalid one, or one the backend cannot serve, is refused with the
    /// error logged, and the current rules stay. A cluster node commits the
    /// file on every node instead (docs/cluster.md, "Cluster-wide reload").
    /// Returns what happened, for whoever asked (`tollgate reload`).
    pub fn reload_rules(&self) -> Result<String, String> {
        let Some(path) = &self.parts.rule_file else {
            let why = "serving the embedded default rules: there is no rule file to reload";
            tracing::warn!("reload: {why}");
            return Err(why.to_owned());
        };
        if let Some(cluster) = &self.parts.cluster {
            let outcome = std::fs::read_to_string(path)
                .map_err(|reason| {
                    ConfigError::Io {
                        path: path.display().to_string(),
                        reason,
                    }
                    .to_string()
                })
                .and_then(|text| cluster.reload_rules(path.display().to_string(), text));
            match &outcome {
                Ok(done) => tracing::info!(path = %path.display(), "{done}"),
                Err(error) => {
                    tracing::error!(path = %path.display(), %error, "reload refused, keeping the current rules")
                }
            }
            return outcome;
        }
        let engine = &self.parts.engine;
        let checked = load_rule_file(path, self.parts.strict_rules)
            .map_err(|error| error.in_file(path))
            .and_then(|rules| match engine.backend().check_rules(&rules) {
                Ok(()) => Ok(rules),
                Err(error) => Err(format!("{}: {error}", path.display())),
            });
        match checked {
            Ok(rules) => {
                let count = rules.rules().len();
                engine.replace_rules(rules);
                tracing::info!(path = %path.display(), rules = count, "rules reloaded");
                Ok(format!("reloaded {count} rules from {}", path.display()))
            }
            Err(error) => {
                tracing::error!(path = %path.display(), %error, "reload refused, keeping the current rules");
                Err(error)
            }
        }
    }

    /// Stops accepting, drains every endpoint (bounded by the drain timeout),
    /// persists every counter once more, stops the exporters, removes the
    /// pid file, then leaves the cluster.
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        if let Some(observability) = &self.parts.observability {
            observability.readiness().set_serving(false);
        }
        if let Some(line) = self.line.take() {
            line.stop();
        }
        if let Some(droplet) = self.droplet.take() {
            droplet.stop();
        }
        if let Some(grpc) = self.grpc.take() {
            grpc.stop();
        }
        if let Some(persistence) = self.parts.persistence.take() {
            match persistence.stop_and_flush() {
                Ok(written) => tracing::info!(written, "persisted every counter"),
                Err(error) => tracing::warn!(%error, "the last persistence pass failed"),
            }
        }
        if let Some(observability) = self.parts.observability.take() {
            observability.stop();
        }
        if let Some(pid_file) = self.parts.pid_file.take() {
            let _ = std::fs::remove_file(pid_file);
        }
        drop(self.parts.cluster.take());
    }
}

impl Drop for RunningApp {
    fn drop(&mut self) {
        self.shut_down();
    }
}
