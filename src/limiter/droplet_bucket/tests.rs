//! The droplet model against SPEC §7's worked examples, and a property test
//! against a naive model that refills millisecond by millisecond.

use super::*;
use proptest::prelude::*;

/// A realistic time that is a multiple of the cleanup interval.
const T0: u64 = 1_700_000_040_000;
const CLEANUP_MS: u64 = 60_000;

/// One bucket as the store would keep it: forgotten state reads as absent.
#[derive(Default)]
struct Bucket {
    state: Option<BucketState>,
}

impl Bucket {
    fn live(&self, now_ms: u64) -> Option<BucketState> {
        self.state.filter(|s| s.forget_at_ms() > now_ms)
    }

    fn take(&mut self, request: TakeRequest, now_ms: u64) -> TakeOutcome {
        let (outcome, state) = take(self.live(now_ms), &request, now_ms, CLEANUP_MS);
        self.state = Some(state);
        outcome
    }

    fn query(&self, now_ms: u64) -> Option<Balances> {
        query(self.live(now_ms).as_ref(), now_ms)
    }
}

fn limits(pairs: &[(Period, u32)]) -> [u32; PERIOD_COUNT] {
    let mut limits = [0; PERIOD_COUNT];
    for &(period, limit) in pairs {
        limits[period.index()] = limit;
    }
    limits
}

fn req(count: i32, pairs: &[(Period, u32)]) -> TakeRequest {
    TakeRequest {
        count,
        reset: false,
        limits: limits(pairs),
    }
}

fn balances(pairs: &[(Period, i32)]) -> Balances {
    let mut b = Balances::default();
    for &(period, balance) in pairs {
        b.0[period.index()] = Some(balance);
    }
    b
}

fn outcome(accept: bool, pairs: &[(Period, i32)]) -> TakeOutcome {
    TakeOutcome {
        accept,
        balances: balances(pairs),
    }
}

use Period::*;

#[test]
fn first_take_creates_a_full_bucket_and_takes_one() {
    let mut bucket = Bucket::default();
    assert_eq!(
        bucket.take(req(1, &[(Second, 10)]), T0),
        outcome(true, &[(Second, 9)])
    );
}

#[test]
fn overtake_is_rejected_and_reports_the_negative_balance() {
    let mut bucket = Bucket::default();
    assert_eq!(
        bucket.take(req(10, &[(Second, 10)]), T0),
        outcome(true, &[(Second, 0)])
    );
    assert_eq!(
        bucket.take(req(1, &[(Second, 10)]), T0),
        outcome(false, &[(Second, -1)])
    );
    // A rejected take changes nothing.
    assert_eq!(
        bucket.take(req(3, &[(Second, 10)]), T0),
        outcome(false, &[(Second, -3)])
    );
    assert_eq!(bucket.query(T0), Some(balances(&[(Second, 0)])));
}

#[test]
fn tokens_accrue_pro_rated_per_millisecond() {
    let mut bucket = Bucket::default();
    bucket.take(req(10, &[(Second, 10)]), T0);
    assert_eq!(bucket.query(T0 + 99), Some(balances(&[(Second, 0)])));
    assert_eq!(bucket.query(T0 + 100), Some(balances(&[(Second, 1)])));
    assert_eq!(bucket.query(T0 + 250), Some(balances(&[(Second, 2)])));
    // 2.5 tokens: a take of 2 leaves half a token, reported as 0.
    assert_eq!(
        bucket.take(req(2, &[(Second, 10)]), T0 + 250),
        outcome(true, &[(Second, 0)])
    );
    assert_eq!(
        bucket.take(req(1, &[(Second, 10)]), T0 + 299),
        outcome(false, &[(Second, -1)])
    );
    assert_eq!(
        bucket.take(req(1, &[(Second, 10)]), T0 + 300),
        outcome(true, &[(Second, 0)])
    );
}

