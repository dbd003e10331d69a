//! `tollgate serve`: every flag and environment variable of the command,
//! mapped onto a [`ServeConfig`] (each subsystem's flags in their own `Args`
//! struct, flattened here), logging, and the signals that drive the server.
//! The server itself is built and run by [`App`].

use super::cluster::ClusterArgs;
use super::control;
use super::observability::ObservabilityArgs;
use crate::app::{
    App, AppError, Control, RuleSource, RunningApp, ServeConfig, SweepConfig, DIVVY_PORT,
};
use crate::cluster::auth::SecretError;
use crate::cluster::ClusterError;
use crate::droplet::DropletConfig;
use crate::engine::UnavailablePolicy;
use crate::envoy::{EnvoyLimits, GrpcConfig};
use crate::server::Limits;
use crate::store::redis::{BackendKind, RedisConfig};
use crate::store::MemoryStoreConfig;
use anyhow::Context;
use clap::{Args, ValueEnum};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Args)]
pub struct ServeArgs {
    /// A `.ini` or `.json` rule file (divvy's formats).
    pub config: Option<PathBuf>,

    /// Refuse a rule file holding keys divvy would ignore (a typo such as
    /// `actorFeild`), at start and on reload, instead of logging a warning
    /// per key.
    #[arg(long)]
    pub strict_rules: bool,

    /// Address to listen on: IP:PORT, HOST:PORT (resolved at start) or PORT
    /// [default: 0.0.0.0:$PORT, or 0.0.0.0:8321].
    #[arg(long, value_name = "ADDR", value_parser = super::values::parse_listen)]
    pub listen: Option<SocketAddr>,

    /// Port to listen on, as divvy reads it (ignored when --listen is given).
    #[arg(long, env = "PORT", default_value_t = DIVVY_PORT, hide_env_values = true)]
    pub port: u16,

    /// Serving threads, each with its own runtime and listener [default: cores;
    /// half the cores in cluster mode, the Raft threads having the rest].
    #[arg(long)]
    pub threads: Option<usize>,

    /// Serve the line protocol on an experimental io_uring loop (Linux, the
    /// in-memory backend only) instead of epoll.
    #[arg(long)]
    pub io_uring: bool,

    /// Longest request line in bytes; longer gets `ERR unknown "line too long"`.
    #[arg(long, default_value_t = Limits::default().line_bytes_max)]
    pub line_bytes_max: usize,

    /// Most client connections open at once.
    #[arg(long, default_value_t = Limits::default().connections_max)]
    pub connections_max: usize,

    /// Most requests per connection executing or awaiting an answer.
    #[arg(long, default_value_t = Limits::default().pipeline_max)]
    pub pipeline_max: usize,

    /// Close connections idle for this many milliseconds (0: never).
    #[arg(long, default_value_t = Limits::default().idle_timeout_ms)]
    pub idle_timeout_ms: u64,

    /// A request line must be complete this many milliseconds after its
    /// first byte arrived (0: no limit); drops slowloris clients.
    #[arg(long, default_value_t = Limits::default().line_timeout_ms)]
    pub line_timeout_ms: u64,

    /// On SIGINT/SIGTERM, how long to let connections finish what they read.
    #[arg(long, default_value_t = ServeConfig::default().drain_timeout_ms)]
    pub drain_timeout_ms: u64,

    /// Most live counters kept in memory; see docs/configuration.md for what
    /// happens at the cap.
    #[arg(long, default_value_t = MemoryStoreConfig::default().live_keys_max)]
    pub live_keys_max: usize,

    /// Lock stripes of the counter store (rounded up to a power of two).
    #[arg(long, default_value_t = MemoryStoreConfig::default().stripes)]
    pub stripes: usize,

    /// How often the sweeper reclaims expired counters, in milliseconds.
    #[arg(long, default_value_t = SweepConfig::default().interval_ms)]
    pub sweep_interval_ms: u64,

    /// Counters the sweeper examines per tick at most (bounds its pauses).
    #[arg(long, default_value_t = SweepConfig::default().entries_per_tick)]
    pub sweep_entries_per_tick: usize,

    /// What a hit gets when its counter cannot be decided (live-key cap
    /// reached, backend unavailable).
    #[arg(long, value_enum, default_value_t = UnavailablePolicy::Error)]
    pub unavailable_policy: UnavailablePolicy,

    /// Write the process id here once serving (for `tollgate reload`).
    #[arg(long)]
    pub pid_file: Option<PathBuf>,

    /// Log format on stderr (filter with RUST_LOG; DEBUG=divvy logs each rule).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    #[command(flatten)]
    pub droplet: DropletArgs,

    #[command(flatten)]
    pub grpc: GrpcArgs,

    #[command(flatten)]
    pub observability: ObservabilityArgs,

