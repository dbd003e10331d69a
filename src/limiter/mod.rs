//! The limiting algorithms, pure: `(state, quota, now_ms) -> (decision, new
//! state)`. No clock reads, no locks, no I/O, so they are tested exhaustively
//! against naive models and shared by every backend that keeps state itself
//! (memory store, cluster replicas).
//!
//! One file per algorithm besides the fixed window kept here:
//! [`token_bucket`] (exact continuous refill, shared with droplet's buckets),
//! [`sliding_window`] (the two-window estimate), and [`droplet_bucket`] (the
//! multi-period buckets of droplet's protocol, SPEC §7).

pub mod droplet_bucket;
pub mod sliding_window;
pub mod token_bucket;

pub use droplet_bucket::replicated::PeriodCell;
pub use sliding_window::sliding_window_hit;
pub use token_bucket::{token_bucket_hit, FullAt, Refill};

/// What one hit is told: the three numbers of an `OK` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// Credit left after this hit (0 when denied).
    pub credit: i64,
    /// Seconds until the window resets, rounded half up from milliseconds
    /// (`-1` for always-deny, `0` for always-allow).
    pub next_reset_seconds: i64,
}

impl Decision {
    /// `OK false 0 -1`: a rule with `creditLimit = 0`.
    pub const ALWAYS_DENY: Decision = Decision {
        allowed: false,
        credit: 0,
        next_reset_seconds: -1,
    };

    /// `OK true <limit> 0`: a rule with `resetSeconds = 0`.
    pub fn always_allow(credit_limit: u64) -> Decision {
        Decision {
            allowed: true,
            credit: clamp_i64(credit_limit),
            next_reset_seconds: 0,
        }
    }
}

pub(crate) fn clamp_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Milliseconds left to whole seconds, half up: `(ms + 500) / 1000` (SPEC §4).
pub fn round_ms_to_seconds(ms_left: u64) -> i64 {
    clamp_i64(ms_left.saturating_add(500) / 1000)
}

/// A counter's state as the store keeps it: one variant per rule algorithm.
/// A rule's counter identity includes its algorithm, so one key only ever
/// holds one variant. Serializable: the cluster replicates it as is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CounterState {
    /// Fixed window (divvy): the window closes at `end_ms`; `used` hits were
    /// admitted in it.
    Window { end_ms: u64, used: u64 },
    /// Token bucket: full again at `full_at` (see [`FullAt`]); absent means
    /// full.
    TokenBucket { full_at: FullAt },
    /// Sliding window: `current` hits admitted in the current window,
    /// `previous` in the one before. The current window starts two window
    /// lengths before `expires_at_ms`, when neither count weighs any more.
    SlidingWindow {
        expires_at_ms: u64,
        current: u64,
        previous: u64,
    },
    /// One period of a droplet bucket in cluster mode (a bucket is kept as
    /// one key per period, see [`droplet_bucket::replicated`]).
    DropletPeriod(PeriodCell),
}

impl CounterState {
    /// When the state is worth nothing any more and reads as absent.
    pub fn expires_at_ms(&self) -> u64 {
        match *self {
            CounterState::Window { end_ms, .. } => end_ms,
            CounterState::TokenBucket { full_at } => full_at.full_at_ms(),
            CounterState::SlidingWindow { expires_at_ms, .. } => expires_at_ms,
            CounterState::DropletPeriod(cell) => cell.forget_at_ms,
        }
    }

    /// Orders the variants, so that merging two different ones (which one key
    /// never holds) is still deterministic.
    fn variant_rank(&self) -> u8 {
        match self {
            CounterState::Window { .. } => 0,
            CounterState::TokenBucket { .. } => 1,
            CounterState::SlidingWindow { .. } => 2,
            CounterState::DropletPeriod(_) => 3,
        }
    }

