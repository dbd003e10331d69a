//! Varints, the integers of data frames (LEB128: seven bits a byte, low
//! group first, the top bit set on every byte but the last): written and
//! read a word at a time when they are longer than a byte, the common
//! case of the timestamps, quotas and credits every state and answer
//! carries; and the eight-byte incarnations, fixed-width.

use super::{FrameError, Reader};

/// Appends a varint: one byte inlined; a longer one under 2^56 (all a frame
/// carries but the extremes) as one word, its 7-bit groups spread out and
/// its continuation bits set, of which the bytes past its length are cut
/// off again (a copy of a fixed eight bytes, not a byte at a time).
#[inline(always)]
pub fn put_varint(out: &mut Vec<u8>, value: u64) {
    if value < 0x80 {
        out.push(value as u8);
        return;
    }
    put_long_varint(out, value);
}

/// [`put_varint`] of a value of more than one byte, out of line: two
/// bytes (quotas, credits, counts: the most common) as they are, longer
/// ones by the word. The word's length and masks cost a two-byte value
/// some forty instructions more than its two bytes do.
#[inline(never)]
fn put_long_varint(out: &mut Vec<u8>, value: u64) {
    // Every call out of here is a tail call (growing the buffer, the
    // rare byte-at-a-time form), so the word path saves no registers.
    if out.capacity() - out.len() < LONG_VARINT_BYTES_MAX {
        return put_long_varint_growing(out, value);
    }
    if value < 1 << 14 {
        out.extend_from_slice(&[value as u8 | 0x80, (value >> 7) as u8]);
        return;
    }
    if value >= 1 << 56 {
        return put_varint_bytewise(out, value);
    }
    let length = (64 - value.leading_zeros() as usize).div_ceil(7);
    let continued = 0x8080_8080_8080_8080 & (u64::MAX >> (64 - 8 * (length - 1)));
    let at = out.len();
    out.extend_from_slice(&(spread_seven_bit_groups(value) | continued).to_le_bytes());
    out.truncate(at + length);
}

/// Most bytes a varint takes (a `u64`'s 64 bits, seven a byte).
const LONG_VARINT_BYTES_MAX: usize = 10;

/// [`put_long_varint`] into a buffer with no room for the longest varint.
#[cold]
#[inline(never)]
fn put_long_varint_growing(out: &mut Vec<u8>, value: u64) {
    out.reserve(LONG_VARINT_BYTES_MAX);
    put_long_varint(out, value);
}

/// The inverse of [`seven_bit_groups`]: `value`'s (under 2^56) 7-bit
/// groups, one per byte of the word, low group first.
#[inline(always)]
fn spread_seven_bit_groups(value: u64) -> u64 {
    let halves = (value & 0x0fff_ffff) | ((value & 0x00ff_ffff_f000_0000) << 4);
    let quads = (halves & 0x0000_3fff_0000_3fff) | ((halves & 0x0fff_c000_0fff_c000) << 2);
    (quads & 0x007f_007f_007f_007f) | ((quads & 0x3f80_3f80_3f80_3f80) << 1)
}

/// [`put_varint`] a byte at a time (values of 2^56 and up: incarnations),
/// kept out of the word path so that it needs no registers saved.
#[cold]
#[inline(never)]
fn put_varint_bytewise(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// The value of a varint of up to eight bytes, given as the little-endian
/// word of its bytes (the bytes after it zeroed): each byte's low seven
/// bits, in order. Pairs of bytes are joined into 14-bit groups, pairs of
/// those into 28-bit groups, then the two halves.
#[inline(always)]
fn seven_bit_groups(word: u64) -> u64 {
    let pairs = (word & 0x007f_007f_007f_007f) | ((word & 0x7f00_7f00_7f00_7f00) >> 1);
    let quads = (pairs & 0x0000_3fff_0000_3fff) | ((pairs & 0x3fff_0000_3fff_0000) >> 2);
    (quads & 0x0000_0000_0fff_ffff) | ((quads & 0x0fff_ffff_0000_0000) >> 4)
}

impl Reader<'_> {
    /// Reads a varint: one byte inlined, a longer one out of line (see
    /// [`Reader::long_varint`]).
    #[inline(always)]
    pub fn varint(&mut self) -> Result<u64, FrameError> {
        match self.bytes {
            [first, rest @ ..] if *first < 0x80 => {
                self.bytes = rest;
                Ok(u64::from(*first))
            }
            _ => self.long_varint(),
        }
    }

    /// A varint of more than one byte: up to eight from one little-endian
    /// word of the frame (its end found from the word's continuation bits,
    /// its 7-bit groups gathered with three shifts), longer ones and those
    /// near the frame's end a byte at a time. Timestamps in states take six
    /// bytes, and byte by byte each one cost a bounds check and a store of
    /// the rest of the frame per byte.
    #[inline(never)]
    fn long_varint(&mut self) -> Result<u64, FrameError> {
        // Two bytes, the most common (see `put_long_varint`), as they are.
        if let [first, second @ 0..0x80, rest @ ..] = self.bytes {
            self.bytes = rest;
            return Ok(u64::from(first & 0x7f) | u64::from(*second) << 7);
        }
        if let Some(chunk) = self.bytes.first_chunk::<8>() {
            let word = u64::from_le_bytes(*chunk);
            let ends = !word & 0x8080_8080_8080_8080;
            if ends != 0 {
                let length = (ends.trailing_zeros() / 8 + 1) as usize;
                self.bytes = &self.bytes[length..];
                return Ok(seven_bit_groups(word & (u64::MAX >> (64 - 8 * length))));
            }
        }
        self.varint_bytewise()
    }

    /// [`Reader::varint`] one byte at a time: a varint of nine or ten
    /// bytes, or one within eight bytes of the frame's end.
    fn varint_bytewise(&mut self) -> Result<u64, FrameError> {
        let mut value: u64 = 0;
        for shift in (0..70).step_by(7) {
            let byte = self.u8()?;
            if shift == 63 && byte > 1 {
                return Err(FrameError::Invalid("varint"));
            }
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(FrameError::Invalid("varint"))
    }

    /// Reads eight bytes, little endian.
    pub fn fixed_u64(&mut self) -> Result<u64, FrameError> {
        let (word, rest) = self
            .bytes
            .split_first_chunk::<8>()
            .ok_or(FrameError::Truncated)?;
        self.bytes = rest;
        Ok(u64::from_le_bytes(*word))
    }
}