    #[command(flatten)]
    pub redis: RedisArgs,

    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// The flags of the droplet endpoint.
#[derive(Args, Debug, Clone)]
pub struct DropletArgs {
    /// Serve droplet's WebSocket protocol on ADDR; without a value, on
    /// 0.0.0.0:3000 (droplet's port). Off unless given. `PORT` stays divvy's.
    #[arg(
        long,
        value_name = "ADDR",
        num_args = 0..=1,
        default_missing_value = "0.0.0.0:3000",
        value_parser = super::values::parse_listen
    )]
    pub droplet_listen: Option<SocketAddr>,

    /// Largest WebSocket message (and frame) accepted, in bytes; a larger one
    /// closes the connection with code 1009.
    #[arg(long, default_value_t = DropletConfig::default().message_bytes_max)]
    pub droplet_message_bytes_max: usize,

    /// droplet's `cleanup_interval`, in milliseconds: a bucket whose every
    /// period is full is forgotten at the next multiple of it (0: never).
    #[arg(long, default_value_t = DropletConfig::default().cleanup_interval_ms)]
    pub droplet_cleanup_interval_ms: u64,

    /// Most buckets kept in memory; a take that would create one more is
    /// refused (`accept: false` over WebSocket, `ERR` on a line).
    #[arg(long, default_value_t = DropletConfig::default().buckets_max)]
    pub droplet_buckets_max: usize,
}

/// The flags of Envoy's rate limit service (gRPC).
#[derive(Args, Debug, Clone)]
pub struct GrpcArgs {
    /// Serve Envoy's rate limit service (gRPC, `ShouldRateLimit`) and gRPC
    /// health on ADDR; without a value, on 0.0.0.0:8081 (envoyproxy/ratelimit's
    /// port). Off unless given. See docs/envoy.md.
    #[arg(
        long,
        value_name = "ADDR",
        num_args = 0..=1,
        default_missing_value = "0.0.0.0:8081",
        value_parser = super::values::parse_listen
    )]
    pub grpc_listen: Option<SocketAddr>,

    /// Largest gRPC request message, in bytes; larger is answered
    /// RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = GrpcConfig::default().message_bytes_max)]
    pub grpc_message_bytes_max: usize,

    /// Most concurrent gRPC calls (HTTP/2 streams) per connection.
    #[arg(long, default_value_t = GrpcConfig::default().streams_per_connection_max)]
    pub grpc_streams_max: u32,

    /// Most descriptors in one ShouldRateLimit request (more: INVALID_ARGUMENT).
    #[arg(long, default_value_t = EnvoyLimits::default().descriptors_max)]
    pub grpc_descriptors_max: usize,

    /// Most entries in one descriptor (more: INVALID_ARGUMENT).
    #[arg(long, default_value_t = EnvoyLimits::default().entries_per_descriptor_max)]
    pub grpc_entries_max: usize,

    /// Largest hits_addend (more: INVALID_ARGUMENT); a request of n hits is
    /// decided as n hits in a row.
    #[arg(long, default_value_t = EnvoyLimits::default().hits_addend_max)]
    pub grpc_hits_addend_max: u64,
}

impl GrpcArgs {
    fn into_config(self) -> GrpcConfig {
        GrpcConfig {
            listen: self.grpc_listen,
            message_bytes_max: self.grpc_message_bytes_max,
            streams_per_connection_max: self.grpc_streams_max,
            first_byte_timeout_ms: GrpcConfig::default().first_byte_timeout_ms,
            keep_alive_ms: GrpcConfig::default().keep_alive_ms,
            limits: EnvoyLimits {
                descriptors_max: self.grpc_descriptors_max,
                entries_per_descriptor_max: self.grpc_entries_max,
                hits_addend_max: self.grpc_hits_addend_max,
            },
        }
    }
}

