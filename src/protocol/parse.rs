//! The request tokenizer and parser, matching divvy 1.7.1 byte for byte
//! (SPEC §1): quoted and unquoted tokens, a case-insensitive command word, and
//! `key=value` pairs with divvy's exact error messages.

use smallvec::SmallVec;
use std::fmt;

/// Pairs beyond this count are sorted and deduplicated so that lookups stay
/// logarithmic; below it a linear scan from the end ("last value wins") is
/// faster than any index.
const PAIRS_LINEAR_MAX: usize = 16;

/// The commands a line may carry. Every command takes the same `k=v` grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// Check and consume quota (divvy).
    Hit,
    /// What a `HIT` would answer, consuming nothing (Tollgate extension).
    Peek,
    /// Take tokens from a droplet-style bucket (Tollgate extension).
    Take,
    /// Read a droplet-style bucket without changing it (Tollgate extension).
    Query,
    /// Describe the cluster's shards and leaders (Tollgate extension).
    Topology,
}

impl Verb {
    const ALL: [(Verb, &'static str); 5] = [
        (Verb::Hit, "HIT"),
        (Verb::Peek, "PEEK"),
        (Verb::Take, "TAKE"),
        (Verb::Query, "QUERY"),
        (Verb::Topology, "TOPOLOGY"),
    ];

    /// The verb of an ASCII command word, matched without case.
    fn from_ascii_word(word: &[u8]) -> Option<Verb> {
        Self::ALL
            .iter()
            .find(|(_, name)| word.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(verb, _)| *verb)
    }

    fn from_word(word: &str) -> Option<Verb> {
        if word.is_ascii() {
            Self::ALL
                .iter()
                .find(|(_, name)| word.eq_ignore_ascii_case(name))
                .map(|(verb, _)| *verb)
        } else {
            // Unicode upper-casing can turn non-ASCII letters into ASCII ones
            // (`ı` → `I`), exactly as divvy's `toUpperCase` did.
            let upper = word.to_uppercase();
            Self::ALL
                .iter()
                .find(|(_, name)| upper == *name)
                .map(|(verb, _)| *verb)
        }
    }
}

/// A parsed request line. Keys and values borrow from the line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command<'a> {
    pub verb: Verb,
    pub pairs: Pairs<'a>,
}

/// The `key=value` pairs of a request, in the order given. When a key is given
/// twice, lookups see its last value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pairs<'a> {
    items: SmallVec<[(&'a str, &'a str); 8]>,
    /// Set when `items` was sorted by key and deduplicated (many pairs).
    sorted: bool,
}

impl<'a> FromIterator<(&'a str, &'a str)> for Pairs<'a> {
    /// Pairs in this order, as the parser would build them (last value wins).
    fn from_iter<I: IntoIterator<Item = (&'a str, &'a str)>>(items: I) -> Self {
        let mut pairs = Pairs::default();
        pairs.items.extend(items);
        pairs.finish();
        pairs
    }
}

impl<'a> Pairs<'a> {
    /// Builds pairs from a list, as the parser would (last value wins).
    pub fn from_slice(items: &[(&'a str, &'a str)]) -> Self {
        items.iter().copied().collect()
    }

    fn finish(&mut self) {
        if self.items.len() > PAIRS_LINEAR_MAX {
            // Stable sort keeps equal keys in input order; keep the last of each run.
            self.items.sort_by(|a, b| a.0.cmp(b.0));
            let mut deduped: SmallVec<[(&'a str, &'a str); 8]> = SmallVec::new();
            for item in self.items.drain(..) {
                match deduped.last_mut() {
                    Some(last) if last.0 == item.0 => *last = item,
                    _ => deduped.push(item),
                }
            }
            self.items = deduped;
            self.sorted = true;
        }
    }

