//! Rule loading, validation and matching tests (SPEC §2–§3).

use super::*;
use crate::protocol::parse_line;

fn evaluated_labels(set: &RuleSet, line: &str) -> Vec<String> {
    let cmd = parse_line(line).unwrap();
    set.evaluate(&cmd.pairs)
        .map(|r| r.label.clone().unwrap_or_else(|| r.operation_text()))
        .collect()
}

const EXAMPLE_INI: &str = r#"
; comment line
# another
[method=GET path=/status]
creditLimit = 1000
resetSeconds = 60
label = status

[method=GET path=/pantry/cookies/special-cookie]
creditLimit = 1
resetSeconds = 86400
comment = 'canary: special'
matchPolicy = canary  # canary this rule
label = special

[method=GET path=/pantry/cookies/* ip=*]
creditLimit = 3
resetSeconds = 3600
actorField = 'ip'
comment = "3 per hour"
label = cookies

[ip=10.0.0.1]
creditLimit = 5
resetSeconds = 60

[path=/v1.0/*]
creditLimit = 7 ; seven
resetSeconds = 60s
label = null

[default]
creditLimit = 0
resetSeconds = 0
comment = 'Default deny!'
"#;

const EXAMPLE_JSON: &str = r#"{
  "overrides": [
    {"operation": {"method": "GET", "path": "/status"}, "creditLimit": 1000, "resetSeconds": 60, "label": "status"},
    {"operation": {"method": "GET", "path": "/pantry/cookies/special-cookie"}, "creditLimit": 1, "resetSeconds": 86400,
     "comment": "canary: special", "matchPolicy": "canary", "label": "special"},
    {"operation": {"method": "GET", "path": "/pantry/cookies/*", "ip": "*"}, "creditLimit": 3, "resetSeconds": 3600,
     "actorField": "ip", "comment": "3 per hour", "label": "cookies"},
    {"operation": {"ip": "10.0.0.1"}, "creditLimit": 5, "resetSeconds": 60},
    {"operation": {"path": "/v1.0/*"}, "creditLimit": 7, "resetSeconds": 60, "label": null}
  ],
  "default": {"operation": {}, "creditLimit": 0, "resetSeconds": 0, "comment": "Default deny!"}
}"#;

fn summary(set: &RuleSet) -> Vec<String> {
    set.rules()
        .iter()
        .map(|r| {
            let mut op: Vec<String> = r
                .operation
                .iter()
                .map(|(k, p)| format!("{k}={}", p.source()))
                .collect();
            op.sort();
            format!(
                "{} {:?} {:?} {:?} {:?} {:?} {}",
                op.join(" "),
                r.quota,
                r.actor_field,
                r.label,
                r.comment,
                r.match_policy,
                r.canonical_operation
            )
        })
        .collect()
}

#[test]
fn ini_and_json_give_identical_rules() {
    let ini = RuleSet::from_ini(EXAMPLE_INI).unwrap();
    let json = RuleSet::from_json(EXAMPLE_JSON).unwrap();
    assert_eq!(summary(&ini), summary(&json));
    assert_eq!(ini.fingerprint(), json.fingerprint());
    assert_eq!(ini.rules().len(), 6);
    let cookies = &ini.rules()[2];
    assert_eq!(cookies.actor_field.as_deref(), Some("ip"));
    assert_eq!(cookies.comment.as_deref(), Some("3 per hour"));
    assert_eq!(
        &*cookies.canonical_operation,
        "ip=* method=GET path=/pantry/cookies/*"
    );
    assert_eq!(ini.rules()[1].match_policy, MatchPolicy::Canary);
    assert_eq!(ini.rules()[4].label, None);
    assert_eq!(
        ini.rules()[4].quota,
        Quota::Limited {
            credit_limit: 7,
            reset_seconds: 60
        }
    );
    assert_eq!(ini.rules()[5].quota, Quota::AlwaysDeny);
    assert_eq!(
        ini.rules()[2].origin,
        RuleOrigin::Ini {
            section: "method=GET path=/pantry/cookies/* ip=*".into(),
            line: 16
        }
    );
}

#[test]
fn embedded_default_is_divvys_example() {
    let set = RuleSet::embedded_default();
    assert_eq!(
        evaluated_labels(&set, "HIT method=GET path=/status"),
        vec!["get-status"]
    );
    assert_eq!(
        evaluated_labels(&set, "HIT method=GET path=/pantry/cookies/x ip=1.2.3.4"),
        vec!["get-cookies"]
    );
    assert_eq!(evaluated_labels(&set, "HIT method=POST"), vec!["default"]);
}

#[test]
fn canary_rules_are_evaluated_before_the_deciding_rule() {
    let set = RuleSet::from_ini(EXAMPLE_INI).unwrap();
    assert_eq!(
        evaluated_labels(
            &set,
            "HIT method=GET path=/pantry/cookies/special-cookie ip=1"
        ),
        vec!["special", "cookies"]
    );
    assert_eq!(
        evaluated_labels(&set, "HIT ip=10.0.0.1"),
        vec!["ip=10.0.0.1"]
    );
    assert_eq!(
        evaluated_labels(&set, "HIT path=/v1.0/x"),
        vec!["path=/v1.0/*"]
    );
}

#[test]
fn canary_default_rule_is_the_last_evaluated() {
    let set = RuleSet::from_ini(
        "[a=1]\ncreditLimit=1\nresetSeconds=1\nmatchPolicy=canary\nlabel=a\n[default]\ncreditLimit=5\nresetSeconds=5\nmatchPolicy=canary\nlabel=d\n",
    )
    .unwrap();
    assert_eq!(evaluated_labels(&set, "HIT a=1"), vec!["a", "d"]);
    assert_eq!(evaluated_labels(&set, "HIT a=2"), vec!["d"]);
}

#[test]
fn star_matches_missing_keys_but_globs_do_not() {
    let set = RuleSet::from_ini(
        "[path=/x/*]\ncreditLimit=1\nresetSeconds=1\nlabel=glob\n[method=GET ip=*]\ncreditLimit=1\nresetSeconds=1\nlabel=any\n[default]\ncreditLimit=0\n",
    )
    .unwrap();
    assert_eq!(
        evaluated_labels(&set, "HIT method=GET other=1"),
        vec!["any"]
    );
    assert_eq!(
        evaluated_labels(&set, "HIT method=GET path=/x/y"),
        vec!["glob"]
    );
    assert_eq!(evaluated_labels(&set, "HIT path=/y"), vec!["default"]);
    // `[ip=*]` matches every request, so a rule after it is unreachable.
    assert!(load_err("[ip=*]\ncreditLimit=1\nresetSeconds=1\n[a=1]\ncreditLimit=1\nresetSeconds=1\n[default]\ncreditLimit=0\n")
        .contains("unreachable"));
}

fn load_err(ini: &str) -> String {
    RuleSet::from_ini(ini)
        .expect_err("must be rejected")
        .to_string()
}

#[test]
fn validation_failures_name_the_rule() {
    assert_eq!(load_err(""), "Config does not define any rules.");
    assert_eq!(
        load_err("[a=1]\ncreditLimit=1\nresetSeconds=1\n"),
        "Config does not define a default rule."
    );
    assert_eq!(
        load_err("[path=/pantry/*]\ncreditLimit=1\nresetSeconds=1\n\n[path=/pantry/cookies method=GET]\ncreditLimit=1\nresetSeconds=1\n[default]\ncreditLimit=0\n"),
        "rule [path=/pantry/cookies method=GET] (line 5) is unreachable: rule [path=/pantry/*] (line 1) matches every request it would match"
    );
    assert_eq!(
        load_err("[a=1]\ncreditLimit=-1\nresetSeconds=1\n[default]\ncreditLimit=0\n"),
        "rule [a=1] (line 1): creditLimit must be a number >= 0, got '-1'"
    );
    assert_eq!(
        load_err("[a=1]\ncreditLimit=lots\nresetSeconds=1\n[default]\ncreditLimit=0\n"),
        "rule [a=1] (line 1): creditLimit must be a number >= 0, got 'lots'"
    );
    assert_eq!(
        load_err("[a=1]\ncreditLimit=5\n[default]\ncreditLimit=0\n"),
        "rule [a=1] (line 1): resetSeconds must be a number >= 1 when creditLimit > 0 (0 means always allow), got ''"
    );
    assert_eq!(
        load_err(
            "[a=1]\ncreditLimit=5\nresetSeconds=1\nlabel=has space\n[default]\ncreditLimit=0\n"
        ),
        "rule [a=1] (line 1): label 'has space' must match ^[a-zA-Z0-9_-]{1,255}$"
    );
    assert_eq!(
        load_err("[a=1]\ncreditLimit=5\nresetSeconds=1\nlabel=x\n[a=2]\ncreditLimit=5\nresetSeconds=1\nlabel=x\n[default]\ncreditLimit=0\n"),
        "rule [a=2] (line 5): label 'x' is already used by rule [a=1] (line 1)"
    );
    assert_eq!(
        load_err("[a=1]\ncreditLimit=5\nresetSeconds=1\nmatchPolicy=sometimes\n[default]\ncreditLimit=0\n"),
        "rule [a=1] (line 1): matchPolicy must be 'stop' or 'canary', got 'sometimes'"
    );
    assert_eq!(
        load_err(
            "[a=1]\ncreditLimit=5\nresetSeconds=1\nalgorithm=magic\n[default]\ncreditLimit=0\n"
        ),
        "rule [a=1] (line 1): unknown algorithm 'magic' (expected fixed-window, token-bucket or sliding-window)"
    );
    assert_eq!(
        load_err("stray = 1\n[default]\ncreditLimit=0\n"),
        "INI key 'stray' at line 1 is outside any section"
    );
    assert!(
        load_err("[default]\ncreditLimit=0\n[a=1]\ncreditLimit=1\nresetSeconds=1\n")
            .contains("unreachable")
    );
}

#[test]
fn json_validation_names_the_index() {
    let err = RuleSet::from_json(
        r#"{"overrides":[{"operation":{"a":"1"},"creditLimit":1,"resetSeconds":1},{"operation":{"a":"1","b":"2"},"creditLimit":1,"resetSeconds":1}],"default":{"creditLimit":0}}"#,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "rule overrides[1] is unreachable: rule overrides[0] matches every request it would match"
    );
    let err = RuleSet::from_json(r#"{"overrides":[],"default":{"creditLimit":-3}}"#)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "rule \"default\": creditLimit must be a number >= 0, got '-3'"
    );
    let err = RuleSet::from_json(r#"{"overrides": ["#)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("JSON error: "), "{err}");
}

#[test]
fn canary_rules_never_mask_and_reset_zero_means_always_allow() {
    let set = RuleSet::from_ini(
        "[a=1]\ncreditLimit=1\nresetSeconds=1\nmatchPolicy=canary\n[a=1 b=2]\ncreditLimit=2\nresetSeconds=0\n[default]\ncreditLimit=0\n",
    )
    .unwrap();
    assert_eq!(set.rules()[1].quota, Quota::AlwaysAllow { credit_limit: 2 });
}

#[test]
fn json_non_string_values_become_their_text() {
    let set = RuleSet::from_json(
        r#"{"overrides":[{"operation":{"n":5,"t":true},"creditLimit":"10","resetSeconds":60}],"default":{"creditLimit":1,"resetSeconds":0}}"#,
    )
    .unwrap();
    assert_eq!(evaluated_labels(&set, "HIT n=5 t=true").len(), 1);
    assert_eq!(&*set.rules()[0].canonical_operation, "n=5 t=true");
}

#[test]
fn counter_id_follows_operation_limit_and_period() {
    let a =
        RuleSet::from_ini("[a=1 b=2]\ncreditLimit=5\nresetSeconds=60\n[default]\ncreditLimit=0\n")
            .unwrap();
    let b = RuleSet::from_ini(
        "[b=2 a=1]\ncreditLimit=5\nresetSeconds=60\nlabel=x\n[default]\ncreditLimit=0\n",
    )
    .unwrap();
    let c =
        RuleSet::from_ini("[a=1 b=2]\ncreditLimit=6\nresetSeconds=60\n[default]\ncreditLimit=0\n")
            .unwrap();
    assert_eq!(a.rules()[0].counter_id, b.rules()[0].counter_id);
    assert_ne!(a.rules()[0].counter_id, c.rules()[0].counter_id);
}

#[test]
fn utf16_key_order_puts_uppercase_before_underscore_before_lowercase() {
    let set = RuleSet::from_ini(
        "[b=1 _x=2 A=3 a=4]\ncreditLimit=5\nresetSeconds=60\n[default]\ncreditLimit=0\n",
    )
    .unwrap();
    assert_eq!(&*set.rules()[0].canonical_operation, "A=3 _x=2 a=4 b=1");
}

#[test]
fn parse_int_prefix_is_javascripts_parse_int() {
    assert_eq!(parse_int_prefix("60"), Some(60));
    assert_eq!(parse_int_prefix(" 60s"), Some(60));
    assert_eq!(parse_int_prefix("-5"), Some(-5));
    assert_eq!(parse_int_prefix("+5"), Some(5));
    assert_eq!(parse_int_prefix("abc"), None);
    assert_eq!(parse_int_prefix(""), None);
}

#[test]
fn each_rule_may_choose_its_algorithm() {
    let ini = RuleSet::from_ini(
        "[a=1]\ncreditLimit=5\nresetSeconds=1\nalgorithm = token-bucket\n\
         [a=2]\ncreditLimit=5\nresetSeconds=1\nalgorithm = sliding-window  ; smoother\n\
         [a=3]\ncreditLimit=5\nresetSeconds=1\nalgorithm = fixed-window\n\
         [default]\ncreditLimit=5\nresetSeconds=1\n",
    )
    .unwrap();
    let algorithms: Vec<Algorithm> = ini.rules().iter().map(|r| r.algorithm).collect();
    assert_eq!(
        algorithms,
        [
            Algorithm::TokenBucket,
            Algorithm::SlidingWindow,
            Algorithm::FixedWindow,
            Algorithm::FixedWindow
        ]
    );
    let json = RuleSet::from_json(
        r#"{"overrides":[{"operation":{"a":"1"},"creditLimit":5,"resetSeconds":1,"algorithm":"sliding-window"}],
            "default":{"creditLimit":5,"resetSeconds":1,"algorithm":"token-bucket"}}"#,
    )
    .unwrap();
    assert_eq!(json.rules()[0].algorithm, Algorithm::SlidingWindow);
    assert_eq!(json.rules()[1].algorithm, Algorithm::TokenBucket);
    let err = RuleSet::from_json(
        r#"{"overrides":[],"default":{"creditLimit":5,"resetSeconds":1,"algorithm":"leaky"}}"#,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "rule \"default\": unknown algorithm 'leaky' (expected fixed-window, token-bucket or sliding-window)"
    );
    // The same operation and limits under another algorithm count separately.
    let a = RuleSet::from_ini("[default]\ncreditLimit=5\nresetSeconds=1\n").unwrap();
    let b = RuleSet::from_ini("[default]\ncreditLimit=5\nresetSeconds=1\nalgorithm=token-bucket\n")
        .unwrap();
    assert_ne!(a.rules()[0].counter_id, b.rules()[0].counter_id);
    assert_ne!(a.fingerprint(), b.fingerprint());
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    fn ini_line() -> impl Strategy<Value = String> {
        prop_oneof![
            "\\[[a-z=*/. ]{0,20}\\]",
            "(creditLimit|resetSeconds|label|matchPolicy|actorField|algorithm|comment) ?= ?[-a-z0-9'\"#; ]{0,12}",
            "[#;].{0,10}",
            ".{0,20}",
        ]
    }

    /// Lines that stress the pre-pass: quotes, backslashes, comments,
    /// brackets, indentation, stray carriage returns.
    fn tricky_ini_line() -> impl Strategy<Value = String> {
        prop_oneof![
            "[ \t]{0,2}\\[[a-z=*\\\\\\] ;#\\[]{0,8}\\]?[ \t;#a-z\\]]{0,4}",
            "[ \t]{0,2}[a-zA-Z:\\\\]{0,6}[ \t]{0,2}[=:]?[ \t]{0,2}['\"a-z \t#;=:\\\\\r]{0,10}",
            "[ \t]{0,2}[#;][^\n]{0,10}",
            "[^\n]{0,16}",
        ]
    }

    fn good_ini_line() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "  ?# [a-z =]{0,8}",
            "; [a-z]{0,8}",
            "\\[[a-z]{1,3}=[a-z*/]{1,4}\\]( # c)?",
            "(creditLimit|resetSeconds|comment|label) ?= ?[a-z0-9]{0,5}( ; c)?",
            "comment = '[a-z #;]{0,6}'",
        ]
    }

    fn bad_ini_line() -> impl Strategy<Value = String> {
        prop_oneof![
            "\\[[a-z=]{1,6}",
            "\\[[a-z]{1,3}\\] [a-z]{1,3}",
            "[a-z]{1,8}",
            "= ?[a-z0-9]{0,3}",
            "comment = '[a-z ]{0,6}",
            "label = [a-z]{0,4}\\\\",
        ]
    }

    proptest! {
        /// Any text loads or is refused with an error; a loaded set always ends
        /// in the default rule and every rule's quota is valid.
        #[test]
        fn ini_loading_never_panics(lines in proptest::collection::vec(ini_line(), 0..12)) {
            if let Ok(set) = RuleSet::from_ini(&lines.join("\n")) {
                prop_assert!(set.rules().last().unwrap().operation.is_empty());
                for rule in set.rules() {
                    if let Quota::Limited { credit_limit, reset_seconds } = rule.quota {
                        prop_assert!(credit_limit >= 1 && reset_seconds >= 1);
                    }
                }
            }
        }

        /// Whatever the line pre-pass accepts, rust-ini reads into exactly
        /// the sections and keys the pre-pass recorded (so line numbers in
        /// messages are right and no line swallows another).
        #[test]
        fn prepass_and_rust_ini_agree(lines in proptest::collection::vec(tricky_ini_line(), 0..14)) {
            let text = lines.join("\n");
            prop_assert_eq!(crate::rules::check_ini_prepass(&text), Ok(()));
            let _ = RuleSet::from_ini(&text);
        }

        /// Every malformed line is reported, at its own line, and no other.
        #[test]
        fn every_malformed_line_is_reported_at_its_line(
            lines in proptest::collection::vec((good_ini_line(), proptest::option::weighted(0.3, bad_ini_line())), 1..14)
        ) {
            let mut text = String::from("[first]\n");
            let mut bad = Vec::new();
            for (i, (good, broken)) in lines.iter().enumerate() {
                match broken {
                    Some(line) => {
                        bad.push(i + 2);
                        text.push_str(line);
                    }
                    None => text.push_str(good),
                }
                text.push('\n');
            }
            match diagnostics::check_ini(&text).rules {
                Err(ConfigError::IniMalformed(found)) => {
                    let at: Vec<usize> = found.iter().map(|m| m.line).collect();
                    prop_assert_eq!(at, bad);
                }
                _ => prop_assert!(bad.is_empty(), "{:?} not reported in {:?}", bad, text),
            }
        }

        /// Every unknown key of a well-formed file is named, with its line.
        #[test]
        fn every_unknown_key_is_named_at_its_line(
            keys in proptest::collection::vec(prop_oneof!["[a-zA-Z_]{1,12}", Just("creditLimit".to_string())], 0..10)
        ) {
            let mut text = String::from("[default]\n");
            let mut unknown = Vec::new();
            for (i, key) in keys.iter().enumerate() {
                text.push_str(&format!("  {key} = 1\n"));
                if !diagnostics::RULE_KEYS.contains(&key.as_str()) {
                    unknown.push((i + 2, key.clone()));
                }
            }
            let checked = diagnostics::check_ini(&text);
            let named: Vec<(usize, String)> = checked
                .warnings
                .iter()
                .map(|w| (w.line.unwrap(), w.key.clone()))
                .collect();
            prop_assert_eq!(named, unknown);
        }

        #[test]
        fn json_loading_never_panics(text in "[{}\\[\\]\":,a-zA-Z0-9 -]{0,120}") {
            let _ = RuleSet::from_json(&text);
        }

        /// Generated valid rule files load identically from INI and JSON.
        #[test]
        fn ini_and_json_agree(rules in proptest::collection::vec(("[a-z]{1,4}", "[a-z0-9/]{1,6}", 0u64..5, 0u64..5), 0..6)) {
            let mut ini = String::new();
            let mut overrides = Vec::new();
            for (key, value, limit, reset) in &rules {
                ini.push_str(&format!("[{key}={value}]\ncreditLimit={limit}\nresetSeconds={reset}\n"));
                overrides.push(format!(r#"{{"operation":{{"{key}":"{value}"}},"creditLimit":{limit},"resetSeconds":{reset}}}"#));
            }
            ini.push_str("[default]\ncreditLimit=0\n");
            let json = format!(r#"{{"overrides":[{}],"default":{{"creditLimit":0}}}}"#, overrides.join(","));
            match (RuleSet::from_ini(&ini), RuleSet::from_json(&json)) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a.fingerprint(), b.fingerprint()),
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "INI {:?} vs JSON {:?}", a.map(|_| ()), b.map(|_| ())),
            }
        }
    }
}
