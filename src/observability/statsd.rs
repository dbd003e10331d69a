//! The statsd exporter: divvy's statsd names, sent from a thread of their
//! own so that a slow or absent sink can never slow a HIT.
//!
//! Counters and the connections gauge are not sent per event: every
//! `flush_interval_ms` the sender reads the same atomics Prometheus reads and
//! sends what changed (`P.hit.accepted:57|c` is the statsd sum of 57 events of
//! `P.hit.accepted:1|c`). Timers need each value, so each HIT's duration goes
//! through a bounded lock-free queue per serving thread ([`HitTimings`]);
//! when it is full the value is dropped and counted, and the timings sent for
//! that interval carry the sample rate (`|@0.5`) so that statsd still
//! computes the right rate. Lines are packed
//! several per UDP datagram (at most `datagram_bytes_max` bytes), or written
//! newline-terminated on one TCP connection. Whatever cannot be sent (socket
//! buffer full, sink refusing or unreachable) is dropped and counted in
//! `tollgate_statsd_dropped_total`, never retried or buffered.

use crate::metrics::{HitStatus, HitTimings, Metrics, StatsdDrop, ERROR_CODES};
use std::collections::HashMap;
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
    /// HIT timings buffered between flushes, over all serving threads; more
    /// are dropped and counted.
    pub timing_queue_len: usize,
    /// Queues the timings are spread over (one per serving thread is best).
    pub timing_queue_shards: usize,
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
            timing_queue_shards: std::thread::available_parallelism().map_or(1, |n| n.get()),
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
        let timings = Arc::new(HitTimings::new(
            config.timing_queue_len.max(1),
            config.timing_queue_shards.clamp(1, 256),
        ));
        if !metrics.attach_hit_timings(Arc::clone(&timings)) {
            return Err(StatsdError::AlreadyAttached);
        }
        let (stop, stopped) = mpsc::channel();
        let mut sender = Sender {
            lines: Lines::new(&config.prefix),
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
    timings: Arc<HitTimings>,
    lines: Lines,
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
            self.sink.send(&self.lines, &self.config, &self.metrics);
            self.lines.clear();
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
                        .counter(&["hit.", status.as_str(), ".", &label], delta);
                }
            }
        }
        for status in HitStatus::ALL {
            let delta = by_status[status as usize];
            if delta > 0 {
                self.lines.counter(&["hit.", status.as_str()], delta);
            }
        }
        for code in ERROR_CODES {
            let now = metrics.errors(code);
            let delta = now.wrapping_sub(self.last.errors[code as usize]);
            self.last.errors[code as usize] = now;
            if delta > 0 {
                self.lines.counter(&["error.", code.as_str()], delta);
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
        let queued = self.timings.len();
        // Written once per flush, appended to every timing line.
        let sample_rate = if dropped > 0 && queued > 0 {
            let rate = queued as f64 / (queued as u64 + dropped) as f64;
            format!("|@{rate:.6}")
        } else {
            String::new()
        };
        let lines = &mut self.lines;
        self.timings
            .drain(|micros| lines.timing("hit", micros, &sample_rate));
    }
}

/// Statsd lines (`name:value|type`, with the prefix) written one after
/// another into one reusable buffer: no allocation or formatting machinery
/// per line, as there is one timing line per HIT.
struct Lines {
    /// `"P."`, or empty without a prefix.
    prefix: Vec<u8>,
    bytes: Vec<u8>,
    /// Where each line ends in `bytes`.
    ends: Vec<usize>,
}

impl Lines {
    fn new(prefix: &str) -> Lines {
        Lines {
            prefix: if prefix.is_empty() {
                Vec::new()
            } else {
                format!("{prefix}.").into_bytes()
            },
            bytes: Vec::with_capacity(64 * 1024),
            ends: Vec::with_capacity(4 * 1024),
        }
    }

    fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn clear(&mut self) {
        self.bytes.clear();
        self.ends.clear();
    }

    fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(self.ends.iter().copied())
            .map(|(start, end)| &self.bytes[start..end])
    }

    fn name(&mut self, parts: &[&str]) {
        self.bytes.extend_from_slice(&self.prefix);
        for part in parts {
            self.bytes.extend_from_slice(part.as_bytes());
        }
        self.bytes.push(b':');
    }

    fn end(&mut self) {
        self.ends.push(self.bytes.len());
    }

    fn counter(&mut self, name: &[&str], delta: u64) {
        self.name(name);
        self.bytes
            .extend_from_slice(itoa::Buffer::new().format(delta).as_bytes());
        self.bytes.extend_from_slice(b"|c");
        self.end();
    }

    fn gauge(&mut self, name: &str, value: i64) {
        self.name(&[name]);
        // A signed gauge value would read as a change in statsd.
        self.bytes
            .extend_from_slice(itoa::Buffer::new().format(value.max(0)).as_bytes());
        self.bytes.extend_from_slice(b"|g");
        self.end();
    }

    /// A timing in milliseconds with microsecond precision (`0.137|ms`),
    /// then `suffix` (a sample rate such as `|@0.5`, or nothing).
    fn timing(&mut self, name: &str, micros: u32, suffix: &str) {
        self.name(&[name]);
        self.bytes
            .extend_from_slice(itoa::Buffer::new().format(micros / 1000).as_bytes());
        let fraction = micros % 1000;
        self.bytes.extend_from_slice(&[
            b'.',
            b'0' + (fraction / 100) as u8,
            b'0' + (fraction / 10 % 10) as u8,
            b'0' + (fraction % 10) as u8,
        ]);
        self.bytes.extend_from_slice(b"|ms");
        self.bytes.extend_from_slice(suffix.as_bytes());
        self.end();
    }
}

