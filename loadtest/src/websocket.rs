//! The sliver of WebSocket (RFC 6455) that `--protocol droplet` needs, client side: the HTTP/1.1
//! upgrade request and the check of its `101` answer (status and `Sec-WebSocket-Accept`), client
//! frames (always masked, here with the all-zero key so that request frames can be built once per
//! actor), and an incremental, allocation-free parser of the server's frames. Anything a server
//! should not send (a masked frame, a fragmented message, a reserved bit or opcode, a control frame
//! longer than 125 bytes) is reported as invalid rather than guessed at.

use std::ops::Range;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use sha1::{Digest, Sha1};

/// The GUID that RFC 6455 appends to the key to derive `Sec-WebSocket-Accept`.
const ACCEPT_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// Longest upgrade answer (status line and headers) accepted.
pub const HANDSHAKE_BYTES_MAX: usize = 16 * 1024;

/// Longest server frame payload accepted: an answer is a few bytes, and a frame must fit in a
/// connection's read buffer.
pub const FRAME_PAYLOAD_BYTES_MAX: u64 = 32 * 1024;

/// Frame opcodes (the low nibble of the first byte).
pub const OPCODE_CONTINUATION: u8 = 0x0;
pub const OPCODE_TEXT: u8 = 0x1;
pub const OPCODE_BINARY: u8 = 0x2;
pub const OPCODE_CLOSE: u8 = 0x8;
pub const OPCODE_PING: u8 = 0x9;
pub const OPCODE_PONG: u8 = 0xA;

/// A `Sec-WebSocket-Key`: the base64 form of 16 bytes. They need not be secret, only vary, so they
/// are derived from the seed, the connection and the attempt (splitmix64).
pub fn handshake_key(seed: u64, conn: usize, attempt: u64) -> String {
    let mut z = seed ^ (conn as u64).rotate_left(32) ^ attempt.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut bytes = [0u8; 16];
    for chunk in bytes.chunks_mut(8) {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    BASE64.encode(bytes)
}

/// The `Sec-WebSocket-Accept` a server must answer to `key`.
pub fn expected_accept(key: &str) -> String {
    let mut sha = Sha1::new();
    sha.update(key.as_bytes());
    sha.update(ACCEPT_GUID.as_bytes());
    BASE64.encode(sha.finalize())
}

/// The upgrade request: `GET /` for `host` (the target as given, `HOST:PORT`).
pub fn handshake_request(host: &str, key: &str) -> Vec<u8> {
    format!(
        "GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    .into_bytes()
}

/// Result of looking for the upgrade answer at the start of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Handshake {
    /// The upgrade was accepted; the answer took this many bytes (frames may follow).
    Accepted(usize),
    /// The head is not complete yet.
    Incomplete,
    /// The server refused or answered something else; the reason, for the error message.
    Refused(String),
}

/// Check the server's answer to the upgrade request sent with `key`.
pub fn parse_handshake(buf: &[u8], key: &str) -> Handshake {
    let Some(end) = memchr::memmem::find(buf, b"\r\n\r\n") else {
        return if buf.len() > HANDSHAKE_BYTES_MAX {
            Handshake::Refused(format!(
                "the upgrade answer exceeds {HANDSHAKE_BYTES_MAX} bytes without ending"
            ))
        } else {
            Handshake::Incomplete
        };
    };
    let head = String::from_utf8_lossy(&buf[..end]);
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or("");
    let mut words = status.split(' ');
    let (version, code) = (words.next(), words.next());
    if !matches!(version, Some(v) if v.starts_with("HTTP/1.")) || code != Some("101") {
        return Handshake::Refused(format!(
            "the WebSocket upgrade was answered {:?}, not 101 (is --target the droplet endpoint?)",
            status.chars().take(80).collect::<String>()
        ));
    }
    let accept = lines.find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("sec-websocket-accept")
            .then(|| value.trim())
    });
    let want = expected_accept(key);
    match accept {
        Some(got) if got == want => Handshake::Accepted(end + 4),
        Some(got) => Handshake::Refused(format!(
            "Sec-WebSocket-Accept is {got:?}, expected {want:?}"
        )),
        None => Handshake::Refused("the 101 answer has no Sec-WebSocket-Accept".to_string()),
    }
}

