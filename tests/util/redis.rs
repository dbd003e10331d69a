//! Real Redis for the Redis tests: a `redis-server` started on a free
//! loopback port without persistence, killed on drop, and able to be killed,
//! paused (SIGSTOP) and restarted on the same port mid-test. Also a Redis
//! backed Tollgate in-process, and the `tollgate` binary as a child process.
//!
//! A test that needs Redis never passes silently without it: when
//! `redis-server` is missing, [`RedisServer::start`] fails the test, unless
//! `TOLLGATE_SKIP_REDIS=1` is set outside CI (then it returns `None` after a
//! loud notice, and the test returns early).

use super::{test_config, TestServer, IO_TIMEOUT};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tollgate::app::{Hooks, ServeConfig};
use tollgate::engine::UnavailablePolicy;
use tollgate::rules::RuleSet;
use tollgate::store::redis::{BackendKind, RedisConfig};

/// How long a started or restarted redis-server may take to answer.
const REDIS_READY_TIMEOUT: Duration = Duration::from_secs(10);

pub struct RedisServer {
    port: u16,
    child: Option<Child>,
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind a free loopback port")
        .port()
}

fn redis_server_installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

impl RedisServer {
    /// Starts a redis-server on a free port (see the module doc for what
    /// happens when it is not installed).
    pub fn start() -> Option<RedisServer> {
        if !redis_server_installed() {
            let required = std::env::var_os("CI").is_some()
                || std::env::var("TOLLGATE_REQUIRE_REDIS").as_deref() == Ok("1");
            let skip = std::env::var("TOLLGATE_SKIP_REDIS").as_deref() == Ok("1");
            eprintln!(
                "\n!!!!!!!! redis-server is not installed: this Redis test cannot run !!!!!!!!\n\
                 install it (apt-get install redis-server), or set TOLLGATE_SKIP_REDIS=1 to skip Redis tests outside CI\n"
            );
            if required || !skip {
                panic!("redis-server is required for this test and is not installed");
            }
            return None;
        }
        for _ in 0..5 {
            let mut server = RedisServer {
                port: free_port(),
                child: None,
            };
            if server.spawn_and_wait() {
                return Some(server);
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    /// Starts redis-server on `self.port`; false if it exited (port taken).
    fn spawn_and_wait(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .args(["--loglevel", "warning"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + REDIS_READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(_exited)) = child.try_wait() {
                    self.child = None;
                    return false;
                }
            }
            if self.ping() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Someone else's server on this port, or ours never came up.
        self.kill();
        false
    }

    /// Does the redis-server we spawned answer on our port? (Another test's
    /// server may hold the port if two tests picked it at once.)
    fn ping(&self) -> bool {
        let Some(pid) = self.child.as_ref().map(Child::id) else {
            return false;
        };
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut connection) = client.get_connection_with_timeout(Duration::from_millis(500))
        else {
            return false;
        };
        let Ok(info) = redis::cmd("INFO")
            .arg("server")
            .query::<String>(&mut connection)
        else {
            return false;
        };
        info.lines()
            .any(|line| line.trim() == format!("process_id:{pid}"))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A plain synchronous connection, for looking at keys.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|client| client.get_connection_with_timeout(IO_TIMEOUT))
            .expect("connect to the test redis-server")
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port (empty: it keeps no data).
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn_and_wait(),
            "redis-server could not start again on port {}",
            self.port
        );
    }

    /// SIGSTOP: Redis accepts connections but answers nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("redis-server is running");
        let status = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} failed");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.resume();
        }
        self.kill();
    }
}

/// The redis backend, as `tollgate serve --backend redis --redis-url URL`.
pub fn redis_config(url: &str, backend_timeout_ms: u64) -> RedisConfig {
    RedisConfig {
        backend: BackendKind::Redis,
        redis_url: Some(url.to_owned()),
        backend_timeout_ms,
        ..RedisConfig::default()
    }
}

/// An in-process Tollgate on the redis backend, on 127.0.0.1 port 0.
pub fn start_on_redis(
    rules: RuleSet,
    url: &str,
    backend_timeout_ms: u64,
    policy: UnavailablePolicy,
) -> TestServer {
    let config = ServeConfig {
        redis: redis_config(url, backend_timeout_ms),
        unavailable_policy: policy,
        ..test_config(rules)
    };
    TestServer::start_app(config, Hooks::default())
}

/// Waits until `condition` holds, polling; false at the deadline.
pub fn wait_for(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One request on a fresh connection; the answer line, or `None` when the
/// server closed without answering or did not answer in time.
pub fn hit_once(addr: SocketAddr, line: &str, timeout: Duration) -> Option<String> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.write_all(format!("{line}\n").as_bytes()).ok()?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).ok()?;
    answer.strip_suffix('\n').map(str::to_string)
}

/// The `tollgate` binary as a child process, killed on drop.
pub struct ServeProcess {
    child: Child,
    pub addr: SocketAddr,
}

impl ServeProcess {
    /// Runs `tollgate serve --listen 127.0.0.1:0 ARGS` and waits for its
    /// "listening on" line. Its warnings go to the test's stderr.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> ServeProcess {
        Self::start_with_stderr(args, env, Stdio::inherit())
    }

    /// Like [`ServeProcess::start`], with the process's log (stderr) sent to
    /// `stderr` (set `RUST_LOG` in `env` for more than warnings).
    pub fn start_with_stderr(args: &[&str], env: &[(&str, &str)], stderr: Stdio) -> ServeProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--threads", "2"])
            .args(args)
            .env_remove("REDIS_HOST")
            .env_remove("REDIS_PORT")
            .env_remove("PORT")
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut child = command.spawn().expect("spawn tollgate serve");
        let stdout = child.stdout.take().expect("stdout is piped");
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = sender.send(line);
            }
            for _ in lines {}
        });
        let line = match receiver.recv_timeout(Duration::from_secs(20)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!("tollgate serve printed no listening line");
            }
        };
        let addr = line
            .strip_prefix("tollgate: listening on ")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("unexpected first line: {line}"));
        ServeProcess { child, addr }
    }

    /// SIGTERM, then waits for a clean exit.
    pub fn terminate(mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for tollgate") {
                assert!(status.success(), "tollgate exited with {status}");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "tollgate did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as a crash would.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
