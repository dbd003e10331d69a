//! The real published droplet client (`droplet@1.4.0` from npm, installed in
//! tests/node by `npm ci --prefix tests/node`) driven by
//! tests/node/droplet_client.js, and what it must be answered: shared by the
//! single-node test (on a manual clock) and the cluster test (three real
//! nodes, real time), so both hold a server to the same answers. Missing
//! `node` or node_modules is a failure, never a silent pass; the whole
//! conversation is bounded in time.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Runs droplet_client.js against the droplet endpoint at 127.0.0.1:`port`.
/// When the script asks for time to pass, `advance` is called with the
/// milliseconds (it moves a manual clock, or sleeps). Returns the script's
/// results; panics when it fails or takes longer than `timeout`.
pub fn run_droplet_client(port: u16, timeout: Duration, mut advance: impl FnMut(u64)) -> Value {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/node");
    assert!(
        dir.join("node_modules/droplet").is_dir(),
        "tests/node/node_modules/droplet is missing: run `npm ci --prefix tests/node` (CI does)"
    );
    let mut child = Command::new("node")
        .arg(dir.join("droplet_client.js"))
        .arg("127.0.0.1")
        .arg(port.to_string())
        .current_dir(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("`node` must be installed for the client tests: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    let (lines, received) = mpsc::channel();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    let mut stderr = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });

    let deadline = Instant::now() + timeout;
    let results = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match received.recv_timeout(left) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "droplet_client.js gave no result within {timeout:?}; stderr: {}",
                    stderr.join().unwrap_or_default()
                );
            }
        };
        let message: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("droplet_client.js printed {line:?}: {e}"));
        if let Some(ms) = message["advance_ms"].as_u64() {
            advance(ms);
            stdin.write_all(b"advanced\n").unwrap();
            stdin.flush().unwrap();
        } else {
            break message["results"].clone();
        }
    };
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "droplet_client.js failed: {}",
        stderr.join().unwrap_or_default()
    );
    results
}

/// What droplet (and so Tollgate, on one node or a cluster) answers
/// droplet_client.js.
pub fn assert_droplet_answers(results: &Value) {
    // protobufjs hands absent optional fields over as their default, 0.
    let answer = |accept: bool, ls: i64| json!({"accept": accept, "ls": ls, "lm": 0, "lh": 0, "ld": 0, "lw": 0, "lo": 0});
    assert_eq!(results["take"], answer(true, 9));
    assert_eq!(results["take_count"], answer(true, 6));
    assert_eq!(results["drain"], answer(true, 0));
    // Overtaking is rejected with the post-debit balance.
    assert_eq!(results["overtake"], answer(false, -1));
    assert_eq!(results["reset"], answer(true, 2));
    // Limits persist: the per-minute limit set first is debited by a take
    // that gives only the per-second one, and a query reports both.
    assert_eq!(
        results["persist_first"],
        json!({"accept": true, "ls": 4, "lm": 99, "lh": 0, "ld": 0, "lw": 0, "lo": 0})
    );
    assert_eq!(results["persist_second"], answer(true, 3));
    assert_eq!(
        results["persist_query"],
        json!({"ls": 3, "lm": 98, "lh": 0, "ld": 0, "lw": 0, "lo": 0})
    );
    assert_eq!(
        results["negative_count"],
        json!([answer(true, 5), answer(true, 8), answer(true, 10)])
    );
    // Time credits accrue per millisecond: 250 ms of 10/s is 2.5 tokens.
    assert_eq!(results["empty"], answer(true, 0));
    assert_eq!(results["after_250ms"], answer(true, 2));
    assert_eq!(
        results["after_250ms_query"],
        json!({"ls": 2, "lm": 0, "lh": 0, "ld": 0, "lw": 0, "lo": 0})
    );
    // ... and never above the limit.
    assert_eq!(
        results["after_10s_query"],
        json!({"ls": 10, "lm": 0, "lh": 0, "ld": 0, "lw": 0, "lo": 0})
    );
    // Pipelined takes are answered in order (from a per-minute bucket, whose
    // refill, a token per 600 ms, real time cannot add in the middle of them
    // on a cluster).
    assert_eq!(
        results["pipelined"],
        json!((80..100).rev().collect::<Vec<i64>>())
    );
}
