//! What a soak needs from the generator: a thousand and more connections opened (paced) with the
//! soft open-files limit raised by the generator itself, a clear error when the hard limit is too
//! low, and `--interval-json`, one line per second of the run.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod tollgate_support;

use std::process::Command;

use common::{args, divvy_server, DivvyBehaviour};
use tollgate_support::Tollgate;

/// Connections of the many-connections test (each side of each needs a file descriptor here).
const MANY_CONNECTIONS: usize = 1200;

/// Run the generator binary under `bash` after `ulimit_args` (e.g. `-Sn 256`).
fn run_with_ulimit(ulimit_args: &str, flags: &[&str]) -> std::process::Output {
    Command::new("bash")
        .arg("-c")
        .arg(format!("ulimit {ulimit_args} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_tollgate-loadtest"))
        .args(flags)
        .output()
        .expect("bash runs")
}

#[test]
fn many_connections_open_with_a_low_soft_limit() {
    // This process holds the server's side of every connection.
    tollgate_loadtest::fd_limit::ensure(tollgate_loadtest::fd_limit::needed(MANY_CONNECTIONS, 1))
        .expect("the test process needs one descriptor per connection");
    let srv = Tollgate::start(64 * 1024);
    let dir = std::env::temp_dir().join(format!("tollgate-many-conns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let conns = MANY_CONNECTIONS.to_string();
    // The soft limit (256) is far below what the run needs; the generator raises it.
    let out = run_with_ulimit(
        "-Sn 256",
        &[
            "--target",
            &srv.line_addr.to_string(),
            "--protocol",
            "take",
            "--connections",
            &conns,
            "--threads",
            "2",
            "--duration",
            "1",
            "--connect-timeout-secs",
            "20",
            "--actors",
            "100000",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["unanswered"], 0, "{v}");
    assert_eq!(v["reconnects"], 0, "{v}");
    // Every connection had a request in flight from the start: at least one answer each.
    assert!(
        v["requests"].as_u64().unwrap() >= MANY_CONNECTIONS as u64,
        "{v}"
    );
}

#[test]
fn too_low_a_hard_limit_is_a_clear_error() {
    // Nothing listens on port 9: the limit is checked before any connection is tried.
    let out = run_with_ulimit(
        "-n 200",
        &[
            "--target",
            "127.0.0.1:9",
            "--connections",
            "500",
            "--duration",
            "1",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("file descriptors") && err.contains("limit is 200"),
        "{err}"
    );
}

#[test]
fn interval_json_has_a_line_per_second() {
    let srv = divvy_server(DivvyBehaviour::default());
    let path =
        std::env::temp_dir().join(format!("tollgate-intervals-{}.jsonl", std::process::id()));
    let a = args(&format!(
        "--target {} --duration 2.5 --warmup 0.5 --connections 2 --actors 1000 --interval-json {}",
        srv.target(),
        path.display()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Lines fall due on a fixed grid (1 s, 2 s, ... after the start) and are written by a thread that
    // wakes every 100 ms; on a loaded machine a wake-up may come late and the next line then covers
    // less than a second (the grid does not drift). So: the lines of a 3 s run are the seconds it
    // covered, each written once its second was due, in order, adding up; what came after the last
    // of them, if anything, is in a last, shorter line. Intervals are bounded generously.
    assert!((2..=5).contains(&lines.len()), "{text}");
    let mut sum = 0;
    let mut previous_elapsed = 0.0;
    for (i, l) in lines.iter().enumerate() {
        let n = l["requests"].as_u64().unwrap();
        sum += n;
        assert_eq!(l["requests_total"].as_u64().unwrap(), sum, "{text}");
        assert_eq!(l["errors"], 0);
        let elapsed = l["elapsed_secs"].as_f64().unwrap();
        let interval = l["interval_secs"].as_f64().unwrap();
        assert!(elapsed > previous_elapsed, "lines in order: {text}");
        // Each line covers the time since the previous one (both rounded to the millisecond).
        assert!(
            (elapsed - previous_elapsed - interval).abs() < 0.003,
            "{text}"
        );
        previous_elapsed = elapsed;
        if i + 1 < lines.len() {
            // Written no earlier than its second fell due, and not much later.
            assert!(elapsed >= (i + 1) as f64 - 0.001, "{text}");
            assert!(interval > 0.0 && interval < 2.0, "{text}");
            assert!(n > 0, "{text}");
            // interval_secs is rounded to the millisecond.
            let rate = l["throughput_per_sec"].as_f64().unwrap();
            assert!((rate / (n as f64 / interval) - 1.0).abs() < 0.01, "{text}");
        }
    }
    assert_eq!(
        lines[0]["phase"], "measure",
        "0.5 s of warmup, then measured time"
    );
    // Every answer of the run is in the lines: the measured ones and the warmup's.
    let total = lines.last().unwrap()["requests_total"].as_u64().unwrap();
    assert!(total > r.requests, "{total} vs {r:?}");
    let t = &srv.tally;
    assert_eq!(total, t.get(&t.lines));
}