    /// Merges a replicated copy into this one so that applying states in any
    /// order, any number of times, gives the same result (idempotent,
    /// commutative, associative):
    /// - fixed window: the later window wins; within one window the larger
    ///   count wins;
    /// - token bucket: the later full-again instant (the emptier bucket) wins;
    /// - sliding window: the later window wins; within one window each count
    ///   takes the larger value;
    /// - a droplet bucket's period: the later version wins, and of one
    ///   version the emptier ([`PeriodCell::merge`]).
    pub fn merge(self, other: CounterState) -> CounterState {
        match (self, other) {
            (
                CounterState::Window {
                    end_ms: a_end,
                    used: a_used,
                },
                CounterState::Window {
                    end_ms: b_end,
                    used: b_used,
                },
            ) => {
                if a_end != b_end {
                    if a_end > b_end {
                        self
                    } else {
                        other
                    }
                } else {
                    CounterState::Window {
                        end_ms: a_end,
                        used: a_used.max(b_used),
                    }
                }
            }
            (
                CounterState::TokenBucket { full_at: a },
                CounterState::TokenBucket { full_at: b },
            ) => CounterState::TokenBucket { full_at: a.max(b) },
            (
                CounterState::SlidingWindow {
                    expires_at_ms: a_end,
                    current: a_current,
                    previous: a_previous,
                },
                CounterState::SlidingWindow {
                    expires_at_ms: b_end,
                    current: b_current,
                    previous: b_previous,
                },
            ) => {
                if a_end != b_end {
                    if a_end > b_end {
                        self
                    } else {
                        other
                    }
                } else {
                    CounterState::SlidingWindow {
                        expires_at_ms: a_end,
                        current: a_current.max(b_current),
                        previous: a_previous.max(b_previous),
                    }
                }
            }
            (CounterState::DropletPeriod(a), CounterState::DropletPeriod(b)) => {
                CounterState::DropletPeriod(a.merge(b))
            }
            _ => {
                if self.variant_rank() >= other.variant_rank() {
                    self
                } else {
                    other
                }
            }
        }
    }
}

/// A limited quota: `credit_limit` hits per `period_ms`, both ≥ 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowQuota {
    credit_limit: u64,
    period_ms: u64,
}

impl WindowQuota {
    /// `None` when either is zero: those are the always-allow/deny cases,
    /// which never reach a counter.
    pub fn new(credit_limit: u64, reset_seconds: u64) -> Option<WindowQuota> {
        (credit_limit > 0 && reset_seconds > 0).then(|| WindowQuota {
            credit_limit,
            period_ms: reset_seconds.saturating_mul(1000),
        })
    }

    pub fn credit_limit(&self) -> u64 {
        self.credit_limit
    }

    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }
}

/// One fixed-window hit (SPEC §4). `state` is the stored state, `None` when
/// absent; an expired state is treated as absent here too. Returns the
/// decision and the state to store (`None`: leave the store unchanged).
pub fn fixed_window_hit(
    state: Option<CounterState>,
    quota: WindowQuota,
    now_ms: u64,
) -> (Decision, Option<CounterState>) {
    // Another algorithm's state never shares a key with a window; if it did,
    // it would read as absent.
    let live = match state {
        Some(CounterState::Window { end_ms, used }) if end_ms > now_ms => Some((end_ms, used)),
        _ => None,
    };
    match live {
        None => {
            let end_ms = now_ms.saturating_add(quota.period_ms);
            let decision = Decision {
                allowed: true,
                credit: clamp_i64(quota.credit_limit - 1),
                next_reset_seconds: round_ms_to_seconds(quota.period_ms),
            };
            (decision, Some(CounterState::Window { end_ms, used: 1 }))
        }
        Some((end_ms, used)) => {
            let next_reset_seconds = round_ms_to_seconds(end_ms - now_ms);
            if used < quota.credit_limit {
                let used = used + 1;
                let decision = Decision {
                    allowed: true,
                    credit: clamp_i64(quota.credit_limit - used),
                    next_reset_seconds,
                };
                (decision, Some(CounterState::Window { end_ms, used }))
            } else {
                let decision = Decision {
                    allowed: false,
                    credit: 0,
                    next_reset_seconds,
                };
                (decision, None)
            }
        }
    }
}

#[cfg(test)]
mod tests;

/// Helpers shared by the algorithms' tests.
#[cfg(test)]
pub(crate) mod test_support {
    use super::{CounterState, Decision, WindowQuota};

    /// One algorithm's pure hit function.
    pub type HitFn = fn(Option<CounterState>, WindowQuota, u64) -> (Decision, Option<CounterState>);

    /// One hit through `hit`, storing the new state as a store would.
    pub fn step(
        hit: HitFn,
        state: &mut Option<CounterState>,
        quota: WindowQuota,
        now_ms: u64,
    ) -> Decision {
        let (decision, new_state) = hit(*state, quota, now_ms);
        if new_state.is_some() {
            *state = new_state;
        }
        decision
    }

    pub fn ok(allowed: bool, credit: i64, next_reset_seconds: i64) -> Decision {
        Decision {
            allowed,
            credit,
            next_reset_seconds,
        }
    }
}
