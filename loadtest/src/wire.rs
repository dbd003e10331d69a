//! Answer parsing, incremental and allocation-free: divvy's `OK`/`ERR` lines, `TAKE`'s
//! `OK <accept> l?=<n> ...` lines, droplet's WebSocket frames carrying a protobuf `Droplet.Response`,
//! and the subset of Redis RESP2 the generator meets (integers, bulk and simple strings, errors,
//! arrays). Each parser looks at the unread bytes of a connection's buffer and says how many bytes
//! one complete answer takes, or that more bytes are needed, or that the bytes are not a valid
//! answer.

use std::ops::Range;

use crate::droplet::decode_response;
use crate::websocket::{
    parse_frame, FrameParse, OPCODE_BINARY, OPCODE_CLOSE, OPCODE_PING, OPCODE_PONG, OPCODE_TEXT,
};

/// The meaning of one answer, as far as the statistics care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The hit was allowed; `credit` is the credit left that the server reported.
    Allowed { credit: i64 },
    /// The hit was denied.
    Denied,
    /// An error answer. divvy closes the connection after one (and so does droplet's endpoint: a
    /// close frame is this answer); `noscript` marks Redis's `NOSCRIPT`.
    Error { noscript: bool },
    /// Any other well-formed answer (for example the SHA1 that `SCRIPT LOAD` returns).
    Other,
}

/// Result of looking for one answer at the start of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parse {
    /// One answer, taking this many bytes.
    Complete(usize, Reply),
    /// A WebSocket control frame that answers no request, taking `used` bytes: a ping (to be
    /// answered by a pong carrying the bytes at `ping` of the buffer), or a pong (`ping: None`).
    Control {
        used: usize,
        ping: Option<Range<usize>>,
    },
    /// Not enough bytes yet.
    Incomplete,
    /// Not a valid answer: the connection is out of step and must be dropped.
    Invalid,
}

#[inline]
fn find_newline(buf: &[u8]) -> Option<usize> {
    memchr::memchr(b'\n', buf)
}

/// Parse a signed decimal integer that spans all of `s`.
#[inline]
fn parse_i64(s: &[u8]) -> Option<i64> {
    let (neg, digits) = match s.first()? {
        b'-' => (true, &s[1..]),
        _ => (false, s),
    };
    if digits.is_empty() || digits.len() > 18 {
        return None;
    }
    let mut v: i64 = 0;
    for &c in digits {
        if !c.is_ascii_digit() {
            return None;
        }
        v = v * 10 + i64::from(c - b'0');
    }
    Some(if neg { -v } else { v })
}

/// The next answer line of a line protocol (without `\n` or `\r\n`) and the
/// index of its `\n`; `Err` when the line is not complete yet, or when a
/// partial line is far longer than any answer (we are out of step).
fn answer_line(buf: &[u8]) -> Result<(&[u8], usize), Parse> {
    let Some(nl) = find_newline(buf) else {
        return Err(if buf.len() > 64 * 1024 {
            Parse::Invalid
        } else {
            Parse::Incomplete
        });
    };
    let line = &buf[..nl];
    Ok((line.strip_suffix(b"\r").unwrap_or(line), nl))
}

/// One divvy answer: `OK true|false <credit> <reset>\n` or `ERR <code> "<message>"\n`.
pub fn parse_divvy(buf: &[u8]) -> Parse {
    let (line, nl) = match answer_line(buf) {
        Ok(found) => found,
        Err(parse) => return parse,
    };
    let reply = if let Some(rest) = line.strip_prefix(b"OK ") {
        let (allowed, rest) = if let Some(r) = rest.strip_prefix(b"true ") {
            (true, r)
        } else if let Some(r) = rest.strip_prefix(b"false ") {
            (false, r)
        } else {
            return Parse::Invalid;
        };
        let Some(sp) = rest.iter().position(|&c| c == b' ') else {
            return Parse::Invalid;
        };
        let (Some(credit), Some(_reset)) = (parse_i64(&rest[..sp]), parse_i64(&rest[sp + 1..]))
        else {
            return Parse::Invalid;
        };
        if allowed {
            Reply::Allowed { credit }
        } else {
            Reply::Denied
        }
    } else if line.starts_with(b"ERR ") {
        Reply::Error { noscript: false }
    } else {
        return Parse::Invalid;
    };
    Parse::Complete(nl + 1, reply)
}

