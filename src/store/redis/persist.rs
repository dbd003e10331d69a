//! Redis as persistence for the in-memory counters (`--persist-redis URL`),
//! so that a full restart does not hand every actor a fresh quota.
//!
//! - **Writing.** Every `interval_ms`, a task on the persistence client's
//!   thread copies the live counters of a few whole stripes (at least
//!   `counters_per_tick` counters, or every stripe once) and writes those
//!   that changed since last written, with pipelined `SET key value PX ttl`,
//!   so the work per tick is bounded and a full pass over N counters takes
//!   `ceil(N / counters_per_tick)` ticks. Keys expire in Redis when their
//!   window does.
//! - **Loading.** At start, before serving, `SCAN` + `MGET` over the prefix
//!   and merge each counter of a rule that still exists into the store.
//! - **Shutdown.** A last full pass, bounded by [`FINAL_FLUSH_TIMEOUT_MS`].
//!
//! What can be lost: on a crash, the hits a counter took since it was last
//! written (at most one full pass, normally one interval). A rule's counters
//! are keyed by what identifies them, in words (algorithm, limits, canonical
//! operation), rather than by the rule's hashed counter id, so that Redis
//! keys stay readable:
//! `<prefix><algorithm>:<limit>:<seconds>:<operation length>:<operation>:<actor>`
//! holding `<window end, ms since the epoch>:<hits used>`. The length prefix
//! makes keys parse back unambiguously whatever the operation and actor hold.

use super::client::{ClientConfig, HealthBoard, Lease, RedisClient};
use super::RedisSetupError;
use crate::clock::Clock;
use crate::limiter::CounterState;
use crate::rules::{CounterId, CurrentRules, Quota, Rule, RuleSet};
use crate::store::MemoryStore;
use redis::{ConnectionInfo, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

pub const DEFAULT_INTERVAL_MS: u64 = 1_000;
pub const DEFAULT_COUNTERS_PER_TICK: usize = 50_000;
pub const DEFAULT_KEY_PREFIX: &str = "tollgate:persist:";
/// Longest the last full pass at shutdown may take.
pub const FINAL_FLUSH_TIMEOUT_MS: u64 = 10_000;
/// Longest loading at start may take; what was loaded by then stays.
pub const LOAD_TIMEOUT_MS: u64 = 60_000;
/// Commands per pipeline when writing or reading counters.
const PIPELINE_COMMANDS_MAX: usize = 1_000;
/// Pipelines sent before waiting for their answers, when writing.
const PIPELINES_IN_FLIGHT: usize = 4;
/// Every this many full passes, every counter is written again, changed or not.
const FULL_REWRITE_PASSES: u64 = 60;

/// Where and how often to persist.
#[derive(Debug, Clone)]
pub struct PersistConfig {
    pub connection_info: ConnectionInfo,
    pub interval_ms: u64,
    pub counters_per_tick: usize,
    pub key_prefix: String,
    /// Longest one Redis round trip (a pipeline) may take.
    pub timeout_ms: u64,
}

/// What persistence did, for tests, logs and the benchmark.
#[derive(Debug, Default)]
pub struct PersistStats {
    pub ticks: AtomicU64,
    pub counters_written: AtomicU64,
    /// Counters not written because they had not changed since last written.
    pub counters_skipped: AtomicU64,
    pub write_errors: AtomicU64,
    pub counters_loaded: AtomicU64,
    /// Full passes over every stripe.
    pub passes: AtomicU64,
    pub last_tick_micros: AtomicU64,
    /// Time spent in ticks, in all.
    pub tick_micros_total: AtomicU64,
    pub last_tick_counters: AtomicU64,
    /// Wall time of the last full pass (first tick to last).
    pub last_pass_ms: AtomicU64,
}

/// Why persisting or loading failed.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("redis: {0}")]
    Redis(String),
    #[error("redis did not answer within {0} ms")]
    Timeout(u64),
    #[error("persistence has stopped")]
    Stopped,
}

