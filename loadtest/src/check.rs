//! The quota checker behind `--check`: from every allowed answer (actor, connection, order on the
//! connection, send and receive times, reported credit) it decides, soundly, whether the server let an
//! actor through more often than divvy's fixed windows permit.
//!
//! The model: an actor's window opens at the hit that finds no live window; that hit is allowed and
//! leaves `limit - 1` credits; the window lasts `window` seconds; at most `limit` hits are allowed in
//! it, reporting credits `limit - 1, ..., 0`; the next window opens at the first hit after it expired.
//! So the windows opened at or after a window opener `o` start no earlier than `o`, `o + window`,
//! `o + 2 window`, ... and by time `T` at most `limit * (floor((T - o) / window) + 1)` allowed hits
//! were decided at or after `o`.
//!
//! Two rules follow, each of which a correct server can never break:
//! 1. **Too many in a window.** We do not know when the server decided a hit, only that it was
//!    between our send and our receive, and that on one connection decisions follow send order. So
//!    for an opener (an allowed hit reporting credit `>= limit - 1`: a correct server reports
//!    `limit - 1` only on the hit that opened a window; hits before it may belong to a window opened
//!    before the run and are ignored), a hit counts only if it was surely decided after the opener:
//!    sent later on the same connection, or sent after the opener's answer arrived. Sorted by
//!    receive time, the k-th counted hit (the opener included) was decided by its receive time `r`,
//!    so `k <= limit * (floor((r - sent(opener)) / window) + 1)` must hold. The first few openers
//!    of each actor are tried and the worst excess is kept.
//! 2. **Credit above the limit.** An allowed hit never leaves more than `limit - 1` credits.
//!
//! A violation is thus proven, never guessed. Under heavy concurrency (many connections with deep
//! pipelines) fewer hits are provably ordered, so rule 1 sees less; it never sees too much. A small
//! slack is taken off the window for servers that round their clock to milliseconds.
//!
//! Token buckets (`take` and `droplet`, [`check_buckets`]): a bucket never holds more than `limit`
//! tokens of a period and earns `limit` per `period`, so over any interval of `t` it can admit at
//! most `limit + limit * t / period` tokens, whatever its history. A take was decided between its
//! send and its receive, so the takes sent at or after `a` and answered by `b` were all decided in
//! `[a, b]`; every such interval (with `a` a send time and `b` a receive time) is tried, in
//! O(n log n) per bucket with a segment tree, and the worst excess is kept. Rule 2 carries over: an
//! accepted take leaves at most `limit - count` tokens of the first period given.

use serde::Serialize;

use crate::workload::actor_name;

/// One allowed answer, as recorded by a connection.
#[derive(Clone, Copy, Debug)]
pub struct AllowedHit {
    pub actor: u32,
    /// Global connection index.
    pub conn: u32,
    /// Position of the request on its connection (reconnects continue the count).
    pub seq: u64,
    /// When the request was written, in ns since the run's base instant.
    pub sent_ns: u64,
    /// When its answer was read, in ns since the run's base instant.
    pub recv_ns: u64,
    /// The credit the server reported.
    pub credit: i64,
}

/// One actor's proven violation.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Violation {
    /// Rule 1: more allowed hits after a window opener than its windows permit.
    TooMany {
        actor: String,
        /// Allowed hits surely decided at or after the opener, by `at_secs`.
        allowed: u64,
        /// The most a correct server could have allowed by then.
        bound: u64,
        /// Seconds from the opener's send to the receive time of the hit that broke the bound.
        at_secs: f64,
    },
    /// Rule 2: an allowed hit reported more credit than the limit leaves.
    CreditAboveLimit { actor: String, credit: i64 },
    /// Token buckets: more tokens admitted within `within_secs` than the bucket can hold and earn.
    BucketOverrun {
        actor: String,
        /// Accepted takes surely decided within the interval.
        allowed: u64,
        /// The most a correct server could have accepted in it.
        bound: u64,
        /// The interval's length (first send to last receive), in seconds.
        within_secs: f64,
        /// The period (in seconds) whose bound was exceeded.
        period_secs: f64,
    },
}

impl Violation {
    /// How bad it is, for ordering the examples (rule 1 first, by excess).
    fn severity(&self) -> u64 {
        match self {
            Violation::TooMany { allowed, bound, .. }
            | Violation::BucketOverrun { allowed, bound, .. } => {
                (allowed - bound).saturating_add(1 << 32)
            }
            Violation::CreditAboveLimit { .. } => 0,
        }
    }
}

