//! Measures the striped memory store under contention: 1, 2 and 4 threads
//! each applying fixed-window hits to 100,000 distinct keys (uniformly
//! spread) and to one hot key, reported as hits per second across threads.

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::sync::Arc;
use tollgate::limiter::{fixed_window_hit, WindowQuota};
use tollgate::store::{MemoryStore, MemoryStoreConfig};

const HITS_PER_THREAD: u64 = 20_000;

fn run(store: &Arc<MemoryStore>, threads: u64, distinct_keys: u64) {
    let quota = WindowQuota::new(u64::MAX / 2, 3600).unwrap();
    let now = 1_700_000_000_000u64;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let store = Arc::clone(store);
            scope.spawn(move || {
                let mut key = Vec::with_capacity(16);
                let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for _ in 0..HITS_PER_THREAD {
                    // xorshift: cheap, deterministic key choice.
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    key.clear();
                    key.extend_from_slice(&(x % distinct_keys).to_le_bytes());
                    let _ = store.update(&key, now, |s| fixed_window_hit(s, quota, now));
                }
            });
        }
    });
}

fn bench_store(c: &mut Criterion) {
    let mut group = c.benchmark_group("store_update");
    for threads in [1u64, 2, 4] {
        group.throughput(Throughput::Elements(threads * HITS_PER_THREAD));
        for (case, keys) in [("100k-keys", 100_000u64), ("one-hot-key", 1)] {
            let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
            run(&store, 1, keys); // warm the table
            group.bench_with_input(BenchmarkId::new(case, threads), &threads, |b, &threads| {
                b.iter(|| run(&store, threads, keys))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_store);
criterion_main!(benches);
