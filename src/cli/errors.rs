//! How the `tollgate` binary words its failures: one line on stderr each,
//! prefixed `tollgate: `. A command-line mistake keeps clap's detail on that
//! line (the missing arguments, "did you mean" for a misspelt flag or
//! command, the values a flag accepts) and names the command whose `--help`
//! to read. A failure's chain of causes is printed once each: a cause whose
//! text is already in the line is not repeated.

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// A command-line mistake as one line, without the `tollgate: ` prefix;
/// `command` is the (sub)command it is about (`tollgate serve`).
pub fn usage_error(error: &clap::Error, command: &str) -> String {
    let rendered = error.render().to_string();
    let first = rendered
        .lines()
        .next()
        .unwrap_or("invalid arguments")
        .trim_start_matches("error: ")
        .trim_end();
    let mut line = first.trim_end_matches(':').to_owned();
    let mut notes = Vec::new();
    for (kind, value) in error.context() {
        match (kind, value) {
            (ContextKind::InvalidArg, ContextValue::Strings(args))
                if error.kind() == ErrorKind::MissingRequiredArgument =>
            {
                line.push_str(": ");
                line.push_str(&args.join(", "));
            }
            (ContextKind::ValidValue, ContextValue::Strings(values)) if !values.is_empty() => {
                notes.push(format!("possible values: {}", values.join(", ")));
            }
            (
                ContextKind::SuggestedArg
                | ContextKind::SuggestedValue
                | ContextKind::SuggestedSubcommand,
                ContextValue::String(suggestion),
            ) => notes.push(format!("did you mean '{suggestion}'?")),
            (
                ContextKind::SuggestedArg
                | ContextKind::SuggestedValue
                | ContextKind::SuggestedSubcommand,
                ContextValue::Strings(suggestions),
            ) if !suggestions.is_empty() => notes.push(format!(
                "did you mean {}?",
                suggestions
                    .iter()
                    .map(|s| format!("'{s}'"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )),
            _ => {}
        }
    }
    for note in notes {
        line.push_str("; ");
        line.push_str(&note);
    }
    format!("{line} (see '{command} --help')")
}

/// The (sub)command the arguments name, as far as they name one that
/// exists: `tollgate cluster add-node` for `cluster add-node 4 --peer …`.
pub fn command_path(command: &clap::Command, args: &[String]) -> String {
    let mut path = vec![command.get_name().to_owned()];
    let mut current = command;
    for arg in args {
        match current.find_subcommand(arg) {
            Some(sub) => {
                path.push(sub.get_name().to_owned());
                current = sub;
            }
            None if arg.starts_with('-') => {}
            None => break,
        }
    }
    path.join(" ")
}

/// A failure and its causes on one line, each cause once: a cause whose
/// text the line holds already (a message that quotes its source) is
/// skipped.
pub fn failure(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if text.is_empty() || line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read {path}: {source}")]
    struct Quoting {
        path: String,
        source: std::io::Error,
    }

    #[test]
    fn a_cause_quoted_by_its_error_is_not_repeated() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let error = anyhow::Error::new(Quoting {
            path: "x.ini".into(),
            source: io,
        })
        .context("cannot start");
        assert_eq!(
            failure(&error),
            "cannot start: cannot read x.ini: No such file"
        );
    }

    #[test]
    fn the_command_path_follows_the_subcommands_given() {
        let command = clap::Command::new("tollgate")
            .subcommand(clap::Command::new("cluster").subcommand(clap::Command::new("add-node")));
        let path = |args: &[&str]| {
            let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            command_path(&command, &args)
        };
        assert_eq!(
            path(&["cluster", "add-node", "4"]),
            "tollgate cluster add-node"
        );
        assert_eq!(path(&["cluster", "--x", "add-nod"]), "tollgate cluster");
        assert_eq!(path(&[]), "tollgate");
    }
}
