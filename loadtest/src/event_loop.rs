//! The event loop: one mio `Poll` per thread driving that thread's connections. It owns connecting and
//! reconnecting (paced: at most [`CONNECTS_PENDING_MAX`] connects under way per thread while the run
//! starts; running out of file descriptors or local ports is a clear error, not a timeout), the
//! WebSocket upgrade of droplet connections, the HTTP/2 frames of envoy-rls calls (streams matched
//! by id, see [`crate::grpc`]), the closed-loop refill (keep `pipeline` requests in
//! flight) and the open-loop schedule (requests due at fixed times, queued when a connection's
//! pipeline is full, latency measured from the due time), reading and parsing answers (and answering
//! a WebSocket ping), and recording them into the thread's histogram, counters, (for `--check`)
//! list of allowed hits and (for `--window-log`) per-window summaries.
//!
//! The steady path does not allocate: request bytes are copied from the shared request table into a
//! reused write buffer, answers are parsed in place in a reused read buffer, and the per-connection
//! queues keep their capacity.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use hdrhistogram::Histogram;
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Registry, Token};
use rand::rngs::SmallRng;
use rand::Rng;

use crate::check::AllowedHit;
use crate::config::Protocol;
use crate::grpc::{self, Frame, FrameParse, StreamTable, Verdict};
use crate::timer::{tighten_timer_slack, Timer};
use crate::websocket::{
    handshake_key, handshake_request, parse_handshake, push_client_frame, Handshake, OPCODE_PONG,
};
use crate::windows::Windows;
use crate::wire::{parse_divvy, parse_droplet, parse_resp, parse_take, Parse, Reply, RespMode};
use crate::workload::{connection_rng, Picker, RequestTable};

/// Bytes of read buffer per connection (an answer line is far shorter).
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Longest latency the histogram tracks exactly (larger values are clamped to it): one hour.
pub const LATENCY_NS_MAX: u64 = 3_600_000_000_000;
/// Reconnect backoff after a failed connection, doubling up to the max.
const BACKOFF_NS_MIN: u64 = 10_000_000;
const BACKOFF_NS_MAX: u64 = 1_000_000_000;
/// Longest the loop sleeps without looking at the clock (progress publication, phase changes).
const TICK_NS: u64 = 50_000_000;
/// Open loop: a request due sooner than this is waited for by polling, not by arming the timer.
const SPIN_NS: u64 = 2_000;
/// Token of the schedule timer (connection tokens are their local indexes).
const TIMER: Token = Token(usize::MAX - 1);
/// While the run starts, most connects (TCP, and the WebSocket upgrade for droplet) under way at
/// once per thread: thousands of simultaneous SYNs overflow a server's accept backlog, and a dropped
/// SYN costs a one-second retransmission.
pub const CONNECTS_PENDING_MAX: usize = 256;

/// What every thread of one run shares (read-only, apart from the progress counters).
pub struct RunShared {
    /// Time origin of every timestamp of the run.
    pub base: Instant,
    pub table: RequestTable,
    pub picker: Picker,
    pub plan: Plan,
    /// Answers so far, all phases (progress display).
    pub answered: AtomicU64,
    /// Error answers so far, all phases (progress display).
    pub errors: AtomicU64,
    /// Set by a thread that failed to connect, so the others give up too.
    pub abort: AtomicBool,
    /// When the run proper started (every connection up), in ns since base; 0 until then.
    pub started_ns: AtomicU64,
}

/// The run's parameters, in the units the loop uses.
#[derive(Clone, Debug)]
pub struct Plan {
    /// `--target`'s addresses: connection `c` goes to `addrs[c % len]`.
    pub addrs: Vec<SocketAddr>,
    /// `--leader-aware`: each connection's own target and actors.
    pub routes: Option<crate::routes::LeaderRoutes>,
    /// The target as given (the `Host` of the WebSocket upgrade).
    pub host: String,
    pub protocol: Protocol,
    pub resp_mode: RespMode,
    pub threads: usize,
    pub connections: usize,
    pub pipeline: usize,
    /// Open loop: requests per second in total.
    pub rate: Option<f64>,
    /// Open loop: the loop wakes to send at most once per this many ns (0: at each due time).
    pub pace_ns: u64,
    pub warmup_ns: u64,
    pub duration_ns: u64,
    /// `--window-log`: the windows' length in ns (`None`: no window log).
    pub window_ns: Option<u64>,
    pub drain_ns: u64,
    pub connect_timeout_ns: u64,
    /// Total request budget (0 = unlimited).
    pub requests: u64,
    pub seed: u64,
    /// Record allowed hits for the checker.
    pub check: bool,
    /// Sent first on every new connection, and again after `NOSCRIPT` (resp-script).
    pub script_load: Option<Vec<u8>>,
    /// envoy-rls: the HPACK header blocks of the calls.
    pub headers: grpc::RequestHeaders,
    /// The longest request of the table, in bytes (envoy-rls: what flow control must allow).
    pub message_bytes_max: usize,
}

impl Plan {
    /// The addresses connections go to, for messages.
    fn targets(&self) -> String {
        let addrs: Vec<String> = self.addrs.iter().map(|a| a.to_string()).collect();
        addrs.join(",")
    }

    /// Where global connection `c` connects.
    fn addr_of(&self, c: usize) -> SocketAddr {
        match &self.routes {
            Some(routes) => routes.addrs[routes.conn_route[c]],
            None => self.addrs[c % self.addrs.len()],
        }
    }

