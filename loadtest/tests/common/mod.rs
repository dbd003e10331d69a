//! Test doubles shared by the integration tests: tiny servers on 127.0.0.1 port 0 (std threads, one
//! per connection) that speak divvy's line protocol or a sliver of Redis RESP with fixed, known
//! behaviour, and that tally what they answered so the generator's report can be compared with it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// What a fake divvy server does.
#[derive(Clone, Debug)]
pub struct DivvyBehaviour {
    /// Each actor (the value of `ip=`) is allowed this many times in all, then denied.
    pub limit: u32,
    /// Sleep before each answer.
    pub delay: Duration,
    /// Answer every n-th line (counted over all connections) with an ERR and close.
    pub err_every: Option<u64>,
    /// Report credits as if the limit were this (a server that over-admits but looks plausible).
    pub claimed_limit: Option<u32>,
}

impl Default for DivvyBehaviour {
    fn default() -> Self {
        DivvyBehaviour {
            limit: 5,
            delay: Duration::ZERO,
            err_every: None,
            claimed_limit: None,
        }
    }
}

/// What a fake server answered.
#[derive(Default)]
pub struct Tally {
    pub allowed: AtomicU64,
    pub denied: AtomicU64,
    pub errors: AtomicU64,
    pub lines: AtomicU64,
    /// Reads from the divvy connections that returned bytes (how many pieces the lines came in).
    pub reads: AtomicU64,
    pub connections: AtomicU64,
    /// Hits per actor.
    pub per_actor: Mutex<HashMap<String, u32>>,
}

impl Tally {
    pub fn get(&self, which: &AtomicU64) -> u64 {
        which.load(Ordering::SeqCst)
    }
}

pub struct FakeServer {
    pub addr: SocketAddr,
    pub tally: Arc<Tally>,
}

impl FakeServer {
    pub fn target(&self) -> String {
        self.addr.to_string()
    }
}

/// Start a fake divvy server; it lives until the test process exits.
pub fn divvy_server(b: DivvyBehaviour) -> FakeServer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let tally = Arc::new(Tally::default());
    let t = tally.clone();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            t.connections.fetch_add(1, Ordering::SeqCst);
            let (t, b) = (t.clone(), b.clone());
            thread::spawn(move || {
                let _ = serve_divvy(stream, &t, &b);
            });
        }
    });
    FakeServer { addr, tally }
}

/// A reader that counts its reads that returned bytes into [`Tally::reads`].
struct CountingReader<'a> {
    inner: TcpStream,
    tally: &'a Tally,
}

impl Read for CountingReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n > 0 {
            self.tally.reads.fetch_add(1, Ordering::SeqCst);
        }
        Ok(n)
    }
}

fn serve_divvy(stream: TcpStream, t: &Tally, b: &DivvyBehaviour) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(CountingReader {
        inner: stream.try_clone()?,
        tally: t,
    });
    let mut out = BufWriter::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let n = t.lines.fetch_add(1, Ordering::SeqCst) + 1;
        if !b.delay.is_zero() {
            thread::sleep(b.delay);
        }
        if b.err_every.is_some_and(|e| n.is_multiple_of(e)) {
            t.errors.fetch_add(1, Ordering::SeqCst);
            out.write_all(b"ERR unknown \"deliberate\"\n")?;
            out.flush()?;
            return Ok(());
        }
        let actor = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("ip="))
            .unwrap_or("")
            .to_string();
        let count = {
            let mut m = t.per_actor.lock().unwrap();
            let c = m.entry(actor).or_insert(0);
            *c += 1;
            *c
        };
        if count <= b.limit {
            t.allowed.fetch_add(1, Ordering::SeqCst);
            let claimed = b.claimed_limit.unwrap_or(b.limit);
            writeln!(out, "OK true {} 10", claimed.saturating_sub(count))?;
        } else {
            t.denied.fetch_add(1, Ordering::SeqCst);
            out.write_all(b"OK false 0 10\n")?;
        }
        if reader.buffer().is_empty() {
            out.flush()?;
        }
    }
}

