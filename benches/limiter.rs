//! Measures one pure fixed-window step (`fixed_window_hit`): opening a
//! window, counting inside it, and denying at the limit.

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::limiter::{fixed_window_hit, CounterState, WindowQuota};

fn bench_limiter(c: &mut Criterion) {
    let quota = WindowQuota::new(1_000, 60).unwrap();
    let now = 1_700_000_000_000u64;
    let mut group = c.benchmark_group("fixed_window_hit");
    group.bench_function("open", |b| {
        b.iter(|| fixed_window_hit(black_box(None), quota, black_box(now)))
    });
    let counting = Some(CounterState::Window {
        end_ms: now + 30_000,
        used: 10,
    });
    group.bench_function("count", |b| {
        b.iter(|| fixed_window_hit(black_box(counting), quota, black_box(now)))
    });
    let full = Some(CounterState::Window {
        end_ms: now + 30_000,
        used: 1_000,
    });
    group.bench_function("deny", |b| {
        b.iter(|| fixed_window_hit(black_box(full), quota, black_box(now)))
    });
    group.finish();
}

criterion_group!(benches, bench_limiter);
criterion_main!(benches);