    /// The value of `key`, if the request has it.
    pub fn get(&self, key: &str) -> Option<&'a str> {
        if self.sorted {
            self.items
                .binary_search_by(|(k, _)| (*k).cmp(key))
                .ok()
                .map(|i| self.items[i].1)
        } else {
            self.items
                .iter()
                .rev()
                .find(|(k, _)| bytes_eq(k.as_bytes(), key.as_bytes()))
                .map(|(_, v)| *v)
        }
    }

    /// The value of the pair at `position` in [`Pairs::iter`]'s order.
    pub fn value_at(&self, position: usize) -> Option<&'a str> {
        self.items.get(position).map(|&(_, value)| value)
    }

    /// Every pair as given (with duplicates when few pairs were given).
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, &'a str)> + '_ {
        self.items.iter().copied()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// Byte equality for the short strings of requests (keys, values): lengths
/// first, then, up to 16 bytes, two words ([`short_words`]) instead of a
/// library call.
#[inline]
pub fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len()
        && match (short_words(a), short_words(b)) {
            (Some(x), Some(y)) => x == y,
            _ => a == b,
        }
}

/// A string of at most 16 bytes as two words read at both ends (they overlap
/// when it is shorter): for strings of one length, equal words mean equal
/// bytes. `None` beyond 16 bytes.
#[inline(always)]
pub fn short_words(s: &[u8]) -> Option<(u64, u64)> {
    let n = s.len();
    let u32_at = |i: usize| {
        s.get(i..i + 4).map_or(0, |b| {
            u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        })
    };
    let u64_at = |i: usize| {
        s.get(i..i + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_le_bytes)
    };
    match n {
        0 => Some((0, 0)),
        1..=3 => Some((
            u64::from(s[0]) | u64::from(s[n / 2]) << 8 | u64::from(s[n - 1]) << 16,
            0,
        )),
        4..=7 => Some((u32_at(0) | u32_at(n - 4) << 32, 0)),
        8..=16 => Some((u64_at(0), u64_at(n - 8))),
        _ => None,
    }
}

/// Why a line could not be executed. `Display` gives divvy's exact message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// The command word is not one we know (already upper-cased).
    UnknownCommand(String),
    UnexpectedEndOfInput,
    UnexpectedEndOfQuoted,
    ExpectedEquals(char),
    ExpectedWhitespace(char),
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::UnknownCommand(word) => write!(f, "Unrecognized command: {word}"),
            ParseError::UnexpectedEndOfInput => f.write_str("Unexpected end of input string."),
            ParseError::UnexpectedEndOfQuoted => f.write_str("Unexpected end of quoted string."),
            ParseError::ExpectedEquals(c) => write!(f, "Expected '=', found '{c}'"),
            ParseError::ExpectedWhitespace(c) => write!(f, "Expected whitespace, found '{c}'"),
        }
    }
}

impl std::error::Error for ParseError {}

/// Whitespace as divvy's tokenizer saw it: JavaScript's `\s` (Unicode
/// White_Space without U+0085, plus U+FEFF).
pub fn is_whitespace(c: char) -> bool {
    matches!(
        c,
        ' ' | '\t' | '\n' | '\u{b}' | '\u{c}' | '\r' | '\u{a0}' | '\u{1680}' | '\u{2000}'
            ..='\u{200a}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202f}'
                | '\u{205f}'
                | '\u{3000}'
                | '\u{feff}'
    )
}

/// ASCII bytes that end an unquoted token: divvy's ASCII whitespace and `=`.
const ASCII_TOKEN_END: [bool; 128] = {
    let mut table = [false; 128];
    let mut i = 0;
    while i < 128 {
        table[i] = matches!(i as u8, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b'=');
        i += 1;
    }
    table
};

/// The byte length of the run of non-whitespace, non-`=` characters that
/// starts `s`. ASCII is decided by table lookup; other characters by
/// [`is_whitespace`].
fn unquoted_len(s: &str) -> usize {
    let bytes = s.as_bytes();
    let mut i = skip_plain_words(bytes);
    loop {
        // Tight ASCII loop; leave it only at a token end or a non-ASCII byte.
        i += bytes[i..]
            .iter()
            .position(|&b| b >= 0x80 || ASCII_TOKEN_END[b as usize])
            .unwrap_or(bytes.len() - i);
        match bytes.get(i) {
            Some(&b) if b >= 0x80 => match s[i..].chars().next() {
                Some(c) if !is_whitespace(c) => i += c.len_utf8(),
                _ => return i,
            },
            _ => return i,
        }
    }
}

