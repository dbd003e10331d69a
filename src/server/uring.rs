//! An experimental io_uring serving loop for the line protocol (`--io-uring`,
//! Linux only, in-memory backend only): one ring per serving thread; the
//! accept, the receives and the sends of all its connections are queued as
//! submissions and handed to the kernel, and their completions reaped, with
//! one `io_uring_enter` per loop turn. Lines are decided inline by the same
//! [`Engine`] as the epoll path, with the same replies in the same order.
//!
//! What it does not do that the epoll path does: network backends (a reply
//! that would have to wait is refused), the yield after large reads (a loop
//! turn serves every connection with a completion anyway), and timeouts
//! are checked on a 100 ms tick, so they fire up to 0.2 s late.

use super::connection::partial_line_since;
use super::socket::InputBuffer;
use super::thread_per_core::{bind_listeners, Serving};
use super::{Limits, ServerConfig};
use crate::engine::{Engine, Outcome, Reply, READ_AHEAD_LINES_MAX};
use crate::metrics::RequestProtocol;
use crate::protocol::{split_line, ErrorCode};
use io_uring::{opcode, types, IoUring};
use smallvec::SmallVec;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Submission queue entries per ring (the completion queue has twice as many).
const RING_ENTRIES: u32 = 1024;
/// Bytes asked of the kernel per receive (as the epoll path).
const READ_CHUNK_BYTES: usize = 16 * 1024;
/// A connection stops receiving while this many reply bytes wait behind a
/// send in flight (backpressure on a client that does not read).
const OUTPUT_BYTES_MAX: usize = 16 * 1024;
/// How often timeouts and shutdown are checked while nothing completes.
const TICK: Duration = Duration::from_millis(100);
/// How long a closing connection drains what the client still sends (as the
/// epoll path), and how many bytes at most.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES_MAX: usize = 1 << 20;

const ACCEPT: u64 = u64::MAX;
const CANCEL: u64 = u64::MAX - 1;
const OP_RECV: u64 = 1;
const OP_SEND: u64 = 2;

/// The line protocol's endpoint on io_uring, bound, not serving yet.
pub struct UringServer {
    listeners: Vec<std::net::TcpListener>,
    local_addr: SocketAddr,
    engine: Arc<Engine>,
    limits: Limits,
    drain_timeout_ms: u64,
}

/// Binds one listener per serving thread, after checking that the kernel
/// gives this process a ring at all.
pub fn bind(config: ServerConfig, engine: Arc<Engine>) -> io::Result<UringServer> {
    // The probe's ring lives and dies on a thread of its own: tearing a ring
    // down signals the task that made it (task work), which would interrupt
    // a blocking call of the caller's with EINTR.
    let probed = std::thread::Builder::new()
        .name("tollgate-uring-probe".to_string())
        .spawn(|| new_ring().map(drop))?
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the probe panicked")));
    probed.map_err(|error| {
        io::Error::new(
            error.kind(),
            format!("--io-uring: the kernel refused an io_uring instance: {error}"),
        )
    })?;
    let (listeners, local_addr) = bind_listeners(config.listen, config.threads)?;
    for listener in &listeners {
        // The ring waits for connections itself.
        listener.set_nonblocking(false)?;
    }
    Ok(UringServer {
        listeners,
        local_addr,
        engine,
        limits: config.limits,
        drain_timeout_ms: config.drain_timeout_ms,
    })
}

fn new_ring() -> io::Result<IoUring> {
    // Task work runs only when this thread enters the kernel to reap, not as
    // an interrupt of whatever it is doing; fall back for older kernels.
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(RING_ENTRIES)
        .or_else(|_| IoUring::new(RING_ENTRIES))
}

impl UringServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Starts one serving thread per listener and returns at once.
    pub fn spawn(self) -> io::Result<Serving> {
        let (sender, receiver) = watch::channel(false);
        let open_connections = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        for (index, listener) in self.listeners.into_iter().enumerate() {
            let worker = Worker {
                listener,
                engine: Arc::clone(&self.engine),
                limits: self.limits,
                drain_timeout: Duration::from_millis(self.drain_timeout_ms),
                shutdown: receiver.clone(),
                open_connections: Arc::clone(&open_connections),
            };
            let spawned = std::thread::Builder::new()
                .name(format!("tollgate-uring-{index}"))
                .spawn(move || worker.run());
            match spawned {
                Ok(thread) => threads.push(thread),
                Err(error) => {
                    let _ = sender.send(true);
                    threads.into_iter().for_each(|thread| drop(thread.join()));
                    return Err(error);
                }
            }
        }
        Ok(Serving::from_threads(self.local_addr, sender, threads))
    }
}

