//! Envoy's rate limit service (`--grpc-listen`) over a real HTTP/2
//! connection, with tonic's client: descriptors decided by divvy's rules
//! (limit, unit, remaining credit, reset), counters shared with `HIT` lines,
//! every descriptor counted when another is over, `hits_addend` and looks
//! (descriptor `hits_addend` 0), bad requests answered with a clear status
//! while the connection keeps serving, gRPC health, and the metrics.

use crate::util::envoy::{descriptor, request, GrpcClient};
use crate::util::{self, TestServer};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{Duration, UInt64Value};
use std::net::SocketAddr;
use std::sync::Arc;
use tollgate::app::ServeConfig;
use tollgate::clock::ManualClock;
use tollgate::envoy::GrpcConfig;
use tollgate::metrics::GrpcMethod;
use tollgate::rules::RuleSet;
use tonic::transport::Channel;

const RULES: &str = "\
[domain=edge path=/login]
creditLimit = 3
resetSeconds = 60
actorField = ip
label = login

[domain=edge path=/upload]
creditLimit = 2
resetSeconds = 30

[domain=edge path=/closed]
creditLimit = 0
resetSeconds = 60

[domain=edge path=/open]
creditLimit = 5
resetSeconds = 0

[default]
creditLimit = 100
resetSeconds = 3600
";

struct GrpcServer {
    server: TestServer,
    grpc_addr: SocketAddr,
    clock: Arc<ManualClock>,
}

impl GrpcServer {
    fn start() -> GrpcServer {
        Self::start_with(GrpcConfig::default())
    }

    /// `grpc.listen` is replaced by 127.0.0.1 port 0.
    fn start_with(grpc: GrpcConfig) -> GrpcServer {
        let clock = util::manual_clock();
        let config = ServeConfig {
            grpc: GrpcConfig {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                ..grpc
            },
            ..util::test_config(RuleSet::from_ini(RULES).unwrap())
        };
        let server = TestServer::start_app(config, util::on_clock(clock.clone()));
        let grpc_addr = server.app.grpc_addr().expect("the gRPC endpoint serves");
        GrpcServer {
            server,
            grpc_addr,
            clock,
        }
    }

    fn client(&self) -> GrpcClient {
        GrpcClient::connect(self.grpc_addr)
    }
}

fn status(
    code: Code,
    limit: Option<(u32, Unit, &str)>,
    remaining: u32,
    reset_seconds: Option<i64>,
) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: limit.map(|(requests, unit, name)| RateLimit {
            name: name.into(),
            requests_per_unit: requests,
            unit: unit as i32,
        }),
        limit_remaining: remaining,
        duration_until_reset: reset_seconds.map(|seconds| Duration { seconds, nanos: 0 }),
        quota: None,
    }
}

#[test]
fn envoy_descriptors_are_decided_by_the_rules() {
    let grpc = GrpcServer::start();
    let mut client = grpc.client();
    let login = || descriptor(&[("path", "/login"), ("ip", "10.0.0.1")]);
    let limit = Some((3, Unit::Minute, "login"));
    for remaining in [2, 1, 0] {
        let response = client.call(request(vec![login()])).unwrap();
        assert_eq!(response.overall_code, Code::Ok as i32);
        assert_eq!(
            response.statuses,
            vec![status(Code::Ok, limit, remaining, Some(60))]
        );
    }
    grpc.clock.advance_ms(20_400);
    let response = client.call(request(vec![login()])).unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    assert_eq!(
        response.statuses,
        vec![status(Code::OverLimit, limit, 0, Some(40))]
    );
    // Another actor (ip) has its own counter; a window without an Envoy
    // unit says UNKNOWN; the default rule applies to unknown paths.
    let response = client
        .call(request(vec![
            descriptor(&[("path", "/login"), ("ip", "10.0.0.2")]),
            descriptor(&[("path", "/upload")]),
            descriptor(&[("path", "/elsewhere")]),
            descriptor(&[("path", "/open")]),
        ]))
        .unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32);
    assert_eq!(
        response.statuses,
        vec![
            status(Code::Ok, limit, 2, Some(60)),
            status(Code::Ok, Some((2, Unit::Unknown, "")), 1, Some(30)),
            status(Code::Ok, Some((100, Unit::Hour, "")), 99, Some(3600)),
            status(Code::Ok, None, 5, None),
        ]
    );
    // The window resets: the first actor is allowed again.
    grpc.clock.advance_ms(40_000);
    let response = client.call(request(vec![login()])).unwrap();
    assert_eq!(
        response.statuses,
        vec![status(Code::Ok, limit, 2, Some(60))]
    );
}

