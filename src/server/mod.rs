//! Serving the line protocol: the bounds that protect the server from bad
//! clients ([`Limits`]), one connection's state machine ([`connection`], over
//! [`socket`]), and the thread-per-core acceptor every TCP endpoint shares
//! ([`thread_per_core`]: one OS thread per core, each with its own
//! single-threaded runtime and `SO_REUSEPORT` listener, the connection limit
//! and graceful shutdown).

pub mod connection;
pub mod host;
pub mod socket;
pub mod thread_per_core;
#[cfg(target_os = "linux")]
pub mod uring;

use crate::engine::Engine;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio::sync::watch;

pub use thread_per_core::{
    AcceptorConfig, ConnectionHandler, Serving, ShutdownHandle, ThreadPerCore,
};

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

/// The line protocol's connections, for the [`ThreadPerCore`] acceptor.
pub struct LineProtocol {
    engine: Arc<Engine>,
    limits: Limits,
}

impl ConnectionHandler for LineProtocol {
    async fn serve(self: Arc<Self>, stream: TcpStream, shutdown: watch::Receiver<bool>) {
        connection::serve(stream, Arc::clone(&self.engine), self.limits, shutdown).await;
    }

    async fn refuse(self: Arc<Self>, stream: TcpStream) {
        if let Ok(socket) = socket::ClientSocket::new(stream) {
            let _ = socket
                .write_all(b"ERR unknown \"too many connections\"\n")
                .await;
            socket.linger_close().await;
        }
    }
}

/// The line protocol's endpoint, bound, not serving yet.
pub type Server = ThreadPerCore<LineProtocol>;

/// The line protocol's endpoint, serving.
pub type RunningServer = Serving;

/// The line protocol's endpoint, bound: on the epoll (tokio) path, or on
/// the experimental io_uring loop (`--io-uring`).
pub enum LineEndpoint {
    Epoll(Server),
    #[cfg(target_os = "linux")]
    Uring(uring::UringServer),
}

impl LineEndpoint {
    pub fn local_addr(&self) -> SocketAddr {
        match self {
            LineEndpoint::Epoll(server) => server.local_addr(),
            #[cfg(target_os = "linux")]
            LineEndpoint::Uring(server) => server.local_addr(),
        }
    }

    /// See [`ThreadPerCore::host_first_on`] (the io_uring loop, never used
    /// in a cluster, keeps its own threads).
    pub fn host_first_on(self, host: Arc<host::HostThread>) -> Self {
        match self {
            LineEndpoint::Epoll(server) => LineEndpoint::Epoll(server.host_first_on(host)),
            #[cfg(target_os = "linux")]
            other => other,
        }
    }

    /// Starts serving and returns at once.
    pub fn spawn(self) -> std::io::Result<Serving> {
        match self {
            LineEndpoint::Epoll(server) => server.spawn(),
            #[cfg(target_os = "linux")]
            LineEndpoint::Uring(server) => server.spawn(),
        }
    }
}

/// Binds the line protocol's listeners for the io_uring loop; refused where
/// there is no io_uring (not Linux, or the kernel refuses a ring).
pub fn bind_io_uring(config: ServerConfig, engine: Arc<Engine>) -> std::io::Result<LineEndpoint> {
    #[cfg(target_os = "linux")]
    {
        uring::bind(config, engine).map(LineEndpoint::Uring)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (config, engine);
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "--io-uring: io_uring exists only on Linux",
        ))
    }
}

/// Binds the line protocol's listeners (one per serving thread) for `engine`
/// to answer; [`ThreadPerCore::spawn`] starts serving.
pub fn bind(config: ServerConfig, engine: Arc<Engine>) -> std::io::Result<Server> {
    let metrics = Arc::clone(&engine.metrics);
    let acceptor = AcceptorConfig {
        listen: config.listen,
        threads: config.threads,
        connections_max: config.limits.connections_max,
        drain_timeout_ms: config.drain_timeout_ms,
        thread_name: "tollgate-io",
    };
    let handler = Arc::new(LineProtocol {
        engine,
        limits: config.limits,
    });
    ThreadPerCore::bind(acceptor, handler, metrics)
}
