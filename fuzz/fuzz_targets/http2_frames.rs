//! Fuzzes the gRPC endpoint's HTTP/2 connection on arbitrary bytes after the
//! client preface, handed over in pieces of every size as reads would: the
//! connection answers, refuses or closes, never panics; the calls it hands
//! over lie within what was read; answering each (with a message or a
//! status, as the server does) keeps its output bounded by its input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate::envoy::http2::{Body, Connection, Http2Limits, CLIENT_PREFACE};

const ROUTES: &[&str] = &["/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"];

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let limits = Http2Limits {
        streams_max: 8,
        body_bytes_max: 64,
        header_block_bytes_max: 1024,
    };
    let mut connection = Connection::new(limits, ROUTES);
    connection.output().clear();
    let mut input = CLIENT_PREFACE.to_vec();
    input.extend_from_slice(data);
    // Reads of `split` bytes (at least one), what was not used kept.
    let step = usize::from(split).max(1);
    let mut unread: Vec<u8> = Vec::new();
    let mut calls = Vec::new();
    let mut written = 0;
    for piece in input.chunks(step) {
        unread.extend_from_slice(piece);
        let used = connection.receive(&unread, &mut calls);
        assert!(used <= unread.len());
        for call in calls.drain(..) {
            match &call.body {
                Body::Input(range) => assert!(range.end <= used),
                Body::Owned(bytes) => assert!(bytes.len() <= limits.body_bytes_max),
                Body::TooLarge(bytes) => assert_eq!(bytes.len(), limits.body_bytes_max),
            }
            if call.stream_id % 2 == 1 && call.body.bytes(&unread).len() % 2 == 0 {
                connection.respond(call.stream_id, b"\0\0\0\0\x02\x08\x01");
            } else {
                connection.respond_status(call.stream_id, 3, "bad \u{1F600} %");
            }
        }
        assert!(connection.open_streams() <= limits.streams_max as usize);
        written += connection.output().len();
        connection.output().clear();
        unread.drain(..used);
    }
    assert!(
        written <= 64 * input.len() + 4096,
        "{written} bytes for {}",
        input.len()
    );
});
