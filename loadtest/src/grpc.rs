//! `--protocol envoy-rls`: Envoy's `ShouldRateLimit` calls over a minimal HTTP/2 client written for
//! the generator's event loop (no async runtime, no per-call allocation). The template's words become
//! one `RateLimitRequest` (its `domain=` word is the request's domain, every other `key=value` word
//! one entry of its single descriptor, in order), encoded by hand as protobuf inside gRPC's 5-byte
//! message prefix once per actor when the request table is built. Each call is a HEADERS frame (its
//! header block built once per run: the first call of a connection indexes the fields in the
//! server's HPACK table, later calls name them by index, as Envoy's and gRPC's own encoders do; see
//! [`RequestHeaders`]) and one DATA frame ending the stream; the stream id is the only part written
//! per call.
//!
//! Answers are read frame by frame and matched to their call by stream id ([`StreamTable`], no
//! search): a call whose response message carries `overall_code` `OK` is allowed, `OVER_LIMIT`
//! denied; a call that ends without a message (gRPC's trailers-only form, which is how an error
//! status travels), is reset (`RST_STREAM`), or answers any other code is an error. The server's
//! header blocks are not decoded (their HPACK state does not matter to a client that reads no
//! header), so a non-zero `grpc-status` after a message would go unnoticed; a unary call never sends
//! one. The client answers SETTINGS and PING, keeps its receive windows open (it advertises the
//! largest window and returns what it read), respects the server's connection send window and
//! `MAX_CONCURRENT_STREAMS`, and after a GOAWAY opens no stream and replaces the connection once the
//! calls the server still answers are done.

use anyhow::{bail, Result};

/// The connection preface every HTTP/2 client sends first.
pub const CLIENT_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The method every call names.
pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// The domain-carrying template word.
pub const DOMAIN_KEY: &str = "domain";
/// Frame types.
pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const WINDOW_UPDATE: u8 = 0x8;
/// Frame flags.
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// SETTINGS parameters.
const SETTINGS_HEADER_TABLE_SIZE: u16 = 0x1;
const SETTINGS_ENABLE_PUSH: u16 = 0x2;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;
/// The largest flow-control window HTTP/2 allows, in bytes: what the client advertises.
pub const WINDOW_BYTES_MAX: u32 = (1 << 31) - 1;
/// Every peer must accept frames this large, in bytes (larger only when it says so): the bound on a
/// request message.
pub const FRAME_PAYLOAD_BYTES_MAX: usize = 16_384;
/// The receive window the client returns once it has read this many bytes of DATA.
const WINDOW_RETURN_BYTES: u64 = 1 << 30;
/// The HPACK table every peer has until SETTINGS says otherwise, in bytes.
const DEFAULT_HEADER_TABLE_BYTES: usize = 4_096;
/// The window every stream and the connection start with until SETTINGS says otherwise, in bytes.
const DEFAULT_WINDOW_BYTES: i64 = 65_535;
/// Highest client stream id.
const STREAM_ID_MAX: u32 = (1 << 31) - 1;

/// `overall_code` values of a `RateLimitResponse`.
const CODE_OK: u8 = 1;
const CODE_OVER_LIMIT: u8 = 2;

/// The template of `--protocol envoy-rls`, parsed: the request's domain and the descriptor's entries,
/// `{actor}` not yet replaced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvoyTemplate {
    pub domain: String,
    pub entries: Vec<(String, String)>,
}

impl EnvoyTemplate {
    /// `domain=<d> k1=v1 k2=v2 …`: exactly one `domain=` word (non-empty), at least one entry.
    pub fn parse(template: &str) -> Result<EnvoyTemplate> {
        let mut domain = None;
        let mut entries = Vec::new();
        for word in template.split_ascii_whitespace() {
            let Some((key, value)) = word.split_once('=') else {
                bail!("template word {word:?} is not key=value");
            };
            if key.is_empty() {
                bail!("template word {word:?} has an empty key");
            }
            if key == DOMAIN_KEY {
                if domain.replace(value.to_string()).is_some() {
                    bail!("template gives domain= twice");
                }
            } else {
                entries.push((key.to_string(), value.to_string()));
            }
        }
        let Some(domain) = domain.filter(|d| !d.is_empty()) else {
            bail!(
                "an envoy-rls template needs a non-empty domain=<name> word (the request's domain)"
            );
        };
        if entries.is_empty() {
            bail!("an envoy-rls template needs at least one key=value entry besides domain=");
        }
        Ok(EnvoyTemplate { domain, entries })
    }