#[test]
fn the_balance_never_exceeds_the_limit() {
    let mut bucket = Bucket::default();
    bucket.take(req(5, &[(Minute, 1_000)]), T0);
    // 3 s later 50 tokens have accrued to a balance of 995. droplet, which
    // capped only when more than 100 had accrued, would now accept a take of
    // 1045 (SPEC §9); the balance here is 1000 at most.
    assert_eq!(
        bucket.take(req(1_001, &[(Minute, 1_000)]), T0 + 3_000),
        outcome(false, &[(Minute, -1)])
    );
    assert_eq!(
        bucket.take(req(1_000, &[(Minute, 1_000)]), T0 + 3_000),
        outcome(true, &[(Minute, 0)])
    );
    // Adding tokens (negative count) stops at the limit too.
    assert_eq!(
        bucket.take(req(-5_000, &[(Minute, 1_000)]), T0 + 3_000),
        outcome(true, &[(Minute, 1_000)])
    );
    assert_eq!(
        bucket.query(T0 + 50_000),
        Some(balances(&[(Minute, 1_000)]))
    );
}

#[test]
fn count_zero_reads_and_negative_count_adds() {
    let mut bucket = Bucket::default();
    bucket.take(req(8, &[(Second, 10)]), T0);
    assert_eq!(
        bucket.take(req(0, &[(Second, 10)]), T0),
        outcome(true, &[(Second, 2)])
    );
    assert_eq!(
        bucket.take(req(-3, &[(Second, 10)]), T0),
        outcome(true, &[(Second, 5)])
    );
    assert_eq!(bucket.query(T0), Some(balances(&[(Second, 5)])));
}

#[test]
fn limits_persist_and_every_configured_period_is_debited() {
    let mut bucket = Bucket::default();
    assert_eq!(
        bucket.take(req(1, &[(Second, 10), (Minute, 100)]), T0),
        outcome(true, &[(Second, 9), (Minute, 99)])
    );
    // Only the per-second limit given: only it is checked and reported, but
    // the per-minute balance is debited too.
    assert_eq!(
        bucket.take(req(1, &[(Second, 10)]), T0),
        outcome(true, &[(Second, 8)])
    );
    assert_eq!(
        bucket.query(T0),
        Some(balances(&[(Second, 8), (Minute, 98)]))
    );
    // No limit given at all: nothing is checked, everything configured is debited.
    assert_eq!(bucket.take(req(3, &[]), T0), outcome(true, &[]));
    assert_eq!(
        bucket.query(T0),
        Some(balances(&[(Second, 5), (Minute, 95)]))
    );
}

#[test]
fn periods_not_checked_can_go_negative() {
    let mut bucket = Bucket::default();
    bucket.take(req(0, &[(Second, 100), (Hour, 2)]), T0);
    for _ in 0..5 {
        assert!(bucket.take(req(1, &[(Second, 100)]), T0).accept);
    }
    assert_eq!(
        bucket.query(T0),
        Some(balances(&[(Second, 95), (Hour, -3)]))
    );
    assert_eq!(
        bucket.take(req(1, &[(Hour, 2)]), T0),
        outcome(false, &[(Hour, -4)])
    );
}

#[test]
fn every_period_given_must_have_the_tokens() {
    let mut bucket = Bucket::default();
    bucket.take(req(3, &[(Second, 10), (Minute, 3)]), T0);
    assert_eq!(
        bucket.take(req(1, &[(Second, 10), (Minute, 3)]), T0 + 10),
        outcome(false, &[(Second, 6), (Minute, -1)])
    );
    // Nothing was debited.
    assert_eq!(
        bucket.query(T0 + 10),
        Some(balances(&[(Second, 7), (Minute, 0)]))
    );
}

#[test]
fn a_changed_limit_keeps_the_balance_and_caps_it() {
    let mut bucket = Bucket::default();
    bucket.take(req(5, &[(Second, 10)]), T0);
    // Raised: 5 tokens stay 5 (not rescaled), then refill at 20 per second.
    assert_eq!(
        bucket.take(req(0, &[(Second, 20)]), T0),
        outcome(true, &[(Second, 5)])
    );
    assert_eq!(bucket.query(T0 + 100), Some(balances(&[(Second, 7)])));
    // Lowered below the balance: capped at the new limit.
    assert_eq!(
        bucket.take(req(0, &[(Second, 3)]), T0 + 100),
        outcome(true, &[(Second, 3)])
    );
    assert_eq!(bucket.query(T0 + 10_000), Some(balances(&[(Second, 3)])));
}

