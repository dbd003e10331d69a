//! The divvy line protocol: framing, tokenizing and parsing request lines into
//! [`Command`]s, and encoding responses. This module knows bytes and commands,
//! nothing about rules or storage (SPEC §1).
//!
//! The parser is zero-copy: a parsed command borrows its keys and values from
//! the line, so a HIT costs no allocation here.

mod parse;
mod response;

pub use parse::{
    bytes_eq, is_whitespace, parse_line, parse_line_into, short_words, Command, Pairs, ParseError,
    Verb,
};
pub use response::{encode_err, encode_ok, ErrorCode};

/// Finds the end of the next complete line in `buf`. Returns the line without
/// its terminator (`\n` or `\r\n`) and the number of bytes it occupied,
/// terminator included. A lone `\r` does not end a line.
pub fn split_line(buf: &[u8]) -> Option<(&[u8], usize)> {
    let newline = memchr::memchr(b'\n', buf)?;
    let mut line = &buf[..newline];
    if let [rest @ .., b'\r'] = line {
        line = rest;
    }
    Some((line, newline + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_line_handles_both_terminators_and_lone_cr() {
        assert_eq!(split_line(b"HIT a=b\n"), Some((&b"HIT a=b"[..], 8)));
        assert_eq!(split_line(b"HIT a=b\r\nX"), Some((&b"HIT a=b"[..], 9)));
        assert_eq!(split_line(b"HIT a\rb\n"), Some((&b"HIT a\rb"[..], 8)));
        assert_eq!(split_line(b"HIT a=b"), None);
        assert_eq!(split_line(b"HIT\r"), None);
    }
}