/// A sliver of Redis: `INCR` (a real counter per key), `SCRIPT LOAD` (answers a fixed SHA1) and
/// `EVALSHA` (allowed while a per-key counter stays under `limit`). The first `noscript` EVALSHAs
/// (over all connections) answer `NOSCRIPT`, as after a `SCRIPT FLUSH`.
pub fn resp_server(limit: i64, noscript: u64) -> FakeServer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let tally = Arc::new(Tally::default());
    let t = tally.clone();
    let left = Arc::new(AtomicU64::new(noscript));
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            t.connections.fetch_add(1, Ordering::SeqCst);
            let (t, left) = (t.clone(), left.clone());
            thread::spawn(move || {
                let _ = serve_resp(stream, &t, limit, &left);
            });
        }
    });
    FakeServer { addr, tally }
}

pub const FAKE_SHA: &str = "0123456789abcdef0123456789abcdef01234567";

fn read_command(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<Vec<Vec<u8>>>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let n: usize = line.trim_end().strip_prefix('*').unwrap().parse().unwrap();
    let mut parts = Vec::with_capacity(n);
    for _ in 0..n {
        line.clear();
        r.read_line(&mut line)?;
        let len: usize = line.trim_end().strip_prefix('$').unwrap().parse().unwrap();
        let mut buf = vec![0u8; len + 2];
        r.read_exact(&mut buf)?;
        buf.truncate(len);
        parts.push(buf);
    }
    Ok(Some(parts))
}

fn serve_resp(
    stream: TcpStream,
    t: &Tally,
    limit: i64,
    noscript: &AtomicU64,
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = BufWriter::new(stream);
    while let Some(cmd) = read_command(&mut reader)? {
        t.lines.fetch_add(1, Ordering::SeqCst);
        let name = String::from_utf8_lossy(&cmd[0]).to_uppercase();
        match name.as_str() {
            "SCRIPT" => write!(out, "$40\r\n{FAKE_SHA}\r\n")?,
            "INCR" | "EVALSHA" => {
                if name == "EVALSHA"
                    && noscript
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                        .is_ok()
                {
                    t.errors.fetch_add(1, Ordering::SeqCst);
                    out.write_all(b"-NOSCRIPT No matching script. Please use EVAL.\r\n")?;
                } else {
                    let key = String::from_utf8_lossy(&cmd[if name == "INCR" { 1 } else { 3 }]);
                    let count = {
                        let mut m = t.per_actor.lock().unwrap();
                        let c = m.entry(key.into_owned()).or_insert(0);
                        *c += 1;
                        i64::from(*c)
                    };
                    if name == "INCR" {
                        write!(out, ":{count}\r\n")?;
                        if count <= limit {
                            t.allowed.fetch_add(1, Ordering::SeqCst);
                        } else {
                            t.denied.fetch_add(1, Ordering::SeqCst);
                        }
                    } else if count <= limit {
                        t.allowed.fetch_add(1, Ordering::SeqCst);
                        write!(out, "*3\r\n:1\r\n:{}\r\n:60\r\n", limit - count)?;
                    } else {
                        t.denied.fetch_add(1, Ordering::SeqCst);
                        out.write_all(b"*3\r\n:0\r\n:0\r\n:60\r\n")?;
                    }
                }
            }
            _ => out.write_all(b"-ERR unknown command\r\n")?,
        }
        if reader.buffer().is_empty() {
            out.flush()?;
        }
    }
    Ok(())
}

/// Parse generator flags (split on whitespace) into its configuration.
pub fn args(flags: &str) -> tollgate_loadtest::Args {
    let argv = std::iter::once("tollgate-loadtest").chain(flags.split_whitespace());
    tollgate_loadtest::Args::parse_from_iter(argv).unwrap()
}

/// The error of a run with these flags (with its causes), which must fail.
pub fn refusal(flags: &str) -> String {
    format!("{:#}", tollgate_loadtest::run(&args(flags)).unwrap_err())
}

/// Run the built generator with `flags` and return what it printed; it must exit 0.
pub fn run_binary<I, S>(flags: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate-loadtest"))
        .args(flags)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