    /// Request budget of global connection `c`.
    fn budget(&self, c: usize) -> u64 {
        if self.requests == 0 {
            return u64::MAX;
        }
        let n = self.connections as u64;
        self.requests / n + u64::from((c as u64) < self.requests % n)
    }
}

/// Answers counted in the measured window.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub allowed: u64,
    pub denied: u64,
    /// `ERR` answers, Redis errors, and unexpected or unparsable answers.
    pub errors: u64,
    /// Requests of the measured window that never got an answer (connection lost, or still pending
    /// when the drain time ran out).
    pub unanswered: u64,
    /// Connections closed and opened again after the run started.
    pub reconnects: u64,
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        self.allowed += o.allowed;
        self.denied += o.denied;
        self.errors += o.errors;
        self.unanswered += o.unanswered;
        self.reconnects += o.reconnects;
    }
}

/// What one thread measured.
pub struct ThreadResult {
    /// Latencies in ns of the answered requests of the measured window.
    pub hist: Histogram<u64>,
    pub counts: Counts,
    pub hits: Vec<AllowedHit>,
    /// `--window-log`: the measured hits per window of the thread's measured time.
    pub windows: Option<Windows>,
    /// Start of the measured window, ns since base.
    pub measure_start_ns: u64,
    /// End of the measured window (earlier than planned when the request budget ran out).
    pub measure_end_ns: u64,
}

/// A request written (or about to be) and not yet answered.
#[derive(Clone, Copy, Debug)]
struct Pending {
    /// When it was due: the send time in closed loop, the schedule's time in open loop.
    due_ns: u64,
    /// When it was put on the wire.
    sent_ns: u64,
    seq: u64,
    actor: u32,
    /// A request of our own (SCRIPT LOAD), not part of the workload.
    control: bool,
}

/// The thread's mutable state that connections update.
struct Ctx<'a> {
    shared: &'a RunShared,
    hist: Histogram<u64>,
    counts: Counts,
    hits: Vec<AllowedHit>,
    /// `--window-log`: the recorded hits by the window of their due time.
    windows: Option<Windows>,
    warm_end_ns: u64,
    meas_end_ns: u64,
    /// Closed loop: still starting new requests.
    sending: bool,
    /// Requests still to be issued by this thread's connections (saturating).
    budget_left: u64,
    /// The run proper has begun (so closes count as reconnects).
    started: bool,
    /// Why the last connect or upgrade failed (for the error when not every connection came up).
    last_connect_error: Option<String>,
    /// A connect failed in a way retrying cannot mend (no file descriptors, no local ports).
    fatal: Option<String>,
    /// Connections currently without a socket.
    closed: usize,
    answered: u64,
    errors: u64,
}

impl Ctx<'_> {
    fn now(&self) -> u64 {
        self.shared.base.elapsed().as_nanos() as u64
    }

    fn in_window(&self, due_ns: u64) -> bool {
        due_ns >= self.warm_end_ns && due_ns < self.meas_end_ns
    }
}

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// No socket: not opened yet, or closed and waiting for its backoff.
    Closed,
    /// The TCP connect is under way.
    Connecting,
    /// droplet: the upgrade request is written and its answer awaited.
    Upgrading,
    /// Requests may be sent.
    Ready,
}

struct Conn {
    id: usize,
    token: Token,
    sock: Option<TcpStream>,
    stage: Stage,
    /// `Sec-WebSocket-Key` of the upgrade under way (droplet).
    ws_key: String,
    /// Upgrades attempted (each uses a fresh key).
    upgrades: u64,
    rbuf: Box<[u8]>,
    rlo: usize,
    rhi: usize,
    wbuf: Vec<u8>,
    wpos: usize,
    inflight: VecDeque<Pending>,
    /// Workload requests in `inflight` (control requests excluded).
    inflight_reqs: usize,
    /// Open loop: due times of requests waiting for room in the pipeline.
    queued: VecDeque<u64>,
    rng: SmallRng,
    budget: u64,
    seq: u64,
    /// Sequence number of the last SCRIPT LOAD sent (resp-script).
    script_seq: Option<u64>,
    /// envoy-rls: the HTTP/2 streams in flight (`inflight` is not used).
    h2: Option<StreamTable<Pending>>,
    retry_at_ns: u64,
    backoff_ns: u64,
}

impl Conn {
    fn new(id: usize, local: usize, plan: &Plan) -> Conn {
        Conn {
            id,
            token: Token(local),
            sock: None,
            stage: Stage::Closed,
            ws_key: String::new(),
            upgrades: 0,
            rbuf: vec![0u8; READ_BUFFER_BYTES].into_boxed_slice(),
            rlo: 0,
            rhi: 0,
            wbuf: Vec::with_capacity(4096),
            wpos: 0,
            inflight: VecDeque::with_capacity(plan.pipeline + 4),
            inflight_reqs: 0,
            queued: VecDeque::new(),
            rng: connection_rng(plan.seed, id),
            budget: plan.budget(id),
            seq: 0,
            script_seq: None,
            h2: (plan.protocol == Protocol::EnvoyRls).then(|| StreamTable::new(plan.pipeline)),
            retry_at_ns: 0,
            backoff_ns: 0,
        }
    }

