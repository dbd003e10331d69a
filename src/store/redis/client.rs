//! A self-healing Redis client. A client owns a few multiplexed Redis
//! connections and a supervisor task that connects, loads the scripts, pings
//! each connection, reconnects with exponential backoff, and reports health
//! to a [`HealthBoard`] shared by every client of one backend: one log line
//! when Redis is lost, one when it is back, and the backend-health metric.
//! A client runs either on a thread of its own ([`RedisClient::start`]) or on
//! the runtime of the thread that uses it ([`RedisClient::start_here`]): a
//! serving thread that owns its connection pipelines its requests onto it
//! with no cross-thread wakeup. Requests never wait for a reconnection: while
//! no connection is up they fail at once, and callers bound the wait for an
//! answer themselves.

use crate::metrics::Metrics;
use arc_swap::ArcSwapOption;
use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, RedisError, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Notify};

/// First wait before reconnecting after a failed attempt; doubles per failure.
const RECONNECT_BACKOFF_MIN_MS: u64 = 50;
/// Longest wait between reconnection attempts.
const RECONNECT_BACKOFF_MAX_MS: u64 = 1_000;
/// How often each live connection is pinged.
const HEALTH_CHECK_INTERVAL_MS: u64 = 1_000;
/// Longest the first connection attempt may hold up [`RedisClient::start`].
const FIRST_CONNECT_WAIT_MS: u64 = 3_000;

/// How a [`RedisClient`] connects and what it reports.
#[derive(Clone)]
pub struct ClientConfig {
    pub connection_info: ConnectionInfo,
    /// Connections kept open: the first one up serves, the others stand by.
    pub connections: usize,
    /// Longest a connection attempt (TCP, TLS, AUTH, SELECT) may take.
    pub connect_timeout_ms: u64,
    /// Longest a health-check `PING` may take before the connection is replaced.
    pub ping_timeout_ms: u64,
    /// Scripts loaded (`SCRIPT LOAD`) on every new connection.
    pub scripts: Vec<&'static str>,
    /// Where health is reported (and who this client is, in log lines).
    pub health: Arc<HealthBoard>,
}

/// The health of every client of one backend (or of persistence): healthy
/// while every client has all its connections up. Logs each change once
/// and sets the backend-health metric, if given one.
pub struct HealthBoard {
    /// Who reports, in log lines ("redis backend", "redis persistence").
    role: &'static str,
    target: String,
    metrics: Option<Arc<Metrics>>,
    state: parking_lot::Mutex<BoardState>,
}

#[derive(Default)]
struct BoardState {
    /// Clients whose last report was "unhealthy".
    unhealthy_clients: usize,
    healthy: Option<bool>,
    down_since: Option<Instant>,
}

impl HealthBoard {
    pub fn new(
        role: &'static str,
        info: &ConnectionInfo,
        metrics: Option<Arc<Metrics>>,
    ) -> Arc<Self> {
        if let Some(metrics) = &metrics {
            metrics.set_backend_healthy(false);
        }
        Arc::new(HealthBoard {
            role,
            target: describe_target(info),
            metrics,
            state: parking_lot::Mutex::new(BoardState {
                down_since: Some(Instant::now()),
                ..BoardState::default()
            }),
        })
    }

    /// A client's health changed from `previous` (`None`: its first report)
    /// to `healthy`; `reason`: why it is down. A client that has not
    /// reported yet counts as neither.
    fn report(&self, previous: Option<bool>, healthy: bool, reason: &str) {
        let mut state = self.state.lock();
        let was_unhealthy = previous == Some(false);
        if healthy && was_unhealthy {
            state.unhealthy_clients = state.unhealthy_clients.saturating_sub(1);
        } else if !healthy && !was_unhealthy {
            state.unhealthy_clients += 1;
        }
        self.publish(&mut state, reason);
    }

    /// A client stopped: it no longer counts.
    fn leave(&self, last_report: Option<bool>) {
        let mut state = self.state.lock();
        if last_report == Some(false) {
            state.unhealthy_clients = state.unhealthy_clients.saturating_sub(1);
        }
    }

    fn publish(&self, state: &mut BoardState, reason: &str) {
        let healthy = state.unhealthy_clients == 0;
        if state.healthy == Some(healthy) {
            return;
        }
        state.healthy = Some(healthy);
        if let Some(metrics) = &self.metrics {
            metrics.set_backend_healthy(healthy);
        }
        let (role, target) = (self.role, &self.target);
        if healthy {
            let down_ms = state
                .down_since
                .take()
                .map_or(0, |since| since.elapsed().as_millis());
            tracing::info!(role, %target, down_ms, "redis connected");
        } else {
            state.down_since = Some(Instant::now());
            tracing::warn!(role, %target, %reason, "redis unavailable; reconnecting with backoff");
        }
    }
}

