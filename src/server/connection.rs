//! One client connection of the line protocol: frames lines out of a read
//! buffer, executes them through the [`Engine`], and writes the replies in
//! request order, many per write. Replies that must wait (network backends)
//! queue behind each other; at most `pipeline_max` requests are in flight
//! before the connection stops reading (backpressure, not buffering).

use super::socket::{ClientSocket, InputBuffer};
use super::Limits;
use crate::clock::Moment;
use crate::engine::{
    DeferredHit, Engine, EngineBatch, LoadedRules, Outcome, Reply, READ_AHEAD_LINES_MAX,
};
use crate::metrics::RequestProtocol;
use crate::protocol::split_line;
use crate::store::SlotAnswers;
use futures_util::future::{BoxFuture, FutureExt};
use futures_util::stream::{FuturesOrdered, StreamExt};
use smallvec::SmallVec;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::watch;

/// Room made for a batch's run (a pipelined read's requests) before its
/// first request, rather than growing one reallocation at a time.
const RUN_ITEMS_INITIAL: usize = 16;
/// Most requests a finished run's list may hold room for to be kept for
/// the connection's next run (a huge read's list is given back).
const RUN_ITEMS_KEPT_MAX: usize = 1024;
/// Bytes asked of the kernel per read.
const READ_CHUNK_BYTES: usize = 16 * 1024;
/// Reads of at least half a chunk a connection may do before it yields its
/// thread to the others (about a thousand requests each).
const LARGE_READS_PER_TURN: u32 = 2;

/// Why a connection ended, for tests and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The client closed its side.
    ClientClosed,
    /// An `ERR` was written (bad line, limit exceeded, backend failure).
    AfterError,
    /// The server is shutting down; everything read was answered.
    Shutdown,
    /// The socket failed (reset, broken pipe).
    Io,
    /// The client sent nothing for `idle_timeout_ms`.
    Idle,
}

/// Replies waiting in request order: one request's (a network backend's
/// future), or a read batch's run of requests decided together (a batching
/// backend: one future for the whole run's answers, if any wait; the run is
/// finished into the output when they are in).
enum PendingReplies {
    One(BoxFuture<'static, Reply>),
    Batch(BatchRun),
}

enum ReadyReplies {
    One(Reply),
    /// A batch's run and its answers: each reply is made and encoded in
    /// turn, with no list of replies in between.
    Batch(BatchRun, SlotAnswers),
}

/// A read batch's run waiting for its deferred hits' answers.
struct BatchRun {
    /// The rules the batch's lines were executed with.
    rules: Arc<LoadedRules>,
    run: Vec<RunItem>,
    /// `None` when nothing of the run waits, or once taken.
    answers: Option<BoxFuture<'static, SlotAnswers>>,
}

impl BatchRun {
    /// Resolves with the run's answers (none when nothing waits).
    fn poll_answers(&mut self, cx: &mut Context<'_>) -> Poll<SlotAnswers> {
        let answers = match self.answers.as_mut() {
            Some(future) => std::task::ready!(future.as_mut().poll(cx)),
            None => Vec::new(),
        };
        self.answers = None;
        Poll::Ready(answers)
    }
}

impl Future for PendingReplies {
    type Output = ReadyReplies;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ReadyReplies> {
        match self.get_mut() {
            PendingReplies::One(future) => future.as_mut().poll(cx).map(ReadyReplies::One),
            PendingReplies::Batch(batch) => {
                let answers = std::task::ready!(batch.poll_answers(cx));
                let run = BatchRun {
                    rules: Arc::clone(&batch.rules),
                    run: std::mem::take(&mut batch.run),
                    answers: None,
                };
                Poll::Ready(ReadyReplies::Batch(run, answers))
            }
        }
    }
}

/// Replies waiting their turn, in request order. A batch's run that waits
/// alone (a cluster connection's usual state: one read batch at a time) is
/// polled directly, its answers waking the connection's task; entries
/// behind one another go through `FuturesOrdered`, which makes a task of
/// each and wakes the connection through it.
struct Waiting {
    /// A batch's run with nothing behind it (`queue` is then empty).
    lone: Option<BatchRun>,
    queue: FuturesOrdered<PendingReplies>,
}

impl Waiting {
    fn new() -> Waiting {
        Waiting {
            lone: None,
            queue: FuturesOrdered::new(),
        }
    }

