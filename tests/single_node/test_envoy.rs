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

/// A client that writes HTTP/2 frames by hand over a plain socket, to do
/// what well-behaved clients never do.
struct RawHttp2 {
    socket: std::net::TcpStream,
    encoder: loona_hpack::Encoder<'static>,
    unread: Vec<u8>,
}

/// Frame types and flags (RFC 9113).
const HEADERS: u8 = 0x1;
const DATA: u8 = 0x0;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;

impl RawHttp2 {
    /// Connected, the preface and an empty SETTINGS sent.
    fn connect(addr: SocketAddr) -> RawHttp2 {
        let socket = std::net::TcpStream::connect(addr).unwrap();
        socket
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut client = RawHttp2 {
            socket,
            encoder: loona_hpack::Encoder::new(),
            unread: Vec::new(),
        };
        client.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        client.frame(SETTINGS, 0, 0, &[]);
        client
    }

    fn send(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.socket.write_all(bytes).unwrap();
    }

    fn frame(&mut self, kind: u8, flags: u8, stream_id: u32, payload: &[u8]) {
        let length = (payload.len() as u32).to_be_bytes();
        let mut frame = vec![length[1], length[2], length[3], kind, flags];
        frame.extend_from_slice(&stream_id.to_be_bytes());
        frame.extend_from_slice(payload);
        self.send(&frame);
    }

    /// HEADERS of a `ShouldRateLimit` call on `stream_id`.
    fn headers(&mut self, stream_id: u32, end_stream: bool) {
        let block = self.encoder.encode(vec![
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (
                b":path",
                b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            ),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]);
        let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
        self.frame(HEADERS, flags, stream_id, &block);
    }

    /// The request message of `request`, gRPC-prefixed, ending the stream.
    fn message(&mut self, stream_id: u32, request: &RateLimitRequest) {
        let message = prost::Message::encode_to_vec(request);
        let mut body = vec![0];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(&message);
        self.frame(DATA, END_STREAM, stream_id, &body);
    }

    /// The next frame, or `None` once the server closed the connection.
    fn next_frame(&mut self) -> Option<(u8, u8, u32, Vec<u8>)> {
        use std::io::Read;
        loop {
            if self.unread.len() >= 9 {
                let length = u32::from_be_bytes([0, self.unread[0], self.unread[1], self.unread[2]])
                    as usize;
                if self.unread.len() >= 9 + length {
                    let frame: Vec<u8> = self.unread.drain(..9 + length).collect();
                    let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]);
                    return Some((frame[3], frame[4], stream_id, frame[9..].to_vec()));
                }
            }
            let mut buffer = [0u8; 16 * 1024];
            match self.socket.read(&mut buffer) {
                Ok(0) => return None,
                Ok(read) => self.unread.extend_from_slice(&buffer[..read]),
                Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(error) => panic!("reading from the server: {error}"),
            }
        }
    }
}

/// A client that opens more streams than allowed has the extra ones
/// refused (REFUSED_STREAM) while the allowed ones are answered, and other
/// clients are served meanwhile.
#[test]
fn a_stream_flood_is_refused_beyond_the_streams_allowed() {
    let grpc = GrpcServer::start_with(GrpcConfig {
        streams_per_connection_max: 8,
        ..GrpcConfig::default()
    });
    let mut flood = RawHttp2::connect(grpc.grpc_addr);
    // 20 streams opened, none finished: 8 are allowed.
    let opened: Vec<u32> = (0..20).map(|i| 2 * i + 1).collect();
    for &stream_id in &opened {
        flood.headers(stream_id, false);
    }
    let mut refused = Vec::new();
    while refused.len() < 12 {
        let (kind, _, stream_id, payload) = flood.next_frame().expect("the server answers");
        if kind == RST_STREAM {
            assert_eq!(payload, REFUSED_STREAM.to_be_bytes());
            refused.push(stream_id);
        }
    }
    assert_eq!(refused, opened[8..].to_vec());
    // Another client is served meanwhile.
    let mut other = grpc.client();
    let response = other
        .call(request(vec![descriptor(&[("path", "/upload")])]))
        .unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32);
    // The allowed streams finish and are answered, each with its trailers.
    let call = request(vec![descriptor(&[("path", "/open")])]);
    for &stream_id in &opened[..8] {
        flood.message(stream_id, &call);
    }
    let mut decoder = loona_hpack::Decoder::new();
    let mut answered = Vec::new();
    while answered.len() < 8 {
        let (kind, flags, stream_id, payload) = flood.next_frame().expect("the server answers");
        if kind == HEADERS {
            let headers = decoder.decode(&payload).unwrap();
            if flags & END_STREAM != 0 {
                assert!(
                    headers.contains(&(b"grpc-status".to_vec(), b"0".to_vec())),
                    "{headers:?}"
                );
                answered.push(stream_id);
            }
        }
    }
    answered.sort_unstable();
    assert_eq!(answered, opened[..8].to_vec());
}

/// A client that stops in the middle of a frame is pinged once it has been
/// silent for the keep-alive interval and closed when it stays silent; a
/// client that opens and resets streams by the thousand is served after.
#[test]
fn half_open_connections_are_closed_and_rapid_resets_do_not_stop_the_server() {
    let grpc = GrpcServer::start_with(GrpcConfig {
        keep_alive_ms: 300,
        ..GrpcConfig::default()
    });
    let mut silent = RawHttp2::connect(grpc.grpc_addr);
    // Five bytes of a frame's nine-byte header, and then nothing.
    silent.send(&[0, 0, 10, HEADERS, END_HEADERS]);
    let started = std::time::Instant::now();
    let mut pinged = false;
    while let Some((kind, flags, _, _)) = silent.next_frame() {
        pinged |= kind == PING && flags == 0;
    }
    assert!(pinged, "the server pings a silent client before closing");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));

    let mut resets = RawHttp2::connect(grpc.grpc_addr);
    for i in 0..2_000 {
        let stream_id = 2 * i + 1;
        resets.headers(stream_id, false);
        resets.frame(RST_STREAM, 0, stream_id, &8u32.to_be_bytes());
    }
    resets.headers(4_001, false);
    resets.message(4_001, &request(vec![descriptor(&[("path", "/open")])]));
    let mut decoder = loona_hpack::Decoder::new();
    loop {
        let (kind, flags, stream_id, payload) = resets.next_frame().expect("the server answers");
        assert_ne!(kind, GOAWAY, "{payload:?}");
        if kind == HEADERS {
            // Every header block is decoded, so the table stays in step.
            let headers = decoder.decode(&payload).unwrap();
            if stream_id == 4_001 && flags & END_STREAM != 0 {
                assert!(headers.contains(&(b"grpc-status".to_vec(), b"0".to_vec())));
                break;
            }
        }
    }
    let mut other = grpc.client();
    let response = other
        .call(request(vec![descriptor(&[("path", "/open")])]))
        .unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32);
}