/// Why the client could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ClientStartError {
    #[error("invalid redis target: {0}")]
    InvalidTarget(RedisError),
    #[error("a client started here needs a tokio runtime on this thread")]
    NoRuntime,
    #[error("cannot start the {role} thread: {source}")]
    Thread {
        role: &'static str,
        source: std::io::Error,
    },
}

/// Why a request got no answer from Redis.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("redis at {0} is not connected")]
    NotConnected(String),
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
}

impl RequestError {
    pub fn redis(&self) -> Option<&RedisError> {
        match self {
            RequestError::Redis(error) => Some(error),
            RequestError::NotConnected(_) => None,
        }
    }
}

/// One open connection, numbered so that a failure report about an old one
/// never tears down its replacement.
struct LiveConnection {
    generation: u64,
    connection: MultiplexedConnection,
}

struct Shared {
    slots: Box<[ArcSwapOption<LiveConnection>]>,
    next_generation: AtomicU64,
    /// Wakes the supervisor when a connection failed.
    wake: Notify,
    /// The target without credentials, for messages.
    target: String,
    /// Set once the first connection attempt has finished.
    first_round_done: AtomicBool,
}

/// Stops the supervisor (and so every connection) when the last clone of the
/// client goes away.
struct Owner {
    shared: Arc<Shared>,
    runtime: tokio::runtime::Handle,
    stop: parking_lot::Mutex<Option<oneshot::Sender<()>>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.lock().take() {
            let _ = stop.send(());
        }
    }
}

/// A cheap, cloneable handle on the connections; `Send + Sync`, usable from
/// any thread or runtime.
#[derive(Clone)]
pub struct RedisClient {
    owner: Arc<Owner>,
}

/// A connection lent for one request (clones share the connection).
#[derive(Clone)]
pub struct Lease {
    slot: usize,
    generation: u64,
    pub connection: MultiplexedConnection,
}

impl Lease {
    /// Which connection this is: a new number after every reconnection.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

impl RedisClient {
    /// Starts the client on a thread of its own and waits (at most a few
    /// seconds) for the first connection attempt, so that the start-up log
    /// says whether Redis is reachable. An unreachable Redis is not an error:
    /// requests fail until it is reachable, and the client keeps trying.
    pub fn start(config: ClientConfig) -> Result<RedisClient, ClientStartError> {
        let role = config.health.role;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| ClientStartError::Thread { role, source })?;
        let (client, supervisor, stop) = Self::prepare(config, runtime.handle().clone())?;
        std::thread::Builder::new()
            .name(format!("tollgate-{}", role.replace(' ', "-")))
            .spawn(move || runtime.block_on(supervisor.run(stop)))
            .map_err(|source| ClientStartError::Thread { role, source })?;
        let deadline = Instant::now() + Duration::from_millis(FIRST_CONNECT_WAIT_MS);
        while !client.first_round_done() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(client)
    }

    /// Starts the client on the runtime of the calling thread (which must be
    /// inside one), without waiting for the first connection.
    /// The client stops with that runtime, or when its last clone is dropped.
    pub fn start_here(config: ClientConfig) -> Result<RedisClient, ClientStartError> {
        let handle =
            tokio::runtime::Handle::try_current().map_err(|_| ClientStartError::NoRuntime)?;
        let (client, supervisor, stop) = Self::prepare(config, handle.clone())?;
        handle.spawn(supervisor.run(stop));
        Ok(client)
    }

    fn prepare(
        config: ClientConfig,
        runtime: tokio::runtime::Handle,
    ) -> Result<(RedisClient, Supervisor, oneshot::Receiver<()>), ClientStartError> {
        let connections = config.connections.max(1);
        let shared = Arc::new(Shared {
            slots: (0..connections).map(|_| ArcSwapOption::empty()).collect(),
            next_generation: AtomicU64::new(1),
            wake: Notify::new(),
            target: describe_target(&config.connection_info),
            first_round_done: AtomicBool::new(false),
        });
        let (stop_sender, stop_receiver) = oneshot::channel();
        let supervisor = Supervisor {
            shared: Arc::clone(&shared),
            client: redis::Client::open(config.connection_info.clone())
                .map_err(ClientStartError::InvalidTarget)?,
            config,
            healthy: None,
            last_failure: String::from("not connected yet"),
            backoff_ms: RECONNECT_BACKOFF_MIN_MS,
            next_connect_at: Instant::now(),
            next_check_at: Instant::now() + Duration::from_millis(HEALTH_CHECK_INTERVAL_MS),
        };
        let client = RedisClient {
            owner: Arc::new(Owner {
                shared,
                runtime,
                stop: parking_lot::Mutex::new(Some(stop_sender)),
            }),
        };
        Ok((client, supervisor, stop_receiver))
    }