/// Persistence, running: writes counters until [`Persistence::stop_and_flush`]
/// (or until dropped, which also ends it after one last pass).
pub struct Persistence {
    client: RedisClient,
    stats: Arc<PersistStats>,
    stop: Option<oneshot::Sender<std::sync::mpsc::Sender<Result<u64, PersistError>>>>,
}

impl Persistence {
    /// Connects, loads the persisted counters into `store` (blocking, before
    /// the caller starts serving), then writes counters every interval.
    /// `rules` says which rules own counters now (a reload may change them),
    /// `clock` what time it is. An unreachable Redis is not fatal: it is
    /// logged, nothing is loaded, and writing starts when Redis is reachable.
    pub fn start(
        config: PersistConfig,
        store: Arc<MemoryStore>,
        rules: Arc<dyn CurrentRules>,
        clock: Arc<dyn Clock>,
    ) -> Result<Persistence, RedisSetupError> {
        let client = RedisClient::start(ClientConfig {
            connection_info: config.connection_info.clone(),
            connections: 1,
            connect_timeout_ms: config.timeout_ms.max(1_000),
            ping_timeout_ms: config.timeout_ms.max(1_000),
            scripts: Vec::new(),
            health: HealthBoard::new("redis persistence", &config.connection_info, None),
        })?;
        let stats = Arc::new(PersistStats::default());
        let writer = Writer {
            client: client.clone(),
            store,
            rules,
            clock,
            config,
            stats: Arc::clone(&stats),
            cursor: 0,
            pass_stripes: 0,
            pass_started: None,
            failing: false,
            written: WrittenStates::default(),
        };
        let (loaded_sender, loaded_receiver) = std::sync::mpsc::channel();
        let (stop_sender, stop_receiver) = oneshot::channel();
        client.spawn(writer.run(loaded_sender, stop_receiver));
        match loaded_receiver.recv_timeout(Duration::from_millis(LOAD_TIMEOUT_MS + 1_000)) {
            Ok(Ok(loaded)) => {
                tracing::info!(
                    target = client.target(),
                    loaded,
                    "persisted counters loaded"
                )
            }
            Ok(Err(error)) => tracing::warn!(
                target = client.target(),
                %error,
                "persisted counters could not be loaded; starting with what was loaded"
            ),
            Err(_) => tracing::warn!(
                target = client.target(),
                "loading persisted counters did not finish; starting with what was loaded"
            ),
        }
        Ok(Persistence {
            client,
            stats,
            stop: Some(stop_sender),
        })
    }

    pub fn stats(&self) -> &PersistStats {
        &self.stats
    }

    /// Where counters are persisted, without credentials.
    pub fn target(&self) -> &str {
        self.client.target()
    }

    /// Stops the periodic writes and writes every live counter once more
    /// (bounded by [`FINAL_FLUSH_TIMEOUT_MS`]). Returns how many were written.
    pub fn stop_and_flush(mut self) -> Result<u64, PersistError> {
        let (done_sender, done_receiver) = std::sync::mpsc::channel();
        let stop = self.stop.take().ok_or(PersistError::Stopped)?;
        stop.send(done_sender).map_err(|_| PersistError::Stopped)?;
        match done_receiver.recv_timeout(Duration::from_millis(FINAL_FLUSH_TIMEOUT_MS + 1_000)) {
            Ok(result) => result,
            Err(_) => Err(PersistError::Timeout(FINAL_FLUSH_TIMEOUT_MS)),
        }
    }
}

/// The task that writes counters; runs on the persistence client's thread.
struct Writer {
    client: RedisClient,
    store: Arc<MemoryStore>,
    rules: Arc<dyn CurrentRules>,
    clock: Arc<dyn Clock>,
    config: PersistConfig,
    stats: Arc<PersistStats>,
    /// Next stripe to write.
    cursor: usize,
    /// Stripes written in the current pass.
    pass_stripes: usize,
    pass_started: Option<Instant>,
    /// The last write failed (log once per streak).
    failing: bool,
    written: WrittenStates,
}

