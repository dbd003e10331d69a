//! The Redis-backed mode and Redis persistence. With `--backend redis`,
//! counters live in the Redis that divvy uses, in divvy's key layout (SPEC
//! §5), so that divvy and Tollgate can count the same keys side by side
//! during a migration: the requests of one read of a client connection go
//! to Redis as one atomic script call (a [`RedisBatch`]), each request's
//! counters applied in order, one request alone when it is not part of a
//! read batch. With
//! `--persist-redis URL`, the in-memory counters are written to Redis
//! periodically and loaded at start ([`persist`]). This is the only module
//! that names `redis` types.
//!
//! Failure behaviour: a hit waits at most `backend_timeout_ms` for Redis,
//! then fails with a [`BackendError`] that the engine turns into `ERR` (or the
//! `--unavailable-policy` answer); while Redis is down hits fail at once; the
//! client reconnects by itself ([`client`]).

pub mod client;
pub mod persist;
pub mod script;

use crate::metrics::Metrics;
use crate::rules::{Algorithm, RuleSet};
use crate::store::{
    Backend, BackendError, BatchDecided, CounterOp, Decided, Decisions, OpBatch, SlotAnswers,
};
use client::{ClientConfig, ClientStartError, HealthBoard, Lease, RedisClient};
use futures_util::future::{join_all, BoxFuture};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo};
use script::{LoadedScript, ScriptCall, ScriptError, BATCH_SCRIPT, CALL_COUNTERS_MAX};
use std::sync::Arc;
use std::time::Duration;

pub use persist::{PersistConfig, Persistence};

/// Where counters live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// In this process's memory (the default).
    #[default]
    Memory,
    /// In Redis, in divvy's key layout (single node; shares divvy's Redis).
    Redis,
}

/// The Redis backend and Redis persistence, as divvy's environment and
/// `tollgate serve`'s flags give them (docs/redis.md). Values divvy read from
/// the environment are kept as text and checked only when used, so that an
/// unrelated `REDIS_PORT` never stops the memory backend.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// Where counters live.
    pub backend: BackendKind,
    /// The redis backend's host (`REDIS_HOST`).
    pub redis_host: String,
    /// The redis backend's port, as text (`REDIS_PORT`); read only with the
    /// redis backend.
    pub redis_port: String,
    /// The redis backend's URL, for a password, a database or TLS; overrides
    /// host and port.
    pub redis_url: Option<String>,
    /// Longest a hit waits for Redis, in milliseconds.
    pub backend_timeout_ms: u64,
    /// Persist the in-memory counters to this Redis (URL).
    pub persist_redis: Option<String>,
    /// How often persistence writes a batch of counters, in milliseconds.
    pub persist_interval_ms: u64,
    /// Most counters persistence writes per interval.
    pub persist_counters_per_tick: usize,
    /// Prefix of persisted counter keys (one per deployment sharing a Redis).
    pub persist_key_prefix: String,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            backend: BackendKind::Memory,
            redis_host: "localhost".into(),
            redis_port: "6379".into(),
            redis_url: None,
            backend_timeout_ms: 1_000,
            persist_redis: None,
            persist_interval_ms: persist::DEFAULT_INTERVAL_MS,
            persist_counters_per_tick: persist::DEFAULT_COUNTERS_PER_TICK,
            persist_key_prefix: persist::DEFAULT_KEY_PREFIX.into(),
        }
    }
}

impl RedisConfig {
    /// The backend's Redis: `--redis-url`, else REDIS_HOST and REDIS_PORT.
    pub fn backend_connection_info(&self) -> Result<ConnectionInfo, RedisSetupError> {
        match &self.redis_url {
            Some(url) => parse_url(url),
            None => {
                let port = self
                    .redis_port
                    .trim()
                    .parse()
                    .map_err(|_| RedisSetupError::BadPort(self.redis_port.clone()))?;
                Ok(ConnectionInfo {
                    addr: ConnectionAddr::Tcp(self.redis_host.clone(), port),
                    redis: RedisConnectionInfo::default(),
                })
            }
        }
    }

    pub fn persist_config(&self) -> Result<Option<PersistConfig>, RedisSetupError> {
        let Some(url) = &self.persist_redis else {
            return Ok(None);
        };
        if self.backend == BackendKind::Redis {
            return Err(RedisSetupError::PersistWithRedisBackend);
        }
        Ok(Some(PersistConfig {
            connection_info: parse_url(url)?,
            interval_ms: self.persist_interval_ms.max(1),
            counters_per_tick: self.persist_counters_per_tick.max(1),
            key_prefix: self.persist_key_prefix.clone(),
            timeout_ms: self.backend_timeout_ms.max(1),
        }))
    }
}

