//! Measures a whole in-process decision: a request line in, the response
//! bytes out, through the engine (parse, match the embedded default rules,
//! memory store, metrics, encode), clocks read once per line as for a
//! connection that reads one line per syscall. The target is ≤ 200 ns median.
//! The engine is the one `App` builds for `tollgate serve` (idle on port 0).
//!
//! `decision/read-of-32-lines` is the same per line for a pipelined read:
//! 32 lines of distinct actors (out of a million, so most miss the cache)
//! through `Engine::execute_hit_run`, which plans and prefetches a run of
//! hits before deciding them, as a connection does; criterion reports the
//! time of the whole read (divide by 32 for a line).

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::app::{App, RunningApp, ServeConfig};
use tollgate::engine::Outcome;

/// Appends a reply the memory backend gave at once.
fn encode_now(outcome: Outcome, out: &mut Vec<u8>) {
    match outcome {
        Outcome::Now(reply) => reply.encode(out),
        Outcome::Later(_) | Outcome::Deferred(_) => {
            unreachable!("the memory backend answers at once")
        }
    }
}

/// The server `tollgate serve` builds on the embedded rules, idle on port 0.
fn serving_app() -> RunningApp {
    App::build(ServeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        threads: Some(1),
        ..ServeConfig::default()
    })
    .expect("build the server")
    .spawn()
    .expect("serve")
}

fn bench_decision(c: &mut Criterion) {
    let app = serving_app();
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
            encode_now(
                engine.execute(black_box(&lines[i]), engine.arrival()),
                &mut out,
            );
            black_box(&out);
        })
    });
}

fn bench_pipelined_read(c: &mut Criterion) {
    let app = serving_app();
    let engine = app.engine();
    const LINES_PER_READ: usize = 32;
    const ACTORS: usize = 1 << 20;
    let reads: Vec<Vec<u8>> = (0..ACTORS / LINES_PER_READ)
        .map(|read| {
            let mut bytes = Vec::new();
            for line in 0..LINES_PER_READ {
                // Actors spread over the million, not consecutive.
                let actor = (read * LINES_PER_READ + line).wrapping_mul(2_654_435_761) % ACTORS;
                bytes.extend_from_slice(
                    format!(
                        "HIT method=GET path=/pantry/cookies/chocolate-chip ip=10.{}.{}.{}\n",
                        actor >> 16,
                        (actor >> 8) & 255,
                        actor & 255
                    )
                    .as_bytes(),
                );
            }
            bytes
        })
        .collect();
    // Every actor once, so that the store holds the million counters.
    let run = |read: &[u8], outcomes: &mut _| {
        engine.execute_hit_run(read, usize::MAX, 4096, engine.arrival(), None, outcomes)
    };
    let mut outcomes = smallvec::SmallVec::new();
    for read in &reads {
        run(read, &mut outcomes);
        outcomes.clear();
    }
    let mut out = Vec::with_capacity(64 * LINES_PER_READ);
    let mut i = 0usize;
    c.bench_function("decision/read-of-32-lines", |b| {
        b.iter(|| {
            i = (i + 1) % reads.len();
            out.clear();
            let read = black_box(&reads[i]);
            let used = run(read, &mut outcomes);
            assert_eq!(used, read.len());
            for outcome in outcomes.drain(..) {
                encode_now(outcome, &mut out);
            }
            black_box(&out);
        })
    });

    // The same reads a line at a time (no run, no prefetch), for comparison.
    c.bench_function("decision/read-of-32-lines-one-at-a-time", |b| {
        b.iter(|| {
            i = (i + 1) % reads.len();
            out.clear();
            let arrival = engine.arrival();
            for line in black_box(&reads[i]).split_inclusive(|&b| b == b'\n') {
                encode_now(engine.execute(&line[..line.len() - 1], arrival), &mut out);
            }
            black_box(&out);
        })
    });
}

criterion_group!(benches, bench_decision, bench_pipelined_read);
criterion_main!(benches);
