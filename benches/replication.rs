//! Measures the per-state work of the cluster's data path that every
//! replicated hit pays, apart from the network: placing a counter key in
//! its shard (the serving node, and the leader of a forwarded hit), encoding
//! a decided state into a round (the leader), and decoding it (each
//! follower). A round of 2,048 states of counter keys as the bench's load
//! makes them (a rule's 8-byte counter id, then an actor such as `a12345`)
//! and fixed-window states expiring an hour from now, reported per state.
//! docs/benchmarks.md, "Cluster data path", has the figures.

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use tollgate::cluster::data_frames::{put_bytes, put_state, Reader};
use tollgate::cluster::placement::{counter_key, Placement};
use tollgate::limiter::CounterState;

const STATES: usize = 2_048;
const NOW_MS: u64 = 1_764_115_200_000;

fn keys() -> Vec<Vec<u8>> {
    (0..STATES)
        .map(|index| {
            let mut key = Vec::new();
            let actor = format!("a{}", (index * 7_919) % 100_000);
            counter_key(&mut key, 0x5eed_0000_1234_abcd, &actor);
            key
        })
        .collect()
}

fn state(index: usize) -> CounterState {
    CounterState::Window {
        end_ms: NOW_MS + 3_600_000,
        used: 1 + index as u64 % 900,
    }
}

fn encode(keys: &[Vec<u8>], out: &mut Vec<u8>) {
    out.clear();
    for (index, key) in keys.iter().enumerate() {
        put_bytes(out, key);
        put_state(out, &state(index));
    }
}

fn bench_replication(c: &mut Criterion) {
    let keys = keys();
    let mut group = c.benchmark_group("replication");
    group.throughput(Throughput::Elements(STATES as u64));

    let placement = Placement::new(64, 3, vec![1, 2, 3]);
    group.bench_function("shard-of-counter-key", |b| {
        b.iter(|| {
            let mut sum = 0u32;
            for key in &keys {
                sum = sum.wrapping_add(placement.shard_of(black_box(key)));
            }
            sum
        })
    });

    let mut round = Vec::with_capacity(STATES * 32);
    group.bench_function("encode-state", |b| {
        b.iter(|| {
            encode(black_box(&keys), &mut round);
            round.len()
        })
    });

    encode(&keys, &mut round);
    group.bench_function("decode-state", |b| {
        b.iter(|| {
            let mut reader = Reader::new(black_box(&round));
            let mut used = 0u64;
            for _ in 0..STATES {
                let key = reader.bytes().unwrap();
                if let CounterState::Window { used: u, .. } = reader.state().unwrap() {
                    used = used.wrapping_add(u).wrapping_add(key.len() as u64);
                }
            }
            used
        })
    });
    group.finish();
}

criterion_group!(benches, bench_replication);
criterion_main!(benches);