#[test]
fn hit_lines_and_grpc_calls_draw_from_one_counter() {
    let grpc = GrpcServer::start();
    let mut client = grpc.client();
    let mut line = grpc.server.connect();
    let hit = "HIT domain=edge path=/login ip=10.9.9.9";
    let rpc = || request(vec![descriptor(&[("path", "/login"), ("ip", "10.9.9.9")])]);
    assert_eq!(util::request(&mut line, hit), "OK true 2 60");
    let response = client.call(rpc()).unwrap();
    assert_eq!(response.statuses[0].limit_remaining, 1);
    assert_eq!(util::request(&mut line, hit), "OK true 0 60");
    let response = client.call(rpc()).unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    assert_eq!(util::request(&mut line, hit), "OK false 0 60");
    // Entry order does not matter to divvy's rules: the same operation.
    let reordered = request(vec![descriptor(&[("ip", "10.9.9.9"), ("path", "/login")])]);
    let response = client.call(reordered).unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
}

#[test]
fn every_descriptor_is_counted_when_one_is_over() {
    let grpc = GrpcServer::start();
    let mut client = grpc.client();
    let both = || {
        request(vec![
            descriptor(&[("path", "/closed")]),
            descriptor(&[("path", "/upload")]),
        ])
    };
    let closed = status(Code::OverLimit, Some((0, Unit::Unknown, "")), 0, None);
    let upload = |code, remaining| status(code, Some((2, Unit::Unknown, "")), remaining, Some(30));
    let response = client.call(both()).unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    assert_eq!(response.statuses, vec![closed.clone(), upload(Code::Ok, 1)]);
    let response = client.call(both()).unwrap();
    assert_eq!(response.statuses, vec![closed.clone(), upload(Code::Ok, 0)]);
    let response = client.call(both()).unwrap();
    assert_eq!(response.statuses, vec![closed, upload(Code::OverLimit, 0)]);
    let mut line = grpc.server.connect();
    assert_eq!(
        util::request(&mut line, "HIT domain=edge path=/upload"),
        "OK false 0 30"
    );
}

#[test]
fn hits_addend_counts_many_hits_and_zero_only_looks() {
    let grpc = GrpcServer::start();
    let mut client = grpc.client();
    let login = || descriptor(&[("path", "/login"), ("ip", "10.1.1.1")]);
    let limit = Some((3, Unit::Minute, "login"));
    let mut two = request(vec![login()]);
    two.hits_addend = 2;
    let response = client.call(two.clone()).unwrap();
    assert_eq!(
        response.statuses,
        vec![status(Code::Ok, limit, 1, Some(60))]
    );
    // A look: what one more hit would get, nothing counted.
    let mut look = login();
    look.hits_addend = Some(UInt64Value { value: 0 });
    for _ in 0..3 {
        let response = client.call(request(vec![look.clone()])).unwrap();
        assert_eq!(
            response.statuses,
            vec![status(Code::Ok, limit, 0, Some(60))]
        );
    }
    // Two more hits than the one left: over, and the one left is used (as
    // two hits in a row would).
    let response = client.call(two).unwrap();
    assert_eq!(
        response.statuses,
        vec![status(Code::OverLimit, limit, 0, Some(60))]
    );
    let response = client.call(request(vec![look])).unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    // The descriptor's hits_addend wins over the request's.
    let mut one = descriptor(&[("path", "/upload")]);
    one.hits_addend = Some(UInt64Value { value: 1 });
    let mut request_of_five = request(vec![one]);
    request_of_five.hits_addend = 5;
    let response = client.call(request_of_five).unwrap();
    assert_eq!(response.statuses[0].code, Code::Ok as i32);
    assert_eq!(response.statuses[0].limit_remaining, 1);
}

/// `RateLimitRequest` with its strings as bytes, to send what a correct
/// client cannot (non-UTF-8 values).
#[derive(Clone, PartialEq, prost::Message)]
struct RawRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<RawEntry>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

fn send_raw(grpc: &GrpcServer, raw: RawRequest) -> Result<RateLimitResponse, tonic::Status> {
    let url = format!("http://{}", grpc.grpc_addr);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let channel = Channel::from_shared(url).unwrap().connect().await.unwrap();
        let mut client = tonic::client::Grpc::new(channel);
        client.ready().await.unwrap();
        let codec = tonic_prost::ProstCodec::<RawRequest, RateLimitResponse>::default();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        );
        client
            .unary(tonic::Request::new(raw), path, codec)
            .await
            .map(tonic::Response::into_inner)
    })
}

