//! The droplet endpoint: droplet's protocol over WebSocket (SPEC §7). Each
//! binary message is one protobuf `Droplet.Request`; each gets one binary
//! `Droplet.Response`, in order. A text message, or a binary one that is not
//! a complete request, gets a close frame with code 1000, as droplet does.
//!
//! Threads: the line protocol's acceptor ([`ThreadPerCore`]), on threads of
//! its own rather than a second listener inside the line protocol's, so that
//! an idle endpoint costs only sleeping threads. Connections over the limit
//! get `503` and are counted with the line protocol's refusals.
//!
//! The HTTP handshake is read here (bounded in bytes and time, parsed with
//! `httparse`) rather than inside tungstenite, because droplet's server
//! answers a plain request without `Upgrade` with `200 Not implemented`,
//! which tungstenite's acceptor cannot do. The upgrade itself is still
//! validated and answered by tungstenite (`create_response`); we add the
//! first offered subprotocol, as droplet's `ws` server echoed it, and decline
//! permessage-deflate by not answering it (a client offering it still
//! connects). Message and frame sizes are bounded by `message_bytes_max`; a
//! larger message closes the connection with code 1009.

use super::proto::{decode_request, encode_response, Command, DecodeError};
use super::{BucketCall, Buckets};
use crate::clock::Clock;
use crate::limiter::droplet_bucket::Balances;
use crate::metrics::{Metrics, RequestProtocol};
use crate::server::{AcceptorConfig, ConnectionHandler, Serving, ThreadPerCore};
use futures_util::{FutureExt, SinkExt, StreamExt};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::handshake::server::{create_response, write_response};
use tokio_tungstenite::tungstenite::http;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

/// Longest HTTP request head accepted for the handshake.
const HANDSHAKE_BYTES_MAX: usize = 16 * 1024;
/// Most headers in the handshake request.
const HANDSHAKE_HEADERS_MAX: usize = 64;
/// A client must complete its handshake request within this long.
const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// After our close frame, how long we wait for the client's.
const CLOSE_WAIT_MS: u64 = 1_000;
/// Read buffer per connection (tungstenite allocates it eagerly).
const READ_BUFFER_BYTES: usize = 16 * 1024;
/// Most requests answered before the answers are written out, so that one
/// busy connection cannot hold its thread.
const ANSWERS_PER_WRITE_MAX: usize = 1024;

const NOT_IMPLEMENTED: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 15\r\nConnection: close\r\n\r\nNot implemented";
const BAD_REQUEST: &[u8] =
    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
const HEAD_TOO_LARGE: &[u8] = b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
const TOO_MANY_CONNECTIONS: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

/// Where and how the droplet endpoint serves.
#[derive(Debug, Clone)]
pub struct DropletServerConfig {
    pub listen: SocketAddr,
    /// Serving threads (one runtime and listener each).
    pub threads: usize,
    /// Largest message (and frame) accepted, in bytes.
    pub message_bytes_max: usize,
    /// Most connections open at once; more are answered `503`.
    pub connections_max: usize,
    /// How long shutdown waits for connections to close.
    pub drain_timeout_ms: u64,
}

impl Default for DropletServerConfig {
    fn default() -> Self {
        DropletServerConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], super::DROPLET_PORT)),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            message_bytes_max: 64 * 1024,
            connections_max: 10_000,
            drain_timeout_ms: 5_000,
        }
    }
}

/// droplet's connections, for the [`ThreadPerCore`] acceptor: what every
/// connection shares.
pub struct DropletProtocol {
    buckets: Arc<Buckets>,
    clock: Arc<dyn Clock>,
    websocket: WebSocketConfig,
    /// A refused take (bucket cap) was logged at warn level once already.
    warned_full: AtomicBool,
    /// Requests are counted here, once per write.
    metrics: Arc<Metrics>,
}

impl ConnectionHandler for DropletProtocol {
    async fn serve(self: Arc<Self>, stream: TcpStream, shutdown: watch::Receiver<bool>) {
        serve_connection(stream, self, shutdown).await;
    }

    async fn refuse(self: Arc<Self>, mut stream: TcpStream) {
        let _ = stream.write_all(TOO_MANY_CONNECTIONS).await;
        let _ = stream.shutdown().await;
    }
}

/// The endpoint with its listeners bound (its address known, port 0
/// included), not serving yet.
pub type DropletServer = ThreadPerCore<DropletProtocol>;

/// A serving endpoint; [`Serving::stop`] closes every connection (code
/// 1001) and waits. Dropping it also shuts the endpoint down, without
/// waiting for its threads.
pub type RunningDroplet = Serving;