    /// The gRPC message (5-byte prefix, then the protobuf `RateLimitRequest`) of `actor`.
    pub fn encode_message(&self, actor: &str) -> Vec<u8> {
        let fill = |s: &str| s.replace("{actor}", actor);
        let mut descriptor = Vec::new();
        for (key, value) in &self.entries {
            let mut entry = Vec::new();
            push_bytes_field(&mut entry, 1, fill(key).as_bytes());
            push_bytes_field(&mut entry, 2, fill(value).as_bytes());
            push_bytes_field(&mut descriptor, 1, &entry);
        }
        let mut request = Vec::new();
        push_bytes_field(&mut request, 1, fill(&self.domain).as_bytes());
        push_bytes_field(&mut request, 2, &descriptor);
        let mut message = Vec::with_capacity(5 + request.len());
        message.push(0); // not compressed
        message.extend_from_slice(&(request.len() as u32).to_be_bytes());
        message.extend_from_slice(&request);
        message
    }
}

fn push_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited protobuf field (wire type 2).
fn push_bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    push_varint(out, u64::from(field << 3 | 2));
    push_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// An HPACK integer with an `n`-bit prefix, the prefix's other bits `flags`.
fn push_hpack_int(out: &mut Vec<u8>, flags: u8, n: u32, v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(flags | v as u8);
        return;
    }
    out.push(flags | max as u8);
    let mut rest = v - max;
    while rest >= 0x80 {
        out.push((rest as u8) | 0x80);
        rest >>= 7;
    }
    out.push(rest as u8);
}

