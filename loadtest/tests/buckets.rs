//! `--protocol take` and `--protocol droplet` against a real Tollgate started in-process: exact
//! accepted/denied counts for a known bucket limit (checked against the server's own buckets), the
//! token-bucket `--check` (passing on Tollgate, failing on a fake server that over-admits), `ERR`
//! answers and droplet close frames counted as errors with reconnection, a target that is not a
//! WebSocket endpoint refused clearly, and the generator's own request bytes decoded by Tollgate's
//! protobuf decoder.
//!
//! The server runs on the real clock, so the limits are per hour (`lh=5`): a bucket earns one token
//! per 720 s, and every test here ends within seconds, so no token is earned during a test and the
//! counts are exact.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod tollgate_support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread;

use common::args;
use tollgate::droplet::proto::{decode_request, Command as DropletCommand};
use tollgate_loadtest::droplet::BucketTemplate;
use tollgate_loadtest::wire::{parse_droplet, Parse, Reply};
use tollgate_loadtest::Args;
use tollgate_support::Tollgate;

/// Actors in the exact-count tests, and the per-hour limit of each one's bucket.
const ACTORS: u64 = 20;
const LIMIT_PER_HOUR: u64 = 5;

/// Generator flags (split on whitespace) and a `--template` (one argument, spaces and all).
fn with_template(flags: &str, template: &str) -> Args {
    let argv = std::iter::once("tollgate-loadtest")
        .chain(flags.split_whitespace())
        .chain(["--template", template]);
    Args::parse_from_iter(argv).unwrap()
}

/// The exact-count run: `ACTORS` actors drawn 2000 times (each well over `LIMIT_PER_HOUR` times).
fn exact_run(protocol: &str, target: std::net::SocketAddr) -> tollgate_loadtest::Report {
    let a = with_template(
        &format!(
            "--target {target} --protocol {protocol} --actors {ACTORS} --requests 2000 \
             --connections 4 --pipeline 8 --duration 20 --seed 5 --check"
        ),
        &format!("bucket=b-{{actor}} lh={LIMIT_PER_HOUR}"),
    );
    tollgate_loadtest::run(&a).unwrap()
}

fn assert_exact(r: &tollgate_loadtest::Report, srv: &Tollgate) {
    assert_eq!(r.allowed, ACTORS * LIMIT_PER_HOUR, "{r:?}");
    assert_eq!(r.denied, 2000 - ACTORS * LIMIT_PER_HOUR, "{r:?}");
    assert_eq!((r.errors, r.unanswered, r.reconnects), (0, 0, 0), "{r:?}");
    // The server agrees: every bucket exists, its hourly balance spent.
    for i in 0..ACTORS {
        let b = srv.balances(&format!("b-a{i}")).expect("the bucket exists");
        assert_eq!(b, [None, None, Some(0), None, None, None], "bucket b-a{i}");
    }
    assert_eq!(srv.buckets.len() as u64, ACTORS);
    let c = r.check.as_ref().expect("--check ran");
    assert_eq!(c.model, "token-bucket");
    assert_eq!(c.allowed_hits, ACTORS * LIMIT_PER_HOUR);
    assert_eq!(c.actors_checked, ACTORS);
    assert_eq!(c.violations, 0, "{c:?}");
}

#[test]
fn take_counts_match_the_bucket_limit_exactly() {
    let srv = Tollgate::start(64 * 1024);
    let r = exact_run("take", srv.line_addr);
    assert_exact(&r, &srv);
    assert_eq!(r.config.template.as_deref(), Some("bucket=b-{actor} lh=5"));
}

#[test]
fn droplet_counts_match_the_bucket_limit_exactly() {
    let srv = Tollgate::start(64 * 1024);
    let r = exact_run("droplet", srv.droplet_addr);
    assert_exact(&r, &srv);
}

#[test]
fn both_protocols_reach_the_same_buckets() {
    // Three takes over WebSocket, then TAKE lines: the lines find the bucket two tokens short.
    let srv = Tollgate::start(64 * 1024);
    let common = "--actors 1 --connections 1 --pipeline 1";
    let template = "bucket=shared lh=5";
    let r = tollgate_loadtest::run(&with_template(
        &format!(
            "--target {} --protocol droplet --requests 3 {common}",
            srv.droplet_addr
        ),
        template,
    ))
    .unwrap();
    assert_eq!((r.allowed, r.denied), (3, 0));
    let r = tollgate_loadtest::run(&with_template(
        &format!(
            "--target {} --protocol take --requests 4 {common}",
            srv.line_addr
        ),
        template,
    ))
    .unwrap();
    assert_eq!((r.allowed, r.denied), (2, 2));
}

