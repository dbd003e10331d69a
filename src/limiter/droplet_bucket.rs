//! droplet's token-bucket model (SPEC §7), pure: named buckets with up to six
//! per-period limits (second, minute, hour, day, week, month), each refilling
//! `limit` tokens per period continuously, exact to the millisecond. Time
//! comes in as `now_ms`; the store keeps a [`BucketState`] per bucket name.
//!
//! The rules, in the order a take applies them:
//! 1. `reset` forgets the bucket's state first.
//! 2. Each limit given sets that period's limit; a period seen for the first
//!    time starts full. A changed limit keeps the tokens already there (no
//!    rescaling) but never lets them exceed the new limit.
//! 3. The take is accepted only if every period *given* holds `count` tokens.
//! 4. If accepted, `count` is taken from *every* configured period, given or
//!    not (those may go negative); a negative count adds tokens, up to the
//!    limit.
//! 5. The answer reports, for each period given, the balance after the debit
//!    (rounded down), even when rejected: a rejected take of 1 from an empty
//!    period reports `-1`.
//!
//! A balance never exceeds its limit: this is droplet's documented contract,
//! which droplet itself broke by capping only when more than 100 tokens had
//! accrued (SPEC §9). Buckets whose every period is full are forgotten at the
//! next tick of the cleanup interval (droplet's periodic sweep); the state
//! carries that instant so the store can treat it as expired.

use super::token_bucket::{shortfall_after_take, within_limit, FullAt, Refill};

/// The periods a bucket can limit, in droplet's field order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    Second,
    Minute,
    Hour,
    Day,
    /// 7 days.
    Week,
    /// 30 days.
    Month,
}

/// How many periods a bucket has.
pub const PERIOD_COUNT: usize = 6;

impl Period {
    pub const ALL: [Period; PERIOD_COUNT] = [
        Period::Second,
        Period::Minute,
        Period::Hour,
        Period::Day,
        Period::Week,
        Period::Month,
    ];

    pub fn period_ms(self) -> u64 {
        const SECOND_MS: u64 = 1_000;
        const DAY_MS: u64 = 86_400 * SECOND_MS;
        match self {
            Period::Second => SECOND_MS,
            Period::Minute => 60 * SECOND_MS,
            Period::Hour => 3_600 * SECOND_MS,
            Period::Day => DAY_MS,
            Period::Week => 7 * DAY_MS,
            Period::Month => 30 * DAY_MS,
        }
    }

    /// The request and response field naming this period's limit and balance.
    pub fn field(self) -> &'static str {
        match self {
            Period::Second => "ls",
            Period::Minute => "lm",
            Period::Hour => "lh",
            Period::Day => "ld",
            Period::Week => "lw",
            Period::Month => "lo",
        }
    }

    pub fn from_field(field: &str) -> Option<Period> {
        Period::ALL.into_iter().find(|p| p.field() == field)
    }

    pub fn index(self) -> usize {
        self as usize
    }

    fn refill(self, limit: u32) -> Option<Refill> {
        Refill::new(u64::from(limit), self.period_ms())
    }
}

/// One take (or read, with `count = 0`) from a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakeRequest {
    /// Tokens to take; 0 reads, negative adds.
    pub count: i32,
    /// Forget the bucket's state first.
    pub reset: bool,
    /// Limit per period, indexed by [`Period::index`]; 0 is "not given".
    pub limits: [u32; PERIOD_COUNT],
}

impl Default for TakeRequest {
    fn default() -> Self {
        TakeRequest {
            count: 1,
            reset: false,
            limits: [0; PERIOD_COUNT],
        }
    }
}

/// Whole-token balances per period, indexed by [`Period::index`]; `None` for
/// the periods not reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Balances(pub [Option<i32>; PERIOD_COUNT]);

impl Balances {
    pub fn get(&self, period: Period) -> Option<i32> {
        self.0[period.index()]
    }

    /// The reported periods with their balances, in droplet's field order.
    pub fn iter(&self) -> impl Iterator<Item = (Period, i32)> + '_ {
        Period::ALL
            .into_iter()
            .filter_map(|p| self.get(p).map(|balance| (p, balance)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakeOutcome {
    pub accept: bool,
    /// The balance after this take for each period the request gave.
    pub balances: Balances,
}

/// One period of a bucket: its limit (0: not configured) and when it is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct PeriodState {
    limit: u32,
    full_at: FullAt,
}

/// A bucket as the store keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketState {
    periods: [PeriodState; PERIOD_COUNT],
    /// The cleanup tick at which this bucket is forgotten: the first one after
    /// its last update at which every period is full.
    forget_at_ms: u64,
}

impl BucketState {
    /// When the bucket is forgotten and reads as absent.
    pub fn forget_at_ms(&self) -> u64 {
        self.forget_at_ms
    }

