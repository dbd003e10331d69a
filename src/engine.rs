//! The request path between bytes and counters: a line is parsed, matched
//! against the rules, its counters are decided by the backend, metrics are
//! counted, and a [`Reply`] comes out. Connections call [`Engine::execute`];
//! nothing here touches a socket.

use crate::clock::{Clock, Moment};
use crate::limiter::{Decision, WindowQuota};
use crate::metrics::{HitStatus, LabelCounters, Metrics, ThreadLabelCounts};
use crate::protocol::{encode_err, encode_ok, parse_line_into, split_line, ErrorCode, Pairs, Verb};
use crate::rules::{CurrentRules, MatchPolicy, Quota, RuleSet};
use crate::store::{
    Backend, BackendError, BatchDecided, CounterOp, Decided, Decisions, OpBatch, PrefetchHashes,
    SlotAnswers, PREFETCH_KEYS_MAX,
};
use arc_swap::ArcSwap;
use futures_util::future::BoxFuture;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Most requests of one read planned, and their counters prefetched,
/// before the first is decided ([`Engine::execute_hit_run`]).
pub const READ_AHEAD_LINES_MAX: usize = 32;

/// A request of a run parsed and matched, its counters prefetched, not yet
/// decided.
struct PlannedHit<'a> {
    ops: SmallVec<[CounterOp<'a>; 2]>,
    plan: Plan,
    peek: bool,
    /// Bytes of the read its line used (terminator included).
    used: usize,
}

/// What a hit gets when its counter cannot be decided (backend down, live-key
/// cap reached).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnavailablePolicy {
    /// `ERR unknown "<reason>"`, as divvy answers when Redis fails.
    #[default]
    Error,
    /// Fail open: `OK true <creditLimit> 0`.
    Allow,
    /// Fail closed: `OK false 0 -1`.
    Deny,
}

impl CurrentRules for Engine {
    fn current(&self) -> Arc<RuleSet> {
        self.rule_set()
    }
}

/// One response line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `OK <allowed> <credit> <nextResetSeconds>`
    Decision(Decision),
    /// A whole line of an extension command (without the newline).
    Line(String),
    /// `ERR <code> "<message>"`; the connection closes after it.
    Error {
        code: ErrorCode,
        message: Cow<'static, str>,
    },
}

impl Reply {
    pub fn error(message: impl Into<Cow<'static, str>>) -> Reply {
        Reply::Error {
            code: ErrorCode::Unknown,
            message: message.into(),
        }
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Decision(d) => encode_ok(out, d.allowed, d.credit, d.next_reset_seconds),
            Reply::Line(line) => {
                out.extend_from_slice(line.as_bytes());
                out.push(b'\n');
            }
            Reply::Error { code, message } => encode_err(out, *code, message),
        }
    }

    /// Does the connection close after this reply?
    pub fn closes_connection(&self) -> bool {
        matches!(self, Reply::Error { .. })
    }
}

/// The result of executing a line: a reply now, or one to wait for.
pub enum Outcome {
    Now(Reply),
    Later(BoxFuture<'static, Reply>),
    /// Waits for its read batch (see [`EngineBatch`]); finish it with
    /// [`Engine::finish_deferred`] once the batch's answers are in.
    Deferred(DeferredHit),
}

/// What [`Engine::decide_operation`] answers: the reply a `HIT` line would
/// get, and the quota and label of the rule that decided it (`None` when no
/// rule was evaluated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationAnswer {
    pub reply: Reply,
    pub quota: Option<Quota>,
    pub label: Option<String>,
}

/// An operation planned in [`Engine::decide_operations`]: its counters, its
/// plan, whether it only looks.
type PlannedOperation<'a> = (SmallVec<[CounterOp<'a>; 2]>, Plan, bool);

/// An [`OperationAnswer`] now, or one to wait for.
pub enum OperationOutcome {
    Now(OperationAnswer),
    Later(BoxFuture<'static, OperationAnswer>),
}

impl OperationOutcome {
    /// Waits for the answer, whichever it is.
    pub async fn answer(self) -> OperationAnswer {
        match self {
            OperationOutcome::Now(answer) => answer,
            OperationOutcome::Later(future) => future.await,
        }
    }
}

/// A hit whose counters wait for their read batch's answers.
pub struct DeferredHit {
    plan: Plan,
    first_slot: u32,
    peek: bool,
    arrival: Arrival,
}

/// The lines of one read, executed against one rule set, whose counters a
/// batching backend (the cluster) decides together: see
/// [`Engine::begin_batch`].
pub struct EngineBatch {
    ops: Box<dyn OpBatch>,
    rules: Arc<LoadedRules>,
}

impl EngineBatch {
    /// Sends the batch's gathered ops; returns the rules its lines were
    /// executed with and the future of the deferred answers, if any.
    pub fn submit(self) -> (Arc<LoadedRules>, Option<BoxFuture<'static, SlotAnswers>>) {
        (self.rules, self.ops.submit())
    }
}

/// Handles for extension commands that other subsystems answer (droplet
/// buckets, cluster topology). Each returns `None` when not enabled.
pub trait CommandExtension: Send + Sync + 'static {
    fn execute(&self, verb: Verb, pairs: &Pairs<'_>, now_ms: u64) -> Option<Outcome>;
}

/// Rules plus the per-label metric cells of each rule, swapped as one.
pub struct LoadedRules {
    pub set: Arc<RuleSet>,
    label_counters: Vec<Arc<LabelCounters>>,
}

/// When a batch of request lines arrived: every line read by one syscall
/// shares it, so the clocks are read once per read, not once per request.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    /// For `divvy_hit_duration_seconds`: time from receipt to decision.
    pub received: Moment,
    /// The limiter's time (wall-clock milliseconds from the engine's clock).
    pub now_ms: u64,
}

