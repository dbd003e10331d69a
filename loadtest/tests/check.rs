//! `--check` against fake divvy servers: a server that over-admits is caught (non-zero exit, the
//! actors named), a correct one passes.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

use common::{args, divvy_server, DivvyBehaviour};

fn run_binary(
    target: &str,
    json: &std::path::Path,
) -> (std::process::ExitStatus, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-loadtest"))
        .args(["--target", target])
        .args("--actors 10 --requests 400 --connections 2 --pipeline 4".split_whitespace())
        .args("--check --check-limit 5 --check-window-secs 60".split_whitespace())
        .args(["--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let v = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let _ = std::fs::remove_file(json);
    (out.status, v)
}

#[test]
fn over_admission_is_reported_and_fails_the_run() {
    // The server lets each actor through 8 times while the rule says 5, and reports credits as if
    // its limit were 5 (4, 3, 2, 1, 0, 0, 0, 0): only counting can catch it.
    let srv = divvy_server(DivvyBehaviour {
        limit: 8,
        claimed_limit: Some(5),
        ..DivvyBehaviour::default()
    });
    let json = std::env::temp_dir().join(format!("tollgate-check-bad-{}.json", std::process::id()));
    let (status, v) = run_binary(&srv.target(), &json);
    assert_eq!(status.code(), Some(3));
    assert_eq!(v["allowed"], 80);
    assert_eq!(v["check"]["violations"], 10);
    assert_eq!(v["check"]["actors_checked"], 10);
    assert_eq!(v["check"]["examples"][0]["kind"], "too_many");
    assert_eq!(v["check"]["examples"][0]["allowed"], 8);
    assert_eq!(v["check"]["examples"][0]["bound"], 5);
}

#[test]
fn a_correct_server_passes() {
    let srv = divvy_server(DivvyBehaviour::default());
    let json =
        std::env::temp_dir().join(format!("tollgate-check-good-{}.json", std::process::id()));
    let (status, v) = run_binary(&srv.target(), &json);
    assert!(status.success());
    assert_eq!(v["allowed"], 50);
    assert_eq!(v["check"]["violations"], 0);
    assert_eq!(v["check"]["actors_checked"], 10);
}

#[test]
fn check_as_a_library_counts_every_allowed_answer() {
    let srv = divvy_server(DivvyBehaviour {
        limit: 6,
        ..DivvyBehaviour::default()
    });
    let a = args(&format!(
        "--target {} --actors 50 --requests 2000 --connections 8 --pipeline 16 --threads 2 --check --check-limit 5 --check-window-secs 30",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    let c = r.check.as_ref().unwrap();
    assert_eq!(c.allowed_hits, 300);
    // The server reports its own limit honestly (credit 5 on the first hit): every actor is caught,
    // whatever the interleaving of 8 connections with deep pipelines.
    assert_eq!(c.violations, 50, "{c:?}");
    let json = serde_json::to_value(c).unwrap();
    assert!(json["examples"][0]["kind"].is_string());
    assert!(r.check_failed());
}
