//! What loading a rule file tells an operator besides the rules themselves.
//! divvy ignored keys it did not know, so a typo such as `actorFeild` quietly
//! turned a per-IP limit into one global counter, and a JSON `"overides"`
//! into a file that denies everything. Such files still load (divvy accepted
//! them), but each unknown key becomes a [`RuleWarning`] naming its line (INI)
//! or rule (JSON) with a "did you mean" for near misses of a known key: the
//! server logs them at start and on reload, `check-config` prints them, and
//! `--strict-rules` refuses the file ([`Loaded::strict`]). A rule that fails
//! validation because a misspelled key left a required one out is reported
//! as that typo ([`explain`]). This module also picks the front end by the
//! file's extension.

use super::{ConfigError, RuleOrigin, RuleSet};
use std::fmt;
use std::path::Path;

/// A JSON rule's keys.
pub const JSON_RULE_KEYS: [&str; 8] = [
    "operation",
    "creditLimit",
    "resetSeconds",
    "actorField",
    "label",
    "comment",
    "matchPolicy",
    "algorithm",
];

/// The keys of a rule in an INI section (the section name is the operation).
pub const RULE_KEYS: &[&str] = JSON_RULE_KEYS.split_at(1).1;

/// A JSON rule file's top-level keys.
pub const JSON_FILE_KEYS: [&str; 2] = ["overrides", "default"];

/// Keys longer than this get no suggestion (the distance is quadratic).
const SUGGESTED_KEY_CHARS_MAX: usize = 64;

/// An unknown key, ignored as divvy ignored it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleWarning {
    /// The rule holding the key; `None` at a JSON file's top level.
    pub rule: Option<RuleOrigin>,
    /// The key's own line (INI).
    pub line: Option<usize>,
    pub key: String,
    /// The known key it most likely meant.
    pub suggestion: Option<&'static str>,
}

impl RuleWarning {
    pub fn new(
        rule: Option<RuleOrigin>,
        line: Option<usize>,
        key: &str,
        known: &[&'static str],
    ) -> RuleWarning {
        RuleWarning {
            rule,
            line,
            key: key.to_owned(),
            suggestion: suggest(key, known),
        }
    }

    fn hint(&self) -> String {
        self.suggestion
            .map(|known| format!(" (did you mean '{known}'?)"))
            .unwrap_or_default()
    }
}

impl fmt::Display for RuleWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (key, hint) = (&self.key, self.hint());
        match (&self.rule, self.line) {
            (Some(RuleOrigin::Ini { section, .. }), Some(line)) => write!(
                f,
                "line {line}: unknown key '{key}' in rule [{section}], ignored{hint}"
            ),
            (Some(rule), _) => write!(f, "{rule}: unknown key '{key}', ignored{hint}"),
            (None, _) => write!(f, "unknown top-level key '{key}', ignored{hint}"),
        }
    }
}

/// The known key `key` most likely meant: the same key in another case, or
/// one at most one edit away (two for keys of six letters or more), an edit
/// being an insertion, a deletion, a substitution or swapping two neighbours.
pub fn suggest(key: &str, known: &[&'static str]) -> Option<&'static str> {
    if key.chars().count() > SUGGESTED_KEY_CHARS_MAX {
        return None;
    }
    let key: Vec<char> = key.to_lowercase().chars().collect();
    known
        .iter()
        .filter_map(|&candidate| {
            let lower: Vec<char> = candidate.to_lowercase().chars().collect();
            let allowed = if lower.len() >= 6 { 2 } else { 1 };
            let distance = edit_distance(&key, &lower);
            (distance <= allowed).then_some((distance, candidate))
        })
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, candidate)| candidate)
}

/// Optimal string alignment distance (Levenshtein plus adjacent swaps).
fn edit_distance(a: &[char], b: &[char]) -> usize {
    let width = b.len() + 1;
    let mut rows = vec![0usize; (a.len() + 1) * width];
    let at = |i: usize, j: usize| i * width + j;
    for i in 0..=a.len() {
        rows[at(i, 0)] = i;
    }
    for j in 0..=b.len() {
        rows[at(0, j)] = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (rows[at(i - 1, j)] + 1)
                .min(rows[at(i, j - 1)] + 1)
                .min(rows[at(i - 1, j - 1)] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(rows[at(i - 2, j - 2)] + 1);
            }
            rows[at(i, j)] = best;
        }
    }
    rows[at(a.len(), b.len())]
}

/// A loaded rule set and what its file holds that divvy would have ignored.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub rules: RuleSet,
    pub warnings: Vec<RuleWarning>,
}

impl Loaded {
    /// `--strict-rules`: the rules, unless the file has an unknown key.
    pub fn strict(self) -> Result<RuleSet, ConfigError> {
        if self.warnings.is_empty() {
            Ok(self.rules)
        } else {
            Err(ConfigError::UnknownKeys(self.warnings))
        }
    }
}

/// Everything loading a file found: the rules or why not, and the keys
/// divvy would have ignored (also when the rules were refused, so that
/// `check-config` names them all).
#[derive(Debug)]
pub struct Checked {
    pub rules: Result<RuleSet, ConfigError>,
    pub warnings: Vec<RuleWarning>,
}

impl Checked {
    pub fn into_loaded(self) -> Result<Loaded, ConfigError> {
        let rules = self.rules?;
        Ok(Loaded {
            rules,
            warnings: self.warnings,
        })
    }
}

