//! `tollgate-loadtest`: a load generator for divvy-protocol servers (Tollgate, divvy), for droplet's
//! token buckets (`TAKE` lines, and protobuf over WebSocket), for Envoy's rate limit service (gRPC)
//! and for Redis. This file owns a run from start to end: validating the configuration, raising the
//! open-files limit, the preflight connection (which also loads the Lua script for resp-script, tries
//! the WebSocket upgrade for droplet, and checks for HTTP/2 for envoy-rls),
//! building the shared request table, starting one event-loop thread per `--threads`, drawing the
//! progress line and writing the per-second `--interval-json` lines, and merging the threads' results
//! into a [`Report`] (with the `--check` verdict, and the `--window-log` CSV written at the end). The
//! binary is a thin wrapper around [`run`].

pub mod check;
pub mod config;
pub mod droplet;
pub mod event_loop;
pub mod failover;
pub mod fd_limit;
pub mod grpc;
pub mod plot;
pub mod report;
pub mod routes;
pub mod timer;
pub mod websocket;
pub mod windows;
pub mod wire;
pub mod workload;

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};

pub use config::{Args, Distribution, Mode, Protocol};
pub use report::{Latency, Report};

use check::PeriodLimit;
use event_loop::{Counts, Plan, RunShared};
use websocket::{handshake_key, handshake_request, parse_handshake, Handshake};
use windows::Windows;
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
    let addrs = args.target_addrs()?;
    let secs = |s: f64| (s * 1e9) as u64;
    fd_limit::ensure(fd_limit::needed(args.connections, args.threads))?;
    let mut script_sha = None;
    for &addr in &addrs {
        script_sha = preflight(args, addr)?;
    }
    let mut intervals = match &args.interval_json {
        Some(path) => Some(IntervalWriter::create(path, args.warmup, args.duration)?),
        None => None,
    };
    // Created now, so that a path that cannot be written fails the run before the load; written
    // once at the end.
    let window_log = match &args.window_log {
        Some(path) => {
            let file = File::create(path)
                .with_context(|| format!("cannot create --window-log {}", path.display()))?;
            Some((path, file))
        }
        None => None,
    };
    let table = RequestTable::build(args, script_sha.as_deref())?;
    let picker = Picker::new(args)?;
    let routes = if args.leader_aware {
        Some(routes::LeaderRoutes::build(args)?)
    } else {
        None
    };
    let plan = Plan {
        addrs: addrs.clone(),
        routes,
        host: args.first_target().to_string(),
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
        pace_ns: args.pace_us * 1_000,
        warmup_ns: secs(args.warmup),
        duration_ns: args.duration_ns(),
        window_ns: args.window_log.is_some().then(|| args.window_ns()),
        drain_ns: secs(args.drain_secs),
        connect_timeout_ns: secs(args.connect_timeout_secs),
        requests: args.requests,
        seed: args.seed,
        check: args.check,
        script_load: (args.protocol == Protocol::RespScript).then(script_load_command),
        headers: if args.protocol == Protocol::EnvoyRls {
            grpc::request_headers(args.first_target())
        } else {
            grpc::RequestHeaders::default()
        },
        message_bytes_max: table.longest(),
    };
    let shared = RunShared {
        base: Instant::now(),
        table,
        picker,
        plan,
        answered: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        abort: AtomicBool::new(false),
        started_ns: AtomicU64::new(0),
    };
    let bar = if progress && std::io::stdout().is_terminal() {
        let total = args.warmup + args.duration;
        let bar = ProgressBar::new((total * 10.0).ceil() as u64);
        if let Ok(style) = ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {msg}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    } else {
        ProgressBar::hidden()
    };

    let barrier = Barrier::new(args.threads);
    let results = std::thread::scope(|scope| {
        #[allow(clippy::expect_used)] // without its threads the run cannot happen at all
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let ids: Vec<usize> = (0..args.connections)
                    .filter(|c| c % args.threads == t)
                    .collect();
                let shared = &shared;
                let barrier = &barrier;
                std::thread::Builder::new()
                    .name(format!("loadtest-{t}"))
                    .spawn_scoped(scope, move || event_loop::run_thread(shared, &ids, barrier))
                    .expect("spawn a load thread")
            })
            .collect();
        let started = Instant::now();
        let mut last = (Instant::now(), 0u64);
        let mut rate = 0.0;
        let mut interval_error = None;
        while !handles.iter().all(|h| h.is_finished()) {
            std::thread::sleep(Duration::from_millis(100));
            if let Some(w) = intervals.as_mut() {
                if let Err(e) = w.tick(&shared, false) {
                    interval_error.get_or_insert(e);
                    intervals = None;
                }
            }
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
        let results = handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a load thread panicked"))?)
            .collect::<Result<Vec<_>>>();
        if let Some(w) = intervals.as_mut() {
            if let Err(e) = w.tick(&shared, true) {
                interval_error.get_or_insert(e);
            }
        }
        match interval_error {
            Some(e) => Err(e),
            None => results,
        }
    });
    bar.finish_and_clear();
    let results = results?;

    let mut hist = Histogram::<u64>::new_with_bounds(1, event_loop::LATENCY_NS_MAX, 3)?;
    let mut counts = Counts::default();
    let mut hits = Vec::new();
    let mut windows: Option<Windows> = None;
    let mut start = u64::MAX;
    let mut end = 0;
    for r in results {
        hist.add(&r.hist)?;
        counts.add(&r.counts);
        hits.extend(r.hits);
        match (windows.as_mut(), r.windows) {
            (Some(all), Some(w)) => all.add(&w),
            (None, w) => windows = w,
            (Some(_), None) => {}
        }
        start = start.min(r.measure_start_ns);
        end = end.max(r.measure_end_ns);
    }
    let duration_secs = (end.saturating_sub(start) as f64 / 1e9).max(1e-9);
    let requests = counts.allowed + counts.denied + counts.errors;
    let check = if !args.check {
        None
    } else if args.protocol.uses_buckets() {
        let t = args.bucket_template()?;
        let periods: Vec<PeriodLimit> = t
            .given_limits()
            .into_iter()
            .map(|(limit, period_ms)| PeriodLimit { limit, period_ms })
            .collect();
        let count = t.count.map_or(1, |c| c.max(1) as u64);
        Some(check::check_buckets(
            hits,
            &periods,
            count,
            &args.actor_prefix,
        ))
    } else {
        Some(check::check(
            hits,
            args.check_limit(),
            args.check_window_secs(),
            &args.actor_prefix,
        ))
    };
    if let (Some((path, file)), Some(w)) = (window_log, windows.as_ref()) {
        w.write_csv(BufWriter::new(file))
            .with_context(|| format!("writing --window-log {}", path.display()))?;
    }
    let mut config = args.clone();
    config.template = Some(args.template().to_string());
    Ok(Report {
        config,
        target_addr: {
            let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
            addrs.join(",")
        },
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
        windows: windows.as_ref().map(Windows::summary),
        histogram: hist,
    })
}

