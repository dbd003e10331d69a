//! Reading divvy's INI rule files with `rust-ini`: one section per rule, the
//! section name is the operation, values may be quoted, inline comments are
//! stripped. Line numbers for error messages come from the raw text.

use super::{parse_int_prefix, ConfigError, RawRule, RuleOrigin};
use ini::{Ini, ParseOption};

/// Splits a section name into the operation's pairs: pieces separated by
/// whitespace, each `k=v` (a piece without `=` is a key with an empty value).
/// The name `default` is the empty operation.
fn operation_of_section(name: &str) -> Vec<(String, String)> {
    if name == "default" {
        return Vec::new();
    }
    name.split(crate::protocol::is_whitespace)
        .filter(|piece| !piece.is_empty())
        .map(|piece| match piece.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (piece.to_owned(), String::new()),
        })
        .collect()
}

/// The 1-based line of every section header, in file order.
fn section_lines(text: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| line.trim_start().starts_with('['))
        .map(|(i, _)| i + 1)
        .collect()
}

/// The 1-based line where a key first appears before any section.
fn top_level_key_line(text: &str, key: &str) -> usize {
    text.lines()
        .position(|line| line.trim_start().starts_with(key))
        .map_or(1, |i| i + 1)
}

pub fn read(text: &str) -> Result<Vec<RawRule>, ConfigError> {
    let options = ParseOption {
        enabled_quote: true,
        enabled_escape: false,
        ..ParseOption::default()
    };
    let ini = Ini::load_from_str_opt(text, options).map_err(|e| ConfigError::IniSyntax {
        line: e.line + 1,
        column: e.col + 1,
        message: e.msg.to_string(),
    })?;
    let lines = section_lines(text);
    let mut rules = Vec::new();
    for (section, properties) in ini.iter() {
        let Some(section) = section else {
            if let Some((key, _)) = properties.iter().next() {
                return Err(ConfigError::IniKeyOutsideSection {
                    key: key.to_owned(),
                    line: top_level_key_line(text, key),
                });
            }
            continue;
        };
        let line = lines.get(rules.len()).copied().unwrap_or(0);
        // A key given twice keeps its last value, as divvy's INI reader did.
        let get = |key: &str| properties.get_all(key).next_back().map(str::to_owned);
        let credit_limit_text = get("creditLimit").unwrap_or_default();
        let reset_seconds_text = get("resetSeconds").unwrap_or_default();
        rules.push(RawRule {
            operation: operation_of_section(section),
            credit_limit: parse_int_prefix(&credit_limit_text),
            credit_limit_text,
            reset_seconds: parse_int_prefix(&reset_seconds_text),
            reset_seconds_text,
            actor_field: get("actorField").filter(|f| !f.is_empty()),
            label: get("label").filter(|l| l != "null"),
            comment: get("comment"),
            match_policy: get("matchPolicy"),
            algorithm: get("algorithm"),
            origin: RuleOrigin::Ini {
                section: section.to_owned(),
                line,
            },
        });
    }
    Ok(rules)
}
