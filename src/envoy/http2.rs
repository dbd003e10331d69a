//! The server side of HTTP/2 as gRPC's unary calls use it, with no I/O: a
//! [`Connection`] is handed the bytes a socket read gave, parses every
//! complete frame in place, and hands back the calls whose request ended in
//! that read; their answers are written into one output buffer that the
//! caller writes once. hyper's general server (a stream slab, a header map,
//! a task or future and several frame queues per call) cost about 8 µs of
//! CPU per call here, ten times the decision itself; a read batch of calls
//! through this module costs little more than the line protocol's
//! (docs/benchmarks.md, issue 16).
//!
//! What it keeps of HTTP/2 (RFC 9113): the preface and SETTINGS (with their
//! acknowledgement), PING, GOAWAY both ways, flow control both ways (our
//! receive window returned as DATA is read; response DATA held back until
//! the peer's connection and stream windows allow it), HEADERS with
//! CONTINUATION, padding and priority fields, RST_STREAM, and the frame-size
//! limit. Header blocks are decoded with `loona-hpack` (the dynamic table
//! must follow the client's encoder even for headers nobody reads); the
//! server's own header blocks are literals without indexing, so the peer's
//! table settings never matter to them.
//!
//! Bounds: at most `streams_max` open streams (more are refused with
//! `REFUSED_STREAM`), a request body of at most `body_bytes_max` (a longer
//! one is handed over cut, as [`Body::TooLarge`], to be refused), a header
//! block of at most `header_block_bytes_max`, frames of at most 16 384
//! bytes: so a connection holds at most `streams_max × body_bytes_max`
//! bytes of requests. A protocol violation ends the connection with GOAWAY
//! naming it; a stream-level one resets only that stream.

use smallvec::SmallVec;
use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::ops::Range;

/// What every HTTP/2 client sends first.
pub const CLIENT_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Every frame starts with this many bytes: length, type, flags, stream id.
pub const FRAME_HEADER_BYTES: usize = 9;
/// The largest frame payload the server accepts (HTTP/2's default, which
/// it does not raise), in bytes.
pub const FRAME_PAYLOAD_BYTES_MAX: usize = 16_384;
/// The largest window HTTP/2 allows, in bytes.
const WINDOW_BYTES_MAX: i64 = (1 << 31) - 1;
/// The window every stream and the connection start with, in bytes.
const DEFAULT_WINDOW_BYTES: i64 = 65_535;
/// The connection receive window the server opens at once, in bytes: what a
/// client may send before the server has read it (bounded again by streams
/// × body size, since the server reads as it receives).
const CONNECTION_WINDOW_BYTES: i64 = 16 << 20;
/// The HPACK dynamic table size the server's decoder allows (the default).
const HEADER_TABLE_BYTES: usize = 4_096;
/// Longest `grpc-message` the server sends, in bytes (longer is cut).
const STATUS_MESSAGE_BYTES_MAX: usize = 1_024;

mod frame {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// HTTP/2's error codes (RFC 9113, section 7), as RST_STREAM and GOAWAY
/// carry them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    NoError = 0x0,
    ProtocolError = 0x1,
    FlowControlError = 0x3,
    StreamClosed = 0x5,
    FrameSizeError = 0x6,
    RefusedStream = 0x7,
    CompressionError = 0x9,
    EnhanceYourCalm = 0xb,
}

/// Why a connection ended: its GOAWAY code and the reason it names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} ({code:?})")]
pub struct ConnectionError {
    pub code: ErrorCode,
    pub reason: String,
}

fn violation(code: ErrorCode, reason: impl Into<String>) -> ConnectionError {
    ConnectionError {
        code,
        reason: reason.into(),
    }
}

/// The bounds of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Http2Limits {
    /// Most streams open at once (the server's `MAX_CONCURRENT_STREAMS`).
    pub streams_max: u32,
    /// Longest request body kept, in bytes.
    pub body_bytes_max: usize,
    /// Longest header block (HEADERS and its CONTINUATIONs), in bytes.
    pub header_block_bytes_max: usize,
}

/// The request body of a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Within the bytes given to [`Connection::receive`] (the common case:
    /// the whole body came in one DATA frame).
    Input(Range<usize>),
    /// Gathered from several DATA frames.
    Owned(Vec<u8>),
    /// Longer than `body_bytes_max`: its first `body_bytes_max` bytes (the
    /// client may still be sending; the stream is reset once answered).
    TooLarge(Vec<u8>),
}

impl Body {
    /// The body's bytes, `input` being what [`Connection::receive`] was given.
    pub fn bytes<'a>(&'a self, input: &'a [u8]) -> &'a [u8] {
        match self {
            Body::Input(range) => &input[range.clone()],
            Body::Owned(bytes) | Body::TooLarge(bytes) => bytes,
        }
    }
}

