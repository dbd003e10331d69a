//! The `serve` command as a library function: every flag of `tollgate serve`
//! (each subsystem's flags live in its own `Args` struct, flattened here), and
//! the wiring from flags to a running server. The binary only parses and calls.

use crate::clock::{Clock, SystemClock};
use crate::engine::{Engine, UnavailablePolicy};
use crate::metrics::Metrics;
use crate::rules::RuleSet;
use crate::server::{Limits, Server, ServerConfig};
use crate::store::{MemoryBackend, MemoryStore, MemoryStoreConfig};
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

    /// Log format on stderr (filter with RUST_LOG; DEBUG=divvy logs each rule).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

pub fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.log_format);
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
    store.spawn_sweeper(
        Arc::clone(&clock),
        Duration::from_millis(args.sweep_interval_ms.max(1)),
        args.sweep_entries_per_tick.max(1),
    );
    let cluster = crate::cluster::start(
        &args.cluster,
        &rules,
        Arc::clone(&store),
        Arc::clone(&clock),
    )
    .context("cannot join the cluster")?;
    let backend: Arc<dyn crate::store::Backend> = match &cluster {
        Some(cluster) => cluster.backend(),
        None => Arc::new(MemoryBackend { store }),
    };
    let listen = args
        .listen
        .or(cluster.as_ref().map(|c| c.client_addr()))
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], args.port)));
    let metrics = Metrics::new();
    let rule_count = rules.rules().len();
    let source = rules.source.clone();
    let backend_name = match &cluster {
        Some(cluster) => cluster.describe(),
        None => backend.name().to_string(),
    };
    let mut engine = Engine::new(rules, backend, clock, metrics, args.unavailable_policy);
    if let Some(cluster) = &cluster {
        engine = engine.with_extension(cluster.topology_command());
    }
    let engine = Arc::new(engine);
    let config = ServerConfig {
        listen,
        threads,
        limits: Limits {
            line_bytes_max: args.line_bytes_max.max(1),
            connections_max: args.connections_max.max(1),
            pipeline_max: args.pipeline_max.max(1),
            idle_timeout_ms: args.idle_timeout_ms,
        },
        drain_timeout_ms: args.drain_timeout_ms,
    };
    let server =
        Server::bind(config, engine).with_context(|| format!("cannot listen on {listen}"))?;
    let local_addr = server.local_addr();
    let running = server.spawn().context("cannot start serving threads")?;
    println!(
        "tollgate: listening on {local_addr} (divvy protocol), rules: {source} ({rule_count} rules), backend: {backend_name}, threads: {threads}"
    );
    use std::io::Write as _;
    let _ = std::io::stdout().flush();

    wait_for_signal()?;
    tracing::info!("shutting down: draining connections");
    running.stop();
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// Blocks until SIGINT or SIGTERM.
pub fn wait_for_signal() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the signal runtime")?;
    runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut terminate = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?;
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        Ok(())
    })
}