/// Skips whole 8-byte words in which no byte could end a token (none is
/// ≤ 0x20, `=` or non-ASCII), eight bytes per step; the byte loop decides
/// the rest exactly.
fn skip_plain_words(bytes: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut i = 0;
    while let Some(word) = bytes.get(i..i + 8) {
        let mut array = [0u8; 8];
        array.copy_from_slice(word);
        let w = u64::from_le_bytes(array);
        let below_0x21 = w.wrapping_sub(ONES * 0x21) & !w & HIGH;
        let equals = w ^ (ONES * u64::from(b'='));
        let has_equals = equals.wrapping_sub(ONES) & !equals & HIGH;
        if (below_0x21 | has_equals | (w & HIGH)) != 0 {
            break;
        }
        i += 8;
    }
    i
}

/// The byte length of the run of whitespace that starts `s`.
fn whitespace_len(s: &str) -> usize {
    let bytes = s.as_bytes();
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b < 0x80 {
            if !(ASCII_TOKEN_END[b as usize] && b != b'=') {
                break;
            }
            i += 1;
        } else {
            match s[i..].chars().next() {
                Some(c) if is_whitespace(c) => i += c.len_utf8(),
                _ => break,
            }
        }
    }
    i
}

/// Trims divvy's whitespace from both ends (JavaScript's `trim`).
fn trim_whitespace(s: &str) -> &str {
    let s = &s[whitespace_len(s)..];
    if s.as_bytes()
        .last()
        .is_some_and(|b| b.is_ascii_alphanumeric())
    {
        return s; // the common case: nothing to trim at the end
    }
    s.trim_end_matches(is_whitespace)
}

/// Reads one token starting at byte `pos`: a quoted token runs to the next
/// `"` (no escapes); any other token runs to the first whitespace or `=`.
/// Returns the token and the byte position just after it.
fn read_token(s: &str, pos: usize) -> Result<(&str, usize), ParseError> {
    let rest = &s[pos..];
    if rest.as_bytes().first() == Some(&b'"') {
        let close =
            memchr::memchr(b'"', &rest.as_bytes()[1..]).ok_or(ParseError::UnexpectedEndOfQuoted)?;
        Ok((&rest[1..1 + close], pos + close + 2))
    } else {
        let len = unquoted_len(rest);
        Ok((&rest[..len], pos + len))
    }
}

/// The character at byte `pos` (a character boundary), if any.
fn char_at(s: &str, pos: usize) -> Option<char> {
    match s.as_bytes().get(pos) {
        Some(&b) if b < 0x80 => Some(b as char),
        Some(_) => s[pos..].chars().next(),
        None => None,
    }
}

/// Parses one request line (without its terminator).
pub fn parse_line(line: &str) -> Result<Command<'_>, ParseError> {
    let mut pairs = Pairs::default();
    let verb = parse_line_into(line, &mut pairs)?;
    Ok(Command { verb, pairs })
}

/// Parses one request line into `pairs` (which must be empty), returning its
/// verb: [`parse_line`] without moving the pairs around, for the hot path.
pub fn parse_line_into<'a>(line: &'a str, pairs: &mut Pairs<'a>) -> Result<Verb, ParseError> {
    if let Some(verb) = parse_line_fast(line, pairs) {
        return Ok(verb);
    }
    pairs.items.clear();
    pairs.sorted = false;
    let command = parse_line_general(line)?;
    *pairs = command.pairs;
    Ok(command.verb)
}

/// Longest line the fast path takes (longer lines are rare; the general
/// parser reads them).
const FAST_LINE_BYTES_MAX: usize = 256;