/// One limit of a token bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PeriodLimit {
    pub limit: u64,
    pub period_ms: u64,
}

/// The checker's result.
#[derive(Clone, Debug, Serialize)]
pub struct CheckOutcome {
    /// `fixed-window` (divvy, resp-script) or `token-bucket` (take, droplet).
    pub model: &'static str,
    /// Fixed windows: the limit per window. Token buckets: the first period's limit.
    pub limit: i64,
    /// Fixed windows: the window. Token buckets: the first period, in seconds.
    pub window_secs: f64,
    /// Token buckets: every limit checked (empty for fixed windows).
    pub periods: Vec<PeriodLimit>,
    /// Allowed answers examined.
    pub allowed_hits: u64,
    /// Actors for which a window opener was seen (so rule 1 could be applied).
    pub actors_checked: u64,
    /// Actors with a proven violation.
    pub violations: u64,
    /// Up to ten of them, the worst first.
    pub examples: Vec<Violation>,
}

/// Slack taken off the window, in ns: servers count time in whole milliseconds.
const WINDOW_SLACK_NS: u64 = 10_000_000;
/// Openers tried per actor.
const OPENERS_MAX: usize = 8;

/// Check all allowed hits against `limit` per `window_secs`. `prefix` only names actors.
pub fn check(
    mut hits: Vec<AllowedHit>,
    limit: i64,
    window_secs: f64,
    prefix: &str,
) -> CheckOutcome {
    let window_ns = (window_secs * 1e9) as u64;
    let window_ns = window_ns
        .saturating_sub(WINDOW_SLACK_NS.min(window_ns / 2))
        .max(1);
    let limit_u = limit.max(0) as u64;
    let allowed_hits = hits.len() as u64;
    hits.sort_unstable_by_key(|h| (h.actor, h.sent_ns, h.conn, h.seq));
    let mut actors_checked = 0;
    let mut found: Vec<Violation> = Vec::new();
    let mut counted: Vec<u64> = Vec::new();
    for group in hits.chunk_by(|a, b| a.actor == b.actor) {
        let name = || actor_name(prefix, u64::from(group[0].actor));
        // Rule 1, from each of the earliest-sent openers.
        let mut worst: Option<(u64, u64, u64)> = None; // (allowed, bound, at_ns)
        let openers = group.iter().filter(|h| h.credit >= limit - 1);
        for (i, opener) in openers.take(OPENERS_MAX).enumerate() {
            if i == 0 {
                actors_checked += 1;
            }
            counted.clear();
            counted.extend(
                group
                    .iter()
                    .filter(|h| {
                        (h.conn == opener.conn && h.seq > opener.seq) || h.sent_ns >= opener.recv_ns
                    })
                    .map(|h| h.recv_ns),
            );
            counted.push(opener.recv_ns);
            counted.sort_unstable();
            for (k, &recv) in counted.iter().enumerate() {
                let k = k as u64 + 1;
                let at = recv.saturating_sub(opener.sent_ns);
                let bound = limit_u.saturating_mul(at / window_ns + 1);
                if k > bound && worst.is_none_or_less(k - bound) {
                    worst = Some((k, bound, at));
                }
            }
        }
        if let Some((allowed, bound, at)) = worst {
            found.push(Violation::TooMany {
                actor: name(),
                allowed,
                bound,
                at_secs: at as f64 / 1e9,
            });
        } else if let Some(h) = group.iter().find(|h| h.credit > limit - 1) {
            // Rule 2.
            found.push(Violation::CreditAboveLimit {
                actor: name(),
                credit: h.credit,
            });
        }
    }
    let violations = found.len() as u64;
    found.sort_by_key(|v| std::cmp::Reverse(v.severity()));
    found.truncate(10);
    CheckOutcome {
        model: "fixed-window",
        limit,
        window_secs,
        periods: Vec::new(),
        allowed_hits,
        actors_checked,
        violations,
        examples: found,
    }
}

/// Slack added to every interval for token buckets, in ns: the server counts time in whole
/// milliseconds, so it may see an interval up to a millisecond longer than it was.
const BUCKET_SLACK_NS: u64 = 10_000_000;

