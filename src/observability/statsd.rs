//! The statsd exporter: divvy's statsd names, sent from a thread of their
//! own so that a slow or absent sink can never slow a HIT.
//!
//! Counters and the connections gauge are not sent per event: every
//! `flush_interval_ms` the sender reads the same atomics Prometheus reads and
//! sends what changed (`P.hit.accepted:57|c` is the statsd sum of 57 events of
//! `P.hit.accepted:1|c`). Timers need each value, so each HIT's duration goes
//! through a bounded lock-free queue; when it is full the value is dropped
//! and counted, and the timings sent for that interval carry the sample rate
//! (`|@0.5`) so that statsd still computes the right rate. Lines are packed
//! several per UDP datagram (at most `datagram_bytes_max` bytes), or written
//! newline-terminated on one TCP connection. Whatever cannot be sent (socket
//! buffer full, sink refusing or unreachable) is dropped and counted in
//! [`Metrics::statsd_dropped`], never retried or buffered.

use crate::metrics::{HitStatus, Metrics, StatsdDrop, ERROR_CODES};
use crossbeam_queue::ArrayQueue;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsdTransport {
    Udp,
    Tcp,
}

#[derive(Debug, Clone)]
pub struct StatsdConfig {
    pub host: String,
    pub port: u16,
    /// Prepended with a `.` to every name (`P.hit`); empty means no prefix.
    pub prefix: String,
    pub transport: StatsdTransport,
    /// How often changes are sent (at most 1000: statsd expects a flush at
    /// least every second).
    pub flush_interval_ms: u64,
    /// Largest UDP payload; lines are packed up to it.
    pub datagram_bytes_max: usize,
    /// HIT timings buffered between flushes; more are dropped and counted.
    pub timing_queue_len: usize,
    /// How long a TCP connect or write may block the sender thread.
    pub tcp_timeout_ms: u64,
    /// The kernel send buffer of the TCP connection: how much may wait for
    /// a slow sink before writes stall, time out and drop (the kernel's
    /// default grows to megabytes of stale metrics).
    pub tcp_send_buffer_bytes: usize,
}