#[test]
fn bad_requests_get_a_clear_status_and_the_connection_keeps_serving() {
    let grpc = GrpcServer::start();
    let mut client = grpc.client();
    let good = || request(vec![descriptor(&[("path", "/upload")])]);
    // Empty entries (2 bytes each), so that the message stays under the
    // size limit and the entry count is what is refused.
    let many = vec![("", ""); 10_000];
    let mut huge_addend = good();
    huge_addend.hits_addend = u32::MAX;
    let mut oversized = good();
    oversized.domain = "x".repeat(100 * 1024);
    let cases = [
        (
            RateLimitRequest {
                domain: String::new(),
                ..good()
            },
            tonic::Code::InvalidArgument,
            "domain must not be empty",
        ),
        (
            request(vec![]),
            tonic::Code::InvalidArgument,
            "descriptor list must not be empty",
        ),
        (
            request(vec![descriptor(&[("path", "/upload")]), descriptor(&[])]),
            tonic::Code::InvalidArgument,
            "descriptor 1 has no entries",
        ),
        (
            request(vec![descriptor(&many)]),
            tonic::Code::InvalidArgument,
            "10000 entries",
        ),
        (
            huge_addend,
            tonic::Code::InvalidArgument,
            "hits_addend 4294967295",
        ),
        (
            request(vec![descriptor(&[("domain", "other")])]),
            tonic::Code::InvalidArgument,
            "`domain` is reserved",
        ),
        (oversized, tonic::Code::ResourceExhausted, "65536 bytes"),
    ];
    for (bad, code, message) in cases {
        let status = client.call(bad).unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(message), "{status:?}");
    }
    let not_utf8 = RawRequest {
        domain: b"edge".to_vec(),
        descriptors: vec![RawDescriptor {
            entries: vec![RawEntry {
                key: b"path".to_vec(),
                value: vec![0xff, 0xfe],
            }],
        }],
    };
    let status = send_raw(&grpc, not_utf8).unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("UTF-8"), "{status:?}");
    // Nothing was counted for the refused requests; the connection serves on.
    let response = client.call(good()).unwrap();
    assert_eq!(response.statuses[0].limit_remaining, 1);

    let metrics = &grpc.server.engine.metrics;
    let count =
        |code: tonic::Code| metrics.grpc_responses(GrpcMethod::ShouldRateLimit, code as usize);
    assert_eq!(count(tonic::Code::InvalidArgument), 7);
    assert_eq!(count(tonic::Code::ResourceExhausted), 1);
    assert_eq!(count(tonic::Code::Ok), 1);
}

#[test]
fn grpc_health_says_serving() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let grpc = GrpcServer::start();
    let url = format!("http://{}", grpc.grpc_addr);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let channel = Channel::from_shared(url).unwrap().connect().await.unwrap();
        let mut health = HealthClient::new(channel);
        for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
            let response = health
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap();
            assert_eq!(response.into_inner().status, ServingStatus::Serving as i32);
        }
        let status = health
            .check(HealthCheckRequest {
                service: "other".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::NotFound);
    });
}

/// Is `python3` there with grpcio and grpcio-tools? Without them the test
/// fails (CI installs them: `.ci/run`), unless `TOLLGATE_SKIP_PYTHON_GRPC=1`
/// outside CI.
fn python_grpc_installed() -> bool {
    let found = std::process::Command::new("python3")
        .args(["-c", "import grpc, grpc_tools"])
        .output()
        .is_ok_and(|output| output.status.success());
    if found {
        return true;
    }
    let in_ci = std::env::var_os("CI").is_some();
    let skip = std::env::var("TOLLGATE_SKIP_PYTHON_GRPC").as_deref() == Ok("1");
    eprintln!(
        "\n!!!!!!!! python3 with grpcio and grpcio-tools is missing: the grpcio client test cannot run !!!!!!!!\n\
         install them (pip install -r tests/python/requirements.txt), or set TOLLGATE_SKIP_PYTHON_GRPC=1 to skip it outside CI\n"
    );
    assert!(
        skip && !in_ci,
        "python3 with grpcio and grpcio-tools is required for this test"
    );
    false
}

/// An independent gRPC implementation as the client: Python's grpcio with
/// stubs generated from Envoy's rls.proto (`tests/python/`) replays a
/// transcript and checks every field of every answer.
#[test]
fn the_python_grpcio_client_gets_every_field_right() {
    if !python_grpc_installed() {
        return;
    }
    let grpc = GrpcServer::start();
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/rls_client.py");
    let output = std::process::Command::new("python3")
        .arg(&script)
        .arg(grpc.grpc_addr.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}\n{stdout}\n{}",
        script.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(seen["checked"], 11, "{stdout}");
}

/// Connections that never speak are closed (they would hold a connection
/// slot for good), while a client that speaks is served as usual.
#[test]
fn a_connection_that_sends_nothing_is_closed() {
    use std::io::Read;
    let grpc = GrpcServer::start_with(GrpcConfig {
        first_byte_timeout_ms: 200,
        ..GrpcConfig::default()
    });
    let mut silent = std::net::TcpStream::connect(grpc.grpc_addr).unwrap();
    silent
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let started = std::time::Instant::now();
    let mut buffer = [0u8; 64];
    // Closed without a byte: the server never started HTTP/2 on it.
    assert_eq!(silent.read(&mut buffer).unwrap(), 0);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    let mut client = grpc.client();
    let response = client
        .call(request(vec![descriptor(&[("path", "/upload")])]))
        .unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32);
}