/// An HPACK string literal, not Huffman-coded.
fn push_hpack_str(out: &mut Vec<u8>, s: &[u8]) {
    push_hpack_int(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// The header blocks of the calls to `authority`, as HTTP/2 clients encode them (Envoy's, gRPC's
/// own): the first call on a connection adds `:path`, `:authority`, `content-type` and `te` to the
/// server's dynamic table (literals with incremental indexing), and every later call names them by
/// index; `:method POST` and `:scheme http` are in the static table. A server that allows less
/// table than the four entries take is sent literals without indexing on every call.
#[derive(Debug, Clone, Default)]
pub struct RequestHeaders {
    /// The first call's block.
    pub first: Vec<u8>,
    /// Every later call's block (six bytes).
    pub indexed: Vec<u8>,
    /// Every call's block when the server's table is too small: a table size update to 0, then
    /// literals without indexing.
    pub literal: Vec<u8>,
    /// What the four entries take of the server's dynamic table (HPACK counts 32 bytes per entry
    /// beyond its name and value), in bytes.
    pub table_bytes: usize,
}

/// Static table indexes (RFC 7541, appendix A).
const STATIC_AUTHORITY: usize = 1;
const STATIC_PATH: usize = 4;
const STATIC_CONTENT_TYPE: usize = 31;
/// The first dynamic table index.
const DYNAMIC_FIRST: usize = 62;

pub fn request_headers(authority: &str) -> RequestHeaders {
    let fields: [(Option<usize>, &[u8], &[u8]); 4] = [
        (
            Some(STATIC_PATH),
            b":path",
            SHOULD_RATE_LIMIT_PATH.as_bytes(),
        ),
        (Some(STATIC_AUTHORITY), b":authority", authority.as_bytes()),
        (
            Some(STATIC_CONTENT_TYPE),
            b"content-type",
            b"application/grpc",
        ),
        (None, b"te", b"trailers"),
    ];
    let static_fields = [0x83, 0x86]; // :method POST, :scheme http
    let mut headers = RequestHeaders::default();
    headers.first.extend_from_slice(&static_fields);
    headers.indexed.extend_from_slice(&static_fields);
    headers.literal.push(0x20); // dynamic table size update: 0
    headers.literal.extend_from_slice(&static_fields);
    for (position, (name_index, name, value)) in fields.iter().enumerate() {
        // Literal with incremental indexing (6-bit prefix), and without (4-bit prefix).
        for (block, flags, bits) in [(&mut headers.first, 0x40, 6), (&mut headers.literal, 0, 4)] {
            match name_index {
                Some(index) => push_hpack_int(block, flags, bits, *index),
                None => {
                    block.push(flags);
                    push_hpack_str(block, name);
                }
            }
            push_hpack_str(block, value);
        }
        // The newest entry has the lowest index.
        let index = DYNAMIC_FIRST + fields.len() - 1 - position;
        push_hpack_int(&mut headers.indexed, 0x80, 7, index);
        headers.table_bytes += name.len() + value.len() + 32;
    }
    headers
}

fn push_frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = len as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// The client preface, the client's SETTINGS (no push, the largest stream window) and a connection
/// WINDOW_UPDATE to the largest window: what a connection sends first.
pub fn push_preface(out: &mut Vec<u8>) {
    out.extend_from_slice(CLIENT_PREFACE);
    push_frame_header(out, 12, SETTINGS, 0, 0);
    out.extend_from_slice(&SETTINGS_ENABLE_PUSH.to_be_bytes());
    out.extend_from_slice(&0u32.to_be_bytes());
    out.extend_from_slice(&SETTINGS_INITIAL_WINDOW_SIZE.to_be_bytes());
    out.extend_from_slice(&WINDOW_BYTES_MAX.to_be_bytes());
    push_window_update(out, WINDOW_BYTES_MAX - DEFAULT_WINDOW_BYTES as u32);
}

/// A connection-level WINDOW_UPDATE.
fn push_window_update(out: &mut Vec<u8>, increment: u32) {
    push_frame_header(out, 4, WINDOW_UPDATE, 0, 0);
    out.extend_from_slice(&increment.to_be_bytes());
}

/// One call on `stream`: HEADERS (`header_block`) then one DATA frame with `message`, ending the
/// stream.
pub fn push_call(out: &mut Vec<u8>, stream: u32, header_block: &[u8], message: &[u8]) {
    push_frame_header(out, header_block.len(), HEADERS, END_HEADERS, stream);
    out.extend_from_slice(header_block);
    push_frame_header(out, message.len(), DATA, END_STREAM, stream);
    out.extend_from_slice(message);
}

/// One frame at the start of a buffer, as far as the client cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// DATA on `stream`: `payload` without padding; `flow` is what it counts against the window.
    Data {
        stream: u32,
        end: bool,
        payload: &'a [u8],
        flow: usize,
    },
    /// HEADERS (response headers or trailers); `end`: the stream ends here.
    Headers {
        stream: u32,
        end: bool,
    },
    Reset {
        stream: u32,
    },
    Settings {
        ack: bool,
        payload: &'a [u8],
    },
    Ping {
        ack: bool,
        payload: &'a [u8],
    },
    GoAway,
    WindowUpdate {
        stream: u32,
        increment: u32,
    },
    /// Any other frame (CONTINUATION, PRIORITY, unknown types).
    Other,
}

/// Result of looking for one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameParse<'a> {
    Complete(usize, Frame<'a>),
    Incomplete,
    /// Malformed, or larger than the client allows (it never raises the frame size): the
    /// connection is out of step.
    Invalid,
}

/// Parse the frame at the start of `buf`.
pub fn parse_frame(buf: &[u8]) -> FrameParse<'_> {
    if buf.len() < 9 {
        return FrameParse::Incomplete;
    }
    let len = (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
    if len > FRAME_PAYLOAD_BYTES_MAX {
        return FrameParse::Invalid;
    }
    if buf.len() < 9 + len {
        return FrameParse::Incomplete;
    }
    let (kind, flags) = (buf[3], buf[4]);
    let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & STREAM_ID_MAX;
    let payload = &buf[9..9 + len];
    let frame = match kind {
        DATA => {
            let Some(payload) = unpad(payload, flags, 0) else {
                return FrameParse::Invalid;
            };
            Frame::Data {
                stream,
                end: flags & END_STREAM != 0,
                payload,
                flow: len,
            }
        }
        HEADERS => {
            let extra = if flags & PRIORITY != 0 { 5 } else { 0 };
            if unpad(payload, flags, extra).is_none() {
                return FrameParse::Invalid;
            }
            Frame::Headers {
                stream,
                end: flags & END_STREAM != 0,
            }
        }
        RST_STREAM => Frame::Reset { stream },
        SETTINGS => {
            if len % 6 != 0 {
                return FrameParse::Invalid;
            }
            Frame::Settings {
                ack: flags & ACK != 0,
                payload,
            }
        }
        PING => {
            if len != 8 {
                return FrameParse::Invalid;
            }
            Frame::Ping {
                ack: flags & ACK != 0,
                payload,
            }
        }
        GOAWAY => Frame::GoAway,
        WINDOW_UPDATE => {
            if len != 4 {
                return FrameParse::Invalid;
            }
            let increment = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]])
                & STREAM_ID_MAX;
            Frame::WindowUpdate { stream, increment }
        }
        _ => Frame::Other,
    };
    FrameParse::Complete(9 + len, frame)
}