/// One `TAKE` answer: `OK true|false` then zero or more ` l<s|m|h|d|w|o>=<integer>`, then `\n`; or
/// `ERR <code> "<message>"\n`. The first balance stands in for the credit.
pub fn parse_take(buf: &[u8]) -> Parse {
    let (line, nl) = match answer_line(buf) {
        Ok(found) => found,
        Err(parse) => return parse,
    };
    let reply = if let Some(rest) = line.strip_prefix(b"OK ") {
        let (allowed, mut rest) = if let Some(r) = rest.strip_prefix(b"true") {
            (true, r)
        } else if let Some(r) = rest.strip_prefix(b"false") {
            (false, r)
        } else {
            return Parse::Invalid;
        };
        let mut first = None;
        while !rest.is_empty() {
            let [b' ', b'l', period, b'=', tail @ ..] = rest else {
                return Parse::Invalid;
            };
            if !b"smhdwo".contains(period) {
                return Parse::Invalid;
            }
            let end = tail.iter().position(|&c| c == b' ').unwrap_or(tail.len());
            let Some(balance) = parse_i64(&tail[..end]) else {
                return Parse::Invalid;
            };
            first.get_or_insert(balance);
            rest = &tail[end..];
        }
        if allowed {
            Reply::Allowed {
                credit: first.unwrap_or(0),
            }
        } else {
            Reply::Denied
        }
    } else if line.starts_with(b"ERR ") {
        Reply::Error { noscript: false }
    } else {
        return Parse::Invalid;
    };
    Parse::Complete(nl + 1, reply)
}

/// One droplet answer: a binary frame holding a `Droplet.Response` (accept, then balances; the first
/// balance stands in for the credit). A close frame is an error answer; a text frame or a binary one
/// that is not a response is an unexpected answer; pings and pongs answer nothing.
pub fn parse_droplet(buf: &[u8]) -> Parse {
    let frame = match parse_frame(buf) {
        FrameParse::Complete(frame) => frame,
        FrameParse::Incomplete => return Parse::Incomplete,
        FrameParse::Invalid(_) => return Parse::Invalid,
    };
    let reply = match frame.opcode {
        OPCODE_BINARY => match decode_response(&buf[frame.payload]) {
            Some(a) if a.accept => Reply::Allowed {
                credit: i64::from(a.first_balance.unwrap_or(0)),
            },
            Some(_) => Reply::Denied,
            None => Reply::Other,
        },
        OPCODE_TEXT => Reply::Other,
        OPCODE_CLOSE => Reply::Error { noscript: false },
        OPCODE_PING => {
            return Parse::Control {
                used: frame.used,
                ping: Some(frame.payload),
            }
        }
        OPCODE_PONG => {
            return Parse::Control {
                used: frame.used,
                ping: None,
            }
        }
        _ => return Parse::Invalid,
    };
    Parse::Complete(frame.used, reply)
}

/// One RESP element header or scalar.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Elem {
    Int(i64),
    Simple(Range<usize>),
    Error(Range<usize>),
    Bulk(Range<usize>),
    Nil,
    Array(usize),
}

/// Read one element starting at `pos`: `Ok(None)` when incomplete, `Err(())` when invalid, else the
/// element and the position after it (for an array: after its header only).
#[allow(clippy::result_unit_err)]
pub fn resp_elem(buf: &[u8], pos: usize) -> Result<Option<(Elem, usize)>, ()> {
    let Some(&kind) = buf.get(pos) else {
        return Ok(None);
    };
    let Some(nl) = find_newline(&buf[pos..]) else {
        return if buf.len() - pos > 64 * 1024 {
            Err(())
        } else {
            Ok(None)
        };
    };
    let end = pos + nl; // index of '\n'
    if end == pos || buf[end - 1] != b'\r' {
        return Err(());
    }
    let body = pos + 1..end - 1;
    let next = end + 1;
    match kind {
        b'+' => Ok(Some((Elem::Simple(body), next))),
        b'-' => Ok(Some((Elem::Error(body), next))),
        b':' => parse_i64(&buf[body])
            .map(|v| Some((Elem::Int(v), next)))
            .ok_or(()),
        b'$' => {
            let len = parse_i64(&buf[body]).ok_or(())?;
            if len < 0 {
                return Ok(Some((Elem::Nil, next)));
            }
            let len = len as usize;
            if buf.len() < next + len + 2 {
                return Ok(None);
            }
            if &buf[next + len..next + len + 2] != b"\r\n" {
                return Err(());
            }
            Ok(Some((Elem::Bulk(next..next + len), next + len + 2)))
        }
        b'*' => {
            let n = parse_i64(&buf[body]).ok_or(())?;
            if n < 0 {
                Ok(Some((Elem::Nil, next)))
            } else {
                Ok(Some((Elem::Array(n as usize), next)))
            }
        }
        _ => Err(()),
    }
}

