//! Limits against bad clients, each driven past its bound over a real socket:
//! the clear error, bounded memory, and well-behaved clients unaffected.

use crate::util;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use tollgate::rules::RuleSet;
use tollgate::server::Limits;
use tollgate::store::MemoryStoreConfig;
use util::{connect, request, TestOptions, TestServer};

// These run against both serving loops: epoll and io_uring (whose replies
// never wait, so the bound on replies awaiting a backend is epoll's alone).
crate::in_both_serving_modes!(
    a_line_longer_than_the_limit_gets_an_error_and_close_after_earlier_answers,
    connections_beyond_the_limit_are_refused_with_an_error,
    a_client_that_never_reads_is_backpressured_and_others_are_unaffected,
    idle_connections_are_closed_when_configured,
    a_connection_in_use_outlives_its_idle_timeout_then_closes_when_idle,
    live_key_cap_answers_an_error_for_new_actors_only,
    unavailability_policies_decide_what_hits_get_at_the_live_key_cap,
    a_line_trickling_in_slower_than_the_line_timeout_is_dropped,
    a_client_streaming_lines_whose_reads_end_mid_line_is_not_timed_out,
    a_panic_in_one_connection_closes_only_that_connection,
    memory_stays_bounded_under_partial_line_and_unread_answer_attacks,
);

const RULES: &str =
    "[op=a]\ncreditLimit=1000000\nresetSeconds=60\nactorField=u\n[default]\ncreditLimit=0\n";

fn start(limits: Limits) -> TestServer {
    TestServer::start(
        RuleSet::from_ini(RULES).unwrap(),
        TestOptions {
            limits,
            ..TestOptions::default()
        },
    )
}

fn a_line_longer_than_the_limit_gets_an_error_and_close_after_earlier_answers() {
    let server = start(Limits {
        line_bytes_max: 1024,
        ..Limits::default()
    });
    let mut stream = server.connect();
    let mut input = b"HIT op=a\n".to_vec();
    input.extend(std::iter::repeat_n(b'x', 100_000));
    // The server may close while we are still writing: that is the point.
    let _ = stream.write_all(&input);
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    assert_eq!(answer, "OK true 999999 60\nERR unknown \"line too long\"\n");

    // A complete line over the limit is refused too; one at the limit is fine.
    let long_value = "v".repeat(1024 - "HIT op=a u=".len());
    let at_limit = format!("HIT op=a u={long_value}\n");
    assert_eq!(at_limit.len() - 1, 1024);
    assert_eq!(server.converse(at_limit.as_bytes()), "OK true 999999 60\n");
    let over = format!("HIT op=a u={long_value}x\n");
    assert_eq!(
        server.converse(over.as_bytes()),
        "ERR unknown \"line too long\"\n"
    );

    // Other clients never noticed.
    let mut other = server.connect();
    assert_eq!(request(&mut other, "HIT op=a u=z"), "OK true 999999 60");
}

