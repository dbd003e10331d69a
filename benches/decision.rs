//! Measures a whole in-process decision: a request line in, the response
//! bytes out, through the engine (parse, match the embedded default rules,
//! memory store, metrics, encode), clocks read once per line as for a
//! connection that reads one line per syscall. The target is ≤ 200 ns median.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::sync::Arc;
use tollgate::clock::SystemClock;
use tollgate::engine::{Engine, Outcome};
use tollgate::metrics::Metrics;
use tollgate::rules::RuleSet;
use tollgate::store::{MemoryBackend, MemoryStore, MemoryStoreConfig};

fn bench_decision(c: &mut Criterion) {
    let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
    let engine = Arc::new(Engine::new(
        RuleSet::embedded_default(),
        Arc::new(MemoryBackend { store }),
        Arc::new(SystemClock),
        Metrics::new(),
        Default::default(),
    ));
    let lines: Vec<Vec<u8>> = (0..1024)
        .map(|i| {
            format!(
                "HIT method=GET path=/pantry/cookies/chocolate-chip ip=10.0.{}.{}",
                i / 256,
                i % 256
            )
            .into_bytes()
        })
        .collect();
    let mut out = Vec::with_capacity(64);
    let mut i = 0usize;
    c.bench_function("decision/line-to-response", |b| {
        b.iter(|| {
            i = (i + 1) & 1023;
            out.clear();
            match engine.execute(black_box(&lines[i]), engine.arrival()) {
                Outcome::Now(reply) => reply.encode(&mut out),
                Outcome::Later(_) | Outcome::Deferred(_) => {
                    unreachable!("the memory backend answers at once")
                }
            }
            black_box(&out);
        })
    });
}

criterion_group!(benches, bench_decision);
criterion_main!(benches);
