//! The `serve` command as a library function: every flag of `tollgate serve`
//! (each subsystem's flags live in its own `Args` struct, flattened here), and
//! the wiring from flags to a running server. The binary only parses and calls.

use crate::clock::{Clock, SystemClock};
use crate::engine::{Engine, UnavailablePolicy};
use crate::metrics::Metrics;
use crate::observability::health::Readiness;
use crate::observability::{Observability, Observed};
use crate::rules::RuleSet;
use crate::server::{Limits, Server, ServerConfig};
use crate::store::redis::{BackendKind, Persistence, RedisArgs, RedisBackend};
use crate::store::{Backend, MemoryBackend, MemoryStore, MemoryStoreConfig};
use anyhow::Context;
use clap::{Args, ValueEnum};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Args)]
pub struct ServeArgs {
    /// A `.ini` or `.json` rule file (divvy's formats).
    pub config: Option<PathBuf>,

    /// Address to listen on [default: 0.0.0.0:$PORT, or 0.0.0.0:8321].
    #[arg(long)]
    pub listen: Option<SocketAddr>,

    /// Port to listen on, as divvy reads it (ignored when --listen is given).
    #[arg(long, env = "PORT", default_value_t = 8321, hide_env_values = true)]
    pub port: u16,

    /// Serving threads, each with its own runtime and listener [default: cores].
    #[arg(long)]
    pub threads: Option<usize>,

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
    #[arg(long, default_value_t = 0)]
    pub idle_timeout_ms: u64,

    /// A request line must be complete this many milliseconds after its
    /// first byte arrived (0: no limit); drops slowloris clients.
    #[arg(long, default_value_t = Limits::default().line_timeout_ms)]
    pub line_timeout_ms: u64,

    /// On SIGINT/SIGTERM, how long to let connections finish what they read.
    #[arg(long, default_value_t = 5_000)]
    pub drain_timeout_ms: u64,

    /// Most live counters kept in memory; see docs/configuration.md for what
    /// happens at the cap.
    #[arg(long, default_value_t = MemoryStoreConfig::default().live_keys_max)]
    pub live_keys_max: usize,

    /// Lock stripes of the counter store (rounded up to a power of two).
    #[arg(long, default_value_t = MemoryStoreConfig::default().stripes)]
    pub stripes: usize,

    /// How often the sweeper reclaims expired counters, in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub sweep_interval_ms: u64,

    /// Counters the sweeper examines per tick at most (bounds its pauses).
    #[arg(long, default_value_t = 20_000)]
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
    pub droplet: crate::droplet::DropletArgs,

    #[command(flatten)]
    pub observability: crate::observability::ObservabilityArgs,

