//! Rule matching compiled once per rule set. Every key a rule checks (or
//! takes its actor from) gets a number; a request's pairs are looked up once
//! per request, not once per rule and check; each rule keeps only the checks
//! that can fail (`*` pairs left out, exact values first), compared without
//! library calls. In larger rule sets, an index on the key most rules ask an
//! exact value of jumps straight to the rules a request can match.
//!
//! The order of evaluation is the rule order, always: the index only leaves
//! out rules that cannot match (their exact value for the indexed key
//! differs from the request's).

use super::{MatchPolicy, Pattern, Rule};
use crate::protocol::{short_words as words, Pairs};
use std::collections::HashMap;

/// Rule sets at least this long get an index on their most checked key...
const INDEX_RULES_MIN: usize = 8;
/// ...when at least this many rules ask for an exact value of it.
const INDEX_EXACT_RULES_MIN: usize = 4;
/// Keys whose values are looked up once per request; a rule set naming more
/// looks the others up when a check needs them.
const RESOLVED_KEYS_MAX: usize = 16;
/// "The request does not have this key", among pair positions.
const ABSENT: u16 = u16::MAX;

/// A string compared many times: up to 16 bytes it is also kept as two
/// words of overlapping loads ([`words`]), so that comparing it with
/// another string of its length is comparing two words.
#[derive(Debug, Clone)]
struct Text {
    bytes: Box<[u8]>,
    words: Option<(u64, u64)>,
}

impl Text {
    fn new(text: &str) -> Text {
        Text {
            bytes: text.as_bytes().into(),
            words: words(text.as_bytes()),
        }
    }

    #[inline(always)]
    fn eq(&self, other: &[u8]) -> bool {
        if other.len() != self.bytes.len() {
            return false;
        }
        match self.words {
            Some(mine) => words(other) == Some(mine),
            None => *self.bytes == *other,
        }
    }
}

/// What a check asks of a value (`*` checks are left out at compile time).
#[derive(Debug, Clone)]
enum Test {
    Exact(Text),
    /// A glob: the prefix, then the pieces of `pattern` in order.
    Glob {
        prefix: Text,
        pattern: Pattern,
    },
}

impl Test {
    fn new(pattern: &Pattern) -> Test {
        match pattern {
            Pattern::Glob { prefix, .. } => Test::Glob {
                prefix: Text::new(prefix),
                pattern: pattern.clone(),
            },
            other => Test::Exact(Text::new(other.source())),
        }
    }

    /// Does the request's value pass (`None`: the key is absent, which no
    /// exact value or glob matches)?
    #[inline(always)]
    fn passes(&self, value: Option<&str>) -> bool {
        let Some(value) = value else { return false };
        let value = value.as_bytes();
        match self {
            Test::Exact(text) => text.eq(value),
            Test::Glob { prefix, pattern } => {
                let n = prefix.bytes.len();
                value.len() >= n
                    && prefix.eq(&value[..n])
                    && match pattern {
                        Pattern::Glob { pieces, .. } => {
                            pieces.is_empty() || super::pattern::pieces_match(pieces, &value[n..])
                        }
                        _ => true,
                    }
            }
        }
    }
}

/// A key a check reads: one of the resolved keys, or (past
/// [`RESOLVED_KEYS_MAX`]) a name to look up.
#[derive(Debug, Clone)]
enum KeyRef {
    Resolved(usize),
    Named(Box<str>),
}

#[derive(Debug, Clone)]
struct CompiledRule {
    /// The request's key and what its value must be.
    checks: Box<[(KeyRef, Test)]>,
    /// Where the rule's actor comes from.
    actor: Option<KeyRef>,
    stop: bool,
}

/// Rules that can match a request, by its value of one key.
#[derive(Debug, Clone)]
struct Index {
    key: Box<str>,
    /// For each value some rule asks for exactly: the positions of the rules
    /// that ask for it, in order.
    by_value: HashMap<Box<str>, Box<[u32]>, ahash::RandomState>,
    /// The positions of the rules that do not ask for an exact value of the
    /// key, in order: a request may match them whatever its value.
    otherwise: Box<[u32]>,
}

/// A rule set's matching, compiled.
#[derive(Debug, Clone)]
pub(super) struct Matcher {
    /// The resolved keys, by number.
    keys: Box<[Text]>,
    rules: Box<[CompiledRule]>,
    index: Option<Index>,
}

impl Matcher {
    pub(super) fn new(rules: &[Rule]) -> Matcher {
        Self::build(rules, INDEX_RULES_MIN)
    }