/// A request's `:path`: one of the routes the connection was made with (by
/// index), or another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Known(usize),
    Unknown(Box<str>),
}

impl Default for Route {
    fn default() -> Self {
        Route::Unknown(Box::from(""))
    }
}

/// The path, for errors (a known route by its index: the caller holds the
/// table).
impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Route::Known(index) => write!(f, "route {index}"),
            Route::Unknown(path) => f.write_str(path),
        }
    }
}

/// Longest unknown `:path` kept (to be named in an error), in bytes.
const UNKNOWN_PATH_BYTES_MAX: usize = 256;

/// A request whose client side has ended (or outgrown its bound): answer it
/// with [`Connection::respond`] or [`Connection::respond_status`].
#[derive(Debug)]
pub struct Call {
    pub stream_id: u32,
    pub route: Route,
    /// Whether its `content-type` is gRPC's (`application/grpc…`).
    pub grpc: bool,
    pub body: Body,
}

/// A stream the server still has to do with: its request being received,
/// decided, or its response waiting for flow control.
struct Stream {
    route: Route,
    grpc: bool,
    body: Vec<u8>,
    /// The client has not ended its side.
    receiving: bool,
    /// Handed to the caller as a [`Call`] (so not handed again).
    called: bool,
    /// What the peer lets the server send on this stream, in bytes.
    send_window: i64,
    /// Response bytes waiting for a window: DATA payload still to send,
    /// then the trailers' header block (boxed: rare, and a stream is moved
    /// in and out of the table once per call).
    held: Option<Box<HeldResponse>>,
}

struct HeldResponse {
    data: Vec<u8>,
    sent: usize,
    trailers: Vec<u8>,
}

/// The streams of a connection, by id.
type Streams = HashMap<u32, Stream, ahash::RandomState>;

/// Where the connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the client's preface.
    Preface,
    /// Serving.
    Open,
    /// GOAWAY sent: streams already opened finish, new ones are refused.
    Draining,
    /// A connection error was sent: nothing more is read.
    Failed,
}

/// A header block being gathered across CONTINUATION frames.
struct PendingHeaders {
    stream_id: u32,
    end_stream: bool,
    block: Vec<u8>,
}

/// One HTTP/2 server connection's state; see the module's documentation.
pub struct Connection {
    limits: Http2Limits,
    /// The `:path`s calls are matched against.
    routes: &'static [&'static str],
    phase: Phase,
    decoder: loona_hpack::Decoder<'static>,
    streams: Streams,
    /// The highest stream id the client has opened.
    last_stream_id: u32,
    continuation: Option<PendingHeaders>,
    /// Counts the header blocks that may have changed the HPACK table.
    table_generation: u64,
    indexed_block: IndexedBlock,
    /// The peer's connection window for the server's DATA, in bytes.
    send_window: i64,
    /// What the peer's `INITIAL_WINDOW_SIZE` gives each new stream.
    peer_initial_window: i64,
    /// The peer's largest frame payload.
    peer_frame_bytes_max: usize,
    /// The server's connection receive window left, in bytes.
    receive_window: i64,
    /// DATA bytes read but not yet given back with WINDOW_UPDATE.
    receive_unreturned: i64,
    /// Streams whose response waits for a window, oldest first.
    held: VecDeque<u32>,
    /// Frames to write, in order.
    out: Vec<u8>,
}

