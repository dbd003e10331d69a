//! The fenced code blocks of a Markdown file and what their info string
//! asks of the doc test. Shell blocks (`sh`, `bash`, `shell`) run and must
//! exit 0; `sh background` starts a server that later blocks of the same
//! file talk to (the test waits for its `tollgate: listening on` line);
//! `console` blocks are transcripts, `$ command` lines followed by the exact
//! output (a line `...` stands for any lines, `...` in a line for any text). A block that cannot run here
//! says why: `sh skip: needs systemd`. An unlabelled block that looks like
//! shell is an error, so that no command escapes the test by accident.

use std::path::{Path, PathBuf};

/// What the test does with a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Run it; it must exit 0.
    Run,
    /// Start it and leave it running until the file's last block ran.
    Background,
    /// Run each command and compare its output.
    Transcript,
    /// Not run, for this reason.
    Skip(String),
    /// Not a shell block.
    Other,
}

#[derive(Debug, Clone)]
pub struct Block {
    pub file: PathBuf,
    /// The 1-based line of the opening fence.
    pub line: usize,
    pub kind: Kind,
    /// The block's text, its list indentation removed.
    pub body: String,
}

impl Block {
    pub fn place(&self) -> String {
        format!("{}:{}", self.file.display(), self.line)
    }
}

/// Words that start a shell command in these docs: an unlabelled block
/// starting with one must be labelled.
const COMMAND_WORDS: &[&str] = &[
    "$ ",
    "tollgate ",
    "cargo ",
    "curl ",
    "printf ",
    "kill ",
    "nc ",
    "cluster/",
    "loadtest/",
    "benches/",
    "tests/",
    "./",
];

fn looks_like_shell(body: &str) -> bool {
    body.lines()
        .map(str::trim_start)
        .find(|line| !line.is_empty() && !line.starts_with('#'))
        .is_some_and(|line| {
            COMMAND_WORDS.iter().any(|word| line.starts_with(word))
                || line.split_once('=').is_some_and(|(name, _)| {
                    !name.is_empty() && name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
                })
        })
}

fn kind_of(info: &str, body: &str) -> Result<Kind, String> {
    let (lang, rest) = info.split_once(char::is_whitespace).unwrap_or((info, ""));
    let rest = rest.trim();
    let skip = |rest: &str| -> Result<Kind, String> {
        let reason = rest.strip_prefix("skip:").map(str::trim).unwrap_or("");
        if reason.is_empty() {
            Err(format!(
                "'{info}': a skipped block says why (`{lang} skip: <reason>`)"
            ))
        } else {
            Ok(Kind::Skip(reason.to_owned()))
        }
    };
    match lang {
        "sh" | "bash" | "shell" => match rest {
            "" => Ok(Kind::Run),
            "background" => Ok(Kind::Background),
            _ if rest.starts_with("skip") => skip(rest),
            _ => Err(format!("'{info}': unknown marker (expected background or skip: <reason>)")),
        },
        "console" => match rest {
            "" => Ok(Kind::Transcript),
            _ => skip(rest),
        },
        "" | "text" if looks_like_shell(body) => Err(
            "an unlabelled block that looks like shell: label it sh (or `sh skip: <reason>`, or console for a transcript)".to_owned()
        ),
        _ => Ok(Kind::Other),
    }
}

/// Every fenced block of `text` (from `file`), or the errors of its labels.
pub fn blocks(file: &Path, text: &str) -> (Vec<Block>, Vec<String>) {
    let mut blocks = Vec::new();
    let mut errors = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((index, line)) = lines.next() {
        let trimmed = line.trim_start();
        let Some(info) = trimmed.strip_prefix("```") else {
            continue;
        };
        let indent = line.len() - trimmed.len();
        let mut body = String::new();
        for (_, inner) in lines.by_ref() {
            if inner.trim() == "```" {
                break;
            }
            let strip = inner.len() - inner.trim_start_matches(' ').len();
            body.push_str(&inner[strip.min(indent)..]);
            body.push('\n');
        }
        let place = format!("{}:{}", file.display(), index + 1);
        match kind_of(info.trim(), &body) {
            Ok(kind) => blocks.push(Block {
                file: file.to_owned(),
                line: index + 1,
                kind,
                body,
            }),
            Err(error) => errors.push(format!("{place}: {error}")),
        }
    }
    (blocks, errors)
}

