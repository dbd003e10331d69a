//! Open loop against fake divvy servers: a slow server's queueing shows up in the latencies because
//! they are measured from each request's intended send time, and the schedule keeps its rate.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{args, divvy_server, refusal, DivvyBehaviour};

const DELAY_MS: f64 = 50.0;

fn slow() -> common::FakeServer {
    divvy_server(DivvyBehaviour {
        delay: Duration::from_millis(DELAY_MS as u64),
        limit: 1_000_000,
        ..DivvyBehaviour::default()
    })
}

#[test]
fn a_slow_server_shows_in_open_loop_latencies() {
    let srv = slow();
    // 60 req/s for 0.5 s = 30 requests; the server answers 20 per second, so they queue.
    let a = args(&format!(
        "--target {} --rate 60 --duration 0.5 --connections 1 --pipeline 1 --drain-secs 3 --actors 5",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert_eq!(r.requests, 30, "{r:?}");
    assert_eq!(r.unanswered, 0);
    let l = r.latency_us;
    assert!(l.p50 >= DELAY_MS * 1000.0, "{l:?}");
    // Request k is due at k/60 s but answered at (k+1)/20 s: the latency grows by ~33 ms per request.
    assert!(l.p90 >= 4.0 * DELAY_MS * 1000.0, "{l:?}");
    assert!(l.max >= 10.0 * DELAY_MS * 1000.0, "{l:?}");
}

#[test]
fn the_same_slow_server_in_closed_loop_hides_the_queue() {
    let srv = slow();
    let a = args(&format!(
        "--target {} --duration 0.5 --connections 1 --pipeline 1 --actors 5",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert!((8..=11).contains(&r.requests), "{r:?}");
    let l = r.latency_us;
    assert!(
        l.p50 >= DELAY_MS * 1000.0 && l.max < 3.0 * DELAY_MS * 1000.0,
        "{l:?}"
    );
}

#[test]
fn open_loop_keeps_its_rate() {
    let srv = divvy_server(DivvyBehaviour::default());
    let a = args(&format!(
        "--target {} --rate 2000 --duration 1 --connections 4 --actors 100",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert!((1990..=2000).contains(&r.requests), "{r:?}");
    assert_eq!(r.allowed, 500);
    assert!(
        (0.95..1.05).contains(&(r.throughput_per_sec / 2000.0)),
        "{r:?}"
    );
    // A fast local server answers well within the 2 ms between a connection's requests.
    assert!(r.latency_us.p50 < 2000.0, "{:?}", r.latency_us);
}

#[test]
fn warmup_is_sent_but_not_recorded_and_threads_share_the_rate() {
    let srv = divvy_server(DivvyBehaviour::default());
    let a = args(&format!(
        "--target {} --rate 1000 --warmup 0.4 --duration 0.6 --connections 4 --threads 2 --actors 10000",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    let t = &srv.tally;
    let seen = t.get(&t.lines);
    assert!((990..=1000).contains(&seen), "server saw {seen}");
    assert!((590..=600).contains(&r.requests), "{r:?}");
    assert!((r.duration_secs - 0.6).abs() < 0.05, "{r:?}");
}

#[test]
fn a_paced_open_loop_sends_each_intervals_requests_in_one_write() {
    let srv = divvy_server(DivvyBehaviour {
        limit: 1_000_000,
        ..DivvyBehaviour::default()
    });
    // A request due every 50 us over four connections, sent in 20 ms paces: 100 per connection
    // per pace, in one write (25 paces x 4 connections = 100 writes). Written one at a time they
    // arrived in about 3 200 reads; sent whenever an answer woke the loop, in about 400.
    let a = args(&format!(
        "--target {} --rate 20000 --pace-us 20000 --duration 0.5 --connections 4 --pipeline 256 --actors 100",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert!((9_900..=10_000).contains(&r.requests), "{r:?}");
    assert_eq!(r.unanswered, 0, "{r:?}");
    let reads = srv.tally.get(&srv.tally.reads);
    assert!(
        reads <= r.requests / 50,
        "{reads} reads for {} requests",
        r.requests
    );
}

#[test]
fn a_paced_open_loop_keeps_its_rate_and_counts_the_lateness() {
    let srv = divvy_server(DivvyBehaviour::default());
    // Requests due every 0.5 ms, sent in 20 ms paces: each waits for the end of its pace, and
    // that wait is in its latency (measured from the due time), about 10 ms on average.
    let a = args(&format!(
        "--target {} --rate 2000 --pace-us 20000 --duration 1 --connections 4 --pipeline 64 --actors 100",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert!((1990..=2000).contains(&r.requests), "{r:?}");
    assert_eq!(r.unanswered, 0, "{r:?}");
    assert!(
        (0.95..1.05).contains(&(r.throughput_per_sec / 2000.0)),
        "{r:?}"
    );
    assert!(r.latency_us.p50 >= 3_000.0, "{:?}", r.latency_us);
    assert!(r.latency_us.max >= 15_000.0, "{:?}", r.latency_us);
}

#[test]
fn pacing_without_a_rate_is_refused() {
    let error = refusal("--target 127.0.0.1:1 --pace-us 100 --duration 0.1");
    assert!(
        error.contains("--pace-us 100") && error.contains("--rate"),
        "{error}"
    );
}