#[test]
fn reset_forgets_the_bucket_first() {
    let mut bucket = Bucket::default();
    bucket.take(req(10, &[(Second, 10), (Day, 50)]), T0);
    let reset = TakeRequest {
        reset: true,
        ..req(1, &[(Second, 10)])
    };
    assert_eq!(bucket.take(reset, T0), outcome(true, &[(Second, 9)]));
    // The per-day limit went with the reset.
    assert_eq!(bucket.query(T0), Some(balances(&[(Second, 9)])));
}

#[test]
fn a_query_never_creates_a_bucket() {
    let bucket = Bucket::default();
    assert_eq!(bucket.query(T0), None);
    assert_eq!(query(None, T0), None);
}

#[test]
fn full_buckets_are_forgotten_at_the_next_cleanup_tick() {
    let mut bucket = Bucket::default();
    // T0 is a multiple of the cleanup interval.
    assert_eq!(T0 % CLEANUP_MS, 0);
    bucket.take(req(10, &[(Second, 10)]), T0 + 1_000);
    // Full at T0 + 2 s; the next tick is T0 + 60 s.
    assert_eq!(bucket.state.unwrap().forget_at_ms(), T0 + CLEANUP_MS);
    assert_eq!(bucket.query(T0 + 59_999), Some(balances(&[(Second, 10)])));
    assert_eq!(bucket.query(T0 + CLEANUP_MS), None);
    // A bucket still filling at a tick survives it.
    bucket.take(req(1, &[(Hour, 60)]), T0 + CLEANUP_MS);
    let state = bucket.state.unwrap();
    assert_eq!(state.forget_at_ms(), T0 + 2 * CLEANUP_MS);
    bucket.take(req(2, &[(Hour, 60)]), T0 + CLEANUP_MS + 1);
    assert_eq!(bucket.state.unwrap().forget_at_ms(), T0 + 4 * CLEANUP_MS);
    // A zero interval never forgets.
    let (_, state) = take(None, &req(0, &[]), T0, 0);
    assert_eq!(state.forget_at_ms(), u64::MAX);
}

#[test]
fn extreme_counts_and_limits_never_panic() {
    let mut bucket = Bucket::default();
    let all = [
        (Second, u32::MAX),
        (Minute, u32::MAX),
        (Hour, 1),
        (Day, u32::MAX),
        (Week, 1),
        (Month, u32::MAX),
    ];
    for count in [i32::MAX, i32::MIN, 0, 1, -1, i32::MAX] {
        let outcome = bucket.take(req(count, &all), T0);
        for (period, balance) in outcome.balances.iter() {
            assert!(i64::from(balance) <= i64::from(all[period.index()].1));
        }
    }
    for _ in 0..10 {
        bucket.take(req(i32::MAX, &all), u64::MAX - 1);
    }
    assert!(bucket.query(u64::MAX - 1).is_some());
}

/// The naive model: per period, tokens × period_ms as an integer, refilled by
/// `limit` every millisecond and capped; forgotten at cleanup ticks when every
/// period is full.
#[derive(Default)]
struct NaiveBucket {
    exists: bool,
    /// (limit, tokens × period_ms) per period.
    periods: [Option<(u32, i128)>; PERIOD_COUNT],
}

impl NaiveBucket {
    fn advance_one_ms(&mut self, to_ms: u64, cleanup_interval_ms: u64) {
        for (index, slot) in self.periods.iter_mut().enumerate() {
            if let Some((limit, scaled)) = slot {
                let cap = i128::from(*limit) * i128::from(Period::ALL[index].period_ms());
                *scaled = (*scaled + i128::from(*limit)).min(cap);
            }
        }
        if self.exists && to_ms.is_multiple_of(cleanup_interval_ms) {
            let all_full = self
                .periods
                .iter()
                .enumerate()
                .all(|(index, slot)| match slot {
                    Some((limit, scaled)) => {
                        *scaled >= i128::from(*limit) * i128::from(Period::ALL[index].period_ms())
                    }
                    None => true,
                });
            if all_full {
                *self = NaiveBucket::default();
            }
        }
    }

