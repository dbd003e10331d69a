//! `tollgate-loadtest`: a load generator for divvy-protocol servers (Tollgate, divvy) and for Redis.
//! This file owns a run from start to end: validating the configuration, the preflight connection
//! (which also loads the Lua script for resp-script), building the shared request table, starting one
//! event-loop thread per `--threads`, drawing the progress line, and merging the threads' results into
//! a [`Report`] (with the `--check` verdict). The binary is a thin wrapper around [`run`].

pub mod check;
pub mod config;
pub mod engine;
pub mod plot;
pub mod report;
pub mod timer;
pub mod wire;
pub mod workload;

use std::io::{IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};

pub use config::{Args, Distribution, Protocol};
pub use report::{Latency, Report};

use engine::{Counts, Plan, RunShared};
use wire::{resp_elem, Elem, RespMode};
use workload::{script_load_command, Picker, RequestTable};

/// Run the load described by `args` without a progress line.
pub fn run(args: &Args) -> Result<Report> {
    run_with_progress(args, false)
}

/// Run the load described by `args`; with `progress`, draw a live progress line on stderr (only when
/// stdout is a terminal).
pub fn run_with_progress(args: &Args, progress: bool) -> Result<Report> {
    args.validate()?;
    let addr = args.target_addr()?;
    let secs = |s: f64| (s * 1e9) as u64;
    let script_sha = preflight(args, addr)?;
    let table = RequestTable::build(args, script_sha.as_deref())?;
    let picker = Picker::new(args)?;
    let plan = Plan {
        addr,
        protocol: args.protocol,
        resp_mode: match args.protocol {
            Protocol::RespIncr => RespMode::Incr {
                limit: args.credit_limit,
            },
            _ => RespMode::Script,
        },
        threads: args.threads,
        connections: args.connections,
        pipeline: args.pipeline,
        rate: args.rate,
        warmup_ns: secs(args.warmup),
        duration_ns: secs(args.duration),
        drain_ns: secs(args.drain_secs),
        connect_timeout_ns: secs(args.connect_timeout_secs),
        requests: args.requests,
        seed: args.seed,
        check: args.check,
        script_load: (args.protocol == Protocol::RespScript).then(script_load_command),
    };
    let shared = RunShared {
        base: Instant::now(),
        table,
        picker,
        plan,
        answered: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        abort: AtomicBool::new(false),
    };
    let bar = if progress && std::io::stdout().is_terminal() {
        let total = args.warmup + args.duration;
        let bar = ProgressBar::new((total * 10.0).ceil() as u64);
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar
    } else {
        ProgressBar::hidden()
    };

    let barrier = Barrier::new(args.threads);
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let ids: Vec<usize> = (0..args.connections)
                    .filter(|c| c % args.threads == t)
                    .collect();
                let shared = &shared;
                let barrier = &barrier;
                std::thread::Builder::new()
                    .name(format!("loadtest-{t}"))
                    .spawn_scoped(scope, move || engine::run_thread(shared, &ids, barrier))
                    .expect("spawn a load thread")
            })
            .collect();
        let started = Instant::now();
        let mut last = (Instant::now(), 0u64);
        let mut rate = 0.0;
        while !handles.iter().all(|h| h.is_finished()) {
            std::thread::sleep(Duration::from_millis(100));
            let answered = shared.answered.load(Ordering::Relaxed);
            let now = Instant::now();
            let dt = now.duration_since(last.0).as_secs_f64();
            if dt >= 0.5 {
                rate = (answered - last.1) as f64 / dt;
                last = (now, answered);
            }
            bar.set_position((started.elapsed().as_secs_f64() * 10.0) as u64);
            bar.set_message(format!(
                "{answered} answers, {rate:.0}/s, {} errors",
                shared.errors.load(Ordering::Relaxed)
            ));
        }
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a load thread panicked"))?)
            .collect::<Result<Vec<_>>>()
    });
    bar.finish_and_clear();
    let results = results?;

    let mut hist = Histogram::<u64>::new_with_bounds(1, engine::LATENCY_NS_MAX, 3)?;
    let mut counts = Counts::default();
    let mut hits = Vec::new();
    let mut start = u64::MAX;
    let mut end = 0;
    for r in results {
        hist.add(&r.hist)?;
        counts.add(&r.counts);
        hits.extend(r.hits);
        start = start.min(r.measure_start_ns);
        end = end.max(r.measure_end_ns);
    }
    let duration_secs = (end.saturating_sub(start) as f64 / 1e9).max(1e-9);
    let requests = counts.allowed + counts.denied + counts.errors;
    let check = args.check.then(|| {
        check::check(
            hits,
            args.check_limit(),
            args.check_window_secs(),
            &args.actor_prefix,
        )
    });
    Ok(Report {
        config: args.clone(),
        target_addr: addr.to_string(),
        mode: if args.rate.is_some() {
            "open-loop"
        } else {
            "closed-loop"
        },
        duration_secs,
        requests,
        throughput_per_sec: requests as f64 / duration_secs,
        allowed: counts.allowed,
        denied: counts.denied,
        errors: counts.errors,
        unanswered: counts.unanswered,
        reconnects: counts.reconnects,
        latency_us: Latency::from_histogram(&hist),
        check,
        histogram: hist,
    })
}

/// Make sure the target answers before starting threads; for resp-script, load the script and return
/// its SHA1 (which the preformatted `EVALSHA` requests carry).
fn preflight(args: &Args, addr: SocketAddr) -> Result<Option<String>> {
    let timeout = Duration::from_secs_f64(args.connect_timeout_secs.max(0.1));
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("cannot connect to {addr}"))?;
    if args.protocol != Protocol::RespScript {
        return Ok(None);
    }
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(&script_load_command())
        .context("sending SCRIPT LOAD")?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    loop {
        match resp_elem(&buf, 0) {
            Err(()) => bail!("SCRIPT LOAD: the target's answer is not RESP"),
            Ok(Some((Elem::Bulk(r), _))) => {
                let sha = String::from_utf8_lossy(&buf[r]).into_owned();
                if sha.len() != 40 || !sha.bytes().all(|c| c.is_ascii_hexdigit()) {
                    bail!("SCRIPT LOAD answered {sha:?}, not a SHA1");
                }
                return Ok(Some(sha));
            }
            Ok(Some((Elem::Error(r), _))) => {
                bail!("SCRIPT LOAD failed: {}", String::from_utf8_lossy(&buf[r]))
            }
            Ok(Some((other, _))) => bail!("SCRIPT LOAD answered {other:?}"),
            Ok(None) => {
                let n = s
                    .read(&mut chunk)
                    .context("reading the SCRIPT LOAD answer")?;
                if n == 0 {
                    bail!("the target closed the connection during SCRIPT LOAD");
                }
                buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
}
