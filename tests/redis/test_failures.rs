//! The redis backend when Redis fails: killed mid-load, paused (answers
//! nothing), or absent at start. Every hit is answered within the backend
//! timeout (plus scheduling slack), nothing hangs, the server reconnects by
//! itself, and the unavailability policy decides what hits get meanwhile.

use crate::util;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::engine::UnavailablePolicy;
use tollgate::rules::RuleSet;
use util::redis::{free_port, hit_once, start_on_redis, wait_for, RedisServer, ServeProcess};

const BACKEND_TIMEOUT_MS: u64 = 300;
/// An answer may come this much later than the backend timeout (thread
/// scheduling on a busy machine); a hang would take far longer.
const SLACK_MS: u64 = 1_500;
/// How long recovery may take after Redis is back (reconnect backoff is at
/// most 1 s, health checks run every second).
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(8);
const HIT: &str = "HIT method=GET path=/status";

fn rules() -> RuleSet {
    RuleSet::from_ini("[default]\ncreditLimit = 1000000\nresetSeconds = 600\nactorField = user\n")
        .unwrap()
}

/// What one load client saw.
#[derive(Default)]
struct Seen {
    ok: usize,
    err: usize,
    /// Requests that got no answer line at all (the server closed, or the
    /// read timed out).
    unanswered: usize,
    slowest: Duration,
    other: Vec<String>,
}

/// Hits in a loop, one at a time, reconnecting after each `ERR` (the server
/// closes the connection after it), until `stop`.
fn load_client(addr: SocketAddr, user: usize, stop: Arc<AtomicBool>) -> Seen {
    let mut seen = Seen::default();
    let read_timeout = Duration::from_millis(BACKEND_TIMEOUT_MS + SLACK_MS + 5_000);
    let mut connection: Option<(TcpStream, BufReader<TcpStream>)> = None;
    while !stop.load(Ordering::Relaxed) {
        let (writer, reader) = match connection.as_mut() {
            Some(pair) => pair,
            None => {
                let stream = TcpStream::connect(addr).expect("connect");
                stream.set_read_timeout(Some(read_timeout)).unwrap();
                let reader = BufReader::new(stream.try_clone().unwrap());
                connection.insert((stream, reader))
            }
        };
        let started = Instant::now();
        let mut line = String::new();
        let answered = writer
            .write_all(format!("HIT user=u{user}\n").as_bytes())
            .is_ok()
            && matches!(reader.read_line(&mut line), Ok(n) if n > 0);
        seen.slowest = seen.slowest.max(started.elapsed());
        if !answered {
            seen.unanswered += 1;
            connection = None;
        } else if line.starts_with("OK true ") {
            seen.ok += 1;
        } else if line.starts_with("ERR unknown \"") {
            seen.err += 1;
            connection = None;
        } else {
            seen.other.push(line);
            connection = None;
        }
    }
    seen
}

fn run_load(
    addr: SocketAddr,
    clients: usize,
) -> (Arc<AtomicBool>, Vec<std::thread::JoinHandle<Seen>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let threads = (0..clients)
        .map(|user| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || load_client(addr, user, stop))
        })
        .collect();
    (stop, threads)
}

fn finish_load(stop: Arc<AtomicBool>, threads: Vec<std::thread::JoinHandle<Seen>>) -> Seen {
    stop.store(true, Ordering::Relaxed);
    let mut total = Seen::default();
    for thread in threads {
        let seen = thread.join().expect("load client");
        total.ok += seen.ok;
        total.err += seen.err;
        total.unanswered += seen.unanswered;
        total.slowest = total.slowest.max(seen.slowest);
        total.other.extend(seen.other);
    }
    total
}

fn assert_bounded(seen: &Seen) {
    assert!(
        seen.other.is_empty(),
        "unexpected answers: {:?}",
        seen.other
    );
    assert_eq!(seen.unanswered, 0, "requests without an answer");
    assert!(
        seen.slowest <= Duration::from_millis(BACKEND_TIMEOUT_MS + SLACK_MS),
        "slowest answer took {:?} (backend timeout {BACKEND_TIMEOUT_MS} ms)",
        seen.slowest
    );
}

fn succeeds(addr: SocketAddr) -> bool {
    hit_once(addr, HIT, Duration::from_secs(5)).is_some_and(|a| a.starts_with("OK "))
}

#[test]
fn redis_killed_mid_load_gives_bounded_errors_then_recovers_without_restart() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let server = start_on_redis(
        rules(),
        &redis.url(),
        BACKEND_TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    let metrics = Arc::clone(&server.engine.metrics);
    assert!(succeeds(server.addr));
    assert!(metrics.backend_healthy());

    let (stop, clients) = run_load(server.addr, 4);
    std::thread::sleep(Duration::from_millis(300));
    redis.kill();
    std::thread::sleep(Duration::from_millis(1_500));
    let during = finish_load(stop, clients);
    assert_bounded(&during);
    assert!(during.ok > 0, "no hit succeeded before the kill");
    assert!(during.err > 0, "no hit failed while Redis was down");
    assert!(
        wait_for(Duration::from_secs(3), || !metrics.backend_healthy()),
        "health metric still says healthy"
    );
    assert!(metrics.backend_errors() > 0);

    let (stop, clients) = run_load(server.addr, 4);
    redis.restart();
    assert!(
        wait_for(RECOVERY_TIMEOUT, || succeeds(server.addr)),
        "hits did not succeed again after Redis restarted"
    );
    std::thread::sleep(Duration::from_millis(300));
    let after = finish_load(stop, clients);
    assert_bounded(&after);
    assert!(after.ok > 0);
    assert!(wait_for(RECOVERY_TIMEOUT, || metrics.backend_healthy()));
}