/// The payload of a frame without its padding (and `extra` leading bytes); `None` when the padding
/// does not fit.
fn unpad(payload: &[u8], flags: u8, extra: usize) -> Option<&[u8]> {
    let (start, pad) = if flags & PADDED != 0 {
        (1, usize::from(*payload.first()?))
    } else {
        (0, 0)
    };
    let start = start + extra;
    let end = payload.len().checked_sub(pad)?;
    payload.get(start..end)
}

/// What a response message says, read from its first DATA frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    OverLimit,
    /// A message with another `overall_code` (or none, `UNKNOWN`), or not a whole gRPC message.
    Unexpected,
}

/// The verdict of the first DATA payload of a response: a 5-byte gRPC prefix, then the protobuf
/// `RateLimitResponse` whose field 1 (`overall_code`, a varint) comes first when set (prost and every
/// other encoder write fields in number order).
pub fn response_verdict(data: &[u8]) -> Verdict {
    match data {
        [0, _, _, _, _, 0x08, code, ..] if *code == CODE_OK => Verdict::Ok,
        [0, _, _, _, _, 0x08, code, ..] if *code == CODE_OVER_LIMIT => Verdict::OverLimit,
        _ => Verdict::Unexpected,
    }
}

/// A call in flight: what the event loop keeps about it, and what its response said so far.
#[derive(Clone, Copy, Debug)]
pub struct Stream<T> {
    pub id: u32,
    pub call: T,
    pub verdict: Option<Verdict>,
}

/// The HTTP/2 state of one connection: flow control, the server's stream limit, and the calls in
/// flight, found by stream id in a power-of-two table at least twice as large as the pipeline (a new
/// call skips the ids whose slot is still taken: HTTP/2 lets a client leave ids unused).
pub struct StreamTable<T> {
    slots: Box<[Option<Stream<T>>]>,
    mask: usize,
    next_id: u32,
    /// What the connection may still send, in bytes.
    pub send_window_bytes: i64,
    /// Every new stream's send window, in bytes.
    pub stream_window_bytes: i64,
    /// The server's `MAX_CONCURRENT_STREAMS`: 0 until its first SETTINGS arrive (calls wait
    /// for them rather than risk streams over a limit not known yet), unlimited if they do not say.
    pub streams_max: usize,
    settings_seen: bool,
    /// The server sent GOAWAY: no new stream; the connection is replaced once
    /// the streams it still answers are done.
    pub going_away: bool,
    /// DATA bytes read and not yet returned in a WINDOW_UPDATE.
    unreturned_bytes: u64,
    pub live: usize,
    /// The server's HPACK table size (`SETTINGS_HEADER_TABLE_SIZE`), in bytes.
    header_table_bytes: usize,
    /// The first call's header block (which fills the server's table) was sent.
    headers_indexed: bool,
}

impl<T: Copy> StreamTable<T> {
    pub fn new(pipeline: usize) -> StreamTable<T> {
        let size = (pipeline.max(1) * 2).next_power_of_two();
        StreamTable {
            slots: vec![None; size].into_boxed_slice(),
            mask: size - 1,
            next_id: 1,
            send_window_bytes: DEFAULT_WINDOW_BYTES,
            stream_window_bytes: DEFAULT_WINDOW_BYTES,
            streams_max: 0,
            settings_seen: false,
            going_away: false,
            unreturned_bytes: 0,
            live: 0,
            header_table_bytes: DEFAULT_HEADER_TABLE_BYTES,
            headers_indexed: false,
        }
    }

