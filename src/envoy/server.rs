//! The gRPC endpoint (`--grpc-listen`): HTTP/2 connections on the
//! thread-per-core acceptor that the line protocol and droplet share (the
//! connection limit, panics and drain are handled there), each served by
//! one task that reads, hands the bytes to the purpose-built
//! [`http2::Connection`], decides every call whose request is complete in
//! that read, and writes all their answers at once: the line protocol's
//! shape (hyper's general server cost ten times the decision per call;
//! docs/benchmarks.md, issue 16). Two methods are answered:
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` and
//! `grpc.health.v1.Health/Check`; any other is `UNIMPLEMENTED`, a request
//! that is not gRPC gets HTTP's 415.
//!
//! A call whose backend answers later (Redis, a shard on another cluster
//! node) waits in the connection's set of pending calls, polled beside the
//! socket; the memory backend answers at once. Bad input stays bounded: a
//! message larger than `message_bytes_max` is refused
//! (`RESOURCE_EXHAUSTED`) without being kept, one that does not decode
//! (truncated, non-UTF-8 strings) is `INVALID_ARGUMENT`, streams per
//! connection are capped (more are refused, `REFUSED_STREAM`), a connection
//! that sends nothing is closed after `first_byte_timeout_ms`, one silent
//! for `keep_alive_ms` is pinged and closed when another `keep_alive_ms`
//! passes without a byte, and one that stops reading its answers is closed
//! after `keep_alive_ms`. Every call is counted in
//! `tollgate_grpc_requests_total` by method and status code.

use super::http2::{self, Call, Http2Limits, Route};
use super::mapping::{self, EnvoyLimits, Operation, RequestView};
use super::wire;
use crate::engine::{Arrival, Engine, OperationOutcome};
use crate::metrics::{GrpcMethod, Metrics};
use crate::server::{AcceptorConfig, ConnectionHandler, Serving, ThreadPerCore};
use bytes::{Buf, BytesMut};
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use smallvec::SmallVec;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::Status;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// The path of Envoy's rate limit call.
pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// The path of the gRPC health check.
pub const HEALTH_CHECK_PATH: &str = "/grpc.health.v1.Health/Check";
/// The paths answered, in [`Route::Known`]'s order.
const ROUTES: &[&str] = &[SHOULD_RATE_LIMIT_PATH, HEALTH_CHECK_PATH];
const ROUTE_SHOULD_RATE_LIMIT: usize = 0;
const ROUTE_HEALTH_CHECK: usize = 1;
/// Largest request header block, in bytes.
const HEADER_BLOCK_BYTES_MAX: usize = 16 * 1024;
/// gRPC's message prefix: a compression flag and a 4-byte length.
const MESSAGE_PREFIX_BYTES: usize = 5;
/// Room kept free in a connection's read buffer, in bytes.
const READ_ROOM_BYTES: usize = 32 * 1024;

/// Where and how the gRPC endpoint serves.
#[derive(Debug, Clone)]
pub struct GrpcServerConfig {
    pub listen: SocketAddr,
    /// Serving threads (one runtime and listener each).
    pub threads: usize,
    /// Most connections open at once; more are closed at once.
    pub connections_max: usize,
    /// How long shutdown waits for connections to finish their calls.
    pub drain_timeout_ms: u64,
    /// Largest request message, in bytes.
    pub message_bytes_max: usize,
    /// Most concurrent streams per HTTP/2 connection.
    pub streams_per_connection_max: u32,
    /// A connection that sends nothing for this long after connecting is
    /// closed.
    pub first_byte_timeout_ms: u64,
    /// A connection silent this long is pinged, and closed when as long
    /// again passes without a byte; also the bound on a write.
    pub keep_alive_ms: u64,
    pub limits: EnvoyLimits,
}

/// What every gRPC connection shares.
pub struct GrpcProtocol {
    engine: Arc<Engine>,
    message_bytes_max: usize,
    streams_per_connection_max: u32,
    first_byte_timeout_ms: u64,
    keep_alive_ms: u64,
    limits: EnvoyLimits,
}

/// The endpoint with its listeners bound, not serving yet.
pub type GrpcServer = ThreadPerCore<GrpcProtocol>;

/// Binds the endpoint's listeners (one per serving thread).
pub fn bind(
    config: GrpcServerConfig,
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
) -> std::io::Result<GrpcServer> {
    let handler = Arc::new(GrpcProtocol {
        engine,
        message_bytes_max: config.message_bytes_max.max(1),
        streams_per_connection_max: config.streams_per_connection_max.max(1),
        first_byte_timeout_ms: config.first_byte_timeout_ms.max(1),
        keep_alive_ms: config.keep_alive_ms.max(1),
        limits: config.limits,
    });
    let acceptor = AcceptorConfig {
        listen: config.listen,
        threads: config.threads,
        connections_max: config.connections_max.max(1),
        drain_timeout_ms: config.drain_timeout_ms,
        thread_name: "tollgate-grpc",
    };
    ThreadPerCore::bind(acceptor, handler, metrics)
}

/// A serving endpoint, as every endpoint's.
pub type RunningGrpc = Serving;

/// A call whose answer comes later: its stream, method, and its response
/// message (prefixed) or status.
type PendingCall = BoxFuture<'static, (u32, GrpcMethod, Result<Vec<u8>, Status>)>;

impl ConnectionHandler for GrpcProtocol {
    async fn serve(self: Arc<Self>, mut stream: TcpStream, mut shutdown: watch::Receiver<bool>) {
        let _ = stream.set_nodelay(true);
        let limits = Http2Limits {
            streams_max: self.streams_per_connection_max,
            body_bytes_max: self.message_bytes_max.saturating_add(MESSAGE_PREFIX_BYTES),
            header_block_bytes_max: HEADER_BLOCK_BYTES_MAX,
        };
        let mut conn = Conn {
            connection: http2::Connection::new(limits, ROUTES),
            pending: FuturesUnordered::new(),
            scratch: Vec::new(),
            outcomes: Vec::new(),
            mapped: Vec::new(),
        };
        let mut input = BytesMut::with_capacity(2 * READ_ROOM_BYTES);
        let mut calls: Vec<Call> = Vec::new();
        let keep_alive = Duration::from_millis(self.keep_alive_ms);
        // Nothing is written before the client speaks: a silent connection
        // is closed after `first_byte_timeout_ms` without a byte.
        let mut heard = false;
        let mut last_heard = Instant::now();
        let mut pinged = false;
        let timer = tokio::time::sleep(Duration::from_millis(self.first_byte_timeout_ms));
        tokio::pin!(timer);
        let mut draining = false;
        if *shutdown.borrow() {
            conn.connection.go_away();
            draining = true;
        }
        loop {
            if heard && !conn.connection.output().is_empty() {
                let written =
                    tokio::time::timeout(keep_alive, stream.write_all(conn.connection.output()))
                        .await;
                if !matches!(written, Ok(Ok(()))) {
                    break;
                }
                conn.connection.output().clear();
            }
            if conn.connection.is_finished() {
                break;
            }
            if input.capacity() - input.len() < READ_ROOM_BYTES {
                input.reserve(2 * READ_ROOM_BYTES);
            }
            tokio::select! {
                read = stream.read_buf(&mut input) => {
                    if !matches!(read, Ok(read) if read > 0) {
                        break;
                    }
                    last_heard = Instant::now();
                    if !heard {
                        // From now on the keep-alive watches the connection.
                        heard = true;
                        timer.as_mut().reset(last_heard + keep_alive);
                    }
                    let used = conn.connection.receive(&input, &mut calls);
                    if !calls.is_empty() {
                        // One clock read for the calls of a read, as for a
                        // read batch of lines.
                        let arrival = self.engine.arrival();
                        self.answer_read(&calls, &input, arrival, &mut conn);
                        calls.clear();
                    }
                    input.advance(used);
                }
                Some((stream_id, method, answer)) = conn.pending.next(), if !conn.pending.is_empty() => {
                    self.respond(&mut conn.connection, stream_id, method, answer);
                }
                _ = &mut timer => {
                    if !heard {
                        break;
                    }
                    let silent = last_heard.elapsed();
                    if silent >= keep_alive {
                        if pinged {
                            break;
                        }
                        conn.connection.ping();
                        pinged = true;
                        last_heard = Instant::now();
                    } else {
                        pinged = false;
                    }
                    timer.as_mut().reset(last_heard + keep_alive);
                }
                _ = shutdown.changed(), if !draining => {
                    conn.connection.go_away();
                    draining = true;
                }
            }
        }
        // Calls still deciding when the connection ended (their answers cannot
        // be sent) finish rather than stop halfway.
        while conn.pending.next().await.is_some() {}
    }

    async fn refuse(self: Arc<Self>, stream: TcpStream) {
        // An HTTP/2 client retries a connection closed before its settings.
        drop(stream);
    }
}

/// A descriptor of a read, as [`mapping::Operation`] but with its entries
/// in the read's list (the request's view is reused call to call).
struct ReadOperation<'a> {
    domain: &'a str,
    entries: Range<usize>,
    hits: u32,
    peek: bool,
}

/// A connection's state beside its socket: the HTTP/2 connection, the calls
/// whose backend answers later, and buffers kept from read to read.
struct Conn {
    connection: http2::Connection,
    pending: FuturesUnordered<PendingCall>,
    /// A response message being written.
    scratch: Vec<u8>,
    /// The outcomes of a read's descriptors.
    outcomes: Vec<OperationOutcome>,
    /// A read's requests: each call's stream and its operations' place, or
    /// why it cannot be decided.
    mapped: Vec<(u32, Result<Range<usize>, Status>)>,
}

impl GrpcProtocol {
    /// A `ShouldRateLimit` request's message read into `view`, and its
    /// descriptors as operations, or why it is refused (before anything is
    /// counted).
    fn read_request<'a>(
        &self,
        body: &'a [u8],
        view: &mut RequestView<'a>,
    ) -> Result<SmallVec<[Operation<'a>; 2]>, Status> {
        let message = request_message(body, self.message_bytes_max)?;
        wire::decode_request_into(message, view)
            .map_err(|error| Status::invalid_argument(error.to_string()))?;
        mapping::operations(view, &self.limits)
            .map_err(|error| Status::invalid_argument(error.to_string()))
    }

    /// Answers the calls of one read: every `ShouldRateLimit` request read
    /// in place and mapped, all their descriptors decided together
    /// ([`Engine::decide_operations`]), then each call answered, now or,
    /// when its backend answers later, once it has.
    fn answer_read(&self, calls: &[Call], input: &[u8], arrival: Arrival, conn: &mut Conn) {
        // Pass 1: each request read in place (into one view, reused) and
        // its descriptors listed as operations, their entries copied out of
        // the view (they point into the read's bytes); other calls answered
        // at once.
        let mut view = RequestView::default();
        let mut entries: Vec<(&str, &str)> = Vec::with_capacity(4 * calls.len());
        let mut operations: Vec<ReadOperation<'_>> = Vec::with_capacity(calls.len());
        let mut mapped = std::mem::take(&mut conn.mapped);
        for call in calls {
            let stream_id = call.stream_id;
            let body = call.body.bytes(input);
            match &call.route {
                _ if !call.grpc => conn.connection.respond_status(stream_id, 0, ""),
                Route::Known(ROUTE_SHOULD_RATE_LIMIT) => {
                    let result = self.read_request(body, &mut view).map(|listed| {
                        let first = operations.len();
                        for operation in listed {
                            let start = entries.len();
                            entries.extend_from_slice(operation.entries(&view));
                            operations.push(ReadOperation {
                                domain: operation.domain,
                                entries: start..entries.len(),
                                hits: operation.hits,
                                peek: operation.peek,
                            });
                        }
                        first..operations.len()
                    });
                    mapped.push((stream_id, result));
                }
                Route::Known(ROUTE_HEALTH_CHECK) => {
                    let answer = health_check(body, self.message_bytes_max);
                    self.respond(&mut conn.connection, stream_id, GrpcMethod::Health, answer);
                }
                Route::Known(_) | Route::Unknown(_) => {
                    let status = Status::unimplemented(format!("no such method: {}", call.route));
                    let code = status.code() as u32;
                    conn.connection
                        .respond_status(stream_id, code, status.message());
                }
            }
        }
        // Pass 2: decided together; pass 3: answered.
        let outcomes = &mut conn.outcomes;
        outcomes.clear();
        let each = operations.iter().map(|op| {
            let pairs = mapping::pairs_of(op.domain, &entries[op.entries.clone()]);
            (pairs, op.hits, op.peek)
        });
        self.engine.decide_operations(each, arrival, outcomes);
        let method = GrpcMethod::ShouldRateLimit;
        // Calls whose backend answers later, with their outcomes' place.
        let mut waiting: SmallVec<[(u32, Range<usize>); 4]> = SmallVec::new();
        for (stream_id, result) in mapped.drain(..) {
            let range = match result {
                Ok(range) => range,
                Err(status) => {
                    self.respond(&mut conn.connection, stream_id, method, Err(status));
                    continue;
                }
            };
            let outcomes = &conn.outcomes[range.clone()];
            let ready = outcomes.iter().map_while(|outcome| match outcome {
                OperationOutcome::Now(answer) => Some(answer),
                OperationOutcome::Later(_) => None,
            });
            if ready.clone().count() < outcomes.len() {
                waiting.push((stream_id, range));
                continue;
            }
            let encoded = mapping::encode_response(ready, &mut conn.scratch);
            let answer = encoded
                .map(|()| &conn.scratch[..])
                .map_err(Status::unavailable);
            self.respond_borrowed(&mut conn.connection, stream_id, method, answer);
        }
        // Kept, empty, for the next read.
        conn.mapped = mapped;
        if waiting.is_empty() {
            return;
        }
        let mut outcomes: Vec<Option<OperationOutcome>> =
            conn.outcomes.drain(..).map(Some).collect();
        for (stream_id, range) in waiting {
            let call: Vec<OperationOutcome> = outcomes[range]
                .iter_mut()
                .filter_map(Option::take)
                .collect();
            conn.pending.push(Box::pin(async move {
                let mut answers = Vec::with_capacity(call.len());
                for outcome in call {
                    answers.push(outcome.answer().await);
                }
                let mut message = Vec::new();
                let encoded = mapping::encode_response(&answers, &mut message);
                let answer = encoded.map(|()| message).map_err(Status::unavailable);
                (stream_id, method, answer)
            }));
        }
    }

    /// Writes a call's answer and counts it.
    fn respond(
        &self,
        connection: &mut http2::Connection,
        stream_id: u32,
        method: GrpcMethod,
        answer: Result<Vec<u8>, Status>,
    ) {
        match answer {
            Ok(message) => self.respond_borrowed(connection, stream_id, method, Ok(&message)),
            Err(status) => self.respond_borrowed(connection, stream_id, method, Err(status)),
        }
    }

    /// [`GrpcProtocol::respond`] with the message borrowed.
    fn respond_borrowed(
        &self,
        connection: &mut http2::Connection,
        stream_id: u32,
        method: GrpcMethod,
        answer: Result<&[u8], Status>,
    ) {
        match answer {
            Ok(message) => {
                self.engine.metrics.grpc_response(method, 0);
                connection.respond(stream_id, message);
            }
            Err(status) => {
                let code = status.code() as u32;
                self.engine.metrics.grpc_response(method, code as usize);
                connection.respond_status(stream_id, code, status.message());
            }
        }
    }
}

/// `message` with its gRPC prefix (not compressed, its length), into `out`.
fn encode_message(message: &impl prost::Message, out: &mut Vec<u8>) {
    let length = message.encoded_len();
    out.clear();
    out.reserve(MESSAGE_PREFIX_BYTES + length);
    out.push(0);
    out.extend_from_slice(&u32::try_from(length).unwrap_or(u32::MAX).to_be_bytes());
    message.encode_raw(out);
}

/// The service name Envoy's health checks may ask for.
const RATE_LIMIT_SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// `grpc.health.v1.Health/Check`: serving for the whole server (`""`) and
/// for the rate limit service; `NOT_FOUND` for any other service name.
fn health_check(body: &[u8], bytes_max: usize) -> Result<Vec<u8>, Status> {
    let request = request_message(body, bytes_max).and_then(|message| {
        <HealthCheckRequest as prost::Message>::decode(message).map_err(|error| {
            Status::invalid_argument(format!("malformed HealthCheckRequest: {error}"))
        })
    });
    match request?.service.as_str() {
        "" | RATE_LIMIT_SERVICE => {
            let response = HealthCheckResponse {
                status: ServingStatus::Serving as i32,
            };
            let mut message = Vec::new();
            encode_message(&response, &mut message);
            Ok(message)
        }
        other => Err(Status::not_found(format!("unknown service {other}"))),
    }
}

/// The status of a request message over `bytes_max`.
fn message_too_large(bytes_max: usize) -> Status {
    Status::resource_exhausted(format!(
        "message larger than the {bytes_max} bytes allowed (--grpc-message-bytes-max)"
    ))
}

/// The one message of a unary request's body (a 5-byte prefix: not
/// compressed, then its length), at most `bytes_max` long.
fn request_message(body: &[u8], bytes_max: usize) -> Result<&[u8], Status> {
    match body {
        [] => Err(Status::invalid_argument("no request message")),
        [0, a, b, c, d, message @ ..] => {
            let length = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
            if length > bytes_max {
                return Err(message_too_large(bytes_max));
            }
            if length != message.len() {
                return Err(Status::invalid_argument(format!(
                    "the request has {} bytes after its gRPC prefix, not the one message of \
                     {length} bytes the prefix announces",
                    message.len()
                )));
            }
            Ok(message)
        }
        [1, ..] => Err(Status::unimplemented(
            "compressed request messages are not accepted (send them uncompressed)",
        )),
        _ => Err(Status::invalid_argument("malformed gRPC message prefix")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_body_is_one_uncompressed_message_within_the_limit() {
        let ok = [0, 0, 0, 0, 2, 0x0a, 0x00];
        assert_eq!(request_message(&ok, 2).map_err(|s| s.code()), Ok(&ok[5..]));
        let code = |body: &[u8]| request_message(body, 2).map(|_| ()).map_err(|s| s.code());
        assert_eq!(code(&[]), Err(tonic::Code::InvalidArgument));
        assert_eq!(code(&[0, 0, 0]), Err(tonic::Code::InvalidArgument));
        // Truncated, and followed by a second message.
        assert_eq!(
            code(&[0, 0, 0, 0, 2, 0x0a]),
            Err(tonic::Code::InvalidArgument)
        );
        assert_eq!(
            code(&[0, 0, 0, 0, 1, 0x0a, 0, 0, 0, 0, 0]),
            Err(tonic::Code::InvalidArgument)
        );
        assert_eq!(
            code(&[0, 0, 0, 0, 3, 1, 2, 3]),
            Err(tonic::Code::ResourceExhausted)
        );
        assert_eq!(
            code(&[0, 0xff, 0xff, 0xff, 0xff]),
            Err(tonic::Code::ResourceExhausted)
        );
        assert_eq!(code(&[1, 0, 0, 0, 0]), Err(tonic::Code::Unimplemented));
        assert_eq!(code(&[7, 0, 0, 0, 0]), Err(tonic::Code::InvalidArgument));
    }
}
