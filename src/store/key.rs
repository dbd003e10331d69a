//! A memory-store key as a lookup sees it ([`KeyBytes`]): whole, or a
//! rule's 8-byte identity and an actor, never assembled; laid out as a
//! slot's 24-byte head in three words read straight from the bytes, and
//! the fixed seeds and multiply of the short-key hash.

use super::memory::INLINE_KEY_BYTES_MAX;

/// `s[start..start + n]` (`n` at most 8) as a little-endian word, zero
/// extended, read with at most two loads and no copy.
#[inline(always)]
fn load_le(s: &[u8], start: usize, n: usize) -> u64 {
    if n == 0 {
        return 0;
    }
    let b = &s[start..start + n];
    let u32_at = |i: usize| u64::from(u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]));
    match n {
        8.. => {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&b[..8]);
            u64::from_le_bytes(bytes)
        }
        // Two overlapping loads: the bytes both cover land on the same bits.
        4..=7 => u32_at(0) | u32_at(n - 4) << (8 * (n - 4)),
        _ => {
            u64::from(b[0])
                | u64::from(b[n / 2]) << (8 * (n / 2))
                | u64::from(b[n - 1]) << (8 * (n - 1))
        }
    }
}

/// A key's bytes: whole, or an 8-byte prefix (little endian: a rule's
/// identity) followed by the rest (an actor).
#[derive(Clone, Copy)]
pub(super) enum KeyBytes<'k> {
    Whole(&'k [u8]),
    Prefixed(u64, &'k [u8]),
}

impl KeyBytes<'_> {
    pub(super) fn len(self) -> usize {
        match self {
            KeyBytes::Whole(key) => key.len(),
            KeyBytes::Prefixed(_, rest) => 8 + rest.len(),
        }
    }

    pub(super) fn eq_bytes(self, other: &[u8]) -> bool {
        match self {
            KeyBytes::Whole(key) => key == other,
            KeyBytes::Prefixed(prefix, rest) => {
                other.len() == 8 + rest.len()
                    && other[..8] == prefix.to_le_bytes()
                    && other[8..] == *rest
            }
        }
    }

    pub(super) fn to_boxed(self) -> Box<[u8]> {
        match self {
            KeyBytes::Whole(key) => key.into(),
            KeyBytes::Prefixed(prefix, rest) => {
                let mut key = Vec::with_capacity(8 + rest.len());
                key.extend_from_slice(&prefix.to_le_bytes());
                key.extend_from_slice(rest);
                key.into()
            }
        }
    }

    /// The head of the slot that holds this key inline, as three words:
    /// the length byte, then the key's bytes, zero padded; `None` for a key
    /// longer than [`INLINE_KEY_BYTES_MAX`].
    #[inline(always)]
    pub(super) fn head(self) -> Option<[u64; 3]> {
        let len = self.len();
        if len > INLINE_KEY_BYTES_MAX {
            return None;
        }
        Some(match self {
            KeyBytes::Whole(key) => [
                len as u64 | load_le(key, 0, len.min(7)) << 8,
                load_le(key, 7, len.saturating_sub(7).min(8)),
                load_le(key, 15, len.saturating_sub(15)),
            ],
            KeyBytes::Prefixed(prefix, rest) => {
                let n = rest.len();
                [
                    len as u64 | prefix << 8,
                    prefix >> 56 | load_le(rest, 0, n.min(7)) << 8,
                    load_le(rest, 7, n.saturating_sub(7)),
                ]
            }
        })
    }
}

/// `a * b` as 128 bits, both halves folded into one word.
#[inline(always)]
pub(super) fn folded_multiply(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ (product >> 64) as u64
}

/// Seeds of the short-key hash (fixed, as the long-key hasher's are).
pub(super) const HEAD_SEEDS: [u64; 4] = [
    0x243f_6a88_85a3_08d3,
    0x1319_8a2e_0370_7344,
    0xa409_3822_299f_31d0,
    0x082e_fa98_ec4e_6c89,
];
