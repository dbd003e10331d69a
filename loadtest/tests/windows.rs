//! `--window-log` against a real Tollgate started in-process: an open-loop run's CSV has its header
//! and one line per window of the measured time, its hits add up to the report's requests, and the
//! JSON report carries the windows' summary only when the flag is given; and the flag's refusals
//! (`--window-ms` without `--window-log`, out of range, too many windows, a path that cannot be
//! created). Latencies' values are not asserted (the machine is shared): counts and structure are.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod tollgate_support;

use common::{args, refusal, run_binary};
use tollgate_support::Tollgate;

const HEADER: &str = "start_ms,hits,p50_us,p90_us,p99_us,max_us,over_1ms,over_2ms";

#[test]
fn an_open_loop_runs_windows_add_up_to_its_requests() {
    let tollgate = Tollgate::start(64 * 1024);
    let dir = std::env::temp_dir().join(format!("tollgate-windows-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("windows.csv");
    let json = dir.join("report.json");
    let flags = format!(
        "--target {} --rate 1000 --duration 1 --warmup 0.2 --connections 4 --actors 1000 \
         --window-ms 20 --window-log {} --json {}",
        tollgate.line_addr,
        csv.display(),
        json.display()
    );
    let table = run_binary(flags.split_whitespace());
    assert!(table.contains("windows      50 of 20 ms; "), "{table}");
    let text = std::fs::read_to_string(&csv).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(HEADER));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    // 1 s in windows of 20 ms.
    assert_eq!(rows.len(), 50, "{text}");
    let mut hits = 0;
    let mut over_2ms = 0;
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row.len(), 8, "{text}");
        assert_eq!(row[0], (i * 20).to_string(), "{text}");
        let n: u64 = row[1].parse().unwrap();
        hits += n;
        let over_1: u64 = row[6].parse().unwrap();
        let over_2: u64 = row[7].parse().unwrap();
        assert!(over_2 <= over_1 && over_1 <= n, "{text}");
        over_2ms += over_2;
        if n == 0 {
            assert!(row[2..6].iter().all(|f| f.is_empty()), "{text}");
        } else {
            let us: Vec<f64> = row[2..6].iter().map(|f| f.parse().unwrap()).collect();
            assert!(us.windows(2).all(|p| p[0] <= p[1]), "{text}");
        }
    }
    // Every answer of the measured time, and no other, is in a window.
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["unanswered"], 0, "{v}");
    assert_eq!(v["requests"], hits, "{v}");
    assert!((990..=1000).contains(&hits), "{hits}");
    let w = &v["windows"];
    assert_eq!(w["window_ms"], 20, "{v}");
    assert_eq!(w["count"], 50, "{v}");
    assert_eq!(w["over_2ms"], over_2ms, "{v}");
    let share = w["share_of_over_2ms_in_worst_tenth"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&share), "{v}");
    assert_eq!(v["config"]["window_ms"], 20, "{v}");
}

#[test]
fn without_the_flag_the_report_has_no_windows() {
    let tollgate = Tollgate::start(64 * 1024);
    let r = tollgate_loadtest::run(&args(&format!(
        "--target {} --rate 500 --duration 0.2 --connections 2 --actors 100",
        tollgate.line_addr
    )))
    .unwrap();
    assert!(r.windows.is_none());
    let v = serde_json::to_value(&r).unwrap();
    assert!(v.get("windows").is_none(), "{v}");
    assert!(!r.table().contains("windows"), "{}", r.table());
}

#[test]
fn window_ms_without_a_window_log_is_refused() {
    let error = refusal("--target 127.0.0.1:1 --window-ms 5");
    assert!(
        error.contains("--window-ms 5") && error.contains("needs --window-log"),
        "{error}"
    );
}

#[test]
fn window_ms_out_of_range_is_refused_with_its_value() {
    for ms in ["0", "60001"] {
        let error = refusal(&format!(
            "--target 127.0.0.1:1 --window-log /nonexistent/w.csv --window-ms {ms}"
        ));
        assert!(
            error.contains(&format!("--window-ms {ms} is out of range")),
            "{error}"
        );
    }
}

#[test]
fn too_many_windows_are_refused() {
    let error = refusal(
        "--target 127.0.0.1:1 --window-log /nonexistent/w.csv --window-ms 1 --duration 100.5",
    );
    assert!(
        error.contains("makes 100500 windows") && error.contains("at most 100000"),
        "{error}"
    );
}

#[test]
fn a_window_log_that_cannot_be_created_is_refused_before_the_load() {
    let tollgate = Tollgate::start(64 * 1024);
    let error = refusal(&format!(
        "--target {} --duration 5 --window-log /nonexistent/dir/w.csv",
        tollgate.line_addr
    ));
    assert!(
        error.contains("--window-log /nonexistent/dir/w.csv"),
        "{error}"
    );
}
