//! Thread-per-core serving: one OS thread per core, each running its own
//! single-threaded tokio runtime with its own `SO_REUSEPORT` listener, so the
//! kernel spreads connections and nothing crosses threads on the hot path.
//! Also owns the connection limit and graceful shutdown (stop accepting,
//! answer what was read, close, bounded by `drain_timeout_ms`).

// Serving code: input never panics the server (see docs/operations.md).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod connection;
pub mod socket;

use crate::engine::Engine;
use socket2::{Domain, Protocol, Socket, Type};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Bounds that protect the server from bad clients. All configurable.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest request line accepted; longer gets `ERR unknown "line too long"`.
    pub line_bytes_max: usize,
    /// Most client connections open at once; more are answered
    /// `ERR unknown "too many connections"` and closed.
    pub connections_max: usize,
    /// Most requests of one connection executing or awaiting an answer; past
    /// it the connection stops reading until answers go out.
    pub pipeline_max: usize,
    /// Close a connection that sent nothing for this long (0: never).
    pub idle_timeout_ms: u64,
    /// A line must be complete this long after its first byte arrived, or the
    /// connection gets `ERR unknown "line timeout"` (0: no limit).
    pub line_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            line_bytes_max: 64 * 1024,
            connections_max: 10_000,
            pipeline_max: 1024,
            idle_timeout_ms: 0,
            line_timeout_ms: 10_000,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Serving threads (one runtime and listener each).
    pub threads: usize,
    pub limits: Limits,
    /// How long shutdown waits for connections to finish what they read.
    pub drain_timeout_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 8321)),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            limits: Limits::default(),
            drain_timeout_ms: 5_000,
        }
    }
}

/// Binds a TCP listener with `SO_REUSEPORT`, so that every serving thread can
/// have its own on the same address.
pub fn bind_reuseport(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// `SO_REUSEPORT` would let a second server on the same port silently share
/// its traffic; a plain bind first makes "address in use" an error again.
pub fn refuse_if_in_use(addr: SocketAddr) -> std::io::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    let probe = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    probe.set_reuse_address(true)?;
    probe.bind(&addr.into()).map_err(|error| {
        std::io::Error::new(error.kind(), format!("{addr} is already in use: {error}"))
    })
}

/// A server whose listeners are bound (so its address is known, port 0
/// included) but which is not serving yet.
pub struct Server {
    listeners: Vec<std::net::TcpListener>,
    local_addr: SocketAddr,
    engine: Arc<Engine>,
    config: ServerConfig,
}

/// Stops a running server.
#[derive(Clone)]
pub struct ShutdownHandle {
    sender: Arc<watch::Sender<bool>>,
}

impl ShutdownHandle {
    pub fn shutdown(&self) {
        let _ = self.sender.send(true);
    }
}

/// A server serving on its own threads (see [`Server::spawn`]).
pub struct RunningServer {
    pub local_addr: SocketAddr,
    pub shutdown: ShutdownHandle,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl RunningServer {
    /// Waits until every serving thread has drained and stopped.
    pub fn join(self) {
        for thread in self.threads {
            let _ = thread.join();
        }
    }

    /// Shuts down and waits.
    pub fn stop(self) {
        self.shutdown.shutdown();
        self.join();
    }
}

impl Server {
    pub fn bind(config: ServerConfig, engine: Arc<Engine>) -> std::io::Result<Server> {
        let threads = config.threads.max(1);
        refuse_if_in_use(config.listen)?;
        let first = bind_reuseport(config.listen)?;
        let local_addr = first.local_addr()?;
        let mut listeners = vec![first];
        for _ in 1..threads {
            listeners.push(bind_reuseport(local_addr)?);
        }
        Ok(Server {
            listeners,
            local_addr,
            engine,
            config,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Starts one serving thread per listener and returns at once.
    pub fn spawn(self) -> std::io::Result<RunningServer> {
        let (sender, receiver) = watch::channel(false);
        let open_connections = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        for (index, listener) in self.listeners.into_iter().enumerate() {
            let worker = Worker {
                listener,
                engine: Arc::clone(&self.engine),
                config: self.config.clone(),
                shutdown: receiver.clone(),
                open_connections: Arc::clone(&open_connections),
            };
            threads.push(
                std::thread::Builder::new()
                    .name(format!("tollgate-io-{index}"))
                    .spawn(move || worker.run())?,
            );
        }
        Ok(RunningServer {
            local_addr: self.local_addr,
            shutdown: ShutdownHandle {
                sender: Arc::new(sender),
            },
            threads,
        })
    }
}

struct Worker {
    listener: std::net::TcpListener,
    engine: Arc<Engine>,
    config: ServerConfig,
    shutdown: watch::Receiver<bool>,
    open_connections: Arc<AtomicUsize>,
}

/// Releases a connection slot when the connection ends, however it ends.
struct ConnectionSlot(Arc<AtomicUsize>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Worker {
    fn run(self) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(error) => {
                tracing::error!(%error, "cannot start a serving runtime");
                return;
            }
        };
        let local = tokio::task::LocalSet::new();
        local.block_on(&runtime, self.serve());
    }

    async fn serve(self) {
        let listener = match tokio::net::TcpListener::from_std(self.listener) {
            Ok(listener) => listener,
            Err(error) => {
                tracing::error!(%error, "cannot register the listener");
                return;
            }
        };
        let mut shutdown = self.shutdown.clone();
        let mut connections = JoinSet::new();
        let limits = self.config.limits;
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, _peer)) = accepted else { continue };
                    let open = self.open_connections.fetch_add(1, Ordering::AcqRel) + 1;
                    let slot = ConnectionSlot(Arc::clone(&self.open_connections));
                    if open > limits.connections_max {
                        self.engine.metrics.connection_refused();
                        connections.spawn_local(async move {
                            let _slot = slot;
                            if let Ok(socket) = socket::ClientSocket::new(stream) {
                                let _ = socket.write_all(b"ERR unknown \"too many connections\"\n").await;
                                socket.linger_close().await;
                            }
                        });
                        continue;
                    }
                    let engine = Arc::clone(&self.engine);
                    let shutdown = self.shutdown.clone();
                    connections.spawn_local(async move {
                        let _slot = slot;
                        connection::serve(stream, engine, limits, shutdown).await;
                    });
                }
                Some(finished) = connections.join_next(), if !connections.is_empty() => {
                    if let Err(error) = finished {
                        if error.is_panic() {
                            // The panic ended only its own connection; say so loudly.
                            tracing::error!("a connection task panicked and was closed; the server keeps serving");
                        }
                    }
                }
                _ = shutdown.changed() => break,
            }
        }
        drop(listener);
        let drain = async { while connections.join_next().await.is_some() {} };
        if tokio::time::timeout(Duration::from_millis(self.config.drain_timeout_ms), drain)
            .await
            .is_err()
        {
            tracing::warn!(
                remaining = connections.len(),
                drain_timeout_ms = self.config.drain_timeout_ms,
                "connections still open at the end of the drain; closing them"
            );
            connections.abort_all();
        }
    }
}
