//! A fault-injection TCP proxy for one directed peer link: it listens on a
//! free loopback port, forwards every connection to the target address, and
//! can be told at run time to
//! - `cut()`: close every open connection (both ways) and close new ones at
//!   once, until healed (what a crashed router or a firewall RST does);
//! - `blackhole()`: keep connections open but silently drop every byte in
//!   both directions (a partition TCP does not notice: no error, no close);
//!   new connections are accepted and blackholed too;
//! - `set_delay(ms)`: deliver each forwarded chunk this long after it was
//!   read (latency, not a bandwidth cap: chunks queue, bounded);
//! - `heal()`: forward normally again. Connections that dropped bytes while
//!   blackholed are closed on heal: their byte streams have holes, which
//!   real TCP never produces, so they must not carry framed traffic again.
//!
//! Counters (bytes and connections forwarded, bytes dropped, connections
//! refused) let a test assert that traffic really went through the proxy.
//! Each proxy runs a current-thread tokio runtime on its own thread; every
//! buffer is bounded; it stops (and closes everything) on drop.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

/// Bytes read per chunk.
const CHUNK_BYTES: usize = 16 * 1024;
/// Chunks queued per direction (delayed or waiting to be written), at most.
const QUEUED_CHUNKS_MAX: usize = 64;
/// How long connecting to the target may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Forward,
    Cut,
    Blackhole,
}

/// What the proxy did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted and connected to the target.
    pub connections: u64,
    /// Connections closed at once because the link was cut (or the target
    /// refused).
    pub refused: u64,
    /// Bytes delivered, both directions together.
    pub bytes_forwarded: u64,
    /// Bytes dropped while blackholed, both directions together.
    pub bytes_dropped: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    refused: AtomicU64,
    bytes_forwarded: AtomicU64,
    bytes_dropped: AtomicU64,
}

/// Run-time state shared with the proxy's tasks. `epoch` grows on every
/// heal after a blackhole, telling connections with holes to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Control {
    mode: Mode,
    delay_ms: u64,
    heal_epoch: u64,
}

pub struct Proxy {
    pub addr: SocketAddr,
    pub target: SocketAddr,
    control: watch::Sender<Control>,
    counters: Arc<Counters>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Starts a proxy to `target` on a free loopback port.
    pub fn start(target: SocketAddr) -> Proxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (control, control_rx) = watch::channel(Control {
            mode: Mode::Forward,
            delay_ms: 0,
            heal_epoch: 0,
        });
        let counters = Arc::new(Counters::default());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task_counters = Arc::clone(&counters);
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{}", addr.port()))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                runtime.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("proxy listener");
                    tokio::select! {
                        _ = stopped => {}
                        _ = accept_loop(listener, target, control_rx, task_counters) => {}
                    }
                });
                // Dropping the runtime cancels every connection task, which
                // closes their sockets.
            })
            .expect("proxy thread");
        Proxy {
            addr,
            target,
            control,
            counters,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn set_mode(&self, mode: Mode) {
        self.control.send_modify(|control| {
            if control.mode == Mode::Blackhole && mode != Mode::Blackhole {
                control.heal_epoch += 1;
            }
            control.mode = mode;
        });
    }

    /// Closes every connection and refuses new ones until healed.
    pub fn cut(&self) {
        self.set_mode(Mode::Cut);
    }

    /// Drops every byte both ways, connections staying open.
    pub fn blackhole(&self) {
        self.set_mode(Mode::Blackhole);
    }

    /// Forwards normally again.
    pub fn heal(&self) {
        self.set_mode(Mode::Forward);
    }

    pub fn mode(&self) -> Mode {
        self.control.borrow().mode
    }

    /// Delays each forwarded chunk by `ms` (0: none).
    pub fn set_delay(&self, ms: u64) {
        self.control.send_modify(|control| control.delay_ms = ms);
    }

    pub fn stats(&self) -> ProxyStats {
        ProxyStats {
            connections: self.counters.connections.load(Ordering::Relaxed),
            refused: self.counters.refused.load(Ordering::Relaxed),
            bytes_forwarded: self.counters.bytes_forwarded.load(Ordering::Relaxed),
            bytes_dropped: self.counters.bytes_dropped.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    control: watch::Receiver<Control>,
    counters: Arc<Counters>,
) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let now = *control.borrow();
        if now.mode == Mode::Cut {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            drop(inbound);
            continue;
        }
        let _ = inbound.set_nodelay(true);
        tokio::spawn(connection(
            inbound,
            target,
            control.clone(),
            Arc::clone(&counters),
        ));
    }
}