/// Where the stop bytes of a line are (one bit per byte): bytes ≤ 0x20
/// (whitespace and control characters), `=`, `"`, and non-ASCII bytes. Built
/// 16 bytes at a time; the parser then walks the stops in order, so finding
/// the end of a token is one bit scan.
struct Stops {
    words: [u64; FAST_LINE_BYTES_MAX / 64],
    /// The word being walked, and its stops not yet passed.
    word: usize,
    bits: u64,
}

impl Stops {
    fn new(bytes: &[u8]) -> Option<Stops> {
        if bytes.len() > FAST_LINE_BYTES_MAX {
            return None;
        }
        let mut words = [0u64; FAST_LINE_BYTES_MAX / 64];
        let mut blocks = bytes.chunks_exact(16);
        let mut at = 0;
        for block in blocks.by_ref() {
            if let Ok(block) = <&[u8; 16]>::try_from(block) {
                words[at / 64] |= u64::from(stop_mask(block)) << (at % 64);
            }
            at += 16;
        }
        let tail = blocks.remainder();
        if !tail.is_empty() {
            // Padding with a byte that never stops a token: no stop past the end.
            let mut array = [b'a'; 16];
            array[..tail.len()].copy_from_slice(tail);
            words[at / 64] |= u64::from(stop_mask(&array)) << (at % 64);
        }
        Some(Stops {
            words,
            word: 0,
            bits: words[0],
        })
    }

    /// Takes the next stop; `len` (the line's length) when none is left.
    #[inline(always)]
    fn next(&mut self, len: usize) -> usize {
        loop {
            if self.bits != 0 {
                let at = self.word * 64 + self.bits.trailing_zeros() as usize;
                self.bits &= self.bits - 1;
                return at;
            }
            self.word += 1;
            match self.words.get(self.word) {
                Some(&bits) => self.bits = bits,
                None => return len,
            }
        }
    }

    /// Drops the stops before `pos`.
    #[inline(always)]
    fn skip_to(&mut self, pos: usize) {
        let word = pos / 64;
        if word != self.word {
            self.word = word;
            self.bits = self.words.get(word).copied().unwrap_or(0);
        }
        self.bits &= u64::MAX << (pos % 64);
    }
}

/// One bit per byte of `block`: is it a stop byte?
#[cfg(target_arch = "x86_64")]
fn stop_mask(block: &[u8; 16]) -> u16 {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_max_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };
    // SAFETY: SSE2 is part of x86_64; the load reads the 16 bytes of `block`.
    unsafe {
        let v = _mm_loadu_si128(block.as_ptr().cast());
        let space = _mm_set1_epi8(0x20);
        let low = _mm_cmpeq_epi8(_mm_max_epu8(v, space), space);
        let equals = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'=' as i8));
        let quote = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8));
        // The sign bit of each byte is the non-ASCII test itself.
        _mm_movemask_epi8(_mm_or_si128(
            _mm_or_si128(low, equals),
            _mm_or_si128(quote, v),
        )) as u16
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn stop_mask(block: &[u8; 16]) -> u16 {
    block
        .iter()
        .enumerate()
        .filter(|&(_, &b)| b <= 0x20 || b == b'=' || b == b'"' || b >= 0x80)
        .fold(0, |mask, (i, _)| mask | 1 << i)
}

