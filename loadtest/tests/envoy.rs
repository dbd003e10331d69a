//! `--protocol envoy-rls` against a real Tollgate's gRPC endpoint (started in-process by `App`, as
//! `tollgate serve --grpc-listen` starts it, with the embedded default rules): exact OK/OVER_LIMIT
//! counts for a known limit (the cookie rule: 3 per hour per `ip`) agreeing with the server's own
//! call counts and with a `HIT` line on the same counter, many streams per connection held within
//! the server's `MAX_CONCURRENT_STREAMS`, refused calls counted as errors on a connection that keeps
//! serving, open loop, and a target that does not speak HTTP/2 refused clearly.
//!
//! The rule's window is an hour on the real clock and every test ends within seconds, so the counts
//! are exact.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod tollgate_support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

use common::args;
use tollgate::envoy::{EnvoyLimits, GrpcConfig};
use tollgate::metrics::GrpcMethod;
use tollgate_support::Tollgate;

/// Allowed hits per actor and hour of the embedded cookie rule.
const COOKIE_LIMIT: u64 = 3;

/// The report's counts and latencies (its `Debug` form includes the whole histogram).
fn brief(r: &tollgate_loadtest::Report) -> String {
    format!(
        "requests {} allowed {} denied {} errors {} unanswered {} reconnects {} latency {:?}",
        r.requests, r.allowed, r.denied, r.errors, r.unanswered, r.reconnects, r.latency_us
    )
}

/// gRPC status codes the tests meet.
const OK: usize = 0;
const INVALID_ARGUMENT: usize = 3;

/// ShouldRateLimit calls the server answered with gRPC status `code`.
fn served(srv: &Tollgate, code: usize) -> u64 {
    srv.engine
        .metrics
        .grpc_responses(GrpcMethod::ShouldRateLimit, code)
}

#[test]
fn counts_match_the_rule_and_the_server_exactly() {
    let srv = Tollgate::start(64 * 1024);
    let a = args(&format!(
        "--target {} --protocol envoy-rls --actors 20 --requests 2000 --connections 4 \
         --pipeline 16 --duration 20 --seed 9 --actor-prefix x",
        srv.grpc_addr
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    // 20 actors drawn 2000 times: each far more often than its 3 allowed hits.
    assert_eq!(r.allowed, 20 * COOKIE_LIMIT, "{}", brief(&r));
    assert_eq!(r.denied, 2000 - 20 * COOKIE_LIMIT, "{}", brief(&r));
    assert_eq!(
        (r.errors, r.unanswered, r.reconnects),
        (0, 0, 0),
        "{}",
        brief(&r)
    );
    assert_eq!(r.requests, 2000);
    assert!(r.latency_us.p50 > 0.0 && r.latency_us.max >= r.latency_us.p99);
    assert_eq!(served(&srv, OK), 2000);
    // The descriptor is the operation `domain=loadtest method=GET path=… ip=x0`: its counter is
    // spent for a HIT line too.
    let mut line = TcpStream::connect(srv.line_addr).unwrap();
    line.write_all(b"HIT domain=loadtest method=GET path=/pantry/cookies/chocolate-chip ip=x0\n")
        .unwrap();
    let mut answer = String::new();
    BufReader::new(line).read_line(&mut answer).unwrap();
    assert!(answer.starts_with("OK false 0 "), "{answer}");
}

#[test]
fn many_streams_per_connection_stay_within_the_servers_limit() {
    // The server allows 8 concurrent streams per connection; the generator asks for 64 and must
    // hold back to 8 (a stream over the limit would be refused, and counted as an error).
    let srv = Tollgate::start_with(
        64 * 1024,
        GrpcConfig {
            streams_per_connection_max: 8,
            ..GrpcConfig::default()
        },
    );
    let a = args(&format!(
        "--target {} --protocol envoy-rls --actors 100000 --requests 6000 --connections 2 \
         --pipeline 64 --duration 30 --actor-prefix m",
        srv.grpc_addr
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert_eq!(r.requests, 6000, "{}", brief(&r));
    assert_eq!(
        (r.errors, r.unanswered, r.reconnects),
        (0, 0, 0),
        "{}",
        brief(&r)
    );
    // 100 000 actors, 6000 draws: most are first hits (allowed), a few repeats are too.
    assert!(
        r.allowed > 5000 && r.allowed + r.denied == 6000,
        "{}",
        brief(&r)
    );
    assert_eq!(served(&srv, OK), 6000);
}

#[test]
fn refused_calls_are_errors_and_the_connection_keeps_serving() {
    // Descriptors of at most 2 entries: the default template's 3 are refused (INVALID_ARGUMENT).
    let srv = Tollgate::start_with(
        64 * 1024,
        GrpcConfig {
            limits: EnvoyLimits {
                entries_per_descriptor_max: 2,
                ..EnvoyLimits::default()
            },
            ..GrpcConfig::default()
        },
    );
    let a = args(&format!(
        "--target {} --protocol envoy-rls --actors 10 --requests 300 --connections 2 \
         --pipeline 8 --duration 20",
        srv.grpc_addr
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert_eq!(
        (r.allowed, r.denied, r.errors),
        (0, 0, 300),
        "{}",
        brief(&r)
    );
    assert_eq!((r.unanswered, r.reconnects), (0, 0), "{}", brief(&r));
    assert_eq!(served(&srv, INVALID_ARGUMENT), 300);
}

#[test]
fn open_loop_keeps_its_rate() {
    let srv = Tollgate::start(64 * 1024);
    let a = args(&format!(
        "--target {} --protocol envoy-rls --rate 2000 --duration 1 --connections 4 --pipeline 4 \
         --actors 100 --actor-prefix o",
        srv.grpc_addr
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert!((1990..=2000).contains(&r.requests), "{}", brief(&r));
    assert_eq!(r.allowed, 100 * COOKIE_LIMIT, "{}", brief(&r));
    assert_eq!((r.errors, r.unanswered), (0, 0), "{}", brief(&r));
}

#[test]
fn a_target_without_http2_is_refused_clearly() {
    let srv = Tollgate::start(64 * 1024);
    let a = args(&format!(
        "--target {} --protocol envoy-rls --duration 1 --connections 1",
        srv.line_addr
    ));
    let e = tollgate_loadtest::run(&a).unwrap_err();
    let text = format!("{e:#}");
    assert!(text.contains("HTTP/2"), "{text}");
}

#[test]
fn templates_without_a_domain_or_entries_are_refused() {
    for template in ["ip={actor}", "domain=d"] {
        let argv = [
            "tollgate-loadtest",
            "--protocol",
            "envoy-rls",
            "--template",
            template,
        ];
        let a = tollgate_loadtest::Args::parse_from_iter(argv).unwrap();
        assert!(a.validate().is_err(), "{template}");
    }
    let a = args("--protocol envoy-rls --check");
    assert!(a.validate().is_err());
}
