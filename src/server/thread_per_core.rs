//! The one thread-per-core acceptor, shared by every TCP endpoint (the line
//! protocol and droplet's WebSocket endpoint): one OS thread per serving
//! thread, each running its own single-threaded tokio runtime with its own
//! `SO_REUSEPORT` listener, so the kernel spreads connections and no
//! connection ever moves between threads. It owns what every endpoint
//! needs around its connections, so that they cannot drift apart: the
//! connection limit (a refused connection is counted in [`Metrics`] and
//! answered by the endpoint), a panicked connection task (logged; only that
//! connection closes), and graceful shutdown (stop accepting, let
//! connections finish, abort what is left after `drain_timeout_ms`). What
//! a connection says is the endpoint's [`ConnectionHandler`].
//!
//! The first serving thread may instead be a job of a node thread
//! ([`ThreadPerCore::host_first_on`], [`HostThread`]): a cluster node on few
//! cores then serves its clients on the thread that runs its cluster tasks.

use super::host::{HostJob, HostThread};
use crate::metrics::Metrics;
use socket2::{Domain, Protocol, Socket, Type};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Pending connections each listener's kernel queue holds before accepting.
const LISTEN_BACKLOG: i32 = 1024;

/// What one endpoint does with its connections. Futures run on the serving
/// thread that accepted the connection, as tasks of its runtime: on a node
/// thread, in the same run queue as the cluster's tasks, so that a peer
/// link's writer, requeued behind the tasks woken with it, writes after the
/// connections that add to its frame (`cluster::cadence::behind_woken_tasks`;
/// on a `LocalSet` they ran apart from it, behind an `epoll_wait`).
pub trait ConnectionHandler: Send + Sync + 'static {
    /// Serves one accepted connection until it ends. `shutdown` turns true
    /// when the endpoint stops: finish what was read, then close.
    fn serve(
        self: Arc<Self>,
        stream: TcpStream,
        shutdown: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static;

    /// Tells a connection over the limit that it is refused, then closes it
    /// (it still holds a slot until this ends).
    fn refuse(self: Arc<Self>, stream: TcpStream) -> impl Future<Output = ()> + Send + 'static;
}

/// Where and how an endpoint accepts.
#[derive(Debug, Clone)]
pub struct AcceptorConfig {
    pub listen: SocketAddr,
    /// Serving threads (one runtime and listener each); at least one.
    pub threads: usize,
    /// Most connections of this endpoint open at once; more are refused.
    pub connections_max: usize,
    /// How long shutdown waits for connections to finish.
    pub drain_timeout_ms: u64,
    /// Serving threads are named `<thread_name>-<index>`.
    pub thread_name: &'static str,
}

