//! Token buckets kept exactly, and the `token-bucket` rule algorithm.
//!
//! A bucket that refills `limit` tokens per `period_ms` continuously is
//! described by one instant: when it will be full again ([`FullAt`], the
//! "theoretical arrival time" of GCRA). Before that instant it lacks
//! `(full_at − now) × limit / period_ms` tokens; from then on it is full. The
//! instant is kept as an exact fraction (`ms + remainder / limit`), so refill
//! is exact to the millisecond with no rounding drift, and a balance can never
//! exceed the limit: it is capped by construction, not by a check.
//!
//! All arithmetic is on the *shortfall*: missing tokens × `period_ms`, an
//! integer. Taking one token adds `period_ms` to it; each millisecond removes
//! `limit` from it. Both the droplet buckets ([`super::droplet_bucket`]) and
//! divvy rules with `algorithm = token-bucket` ([`token_bucket_hit`]) use it.

use super::{clamp_i64, CounterState, Decision, WindowQuota};

/// A refill rate: `limit` tokens every `period_ms`, pro-rated per
/// millisecond. Both are at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refill {
    limit: u64,
    period_ms: u64,
}

impl Refill {
    /// `None` when either is zero (no refill: not a token bucket).
    pub fn new(limit: u64, period_ms: u64) -> Option<Refill> {
        (limit > 0 && period_ms > 0).then_some(Refill { limit, period_ms })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }

    /// The shortfall of an empty bucket: `limit × period_ms`.
    fn empty_shortfall(&self) -> i128 {
        i128::from(self.limit).saturating_mul(i128::from(self.period_ms))
    }

    /// The shortfall that `tokens` more (or, negative, fewer) tokens missing
    /// would add.
    fn shortfall_of_tokens(&self, tokens: i64) -> i128 {
        i128::from(tokens).saturating_mul(i128::from(self.period_ms))
    }

    /// Whole tokens in a bucket with this shortfall, rounded down:
    /// `limit − ⌈shortfall / period_ms⌉`. Negative when more than the limit is
    /// missing (droplet debits periods a request did not check).
    pub fn tokens(&self, shortfall: i128) -> i64 {
        let missing = div_ceil(shortfall.max(0), i128::from(self.period_ms));
        let tokens = i128::from(self.limit).saturating_sub(missing);
        i64::try_from(tokens).unwrap_or(if tokens < 0 { i64::MIN } else { i64::MAX })
    }

    /// Milliseconds until a bucket with this shortfall holds one more whole
    /// token than it does now (0 when it is full: no token will come).
    pub fn ms_until_next_token(&self, shortfall: i128) -> u64 {
        if shortfall <= 0 {
            return 0;
        }
        let period = i128::from(self.period_ms);
        // Shortfall once the next whole token is in: the next lower multiple
        // of the period (the current one excluded).
        let target = (div_ceil(shortfall, period) - 1).saturating_mul(period);
        let wait = div_ceil(shortfall - target, i128::from(self.limit));
        u64::try_from(wait).unwrap_or(u64::MAX)
    }
}

fn div_ceil(a: i128, b: i128) -> i128 {
    let q = a.div_euclid(b);
    if a.rem_euclid(b) == 0 {
        q
    } else {
        q + 1
    }
}

/// When a token bucket is full again, exactly: `ms + remainder / limit`
/// milliseconds since the epoch, with `remainder < limit` for the bucket's
/// [`Refill`]. [`FullAt::FULL`] (the epoch) is a bucket that is full now.
///
/// Ordered by time, so the later of two copies is the emptier one (what a
/// replicated merge keeps).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct FullAt {
    ms: u64,
    remainder: u64,
}

impl FullAt {
    /// A bucket that is already full.
    pub const FULL: FullAt = FullAt {
        ms: 0,
        remainder: 0,
    };

    /// The instant (ms) and the sub-millisecond remainder, for encoders that
    /// carry the state as it is (the cluster's peer stream).
    pub fn to_parts(self) -> (u64, u64) {
        (self.ms, self.remainder)
    }

    /// The inverse of [`FullAt::to_parts`].
    pub fn from_parts(ms: u64, remainder: u64) -> FullAt {
        FullAt { ms, remainder }
    }

    /// Missing tokens × `period_ms` at `now_ms`: 0 when full.
    pub fn shortfall(self, rate: Refill, now_ms: u64) -> i128 {
        if self.ms < now_ms {
            return 0; // remainder < limit: full before now
        }
        i128::from(self.ms - now_ms)
            .saturating_mul(i128::from(rate.limit))
            .saturating_add(i128::from(self.remainder))
    }

