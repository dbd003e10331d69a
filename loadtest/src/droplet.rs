//! droplet's token-bucket requests, for `--protocol take` and `--protocol droplet`: the template
//! (`bucket={actor} ls=1000 lm=50000`, plain `key=value` words), its translation into a protobuf
//! `Droplet.Request` (proto/droplet.proto, encoded by hand: the request table is built once, so
//! nothing here is on the hot path), and the decoding of a `Droplet.Response` into accept and the
//! first balance. The decoder is allocation-free and rejects, rather than misreads, anything that
//! is not a well-formed response.
//!
//! Template words: `bucket` (required), `id`, `count`, `reset` (`true`/`false`), the limits `ls`
//! (per second), `lm` (minute), `lh` (hour), `ld` (day), `lw` (week), `lo` (month, 30 days), and,
//! for droplet only, `type` (`take`, `query` or a number). `{actor}` is replaced in `bucket` and
//! `id`; the numbers are fixed for the run.

use anyhow::{bail, Context, Result};

/// droplet's periods in field order, with their names and lengths in milliseconds.
pub const PERIODS: [(&str, u64); 6] = [
    ("ls", 1_000),
    ("lm", 60_000),
    ("lh", 3_600_000),
    ("ld", 86_400_000),
    ("lw", 7 * 86_400_000),
    ("lo", 30 * 86_400_000),
];

/// One parsed template.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BucketTemplate {
    /// The bucket name, `{actor}` not yet replaced.
    pub bucket: String,
    /// The request id (droplet's `id`, for logging); empty when not given.
    pub id: String,
    pub count: Option<i32>,
    pub reset: Option<bool>,
    /// Limits per period in [`PERIODS`] order; `None` (or 0) is "not given".
    pub limits: [Option<u32>; 6],
    /// droplet's `type`: 0 take, anything else a query.
    pub kind: Option<i32>,
}

impl BucketTemplate {
    /// Parse `template`. `allow_type`: whether `type=` is accepted (droplet only; `TAKE` lines have
    /// no such argument).
    pub fn parse(template: &str, allow_type: bool) -> Result<BucketTemplate> {
        let mut t = BucketTemplate::default();
        let mut bucket = None;
        let mut seen: Vec<&str> = Vec::new();
        for word in template.split_ascii_whitespace() {
            let Some((key, value)) = word.split_once('=') else {
                bail!("template word {word:?} is not key=value");
            };
            if seen.contains(&key) {
                bail!("template gives {key} twice");
            }
            seen.push(key);
            if key != "bucket" && key != "id" && value.contains("{actor}") {
                bail!("{{actor}} can only stand in bucket= and id=, not in {key}=");
            }
            let number = |what: &str| -> Result<i64> {
                value
                    .parse::<i64>()
                    .with_context(|| format!("template {key}={value:?}: {what}"))
            };
            match key {
                "bucket" => bucket = Some(value.to_string()),
                "id" => t.id = value.to_string(),
                "count" => {
                    let n = number("count must be an integer")?;
                    t.count = Some(i32::try_from(n).context("count must fit in 32 bits")?);
                }
                "reset" => {
                    t.reset = Some(match value {
                        "true" => true,
                        "false" => false,
                        _ => bail!("template reset={value:?}: must be true or false"),
                    })
                }
                "type" if allow_type => {
                    t.kind = Some(match value {
                        "take" => 0,
                        "query" => 1,
                        _ => i32::try_from(number("type must be take, query or a number")?)
                            .context("type must fit in 32 bits")?,
                    })
                }
                _ => {
                    let Some(i) = PERIODS.iter().position(|(name, _)| *name == key) else {
                        let also = if allow_type { ", type" } else { "" };
                        bail!(
                            "unknown template key {key:?} (expected bucket, id, count, reset, \
                             ls, lm, lh, ld, lw, lo{also})"
                        );
                    };
                    let n = number("a limit must be an integer")?;
                    t.limits[i] =
                        Some(u32::try_from(n).context("a limit must be in 0..=4294967295")?);
                }
            }
        }
        t.bucket = bucket.context("the template needs bucket=<name> (say bucket={actor})")?;
        Ok(t)
    }

    /// The limits given (non-zero), as (limit, period in ms).
    pub fn given_limits(&self) -> Vec<(u64, u64)> {
        self.limits
            .iter()
            .zip(PERIODS)
            .filter_map(|(l, (_, ms))| l.filter(|&l| l > 0).map(|l| (u64::from(l), ms)))
            .collect()
    }

    /// The protobuf `Droplet.Request` for `actor` (its name on the wire).
    pub fn encode_request(&self, actor: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.bucket.len() + self.id.len());
        let bucket = self.bucket.replace("{actor}", actor);
        let id = self.id.replace("{actor}", actor);
        push_bytes(&mut out, 1, bucket.as_bytes());
        push_bytes(&mut out, 2, id.as_bytes());
        if let Some(count) = self.count {
            // int32: negative values are sign-extended to 64 bits (ten bytes).
            push_varint_field(&mut out, 3, i64::from(count) as u64);
        }
        if let Some(reset) = self.reset {
            push_varint_field(&mut out, 4, u64::from(reset));
        }
        for (i, limit) in self.limits.iter().enumerate() {
            if let Some(limit) = limit {
                push_varint_field(&mut out, 5 + i as u32, u64::from(*limit));
            }
        }
        if let Some(kind) = self.kind {
            push_varint_field(&mut out, 11, i64::from(kind) as u64);
        }
        out
    }
}

fn push_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn push_varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    push_varint(out, u64::from(field << 3));
    push_varint(out, v);
}