/// When a request's decision was reached, for `divvy_hit_duration_seconds`.
#[derive(Debug, Clone, Copy)]
enum DecidedAt {
    /// While its read's lines execute: see [`synchronous_elapsed_ns`].
    InBatch,
    /// Now: a backend's future for it resolved.
    Now,
    /// At this moment, read once for a run of deferred hits answered
    /// together.
    At(Moment),
}

/// Synchronous decisions of one batch that share a clock read for
/// `divvy_hit_duration_seconds`.
const DECISIONS_PER_DURATION_READ: u32 = 16;

thread_local! {
    /// The batch this thread last timed (its arrival), the instant its
    /// decisions are counted at, and how many used that instant.
    static BATCH_TIMING: Cell<Option<(Moment, Moment, u32)>> = const { Cell::new(None) };
}

/// Time from receipt to decision of a request decided while its batch
/// executes, at one clock read per [`DECISIONS_PER_DURATION_READ`] decisions
/// instead of one each: a decision is counted at the last read taken for its
/// batch, and a read is taken for the first decision of a batch and then
/// every few decisions. A duration is short by at most the time those few
/// decisions took (microseconds; the histogram's buckets are milliseconds).
fn synchronous_elapsed_ns(received: Moment) -> u64 {
    BATCH_TIMING.with(|cell| {
        let (decided_at, uses) = match cell.get() {
            Some((batch, at, uses)) if batch == received && uses < DECISIONS_PER_DURATION_READ => {
                (at, uses + 1)
            }
            _ => (Moment::now(), 1),
        };
        cell.set(Some((received, decided_at, uses)));
        decided_at.saturating_nanos_since(received)
    })
}

/// One evaluated rule of a request: its position and, for limited quotas, the
/// index of its counter op (otherwise its fixed decision).
#[derive(Clone, Copy)]
enum Step {
    Fixed(usize, Decision),
    Counter(usize, usize),
}

impl Step {
    fn position(self) -> usize {
        match self {
            Step::Fixed(position, _) | Step::Counter(position, _) => position,
        }
    }
}

type Plan = SmallVec<[Step; 2]>;

/// Engines told apart by the per-thread rules cache ([`Engine::with_rules`]).
static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(0);

/// The rules a thread last executed with, of which engine and generation,
/// and this thread's cells of each rule's label counters.
struct CachedRules {
    engine: u64,
    generation: u64,
    rules: Arc<LoadedRules>,
    label_counts: Box<[Arc<ThreadLabelCounts>]>,
}

thread_local! {
    /// [`Engine::with_rules`]'s copy of the served rules: a request reads
    /// its engine's generation, a plain load, where `ArcSwap::load` and
    /// its guard's drop are two atomic read-modify-writes.
    /// Boxed: taken out and put back by every request, it then moves as
    /// one pointer.
    static CACHED_RULES: Cell<Option<Box<CachedRules>>> = const { Cell::new(None) };
}

pub struct Engine {
    rules: ArcSwap<LoadedRules>,
    /// Bumped after each [`Engine::replace_rules`]: threads' cached rules of
    /// an older generation are loaded again.
    rules_generation: AtomicU64,
    id: u64,
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    pub metrics: Arc<Metrics>,
    unavailable_policy: UnavailablePolicy,
    extensions: Vec<Arc<dyn CommandExtension>>,
    /// `DEBUG=divvy`: log each evaluated rule's comment.
    debug_rules: bool,
}