    /// Start a non-blocking connect; completion is reported as a writable event.
    fn connect(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) {
        debug_assert!(self.sock.is_none());
        match TcpStream::connect(ctx.shared.plan.addr_of(self.id)) {
            Ok(mut s) => {
                match registry.register(&mut s, self.token, Interest::READABLE | Interest::WRITABLE)
                {
                    Ok(()) => {
                        self.sock = Some(s);
                        self.stage = Stage::Connecting;
                        ctx.closed -= 1;
                    }
                    Err(e) => {
                        ctx.last_connect_error = Some(format!("registering a socket: {e}"));
                        self.retry_later(now);
                    }
                }
            }
            Err(e) => {
                if let Some(why) = fatal_connect_error(&e) {
                    ctx.fatal.get_or_insert(why);
                }
                ctx.last_connect_error = Some(e.to_string());
                self.retry_later(now);
            }
        }
    }

    fn retry_later(&mut self, now: u64) {
        self.retry_at_ns = now + self.backoff_ns;
        self.backoff_ns = (self.backoff_ns * 2).clamp(BACKOFF_NS_MIN, BACKOFF_NS_MAX);
    }

    /// Drop the connection; its unanswered requests are lost. It is reopened after the backoff.
    fn close(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) {
        if let Some(mut s) = self.sock.take() {
            let _ = registry.deregister(&mut s);
            ctx.closed += 1;
            if ctx.started {
                ctx.counts.reconnects += 1;
            }
        }
        self.stage = Stage::Closed;
        for p in self.inflight.drain(..) {
            if !p.control && ctx.in_window(p.due_ns) {
                ctx.counts.unanswered += 1;
            }
        }
        if let Some(h2) = self.h2.as_mut() {
            for stream in h2.drain() {
                if ctx.in_window(stream.call.due_ns) {
                    ctx.counts.unanswered += 1;
                }
            }
        }
        self.inflight_reqs = 0;
        self.script_seq = None;
        self.rlo = 0;
        self.rhi = 0;
        self.wbuf.clear();
        self.wpos = 0;
        self.retry_later(now);
    }

    /// An event on a connection that is not ready yet: the connect finished (or failed), or, for
    /// droplet, the upgrade's answer arrived.
    fn on_connect_event(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) {
        match self.stage {
            Stage::Connecting => self.on_connected(ctx, registry, now),
            Stage::Upgrading => {
                self.flush(ctx, registry, now);
                if self.stage == Stage::Upgrading {
                    self.read_upgrade(ctx, registry, now);
                }
            }
            Stage::Closed | Stage::Ready => {}
        }
    }

    fn on_connected(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) {
        let Some(s) = self.sock.as_ref() else { return };
        match s.take_error() {
            Ok(None) => {}
            Ok(Some(e)) | Err(e) => {
                ctx.last_connect_error = Some(e.to_string());
                self.close(ctx, registry, now);
                return;
            }
        }
        match s.peer_addr() {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotConnected => return, // still connecting
            Err(e) => {
                ctx.last_connect_error = Some(e.to_string());
                self.close(ctx, registry, now);
                return;
            }
        }
        let _ = s.set_nodelay(true);
        let plan = &ctx.shared.plan;
        if plan.protocol == Protocol::Droplet {
            self.ws_key = handshake_key(plan.seed, self.id, self.upgrades);
            self.upgrades += 1;
            self.wbuf
                .extend_from_slice(&handshake_request(&plan.host, &self.ws_key));
            self.stage = Stage::Upgrading;
            self.flush(ctx, registry, now);
            return;
        }
        if let Some(h2) = self.h2.as_mut() {
            h2.reset();
            grpc::push_preface(&mut self.wbuf);
        }
        self.stage = Stage::Ready;
        if plan.script_load.is_some() {
            self.push_script_load(ctx, now);
        }
    }