    /// Compiles `rules`, with an index when there are at least
    /// `index_rules_min` of them.
    fn build(rules: &[Rule], index_rules_min: usize) -> Matcher {
        let mut keys: Vec<Text> = Vec::new();
        let mut key_ref = |key: &str| match keys.iter().position(|k| k.eq(key.as_bytes())) {
            Some(number) => KeyRef::Resolved(number),
            None if keys.len() < RESOLVED_KEYS_MAX => {
                keys.push(Text::new(key));
                KeyRef::Resolved(keys.len() - 1)
            }
            None => KeyRef::Named(key.into()),
        };
        let compiled: Box<[CompiledRule]> = rules
            .iter()
            .map(|rule| CompiledRule {
                checks: rule
                    .checks
                    .iter()
                    .map(|(key, pattern)| (key_ref(key), Test::new(pattern)))
                    .collect(),
                actor: rule.actor_field.as_deref().map(&mut key_ref),
                stop: rule.match_policy == MatchPolicy::Stop,
            })
            .collect();
        let index = (rules.len() >= index_rules_min)
            .then(|| Self::build_index(rules))
            .flatten();
        Matcher {
            keys: keys.into(),
            rules: compiled,
            index,
        }
    }

    /// The exact value a rule asks for `key`, if it asks for one.
    fn exact_value<'r>(rule: &'r Rule, key: &str) -> Option<&'r str> {
        rule.checks.iter().find_map(|(k, pattern)| match pattern {
            Pattern::Exact(value) if *k == *key => Some(value.as_str()),
            _ => None,
        })
    }

    /// An index on the key most rules ask an exact value of, when enough do
    /// for the index to prune anything.
    fn build_index(rules: &[Rule]) -> Option<Index> {
        let mut exact_counts: HashMap<&str, usize> = HashMap::new();
        for rule in rules {
            for (key, pattern) in rule.checks.iter() {
                if matches!(pattern, Pattern::Exact(_)) {
                    *exact_counts.entry(key).or_default() += 1;
                }
            }
        }
        let (key, exact_rules) = exact_counts
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(a.0)))?;
        if exact_rules < INDEX_EXACT_RULES_MIN {
            return None;
        }
        let mut by_value: HashMap<Box<str>, Vec<u32>, ahash::RandomState> = HashMap::default();
        let mut otherwise = Vec::new();
        for (position, rule) in rules.iter().enumerate() {
            let position = u32::try_from(position).ok()?;
            match Self::exact_value(rule, key) {
                Some(value) => by_value.entry(value.into()).or_default().push(position),
                None => otherwise.push(position),
            }
        }
        Some(Index {
            key: key.into(),
            by_value: by_value
                .into_iter()
                .map(|(value, positions)| (value, positions.into()))
                .collect(),
            otherwise: otherwise.into(),
        })
    }

    /// Starts evaluating a request: where its value of each resolved key is,
    /// and the rules to try.
    pub(super) fn start<'s, 'r, 'p>(&'s self, request: &'r Pairs<'p>) -> Evaluation<'s, 'r, 'p> {
        let mut values = [ABSENT; RESOLVED_KEYS_MAX];
        for (position, (key, _)) in request.iter().enumerate() {
            let Ok(position) = u16::try_from(position) else {
                break; // Beyond 65,535 pairs (line limits forbid it): keep the first ones.
            };
            let key = key.as_bytes();
            let key_words = words(key);
            let found = self.keys.iter().position(|k| {
                k.bytes.len() == key.len()
                    && match (k.words, key_words) {
                        (Some(a), Some(b)) => a == b,
                        _ => *k.bytes == *key,
                    }
            });
            if let Some(number) = found {
                // Pairs in order: a key given twice keeps its last value.
                values[number] = position;
            }
        }
        let candidates = match &self.index {
            Some(index) => Candidates::Merged {
                exact: request
                    .get(&index.key)
                    .and_then(|value| index.by_value.get(value))
                    .map_or(&[][..], |positions| &positions[..])
                    .iter()
                    .peekable(),
                otherwise: index.otherwise.iter().peekable(),
            },
            None => Candidates::All(0..self.rules.len()),
        };
        Evaluation {
            rules: &self.rules,
            request,
            values,
            candidates,
        }
    }
}

enum Candidates<'s> {
    All(std::ops::Range<usize>),
    /// Two lists of positions, each in order, merged in order: the rules
    /// asking for the request's value of the indexed key, and those asking
    /// for no exact value of it.
    Merged {
        exact: std::iter::Peekable<std::slice::Iter<'s, u32>>,
        otherwise: std::iter::Peekable<std::slice::Iter<'s, u32>>,
    },
}