/// Check every accepted take against the token-bucket bound of each of `periods`, each take taking
/// `count` tokens. `prefix` only names actors.
pub fn check_buckets(
    mut hits: Vec<AllowedHit>,
    periods: &[PeriodLimit],
    count: u64,
    prefix: &str,
) -> CheckOutcome {
    let allowed_hits = hits.len() as u64;
    hits.sort_unstable_by_key(|h| (h.actor, h.sent_ns));
    let first = periods.first().copied().unwrap_or(PeriodLimit {
        limit: 0,
        period_ms: 1,
    });
    let mut actors_checked = 0;
    let mut found: Vec<Violation> = Vec::new();
    let mut tree = MaxTree::default();
    for group in hits.chunk_by(|a, b| a.actor == b.actor) {
        actors_checked += 1;
        let name = || actor_name(prefix, u64::from(group[0].actor));
        let worst = periods
            .iter()
            .filter_map(|p| worst_interval(group, *p, count, &mut tree).map(|w| (w, p.period_ms)))
            .max_by_key(|((allowed, bound, _), _)| allowed - bound);
        if let Some(((allowed, bound, within_ns), period_ms)) = worst {
            found.push(Violation::BucketOverrun {
                actor: name(),
                allowed,
                bound,
                within_secs: within_ns as f64 / 1e9,
                period_secs: period_ms as f64 / 1e3,
            });
        } else if let Some(h) = group
            .iter()
            .find(|h| h.credit > first.limit as i64 - count as i64)
        {
            found.push(Violation::CreditAboveLimit {
                actor: name(),
                credit: h.credit,
            });
        }
    }
    let violations = found.len() as u64;
    found.sort_by_key(|v| std::cmp::Reverse(v.severity()));
    found.truncate(10);
    CheckOutcome {
        model: "token-bucket",
        limit: first.limit as i64,
        window_secs: first.period_ms as f64 / 1e3,
        periods: periods.to_vec(),
        allowed_hits,
        actors_checked,
        violations,
        examples: found,
    }
}

/// The worst interval of one bucket's accepted takes (`hits` sorted by send time) against one
/// period: `(takes, bound, interval ns)` when the takes exceed the bound, else `None`.
///
/// In units of 1/period_ns tokens, `n` takes in `[a, b]` break the bound when
/// `n * count * P > L * P + L * (b - a + slack)`, that is when
/// `n * count * P + L * a > L * (P + b + slack)`. Visiting receive times `b` in order, position `k`
/// of the tree (send times sorted, `a = sent_k`) holds `L * a` plus `count * P` for each take
/// answered so far and sent at or after `a`; the left side's best value is the tree's maximum over
/// the positions with `a <= b`.
fn worst_interval(
    hits: &[AllowedHit],
    period: PeriodLimit,
    count: u64,
    tree: &mut MaxTree,
) -> Option<(u64, u64, u64)> {
    let p = i128::from(period.period_ms) * 1_000_000;
    let l = i128::from(period.limit);
    let c = i128::from(count.max(1));
    let sends: Vec<u64> = hits.iter().map(|h| h.sent_ns).collect(); // sorted
    tree.reset(sends.iter().map(|&a| l * i128::from(a)));
    let mut by_recv: Vec<&AllowedHit> = hits.iter().collect();
    by_recv.sort_unstable_by_key(|h| h.recv_ns);
    let mut worst: Option<(i128, u64, u64)> = None; // (excess scaled, a, b)
    for h in by_recv {
        // Positions whose start is at or before this send time gain this take.
        let upto = sends.partition_point(|&a| a <= h.sent_ns);
        tree.add(0, upto, c * p);
        let b = h.recv_ns;
        let open = sends.partition_point(|&a| a <= b);
        let (best, k) = tree.max(0, open);
        let excess = best - l * (p + i128::from(b) + i128::from(BUCKET_SLACK_NS));
        if excess > 0 && worst.is_none_or_less_scaled(excess) {
            worst = Some((excess, sends[k], b));
        }
    }
    let (_, a, b) = worst?;
    // Recount the takes surely decided in [a, b] and the bound, in whole takes.
    let allowed = hits
        .iter()
        .filter(|h| h.sent_ns >= a && h.recv_ns <= b)
        .count() as u64;
    let t = i128::from(b - a) + i128::from(BUCKET_SLACK_NS);
    let bound_tokens = (l * p + l * t) / p;
    let bound = u64::try_from(bound_tokens / c).unwrap_or(u64::MAX);
    Some((allowed, bound, b - a))
}

/// A segment tree over positions `0..n` with range add and range maximum (with its position).
#[derive(Default)]
struct MaxTree {
    n: usize,
    max: Vec<i128>,
    arg: Vec<usize>,
    lazy: Vec<i128>,
}