fn push_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    push_varint(out, u64::from(field << 3 | 2));
    push_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Read one varint at `*pos` (at most ten bytes).
fn read_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..70).step_by(7) {
        let b = *buf.get(*pos)?;
        *pos += 1;
        v |= u64::from(b & 0x7F) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// A decoded `Droplet.Response`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropletAnswer {
    pub accept: bool,
    /// The balance of the shortest period present (the first field of `ls` … `lo`).
    pub first_balance: Option<i32>,
}

/// Decode a `Droplet.Response`; `None` when the bytes are not one (bad varint, a known field with
/// the wrong wire type, or no `accept`). Unknown fields are skipped, as protobuf requires.
pub fn decode_response(buf: &[u8]) -> Option<DropletAnswer> {
    let mut pos = 0;
    let mut accept = None;
    let mut first: Option<(u64, i32)> = None;
    while pos < buf.len() {
        let key = read_varint(buf, &mut pos)?;
        let (field, wire) = (key >> 3, key & 7);
        match (field, wire) {
            (0, _) => return None,
            (1, 0) => accept = Some(read_varint(buf, &mut pos)? != 0),
            (2..=7, 0) => {
                // int32 on the wire: the low 32 bits of the (sign-extended) varint.
                let v = read_varint(buf, &mut pos)? as u32 as i32;
                match first {
                    Some((kept, _)) if kept < field => {}
                    _ => first = Some((field, v)),
                }
            }
            (1..=7, _) => return None,
            (_, 0) => {
                read_varint(buf, &mut pos)?;
            }
            (_, 1) => pos = pos.checked_add(8)?,
            (_, 2) => {
                let len = usize::try_from(read_varint(buf, &mut pos)?).ok()?;
                pos = pos.checked_add(len)?;
            }
            (_, 5) => pos = pos.checked_add(4)?,
            _ => return None,
        }
        if pos > buf.len() {
            return None;
        }
    }
    Some(DropletAnswer {
        accept: accept?,
        first_balance: first.map(|(_, v)| v),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_parse_and_reject_what_they_cannot_send() {
        let t = BucketTemplate::parse("bucket={actor} ls=1000 lm=50000", false).unwrap();
        assert_eq!(t.bucket, "{actor}");
        assert_eq!(t.limits, [Some(1000), Some(50000), None, None, None, None]);
        assert_eq!(t.given_limits(), vec![(1000, 1000), (50000, 60_000)]);
        let t = BucketTemplate::parse(
            "  bucket=b-{actor} id=x count=-2 reset=true lo=1 type=query",
            true,
        )
        .unwrap();
        assert_eq!(
            (t.bucket.as_str(), t.id.as_str(), t.count, t.reset, t.kind),
            ("b-{actor}", "x", Some(-2), Some(true), Some(1))
        );
        for bad in [
            "ls=1",
            "bucket=a ls",
            "bucket=a lx=1",
            "bucket=a ls=-1",
            "bucket=a ls=4294967296",
            "bucket=a count=2147483648",
            "bucket=a reset=yes",
            "bucket=a ls={actor}",
            "bucket=a bucket=b",
            "bucket=a type=take",
        ] {
            assert!(BucketTemplate::parse(bad, false).is_err(), "{bad}");
        }
        assert!(BucketTemplate::parse("bucket=a type=take", true).is_ok());
    }

    #[test]
    fn requests_encode_field_by_field() {
        let t = BucketTemplate::parse("bucket={actor} ls=1000 lm=50000", false).unwrap();
        assert_eq!(
            t.encode_request("a7"),
            b"\x0a\x02a7\x12\x00\x28\xe8\x07\x30\xd0\x86\x03"
        );
        let t =
            BucketTemplate::parse("bucket=b id={actor} count=-1 reset=false type=1", true).unwrap();
        let mut want = b"\x0a\x01b\x12\x02a1\x18".to_vec();
        want.extend_from_slice(&[0xff; 9]);
        want.extend_from_slice(b"\x01\x20\x00\x58\x01");
        assert_eq!(t.encode_request("a1"), want);
    }

    #[test]
    fn responses_decode_and_junk_is_rejected() {
        let ok = |accept, first_balance| {
            Some(DropletAnswer {
                accept,
                first_balance,
            })
        };
        assert_eq!(decode_response(b"\x08\x01\x10\x09"), ok(true, Some(9)));
        assert_eq!(decode_response(b"\x08\x01"), ok(true, None));
        // Field order on the wire does not matter; the shortest period wins.
        assert_eq!(
            decode_response(b"\x18\x05\x08\x00\x10\x02"),
            ok(false, Some(2))
        );
        let mut neg = b"\x08\x00\x10".to_vec();
        neg.extend_from_slice(&[0xff; 9]);
        neg.push(0x01);
        assert_eq!(decode_response(&neg), ok(false, Some(-1)));
        // Unknown fields of every wire type are skipped.
        assert_eq!(
            decode_response(b"\x08\x01\x40\x05\x49\0\0\0\0\0\0\0\0\x52\x02xy\x5d\0\0\0\0"),
            ok(true, None)
        );
        for bad in [
            &b""[..],
            b"\x10\x01",                                         // no accept
            b"\x08",                                             // truncated varint
            b"\x0a\x01x",                                        // accept as bytes
            b"\x08\x01\x52\x05xy",                               // length past the end
            b"\x08\x01\x5b",                                     // group
            b"\x00\x01",                                         // field 0
            b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", // 11-byte varint
        ] {
            assert_eq!(decode_response(bad), None, "{bad:?}");
        }
    }
}
