//! Latency over time (`--window-log`): the measured time cut into windows of `--window-ms`, and per
//! window a count of hits in coarse log-spaced latency buckets, the exact counts over 1 ms and over
//! 2 ms, and the largest latency. A hit belongs to the window of its due time (the time its latency
//! is measured from), counted from the end of the warm-up. Each event-loop thread keeps its own
//! [`Windows`], sized once from the run's duration (no allocation and no lock per hit); the run
//! adds the threads' windows index by index at the end (each thread counts from its own end of
//! warm-up, which differ by the threads' start skew), writes them as CSV ([`Windows::write_csv`])
//! and sums them up for the report ([`WindowSummary`]). A window costs 272 bytes per thread.

use std::io::{self, Write};

use serde::Serialize;

/// Latency buckets per window.
pub const BUCKETS: usize = 64;
/// `--window-ms` when not given.
pub const WINDOW_MS_DEFAULT: u64 = 10;
/// The longest `--window-ms`: a minute.
pub const WINDOW_MS_MAX: u64 = 60_000;
/// The most windows a run may ask for (`--duration` ÷ `--window-ms`, rounded up): 27 MB a
/// load thread at 272 bytes a window.
pub const WINDOWS_MAX: u64 = 100_000;

const OVER_1MS_NS: u64 = 1_000_000;
const OVER_2MS_NS: u64 = 2_000_000;

/// The buckets' upper bounds in ns: 1 µs, then each a quarter more than the one before (rounded
/// down), up to about 1.27 s. Bucket `k` holds the latencies in `(BOUNDS_NS[k - 1], BOUNDS_NS[k]]`;
/// the last one also holds everything above.
pub const BOUNDS_NS: [u64; BUCKETS] = bounds();

const fn bounds() -> [u64; BUCKETS] {
    let mut b = [0u64; BUCKETS];
    b[0] = 1_000;
    let mut k = 1;
    while k < BUCKETS {
        b[k] = b[k - 1] + b[k - 1] / 4;
        k += 1;
    }
    b
}

/// The bucket of a latency in ns.
pub fn bucket_of(latency_ns: u64) -> usize {
    BOUNDS_NS
        .partition_point(|&bound| bound < latency_ns)
        .min(BUCKETS - 1)
}

/// How many windows of `window_ns` cover `duration_ns` (the last one may be cut short).
pub fn window_count(duration_ns: u64, window_ns: u64) -> u64 {
    duration_ns.div_ceil(window_ns.max(1))
}

/// One window's hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    buckets: [u32; BUCKETS],
    over_1ms: u32,
    over_2ms: u32,
    max_ns: u64,
}

impl Window {
    const EMPTY: Window = Window {
        buckets: [0; BUCKETS],
        over_1ms: 0,
        over_2ms: 0,
        max_ns: 0,
    };

    /// Count one hit of `latency_ns`.
    pub fn record(&mut self, latency_ns: u64) {
        let b = &mut self.buckets[bucket_of(latency_ns)];
        *b = b.saturating_add(1);
        self.over_1ms = self
            .over_1ms
            .saturating_add(u32::from(latency_ns > OVER_1MS_NS));
        self.over_2ms = self
            .over_2ms
            .saturating_add(u32::from(latency_ns > OVER_2MS_NS));
        self.max_ns = self.max_ns.max(latency_ns);
    }