impl MaxTree {
    fn reset(&mut self, values: impl ExactSizeIterator<Item = i128>) {
        self.n = values.len().max(1);
        let size = 4 * self.n;
        self.max.clear();
        self.max.resize(size, i128::MIN);
        self.arg.clear();
        self.arg.resize(size, 0);
        self.lazy.clear();
        self.lazy.resize(size, 0);
        let values: Vec<i128> = values.collect();
        if !values.is_empty() {
            self.build(1, 0, self.n, &values);
        }
    }

    fn build(&mut self, node: usize, lo: usize, hi: usize, values: &[i128]) {
        if hi - lo == 1 {
            self.max[node] = values[lo];
            self.arg[node] = lo;
            return;
        }
        let mid = (lo + hi) / 2;
        self.build(2 * node, lo, mid, values);
        self.build(2 * node + 1, mid, hi, values);
        self.pull(node);
    }

    fn pull(&mut self, node: usize) {
        let (l, r) = (2 * node, 2 * node + 1);
        let (m, a) = if self.max[l] >= self.max[r] {
            (self.max[l], self.arg[l])
        } else {
            (self.max[r], self.arg[r])
        };
        self.max[node] = m + self.lazy[node];
        self.arg[node] = a;
    }

    /// Add `v` to positions `from..to`.
    fn add(&mut self, from: usize, to: usize, v: i128) {
        if from < to {
            self.add_in(1, 0, self.n, from, to, v);
        }
    }

    fn add_in(&mut self, node: usize, lo: usize, hi: usize, from: usize, to: usize, v: i128) {
        if to <= lo || hi <= from {
            return;
        }
        if from <= lo && hi <= to {
            self.max[node] += v;
            self.lazy[node] += v;
            return;
        }
        let mid = (lo + hi) / 2;
        self.add_in(2 * node, lo, mid, from, to, v);
        self.add_in(2 * node + 1, mid, hi, from, to, v);
        self.pull(node);
    }

    /// The maximum over `from..to` (non-empty) and its position.
    fn max(&self, from: usize, to: usize) -> (i128, usize) {
        if from >= to {
            return (i128::MIN / 4, 0);
        }
        self.max_in(1, 0, self.n, from, to)
    }

    fn max_in(&self, node: usize, lo: usize, hi: usize, from: usize, to: usize) -> (i128, usize) {
        if from <= lo && hi <= to {
            return (self.max[node], self.arg[node]);
        }
        let mid = (lo + hi) / 2;
        let mut best = (i128::MIN / 4, 0);
        if from < mid {
            best = self.max_in(2 * node, lo, mid, from, to);
        }
        if to > mid {
            let r = self.max_in(2 * node + 1, mid, hi, from, to);
            if r.0 > best.0 {
                best = r;
            }
        }
        (best.0 + self.lazy[node], best.1)
    }
}

trait ScaledExt {
    fn is_none_or_less_scaled(&self, excess: i128) -> bool;
}

impl ScaledExt for Option<(i128, u64, u64)> {
    /// No violation yet, or a smaller scaled excess than `excess`.
    fn is_none_or_less_scaled(&self, excess: i128) -> bool {
        match self {
            None => true,
            Some((e, _, _)) => *e < excess,
        }
    }
}

trait WorstExt {
    fn is_none_or_less(&self, excess: u64) -> bool;
}