/// The state last written for each counter, by a hash of its key, so that
/// counters unchanged since are not written again. Forgotten whenever Redis
/// may have lost what was written: after a reconnection, a failed write, and
/// every [`FULL_REWRITE_PASSES`] passes (a Redis flushed behind our back).
#[derive(Default)]
struct WrittenStates {
    by_key_hash: HashMap<u64, CounterState>,
    hasher: ahash::RandomState,
    /// The connection the states were written on.
    generation: Option<u64>,
    passes: u64,
}

impl WrittenStates {
    fn unchanged(&self, key_hash: u64, state: CounterState) -> bool {
        self.by_key_hash.get(&key_hash) == Some(&state)
    }

    fn forget(&mut self) {
        self.by_key_hash.clear();
    }

    /// A full pass ended: drop what has expired; now and then, everything.
    fn pass_done(&mut self, now_ms: u64) {
        self.passes += 1;
        if self.passes.is_multiple_of(FULL_REWRITE_PASSES) {
            self.forget();
        } else {
            self.by_key_hash
                .retain(|_, state| state.expires_at_ms() > now_ms);
        }
    }
}

type StopRequest = std::sync::mpsc::Sender<Result<u64, PersistError>>;

impl Writer {
    async fn run(
        mut self,
        loaded: std::sync::mpsc::Sender<Result<u64, PersistError>>,
        mut stop: oneshot::Receiver<StopRequest>,
    ) {
        let load = self.load();
        let result = match tokio::time::timeout(Duration::from_millis(LOAD_TIMEOUT_MS), load).await
        {
            Ok(result) => result,
            Err(_) => Err(PersistError::Timeout(LOAD_TIMEOUT_MS)),
        };
        let _ = loaded.send(result);
        let mut interval = tokio::time::interval(Duration::from_millis(self.config.interval_ms));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval.tick().await;
        loop {
            tokio::select! {
                biased;
                request = &mut stop => {
                    let flushed = tokio::time::timeout(
                        Duration::from_millis(FINAL_FLUSH_TIMEOUT_MS),
                        self.write_full_pass(),
                    )
                    .await
                    .unwrap_or(Err(PersistError::Timeout(FINAL_FLUSH_TIMEOUT_MS)));
                    if let Ok(request) = request {
                        let _ = request.send(flushed);
                    }
                    return;
                }
                _ = interval.tick() => {
                    let _ = self.write_step(self.config.counters_per_tick).await;
                }
            }
        }
    }

    /// Loads every persisted counter of a rule that still exists.
    async fn load(&mut self) -> Result<u64, PersistError> {
        if self.client.lease().is_none() {
            return Err(PersistError::Redis(self.client.not_connected().to_string()));
        }
        let rules = self.rules.current();
        let persisted_rules = PersistedRules::new(&rules);
        let now_ms = self.clock.now_ms();
        let pattern = format!("{}*", escape_glob(&self.config.key_prefix));
        let mut cursor: u64 = 0;
        let mut loaded = 0;
        let mut key_buf = Vec::with_capacity(128);
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(PIPELINE_COMMANDS_MAX);
            let (next, keys): (u64, Vec<Vec<u8>>) = self.query(&scan).await?;
            if !keys.is_empty() {
                let mut mget = redis::cmd("MGET");
                for key in &keys {
                    mget.arg(key.as_slice());
                }
                let values: Vec<Option<Vec<u8>>> = self.query(&mget).await?;
                for (key, value) in keys.iter().zip(values) {
                    let Some(value) = value else { continue };
                    let Some(key) = key.strip_prefix(self.config.key_prefix.as_bytes()) else {
                        continue;
                    };
                    let (Some(counter), Some(state)) =
                        (PersistedKey::parse(key), parse_value(&value))
                    else {
                        tracing::debug!("skipping a persisted counter that does not parse");
                        continue;
                    };
                    let Some(rule) = persisted_rules.find(&counter) else {
                        continue; // its rule is gone (or its limits changed): fresh counters
                    };
                    rule.counter_id
                        .write_key(&mut key_buf, counter.actor.as_bytes());
                    if state.expires_at_ms() <= now_ms {
                        continue;
                    }
                    if let Err(full) = self.store.merge(&key_buf, state, now_ms) {
                        tracing::warn!(%full, "stopped loading persisted counters");
                        return Ok(loaded);
                    }
                    loaded += 1;
                    self.stats.counters_loaded.fetch_add(1, Ordering::Relaxed);
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(loaded);
            }
        }
    }