    /// The configured limit per period (0: not configured).
    pub fn limits(&self) -> [u32; PERIOD_COUNT] {
        self.periods.map(|p| p.limit)
    }

    /// Each configured period's rate and state.
    fn configured(&self) -> impl Iterator<Item = (Period, Refill, FullAt)> + '_ {
        Period::ALL.into_iter().filter_map(|period| {
            let state = self.periods[period.index()];
            period
                .refill(state.limit)
                .map(|rate| (period, rate, state.full_at))
        })
    }
}

fn clamp_i32(n: i64) -> i32 {
    i32::try_from(n).unwrap_or(if n < 0 { i32::MIN } else { i32::MAX })
}

/// The first cleanup tick (a multiple of `cleanup_interval_ms`) after `now_ms`
/// at which every period is full; never with a zero interval.
fn forget_at_ms(
    periods: &[PeriodState; PERIOD_COUNT],
    now_ms: u64,
    cleanup_interval_ms: u64,
) -> u64 {
    if cleanup_interval_ms == 0 {
        return u64::MAX;
    }
    let full_ms = periods
        .iter()
        .filter(|p| p.limit > 0)
        .map(|p| p.full_at.full_at_ms())
        .max()
        .unwrap_or(0)
        .max(now_ms.saturating_add(1));
    full_ms
        .div_ceil(cleanup_interval_ms)
        .saturating_mul(cleanup_interval_ms)
}

/// A take (SPEC §7). `state` is the bucket's live state (`None`: absent or
/// forgotten). Returns the answer and the state to store: a take always
/// leaves a bucket behind, with the limits it set.
pub fn take(
    state: Option<BucketState>,
    request: &TakeRequest,
    now_ms: u64,
    cleanup_interval_ms: u64,
) -> (TakeOutcome, BucketState) {
    let mut periods = match state {
        Some(state) if !request.reset => state.periods,
        _ => [PeriodState::default(); PERIOD_COUNT],
    };

    // Set the limits given: a new period starts full; a changed limit keeps
    // the tokens, capped at the new limit.
    for period in Period::ALL {
        let slot = &mut periods[period.index()];
        let Some(new_rate) = period.refill(request.limits[period.index()]) else {
            continue;
        };
        slot.full_at = match period.refill(slot.limit) {
            None => FullAt::FULL,
            Some(old_rate) if old_rate != new_rate => {
                slot.full_at.with_new_rate(old_rate, new_rate, now_ms)
            }
            Some(_) => slot.full_at,
        };
        slot.limit = request.limits[period.index()];
    }

    // Check the periods given, reporting each one's balance after the debit.
    let count = i64::from(request.count);
    let mut accept = true;
    let mut balances = Balances::default();
    for period in Period::ALL {
        if request.limits[period.index()] == 0 {
            continue;
        }
        let slot = periods[period.index()];
        let Some(rate) = period.refill(slot.limit) else {
            continue;
        };
        let after = shortfall_after_take(rate, slot.full_at.shortfall(rate, now_ms), count);
        accept &= within_limit(rate, after);
        balances.0[period.index()] = Some(clamp_i32(rate.tokens(after)));
    }

    // Debit every configured period.
    if accept {
        for period in Period::ALL {
            let slot = &mut periods[period.index()];
            let Some(rate) = period.refill(slot.limit) else {
                continue;
            };
            let after = shortfall_after_take(rate, slot.full_at.shortfall(rate, now_ms), count);
            slot.full_at = FullAt::from_shortfall(rate, now_ms, after);
        }
    }

    let state = BucketState {
        periods,
        forget_at_ms: forget_at_ms(&periods, now_ms, cleanup_interval_ms),
    };
    (TakeOutcome { accept, balances }, state)
}

/// A query: every configured period's balance, changing nothing. `None` when
/// the bucket does not exist (a query never creates one).
pub fn query(state: Option<&BucketState>, now_ms: u64) -> Option<Balances> {
    let state = state?;
    let mut balances = Balances::default();
    for (period, rate, full_at) in state.configured() {
        balances.0[period.index()] = Some(clamp_i32(rate.tokens(full_at.shortfall(rate, now_ms))));
    }
    Some(balances)
}

pub mod replicated;

#[cfg(test)]
mod tests;
