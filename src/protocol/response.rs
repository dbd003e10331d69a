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

/// Appends `OK true 999 60\n` (or the like) to `out`.
pub fn encode_ok(out: &mut Vec<u8>, allowed: bool, credit: i64, next_reset_seconds: i64) {
    let mut ints = itoa::Buffer::new();
    out.extend_from_slice(if allowed { b"OK true " } else { b"OK false " });
    out.extend_from_slice(ints.format(credit).as_bytes());
    out.push(b' ');
    out.extend_from_slice(ints.format(next_reset_seconds).as_bytes());
    out.push(b'\n');
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
        encode_err(
            &mut out,
            ErrorCode::UnknownCommand,
            "Unrecognized command: FOO",
        );
        assert_eq!(
            out,
            b"OK true 999 60\nOK false 0 -1\nERR unknown-command \"Unrecognized command: FOO\"\n"
        );
    }

    #[test]
    fn newlines_in_messages_never_break_framing() {
        let mut out = Vec::new();
        encode_err(&mut out, ErrorCode::Unknown, "a\nb");
        assert_eq!(out, b"ERR unknown \"a b\"\n");
    }
}