    async fn query<T: redis::FromRedisValue>(
        &self,
        command: &redis::Cmd,
    ) -> Result<T, PersistError> {
        let request = self.client.request(command);
        let value = tokio::time::timeout(Duration::from_millis(self.config.timeout_ms), request)
            .await
            .map_err(|_| PersistError::Timeout(self.config.timeout_ms))?
            .map_err(|error| PersistError::Redis(error.to_string()))?;
        redis::from_owned_redis_value(value).map_err(|error| PersistError::Redis(error.to_string()))
    }

    /// Writes every live counter once, step by step (so memory stays bounded
    /// by one step's counters). Returns how many were written.
    async fn write_full_pass(&mut self) -> Result<u64, PersistError> {
        let stripes = self.store.stripe_count();
        let mut visited = 0;
        let mut written = 0;
        while visited < stripes {
            let (result, step_stripes) = self.write_step(self.config.counters_per_tick).await;
            written += result?;
            visited += step_stripes;
        }
        Ok(written)
    }

    /// Writes the live counters of the next stripes, at least `budget` of
    /// them (or every stripe once). Returns how many were written, and how
    /// many stripes were visited.
    async fn write_step(&mut self, budget: usize) -> (Result<u64, PersistError>, usize) {
        let started = Instant::now();
        let now_ms = self.clock.now_ms();
        let rules = self.rules.current();
        let heads = PersistedRules::new(&rules).key_heads(&self.config.key_prefix);
        let mut copied: Vec<(Vec<u8>, CounterState)> = Vec::new();
        let (next, stripes) =
            self.store
                .visit_live_step(self.cursor, budget, now_ms, |key, state| {
                    copied.push((key.to_vec(), state));
                });
        self.cursor = next;
        if self.pass_started.is_none() {
            self.pass_started = Some(started);
        }
        self.pass_stripes += stripes;

        let mut written = 0;
        let mut skipped = 0;
        let mut result = Ok(());
        let lease = self.client.lease();
        let generation = lease.as_ref().map(Lease::generation);
        if generation != self.written.generation {
            self.written.forget();
            self.written.generation = generation;
        }
        // Pipelines, each with the (key hash, state) of the counters it writes.
        let mut pipelines: Vec<(redis::Pipeline, Vec<(u64, CounterState)>)> = Vec::new();
        for chunk in copied.chunks(PIPELINE_COMMANDS_MAX) {
            let mut pipeline = redis::pipe();
            let mut states = Vec::with_capacity(chunk.len());
            for (key, state) in chunk {
                let key_hash = self.written.hasher.hash_one(key.as_slice());
                if self.written.unchanged(key_hash, *state) {
                    skipped += 1;
                    continue;
                }
                let Some((counter_id, actor)) = CounterId::split_key(key) else {
                    continue;
                };
                let Some(head) = heads.get(&counter_id) else {
                    continue; // the rule was removed by a reload
                };
                let Some((value, ttl_ms)) = encode_value(*state, now_ms) else {
                    continue;
                };
                let mut persisted_key = Vec::with_capacity(head.len() + actor.len());
                persisted_key.extend_from_slice(head.as_bytes());
                persisted_key.extend_from_slice(actor);
                pipeline
                    .cmd("SET")
                    .arg(persisted_key)
                    .arg(value)
                    .arg("PX")
                    .arg(ttl_ms);
                states.push((key_hash, *state));
            }
            if !states.is_empty() {
                pipelines.push((pipeline, states));
            }
        }
        drop(copied);
        // A few pipelines in flight at once keep the connection busy.
        for group in pipelines.chunks(PIPELINES_IN_FLIGHT) {
            let writes = group
                .iter()
                .map(|(pipeline, _)| self.write(lease.clone(), pipeline));
            let outcomes = futures_util::future::join_all(writes).await;
            for ((_, states), outcome) in group.iter().zip(outcomes) {
                match outcome {
                    Ok(()) => {
                        written += states.len() as u64;
                        self.written.by_key_hash.extend(states.iter().copied());
                    }
                    Err(error) => result = Err(error),
                }
            }
            if result.is_err() {
                self.written.forget();
                break;
            }
        }
        let elapsed = started.elapsed();
        let stats = &self.stats;
        stats.ticks.fetch_add(1, Ordering::Relaxed);
        stats.counters_written.fetch_add(written, Ordering::Relaxed);
        stats.counters_skipped.fetch_add(skipped, Ordering::Relaxed);
        stats
            .last_tick_micros
            .store(elapsed.as_micros() as u64, Ordering::Relaxed);
        stats
            .tick_micros_total
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        stats.last_tick_counters.store(written, Ordering::Relaxed);
        if self.pass_stripes >= self.store.stripe_count() {
            self.pass_stripes = 0;
            if let Some(pass_started) = self.pass_started.take() {
                stats
                    .last_pass_ms
                    .store(pass_started.elapsed().as_millis() as u64, Ordering::Relaxed);
            }
            stats.passes.fetch_add(1, Ordering::Relaxed);
            self.written.pass_done(now_ms);
        }
        tracing::debug!(
            written,
            micros = elapsed.as_micros() as u64,
            "persisted counters"
        );
        let result = match result {
            Ok(()) => {
                if self.failing {
                    self.failing = false;
                    tracing::info!(target = self.client.target(), "persisting counters again");
                }
                Ok(written)
            }
            Err(error) => {
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                if !self.failing {
                    self.failing = true;
                    tracing::warn!(
                        target = self.client.target(),
                        %error,
                        "cannot persist counters; retrying every interval"
                    );
                }
                Err(error)
            }
        };
        (result, stripes)
    }

