//! The command line of the `tollgate` binary, the one place that knows
//! `clap`: the commands and their flags, and divvy's environment variables,
//! mapped onto the library's plain configuration structs ([`ServeConfig`]
//! for `serve`, [`ClusterConfig`](crate::cluster::ClusterConfig) inside it);
//! logging and signals; and exit codes. The library below it takes
//! configuration and returns errors.
//!
//! [`ServeConfig`]: crate::app::ServeConfig

mod cluster;
mod observability;
mod serve;
mod values;

pub use serve::ServeArgs;

use crate::rules::{Quota, RuleSet};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Tollgate: a rate-limit and quota server, drop-in compatible with divvy.
#[derive(Parser)]
#[command(version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once at startup
enum Command {
    /// Serve the divvy line protocol. Without CONFIG, runs on the embedded
    /// default (the example configuration of divvy's README).
    Serve(Box<ServeArgs>),
    /// Validate a rule file: exit 0 with a summary, or 1 with the error.
    CheckConfig {
        /// A `.ini` or `.json` rule file.
        file: PathBuf,
    },
    /// Make a running server re-read its rule file (sends it SIGHUP). An
    /// invalid file is refused by the server, which keeps its rules and logs why.
    Reload {
        /// The `--pid-file` the server was started with.
        #[arg(long, conflicts_with = "pid", required_unless_present = "pid")]
        pid_file: Option<PathBuf>,
        /// The server's process id.
        #[arg(long)]
        pid: Option<i32>,
    },
    /// Cluster tools (`tollgate cluster status|add-node|remove-node`).
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Show nodes, shards, leaders and replication lag, asking any node.
    Status(cluster::StatusArgs),
    /// Add a running node (started with `serve --join`) to the cluster;
    /// shards move to it in the background.
    AddNode(cluster::AddNodeArgs),
    /// Remove a node from the cluster; its shards move to the others first.
    RemoveNode(cluster::RemoveNodeArgs),
}

/// The `tollgate` binary's whole work: parses the command line, runs the
/// command, prints errors as one line, and says how the process exits (2 for
/// bad arguments, 1 for failures).
pub fn main() -> ExitCode {
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
        Command::Serve(args) => serve::serve(*args).map(|()| ExitCode::SUCCESS),
        Command::CheckConfig { file } => check_config(&file),
        Command::Cluster(ClusterCommand::Status(args)) => cluster::status_command(&args),
        Command::Cluster(ClusterCommand::AddNode(args)) => cluster::add_node_command(&args),
        Command::Cluster(ClusterCommand::RemoveNode(args)) => cluster::remove_node_command(&args),
        Command::Reload { pid_file, pid } => reload(pid_file.as_deref(), pid),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("tollgate: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn reload(pid_file: Option<&Path>, pid: Option<i32>) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let pid = match (pid, pid_file) {
        (Some(pid), _) => pid,
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            text.trim()
                .parse()
                .with_context(|| format!("{} does not hold a process id", file.display()))?
        }
        (None, None) => anyhow::bail!("give --pid-file or --pid"),
    };
    anyhow::ensure!(pid > 0, "invalid process id {pid}");
    // SAFETY: kill(2) with a valid signal number has no memory-safety preconditions.
    if unsafe { libc::kill(pid, libc::SIGHUP) } != 0 {
        anyhow::bail!(
            "cannot signal process {pid}: {}",
            std::io::Error::last_os_error()
        );
    }
    println!("tollgate: asked process {pid} to reload its rules");
    Ok(ExitCode::SUCCESS)
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
        if rule.match_policy == crate::rules::MatchPolicy::Canary {
            extra.push_str(", canary");
        }
        if let Some(label) = &rule.label {
            extra.push_str(&format!(", label {label}"));
        }
        if rule.algorithm != crate::rules::Algorithm::default() {
            extra.push_str(&format!(", {}", rule.algorithm));
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