/// Flags of the Redis backend and of Redis persistence.
#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// Where counters live: `memory`, or `redis` (divvy's Redis and key layout).
    #[arg(long, value_enum, default_value_t = BackendKind::Memory)]
    pub backend: BackendKind,

    /// Redis host of the redis backend, as divvy reads it.
    #[arg(long, env = "REDIS_HOST", default_value_t = RedisConfig::default().redis_host)]
    pub redis_host: String,

    /// Redis port of the redis backend, as divvy reads it (read only with
    /// --backend redis, so that an unrelated REDIS_PORT, such as the
    /// `tcp://…` that Kubernetes sets, never stops the memory backend).
    #[arg(long, env = "REDIS_PORT", default_value_t = RedisConfig::default().redis_port)]
    pub redis_port: String,

    /// Redis URL of the redis backend, for a password, a database or TLS
    /// (`redis://[user:password@]host:port/db`, `rediss://…`); overrides
    /// REDIS_HOST and REDIS_PORT.
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,

    /// Longest a hit waits for its backend (Redis) before it is answered
    /// `ERR` or by --unavailable-policy, in milliseconds.
    #[arg(long, default_value_t = RedisConfig::default().backend_timeout_ms)]
    pub backend_timeout_ms: u64,

    /// Persist the in-memory counters to this Redis (URL): written every
    /// --persist-interval-ms, loaded at start, written fully at shutdown.
    #[arg(long, value_name = "URL")]
    pub persist_redis: Option<String>,

    /// How often persistence writes a batch of counters, in milliseconds.
    #[arg(long, default_value_t = RedisConfig::default().persist_interval_ms)]
    pub persist_interval_ms: u64,

    /// Most counters persistence writes per interval (bounds its cost; a full
    /// pass over N counters takes ceil(N / this) intervals).
    #[arg(long, default_value_t = RedisConfig::default().persist_counters_per_tick)]
    pub persist_counters_per_tick: usize,

    /// Prefix of persisted counter keys (one per deployment sharing a Redis).
    #[arg(long, default_value_t = RedisConfig::default().persist_key_prefix)]
    pub persist_key_prefix: String,
}

impl RedisArgs {
    fn into_config(self) -> RedisConfig {
        RedisConfig {
            backend: self.backend,
            redis_host: self.redis_host,
            redis_port: self.redis_port,
            redis_url: self.redis_url,
            backend_timeout_ms: self.backend_timeout_ms,
            persist_redis: self.persist_redis,
            persist_interval_ms: self.persist_interval_ms,
            persist_counters_per_tick: self.persist_counters_per_tick,
            persist_key_prefix: self.persist_key_prefix,
        }
    }
}

impl ServeArgs {
    /// The server these flags and environment variables describe. Invalid
    /// values of divvy's variables are errors naming the variable; one half
    /// of a pair (metrics, statsd) is a warning, as in divvy.
    pub fn into_config(self) -> anyhow::Result<ServeConfig> {
        let cluster = self.cluster.into_config();
        // In cluster mode the node's client address comes from the cluster file.
        let listen = self.listen.or_else(|| {
            cluster
                .cluster_file
                .is_none()
                .then(|| SocketAddr::from(([0, 0, 0, 0], self.port)))
        });
        Ok(ServeConfig {
            rules: match self.config {
                Some(path) => RuleSource::File(path),
                None => RuleSource::Embedded,
            },
            strict_rules: self.strict_rules,
            listen,
            threads: self.threads,
            limits: Limits {
                line_bytes_max: self.line_bytes_max,
                connections_max: self.connections_max,
                pipeline_max: self.pipeline_max,
                idle_timeout_ms: self.idle_timeout_ms,
                line_timeout_ms: self.line_timeout_ms,
            },
            drain_timeout_ms: self.drain_timeout_ms,
            store: MemoryStoreConfig {
                stripes: self.stripes,
                live_keys_max: self.live_keys_max,
            },
            sweep: SweepConfig {
                interval_ms: self.sweep_interval_ms,
                entries_per_tick: self.sweep_entries_per_tick,
            },
            unavailable_policy: self.unavailable_policy,
            debug_rules: super::logging::divvy_debug(),
            pid_file: self.pid_file,
            droplet: DropletConfig {
                listen: self.droplet.droplet_listen,
                message_bytes_max: self.droplet.droplet_message_bytes_max,
                cleanup_interval_ms: self.droplet.droplet_cleanup_interval_ms,
                buckets_max: self.droplet.droplet_buckets_max,
            },
            grpc: self.grpc.into_config(),
            observability: self.observability.into_config()?,
            redis: self.redis.into_config(),
            cluster,
            io_uring: self.io_uring,
        })
    }
}

/// `tollgate serve`: logs, builds the server, announces it on stdout once it
/// serves, and serves until SIGINT or SIGTERM (SIGHUP reloads the rules).
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    super::logging::init_logging(args.log_format);
    let join = args.cluster.join_existing;
    let config = args.into_config()?;
    // Until the server is built (a cluster join may wait for peers), a signal
    // still terminates the process at once.
    let app = App::build(config).map_err(|error| match error {
        AppError::Cluster(ClusterError::Secret(SecretError::Missing)) => {
            super::cluster::missing_secret(join)
        }
        other => other.into(),
    })?;
    // Installed before anything is announced, so that no signal can arrive
    // while its default action (termination) still applies.
    let mut signals = Signals::install()?;
    app.run_until(announce, |running| signals.wait(running))?;
    Ok(())
}