/// Skip one whole element (arrays recursively, to a bounded depth). Returns the position after it and
/// the element itself; for an array, also up to its first three integer members.
type Skipped = (Elem, usize, [Option<i64>; 3]);

fn resp_skip(buf: &[u8], pos: usize, depth: u32) -> Result<Option<Skipped>, ()> {
    if depth > 8 {
        return Err(());
    }
    let Some((elem, mut next)) = resp_elem(buf, pos)? else {
        return Ok(None);
    };
    let mut ints = [None; 3];
    if let Elem::Array(n) = elem {
        let mut slots = ints.iter_mut();
        for _ in 0..n {
            let Some((member, after, _)) = resp_skip(buf, next, depth + 1)? else {
                return Ok(None);
            };
            let slot = slots.next();
            if let (Elem::Int(v), Some(slot)) = (member, slot) {
                *slot = Some(v);
            }
            next = after;
        }
    }
    Ok(Some((elem, next, ints)))
}

/// How RESP answers are read.
#[derive(Clone, Copy, Debug)]
pub enum RespMode {
    /// `INCR`: the counter's new value; allowed while it is <= `limit`.
    Incr { limit: i64 },
    /// divvy's script: `{allowed, credit, ttl}`.
    Script,
}

/// One RESP answer.
pub fn parse_resp(buf: &[u8], mode: RespMode) -> Parse {
    match resp_skip(buf, 0, 0) {
        Err(()) => Parse::Invalid,
        Ok(None) => Parse::Incomplete,
        Ok(Some((elem, used, ints))) => {
            let reply = match (elem, mode) {
                (Elem::Error(r), _) => Reply::Error {
                    noscript: buf[r].starts_with(b"NOSCRIPT"),
                },
                (Elem::Int(v), RespMode::Incr { limit }) => {
                    if v <= limit {
                        Reply::Allowed { credit: limit - v }
                    } else {
                        Reply::Denied
                    }
                }
                (Elem::Array(3), RespMode::Script) => match ints {
                    [Some(1), Some(credit), Some(_)] => Reply::Allowed { credit },
                    [Some(0), Some(_), Some(_)] => Reply::Denied,
                    _ => Reply::Other,
                },
                _ => Reply::Other,
            };
            Parse::Complete(used, reply)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divvy_answers() {
        assert_eq!(
            parse_divvy(b"OK true 2 3600\nOK"),
            Parse::Complete(15, Reply::Allowed { credit: 2 })
        );
        assert_eq!(
            parse_divvy(b"OK false 0 -1\n"),
            Parse::Complete(14, Reply::Denied)
        );
        assert_eq!(
            parse_divvy(b"OK true -1 0\r\n"),
            Parse::Complete(14, Reply::Allowed { credit: -1 })
        );
        assert_eq!(
            parse_divvy(b"ERR unknown-command \"Unrecognized command: FOO\"\n"),
            Parse::Complete(48, Reply::Error { noscript: false })
        );
        assert_eq!(parse_divvy(b"OK true 2 36"), Parse::Incomplete);
        assert_eq!(parse_divvy(b""), Parse::Incomplete);
        assert_eq!(parse_divvy(b"OK maybe 1 2\n"), Parse::Invalid);
        assert_eq!(parse_divvy(b"OK true 1\n"), Parse::Invalid);
        assert_eq!(parse_divvy(b"OK true x 1\n"), Parse::Invalid);
        assert_eq!(parse_divvy(b"HELLO\n"), Parse::Invalid);
    }

    #[test]
    fn take_answers() {
        assert_eq!(
            parse_take(b"OK true ls=999 lm=49999\nOK"),
            Parse::Complete(24, Reply::Allowed { credit: 999 })
        );
        assert_eq!(
            parse_take(b"OK false ls=-1 lm=3\r\n"),
            Parse::Complete(21, Reply::Denied)
        );
        assert_eq!(
            parse_take(b"OK true\n"),
            Parse::Complete(8, Reply::Allowed { credit: 0 })
        );
        assert_eq!(
            parse_take(b"OK true lo=-2147483648\n"),
            Parse::Complete(
                23,
                Reply::Allowed {
                    credit: -2147483648
                }
            )
        );
        assert_eq!(
            parse_take(b"ERR unknown \"TAKE needs bucket=<name>\"\n"),
            Parse::Complete(39, Reply::Error { noscript: false })
        );
        assert_eq!(parse_take(b"OK true ls=9"), Parse::Incomplete);
        for bad in [
            &b"OK true 2 3600\n"[..],
            b"OK truest\n",
            b"OK true ls=\n",
            b"OK true lx=1\n",
            b"OK true ls=1 \n",
            b"OK true  ls=1\n",
            b"OK true ls=1x\n",
            b"OK maybe\n",
            b"HELLO\n",
        ] {
            assert_eq!(parse_take(bad), Parse::Invalid, "{bad:?}");
        }
    }

    #[test]
    fn droplet_answers() {
        assert_eq!(
            parse_droplet(b"\x82\x04\x08\x01\x10\x09\x82"),
            Parse::Complete(6, Reply::Allowed { credit: 9 })
        );
        assert_eq!(
            parse_droplet(b"\x82\x02\x08\x00"),
            Parse::Complete(4, Reply::Denied)
        );
        assert_eq!(parse_droplet(b"\x82\x04\x08\x01\x10"), Parse::Incomplete);
        assert_eq!(
            parse_droplet(b"\x82\x02\x10\x01"),
            Parse::Complete(4, Reply::Other)
        );
        assert_eq!(
            parse_droplet(b"\x81\x02hi"),
            Parse::Complete(4, Reply::Other)
        );
        assert_eq!(
            parse_droplet(b"\x88\x02\x03\xe8"),
            Parse::Complete(4, Reply::Error { noscript: false })
        );
        assert_eq!(
            parse_droplet(b"\x89\x01z"),
            Parse::Control {
                used: 3,
                ping: Some(2..3)
            }
        );
        assert_eq!(
            parse_droplet(b"\x8a\x00"),
            Parse::Control {
                used: 2,
                ping: None
            }
        );
        assert_eq!(parse_droplet(b"\x82\x82\0\0\0\0\x08\x01"), Parse::Invalid);
    }

    #[test]
    fn resp_incr_answers() {
        let m = RespMode::Incr { limit: 3 };
        assert_eq!(
            parse_resp(b":1\r\n", m),
            Parse::Complete(4, Reply::Allowed { credit: 2 })
        );
        assert_eq!(
            parse_resp(b":4\r\n:5", m),
            Parse::Complete(4, Reply::Denied)
        );
        assert_eq!(parse_resp(b":4\r", m), Parse::Incomplete);
        assert_eq!(
            parse_resp(b"-ERR wrong type\r\n", m),
            Parse::Complete(17, Reply::Error { noscript: false })
        );
        assert_eq!(parse_resp(b"?x\r\n", m), Parse::Invalid);
        assert_eq!(parse_resp(b":x\r\n", m), Parse::Invalid);
    }

    #[test]
    fn resp_script_answers() {
        let m = RespMode::Script;
        let ok = b"*3\r\n:1\r\n:2\r\n:3600\r\n";
        assert_eq!(
            parse_resp(ok, m),
            Parse::Complete(ok.len(), Reply::Allowed { credit: 2 })
        );
        for cut in 0..ok.len() {
            assert_eq!(parse_resp(&ok[..cut], m), Parse::Incomplete, "cut {cut}");
        }
        let no = b"*3\r\n:0\r\n:0\r\n:17\r\n";
        assert_eq!(parse_resp(no, m), Parse::Complete(no.len(), Reply::Denied));
        let e = b"-NOSCRIPT No matching script. Please use EVAL.\r\n";
        assert_eq!(
            parse_resp(e, m),
            Parse::Complete(e.len(), Reply::Error { noscript: true })
        );
        let sha = b"$40\r\n0123456789012345678901234567890123456789\r\n";
        assert_eq!(parse_resp(sha, m), Parse::Complete(sha.len(), Reply::Other));
        assert_eq!(parse_resp(&sha[..20], m), Parse::Incomplete);
        assert_eq!(parse_resp(b"$-1\r\n", m), Parse::Complete(5, Reply::Other));
        assert_eq!(
            parse_resp(b"*1\r\n*1\r\n$1\r\nx\r\n", m),
            Parse::Complete(15, Reply::Other)
        );
        assert_eq!(parse_resp(b"$1\r\nxy\r\n", m), Parse::Invalid);
    }
}
