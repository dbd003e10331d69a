//! Fuzzes the droplet protobuf decoder on arbitrary WebSocket message bytes:
//! it decodes or fails with an error, never panics; a decoded take is applied
//! to a real bucket store, whose answer encodes without panicking either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tollgate::droplet::proto::{decode_request, encode_response, Command};
use tollgate::droplet::{Buckets, BucketsConfig};

fn buckets() -> &'static Buckets {
    static BUCKETS: OnceLock<Buckets> = OnceLock::new();
    BUCKETS.get_or_init(|| {
        Buckets::new(BucketsConfig {
            stripes: 4,
            buckets_max: 1_000,
            cleanup_interval_ms: 60_000,
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(command) = decode_request(data) else {
        return;
    };
    let now_ms = 1_700_000_000_000;
    if let Command::Take { bucket, request } = command {
        if let Ok(outcome) = buckets().take(&bucket, &request, now_ms) {
            let _ = encode_response(outcome.accept, &outcome.balances);
        }
    }
});