    #[command(flatten)]
    pub redis: RedisArgs,

    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let mut filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,openraft=error"));
    if std::env::var("DEBUG").is_ok_and(|v| v.split(',').any(|s| s.trim() == "divvy")) {
        if let Ok(directive) = "divvy=debug".parse() {
            filter = filter.add_directive(directive);
        }
    }
    use std::io::IsTerminal as _;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

pub fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.log_format);
    if args.cluster.cluster_file.is_some() {
        if args.redis.persist_redis.is_some() {
            anyhow::bail!(
                "--persist-redis cannot be used with --cluster: in cluster mode the counters are replicated by Raft, not persisted to Redis"
            );
        }
        if args.redis.backend != BackendKind::Memory {
            anyhow::bail!(
                "--backend redis cannot be used with --cluster: the cluster keeps its counters in memory on each node"
            );
        }
    }
    let rules = match &args.config {
        Some(path) => RuleSet::load_file(path).with_context(|| format!("{}", path.display()))?,
        None => RuleSet::embedded_default(),
    };
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = Arc::new(MemoryStore::new(MemoryStoreConfig {
        stripes: args.stripes.max(4 * threads),
        live_keys_max: args.live_keys_max,
    }));
    store
        .spawn_sweeper(
            Arc::clone(&clock),
            Duration::from_millis(args.sweep_interval_ms.max(1)),
            args.sweep_entries_per_tick.max(1),
        )
        .context("cannot start the sweeper thread")?;
    let buckets = args
        .droplet
        .buckets(
            args.stripes.max(4 * threads),
            &clock,
            args.sweep_interval_ms,
            args.sweep_entries_per_tick,
        )
        .context("cannot start the bucket sweeper thread")?;
    let metrics = Metrics::new();
    let rule_count = rules.rules().len();
    let source = rules.source.clone();
    let readiness = Arc::new(Readiness::new(Arc::clone(&metrics)));
    let persist_config = args.redis.persist_config()?;
    let cluster = crate::cluster::start(
        &args.cluster,
        &rules,
        Arc::clone(&store),
        Arc::clone(&clock),
    )
    .context("cannot join the cluster")?;
    let backend: Arc<dyn Backend> = match (&cluster, args.redis.backend) {
        (Some(cluster), _) => cluster.backend(),
        (None, BackendKind::Memory) => Arc::new(MemoryBackend {
            store: Arc::clone(&store),
        }),
        (None, BackendKind::Redis) => Arc::new(RedisBackend::start(
            &args.redis,
            &rules,
            Arc::clone(&metrics),
        )?),
    };
    let listen = args
        .listen
        .or(cluster.as_ref().map(|c| c.client_addr()))
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], args.port)));
    let backend_name = match &cluster {
        Some(cluster) => cluster.describe(),
        None => backend.name().to_string(),
    };
    let mut engine = Engine::new(
        rules,
        backend,
        Arc::clone(&clock),
        metrics,
        args.unavailable_policy,
    );
    if let Some(cluster) = &cluster {
        engine = engine.with_extension(cluster.topology_command());
    }
    let droplet_lines = crate::droplet::LineCommands::new(Arc::clone(&buckets));
    let engine = Arc::new(engine.with_extension(Arc::new(droplet_lines)));
    // Loads the persisted counters before serving.
    let persistence = persist_config
        .map(|config| {
            let rules: Arc<dyn crate::rules::CurrentRules> = engine.clone();
            Persistence::start(config, Arc::clone(&store), rules, Arc::clone(&clock))
        })
        .transpose()?;
    let observability = Observability::start(
        &args.observability,
        Observed {
            engine: Arc::clone(&engine),
            store: Some(store),
            buckets: Some(Arc::clone(&buckets)),
            readiness,
        },
    )?;
    let config = ServerConfig {
        listen,
        threads,
        limits: Limits {
            line_bytes_max: args.line_bytes_max.max(1),
            connections_max: args.connections_max.max(1),
            pipeline_max: args.pipeline_max.max(1),
            idle_timeout_ms: args.idle_timeout_ms,
            line_timeout_ms: args.line_timeout_ms,
        },
        drain_timeout_ms: args.drain_timeout_ms,
    };
    let mut signals = Signals::install()?;
    let server = Server::bind(config, Arc::clone(&engine))
        .with_context(|| format!("cannot listen on {listen}"))?;
    let local_addr = server.local_addr();
    let running = server.spawn().context("cannot start serving threads")?;
    if let Some(pid_file) = &args.pid_file {
        std::fs::write(pid_file, format!("{}\n", std::process::id()))
            .with_context(|| format!("cannot write the pid file {}", pid_file.display()))?;
    }
    println!(
        "tollgate: listening on {local_addr} (divvy protocol), rules: {source} ({rule_count} rules), backend: {backend_name}, threads: {threads}"
    );
    let droplet = args
        .droplet
        .serve(
            buckets,
            clock,
            threads,
            args.connections_max,
            args.drain_timeout_ms,
        )
        .context("cannot start the droplet endpoint")?;
    observability.readiness().set_serving(true);
    if let Some(droplet) = &droplet {
        println!(
            "tollgate: listening on {} (droplet protocol)",
            droplet.local_addr
        );
    }
    if let Some(url) = observability.metrics_url() {
        println!("tollgate: serving Prometheus metrics at {url}, health at /healthz and /readyz");
    }
    use std::io::Write as _;
    let _ = std::io::stdout().flush();

    loop {
        match signals.wait() {
            Signal::Stop => break,
            Signal::Reload => reload_rules(&engine, args.config.as_deref()),
        }
    }
    tracing::info!("shutting down: draining connections");
    observability.readiness().set_serving(false);
    running.stop();
    if let Some(droplet) = droplet {
        droplet.stop();
    }
    if let Some(persistence) = persistence {
        match persistence.stop_and_flush() {
            Ok(written) => tracing::info!(written, "persisted every counter"),
            Err(error) => tracing::warn!(%error, "the last persistence pass failed"),
        }
    }
    observability.stop();
    if let Some(pid_file) = &args.pid_file {
        let _ = std::fs::remove_file(pid_file);
    }
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// What the process was told by a signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// SIGINT or SIGTERM: drain and exit.
    Stop,
    /// SIGHUP: re-read the rule file.
    Reload,
}

/// The signal handlers, installed before the server announces itself so that
/// no signal can arrive while its default action (termination) still applies.
pub struct Signals {
    runtime: tokio::runtime::Runtime,
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    pub fn install() -> anyhow::Result<Signals> {
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
            runtime,
        })
    }

    /// Blocks until the next signal.
    pub fn wait(&mut self) -> Signal {
        let Signals {
            runtime,
            terminate,
            interrupt,
            hangup,
        } = self;
        runtime.block_on(async {
            tokio::select! {
                _ = terminate.recv() => Signal::Stop,
                _ = interrupt.recv() => Signal::Stop,
                _ = hangup.recv() => Signal::Reload,
            }
        })
    }
}

/// Re-reads the rule file: a valid file replaces the rules without dropping
/// connections (counters of unchanged rules keep counting); an invalid one is
/// refused with the error logged, and the current rules stay.
pub fn reload_rules(engine: &Engine, config: Option<&std::path::Path>) {
    let Some(path) = config else {
        tracing::warn!(
            "SIGHUP: serving the embedded default rules, there is no rule file to reload"
        );
        return;
    };
    let checked = RuleSet::load_file(path)
        .map_err(|error| error.to_string())
        .and_then(|rules| match engine.backend().check_rules(&rules) {
            Ok(()) => Ok(rules),
            Err(error) => Err(error.to_string()),
        });
    match checked {
        Ok(rules) => {
            let count = rules.rules().len();
            engine.replace_rules(rules);
            tracing::info!(path = %path.display(), rules = count, "rules reloaded");
        }
        Err(error) => {
            tracing::error!(path = %path.display(), %error, "reload refused, keeping the current rules");
        }
    }
}
