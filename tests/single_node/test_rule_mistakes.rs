//! Rule-file mistakes as an operator makes them, through the real binary:
//! `check-config` names every unknown key and malformed line with its line
//! (and a "did you mean" for near misses of a known key), `serve` refuses a
//! file rust-ini would misread, loads one with unknown keys (divvy did)
//! logging one warning per key at start and on reload, and `--strict-rules`
//! refuses it instead.

use crate::util::{self, ServedBinary};

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// One mistake: the file, and exactly what `check-config` prints.
struct Case {
    file: &'static str,
    text: &'static str,
    /// Exit status of `check-config`.
    code: i32,
    /// Every stderr line, with `FILE` for the file's path.
    stderr: &'static [&'static str],
    /// The first stdout line (the summary), if any.
    summary: Option<&'static str>,
}

const CASES: &[Case] = &[
    Case {
        file: "actor.ini",
        text: "[method=GET path=/pantry/*]\ncreditLimit = 3\nresetSeconds = 3600\nactorFeild = ip\n\n[default]\ncreditLimit = 0\n",
        code: 0,
        stderr: &["tollgate: FILE: warning: line 4: unknown key 'actorFeild' in rule [method=GET path=/pantry/*], ignored (did you mean 'actorField'?)"],
        summary: Some("FILE: 2 rules, valid, 1 warning"),
    },
    Case {
        file: "overides.json",
        text: r#"{"overides": [{"operation": {"method": "GET"}, "creditLimit": 5, "resetSeconds": 60}], "default": {"creditLimit": 0}}"#,
        code: 0,
        stderr: &["tollgate: FILE: warning: unknown top-level key 'overides', ignored (did you mean 'overrides'?)"],
        summary: Some("FILE: 1 rules, valid, 1 warning"),
    },
    Case {
        file: "json-rule.json",
        text: r#"{"overrides": [{"operation": {"method": "GET"}, "creditLimit": 5, "resetSeconds": 60, "actor_field": "ip", "burst": 2}], "default": {"creditLimit": 0, "lable": "x"}}"#,
        code: 0,
        stderr: &[
            "tollgate: FILE: warning: overrides[0]: unknown key 'actor_field', ignored (did you mean 'actorField'?)",
            "tollgate: FILE: warning: overrides[0]: unknown key 'burst', ignored",
            "tollgate: FILE: warning: \"default\": unknown key 'lable', ignored (did you mean 'label'?)",
        ],
        summary: Some("FILE: 2 rules, valid, 3 warnings"),
    },
    Case {
        file: "unclosed.ini",
        text: "[method=GET path=/status\ncreditLimit = 100\nresetSeconds = 60\n\n[default]\ncreditLimit = 0\n",
        code: 1,
        stderr: &["tollgate: FILE: line 1: section header '[method=GET path=/status' is not closed (missing ']')"],
        summary: None,
    },
    Case {
        file: "unclosed-at-end.ini",
        text: "[default]\ncreditLimit = 0\n\n[method=GET path=/status\ncreditLimit = 100",
        code: 1,
        stderr: &["tollgate: FILE: line 4: section header '[method=GET path=/status' is not closed (missing ']')"],
        summary: None,
    },
    Case {
        file: "credit.ini",
        text: "[a=1]\ncreditLimt = 5\nresetSeconds = 60\n[default]\ncreditLimit = 0\n",
        code: 1,
        stderr: &["tollgate: FILE: rule [a=1] (line 1): creditLimit is missing; 'creditLimt' at line 2 is not a known key (did you mean 'creditLimit'?)"],
        summary: None,
    },
    Case {
        file: "json-credit.json",
        text: r#"{"overrides": [{"operation": {"a": "1"}, "creditlimit": 5, "resetSeconds": 60}], "default": {"creditLimit": 0}}"#,
        code: 1,
        stderr: &["tollgate: FILE: rule overrides[0]: creditLimit is missing; 'creditlimit' is not a known key (did you mean 'creditLimit'?)"],
        summary: None,
    },
    Case {
        file: "reset.ini",
        text: "[a=1]\ncreditLimit = 5\nreset_seconds = 60\nfoo = 1\n[default]\ncreditLimit = 0\n",
        code: 1,
        stderr: &[
            "tollgate: FILE: warning: line 4: unknown key 'foo' in rule [a=1], ignored",
            "tollgate: FILE: rule [a=1] (line 1): resetSeconds is missing; 'reset_seconds' at line 3 is not a known key (did you mean 'resetSeconds'?)",
        ],
        summary: None,
    },
    Case {
        file: "many.ini",
        text: "[a=1]\ncreditLimit 5\nresetSeconds = 60\n= 3\n[b=2] [c=3]\ncomment = 'open\nlabel = x\\\n[default]\ncreditLimit = 0\n",
        code: 1,
        stderr: &[
            "tollgate: FILE: line 2: 'creditLimit 5' is neither a [section] header, a comment nor a key = value line",
            "tollgate: FILE: line 4: '= 3' has no key before '='",
            "tollgate: FILE: line 5: unexpected '[c=3]' after the section header [b=2] (a comment starts with # or ;)",
            "tollgate: FILE: line 6: the value of 'comment' opens a quote (') that is not closed on its line",
            "tollgate: FILE: line 7: 'label = x\\' ends with '\\', which would continue it on the next line",
        ],
        summary: None,
    },
    Case {
        // rust-ini read an indented comment as a key that swallowed the next
        // line; the SPEC says a comment is a line whose first non-blank is # or ;.
        file: "indented.ini",
        text: "[a=1]\ncreditLimit = 5\n    # the window\nresetSeconds = 60\n  [default]\n  creditLimit = 0\n",
        code: 0,
        stderr: &[],
        summary: Some("FILE: 2 rules, valid"),
    },
    Case {
        file: "outside.ini",
        text: "creditLimit = 5\n[default]\ncreditLimit = 0\n",
        code: 1,
        stderr: &["tollgate: FILE: INI key 'creditLimit' at line 1 is outside any section"],
        summary: None,
    },
    Case {
        file: "rules.txt",
        text: "[default]\ncreditLimit = 0\n",
        code: 1,
        stderr: &["tollgate: FILE: unknown rule file type (expected .ini or .json)"],
        summary: None,
    },
];

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn check_config_names_every_mistake_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for case in CASES {
        let path = write(dir.path(), case.file, case.text);
        let out = Command::new(BIN)
            .arg("check-config")
            .arg(&path)
            .output()
            .unwrap();
        let name = path.display().to_string();
        let stderr = String::from_utf8(out.stderr).unwrap();
        let stdout = String::from_utf8(out.stdout).unwrap();
        let expected: Vec<String> = case
            .stderr
            .iter()
            .map(|l| l.replace("FILE", &name))
            .collect();
        let got: Vec<&str> = stderr.lines().collect();
        let summary = case.summary.map(|s| s.replace("FILE", &name));
        if out.status.code() != Some(case.code)
            || got != expected
            || summary.as_deref() != stdout.lines().next()
        {
            failures.push(format!(
                "{}: exit {:?} (expected {}), stderr {got:#?} (expected {expected:#?}), stdout {stdout:?} (expected summary {summary:?})",
                case.file,
                out.status.code(),
                case.code
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn strict_rules_turns_unknown_keys_into_a_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), CASES[0].file, CASES[0].text);
    let out = Command::new(BIN)
        .args(["check-config", "--strict-rules"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    let name = path.display();
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [
            format!("tollgate: {name}: warning: line 4: unknown key 'actorFeild' in rule [method=GET path=/pantry/*], ignored (did you mean 'actorField'?)"),
            format!("tollgate: {name}: refused by --strict-rules: 1 unknown key"),
        ]
    );

    // `serve --strict-rules` does not start on it.
    let out = Command::new(BIN)
        .args(["serve", "--strict-rules", "--listen", "127.0.0.1:0"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        stderr.trim_end(),
        format!("tollgate: {name}: --strict-rules refuses unknown keys: line 4: unknown key 'actorFeild' in rule [method=GET path=/pantry/*], ignored (did you mean 'actorField'?)")
    );
}

#[test]
fn serve_refuses_a_malformed_section_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "unclosed.ini", CASES[3].text);
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim_end(),
        format!(
            "tollgate: {}: line 1: section header '[method=GET path=/status' is not closed (missing ']')",
            path.display()
        )
    );
}

