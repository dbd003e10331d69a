//! The limiting algorithms, pure: `(state, quota, now_ms) -> (decision, new
//! state)`. No clock reads, no locks, no I/O, so they are tested exhaustively
//! against naive models and shared by every backend that keeps state itself
//! (memory store, cluster replicas).

// Serving code: input never panics the server (see docs/operations.md).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

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

fn clamp_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Milliseconds left to whole seconds, half up: `(ms + 500) / 1000` (SPEC §4).
pub fn round_ms_to_seconds(ms_left: u64) -> i64 {
    clamp_i64(ms_left.saturating_add(500) / 1000)
}

/// A counter's state as the store keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterState {
    /// Fixed window (divvy): the window closes at `end_ms`; `used` hits were
    /// admitted in it.
    Window { end_ms: u64, used: u64 },
}

impl CounterState {
    /// When the state is worth nothing any more and reads as absent.
    pub fn expires_at_ms(&self) -> u64 {
        match *self {
            CounterState::Window { end_ms, .. } => end_ms,
        }
    }

    /// Merges a replicated copy into this one so that applying states in any
    /// order, any number of times, gives the same result: the later window
    /// wins; within one window the larger count wins.
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
    let live = state.filter(|s| s.expires_at_ms() > now_ms);
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
        Some(CounterState::Window { end_ms, used }) => {
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