    fn len(&self) -> usize {
        self.queue.len() + usize::from(self.lone.is_some())
    }

    fn is_empty(&self) -> bool {
        self.lone.is_none() && self.queue.is_empty()
    }

    fn push_back(&mut self, entry: PendingReplies) {
        if let Some(lone) = self.lone.take() {
            self.queue.push_back(PendingReplies::Batch(lone));
        }
        match entry {
            PendingReplies::Batch(batch) if self.queue.is_empty() => self.lone = Some(batch),
            entry => self.queue.push_back(entry),
        }
    }

    /// The oldest entry's replies, once they are ready.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<ReadyReplies>> {
        if let Some(lone) = self.lone.as_mut() {
            let answers = std::task::ready!(lone.poll_answers(cx));
            return Poll::Ready(
                self.lone
                    .take()
                    .map(|run| ReadyReplies::Batch(run, answers)),
            );
        }
        self.queue.poll_next_unpin(cx)
    }

    fn next(&mut self) -> impl Future<Output = Option<ReadyReplies>> + '_ {
        std::future::poll_fn(move |cx| self.poll_next(cx))
    }
}

/// A timeout's timer, made once and moved on lazily: it fires at the
/// deadline it was last set to, and its owner then checks the current
/// deadline, which only ever moves later (activity since, a newer partial
/// line), setting the timer again while that is still ahead. A timer made
/// afresh at every turn of the connection's loop was registered with the
/// runtime's timer wheel and removed again once per read batch: 2 % of one
/// node's CPU per hit with `--idle-timeout-ms` set (docs/benchmarks.md,
/// "Twentieth round").
#[derive(Default)]
struct LazyDeadline {
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl LazyDeadline {
    /// Sets the timer to `deadline` unless it is set already (to an
    /// earlier deadline: it is moved on when that one fires).
    fn arm(&mut self, deadline: tokio::time::Instant) {
        if self.sleep.is_none() {
            self.sleep = Some(Box::pin(tokio::time::sleep_until(deadline)));
        }
    }

    /// Resolves when the timer fires; never when it was never armed.
    async fn fired(&mut self) {
        match self.sleep.as_mut() {
            Some(sleep) => sleep.as_mut().await,
            None => std::future::pending().await,
        }
    }

    /// Whether `deadline` (the timeout's current one) has passed; if not,
    /// the timer is set to fire at it.
    fn passed(&mut self, deadline: tokio::time::Instant) -> bool {
        if deadline <= tokio::time::Instant::now() {
            return true;
        }
        match self.sleep.as_mut() {
            Some(sleep) => sleep.as_mut().reset(deadline),
            None => self.arm(deadline),
        }
        false
    }
}

/// A request of a batched run: answered already, or waiting for the batch.
enum RunItem {
    Ready(Reply),
    Deferred(DeferredHit),
}

struct Connection {
    socket: ClientSocket,
    engine: Arc<Engine>,
    limits: Limits,
    input: InputBuffer,
    output: Vec<u8>,
    pending: Waiting,
    /// Requests of the current read batch, in order, answered together when
    /// the batch's deferred hits are (empty unless the backend batches).
    run: Vec<RunItem>,
    /// An `ERR` was produced: stop executing, flush, close.
    closing: bool,
    /// No more input will be read (shutdown or EOF); finish what was read.
    input_done: bool,
    /// When the unexecuted bytes in `input` arrived.
    arrival: crate::engine::Arrival,
    /// Since when an incomplete line has been waiting for its end.
    partial_line_since: Option<tokio::time::Instant>,
    /// Large reads since this connection last yielded its thread.
    large_reads_in_turn: u32,
}

/// Since when the incomplete line at the start of `unread` (after a read's
/// lines were executed) has been waiting for its end, for the line timeout:
/// `None` when nothing is incomplete (a complete line waiting for room in the
/// pipeline waits for the server, not the client); `now` for a line that
/// started in this read (`consumed`: lines before it ended, so a client that
/// streams lines whose reads end mid-line keeps its connection), else the
/// time the line was first seen.
pub(super) fn partial_line_since<T: Copy>(
    unread: &[u8],
    consumed: bool,
    since: Option<T>,
    now: impl FnOnce() -> T,
) -> Option<T> {
    if unread.is_empty() || split_line(unread).is_some() {
        None
    } else if consumed || since.is_none() {
        Some(now())
    } else {
        since
    }
}

/// Counts a connection open for as long as it lives, even if its task panics.
struct OpenConnectionGauge(Arc<Engine>);

impl Drop for OpenConnectionGauge {
    fn drop(&mut self) {
        self.0.metrics.connection_closed();
    }
}

/// Serves one client connection until it ends; returns why it ended.
pub async fn serve(
    stream: TcpStream,
    engine: Arc<Engine>,
    limits: Limits,
    shutdown: watch::Receiver<bool>,
) -> Ended {
    engine.metrics.connection_opened();
    let _gauge = OpenConnectionGauge(Arc::clone(&engine));
    let Ok(socket) = ClientSocket::new(stream) else {
        return Ended::Io;
    };
    let mut connection = Connection {
        socket,
        engine: Arc::clone(&engine),
        limits,
        input: InputBuffer::new(
            READ_CHUNK_BYTES,
            limits.line_bytes_max.saturating_add(READ_CHUNK_BYTES),
        ),
        output: Vec::with_capacity(READ_CHUNK_BYTES),
        pending: Waiting::new(),
        run: Vec::new(),
        closing: false,
        input_done: false,
        arrival: engine.arrival(),
        partial_line_since: None,
        large_reads_in_turn: 0,
    };
    let ended = connection.run(shutdown).await;
    if ended == Ended::AfterError {
        connection.socket.linger_close().await;
    }
    ended
}

impl Connection {
    async fn run(&mut self, mut shutdown: watch::Receiver<bool>) -> Ended {
        let mut ended_by = Ended::ClientClosed;
        if *shutdown.borrow() {
            return Ended::Shutdown;
        }
        // Made once: a fresh `changed()` at every turn of the loop would
        // register its waiter, and remove it, under the channel's lock each
        // time. Polled until it fires (which ends the input).
        let shutdown_changed = shutdown.changed();
        tokio::pin!(shutdown_changed);
        // The idle and line timeouts, each one timer for the connection's
        // life (see `LazyDeadline`).
        let idle_on = self.limits.idle_timeout_ms > 0;
        let idle_after = Duration::from_millis(self.limits.idle_timeout_ms);
        let line_after = Duration::from_millis(self.limits.line_timeout_ms);
        let mut idle = LazyDeadline::default();
        let mut line = LazyDeadline::default();
        let mut last_active = tokio::time::Instant::now();
        if idle_on {
            idle.arm(last_active + idle_after);
        }
        loop {
            self.execute_buffered_lines();
            if !self.output.is_empty() && self.flush().await.is_err() {
                return Ended::Io;
            }
            if self.large_reads_in_turn >= LARGE_READS_PER_TURN {
                // A client streaming requests as fast as it can must not hold the
                // thread: let every other connection of this thread have a turn.
                self.large_reads_in_turn = 0;
                tokio::task::yield_now().await;
            }
            if self.closing && self.pending.is_empty() {
                return Ended::AfterError;
            }
            if self.input_done && self.pending.is_empty() {
                // Partial lines left at EOF or shutdown are never answered.
                return ended_by;
            }
            let can_read =
                !self.input_done && !self.closing && self.pending.len() < self.limits.pipeline_max;
            let idle_armed =
                idle_on && can_read && self.pending.is_empty() && self.partial_line_since.is_none();
            let partial_line_deadline = self
                .partial_line_since
                .filter(|_| self.limits.line_timeout_ms > 0)
                .map(|since| since + line_after);
            if let Some(deadline) = partial_line_deadline {
                line.arm(deadline);
            }
            tokio::select! {
                biased;
                Some(replies) = self.pending.next(), if !self.pending.is_empty() => {
                    if idle_on {
                        last_active = tokio::time::Instant::now();
                    }
                    self.push_replies(replies);
                    // Collect every other reply that is already done, to answer them in one write.
                    while let Some(Some(replies)) = self.pending.next().now_or_never() {
                        self.push_replies(replies);
                    }
                }
                read = self.socket.read(&mut self.input), if can_read => {
                    match read {
                        Ok(0) => self.input_done = true,
                        Ok(n) => {
                            if idle_on {
                                last_active = tokio::time::Instant::now();
                            }
                            self.arrival = self.engine.arrival();
                            if n >= READ_CHUNK_BYTES / 2 {
                                self.large_reads_in_turn += 1;
                            }
                        }
                        Err(_) => return Ended::Io,
                    }
                }
                _ = &mut shutdown_changed, if !self.input_done => {
                    self.input_done = true;
                    ended_by = Ended::Shutdown;
                }
                _ = line.fired(), if can_read && partial_line_deadline.is_some() => {
                    if partial_line_deadline.is_some_and(|deadline| line.passed(deadline)) {
                        // A line trickling in slower than this holds a slot for nothing (slowloris).
                        self.engine.metrics.error(crate::protocol::ErrorCode::Unknown);
                        self.engine.metrics.requests_read(RequestProtocol::Divvy, 1);
                        self.queue_reply(Reply::error("line timeout"));
                    }
                }
                _ = idle.fired(), if idle_armed => {
                    if idle.passed(last_active + idle_after) {
                        return Ended::Idle;
                    }
                }
            }
        }
    }