fn parse_url(url: &str) -> Result<ConnectionInfo, RedisSetupError> {
    url.into_connection_info()
        .map_err(|error| RedisSetupError::BadUrl(error.to_string()))
}

/// Why the Redis backend or persistence could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RedisSetupError {
    #[error("invalid redis URL: {0}")]
    BadUrl(String),
    #[error("REDIS_PORT (--redis-port) must be a port number, got '{0}'")]
    BadPort(String),
    #[error(transparent)]
    Client(#[from] ClientStartError),
    #[error("rule {rule} uses the {algorithm} algorithm; the redis backend counts only fixed windows (divvy's), so it cannot serve this rule")]
    UnsupportedAlgorithm { rule: String, algorithm: String },
    #[error("--persist-redis persists the in-memory backend; with --backend redis the counters already live in Redis")]
    PersistWithRedisBackend,
}

/// Checks that the redis backend can serve every rule: Redis counts divvy's
/// fixed windows only. Call it on every rule set the backend will see (at
/// start, and on reload). This is the one place to extend when other
/// algorithms get a Redis form.
pub fn check_rules(rules: &RuleSet) -> Result<(), RedisSetupError> {
    for rule in rules.rules() {
        check_algorithm(rule.algorithm).map_err(|algorithm| {
            RedisSetupError::UnsupportedAlgorithm {
                rule: rule.origin.to_string(),
                algorithm: algorithm.to_string(),
            }
        })?;
    }
    Ok(())
}

/// `Err(name)` for an algorithm that has no Redis form (divvy's Redis knows
/// only its fixed window). A new algorithm must be decided on here.
fn check_algorithm(algorithm: Algorithm) -> Result<(), &'static str> {
    match algorithm {
        Algorithm::FixedWindow => Ok(()),
        Algorithm::TokenBucket | Algorithm::SlidingWindow => Err(algorithm.as_str()),
    }
}

/// Counters in Redis, in divvy's layout.
///
/// Each serving thread opens its own Redis connection on first use, on its
/// own runtime, and pipelines the script calls of all its client
/// connections onto it: no request crosses threads, and those of one client
/// connection reach Redis in order. A probe connection on a thread of its
/// own checks Redis at start (so the start-up log says whether it is
/// reachable) and stands in while a thread's own connection is not up
/// (first use, reconnection) or for callers without a runtime.
pub struct RedisBackend {
    shared: Arc<BackendShared>,
}

/// What the backend and its batches share.
struct BackendShared {
    /// Tells the serving threads' clients apart from other backends' in
    /// [`THREAD_CLIENTS`]; they stop once it is gone.
    alive: Arc<()>,
    probe_client: RedisClient,
    thread_client_config: ClientConfig,
    script: LoadedScript,
    backend_timeout_ms: u64,
    metrics: Arc<Metrics>,
}