impl Engine {
    pub fn new(
        rules: RuleSet,
        backend: Arc<dyn Backend>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
        unavailable_policy: UnavailablePolicy,
    ) -> Engine {
        // The monotonic clock is calibrated now, not on the first request.
        Moment::calibrate();
        let loaded = Self::load(&metrics, rules);
        Engine {
            rules: ArcSwap::from_pointee(loaded),
            rules_generation: AtomicU64::new(0),
            id: NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed),
            backend,
            clock,
            metrics,
            unavailable_policy,
            extensions: Vec::new(),
            debug_rules: false,
        }
    }

    /// Logs each evaluated rule's comment at debug level (divvy's
    /// `DEBUG=divvy`; the binary reads the variable).
    pub fn with_debug_rules(mut self, debug_rules: bool) -> Engine {
        self.debug_rules = debug_rules;
        self
    }

    /// Adds a handler for extension commands (`TAKE`, `QUERY`, `TOPOLOGY`).
    pub fn with_extension(mut self, extension: Arc<dyn CommandExtension>) -> Engine {
        self.extensions.push(extension);
        self
    }

    fn load(metrics: &Metrics, set: RuleSet) -> LoadedRules {
        let label_counters = set
            .rules()
            .iter()
            .map(|r| metrics.label_counters(r.label.as_deref().unwrap_or("")))
            .collect();
        LoadedRules {
            set: Arc::new(set),
            label_counters,
        }
    }

    /// Replaces the rules; requests already executing finish on the old ones.
    /// Counters of rules whose identity is unchanged keep counting.
    pub fn replace_rules(&self, set: RuleSet) {
        self.rules.store(Arc::new(Self::load(&self.metrics, set)));
        self.rules_generation.fetch_add(1, Ordering::SeqCst);
    }

    pub fn rules(&self) -> Arc<LoadedRules> {
        self.rules.load_full()
    }

    /// The rule set being served, without its metric cells.
    pub fn rule_set(&self) -> Arc<RuleSet> {
        Arc::clone(&self.rules.load().set)
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Reads the clock for a batch of lines that just arrived: one read
    /// gives both the instant and the limiter's wall time.
    pub fn arrival(&self) -> Arrival {
        let received = Moment::now();
        Arrival {
            received,
            now_ms: self.clock.now_ms_at(received),
        }
    }

    /// A batch for the lines of one read when the backend decides many
    /// requests together (`None` otherwise: use [`Engine::execute`]).
    pub fn begin_batch(&self) -> Option<EngineBatch> {
        let ops = self.backend.begin_batch()?;
        Some(EngineBatch {
            ops,
            rules: self.rules.load_full(),
        })
    }

    /// Executes one request line (without its terminator) that arrived at `arrival`.
    pub fn execute(self: &Arc<Self>, line: &[u8], arrival: Arrival) -> Outcome {
        self.execute_with(line, arrival, None)
    }

    /// [`Engine::execute`] within a read batch: hits may come back
    /// [`Outcome::Deferred`].
    pub fn execute_in(
        self: &Arc<Self>,
        line: &[u8],
        arrival: Arrival,
        batch: &mut EngineBatch,
    ) -> Outcome {
        self.execute_with(line, arrival, Some(batch))
    }

    fn execute_with(
        self: &Arc<Self>,
        line: &[u8],
        arrival: Arrival,
        batch: Option<&mut EngineBatch>,
    ) -> Outcome {
        let text = if line.is_ascii() {
            // SAFETY: ASCII is valid UTF-8 (and the check is cheaper than
            // full validation, for the lines almost every client sends).
            Cow::Borrowed(unsafe { std::str::from_utf8_unchecked(line) })
        } else {
            String::from_utf8_lossy(line)
        };
        // Parsed in place: the pairs are not moved around after parsing.
        let mut pairs = Pairs::default();
        let verb = match parse_line_into(&text, &mut pairs) {
            Ok(verb) => verb,
            Err(error) => {
                let code = match error {
                    crate::protocol::ParseError::UnknownCommand(_) => ErrorCode::UnknownCommand,
                    _ => ErrorCode::Unknown,
                };
                self.metrics.error(code);
                return Outcome::Now(Reply::Error {
                    code,
                    message: error.to_string().into(),
                });
            }
        };
        match verb {
            Verb::Hit | Verb::Peek => {
                let peek = verb == Verb::Peek;
                match batch {
                    Some(batch) => self.hit_in_batch(&pairs, peek, arrival, batch),
                    None => self.hit(&pairs, peek, arrival),
                }
            }
            verb => {
                for extension in &self.extensions {
                    if let Some(outcome) = extension.execute(verb, &pairs, arrival.now_ms) {
                        return outcome;
                    }
                }
                let word = match verb {
                    Verb::Take => "TAKE",
                    Verb::Query => "QUERY",
                    Verb::Topology => "TOPOLOGY",
                    Verb::Hit | Verb::Peek => unreachable!("handled above"),
                };
                self.metrics.error(ErrorCode::UnknownCommand);
                Outcome::Now(Reply::Error {
                    code: ErrorCode::UnknownCommand,
                    message: format!("Unrecognized command: {word}").into(),
                })
            }
        }
    }

    /// Executes a run of `HIT`/`PEEK` lines at the start of `unread` in two
    /// passes: every line is parsed and matched and its counters' store
    /// lines prefetched, then each is decided in order. A read of many
    /// requests then waits for their cache misses together, not one after
    /// another. The run ends before a line of another command, a line that
    /// is not ASCII or longer than `line_bytes_max`, an incomplete line, and
    /// after `lines_max` lines (at most [`READ_AHEAD_LINES_MAX`]) or a reply
    /// that closes the connection; those are left to [`Engine::execute`].
    ///
    /// Outcomes are pushed to `outcomes` in request order; returns the
    /// bytes of `unread` they used. Does nothing (returns 0) unless the
    /// backend decides in memory on this thread and two complete lines are
    /// there: a lone request has no miss to overlap.
    pub fn execute_hit_run(
        self: &Arc<Self>,
        unread: &[u8],
        lines_max: usize,
        line_bytes_max: usize,
        arrival: Arrival,
        mut batch: Option<&mut EngineBatch>,
        outcomes: &mut SmallVec<[Outcome; READ_AHEAD_LINES_MAX]>,
    ) -> usize {
        let Some(store) = self.backend.prefetch_store() else {
            return 0;
        };
        let lines_max = lines_max.min(READ_AHEAD_LINES_MAX);
        let two_lines = split_line(unread)
            .is_some_and(|(_, used)| memchr::memchr(b'\n', &unread[used..]).is_some());
        if lines_max < 2 || !two_lines {
            return 0;
        }
        // The thread's copy of the rules and its cells of their label
        // counters, as a lone request uses them; a batch keeps the rules it
        // began with, and counts in the cells while they are of those rules.
        self.with_rules(|current, label_counts| {
            let loaded = match batch.as_ref() {
                Some(batch) => Arc::clone(&batch.rules),
                None => Arc::clone(current),
            };
            let label_counts = Arc::ptr_eq(&loaded, current).then_some(label_counts);
            // Pass 1: parse, match, hash and prefetch.
            let mut planned: SmallVec<[PlannedHit<'_>; READ_AHEAD_LINES_MAX]> = SmallVec::new();
            let mut hashes = PrefetchHashes::new();
            let mut rest = unread;
            while planned.len() < lines_max {
                let Some((line, used)) = split_line(rest) else {
                    break;
                };
                if line.len() > line_bytes_max || !line.is_ascii() {
                    break;
                }
                // SAFETY: ASCII is valid UTF-8.
                let text = unsafe { std::str::from_utf8_unchecked(line) };
                let mut pairs = Pairs::default();
                let peek = match parse_line_into(text, &mut pairs) {
                    Ok(Verb::Hit) => false,
                    Ok(Verb::Peek) => true,
                    _ => break,
                };
                let (ops, plan) = Self::plan_hit(&loaded, &pairs, peek);
                if hashes.len() + ops.len() <= PREFETCH_KEYS_MAX {
                    self.backend.counter_hashes(&ops, &mut hashes);
                }
                planned.push(PlannedHit {
                    ops,
                    plan,
                    peek,
                    used,
                });
                rest = &rest[used..];
            }
            store.prefetch_hashes(&hashes);
            // Pass 2: decide, in order.
            let mut used_bytes = 0;
            for mut hit in planned {
                used_bytes += hit.used;
                let outcome = match batch.as_deref_mut() {
                    Some(batch) => {
                        let (ops, plan, peek) = (&hit.ops, hit.plan, hit.peek);
                        self.decide_in_batch(&loaded, ops, plan, peek, arrival, batch, label_counts)
                    }
                    None => {
                        let (ops, plan, peek) = (&hit.ops, &mut hit.plan, hit.peek);
                        self.decide_planned(&loaded, ops, plan, peek, arrival, label_counts)
                    }
                };
                let closes = matches!(&outcome, Outcome::Now(reply) if reply.closes_connection());
                outcomes.push(outcome);
                if closes {
                    break;
                }
            }
            used_bytes
        })
    }

    /// The counter ops and the reply plan of a hit under `loaded`
    /// (inlined: returned by value, the two vectors were moved through the
    /// stack twice per request).
    #[inline(always)]
    fn plan_hit<'a, 'p: 'a>(
        loaded: &'a LoadedRules,
        pairs: &Pairs<'p>,
        peek: bool,
    ) -> (SmallVec<[CounterOp<'a>; 2]>, Plan) {
        Self::plan_hits(loaded, pairs, peek, 1)
    }

    /// [`Engine::plan_hit`] for `hits` hits of one operation in a row (at
    /// least one): the one hit's rules evaluated `hits` times, so that each
    /// backend decides them in order within one call.
    #[inline(always)]
    fn plan_hits<'a, 'p: 'a>(
        loaded: &'a LoadedRules,
        pairs: &Pairs<'p>,
        peek: bool,
        hits: u32,
    ) -> (SmallVec<[CounterOp<'a>; 2]>, Plan) {
        let mut ops: SmallVec<[CounterOp<'a>; 2]> = SmallVec::new();
        let mut plan = Plan::new();
        Self::plan_hits_into(loaded, pairs, peek, hits, &mut ops, &mut plan);
        (ops, plan)
    }

    /// [`Engine::plan_hits`] into `ops` and `plan` (empty), where the
    /// caller keeps them: the hot path's form, which moves nothing.
    #[inline(always)]
    fn plan_hits_into<'a, 'p: 'a>(
        loaded: &'a LoadedRules,
        pairs: &Pairs<'p>,
        peek: bool,
        hits: u32,
        ops: &mut SmallVec<[CounterOp<'a>; 2]>,
        plan: &mut Plan,
    ) {
        let mut evaluated = loaded.set.evaluate(pairs);
        while let Some(rule) = evaluated.next() {
            let step = match rule.quota {
                Quota::AlwaysDeny => Step::Fixed(rule.position, Decision::ALWAYS_DENY),
                Quota::AlwaysAllow { credit_limit } => {
                    Step::Fixed(rule.position, Decision::always_allow(credit_limit))
                }
                Quota::Limited {
                    credit_limit,
                    reset_seconds,
                } => match WindowQuota::new(credit_limit, reset_seconds) {
                    Some(quota) => {
                        ops.push(CounterOp {
                            rule,
                            actor: evaluated.actor(rule),
                            quota,
                            peek,
                        });
                        Step::Counter(rule.position, ops.len() - 1)
                    }
                    // Validation makes both positive; never count against a zero quota.
                    None => Step::Fixed(rule.position, Decision::ALWAYS_DENY),
                },
            };
            plan.push(step);
        }
        let (one_ops, one_plan) = (ops.len(), plan.len());
        for _ in 1..hits.max(1) {
            for op in 0..one_ops {
                ops.push(ops[op]);
            }
            for step in 0..one_plan {
                let step = match plan[step] {
                    Step::Counter(position, op) => {
                        Step::Counter(position, ops.len() - one_ops + op)
                    }
                    fixed => fixed,
                };
                plan.push(step);
            }
        }
    }

    /// Decides one operation given as pairs rather than as a line (Envoy's
    /// rate limit service): the same rules, counters and metrics as a `HIT`
    /// of those pairs, repeated `hits` times in a row (at least once), or, with
    /// `peek`, what one hit would get (`PEEK`). The answer also names the
    /// rule that decided, for protocols that report the limit.
    pub fn decide_operation(
        self: &Arc<Self>,
        pairs: &Pairs<'_>,
        hits: u32,
        peek: bool,
        arrival: Arrival,
    ) -> OperationOutcome {
        let loaded = self.rules.load();
        let hits = if peek { 1 } else { hits.max(1) };
        let (ops, plan) = Self::plan_hits(&loaded, pairs, peek, hits);
        self.operation_outcome(&loaded, &ops, &plan, peek, arrival)
    }

    /// Decides a planned operation's `ops`; the answer follows `plan`.
    fn operation_outcome(
        self: &Arc<Self>,
        loaded: &Arc<LoadedRules>,
        ops: &[CounterOp<'_>],
        plan: &Plan,
        peek: bool,
        arrival: Arrival,
    ) -> OperationOutcome {
        let decided = if ops.is_empty() {
            Decided::Ready(Decisions::new())
        } else {
            self.backend.decide(ops, arrival.now_ms)
        };
        match decided {
            Decided::Ready(decisions) => OperationOutcome::Now(self.answer_operation(
                loaded,
                plan,
                decisions,
                peek,
                arrival,
                DecidedAt::InBatch,
            )),
            Decided::Later(future) => {
                let engine = Arc::clone(self);
                let loaded = Arc::clone(loaded);
                let plan = plan.clone();
                OperationOutcome::Later(Box::pin(async move {
                    let decisions = future.await;
                    engine.answer_operation(
                        &loaded,
                        &plan,
                        decisions,
                        peek,
                        arrival,
                        DecidedAt::Now,
                    )
                }))
            }
        }
    }

    /// Decides the operations of one read (every descriptor of every call
    /// in it) as [`Engine::decide_operation`] would one by one, in order,
    /// appending each outcome to `outcomes`; on the memory backend every
    /// operation is planned and its counters' places fetched into the cache
    /// before the first is decided (as [`Engine::execute_hit_run`] does for
    /// lines), so that their cache misses overlap.
    pub fn decide_operations<'p>(
        self: &Arc<Self>,
        operations: impl ExactSizeIterator<Item = (Pairs<'p>, u32, bool)>,
        arrival: Arrival,
        outcomes: &mut Vec<OperationOutcome>,
    ) {
        if self.backend.prefetch_store().is_none() || operations.len() < 2 {
            for (pairs, hits, peek) in operations {
                outcomes.push(self.decide_operation(&pairs, hits, peek, arrival));
            }
            return;
        }
        let loaded = self.rules.load();
        let mut planned: SmallVec<[PlannedOperation<'_>; 32]> =
            SmallVec::with_capacity(operations.len());
        let mut hashes = PrefetchHashes::new();
        // The pairs' strings outlive the plans (they borrow the request),
        // the pairs themselves need not.
        for (pairs, hits, peek) in operations {
            let hits = if peek { 1 } else { hits.max(1) };
            let (ops, plan) = Self::plan_hits(&loaded, &pairs, peek, hits);
            if hashes.len() + ops.len() <= PREFETCH_KEYS_MAX {
                self.backend.counter_hashes(&ops, &mut hashes);
            }
            planned.push((ops, plan, peek));
        }
        if let Some(store) = self.backend.prefetch_store() {
            store.prefetch_hashes(&hashes);
        }
        for (ops, plan, peek) in &planned {
            outcomes.push(self.operation_outcome(&loaded, ops, plan, *peek, arrival));
        }
    }

    fn answer_operation(
        &self,
        loaded: &LoadedRules,
        plan: &Plan,
        decisions: Decisions,
        peek: bool,
        arrival: Arrival,
        decided_at: DecidedAt,
    ) -> OperationAnswer {
        let reply = self.finish(loaded, plan, &decisions, peek, arrival, decided_at, None);
        let rule = plan.last().map(|step| &loaded.set.rules()[step.position()]);
        OperationAnswer {
            reply,
            quota: rule.map(|rule| rule.quota),
            label: rule.and_then(|rule| rule.label.clone()),
        }
    }

    #[inline]
    fn hit(self: &Arc<Self>, pairs: &Pairs<'_>, peek: bool, arrival: Arrival) -> Outcome {
        self.with_rules(|loaded, label_counts| {
            let mut ops = SmallVec::new();
            let mut plan = Plan::new();
            Self::plan_hits_into(loaded, pairs, peek, 1, &mut ops, &mut plan);
            self.decide_planned(loaded, &ops, &mut plan, peek, arrival, Some(label_counts))
        })
    }

    /// Calls `f` with the rules being served, as [`Engine::rules`] gives
    /// them, from this thread's copy while the engine's generation has not
    /// changed (a request that began before a replacement finishes on the
    /// old rules, as with `ArcSwap`), and this thread's cells of their
    /// label counters. Reentrant: a nested call, which finds the copy
    /// taken, loads the rules itself.
    #[inline(always)]
    fn with_rules<R>(
        &self,
        f: impl FnOnce(&Arc<LoadedRules>, &[Arc<ThreadLabelCounts>]) -> R,
    ) -> R {
        // Read before the rules: a copy is never newer than its generation.
        let generation = self.rules_generation.load(Ordering::Acquire);
        // (`try_with`: a thread's destructors may still run requests' code.)
        let cached = CACHED_RULES.try_with(Cell::take).ok().flatten();
        let cached = match cached {
            Some(cached) if cached.engine == self.id && cached.generation == generation => cached,
            _ => {
                let rules = self.rules.load_full();
                Box::new(CachedRules {
                    engine: self.id,
                    generation,
                    label_counts: rules
                        .label_counters
                        .iter()
                        .map(|counters| counters.cells_of_this_thread())
                        .collect(),
                    rules,
                })
            }
        };
        let result = f(&cached.rules, &cached.label_counts);
        let _ = CACHED_RULES.try_with(|cell| cell.set(Some(cached)));
        result
    }

    /// Decides a planned hit's `ops` on the backend; the reply follows
    /// `plan`.
    #[inline]
    fn decide_planned(
        self: &Arc<Self>,
        loaded: &Arc<LoadedRules>,
        ops: &[CounterOp<'_>],
        plan: &mut Plan,
        peek: bool,
        arrival: Arrival,
        label_counts: Option<&[Arc<ThreadLabelCounts>]>,
    ) -> Outcome {
        let decided = if ops.is_empty() {
            Decided::Ready(Decisions::new())
        } else {
            self.backend.decide(ops, arrival.now_ms)
        };
        match decided {
            Decided::Ready(ref decisions) => Outcome::Now(self.finish(
                loaded,
                plan,
                decisions,
                peek,
                arrival,
                DecidedAt::InBatch,
                label_counts,
            )),
            Decided::Later(future) => {
                let engine = Arc::clone(self);
                let loaded = Arc::clone(loaded);
                let plan = std::mem::take(plan);
                Outcome::Later(Box::pin(async move {
                    let decisions = future.await;
                    let at = DecidedAt::Now;
                    engine.finish(&loaded, &plan, &decisions, peek, arrival, at, None)
                }))
            }
        }
    }

    fn hit_in_batch(
        &self,
        pairs: &Pairs<'_>,
        peek: bool,
        arrival: Arrival,
        batch: &mut EngineBatch,
    ) -> Outcome {
        let loaded = Arc::clone(&batch.rules);
        let (ops, plan) = Self::plan_hit(&loaded, pairs, peek);
        self.decide_in_batch(&loaded, &ops, plan, peek, arrival, batch, None)
    }

    /// Decides a planned hit's `ops` in `batch`: now, or deferred to the
    /// batch's answers (counted in `label_counts`, this thread's cells of
    /// `loaded`'s label counters, when given and decided now).
    #[allow(clippy::too_many_arguments)]
    fn decide_in_batch(
        &self,
        loaded: &LoadedRules,
        ops: &[CounterOp<'_>],
        plan: Plan,
        peek: bool,
        arrival: Arrival,
        batch: &mut EngineBatch,
        label_counts: Option<&[Arc<ThreadLabelCounts>]>,
    ) -> Outcome {
        let decided = if ops.is_empty() {
            BatchDecided::Ready(Decisions::new())
        } else {
            batch.ops.decide(ops, arrival.now_ms)
        };
        match decided {
            BatchDecided::Ready(ref decisions) => Outcome::Now(self.finish(
                loaded,
                &plan,
                decisions,
                peek,
                arrival,
                DecidedAt::InBatch,
                label_counts,
            )),
            BatchDecided::Slots { first } => Outcome::Deferred(DeferredHit {
                plan,
                first_slot: first,
                peek,
                arrival,
            }),
        }
    }

    /// The reply of a deferred hit, from its batch's answers, which came in
    /// at `decided_at` (one clock read for the whole run, not one a hit).
    pub fn finish_deferred(
        &self,
        loaded: &LoadedRules,
        hit: &DeferredHit,
        answers: &SlotAnswers,
        decided_at: Moment,
        label_counts: Option<&[Arc<ThreadLabelCounts>]>,
    ) -> Reply {
        let ops = hit
            .plan
            .iter()
            .filter(|step| matches!(step, Step::Counter(..)))
            .count();
        let first = hit.first_slot as usize;
        let Some(decisions) = answers.get(first..first + ops) else {
            return Reply::error("backend returned too few decisions");
        };
        self.finish(
            loaded,
            &hit.plan,
            decisions,
            hit.peek,
            hit.arrival,
            DecidedAt::At(decided_at),
            label_counts,
        )
    }

    /// Runs `f` with this thread's cells of `loaded`'s label counters when
    /// `loaded` is the rule set this thread serves (`None` otherwise: the
    /// shared counters), for [`Engine::finish_deferred`]: a batch's replies
    /// finished later count where the thread's own requests count, not with
    /// a locked add per hit.
    pub fn with_label_counts<R>(
        &self,
        loaded: &Arc<LoadedRules>,
        f: impl FnOnce(Option<&[Arc<ThreadLabelCounts>]>) -> R,
    ) -> R {
        self.with_rules(|current, counts| f(Arc::ptr_eq(loaded, current).then_some(counts)))
    }

    /// Turns decisions into the reply (the last evaluated rule's) and counts
    /// metrics once per evaluated rule, in this thread's cells of the rules'
    /// label counters when given (`label_counts`, by rule position).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn finish(
        &self,
        loaded: &LoadedRules,
        plan: &Plan,
        decisions: &[Result<Decision, BackendError>],
        peek: bool,
        arrival: Arrival,
        decided_at: DecidedAt,
        label_counts: Option<&[Arc<ThreadLabelCounts>]>,
    ) -> Reply {
        // By reference: the decision is copied once, into the reply.
        let mut last: Option<Result<&Decision, &BackendError>> = None;
        // A cluster shard that cannot decide is a backend failure, counted
        // here once per request (the Redis backend counts its own).
        if decisions
            .iter()
            .any(|d| matches!(d, Err(BackendError::ShardUnavailable(_))))
        {
            self.metrics.backend_error();
        }
        for step in plan {
            let (position, result) = match step {
                Step::Fixed(position, decision) => (*position, Ok(decision)),
                Step::Counter(position, op) => match decisions.get(*op) {
                    Some(Ok(decision)) => (*position, Ok(decision)),
                    Some(Err(error)) => (*position, Err(error)),
                    None => return Reply::error("backend returned too few decisions"),
                },
            };
            let rule = &loaded.set.rules()[position];
            if let (Ok(decision), false) = (&result, peek) {
                let canary = rule.match_policy == MatchPolicy::Canary;
                let status = HitStatus::new(decision.allowed, canary);
                match label_counts.and_then(|counts| counts.get(position)) {
                    Some(mine) => self.metrics.hit_evaluated_alone(mine, status),
                    None => self
                        .metrics
                        .hit_evaluated(&loaded.label_counters[position], status),
                }
                if self.debug_rules {
                    tracing::debug!(
                        target: "divvy",
                        rule = %rule.origin,
                        comment = rule.comment.as_deref().unwrap_or(""),
                        allowed = decision.allowed,
                        "rule evaluated"
                    );
                }
            }
            last = Some(result);
        }
        match last {
            Some(Ok(decision)) => {
                if !peek {
                    self.metrics.hit_duration_ns(match decided_at {
                        DecidedAt::InBatch => synchronous_elapsed_ns(arrival.received),
                        DecidedAt::Now => Moment::now().saturating_nanos_since(arrival.received),
                        DecidedAt::At(at) => at.saturating_nanos_since(arrival.received),
                    });
                }
                Reply::Decision(*decision)
            }
            Some(Err(error)) => self.unavailable(loaded, plan, error),
            None => Reply::error("no rule matched"),
        }
    }

    fn unavailable(&self, loaded: &LoadedRules, plan: &Plan, error: &BackendError) -> Reply {
        match self.unavailable_policy {
            UnavailablePolicy::Error => {
                self.metrics.error(ErrorCode::Unknown);
                Reply::error(error.to_string())
            }
            UnavailablePolicy::Deny => Reply::Decision(Decision::ALWAYS_DENY),
            UnavailablePolicy::Allow => {
                let credit_limit =
                    plan.last()
                        .map_or(0, |step| match loaded.set.rules()[step.position()].quota {
                            Quota::Limited { credit_limit, .. }
                            | Quota::AlwaysAllow { credit_limit } => credit_limit,
                            Quota::AlwaysDeny => 0,
                        });
                Reply::Decision(Decision::always_allow(credit_limit))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::metrics::Metrics;
    use crate::store::{MemoryBackend, MemoryStore, MemoryStoreConfig};

    const RULES: &str = "[path=/limited]\ncreditLimit = 3\nresetSeconds = 60\nactorField = user\n\n[default]\ncreditLimit = 100\nresetSeconds = 60\n";

    fn engine() -> Arc<Engine> {
        let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
        Arc::new(Engine::new(
            RuleSet::from_ini(RULES).unwrap(),
            Arc::new(MemoryBackend { store }),
            Arc::new(ManualClock::new(1_000_000)),
            Metrics::new(),
            UnavailablePolicy::Error,
        ))
    }

    fn encoded(outcome: Outcome) -> String {
        let Outcome::Now(reply) = outcome else {
            panic!("the memory backend answers at once");
        };
        let mut out = Vec::new();
        reply.encode(&mut out);
        String::from_utf8(out).unwrap()
    }

    /// Runs `input` through `execute_hit_run` and then `execute`, as a
    /// connection does; returns every reply and how many came from runs.
    fn serve(engine: &Arc<Engine>, mut input: &[u8], lines_max: usize) -> (String, usize) {
        let (mut replies, mut from_runs) = (String::new(), 0);
        let mut outcomes = SmallVec::new();
        loop {
            let arrival = engine.arrival();
            let used = engine.execute_hit_run(input, lines_max, 64, arrival, None, &mut outcomes);
            if used > 0 {
                input = &input[used..];
                from_runs += outcomes.len();
                for outcome in outcomes.drain(..) {
                    let reply = encoded(outcome);
                    let closes = reply.starts_with("ERR");
                    replies += &reply;
                    if closes {
                        return (replies, from_runs);
                    }
                }
                continue;
            }
            let Some((line, used)) = split_line(input) else {
                return (replies, from_runs);
            };
            input = &input[used..];
            let reply = encoded(engine.execute(line, arrival));
            let closes = reply.starts_with("ERR");
            replies += &reply;
            if closes {
                return (replies, from_runs);
            }
        }
    }

    #[test]
    fn each_request_sees_its_own_engines_rules_and_the_latest_replacement() {
        let (first, second) = (engine(), engine());
        second.replace_rules(
            RuleSet::from_ini("[default]\ncreditLimit = 7\nresetSeconds = 60\n").unwrap(),
        );
        // One thread alternating between engines: the cached rules of one
        // are never used for the other.
        for _ in 0..3 {
            let line = b"PEEK path=/other";
            assert_eq!(
                encoded(first.execute(line, first.arrival())),
                "OK true 99 60\n"
            );
            assert_eq!(
                encoded(second.execute(line, second.arrival())),
                "OK true 6 60\n"
            );
        }
        // A replacement is seen by the next request of a thread that cached
        // the rules before it.
        first.replace_rules(
            RuleSet::from_ini("[default]\ncreditLimit = 5\nresetSeconds = 60\n").unwrap(),
        );
        let peek = encoded(first.execute(b"PEEK path=/other", first.arrival()));
        assert_eq!(peek, "OK true 4 60\n");
    }

    #[test]
    fn a_run_of_hits_answers_as_line_by_line_execution_does() {
        let input =
            b"HIT path=/limited user=a\nPEEK path=/limited user=a\nHIT path=/limited user=b\n\
HIT path=/limited user=a\nHIT path=/limited user=a\nHIT path=/limited user=a\nHIT path=/other\n";
        let runs = engine();
        let (run, from_runs) = serve(&runs, input, usize::MAX);
        let reference = engine();
        let mut expected = String::new();
        for line in input.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            expected += &encoded(reference.execute(line, reference.arrival()));
        }
        assert_eq!(run, expected);
        assert_eq!(from_runs, 7, "every line is a hit: one run");
        // Counted in the rules' label counters alike (the PEEK is not).
        for (status, hits) in [(HitStatus::Accepted, 5), (HitStatus::Rejected, 1)] {
            for engine in [&runs, &reference] {
                assert_eq!(engine.metrics.label_counters("").get(status), hits);
            }
        }
        // Hits on one counter within a run are decided in order.
        assert_eq!(
            run.lines().collect::<Vec<_>>(),
            [
                "OK true 2 60",
                "OK true 1 60",
                "OK true 2 60",
                "OK true 1 60",
                "OK true 0 60",
                "OK false 0 60",
                "OK true 99 60",
            ]
        );
    }

    #[test]
    fn a_run_stops_before_other_commands_and_after_a_closing_reply() {
        let engine = engine();
        // An unknown command ends the run; it is answered (and closes the
        // connection) by the line-by-line path, and nothing after it runs.
        let input = b"HIT path=/limited user=c\nHIT path=/limited user=c\nBOGUS x=y\nHIT path=/limited user=c\n";
        let (replies, from_runs) = serve(&engine, input, usize::MAX);
        assert_eq!(from_runs, 2);
        let lines: Vec<&str> = replies.lines().collect();
        assert_eq!(lines.len(), 3, "{replies}");
        assert!(lines[2].starts_with("ERR"), "{replies}");
        let peek = encoded(engine.execute(b"PEEK path=/limited user=c", engine.arrival()));
        // Two hits counted: a third would be allowed (a fourth would not).
        assert_eq!(
            peek, "OK true 0 60\n",
            "the hit after the error was not counted"
        );
    }

    #[test]
    fn a_run_respects_its_line_budget_and_leaves_incomplete_and_long_lines() {
        let engine = engine();
        let mut outcomes = SmallVec::new();
        let arrival = engine.arrival();
        let input =
            b"HIT path=/limited user=d\nHIT path=/limited user=e\nHIT path=/limited user=f\n";
        let used = engine.execute_hit_run(input, 2, 64, arrival, None, &mut outcomes);
        assert_eq!((used, outcomes.len()), (50, 2));
        outcomes.clear();
        // One line alone, or a line budget of one, is left to `execute`.
        assert_eq!(
            engine.execute_hit_run(&input[..25], 8, 64, arrival, None, &mut outcomes),
            0
        );
        assert_eq!(
            engine.execute_hit_run(input, 1, 64, arrival, None, &mut outcomes),
            0
        );
        // The incomplete last line stays unread.
        let partial = b"HIT path=/limited user=g\nHIT path=/limited user=g\nHIT path=/lim";
        assert_eq!(
            engine.execute_hit_run(partial, 8, 64, arrival, None, &mut outcomes),
            50
        );
        outcomes.clear();
        // A line over the byte limit ends the run before it.
        let long = b"HIT path=/limited user=h\nHIT path=/limited user=hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh\nHIT path=/limited user=h\n";
        assert_eq!(
            engine.execute_hit_run(long, 8, 64, arrival, None, &mut outcomes),
            25
        );
        assert_eq!(outcomes.len(), 1);
        outcomes.clear();
        // So does a line that is not ASCII.
        let utf8 = "HIT path=/limited user=i\nHIT path=/limited user=\u{e9}\n".as_bytes();
        assert_eq!(
            engine.execute_hit_run(utf8, 8, 64, arrival, None, &mut outcomes),
            25
        );
    }
}