fn serve(rules: &Path, flags: &[&str]) -> ServedBinary {
    let mut args: Vec<&OsStr> = flags.iter().map(OsStr::new).collect();
    args.push(rules.as_os_str());
    ServedBinary::start(rules.parent().unwrap(), &args)
}

fn reload(served: &ServedBinary) -> std::process::Output {
    let pid = served.child.id().to_string();
    util::reload_command(&[OsStr::new("--pid"), OsStr::new(&pid)])
}

#[test]
fn unknown_keys_are_served_as_divvy_did_with_one_warning_each_at_start_and_on_reload() {
    let dir = tempfile::tempdir().unwrap();
    let rules = write(
        dir.path(),
        "rules.ini",
        "[path=/a]\ncreditLimit = 1\nresetSeconds = 60\nactorFeild = ip\nburst = 3\n[default]\ncreditLimit = 0\n",
    );
    let served = serve(&rules, &[]);
    let log = served.wait_for_log(1, "unknown key 'burst'");
    assert_eq!(log.matches("unknown key").count(), 2, "{log}");
    assert!(
        log.contains("line 4: unknown key 'actorFeild' in rule [path=/a], ignored (did you mean 'actorField'?)"),
        "{log}"
    );
    // The typo makes the limit global, as in divvy: the second ip is denied.
    let mut stream = util::connect(served.addr);
    assert_eq!(
        util::request(&mut stream, "HIT path=/a ip=1"),
        "OK true 0 60"
    );
    assert!(util::request(&mut stream, "HIT path=/a ip=2").starts_with("OK false 0 "));

    let out = reload(&served);
    assert!(out.status.success(), "{out:?}");
    let log = served.wait_for_log(2, "unknown key 'burst'");
    assert_eq!(log.matches("unknown key").count(), 4, "{log}");
}

#[test]
fn a_strict_server_refuses_a_reload_with_unknown_keys_and_keeps_its_rules() {
    let dir = tempfile::tempdir().unwrap();
    let rules = write(
        dir.path(),
        "rules.ini",
        "[path=/a]\ncreditLimit = 1\nresetSeconds = 60\nactorField = ip\n[default]\ncreditLimit = 0\n",
    );
    let served = serve(&rules, &["--strict-rules"]);
    std::fs::write(
        &rules,
        "[path=/a]\ncreditLimit = 1\nresetSeconds = 60\nactorFeild = ip\n[default]\ncreditLimit = 0\n",
    )
    .unwrap();
    let out = reload(&served);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("kept its rules: ")
            && stderr
                .contains("--strict-rules refuses unknown keys: line 4: unknown key 'actorFeild'"),
        "{stderr}"
    );
    // Still per ip.
    let mut stream = util::connect(served.addr);
    assert_eq!(
        util::request(&mut stream, "HIT path=/a ip=1"),
        "OK true 0 60"
    );
    assert_eq!(
        util::request(&mut stream, "HIT path=/a ip=2"),
        "OK true 0 60"
    );
}
