//! Rules: the ordered quota configuration (SPEC §2–§3). This module owns the
//! rule model, loading it from divvy's INI and JSON files, the five validation
//! steps, and matching a request against the rules. It knows nothing about
//! sockets or storage.

mod counter_id;
pub mod diagnostics;
mod ini_file;
mod ini_scan;
mod json_file;
mod matcher;
mod pattern;

use crate::protocol::Pairs;
pub use counter_id::CounterId;
pub use diagnostics::{Loaded, RuleWarning};
#[doc(hidden)]
pub use ini_file::check_prepass as check_ini_prepass;
pub use ini_scan::{Malformed, Problem as MalformedProblem};
pub use pattern::Pattern;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// The example configuration from divvy's README, used when `tollgate serve`
/// is given no rule file.
pub const EMBEDDED_DEFAULT_INI: &str = include_str!("default.ini");

/// The rules being served, replaced whole on reload: what background work
/// (persistence) reads instead of holding whoever serves them. Each call
/// returns the rules current at that moment.
pub trait CurrentRules: Send + Sync + 'static {
    fn current(&self) -> Arc<RuleSet>;
}

/// What a matching rule does with its result (SPEC §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatchPolicy {
    /// The rule decides the answer and ends the search.
    #[default]
    Stop,
    /// The rule consumes quota and counts metrics but the search goes on.
    Canary,
}

/// The counting algorithm of a rule (`algorithm = …` in a rule file). Divvy
/// knows only the fixed window, the default; docs/configuration.md (Algorithms) shows how each
/// admits a burst and what `currentCredit` and `nextResetSeconds` mean.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum Algorithm {
    /// divvy's window: opens at the first hit, admits `creditLimit`, closes
    /// `resetSeconds` later.
    #[default]
    FixedWindow,
    /// Holds up to `creditLimit` tokens, refilled continuously at
    /// `creditLimit` per `resetSeconds`.
    TokenBucket,
    /// The previous window's count, weighted by how much of it still lies
    /// within the last `resetSeconds`, plus the current window's.
    SlidingWindow,
}

impl Algorithm {
    pub const ALL: [Algorithm; 3] = [
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
        Algorithm::SlidingWindow,
    ];

    pub fn parse(text: &str) -> Option<Algorithm> {
        Self::ALL.into_iter().find(|a| a.as_str() == text)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed-window",
            Algorithm::TokenBucket => "token-bucket",
            Algorithm::SlidingWindow => "sliding-window",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How many hits a rule admits, as a type that cannot be built invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Quota {
    /// `creditLimit = 0`: `OK false 0 -1`, no counter touched.
    AlwaysDeny,
    /// `resetSeconds = 0` with a positive limit: `OK true <limit> 0`.
    AlwaysAllow { credit_limit: u64 },
    /// `credit_limit` hits per `reset_seconds`, both ≥ 1.
    Limited {
        credit_limit: u64,
        reset_seconds: u64,
    },
}

/// Where a rule came from, for error messages that name it the way its file does.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RuleOrigin {
    Ini {
        section: String,
        line: usize,
    },
    Json {
        index: Option<usize>,
    },
    #[default]
    Built,
}

impl fmt::Display for RuleOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleOrigin::Ini { section, line } => write!(f, "[{section}] (line {line})"),
            RuleOrigin::Json { index: Some(i) } => write!(f, "overrides[{i}]"),
            RuleOrigin::Json { index: None } => f.write_str("\"default\""),
            RuleOrigin::Built => f.write_str("rule"),
        }
    }
}

/// One rule: which requests it matches and what quota applies to them.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The operation's pairs, in the order the file gives them.
    pub operation: Vec<(String, Pattern)>,
    /// The pairs a request is checked against: `*` pairs left out (they
    /// match anything), exact values first (cheapest, most selective).
    checks: Vec<(String, Pattern)>,
    pub quota: Quota,
    pub actor_field: Option<String>,
    pub label: Option<String>,
    pub comment: Option<String>,
    pub match_policy: MatchPolicy,
    pub algorithm: Algorithm,
    pub origin: RuleOrigin,
    /// The operation as divvy writes it in Redis keys: keys sorted by UTF-16
    /// code units, `k=v` joined by one space.
    pub canonical_operation: Arc<str>,
    /// The rule's index in its rule set.
    pub position: usize,
    /// Identifies this rule's counters (operation, limits, algorithm): rules
    /// that agree on it share counters, and it survives a reload, a restart
    /// and a trip to another cluster node.
    pub counter_id: CounterId,
}

