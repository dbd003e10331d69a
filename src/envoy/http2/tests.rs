//! The HTTP/2 connection driven by hand-built client frames (header blocks
//! from `loona-hpack`'s encoder, which indexes, so the decoder's table is
//! exercised), its output parsed back into frames.

use super::*;

const ROUTES: &[&str] = &["/svc/Call"];

fn limits() -> Http2Limits {
    Http2Limits {
        streams_max: 4,
        body_bytes_max: 32,
        header_block_bytes_max: 1024,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    kind: u8,
    flags: u8,
    stream_id: u32,
    payload: Vec<u8>,
}

fn parse(mut bytes: &[u8]) -> Vec<Frame> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        let length =
            (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
        frames.push(Frame {
            kind: bytes[3],
            flags: bytes[4],
            stream_id: u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]),
            payload: bytes[9..9 + length].to_vec(),
        });
        bytes = &bytes[9 + length..];
    }
    frames
}

fn raw_frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    write_frame_header(&mut out, payload.len(), kind, flags, stream_id);
    out.extend_from_slice(payload);
    out
}

/// A client: its encoder keeps HPACK state across requests, like a real one.
struct Client {
    encoder: loona_hpack::Encoder<'static>,
}

impl Client {
    fn new() -> Client {
        Client {
            encoder: loona_hpack::Encoder::new(),
        }
    }

    fn headers_block(&mut self, path: &str, content_type: &str) -> Vec<u8> {
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", b"localhost"),
            (b"content-type", content_type.as_bytes()),
            (b"te", b"trailers"),
        ];
        self.encoder.encode(headers)
    }

    fn request(&mut self, stream_id: u32, body: &[u8]) -> Vec<u8> {
        let block = self.headers_block("/svc/Call", "application/grpc");
        let mut out = raw_frame(frame::HEADERS, flag::END_HEADERS, stream_id, &block);
        out.extend(raw_frame(frame::DATA, flag::END_STREAM, stream_id, body));
        out
    }
}

fn opened() -> (Connection, Vec<u8>) {
    let mut connection = Connection::new(limits(), ROUTES);
    let greeting = parse(&std::mem::take(connection.output()));
    assert_eq!(greeting[0].kind, frame::SETTINGS);
    assert_eq!(greeting[1].kind, frame::WINDOW_UPDATE);
    let mut input = CLIENT_PREFACE.to_vec();
    input.extend(raw_frame(frame::SETTINGS, 0, 0, &[]));
    (connection, input)
}

fn take_frames(connection: &mut Connection) -> Vec<Frame> {
    parse(&std::mem::take(connection.output()))
}

#[test]
fn a_call_in_one_read_is_answered_with_headers_message_and_trailers() {
    let (mut connection, mut input) = opened();
    let mut client = Client::new();
    input.extend(client.request(1, b"hello"));
    input.extend(client.request(3, b"again"));
    let mut calls = Vec::new();
    assert_eq!(connection.receive(&input, &mut calls), input.len());
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].stream_id, 1);
    assert_eq!(calls[0].route, Route::Known(0));
    assert!(calls[0].grpc);
    assert!(matches!(calls[0].body, Body::Input(_)));
    assert_eq!(calls[0].body.bytes(&input), b"hello");
    assert_eq!(calls[1].body.bytes(&input), b"again");
    assert_eq!(connection.open_streams(), 2);
    connection.respond(3, b"answer-3");
    connection.respond(1, b"answer-1");
    assert_eq!(connection.open_streams(), 0);
    let frames = take_frames(&mut connection);
    let kinds: Vec<_> = frames.iter().map(|f| (f.kind, f.stream_id)).collect();
    assert_eq!(
        kinds,
        vec![
            (frame::SETTINGS, 0),
            (frame::HEADERS, 3),
            (frame::DATA, 3),
            (frame::HEADERS, 3),
            (frame::HEADERS, 1),
            (frame::DATA, 1),
            (frame::HEADERS, 1),
        ]
    );
    assert_eq!(frames[0].flags, flag::ACK);
    assert_eq!(frames[2].payload, b"answer-3");
    assert_eq!(frames[3].flags, flag::END_HEADERS | flag::END_STREAM);
    // The blocks decode as what they say.
    let mut decoder = loona_hpack::Decoder::new();
    let headers = decoder.decode(&frames[1].payload).unwrap();
    assert_eq!(
        headers,
        vec![
            (b":status".to_vec(), b"200".to_vec()),
            (b"content-type".to_vec(), b"application/grpc".to_vec())
        ]
    );
    let trailers = decoder.decode(&frames[3].payload).unwrap();
    assert_eq!(trailers, vec![(b"grpc-status".to_vec(), b"0".to_vec())]);
}