impl Iterator for Candidates<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        match self {
            Candidates::All(range) => range.next(),
            Candidates::Merged { exact, otherwise } => {
                let next = match (exact.peek(), otherwise.peek()) {
                    (Some(a), Some(b)) if a < b => exact.next(),
                    (Some(_), Some(_)) | (None, _) => otherwise.next(),
                    (Some(_), None) => exact.next(),
                };
                next.map(|&position| position as usize)
            }
        }
    }
}

/// A request being evaluated (see [`super::RuleSet::evaluate`]).
pub(super) struct Evaluation<'s, 'r, 'p> {
    rules: &'s [CompiledRule],
    request: &'r Pairs<'p>,
    /// The position among the request's pairs of each resolved key's value.
    values: [u16; RESOLVED_KEYS_MAX],
    candidates: Candidates<'s>,
}

impl<'p> Evaluation<'_, '_, 'p> {
    /// The request's value of `key`.
    fn value(&self, key: &KeyRef) -> Option<&'p str> {
        match key {
            KeyRef::Resolved(number) => match self.values.get(*number) {
                Some(&ABSENT) | None => None,
                Some(&position) => self.request.value_at(usize::from(position)),
            },
            KeyRef::Named(name) => self.request.get(name),
        }
    }

    /// The position of the next matching rule and whether it stops the
    /// search.
    pub(super) fn next_match(&mut self) -> Option<(usize, bool)> {
        loop {
            let position = self.candidates.next()?;
            let rule = self.rules.get(position)?;
            let matches = rule
                .checks
                .iter()
                .all(|(key, test)| test.passes(self.value(key)));
            if matches {
                return Some((position, rule.stop));
            }
        }
    }

    /// The actor of the rule at `position` (`""` without an actor field or
    /// value), as [`Rule::actor`] gives it.
    pub(super) fn actor(&self, position: usize) -> &'p str {
        self.rules
            .get(position)
            .and_then(|rule| rule.actor.as_ref())
            .and_then(|key| self.value(key))
            .unwrap_or("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::parse_line;
    use crate::rules::RuleSet;
    use proptest::prelude::*;

    /// Rules over few keys and values, so that requests often match (and
    /// few rules mask later ones, which loading refuses).
    fn rule_set(rules: &[(u8, u8, u8, bool)]) -> Option<RuleSet> {
        let mut ini = String::new();
        for (i, &(key, value, shape, canary)) in rules.iter().enumerate() {
            let value = match shape % 8 {
                0 => "*".to_string(),
                1 => format!("v{}*", value % 2),
                _ => format!("v{value}"),
            };
            let other = if shape >= 8 {
                format!(" k{}=v{}", (key + 1) % 3, shape % 3)
            } else {
                String::new()
            };
            ini.push_str(&format!(
                "[k{}={value}{other}]\ncreditLimit=1\nresetSeconds=1\nlabel=r{i}\nactorField=k{}\n",
                key % 3,
                (key + shape) % 4
            ));
            if canary {
                ini.push_str("matchPolicy=canary\n");
            }
        }
        ini.push_str("[default]\ncreditLimit=1\nresetSeconds=1\n");
        RuleSet::from_ini(&ini).ok()
    }

    proptest! {
        /// The compiled matcher, indexed or not, evaluates exactly the rules
        /// that trying each rule in order would.
        #[test]
        fn compiled_matching_agrees_with_trying_every_rule(
            rules in proptest::collection::vec((0u8..3, 0u8..6, 0u8..16, any::<bool>()), 0..24),
            request in proptest::collection::vec((0u8..4, 0u8..6), 0..5),
        ) {
            let Some(set) = rule_set(&rules) else { return Ok(()) };
            let mut line = String::from("HIT");
            for (k, v) in &request {
                line.push_str(&format!(" k{k}=v{v}"));
            }
            let command = parse_line(&line).unwrap();
            let mut naive = Vec::new();
            for rule in set.rules() {
                if rule.matches(&command.pairs) {
                    naive.push(rule.position);
                    if rule.match_policy == MatchPolicy::Stop {
                        break;
                    }
                }
            }
            let mut evaluated = Vec::new();
            let mut evaluation = set.evaluate(&command.pairs);
            while let Some(rule) = evaluation.next() {
                prop_assert_eq!(evaluation.actor(rule), rule.actor(&command.pairs));
                evaluated.push(rule.position);
            }
            prop_assert_eq!(&evaluated, &naive);
            for index_rules_min in [0, usize::MAX] {
                let matcher = Matcher::build(set.rules(), index_rules_min);
                let mut evaluation = matcher.start(&command.pairs);
                let mut positions = Vec::new();
                while let Some((position, stop)) = evaluation.next_match() {
                    positions.push(position);
                    if stop {
                        break;
                    }
                }
                prop_assert_eq!(&positions, &naive);
            }
        }
    }
}
