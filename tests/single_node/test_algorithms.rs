//! Per-rule algorithms from a rule file, over real sockets on a manual clock:
//! the fixed window (divvy's), the token bucket and the sliding window side
//! by side, with `PEEK` for each.

use crate::util;

use std::io::Write;
use tollgate::rules::{Algorithm, RuleSet};
use util::{TestOptions, TestServer};

const RULES: &str = "\
[route=fixed]
creditLimit = 3
resetSeconds = 10

[route=bucket]
creditLimit = 3
resetSeconds = 6
algorithm = token-bucket

[route=sliding]
creditLimit = 4
resetSeconds = 10
algorithm = sliding-window
actorField = ip

[default]
creditLimit = 0
resetSeconds = 60
";

fn start() -> (TestServer, std::sync::Arc<tollgate::clock::ManualClock>) {
    let mut file = tempfile::Builder::new().suffix(".ini").tempfile().unwrap();
    file.write_all(RULES.as_bytes()).unwrap();
    let rules = RuleSet::load_file(file.path()).expect("the rule file is valid");
    let algorithms: Vec<Algorithm> = rules.rules().iter().map(|r| r.algorithm).collect();
    assert_eq!(
        algorithms,
        [
            Algorithm::FixedWindow,
            Algorithm::TokenBucket,
            Algorithm::SlidingWindow,
            Algorithm::FixedWindow
        ]
    );
    let clock = util::manual_clock();
    let options = TestOptions {
        clock: clock.clone(),
        ..TestOptions::default()
    };
    (TestServer::start(rules, options), clock)
}

#[test]
fn each_algorithm_admits_a_burst_its_own_way() {
    let (server, clock) = start();
    // The clock starts on a multiple of 10 s: sliding windows are aligned.
    let mut s = server.connect();
    let mut hit = |line: &str| util::request(&mut s, line);

    // Fixed window: 3, then denied until the window closes 10 s later.
    for expected in [
        "OK true 2 10",
        "OK true 1 10",
        "OK true 0 10",
        "OK false 0 10",
    ] {
        assert_eq!(hit("HIT route=fixed"), expected);
    }
    // Token bucket: a burst of 3, then one token every 2 s; nextResetSeconds
    // is the wait for the next token.
    for expected in ["OK true 2 2", "OK true 1 2", "OK true 0 2", "OK false 0 2"] {
        assert_eq!(hit("HIT route=bucket"), expected);
    }
    assert_eq!(hit("PEEK route=bucket"), "OK false 0 2");

    clock.advance_ms(2_000);
    assert_eq!(hit("PEEK route=bucket"), "OK true 0 2");
    assert_eq!(hit("HIT route=bucket"), "OK true 0 2");
    assert_eq!(hit("HIT route=bucket"), "OK false 0 2");
    assert_eq!(hit("HIT route=fixed"), "OK false 0 8");

    // Sliding window, per ip: 4 in the first window (5 s in)...
    clock.advance_ms(3_000);
    for expected in ["OK true 3 5", "OK true 2 5", "OK true 1 5", "OK true 0 5"] {
        assert_eq!(hit("HIT route=sliding ip=1"), expected);
    }
    assert_eq!(hit("HIT route=sliding ip=1"), "OK false 0 5");
    assert_eq!(hit("HIT route=sliding ip=2"), "OK true 3 5");
    // ... and 2.5 s into the next window the previous 4 weigh 3: one more.
    clock.advance_ms(7_500);
    assert_eq!(hit("PEEK route=sliding ip=1"), "OK true 0 8");
    assert_eq!(hit("HIT route=sliding ip=1"), "OK true 0 8");
    assert_eq!(hit("HIT route=sliding ip=1"), "OK false 0 8");
    // The fixed window reopened; the token bucket refilled, capped at 3.
    assert_eq!(hit("HIT route=fixed"), "OK true 2 10");
    assert_eq!(hit("HIT route=bucket"), "OK true 2 2");
}

#[test]
fn an_unknown_algorithm_is_refused_with_the_rule_named() {
    let error = RuleSet::from_ini(
        "[route=a]\ncreditLimit = 1\nresetSeconds = 1\nalgorithm = leaky-bucket\n[default]\ncreditLimit = 0\n",
    )
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "rule [route=a] (line 1): unknown algorithm 'leaky-bucket' (expected fixed-window, token-bucket or sliding-window)"
    );
}

/// The burst table of docs/configuration.md (Algorithms), replayed over a socket.
#[test]
fn the_documented_burst_table_holds() {
    let rules = RuleSet::from_ini(
        "[route=fixed]\ncreditLimit = 4\nresetSeconds = 4\n\
         [route=bucket]\ncreditLimit = 4\nresetSeconds = 4\nalgorithm = token-bucket\n\
         [route=sliding]\ncreditLimit = 4\nresetSeconds = 4\nalgorithm = sliding-window\n\
         [default]\ncreditLimit = 0\n",
    )
    .unwrap();
    let clock = util::manual_clock();
    let server = TestServer::start(
        rules,
        TestOptions {
            clock: clock.clone(),
            ..TestOptions::default()
        },
    );
    let mut s = server.connect();
    // (time in ms since the start, hits sent)
    let schedule = [
        (0, 1),
        (3_900, 6),
        (4_000, 6),
        (5_000, 2),
        (6_000, 2),
        (7_000, 2),
        (8_000, 2),
    ];
    let expected = [
        ("fixed", [1, 3, 4, 0, 0, 0, 2]),
        ("bucket", [1, 4, 0, 1, 1, 1, 1]),
        ("sliding", [1, 3, 0, 1, 1, 1, 1]),
    ];
    let mut elapsed_ms = 0;
    let mut admitted = [[0; 7]; 3];
    for (step, (at_ms, sent)) in schedule.into_iter().enumerate() {
        clock.advance_ms(at_ms - elapsed_ms);
        elapsed_ms = at_ms;
        for (rule, (route, _)) in expected.iter().enumerate() {
            for _ in 0..sent {
                if util::request(&mut s, &format!("HIT route={route}")).starts_with("OK true") {
                    admitted[rule][step] += 1;
                }
            }
        }
    }
    for (rule, (route, counts)) in expected.iter().enumerate() {
        assert_eq!(admitted[rule], *counts, "{route}");
    }
}