    /// Executes every complete line in the buffer, unless the pipeline is full
    /// or an error ended the conversation. With a batching backend the lines
    /// of one call share one batch and are answered as one run, in one write
    /// once its deferred hits are decided (replies ready before then wait
    /// for them: one write per read batch, not one before and one after).
    fn execute_buffered_lines(&mut self) {
        if self.input.unread().is_empty() {
            // Nothing new since the last call (a turn woken by a batch's
            // answers, or after a write): no batch to begin and end.
            self.partial_line_since = None;
            return;
        }
        let mut batch = self.engine.begin_batch();
        if batch.is_some() && self.run.capacity() == 0 {
            // The last run went to its future: room for a pipelined read's.
            self.run.reserve(RUN_ITEMS_INITIAL);
        }
        // Lines read in this call, counted once at the end (not per line).
        let mut lines = 0u64;
        let mut outcomes = SmallVec::<[Outcome; READ_AHEAD_LINES_MAX]>::new();
        while !self.closing && self.pending.len() + self.run.len() < self.limits.pipeline_max {
            // Runs of hits are planned and prefetched before they are decided.
            let used = self.engine.execute_hit_run(
                self.input.unread(),
                self.limits.pipeline_max - self.pending.len() - self.run.len(),
                self.limits.line_bytes_max,
                self.arrival,
                batch.as_mut(),
                &mut outcomes,
            );
            if used > 0 {
                self.input.consume(used);
                lines += outcomes.len() as u64;
                for outcome in outcomes.drain(..) {
                    self.take_outcome(outcome, &mut batch);
                }
                continue;
            }
            let unread = self.input.unread();
            let Some((line, used)) = split_line(unread) else {
                if unread.len() > self.limits.line_bytes_max {
                    lines += 1;
                    self.fail_line_too_long();
                }
                break;
            };
            lines += 1;
            if line.len() > self.limits.line_bytes_max {
                self.fail_line_too_long();
                break;
            }
            let outcome = match batch.as_mut() {
                Some(batch) => self.engine.execute_in(line, self.arrival, batch),
                None => self.engine.execute(line, self.arrival),
            };
            self.input.consume(used);
            self.take_outcome(outcome, &mut batch);
        }
        self.end_run(batch);
        if lines > 0 {
            self.engine
                .metrics
                .requests_read(RequestProtocol::Divvy, lines);
        }
        self.partial_line_since = partial_line_since(
            self.input.unread(),
            lines > 0,
            self.partial_line_since,
            tokio::time::Instant::now,
        );
    }

