//! Reading divvy's INI rule files with `rust-ini`: one section per rule, the
//! section name is the operation, values may be quoted, inline comments are
//! stripped. The pre-pass of [`super::ini_scan`] runs first: it refuses lines
//! rust-ini would misread (every one of them, by line number) and gives the
//! line of each section and key, for error messages and for the warnings
//! about keys divvy would have ignored.

use super::diagnostics::{RuleWarning, RULE_KEYS};
use super::ini_scan::{self, ScannedSection};
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

/// rust-ini's reading of text the pre-pass accepted.
fn parse(normalized: &str) -> Result<Ini, ConfigError> {
    let options = ParseOption {
        enabled_quote: true,
        enabled_escape: false,
        ..ParseOption::default()
    };
    Ini::load_from_str_opt(normalized, options).map_err(|e| ConfigError::IniSyntax {
        line: e.line,
        column: e.col,
        message: e.msg.to_string(),
    })
}

/// The sections and keys rust-ini read, in file order.
fn structure(ini: &Ini) -> Vec<(String, Vec<String>)> {
    ini.iter()
        .filter_map(|(section, properties)| {
            let keys = properties.iter().map(|(k, _)| k.to_owned()).collect();
            section.map(|name| (name.to_owned(), keys))
        })
        .collect()
}

fn scanned_structure(sections: &[ScannedSection]) -> Vec<(String, Vec<String>)> {
    sections
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                s.keys.iter().map(|k| k.key.clone()).collect(),
            )
        })
        .collect()
}

/// Checks that rust-ini reads whatever the pre-pass accepts into exactly the
/// sections and keys the pre-pass recorded (property tests and fuzzing).
#[doc(hidden)]
pub fn check_prepass(text: &str) -> Result<(), String> {
    let scan = ini_scan::scan(text);
    if !scan.malformed.is_empty() {
        return Ok(());
    }
    let ini = parse(&scan.normalized).map_err(|e| format!("rust-ini refused it: {e}"))?;
    let (read, scanned) = (structure(&ini), scanned_structure(&scan.sections));
    if read != scanned {
        return Err(format!("rust-ini read {read:?}, the pre-pass {scanned:?}"));
    }
    let top_level = ini
        .section(None::<String>)
        .map_or(0, |general| general.iter().count());
    if top_level != scan.top_level.len() {
        return Err(format!(
            "rust-ini read {top_level} top-level keys, the pre-pass {}",
            scan.top_level.len()
        ));
    }
    Ok(())
}

/// The rules of an INI file, in order, and a warning per unknown key.
pub fn read(text: &str) -> Result<(Vec<RawRule>, Vec<RuleWarning>), ConfigError> {
    let scan = ini_scan::scan(text);
    if !scan.malformed.is_empty() {
        return Err(ConfigError::IniMalformed(scan.malformed));
    }
    if let Some(key) = scan.top_level.first() {
        return Err(ConfigError::IniKeyOutsideSection {
            key: key.key.clone(),
            line: key.line,
        });
    }
    let ini = parse(&scan.normalized)?;
    let sections: Vec<_> = ini
        .iter()
        .filter_map(|(section, properties)| section.map(|name| (name, properties)))
        .collect();
    if structure(&ini) != scanned_structure(&scan.sections) {
        return Err(ConfigError::IniSyntax {
            line: 0,
            column: 0,
            message: "rust-ini and the line pre-pass read this file differently (a bug: please report it with the file)".into(),
        });
    }
    let mut rules = Vec::with_capacity(sections.len());
    let mut warnings = Vec::new();
    for ((section, properties), scanned) in sections.into_iter().zip(&scan.sections) {
        let origin = RuleOrigin::Ini {
            section: section.to_owned(),
            line: scanned.line,
        };
        warnings.extend(
            scanned
                .keys
                .iter()
                .filter(|k| !RULE_KEYS.contains(&k.key.as_str()))
                .map(|k| RuleWarning::new(Some(origin.clone()), Some(k.line), &k.key, RULE_KEYS)),
        );
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
            origin,
        });
    }
    Ok((rules, warnings))
}