    /// Back to a new connection's state (the calls in flight are dropped: take them first).
    pub fn reset(&mut self) {
        self.slots.iter_mut().for_each(|s| *s = None);
        self.next_id = 1;
        self.send_window_bytes = DEFAULT_WINDOW_BYTES;
        self.stream_window_bytes = DEFAULT_WINDOW_BYTES;
        self.streams_max = 0;
        self.settings_seen = false;
        self.going_away = false;
        self.unreturned_bytes = 0;
        self.live = 0;
        self.header_table_bytes = DEFAULT_HEADER_TABLE_BYTES;
        self.headers_indexed = false;
    }

    /// The header block of the next call on this connection (see [`RequestHeaders`]).
    pub fn header_block<'h>(&mut self, headers: &'h RequestHeaders) -> &'h [u8] {
        if self.header_table_bytes < headers.table_bytes {
            &headers.literal
        } else if self.headers_indexed {
            &headers.indexed
        } else {
            self.headers_indexed = true;
            &headers.first
        }
    }

    fn slot(&self, id: u32) -> usize {
        (id >> 1) as usize & self.mask
    }

    /// The stream ids are used up, or the server is going away: the connection must be replaced
    /// once its calls are answered.
    pub fn exhausted(&self) -> bool {
        self.going_away || self.next_id > STREAM_ID_MAX - 2 * self.slots.len() as u32
    }

    /// How many calls of at most `message_bytes` each may start now: the pipeline's room, the
    /// server's stream limit and the connection's send window allowing (0 once the ids are used up).
    pub fn room(&self, pipeline: usize, message_bytes: usize) -> usize {
        let bytes = message_bytes.max(1) as i64;
        if self.exhausted() || bytes > self.stream_window_bytes {
            return 0;
        }
        let streams = pipeline
            .min(self.streams_max)
            .min(self.slots.len() / 2)
            .saturating_sub(self.live);
        let window = (self.send_window_bytes.max(0) / bytes) as usize;
        streams.min(window)
    }

    /// Opens a stream for `call` whose message is `message_bytes` long; `None` when the server's
    /// stream limit or flow control does not allow it now, or the ids are used up.
    pub fn open(&mut self, call: T, message_bytes: usize) -> Option<u32> {
        let bytes = message_bytes as i64;
        if self.live >= self.streams_max
            || self.live >= self.slots.len() / 2
            || bytes > self.send_window_bytes
            || bytes > self.stream_window_bytes
            || self.exhausted()
        {
            return None;
        }
        let mut id = self.next_id;
        while self.slots[self.slot(id)].is_some() {
            id += 2;
        }
        let slot = self.slot(id);
        self.slots[slot] = Some(Stream {
            id,
            call,
            verdict: None,
        });
        self.next_id = id + 2;
        self.send_window_bytes -= bytes;
        self.live += 1;
        Some(id)
    }

    /// The call of stream `id`, if it is in flight.
    pub fn get_mut(&mut self, id: u32) -> Option<&mut Stream<T>> {
        let slot = self.slot(id);
        self.slots[slot].as_mut().filter(|s| s.id == id)
    }

    /// Ends stream `id`, handing back its call.
    pub fn close(&mut self, id: u32) -> Option<Stream<T>> {
        let slot = self.slot(id);
        if self.slots[slot].is_some_and(|s| s.id == id) {
            self.live -= 1;
            return self.slots[slot].take();
        }
        None
    }

    /// Takes every call in flight (the connection is gone).
    pub fn drain(&mut self) -> impl Iterator<Item = Stream<T>> + '_ {
        self.live = 0;
        self.slots.iter_mut().filter_map(Option::take)
    }

    /// Counts `flow` bytes of DATA read; appends a WINDOW_UPDATE to `out` when enough are owed.
    pub fn consumed(&mut self, flow: usize, out: &mut Vec<u8>) {
        self.unreturned_bytes += flow as u64;
        if self.unreturned_bytes >= WINDOW_RETURN_BYTES {
            push_window_update(out, self.unreturned_bytes as u32);
            self.unreturned_bytes = 0;
        }
    }

    /// Applies the server's SETTINGS and appends their acknowledgement to `out`.
    pub fn settings(&mut self, payload: &[u8], out: &mut Vec<u8>) {
        if !self.settings_seen {
            self.settings_seen = true;
            self.streams_max = usize::MAX;
        }
        for p in payload.chunks_exact(6) {
            let id = u16::from_be_bytes([p[0], p[1]]);
            let value = u32::from_be_bytes([p[2], p[3], p[4], p[5]]);
            match id {
                SETTINGS_MAX_CONCURRENT_STREAMS => self.streams_max = value as usize,
                SETTINGS_INITIAL_WINDOW_SIZE => self.stream_window_bytes = i64::from(value),
                SETTINGS_HEADER_TABLE_SIZE => self.header_table_bytes = value as usize,
                _ => {}
            }
        }
        push_frame_header(out, 0, SETTINGS, ACK, 0);
    }

    /// A WINDOW_UPDATE from the server (streams' own windows do not matter: each call sends its one
    /// DATA frame at once).
    pub fn window_update(&mut self, stream: u32, increment: u32) {
        if stream == 0 {
            self.send_window_bytes += i64::from(increment);
        }
    }
}

