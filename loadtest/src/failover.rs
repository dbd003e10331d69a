//! `tollgate-loadtest failover-probe`: measures a cluster failover as clients see it (used by
//! cluster/bench.sh). It SIGKILLs a node, then sends rounds of hits through a surviving node, one
//! round = one pipelined batch with eight actors per shard on average (so every shard is hit), back
//! to back. A round is *disturbed* when an answer is not `OK` or when it takes much longer than the
//! rounds before the kill (hits whose shard has no leader wait for the new one instead of failing,
//! up to the node's `--forward-timeout-ms`). The failover time is from the kill to the end of the
//! last disturbed round, i.e. until every shard answered again; the probe stops after five calm
//! rounds in a row, or three seconds after the kill when nothing was disturbed (the node led no
//! shard), or at `--timeout-secs`.

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

/// Rounds timed before the kill, to know what an undisturbed round takes.
const ROUNDS_BEFORE_KILL: usize = 5;
/// Calm rounds in a row after a disturbance that end the probe.
const CALM_ROUNDS_TO_END: usize = 5;
/// With nothing disturbed this long after the kill, the killed node led no shard.
const UNDISTURBED_END: Duration = Duration::from_secs(3);
/// Actors per shard in each round, on average.
const ACTORS_PER_SHARD: u32 = 8;
/// Longest a connect or a read may take.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The flags of `tollgate-loadtest failover-probe`.
#[derive(Args, Clone, Debug)]
pub struct ProbeArgs {
    /// Client address of a node that stays up, HOST:PORT.
    #[arg(long)]
    pub node: String,
    /// Process id of the node to SIGKILL.
    #[arg(long)]
    pub pid: i32,
    /// The cluster's shard count (rounds hit eight actors per shard on average).
    #[arg(long, default_value_t = 64)]
    pub shards: u32,
    /// Longest the probe runs after the kill, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub timeout_secs: f64,
}

/// What the probe saw; prints as `failover_ms=N errors=N unanswered=N slowest_round_ms=N`,
/// then `first_error="…"` when an answer was not `OK` (the first such line, or why a round
/// ended short).
#[derive(Debug, Clone, PartialEq)]
pub enum FailoverReport {
    /// The rounds before the kill already failed: nothing was killed.
    FailedBeforeKill,
    Measured {
        /// From the kill to the end of the last disturbed round (0: none was).
        failover_ms: f64,
        /// Answers after the kill that were not `OK`.
        errors: u64,
        /// Hits after the kill whose answer never came: a node closes the
        /// connection after an `ERR`, and the rest of that round goes
        /// unanswered.
        unanswered: u64,
        slowest_round_ms: f64,
        /// The first answer after the kill that was not `OK`, or why a round ended short.
        first_error: Option<String>,
    },
}

impl fmt::Display for FailoverReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailoverReport::FailedBeforeKill => f.write_str(
                "failover_ms=nan errors=before-kill unanswered=nan slowest_round_ms=nan",
            ),
            FailoverReport::Measured {
                failover_ms,
                errors,
                unanswered,
                slowest_round_ms,
                first_error,
            } => {
                write!(
                    f,
                    "failover_ms={failover_ms:.0} errors={errors} unanswered={unanswered} slowest_round_ms={slowest_round_ms:.0}"
                )?;
                match first_error {
                    Some(error) => write!(f, " first_error={error:?}"),
                    None => Ok(()),
                }
            }
        }
    }
}

/// One round's outcome.
struct Round {
    /// Every answer came and was `OK`.
    ok: bool,
    errors: u64,
    unanswered: u64,
    took: Duration,
    /// The round's first answer that was not `OK`, or why it ended short.
    first_error: Option<String>,
}

/// A connection to the surviving node, reopened after the node closes it (it does after an `ERR`).
struct Probe {
    addr: SocketAddr,
    batch: Vec<u8>,
    actors: usize,
    connection: Option<(TcpStream, BufReader<TcpStream>)>,
}