#[test]
fn frames_split_across_reads_and_bodies_across_frames_are_gathered() {
    let (mut connection, mut input) = opened();
    let mut client = Client::new();
    let block = client.headers_block("/svc/Call", "application/grpc+proto");
    input.extend(raw_frame(frame::HEADERS, flag::END_HEADERS, 1, &block));
    input.extend(raw_frame(frame::DATA, 0, 1, b"hel"));
    // Padded: a pad length of 2, then the data, then two bytes of padding.
    input.extend(raw_frame(
        frame::DATA,
        flag::END_STREAM | flag::PADDED,
        1,
        b"\x02lo\0\0",
    ));
    let mut calls = Vec::new();
    let mut used = 0;
    // One byte at a time: every frame is parsed once complete.
    for end in 1..=input.len() {
        used += connection.receive(&input[used..end], &mut calls);
    }
    assert_eq!(used, input.len());
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].body, Body::Owned(b"hello".to_vec()));
    // A padded body in one frame is still read in place.
    let mut input = client.request(3, b"");
    input.truncate(input.len() - 9);
    input.extend(raw_frame(
        frame::DATA,
        flag::END_STREAM | flag::PADDED,
        3,
        b"\x01abc\0",
    ));
    let mut calls = Vec::new();
    assert_eq!(connection.receive(&input, &mut calls), input.len());
    assert_eq!(calls[0].body.bytes(&input), b"abc");
}

#[test]
fn headers_continued_and_trailers_from_the_client_end_a_request() {
    let (mut connection, mut input) = opened();
    let mut client = Client::new();
    let block = client.headers_block("/svc/Call", "application/grpc");
    let (first, rest) = block.split_at(block.len() / 2);
    input.extend(raw_frame(frame::HEADERS, 0, 1, first));
    input.extend(raw_frame(frame::CONTINUATION, flag::END_HEADERS, 1, rest));
    input.extend(raw_frame(frame::DATA, 0, 1, b"body"));
    let trailers = client.encoder.encode(vec![(&b"x-trailer"[..], &b"1"[..])]);
    input.extend(raw_frame(
        frame::HEADERS,
        flag::END_HEADERS | flag::END_STREAM,
        1,
        &trailers,
    ));
    let mut calls = Vec::new();
    assert_eq!(connection.receive(&input, &mut calls), input.len());
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].body, Body::Owned(b"body".to_vec()));
}

#[test]
fn streams_over_the_limit_are_refused_and_others_go_on() {
    let (mut connection, mut input) = opened();
    let mut client = Client::new();
    for stream_id in [1, 3, 5, 7, 9] {
        let block = client.headers_block("/svc/Call", "application/grpc");
        input.extend(raw_frame(
            frame::HEADERS,
            flag::END_HEADERS,
            stream_id,
            &block,
        ));
    }
    let mut calls = Vec::new();
    connection.receive(&input, &mut calls);
    assert!(calls.is_empty());
    assert_eq!(connection.open_streams(), 4);
    let frames = take_frames(&mut connection);
    let refused = frames.iter().find(|f| f.kind == frame::RST_STREAM).unwrap();
    assert_eq!(refused.stream_id, 9);
    assert_eq!(
        refused.payload,
        (ErrorCode::RefusedStream as u32).to_be_bytes()
    );
    // The open ones complete; then a new stream is accepted.
    let mut input = raw_frame(frame::DATA, flag::END_STREAM, 1, b"x");
    input.extend(raw_frame(frame::RST_STREAM, 0, 3, &[0, 0, 0, 8]));
    connection.receive(&input, &mut calls);
    assert_eq!(calls.len(), 1);
    connection.respond(1, b"ok");
    assert_eq!(connection.open_streams(), 2);
    let input = client.request(11, b"y");
    connection.receive(&input, &mut calls);
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1].stream_id, 11);
}