impl Connection {
    /// A connection whose first output (the server's SETTINGS and the
    /// opening of its receive window) is already in [`Connection::output`].
    pub fn new(limits: Http2Limits, routes: &'static [&'static str]) -> Connection {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_BYTES);
        let mut connection = Connection {
            limits,
            routes,
            phase: Phase::Preface,
            decoder,
            streams: Streams::default(),
            last_stream_id: 0,
            continuation: None,
            table_generation: 0,
            indexed_block: IndexedBlock::default(),
            send_window: DEFAULT_WINDOW_BYTES,
            peer_initial_window: DEFAULT_WINDOW_BYTES,
            peer_frame_bytes_max: FRAME_PAYLOAD_BYTES_MAX,
            receive_window: CONNECTION_WINDOW_BYTES,
            receive_unreturned: 0,
            held: VecDeque::new(),
            out: Vec::with_capacity(16 * 1024),
        };
        // One byte more than a body may have: a client sending a longer one
        // can send enough for the server to see it is too long.
        let stream_window = limits
            .body_bytes_max
            .saturating_add(1)
            .max(DEFAULT_WINDOW_BYTES as usize)
            .min(WINDOW_BYTES_MAX as usize) as u32;
        let settings = [
            (setting::MAX_CONCURRENT_STREAMS, limits.streams_max),
            (setting::INITIAL_WINDOW_SIZE, stream_window),
            (
                setting::MAX_HEADER_LIST_SIZE,
                limits.header_block_bytes_max as u32,
            ),
        ];
        connection.frame_header(settings.len() * 6, frame::SETTINGS, 0, 0);
        for (id, value) in settings {
            connection.out.extend_from_slice(&id.to_be_bytes());
            connection.out.extend_from_slice(&value.to_be_bytes());
        }
        let opened = (CONNECTION_WINDOW_BYTES - DEFAULT_WINDOW_BYTES) as u32;
        connection.window_update(0, opened);
        connection
    }

    /// The bytes to write to the peer; the caller writes and clears them.
    pub fn output(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Streams open (being received, decided, or answered).
    pub fn open_streams(&self) -> usize {
        self.streams.len()
    }

    /// Whether the connection is over: a connection error was sent, or it
    /// drained (GOAWAY sent and every stream done).
    pub fn is_finished(&self) -> bool {
        match self.phase {
            Phase::Failed => true,
            Phase::Draining => self.streams.is_empty(),
            Phase::Preface | Phase::Open => false,
        }
    }

    /// Starts a graceful close: GOAWAY names the last stream the server
    /// will answer; streams opened after it are refused.
    pub fn go_away(&mut self) {
        if matches!(self.phase, Phase::Preface | Phase::Open) {
            self.phase = Phase::Draining;
            self.goaway(ErrorCode::NoError, b"");
        }
    }

    /// Sends a PING (the keep-alive: any answer shows the peer alive).
    pub fn ping(&mut self) {
        self.frame_header(8, frame::PING, 0, 0);
        self.out.extend_from_slice(b"tollgate");
    }

    /// Parses every complete frame of `input`, adding the calls whose
    /// request is complete to `calls`, and returns how many bytes it used
    /// (the rest is an incomplete frame: hand it again with what follows).
    /// On a connection error the GOAWAY naming it is in the output and the
    /// connection reads nothing more.
    pub fn receive(&mut self, input: &[u8], calls: &mut Vec<Call>) -> usize {
        match self.receive_frames(input, calls) {
            Ok(used) => used,
            Err(error) => {
                self.fail(&error);
                input.len()
            }
        }
    }

    /// Ends the connection for `error`: GOAWAY naming it, nothing more read.
    fn fail(&mut self, error: &ConnectionError) {
        if self.phase != Phase::Failed {
            tracing::debug!(%error, "closing an HTTP/2 connection that broke the protocol");
            self.goaway(error.code, error.reason.as_bytes());
            self.phase = Phase::Failed;
        }
    }

    fn receive_frames(
        &mut self,
        input: &[u8],
        calls: &mut Vec<Call>,
    ) -> Result<usize, ConnectionError> {
        let mut used = 0;
        if self.phase == Phase::Failed {
            return Ok(input.len());
        }
        if self.phase == Phase::Preface {
            let seen = input.len().min(CLIENT_PREFACE.len());
            if input[..seen] != CLIENT_PREFACE[..seen] {
                return Err(violation(
                    ErrorCode::ProtocolError,
                    "not an HTTP/2 connection preface (gRPC needs HTTP/2 with prior knowledge)",
                ));
            }
            if seen < CLIENT_PREFACE.len() {
                return Ok(0);
            }
            used = CLIENT_PREFACE.len();
            self.phase = Phase::Open;
        }
        while input.len() - used >= FRAME_HEADER_BYTES {
            let header = &input[used..used + FRAME_HEADER_BYTES];
            let length =
                usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
            if length > FRAME_PAYLOAD_BYTES_MAX {
                return Err(violation(
                    ErrorCode::FrameSizeError,
                    format!(
                        "a frame of {length} bytes, over the {FRAME_PAYLOAD_BYTES_MAX} allowed"
                    ),
                ));
            }
            let end = used + FRAME_HEADER_BYTES + length;
            if end > input.len() {
                break;
            }
            let kind = header[3];
            let flags = header[4];
            let stream_id =
                u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
            let payload_at = used + FRAME_HEADER_BYTES;
            self.on_frame(kind, flags, stream_id, input, payload_at..end, calls)?;
            used = end;
            if self.phase == Phase::Failed {
                return Ok(input.len());
            }
        }
        Ok(used)
    }

    fn on_frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream_id: u32,
        input: &[u8],
        payload: Range<usize>,
        calls: &mut Vec<Call>,
    ) -> Result<(), ConnectionError> {
        if let Some(pending) = &self.continuation {
            if kind != frame::CONTINUATION || stream_id != pending.stream_id {
                return Err(violation(
                    ErrorCode::ProtocolError,
                    "a header block interrupted before its END_HEADERS",
                ));
            }
        }
        let bytes = &input[payload.clone()];
        match kind {
            frame::DATA => self.on_data(flags, stream_id, input, payload, calls),
            frame::HEADERS => self.on_headers(flags, stream_id, bytes, calls),
            frame::CONTINUATION => self.on_continuation(flags, stream_id, bytes, calls),
            frame::PRIORITY => {
                if stream_id == 0 || bytes.len() != 5 {
                    return Err(violation(
                        ErrorCode::ProtocolError,
                        "a malformed PRIORITY frame",
                    ));
                }
                Ok(())
            }
            frame::RST_STREAM => {
                if stream_id == 0 || bytes.len() != 4 {
                    return Err(violation(
                        ErrorCode::ProtocolError,
                        "a malformed RST_STREAM frame",
                    ));
                }
                if stream_id > self.last_stream_id {
                    return Err(violation(
                        ErrorCode::ProtocolError,
                        "RST_STREAM on an idle stream",
                    ));
                }
                if self.streams.remove(&stream_id).is_some() {
                    self.held.retain(|held| *held != stream_id);
                }
                Ok(())
            }
            frame::SETTINGS => self.on_settings(flags, stream_id, bytes),
            frame::PUSH_PROMISE => Err(violation(
                ErrorCode::ProtocolError,
                "a client sent PUSH_PROMISE",
            )),
            frame::PING => {
                if stream_id != 0 || bytes.len() != 8 {
                    return Err(violation(
                        ErrorCode::ProtocolError,
                        "a malformed PING frame",
                    ));
                }
                if flags & flag::ACK == 0 {
                    self.frame_header(8, frame::PING, flag::ACK, 0);
                    self.out.extend_from_slice(bytes);
                }
                Ok(())
            }
            frame::GOAWAY => {
                if stream_id != 0 || bytes.len() < 8 {
                    return Err(violation(
                        ErrorCode::ProtocolError,
                        "a malformed GOAWAY frame",
                    ));
                }
                // The client opens nothing more; what it opened is answered.
                if matches!(self.phase, Phase::Open) {
                    self.phase = Phase::Draining;
                }
                Ok(())
            }
            frame::WINDOW_UPDATE => self.on_window_update(stream_id, bytes),
            // Unknown frame types are ignored (RFC 9113, 5.5).
            _ => Ok(()),
        }
    }

    fn on_data(
        &mut self,
        flags: u8,
        stream_id: u32,
        input: &[u8],
        payload: Range<usize>,
        calls: &mut Vec<Call>,
    ) -> Result<(), ConnectionError> {
        if stream_id == 0 {
            return Err(violation(ErrorCode::ProtocolError, "DATA on stream 0"));
        }
        let length = payload.len() as i64;
        self.receive_window -= length;
        if self.receive_window < 0 {
            return Err(violation(
                ErrorCode::FlowControlError,
                "DATA beyond the connection's flow-control window",
            ));
        }
        self.receive_unreturned += length;
        if self.receive_unreturned >= CONNECTION_WINDOW_BYTES / 2 {
            let returned = self.receive_unreturned;
            self.receive_unreturned = 0;
            self.receive_window += returned;
            self.window_update(0, returned as u32);
        }
        let data = unpad(flags, &input[payload.clone()]).ok_or_else(|| {
            violation(
                ErrorCode::ProtocolError,
                "DATA padding longer than its frame",
            )
        })?;
        let data_at = payload.start + usize::from(flags & flag::PADDED != 0);
        let data_range = data_at..data_at + data.len();
        let end_stream = flags & flag::END_STREAM != 0;
        if stream_id > self.last_stream_id {
            return Err(violation(
                ErrorCode::ProtocolError,
                "DATA on an idle stream",
            ));
        }
        let body_bytes_max = self.limits.body_bytes_max;
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            // A stream already answered and reset, or reset by the client.
            return Ok(());
        };
        if !stream.receiving {
            self.reset(stream_id, ErrorCode::StreamClosed);
            return Ok(());
        }
        if stream.called {
            // Answered (or being answered) while the client still sends:
            // what follows is not read.
            stream.receiving = !end_stream;
            return Ok(());
        }
        if stream.body.len() + data.len() > body_bytes_max {
            let room = body_bytes_max - stream.body.len();
            stream.body.extend_from_slice(&data[..room]);
            stream.receiving = !end_stream;
            stream.called = true;
            calls.push(Call {
                stream_id,
                route: std::mem::take(&mut stream.route),
                grpc: stream.grpc,
                body: Body::TooLarge(std::mem::take(&mut stream.body)),
            });
            return Ok(());
        }
        if !end_stream {
            stream.body.extend_from_slice(data);
            return Ok(());
        }
        stream.receiving = false;
        stream.called = true;
        let body = if stream.body.is_empty() {
            Body::Input(data_range)
        } else {
            stream.body.extend_from_slice(data);
            Body::Owned(std::mem::take(&mut stream.body))
        };
        calls.push(Call {
            stream_id,
            route: std::mem::take(&mut stream.route),
            grpc: stream.grpc,
            body,
        });
        Ok(())
    }

    fn on_headers(
        &mut self,
        flags: u8,
        stream_id: u32,
        bytes: &[u8],
        calls: &mut Vec<Call>,
    ) -> Result<(), ConnectionError> {
        if stream_id == 0 {
            return Err(violation(ErrorCode::ProtocolError, "HEADERS on stream 0"));
        }
        let mut block = unpad(flags, bytes).ok_or_else(|| {
            violation(
                ErrorCode::ProtocolError,
                "HEADERS padding longer than its frame",
            )
        })?;
        if flags & flag::PRIORITY != 0 {
            block = block.get(5..).ok_or_else(|| {
                violation(
                    ErrorCode::ProtocolError,
                    "HEADERS too short for its priority",
                )
            })?;
        }
        let end_stream = flags & flag::END_STREAM != 0;
        if flags & flag::END_HEADERS == 0 {
            self.check_block_size(block.len())?;
            self.continuation = Some(PendingHeaders {
                stream_id,
                end_stream,
                block: block.to_vec(),
            });
            return Ok(());
        }
        self.on_header_block(stream_id, end_stream, block, calls)
    }

    fn on_continuation(
        &mut self,
        flags: u8,
        stream_id: u32,
        bytes: &[u8],
        calls: &mut Vec<Call>,
    ) -> Result<(), ConnectionError> {
        let Some(mut pending) = self.continuation.take() else {
            return Err(violation(
                ErrorCode::ProtocolError,
                "CONTINUATION without HEADERS",
            ));
        };
        debug_assert_eq!(pending.stream_id, stream_id);
        self.check_block_size(pending.block.len() + bytes.len())?;
        pending.block.extend_from_slice(bytes);
        if flags & flag::END_HEADERS == 0 {
            self.continuation = Some(pending);
            return Ok(());
        }
        self.on_header_block(stream_id, pending.end_stream, &pending.block, calls)
    }

    fn check_block_size(&self, bytes: usize) -> Result<(), ConnectionError> {
        if bytes > self.limits.header_block_bytes_max {
            return Err(violation(
                ErrorCode::EnhanceYourCalm,
                format!(
                    "a header block over the {} bytes allowed",
                    self.limits.header_block_bytes_max
                ),
            ));
        }
        Ok(())
    }

    fn on_header_block(
        &mut self,
        stream_id: u32,
        end_stream: bool,
        block: &[u8],
        calls: &mut Vec<Call>,
    ) -> Result<(), ConnectionError> {
        let request = self.decode_headers(block)?;
        if stream_id <= self.last_stream_id {
            // Trailers on a stream still sending, else a closed stream.
            return match self.streams.get_mut(&stream_id) {
                Some(stream) if stream.receiving && end_stream => {
                    self.on_data_end(stream_id, calls);
                    Ok(())
                }
                Some(_) => {
                    self.reset(stream_id, ErrorCode::ProtocolError);
                    Ok(())
                }
                None => Ok(()),
            };
        }
        if stream_id.is_multiple_of(2) {
            return Err(violation(
                ErrorCode::ProtocolError,
                "a client opened an even stream id",
            ));
        }
        self.last_stream_id = stream_id;
        if self.phase != Phase::Open || self.streams.len() >= self.limits.streams_max as usize {
            self.write_rst_stream(stream_id, ErrorCode::RefusedStream);
            return Ok(());
        }
        let Some(route) = request.route else {
            self.write_rst_stream(stream_id, ErrorCode::ProtocolError);
            return Ok(());
        };
        let mut stream = Stream {
            route,
            grpc: request.grpc && request.post,
            body: Vec::new(),
            receiving: !end_stream,
            called: end_stream,
            send_window: self.peer_initial_window,
            held: None,
        };
        if end_stream {
            calls.push(Call {
                stream_id,
                route: std::mem::take(&mut stream.route),
                grpc: stream.grpc,
                body: Body::Owned(Vec::new()),
            });
        }
        self.streams.insert(stream_id, stream);
        Ok(())
    }

    /// Decodes a header block, whatever becomes of its stream: the table
    /// must follow the client's encoder. A block of indexed fields only
    /// leaves the table as it was, so the same bytes mean the same headers
    /// until a block that is not changes it: clients send one such block for
    /// every call after the first, and it is decoded once.
    fn decode_headers(&mut self, block: &[u8]) -> Result<RequestHeaders, ConnectionError> {
        let cache = &self.indexed_block;
        if cache.table_generation == self.table_generation && cache.block[..] == *block {
            if let Some(headers) = &cache.headers {
                return Ok(headers.clone());
            }
        }
        let mut request = RequestHeaders {
            routes: self.routes,
            route: None,
            post: false,
            grpc: false,
        };
        self.decoder
            .decode_with_cb(block, |name, value| request.see(name, value))
            .map_err(|error| violation(ErrorCode::CompressionError, format!("HPACK: {error}")))?;
        if !only_indexed(block) {
            self.table_generation += 1;
        } else if matches!(request.route, Some(Route::Known(_)))
            && block.len() <= INDEXED_BLOCK_BYTES_MAX
        {
            self.indexed_block = IndexedBlock {
                block: SmallVec::from_slice(block),
                table_generation: self.table_generation,
                headers: Some(request.clone()),
            };
        }
        Ok(request)
    }

    /// The client ended a stream with trailers: its body is complete.
    fn on_data_end(&mut self, stream_id: u32, calls: &mut Vec<Call>) {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        stream.receiving = false;
        if !stream.called {
            stream.called = true;
            calls.push(Call {
                stream_id,
                route: std::mem::take(&mut stream.route),
                grpc: stream.grpc,
                body: Body::Owned(std::mem::take(&mut stream.body)),
            });
        }
    }

    fn on_settings(
        &mut self,
        flags: u8,
        stream_id: u32,
        bytes: &[u8],
    ) -> Result<(), ConnectionError> {
        if stream_id != 0 || !bytes.len().is_multiple_of(6) {
            return Err(violation(
                ErrorCode::ProtocolError,
                "a malformed SETTINGS frame",
            ));
        }
        if flags & flag::ACK != 0 {
            return if bytes.is_empty() {
                Ok(())
            } else {
                Err(violation(
                    ErrorCode::FrameSizeError,
                    "a SETTINGS acknowledgement with a payload",
                ))
            };
        }
        for entry in bytes.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            match id {
                setting::INITIAL_WINDOW_SIZE => {
                    let value = i64::from(value);
                    if value > WINDOW_BYTES_MAX {
                        return Err(violation(
                            ErrorCode::FlowControlError,
                            "INITIAL_WINDOW_SIZE over 2^31 - 1",
                        ));
                    }
                    let delta = value - self.peer_initial_window;
                    self.peer_initial_window = value;
                    for stream in self.streams.values_mut() {
                        stream.send_window += delta;
                    }
                }
                setting::MAX_FRAME_SIZE => {
                    if !(FRAME_PAYLOAD_BYTES_MAX as u32..=(1 << 24) - 1).contains(&value) {
                        return Err(violation(
                            ErrorCode::ProtocolError,
                            "MAX_FRAME_SIZE out of range",
                        ));
                    }
                    self.peer_frame_bytes_max = value as usize;
                }
                setting::ENABLE_PUSH if value > 1 => {
                    return Err(violation(
                        ErrorCode::ProtocolError,
                        "ENABLE_PUSH neither 0 nor 1",
                    ));
                }
                // The server's blocks never use the peer's table; it opens
                // no streams; header list sizes are advisory.
                setting::HEADER_TABLE_SIZE
                | setting::ENABLE_PUSH
                | setting::MAX_CONCURRENT_STREAMS
                | setting::MAX_HEADER_LIST_SIZE => {}
                _ => {}
            }
        }
        self.frame_header(0, frame::SETTINGS, flag::ACK, 0);
        self.flush_held();
        Ok(())
    }

    fn on_window_update(&mut self, stream_id: u32, bytes: &[u8]) -> Result<(), ConnectionError> {
        if bytes.len() != 4 {
            return Err(violation(
                ErrorCode::FrameSizeError,
                "a WINDOW_UPDATE not of 4 bytes",
            ));
        }
        let increment =
            i64::from(u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) & 0x7fff_ffff);
        if stream_id == 0 {
            if increment == 0 {
                return Err(violation(ErrorCode::ProtocolError, "a WINDOW_UPDATE of 0"));
            }
            self.send_window += increment;
            if self.send_window > WINDOW_BYTES_MAX {
                return Err(violation(
                    ErrorCode::FlowControlError,
                    "the connection window over 2^31 - 1",
                ));
            }
        } else {
            if stream_id > self.last_stream_id {
                return Err(violation(
                    ErrorCode::ProtocolError,
                    "WINDOW_UPDATE on an idle stream",
                ));
            }
            let Some(stream) = self.streams.get_mut(&stream_id) else {
                return Ok(());
            };
            stream.send_window += increment;
            if increment == 0 {
                self.reset(stream_id, ErrorCode::ProtocolError);
                return Ok(());
            }
            if stream.send_window > WINDOW_BYTES_MAX {
                self.reset(stream_id, ErrorCode::FlowControlError);
                return Ok(());
            }
        }
        self.flush_held();
        Ok(())
    }

    /// Answers `stream_id` with one gRPC message (`message`: its 5-byte
    /// prefix included) and `grpc-status: 0`. A stream the client reset
    /// meanwhile is not answered.
    pub fn respond(&mut self, stream_id: u32, message: &[u8]) {
        let peer_frame_bytes_max = self.peer_frame_bytes_max;
        let send_window = self.send_window;
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        let length = message.len() as i64;
        let fits = stream.held.is_none()
            && length <= send_window
            && length <= stream.send_window
            && message.len() <= peer_frame_bytes_max;
        if fits {
            stream.send_window -= length;
            self.send_window -= length;
            self.write_headers(stream_id, RESPONSE_HEADERS, false);
            self.frame_header(message.len(), frame::DATA, 0, stream_id);
            self.out.extend_from_slice(message);
            self.write_headers(stream_id, OK_TRAILERS, true);
            self.finish_stream(stream_id);
            return;
        }
        stream.held = Some(Box::new(HeldResponse {
            data: message.to_vec(),
            sent: 0,
            trailers: OK_TRAILERS.to_vec(),
        }));
        self.write_headers(stream_id, RESPONSE_HEADERS, false);
        self.held.push_back(stream_id);
        self.flush_held();
    }

    /// Answers `stream_id` with gRPC status `code` and `message` and no
    /// response message (gRPC's trailers-only form), or, for a request that
    /// is not gRPC, with HTTP's 415.
    pub fn respond_status(&mut self, stream_id: u32, code: u32, message: &str) {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        let mut block = Vec::with_capacity(64 + message.len());
        if stream.grpc {
            block.extend_from_slice(RESPONSE_HEADERS);
            hpack_literal(&mut block, b"grpc-status", code.to_string().as_bytes());
            if !message.is_empty() {
                hpack_literal(&mut block, b"grpc-message", &percent_encode(message));
            }
        } else {
            hpack_literal(&mut block, b":status", b"415");
        }
        self.write_headers(stream_id, &block, true);
        self.finish_stream(stream_id);
    }

    /// The stream's response is written: the stream is done, and a client
    /// still sending is told to stop.
    fn finish_stream(&mut self, stream_id: u32) {
        if let Some(stream) = self.streams.remove(&stream_id) {
            if stream.receiving {
                self.write_rst_stream(stream_id, ErrorCode::NoError);
            }
        }
    }

    /// Writes what the windows now allow of held responses, oldest first.
    fn flush_held(&mut self) {
        let mut index = 0;
        while index < self.held.len() && self.send_window > 0 {
            let stream_id = self.held[index];
            let frame_max = self.peer_frame_bytes_max;
            let Some(stream) = self.streams.get_mut(&stream_id) else {
                self.held.remove(index);
                continue;
            };
            let Some(held) = stream.held.as_mut() else {
                self.held.remove(index);
                continue;
            };
            let mut finished = false;
            loop {
                let left = held.data.len() - held.sent;
                if left == 0 {
                    let trailers = std::mem::take(&mut held.trailers);
                    stream.held = None;
                    write_frame_header(
                        &mut self.out,
                        trailers.len(),
                        frame::HEADERS,
                        flag::END_HEADERS | flag::END_STREAM,
                        stream_id,
                    );
                    self.out.extend_from_slice(&trailers);
                    finished = true;
                    break;
                }
                let allowed = (left as i64)
                    .min(self.send_window)
                    .min(stream.send_window)
                    .min(frame_max as i64);
                if allowed <= 0 {
                    break;
                }
                let chunk = &held.data[held.sent..held.sent + allowed as usize];
                write_frame_header(&mut self.out, chunk.len(), frame::DATA, 0, stream_id);
                self.out.extend_from_slice(chunk);
                held.sent += allowed as usize;
                self.send_window -= allowed;
                stream.send_window -= allowed;
            }
            if finished {
                self.held.remove(index);
                self.finish_stream(stream_id);
            } else {
                index += 1;
            }
        }
    }

    /// Resets a stream the server no longer serves.
    fn reset(&mut self, stream_id: u32, code: ErrorCode) {
        if self.streams.remove(&stream_id).is_some() {
            self.held.retain(|held| *held != stream_id);
        }
        self.write_rst_stream(stream_id, code);
    }

    fn write_rst_stream(&mut self, stream_id: u32, code: ErrorCode) {
        self.frame_header(4, frame::RST_STREAM, 0, stream_id);
        self.out.extend_from_slice(&(code as u32).to_be_bytes());
    }

    fn write_headers(&mut self, stream_id: u32, block: &[u8], end_stream: bool) {
        let flags = flag::END_HEADERS | if end_stream { flag::END_STREAM } else { 0 };
        self.frame_header(block.len(), frame::HEADERS, flags, stream_id);
        self.out.extend_from_slice(block);
    }

    fn goaway(&mut self, code: ErrorCode, debug: &[u8]) {
        let debug = &debug[..debug.len().min(256)];
        self.frame_header(8 + debug.len(), frame::GOAWAY, 0, 0);
        self.out
            .extend_from_slice(&self.last_stream_id.to_be_bytes());
        self.out.extend_from_slice(&(code as u32).to_be_bytes());
        self.out.extend_from_slice(debug);
    }

    fn window_update(&mut self, stream_id: u32, increment: u32) {
        self.frame_header(4, frame::WINDOW_UPDATE, 0, stream_id);
        self.out.extend_from_slice(&increment.to_be_bytes());
    }

    fn frame_header(&mut self, length: usize, kind: u8, flags: u8, stream_id: u32) {
        write_frame_header(&mut self.out, length, kind, flags, stream_id);
    }
}

