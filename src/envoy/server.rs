//! The gRPC endpoint (`--grpc-listen`): HTTP/2 connections on the
//! thread-per-core acceptor that the line protocol and droplet share (the
//! connection limit, panics and drain are handled there), each served by
//! hyper's HTTP/2 server. Two methods are answered:
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, framed
//! here (the body read whole within the size limit, the 5-byte gRPC prefix
//! checked, the response message and its `grpc-status: 0` trailers written
//! by a two-frame body: tonic's generic unary machinery cost more per call
//! than the decision), and `grpc.health.v1.Health/Check`, framed by tonic;
//! any other is `UNIMPLEMENTED`.
//!
//! Bad input stays bounded: a message larger than `message_bytes_max` is
//! refused (`RESOURCE_EXHAUSTED`) before it is buffered, one that does not
//! decode (truncated, non-UTF-8 strings) is `INVALID_ARGUMENT`, streams per
//! connection are capped (more wait for HTTP/2 flow control; rapid resets
//! are capped by hyper), a connection that sends nothing is closed after
//! `first_byte_timeout_ms`, and keep-alive pings drop peers that stopped
//! answering. Every call is counted in `tollgate_grpc_requests_total` by
//! method and status code.

use super::mapping::{self, EnvoyLimits};
use crate::engine::Engine;
use crate::metrics::{GrpcMethod, Metrics};
use crate::protocol::Pairs;
use crate::server::{AcceptorConfig, ConnectionHandler, Serving, ThreadPerCore};
use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use futures_util::future::LocalBoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::cell::RefCell;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tonic::codegen::http;
use tonic::server::{Grpc, UnaryService};
use tonic::Status;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_prost::ProstCodec;

/// The path of Envoy's rate limit call.
pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// The path of the gRPC health check.
pub const HEALTH_CHECK_PATH: &str = "/grpc.health.v1.Health/Check";
/// Pings a connection idle this long, in milliseconds...
const KEEP_ALIVE_INTERVAL_MS: u64 = 20_000;
/// ...and closes it when the ping is not answered within this long.
const KEEP_ALIVE_TIMEOUT_MS: u64 = 20_000;
/// Largest request header block, in bytes.
const HEADER_LIST_BYTES_MAX: u32 = 16 * 1024;
/// Streams a client may reset before their handling starts (rapid reset).
const PENDING_RESET_STREAMS_MAX: usize = 64;
/// gRPC's message prefix: a compression flag and a 4-byte length.
const MESSAGE_PREFIX_BYTES: usize = 5;

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
    /// closed (keep-alive pings watch it once HTTP/2 is up).
    pub first_byte_timeout_ms: u64,
    pub limits: EnvoyLimits,
}

/// What every gRPC connection shares.
pub struct GrpcProtocol {
    engine: Arc<Engine>,
    message_bytes_max: usize,
    streams_per_connection_max: u32,
    first_byte_timeout_ms: u64,
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

impl ConnectionHandler for GrpcProtocol {
    async fn serve(self: Arc<Self>, stream: TcpStream, mut shutdown: watch::Receiver<bool>) {
        let _ = stream.set_nodelay(true);
        // A client that connects and says nothing would hold a connection
        // slot for good: HTTP/2's keep-alive starts only after its preface.
        let mut first = [0u8; 1];
        let first_byte = tokio::time::timeout(
            Duration::from_millis(self.first_byte_timeout_ms),
            stream.peek(&mut first),
        )
        .await;
        if !matches!(first_byte, Ok(Ok(read)) if read > 0) {
            return;
        }
        let streams = StreamSet::default();
        let mut builder = hyper::server::conn::http2::Builder::new(streams.clone());
        builder
            .timer(TokioTimer::new())
            .max_concurrent_streams(self.streams_per_connection_max)
            .max_header_list_size(HEADER_LIST_BYTES_MAX)
            .max_pending_accept_reset_streams(Some(PENDING_RESET_STREAMS_MAX))
            .keep_alive_interval(Some(Duration::from_millis(KEEP_ALIVE_INTERVAL_MS)))
            .keep_alive_timeout(Duration::from_millis(KEEP_ALIVE_TIMEOUT_MS))
            // gRPC has no use for a `date` header on every response.
            .auto_date_header(false);
        let shared = Arc::clone(&self);
        let service = hyper::service::service_fn(move |request| {
            let shared = Arc::clone(&shared);
            // Boxed: a small stream future moves cheaply.
            Box::pin(async move { Ok::<_, Infallible>(shared.route(request).await) })
        });
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        tokio::pin!(connection);
        if *shutdown.borrow() {
            connection.as_mut().graceful_shutdown();
        }
        tokio::select! {
            _ = streams.drive(connection.as_mut()) => {}
            _ = shutdown.changed() => {
                connection.as_mut().graceful_shutdown();
                // GOAWAY sent: calls in progress finish (the acceptor bounds this).
                let _ = streams.drive(connection.as_mut()).await;
            }
        }
        // Calls still deciding when the connection ended (their answers cannot
        // be sent) finish rather than stop halfway.
        std::future::poll_fn(|cx| streams.poll_streams(cx)).await;
    }