    /// Read the upgrade's answer; on `101`, the connection is ready (bytes after the answer stay in
    /// the read buffer and are handled as answers).
    fn read_upgrade(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) {
        loop {
            let Some(s) = self.sock.as_mut() else { return };
            match s.read(&mut self.rbuf[self.rhi..]) {
                Ok(0) => {
                    ctx.last_connect_error = Some(
                        "the server closed the connection during the WebSocket upgrade".into(),
                    );
                    self.close(ctx, registry, now);
                    return;
                }
                Ok(k) => {
                    self.rhi += k;
                    match parse_handshake(&self.rbuf[..self.rhi], &self.ws_key) {
                        Handshake::Incomplete => {}
                        Handshake::Accepted(used) => {
                            self.rlo = used;
                            self.stage = Stage::Ready;
                            if self.rlo < self.rhi {
                                self.handle_answers(ctx, registry, now);
                            } else {
                                self.rlo = 0;
                                self.rhi = 0;
                            }
                            return;
                        }
                        Handshake::Refused(why) => {
                            ctx.last_connect_error = Some(why);
                            self.close(ctx, registry, now);
                            return;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    ctx.last_connect_error = Some(e.to_string());
                    self.close(ctx, registry, now);
                    return;
                }
            }
        }
    }

    fn push_script_load(&mut self, ctx: &Ctx, now: u64) {
        let Some(load) = ctx.shared.plan.script_load.as_deref() else {
            return;
        };
        self.wbuf.extend_from_slice(load);
        self.inflight.push_back(Pending {
            due_ns: now,
            sent_ns: now,
            seq: self.seq,
            actor: 0,
            control: true,
        });
        self.script_seq = Some(self.seq);
        self.seq += 1;
    }

    /// Put requests on the wire up to the pipeline depth, then write.
    fn fill(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) {
        if self.stage != Stage::Ready {
            return;
        }
        let shared = ctx.shared;
        let room = match self.h2.as_ref() {
            Some(h2) => {
                if h2.exhausted() && self.inflight_reqs == 0 {
                    // Out of stream ids, or the server went away: a new connection starts over.
                    self.close(ctx, registry, now);
                    self.retry_at_ns = now;
                    return;
                }
                h2.room(shared.plan.pipeline, shared.plan.message_bytes_max)
            }
            None => shared.plan.pipeline - self.inflight_reqs,
        };
        let open = shared.plan.rate.is_some();
        let n = if open {
            room.min(self.queued.len())
        } else if ctx.sending {
            let n = (room as u64).min(self.budget);
            self.budget -= n;
            ctx.budget_left = ctx.budget_left.saturating_sub(n);
            n as usize
        } else {
            0
        };
        let mut sent = 0;
        while sent < n {
            let due_ns = if open {
                self.queued.pop_front().unwrap_or(now)
            } else {
                now
            };
            let actor = match &shared.plan.routes {
                Some(routes) => {
                    let own = &routes.actors[routes.conn_route[self.id]];
                    own[self.rng.gen_range(0..own.len())]
                }
                None => shared.picker.pick(&mut self.rng),
            };
            let pending = Pending {
                due_ns,
                sent_ns: now,
                seq: self.seq,
                actor,
                control: false,
            };
            let request = shared.table.get(actor);
            match self.h2.as_mut() {
                Some(h2) => {
                    // `room` made sure every call of the table fits.
                    let Some(stream) = h2.open(pending, request.len()) else {
                        if open {
                            self.queued.push_front(due_ns);
                        } else {
                            let unsent = (n - sent) as u64;
                            self.budget += unsent;
                            ctx.budget_left = ctx.budget_left.saturating_add(unsent);
                        }
                        break;
                    };
                    let block = h2.header_block(&shared.plan.headers);
                    grpc::push_call(&mut self.wbuf, stream, block, request);
                }
                None => {
                    self.wbuf.extend_from_slice(request);
                    self.inflight.push_back(pending);
                }
            }
            self.seq += 1;
            sent += 1;
        }
        self.inflight_reqs += sent;
        self.flush(ctx, registry, now);
    }

    /// Write as much of the write buffer as the socket takes.
    fn flush(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) {
        while self.wpos < self.wbuf.len() {
            let Some(s) = self.sock.as_mut() else { return };
            match s.write(&self.wbuf[self.wpos..]) {
                Ok(0) => {
                    self.close(ctx, registry, now);
                    return;
                }
                Ok(k) => self.wpos += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close(ctx, registry, now);
                    return;
                }
            }
        }
        self.wbuf.clear();
        self.wpos = 0;
    }

    /// Read everything available and handle the answers. A short read means the socket was drained
    /// (Linux signals an edge for every new arrival), saving the `WouldBlock` read; unless the peer
    /// hung up (`read_closed`), in which case we read on to see the end of the stream.
    fn on_readable(&mut self, ctx: &mut Ctx, registry: &Registry, read_closed: bool) {
        let now = ctx.now();
        loop {
            if self.rhi == self.rbuf.len() {
                if self.rlo == 0 {
                    // One answer larger than the buffer: we are out of step.
                    ctx.counts.errors += 1;
                    self.close(ctx, registry, now);
                    return;
                }
                self.rbuf.copy_within(self.rlo..self.rhi, 0);
                self.rhi -= self.rlo;
                self.rlo = 0;
            }
            let Some(s) = self.sock.as_mut() else { return };
            match s.read(&mut self.rbuf[self.rhi..]) {
                Ok(0) => {
                    self.close(ctx, registry, now);
                    return;
                }
                Ok(k) => {
                    let short = self.rhi + k < self.rbuf.len();
                    self.rhi += k;
                    if !self.handle_answers(ctx, registry, now) {
                        return;
                    }
                    if short && !read_closed && cfg!(target_os = "linux") {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close(ctx, registry, now);
                    return;
                }
            }
        }
        self.fill(ctx, registry, ctx.now());
    }

    /// Parse and record the complete answers in the read buffer. False when the connection closed.
    fn handle_answers(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) -> bool {
        let shared = ctx.shared;
        let plan = &shared.plan;
        if self.h2.is_some() {
            return self.handle_frames(ctx, registry, now);
        }
        loop {
            let buf = &self.rbuf[self.rlo..self.rhi];
            let parsed = match plan.protocol {
                Protocol::Divvy => parse_divvy(buf),
                Protocol::Take => parse_take(buf),
                Protocol::Droplet => parse_droplet(buf),
                Protocol::RespIncr | Protocol::RespScript => parse_resp(buf, plan.resp_mode),
                // Read by `handle_frames`.
                Protocol::EnvoyRls => Parse::Invalid,
            };
            let (used, reply) = match parsed {
                Parse::Control { used, ping } => {
                    if let Some(payload) = ping {
                        push_client_frame(&mut self.wbuf, OPCODE_PONG, &buf[payload]);
                        self.rlo += used;
                        self.flush(ctx, registry, now);
                        if self.sock.is_none() {
                            return false;
                        }
                    } else {
                        self.rlo += used;
                    }
                    continue;
                }
                Parse::Incomplete => {
                    if self.rlo == self.rhi {
                        self.rlo = 0;
                        self.rhi = 0;
                    }
                    return true;
                }
                Parse::Invalid => {
                    ctx.counts.errors += 1;
                    ctx.errors += 1;
                    self.close(ctx, registry, now);
                    return false;
                }
                Parse::Complete(used, reply) => (used, reply),
            };
            self.rlo += used;
            let Some(p) = self.inflight.pop_front() else {
                // An answer nobody asked for.
                ctx.counts.errors += 1;
                ctx.errors += 1;
                self.close(ctx, registry, now);
                return false;
            };
            self.backoff_ns = 0;
            if p.control {
                if let Reply::Error { .. } = reply {
                    ctx.counts.errors += 1;
                    ctx.errors += 1;
                }
                continue;
            }
            if !self.record(ctx, registry, p, reply, now) {
                return false;
            }
        }
    }

    /// Parse the HTTP/2 frames in the read buffer (envoy-rls): answer SETTINGS and PING, apply
    /// flow control, and record each call when its stream ends. False when the connection closed.
    fn handle_frames(&mut self, ctx: &mut Ctx, registry: &Registry, now: u64) -> bool {
        loop {
            let Some(h2) = self.h2.as_mut() else {
                return false;
            };
            let (used, frame) = match grpc::parse_frame(&self.rbuf[self.rlo..self.rhi]) {
                FrameParse::Complete(used, frame) => (used, frame),
                FrameParse::Incomplete => {
                    if self.rlo == self.rhi {
                        self.rlo = 0;
                        self.rhi = 0;
                    }
                    return true;
                }
                FrameParse::Invalid => {
                    ctx.counts.errors += 1;
                    ctx.errors += 1;
                    self.close(ctx, registry, now);
                    return false;
                }
            };
            // A stream that ended: its call and whether it was reset.
            let mut ended = None;
            match frame {
                Frame::Data {
                    stream,
                    end,
                    payload,
                    flow,
                } => {
                    h2.consumed(flow, &mut self.wbuf);
                    if let Some(s) = h2.get_mut(stream) {
                        s.verdict.get_or_insert(grpc::response_verdict(payload));
                    }
                    if end {
                        ended = h2.close(stream).map(|s| (s, false));
                    }
                }
                Frame::Headers { stream, end: true } => {
                    ended = h2.close(stream).map(|s| (s, false));
                }
                Frame::Reset { stream } => ended = h2.close(stream).map(|s| (s, true)),
                Frame::Settings {
                    ack: false,
                    payload,
                } => h2.settings(payload, &mut self.wbuf),
                Frame::Ping {
                    ack: false,
                    payload,
                } => grpc::push_ping_ack(&mut self.wbuf, payload),
                Frame::WindowUpdate { stream, increment } => h2.window_update(stream, increment),
                // The server is closing: it answers the streams it took (or closes, and what it
                // has not answered is lost); `fill` replaces the connection once they are done.
                Frame::GoAway => h2.going_away = true,
                Frame::Headers { .. }
                | Frame::Settings { .. }
                | Frame::Ping { .. }
                | Frame::Other => {}
            }
            self.rlo += used;
            let Some((stream, reset)) = ended else {
                continue;
            };
            self.backoff_ns = 0;
            let reply = match (reset, stream.verdict) {
                (false, Some(Verdict::Ok)) => Reply::Allowed { credit: 0 },
                (false, Some(Verdict::OverLimit)) => Reply::Denied,
                (false, Some(Verdict::Unexpected)) => Reply::Other,
                // No message: gRPC's trailers-only error form; or the stream was reset.
                (_, None) | (true, _) => Reply::Error { noscript: false },
            };
            if !self.record(ctx, registry, stream.call, reply, now) {
                return false;
            }
        }
    }

    /// Record the answer `reply` to the workload request `p`. False when the connection closed.
    fn record(
        &mut self,
        ctx: &mut Ctx,
        registry: &Registry,
        p: Pending,
        reply: Reply,
        now: u64,
    ) -> bool {
        let plan = &ctx.shared.plan;
        self.inflight_reqs -= 1;
        ctx.answered += 1;
        let recorded = ctx.in_window(p.due_ns);
        if recorded {
            let latency = now.saturating_sub(p.due_ns).clamp(1, LATENCY_NS_MAX);
            ctx.hist.saturating_record(latency);
            if let Some(w) = ctx.windows.as_mut() {
                w.record(p.due_ns.saturating_sub(ctx.warm_end_ns), latency);
            }
        }
        match reply {
            Reply::Allowed { credit } => {
                if recorded {
                    ctx.counts.allowed += 1;
                }
                if plan.check {
                    ctx.hits.push(AllowedHit {
                        actor: p.actor,
                        conn: self.id as u32,
                        seq: p.seq,
                        sent_ns: p.sent_ns,
                        recv_ns: now,
                        credit,
                    });
                }
            }
            Reply::Denied => {
                if recorded {
                    ctx.counts.denied += 1;
                }
            }
            Reply::Error { noscript } => {
                ctx.errors += 1;
                if recorded {
                    ctx.counts.errors += 1;
                }
                if plan.protocol.closes_after_error() {
                    // The server closes after an ERR (or droplet's close frame); nothing after
                    // it was executed.
                    self.close(ctx, registry, now);
                    self.retry_at_ns = now;
                    return false;
                }
                if noscript && self.script_seq.is_none_or_before(p.seq) {
                    self.push_script_load(ctx, now);
                    self.flush(ctx, registry, now);
                }
            }
            Reply::Other => {
                ctx.errors += 1;
                if recorded {
                    ctx.counts.errors += 1;
                }
            }
        }
        true
    }
}

/// A connect error that retrying cannot mend, explained; `None` for the others.
fn fatal_connect_error(e: &io::Error) -> Option<String> {
    #[cfg(target_os = "linux")]
    match e.raw_os_error() {
        Some(libc::EMFILE) => {
            let soft = crate::fd_limit::soft_limit()
                .map_or_else(|| "unknown".to_string(), |n| n.to_string());
            return Some(format!(
                "out of file descriptors ({e}): raise `ulimit -n` (the soft limit is {soft}) or use \
                 fewer --connections"
            ));
        }
        Some(libc::ENFILE) => {
            return Some(format!(
                "the system is out of file descriptors ({e}): raise fs.file-max or use fewer \
                 --connections"
            ))
        }
        Some(libc::EADDRNOTAVAIL) => {
            return Some(format!(
                "out of local ports ({e}): widen net.ipv4.ip_local_port_range or use fewer \
                 --connections"
            ))
        }
        _ => {}
    }
    let _ = e;
    None
}

trait SeqExt {
    fn is_none_or_before(&self, seq: u64) -> bool;
}

impl SeqExt for Option<u64> {
    /// No SCRIPT LOAD was sent after request `seq`.
    fn is_none_or_before(&self, seq: u64) -> bool {
        match *self {
            None => true,
            Some(s) => s < seq,
        }
    }
}

/// Open-loop schedule of one thread: global connection `c` gets the requests due at
/// `start + (c + k * connections) / rate` for k = 0, 1, ...; the thread walks its connections in
/// order of `c`, round after round.
struct Schedule {
    start_ns: u64,
    ns_per_request: f64,
    connections: u64,
    cursor: usize,
    round: u64,
}

impl Schedule {
    fn due(&self, conns: &[Conn]) -> u64 {
        let slot = conns[self.cursor].id as u64 + self.round * self.connections;
        self.start_ns + (slot as f64 * self.ns_per_request) as u64
    }

    fn advance(&mut self, n: usize) {
        self.cursor += 1;
        if self.cursor == n {
            self.cursor = 0;
            self.round += 1;
        }
    }
}

/// Run one thread's share of the connections (global ids `ids`) to completion: connect them all,
/// start together with the other threads (`barrier`), run, and count what is left unanswered.
pub fn run_thread(shared: &RunShared, ids: &[usize], barrier: &Barrier) -> Result<ThreadResult> {
    let mut thread = ThreadLoop::new(shared, ids)?;
    let connected = thread.connect_all();
    if connected.is_err() {
        shared.abort.store(true, Ordering::Relaxed);
    }
    barrier.wait();
    connected?;
    if shared.abort.load(Ordering::Relaxed) {
        return Err(anyhow!("another thread could not connect"));
    }
    let done_ns = thread.run()?;
    Ok(thread.finish(done_ns))
}

/// One thread's event loop: its connections, its poll and what they record.
struct ThreadLoop<'a> {
    ctx: Ctx<'a>,
    conns: Vec<Conn>,
    poll: Poll,
    events: Events,
    /// Wakes the loop when the next open-loop request is due (where the timer is precise).
    timer: Timer,
    /// The due time the timer is armed for (0: none).
    timer_armed_for: u64,
    /// Open loop: which request is due next.
    schedule: Option<Schedule>,
    /// Open loop: the connections handed requests at this wake-up, each filled once after all
    /// are handed out, so that a connection's requests due by then go out in one write.
    handed: Vec<usize>,
    /// Answers and errors already added to the run's shared progress counters.
    published: (u64, u64),
}

impl<'a> ThreadLoop<'a> {
    fn new(shared: &'a RunShared, ids: &[usize]) -> Result<ThreadLoop<'a>> {
        let plan = &shared.plan;
        if plan.rate.is_some() {
            tighten_timer_slack();
        }
        let poll = Poll::new()?;
        let conns: Vec<Conn> = ids
            .iter()
            .enumerate()
            .map(|(local, &id)| Conn::new(id, local, plan))
            .collect();
        let ctx = Ctx {
            shared,
            hist: Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3)?,
            counts: Counts::default(),
            hits: Vec::new(),
            windows: plan.window_ns.map(|w| Windows::new(w, plan.duration_ns)),
            warm_end_ns: u64::MAX,
            meas_end_ns: u64::MAX,
            sending: false,
            budget_left: conns.iter().fold(0u64, |a, c| a.saturating_add(c.budget)),
            started: false,
            last_connect_error: None,
            fatal: None,
            closed: conns.len(),
            answered: 0,
            errors: 0,
        };
        let timer = Timer::new(poll.registry(), TIMER)?;
        Ok(ThreadLoop {
            ctx,
            conns,
            poll,
            events: Events::with_capacity(1024),
            timer,
            timer_armed_for: 0,
            schedule: None,
            handed: Vec::new(),
            published: (0, 0),
        })
    }

