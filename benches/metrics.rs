//! The request path's cost of metrics: `Metrics::hit_duration` (the one
//! hook that exporters change: with statsd on, it also queues the HIT's
//! timing) and `hit_evaluated`, alone and with two threads recording at once
//! (the thread-per-core server's case). Compare the `statsd-*` lines with
//! `exporters-off` to get what turning statsd on adds per HIT.

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::metrics::{HitStatus, HitTimings, Metrics};

const ELAPSED: Duration = Duration::from_micros(37);

/// Metrics with a timing queue that a thread empties every `drain_every`
/// (the statsd sender's flush), or never (`None`: the queue stays full).
fn with_statsd(drain_every: Option<Duration>) -> (Arc<Metrics>, Option<Drainer>) {
    let metrics = Metrics::new();
    let queue = Arc::new(HitTimings::new(65_536, 2));
    assert!(metrics.attach_hit_timings(Arc::clone(&queue)));
    match drain_every {
        None => {
            // Fill every shard: more pushes than the capacity, from each of
            // the two threads that will record (each takes its own shard).
            std::thread::scope(|scope| {
                for _ in 0..2 {
                    scope.spawn(|| (0..65_536).for_each(|_| queue.push(0)));
                }
            });
            (metrics, None)
        }
        Some(every) => (metrics, Some(Drainer::start(queue, every))),
    }
}

struct Drainer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drainer {
    fn start(queue: Arc<HitTimings>, every: Duration) -> Drainer {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                std::thread::sleep(every);
                queue.drain(|micros| {
                    black_box(micros);
                });
            }
        });
        Drainer {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Drainer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One HIT's metrics: one evaluated rule, then its duration.
fn record(metrics: &Metrics, label: &tollgate::metrics::LabelCounters) {
    metrics.hit_evaluated(label, HitStatus::Accepted);
    metrics.hit_duration(black_box(ELAPSED));
}

/// `iters` HITs recorded by `threads` threads at once; wall time.
fn contended(metrics: &Arc<Metrics>, threads: u64, iters: u64) -> Duration {
    let label = metrics.label_counters("bench");
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                for _ in 0..iters / threads {
                    record(metrics, &label);
                }
            });
        }
    });
    started.elapsed()
}

fn bench_metrics(c: &mut Criterion) {
    let cases: [(&str, Option<Option<Duration>>); 3] = [
        ("exporters-off", None),
        ("statsd-queue-drained", Some(Some(Duration::from_millis(1)))),
        ("statsd-queue-full", Some(None)),
    ];
    for (name, statsd) in cases {
        let (metrics, _drainer) = match statsd {
            None => (Metrics::new(), None),
            Some(drain_every) => with_statsd(drain_every),
        };
        let label = metrics.label_counters("bench");
        c.bench_function(&format!("metrics/hit/{name}/1-thread"), |b| {
            b.iter(|| record(&metrics, &label))
        });
        c.bench_function(&format!("metrics/hit/{name}/2-threads"), |b| {
            b.iter_custom(|iters| contended(&metrics, 2, iters))
        });
    }
}

criterion_group!(benches, bench_metrics);
criterion_main!(benches);