thread_local! {
    /// The Redis clients this thread started for itself, with the backend
    /// each belongs to.
    static THREAD_CLIENTS: std::cell::RefCell<Vec<(std::sync::Weak<()>, RedisClient)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

impl RedisBackend {
    /// Connects (without waiting long: an unreachable Redis is reported and
    /// retried, not fatal) and checks that Redis can serve `rules`.
    pub fn start(
        redis: &RedisConfig,
        rules: &RuleSet,
        metrics: Arc<Metrics>,
    ) -> Result<RedisBackend, RedisSetupError> {
        check_rules(rules)?;
        let connection_info = redis.backend_connection_info()?;
        let config = ClientConfig {
            health: HealthBoard::new(
                "redis backend",
                &connection_info,
                Some(Arc::clone(&metrics)),
            ),
            connection_info,
            connections: 1,
            connect_timeout_ms: redis.backend_timeout_ms.max(1_000),
            ping_timeout_ms: redis.backend_timeout_ms.max(500),
            scripts: vec![BATCH_SCRIPT],
        };
        Ok(RedisBackend {
            shared: Arc::new(BackendShared {
                alive: Arc::new(()),
                probe_client: RedisClient::start(config.clone())?,
                thread_client_config: config,
                script: LoadedScript::new(BATCH_SCRIPT),
                backend_timeout_ms: redis.backend_timeout_ms.max(1),
                metrics,
            }),
        })
    }

    /// Where the backend connects, without credentials.
    pub fn target(&self) -> &str {
        self.shared.probe_client.target()
    }
}

impl BackendShared {
    /// This thread's own client, started on its runtime on first use (the
    /// probe client when the thread has no runtime).
    fn thread_client(&self) -> RedisClient {
        THREAD_CLIENTS.with(|clients| {
            let mut clients = clients.borrow_mut();
            if let Some((_, client)) = clients
                .iter()
                .find(|(backend, _)| std::ptr::eq(backend.as_ptr(), Arc::as_ptr(&self.alive)))
            {
                return client.clone();
            }
            // Clients of backends that are gone stop when dropped here.
            clients.retain(|(backend, _)| backend.strong_count() > 0);
            match RedisClient::start_here(self.thread_client_config.clone()) {
                Ok(client) => {
                    clients.push((Arc::downgrade(&self.alive), client.clone()));
                    client
                }
                Err(_) => self.probe_client.clone(),
            }
        })
    }

    /// This thread's own connection; while it is not up (first use,
    /// reconnecting), the probe connection stands in.
    fn lease(&self) -> Result<(RedisClient, Lease), BackendError> {
        let thread_client = self.thread_client();
        if let Some(lease) = thread_client.lease() {
            return Ok((thread_client, lease));
        }
        match self.probe_client.lease() {
            Some(lease) => Ok((self.probe_client.clone(), lease)),
            None => Err(BackendError::Unavailable(
                thread_client.not_connected().to_string(),
            )),
        }
    }

    /// `count` counters of one request that cannot be decided.
    fn fail(&self, count: usize, error: BackendError) -> Decisions {
        self.metrics.backend_error();
        (0..count).map(|_| Err(error.clone())).collect()
    }
}

/// An error message safe inside `ERR unknown "<message>"`: one line, no
/// double quotes, bounded length.
fn client_safe_message(text: &str) -> String {
    const MESSAGE_CHARS_MAX: usize = 200;
    text.chars()
        .map(|c| match c {
            '"' => '\'',
            c if c.is_control() => ' ',
            c => c,
        })
        .take(MESSAGE_CHARS_MAX)
        .collect()
}

/// The requests of one read of a client connection, gathered into script
/// calls of at most [`CALL_COUNTERS_MAX`] counters (a request is never
/// split) and sent back to back on one connection when the read is done:
/// one round trip, and one script run in Redis, for many requests.
pub struct RedisBatch {
    shared: Arc<BackendShared>,
    /// The connection, leased at the first request.
    lease: Option<(RedisClient, Lease)>,
    calls: Vec<ScriptCall>,
    /// Counters gathered (the next slot).
    counters: usize,
}

impl RedisBatch {
    fn new(shared: Arc<BackendShared>) -> RedisBatch {
        RedisBatch {
            shared,
            lease: None,
            calls: Vec::new(),
            counters: 0,
        }
    }
}

impl OpBatch for RedisBatch {
    fn decide(&mut self, ops: &[CounterOp<'_>], _now_ms: u64) -> BatchDecided {
        // Redis keeps its own clock: the window is the key's TTL.
        if let Some(algorithm) = ops
            .iter()
            .find_map(|op| check_algorithm(op.rule.algorithm).err())
        {
            let error =
                BackendError::Unavailable(format!("the redis backend cannot count {algorithm}"));
            return BatchDecided::Ready(self.shared.fail(ops.len(), error));
        }
        if self.lease.is_none() {
            match self.shared.lease() {
                Ok(lease) => self.lease = Some(lease),
                // While Redis is down, hits fail at once.
                Err(error) => return BatchDecided::Ready(self.shared.fail(ops.len(), error)),
            }
        }
        match self.calls.last_mut() {
            Some(call) if call.len() + ops.len() <= CALL_COUNTERS_MAX => call.push(ops),
            _ => self.calls.push(ScriptCall::new(ops)),
        }
        let first = self.counters as u32;
        self.counters += ops.len();
        BatchDecided::Slots { first }
    }

    fn submit(self: Box<Self>) -> Option<BoxFuture<'static, SlotAnswers>> {
        let RedisBatch {
            shared,
            lease,
            calls,
            counters,
        } = *self;
        let (client, lease) = lease?;
        if counters == 0 {
            return None;
        }
        Some(Box::pin(async move {
            let timeout = Duration::from_millis(shared.backend_timeout_ms);
            let script = &shared.script;
            let invocations = calls.iter().map(|call| {
                let (client, mut lease) = (&client, lease.clone());
                async move {
                    tokio::time::timeout(timeout, call.invoke(client, &mut lease, script)).await
                }
            });
            let mut answers = SlotAnswers::with_capacity(counters);
            for (call, invoked) in calls.iter().zip(join_all(invocations).await) {
                let error = match invoked {
                    Ok(Ok(decided)) => {
                        let mut start = 0;
                        for &count in call.requests() {
                            let request = &decided[start..start + count as usize];
                            start += count as usize;
                            if request.iter().any(|answer| answer.is_err()) {
                                shared.metrics.backend_error();
                            }
                            answers.extend(request.iter().map(|answer| match answer {
                                Ok(decision) => Ok(*decision),
                                Err(message) => Err(BackendError::Unavailable(
                                    client_safe_message(&format!("redis: {message}")),
                                )),
                            }));
                        }
                        continue;
                    }
                    Ok(Err(ScriptError::Request(error))) => {
                        BackendError::Unavailable(client_safe_message(&error.to_string()))
                    }
                    Ok(Err(error @ ScriptError::Reply(_))) => {
                        BackendError::Unavailable(client_safe_message(&error.to_string()))
                    }
                    Err(_elapsed) => BackendError::Timeout(shared.backend_timeout_ms),
                };
                for &count in call.requests() {
                    answers.extend(shared.fail(count as usize, error.clone()));
                }
            }
            answers
        }))
    }
}

impl Backend for RedisBackend {
    /// One request alone: a batch of one.
    fn decide(&self, ops: &[CounterOp<'_>], now_ms: u64) -> Decided {
        let mut batch = Box::new(RedisBatch::new(Arc::clone(&self.shared)));
        match batch.decide(ops, now_ms) {
            BatchDecided::Ready(decisions) => Decided::Ready(decisions),
            BatchDecided::Slots { .. } => match batch.submit() {
                Some(answers) => {
                    Decided::Later(Box::pin(async move { answers.await.into_iter().collect() }))
                }
                None => Decided::Ready(Decisions::new()),
            },
        }
    }

    fn begin_batch(&self) -> Option<Box<dyn OpBatch>> {
        Some(Box::new(RedisBatch::new(Arc::clone(&self.shared))))
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn check_rules(&self, rules: &RuleSet) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(check_rules(rules)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_for_clients_are_one_quoted_safe_line() {
        assert_eq!(client_safe_message("ERR \"bad\"\nthing"), "ERR 'bad' thing");
        assert_eq!(client_safe_message(&"x".repeat(500)).len(), 200);
    }

    #[test]
    fn only_fixed_window_rules_can_be_served_from_redis() {
        assert!(check_rules(&RuleSet::embedded_default()).is_ok());
        for algorithm in ["token-bucket", "sliding-window"] {
            let rules = RuleSet::from_ini(&format!(
                "[route=a]\ncreditLimit = 1\nresetSeconds = 1\nalgorithm = {algorithm}\n[default]\ncreditLimit = 0\n"
            ))
            .unwrap();
            let error = check_rules(&rules).unwrap_err().to_string();
            assert!(error.contains("[route=a]"), "{error}");
            assert!(error.contains(algorithm), "{error}");
        }
    }

    #[test]
    fn the_backend_target_comes_from_divvys_environment_or_a_url() {
        let config = |edit: fn(&mut RedisConfig)| {
            let mut config = RedisConfig::default();
            edit(&mut config);
            config
        };
        let info = config(|c| {
            c.redis_host = "10.0.0.7".into();
            c.redis_port = "6380".into();
        })
        .backend_connection_info()
        .unwrap();
        assert_eq!(client::describe_target(&info), "10.0.0.7:6380");
        let info = config(|c| c.redis_url = Some("redis://:secret@db.example:6390/3".into()))
            .backend_connection_info()
            .unwrap();
        assert_eq!(info.redis.password.as_deref(), Some("secret"));
        assert_eq!(client::describe_target(&info), "db.example:6390/3");
        assert!(matches!(
            config(|c| c.redis_port = "tcp://10.0.0.7:6379".into()).backend_connection_info(),
            Err(RedisSetupError::BadPort(_))
        ));
        assert!(matches!(
            config(|c| c.redis_url = Some("http://nope".into())).backend_connection_info(),
            Err(RedisSetupError::BadUrl(_))
        ));
        assert!(matches!(
            config(|c| {
                c.backend = BackendKind::Redis;
                c.persist_redis = Some("redis://x".into());
            })
            .persist_config(),
            Err(RedisSetupError::PersistWithRedisBackend)
        ));
    }
}
