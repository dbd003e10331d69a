//! What is sent: the table of preformatted request bytes (one entry per actor, built once before the
//! run so the steady path only copies bytes: divvy `HIT` and `TAKE` lines, RESP commands, whole
//! WebSocket frames for droplet, which the all-zero masking key makes the same on every send, and
//! gRPC messages for envoy-rls, whose HTTP/2 frames are written around them per call since they carry
//! the stream id), the actor picker (uniform or Zipf, driven by a seeded per-connection `SmallRng`),
//! and divvy's fixed-window Lua script with the RESP framing around it.

use anyhow::{bail, Result};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::Zipf;

use crate::config::{Args, Distribution, Protocol};
use crate::grpc::FRAME_PAYLOAD_BYTES_MAX;
use crate::websocket::{push_client_frame, OPCODE_BINARY};

/// divvy's fixed-window step, one atomic script per hit. KEYS[1] = counter key, ARGV[1] = creditLimit,
/// ARGV[2] = resetSeconds. Answers `{allowed (1/0), credit left, TTL in seconds}`.
pub const FIXED_WINDOW_SCRIPT: &str = "\
local limit = tonumber(ARGV[1])
local reset = tonumber(ARGV[2])
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SETEX', KEYS[1], reset, limit - 1)
  return {1, limit - 1, reset}
end
local allowed = 0
local credit = 0
if tonumber(v) > 0 then
  credit = redis.call('DECR', KEYS[1])
  allowed = 1
end
return {allowed, credit, redis.call('TTL', KEYS[1])}
";

/// Upper bound on the request table, so a huge `--actors` with a long template fails early.
pub const TABLE_BYTES_MAX: usize = 2 << 30;

/// The name of actor `i` on the wire.
pub fn actor_name(prefix: &str, i: u64) -> String {
    format!("{prefix}{i}")
}