    async fn refuse(self: Arc<Self>, stream: TcpStream) {
        // An HTTP/2 client retries a connection closed before its settings.
        drop(stream);
    }
}

/// The calls (HTTP/2 streams) of one connection, run inside the
/// connection's own task: hyper hands each stream to its executor, and a
/// tokio task per call (allocated, scheduled, woken across tasks) cost more
/// than the call's decision. A call that panicked would end its connection
/// (logged by the acceptor, as on the other endpoints) rather than only its
/// stream.
#[derive(Clone, Default)]
struct StreamSet(Rc<StreamSetInner>);

#[derive(Default)]
struct StreamSetInner {
    running: RefCell<FuturesUnordered<LocalBoxFuture<'static, ()>>>,
    /// Streams handed over while `running` is being polled (never, for
    /// gRPC: only HTTP upgrades spawn from a stream), moved in before the
    /// next poll.
    incoming: RefCell<Vec<LocalBoxFuture<'static, ()>>>,
}

impl<F: Future<Output = ()> + 'static> hyper::rt::Executor<F> for StreamSet {
    fn execute(&self, stream: F) {
        match self.0.running.try_borrow_mut() {
            Ok(running) => running.push(Box::pin(stream)),
            Err(_) => self.0.incoming.borrow_mut().push(Box::pin(stream)),
        }
    }
}

impl StreamSet {
    /// Polls every stream that can progress; ready when none is left.
    fn poll_streams(&self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let mut running = self.0.running.borrow_mut();
            running.extend(self.0.incoming.borrow_mut().drain(..));
            let polled = running.poll_next_unpin(cx);
            drop(running);
            match polled {
                Poll::Ready(Some(())) => continue,
                Poll::Ready(None) if self.0.incoming.borrow().is_empty() => return Poll::Ready(()),
                Poll::Ready(None) => continue,
                Poll::Pending if self.0.incoming.borrow().is_empty() => return Poll::Pending,
                Poll::Pending => continue,
            }
        }
    }

    /// Drives `connection` and its streams until the connection ends.
    fn drive<'a, C: Future>(
        &'a self,
        mut connection: Pin<&'a mut C>,
    ) -> impl Future<Output = C::Output> + 'a {
        std::future::poll_fn(move |cx| {
            let _ = self.poll_streams(cx);
            let polled = connection.as_mut().poll(cx);
            if polled.is_pending() {
                // Streams the connection just accepted start now.
                let _ = self.poll_streams(cx);
            }
            polled
        })
    }
}

impl GrpcProtocol {
    async fn route(
        self: Arc<Self>,
        request: http::Request<Incoming>,
    ) -> http::Response<tonic::body::Body> {
        let metrics = Arc::clone(&self.engine.metrics);
        let (method, response) = match request.uri().path() {
            SHOULD_RATE_LIMIT_PATH => {
                let (code, response) = match self.should_rate_limit_call(request).await {
                    Ok(message) => (0, unary_response(message)),
                    Err(status) => (status.code() as usize, status.into_http()),
                };
                metrics.grpc_response(GrpcMethod::ShouldRateLimit, code);
                return response;
            }
            HEALTH_CHECK_PATH => {
                let codec = ProstCodec::<HealthCheckResponse, HealthCheckRequest>::default();
                let mut grpc = Grpc::new(codec).max_decoding_message_size(self.message_bytes_max);
                let response = grpc.unary(HealthCheck, request).await;
                (GrpcMethod::Health, response)
            }
            path => {
                let status = Status::unimplemented(format!("no such method: {path}"));
                return status.into_http();
            }
        };
        let mut response = response;
        let code = grpc_status(&response);
        let code = if code == tonic::Code::OutOfRange as usize {
            // tonic's refusal of a message over the size limit.
            response = message_too_large(self.message_bytes_max).into_http();
            tonic::Code::ResourceExhausted as usize
        } else {
            code
        };
        metrics.grpc_response(method, code);
        response
    }