impl StatsdConfig {
    pub fn new(host: String, port: u16, prefix: String, transport: StatsdTransport) -> Self {
        StatsdConfig {
            host,
            port,
            prefix,
            transport,
            flush_interval_ms: 500,
            datagram_bytes_max: 1400,
            timing_queue_len: 65_536,
            tcp_timeout_ms: 1_000,
            tcp_send_buffer_bytes: 64 * 1024,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StatsdError {
    #[error("cannot start the statsd thread: {0}")]
    Thread(std::io::Error),
    #[error("statsd timings are already being sent by another exporter")]
    AlreadyAttached,
}

/// The running sender thread. Stopping it sends what is left first.
pub struct StatsdExporter {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StatsdExporter {
    pub fn start(
        config: StatsdConfig,
        metrics: Arc<Metrics>,
    ) -> Result<StatsdExporter, StatsdError> {
        let timings = Arc::new(ArrayQueue::new(config.timing_queue_len.max(1)));
        if !metrics.attach_hit_timings(Arc::clone(&timings)) {
            return Err(StatsdError::AlreadyAttached);
        }
        let (stop, stopped) = mpsc::channel();
        let mut sender = Sender {
            lines: LineBuilder::new(&config.prefix),
            sink: Sink::new(&config),
            config,
            metrics,
            timings,
            last: Snapshot::default(),
        };
        let thread = std::thread::Builder::new()
            .name("tollgate-statsd".into())
            .spawn(move || sender.run(stopped))
            .map_err(StatsdError::Thread)?;
        Ok(StatsdExporter {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Sends what changed since the last flush, then stops the thread.
    pub fn stop(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        // Dropping the channel's sender wakes the thread at once.
        self.stop.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for StatsdExporter {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// The values sent at the last flush, to send only what changed.
#[derive(Default)]
struct Snapshot {
    hits: HashMap<String, [u64; 4]>,
    errors: [u64; 2],
    connections_open: i64,
    connections_accepted: u64,
    timings_dropped: u64,
}

struct Sender {
    config: StatsdConfig,
    metrics: Arc<Metrics>,
    timings: Arc<ArrayQueue<u32>>,
    lines: LineBuilder,
    sink: Sink,
    last: Snapshot,
}

impl Sender {
    fn run(&mut self, stopped: mpsc::Receiver<()>) {
        let interval = Duration::from_millis(self.config.flush_interval_ms.clamp(1, 1_000));
        let mut next_flush = Instant::now() + interval;
        loop {
            let wait = next_flush.saturating_duration_since(Instant::now());
            let stopping = !matches!(
                stopped.recv_timeout(wait),
                Err(mpsc::RecvTimeoutError::Timeout)
            );
            self.flush();
            if stopping {
                return;
            }
            next_flush += interval;
            // Never try to catch up on missed flushes (a slow TCP sink).
            next_flush = next_flush.max(Instant::now());
        }
    }

    fn flush(&mut self) {
        self.collect_counters();
        self.collect_timings();
        if !self.lines.is_empty() {
            let lines = self.lines.take();
            self.sink.send(&lines, &self.config, &self.metrics);
        }
    }

    fn collect_counters(&mut self) {
        let metrics = &self.metrics;
        let mut by_status = [0u64; 4];
        for (label, counters) in metrics.labels() {
            let last = self.last.hits.entry(label.clone()).or_default();
            for status in HitStatus::ALL {
                let now = counters.get(status);
                let delta = now.wrapping_sub(last[status as usize]);
                last[status as usize] = now;
                by_status[status as usize] += delta;
                if delta > 0 && !label.is_empty() {
                    self.lines
                        .counter(format_args!("hit.{}.{label}", status.as_str()), delta);
                }
            }
        }
        for status in HitStatus::ALL {
            let delta = by_status[status as usize];
            if delta > 0 {
                self.lines
                    .counter(format_args!("hit.{}", status.as_str()), delta);
            }
        }
        for code in ERROR_CODES {
            let now = metrics.errors(code);
            let delta = now.wrapping_sub(self.last.errors[code as usize]);
            self.last.errors[code as usize] = now;
            if delta > 0 {
                self.lines
                    .counter(format_args!("error.{}", code.as_str()), delta);
            }
        }
        // divvy sent the gauge on every open and close: send it when any
        // happened since the last flush.
        let open = metrics.connections_open();
        let accepted = metrics.connections_accepted();
        if open != self.last.connections_open || accepted != self.last.connections_accepted {
            self.lines.gauge("connections", open);
            self.last.connections_open = open;
            self.last.connections_accepted = accepted;
        }
    }

    fn collect_timings(&mut self) {
        let dropped_total = self.metrics.statsd_dropped_total(StatsdDrop::QueueFull);
        let dropped = dropped_total.wrapping_sub(self.last.timings_dropped);
        self.last.timings_dropped = dropped_total;
        // Take at most what was queued now, so a flood cannot keep this loop
        // from sending.
        let queued = self.timings.len();
        let sample_rate = if dropped > 0 && queued > 0 {
            Some(queued as f64 / (queued as u64 + dropped) as f64)
        } else {
            None
        };
        for _ in 0..queued {
            let Some(micros) = self.timings.pop() else {
                break;
            };
            self.lines.timing("hit", micros, sample_rate);
        }
    }
}

/// Builds statsd lines (`name:value|type`) with the prefix, without
/// separators; packing into payloads is the sink's job.
struct LineBuilder {
    /// `"P."`, or empty without a prefix.
    prefix: String,
    lines: Vec<String>,
}

impl LineBuilder {
    fn new(prefix: &str) -> LineBuilder {
        LineBuilder {
            prefix: if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}.")
            },
            lines: Vec::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    fn take(&mut self) -> Vec<String> {
        std::mem::take(&mut self.lines)
    }

    fn push(&mut self, name: std::fmt::Arguments<'_>, value: std::fmt::Arguments<'_>) {
        let mut line = String::with_capacity(self.prefix.len() + 32);
        line.push_str(&self.prefix);
        let _ = write!(line, "{name}:{value}");
        self.lines.push(line);
    }

    fn counter(&mut self, name: std::fmt::Arguments<'_>, delta: u64) {
        self.push(name, format_args!("{delta}|c"));
    }

    fn gauge(&mut self, name: &str, value: i64) {
        // A negative gauge value would read as a decrement in statsd.
        self.push(format_args!("{name}"), format_args!("{}|g", value.max(0)));
    }

    /// A timing in milliseconds with microsecond precision (`0.137|ms`).
    fn timing(&mut self, name: &str, micros: u32, sample_rate: Option<f64>) {
        let (ms, fraction) = (micros / 1000, micros % 1000);
        match sample_rate {
            None => self.push(
                format_args!("{name}"),
                format_args!("{ms}.{fraction:03}|ms"),
            ),
            Some(rate) => self.push(
                format_args!("{name}"),
                format_args!("{ms}.{fraction:03}|ms|@{rate:.6}"),
            ),
        }
    }
}

/// Packs lines into payloads of at most `bytes_max` bytes, `\n` between
/// lines. A single line longer than that travels alone.
fn pack(lines: &[String], bytes_max: usize) -> Vec<(Vec<u8>, usize)> {
    let mut payloads = Vec::new();
    let mut payload: Vec<u8> = Vec::with_capacity(bytes_max);
    let mut count = 0;
    for line in lines {
        if count > 0 && payload.len() + 1 + line.len() > bytes_max {
            payloads.push((std::mem::take(&mut payload), count));
            count = 0;
        }
        if count > 0 {
            payload.push(b'\n');
        }
        payload.extend_from_slice(line.as_bytes());
        count += 1;
    }
    if count > 0 {
        payloads.push((payload, count));
    }
    payloads
}

/// Where lines go: a UDP socket, or a TCP connection (re)made on demand.
enum Sink {
    Udp(Option<UdpSocket>),
    Tcp {
        stream: Option<TcpStream>,
        /// No reconnect attempt before this instant (backoff after failures).
        retry_at: Instant,
        backoff: Duration,
    },
}

/// The first and the longest wait between TCP reconnect attempts.
const TCP_BACKOFF_MIN: Duration = Duration::from_millis(250);
const TCP_BACKOFF_MAX: Duration = Duration::from_secs(8);

impl Sink {
    fn new(config: &StatsdConfig) -> Sink {
        match config.transport {
            StatsdTransport::Udp => Sink::Udp(None),
            StatsdTransport::Tcp => Sink::Tcp {
                stream: None,
                retry_at: Instant::now(),
                backoff: TCP_BACKOFF_MIN,
            },
        }
    }

    fn send(&mut self, lines: &[String], config: &StatsdConfig, metrics: &Metrics) {
        let dropped = match self {
            Sink::Udp(socket) => send_udp(socket, lines, config),
            Sink::Tcp {
                stream,
                retry_at,
                backoff,
            } => send_tcp(stream, retry_at, backoff, lines, config),
        };
        if dropped > 0 {
            metrics.statsd_dropped(StatsdDrop::SendFailed, dropped as u64);
        }
    }
}

fn resolve(config: &StatsdConfig) -> Option<SocketAddr> {
    match (config.host.as_str(), config.port).to_socket_addrs() {
        Ok(mut addrs) => addrs.next(),
        Err(error) => {
            tracing::debug!(%error, host = %config.host, "cannot resolve the statsd host");
            None
        }
    }
}

/// Returns how many lines were dropped.
fn send_udp(socket: &mut Option<UdpSocket>, lines: &[String], config: &StatsdConfig) -> usize {
    if socket.is_none() {
        *socket = resolve(config).and_then(|addr| {
            let local: SocketAddr = if addr.is_ipv4() {
                (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
            } else {
                (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
            };
            let socket = UdpSocket::bind(local).ok()?;
            socket.connect(addr).ok()?;
            // Never wait for buffer space: a full buffer drops the datagram.
            socket.set_nonblocking(true).ok()?;
            Some(socket)
        });
    }
    let Some(udp) = socket else {
        return lines.len();
    };
    let mut dropped = 0;
    for (payload, count) in pack(lines, config.datagram_bytes_max.max(1)) {
        if udp.send(&payload).is_err() {
            dropped += count;
        }
    }
    dropped
}

fn send_tcp(
    stream: &mut Option<TcpStream>,
    retry_at: &mut Instant,
    backoff: &mut Duration,
    lines: &[String],
    config: &StatsdConfig,
) -> usize {
    let timeout = Duration::from_millis(config.tcp_timeout_ms.max(1));
    if stream.is_none() {
        if Instant::now() < *retry_at {
            return lines.len();
        }
        let connected = resolve(config).and_then(|addr| {
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )
            .ok()?;
            socket
                .set_send_buffer_size(config.tcp_send_buffer_bytes.max(1))
                .ok()?;
            socket.connect_timeout(&addr.into(), timeout).ok()?;
            socket.set_write_timeout(Some(timeout)).ok()?;
            socket.set_nodelay(true).ok()?;
            Some(TcpStream::from(socket))
        });
        match connected {
            Some(connected) => {
                *stream = Some(connected);
                *backoff = TCP_BACKOFF_MIN;
            }
            None => {
                *retry_at = Instant::now() + *backoff;
                *backoff = (*backoff * 2).min(TCP_BACKOFF_MAX);
                return lines.len();
            }
        }
    }
    let Some(tcp) = stream else {
        return lines.len();
    };
    let mut sent = 0;
    for (mut payload, count) in pack(lines, config.datagram_bytes_max.max(1)) {
        payload.push(b'\n');
        if tcp.write_all(&payload).is_err() {
            // A partial write may have cut a line: start over on a new
            // connection rather than corrupt the next one.
            *stream = None;
            *retry_at = Instant::now() + *backoff;
            return lines.len() - sent;
        }
        sent += count;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_is_joined_with_a_dot_and_absent_without_one() {
        let mut with = LineBuilder::new("P");
        with.counter(format_args!("hit.accepted"), 3);
        with.gauge("connections", 2);
        with.timing("hit", 1_234, None);
        assert_eq!(
            with.take(),
            ["P.hit.accepted:3|c", "P.connections:2|g", "P.hit:1.234|ms"]
        );
        let mut without = LineBuilder::new("");
        without.counter(format_args!("error.unknown"), 1);
        without.timing("hit", 7, Some(0.25));
        assert_eq!(
            without.take(),
            ["error.unknown:1|c", "hit:0.007|ms|@0.250000"]
        );
    }

    #[test]
    fn packing_keeps_payloads_under_the_limit_and_every_line_once() {
        let lines: Vec<String> = (0..100).map(|i| format!("P.hit:{i}.000|ms")).collect();
        let payloads = pack(&lines, 64);
        assert!(payloads.len() > 1);
        let mut seen = Vec::new();
        for (payload, count) in &payloads {
            assert!(payload.len() <= 64, "{} bytes", payload.len());
            let text = std::str::from_utf8(payload).unwrap();
            assert_eq!(text.split('\n').count(), *count);
            seen.extend(text.split('\n').map(str::to_owned));
        }
        assert_eq!(seen, lines);
    }

    #[test]
    fn a_line_longer_than_the_limit_travels_alone() {
        let lines = vec!["a:1|c".to_owned(), "x".repeat(50), "b:1|c".to_owned()];
        let payloads = pack(&lines, 20);
        let counts: Vec<usize> = payloads.iter().map(|(_, count)| *count).collect();
        assert_eq!(counts, [1, 1, 1]);
    }
}