    /// Phase 1: connect everything, paced ([`CONNECTS_PENDING_MAX`] under way at once) and bounded
    /// by `--connect-timeout-secs`.
    fn connect_all(&mut self) -> Result<()> {
        let plan = &self.ctx.shared.plan;
        let deadline = self.ctx.now() + plan.connect_timeout_ns;
        loop {
            let now = self.ctx.now();
            if self.conns.iter().all(|c| c.stage == Stage::Ready) {
                return Ok(());
            }
            let up = || {
                self.conns
                    .iter()
                    .filter(|c| c.stage == Stage::Ready)
                    .count()
            };
            if let Some(why) = self.ctx.fatal.take() {
                return Err(anyhow!(
                    "cannot open a connection to {} ({} of this thread's {} are up): {why}",
                    plan.targets(),
                    up(),
                    self.conns.len()
                ));
            }
            if now >= deadline || self.ctx.shared.abort.load(Ordering::Relaxed) {
                let why = match &self.ctx.last_connect_error {
                    Some(e) => format!(" (last failure: {e})"),
                    None => String::new(),
                };
                return Err(anyhow!(
                    "only {} of {} connections to {} were established within {:.1} s{why}",
                    up(),
                    self.conns.len(),
                    plan.targets(),
                    plan.connect_timeout_ns as f64 / 1e9
                ));
            }
            let mut pending = self
                .conns
                .iter()
                .filter(|c| matches!(c.stage, Stage::Connecting | Stage::Upgrading))
                .count();
            for c in self.conns.iter_mut() {
                if pending >= CONNECTS_PENDING_MAX {
                    break;
                }
                if c.sock.is_none() && c.retry_at_ns <= now {
                    c.connect(&mut self.ctx, self.poll.registry(), now);
                    if c.sock.is_some() {
                        pending += 1;
                    }
                }
            }
            let wait = (deadline - now).min(10_000_000);
            self.poll
                .poll(&mut self.events, Some(Duration::from_nanos(wait)))?;
            let now = self.ctx.now();
            for ev in self.events.iter() {
                if let Some(c) = self.conns.get_mut(ev.token().0) {
                    if c.stage != Stage::Ready {
                        c.on_connect_event(&mut self.ctx, self.poll.registry(), now);
                    }
                }
            }
        }
    }