/// Binds a TCP listener with `SO_REUSEPORT`, so that every serving thread can
/// have its own on the same address.
pub fn bind_reuseport(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// `SO_REUSEPORT` would let a second server on the same port silently share
/// its traffic; a plain bind first makes "address in use" an error again.
pub fn refuse_if_in_use(addr: SocketAddr) -> std::io::Result<()> {
    hold_address(addr).map(drop)
}

/// Binds `addr` without listening (refused if in use, as by
/// [`refuse_if_in_use`]) and keeps it bound until the socket is dropped:
/// nothing else is given the port meanwhile. `None` for port 0.
pub fn hold_address(addr: SocketAddr) -> std::io::Result<Option<Socket>> {
    if addr.port() == 0 {
        return Ok(None);
    }
    let probe = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    probe.set_reuse_address(true)?;
    // The caller names the address; the error says it is in use.
    probe.bind(&addr.into())?;
    Ok(Some(probe))
}

/// Binds one `SO_REUSEPORT` listener per serving thread (at least one) on
/// `listen`, refusing an address already in use; returns them and the
/// address they share (port 0 resolved).
pub fn bind_listeners(
    listen: SocketAddr,
    threads: usize,
) -> std::io::Result<(Vec<std::net::TcpListener>, SocketAddr)> {
    refuse_if_in_use(listen)?;
    let first = bind_reuseport(listen)?;
    let local_addr = first.local_addr()?;
    let mut listeners = vec![first];
    for _ in 1..threads.max(1) {
        listeners.push(bind_reuseport(local_addr)?);
    }
    Ok((listeners, local_addr))
}

/// An endpoint whose listeners are bound (so its address is known, port 0
/// included) but which does not serve yet.
pub struct ThreadPerCore<H: ConnectionHandler> {
    listeners: Vec<std::net::TcpListener>,
    local_addr: SocketAddr,
    handler: Arc<H>,
    config: AcceptorConfig,
    metrics: Arc<Metrics>,
    host: Option<Arc<HostThread>>,
}

impl<H: ConnectionHandler> ThreadPerCore<H> {
    /// Binds one listener per serving thread; refused connections will be
    /// counted in `metrics`.
    pub fn bind(
        config: AcceptorConfig,
        handler: Arc<H>,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<ThreadPerCore<H>> {
        let (listeners, local_addr) = bind_listeners(config.listen, config.threads)?;
        Ok(ThreadPerCore {
            listeners,
            local_addr,
            handler,
            config,
            metrics,
            host: None,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves the first listener on `host`'s thread (beside the tasks of
    /// its runtime) instead of a thread of its own.
    pub fn host_first_on(mut self, host: Arc<HostThread>) -> Self {
        self.host = Some(host);
        self
    }

    /// Starts one serving thread per listener and returns at once.
    pub fn spawn(self) -> std::io::Result<Serving> {
        let (sender, receiver) = watch::channel(false);
        let open_connections = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        let mut host = self.host;
        for (index, listener) in self.listeners.into_iter().enumerate() {
            let acceptor = Acceptor {
                listener,
                handler: Arc::clone(&self.handler),
                config: self.config.clone(),
                metrics: Arc::clone(&self.metrics),
                shutdown: receiver.clone(),
                open_connections: Arc::clone(&open_connections),
            };
            if let Some(host) = host.take() {
                let (done, finished) = std::sync::mpsc::sync_channel(1);
                let job: HostJob = Box::new(move || {
                    Box::pin(async move {
                        acceptor.accept_until_shutdown().await;
                        let _ = done.send(());
                    })
                });
                if host.run(job).is_err() {
                    let _ = sender.send(true);
                    threads.into_iter().for_each(ServingThread::join);
                    return Err(std::io::Error::other("the node thread has stopped"));
                }
                threads.push(ServingThread::Hosted(finished));
                continue;
            }
            let spawned = std::thread::Builder::new()
                .name(format!("{}-{index}", self.config.thread_name))
                .spawn(move || acceptor.run());
            match spawned {
                Ok(thread) => threads.push(ServingThread::Own(thread)),
                Err(error) => {
                    // Stop the threads already started before reporting.
                    let _ = sender.send(true);
                    threads.into_iter().for_each(ServingThread::join);
                    return Err(error);
                }
            }
        }
        Ok(Serving {
            local_addr: self.local_addr,
            shutdown: ShutdownHandle {
                sender: Arc::new(sender),
            },
            threads,
        })
    }
}

/// Stops a serving endpoint.
#[derive(Clone)]
pub struct ShutdownHandle {
    sender: Arc<watch::Sender<bool>>,
}

impl ShutdownHandle {
    pub fn shutdown(&self) {
        let _ = self.sender.send(true);
    }
}

/// An endpoint serving on its own threads. Dropping it shuts the endpoint
/// down without waiting; [`Serving::stop`] waits for the drain.
pub struct Serving {
    pub local_addr: SocketAddr,
    pub shutdown: ShutdownHandle,
    threads: Vec<ServingThread>,
}

/// A serving thread of its own, or a job on a node thread.
enum ServingThread {
    Own(std::thread::JoinHandle<()>),
    /// Receives (or is disconnected) when the job has drained and ended.
    Hosted(std::sync::mpsc::Receiver<()>),
}

impl ServingThread {
    fn join(self) {
        match self {
            ServingThread::Own(thread) => drop(thread.join()),
            ServingThread::Hosted(finished) => drop(finished.recv()),
        }
    }
}

impl Serving {
    /// An endpoint served by `threads` of its own, which stop once
    /// `shutdown` turns true (the io_uring loop).
    #[cfg(target_os = "linux")]
    pub(crate) fn from_threads(
        local_addr: SocketAddr,
        shutdown: watch::Sender<bool>,
        threads: Vec<std::thread::JoinHandle<()>>,
    ) -> Serving {
        Serving {
            local_addr,
            shutdown: ShutdownHandle {
                sender: Arc::new(shutdown),
            },
            threads: threads.into_iter().map(ServingThread::Own).collect(),
        }
    }

    /// Waits until every serving thread has drained and stopped.
    pub fn join(mut self) {
        for thread in std::mem::take(&mut self.threads) {
            thread.join();
        }
    }

    /// Shuts down and waits.
    pub fn stop(self) {
        self.shutdown.shutdown();
        self.join();
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.shutdown.shutdown();
    }
}

/// One serving thread: its listener and what it shares with the others.
struct Acceptor<H> {
    listener: std::net::TcpListener,
    handler: Arc<H>,
    config: AcceptorConfig,
    metrics: Arc<Metrics>,
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

impl<H: ConnectionHandler> Acceptor<H> {
    fn run(self) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(error) => {
                tracing::error!(%error, thread = self.config.thread_name, "cannot start a serving runtime");
                return;
            }
        };
        let local = tokio::task::LocalSet::new();
        local.block_on(&runtime, self.accept_until_shutdown());
    }

    async fn accept_until_shutdown(self) {
        let name = self.config.thread_name;
        let listener = match tokio::net::TcpListener::from_std(self.listener) {
            Ok(listener) => listener,
            Err(error) => {
                tracing::error!(%error, thread = name, "cannot register the listener");
                return;
            }
        };
        let mut stop = self.shutdown.clone();
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, _peer)) = accepted else { continue };
                    let open = self.open_connections.fetch_add(1, Ordering::AcqRel) + 1;
                    let slot = ConnectionSlot(Arc::clone(&self.open_connections));
                    let handler = Arc::clone(&self.handler);
                    if open > self.config.connections_max {
                        self.metrics.connection_refused();
                        connections.spawn(async move {
                            let _slot = slot;
                            handler.refuse(stream).await;
                        });
                        continue;
                    }
                    let shutdown = self.shutdown.clone();
                    connections.spawn(async move {
                        let _slot = slot;
                        handler.serve(stream, shutdown).await;
                    });
                }
                Some(finished) = connections.join_next(), if !connections.is_empty() => {
                    log_panic(name, finished);
                }
                _ = stop.changed() => break,
            }
        }
        drop(listener);
        let drain = async {
            while let Some(finished) = connections.join_next().await {
                log_panic(name, finished);
            }
        };
        let drain_timeout_ms = self.config.drain_timeout_ms;
        if tokio::time::timeout(Duration::from_millis(drain_timeout_ms), drain)
            .await
            .is_err()
        {
            tracing::warn!(
                thread = name,
                remaining = connections.len(),
                drain_timeout_ms,
                "connections still open at the end of the drain; closing them"
            );
            connections.abort_all();
        }
    }
}

/// A panic ends only its own connection; say so loudly.
fn log_panic(thread: &str, finished: Result<(), tokio::task::JoinError>) {
    if let Err(error) = finished {
        if error.is_panic() {
            tracing::error!(
                thread,
                "a connection task panicked and was closed; the server keeps serving"
            );
        }
    }
}