fn connections_beyond_the_limit_are_refused_with_an_error() {
    let server = start(Limits {
        connections_max: 4,
        ..Limits::default()
    });
    let mut open: Vec<_> = (0..4).map(|_| server.connect()).collect();
    for (i, stream) in open.iter_mut().enumerate() {
        assert_eq!(
            request(stream, &format!("HIT op=a u={i}")),
            "OK true 999999 60"
        );
    }
    let mut refused = server.connect();
    let mut answer = String::new();
    refused.read_to_string(&mut answer).unwrap();
    assert_eq!(answer, "ERR unknown \"too many connections\"\n");
    assert_eq!(server.engine.metrics.connections_refused(), 1);
    // Established connections keep working; a slot frees up when one closes.
    assert_eq!(request(&mut open[0], "HIT op=a u=0"), "OK true 999998 60");
    drop(open.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut stream = server.connect();
        stream.write_all(b"HIT op=a u=new\n").unwrap();
        let answer = util::read_line(&mut stream);
        if answer == "OK true 999999 60" {
            break;
        }
        assert_eq!(answer, "ERR unknown \"too many connections\"");
        assert!(Instant::now() < deadline, "the freed slot was never reused");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn a_client_that_never_reads_is_backpressured_and_others_are_unaffected() {
    let server = start(Limits {
        pipeline_max: 16,
        ..Limits::default()
    });
    // Write requests without reading any answer until the kernel buffers fill
    // and the server stops reading from us.
    let mut greedy = server.connect();
    greedy
        .set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let line = b"HIT op=a u=greedy\n";
    let chunk: Vec<u8> = line
        .iter()
        .copied()
        .cycle()
        .take(line.len() * 4096)
        .collect();
    let mut sent_bytes = 0usize;
    let started = Instant::now();
    loop {
        match greedy.write(&chunk) {
            Ok(n) => sent_bytes += n,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                break
            }
            Err(e) => panic!("unexpected write error {e}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the server kept reading {sent_bytes} bytes without us reading answers"
        );
    }
    let sent_requests = sent_bytes / line.len();
    // The server executed some, then stopped reading: what we wrote beyond
    // that waits in kernel buffers, not in the server's memory.
    let mut other = server.connect();
    let peek = request(&mut other, "PEEK op=a u=greedy");
    let credit: usize = peek.split(' ').nth(2).unwrap().parse().unwrap();
    let executed = 1_000_000 - 1 - credit;
    assert!(
        executed > 0 && executed < sent_requests,
        "executed {executed} of {sent_requests}"
    );
    assert_eq!(
        request(&mut other, "HIT op=a u=polite"),
        "OK true 999999 60"
    );
    // Now read the greedy client's answers: they arrive in order, and the
    // server resumes reading.
    let mut reader = std::io::BufReader::new(greedy.try_clone().unwrap());
    let mut line_buf = String::new();
    use std::io::BufRead;
    for i in 1..=1000u64 {
        line_buf.clear();
        reader.read_line(&mut line_buf).unwrap();
        assert_eq!(line_buf, format!("OK true {} 60\n", 1_000_000 - i));
    }
    assert!(sent_requests > 1000, "sent {sent_requests}");
}

fn idle_connections_are_closed_when_configured() {
    let server = start(Limits {
        idle_timeout_ms: 200,
        ..Limits::default()
    });
    let mut stream = connect(server.addr);
    assert_eq!(request(&mut stream, "HIT op=a u=1"), "OK true 999999 60");
    closes_silently_no_sooner_than(stream, Duration::from_millis(150));
}

/// Reads until the server closes `stream` (nothing more was sent) and
/// checks that it took at least `quiet_at_least`.
fn closes_silently_no_sooner_than(mut stream: TcpStream, quiet_at_least: Duration) {
    let quiet_since = Instant::now();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    let quiet = quiet_since.elapsed();
    assert!(quiet >= quiet_at_least, "closed after {quiet:?}");
}

fn a_connection_in_use_outlives_its_idle_timeout_then_closes_when_idle() {
    let server = start(Limits {
        idle_timeout_ms: 1_000,
        ..Limits::default()
    });
    let mut stream = connect(server.addr);
    // Requests a tenth of the timeout apart, for more than twice the
    // timeout: every one answered on the same connection.
    let started = Instant::now();
    let mut answered = 0u32;
    while started.elapsed() < Duration::from_millis(2_500) {
        assert_eq!(
            request(&mut stream, &format!("HIT op=a u={answered}")),
            "OK true 999999 60"
        );
        answered += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(answered >= 10, "{answered}");
    // Then silence: closed, not before the timeout.
    closes_silently_no_sooner_than(stream, Duration::from_millis(750));
}

fn live_key_cap_answers_an_error_for_new_actors_only() {
    let server = TestServer::start(
        RuleSet::from_ini(RULES).unwrap(),
        TestOptions {
            store: MemoryStoreConfig {
                stripes: 4,
                live_keys_max: 3,
            },
            ..TestOptions::default()
        },
    );
    let mut stream = server.connect();
    for i in 0..3 {
        assert_eq!(
            request(&mut stream, &format!("HIT op=a u={i}")),
            "OK true 999999 60"
        );
    }
    assert_eq!(
        request(&mut stream, "HIT op=a u=new"),
        "ERR unknown \"live key limit reached (3 counters)\""
    );
    let mut stream = server.connect();
    assert_eq!(request(&mut stream, "HIT op=a u=1"), "OK true 999998 60");
}

/// An extension whose replies wait until the test releases them, so requests
/// really are "awaiting an answer".
struct HeldReplies {
    started: std::sync::atomic::AtomicUsize,
    release: std::sync::Arc<tokio::sync::Semaphore>,
}

impl tollgate::engine::CommandExtension for HeldReplies {
    fn execute(
        &self,
        verb: tollgate::protocol::Verb,
        _pairs: &tollgate::protocol::Pairs<'_>,
        _now_ms: u64,
    ) -> Option<tollgate::engine::Outcome> {
        if verb != tollgate::protocol::Verb::Query {
            return None;
        }
        let n = self
            .started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let release = std::sync::Arc::clone(&self.release);
        Some(tollgate::engine::Outcome::Later(Box::pin(async move {
            release.acquire().await.expect("semaphore open").forget();
            tollgate::engine::Reply::Line(format!("HELD {n}"))
        })))
    }
}

#[test]
fn pipelined_requests_awaiting_answers_are_bounded_per_connection() {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    let held = Arc::new(HeldReplies {
        started: Default::default(),
        release: Arc::new(tokio::sync::Semaphore::new(0)),
    });
    let server = TestServer::start(
        RuleSet::from_ini(RULES).unwrap(),
        TestOptions {
            threads: 1,
            limits: Limits {
                pipeline_max: 8,
                ..Limits::default()
            },
            extensions: vec![held.clone()],
            ..TestOptions::default()
        },
    );
    let mut stream = server.connect();
    let requests: String = (0..100).map(|_| "QUERY bucket=x\n").collect();
    stream.write_all(requests.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        held.started.load(Ordering::SeqCst),
        8,
        "only pipeline_max requests may be in flight"
    );
    // Meanwhile other connections are served.
    let mut other = server.connect();
    assert_eq!(request(&mut other, "HIT op=a u=1"), "OK true 999999 60");
    held.release.add_permits(100);
    let mut reader = std::io::BufReader::new(stream);
    use std::io::BufRead;
    for n in 0..100 {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert_eq!(line, format!("HELD {n}\n"));
    }
    assert_eq!(held.started.load(Ordering::SeqCst), 100);
}

fn unavailability_policies_decide_what_hits_get_at_the_live_key_cap() {
    use tollgate::engine::UnavailablePolicy;
    for (policy, expected) in [
        (UnavailablePolicy::Allow, "OK true 1000000 0"),
        (UnavailablePolicy::Deny, "OK false 0 -1"),
    ] {
        let server = TestServer::start(
            RuleSet::from_ini(RULES).unwrap(),
            TestOptions {
                store: MemoryStoreConfig {
                    stripes: 1,
                    live_keys_max: 1,
                },
                policy,
                ..TestOptions::default()
            },
        );
        let mut stream = server.connect();
        assert_eq!(
            request(&mut stream, "HIT op=a u=first"),
            "OK true 999999 60"
        );
        // No error, so the connection stays open for the next request.
        assert_eq!(
            request(&mut stream, "HIT op=a u=second"),
            expected,
            "{policy:?}"
        );
        assert_eq!(
            request(&mut stream, "HIT op=a u=first"),
            "OK true 999998 60"
        );
    }
}

fn a_line_trickling_in_slower_than_the_line_timeout_is_dropped() {
    let server = start(Limits {
        line_timeout_ms: 300,
        ..Limits::default()
    });
    let mut slow = server.connect();
    slow.write_all(b"HIT op=a u=1\nHIT op=").unwrap();
    let started = Instant::now();
    // Keep trickling bytes: activity does not extend a line's deadline.
    let mut answer = String::new();
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(100));
        if slow.write_all(b"a").is_err() {
            break;
        }
    }
    let _ = slow.read_to_string(&mut answer);
    assert_eq!(answer, "OK true 999999 60\nERR unknown \"line timeout\"\n");
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
    let mut other = server.connect();
    assert_eq!(request(&mut other, "HIT op=a u=2"), "OK true 999999 60");
}

fn a_client_streaming_lines_whose_reads_end_mid_line_is_not_timed_out() {
    let server = start(Limits {
        line_timeout_ms: 1_000,
        ..Limits::default()
    });
    let mut client = server.connect();
    // Every write ends a line and starts the next: no line waits long for
    // its end, though the connection always holds an incomplete one, for
    // three times the line timeout.
    const WRITES: usize = 30;
    client.write_all(b"HIT op=").unwrap();
    let started = Instant::now();
    for _ in 0..WRITES {
        std::thread::sleep(Duration::from_millis(100));
        client.write_all(b"a u=1\nHIT op=").unwrap();
    }
    client.write_all(b"a u=1\n").unwrap();
    assert!(started.elapsed() >= Duration::from_millis(3_000));
    client.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    client.read_to_string(&mut answer).unwrap();
    // Every line answered in order (the reset seconds count down meanwhile).
    let credits: Vec<String> = answer
        .lines()
        .map(|line| {
            line.rsplit_once(' ')
                .map_or(line, |(head, _)| head)
                .to_string()
        })
        .collect();
    let expected: Vec<String> = (1..=WRITES + 1)
        .map(|n| format!("OK true {}", 1_000_000 - n))
        .collect();
    assert_eq!(credits, expected, "{answer}");
}

/// An extension that panics, standing in for any bug on the serving path.
struct PanicOnQuery;

impl tollgate::engine::CommandExtension for PanicOnQuery {
    fn execute(
        &self,
        verb: tollgate::protocol::Verb,
        _pairs: &tollgate::protocol::Pairs<'_>,
        _now_ms: u64,
    ) -> Option<tollgate::engine::Outcome> {
        assert!(
            verb != tollgate::protocol::Verb::Query,
            "deliberate panic for the test"
        );
        None
    }
}

fn a_panic_in_one_connection_closes_only_that_connection() {
    let server = TestServer::start(
        RuleSet::from_ini(RULES).unwrap(),
        TestOptions {
            threads: 1,
            extensions: vec![std::sync::Arc::new(PanicOnQuery)],
            ..TestOptions::default()
        },
    );
    let engine = std::sync::Arc::clone(&server.engine);
    let mut bystander = server.connect();
    assert_eq!(request(&mut bystander, "HIT op=a u=1"), "OK true 999999 60");
    for _ in 0..3 {
        // The panicking connection is closed; its batch gets no answer.
        assert_eq!(server.converse(b"QUERY x=1\n"), "");
    }
    // Same thread, same stripe lock: everything still works and counts (the
    // panic hook may print a slow backtrace, so the window's seconds may tick).
    let answer = request(&mut bystander, "HIT op=a u=1");
    assert!(answer.starts_with("OK true 999998 "), "{answer}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while engine.metrics.connections_open() != 1 {
        assert!(
            Instant::now() < deadline,
            "gauge stuck at {}",
            engine.metrics.connections_open()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 4096
}

fn memory_stays_bounded_under_partial_line_and_unread_answer_attacks() {
    const PARTIAL_LINE_ATTACKERS: usize = 150;
    const FLOODERS: usize = 20;
    // The process's RSS is measured: the epoll and io_uring runs of this
    // test take turns rather than attack at once.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let server = start(Limits {
        line_bytes_max: 64 * 1024,
        ..Limits::default()
    });
    let before = resident_bytes();
    let mut attackers = Vec::new();
    // Each parks almost a whole line (60 KiB of a 64 KiB limit).
    let partial = vec![b'x'; 60 * 1024];
    for _ in 0..PARTIAL_LINE_ATTACKERS {
        let mut stream = server.connect();
        stream.write_all(b"HIT op=a u=").unwrap();
        stream.write_all(&partial).unwrap();
        attackers.push(stream);
    }
    // Each sends 256 KiB of requests and never reads an answer.
    let flood: Vec<u8> = b"HIT op=a u=flood\n"
        .iter()
        .copied()
        .cycle()
        .take(256 * 1024)
        .collect();
    for _ in 0..FLOODERS {
        let mut stream = server.connect();
        stream.write_all(&flood).unwrap();
        attackers.push(stream);
    }
    // A polite client is served while the attack goes on.
    let started = Instant::now();
    let mut polite = server.connect();
    assert_eq!(
        request(&mut polite, "HIT op=a u=polite"),
        "OK true 999999 60"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    std::thread::sleep(Duration::from_millis(300));
    let grown = resident_bytes().saturating_sub(before);
    // Per connection at most one line (64 KiB), one read chunk (16 KiB) and the
    // answers to one batch: 170 connections stay far below 64 MiB.
    assert!(
        grown < 64 * 1024 * 1024,
        "RSS grew by {} MiB",
        grown / (1024 * 1024)
    );
    drop(attackers);
}