/// Appends the acknowledgement of a PING carrying `payload`.
pub fn push_ping_ack(out: &mut Vec<u8>, payload: &[u8]) {
    push_frame_header(out, payload.len(), PING, ACK, 0);
    out.extend_from_slice(payload);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_makes_one_descriptor_with_the_domain_apart() {
        let t = EnvoyTemplate::parse("path=/a domain=edge ip={actor}").unwrap();
        assert_eq!(t.domain, "edge");
        assert_eq!(
            t.entries,
            vec![
                ("path".into(), "/a".into()),
                ("ip".into(), "{actor}".into())
            ]
        );
        let m = t.encode_message("a7");
        // domain "edge"; descriptor { entry {path, /a}, entry {ip, a7} }
        let want_proto: &[u8] =
            b"\x0a\x04edge\x12\x16\x0a\x0a\x0a\x04path\x12\x02/a\x0a\x08\x0a\x02ip\x12\x02a7";
        assert_eq!(&m[..5], &[0, 0, 0, 0, want_proto.len() as u8]);
        assert_eq!(&m[5..], want_proto);
    }

    #[test]
    fn bad_templates_are_refused() {
        for bad in [
            "ip={actor}",
            "domain= ip=x",
            "domain=a domain=b ip=x",
            "domain=a",
            "domain=a ip",
            "domain=a =x",
        ] {
            assert!(EnvoyTemplate::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn hpack_integers_use_their_prefix_then_continuation_bytes() {
        let mut out = Vec::new();
        push_hpack_int(&mut out, 0, 4, 31);
        assert_eq!(out, [0x0f, 0x10]);
        out.clear();
        push_hpack_int(&mut out, 0, 7, 1337);
        assert_eq!(out, [0x7f, 0xba, 0x09]);
        let headers = request_headers("h:1");
        assert!(headers
            .first
            .starts_with(&[0x83, 0x86, 0x44, SHOULD_RATE_LIMIT_PATH.len() as u8]));
        assert_eq!(headers.indexed, [0x83, 0x86, 0xc1, 0xc0, 0xbf, 0xbe]);
        assert!(headers.literal.starts_with(&[0x20, 0x83, 0x86, 0x04]));
        let mut table = StreamTable::<()>::new(4);
        assert_eq!(table.header_block(&headers), &headers.first[..]);
        assert_eq!(table.header_block(&headers), &headers.indexed[..]);
        table.reset();
        assert_eq!(table.header_block(&headers), &headers.first[..]);
        let mut ack = Vec::new();
        table.settings(&[0, 1, 0, 0, 0, 0], &mut ack);
        assert_eq!(table.header_block(&headers), &headers.literal[..]);
    }

    #[test]
    fn frames_parse_and_padding_is_stripped() {
        let mut buf = Vec::new();
        push_call(&mut buf, 5, b"hdr", b"msg");
        let FrameParse::Complete(
            used,
            Frame::Headers {
                stream: 5,
                end: false,
            },
        ) = parse_frame(&buf)
        else {
            panic!("{:?}", parse_frame(&buf));
        };
        assert_eq!(
            parse_frame(&buf[used..]),
            FrameParse::Complete(
                12,
                Frame::Data {
                    stream: 5,
                    end: true,
                    payload: b"msg",
                    flow: 3
                }
            )
        );
        assert_eq!(parse_frame(&buf[used..used + 11]), FrameParse::Incomplete);
        // Padded DATA: pad length 2, "ab", two zero bytes.
        let padded = [0, 0, 5, DATA, PADDED, 0, 0, 0, 3, 2, b'a', b'b', 0, 0];
        assert!(matches!(
            parse_frame(&padded),
            FrameParse::Complete(
                14,
                Frame::Data {
                    payload: b"ab",
                    flow: 5,
                    ..
                }
            )
        ));
        let bad_pad = [0, 0, 1, DATA, PADDED, 0, 0, 0, 3, 9];
        assert_eq!(parse_frame(&bad_pad), FrameParse::Invalid);
        let huge = [0x01, 0, 0, DATA, 0, 0, 0, 0, 1];
        assert_eq!(parse_frame(&huge), FrameParse::Invalid);
    }

    #[test]
    fn verdicts_read_the_overall_code() {
        assert_eq!(
            response_verdict(&[0, 0, 0, 0, 9, 0x08, 1, 0x12]),
            Verdict::Ok
        );
        assert_eq!(
            response_verdict(&[0, 0, 0, 0, 2, 0x08, 2]),
            Verdict::OverLimit
        );
        assert_eq!(response_verdict(&[0, 0, 0, 0, 0]), Verdict::Unexpected);
        assert_eq!(
            response_verdict(&[1, 0, 0, 0, 2, 0x08, 1]),
            Verdict::Unexpected
        );
    }

    #[test]
    fn streams_are_found_by_id_and_respect_limits() {
        let mut t: StreamTable<u32> = StreamTable::new(2);
        let mut out = Vec::new();
        assert_eq!(
            t.open(10, 100),
            None,
            "no stream before the server's SETTINGS"
        );
        t.settings(&[], &mut out);
        let a = t.open(10, 100).unwrap();
        let b = t.open(11, 100).unwrap();
        assert_eq!((a, b), (1, 3));
        // The pipeline (half the table) is full.
        assert_eq!(t.open(12, 100), None);
        assert_eq!(t.close(a).unwrap().call, 10);
        assert!(t.close(a).is_none());
        // Slot of id 5 and 7 are free: 5 is next.
        assert_eq!(t.open(12, 100), Some(5));
        assert_eq!(t.get_mut(3).unwrap().call, 11);
        assert!(t.get_mut(1).is_none());
        out.clear();
        let mut settings = Vec::new();
        settings.extend_from_slice(&SETTINGS_MAX_CONCURRENT_STREAMS.to_be_bytes());
        settings.extend_from_slice(&2u32.to_be_bytes());
        t.settings(&settings, &mut out);
        assert_eq!(out, [0, 0, 0, SETTINGS, ACK, 0, 0, 0, 0]);
        assert_eq!(t.room(8, 100), 0, "the server's limit of 2 streams");
        t.close(3);
        assert_eq!(t.room(8, 100), 1);
        t.close(5);
        assert_eq!(t.live, 0);
        assert_eq!(t.room(8, 30_000), 2);
        assert_eq!(t.room(8, 40_000), 1, "the send window holds one more");
        // Flow control: the connection window (65535 less 300 sent) bounds a message.
        assert_eq!(t.open(1, 65_400), None);
        t.window_update(0, 10_000);
        assert!(t.open(1, 65_400).is_some());
        // ...and so does a new stream's window.
        t.window_update(0, 100_000);
        assert_eq!(t.open(1, 65_536), None);
        assert_eq!(t.drain().count(), 1);
        assert_eq!(t.live, 0);
        // After GOAWAY: no new stream, and the connection is to be replaced.
        assert!(t.room(8, 100) > 0 && !t.exhausted());
        t.going_away = true;
        assert_eq!((t.room(8, 100), t.exhausted()), (0, true));
        t.reset();
        assert!(!t.exhausted());
    }
}