/// Binds the endpoint's listeners (one per serving thread); refused
/// connections are counted in `metrics`.
pub fn bind(
    config: DropletServerConfig,
    buckets: Arc<Buckets>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
) -> std::io::Result<DropletServer> {
    let message_bytes_max = config.message_bytes_max.max(1);
    let websocket = WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_BYTES)
        .write_buffer_size(READ_BUFFER_BYTES)
        .max_message_size(Some(message_bytes_max))
        .max_frame_size(Some(message_bytes_max));
    let handler = Arc::new(DropletProtocol {
        buckets,
        clock,
        websocket,
        warned_full: AtomicBool::new(false),
        metrics: Arc::clone(&metrics),
    });
    let acceptor = AcceptorConfig {
        listen: config.listen,
        threads: config.threads,
        connections_max: config.connections_max.max(1),
        drain_timeout_ms: config.drain_timeout_ms,
        thread_name: "tollgate-droplet",
    };
    ThreadPerCore::bind(acceptor, handler, metrics)
}

/// What the handshake request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Handshake {
    /// A WebSocket upgrade: the `101` response to write, and how many bytes
    /// of the buffer the request head took (the rest are WebSocket frames).
    Upgrade {
        response: Vec<u8>,
        head_bytes: usize,
    },
    /// Anything else: write this and close.
    Refuse(&'static [u8]),
}