    /// Add another window's hits to this one's.
    pub fn add(&mut self, other: &Window) {
        for (b, o) in self.buckets.iter_mut().zip(&other.buckets) {
            *b = b.saturating_add(*o);
        }
        self.over_1ms = self.over_1ms.saturating_add(other.over_1ms);
        self.over_2ms = self.over_2ms.saturating_add(other.over_2ms);
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    pub fn hits(&self) -> u64 {
        self.buckets.iter().map(|&b| u64::from(b)).sum()
    }

    /// Hits whose latency exceeded 1 ms (exactly counted).
    pub fn over_1ms(&self) -> u64 {
        u64::from(self.over_1ms)
    }

    /// Hits whose latency exceeded 2 ms (exactly counted).
    pub fn over_2ms(&self) -> u64 {
        u64::from(self.over_2ms)
    }

    /// The largest latency in ns (`None` without hits).
    pub fn max_ns(&self) -> Option<u64> {
        (self.hits() > 0).then_some(self.max_ns)
    }

    /// An upper bound of the `per_mille`/1000 quantile in ns (`None` without hits): the upper bound
    /// of the bucket it falls in, but never above the window's max (in the last bucket, the max).
    pub fn quantile_ns(&self, per_mille: u64) -> Option<u64> {
        let hits = self.hits();
        if hits == 0 {
            return None;
        }
        // The rank of the quantile's hit, counted from 1.
        let rank = (hits * per_mille.min(1000)).div_ceil(1000).max(1);
        let mut seen = 0;
        let mut bucket = BUCKETS - 1;
        for (k, &n) in self.buckets.iter().enumerate() {
            seen += u64::from(n);
            if seen >= rank {
                bucket = k;
                break;
            }
        }
        Some(if bucket == BUCKETS - 1 {
            self.max_ns
        } else {
            BOUNDS_NS[bucket].min(self.max_ns)
        })
    }
}

/// The run's windows (or one thread's).
#[derive(Clone, Debug)]
pub struct Windows {
    window_ns: u64,
    windows: Vec<Window>,
}

impl Windows {
    /// Empty windows of `window_ns` covering `duration_ns` (at most [`WINDOWS_MAX`]).
    pub fn new(window_ns: u64, duration_ns: u64) -> Windows {
        let count = window_count(duration_ns, window_ns).min(WINDOWS_MAX);
        Windows {
            window_ns: window_ns.max(1),
            windows: vec![Window::EMPTY; count as usize],
        }
    }

    /// Count a hit due `since_ns` after the end of the warm-up, of `latency_ns` (a hit due after
    /// the last window is not counted).
    pub fn record(&mut self, since_ns: u64, latency_ns: u64) {
        let index = since_ns / self.window_ns;
        if let Some(w) = usize::try_from(index)
            .ok()
            .and_then(|i| self.windows.get_mut(i))
        {
            w.record(latency_ns);
        }
    }

    /// Add another thread's windows to these, index by index.
    pub fn add(&mut self, other: &Windows) {
        for (w, o) in self.windows.iter_mut().zip(&other.windows) {
            w.add(o);
        }
    }

    pub fn windows(&self) -> &[Window] {
        &self.windows
    }

    /// The `--window-log` CSV: a header line, then one line per window (see [`CSV_HEADER`]).
    pub fn write_csv<W: Write>(&self, mut out: W) -> io::Result<()> {
        writeln!(out, "{CSV_HEADER}")?;
        let window_ms = self.window_ns / 1_000_000;
        let us = |ns: Option<u64>| ns.map_or_else(String::new, micros);
        for (i, w) in self.windows.iter().enumerate() {
            writeln!(
                out,
                "{},{},{},{},{},{},{},{}",
                i as u64 * window_ms,
                w.hits(),
                us(w.quantile_ns(500)),
                us(w.quantile_ns(900)),
                us(w.quantile_ns(990)),
                us(w.max_ns()),
                w.over_1ms(),
                w.over_2ms()
            )?;
        }
        out.flush()
    }