/// Packs lines into payloads of at most `bytes_max` bytes, `\n` between
/// lines (and after the last one when `terminated`, as TCP needs), and hands
/// each to `send` with its number of lines. A single line longer than the
/// limit travels alone. Stops early when `send` returns `false`.
fn pack(
    lines: &Lines,
    bytes_max: usize,
    terminated: bool,
    mut send: impl FnMut(&[u8], usize) -> bool,
) {
    let mut payload: Vec<u8> = Vec::with_capacity(bytes_max + 1);
    let mut count = 0;
    for line in lines.iter() {
        if count > 0 && payload.len() + 1 + line.len() > bytes_max {
            if terminated {
                payload.push(b'\n');
            }
            if !send(&payload, count) {
                return;
            }
            payload.clear();
            count = 0;
        }
        if count > 0 {
            payload.push(b'\n');
        }
        payload.extend_from_slice(line);
        count += 1;
    }
    if count > 0 {
        if terminated {
            payload.push(b'\n');
        }
        send(&payload, count);
    }
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

    fn send(&mut self, lines: &Lines, config: &StatsdConfig, metrics: &Metrics) {
        let dropped = match self {
            Sink::Udp(socket) => send_udp(socket, lines, config),
            Sink::Tcp {
                stream,
                retry_at,
                backoff,
            } => send_tcp(stream, retry_at, backoff, lines, config),
        };
        if dropped > 0 {
            metrics.statsd_send_failed(dropped as u64);
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
fn send_udp(socket: &mut Option<UdpSocket>, lines: &Lines, config: &StatsdConfig) -> usize {
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
    pack(
        lines,
        config.datagram_bytes_max.max(1),
        false,
        |payload, count| {
            if udp.send(payload).is_err() {
                dropped += count;
            }
            true
        },
    );
    dropped
}

fn send_tcp(
    stream: &mut Option<TcpStream>,
    retry_at: &mut Instant,
    backoff: &mut Duration,
    lines: &Lines,
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
    let mut failed = false;
    pack(
        lines,
        config.datagram_bytes_max.max(1),
        true,
        |payload, count| {
            failed = tcp.write_all(payload).is_err();
            if !failed {
                sent += count;
            }
            !failed
        },
    );
    if failed {
        // A partial write may have cut a line: start over on a new
        // connection rather than corrupt the next one.
        *stream = None;
        *retry_at = Instant::now() + *backoff;
    }
    lines.len() - sent
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(lines: &Lines) -> Vec<String> {
        lines
            .iter()
            .map(|l| String::from_utf8(l.to_vec()).unwrap())
            .collect()
    }

    fn packed(lines: &Lines, bytes_max: usize, terminated: bool) -> Vec<(String, usize)> {
        let mut payloads = Vec::new();
        pack(lines, bytes_max, terminated, |payload, count| {
            payloads.push((String::from_utf8(payload.to_vec()).unwrap(), count));
            true
        });
        payloads
    }

    #[test]
    fn prefix_is_joined_with_a_dot_and_absent_without_one() {
        let mut with = Lines::new("P");
        with.counter(&["hit.", "accepted"], 3);
        with.gauge("connections", 2);
        with.timing("hit", 1_234, "");
        with.timing("hit", 12_000_007, "");
        assert_eq!(
            texts(&with),
            [
                "P.hit.accepted:3|c",
                "P.connections:2|g",
                "P.hit:1.234|ms",
                "P.hit:12000.007|ms"
            ]
        );
        let mut without = Lines::new("");
        without.counter(&["error.", "unknown"], 1);
        without.timing("hit", 7, "|@0.250000");
        without.gauge("connections", -1);
        assert_eq!(
            texts(&without),
            [
                "error.unknown:1|c",
                "hit:0.007|ms|@0.250000",
                "connections:0|g"
            ]
        );
        without.clear();
        assert!(without.is_empty());
    }

    #[test]
    fn packing_keeps_payloads_under_the_limit_and_every_line_once() {
        let mut lines = Lines::new("P");
        for i in 0..100 {
            lines.timing("hit", i * 1000, "");
        }
        let payloads = packed(&lines, 64, false);
        assert!(payloads.len() > 1);
        let mut seen = Vec::new();
        for (payload, count) in &payloads {
            assert!(payload.len() <= 64, "{} bytes", payload.len());
            assert_eq!(payload.split('\n').count(), *count);
            seen.extend(payload.split('\n').map(str::to_owned));
        }
        assert_eq!(seen, texts(&lines));
    }

    #[test]
    fn tcp_payloads_end_every_line_with_a_newline() {
        let mut lines = Lines::new("");
        for delta in 1..=30 {
            lines.counter(&["hit.", "accepted"], delta);
        }
        let payloads = packed(&lines, 100, true);
        assert!(payloads.len() > 1);
        let joined: String = payloads.iter().map(|(p, _)| p.as_str()).collect();
        assert!(payloads.iter().all(|(p, _)| p.ends_with('\n')));
        assert_eq!(joined.lines().collect::<Vec<_>>(), texts(&lines));
    }

    #[test]
    fn a_line_longer_than_the_limit_travels_alone() {
        let mut lines = Lines::new("");
        lines.counter(&["a"], 1);
        lines.counter(&[&"x".repeat(50)], 1);
        lines.counter(&["b"], 1);
        let counts: Vec<usize> = packed(&lines, 20, false).iter().map(|(_, c)| *c).collect();
        assert_eq!(counts, [1, 1, 1]);
    }

    #[test]
    fn packing_stops_when_the_sink_fails() {
        let mut lines = Lines::new("");
        for delta in 1..=30 {
            lines.counter(&["hit.", "accepted"], delta);
        }
        let mut calls = 0;
        pack(&lines, 40, false, |_, _| {
            calls += 1;
            false
        });
        assert_eq!(calls, 1);
    }
}
