//! A rule counter's state ([`CounterState`]) packed into the 8 bytes a
//! memory-store slot keeps beside its inline key ([`PackedCounter`]), so a
//! slot is 32 bytes, two per cache line. A state that does not fit (a count
//! of a million or more) is declined and the store spills it.

use super::memory::StoredState;
use crate::limiter::{CounterState, FullAt};

/// Bits of a packed counter: a 2-bit variant tag, an instant in milliseconds
/// since the epoch (42 bits: until the year 2109) and one or two counts.
const PACK_MS_BITS: u32 = 42;
pub(super) const PACK_COUNT_BITS: u32 = 20;
const PACK_HALF_COUNT_BITS: u32 = PACK_COUNT_BITS / 2;
const PACK_TAG_SHIFT: u32 = 62;
const PACK_WINDOW: u64 = 1;
const PACK_TOKEN_BUCKET: u64 = 2;
const PACK_SLIDING_WINDOW: u64 = 3;

/// A [`CounterState`] in 8 bytes; the 0 value (never produced by `pack`) is
/// only a placeholder in spilled slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PackedCounter(u64);

impl StoredState for CounterState {
    type Packed = PackedCounter;

    fn expires_at_ms(&self) -> u64 {
        CounterState::expires_at_ms(self)
    }

    fn pack(&self) -> Option<PackedCounter> {
        let fits = |ms: u64, counts: &[(u64, u32)]| {
            ms < 1 << PACK_MS_BITS && counts.iter().all(|&(n, bits)| n < 1 << bits)
        };
        let packed = match *self {
            CounterState::Window { end_ms, used } => {
                if !fits(end_ms, &[(used, PACK_COUNT_BITS)]) {
                    return None;
                }
                PACK_WINDOW << PACK_TAG_SHIFT | end_ms << PACK_COUNT_BITS | used
            }
            CounterState::TokenBucket { full_at } => {
                let (ms, remainder) = full_at.to_parts();
                if !fits(ms, &[(remainder, PACK_COUNT_BITS)]) {
                    return None;
                }
                PACK_TOKEN_BUCKET << PACK_TAG_SHIFT | ms << PACK_COUNT_BITS | remainder
            }
            CounterState::SlidingWindow {
                expires_at_ms,
                current,
                previous,
            } => {
                let half = PACK_HALF_COUNT_BITS;
                if !fits(expires_at_ms, &[(current, half), (previous, half)]) {
                    return None;
                }
                PACK_SLIDING_WINDOW << PACK_TAG_SHIFT
                    | expires_at_ms << PACK_COUNT_BITS
                    | current << half
                    | previous
            }
            // Droplet periods (cluster mode) are spilled: they hold a bucket's
            // version and limit besides its instants.
            CounterState::DropletPeriod(_) => return None,
        };
        Some(PackedCounter(packed))
    }

    fn unpack(packed: PackedCounter) -> CounterState {
        let bits = packed.0;
        let ms = (bits >> PACK_COUNT_BITS) & ((1 << PACK_MS_BITS) - 1);
        let count = bits & ((1 << PACK_COUNT_BITS) - 1);
        let half_mask = (1 << PACK_HALF_COUNT_BITS) - 1;
        match bits >> PACK_TAG_SHIFT {
            PACK_TOKEN_BUCKET => CounterState::TokenBucket {
                full_at: FullAt::from_parts(ms, count),
            },
            PACK_SLIDING_WINDOW => CounterState::SlidingWindow {
                expires_at_ms: ms,
                current: (count >> PACK_HALF_COUNT_BITS) & half_mask,
                previous: count & half_mask,
            },
            // PACK_WINDOW, and the placeholder (an expired empty window).
            _ => CounterState::Window {
                end_ms: ms,
                used: count,
            },
        }
    }
}