#[test]
fn the_default_template_is_mostly_admitted() {
    // bucket={actor} ls=1000 lm=50000: 500 requests over 50 actors never empty a bucket.
    let srv = Tollgate::start(64 * 1024);
    for (protocol, target) in [("take", srv.line_addr), ("droplet", srv.droplet_addr)] {
        let r = tollgate_loadtest::run(&args(&format!(
            "--target {target} --protocol {protocol} --actors 50 --requests 500 --connections 2 \
             --pipeline 4 --actor-prefix {protocol}"
        )))
        .unwrap();
        assert_eq!(
            (r.allowed, r.denied, r.errors),
            (500, 0, 0),
            "{protocol}: {r:?}"
        );
        assert_eq!(
            r.config.template.as_deref(),
            Some("bucket={actor} ls=1000 lm=50000")
        );
    }
    let b = srv.balances("take7").expect("bucket take7 exists");
    assert!(b[0].is_some() && b[1].is_some() && b[2].is_none(), "{b:?}");
}

#[test]
fn err_answers_to_take_are_errors_and_the_connection_comes_back() {
    // `lx` is no TAKE argument: every line is answered ERR, and the server closes.
    let srv = Tollgate::start(64 * 1024);
    let r = tollgate_loadtest::run(&with_template(
        &format!(
            "--target {} --protocol take --requests 200 --connections 2 --pipeline 4 --duration 20",
            srv.line_addr
        ),
        "bucket=x lx=1",
    ))
    .unwrap();
    assert_eq!((r.allowed, r.denied), (0, 0), "{r:?}");
    // Each connection sends rounds of 4 pipelined requests (100 each, so 25 rounds); the first of a
    // round is answered ERR, and the 3 behind it are lost with the connection.
    assert_eq!((r.errors, r.unanswered), (50, 150), "{r:?}");
    assert!(r.reconnects >= r.errors, "{r:?}");
}

#[test]
fn droplet_close_frames_are_errors_and_the_connection_comes_back() {
    // The endpoint accepts messages of up to 48 bytes; these requests are longer, so each is
    // answered by a close frame (code 1009).
    let srv = Tollgate::start(48);
    let long = "x".repeat(60);
    let r = tollgate_loadtest::run(&with_template(
        &format!(
            "--target {} --protocol droplet --requests 100 --connections 2 --pipeline 2 --duration 20",
            srv.droplet_addr
        ),
        &format!("bucket={long}{{actor}} lh=5"),
    ))
    .unwrap();
    assert_eq!((r.allowed, r.denied), (0, 0), "{r:?}");
    // Each connection sends rounds of 2 (50 each, so 25 rounds): the first is answered by a close
    // frame, the second is lost with the connection.
    assert_eq!((r.errors, r.unanswered), (50, 50), "{r:?}");
    assert!(r.reconnects >= r.errors, "{r:?}");
    assert_eq!(srv.buckets.len(), 0, "no take was executed");
}

#[test]
fn a_target_that_is_not_a_websocket_endpoint_is_refused_clearly() {
    let srv = Tollgate::start(64 * 1024);
    let a = args(&format!(
        "--target {} --protocol droplet --duration 1 --connect-timeout-secs 2",
        srv.line_addr
    ));
    let err = format!("{:#}", tollgate_loadtest::run(&a).unwrap_err());
    assert!(err.contains("WebSocket upgrade"), "{err}");
}

#[test]
fn bad_templates_and_checks_are_refused_before_connecting() {
    let unreachable = "--target 127.0.0.1:9";
    for (flags, template, wanted) in [
        ("--protocol droplet", "ls=5", "bucket"),
        (
            "--protocol droplet",
            "bucket=a lz=5",
            "unknown template key",
        ),
        (
            "--protocol take --check",
            "bucket=a count=-1 ls=5",
            "positive count",
        ),
        (
            "--protocol droplet --check",
            "bucket=a reset=true ls=5",
            "positive count",
        ),
        (
            "--protocol droplet --check",
            "bucket=a type=query ls=5",
            "positive count",
        ),
        ("--protocol take --check", "bucket=a", "no limit"),
        (
            "--protocol take --check --check-limit 3",
            "bucket=a ls=1",
            "template's limits",
        ),
    ] {
        let a = with_template(&format!("{unreachable} {flags}"), template);
        let err = format!("{:#}", a.validate().unwrap_err());
        assert!(err.contains(wanted), "{flags} {template}: {err}");
    }
    // And the same words are fine without --check.
    let a = with_template(
        &format!("{unreachable} --protocol take"),
        "bucket=a count=-1",
    );
    a.validate().unwrap();
}