struct Worker {
    listener: std::net::TcpListener,
    engine: Arc<Engine>,
    limits: Limits,
    drain_timeout: Duration,
    shutdown: watch::Receiver<bool>,
    open_connections: Arc<AtomicUsize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading and answering lines.
    Open,
    /// An `ERR` was produced: send what is queued, then half-close.
    Closing,
    /// Half-closed after an `ERR`: discard what the client still sends.
    Lingering { until: Instant, drained: usize },
    /// Nothing more to do: close once no operation is in flight.
    Done,
}

struct Conn {
    fd: OwnedFd,
    input: InputBuffer,
    /// Replies not yet handed to the kernel.
    output: Vec<u8>,
    /// Replies handed to a send (`sending[sent..]` not sent yet).
    sending: Vec<u8>,
    sent: usize,
    recv_armed: bool,
    send_armed: bool,
    cancel_asked: bool,
    state: State,
    /// End of stream, or shutdown: no more input.
    input_done: bool,
    arrival: crate::engine::Arrival,
    partial_line_since: Option<Instant>,
    last_input: Instant,
    /// Counted in `open_connections` and, unless refused, in the gauge.
    counted_open: bool,
}

struct Loop {
    ring: IoUring,
    engine: Arc<Engine>,
    limits: Limits,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    open_connections: Arc<AtomicUsize>,
    live: usize,
}

impl Worker {
    fn run(self) {
        // A tokio context, should anything under the engine look for one.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        let runtime = match runtime {
            Ok(runtime) => runtime,
            Err(error) => {
                tracing::error!(%error, "cannot start a serving runtime");
                return;
            }
        };
        let _context = runtime.enter();
        let ring = match new_ring() {
            Ok(ring) => ring,
            Err(error) => {
                tracing::error!(%error, "cannot create an io_uring instance");
                return;
            }
        };
        let mut serving = Loop {
            ring,
            engine: self.engine,
            limits: self.limits,
            conns: Vec::new(),
            free: Vec::new(),
            open_connections: self.open_connections,
            live: 0,
        };
        serving.run(&self.listener, &self.shutdown, self.drain_timeout);
    }
}

