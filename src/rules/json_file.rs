//! Reading divvy's JSON rule files with serde: `{"overrides": [rule, …],
//! "default": rule}`, the default appended last. Non-string operation values
//! become their JSON text, as divvy's JavaScript did. Keys divvy ignored
//! are ignored too, each with a warning naming its rule.

use super::diagnostics::{RuleWarning, JSON_FILE_KEYS, JSON_RULE_KEYS};
use super::{parse_int_prefix, ConfigError, RawRule, RuleOrigin};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;

#[derive(Deserialize)]
struct File {
    #[serde(default)]
    overrides: Vec<JsonRule>,
    default: Option<JsonRule>,
    /// Keys we do not know are ignored, as divvy did, with a warning.
    #[serde(flatten)]
    unknown: BTreeMap<String, Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonRule {
    #[serde(default)]
    operation: serde_json::Map<String, Value>,
    #[serde(default)]
    credit_limit: Value,
    #[serde(default)]
    reset_seconds: Value,
    #[serde(default)]
    actor_field: Option<String>,
    #[serde(default)]
    label: Option<String>,
    #[serde(default)]
    comment: Option<String>,
    #[serde(default)]
    match_policy: Option<String>,
    #[serde(default)]
    algorithm: Option<String>,
    /// Fields we do not know are ignored, as divvy did, with a warning.
    #[serde(flatten)]
    unknown: BTreeMap<String, Value>,
}

/// A JSON value as text: strings as themselves, anything else as JSON.
fn text_of(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A whole number from a JSON number or a numeric string; `None` otherwise
/// (fractions included: quotas count whole hits).
fn integer_of(value: &Value) -> Option<i64> {
    match value {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => parse_int_prefix(s),
        _ => None,
    }
}

impl JsonRule {
    fn into_raw(self, index: Option<usize>, warnings: &mut Vec<RuleWarning>) -> RawRule {
        let origin = RuleOrigin::Json { index };
        warnings.extend(
            self.unknown
                .keys()
                .map(|key| RuleWarning::new(Some(origin.clone()), None, key, &JSON_RULE_KEYS)),
        );
        RawRule {
            operation: self
                .operation
                .iter()
                .map(|(k, v)| (k.clone(), text_of(v)))
                .collect(),
            credit_limit: integer_of(&self.credit_limit),
            credit_limit_text: text_of(&self.credit_limit),
            reset_seconds: integer_of(&self.reset_seconds),
            reset_seconds_text: text_of(&self.reset_seconds),
            actor_field: self.actor_field.filter(|f| !f.is_empty()),
            label: self.label,
            comment: self.comment,
            match_policy: self.match_policy,
            algorithm: self.algorithm,
            origin,
        }
    }
}

/// The rules of a JSON file, in order, and a warning per unknown key.
pub fn read(text: &str) -> Result<(Vec<RawRule>, Vec<RuleWarning>), ConfigError> {
    let file: File = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
    let mut warnings: Vec<RuleWarning> = file
        .unknown
        .keys()
        .map(|key| RuleWarning::new(None, None, key, &JSON_FILE_KEYS))
        .collect();
    let mut rules: Vec<RawRule> = file
        .overrides
        .into_iter()
        .enumerate()
        .map(|(i, rule)| rule.into_raw(Some(i), &mut warnings))
        .collect();
    if let Some(default) = file.default {
        rules.push(default.into_raw(None, &mut warnings));
    }
    Ok((rules, warnings))
}