    /// Puts a line's outcome where its reply waits its turn.
    fn take_outcome(&mut self, outcome: Outcome, batch: &mut Option<EngineBatch>) {
        match outcome {
            // Within a batch, a reply held until the batch's end goes out in one
            // write with the deferred replies after it, not in a write of its own.
            Outcome::Now(reply) if batch.is_some() => self.hold_reply(reply),
            Outcome::Now(reply) => self.queue_reply(reply),
            Outcome::Later(future) => {
                // Replies keep request order: the run so far goes first.
                if batch.is_some() {
                    self.end_run(batch.take());
                    *batch = self.engine.begin_batch();
                }
                self.pending.push_back(PendingReplies::One(future));
            }
            Outcome::Deferred(hit) => self.run.push(RunItem::Deferred(hit)),
        }
    }

    /// Submits the batch and queues its run (if any) as one pending item.
    fn end_run(&mut self, batch: Option<EngineBatch>) {
        let Some(batch) = batch else {
            return;
        };
        let (rules, answers) = batch.submit();
        if self.run.is_empty() {
            return;
        }
        let mut run = std::mem::take(&mut self.run);
        if answers.is_none()
            && self.pending.is_empty()
            && run.iter().all(|item| matches!(item, RunItem::Ready(_)))
        {
            // Nothing waits, neither in the run nor ahead of it: answer now,
            // and keep the run's list for the next batch.
            for item in run.drain(..) {
                if let RunItem::Ready(reply) = item {
                    self.queue_reply(reply);
                }
            }
            self.run = run;
            return;
        }
        // Behind what is pending, or waiting for answers: one entry for the
        // whole run (not one per reply).
        self.pending.push_back(PendingReplies::Batch(BatchRun {
            rules,
            run,
            answers,
        }));
    }