/// Append one client frame (FIN set, masked with the all-zero key, so the payload is unchanged).
pub fn push_client_frame(out: &mut Vec<u8>, opcode: u8, payload: &[u8]) {
    out.push(0x80 | (opcode & 0x0F));
    let len = payload.len();
    if len < 126 {
        out.push(0x80 | len as u8);
    } else if let Ok(len16) = u16::try_from(len) {
        out.push(0x80 | 126);
        out.extend_from_slice(&len16.to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(payload);
}

/// One complete server frame at the start of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub opcode: u8,
    /// Where the payload is, in the buffer given.
    pub payload: Range<usize>,
    /// Bytes the frame takes, header included.
    pub used: usize,
}

/// Result of looking for one server frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameParse {
    Complete(Frame),
    Incomplete,
    /// Not a frame this client accepts; the reason.
    Invalid(&'static str),
}

/// Parse the server frame at the start of `buf`.
pub fn parse_frame(buf: &[u8]) -> FrameParse {
    let [b0, b1, ..] = *buf else {
        return FrameParse::Incomplete;
    };
    let fin = b0 & 0x80 != 0;
    let opcode = b0 & 0x0F;
    if b0 & 0x70 != 0 {
        return FrameParse::Invalid("reserved bits set (no extension was negotiated)");
    }
    if b1 & 0x80 != 0 {
        return FrameParse::Invalid("a server frame is masked");
    }
    let control = opcode & 0x08 != 0;
    match opcode {
        OPCODE_TEXT | OPCODE_BINARY if fin => {}
        OPCODE_TEXT | OPCODE_BINARY | OPCODE_CONTINUATION => {
            return FrameParse::Invalid("a fragmented message")
        }
        OPCODE_CLOSE | OPCODE_PING | OPCODE_PONG if fin => {}
        OPCODE_CLOSE | OPCODE_PING | OPCODE_PONG => {
            return FrameParse::Invalid("a fragmented control frame")
        }
        _ => return FrameParse::Invalid("a reserved opcode"),
    }
    let (len, header) = match b1 & 0x7F {
        126 => {
            let Some(b) = buf.get(2..4) else {
                return FrameParse::Incomplete;
            };
            (u64::from(u16::from_be_bytes([b[0], b[1]])), 4)
        }
        127 => {
            let Some(b) = buf.get(2..10) else {
                return FrameParse::Incomplete;
            };
            let mut be = [0u8; 8];
            be.copy_from_slice(b);
            (u64::from_be_bytes(be), 10)
        }
        n => (u64::from(n), 2),
    };
    if control && len > 125 {
        return FrameParse::Invalid("a control frame longer than 125 bytes");
    }
    if len > FRAME_PAYLOAD_BYTES_MAX {
        return FrameParse::Invalid("a frame larger than any answer");
    }
    let end = header + len as usize;
    if buf.len() < end {
        return FrameParse::Incomplete;
    }
    FrameParse::Complete(Frame {
        opcode,
        payload: header..end,
        used: end,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_matches_the_rfc_example() {
        // RFC 6455 section 1.3.
        assert_eq!(
            expected_accept("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn keys_are_16_bytes_and_vary() {
        let k = handshake_key(1, 0, 0);
        assert_eq!(BASE64.decode(&k).unwrap().len(), 16);
        assert_ne!(k, handshake_key(1, 1, 0));
        assert_ne!(k, handshake_key(1, 0, 1));
        assert_eq!(k, handshake_key(1, 0, 0));
    }

    #[test]
    fn handshake_answers() {
        let key = "dGhlIHNhbXBsZSBub25jZQ==";
        let ok =
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                   sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n\x82\x02\x08\x01";
        assert_eq!(parse_handshake(ok, key), Handshake::Accepted(ok.len() - 4));
        for cut in 0..ok.len() - 4 {
            assert_eq!(parse_handshake(&ok[..cut], key), Handshake::Incomplete);
        }
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\nNot implemented";
        assert!(matches!(
            parse_handshake(plain, key),
            Handshake::Refused(m) if m.contains("200 OK")
        ));
        let wrong = b"HTTP/1.1 101 Switching Protocols\r\nSec-WebSocket-Accept: xyz\r\n\r\n";
        assert!(matches!(parse_handshake(wrong, key), Handshake::Refused(_)));
        let none = b"HTTP/1.1 101 Switching Protocols\r\n\r\n";
        assert!(matches!(parse_handshake(none, key), Handshake::Refused(_)));
        let junk = vec![b'x'; HANDSHAKE_BYTES_MAX + 1];
        assert!(matches!(parse_handshake(&junk, key), Handshake::Refused(_)));
        let request = String::from_utf8(handshake_request("127.0.0.1:3000", key)).unwrap();
        assert!(request.starts_with("GET / HTTP/1.1\r\nHost: 127.0.0.1:3000\r\n"));
        assert!(request.ends_with("Sec-WebSocket-Version: 13\r\n\r\n"));
    }

    #[test]
    fn client_frames_are_masked_with_the_zero_key() {
        let mut out = Vec::new();
        push_client_frame(&mut out, OPCODE_BINARY, b"abc");
        assert_eq!(out, b"\x82\x83\0\0\0\0abc");
        out.clear();
        push_client_frame(&mut out, OPCODE_BINARY, &[7; 300]);
        assert_eq!(&out[..8], b"\x82\xFE\x01\x2C\0\0\0\0");
        assert_eq!(out.len(), 8 + 300);
        out.clear();
        push_client_frame(&mut out, OPCODE_BINARY, &[7; 70_000]);
        assert_eq!(&out[..2], b"\x82\xFF");
        assert_eq!(&out[2..10], &70_000u64.to_be_bytes());
        assert_eq!(out.len(), 14 + 70_000);
    }

    #[test]
    fn server_frames() {
        let f = b"\x82\x02\x08\x01\x82";
        assert_eq!(
            parse_frame(f),
            FrameParse::Complete(Frame {
                opcode: OPCODE_BINARY,
                payload: 2..4,
                used: 4
            })
        );
        for cut in 0..4 {
            assert_eq!(parse_frame(&f[..cut]), FrameParse::Incomplete, "cut {cut}");
        }
        let mut long = vec![0x82, 126, 0x01, 0x00];
        long.extend_from_slice(&[0; 256]);
        assert!(matches!(
            parse_frame(&long),
            FrameParse::Complete(Frame { used: 260, .. })
        ));
        assert_eq!(parse_frame(&long[..259]), FrameParse::Incomplete);
        assert!(matches!(
            parse_frame(b"\x88\x02\x03\xe8"),
            FrameParse::Complete(Frame {
                opcode: OPCODE_CLOSE,
                ..
            })
        ));
        for bad in [
            &b"\x82\x82\0\0\0\0ab"[..],    // masked
            b"\x02\x01a",                  // not FIN
            b"\x80\x01a",                  // continuation
            b"\xc2\x01a",                  // RSV1
            b"\x83\x01a",                  // reserved opcode
            b"\x89\x7e\x00\x7e",           // control frame of 126 bytes
            b"\x82\x7f\0\0\0\x01\0\0\0\0", // 4 GiB
        ] {
            assert!(
                matches!(parse_frame(bad), FrameParse::Invalid(_)),
                "{bad:?}"
            );
        }
    }
}
