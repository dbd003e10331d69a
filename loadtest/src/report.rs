//! The results of a run: the `Report` that merges every thread's figures, its terminal table and its
//! JSON form (field names are stable: scripts such as `compare.sh` read them).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::check::{CheckOutcome, Violation};
use crate::config::Args;
use crate::windows::WindowSummary;

/// Latency figures in microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Latency {
    pub min: f64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Latency {
    /// From a histogram of nanoseconds (all zero when it is empty).
    pub fn from_histogram(h: &Histogram<u64>) -> Latency {
        if h.is_empty() {
            return Latency::default();
        }
        let us = |ns: u64| (ns as f64 / 100.0).round() / 10.0;
        Latency {
            min: us(h.min()),
            mean: (h.mean() / 100.0).round() / 10.0,
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
        }
    }
}

/// Everything a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The configuration, as given.
    pub config: Args,
    /// The address the target resolved to.
    pub target_addr: String,
    /// `closed-loop` or `open-loop`.
    pub mode: &'static str,
    /// Length of the measured window in seconds (shorter than `--duration` when `--requests` ran out).
    pub duration_secs: f64,
    /// Answered requests of the measured window (allowed + denied + errors).
    pub requests: u64,
    pub throughput_per_sec: f64,
    pub allowed: u64,
    pub denied: u64,
    pub errors: u64,
    pub unanswered: u64,
    pub reconnects: u64,
    pub latency_us: Latency,
    /// Present with `--check`.
    pub check: Option<CheckOutcome>,
    /// Present with `--window-log`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub windows: Option<WindowSummary>,
    /// Latencies in ns (for the plot).
    #[serde(skip)]
    pub histogram: Histogram<u64>,
}

impl Report {
    /// True when `--check` found a violation.
    pub fn check_failed(&self) -> bool {
        self.check.as_ref().is_some_and(|c| c.violations > 0)
    }

    /// The protocol's name as on the command line.
    pub fn protocol_name(&self) -> &'static str {
        self.config.protocol.name()
    }

    /// The human-readable table printed at the end of a run.
    pub fn table(&self) -> String {
        let c = &self.config;
        let proto = self.protocol_name();
        let load = match c.rate {
            Some(r) => format!("open loop at {r} req/s"),
            None => "closed loop".to_string(),
        };
        let mut t = String::new();
        let _ = writeln!(
            t,
            "target       {} ({}, {}, {} connections x pipeline {}, {} thread{})",
            self.target_addr,
            proto,
            load,
            c.connections,
            c.pipeline,
            c.threads,
            if c.threads == 1 { "" } else { "s" }
        );
        let _ = writeln!(t, "duration     {:.2} s", self.duration_secs);
        let _ = writeln!(t, "requests     {}", self.requests);
        let _ = writeln!(t, "throughput   {:.1} /s", self.throughput_per_sec);
        let _ = writeln!(t, "allowed      {}", self.allowed);
        let _ = writeln!(t, "denied       {}", self.denied);
        let _ = writeln!(t, "errors       {}", self.errors);
        if self.unanswered > 0 || self.reconnects > 0 {
            let _ = writeln!(t, "unanswered   {}", self.unanswered);
            let _ = writeln!(t, "reconnects   {}", self.reconnects);
        }
        let l = &self.latency_us;
        let _ = writeln!(t, "latency (us) p50 {:>10.1}", l.p50);
        let _ = writeln!(t, "             p90 {:>10.1}", l.p90);
        let _ = writeln!(t, "             p99 {:>10.1}", l.p99);
        let _ = writeln!(t, "           p99.9 {:>10.1}", l.p999);
        let _ = writeln!(t, "             max {:>10.1}", l.max);
        if let Some(w) = &self.windows {
            let over = if w.over_2ms == 0 {
                "no hit over 2 ms".to_string()
            } else {
                format!(
                    "{:.0} % of the {} hits over 2 ms fell in the worst tenth",
                    w.share_of_over_2ms_in_worst_tenth * 100.0,
                    w.over_2ms
                )
            };
            let _ = writeln!(t, "windows      {} of {} ms; {over}", w.count, w.window_ms);
        }
        if let Some(ch) = &self.check {
            let limits = if ch.periods.is_empty() {
                format!("limit {} per {} s", ch.limit, ch.window_secs)
            } else {
                let each: Vec<String> = ch
                    .periods
                    .iter()
                    .map(|p| format!("{} per {} s", p.limit, p.period_ms as f64 / 1e3))
                    .collect();
                format!("token buckets of {}", each.join(" and "))
            };
            let _ = writeln!(
                t,
                "check        {limits}: {} allowed answers, {} actors checked, {} in violation",
                ch.allowed_hits, ch.actors_checked, ch.violations
            );
            for v in &ch.examples {
                let _ = match v {
                    Violation::TooMany {
                        actor,
                        allowed,
                        bound,
                        at_secs,
                    } => writeln!(
                        t,
                        "  actor {actor}: {allowed} allowed within {at_secs:.3} s of a window opening, at most {bound} possible"
                    ),
                    Violation::BucketOverrun {
                        actor,
                        allowed,
                        bound,
                        within_secs,
                        period_secs,
                    } => writeln!(
                        t,
                        "  actor {actor}: {allowed} takes accepted within {within_secs:.3} s, \
                         at most {bound} possible (the {period_secs} s limit)"
                    ),
                    Violation::CreditAboveLimit { actor, credit } => writeln!(
                        t,
                        "  actor {actor}: allowed with {credit} credit left, more than the limit leaves"
                    ),
                };
            }
        }
        t
    }

    /// Write the JSON form to `path`.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
    }
}