#[test]
fn paused_redis_times_out_within_the_bound_then_recovers() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let server = start_on_redis(
        rules(),
        &redis.url(),
        BACKEND_TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    assert!(succeeds(server.addr));

    redis.pause();
    let (stop, clients) = run_load(server.addr, 3);
    std::thread::sleep(Duration::from_millis(2_500));
    let during = finish_load(stop, clients);
    redis.resume();
    assert_bounded(&during);
    assert!(during.err > 0, "no hit failed while Redis was paused");
    assert_eq!(during.ok, 0, "a hit succeeded while Redis answered nothing");
    assert!(
        wait_for(RECOVERY_TIMEOUT, || succeeds(server.addr)),
        "hits did not succeed again after SIGCONT"
    );
}

#[test]
fn a_hit_waiting_on_a_paused_redis_answers_the_timeout_error() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let server = start_on_redis(
        rules(),
        &redis.url(),
        BACKEND_TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    assert!(succeeds(server.addr));
    redis.pause();
    let started = Instant::now();
    let answer = hit_once(server.addr, HIT, Duration::from_secs(10));
    let took = started.elapsed();
    redis.resume();
    assert_eq!(
        answer.as_deref(),
        Some("ERR unknown \"backend timed out after 300 ms\"")
    );
    assert!(
        took >= Duration::from_millis(BACKEND_TIMEOUT_MS),
        "{took:?}"
    );
    assert!(
        took <= Duration::from_millis(BACKEND_TIMEOUT_MS + SLACK_MS),
        "{took:?}"
    );
}

#[test]
fn policies_decide_what_hits_get_while_redis_is_unreachable() {
    let dead_url = format!("redis://127.0.0.1:{}", free_port());
    let cases = [
        (UnavailablePolicy::Allow, "OK true 1000000 0"),
        (UnavailablePolicy::Deny, "OK false 0 -1"),
    ];
    for (policy, expected) in cases {
        let server = start_on_redis(rules(), &dead_url, BACKEND_TIMEOUT_MS, policy);
        let mut stream = server.connect();
        // The connection stays open: a policy answer is not an error.
        for _ in 0..3 {
            assert_eq!(
                util::request(&mut stream, "HIT user=a"),
                expected,
                "{policy:?}"
            );
        }
        assert!(server.engine.metrics.backend_errors() >= 3);
        assert!(!server.engine.metrics.backend_healthy());
    }
    let server = start_on_redis(
        rules(),
        &dead_url,
        BACKEND_TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    let port = dead_url.rsplit(':').next().unwrap();
    assert_eq!(
        server.converse(b"HIT user=a\nHIT user=a\n"),
        format!(
            "ERR unknown \"backend unavailable: redis at 127.0.0.1:{port} is not connected\"\n"
        ),
        "error policy: ERR, then the connection closes"
    );
}

#[test]
fn a_server_started_before_redis_serves_once_redis_is_up() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    redis.kill();
    let server = start_on_redis(
        rules(),
        &redis.url(),
        BACKEND_TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    let answer = hit_once(server.addr, HIT, Duration::from_secs(5));
    assert!(
        answer
            .as_deref()
            .is_some_and(|a| a.starts_with("ERR unknown \"backend unavailable")),
        "{answer:?}"
    );
    redis.restart();
    assert!(
        wait_for(RECOVERY_TIMEOUT, || succeeds(server.addr)),
        "hits did not succeed once Redis came up"
    );
}

#[test]
fn losing_and_regaining_redis_logs_one_line_each() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let log = tempfile::NamedTempFile::new().unwrap();
    let timeout = BACKEND_TIMEOUT_MS.to_string();
    let url = redis.url();
    let server = ServeProcess::start_with_stderr(
        &[
            "--backend",
            "redis",
            "--redis-url",
            &url,
            "--backend-timeout-ms",
            &timeout,
        ],
        &[("RUST_LOG", "info")],
        std::process::Stdio::from(log.reopen().unwrap()),
    );
    let read_log = || std::fs::read_to_string(log.path()).unwrap();
    let count = |text: &str, needle: &str| text.matches(needle).count();
    // Traffic on every serving thread, so that each opens its own connection.
    for _ in 0..8 {
        assert!(succeeds(server.addr));
    }
    let connected = |text: &str| count(text, "redis connected");
    assert!(
        wait_for(Duration::from_secs(5), || connected(&read_log()) == 1),
        "{}",
        read_log()
    );

    redis.kill();
    for _ in 0..8 {
        let answer = hit_once(server.addr, HIT, Duration::from_secs(5));
        assert!(answer.is_some_and(|a| a.starts_with("ERR unknown ")));
    }
    assert!(
        wait_for(Duration::from_secs(5), || count(
            &read_log(),
            "redis unavailable"
        ) == 1),
        "{}",
        read_log()
    );
    redis.restart();
    assert!(wait_for(RECOVERY_TIMEOUT, || succeeds(server.addr)));
    assert!(
        wait_for(RECOVERY_TIMEOUT, || count(&read_log(), "redis connected")
            == 2),
        "{}",
        read_log()
    );
    std::thread::sleep(Duration::from_millis(1_500));
    let text = read_log();
    assert_eq!(count(&text, "redis unavailable"), 1, "{text}");
    assert_eq!(count(&text, "redis connected"), 2, "{text}");
    server.terminate();
}