impl Rule {
    /// Does the request match every pair of this rule's operation?
    pub fn matches(&self, request: &Pairs<'_>) -> bool {
        self.checks
            .iter()
            .all(|(key, pattern)| pattern.matches(request.get(key)))
    }

    /// The actor of a request under this rule (`""` without an actor field).
    pub fn actor<'a>(&self, request: &Pairs<'a>) -> &'a str {
        match &self.actor_field {
            Some(field) => request.get(field).unwrap_or(""),
            None => "",
        }
    }

    /// The operation as the section name of an INI file would write it.
    pub fn operation_text(&self) -> String {
        if self.operation.is_empty() {
            return "default".to_string();
        }
        let parts: Vec<String> = self
            .operation
            .iter()
            .map(|(k, p)| format!("{k}={}", p.source()))
            .collect();
        parts.join(" ")
    }
}

/// Fields of a rule as read from a file, before validation.
#[derive(Debug, Clone, Default)]
pub struct RawRule {
    pub operation: Vec<(String, String)>,
    /// `creditLimit` as divvy's `parseInt` read it (`None` is NaN).
    pub credit_limit: Option<i64>,
    pub credit_limit_text: String,
    pub reset_seconds: Option<i64>,
    pub reset_seconds_text: String,
    pub actor_field: Option<String>,
    pub label: Option<String>,
    pub comment: Option<String>,
    pub match_policy: Option<String>,
    pub algorithm: Option<String>,
    pub origin: RuleOrigin,
}

/// Why a configuration could not be loaded. Each message names the rule.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {reason}")]
    Io {
        path: String,
        reason: std::io::Error,
    },
    #[error("{path}: unknown rule file type (expected .ini or .json)")]
    UnknownFormat { path: String },
    #[error("INI syntax error at line {line}, column {column}: {message}")]
    IniSyntax {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("INI key '{key}' at line {line} is outside any section")]
    IniKeyOutsideSection { key: String, line: usize },
    /// Lines rust-ini would misread (see `ini_scan`), every one of them.
    #[error("{}", join(.0))]
    IniMalformed(Vec<Malformed>),
    #[error("rule {rule}: {key} is missing; {found} is not a known key (did you mean '{key}'?)")]
    MisspelledKey {
        rule: String,
        key: &'static str,
        found: String,
    },
    /// `--strict-rules` and keys divvy would have ignored.
    #[error("--strict-rules refuses unknown keys: {}", join(.0))]
    UnknownKeys(Vec<RuleWarning>),
    #[error("JSON error: {0}")]
    Json(String),
    #[error("Config does not define any rules.")]
    NoRules,
    #[error("Config does not define a default rule.")]
    NoDefaultRule,
    #[error("rule {rule} is unreachable: rule {masked_by} matches every request it would match")]
    Unreachable { rule: String, masked_by: String },
    #[error("rule {rule}: creditLimit must be a number >= 0, got '{value}'")]
    BadCreditLimit { rule: String, value: String },
    #[error("rule {rule}: resetSeconds must be a number >= 1 when creditLimit > 0 (0 means always allow), got '{value}'")]
    BadResetSeconds { rule: String, value: String },
    #[error("rule {rule}: label '{label}' must match ^[a-zA-Z0-9_-]{{1,255}}$")]
    BadLabel { rule: String, label: String },
    #[error("rule {rule}: label '{label}' is already used by rule {other}")]
    DuplicateLabel {
        rule: String,
        label: String,
        other: String,
    },
    #[error("rule {rule}: matchPolicy must be 'stop' or 'canary', got '{value}'")]
    BadMatchPolicy { rule: String, value: String },
    #[error("rule {rule}: unknown algorithm '{value}' (expected fixed-window, token-bucket or sliding-window)")]
    BadAlgorithm { rule: String, value: String },
}

fn join<T: fmt::Display>(items: &[T]) -> String {
    let texts: Vec<String> = items.iter().map(ToString::to_string).collect();
    texts.join("; ")
}

impl ConfigError {
    /// The error as one line about the file at `path`: prefixed with the
    /// path unless the message names it already.
    pub fn in_file(&self, path: &Path) -> String {
        match self {
            ConfigError::Io { .. } | ConfigError::UnknownFormat { .. } => self.to_string(),
            _ => format!("{}: {self}", path.display()),
        }
    }
}