/// The common line, read in one pass: ASCII, well formed, each token ended by
/// ASCII whitespace or `=`. Anything else (an error, a non-ASCII character
/// outside quotes, a control character, a `"` inside an unquoted token, a
/// line over [`FAST_LINE_BYTES_MAX`]) returns `None`, and the general parser,
/// which knows every rule and every message, reads the line again. The two
/// agree wherever this one answers (a property test checks it).
fn parse_line_fast<'a>(line: &'a str, pairs: &mut Pairs<'a>) -> Option<Verb> {
    let bytes = line.as_bytes();
    let len = bytes.len();
    let mut stops = Stops::new(bytes)?;
    let word_end = stops.next(len);
    if word_end == 0 {
        return None;
    }
    let verb = Verb::from_ascii_word(bytes.get(..word_end)?)?;
    let mut pos = word_end;
    loop {
        // After the command word or a value: the end, or whitespace.
        match bytes.get(pos) {
            None => break,
            Some(&b) if is_ascii_whitespace_byte(b) => {}
            Some(_) => return None,
        }
        pos += 1;
        while bytes.get(pos).is_some_and(|&b| is_ascii_whitespace_byte(b)) {
            pos += 1;
        }
        if pos == len {
            break;
        }
        stops.skip_to(pos);
        let (key, after_key) = fast_token(line, &mut stops, pos)?;
        if bytes.get(after_key) != Some(&b'=') {
            return None;
        }
        let (value, after_value) = fast_token(line, &mut stops, after_key + 1)?;
        pairs.items.push((key, value));
        pos = after_value;
    }
    pairs.finish();
    Some(verb)
}

/// Divvy's ASCII whitespace (not `=`): tab, newline, vertical tab, form
/// feed, carriage return and space, as one bit test.
#[inline(always)]
fn is_ascii_whitespace_byte(b: u8) -> bool {
    const WHITESPACE: u64 =
        1 << b' ' | 1 << b'\t' | 1 << b'\n' | 1 << 0x0b | 1 << 0x0c | 1 << b'\r';
    b <= b' ' && WHITESPACE >> b & 1 == 1
}

/// One token of the fast path starting at `pos` (`pos <= line.len()`; no
/// stop before `pos` is left in `stops`): quoted, to the next `"`;
/// otherwise to the next stop, which must be whitespace, `=` or the end.
/// Returns the token and the position after it, whose stop is taken.
#[inline(always)]
fn fast_token<'a>(line: &'a str, stops: &mut Stops, pos: usize) -> Option<(&'a str, usize)> {
    let bytes = line.as_bytes();
    if bytes.get(pos) == Some(&b'"') {
        let close = pos + 1 + memchr::memchr(b'"', bytes.get(pos + 1..)?)?;
        stops.skip_to(close + 2);
        // Both quotes are ASCII, so both ends are character boundaries.
        return Some((line.get(pos + 1..close)?, close + 1));
    }
    let end = stops.next(bytes.len());
    match bytes.get(end) {
        Some(&b) if b != b'=' && !is_ascii_whitespace_byte(b) => None,
        _ => {
            let token = bytes.get(pos..end)?;
            // SAFETY: every non-ASCII byte is a stop, so the bytes from `pos`
            // (a token's start) to the first stop are ASCII: valid UTF-8.
            Some((unsafe { std::str::from_utf8_unchecked(token) }, end))
        }
    }
}

/// Parses one request line with every rule of the tokenizer (any Unicode,
/// quotes anywhere, divvy's exact error messages).
fn parse_line_general(line: &str) -> Result<Command<'_>, ParseError> {
    let (word, after_word) = read_token(line, 0)?;
    let verb =
        Verb::from_word(word).ok_or_else(|| ParseError::UnknownCommand(word.to_uppercase()))?;
    let pairs = parse_pairs(trim_whitespace(&line[after_word..]))?;
    Ok(Command { verb, pairs })
}