    /// One `ShouldRateLimit` call: the request message read whole (refused
    /// past `message_bytes_max`), decided, and the response message with its
    /// gRPC prefix.
    async fn should_rate_limit_call(
        &self,
        request: http::Request<Incoming>,
    ) -> Result<Bytes, Status> {
        let limit = self.message_bytes_max.saturating_add(MESSAGE_PREFIX_BYTES);
        let body = Limited::new(request.into_body(), limit)
            .collect()
            .await
            .map_err(|error| {
                if error.is::<LengthLimitError>() {
                    message_too_large(self.message_bytes_max)
                } else {
                    Status::cancelled(format!("reading the request: {error}"))
                }
            })?
            .to_bytes();
        let message = request_message(&body, self.message_bytes_max)?;
        let request = mapping::decode_request(message).map_err(Status::invalid_argument)?;
        let response = self.should_rate_limit(request).await?;
        let length = prost::Message::encoded_len(&response);
        let mut out = BytesMut::with_capacity(MESSAGE_PREFIX_BYTES + length);
        out.put_u8(0);
        out.put_u32(u32::try_from(length).unwrap_or(u32::MAX));
        prost::Message::encode_raw(&response, &mut out);
        Ok(out.freeze())
    }

    /// Decides every descriptor of `request`, in order.
    async fn should_rate_limit(
        &self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, Status> {
        let operations = mapping::operations(&request, &self.limits)
            .map_err(|error| Status::invalid_argument(error.to_string()))?;
        let arrival = self.engine.arrival();
        // Started together, so that a slower backend (Redis, a forwarded
        // shard) decides the descriptors concurrently.
        let outcomes: Vec<_> = operations
            .iter()
            .map(|operation| {
                let pairs = Pairs::from_slice(&operation.pairs);
                self.engine
                    .decide_operation(&pairs, operation.hits, operation.peek, arrival)
            })
            .collect();
        let mut statuses = Vec::with_capacity(outcomes.len());
        for outcome in outcomes {
            let answer = outcome.answer().await;
            let status = mapping::descriptor_status(&answer).map_err(Status::unavailable)?;
            statuses.push(status);
        }
        Ok(mapping::response(statuses))
    }
}

/// The `grpc-status` of a trailers-only response (an error), else 0: a
/// unary call's success sends its status in the trailers.
fn grpc_status(response: &http::Response<tonic::body::Body>) -> usize {
    response
        .headers()
        .get("grpc-status")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
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

/// A successful unary response: `message` (prefixed), then the trailers.
fn unary_response(message: Bytes) -> http::Response<tonic::body::Body> {
    let mut response = http::Response::new(tonic::body::Body::new(UnaryBody {
        message: Some(message),
        trailers_sent: false,
    }));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

/// The body of a successful unary call: one message, then `grpc-status: 0`.
struct UnaryBody {
    message: Option<Bytes>,
    trailers_sent: bool,
}

impl hyper::body::Body for UnaryBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(message) = self.message.take() {
            return Poll::Ready(Some(Ok(Frame::data(message))));
        }
        if self.trailers_sent {
            return Poll::Ready(None);
        }
        self.trailers_sent = true;
        let mut trailers = http::HeaderMap::with_capacity(1);
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && self.trailers_sent
    }
}

/// `grpc.health.v1.Health/Check`: serving for the whole server (`""`) and
/// for the rate limit service; `NOT_FOUND` for any other service name.
struct HealthCheck;

/// The service name Envoy's health checks may ask for.
const RATE_LIMIT_SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";

impl UnaryService<HealthCheckRequest> for HealthCheck {
    type Response = HealthCheckResponse;
    type Future = std::future::Ready<Result<tonic::Response<HealthCheckResponse>, Status>>;

    fn call(&mut self, request: tonic::Request<HealthCheckRequest>) -> Self::Future {
        let service = request.into_inner().service;
        std::future::ready(match service.as_str() {
            "" | RATE_LIMIT_SERVICE => Ok(tonic::Response::new(HealthCheckResponse {
                status: ServingStatus::Serving as i32,
            })),
            other => Err(Status::not_found(format!("unknown service {other}"))),
        })
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
