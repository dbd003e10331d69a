//! The line-by-line pre-pass over an INI rule file, run before rust-ini
//! reads it. rust-ini lets one broken line swallow the next ones: a section
//! header without its `]`, a key line without `=`, a quote left open or a
//! trailing `\` all run on into the following lines, and an indented comment
//! is read as a key. This pass finds every such line (so that `check-config`
//! can name them all, with their line numbers, and `serve` can refuse the
//! file), records each section and key with its line (rust-ini keeps no
//! positions), and hands rust-ini the text with each line's leading blanks
//! removed, which is what the SPEC means by "first non-blank character".
//! Values are still read by rust-ini alone; a property test checks that
//! whatever this pass accepts, rust-ini reads into exactly the sections and
//! keys recorded here.

use std::fmt;

/// A key as the pre-pass found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedKey {
    pub key: String,
    /// 1-based.
    pub line: usize,
}

/// A section header and the keys under it, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedSection {
    /// The name between the brackets, trimmed (as rust-ini trims it).
    pub name: String,
    pub line: usize,
    pub keys: Vec<ScannedKey>,
}

/// What the pre-pass found in a file.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    /// Keys before the first section header.
    pub top_level: Vec<ScannedKey>,
    pub sections: Vec<ScannedSection>,
    pub malformed: Vec<Malformed>,
    /// The text rust-ini is to read: every line without its leading blanks.
    pub normalized: String,
}

/// A line rust-ini would misread, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    pub line: usize,
    pub problem: Problem,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// `[name` with no `]` on the line.
    UnclosedSection(String),
    /// `[name] text`: something other than a comment after the `]`.
    TextAfterSection { section: String, text: String },
    /// A line that is not a section, a comment or `key = value`.
    NotKeyValue(String),
    /// `= value`.
    MissingKey(String),
    /// A value whose quote is not closed on its line.
    UnclosedQuote { key: String, quote: char },
    /// A line ending in `\`, which rust-ini continues on the next line.
    Continuation(String),
    /// A carriage return not followed by a line feed.
    StrayCarriageReturn,
}

/// At most this many characters of a line are quoted in a message.
const QUOTED_CHARS_MAX: usize = 60;

fn quoted(text: &str) -> String {
    let mut chars = text.chars();
    let head: String = chars.by_ref().take(QUOTED_CHARS_MAX).collect();
    if chars.next().is_some() {
        format!("{head}…")
    } else {
        head
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::UnclosedSection(text) => write!(
                f,
                "section header '{}' is not closed (missing ']')",
                quoted(text)
            ),
            Problem::TextAfterSection { section, text } => write!(
                f,
                "unexpected '{}' after the section header [{}] (a comment starts with # or ;)",
                quoted(text),
                quoted(section)
            ),
            Problem::NotKeyValue(text) => write!(
                f,
                "'{}' is neither a [section] header, a comment nor a key = value line",
                quoted(text)
            ),
            Problem::MissingKey(text) => write!(f, "'{}' has no key before '='", quoted(text)),
            Problem::UnclosedQuote { key, quote } => write!(
                f,
                "the value of '{}' opens a quote ({quote}) that is not closed on its line",
                quoted(key)
            ),
            Problem::Continuation(text) => write!(
                f,
                "'{}' ends with '\\', which would continue it on the next line",
                quoted(text)
            ),
            Problem::StrayCarriageReturn => {
                f.write_str("a carriage return (\\r) in the middle of the line")
            }
        }
    }
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.problem)
    }
}

/// Blanks at the start of a line (rust-ini reads an indented comment as a key).
fn is_blank(c: char) -> bool {
    c != '\n' && c != '\r' && c.is_whitespace()
}

/// Where `stop` first occurs in `text` outside a backslash pair (rust-ini
/// keeps `\x` as two characters, so `\]` does not end a section name), or
/// `Err(())` when the text ends in a lone backslash (a continuation).
fn find_unescaped(text: &str, stop: impl Fn(char) -> bool) -> Result<Option<usize>, ()> {
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        if c == '\\' {
            if chars.next().is_none() {
                return Err(());
            }
        } else if stop(c) {
            return Ok(Some(i));
        }
    }
    Ok(None)
}

/// Checks a value as rust-ini's `parse_val` reads it: quoted parts must
/// close on the line, and the unquoted rest must not end in `\` (before an
/// inline comment, which starts at a blank followed by `#` or `;`).
fn check_value(value: &str, key: &str) -> Option<Problem> {
    let mut rest = value.trim_start_matches(|c: char| c == ' ' || c == '\t' || is_blank(c));
    while let Some(quote) = rest.chars().next().filter(|c| *c == '"' || *c == '\'') {
        match find_unescaped(&rest[1..], |c| c == quote) {
            Ok(Some(end)) => rest = &rest[1 + end + 1..],
            Ok(None) | Err(()) => {
                return Some(Problem::UnclosedQuote {
                    key: key.to_owned(),
                    quote,
                })
            }
        }
    }
    let mut chars = rest.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' if matches!(chars.peek(), Some('#' | ';')) => return None,
            '\\' if chars.next().is_none() => {
                return Some(Problem::Continuation(format!("{key} ={value}")));
            }
            _ => {}
        }
    }
    None
}

/// What one line holds, once its leading blanks are gone.
enum Line {
    Empty,
    Section(String),
    Key(String),
}