/// Reads `key=value` pairs separated by whitespace from an already trimmed string.
fn parse_pairs(s: &str) -> Result<Pairs<'_>, ParseError> {
    let mut pairs = Pairs::default();
    let mut pos = 0;
    while pos < s.len() {
        let (key, after_key) = read_token(s, pos)?;
        match char_at(s, after_key) {
            Some('=') => {}
            Some(c) => return Err(ParseError::ExpectedEquals(c)),
            None => return Err(ParseError::UnexpectedEndOfInput),
        }
        let (value, after_value) = read_token(s, after_key + 1)?;
        pairs.items.push((key, value));
        match char_at(s, after_value) {
            None => break,
            Some(c) if is_whitespace(c) => pos = after_value + whitespace_len(&s[after_value..]),
            Some(c) => return Err(ParseError::ExpectedWhitespace(c)),
        }
    }
    pairs.finish();
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(line: &str) -> Vec<(String, String)> {
        let cmd = parse_line(line).expect("parses");
        assert_eq!(cmd.verb, Verb::Hit);
        cmd.pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn err(line: &str) -> String {
        parse_line(line).expect_err("must fail").to_string()
    }

    #[test]
    fn spec_error_table() {
        assert_eq!(err("FOO"), "Unrecognized command: FOO");
        assert_eq!(err("foo bar"), "Unrecognized command: FOO");
        assert_eq!(err(""), "Unrecognized command: ");
        assert_eq!(err("   "), "Unrecognized command: ");
        assert_eq!(err(" HIT a=b"), "Unrecognized command: ");
        assert_eq!(err("HIT a"), "Unexpected end of input string.");
        assert_eq!(err("HIT a b"), "Expected '=', found ' '");
        assert_eq!(err("HIT a=b=c"), "Expected whitespace, found '='");
        assert_eq!(err("HIT a=\"b\"c"), "Expected whitespace, found 'c'");
        assert_eq!(err("HIT \"a"), "Unexpected end of quoted string.");
        assert_eq!(err("\"HIT"), "Unexpected end of quoted string.");
        assert_eq!(err("HIT a=\"b"), "Unexpected end of quoted string.");
    }

    #[test]
    fn quoting_and_edge_pairs() {
        assert_eq!(pairs("HIT"), vec![]);
        assert_eq!(pairs("hit a=b"), vec![("a".into(), "b".into())]);
        assert_eq!(
            pairs("Hit \"a b\"=\"c=d\tx\""),
            vec![("a b".into(), "c=d\tx".into())]
        );
        assert_eq!(pairs("HIT ="), vec![("".into(), "".into())]);
        assert_eq!(pairs("HIT \"\"=\"\""), vec![("".into(), "".into())]);
        assert_eq!(pairs("HIT a="), vec![("a".into(), "".into())]);
        assert_eq!(pairs("HIT a=b\"c"), vec![("a".into(), "b\"c".into())]);
        assert_eq!(pairs("HIT=x"), vec![("".into(), "x".into())]);
        assert_eq!(
            pairs("HIT  a=1 \t b=2  "),
            vec![("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        assert_eq!(
            pairs("HIT a=1\rb=2\r"),
            vec![("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        assert_eq!(
            pairs("HIT\u{3000}a=1\u{feff}b=2"),
            vec![("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        assert_eq!(pairs("\"HIT\" a=1"), vec![("a".into(), "1".into())]);
    }

    #[test]
    fn unicode_whitespace_and_offending_characters() {
        assert_eq!(err("HIT a\u{2003}b"), "Expected '=', found '\u{2003}'");
        assert_eq!(err("HIT a=b=\u{1F600}"), "Expected whitespace, found '='");
        assert_eq!(
            err("HIT a=\"b\"\u{1F600}"),
            "Expected whitespace, found '\u{1F600}'"
        );
        // U+0085 is not whitespace to divvy: it is part of the token.
        assert_eq!(
            pairs("HIT a=b\u{85}c"),
            vec![("a".into(), "b\u{85}c".into())]
        );
        // Dotless i upper-cases to I, as in JavaScript.
        assert_eq!(parse_line("h\u{131}t a=b").unwrap().verb, Verb::Hit);
        assert_eq!(err("caf\u{e9}"), "Unrecognized command: CAF\u{c9}");
    }

    #[test]
    fn last_value_wins_with_few_and_many_pairs() {
        let cmd = parse_line("HIT a=1 b=2 a=3").unwrap();
        assert_eq!(cmd.pairs.get("a"), Some("3"));
        assert_eq!(cmd.pairs.get("c"), None);
        let mut line = String::from("HIT");
        for i in 0..100 {
            line.push_str(&format!(" k{}={}", i % 30, i));
        }
        let cmd = parse_line(&line).unwrap();
        assert_eq!(cmd.pairs.get("k5"), Some("95"));
        assert_eq!(cmd.pairs.get("k29"), Some("89"));
        assert_eq!(cmd.pairs.get("k30"), None);
    }

    #[test]
    fn bytes_eq_is_equality() {
        let words: Vec<Vec<u8>> = (0..20)
            .flat_map(|n| {
                let base: Vec<u8> = (0..n).map(|i| b'a' + i as u8).collect();
                let mut variants = vec![base.clone()];
                for i in 0..n {
                    let mut v = base.clone();
                    v[i] ^= 1;
                    variants.push(v);
                }
                variants
            })
            .collect();
        for a in &words {
            for b in &words {
                assert_eq!(bytes_eq(a, b), a == b, "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn other_verbs() {
        assert_eq!(parse_line("peek a=b").unwrap().verb, Verb::Peek);
        assert_eq!(parse_line("TAKE bucket=x").unwrap().verb, Verb::Take);
        assert_eq!(parse_line("query bucket=x").unwrap().verb, Verb::Query);
        assert_eq!(parse_line("TOPOLOGY").unwrap().verb, Verb::Topology);
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    fn reference_unquoted_len(s: &str) -> usize {
        s.char_indices()
            .find(|&(_, c)| c == '=' || is_whitespace(c))
            .map_or(s.len(), |(i, _)| i)
    }

    proptest! {
        /// The word-at-a-time scan agrees with the character-by-character definition.
        #[test]
        fn fast_token_scan_matches_the_definition(s in "[a-z=\\\\ \t\r\u{b}\u{c}\u{85}\u{a0}\u{3000}\u{feff}\u{1}\"é]{0,40}") {
            prop_assert_eq!(unquoted_len(&s), reference_unquoted_len(&s));
            let ws = s.len() - s.trim_start_matches(is_whitespace).len();
            prop_assert_eq!(whitespace_len(&s), ws);
        }

        /// The fast path answers only where the general parser agrees.
        #[test]
        fn fast_path_agrees_with_the_general_parser(s in "(?i:hit|peek|take|x)?[ a-c=\"\t\r\u{b}\u{1}\u{a0}\u{3000}é]{0,40}") {
            let mut pairs = Pairs::default();
            if let Some(verb) = parse_line_fast(&s, &mut pairs) {
                prop_assert_eq!(Ok(Command { verb, pairs }), parse_line_general(&s));
            }
        }

        /// Well-formed ASCII lines take the fast path.
        #[test]
        fn well_formed_lines_take_the_fast_path(pairs in proptest::collection::vec(("[a-z0-9/.*-]{0,12}", "[a-z0-9/.*-]{0,12}", any::<bool>()), 0..10)) {
            let mut line = String::from("HIT");
            for (k, v, quoted) in &pairs {
                if *quoted {
                    line.push_str(&format!(" \"{k}\"=\"{v}\""));
                } else {
                    line.push_str(&format!(" {k}={v}"));
                }
            }
            let mut pairs = Pairs::default();
            let verb = parse_line_fast(&line, &mut pairs);
            prop_assert!(verb.is_some(), "{}", line);
            prop_assert_eq!(Ok(Command { verb: verb.unwrap(), pairs }), parse_line_general(&line));
        }

        /// Any input parses or fails with a message; it never panics.
        #[test]
        fn parse_line_never_panics(s in "\\PC{0,80}") {
            let _ = parse_line(&s).map(|c| c.pairs.iter().count());
        }

        /// Pairs written the way the client library writes them read back intact.
        #[test]
        fn formatted_pairs_round_trip(pairs in proptest::collection::vec(("[a-zA-Z0-9_ =/.*-]{0,12}", "[a-zA-Z0-9_ =/.*-]{0,12}"), 0..10)) {
            let borrowed: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let line = crate::client::format_request("HIT", &borrowed).unwrap();
            let command = parse_line(&line).unwrap();
            prop_assert_eq!(command.verb, Verb::Hit);
            prop_assert_eq!(command.pairs.iter().collect::<Vec<_>>(), borrowed);
        }
    }
}