#[test]
fn a_body_over_its_bound_is_handed_over_cut_and_its_stream_reset_once_answered() {
    let (mut connection, mut input) = opened();
    let mut client = Client::new();
    let block = client.headers_block("/svc/Call", "application/grpc");
    input.extend(raw_frame(frame::HEADERS, flag::END_HEADERS, 1, &block));
    input.extend(raw_frame(frame::DATA, 0, 1, &[7u8; 20]));
    input.extend(raw_frame(frame::DATA, 0, 1, &[7u8; 20]));
    let mut calls = Vec::new();
    connection.receive(&input, &mut calls);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].body, Body::TooLarge(vec![7u8; 32]));
    // More of it is not read, nor handed over again.
    connection.receive(&raw_frame(frame::DATA, 0, 1, &[7u8; 20]), &mut calls);
    assert_eq!(calls.len(), 1);
    connection.respond_status(1, 8, "too large: 100%");
    let frames = take_frames(&mut connection);
    let answer = frames.iter().find(|f| f.kind == frame::HEADERS).unwrap();
    assert_eq!(answer.flags, flag::END_HEADERS | flag::END_STREAM);
    let headers = loona_hpack::Decoder::new().decode(&answer.payload).unwrap();
    assert!(headers.contains(&(b"grpc-status".to_vec(), b"8".to_vec())));
    assert!(headers.contains(&(b"grpc-message".to_vec(), b"too large: 100%25".to_vec())));
    let reset = frames.last().unwrap();
    assert_eq!((reset.kind, reset.stream_id), (frame::RST_STREAM, 1));
    assert_eq!(reset.payload, (ErrorCode::NoError as u32).to_be_bytes());
    // Data the client had in flight is ignored.
    connection.receive(
        &raw_frame(frame::DATA, flag::END_STREAM, 1, b"z"),
        &mut calls,
    );
    assert!(take_frames(&mut connection).is_empty());
    assert!(!connection.is_finished());
}

#[test]
fn responses_wait_for_the_peers_windows() {
    let mut connection = Connection::new(limits(), ROUTES);
    connection.output().clear();
    let mut input = CLIENT_PREFACE.to_vec();
    let mut settings = setting::INITIAL_WINDOW_SIZE.to_be_bytes().to_vec();
    settings.extend(0u32.to_be_bytes());
    input.extend(raw_frame(frame::SETTINGS, 0, 0, &settings));
    let mut client = Client::new();
    input.extend(client.request(1, b"q"));
    let mut calls = Vec::new();
    connection.receive(&input, &mut calls);
    connection.output().clear();
    connection.respond(1, b"0123456789");
    // Headers go; the message waits for the stream's window.
    let frames = take_frames(&mut connection);
    assert_eq!(frames.len(), 1);
    assert_eq!(frames[0].kind, frame::HEADERS);
    connection.receive(
        &raw_frame(frame::WINDOW_UPDATE, 0, 1, &4u32.to_be_bytes()),
        &mut calls,
    );
    let frames = take_frames(&mut connection);
    assert_eq!(frames.len(), 1);
    assert_eq!(
        (frames[0].kind, &frames[0].payload[..]),
        (frame::DATA, &b"0123"[..])
    );
    assert_eq!(connection.open_streams(), 1);
    connection.receive(
        &raw_frame(frame::WINDOW_UPDATE, 0, 1, &100u32.to_be_bytes()),
        &mut calls,
    );
    let frames = take_frames(&mut connection);
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[0].payload, b"456789");
    assert_eq!(frames[1].flags, flag::END_HEADERS | flag::END_STREAM);
    assert_eq!(connection.open_streams(), 0);
}

#[test]
fn ping_is_answered_and_settings_acknowledged() {
    let (mut connection, mut input) = opened();
    input.extend(raw_frame(frame::PING, 0, 0, b"12345678"));
    input.extend(raw_frame(frame::PING, flag::ACK, 0, b"tollgate"));
    connection.receive(&input, &mut Vec::new());
    let frames = take_frames(&mut connection);
    assert_eq!(frames[0].kind, frame::SETTINGS);
    assert_eq!(frames[0].flags, flag::ACK);
    assert_eq!(frames[1].kind, frame::PING);
    assert_eq!(frames[1].flags, flag::ACK);
    assert_eq!(frames[1].payload, b"12345678");
    assert_eq!(frames.len(), 2);
}

fn goaway_code(frames: &[Frame]) -> Option<u32> {
    let goaway = frames.iter().find(|f| f.kind == frame::GOAWAY)?;
    Some(u32::from_be_bytes(goaway.payload[4..8].try_into().unwrap()))
}