    /// Has the first connection attempt finished (whatever its outcome)?
    pub fn first_round_done(&self) -> bool {
        self.shared().first_round_done.load(Ordering::Acquire)
    }

    /// Runs a task on the client's thread (it ends when the client does).
    pub fn spawn<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.owner.runtime.spawn(task);
    }

    fn shared(&self) -> &Shared {
        &self.owner.shared
    }

    /// Where this client connects, without credentials.
    pub fn target(&self) -> &str {
        &self.shared().target
    }

    /// Lends a live connection (the first one up, so that a client's
    /// requests keep their order on one connection while it lives); `None`
    /// when none is up.
    pub fn lease(&self) -> Option<Lease> {
        self.shared()
            .slots
            .iter()
            .enumerate()
            .find_map(|(slot, live)| {
                live.load().as_ref().map(|live| Lease {
                    slot,
                    generation: live.generation,
                    connection: live.connection.clone(),
                })
            })
    }

    /// Sends one command on a leased connection. A failure of the connection
    /// itself takes it out of service and wakes the supervisor.
    pub async fn send(&self, lease: &mut Lease, command: &Cmd) -> Result<Value, RequestError> {
        // Server errors (NOSCRIPT, script errors) arrive as values: make them errors.
        let result = lease
            .connection
            .send_packed_command(command)
            .await
            .and_then(Value::extract_error);
        self.check(lease, result)
    }

    /// Sends commands as one pipeline on a leased connection.
    pub async fn send_pipeline(
        &self,
        lease: &mut Lease,
        pipeline: &redis::Pipeline,
    ) -> Result<Vec<Value>, RequestError> {
        let result = lease
            .connection
            .send_packed_commands(pipeline, 0, pipeline.len())
            .await;
        self.check(lease, result)
    }

    /// Leases a connection and sends one command on it.
    pub async fn request(&self, command: &Cmd) -> Result<Value, RequestError> {
        let mut lease = self.lease().ok_or_else(|| self.not_connected())?;
        self.send(&mut lease, command).await
    }

    pub fn not_connected(&self) -> RequestError {
        RequestError::NotConnected(self.shared().target.clone())
    }

    fn check<T>(&self, lease: &Lease, result: Result<T, RedisError>) -> Result<T, RequestError> {
        match result {
            Ok(value) => Ok(value),
            Err(error) => {
                if breaks_connection(&error) {
                    self.retire(lease.slot, lease.generation);
                }
                Err(RequestError::Redis(error))
            }
        }
    }

    /// Takes a failed connection out of service (unless it was already
    /// replaced) and asks the supervisor to reconnect.
    fn retire(&self, slot: usize, generation: u64) {
        let shared = self.shared();
        let current = shared.slots[slot].load();
        if current.as_ref().map(|live| live.generation) == Some(generation) {
            shared.slots[slot].compare_and_swap(&current, None);
        }
        shared.wake.notify_one();
    }
}

/// Errors after which a connection must be replaced: the socket failed or the
/// stream can no longer be trusted. Server replies (`NOSCRIPT`, script
/// errors, `LOADING`) leave the connection in service.
fn breaks_connection(error: &RedisError) -> bool {
    error.is_io_error() || error.is_unrecoverable_error()
}

/// `host:port[/db]`, `host:port (tls)` or a socket path: never credentials.
pub fn describe_target(info: &ConnectionInfo) -> String {
    let address = match &info.addr {
        ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
        ConnectionAddr::TcpTls { host, port, .. } => format!("{host}:{port} (tls)"),
        ConnectionAddr::Unix(path) => path.display().to_string(),
    };
    match info.redis.db {
        0 => address,
        db => format!("{address}/{db}"),
    }
}

/// Owns the connections: runs on the client's runtime.
struct Supervisor {
    shared: Arc<Shared>,
    client: redis::Client,
    config: ClientConfig,
    /// What this client last reported to the health board.
    healthy: Option<bool>,
    last_failure: String,
    backoff_ms: u64,
    next_connect_at: Instant,
    next_check_at: Instant,
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.config.health.leave(self.healthy);
    }
}

impl Supervisor {
    async fn run(mut self, mut stop: oneshot::Receiver<()>) {
        loop {
            tokio::select! {
                biased;
                _ = &mut stop => break,
                _ = self.step() => {}
            }
        }
        for slot in self.shared.slots.iter() {
            slot.store(None);
        }
    }