/// A transcript's steps: each command and the output expected of it.
pub fn transcript(body: &str) -> Vec<(String, Vec<String>)> {
    let mut steps: Vec<(String, Vec<String>)> = Vec::new();
    let mut continued = false;
    for line in body.lines() {
        if continued {
            if let Some((command, _)) = steps.last_mut() {
                command.push('\n');
                command.push_str(line);
            }
            continued = line.ends_with('\\');
        } else if let Some(command) = line.strip_prefix("$ ") {
            steps.push((command.to_owned(), Vec::new()));
            continued = command.ends_with('\\');
        } else if let Some((_, output)) = steps.last_mut() {
            output.push(line.to_owned());
        }
    }
    steps
}

/// Does `got` match `expected`, where an expected line `...` matches any
/// number of lines? Trailing blanks are ignored.
pub fn output_matches(expected: &[String], got: &[&str]) -> bool {
    match expected.split_first() {
        None => got.is_empty(),
        Some((first, rest)) if first.trim_end() == "..." => {
            (0..=got.len()).any(|skip| output_matches(rest, &got[skip..]))
        }
        Some((first, rest)) => got.split_first().is_some_and(|(line, others)| {
            line_matches(first.trim_end(), line.trim_end()) && output_matches(rest, others)
        }),
    }
}

/// Does `line` match `pattern`, where `...` inside a pattern stands for any
/// text (a process id, a time)?
fn line_matches(pattern: &str, line: &str) -> bool {
    let mut parts = pattern.split("...");
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = line.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[test]
fn labels_and_transcripts_are_read_as_documented() {
    let text = "intro\n```sh\necho a\n```\n1. step\n   ```sh background\n   tollgate serve\n   ```\n```sh skip: needs systemd\nsystemctl start x\n```\n```\ntollgate serve\n```\n```sh skip\nx\n```\n```ini\n[a]\n```\n```console\n$ printf 'a\\n' \\\n  'b'\na\n...\n$ true\n```\n";
    let (blocks, errors) = blocks(Path::new("x.md"), text);
    let kinds: Vec<&Kind> = blocks.iter().map(|b| &b.kind).collect();
    assert_eq!(
        kinds,
        [
            &Kind::Run,
            &Kind::Background,
            &Kind::Skip("needs systemd".into()),
            &Kind::Other,
            &Kind::Transcript
        ]
    );
    assert_eq!(blocks[1].body, "tollgate serve\n");
    assert_eq!(blocks[1].line, 6);
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0].starts_with("x.md:12: an unlabelled block"),
        "{errors:?}"
    );
    assert!(
        errors[1].starts_with("x.md:15: 'sh skip': a skipped block says why"),
        "{errors:?}"
    );
    let steps = transcript(&blocks[4].body);
    assert_eq!(
        steps,
        [
            (
                "printf 'a\\n' \\\n  'b'".to_owned(),
                vec!["a".to_owned(), "...".to_owned()]
            ),
            ("true".to_owned(), vec![])
        ]
    );
    let expected = ["a".to_owned(), "...".to_owned(), "z".to_owned()];
    assert!(output_matches(&expected, &["a", "z"]));
    assert!(output_matches(&expected, &["a", "x", "y", "z  "]));
    assert!(!output_matches(&expected, &["a", "x"]));
    assert!(line_matches(
        "process ...: reloaded ... rules",
        "process 12: reloaded 4 rules"
    ));
    assert!(line_matches("a...", "a"));
    assert!(!line_matches("process ...: x", "process 12: y"));
    assert!(!line_matches("ab...ba", "aba"));
}