/// A validated, ordered list of rules ending in the default rule.
#[derive(Debug, Clone)]
pub struct RuleSet {
    rules: Vec<Rule>,
    /// The rules' matching, compiled once (see [`matcher`]).
    matcher: matcher::Matcher,
    /// Where the rules came from ("embedded default" or a path), for logs.
    pub source: String,
}

impl RuleSet {
    /// Loads and validates a `.ini` or `.json` rule file (its warnings:
    /// [`diagnostics::load_file`]).
    pub fn load_file(path: &Path) -> Result<RuleSet, ConfigError> {
        diagnostics::load_file(path).map(|loaded| loaded.rules)
    }

    /// The example configuration of divvy's README.
    #[allow(clippy::expect_used)] // a constant file, validated by a unit test
    pub fn embedded_default() -> RuleSet {
        let mut set =
            Self::from_ini(EMBEDDED_DEFAULT_INI).expect("the embedded default config is valid");
        set.source = "embedded default".to_string();
        set
    }

    pub fn from_ini(text: &str) -> Result<RuleSet, ConfigError> {
        diagnostics::load_ini(text).map(|loaded| loaded.rules)
    }

    pub fn from_json(text: &str) -> Result<RuleSet, ConfigError> {
        diagnostics::load_json(text).map(|loaded| loaded.rules)
    }

    /// Validates raw rules in order (SPEC §2) and builds the set.
    pub fn from_raw(raw_rules: Vec<RawRule>) -> Result<RuleSet, ConfigError> {
        let mut rules: Vec<Rule> = Vec::with_capacity(raw_rules.len());
        for raw in raw_rules {
            let mut rule = validate_rule(raw, &rules)?;
            rule.position = rules.len();
            rules.push(rule);
        }
        match rules.last() {
            None => return Err(ConfigError::NoRules),
            Some(last) if !last.operation.is_empty() => return Err(ConfigError::NoDefaultRule),
            Some(_) => {}
        }
        Ok(RuleSet {
            matcher: matcher::Matcher::new(&rules),
            rules,
            source: String::new(),
        })
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The rules a request evaluates, in order: every matching canary rule up to
    /// the first matching stop rule, which ends the list. The answer is the
    /// result of the last rule yielded.
    pub fn evaluate<'s, 'r, 'p>(&'s self, request: &'r Pairs<'p>) -> Evaluated<'s, 'r, 'p> {
        Evaluated {
            rules: &self.rules,
            evaluation: self.matcher.start(request),
            done: false,
        }
    }

    /// A stable fingerprint of the rules (for checking that cluster nodes agree).
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        for rule in &self.rules {
            rule.canonical_operation.hash(&mut hasher);
            rule.quota.hash(&mut hasher);
            rule.actor_field.hash(&mut hasher);
            rule.label.hash(&mut hasher);
            (rule.match_policy == MatchPolicy::Canary).hash(&mut hasher);
            rule.algorithm.hash(&mut hasher);
        }
        hasher.finish()
    }
}

/// Iterator over the rules a request evaluates (see [`RuleSet::evaluate`]).
pub struct Evaluated<'s, 'r, 'p> {
    rules: &'s [Rule],
    evaluation: matcher::Evaluation<'s, 'r, 'p>,
    done: bool,
}

impl<'p> Evaluated<'_, '_, 'p> {
    /// The actor of `rule`, one this evaluation yielded: [`Rule::actor`],
    /// from the values already looked up.
    pub fn actor(&self, rule: &Rule) -> &'p str {
        self.evaluation.actor(rule.position)
    }
}

impl<'s> Iterator for Evaluated<'s, '_, '_> {
    type Item = &'s Rule;

    fn next(&mut self) -> Option<&'s Rule> {
        if self.done {
            return None;
        }
        match self.evaluation.next_match() {
            Some((position, stop)) => {
                self.done = stop;
                self.rules.get(position)
            }
            None => {
                self.done = true;
                None
            }
        }
    }
}

/// JavaScript's `parseInt(text, 10)`: optional whitespace and sign, then the
/// leading digits; `None` when there are none (NaN).
pub fn parse_int_prefix(text: &str) -> Option<i64> {
    let t = text.trim_start_matches(crate::protocol::is_whitespace);
    let (negative, digits) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let end = digits.bytes().take_while(u8::is_ascii_digit).count();
    if end == 0 {
        return None;
    }
    // Saturate absurdly long numbers rather than fail: they are still "a number".
    let magnitude = digits[..end].parse::<i64>().unwrap_or(i64::MAX);
    Some(if negative { -magnitude } else { magnitude })
}

