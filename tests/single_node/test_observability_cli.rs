//! The `tollgate` binary's observability wiring, driven the way divvy was
//! deployed: through environment variables. Each test starts the real binary
//! on loopback ports, talks to it over real sockets, and stops it with
//! SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PATIENCE: Duration = Duration::from_secs(10);

/// Every variable the server reads, removed so the host's cannot leak in.
const SERVER_ENV: [&str; 11] = [
    "PORT",
    "HTTP_SERVICE_PORT",
    "PROMETHEUS_METRICS_PATH",
    "STATSD_HOST",
    "STATSD_PORT",
    "STATSD_PREFIX",
    "STATSD_USE_TCP",
    "REDIS_HOST",
    "REDIS_PORT",
    "RUST_LOG",
    "DEBUG",
];

struct Running {
    child: Child,
    stdout: mpsc::Receiver<String>,
    /// The divvy listener, from the first stdout line.
    addr: SocketAddr,
}

fn tollgate(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(["serve", "--threads", "1", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for name in SERVER_ENV {
        command.env_remove(name);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    command
}

fn start(args: &[&str], env: &[(&str, &str)]) -> Running {
    let mut child = tollgate(args, env).spawn().expect("start tollgate");
    let stdout = child.stdout.take().unwrap();
    let (lines, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    let first = receiver
        .recv_timeout(PATIENCE)
        .expect("tollgate prints where it listens");
    let addr = first
        .strip_prefix("tollgate: listening on ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|addr| addr.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"));
    Running {
        child,
        stdout: receiver,
        addr,
    }
}

impl Running {
    fn next_line(&self) -> String {
        self.stdout
            .recv_timeout(PATIENCE)
            .expect("another stdout line")
    }

    fn hit(&self, line: &str) -> String {
        let mut stream = TcpStream::connect(self.addr).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        stream.write_all(format!("{line}\n").as_bytes()).unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    }

    /// SIGTERM, then everything it wrote on stderr.
    fn stop(mut self) -> String {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        let deadline = Instant::now() + PATIENCE;
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("tollgate did not stop on SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut stderr = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        stderr
    }
}

impl Drop for Running {
    /// A test that fails before [`Running::stop`] leaves no server behind.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn http_get(addr: SocketAddr, target: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        stream,
        "GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

#[test]
fn divvys_environment_turns_on_prometheus_and_statsd() {
    let sink = UdpSocket::bind("127.0.0.1:0").unwrap();
    sink.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let statsd_port = sink.local_addr().unwrap().port().to_string();
    let running = start(
        &[],
        &[
            ("HTTP_SERVICE_PORT", "127.0.0.1:0"),
            ("PROMETHEUS_METRICS_PATH", "/metrics"),
            ("STATSD_HOST", "127.0.0.1"),
            ("STATSD_PORT", &statsd_port),
            ("STATSD_PREFIX", "divvy"),
        ],
    );
    let announced = running.next_line();
    let url = announced
        .strip_prefix("tollgate: serving Prometheus metrics at http://")
        .unwrap_or_else(|| panic!("unexpected line {announced:?}"));
    let (http_addr, path) = url.split_once('/').unwrap();
    let http_addr: SocketAddr = http_addr.parse().unwrap();
    assert!(path.starts_with("metrics,"), "{path}");

    // The embedded default rules are divvy's README example.
    assert_eq!(
        running.hit("HIT method=GET path=/status"),
        "OK true 999 60\n"
    );
    let (status, body) = http_get(http_addr, "/metrics");
    assert_eq!(status, 200);
    assert!(
        body.lines()
            .any(|l| l == "divvy_hits_total{status=\"accepted\",rule_label=\"get-status\"} 1"),
        "{body}"
    );
    assert_eq!(http_get(http_addr, "/readyz"), (200, "ready\n".to_owned()));

    let mut lines = Vec::new();
    let mut buf = [0u8; 65_536];
    let deadline = Instant::now() + PATIENCE;
    while !lines
        .iter()
        .any(|l| l == "divvy.hit.accepted.get-status:1|c")
    {
        assert!(Instant::now() < deadline, "statsd got only {lines:?}");
        if let Ok(n) = sink.recv(&mut buf) {
            let datagram = String::from_utf8(buf[..n].to_vec()).unwrap();
            lines.extend(datagram.split('\n').map(str::to_owned));
        }
    }
    assert!(
        lines.iter().any(|l| l == "divvy.hit.accepted:1|c"),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("divvy.hit:") && l.ends_with("|ms")),
        "{lines:?}"
    );
    running.stop();
}

#[test]
fn one_half_of_the_http_settings_alone_warns_and_serves_nothing() {
    let running = start(&[], &[("HTTP_SERVICE_PORT", "127.0.0.1:0")]);
    assert_eq!(
        running.hit("HIT method=GET path=/status"),
        "OK true 999 60\n"
    );
    let stderr = running.stop();
    assert!(stderr.contains("only one of HTTP_SERVICE_PORT"), "{stderr}");

    let running = start(&[], &[("PROMETHEUS_METRICS_PATH", "/metrics")]);
    let stderr = running.stop();
    assert!(stderr.contains("only one of HTTP_SERVICE_PORT"), "{stderr}");
}

#[test]
fn empty_variables_count_as_unset_and_bad_ones_stop_the_start() {
    let running = start(
        &[],
        &[
            ("HTTP_SERVICE_PORT", ""),
            ("PROMETHEUS_METRICS_PATH", ""),
            ("STATSD_HOST", ""),
            ("STATSD_PORT", ""),
            ("STATSD_USE_TCP", ""),
        ],
    );
    assert_eq!(
        running.hit("HIT method=GET path=/status"),
        "OK true 999 60\n"
    );
    let stderr = running.stop();
    assert!(!stderr.contains("WARN"), "{stderr}");

    let output = tollgate(
        &[],
        &[("STATSD_HOST", "127.0.0.1"), ("STATSD_PORT", "eight")],
    )
    .output()
    .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("invalid STATSD_PORT"), "{stderr}");
}

#[test]
fn debug_divvy_logs_each_rules_comment() {
    let running = start(&[], &[("DEBUG", "divvy")]);
    assert_eq!(
        running.hit("HIT method=GET path=/status"),
        "OK true 999 60\n"
    );
    let stderr = running.stop();
    assert!(
        stderr.contains("1000 requests per minute for GET /status"),
        "{stderr}"
    );

    let quiet = start(&[], &[]);
    assert_eq!(quiet.hit("HIT method=GET path=/status"), "OK true 999 60\n");
    let stderr = quiet.stop();
    assert!(!stderr.contains("requests per minute"), "{stderr}");
}

#[test]
fn json_log_format_writes_one_json_object_per_line() {
    let running = start(&["--log-format", "json"], &[("DEBUG", "divvy")]);
    assert_eq!(
        running.hit("HIT method=GET path=/status"),
        "OK true 999 60\n"
    );
    let stderr = running.stop();
    let mut comments = 0;
    for line in stderr.lines() {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        assert!(value.get("level").is_some(), "{line}");
        if value["fields"]["comment"] == "1000 requests per minute for GET /status" {
            comments += 1;
        }
    }
    assert_eq!(comments, 1, "{stderr}");
}