    /// Phase 2: warmup, measured time and drain. Returns when every request was answered
    /// (`Some(when)`) or at the end of the drain (`None`).
    fn run(&mut self) -> Result<Option<u64>> {
        let shared = self.ctx.shared;
        let plan = &shared.plan;
        let start_ns = self.ctx.now();
        let _ = shared.started_ns.compare_exchange(
            0,
            start_ns.max(1),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        self.ctx.warm_end_ns = start_ns + plan.warmup_ns;
        self.ctx.meas_end_ns = self.ctx.warm_end_ns + plan.duration_ns;
        let drain_end_ns = self.ctx.meas_end_ns + plan.drain_ns;
        self.ctx.started = true;
        self.ctx.sending = true;
        self.schedule = plan.rate.map(|rate| Schedule {
            start_ns,
            ns_per_request: 1e9 / rate,
            connections: plan.connections as u64,
            cursor: 0,
            round: 0,
        });
        if self.schedule.is_none() {
            let now = self.ctx.now();
            for c in self.conns.iter_mut() {
                c.fill(&mut self.ctx, self.poll.registry(), now);
            }
        }
        loop {
            let now = self.ctx.now();
            // Every request due before the end is sent, even when the loop wakes after it (a
            // paced loop wakes at the end of the pace its last requests fall in).
            let next_due = self.hand_out_due_requests(now);
            if self.ctx.sending && now >= self.ctx.meas_end_ns {
                self.ctx.sending = false;
            }
            // Finished? Nothing more to send and nothing outstanding, or out of drain time.
            if !self.ctx.sending || self.ctx.budget_left == 0 {
                let idle = self
                    .conns
                    .iter()
                    .all(|c| c.inflight_reqs == 0 && c.queued.is_empty());
                if idle {
                    return Ok(Some(now));
                }
                if now >= drain_end_ns {
                    return Ok(None);
                }
            }
            let phase_end = if self.ctx.sending {
                self.ctx.meas_end_ns
            } else {
                drain_end_ns
            };
            let wake = self.reconnect_due(now, phase_end);
            self.wait(now, wake, next_due)?;
            self.handle_events();
            self.publish_progress();
        }
    }

    /// Open loop: hands every request due by `now` to its connection. Returns when the next one is
    /// due (`u64::MAX`: none, or closed loop).
    fn hand_out_due_requests(&mut self, now: u64) -> u64 {
        let Some(s) = self.schedule.as_mut() else {
            return u64::MAX;
        };
        let connections = self.conns.len();
        // Paced, only what was due by the start of the current interval (the loop also wakes for
        // answers, and sending at each of those wake-ups would send a request or two at a time);
        // after the end, everything due before it.
        let pace = self.ctx.shared.plan.pace_ns;
        let cutoff = if pace > 0 && now < self.ctx.meas_end_ns {
            now / pace * pace
        } else {
            now
        };
        let mut next_due = u64::MAX;
        while self.ctx.sending && self.ctx.budget_left > 0 {
            let due = s.due(&self.conns);
            if due >= self.ctx.meas_end_ns {
                self.ctx.sending = false;
                break;
            }
            if due > cutoff {
                next_due = due;
                break;
            }
            let index = s.cursor;
            let c = &mut self.conns[index];
            s.advance(connections);
            if c.budget == 0 {
                continue;
            }
            c.budget -= 1;
            self.ctx.budget_left -= 1;
            c.queued.push_back(due);
            self.handed.push(index);
        }
        // Written after all are handed out: with `--pace-us`, every request due in the interval
        // leaves in one write per connection, as a pipelining client sends what it has at once.
        self.handed.sort_unstable();
        self.handed.dedup();
        for &index in &self.handed {
            self.conns[index].fill(&mut self.ctx, self.poll.registry(), now);
        }
        self.handed.clear();
        next_due
    }

    /// Reopens connections whose backoff expired. Returns when the loop must look again: `wake`,
    /// or earlier when a backoff ends before it.
    fn reconnect_due(&mut self, now: u64, mut wake: u64) -> u64 {
        if self.ctx.closed == 0 {
            return wake;
        }
        for c in self.conns.iter_mut() {
            if c.sock.is_none() {
                if c.retry_at_ns <= now {
                    c.connect(&mut self.ctx, self.poll.registry(), now);
                } else {
                    wake = wake.min(c.retry_at_ns);
                }
            }
        }
        wake
    }

    /// Sleeps until an event, the next due request (`next_due`), or `wake`, at most [`TICK_NS`].
    fn wait(&mut self, now: u64, wake: u64, next_due: u64) -> Result<()> {
        let wake = wake.min(now + TICK_NS);
        let mut timeout = Duration::from_nanos(wake.saturating_sub(now));
        if next_due != u64::MAX {
            // Paced: wake at the end of the pace interval the next request falls in, for every
            // request due by then (their lateness counts in their latency).
            let pace = self.ctx.shared.plan.pace_ns;
            let next_due = if pace > 0 {
                next_due.div_ceil(pace).saturating_mul(pace)
            } else {
                next_due
            };
            let until = next_due.saturating_sub(now);
            if (until <= SPIN_NS && pace == 0) || !Timer::PRECISE {
                timeout = timeout.min(Duration::from_nanos(if until <= SPIN_NS {
                    0
                } else {
                    until
                }));
            } else if self.timer_armed_for != next_due {
                self.timer.arm(until)?;
                self.timer_armed_for = next_due;
            }
        }
        self.poll.poll(&mut self.events, Some(timeout))?;
        Ok(())
    }

    /// Lets each connection act on what the poll reported: finish connecting, read answers, write.
    fn handle_events(&mut self) {
        for ev in self.events.iter() {
            if ev.token() == TIMER {
                self.timer.ack();
                self.timer_armed_for = 0;
                continue;
            }
            let Some(c) = self.conns.get_mut(ev.token().0) else {
                continue;
            };
            if c.sock.is_none() {
                continue;
            }
            let registry = self.poll.registry();
            if c.stage != Stage::Ready {
                let now = self.ctx.now();
                c.on_connect_event(&mut self.ctx, registry, now);
                if c.stage == Stage::Ready {
                    c.fill(&mut self.ctx, registry, now);
                }
                continue;
            }
            if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                c.on_readable(
                    &mut self.ctx,
                    registry,
                    ev.is_read_closed() || ev.is_error(),
                );
            }
            if ev.is_writable() && c.stage == Stage::Ready {
                let now = self.ctx.now();
                c.flush(&mut self.ctx, registry, now);
                c.fill(&mut self.ctx, registry, now);
            }
        }
    }