fn write_frame_header(out: &mut Vec<u8>, length: usize, kind: u8, flags: u8, stream_id: u32) {
    let length = length as u32;
    out.extend_from_slice(&[
        (length >> 16) as u8,
        (length >> 8) as u8,
        length as u8,
        kind,
        flags,
    ]);
    out.extend_from_slice(&stream_id.to_be_bytes());
}

/// The payload without its padding, or `None` when the padding is longer
/// than the frame.
fn unpad(flags: u8, payload: &[u8]) -> Option<&[u8]> {
    if flags & flag::PADDED == 0 {
        return Some(payload);
    }
    let (pad, rest) = payload.split_first()?;
    rest.len()
        .checked_sub(usize::from(*pad))
        .map(|length| &rest[..length])
}

/// Longest header block kept to be recognised, in bytes.
const INDEXED_BLOCK_BYTES_MAX: usize = 32;

/// The last header block of indexed fields only, and what it decoded to.
#[derive(Default)]
struct IndexedBlock {
    block: SmallVec<[u8; INDEXED_BLOCK_BYTES_MAX]>,
    /// The table it was decoded against.
    table_generation: u64,
    headers: Option<RequestHeaders>,
}

/// Whether every field of `block` is an indexed one (RFC 7541, 6.1), which
/// leaves the dynamic table unchanged.
fn only_indexed(block: &[u8]) -> bool {
    let mut rest = block;
    while let Some((first, tail)) = rest.split_first() {
        if first & 0x80 == 0 {
            return false;
        }
        rest = tail;
        if first & 0x7f == 0x7f {
            // The index goes on in bytes whose top bit says more follow.
            let Some(end) = rest.iter().position(|byte| byte & 0x80 == 0) else {
                return false;
            };
            rest = &rest[end + 1..];
        }
    }
    true
}