impl WorstExt for Option<(u64, u64, u64)> {
    /// No violation yet, or a smaller excess than `excess`.
    fn is_none_or_less(&self, excess: u64) -> bool {
        match self {
            None => true,
            Some((allowed, bound, _)) => allowed - bound < excess,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    /// A hit decided at `t` (sent 1 ms before, answered 1 ms after) on connection `conn`.
    fn hit(actor: u32, conn: u32, seq: u64, t: u64, credit: i64) -> AllowedHit {
        AllowedHit {
            actor,
            conn,
            seq,
            sent_ns: t - MS,
            recv_ns: t + MS,
            credit,
        }
    }

    /// Simulate a correct fixed-window server for one actor at the given hit times.
    fn correct(times: &[u64], limit: i64, window: u64, conns: u32) -> Vec<AllowedHit> {
        let mut out = Vec::new();
        let mut open: Option<(u64, i64)> = None;
        for (i, &t) in times.iter().enumerate() {
            match open {
                Some((o, c)) if t < o + window => {
                    if c > 0 {
                        open = Some((o, c - 1));
                        out.push(hit(0, i as u32 % conns, i as u64, t, c - 1));
                    }
                }
                _ => {
                    open = Some((t, limit - 1));
                    out.push(hit(0, i as u32 % conns, i as u64, t, limit - 1));
                }
            }
        }
        out
    }

    #[test]
    fn a_correct_server_passes_across_window_boundaries() {
        // Hits every 100 ms for 10 s, window 1 s, limit 3: plenty of back-to-back windows.
        let times: Vec<u64> = (1..100).map(|i| i * 100 * MS).collect();
        for conns in [1, 4] {
            let hits = correct(&times, 3, S, conns);
            let out = check(hits, 3, 1.0, "a");
            assert_eq!(out.actors_checked, 1);
            assert_eq!(out.violations, 0, "{out:?}");
        }
    }

    #[test]
    fn over_admission_is_found() {
        // Limit 5 claimed, but 8 allowed inside one window.
        let hits: Vec<AllowedHit> = (0..8)
            .map(|i| hit(0, 0, i, (10 + i) * MS * 10, 7 - i as i64))
            .collect();
        let out = check(hits, 5, 10.0, "a");
        assert_eq!(out.violations, 1);
        match &out.examples[0] {
            Violation::TooMany { allowed, bound, .. } => assert_eq!((*allowed, *bound), (8, 5)),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn pipelined_hits_on_one_connection_count_in_order() {
        // All sent at once on one connection, all answered together: order is known anyway.
        let hits: Vec<AllowedHit> = (0..4)
            .map(|i| AllowedHit {
                actor: 3,
                conn: 1,
                seq: i,
                sent_ns: MS,
                recv_ns: 2 * MS,
                credit: 1 - i as i64,
            })
            .collect();
        let out = check(hits, 2, 60.0, "a");
        assert_eq!(out.violations, 1);
        assert!(matches!(&out.examples[0], Violation::TooMany { actor, .. } if actor == "a3"));
    }

    #[test]
    fn concurrent_hits_of_unknown_order_are_not_blamed() {
        // Two connections, overlapping in time: nothing proves the second set came after the opener.
        let mut hits = vec![hit(0, 0, 0, 10 * MS, 1)];
        hits.push(AllowedHit {
            actor: 0,
            conn: 1,
            seq: 0,
            sent_ns: 5 * MS,
            recv_ns: 20 * MS,
            credit: 0,
        });
        assert_eq!(check(hits, 2, 60.0, "a").violations, 0);
    }

    #[test]
    fn hits_before_the_first_opener_are_ignored() {
        // A window opened before the run: credits 1, 0; then a fresh window opens 1 s later.
        let mut hits = vec![hit(0, 0, 0, 100 * MS, 1), hit(0, 0, 1, 200 * MS, 0)];
        hits.extend((0..3).map(|i| hit(0, 0, 2 + i, S + i * MS * 10 + 10 * MS, 2 - i as i64)));
        let out = check(hits, 3, 1.0, "a");
        assert_eq!(out.actors_checked, 1);
        assert_eq!(out.violations, 0);
    }

    #[test]
    fn credit_above_the_limit_is_a_violation_even_when_order_is_unknown() {
        // Six connections, all overlapping: rule 1 proves nothing, but credit 5 > limit 5 - 1.
        let hits: Vec<AllowedHit> = (0..6)
            .map(|i| AllowedHit {
                actor: 0,
                conn: i,
                seq: 0,
                sent_ns: MS,
                recv_ns: 9 * MS,
                credit: 5 - i64::from(i),
            })
            .collect();
        let out = check(hits, 5, 60.0, "a");
        assert_eq!(out.violations, 1);
        assert!(matches!(
            out.examples[0],
            Violation::CreditAboveLimit { credit: 5, .. }
        ));
    }

    #[test]
    fn limit_zero_means_any_allowed_hit_is_a_violation() {
        let out = check(vec![hit(0, 0, 0, 10 * MS, 5)], 0, 1.0, "a");
        assert_eq!(out.violations, 1);
    }

    /// Simulate a correct token bucket (exact arithmetic) for one actor: takes of `count` at the
    /// given decision times, each on connection i % conns, sent 1 ms before and answered 1 ms after.
    fn correct_bucket(
        times: &[u64],
        limit: u64,
        period: u64,
        count: u64,
        conns: u32,
    ) -> Vec<AllowedHit> {
        let mut out = Vec::new();
        // Tokens scaled by `period` so refill is exact.
        let cap = (limit * period) as i128;
        let mut tokens = cap;
        let mut last = 0u64;
        for (i, &t) in times.iter().enumerate() {
            tokens = (tokens + (t - last) as i128 * limit as i128).min(cap);
            last = t;
            let need = (count * period) as i128;
            if tokens >= need {
                tokens -= need;
                out.push(hit(
                    0,
                    i as u32 % conns,
                    i as u64,
                    t,
                    (tokens / period as i128) as i64,
                ));
            }
        }
        out
    }

    fn second(limit: u64) -> PeriodLimit {
        PeriodLimit {
            limit,
            period_ms: 1_000,
        }
    }

    #[test]
    fn a_correct_token_bucket_passes_with_refill() {
        // A take every 20 ms for 10 s against 10 per second: the burst, then 10 a second.
        let times: Vec<u64> = (1..500).map(|i| i * 20 * MS).collect();
        for (count, conns) in [(1, 1), (1, 4), (3, 2)] {
            let hits = correct_bucket(&times, 10, S, count, conns);
            assert!(hits.len() as u64 * count >= 100, "{}", hits.len());
            let out = check_buckets(hits, &[second(10)], count, "a");
            assert_eq!(out.model, "token-bucket");
            assert_eq!(out.actors_checked, 1);
            assert_eq!(out.violations, 0, "count {count}: {out:?}");
        }
    }

    #[test]
    fn a_bucket_admitting_too_much_is_caught_with_the_worst_interval() {
        // 10 per second claimed; 15 admitted within 100 ms, then a correct rhythm.
        let mut hits: Vec<AllowedHit> = (0..15)
            .map(|i| hit(0, 0, i, (10 + i * 6) * MS, 0))
            .collect();
        hits.extend((0..20).map(|i| hit(0, 0, 100 + i, 2 * S + i * 100 * MS, 0)));
        let out = check_buckets(hits, &[second(10)], 1, "a");
        assert_eq!(out.violations, 1, "{out:?}");
        match &out.examples[0] {
            Violation::BucketOverrun {
                allowed,
                bound,
                within_secs,
                period_secs,
                ..
            } => {
                assert_eq!((*allowed, *bound), (15, 10));
                assert!(*within_secs < 0.1, "{within_secs}");
                assert_eq!(*period_secs, 1.0);
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn every_period_is_checked() {
        // 30 takes over 3 s: fine for 10 per second, too many for 20 per minute.
        let times: Vec<u64> = (0..30).map(|i| (i * 100 + 50) * MS).collect();
        let hits: Vec<AllowedHit> = times
            .iter()
            .enumerate()
            .map(|(i, &t)| hit(4, 0, i as u64, t, 0))
            .collect();
        let minute = PeriodLimit {
            limit: 20,
            period_ms: 60_000,
        };
        let out = check_buckets(hits.clone(), &[second(10)], 1, "a");
        assert_eq!(out.violations, 0, "{out:?}");
        let out = check_buckets(hits, &[second(10), minute], 1, "a");
        assert_eq!(out.violations, 1, "{out:?}");
        assert!(matches!(
            &out.examples[0],
            Violation::BucketOverrun { actor, allowed: 30, bound: 20, .. } if actor == "a4"
        ));
    }

    #[test]
    fn overlapping_takes_of_unknown_order_are_not_blamed() {
        // 12 takes all in flight over the same 2 s, limit 10 per second: a correct bucket could
        // have decided them a second apart (10 + 10 * 2 = 30 possible).
        let hits: Vec<AllowedHit> = (0..12)
            .map(|i| AllowedHit {
                actor: 0,
                conn: i,
                seq: 0,
                sent_ns: MS,
                recv_ns: 2 * S,
                credit: 0,
            })
            .collect();
        assert_eq!(check_buckets(hits, &[second(10)], 1, "a").violations, 0);
    }

    #[test]
    fn a_bucket_balance_above_what_the_take_leaves_is_a_violation() {
        let out = check_buckets(vec![hit(0, 0, 0, 10 * MS, 10)], &[second(10)], 1, "a");
        assert_eq!(out.violations, 1);
        assert!(matches!(
            out.examples[0],
            Violation::CreditAboveLimit { credit: 10, .. }
        ));
        let out = check_buckets(vec![hit(0, 0, 0, 10 * MS, 9)], &[second(10)], 1, "a");
        assert_eq!(out.violations, 0);
    }
}
