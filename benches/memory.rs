//! Measures memory per live counter: inserts N counters (1M and 10M by
//! default; `MEMORY_BENCH_COUNTS=1000000,10000000`) into a `MemoryStore` the
//! way the server does (rule identity + actor bytes, one fixed-window state
//! each) and reports the growth of the process's resident set per counter,
//! and that growth minus the key bytes. Run with `cargo bench --bench memory`.

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use tollgate::limiter::{fixed_window_hit, WindowQuota};
use tollgate::store::{MemoryStore, MemoryStoreConfig};

/// Thresholds for counting slow inserts, in microseconds.
const SLOW_BOUNDS_US: [u128; 3] = [50, 200, 1000];

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn main() {
    // `cargo test --benches` runs bench binaries with `--bench` absent: stay quick then.
    let quick = !std::env::args().any(|a| a == "--bench");
    let counts: Vec<u64> = std::env::var("MEMORY_BENCH_COUNTS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| {
            if quick {
                vec![10_000]
            } else {
                vec![1_000_000, 10_000_000]
            }
        });
    if counts.len() > 1 {
        // One process per size, so memory freed by one run cannot flatter the next.
        for count in counts {
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args(std::env::args().skip(1))
                .env("MEMORY_BENCH_COUNTS", count.to_string())
                .status()
                .unwrap();
            assert!(status.success());
        }
        return;
    }
    let quota = WindowQuota::new(100, 3600).unwrap();
    let now = 1_700_000_000_000u64;
    for count in counts {
        let before = resident_bytes();
        let store = Arc::new(MemoryStore::new(MemoryStoreConfig {
            live_keys_max: usize::MAX,
            ..MemoryStoreConfig::default()
        }));
        let mut key = Vec::with_capacity(32);
        let mut key_bytes = 0u64;
        // The longest single update: a stripe's table growing under its lock.
        let mut longest_update = std::time::Duration::ZERO;
        let mut slow = [0u64; SLOW_BOUNDS_US.len()];
        for i in 0..count {
            key.clear();
            key.extend_from_slice(&7u32.to_le_bytes());
            // A realistic actor: an IPv4 address as text (7–15 bytes).
            key.extend_from_slice(
                format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255).as_bytes(),
            );
            key.extend_from_slice(&(i >> 24).to_le_bytes()[..1]);
            key_bytes += key.len() as u64;
            let started = std::time::Instant::now();
            let _ = store.update(&key, now, |s| fixed_window_hit(s, quota, now));
            let took = started.elapsed();
            if took > longest_update {
                longest_update = took;
            }
            for (bound, n) in SLOW_BOUNDS_US.iter().zip(slow.iter_mut()) {
                if took.as_micros() > *bound {
                    *n += 1;
                }
            }
        }
        let grown = resident_bytes().saturating_sub(before);
        println!(
            "memory/{count}-counters: rss +{:.1} MiB, {:.1} bytes per counter, {:.1} bytes per counter beyond its {:.1} key bytes",
            grown as f64 / (1024.0 * 1024.0),
            grown as f64 / count as f64,
            (grown as f64 - key_bytes as f64) / count as f64,
            key_bytes as f64 / count as f64,
        );
        println!(
            "memory/{count}-counters: longest single insert {:.0} us; inserts over 50 us, 200 us, 1 ms: {:?}",
            longest_update.as_secs_f64() * 1e6,
            slow
        );
        assert_eq!(store.live_keys() as u64, count);
    }
}