fn classify(content: &str) -> Result<Line, Problem> {
    if content.is_empty() || content.starts_with(['#', ';']) {
        return Ok(Line::Empty);
    }
    if content.contains('\r') {
        return Err(Problem::StrayCarriageReturn);
    }
    if let Some(header) = content.strip_prefix('[') {
        let close = match find_unescaped(header, |c| c == ']') {
            Ok(Some(close)) => close,
            Ok(None) => return Err(Problem::UnclosedSection(content.to_owned())),
            Err(()) => return Err(Problem::Continuation(content.to_owned())),
        };
        let name = header[..close].trim().to_owned();
        let after = header[close + 1..].trim_start_matches(is_blank);
        if !after.is_empty() && !after.starts_with(['#', ';']) {
            return Err(Problem::TextAfterSection {
                section: name,
                text: after.to_owned(),
            });
        }
        return Ok(Line::Section(name));
    }
    match find_unescaped(content, |c| c == '=' || c == ':') {
        Err(()) => Err(Problem::Continuation(content.to_owned())),
        Ok(None) => Err(Problem::NotKeyValue(content.to_owned())),
        Ok(Some(separator)) => {
            let key = content[..separator].trim();
            if key.is_empty() {
                return Err(Problem::MissingKey(content.to_owned()));
            }
            match check_value(&content[separator + 1..], key) {
                Some(problem) => Err(problem),
                None => Ok(Line::Key(key.to_owned())),
            }
        }
    }
}

/// Scans `text` line by line (lines end at `\n`; a `\r` before it is part
/// of the line ending).
pub fn scan(text: &str) -> Scan {
    let mut scan = Scan {
        normalized: String::with_capacity(text.len()),
        ..Scan::default()
    };
    // A byte-order mark (editors on Windows write one) is not part of the
    // first line; rust-ini would read it as the start of a key.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (index, raw) in text.split_inclusive('\n').enumerate() {
        let number = index + 1;
        let stripped = raw.trim_start_matches(is_blank);
        scan.normalized.push_str(stripped);
        let content = stripped.strip_suffix('\n').unwrap_or(stripped);
        let content = content.strip_suffix('\r').unwrap_or(content);
        match classify(content) {
            Ok(Line::Empty) => {}
            Ok(Line::Section(name)) => scan.sections.push(ScannedSection {
                name,
                line: number,
                keys: Vec::new(),
            }),
            Ok(Line::Key(key)) => {
                let key = ScannedKey { key, line: number };
                match scan.sections.last_mut() {
                    Some(section) => section.keys.push(key),
                    None => scan.top_level.push(key),
                }
            }
            Err(problem) => scan.malformed.push(Malformed {
                line: number,
                problem,
            }),
        }
    }
    scan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(text: &str) -> Vec<String> {
        scan(text)
            .malformed
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn well_formed_lines_are_recorded_with_their_numbers() {
        let scan = scan(
            "# head\n[a=1]  ; c\n  creditLimit = 5\n\tresetSeconds: 60 # x\n\n  # indented comment\n[default]\r\ncreditLimit = '0'\r\n",
        );
        assert!(scan.malformed.is_empty(), "{:?}", scan.malformed);
        let names: Vec<(&str, usize)> = scan
            .sections
            .iter()
            .map(|s| (s.name.as_str(), s.line))
            .collect();
        assert_eq!(names, [("a=1", 2), ("default", 7)]);
        let keys: Vec<(&str, usize)> = scan.sections[0]
            .keys
            .iter()
            .map(|k| (k.key.as_str(), k.line))
            .collect();
        assert_eq!(keys, [("creditLimit", 3), ("resetSeconds", 4)]);
        assert!(scan.normalized.contains("\n# indented comment\n"));
    }

    #[test]
    fn every_malformed_line_is_named() {
        assert_eq!(
            problems("[method=GET path=/status\ncreditLimit = 100\nresetSeconds = 60\n[default]\ncreditLimit=0\n"),
            ["line 1: section header '[method=GET path=/status' is not closed (missing ']')"]
        );
        assert_eq!(
            problems("[a] b]\ncreditLimit 100\n= 5\ncomment = 'open\nlabel = x\\\n[b\\]\nx = 1\r2\n"),
            [
                "line 1: unexpected 'b]' after the section header [a] (a comment starts with # or ;)",
                "line 2: 'creditLimit 100' is neither a [section] header, a comment nor a key = value line",
                "line 3: '= 5' has no key before '='",
                "line 4: the value of 'comment' opens a quote (') that is not closed on its line",
                "line 5: 'label = x\\' ends with '\\', which would continue it on the next line",
                "line 6: section header '[b\\]' is not closed (missing ']')",
                "line 7: a carriage return (\\r) in the middle of the line",
            ]
        );
    }

    #[test]
    fn comments_after_a_value_and_escaped_quotes_are_fine() {
        for text in [
            "[a]\ncomment = 'it''s' # note \\\n",
            "[a]\ncomment = \"a \\\" b\"\n",
            "[a]\npath = C:\\dir\\x ; comment\n",
            "[a]\nlabel = x \\ # not a continuation\n",
        ] {
            assert!(scan(text).malformed.is_empty(), "{text:?}");
        }
    }

    #[test]
    fn long_lines_are_shortened_in_messages() {
        let line = format!("[{}", "x".repeat(200));
        let message = problems(&line).remove(0);
        assert!(message.len() < 140, "{message}");
        assert!(message.contains('…'), "{message}");
    }
}
