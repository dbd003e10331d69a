//! Envoy's rate limit service on the redis backend: gRPC calls and `HIT`
//! lines count the same key in divvy's layout, `hits_addend` is applied in
//! one script call, and a Redis that is gone makes the call fail with
//! `UNAVAILABLE` (Envoy's `failure_mode_deny` then decides) until it is back.

use crate::util;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use redis::Commands;
use tollgate::app::ServeConfig;
use tollgate::envoy::GrpcConfig;
use tollgate::rules::RuleSet;
use util::envoy::{descriptor, request, GrpcClient};
use util::redis::{redis_config, wait_for, RedisServer};
use util::{request as line_request, TestServer};

const RULES: &str = "\
[domain=edge path=/login]
creditLimit = 5
resetSeconds = 60
actorField = ip

[default]
creditLimit = 0
resetSeconds = 60
";

#[test]
fn grpc_calls_and_hit_lines_count_one_redis_key() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let config = ServeConfig {
        redis: redis_config(&redis.url(), 2_000),
        grpc: GrpcConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            ..GrpcConfig::default()
        },
        ..util::test_config(RuleSet::from_ini(RULES).unwrap())
    };
    let server = TestServer::start_app(config, tollgate::app::Hooks::default());
    let mut client = GrpcClient::connect(server.app.grpc_addr().unwrap());
    let login = || request(vec![descriptor(&[("path", "/login"), ("ip", "10.0.0.7")])]);
    let key = "divvy:domain=edge path=/login:10.0.0.7:5:60";

    let response = client.call(login()).unwrap();
    assert_eq!(response.statuses[0].limit_remaining, 4);
    let stored: i64 = redis.connection().get(key).unwrap();
    assert_eq!(stored, 4);

    let mut line = server.connect();
    assert!(
        line_request(&mut line, "HIT domain=edge path=/login ip=10.0.0.7")
            .starts_with("OK true 3 ")
    );
    let mut three = login();
    three.hits_addend = 3;
    let response = client.call(three.clone()).unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32);
    assert_eq!(response.statuses[0].limit_remaining, 0);
    let stored: i64 = redis.connection().get(key).unwrap();
    assert_eq!(stored, 0);
    let response = client.call(login()).unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    let ttl = response.statuses[0].duration_until_reset.unwrap().seconds;
    assert!((58..=60).contains(&ttl), "{ttl}");

    // Redis gone: the call fails with UNAVAILABLE, within the backend timeout.
    redis.kill();
    let status = client.call(login()).unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // Back (empty): calls are answered again, on fresh counters.
    redis.restart();
    assert!(
        wait_for(std::time::Duration::from_secs(10), || client
            .call(login())
            .is_ok_and(|r| r.overall_code == Code::Ok as i32)),
        "the gRPC endpoint answers again once Redis is back"
    );
}