fn label_is_valid(label: &str) -> bool {
    (1..=255).contains(&label.len())
        && label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Compares strings by UTF-16 code units, as JavaScript's default sort does.
fn cmp_utf16(a: &str, b: &str) -> std::cmp::Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

fn canonical_operation(operation: &[(String, String)]) -> String {
    let mut sorted: Vec<&(String, String)> = operation.iter().collect();
    sorted.sort_by(|a, b| cmp_utf16(&a.0, &b.0));
    let parts: Vec<String> = sorted.iter().map(|(k, v)| format!("{k}={v}")).collect();
    parts.join(" ")
}

fn validate_rule(raw: RawRule, earlier: &[Rule]) -> Result<Rule, ConfigError> {
    let name = raw.origin.to_string();

    // 1. Unreachable: the new operation, read as a request, matched by an earlier stop rule.
    {
        let as_request = Pairs::from_slice(
            &raw.operation
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect::<Vec<_>>(),
        );
        if let Some(mask) = earlier
            .iter()
            .find(|r| r.match_policy == MatchPolicy::Stop && r.matches(&as_request))
        {
            return Err(ConfigError::Unreachable {
                rule: name,
                masked_by: mask.origin.to_string(),
            });
        }
    }

    // 2. creditLimit >= 0.
    let credit_limit = match raw.credit_limit {
        Some(n) if n >= 0 => n as u64,
        _ => {
            return Err(ConfigError::BadCreditLimit {
                rule: name,
                value: raw.credit_limit_text,
            })
        }
    };

    // 3. resetSeconds >= 1 when creditLimit > 0; 0 means always allow (SPEC §9).
    let quota = if credit_limit == 0 {
        Quota::AlwaysDeny
    } else {
        match raw.reset_seconds {
            Some(0) => Quota::AlwaysAllow { credit_limit },
            Some(n) if n >= 1 => Quota::Limited {
                credit_limit,
                reset_seconds: n as u64,
            },
            _ => {
                return Err(ConfigError::BadResetSeconds {
                    rule: name,
                    value: raw.reset_seconds_text,
                })
            }
        }
    };

    // 4. label: a slug, unique.
    if let Some(label) = &raw.label {
        if !label_is_valid(label) {
            return Err(ConfigError::BadLabel {
                rule: name,
                label: label.clone(),
            });
        }
        if let Some(other) = earlier.iter().find(|r| r.label.as_deref() == Some(label)) {
            return Err(ConfigError::DuplicateLabel {
                rule: name,
                label: label.clone(),
                other: other.origin.to_string(),
            });
        }
    }

    // 5. matchPolicy: stop or canary.
    let match_policy = match raw.match_policy.as_deref() {
        None | Some("stop") => MatchPolicy::Stop,
        Some("canary") => MatchPolicy::Canary,
        Some(other) => {
            return Err(ConfigError::BadMatchPolicy {
                rule: name,
                value: other.to_string(),
            })
        }
    };

    let algorithm = match raw.algorithm.as_deref() {
        None => Algorithm::default(),
        Some(text) => Algorithm::parse(text).ok_or_else(|| ConfigError::BadAlgorithm {
            rule: name.clone(),
            value: text.to_string(),
        })?,
    };

    let canonical = canonical_operation(&raw.operation);
    // Only limited rules count; the others get an id that no counter uses.
    let (limit, period_ms) = match quota {
        Quota::Limited {
            credit_limit,
            reset_seconds,
        } => (credit_limit, reset_seconds.saturating_mul(1000)),
        Quota::AlwaysAllow { credit_limit } => (credit_limit, 0),
        Quota::AlwaysDeny => (0, 0),
    };
    let counter_id = CounterId::of(&canonical, limit, period_ms, algorithm.as_str());

    let operation: Vec<(String, Pattern)> = raw
        .operation
        .into_iter()
        .map(|(k, v)| {
            let pattern = Pattern::new(&v);
            (k, pattern)
        })
        .collect();
    let mut checks: Vec<(String, Pattern)> = operation
        .iter()
        .filter(|(_, pattern)| *pattern != Pattern::Any)
        .cloned()
        .collect();
    checks.sort_by_key(|(_, pattern)| !matches!(pattern, Pattern::Exact(_)));

    Ok(Rule {
        operation,
        checks,
        quota,
        actor_field: raw.actor_field,
        label: raw.label,
        comment: raw.comment,
        match_policy,
        algorithm,
        origin: raw.origin,
        canonical_operation: canonical.into(),
        position: 0,
        counter_id,
    })
}

#[cfg(test)]
mod tests;