/// Append one RESP bulk string.
fn push_bulk(out: &mut Vec<u8>, item: &[u8]) {
    out.push(b'$');
    out.extend_from_slice(item.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(item);
    out.extend_from_slice(b"\r\n");
}

/// Encode a command as a RESP array of bulk strings.
pub fn resp_command(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + parts.iter().map(|p| p.len() + 16).sum::<usize>());
    out.push(b'*');
    out.extend_from_slice(parts.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for p in parts {
        push_bulk(&mut out, p);
    }
    out
}

/// `SCRIPT LOAD <fixed-window script>`.
pub fn script_load_command() -> Vec<u8> {
    resp_command(&[b"SCRIPT", b"LOAD", FIXED_WINDOW_SCRIPT.as_bytes()])
}

/// divvy's Redis key for `actor` under the configured rule.
pub fn redis_key(args: &Args, actor: u64) -> String {
    format!(
        "divvy:{}:{}:{}:{}",
        args.redis_operation,
        actor_name(&args.actor_prefix, actor),
        args.credit_limit,
        args.reset_seconds
    )
}

/// One preformatted request per actor, stored back to back.
pub struct RequestTable {
    bytes: Vec<u8>,
    /// `offsets[i]..offsets[i + 1]` is actor i's request.
    offsets: Vec<usize>,
}

impl RequestTable {
    /// Build the table for `args.protocol`. `script_sha` is needed for resp-script.
    pub fn build(args: &Args, script_sha: Option<&str>) -> Result<RequestTable> {
        let n = args.actors;
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n as usize + 1);
        offsets.push(0);
        let limit = args.credit_limit.to_string();
        let reset = args.reset_seconds.to_string();
        let template = args.template();
        let bucket_template = match args.protocol {
            Protocol::Droplet => Some(args.bucket_template()?),
            _ => None,
        };
        let envoy_template = match args.protocol {
            Protocol::EnvoyRls => Some(args.envoy_template()?),
            _ => None,
        };
        for i in 0..n {
            match args.protocol {
                Protocol::Divvy | Protocol::Take => {
                    bytes.extend_from_slice(if args.protocol == Protocol::Divvy {
                        b"HIT "
                    } else {
                        b"TAKE "
                    });
                    bytes.extend_from_slice(
                        template
                            .replace("{actor}", &actor_name(&args.actor_prefix, i))
                            .as_bytes(),
                    );
                    bytes.push(b'\n');
                }
                Protocol::Droplet => {
                    let Some(t) = bucket_template.as_ref() else {
                        bail!("droplet needs a bucket template");
                    };
                    let request = t.encode_request(&actor_name(&args.actor_prefix, i));
                    push_client_frame(&mut bytes, OPCODE_BINARY, &request);
                }
                Protocol::EnvoyRls => {
                    let Some(t) = envoy_template.as_ref() else {
                        bail!("envoy-rls needs a descriptor template");
                    };
                    let message = t.encode_message(&actor_name(&args.actor_prefix, i));
                    if message.len() > FRAME_PAYLOAD_BYTES_MAX {
                        bail!(
                            "--template and --actor-prefix make envoy-rls messages larger than \
                             {FRAME_PAYLOAD_BYTES_MAX} bytes (one HTTP/2 frame)"
                        );
                    }
                    bytes.extend_from_slice(&message);
                }
                Protocol::RespIncr => {
                    let key = redis_key(args, i);
                    bytes.extend_from_slice(&resp_command(&[b"INCR", key.as_bytes()]));
                }
                Protocol::RespScript => {
                    let Some(sha) = script_sha else {
                        bail!("resp-script needs the script's SHA1");
                    };
                    let key = redis_key(args, i);
                    bytes.extend_from_slice(&resp_command(&[
                        b"EVALSHA",
                        sha.as_bytes(),
                        b"1",
                        key.as_bytes(),
                        limit.as_bytes(),
                        reset.as_bytes(),
                    ]));
                }
            }
            if bytes.len() > TABLE_BYTES_MAX {
                bail!("request table exceeds {TABLE_BYTES_MAX} bytes: use fewer --actors or a shorter --template");
            }
            offsets.push(bytes.len());
        }
        Ok(RequestTable { bytes, offsets })
    }

    /// The request bytes of actor `i`.
    #[inline]
    pub fn get(&self, i: u32) -> &[u8] {
        let i = i as usize;
        &self.bytes[self.offsets[i]..self.offsets[i + 1]]
    }

    /// The longest request in the table, in bytes.
    pub fn longest(&self) -> usize {
        self.offsets
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }

    /// Number of actors in the table.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// True when the table has no actor.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Draws actor indexes.
#[derive(Clone)]
pub enum Picker {
    Uniform { n: u32 },
    Zipf { n: u32, zipf: Zipf<f64> },
}

impl Picker {
    pub fn new(args: &Args) -> Result<Picker> {
        let n = u32::try_from(args.actors)?;
        Ok(match args.distribution {
            Distribution::Uniform => Picker::Uniform { n },
            Distribution::Zipf => Picker::Zipf {
                n,
                zipf: Zipf::new(args.actors, args.zipf_exponent)
                    .map_err(|e| anyhow::anyhow!("zipf: {e}"))?,
            },
        })
    }

    /// The next actor index, in `0..n`.
    #[inline]
    pub fn pick(&self, rng: &mut SmallRng) -> u32 {
        match self {
            Picker::Uniform { n } => rng.gen_range(0..*n),
            Picker::Zipf { n, zipf } => {
                let rank: f64 = rng.sample(zipf);
                // Ranks are 1..=n; rank 1 (the hottest) is actor a0.
                ((rank as u64).saturating_sub(1) as u32).min(n - 1)
            }
        }
    }
}

/// The generator of global connection `conn`: a function of the seed and the index only.
pub fn connection_rng(seed: u64, conn: usize) -> SmallRng {
    // splitmix64 of the pair, so neighbouring indexes give unrelated streams.
    let mut z = seed ^ (conn as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    SmallRng::seed_from_u64(z)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["tollgate-loadtest"];
        v.extend_from_slice(extra);
        Args::parse_from(v)
    }

    #[test]
    fn divvy_requests_substitute_the_actor() {
        let a = args(&["--actors", "3", "--template", "ip={actor} x={actor}"]);
        let t = RequestTable::build(&a, None).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.get(0), b"HIT ip=a0 x=a0\n");
        assert_eq!(t.get(2), b"HIT ip=a2 x=a2\n");
    }

    #[test]
    fn take_requests_use_the_bucket_template() {
        let a = args(&["--actors", "2", "--protocol", "take"]);
        let t = RequestTable::build(&a, None).unwrap();
        assert_eq!(t.get(1), b"TAKE bucket=a1 ls=1000 lm=50000\n");
        let a = args(&[
            "--actors",
            "1",
            "--protocol",
            "take",
            "--template",
            "bucket=x{actor} lh=5",
        ]);
        let t = RequestTable::build(&a, None).unwrap();
        assert_eq!(t.get(0), b"TAKE bucket=xa0 lh=5\n");
    }

    #[test]
    fn droplet_requests_are_whole_masked_frames() {
        let a = args(&[
            "--actors",
            "2",
            "--protocol",
            "droplet",
            "--actor-prefix",
            "b",
        ]);
        let t = RequestTable::build(&a, None).unwrap();
        let payload = b"\x0a\x02b1\x12\x00\x28\xe8\x07\x30\xd0\x86\x03";
        let mut frame = vec![0x82, 0x80 | payload.len() as u8, 0, 0, 0, 0];
        frame.extend_from_slice(payload);
        assert_eq!(t.get(1), frame);
    }

    #[test]
    fn envoy_requests_are_grpc_messages() {
        let a = args(&["--actors", "2", "--protocol", "envoy-rls"]);
        let t = RequestTable::build(&a, None).unwrap();
        let m = t.get(1);
        assert_eq!(m[0], 0, "not compressed");
        assert_eq!(
            u32::from_be_bytes([m[1], m[2], m[3], m[4]]) as usize,
            m.len() - 5
        );
        assert!(m.windows(10).any(|w| w == b"\x0a\x08loadtest"), "{m:?}");
        assert!(m.ends_with(b"\x0a\x02ip\x12\x02a1"), "{m:?}");
    }

    #[test]
    fn resp_requests_use_divvy_key_layout() {
        let a = args(&["--actors", "2", "--protocol", "resp-incr"]);
        let t = RequestTable::build(&a, None).unwrap();
        let key = "divvy:ip=* method=GET path=/pantry/cookies/*:a1:3:3600";
        let want = format!("*2\r\n$4\r\nINCR\r\n${}\r\n{key}\r\n", key.len());
        assert_eq!(t.get(1), want.as_bytes());

        let a = args(&[
            "--actors",
            "1",
            "--protocol",
            "resp-script",
            "--redis-operation",
            "",
        ]);
        let sha = "0123456789012345678901234567890123456789";
        let t = RequestTable::build(&a, Some(sha)).unwrap();
        let want = format!(
            "*6\r\n$7\r\nEVALSHA\r\n$40\r\n{sha}\r\n$1\r\n1\r\n$16\r\ndivvy::a0:3:3600\r\n$1\r\n3\r\n$4\r\n3600\r\n"
        );
        assert_eq!(t.get(0), want.as_bytes());
    }

    #[test]
    fn pickers_are_deterministic_and_in_range() {
        for dist in ["uniform", "zipf"] {
            let a = args(&["--actors", "1000", "--distribution", dist]);
            let p = Picker::new(&a).unwrap();
            let mut r1 = connection_rng(7, 3);
            let mut r2 = connection_rng(7, 3);
            let s1: Vec<u32> = (0..1000).map(|_| p.pick(&mut r1)).collect();
            let s2: Vec<u32> = (0..1000).map(|_| p.pick(&mut r2)).collect();
            assert_eq!(s1, s2);
            assert!(s1.iter().all(|&x| x < 1000));
            let mut r3 = connection_rng(7, 4);
            let s3: Vec<u32> = (0..1000).map(|_| p.pick(&mut r3)).collect();
            assert_ne!(s1, s3);
        }
    }

    #[test]
    fn zipf_makes_actor_zero_hottest() {
        let a = args(&["--actors", "1000", "--distribution", "zipf"]);
        let p = Picker::new(&a).unwrap();
        let mut rng = connection_rng(1, 0);
        let mut counts = vec![0u32; 1000];
        for _ in 0..20_000 {
            counts[p.pick(&mut rng) as usize] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[10] && counts[0] > 1500);
    }
}