    /// Adds this thread's new answers and errors to the run's progress counters.
    fn publish_progress(&mut self) {
        let shared = self.ctx.shared;
        let (answered, errors) = self.published;
        if self.ctx.answered != answered {
            shared
                .answered
                .fetch_add(self.ctx.answered - answered, Ordering::Relaxed);
        }
        if self.ctx.errors != errors {
            shared
                .errors
                .fetch_add(self.ctx.errors - errors, Ordering::Relaxed);
        }
        self.published = (self.ctx.answered, self.ctx.errors);
    }

    /// Counts what is still outstanding as lost, publishes the last progress, and hands over the
    /// thread's results; `done_ns` is when the last answer came, if every request got one.
    fn finish(mut self, done_ns: Option<u64>) -> ThreadResult {
        for c in self.conns.iter_mut() {
            for p in c.inflight.drain(..) {
                if !p.control && self.ctx.in_window(p.due_ns) {
                    self.ctx.counts.unanswered += 1;
                }
            }
            if let Some(h2) = c.h2.as_mut() {
                for stream in h2.drain() {
                    if self.ctx.in_window(stream.call.due_ns) {
                        self.ctx.counts.unanswered += 1;
                    }
                }
            }
            for due in c.queued.drain(..) {
                if self.ctx.in_window(due) {
                    self.ctx.counts.unanswered += 1;
                }
            }
        }
        self.publish_progress();
        let ctx = self.ctx;
        let measure_end_ns = match done_ns {
            Some(d) => d.min(ctx.meas_end_ns),
            None => ctx.meas_end_ns,
        }
        .max(ctx.warm_end_ns);
        ThreadResult {
            hist: ctx.hist,
            counts: ctx.counts,
            hits: ctx.hits,
            windows: ctx.windows,
            measure_start_ns: ctx.warm_end_ns,
            measure_end_ns,
        }
    }
}
