//! One value of a rule's operation: `*` (anything, even absent), a glob with
//! `*` wildcards anchored at the start of the value only, or an exact string.

use crate::protocol::bytes_eq;
use memchr::memmem::Finder;

/// How a rule's value matches a request's value (SPEC §3).
#[derive(Debug, Clone)]
pub enum Pattern {
    /// `*`: matches any value, including a missing key.
    Any,
    /// A value containing `*` elsewhere: the literal text before the first
    /// star must start the value; each later non-empty piece must follow, in
    /// order (searched with a precomputed finder).
    Glob {
        prefix: String,
        pieces: Vec<Finder<'static>>,
        source: String,
    },
    /// Any other value: equality, case-sensitive.
    Exact(String),
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Pattern) -> bool {
        self.source() == other.source()
    }
}

impl Eq for Pattern {}

impl Pattern {
    pub fn new(value: &str) -> Pattern {
        if value == "*" {
            Pattern::Any
        } else if let Some((prefix, rest)) = value.split_once('*') {
            Pattern::Glob {
                prefix: prefix.to_owned(),
                pieces: rest
                    .split('*')
                    .filter(|piece| !piece.is_empty())
                    .map(|piece| Finder::new(piece).into_owned())
                    .collect(),
                source: value.to_owned(),
            }
        } else {
            Pattern::Exact(value.to_owned())
        }
    }

    /// The value as written in the rule file.
    pub fn source(&self) -> &str {
        match self {
            Pattern::Any => "*",
            Pattern::Glob { source, .. } => source,
            Pattern::Exact(value) => value,
        }
    }

    /// Does this pattern accept the request's value (`None`: key absent)?
    pub fn matches(&self, value: Option<&str>) -> bool {
        match (self, value) {
            (Pattern::Any, _) => true,
            (_, None) => false,
            (Pattern::Exact(expected), Some(value)) => {
                bytes_eq(expected.as_bytes(), value.as_bytes())
            }
            (Pattern::Glob { prefix, pieces, .. }, Some(value)) => {
                glob_matches(prefix, pieces, value)
            }
        }
    }
}

/// Start-anchored glob: leftmost matching of each piece in turn is optimal
/// because nothing anchors the end.
fn glob_matches(prefix: &str, pieces: &[Finder<'static>], value: &str) -> bool {
    let (value, prefix) = (value.as_bytes(), prefix.as_bytes());
    if value.len() < prefix.len() || !bytes_eq(&value[..prefix.len()], prefix) {
        return false;
    }
    pieces_match(pieces, &value[prefix.len()..])
}

/// Do the glob's pieces follow each other, in order, in `remaining` (the
/// value after the glob's prefix)?
pub(super) fn pieces_match(pieces: &[Finder<'static>], mut remaining: &[u8]) -> bool {
    for piece in pieces {
        match piece.find(remaining) {
            Some(at) => remaining = &remaining[at + piece.needle().len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pattern: &str, value: Option<&str>) -> bool {
        Pattern::new(pattern).matches(value)
    }

    #[test]
    fn star_matches_anything_even_absent() {
        assert!(m("*", Some("x")));
        assert!(m("*", Some("")));
        assert!(m("*", None));
    }

    #[test]
    fn globs_are_start_anchored_only() {
        assert!(m("/pantry/*", Some("/pantry/cookiesXYZ")));
        assert!(m("/pantry/*", Some("/pantry/")));
        assert!(!m("/pantry/*", Some("/pan")));
        assert!(!m("/pantry/*", Some("x/pantry/a")));
        assert!(m("/resource/*/first", Some("/resource/a/first-and-more")));
        assert!(m("/resource/*/first", Some("/resource/a/b/first")));
        assert!(!m("/resource/*/first", Some("/resource/a/second")));
        assert!(m("a**b", Some("axxb")));
        assert!(m("*x", Some("abcx")));
        assert!(!m("/pantry/*", None), "a glob never matches a missing key");
    }

    #[test]
    fn other_characters_are_literal() {
        assert!(m("a?.[*", Some("a?.[z")));
        assert!(!m("a?.[*", Some("ab.[z")));
        assert!(m("GET", Some("GET")));
        assert!(!m("GET", Some("get")));
        assert!(!m("GET", None));
    }
}