    fn fail_line_too_long(&mut self) {
        self.engine
            .metrics
            .error(crate::protocol::ErrorCode::Unknown);
        self.queue_reply(Reply::error("line too long"));
    }

    /// Holds a reply of the current batch in its run, answered with the
    /// batch (see [`Connection::end_run`]).
    fn hold_reply(&mut self, reply: Reply) {
        if reply.closes_connection() {
            self.closing = true;
        }
        self.run.push(RunItem::Ready(reply));
    }

    /// Answers now when nothing is waiting ahead of this reply, else queues it.
    /// An error stops execution at once: no line after it runs.
    fn queue_reply(&mut self, reply: Reply) {
        if reply.closes_connection() {
            self.closing = true;
        }
        if !self.run.is_empty() {
            self.run.push(RunItem::Ready(reply));
        } else if self.pending.is_empty() {
            self.push_reply(reply);
        } else {
            self.pending
                .push_back(PendingReplies::One(Box::pin(std::future::ready(reply))));
        }
    }

    fn push_replies(&mut self, replies: ReadyReplies) {
        match replies {
            ReadyReplies::One(reply) => self.push_reply(reply),
            ReadyReplies::Batch(batch, answers) => self.push_batch_replies(batch, &answers),
        }
    }

    /// Makes and encodes a batch's replies, in request order, once its
    /// answers are in (one clock read for the run); keeps its run's list
    /// for the next batch.
    fn push_batch_replies(&mut self, batch: BatchRun, answers: &SlotAnswers) {
        let BatchRun { rules, mut run, .. } = batch;
        let decided_at = Moment::now();
        let engine = Arc::clone(&self.engine);
        engine.with_label_counts(&rules, |counts| {
            for item in run.drain(..) {
                let reply = match item {
                    RunItem::Ready(reply) => reply,
                    RunItem::Deferred(hit) => {
                        engine.finish_deferred(&rules, &hit, answers, decided_at, counts)
                    }
                };
                let closes = reply.closes_connection();
                self.push_reply(reply);
                if closes {
                    break; // nothing after an ERR is answered
                }
            }
        });
        if self.run.capacity() == 0 && run.capacity() <= RUN_ITEMS_KEPT_MAX {
            run.clear();
            self.run = run;
        }
    }

    fn push_reply(&mut self, reply: Reply) {
        reply.encode(&mut self.output);
        if reply.closes_connection() {
            self.closing = true;
            // Replies queued after an error (from a backend failure) are dropped:
            // the connection closes after the first ERR.
            self.pending = Waiting::new();
        }
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        self.socket.write_all(&self.output).await?;
        self.output.clear();
        Ok(())
    }
}