    fn take(&mut self, request: &TakeRequest) -> TakeOutcome {
        if request.reset {
            *self = NaiveBucket::default();
        }
        self.exists = true;
        for period in Period::ALL {
            let limit = request.limits[period.index()];
            if limit == 0 {
                continue;
            }
            let cap = i128::from(limit) * i128::from(period.period_ms());
            let slot = &mut self.periods[period.index()];
            *slot = Some(match *slot {
                None => (limit, cap),
                Some((_, scaled)) => (limit, scaled.min(cap)),
            });
        }
        let count = i128::from(request.count);
        let mut accept = true;
        let mut balances = Balances::default();
        for period in Period::ALL {
            if request.limits[period.index()] == 0 {
                continue;
            }
            let (limit, scaled) = self.periods[period.index()].unwrap();
            let p = i128::from(period.period_ms());
            let after = (scaled - count * p).min(i128::from(limit) * p);
            accept &= after >= 0;
            balances.0[period.index()] = Some(after.div_euclid(p) as i32);
        }
        if accept {
            for (index, slot) in self.periods.iter_mut().enumerate() {
                if let Some((limit, scaled)) = slot {
                    let p = i128::from(Period::ALL[index].period_ms());
                    *scaled = (*scaled - count * p).min(i128::from(*limit) * p);
                }
            }
        }
        TakeOutcome { accept, balances }
    }

    fn query(&self) -> Option<Balances> {
        if !self.exists {
            return None;
        }
        let mut balances = Balances::default();
        for period in Period::ALL {
            if let Some((_, scaled)) = self.periods[period.index()] {
                let p = i128::from(period.period_ms());
                balances.0[period.index()] = Some(scaled.div_euclid(p) as i32);
            }
        }
        Some(balances)
    }
}

#[derive(Debug, Clone)]
enum Op {
    Take(TakeRequest),
    Query,
}

fn any_op() -> impl Strategy<Value = Op> {
    let limit = prop_oneof![3 => Just(0u32), 2 => 1u32..12, 1 => 1u32..3_000];
    let take = (
        -4i32..14,
        proptest::bool::weighted(0.05),
        proptest::array::uniform6(limit),
    )
        .prop_map(|(count, reset, limits)| {
            Op::Take(TakeRequest {
                count,
                reset,
                limits,
            })
        });
    prop_oneof![4 => take, 1 => Just(Op::Query)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Same answers as the naive model at every step, refill exact to the
    /// millisecond, and no balance ever above its limit.
    #[test]
    fn matches_a_millisecond_by_millisecond_model(
        steps in proptest::collection::vec((0u64..1_300, any_op()), 1..40),
    ) {
        let cleanup_interval_ms = 700;
        let mut real: Option<BucketState> = None;
        let mut naive = NaiveBucket::default();
        let mut now = T0;
        for (gap, op) in steps {
            for _ in 0..gap {
                now += 1;
                naive.advance_one_ms(now, cleanup_interval_ms);
            }
            let live = real.filter(|s| s.forget_at_ms() > now);
            match op {
                Op::Take(request) => {
                    let (outcome, state) = take(live, &request, now, cleanup_interval_ms);
                    real = Some(state);
                    prop_assert_eq!(outcome, naive.take(&request));
                    for (period, balance) in outcome.balances.iter() {
                        prop_assert!(balance as u32 <= request.limits[period.index()] || balance < 0);
                    }
                }
                Op::Query => {
                    let balances = query(live.as_ref(), now);
                    prop_assert_eq!(balances, naive.query());
                    if let (Some(balances), Some(state)) = (balances, live) {
                        for (period, balance) in balances.iter() {
                            prop_assert!(i64::from(balance) <= i64::from(state.limits()[period.index()]));
                        }
                    }
                }
            }
        }
    }
}