impl Loop {
    fn run(
        &mut self,
        listener: &std::net::TcpListener,
        shutdown: &watch::Receiver<bool>,
        drain_timeout: Duration,
    ) {
        let listen_fd = types::Fd(listener.as_raw_fd());
        let accept = opcode::Accept::new(listen_fd, std::ptr::null_mut(), std::ptr::null_mut())
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(ACCEPT);
        let mut accept_armed = false;
        let mut draining_since: Option<Instant> = None;
        let mut completions: Vec<(u64, i32)> = Vec::with_capacity(256);
        let mut last_tick = Instant::now();
        let tick = types::Timespec::from(TICK);
        let brief = types::Timespec::from(Duration::from_millis(1));
        let mut shutdown_seen = false;
        loop {
            if draining_since.is_none() && shutdown_seen {
                // One turn after the signal (receives that were ready then
                // are in): stop reading, answer what was read, close.
                draining_since = Some(Instant::now());
                if accept_armed {
                    self.push(&opcode::AsyncCancel::new(ACCEPT).build().user_data(CANCEL));
                }
                for index in 0..self.conns.len() {
                    if let Some(conn) = self.conns[index].as_mut() {
                        conn.input_done = true;
                        self.progress(index);
                    }
                }
            }
            if let Some(since) = draining_since {
                if self.live == 0 && !accept_armed {
                    return;
                }
                if since.elapsed() >= drain_timeout {
                    // Dropping the loop closes the ring (cancelling what is
                    // in flight), then the connections (see `Drop`).
                    return;
                }
            } else if !accept_armed {
                self.push(&accept);
                accept_armed = true;
            }
            if !shutdown_seen && *shutdown.borrow() {
                // Completions the kernel holds back until asked (deferred
                // task work) are reaped by one more, brief, turn.
                shutdown_seen = true;
            }
            let wait = match (shutdown_seen, draining_since) {
                (true, None) => &brief,
                _ => &tick,
            };
            let args = types::SubmitArgs::new().timespec(wait);
            if let Err(error) = self.ring.submitter().submit_with_args(1, &args) {
                match error.raw_os_error() {
                    Some(libc::ETIME | libc::EINTR | libc::EBUSY) => {}
                    // A ring this loop set up wrongly: nothing will ever work.
                    Some(
                        libc::EBADF | libc::EFAULT | libc::EINVAL | libc::ENXIO | libc::EOPNOTSUPP,
                    ) => {
                        tracing::error!(%error, "io_uring_enter failed; this serving thread stops");
                        return;
                    }
                    // Short of memory or resources (EAGAIN, ENOMEM, EBADR): the
                    // connections stay; try again in a moment.
                    _ => {
                        tracing::warn!(%error, "io_uring_enter failed; retrying");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
            completions.clear();
            completions.extend(
                self.ring
                    .completion()
                    .map(|entry| (entry.user_data(), entry.result())),
            );
            for &(user_data, result) in &completions {
                match user_data {
                    CANCEL => {}
                    ACCEPT => {
                        accept_armed = false;
                        if result >= 0 {
                            // SAFETY: a successful accept returns a new descriptor we own.
                            let fd = unsafe { OwnedFd::from_raw_fd(result) };
                            self.accepted(fd, draining_since.is_some());
                        }
                    }
                    _ => self.completed(user_data, result),
                }
            }
            if last_tick.elapsed() >= TICK {
                last_tick = Instant::now();
                self.check_timeouts();
            }
        }
    }

    /// Queues one submission, handing the queue to the kernel first if full.
    fn push(&mut self, entry: &io_uring::squeue::Entry) {
        loop {
            // SAFETY: every buffer an entry points to belongs to a `Conn` that
            // is not freed, nor its buffer touched, until the entry completes.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return;
            }
            if let Err(error) = self.ring.submit() {
                if error.raw_os_error() != Some(libc::EBUSY) {
                    tracing::warn!(%error, "io_uring submit failed");
                }
            }
        }
    }

    fn accepted(&mut self, fd: OwnedFd, draining: bool) {
        if draining {
            return;
        }
        let nodelay: libc::c_int = 1;
        // SAFETY: a valid socket and an option of the size given.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                std::ptr::addr_of!(nodelay).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        let open = self.open_connections.fetch_add(1, Ordering::AcqRel) + 1;
        let refused = open > self.limits.connections_max;
        let now = Instant::now();
        let mut conn = Conn {
            fd,
            input: InputBuffer::new(
                READ_CHUNK_BYTES,
                self.limits.line_bytes_max.saturating_add(READ_CHUNK_BYTES),
            ),
            output: Vec::with_capacity(256),
            sending: Vec::with_capacity(256),
            sent: 0,
            recv_armed: false,
            send_armed: false,
            cancel_asked: false,
            state: State::Open,
            input_done: false,
            arrival: self.engine.arrival(),
            partial_line_since: None,
            last_input: now,
            counted_open: !refused,
        };
        if refused {
            self.engine.metrics.connection_refused();
            conn.output
                .extend_from_slice(b"ERR unknown \"too many connections\"\n");
            conn.state = State::Closing;
        } else {
            self.engine.metrics.connection_opened();
        }
        let index = match self.free.pop() {
            Some(index) => {
                self.conns[index] = Some(conn);
                index
            }
            None => {
                self.conns.push(Some(conn));
                self.conns.len() - 1
            }
        };
        self.live += 1;
        self.progress(index);
    }

    fn completed(&mut self, user_data: u64, result: i32) {
        let index = (user_data >> 8) as usize;
        let op = user_data & 0xff;
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        if op == OP_RECV {
            conn.recv_armed = false;
            if result > 0 {
                let n = result as usize;
                match &mut conn.state {
                    State::Lingering { drained, .. } => {
                        *drained += n;
                        let unread = conn.input.unread().len();
                        conn.input.consume(unread);
                        if *drained >= LINGER_BYTES_MAX {
                            conn.state = State::Done;
                        }
                    }
                    _ => {
                        conn.input.filled(n);
                        conn.arrival = self.engine.arrival();
                        conn.last_input = Instant::now();
                    }
                }
            } else if result == 0 || result == -libc::ECANCELED {
                conn.input_done = true;
                if matches!(conn.state, State::Lingering { .. }) {
                    conn.state = State::Done;
                }
            } else if result != -libc::EINTR && result != -libc::EAGAIN {
                conn.state = State::Done;
            }
        } else if op == OP_SEND {
            conn.send_armed = false;
            if result > 0 {
                conn.sent += result as usize;
            } else if result != -libc::EINTR && result != -libc::EAGAIN {
                conn.state = State::Done;
            }
        }
        self.progress(index);
    }

    /// Moves a connection on after a completion: executes what it read,
    /// queues its next send and receive, and closes it when it is done.
    fn progress(&mut self, index: usize) {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        if conn.state == State::Open && !conn.recv_armed {
            execute_buffered_lines(&self.engine, &self.limits, conn);
        }
        let mut entries: [Option<io_uring::squeue::Entry>; 3] = [None, None, None];
        let fd = types::Fd(conn.fd.as_raw_fd());
        if conn.state != State::Done && !conn.send_armed {
            if conn.sent >= conn.sending.len() {
                conn.sending.clear();
                conn.sent = 0;
                std::mem::swap(&mut conn.output, &mut conn.sending);
            }
            if conn.sent < conn.sending.len() {
                let rest = &conn.sending[conn.sent..];
                let len = rest.len().min(u32::MAX as usize) as u32;
                entries[0] = Some(
                    opcode::Send::new(fd, rest.as_ptr(), len)
                        .flags(libc::MSG_NOSIGNAL)
                        .build()
                        .user_data(((index as u64) << 8) | OP_SEND),
                );
                conn.send_armed = true;
            }
        }
        let flushed = !conn.send_armed && conn.output.is_empty();
        if conn.state == State::Closing && flushed {
            // After our last line: half-close, then drain for a moment.
            // SAFETY: shutting down a socket we own.
            unsafe { libc::shutdown(conn.fd.as_raw_fd(), libc::SHUT_WR) };
            let unread = conn.input.unread().len();
            conn.input.consume(unread);
            conn.state = State::Lingering {
                until: Instant::now() + LINGER,
                drained: 0,
            };
        }
        if conn.state == State::Open && conn.input_done && flushed {
            // Partial lines left at end of stream or shutdown are never answered.
            conn.state = State::Done;
        }
        let wants_input = match conn.state {
            State::Open => !conn.input_done && conn.output.len() < OUTPUT_BYTES_MAX,
            State::Lingering { .. } => !conn.input_done,
            State::Closing | State::Done => false,
        };
        if wants_input && !conn.recv_armed {
            let spare = conn.input.spare();
            if spare.is_empty() {
                // Cannot happen: a full buffer holds a line over the limit,
                // which is answered with an error.
                conn.state = State::Done;
            } else {
                let len = spare.len().min(u32::MAX as usize) as u32;
                entries[1] = Some(
                    opcode::Recv::new(fd, spare.as_mut_ptr(), len)
                        .build()
                        .user_data(((index as u64) << 8) | OP_RECV),
                );
                conn.recv_armed = true;
                conn.cancel_asked = false;
            }
        }
        let stop_receiving = conn.state == State::Done
            || (conn.input_done && conn.state == State::Open)
            || conn.state == State::Closing;
        if stop_receiving && conn.recv_armed && !conn.cancel_asked {
            conn.cancel_asked = true;
            entries[2] = Some(
                opcode::AsyncCancel::new(((index as u64) << 8) | OP_RECV)
                    .build()
                    .user_data(CANCEL),
            );
        }
        let finished = conn.state == State::Done && !conn.recv_armed && !conn.send_armed;
        for entry in entries.iter().flatten() {
            self.push(entry);
        }
        if finished {
            self.free_conn(index);
        }
    }

    fn free_conn(&mut self, index: usize) {
        if let Some(conn) = self.conns[index].take() {
            if conn.counted_open {
                self.engine.metrics.connection_closed();
            }
            self.open_connections.fetch_sub(1, Ordering::AcqRel);
            self.live -= 1;
            self.free.push(index);
            // Dropping `conn` closes its socket.
        }
    }

    /// The line and idle timeouts, and the end of lingering.
    fn check_timeouts(&mut self) {
        let now = Instant::now();
        for index in 0..self.conns.len() {
            let Some(conn) = self.conns[index].as_mut() else {
                continue;
            };
            match conn.state {
                State::Lingering { until, .. } if now >= until => conn.state = State::Done,
                State::Open => {
                    let line_late = self.limits.line_timeout_ms > 0
                        && conn.partial_line_since.is_some_and(|since| {
                            now.duration_since(since)
                                >= Duration::from_millis(self.limits.line_timeout_ms)
                        });
                    let idle = self.limits.idle_timeout_ms > 0
                        && conn.partial_line_since.is_none()
                        && conn.output.is_empty()
                        && !conn.send_armed
                        && now.duration_since(conn.last_input)
                            >= Duration::from_millis(self.limits.idle_timeout_ms);
                    if line_late {
                        // A line trickling in slower than this holds a slot for nothing.
                        self.engine.metrics.error(ErrorCode::Unknown);
                        self.engine.metrics.requests_read(RequestProtocol::Divvy, 1);
                        Reply::error("line timeout").encode(&mut conn.output);
                        conn.state = State::Closing;
                    } else if idle {
                        conn.state = State::Done;
                    } else {
                        continue;
                    }
                }
                _ => continue,
            }
            self.progress(index);
        }
    }
}

impl Drop for Loop {
    /// Counts the connections still open as closed; the fields drop in
    /// order, the ring (and what is in flight on it) before the buffers.
    fn drop(&mut self) {
        for conn in self.conns.iter().flatten() {
            if conn.counted_open {
                self.engine.metrics.connection_closed();
            }
            self.open_connections.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Executes every complete line in the buffer (as the epoll path does, for
/// a backend that answers at once), appending the replies to `output`.
fn execute_buffered_lines(engine: &Arc<Engine>, limits: &Limits, conn: &mut Conn) {
    let mut lines = 0u64;
    let mut outcomes = SmallVec::<[Outcome; READ_AHEAD_LINES_MAX]>::new();
    while conn.state == State::Open {
        // Runs of hits are planned and prefetched before they are decided.
        let arrival = conn.arrival;
        let unread = conn.input.unread();
        let executed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            engine.execute_hit_run(
                unread,
                usize::MAX,
                limits.line_bytes_max,
                arrival,
                None,
                &mut outcomes,
            )
        }));
        let Ok(used) = executed else {
            panicked(conn);
            break;
        };
        if used > 0 {
            conn.input.consume(used);
            lines += outcomes.len() as u64;
            for outcome in outcomes.drain(..) {
                answer(engine, conn, outcome);
            }
            continue;
        }
        let unread = conn.input.unread();
        let Some((line, used)) = split_line(unread) else {
            if unread.len() > limits.line_bytes_max {
                lines += 1;
                fail(engine, conn, Reply::error("line too long"));
            }
            break;
        };
        lines += 1;
        if line.len() > limits.line_bytes_max {
            fail(engine, conn, Reply::error("line too long"));
            break;
        }
        let arrival = conn.arrival;
        let executed = std::panic::catch_unwind(AssertUnwindSafe(|| engine.execute(line, arrival)));
        let Ok(outcome) = executed else {
            panicked(conn);
            break;
        };
        conn.input.consume(used);
        answer(engine, conn, outcome);
    }
    if lines > 0 {
        engine.metrics.requests_read(RequestProtocol::Divvy, lines);
    }
    conn.partial_line_since = partial_line_since(
        conn.input.unread(),
        lines > 0,
        conn.partial_line_since,
        Instant::now,
    );
}

/// Appends a line's reply to `output`.
fn answer(engine: &Arc<Engine>, conn: &mut Conn, outcome: Outcome) {
    let reply = match outcome {
        Outcome::Now(reply) => reply,
        // The memory backend answers at once; nothing here can wait.
        Outcome::Later(_) | Outcome::Deferred(_) => {
            engine.metrics.error(ErrorCode::Unknown);
            Reply::error("this request needs a backend --io-uring does not serve")
        }
    };
    reply.encode(&mut conn.output);
    if reply.closes_connection() {
        conn.state = State::Closing;
    }
}

/// A bug on the serving path: only this connection closes, unanswered.
fn panicked(conn: &mut Conn) {
    tracing::error!("a request panicked; its connection is closed");
    conn.output.clear();
    conn.state = State::Done;
}

fn fail(engine: &Arc<Engine>, conn: &mut Conn, reply: Reply) {
    engine.metrics.error(ErrorCode::Unknown);
    reply.encode(&mut conn.output);
    conn.state = State::Closing;
}