/// What the server reads of a request's headers.
#[derive(Clone)]
struct RequestHeaders {
    routes: &'static [&'static str],
    route: Option<Route>,
    post: bool,
    grpc: bool,
}

impl RequestHeaders {
    fn see(&mut self, name: Cow<[u8]>, value: Cow<[u8]>) {
        match &*name {
            b":path" => {
                let known = self
                    .routes
                    .iter()
                    .position(|route| route.as_bytes() == &*value);
                self.route = Some(match known {
                    Some(index) => Route::Known(index),
                    None => {
                        let kept = &value[..value.len().min(UNKNOWN_PATH_BYTES_MAX)];
                        Route::Unknown(String::from_utf8_lossy(kept).into())
                    }
                });
            }
            b":method" => self.post = &*value == b"POST",
            b"content-type" => self.grpc = value.starts_with(b"application/grpc"),
            _ => {}
        }
    }
}

/// `:status: 200` (static table index 8) and `content-type:
/// application/grpc`, literals without indexing.
const RESPONSE_HEADERS: &[u8] = b"\x88\x0f\x10\x10application/grpc";
/// `grpc-status: 0`.
const OK_TRAILERS: &[u8] = b"\x00\x0bgrpc-status\x010";

/// Appends a header as a literal without indexing, new name, no Huffman
/// coding (RFC 7541, 6.2.2).
fn hpack_literal(block: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    block.push(0);
    hpack_integer(block, name.len(), 7, 0);
    block.extend_from_slice(name);
    hpack_integer(block, value.len(), 7, 0);
    block.extend_from_slice(value);
}

/// HPACK's prefixed integer (RFC 7541, 5.1).
fn hpack_integer(block: &mut Vec<u8>, mut value: usize, prefix_bits: u8, first: u8) {
    let prefix_max = (1usize << prefix_bits) - 1;
    if value < prefix_max {
        block.push(first | value as u8);
        return;
    }
    block.push(first | prefix_max as u8);
    value -= prefix_max;
    while value >= 128 {
        block.push((value % 128 + 128) as u8);
        value /= 128;
    }
    block.push(value as u8);
}

/// gRPC's `grpc-message` encoding: bytes outside printable ASCII, and `%`,
/// as `%XX`; cut to [`STATUS_MESSAGE_BYTES_MAX`].
fn percent_encode(message: &str) -> Vec<u8> {
    let mut encoded = Vec::with_capacity(message.len().min(STATUS_MESSAGE_BYTES_MAX));
    for byte in message.bytes() {
        if encoded.len() + 3 > STATUS_MESSAGE_BYTES_MAX {
            break;
        }
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            encoded.push(byte);
        } else {
            encoded.extend_from_slice(format!("%{byte:02X}").as_bytes());
        }
    }
    encoded
}

#[cfg(test)]
mod tests;