    /// The instant a bucket with this shortfall at `now_ms` is full again.
    /// A negative shortfall (more tokens than the limit) is capped: full now.
    pub fn from_shortfall(rate: Refill, now_ms: u64, shortfall: i128) -> FullAt {
        if shortfall <= 0 {
            return FullAt::FULL;
        }
        let limit = i128::from(rate.limit);
        let whole_ms = shortfall / limit;
        match u64::try_from(whole_ms)
            .ok()
            .and_then(|ms| now_ms.checked_add(ms))
        {
            Some(ms) => FullAt {
                ms,
                remainder: (shortfall % limit) as u64,
            },
            // Full again in more than 500 million years: never, in practice.
            None => FullAt {
                ms: u64::MAX,
                remainder: 0,
            },
        }
    }

    /// The first whole millisecond at which the bucket is full.
    pub fn full_at_ms(self) -> u64 {
        self.ms.saturating_add(u64::from(self.remainder > 0))
    }

    /// The same balance at `now_ms`, re-expressed for a new rate: the limit
    /// changed, the tokens in the bucket did not (droplet does not rescale
    /// balances). A balance above a lowered limit is capped at it.
    pub fn with_new_rate(self, old: Refill, new: Refill, now_ms: u64) -> FullAt {
        let shortfall = self.shortfall(old, now_ms);
        let tokens_delta = i128::from(new.limit) - i128::from(old.limit);
        let shortfall =
            shortfall.saturating_add(tokens_delta.saturating_mul(i128::from(new.period_ms)));
        FullAt::from_shortfall(new, now_ms, shortfall)
    }
}

/// The shortfall after taking `count` tokens (a negative count adds tokens),
/// capped so that the bucket is never above its limit.
pub fn shortfall_after_take(rate: Refill, shortfall: i128, count: i64) -> i128 {
    shortfall
        .saturating_add(rate.shortfall_of_tokens(count))
        .max(0)
}

/// Does a bucket with this shortfall hold no negative balance (every token it
/// was asked for was there)?
pub fn within_limit(rate: Refill, shortfall: i128) -> bool {
    shortfall <= rate.empty_shortfall()
}

/// Milliseconds to whole seconds, rounded up: waiting this long is enough.
fn ms_to_seconds_ceil(ms: u64) -> i64 {
    clamp_i64(ms.div_ceil(1000))
}