/// Should this connection close now? (Cut, or healed after losing bytes.)
fn must_close(control: &Control, opened_epoch: u64, lost_bytes: bool) -> bool {
    control.mode == Mode::Cut || (lost_bytes && control.heal_epoch != opened_epoch)
}

async fn connection(
    inbound: TcpStream,
    target: SocketAddr,
    mut control: watch::Receiver<Control>,
    counters: Arc<Counters>,
) {
    let at_start = *control.borrow_and_update();
    let outbound = if at_start.mode == Mode::Blackhole {
        // A blackholed connection never reaches the target.
        None
    } else {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                counters.connections.fetch_add(1, Ordering::Relaxed);
                Some(stream)
            }
            _ => {
                counters.refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    };
    let Some(outbound) = outbound else {
        // Read and drop until healed (then close: nothing was forwarded)
        // or cut.
        let (mut read, _write) = inbound.into_split();
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            tokio::select! {
                read = read.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => { counters.bytes_dropped.fetch_add(n as u64, Ordering::Relaxed); }
                },
                changed = control.changed() => {
                    if changed.is_err() || control.borrow_and_update().mode != Mode::Blackhole {
                        return;
                    }
                }
            }
        }
    };
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    let epoch = at_start.heal_epoch;
    let up = pump(
        in_read,
        out_write,
        control.clone(),
        Arc::clone(&counters),
        epoch,
    );
    let down = pump(out_read, in_write, control, counters, epoch);
    // Either direction ending (EOF, error, cut, holes) closes both.
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// Forwards one direction: a reader stamps chunks with their delivery time
/// into a bounded queue, a writer delivers them on time.
async fn pump(
    mut read: tokio::net::tcp::OwnedReadHalf,
    mut write: tokio::net::tcp::OwnedWriteHalf,
    mut control: watch::Receiver<Control>,
    counters: Arc<Counters>,
    epoch: u64,
) {
    let (queue, mut queued) = mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(QUEUED_CHUNKS_MAX);
    let writer_counters = Arc::clone(&counters);
    let writer = async move {
        while let Some((due, chunk)) = queued.recv().await {
            tokio::time::sleep_until(due).await;
            if write.write_all(&chunk).await.is_err() {
                return;
            }
            writer_counters
                .bytes_forwarded
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
    };
    let reader = async move {
        // Moved in so that it drops (ending the writer) when this returns.
        let queue = queue;
        let mut lost_bytes = false;
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            let now = *control.borrow_and_update();
            if must_close(&now, epoch, lost_bytes) {
                return false;
            }
            tokio::select! {
                read = read.read(&mut buf) => {
                    let n = match read {
                        Ok(0) | Err(_) => return true,
                        Ok(n) => n,
                    };
                    let now = *control.borrow();
                    match now.mode {
                        Mode::Cut => return false,
                        Mode::Blackhole => {
                            lost_bytes = true;
                            counters.bytes_dropped.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        Mode::Forward => {
                            let due = tokio::time::Instant::now()
                                + Duration::from_millis(now.delay_ms);
                            if queue.send((due, buf[..n].to_vec())).await.is_err() {
                                return false;
                            }
                        }
                    }
                }
                changed = control.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                }
            }
        }
    };
    // The reader ending at the end of the stream drops the queue and lets
    // the writer deliver what is queued; ending on a cut (or holes) drops
    // both at once.
    tokio::pin!(writer);
    tokio::select! {
        end_of_stream = reader => {
            if end_of_stream {
                writer.await;
            }
        }
        _ = &mut writer => {}
    }
}