impl Probe {
    fn connect(&mut self) -> Result<()> {
        let stream = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT)
            .with_context(|| format!("cannot connect to {}", self.addr))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        let reader = BufReader::new(stream.try_clone()?);
        self.connection = Some((stream, reader));
        Ok(())
    }

    /// Sends one round and reads its answers.
    fn round(&mut self) -> Result<Round> {
        let started = Instant::now();
        let mut answers = 0;
        let mut errors = 0;
        let mut first_error = None;
        if let Some((stream, reader)) = self.connection.as_mut() {
            if stream.write_all(&self.batch).is_ok() {
                let mut line = String::new();
                while answers < self.actors {
                    line.clear();
                    match reader.read_line(&mut line) {
                        Ok(n) if n > 0 => {
                            answers += 1;
                            if !line.starts_with("OK ") {
                                errors += 1;
                                first_error.get_or_insert_with(|| line.trim_end().to_string());
                            }
                        }
                        _ => break,
                    }
                }
            }
        }
        let took = started.elapsed();
        if answers < self.actors {
            // The node closed the connection (after an ERR line) or stopped answering.
            self.connect()?;
            let why = format!(
                "the connection ended after {answers} of {} answers",
                self.actors
            );
            return Ok(Round {
                ok: false,
                errors,
                unanswered: (self.actors - answers) as u64,
                took,
                first_error: Some(
                    first_error.map_or(why.clone(), |line| format!("{line} ({why})")),
                ),
            });
        }
        Ok(Round {
            ok: errors == 0,
            errors,
            unanswered: 0,
            took,
            first_error,
        })
    }
}

/// Runs the probe: times rounds, kills `args.pid`, measures until every shard answers again.
pub fn probe(args: &ProbeArgs) -> Result<FailoverReport> {
    let addr = args
        .node
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {}", args.node))?
        .next()
        .with_context(|| format!("{} resolves to no address", args.node))?;
    let actors = (args.shards.max(1) * ACTORS_PER_SHARD) as usize;
    let batch: Vec<u8> = (0..actors)
        .flat_map(|i| format!("HIT path=/bench user=probe{i}\n").into_bytes())
        .collect();
    let mut probe = Probe {
        addr,
        batch,
        actors,
        connection: None,
    };
    probe.connect()?;
    let mut before = Vec::with_capacity(ROUNDS_BEFORE_KILL);
    for _ in 0..ROUNDS_BEFORE_KILL {
        let round = probe.round()?;
        if !round.ok {
            return Ok(FailoverReport::FailedBeforeKill);
        }
        before.push(round.took);
    }
    before.sort();
    let usual = before[before.len() / 2];
    let slow = (usual * 4).max(usual + Duration::from_millis(50));
    let timeout = Duration::from_secs_f64(args.timeout_secs.max(0.0));

    let killed = Instant::now();
    sigkill(args.pid)?;
    let mut errors = 0;
    let mut unanswered = 0;
    let mut first_error = None;
    let mut slowest = Duration::ZERO;
    let mut last_disturbed_end: Option<Instant> = None;
    let mut calm_rounds = 0;
    while killed.elapsed() < timeout {
        let round = probe.round()?;
        errors += round.errors;
        unanswered += round.unanswered;
        if first_error.is_none() {
            first_error = round.first_error;
        }
        slowest = slowest.max(round.took);
        if !round.ok || round.took > slow {
            last_disturbed_end = Some(Instant::now());
            calm_rounds = 0;
        } else {
            calm_rounds += 1;
        }
        match last_disturbed_end {
            Some(_) if calm_rounds >= CALM_ROUNDS_TO_END => break,
            None if killed.elapsed() > UNDISTURBED_END => break,
            _ => {}
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok(FailoverReport::Measured {
        failover_ms: last_disturbed_end.map_or(0.0, |end| ms(end - killed)),
        errors,
        unanswered,
        slowest_round_ms: ms(slowest),
        first_error,
    })
}

#[cfg(target_os = "linux")]
fn sigkill(pid: i32) -> Result<()> {
    if pid <= 0 {
        bail!("invalid process id {pid}");
    }
    // SAFETY: kill(2) with a valid signal number has no memory-safety preconditions.
    if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
        bail!(
            "cannot kill process {pid}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn sigkill(pid: i32) -> Result<()> {
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .context("run kill")?;
    if !status.success() {
        bail!("cannot kill process {pid}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_print_as_bench_sh_reads_them() {
        let measured = FailoverReport::Measured {
            failover_ms: 1234.4,
            errors: 3,
            unanswered: 0,
            slowest_round_ms: 980.6,
            first_error: None,
        };
        assert_eq!(
            measured.to_string(),
            "failover_ms=1234 errors=3 unanswered=0 slowest_round_ms=981"
        );
        let with_error = FailoverReport::Measured {
            failover_ms: 700.0,
            errors: 1,
            unanswered: 502,
            slowest_round_ms: 690.0,
            first_error: Some("ERR unknown \"shard 3 unavailable\"".to_string()),
        };
        assert_eq!(
            with_error.to_string(),
            "failover_ms=700 errors=1 unanswered=502 slowest_round_ms=690 first_error=\"ERR unknown \\\"shard 3 unavailable\\\"\""
        );
        assert_eq!(
            FailoverReport::FailedBeforeKill.to_string(),
            "failover_ms=nan errors=before-kill unanswered=nan slowest_round_ms=nan"
        );
    }
}
