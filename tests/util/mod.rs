//! Helpers shared by the single-node test binaries: a real server on
//! 127.0.0.1 port 0, built in-process by [`App`] (the binary's startup, its
//! own serving threads), raw-byte conversations, and a manual clock when a
//! test must control time. [`redis`] adds a real `redis-server`, [`droplet`]
//! the WebSocket endpoint, [`envoy`] a gRPC client of Envoy's rate limit
//! service.
#![allow(dead_code)]

pub mod droplet;
pub mod droplet_node;
pub mod envoy;
pub mod redis;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;
use tollgate::app::{App, Hooks, RuleSource, RunningApp, ServeConfig};
use tollgate::clock::{Clock, ManualClock, SystemClock};
use tollgate::engine::{CommandExtension, Engine, UnavailablePolicy};
use tollgate::rules::RuleSet;
use tollgate::server::Limits;
use tollgate::store::{MemoryStore, MemoryStoreConfig};

/// How long any single socket read in a test may wait before failing.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

thread_local! {
    /// Servers this test thread starts serve on the io_uring loop.
    static IO_URING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `test` with every server it starts serving the line protocol on the
/// io_uring loop (`--io-uring`) instead of epoll.
pub fn with_io_uring(test: fn()) {
    IO_URING.with(|mode| mode.set(true));
    test();
    IO_URING.with(|mode| mode.set(false));
}

/// A server's configuration for tests: `rules`, on 127.0.0.1 port 0, two
/// serving threads, a short drain (on the io_uring loop within
/// [`with_io_uring`]).
pub fn test_config(rules: RuleSet) -> ServeConfig {
    ServeConfig {
        rules: RuleSource::Loaded(rules),
        listen: Some("127.0.0.1:0".parse().unwrap()),
        threads: Some(2),
        drain_timeout_ms: 2_000,
        io_uring: IO_URING.with(std::cell::Cell::get),
        ..ServeConfig::default()
    }
}

/// Runs each named test (a `fn()` of the calling module) twice: as
/// `epoll::<name>`, and as `io_uring::<name>` with its servers on the
/// io_uring loop (Linux only).
#[macro_export]
macro_rules! in_both_serving_modes {
    ($($name:ident),* $(,)?) => {
        mod epoll {
            $( #[test] fn $name() { super::$name() } )*
        }
        #[cfg(target_os = "linux")]
        mod io_uring {
            $( #[test] fn $name() { $crate::util::with_io_uring(super::$name) } )*
        }
    };
}

/// A server started by [`App`]; stopped when dropped.
pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    pub store: Arc<MemoryStore>,
    pub app: RunningApp,
}

/// What the tests of the line protocol vary.
#[derive(Clone)]
pub struct TestOptions {
    pub threads: usize,
    pub limits: Limits,
    pub store: MemoryStoreConfig,
    pub clock: Arc<dyn Clock>,
    pub policy: UnavailablePolicy,
    pub drain_timeout_ms: u64,
    /// More line commands (tests that need replies to wait, or to panic).
    pub extensions: Vec<Arc<dyn CommandExtension>>,
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
            extensions: Vec::new(),
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
        let config = ServeConfig {
            threads: Some(options.threads),
            limits: options.limits,
            store: options.store,
            unavailable_policy: options.policy,
            drain_timeout_ms: options.drain_timeout_ms,
            ..test_config(rules)
        };
        Self::start_app(
            config,
            Hooks {
                clock: Some(options.clock),
                extensions: options.extensions,
            },
        )
    }

    /// The one way every test server starts: the binary's own [`App`].
    pub fn start_app(config: ServeConfig, hooks: Hooks) -> TestServer {
        let app = App::build_with(config, hooks)
            .expect("build the test server")
            .spawn()
            .expect("serve");
        TestServer {
            addr: app.local_addr(),
            engine: Arc::clone(app.engine()),
            store: Arc::clone(app.store()),
            app,
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

    pub fn stop(self) {
        self.app.stop();
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

/// Hooks that put `clock` in charge of time.
pub fn on_clock(clock: Arc<dyn Clock>) -> Hooks {
    Hooks {
        clock: Some(clock),
        ..Hooks::default()
    }
}

/// A `tollgate serve` process of the real binary on 127.0.0.1 port 0, its
/// stderr (logs) in a file; killed when dropped.
pub struct ServedBinary {
    pub child: std::process::Child,
    pub addr: SocketAddr,
    pub log: std::path::PathBuf,
}

impl ServedBinary {
    /// Starts `tollgate serve --threads 1 --listen 127.0.0.1:0 ARGS`, logging
    /// to `DIR/serve.log`, and waits for its listening line.
    pub fn start(dir: &std::path::Path, args: &[&std::ffi::OsStr]) -> ServedBinary {
        use std::io::BufRead;
        let log = dir.join("serve.log");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["serve", "--threads", "1", "--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .split("listening on ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .parse()
            .unwrap();
        ServedBinary { child, addr, log }
    }

    /// Waits (at most 10 s) until the log holds `needle` `count` times;
    /// returns the log.
    pub fn wait_for_log(&self, count: usize, needle: &str) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap();
            if log.matches(needle).count() >= count {
                return log;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{count} x {needle:?} not logged: {log}"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for ServedBinary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `tollgate reload ARGS`.
pub fn reload_command(args: &[&std::ffi::OsStr]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("reload")
        .args(args)
        .output()
        .unwrap()
}
