//! Fuzzes what the cluster's peer port reads: arbitrary bytes decoded as a
//! control request and response (each decodes or fails with an error, never
//! panics; what decodes encodes again), read as a data frame's sections
//! (forwarded hits, answers, rounds, acks: an error, never a panic or an
//! allocation beyond the input; the prefetch's skim finds the same keys),
//! looked for as a whole frame in a read buffer (found only within the
//! bytes), and fed to the server side of the peer handshake, which must
//! refuse them without panicking (random bytes cannot prove the cluster
//! secret).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tokio::io::AsyncWriteExt;
use tollgate::cluster::auth::{authenticate_server, PeerSecrets};
use tollgate::cluster::codec::{decode, encode_frame, whole_frame_at};
use tollgate::cluster::data_frames;
use tollgate::cluster::wire::{PeerRequest, PeerResponse};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fn secrets() -> &'static PeerSecrets {
    static SECRETS: OnceLock<PeerSecrets> = OnceLock::new();
    SECRETS.get_or_init(|| {
        PeerSecrets::parse_value("fuzzing-cluster-secret-0123456789").expect("secret")
    })
}

fuzz_target!(|data: &[u8]| {
    let mut out = Vec::new();
    if let Ok(request) = decode::<PeerRequest>(data) {
        let _ = encode_frame(&mut out, 1, &request);
    }
    if let Ok(response) = decode::<PeerResponse>(data) {
        let _ = encode_frame(&mut out, 1, &response);
    }
    // The prefetch's skim finds the keys the full walk finds before it
    // stops, and in a frame the full walk reads whole, exactly those.
    let mut walked = Vec::new();
    let valid = data_frames::walk_keys(data, |key| {
        walked.push(key.to_vec());
        true
    })
    .is_ok();
    let mut skimmed = Vec::new();
    data_frames::skim_keys(data, |key| {
        skimmed.push(key.to_vec());
        true
    });
    assert!(skimmed.starts_with(&walked));
    assert!(!valid || skimmed == walked);
    // Found in place, a frame's body lies within the bytes read.
    if let Ok(Some((_, body))) = whole_frame_at(data) {
        assert!(body.end <= data.len() && body.start <= body.end);
    }
    // The handshake reads fixed sizes well under 4 KiB.
    let bytes = data[..data.len().min(4096)].to_vec();
    let accepted = runtime().block_on(async move {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        let writer = async move {
            let _ = client.write_all(&bytes).await;
            // Dropping the client ends the stream: the server reads EOF.
        };
        let (_, verdict) = tokio::join!(writer, authenticate_server(&mut server, secrets()));
        verdict.is_ok()
    });
    assert!(!accepted, "random bytes passed the peer handshake");
});