/// A fake line server answering `TAKE` for 8 takes per bucket while reporting balances as if its
/// limit were 5 (4, 3, 2, 1, 0, 0, 0, 0): it over-admits, and only counting can tell.
fn over_admitting_take_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let taken: Arc<Mutex<HashMap<String, i64>>> = Arc::default();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let taken = taken.clone();
            thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut out = stream;
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap_or(0) > 0 {
                    let bucket = line.split_whitespace().nth(1).unwrap_or("").to_string();
                    let n = {
                        let mut m = taken.lock().unwrap();
                        let n = m.entry(bucket).or_insert(0);
                        *n += 1;
                        *n
                    };
                    let answer = if n <= 8 {
                        format!("OK true lh={}\n", (5 - n).max(0))
                    } else {
                        "OK false lh=-1\n".to_string()
                    };
                    if out.write_all(answer.as_bytes()).is_err() {
                        return;
                    }
                    line.clear();
                }
            });
        }
    });
    addr
}

#[test]
fn the_bucket_check_catches_over_admission() {
    let addr = over_admitting_take_server();
    let json =
        std::env::temp_dir().join(format!("tollgate-bucket-check-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-loadtest"))
        .args(["--target", &addr.to_string(), "--protocol", "take"])
        .args(["--template", "bucket={actor} lh=5"])
        .args("--actors 10 --requests 400 --connections 3 --pipeline 4 --check".split_whitespace())
        .args(["--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("token buckets of 5 per 3600 s"), "{table}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(v["allowed"], 80);
    assert_eq!(v["check"]["model"], "token-bucket");
    assert_eq!(v["check"]["violations"], 10);
    let worst = &v["check"]["examples"][0];
    assert_eq!(worst["kind"], "bucket_overrun");
    assert_eq!(worst["allowed"], 8);
    assert_eq!(worst["bound"], 5);
    assert_eq!(worst["period_secs"], 3600.0);
}

#[test]
fn droplet_request_frames_decode_with_tollgates_decoder() {
    let t = BucketTemplate::parse(
        "bucket=b-{actor} id=req-{actor} count=2 reset=false ls=7 lm=50000 lo=4294967295",
        true,
    )
    .unwrap();
    let bytes = t.encode_request("a42");
    match decode_request(&bytes).unwrap() {
        DropletCommand::Take { bucket, request } => {
            assert_eq!(bucket, b"b-a42");
            assert_eq!(request.count, 2);
            assert!(!request.reset);
            assert_eq!(request.limits, [7, 50000, 0, 0, 0, 4294967295]);
        }
        other => panic!("{other:?}"),
    }
    let q = BucketTemplate::parse("bucket=q type=query", true).unwrap();
    assert!(matches!(
        decode_request(&q.encode_request("a0")).unwrap(),
        DropletCommand::Query { .. }
    ));
}

#[test]
fn tollgates_responses_parse_including_negative_balances() {
    use tollgate::droplet::proto::encode_response;
    use tollgate::limiter::droplet_bucket::Balances;
    for (accept, balances, want) in [
        (
            true,
            [Some(9), Some(99), None, None, None, None],
            Reply::Allowed { credit: 9 },
        ),
        (
            true,
            [None, None, Some(-3), None, None, Some(7)],
            Reply::Allowed { credit: -3 },
        ),
        (
            false,
            [Some(-1), None, None, None, None, None],
            Reply::Denied,
        ),
        (true, [None; 6], Reply::Allowed { credit: 0 }),
    ] {
        let payload = encode_response(accept, &Balances(balances));
        let mut frame = vec![0x82, payload.len() as u8];
        frame.extend_from_slice(&payload);
        assert_eq!(parse_droplet(&frame), Parse::Complete(frame.len(), want));
    }
}
