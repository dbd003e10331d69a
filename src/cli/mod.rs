//! The command line of the `tollgate` binary, the one place that knows
//! `clap`: the commands and their flags, and divvy's environment variables,
//! mapped onto the library's plain configuration structs ([`ServeConfig`]
//! for `serve`, [`ClusterConfig`](crate::cluster::ClusterConfig) inside it);
//! logging and signals; and exit codes. The library below it takes
//! configuration and returns errors.
//!
//! [`ServeConfig`]: crate::app::ServeConfig

mod cluster;
mod control;
mod errors;
mod logging;
mod observability;
mod serve;
mod values;

pub use serve::ServeArgs;

use crate::rules::{diagnostics, ConfigError, Quota};
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
    /// Validate a rule file: exit 0 with a summary (and a warning per key
    /// divvy would ignore), or 1 naming every malformed line or the first
    /// invalid rule.
    CheckConfig {
        /// A `.ini` or `.json` rule file.
        file: PathBuf,
        /// Also fail (exit 1) on keys divvy would ignore, as `serve
        /// --strict-rules` refuses them.
        #[arg(long)]
        strict_rules: bool,
    },
    /// Make a running server re-read its rule file, through its control
    /// socket, and report the outcome: exit 0 when the new rules serve, 1
    /// with the server's reason when it refused them (it keeps its rules).
    /// A pid that is not a Tollgate server is never signalled.
    Reload {
        /// The `--pid-file` the server was started with.
        #[arg(long, conflicts_with = "pid", required_unless_present = "pid")]
        pid_file: Option<PathBuf>,
        /// The server's process id.
        #[arg(long)]
        pid: Option<i32>,
    },
    /// Cluster tools (`tollgate cluster status|add-node|remove-node|reload`).
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
    /// Change the rules of every node: the file is checked by every node,
    /// then committed, and every node switches to it (nothing changes
    /// anywhere when a node refuses it).
    Reload(cluster::ReloadArgs),
}

/// The `tollgate` binary's whole work: parses the command line, runs the
/// command, prints errors as one line, and says how the process exits (2 for
/// bad arguments, 1 for failures).
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            use clap::error::ErrorKind;
            match error.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = error.print();
                    return ExitCode::SUCCESS;
                }
                // `tollgate` or `tollgate cluster` alone: the help, as an error.
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = error.print();
                }
                _ => {
                    use clap::CommandFactory;
                    let args: Vec<String> = std::env::args().skip(1).collect();
                    let command = errors::command_path(&Cli::command(), &args);
                    eprintln!("tollgate: {}", errors::usage_error(&error, &command));
                }
            }
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Serve(args) => serve::serve(*args).map(|()| ExitCode::SUCCESS),
        Command::CheckConfig { file, strict_rules } => Ok(check_config(&file, strict_rules)),
        Command::Cluster(ClusterCommand::Status(args)) => cluster::status_command(&args),
        Command::Cluster(ClusterCommand::AddNode(args)) => cluster::add_node_command(&args),
        Command::Cluster(ClusterCommand::RemoveNode(args)) => cluster::remove_node_command(&args),
        Command::Cluster(ClusterCommand::Reload(args)) => cluster::reload_command(&args),
        Command::Reload { pid_file, pid } => reload(pid_file.as_deref(), pid),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("tollgate: {}", errors::failure(&error));
            ExitCode::FAILURE
        }
    }
}

/// `tollgate reload`: the server's answer on stdout (exit 0), or its
/// refusal on stderr (exit 1).
fn reload(pid_file: Option<&Path>, pid: Option<i32>) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let pid = match (pid, pid_file) {
        (Some(pid), _) => pid,
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file).with_context(|| {
                format!(
                    "cannot read the pid file {} (the server writes it once serving)",
                    file.display()
                )
            })?;
            text.trim().parse().with_context(|| {
                format!(
                    "{} does not hold a process id: {:?}",
                    file.display(),
                    text.trim()
                )
            })?
        }
        (None, None) => anyhow::bail!("give --pid-file or --pid"),
    };
    let pid = u32::try_from(pid)
        .ok()
        .filter(|&pid| pid > 0)
        .with_context(|| format!("invalid process id {pid}"))?;
    match control::reload(pid)? {
        Ok(done) => {
            println!("tollgate: process {pid}: {done}");
            Ok(ExitCode::SUCCESS)
        }
        Err(refused) => {
            eprintln!("tollgate: process {pid} kept its rules: {refused}");
            Ok(ExitCode::FAILURE)
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

/// `tollgate check-config`: every warning and error on stderr, one a line
/// (`tollgate: FILE: …`), the summary on stdout.
fn check_config(file: &Path, strict: bool) -> ExitCode {
    let name = file.display();
    let checked = diagnostics::check_file(file);
    for warning in &checked.warnings {
        eprintln!("tollgate: {name}: warning: {warning}");
    }
    let rules = match checked.rules {
        Ok(rules) => rules,
        Err(ConfigError::IniMalformed(lines)) => {
            for line in lines {
                eprintln!("tollgate: {name}: {line}");
            }
            return ExitCode::FAILURE;
        }
        Err(error) => {
            eprintln!("tollgate: {}", error.in_file(file));
            return ExitCode::FAILURE;
        }
    };
    let warnings = checked.warnings.len();
    if strict && warnings > 0 {
        eprintln!(
            "tollgate: {name}: refused by --strict-rules: {warnings} unknown key{}",
            if warnings == 1 { "" } else { "s" }
        );
        return ExitCode::FAILURE;
    }
    let warned = match warnings {
        0 => String::new(),
        1 => ", 1 warning".to_owned(),
        n => format!(", {n} warnings"),
    };
    println!("{name}: {} rules, valid{warned}", rules.rules().len());
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
    ExitCode::SUCCESS
}
