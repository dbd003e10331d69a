//! Measures a whole in-process decision: a request line in, the response
//! bytes out, through the engine (parse, match the embedded default rules,
//! memory store, metrics, encode), clocks read once per line as for a
//! connection that reads one line per syscall. The target is ≤ 200 ns median.
//! The engine is the one `App` builds for `tollgate serve` (idle on port 0).

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::app::{App, ServeConfig};
use tollgate::engine::Outcome;

fn bench_decision(c: &mut Criterion) {
    let app = App::build(ServeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        threads: Some(1),
        ..ServeConfig::default()
    })
    .expect("build the server")
    .spawn()
    .expect("serve");
    let engine = app.engine();
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
