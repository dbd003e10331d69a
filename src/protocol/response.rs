//! Response encoding: `OK <isAllowed> <currentCredit> <nextResetSeconds>\n`
//! and `ERR <code> "<message>"\n`, written into a caller's buffer so that many
//! responses go out in one write.

/// The error codes divvy's clients understand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The command word is not known.
    UnknownCommand,
    /// Anything else: a malformed line, a limit exceeded, a backend failure.
    Unknown,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::UnknownCommand => "unknown-command",
            ErrorCode::Unknown => "unknown",
        }
    }
}

/// Appends `OK true 999 60\n` (or the like) to `out`. The line is built in
/// a fixed-size block on the stack and copied whole into `out`'s spare
/// capacity: no library call, one capacity check.
pub fn encode_ok(out: &mut Vec<u8>, allowed: bool, credit: i64, next_reset_seconds: i64) {
    let mut line = [0u8; OK_LINE_BYTES_MAX];
    let mut len = if allowed {
        line[..8].copy_from_slice(b"OK true ");
        8
    } else {
        line[..9].copy_from_slice(b"OK false ");
        9
    };
    len = write_int(&mut line, len, credit);
    line[len] = b' ';
    len = write_int(&mut line, len + 1, next_reset_seconds);
    line[len] = b'\n';
    len += 1;
    out.reserve(OK_LINE_BYTES_MAX);
    // SAFETY: `reserve` made room for the whole block after `out.len()`; the
    // copy (of a constant size: a few vector moves) initialises it, and the
    // new length covers only the `len <= OK_LINE_BYTES_MAX` bytes of the line.
    unsafe {
        let end = out.as_mut_ptr().add(out.len());
        std::ptr::copy_nonoverlapping(line.as_ptr(), end, OK_LINE_BYTES_MAX);
        out.set_len(out.len() + len);
    }
}

/// The block an `OK` line is built in: `OK false `, two 20-character
/// integers, a space and the newline fit.
const OK_LINE_BYTES_MAX: usize = 64;

/// Writes `n` in decimal at `at`; returns the position after it.
fn write_int(line: &mut [u8; OK_LINE_BYTES_MAX], at: usize, n: i64) -> usize {
    if (0..10).contains(&n) {
        line[at] = b'0' + n as u8; // the common case: a small credit
        return at + 1;
    }
    let mut ints = itoa::Buffer::new();
    let text = ints.format(n).as_bytes();
    line[at..at + text.len()].copy_from_slice(text);
    at + text.len()
}

/// Appends `ERR <code> "<message>"\n` to `out`. The message is not escaped, as
/// in divvy; a `\n` inside it would break framing, so it is replaced.
pub fn encode_err(out: &mut Vec<u8>, code: ErrorCode, message: &str) {
    out.extend_from_slice(b"ERR ");
    out.extend_from_slice(code.as_str().as_bytes());
    out.extend_from_slice(b" \"");
    out.extend(message.bytes().map(|b| if b == b'\n' { b' ' } else { b }));
    out.extend_from_slice(b"\"\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_exact_bytes() {
        let mut out = Vec::new();
        encode_ok(&mut out, true, 999, 60);
        encode_ok(&mut out, false, 0, -1);
        encode_ok(&mut out, true, i64::MAX, i64::MIN);
        encode_ok(&mut out, false, 9, 10);
        encode_ok(&mut out, true, 99, 100);
        encode_ok(&mut out, true, 999, 1000);
        encode_ok(&mut out, true, 9999, 10000);
        encode_err(
            &mut out,
            ErrorCode::UnknownCommand,
            "Unrecognized command: FOO",
        );
        assert_eq!(
            out,
            b"OK true 999 60\nOK false 0 -1\nOK true 9223372036854775807 -9223372036854775808\nOK false 9 10\nOK true 99 100\nOK true 999 1000\nOK true 9999 10000\nERR unknown-command \"Unrecognized command: FOO\"\n"
        );
    }

    #[test]
    fn newlines_in_messages_never_break_framing() {
        let mut out = Vec::new();
        encode_err(&mut out, ErrorCode::Unknown, "a\nb");
        assert_eq!(out, b"ERR unknown \"a b\"\n");
    }
}