#[test]
fn protocol_violations_end_the_connection_with_goaway() {
    let cases: Vec<(Vec<u8>, ErrorCode)> = vec![
        (b"GET / HTTP/1.1\r\n\r\n".to_vec(), ErrorCode::ProtocolError),
        (raw_frame(frame::DATA, 0, 0, b"x"), ErrorCode::ProtocolError),
        (raw_frame(frame::DATA, 0, 5, b"x"), ErrorCode::ProtocolError),
        (
            raw_frame(frame::HEADERS, flag::END_HEADERS, 2, b"\x82"),
            ErrorCode::ProtocolError,
        ),
        (
            raw_frame(
                frame::HEADERS,
                flag::END_HEADERS,
                1,
                b"\xff\xff\xff\xff\x0f",
            ),
            ErrorCode::CompressionError,
        ),
        (
            raw_frame(frame::CONTINUATION, flag::END_HEADERS, 1, b""),
            ErrorCode::ProtocolError,
        ),
        (
            raw_frame(frame::SETTINGS, 0, 0, b"\x00\x04\xff\xff\xff\xff"),
            ErrorCode::FlowControlError,
        ),
        (
            raw_frame(frame::PUSH_PROMISE, 0, 1, b"\0\0\0\x02"),
            ErrorCode::ProtocolError,
        ),
        (
            raw_frame(frame::WINDOW_UPDATE, 0, 0, &0u32.to_be_bytes()),
            ErrorCode::ProtocolError,
        ),
        (
            raw_frame(frame::HEADERS, 0, 1, &[0u8; 1000]),
            ErrorCode::ProtocolError,
        ),
        (
            {
                let mut big = vec![0u8, 0x40, 0x01, frame::DATA, 0, 0, 0, 0, 1];
                big.extend(vec![0u8; 16_385]);
                big
            },
            ErrorCode::FrameSizeError,
        ),
    ];
    for (index, (bytes, code)) in cases.into_iter().enumerate() {
        let (mut connection, mut input) = opened();
        if index == 0 {
            input = bytes;
        } else {
            input.extend(bytes);
            // Frames that need a frame after them to be judged.
            input.extend(raw_frame(frame::PING, 0, 0, b"12345678"));
        }
        let used = connection.receive(&input, &mut Vec::new());
        assert_eq!(used, input.len(), "case {index}");
        assert!(connection.is_finished(), "case {index}");
        let frames = take_frames(&mut connection);
        assert_eq!(
            goaway_code(&frames),
            Some(code as u32),
            "case {index}: {frames:?}"
        );
        // Nothing more is read.
        assert_eq!(connection.receive(b"anything", &mut Vec::new()), 8);
        assert!(connection.output().is_empty());
    }
}

#[test]
fn a_graceful_close_refuses_new_streams_and_finishes_open_ones() {
    let (mut connection, mut input) = opened();
    let mut client = Client::new();
    input.extend(client.request(1, b"a"));
    let mut calls = Vec::new();
    connection.receive(&input, &mut calls);
    connection.go_away();
    assert!(!connection.is_finished());
    let frames = take_frames(&mut connection);
    assert_eq!(goaway_code(&frames), Some(0));
    let goaway = frames.iter().find(|f| f.kind == frame::GOAWAY).unwrap();
    assert_eq!(goaway.payload[..4], 1u32.to_be_bytes());
    connection.receive(&client.request(3, b"b"), &mut calls);
    assert_eq!(calls.len(), 1);
    let refused = take_frames(&mut connection);
    assert_eq!(refused[0].kind, frame::RST_STREAM);
    connection.respond(1, b"done");
    assert!(connection.is_finished());
}

#[test]
fn a_stream_reset_by_the_client_is_not_answered() {
    let (mut connection, mut input) = opened();
    let mut client = Client::new();
    input.extend(client.request(1, b"a"));
    input.extend(raw_frame(frame::RST_STREAM, 0, 1, &8u32.to_be_bytes()));
    let mut calls = Vec::new();
    connection.receive(&input, &mut calls);
    assert_eq!(calls.len(), 1);
    connection.output().clear();
    connection.respond(1, b"late");
    connection.respond_status(1, 2, "late");
    assert!(connection.output().is_empty());
    assert_eq!(connection.open_streams(), 0);
}