/// Make sure the target answers before starting threads; for droplet, that it accepts the
/// WebSocket upgrade; for resp-script, load the script and return its SHA1 (which the preformatted
/// `EVALSHA` requests carry).
fn preflight(args: &Args, addr: SocketAddr) -> Result<Option<String>> {
    let timeout = Duration::from_secs_f64(args.connect_timeout_secs.max(0.1));
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("cannot connect to {addr}"))?;
    if args.protocol == Protocol::Droplet {
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        let key = handshake_key(args.seed, usize::MAX, 0);
        s.write_all(&handshake_request(args.first_target(), &key))
            .context("sending the WebSocket upgrade")?;
        let mut buf = Vec::with_capacity(512);
        let mut chunk = [0u8; 512];
        loop {
            match parse_handshake(&buf, &key) {
                Handshake::Accepted(_) => return Ok(None),
                Handshake::Refused(why) => bail!("{addr}: {why}"),
                Handshake::Incomplete => {}
            }
            let n = s
                .read(&mut chunk)
                .with_context(|| format!("{addr}: reading the answer to the WebSocket upgrade"))?;
            if n == 0 {
                bail!("{addr} closed the connection during the WebSocket upgrade");
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }
    if args.protocol == Protocol::EnvoyRls {
        preflight_http2(&mut s, addr, timeout)?;
        return Ok(None);
    }
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

/// envoy-rls: the target must speak HTTP/2 without TLS (prior knowledge): its first frame after our
/// preface is SETTINGS.
fn preflight_http2(s: &mut TcpStream, addr: SocketAddr, timeout: Duration) -> Result<()> {
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut preface = Vec::new();
    grpc::push_preface(&mut preface);
    s.write_all(&preface)
        .context("sending the HTTP/2 preface")?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    loop {
        match grpc::parse_frame(&buf) {
            grpc::FrameParse::Complete(_, grpc::Frame::Settings { ack: false, .. }) => return Ok(()),
            grpc::FrameParse::Incomplete => {}
            _ => bail!("{addr} does not speak HTTP/2 (its first frame is not SETTINGS): is it the --grpc-listen address?"),
        }
        let n = s
            .read(&mut chunk)
            .with_context(|| format!("{addr}: waiting for the server's HTTP/2 SETTINGS"))?;
        if n == 0 {
            bail!("{addr} closed the connection after the HTTP/2 preface: is it the --grpc-listen address?");
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Writes `--interval-json`: one line per second of the run, from the moment every thread is
/// connected (the threads set `RunShared::started_ns`). Lines fall due on a fixed grid (1 s, 2 s, ...
/// after the start), so they do not drift; each covers the time since the previous one.
struct IntervalWriter {
    out: BufWriter<File>,
    warmup_secs: f64,
    duration_secs: f64,
    /// When the next line is due, in ns since base (0: the run has not started).
    next_due_ns: u64,
    /// (ns since base, answers, errors) when the last line was written.
    last: (u64, u64, u64),
}

impl IntervalWriter {
    fn create(path: &Path, warmup_secs: f64, duration_secs: f64) -> Result<IntervalWriter> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(IntervalWriter {
            out: BufWriter::new(file),
            warmup_secs,
            duration_secs,
            next_due_ns: 0,
            last: (0, 0, 0),
        })
    }

    /// Write a line if one is due (or, with `last`, for whatever came after the last line).
    fn tick(&mut self, shared: &RunShared, last: bool) -> Result<()> {
        const SECOND_NS: u64 = 1_000_000_000;
        let started = shared.started_ns.load(Ordering::Acquire);
        if started == 0 {
            return Ok(());
        }
        if self.next_due_ns == 0 {
            self.next_due_ns = started + SECOND_NS;
            self.last = (started, 0, 0);
        }
        let now = shared.base.elapsed().as_nanos() as u64;
        let (prev_ns, prev_answers, prev_errors) = self.last;
        let answers = shared.answered.load(Ordering::Relaxed);
        let errors = shared.errors.load(Ordering::Relaxed);
        let due = now >= self.next_due_ns;
        let rest = last && (answers, errors) != (prev_answers, prev_errors);
        if !due && !rest {
            return Ok(());
        }
        while self.next_due_ns <= now {
            self.next_due_ns += SECOND_NS;
        }
        let elapsed = now.saturating_sub(started) as f64 / 1e9;
        let interval = now.saturating_sub(prev_ns) as f64 / 1e9;
        let phase = if elapsed <= self.warmup_secs {
            "warmup"
        } else if elapsed <= self.warmup_secs + self.duration_secs {
            "measure"
        } else {
            "drain"
        };
        let unix_secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let requests = answers.saturating_sub(prev_answers);
        let line = serde_json::json!({
            "unix_time_secs": (unix_secs * 1e3).round() / 1e3,
            "elapsed_secs": (elapsed * 1e3).round() / 1e3,
            "interval_secs": (interval * 1e3).round() / 1e3,
            "phase": phase,
            "requests": requests,
            "errors": errors.saturating_sub(prev_errors),
            "throughput_per_sec": (requests as f64 / interval.max(1e-3)).round(),
            "requests_total": answers,
            "errors_total": errors,
        });
        writeln!(self.out, "{line}").context("writing --interval-json")?;
        self.out.flush().context("writing --interval-json")?;
        self.last = (now, answers, errors);
        Ok(())
    }
}