/// One hit of a rule with `algorithm = token-bucket`: the bucket holds up to
/// `creditLimit` tokens and refills `creditLimit` per `resetSeconds`
/// continuously; a hit takes one token when there is a whole one.
///
/// - `currentCredit`: whole tokens left after this hit (0 when denied).
/// - `nextResetSeconds`: seconds until the next whole token arrives, rounded
///   up, so that a denied client retrying after that long is admitted.
///
/// An absent (or expired) state is a full bucket; a denied hit changes
/// nothing.
pub fn token_bucket_hit(
    state: Option<CounterState>,
    quota: WindowQuota,
    now_ms: u64,
) -> (Decision, Option<CounterState>) {
    let Some(rate) = Refill::new(quota.credit_limit(), quota.period_ms()) else {
        return (Decision::ALWAYS_DENY, None);
    };
    let full_at = match state {
        Some(CounterState::TokenBucket { full_at }) => full_at,
        _ => FullAt::FULL,
    };
    let shortfall = full_at.shortfall(rate, now_ms);
    let after = shortfall_after_take(rate, shortfall, 1);
    if within_limit(rate, after) {
        let decision = Decision {
            allowed: true,
            credit: rate.tokens(after),
            next_reset_seconds: ms_to_seconds_ceil(rate.ms_until_next_token(after)),
        };
        let full_at = FullAt::from_shortfall(rate, now_ms, after);
        (decision, Some(CounterState::TokenBucket { full_at }))
    } else {
        let decision = Decision {
            allowed: false,
            credit: 0,
            next_reset_seconds: ms_to_seconds_ceil(rate.ms_until_next_token(shortfall)),
        };
        (decision, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use crate::limiter::test_support::ok;

    fn run(state: &mut Option<CounterState>, quota: WindowQuota, now_ms: u64) -> Decision {
        crate::limiter::test_support::step(token_bucket_hit, state, quota, now_ms)
    }

    #[test]
    fn burst_of_the_limit_then_one_token_per_interval() {
        // 3 tokens per 6 s: one token every 2 s.
        let quota = WindowQuota::new(3, 6).unwrap();
        let mut state = None;
        let t0 = 1_000_000;
        assert_eq!(run(&mut state, quota, t0), ok(true, 2, 2));
        assert_eq!(run(&mut state, quota, t0), ok(true, 1, 2));
        assert_eq!(run(&mut state, quota, t0), ok(true, 0, 2));
        assert_eq!(run(&mut state, quota, t0 + 500), ok(false, 0, 2));
        assert_eq!(run(&mut state, quota, t0 + 1_999), ok(false, 0, 1));
        // Exactly one token after 2 s.
        assert_eq!(run(&mut state, quota, t0 + 2_000), ok(true, 0, 2));
        assert_eq!(run(&mut state, quota, t0 + 2_001), ok(false, 0, 2));
        // Long idle: full again, never above the limit.
        assert_eq!(run(&mut state, quota, t0 + 100_000), ok(true, 2, 2));
    }

    #[test]
    fn state_expires_exactly_when_full() {
        let quota = WindowQuota::new(2, 1).unwrap(); // one token per 500 ms
        let (_, state) = token_bucket_hit(None, quota, 10_000);
        let state = state.unwrap();
        assert_eq!(state.expires_at_ms(), 10_500);
        let (_, state) = token_bucket_hit(Some(state), quota, 10_100);
        assert_eq!(state.unwrap().expires_at_ms(), 10_100 + 500 + 400);
    }

    #[test]
    fn fractional_refill_is_exact() {
        // 3 tokens per second: one every 333⅓ ms.
        let rate = Refill::new(3, 1000).unwrap();
        let empty = FullAt::from_shortfall(rate, 0, 3000);
        assert_eq!(
            empty,
            FullAt {
                ms: 1000,
                remainder: 0
            }
        );
        assert_eq!(rate.tokens(empty.shortfall(rate, 333)), 0);
        assert_eq!(rate.tokens(empty.shortfall(rate, 334)), 1);
        assert_eq!(rate.tokens(empty.shortfall(rate, 666)), 1);
        assert_eq!(rate.tokens(empty.shortfall(rate, 667)), 2);
        assert_eq!(rate.tokens(empty.shortfall(rate, 1000)), 3);
        assert_eq!(rate.ms_until_next_token(empty.shortfall(rate, 0)), 334);
        // One token taken at 100 ms from a full bucket.
        let one_taken = FullAt::from_shortfall(rate, 100, 1000);
        assert_eq!(
            one_taken,
            FullAt {
                ms: 433,
                remainder: 1
            }
        );
        assert_eq!(one_taken.full_at_ms(), 434);
    }

    #[test]
    fn absurd_quotas_never_panic() {
        let quota = WindowQuota::new(u64::MAX / 2, u64::MAX / 1000).unwrap();
        let mut state = None;
        for now in [0, 1, u64::MAX / 2, u64::MAX] {
            let d = run(&mut state, quota, now);
            assert!(d.credit >= 0);
        }
    }

    proptest! {
        /// Against a naive model that refills millisecond by millisecond with
        /// exact fractions: same decisions, and never above the limit.
        #[test]
        fn matches_a_millisecond_by_millisecond_model(
            limit in 1u64..20,
            period_s in 1u64..4,
            gaps in proptest::collection::vec(0u64..700, 1..60),
        ) {
            let quota = WindowQuota::new(limit, period_s).unwrap();
            let period_ms = period_s * 1000;
            // Naive: tokens × period_ms, refilled by `limit` each millisecond, capped.
            let mut naive = (limit * period_ms) as i128;
            let mut state = None;
            let mut now = 5_000u64;
            for gap in gaps {
                for _ in 0..gap {
                    naive = (naive + limit as i128).min((limit * period_ms) as i128);
                }
                now += gap;
                let decision = run(&mut state, quota, now);
                let naive_allowed = naive >= period_ms as i128;
                if naive_allowed {
                    naive -= period_ms as i128;
                }
                prop_assert_eq!(decision.allowed, naive_allowed);
                let naive_credit = if naive_allowed { (naive / period_ms as i128) as i64 } else { 0 };
                prop_assert_eq!(decision.credit, naive_credit);
                prop_assert!(decision.credit < limit as i64);
            }
        }
    }
}