#[test]
fn other_paths_and_content_types_are_said_so() {
    let (mut connection, mut input) = opened();
    let mut client = Client::new();
    let block = client.headers_block("/other/Method", "application/grpc");
    input.extend(raw_frame(
        frame::HEADERS,
        flag::END_HEADERS | flag::END_STREAM,
        1,
        &block,
    ));
    let block = client.headers_block("/svc/Call", "text/plain");
    input.extend(raw_frame(
        frame::HEADERS,
        flag::END_HEADERS | flag::END_STREAM,
        3,
        &block,
    ));
    let mut calls = Vec::new();
    connection.receive(&input, &mut calls);
    assert_eq!(calls[0].route, Route::Unknown("/other/Method".into()));
    assert_eq!(calls[0].body, Body::Owned(Vec::new()));
    assert!(!calls[1].grpc);
    connection.output().clear();
    connection.respond_status(3, 3, "");
    let frames = take_frames(&mut connection);
    let headers = loona_hpack::Decoder::new()
        .decode(&frames[0].payload)
        .unwrap();
    assert_eq!(headers, vec![(b":status".to_vec(), b"415".to_vec())]);
}

/// Arbitrary bytes after the preface: answered or refused, never a panic,
/// and the output stays bounded by what was read.
#[test]
fn arbitrary_frames_never_panic() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut client = Client::new();
    for _ in 0..2_000 {
        let (mut connection, mut input) = opened();
        for _ in 0..(next() % 8) {
            let kind = (next() % 11) as u8;
            let flags = (next() % 64) as u8;
            let stream_id = (next() % 8) as u32;
            let payload: Vec<u8> = match next() % 3 {
                0 => client.headers_block("/svc/Call", "application/grpc"),
                _ => (0..next() % 24).map(|_| next() as u8).collect(),
            };
            input.extend(raw_frame(kind, flags, stream_id, &payload));
        }
        let mut calls = Vec::new();
        connection.receive(&input, &mut calls);
        for call in &calls {
            if call.stream_id % 3 == 0 {
                connection.respond(call.stream_id, b"answer");
            } else {
                connection.respond_status(call.stream_id, 2, "no");
            }
        }
        assert!(connection.output().len() < 4 * input.len() + 1024);
    }
}

/// A block of indexed fields is decoded once while the table stays as it
/// was, and again once a block that adds to the table has moved its indexes.
#[test]
fn a_repeated_indexed_block_follows_the_table() {
    let (mut connection, mut input) = opened();
    let literal_path = |path: &str| {
        let mut block = vec![0x83, 0x86, 0x44, path.len() as u8];
        block.extend_from_slice(path.as_bytes());
        block
    };
    // 62: content-type, 63: :path /svc/Call.
    let mut first = literal_path("/svc/Call");
    first.extend_from_slice(b"\x5f\x10application/grpc");
    let indexed = [0x83, 0x86, 0xbf, 0xbe];
    // Then 62: :path /other, 63: content-type, 64: :path /svc/Call.
    let mut moved = literal_path("/other");
    moved.push(0xbf);
    let flags = flag::END_HEADERS | flag::END_STREAM;
    let blocks = [
        (1, &first[..]),
        (3, &indexed),
        (5, &indexed),
        (7, &moved),
        (9, &indexed),
    ];
    let mut calls = Vec::new();
    let mut routes = Vec::new();
    for (stream_id, block) in blocks {
        input.extend(raw_frame(frame::HEADERS, flags, stream_id, block));
        connection.receive(&std::mem::take(&mut input), &mut calls);
        // Answered at once, so the streams' limit (4) refuses none.
        for call in calls.drain(..) {
            routes.push((call.route.clone(), call.grpc));
            connection.respond_status(call.stream_id, 0, "");
        }
    }
    assert_eq!(
        routes,
        vec![
            (Route::Known(0), true),
            (Route::Known(0), true),
            (Route::Known(0), true),
            (Route::Unknown("/other".into()), true),
            // 63 is content-type now, 62 the new path.
            (Route::Unknown("/other".into()), true),
        ]
    );
    assert!(only_indexed(&[0x82, 0xff, 0x80, 0x01]));
    assert!(!only_indexed(&[0x82, 0xff, 0x80]));
    assert!(!only_indexed(&[0x82, 0x40]));
}