/// Loads and validates a `.ini` or `.json` rule file.
pub fn load_file(path: &Path) -> Result<Loaded, ConfigError> {
    check_file(path).into_loaded()
}

pub fn load_ini(text: &str) -> Result<Loaded, ConfigError> {
    check_ini(text).into_loaded()
}

pub fn load_json(text: &str) -> Result<Loaded, ConfigError> {
    check_json(text).into_loaded()
}

/// Reads a `.ini` or `.json` rule file, by its extension.
pub fn check_file(path: &Path) -> Checked {
    let display = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => check_text(&display, &text),
        Err(reason) => refused(ConfigError::Io {
            path: display,
            reason,
        }),
    }
}

/// Checks the text of a rule file named `name` (its extension says the
/// format, as for [`check_file`]); the rules' source is `name`. Cluster
/// nodes check a reloaded file's text this way, wherever the file lives.
pub fn check_text(name: &str, text: &str) -> Checked {
    let extension = Path::new(name)
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("");
    let mut checked = match extension.to_ascii_lowercase().as_str() {
        "ini" => check_ini(text),
        "json" => check_json(text),
        _ => {
            return refused(ConfigError::UnknownFormat {
                path: name.to_string(),
            })
        }
    };
    if let Ok(rules) = &mut checked.rules {
        rules.source = name.to_string();
    }
    checked
}

/// Loads the text of a rule file named `name` (see [`check_text`]): with
/// `strict` (`--strict-rules`), keys divvy would ignore refuse the file;
/// otherwise they come back as warnings, for the caller to log.
pub fn load_text(name: &str, text: &str, strict: bool) -> Result<Loaded, ConfigError> {
    let loaded = check_text(name, text).into_loaded()?;
    if strict {
        return loaded.strict().map(|rules| Loaded {
            rules,
            warnings: Vec::new(),
        });
    }
    Ok(loaded)
}

pub fn check_ini(text: &str) -> Checked {
    match super::ini_file::read(text) {
        Ok((raw, warnings)) => validate(raw, warnings),
        Err(error) => refused(error),
    }
}

pub fn check_json(text: &str) -> Checked {
    match super::json_file::read(text) {
        Ok((raw, warnings)) => validate(raw, warnings),
        Err(error) => refused(error),
    }
}

fn refused(error: ConfigError) -> Checked {
    Checked {
        rules: Err(error),
        warnings: Vec::new(),
    }
}

fn validate(raw: Vec<super::RawRule>, mut warnings: Vec<RuleWarning>) -> Checked {
    let rules = RuleSet::from_raw(raw).map_err(|error| {
        let (error, used) = explain(error, &warnings);
        if let Some(used) = used {
            // The error names it already.
            warnings.remove(used);
        }
        error
    });
    Checked { rules, warnings }
}

/// A rule refused for a missing `creditLimit` or `resetSeconds` is reported
/// as the misspelling of it that the rule holds, if it holds one (with the
/// index of the warning about that misspelling).
pub fn explain(error: ConfigError, warnings: &[RuleWarning]) -> (ConfigError, Option<usize>) {
    let (rule, key) = match &error {
        ConfigError::BadCreditLimit { rule, value } if is_absent(value) => (rule, "creditLimit"),
        ConfigError::BadResetSeconds { rule, value } if is_absent(value) => (rule, "resetSeconds"),
        _ => return (error, None),
    };
    let typo = warnings.iter().position(|w| {
        w.suggestion == Some(key) && w.rule.as_ref().is_some_and(|r| r.to_string() == *rule)
    });
    match typo {
        Some(index) => {
            let typo = &warnings[index];
            let found = match typo.line {
                Some(line) => format!("'{}' at line {line}", typo.key),
                None => format!("'{}'", typo.key),
            };
            let error = ConfigError::MisspelledKey {
                rule: rule.clone(),
                key,
                found,
            };
            (error, Some(index))
        }
        None => (error, None),
    }
}

/// How a front end renders a key that is not there: INI `""`, JSON `null`.
fn is_absent(value: &str) -> bool {
    value.is_empty() || value == "null"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_misses_of_known_keys_are_suggested() {
        for (typo, meant) in [
            ("actorFeild", "actorField"),
            ("creditLimt", "creditLimit"),
            ("creditlimit", "creditLimit"),
            ("CREDITLIMIT", "creditLimit"),
            ("actor_field", "actorField"),
            ("resetSecond", "resetSeconds"),
            ("reset_seconds", "resetSeconds"),
            ("lable", "label"),
            ("matchpolicy", "matchPolicy"),
            ("algoritm", "algorithm"),
        ] {
            assert_eq!(suggest(typo, RULE_KEYS), Some(meant), "{typo}");
        }
        assert_eq!(suggest("overides", &JSON_FILE_KEYS), Some("overrides"));
        for unrelated in ["ip", "burst", "limit", "window", "", &"x".repeat(500)] {
            assert_eq!(suggest(unrelated, RULE_KEYS), None, "{unrelated}");
        }
    }

    #[test]
    fn edit_distance_counts_swaps_as_one() {
        let d = |a: &str, b: &str| {
            edit_distance(
                &a.chars().collect::<Vec<_>>(),
                &b.chars().collect::<Vec<_>>(),
            )
        };
        assert_eq!(d("ie", "ei"), 1);
        assert_eq!(d("kitten", "sitting"), 3);
        assert_eq!(d("", "abc"), 3);
        assert_eq!(d("same", "same"), 0);
    }
}