/// The lines scripts and tests wait for: where each endpoint listens.
fn announce(app: &RunningApp) {
    println!(
        "tollgate: listening on {} (divvy protocol), {}",
        app.local_addr(),
        app.describe()
    );
    if let Some(addr) = app.droplet_addr() {
        println!("tollgate: listening on {addr} (droplet protocol)");
    }
    if let Some(addr) = app.grpc_addr() {
        println!("tollgate: listening on {addr} (Envoy rate limit service, gRPC)");
    }
    if let Some(url) = app.metrics_url() {
        println!("tollgate: serving Prometheus metrics at {url}, health at /healthz and /readyz");
    }
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
}

/// The signal handlers and the control socket, on a small runtime of their
/// own.
struct Signals {
    runtime: tokio::runtime::Runtime,
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
    control: Option<tokio::sync::mpsc::Receiver<control::Request>>,
}

impl Signals {
    fn install() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the signal runtime")?;
        let _context = runtime.enter();
        Ok(Signals {
            terminate: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
            interrupt: signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?,
            hangup: signal(SignalKind::hangup()).context("cannot listen for SIGHUP")?,
            control: control::listen(),
            runtime,
        })
    }

    /// Blocks until SIGINT or SIGTERM says stop; meanwhile SIGHUP reloads
    /// the rules, and so does a control request, which gets the outcome.
    fn wait(&mut self, running: &RunningApp) -> Control {
        let Signals {
            runtime,
            terminate,
            interrupt,
            hangup,
            control,
        } = self;
        loop {
            let event = runtime.block_on(async {
                let next_request = async {
                    match control.as_mut() {
                        Some(requests) => requests.recv().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = terminate.recv() => Event::Stop,
                    _ = interrupt.recv() => Event::Stop,
                    _ = hangup.recv() => Event::Hangup,
                    request = next_request => Event::Request(request),
                }
            });
            match event {
                Event::Stop => return Control::Stop,
                Event::Hangup => {
                    let _ = running.reload_rules();
                }
                Event::Request(None) => *control = None,
                Event::Request(Some(request)) => match request.command {
                    control::Command::Reload => {
                        let _ = request.answer.send(running.reload_rules());
                    }
                },
            }
        }
    }
}

/// What woke [`Signals::wait`].
enum Event {
    Stop,
    Hangup,
    /// A control request; `None` when the control socket stopped.
    Request(Option<control::Request>),
}

#[cfg(test)]
mod tests {
    use super::super::Cli;
    use super::*;
    use clap::Parser;

    fn serve_config(flags: &[&str]) -> ServeConfig {
        let cli = Cli::try_parse_from(["tollgate", "serve"].iter().chain(flags)).unwrap();
        match cli.command {
            super::super::Command::Serve(args) => args.into_config().unwrap(),
            _ => unreachable!("serve was parsed"),
        }
    }

    #[test]
    fn defaults_are_the_librarys() {
        let config = serve_config(&[]);
        let default = ServeConfig::default();
        assert_eq!(config.listen, Some("0.0.0.0:8321".parse().unwrap()));
        assert_eq!(config.drain_timeout_ms, default.drain_timeout_ms);
        assert_eq!(config.store.stripes, default.store.stripes);
        assert_eq!(config.redis.redis_host, default.redis.redis_host);
        assert_eq!(config.redis.backend, BackendKind::Memory);
        assert_eq!(
            config.cluster.raft_heartbeat_ms,
            default.cluster.raft_heartbeat_ms
        );
        assert!(config.cluster.leader_balance);
        assert!(config.droplet.listen.is_none());
    }

    #[test]
    fn flags_reach_the_config() {
        let config = serve_config(&[
            "rules.ini",
            "--listen",
            "127.0.0.1:9000",
            "--backend",
            "redis",
            "--redis-url",
            "redis://db:6390/3",
            "--unavailable-policy",
            "deny",
            "--droplet-listen",
            "--consistency",
            "fast",
            "--leader-balance",
            "false",
        ]);
        assert!(
            matches!(config.rules, RuleSource::File(ref path) if path == &PathBuf::from("rules.ini"))
        );
        assert_eq!(config.listen, Some("127.0.0.1:9000".parse().unwrap()));
        assert_eq!(config.redis.backend, BackendKind::Redis);
        assert_eq!(config.redis.redis_url.as_deref(), Some("redis://db:6390/3"));
        assert_eq!(config.unavailable_policy, UnavailablePolicy::Deny);
        assert_eq!(config.droplet.listen, Some("0.0.0.0:3000".parse().unwrap()));
        assert_eq!(
            config.cluster.consistency,
            crate::cluster::Consistency::Fast
        );
        assert!(!config.cluster.leader_balance);
    }

    #[test]
    fn a_cluster_node_listens_where_its_cluster_file_says() {
        let config = serve_config(&["--cluster", "cluster.ini", "--node-id", "2"]);
        assert_eq!(config.listen, None);
        assert_eq!(config.cluster.node_id, Some(2));
    }
}