/// Reads the request head and decides, bounded by [`HANDSHAKE_BYTES_MAX`].
/// `None`: the client left (or failed) before finishing its request.
async fn read_handshake(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<Handshake> {
    loop {
        match parse_handshake(buffer) {
            Some(handshake) => return Some(handshake),
            None if buffer.len() >= HANDSHAKE_BYTES_MAX => {
                return Some(Handshake::Refuse(HEAD_TOO_LARGE))
            }
            None => {}
        }
        let wanted = (HANDSHAKE_BYTES_MAX - buffer.len()).min(4096);
        let mut chunk = vec![0u8; wanted];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Decides what a (possibly partial) request head asks: `None` while it is
/// incomplete.
fn parse_handshake(buffer: &[u8]) -> Option<Handshake> {
    let mut headers = [httparse::EMPTY_HEADER; HANDSHAKE_HEADERS_MAX];
    let mut request = httparse::Request::new(&mut headers);
    let head_bytes = match request.parse(buffer) {
        Ok(httparse::Status::Complete(head_bytes)) => head_bytes,
        Ok(httparse::Status::Partial) => return None,
        Err(httparse::Error::TooManyHeaders) => return Some(Handshake::Refuse(HEAD_TOO_LARGE)),
        Err(_) => return Some(Handshake::Refuse(BAD_REQUEST)),
    };
    let upgrade = request
        .headers
        .iter()
        .any(|h| h.name.eq_ignore_ascii_case("upgrade"));
    if !upgrade {
        return Some(Handshake::Refuse(NOT_IMPLEMENTED));
    }
    match upgrade_response(&request) {
        Some(response) => Some(Handshake::Upgrade {
            response,
            head_bytes,
        }),
        None => Some(Handshake::Refuse(BAD_REQUEST)),
    }
}

/// The `101 Switching Protocols` response, or `None` for an invalid upgrade.
fn upgrade_response(request: &httparse::Request<'_, '_>) -> Option<Vec<u8>> {
    let mut builder = http::Request::builder()
        .method(request.method?)
        .uri(request.path?)
        .version(match request.version? {
            0 => http::Version::HTTP_10,
            _ => http::Version::HTTP_11,
        });
    for header in request.headers.iter() {
        builder = builder.header(header.name, header.value);
    }
    let request = builder.body(()).ok()?;
    let mut response = create_response(&request).ok()?;
    // Echo the first subprotocol offered, as droplet's server did.
    let offered = request
        .headers()
        .get_all("Sec-WebSocket-Protocol")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .find(|protocol| !protocol.is_empty());
    if let Some(protocol) = offered.and_then(|p| http::HeaderValue::from_str(p).ok()) {
        response
            .headers_mut()
            .insert("Sec-WebSocket-Protocol", protocol);
    }
    let mut bytes = Vec::with_capacity(256);
    write_response(&mut bytes, &response).ok()?;
    Some(bytes)
}

async fn serve_connection(
    mut stream: TcpStream,
    shared: Arc<DropletProtocol>,
    shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let mut buffer = Vec::with_capacity(1024);
    let handshake = tokio::time::timeout(
        Duration::from_millis(HANDSHAKE_TIMEOUT_MS),
        read_handshake(&mut stream, &mut buffer),
    )
    .await;
    let (response, head_bytes) = match handshake {
        Ok(Some(Handshake::Upgrade {
            response,
            head_bytes,
        })) => (response, head_bytes),
        Ok(Some(Handshake::Refuse(answer))) => {
            let _ = stream.write_all(answer).await;
            let _ = stream.shutdown().await;
            return;
        }
        Ok(None) | Err(_) => return,
    };
    if stream.write_all(&response).await.is_err() {
        return;
    }
    let leftover = buffer.split_off(head_bytes);
    let websocket = WebSocketStream::from_partially_read(
        stream,
        leftover,
        Role::Server,
        Some(shared.websocket),
    )
    .await;
    Session { shared, websocket }.run(shutdown).await;
}

/// What one incoming message calls for.
enum Step {
    Answer(Vec<u8>),
    /// Cluster mode: a request for the shared buckets, answered with the
    /// others read before the next write (see [`Session::answer_shared`]).
    Ask(Command),
    /// Control frames: tungstenite answers pings and closes by itself.
    Nothing,
    Close(CloseCode),
    /// The connection is gone.
    End,
}

struct Session {
    shared: Arc<DropletProtocol>,
    websocket: WebSocketStream<TcpStream>,
}

impl Session {
    async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        if *shutdown.borrow() {
            return self.close(CloseCode::Away).await;
        }
        loop {
            let incoming = tokio::select! {
                incoming = self.websocket.next() => incoming,
                _ = shutdown.changed() => return self.close(CloseCode::Away).await,
            };
            // Data messages read before this write, counted once.
            let mut requests = 0u64;
            let mut asked = Vec::new();
            let mut step = self.step(incoming, &mut requests);
            // Answer everything that has already arrived, then write once.
            for answered in 1.. {
                if !matches!(step, Step::Answer(_) | Step::Ask(_) | Step::Nothing)
                    && !self.answer_shared(&mut asked).await
                {
                    return;
                }
                match step {
                    Step::Ask(command) => asked.push(command),
                    Step::Answer(bytes) => {
                        if self
                            .websocket
                            .feed(Message::Binary(bytes.into()))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    Step::Nothing => {}
                    Step::Close(code) => {
                        self.count_requests(requests);
                        return self.close(code).await;
                    }
                    Step::End => {
                        self.count_requests(requests);
                        let _ = self.websocket.flush().await;
                        return;
                    }
                }
                if answered == ANSWERS_PER_WRITE_MAX {
                    break;
                }
                match self.websocket.next().now_or_never() {
                    Some(incoming) => step = self.step(incoming, &mut requests),
                    None => break,
                }
            }
            if !self.answer_shared(&mut asked).await {
                return;
            }
            self.count_requests(requests);
            if self.websocket.flush().await.is_err() {
                return;
            }
        }
    }

    fn count_requests(&self, requests: u64) {
        if requests > 0 {
            self.shared
                .metrics
                .requests_read(RequestProtocol::Droplet, requests);
        }
    }

    /// What `incoming` calls for; a data message (a request, or text) adds
    /// one to `requests`.
    fn step(&self, incoming: Option<Result<Message, WsError>>, requests: &mut u64) -> Step {
        if matches!(incoming, Some(Ok(Message::Binary(_) | Message::Text(_)))) {
            *requests += 1;
        }
        match incoming {
            Some(Ok(Message::Binary(bytes))) if self.shared.buckets.shared().is_some() => {
                match decode_request(&bytes) {
                    Ok(command) => Step::Ask(command),
                    Err(error) => {
                        tracing::debug!(%error, "droplet: undecodable request, closing");
                        Step::Close(CloseCode::Normal)
                    }
                }
            }
            Some(Ok(Message::Binary(bytes))) => match self.answer(&bytes) {
                Ok(response) => Step::Answer(response),
                Err(error) => {
                    tracing::debug!(%error, "droplet: undecodable request, closing");
                    Step::Close(CloseCode::Normal)
                }
            },
            Some(Ok(Message::Text(_))) => {
                tracing::debug!("droplet: text message, closing");
                Step::Close(CloseCode::Normal)
            }
            Some(Ok(
                Message::Ping(_) | Message::Pong(_) | Message::Close(_) | Message::Frame(_),
            )) => Step::Nothing,
            Some(Err(WsError::Capacity(error))) => {
                tracing::debug!(%error, "droplet: message too large, closing");
                Step::Close(CloseCode::Size)
            }
            Some(Err(_)) | None => Step::End,
        }
    }

    /// Cluster mode: decides the requests read so far together, on the
    /// cluster's buckets, and queues their answers in order. A bucket that
    /// cannot be reached answers `accept: false` with no balances (droplet's
    /// protocol has no error), logged at debug level. Returns false when
    /// the connection is gone.
    async fn answer_shared(&mut self, asked: &mut Vec<Command>) -> bool {
        if asked.is_empty() {
            return true;
        }
        let Some(shared) = self.shared.buckets.shared() else {
            asked.clear();
            return true;
        };
        let calls: Vec<BucketCall<'_>> = asked
            .iter()
            .map(|command| match command {
                Command::Take { bucket, request } => BucketCall::Take {
                    bucket,
                    request: *request,
                },
                Command::Query { bucket } => BucketCall::Query { bucket },
            })
            .collect();
        let now_ms = self.shared.clock.now_ms();
        let cleanup_interval_ms = self.shared.buckets.cleanup_interval_ms();
        let answers = shared.decide(&calls, cleanup_interval_ms, now_ms);
        drop(calls);
        asked.clear();
        for answer in answers.await {
            let response = match answer {
                Ok(outcome) => encode_response(outcome.accept, &outcome.balances),
                Err(error) => {
                    tracing::debug!(%error, "droplet: bucket unavailable (answered accept=false)");
                    encode_response(false, &Balances::default())
                }
            };
            if self
                .websocket
                .feed(Message::Binary(response.into()))
                .await
                .is_err()
            {
                return false;
            }
        }
        true
    }

    fn answer(&self, bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
        let now_ms = self.shared.clock.now_ms();
        let buckets = &self.shared.buckets;
        Ok(match decode_request(bytes)? {
            Command::Take { bucket, request } => match buckets.take(&bucket, &request, now_ms) {
                Ok(outcome) => encode_response(outcome.accept, &outcome.balances),
                Err(full) => {
                    if !self.shared.warned_full.swap(true, Ordering::Relaxed) {
                        tracing::warn!(%full, "droplet: take refused (answered accept=false); further refusals are logged at debug level");
                    } else {
                        tracing::debug!(%full, "droplet: take refused");
                    }
                    encode_response(false, &Balances::default())
                }
            },
            Command::Query { bucket } => {
                encode_response(true, &buckets.query(&bucket, now_ms).unwrap_or_default())
            }
        })
    }

    /// Sends a close frame, then waits (briefly) for the client's.
    async fn close(mut self, code: CloseCode) {
        let frame = CloseFrame {
            code,
            reason: "".into(),
        };
        if self.websocket.close(Some(frame)).await.is_err() {
            return;
        }
        let wait_for_client = async { while let Some(Ok(_)) = self.websocket.next().await {} };
        let _ = tokio::time::timeout(Duration::from_millis(CLOSE_WAIT_MS), wait_for_client).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upgrade_request(extra_headers: &str) -> String {
        format!(
            "GET /any/path HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{extra_headers}\r\n"
        )
    }

    #[test]
    fn upgrade_echoes_the_first_subprotocol_and_declines_deflate() {
        let request = upgrade_request(
            "Sec-WebSocket-Protocol: droplet, other\r\nSec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n",
        );
        let Some(Handshake::Upgrade {
            response,
            head_bytes,
        }) = parse_handshake(request.as_bytes())
        else {
            panic!("an upgrade");
        };
        assert_eq!(head_bytes, request.len());
        let response = String::from_utf8(response).unwrap().to_ascii_lowercase();
        assert!(
            response.starts_with("http/1.1 101 switching protocols\r\n"),
            "{response}"
        );
        // RFC 6455's example key.
        assert!(response.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo=\r\n"));
        assert!(response.contains("sec-websocket-protocol: droplet\r\n"));
        assert!(!response.contains("sec-websocket-extensions"));
    }

    #[test]
    fn partial_plain_and_invalid_requests() {
        let request = upgrade_request("");
        assert_eq!(parse_handshake(&request.as_bytes()[..20]), None);
        assert_eq!(
            parse_handshake(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            Some(Handshake::Refuse(NOT_IMPLEMENTED))
        );
        assert_eq!(
            parse_handshake(b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n"),
            Some(Handshake::Refuse(BAD_REQUEST))
        );
        assert_eq!(
            parse_handshake(b"\x16\x03\x01 not http\r\n\r\n"),
            Some(Handshake::Refuse(BAD_REQUEST))
        );
    }
}
