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
}

impl Violation {
    /// How bad it is, for ordering the examples (rule 1 first, by excess).
    fn severity(&self) -> u64 {
        match self {
            Violation::TooMany { allowed, bound, .. } => (allowed - bound).saturating_add(1 << 32),
            Violation::CreditAboveLimit { .. } => 0,
        }
    }
}

/// The checker's result.
#[derive(Clone, Debug, Serialize)]
pub struct CheckOutcome {
    pub limit: i64,
    pub window_secs: f64,
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
        limit,
        window_secs,
        allowed_hits,
        actors_checked,
        violations,
        examples: found,
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
}
