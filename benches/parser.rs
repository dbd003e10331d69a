//! Measures the line parser: bytes per second for typical divvy requests
//! (unquoted, and the Node client's always-quoted sorted keys) and for a long
//! line of many pairs, from `&str` to a parsed `Command` with its pairs.

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use tollgate::protocol::parse_line;

fn bench_parser(c: &mut Criterion) {
    let many_pairs: String = std::iter::once("HIT".to_string())
        .chain((0..64).map(|i| format!(" key{i}=value{i}")))
        .collect();
    let cases = [
        ("unquoted", "HIT method=GET path=/pantry/cookies/chocolate-chip ip=192.168.1.1".to_string()),
        (
            "node-client-quoted",
            "HIT \"ip\"=\"192.168.1.1\" \"method\"=\"GET\" \"path\"=\"/pantry/cookies/chocolate-chip\"".to_string(),
        ),
        ("64-pairs", many_pairs),
    ];
    let mut group = c.benchmark_group("parse_line");
    for (name, line) in &cases {
        group.throughput(Throughput::Bytes(line.len() as u64));
        group.bench_function(*name, |b| {
            b.iter(|| parse_line(black_box(line)).map(|c| c.pairs.iter().count()))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_parser);
criterion_main!(benches);