    /// The figures of the JSON report.
    pub fn summary(&self) -> WindowSummary {
        let mut over: Vec<u64> = self.windows.iter().map(Window::over_2ms).collect();
        let over_2ms: u64 = over.iter().sum();
        over.sort_unstable_by(|a, b| b.cmp(a));
        let tenth = over.len().div_ceil(10);
        let worst: u64 = over.iter().take(tenth).sum();
        let share = if over_2ms == 0 {
            0.0
        } else {
            (worst as f64 / over_2ms as f64 * 1e4).round() / 1e4
        };
        WindowSummary {
            window_ms: self.window_ns / 1_000_000,
            count: self.windows.len() as u64,
            over_2ms,
            share_of_over_2ms_in_worst_tenth: share,
        }
    }
}

/// The columns of the `--window-log` CSV.
pub const CSV_HEADER: &str = "start_ms,hits,p50_us,p90_us,p99_us,max_us,over_1ms,over_2ms";

/// ns as µs with three decimals, exactly.
fn micros(ns: u64) -> String {
    format!("{}.{:03}", ns / 1_000, ns % 1_000)
}

/// `--window-log`'s summary in the JSON report.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct WindowSummary {
    /// `--window-ms`.
    pub window_ms: u64,
    /// Windows of the measured time (lines of the CSV).
    pub count: u64,
    /// Hits over 2 ms in all windows.
    pub over_2ms: u64,
    /// The fraction of the hits over 2 ms that fell in the tenth of the windows (rounded up) with
    /// the most of them (0 when there are none).
    pub share_of_over_2ms_in_worst_tenth: f64,
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn bounds_start_at_a_microsecond_and_grow_by_about_a_quarter() {
        assert_eq!(BOUNDS_NS[0], 1_000);
        for k in 1..BUCKETS {
            let ratio = BOUNDS_NS[k] as f64 / BOUNDS_NS[k - 1] as f64;
            assert!((1.24..=1.25).contains(&ratio), "bucket {k}: {ratio}");
        }
        let top = BOUNDS_NS[BUCKETS - 1];
        assert!((1_200_000_000..1_300_000_000).contains(&top), "{top}");
    }

