//! The `tollgate` binary: parses flags and environment, builds the server
//! from the library, and waits for a signal. Everything else is in the library.

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tollgate::clock::{Clock, SystemClock};
use tollgate::engine::{Engine, UnavailablePolicy};
use tollgate::metrics::Metrics;
use tollgate::rules::{Quota, RuleSet};
use tollgate::server::{Limits, Server, ServerConfig};
use tollgate::store::{MemoryBackend, MemoryStore, MemoryStoreConfig};

/// Tollgate: a rate-limit and quota server, drop-in compatible with divvy.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the divvy line protocol. Without CONFIG, runs on the embedded
    /// default (the example configuration of divvy's README).
    Serve(ServeArgs),
    /// Validate a rule file: exit 0 with a summary, or 1 with the error.
    CheckConfig {
        /// A `.ini` or `.json` rule file.
        file: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Args)]
struct ServeArgs {
    /// A `.ini` or `.json` rule file (divvy's formats).
    config: Option<PathBuf>,

    /// Address to listen on [default: 0.0.0.0:$PORT, or 0.0.0.0:8321].
    #[arg(long)]
    listen: Option<SocketAddr>,

    /// Port to listen on, as divvy reads it (ignored when --listen is given).
    #[arg(long, env = "PORT", default_value_t = 8321, hide_env_values = true)]
    port: u16,

    /// Serving threads, each with its own runtime and listener [default: cores].
    #[arg(long)]
    threads: Option<usize>,

    /// Longest request line in bytes; longer gets `ERR unknown "line too long"`.
    #[arg(long, default_value_t = Limits::default().line_bytes_max)]
    line_bytes_max: usize,

    /// Most client connections open at once.
    #[arg(long, default_value_t = Limits::default().connections_max)]
    connections_max: usize,

    /// Most requests per connection executing or awaiting an answer.
    #[arg(long, default_value_t = Limits::default().pipeline_max)]
    pipeline_max: usize,

    /// Close connections idle for this many milliseconds (0: never).
    #[arg(long, default_value_t = 0)]
    idle_timeout_ms: u64,

    /// On SIGINT/SIGTERM, how long to let connections finish what they read.
    #[arg(long, default_value_t = 5_000)]
    drain_timeout_ms: u64,

    /// Most live counters kept in memory; see docs/configuration.md for what
    /// happens at the cap.
    #[arg(long, default_value_t = MemoryStoreConfig::default().live_keys_max)]
    live_keys_max: usize,

    /// Lock stripes of the counter store (rounded up to a power of two).
    #[arg(long, default_value_t = MemoryStoreConfig::default().stripes)]
    stripes: usize,

    /// How often the sweeper reclaims expired counters, in milliseconds.
    #[arg(long, default_value_t = 100)]
    sweep_interval_ms: u64,

    /// Counters the sweeper examines per tick at most (bounds its pauses).
    #[arg(long, default_value_t = 20_000)]
    sweep_entries_per_tick: usize,

    /// What a hit gets when its counter cannot be decided (live-key cap
    /// reached, backend unavailable).
    #[arg(long, value_enum, default_value_t = UnavailablePolicy::Error)]
    unavailable_policy: UnavailablePolicy,

    /// Log format on stderr (filter with RUST_LOG; DEBUG=divvy logs each rule).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            use clap::error::ErrorKind;
            if matches!(
                error.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
            ) {
                let _ = error.print();
                return ExitCode::SUCCESS;
            }
            let rendered = error.render().to_string();
            let first = rendered.lines().next().unwrap_or("invalid arguments");
            eprintln!(
                "tollgate: {} (see tollgate --help)",
                first.trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::CheckConfig { file } => check_config(&file),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("tollgate: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn describe_quota(quota: &Quota) -> String {
    match quota {
        Quota::AlwaysDeny => "always deny".into(),
        Quota::AlwaysAllow { .. } => "always allow".into(),
        Quota::Limited {
            credit_limit,
            reset_seconds,
        } => format!("{credit_limit} per {reset_seconds}s"),
    }
}

fn check_config(file: &Path) -> anyhow::Result<ExitCode> {
    let rules = match RuleSet::load_file(file) {
        Ok(rules) => rules,
        Err(error) => {
            eprintln!("tollgate: {}: {error}", file.display());
            return Ok(ExitCode::FAILURE);
        }
    };
    println!("{}: {} rules, valid", file.display(), rules.rules().len());
    for (i, rule) in rules.rules().iter().enumerate() {
        let mut extra = String::new();
        if let Some(actor) = &rule.actor_field {
            extra.push_str(&format!(", per {actor}"));
        }
        if rule.match_policy == tollgate::rules::MatchPolicy::Canary {
            extra.push_str(", canary");
        }
        if let Some(label) = &rule.label {
            extra.push_str(&format!(", label {label}"));
        }
        println!(
            "  {:>3}. [{}] {}{extra}",
            i + 1,
            rule.operation_text(),
            describe_quota(&rule.quota)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
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

fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.log_format);
    let rules = match &args.config {
        Some(path) => RuleSet::load_file(path).with_context(|| format!("{}", path.display()))?,
        None => RuleSet::embedded_default(),
    };
    let listen = args
        .listen
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], args.port)));
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
    let metrics = Metrics::new();
    let rule_count = rules.rules().len();
    let source = rules.source.clone();
    let engine = Arc::new(Engine::new(
        rules,
        Arc::new(MemoryBackend { store }),
        clock,
        metrics,
        args.unavailable_policy,
    ));
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
        "tollgate: listening on {local_addr} (divvy protocol), rules: {source} ({rule_count} rules), backend: memory, threads: {threads}"
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
fn wait_for_signal() -> anyhow::Result<()> {
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
