//! Helpers shared by the integration tests: a real server on 127.0.0.1 port 0
//! (in-process, its own serving threads), raw-byte conversations, and a
//! manual clock when a test must control time.
#![allow(dead_code)]

pub mod redis;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;
use tollgate::clock::{Clock, ManualClock, SystemClock};
use tollgate::engine::{Engine, UnavailablePolicy};
use tollgate::metrics::Metrics;
use tollgate::rules::RuleSet;
use tollgate::server::{Limits, RunningServer, Server, ServerConfig};
use tollgate::store::{MemoryBackend, MemoryStore, MemoryStoreConfig};

/// How long any single socket read in a test may wait before failing.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    pub store: Arc<MemoryStore>,
    running: Option<RunningServer>,
}

#[derive(Clone)]
pub struct TestOptions {
    pub threads: usize,
    pub limits: Limits,
    pub store: MemoryStoreConfig,
    pub clock: Arc<dyn Clock>,
    pub policy: UnavailablePolicy,
    pub drain_timeout_ms: u64,
}

impl Default for TestOptions {
    fn default() -> Self {
        TestOptions {
            threads: 2,
            limits: Limits::default(),
            store: MemoryStoreConfig::default(),
            clock: Arc::new(SystemClock),
            policy: UnavailablePolicy::Error,
            drain_timeout_ms: 2_000,
        }
    }
}

impl TestServer {
    pub fn start_ini(ini: &str) -> TestServer {
        Self::start(
            RuleSet::from_ini(ini).expect("test rules are valid"),
            TestOptions::default(),
        )
    }

    pub fn start_default() -> TestServer {
        Self::start(RuleSet::embedded_default(), TestOptions::default())
    }

    pub fn start(rules: RuleSet, options: TestOptions) -> TestServer {
        let store = Arc::new(MemoryStore::new(options.store));
        let engine = Arc::new(Engine::new(
            rules,
            Arc::new(MemoryBackend {
                store: Arc::clone(&store),
            }),
            options.clock,
            Metrics::new(),
            options.policy,
        ));
        Self::start_engine(
            engine,
            store,
            options.threads,
            options.limits,
            options.drain_timeout_ms,
        )
    }

    pub fn start_engine(
        engine: Arc<Engine>,
        store: Arc<MemoryStore>,
        threads: usize,
        limits: Limits,
        drain_timeout_ms: u64,
    ) -> TestServer {
        let config = ServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            threads,
            limits,
            drain_timeout_ms,
        };
        let server = Server::bind(config, Arc::clone(&engine)).expect("bind on port 0");
        let running = server.spawn().expect("spawn serving threads");
        TestServer {
            addr: running.local_addr,
            engine,
            store,
            running: Some(running),
        }
    }

    pub fn connect(&self) -> TcpStream {
        connect(self.addr)
    }

    /// Sends `bytes`, half-closes, and returns everything the server answers
    /// until it closes.
    pub fn converse(&self, bytes: &[u8]) -> String {
        converse(self.addr, bytes)
    }

    pub fn stop(mut self) {
        if let Some(running) = self.running.take() {
            running.stop();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop();
        }
    }
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect to the test server");
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

pub fn converse(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut stream = connect(addr);
    stream.write_all(bytes).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .expect("read until the server closes");
    String::from_utf8(answer).expect("answers are UTF-8")
}

/// Sends one line and reads one answer line on an open connection.
pub fn request(stream: &mut TcpStream, line: &str) -> String {
    stream.write_all(line.as_bytes()).unwrap();
    stream.write_all(b"\n").unwrap();
    read_line(stream)
}

/// Reads one `\n`-terminated line, byte by byte (tests only).
pub fn read_line(stream: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte) {
            Ok(0) => break,
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => line.push(byte[0]),
            Err(e) => panic!(
                "reading a line: {e} (got {:?} so far)",
                String::from_utf8_lossy(&line)
            ),
        }
    }
    String::from_utf8(line).unwrap()
}

/// A manual clock starting at a fixed, realistic time.
pub fn manual_clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(1_700_000_000_000))
}