    async fn write(
        &self,
        lease: Option<Lease>,
        pipeline: &redis::Pipeline,
    ) -> Result<(), PersistError> {
        let Some(mut lease) = lease else {
            return Err(PersistError::Redis(self.client.not_connected().to_string()));
        };
        let replies = tokio::time::timeout(
            Duration::from_millis(self.config.timeout_ms),
            self.client.send_pipeline(&mut lease, pipeline),
        )
        .await
        .map_err(|_| PersistError::Timeout(self.config.timeout_ms))?
        .map_err(|error| PersistError::Redis(error.to_string()))?;
        match replies
            .into_iter()
            .find(|reply| matches!(reply, Value::ServerError(_)))
        {
            Some(Value::ServerError(error)) => Err(PersistError::Redis(format!("{error:?}"))),
            _ => Ok(()),
        }
    }
}

/// The current rules that own counters, by their counter id (the head of
/// their counters' keys in memory).
struct PersistedRules<'r> {
    by_counter_id: HashMap<CounterId, &'r Rule>,
}

impl<'r> PersistedRules<'r> {
    fn new(rules: &'r RuleSet) -> PersistedRules<'r> {
        PersistedRules {
            by_counter_id: rules
                .rules()
                .iter()
                .filter(|rule| matches!(rule.quota, Quota::Limited { .. }))
                .map(|rule| (rule.counter_id, rule))
                .collect(),
        }
    }

    /// The persisted key of each rule up to the actor.
    fn key_heads(&self, prefix: &str) -> HashMap<CounterId, String> {
        self.by_counter_id
            .iter()
            .filter_map(|(&counter_id, rule)| {
                let Quota::Limited {
                    credit_limit,
                    reset_seconds,
                } = rule.quota
                else {
                    return None;
                };
                let operation = &rule.canonical_operation;
                Some((
                    counter_id,
                    format!(
                        "{prefix}{}:{credit_limit}:{reset_seconds}:{}:{operation}:",
                        rule.algorithm.as_str(),
                        operation.len()
                    ),
                ))
            })
            .collect()
    }

    /// The rule a persisted counter belongs to, if it still exists.
    fn find(&self, counter: &PersistedKey<'_>) -> Option<&'r Rule> {
        let counter_id = CounterId::of(
            counter.operation,
            counter.credit_limit,
            counter.reset_seconds.saturating_mul(1000),
            counter.algorithm,
        );
        self.by_counter_id.get(&counter_id).copied()
    }
}

/// A persisted key, after the prefix, parsed back.
#[derive(Debug, PartialEq, Eq)]
struct PersistedKey<'k> {
    algorithm: &'k str,
    credit_limit: u64,
    reset_seconds: u64,
    operation: &'k str,
    actor: &'k str,
}

impl<'k> PersistedKey<'k> {
    fn parse(key: &'k [u8]) -> Option<PersistedKey<'k>> {
        let text = std::str::from_utf8(key).ok()?;
        let mut fields = text.splitn(5, ':');
        let algorithm = fields.next()?;
        let credit_limit = fields.next()?.parse().ok()?;
        let reset_seconds = fields.next()?.parse().ok()?;
        let operation_len: usize = fields.next()?.parse().ok()?;
        let rest = fields.next()?;
        let operation = rest.get(..operation_len)?;
        let actor = rest.get(operation_len..)?.strip_prefix(':')?;
        Some(PersistedKey {
            algorithm,
            credit_limit,
            reset_seconds,
            operation,
            actor,
        })
    }
}

/// `<window end ms>:<used>` and the time left in the window, for `PX`;
/// `None` for a state with nothing left to keep.
fn encode_value(state: CounterState, now_ms: u64) -> Option<(String, u64)> {
    #[allow(unreachable_patterns)] // states of other algorithms are not persisted yet
    match state {
        CounterState::Window { end_ms, used } => {
            let ttl_ms = end_ms.checked_sub(now_ms).filter(|&ms| ms > 0)?;
            Some((format!("{end_ms}:{used}"), ttl_ms))
        }
        _ => None,
    }
}

fn parse_value(value: &[u8]) -> Option<CounterState> {
    let text = std::str::from_utf8(value).ok()?;
    let (end_ms, used) = text.split_once(':')?;
    Some(CounterState::Window {
        end_ms: end_ms.parse().ok()?,
        used: used.parse().ok()?,
    })
}

/// Escapes Redis glob characters, so a prefix matches only itself.
fn escape_glob(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn persisted_keys_parse_back_whatever_the_operation_and_actor_hold() {
        let rules = RuleSet::from_ini(
            "[path=/a:b c=*]\ncreditLimit = 3\nresetSeconds = 60\nactorField = c\n\n[default]\ncreditLimit = 1\nresetSeconds = 5\n",
        )
        .unwrap();
        let persisted = PersistedRules::new(&rules);
        let heads = persisted.key_heads("p:");
        for rule in rules.rules() {
            let head = &heads[&rule.counter_id];
            let key = format!("{head}x:y:z");
            let parsed = PersistedKey::parse(key.strip_prefix("p:").unwrap().as_bytes()).unwrap();
            assert_eq!(parsed.actor, "x:y:z");
            assert_eq!(parsed.operation, &*rule.canonical_operation);
            assert_eq!(
                persisted.find(&parsed).map(|r| r.position),
                Some(rule.position)
            );
        }
        assert_eq!(PersistedKey::parse(b"fixed-window:1:1:99:short:a"), None);
        assert_eq!(PersistedKey::parse(b"fixed-window:x:1:0::a"), None);
    }

    #[test]
    fn values_round_trip_and_expired_states_are_not_written() {
        let state = CounterState::Window {
            end_ms: 1_700_000_060_000,
            used: 7,
        };
        let (value, ttl_ms) = encode_value(state, 1_700_000_000_000).unwrap();
        assert_eq!(ttl_ms, 60_000);
        assert_eq!(parse_value(value.as_bytes()), Some(state));
        assert_eq!(encode_value(state, 1_700_000_060_000), None);
        assert_eq!(parse_value(b"12"), None);
    }

    #[test]
    fn glob_characters_in_the_prefix_are_escaped() {
        assert_eq!(escape_glob("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