    #[test]
    fn each_latency_falls_in_the_bucket_whose_range_holds_it() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1), 0);
        assert_eq!(bucket_of(1_000), 0);
        assert_eq!(bucket_of(1_001), 1);
        assert_eq!(bucket_of(1_250), 1);
        assert_eq!(bucket_of(1_251), 2);
        for k in 1..BUCKETS {
            assert_eq!(bucket_of(BOUNDS_NS[k]), k);
            assert_eq!(bucket_of(BOUNDS_NS[k - 1] + 1), k);
        }
        // Clamped above.
        assert_eq!(bucket_of(BOUNDS_NS[BUCKETS - 1] + 1), BUCKETS - 1);
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        let mut last = 0;
        for ns in (0..50_000_000).step_by(997) {
            let b = bucket_of(ns);
            assert!(b >= last, "{ns}");
            last = b;
        }
    }

    #[test]
    fn window_count_rounds_up() {
        assert_eq!(window_count(1_000_000_000, 10_000_000), 100);
        assert_eq!(window_count(1_000_000_001, 10_000_000), 101);
        assert_eq!(window_count(5_000_000, 10_000_000), 1);
        assert_eq!(window_count(0, 10_000_000), 0);
    }

    #[test]
    fn quantiles_are_monotone_upper_bounds_within_a_bucket() {
        let mut rng = SmallRng::seed_from_u64(7);
        for round in 0..200 {
            let mut w = Window::EMPTY;
            let n = rng.gen_range(1..2_000);
            let mut all: Vec<u64> = (0..n)
                .map(|_| {
                    // Log-uniform from 100 ns to 3 s, so every bucket and the clamp see hits.
                    let exp = rng.gen_range(2.0..9.5f64);
                    10f64.powf(exp) as u64
                })
                .collect();
            for &ns in &all {
                w.record(ns);
            }
            all.sort_unstable();
            assert_eq!(w.hits(), n);
            let max = w.max_ns().unwrap();
            assert_eq!(max, all[all.len() - 1]);
            let mut previous = 0;
            for per_mille in [500, 900, 990] {
                let q = w.quantile_ns(per_mille).unwrap();
                assert!(
                    q >= previous,
                    "round {round}: p{per_mille} {q} < {previous}"
                );
                assert!(q <= max, "round {round}");
                let rank = (n * per_mille).div_ceil(1000) as usize;
                let exact = all[rank - 1];
                assert!(q >= exact, "round {round}: p{per_mille} {q} below {exact}");
                // Within the exact value's bucket: at most a quarter above it (or 1 µs).
                assert!(
                    q <= exact.max(1_000) * 5 / 4 || q == max,
                    "round {round}: p{per_mille} {q} for {exact}"
                );
                previous = q;
            }
        }
    }

    #[test]
    fn over_1ms_and_over_2ms_are_exact() {
        let mut w = Window::EMPTY;
        for ns in [
            999_999, 1_000_000, 1_000_001, 2_000_000, 2_000_001, 5_000_000,
        ] {
            w.record(ns);
        }
        assert_eq!(w.over_1ms(), 4);
        assert_eq!(w.over_2ms(), 2);
        let mut other = Window::EMPTY;
        other.record(2_000_001);
        w.add(&other);
        assert_eq!((w.hits(), w.over_1ms(), w.over_2ms()), (7, 5, 3));
        assert_eq!(w.max_ns(), Some(5_000_000));
    }

    #[test]
    fn an_empty_window_has_no_quantiles() {
        let w = Window::EMPTY;
        assert_eq!(w.hits(), 0);
        assert_eq!(w.quantile_ns(500), None);
        assert_eq!(w.max_ns(), None);
    }

    #[test]
    fn hits_go_to_the_window_of_their_due_time_and_threads_add_up() {
        let mut a = Windows::new(10_000_000, 35_000_000);
        assert_eq!(a.windows().len(), 4);
        a.record(0, 50_000);
        a.record(9_999_999, 50_000);
        a.record(10_000_000, 3_000_000);
        a.record(34_999_999, 1_500_000);
        // Past the last window: not counted.
        a.record(40_000_000, 1_000);
        let mut b = Windows::new(10_000_000, 35_000_000);
        b.record(10_000_001, 2_500_000);
        a.add(&b);
        let hits: Vec<u64> = a.windows().iter().map(Window::hits).collect();
        assert_eq!(hits, [2, 2, 0, 1]);
        assert_eq!(a.windows()[1].over_2ms(), 2);
    }

    #[test]
    fn the_csv_has_a_line_per_window_and_empty_fields_for_an_empty_one() {
        let mut w = Windows::new(20_000_000, 60_000_000);
        for _ in 0..99 {
            w.record(1_000_000, 50_000);
        }
        w.record(2_000_000, 2_500_000);
        w.record(45_000_000, 1_234);
        let mut out = Vec::new();
        w.write_csv(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "start_ms,hits,p50_us,p90_us,p99_us,max_us,over_1ms,over_2ms"
        );
        assert_eq!(lines.len(), 1 + 3);
        // The p50, p90 and p99 are the 50th, 90th and 99th hits': 50 µs, read as its bucket's bound.
        let b = BOUNDS_NS[bucket_of(50_000)];
        let b_us = format!("{}.{:03}", b / 1_000, b % 1_000);
        assert_eq!(lines[1], format!("0,100,{b_us},{b_us},{b_us},2500.000,1,1"));
        assert_eq!(lines[2], "20,0,,,,,0,0");
        // One hit: every quantile is its bucket's bound, capped by the max (the hit itself).
        assert_eq!(lines[3], "40,1,1.234,1.234,1.234,1.234,0,0");
    }

    #[test]
    fn the_summary_gives_the_worst_tenths_share_of_hits_over_2ms() {
        let mut w = Windows::new(10_000_000, 200_000_000);
        assert_eq!(w.summary().share_of_over_2ms_in_worst_tenth, 0.0);
        // 20 windows: the worst tenth is 2 windows, with 6 and 3 of the 10 hits over 2 ms.
        for (window, n) in [(4, 6), (11, 3), (19, 1)] {
            for _ in 0..n {
                w.record(window * 10_000_000, 3_000_000);
            }
            w.record(window * 10_000_000, 2_000_000);
        }
        let s = w.summary();
        assert_eq!(s.window_ms, 10);
        assert_eq!(s.count, 20);
        assert_eq!(s.over_2ms, 10);
        assert_eq!(s.share_of_over_2ms_in_worst_tenth, 0.9);
    }
}
