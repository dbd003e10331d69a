//! Rule matching compiled once per rule set: every key a rule checks gets a
//! number, a request's values are looked up once per key (not once per rule
//! and check), and, in larger rule sets, an index on the key most rules check
//! for an exact value jumps straight to the rules a request can match.
//!
//! The order of evaluation is the rule order, always: the index only leaves
//! out rules that cannot match (their exact value for the indexed key
//! differs from the request's).

use super::{MatchPolicy, Pattern, Rule};
use crate::protocol::Pairs;
use smallvec::SmallVec;
use std::collections::HashMap;

/// Rule sets at least this long get an index on their most checked key...
const INDEX_RULES_MIN: usize = 8;
/// ...when at least this many rules ask for an exact value of it.
const INDEX_EXACT_RULES_MIN: usize = 4;

/// One check of a compiled rule: the key's number and what its value must be.
#[derive(Debug, Clone)]
struct Check {
    key: usize,
    pattern: Pattern,
}

#[derive(Debug, Clone)]
struct CompiledRule {
    checks: Box<[Check]>,
    stop: bool,
}

/// Rules that can match a request, by its value of one key.
#[derive(Debug, Clone)]
struct Index {
    key: usize,
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
    /// Every key a rule checks, once, numbered by position.
    keys: Box<[Box<str>]>,
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
        let mut keys: Vec<Box<str>> = Vec::new();
        let compiled: Box<[CompiledRule]> = rules
            .iter()
            .map(|rule| CompiledRule {
                checks: rule
                    .checks
                    .iter()
                    .map(|(key, pattern)| Check {
                        key: match keys.iter().position(|k| **k == **key) {
                            Some(at) => at,
                            None => {
                                keys.push(key.as_str().into());
                                keys.len() - 1
                            }
                        },
                        pattern: pattern.clone(),
                    })
                    .collect(),
                stop: rule.match_policy == MatchPolicy::Stop,
            })
            .collect();
        let index = (rules.len() >= index_rules_min)
            .then(|| Self::build_index(&compiled, keys.len()))
            .flatten();
        Matcher {
            keys: keys.into(),
            rules: compiled,
            index,
        }
    }

    /// The exact value a rule asks for `key`, if it asks for one.
    fn exact_value(rule: &CompiledRule, key: usize) -> Option<&str> {
        rule.checks.iter().find_map(|check| match &check.pattern {
            Pattern::Exact(value) if check.key == key => Some(value.as_str()),
            _ => None,
        })
    }

    /// An index on the key most rules ask an exact value of, when enough do
    /// for the index to prune anything.
    fn build_index(rules: &[CompiledRule], key_count: usize) -> Option<Index> {
        let (key, exact_rules) = (0..key_count)
            .map(|key| {
                let n = rules
                    .iter()
                    .filter(|r| Self::exact_value(r, key).is_some())
                    .count();
                (key, n)
            })
            .max_by_key(|&(key, n)| (n, std::cmp::Reverse(key)))?;
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
            key,
            by_value: by_value
                .into_iter()
                .map(|(value, positions)| (value, positions.into()))
                .collect(),
            otherwise: otherwise.into(),
        })
    }

    /// The number of `key` among the checked keys.
    fn key_number(&self, key: &str) -> Option<usize> {
        self.keys
            .iter()
            .position(|k| short_eq(k.as_bytes(), key.as_bytes()))
    }

    /// Starts evaluating a request: its value of every checked key, and the
    /// rules to try.
    pub(super) fn start<'s, 'p>(&'s self, request: &Pairs<'p>) -> Evaluation<'s, 'p> {
        let mut values: SmallVec<[Option<&'p str>; 8]> = SmallVec::from_elem(None, self.keys.len());
        for (key, value) in request.iter() {
            if let Some(number) = self.key_number(key) {
                // Pairs in order: a key given twice keeps its last value.
                values[number] = Some(value);
            }
        }
        let candidates = match &self.index {
            Some(index) => Candidates::Merged {
                exact: values[index.key]
                    .and_then(|value| index.by_value.get(value))
                    .map_or(&[][..], |positions| &positions[..])
                    .iter()
                    .peekable(),
                otherwise: index.otherwise.iter().peekable(),
            },
            None => Candidates::All(0..self.rules.len()),
        };
        Evaluation {
            matcher: self,
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
pub(super) struct Evaluation<'s, 'p> {
    matcher: &'s Matcher,
    values: SmallVec<[Option<&'p str>; 8]>,
    candidates: Candidates<'s>,
}

impl Evaluation<'_, '_> {
    /// The position of the next matching rule and whether it stops the
    /// search.
    pub(super) fn next_match(&mut self) -> Option<(usize, bool)> {
        loop {
            let position = self.candidates.next()?;
            let rule = &self.matcher.rules[position];
            let matches = rule
                .checks
                .iter()
                .all(|check| check.pattern.matches(self.values[check.key]));
            if matches {
                return Some((position, rule.stop));
            }
        }
    }
}

/// Byte equality for the short strings of keys: lengths first, then the
/// bytes without a library call when they fit two overlapping words.
fn short_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let n = a.len();
    let word = |s: &[u8], at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&s[at..at + 8]);
        u64::from_le_bytes(w)
    };
    match n {
        0 => true,
        1..=3 => a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1],
        4..=7 => {
            let half = |s: &[u8], at: usize| {
                let mut w = [0u8; 4];
                w.copy_from_slice(&s[at..at + 4]);
                u32::from_le_bytes(w)
            };
            half(a, 0) == half(b, 0) && half(a, n - 4) == half(b, n - 4)
        }
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::parse_line;
    use crate::rules::RuleSet;
    use proptest::prelude::*;

    #[test]
    fn short_eq_is_equality() {
        let words: Vec<Vec<u8>> = (0..20)
            .flat_map(|n| {
                let base: Vec<u8> = (0..n).map(|i| b'a' + i as u8).collect();
                let mut variants = vec![base.clone()];
                for i in 0..n {
                    let mut v = base.clone();
                    v[i] ^= 1;
                    variants.push(v);
                }
                variants
            })
            .collect();
        for a in &words {
            for b in &words {
                assert_eq!(short_eq(a, b), a == b, "{a:?} {b:?}");
            }
        }
    }

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
                "[k{}={value}{other}]\ncreditLimit=1\nresetSeconds=1\nlabel=r{i}\n",
                key % 3
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
            let evaluated: Vec<usize> = set.evaluate(&command.pairs).map(|r| r.position).collect();
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
