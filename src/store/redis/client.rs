//! A shared, self-healing Redis client. It owns a few multiplexed Redis
//! connections on one dedicated thread (their I/O drivers run on that
//! thread's runtime), and hands out cheap leases to them, so that requests
//! from every client connection on every serving thread are pipelined onto
//! the same few sockets. A supervisor task on the same thread connects,
//! loads the scripts, pings each connection, reconnects with exponential
//! backoff, and reports health: one log line when Redis is lost, one when it
//! is back, and the backend-health metric. Requests never wait for a
//! connection: while none is up they fail at once, and callers bound the
//! wait for an answer themselves.

use crate::metrics::Metrics;
use arc_swap::ArcSwapOption;
use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, RedisError, Value};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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
    /// Connections kept open; requests are spread over them.
    pub connections: usize,
    /// Longest a connection attempt (TCP, TLS, AUTH, SELECT) may take.
    pub connect_timeout_ms: u64,
    /// Longest a health-check `PING` may take before the connection is replaced.
    pub ping_timeout_ms: u64,
    /// Who this client is, in log lines ("redis backend", "redis persistence").
    pub role: &'static str,
    /// Scripts loaded (`SCRIPT LOAD`) on every new connection.
    pub scripts: Vec<&'static str>,
    /// Where health is reported, if anywhere.
    pub health_metrics: Option<Arc<Metrics>>,
}

/// Why the client could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ClientStartError {
    #[error("invalid redis target: {0}")]
    InvalidTarget(RedisError),
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

/// Numbers threads in the order they first use a client (see [`RedisClient::lease`]).
static NEXT_THREAD_AFFINITY: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD_AFFINITY: std::cell::OnceCell<usize> = const { std::cell::OnceCell::new() };
}

struct Shared {
    slots: Box<[ArcSwapOption<LiveConnection>]>,
    next_generation: AtomicU64,
    /// Wakes the supervisor when a connection failed.
    wake: Notify,
    /// The target without credentials, for messages.
    target: String,
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

/// A connection lent for one request.
pub struct Lease {
    slot: usize,
    generation: u64,
    pub connection: MultiplexedConnection,
}

impl RedisClient {
    /// Starts the client thread and waits (at most a few seconds) for the
    /// first connection attempt, so that the start-up log says whether Redis
    /// is reachable. An unreachable Redis is not an error: requests fail until
    /// it is reachable, and the client keeps trying.
    pub fn start(config: ClientConfig) -> Result<RedisClient, ClientStartError> {
        let connections = config.connections.max(1);
        let shared = Arc::new(Shared {
            slots: (0..connections).map(|_| ArcSwapOption::empty()).collect(),
            next_generation: AtomicU64::new(1),
            wake: Notify::new(),
            target: describe_target(&config.connection_info),
        });
        let (stop_sender, stop_receiver) = oneshot::channel();
        let (first_round_sender, first_round_receiver) = std::sync::mpsc::channel();
        let role = config.role;
        if let Some(metrics) = &config.health_metrics {
            metrics.set_backend_healthy(false);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| ClientStartError::Thread { role, source })?;
        let runtime_handle = runtime.handle().clone();
        let supervisor = Supervisor {
            shared: Arc::clone(&shared),
            client: redis::Client::open(config.connection_info.clone())
                .map_err(ClientStartError::InvalidTarget)?,
            config,
            healthy: None,
            down_since: Some(Instant::now()),
            last_failure: String::from("not connected yet"),
            backoff_ms: RECONNECT_BACKOFF_MIN_MS,
            next_connect_at: Instant::now(),
            next_check_at: Instant::now() + Duration::from_millis(HEALTH_CHECK_INTERVAL_MS),
            first_round: Some(first_round_sender),
        };
        std::thread::Builder::new()
            .name(format!("tollgate-{}", role.replace(' ', "-")))
            .spawn(move || supervisor.run(runtime, stop_receiver))
            .map_err(|source| ClientStartError::Thread { role, source })?;
        let _ = first_round_receiver.recv_timeout(Duration::from_millis(FIRST_CONNECT_WAIT_MS));
        Ok(RedisClient {
            owner: Arc::new(Owner {
                shared,
                runtime: runtime_handle,
                stop: parking_lot::Mutex::new(Some(stop_sender)),
            }),
        })
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

    /// Is every connection up?
    pub fn all_connected(&self) -> bool {
        self.shared().slots.iter().all(|slot| slot.load().is_some())
    }

    /// Lends a live connection; `None` when none is up. Each thread has its
    /// own preferred connection, so the requests of one client connection
    /// (which lives on one serving thread) reach Redis in the order they
    /// were made, while the threads spread over the connections. When the
    /// preferred one is down, another takes over.
    pub fn lease(&self) -> Option<Lease> {
        let shared = self.shared();
        let count = shared.slots.len();
        let preferred = THREAD_AFFINITY.with(|affinity| {
            *affinity.get_or_init(|| NEXT_THREAD_AFFINITY.fetch_add(1, Ordering::Relaxed))
        });
        (0..count).find_map(|offset| {
            let slot = (preferred + offset) % count;
            let live = shared.slots[slot].load();
            live.as_ref().map(|live| Lease {
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

/// Owns the connections: runs on the client thread.
struct Supervisor {
    shared: Arc<Shared>,
    client: redis::Client,
    config: ClientConfig,
    /// `None` until the first round, so that the first state is logged too.
    healthy: Option<bool>,
    down_since: Option<Instant>,
    last_failure: String,
    backoff_ms: u64,
    next_connect_at: Instant,
    next_check_at: Instant,
    first_round: Option<std::sync::mpsc::Sender<()>>,
}

impl Supervisor {
    fn run(mut self, runtime: tokio::runtime::Runtime, stop: oneshot::Receiver<()>) {
        runtime.block_on(async move {
            let mut stop = stop;
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
        });
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
        if let Some(first_round) = self.first_round.take() {
            let _ = first_round.send(());
        }
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
                    tracing::debug!(role = self.config.role, %error, "SCRIPT LOAD refused");
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

    /// Healthy means every connection is up. Logs each change once.
    fn report_health(&mut self) {
        let healthy = self.shared.slots.iter().all(|slot| slot.load().is_some());
        if self.healthy == Some(healthy) {
            return;
        }
        self.healthy = Some(healthy);
        if let Some(metrics) = &self.config.health_metrics {
            metrics.set_backend_healthy(healthy);
        }
        let role = self.config.role;
        let target = &self.shared.target;
        if healthy {
            let down_ms = self
                .down_since
                .take()
                .map_or(0, |since| since.elapsed().as_millis());
            tracing::info!(role, %target, down_ms, "redis connected");
        } else {
            self.down_since = Some(Instant::now());
            tracing::warn!(
                role,
                %target,
                reason = %self.last_failure,
                "redis unavailable; reconnecting with backoff"
            );
        }
    }
}