    /// One round: reconnect what is down (when the backoff allows), ping what
    /// is up (when due), report health, then sleep until the next thing is due
    /// or a request reports a failure.
    async fn step(&mut self) {
        let now = Instant::now();
        let missing: Vec<usize> = (0..self.shared.slots.len())
            .filter(|&slot| self.shared.slots[slot].load().is_none())
            .collect();
        if !missing.is_empty() && now >= self.next_connect_at {
            self.reconnect(&missing).await;
        }
        if Instant::now() >= self.next_check_at {
            self.check_connections().await;
            self.next_check_at = Instant::now() + Duration::from_millis(HEALTH_CHECK_INTERVAL_MS);
        }
        self.report_health();
        self.shared.first_round_done.store(true, Ordering::Release);
        let all_up = self.shared.slots.iter().all(|slot| slot.load().is_some());
        let wake_at = if all_up {
            self.next_check_at
        } else {
            self.next_connect_at.min(self.next_check_at)
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wake_at.into()) => {}
            _ = self.shared.wake.notified() => {}
        }
    }

    async fn reconnect(&mut self, missing: &[usize]) {
        let attempts = missing.iter().map(|_| self.connect());
        let results = join_all(attempts).await;
        let mut failed = false;
        for (&slot, result) in missing.iter().zip(results) {
            match result {
                Ok(connection) => {
                    let generation = self.shared.next_generation.fetch_add(1, Ordering::Relaxed);
                    self.shared.slots[slot].store(Some(Arc::new(LiveConnection {
                        generation,
                        connection,
                    })));
                }
                Err(reason) => {
                    failed = true;
                    self.last_failure = reason;
                }
            }
        }
        if failed {
            self.next_connect_at = Instant::now() + Duration::from_millis(self.backoff_ms);
            self.backoff_ms = (self.backoff_ms * 2).min(RECONNECT_BACKOFF_MAX_MS);
        } else {
            self.backoff_ms = RECONNECT_BACKOFF_MIN_MS;
        }
    }

    /// Opens one connection and loads the scripts on it.
    async fn connect(&self) -> Result<MultiplexedConnection, String> {
        let timeout = Duration::from_millis(self.config.connect_timeout_ms.max(1));
        let settings = AsyncConnectionConfig::new().set_connection_timeout(timeout);
        let attempt = async {
            let mut connection = self
                .client
                .get_multiplexed_async_connection_with_config(&settings)
                .await
                .map_err(|error| error.to_string())?;
            for script in &self.config.scripts {
                // A Redis that refuses SCRIPT LOAD (ACLs) can still EVAL: the
                // NOSCRIPT fallback covers it, so this is not fatal.
                if let Err(error) = redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(*script)
                    .query_async::<String>(&mut connection)
                    .await
                {
                    if breaks_connection(&error) {
                        return Err(error.to_string());
                    }
                    tracing::debug!(role = self.config.health.role, %error, "SCRIPT LOAD refused");
                }
            }
            Ok(connection)
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "connecting took more than {} ms",
                self.config.connect_timeout_ms
            )),
        }
    }

    /// Pings every live connection; one that fails or does not answer in
    /// time is replaced.
    async fn check_connections(&mut self) {
        let timeout = Duration::from_millis(self.config.ping_timeout_ms.max(1));
        let live: Vec<(usize, Arc<LiveConnection>)> = (0..self.shared.slots.len())
            .filter_map(|slot| self.shared.slots[slot].load_full().map(|live| (slot, live)))
            .collect();
        let pings = live.iter().map(|(_, live)| {
            let mut connection = live.connection.clone();
            async move {
                match tokio::time::timeout(
                    timeout,
                    redis::cmd("PING").query_async::<String>(&mut connection),
                )
                .await
                {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(error)) if !breaks_connection(&error) => Ok(()),
                    Ok(Err(error)) => Err(error.to_string()),
                    Err(_) => Err(format!(
                        "PING got no answer within {} ms",
                        timeout.as_millis()
                    )),
                }
            }
        });
        let results = join_all(pings).await;
        for ((slot, live), result) in live.into_iter().zip(results) {
            if let Err(reason) = result {
                let current = self.shared.slots[slot].load();
                if current.as_ref().map(|c| c.generation) == Some(live.generation) {
                    self.shared.slots[slot].compare_and_swap(&current, None);
                }
                self.last_failure = reason;
                self.next_connect_at = Instant::now();
            }
        }
    }

    /// Healthy means every connection is up; the board logs changes.
    fn report_health(&mut self) {
        let healthy = self.shared.slots.iter().all(|slot| slot.load().is_some());
        if self.healthy == Some(healthy) {
            return;
        }
        let previous = self.healthy.replace(healthy);
        self.config
            .health
            .report(previous, healthy, &self.last_failure);
    }
}
