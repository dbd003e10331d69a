//! The redis backend against a real redis-server: the same transcripts give
//! the same answers as the memory backend, counters use divvy's exact keys
//! and TTLs, keys written by divvy are continued (and the other way round),
//! `SCRIPT FLUSH` under load reaches no client, and concurrent connections on
//! one actor never admit more than the limit.

use crate::util;

use redis::Commands;
use std::io::Write;
use std::time::Duration;
use tollgate::engine::UnavailablePolicy;
use tollgate::rules::RuleSet;
use util::redis::{start_on_redis, RedisServer, ServeProcess};
use util::{connect, converse, read_line, request, TestServer};

/// The backend waits this long for Redis in these tests (Redis is healthy).
const TIMEOUT_MS: u64 = 2_000;

const CANARY_INI: &str = "\
[method=GET path=/x]
creditLimit = 2
resetSeconds = 60
matchPolicy = canary
label = x-canary

[method=GET path=/y]
creditLimit = 5
resetSeconds = 0

[default]
creditLimit = 3
resetSeconds = 60
actorField = user
";

/// Conversations sent to both backends, in order, each on its own
/// connection (the server closes after an `ERR`).
const TRANSCRIPTS: &[&str] = &[
    "HIT method=GET path=/status\nHIT method=GET path=/status\nHIT path=/status method=GET\n",
    "HIT method=GET path=/pantry/cookies/a ip=1.2.3.4\nHIT method=GET path=/pantry/cookies/b ip=1.2.3.4\nHIT method=GET path=/pantry/cookies/c ip=1.2.3.4\nHIT method=GET path=/pantry/cookies/d ip=1.2.3.4\nHIT method=GET path=/pantry/cookies/a ip=5.6.7.8\n",
    "PEEK method=GET path=/pantry/jam ip=9.9.9.9\nHIT method=GET path=/pantry/jam ip=9.9.9.9\nPEEK method=GET path=/pantry/jam ip=9.9.9.9\nHIT method=GET path=/pantry/jam ip=9.9.9.9\n",
    "HIT \"method\"=\"GET\" \"path\"=\"/pantry/cookies/x\" \"ip\"=\"ü 1\"\nHIT method=POST path=/anything\n",
    "HIT method=GET path=/status\nHIT a b\nHIT method=GET path=/status\n",
    "FOO bar\n",
];

const CANARY_TRANSCRIPTS: &[&str] = &[
    "HIT method=GET path=/x user=a\nHIT method=GET path=/x user=a\nHIT method=GET path=/x user=a\nHIT method=GET path=/x user=a\nHIT user=a\n",
    "HIT method=GET path=/y\nHIT method=GET path=/y user=b\nHIT user=b\nPEEK user=b\nPEEK user=c\n",
];

/// Lines agree: same text, except that `nextResetSeconds` may differ by one
/// second, since each backend rounds the time left on its own clock (Redis's
/// TTL, Tollgate's milliseconds), a few milliseconds apart.
fn assert_same_answers(memory: &str, redis: &str, transcript: &str) {
    let memory_lines: Vec<&str> = memory.lines().collect();
    let redis_lines: Vec<&str> = redis.lines().collect();
    assert_eq!(
        memory_lines.len(),
        redis_lines.len(),
        "{transcript:?}\nmemory:\n{memory}\nredis:\n{redis}"
    );
    for (m, r) in memory_lines.iter().zip(&redis_lines) {
        let (m_fields, r_fields): (Vec<&str>, Vec<&str>) =
            (m.split(' ').collect(), r.split(' ').collect());
        if m.starts_with("OK ") && r.starts_with("OK ") && m_fields.len() == 4 {
            assert_eq!(
                m_fields[..3],
                r_fields[..3],
                "{transcript:?}: {m} vs {r}\nmemory:\n{memory}\nredis:\n{redis}"
            );
            let m_reset: i64 = m_fields[3].parse().unwrap();
            let r_reset: i64 = r_fields[3].parse().unwrap();
            assert!((m_reset - r_reset).abs() <= 1, "{transcript:?}: {m} vs {r}");
        } else {
            assert_eq!(m, r, "{transcript:?}");
        }
    }
}

fn compare_backends(rules: RuleSet, transcripts: &[&str]) {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let memory = TestServer::start(rules.clone(), Default::default());
    let on_redis = start_on_redis(rules, &redis.url(), TIMEOUT_MS, UnavailablePolicy::Error);
    for transcript in transcripts {
        let from_memory = converse(memory.addr, transcript.as_bytes());
        let from_redis = converse(on_redis.addr, transcript.as_bytes());
        assert_same_answers(&from_memory, &from_redis, transcript);
    }
}

#[test]
fn transcripts_answer_as_on_the_memory_backend() {
    compare_backends(RuleSet::embedded_default(), TRANSCRIPTS);
}

#[test]
fn canary_always_allow_and_actor_transcripts_answer_as_on_the_memory_backend() {
    compare_backends(RuleSet::from_ini(CANARY_INI).unwrap(), CANARY_TRANSCRIPTS);
}

#[test]
fn the_readme_example_answers_exactly() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let server = start_on_redis(
        RuleSet::embedded_default(),
        &redis.url(),
        TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    let mut stream = server.connect();
    assert_eq!(
        request(&mut stream, "HIT method=GET path=/status"),
        "OK true 999 60"
    );
    let cookie = "HIT method=GET path=/pantry/cookies/choc ip=10.0.0.1";
    assert_eq!(request(&mut stream, cookie), "OK true 2 3600");
    assert_eq!(request(&mut stream, cookie), "OK true 1 3600");
    assert_eq!(request(&mut stream, cookie), "OK true 0 3600");
    assert_eq!(request(&mut stream, cookie), "OK false 0 3600");
    assert_eq!(request(&mut stream, "HIT method=DELETE"), "OK false 0 -1");
}

#[test]
fn counters_use_divvys_keys_values_and_ttls() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let server = start_on_redis(
        RuleSet::embedded_default(),
        &redis.url(),
        TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    let answers = converse(
        server.addr,
        b"HIT method=GET path=/status\n\
          HIT method=GET path=/pantry/cookies/a ip=1.2.3.4\n\
          HIT method=GET path=/pantry/cookies/b ip=1.2.3.4\n\
          HIT method=GET path=/pantry/jam ip=1.2.3.4\n\
          HIT method=DELETE\n\
          PEEK method=GET path=/pantry/cookies/a ip=4.4.4.4\n",
    );
    assert_eq!(answers.lines().count(), 6, "{answers}");
    let mut redis_conn = redis.connection();
    let mut keys: Vec<String> = redis_conn.keys("*").unwrap();
    keys.sort();
    // Operation keys sorted as JavaScript sorts them; then actor, limit, seconds.
    let expected = [
        (
            "divvy:ip=* method=GET path=/pantry/*:1.2.3.4:1:86400",
            0,
            86_400,
        ),
        (
            "divvy:ip=* method=GET path=/pantry/cookies/*:1.2.3.4:3:3600",
            1,
            3_600,
        ),
        ("divvy:method=GET path=/status::1000:60", 999, 60),
    ];
    assert_eq!(
        keys,
        expected
            .iter()
            .map(|(k, _, _)| k.to_string())
            .collect::<Vec<_>>(),
        "no key for always-deny rules or PEEK"
    );
    for (key, credit, seconds) in expected {
        let value: i64 = redis_conn.get(key).unwrap();
        assert_eq!(value, credit, "{key} holds the credit left");
        let ttl_ms: i64 = redis_conn.pttl(key).unwrap();
        assert!(
            ttl_ms <= seconds * 1000 && ttl_ms > seconds * 1000 - 5_000,
            "{key}: PTTL {ttl_ms} for a {seconds} s window"
        );
    }
}

/// divvy's own step, as divvy 1.7.1 runs it (`EVALSHA sha 1 key resetSeconds
/// creditLimit-1`), written out here to stand in for a divvy server sharing
/// the Redis.
const DIVVY_STEP: &str = "
local credit = redis.call('GET', KEYS[1])
local allowed, left
if not credit then
  redis.call('SETEX', KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
  allowed, left = 1, tonumber(ARGV[2])
elseif tonumber(credit) > 0 then
  allowed, left = 1, redis.call('DECR', KEYS[1])
else
  allowed, left = 0, 0
end
return {allowed, left, redis.call('TTL', KEYS[1])}
";

#[test]
fn divvy_and_tollgate_continue_each_others_windows() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let server = start_on_redis(
        RuleSet::embedded_default(),
        &redis.url(),
        TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    let mut redis_conn = redis.connection();
    let divvy_hit = |conn: &mut redis::Connection, key: &str, seconds: u64, limit: u64| {
        redis::Script::new(DIVVY_STEP)
            .key(key)
            .arg(seconds)
            .arg(limit - 1)
            .invoke::<Vec<i64>>(conn)
            .unwrap()
    };
    let mut stream = server.connect();

    // A window divvy opened 30 s ago with 5 credits left.
    let status = "divvy:method=GET path=/status::1000:60";
    let _: () = redis_conn.set_ex(status, 5, 30).unwrap();
    assert_eq!(
        request(&mut stream, "HIT method=GET path=/status"),
        "OK true 4 30"
    );
    let left: i64 = redis_conn.get(status).unwrap();
    assert_eq!(left, 4);
    // divvy's next hit continues Tollgate's count.
    assert_eq!(divvy_hit(&mut redis_conn, status, 60, 1000), vec![1, 3, 30]);
    assert_eq!(
        request(&mut stream, "HIT method=GET path=/status"),
        "OK true 2 30"
    );

    // A window divvy exhausted: denied, nothing changes.
    let cookies = "divvy:ip=* method=GET path=/pantry/cookies/*:7.7.7.7:3:3600";
    let _: () = redis_conn.set_ex(cookies, 0, 100).unwrap();
    let cookie_hit = "HIT method=GET path=/pantry/cookies/a ip=7.7.7.7";
    assert_eq!(request(&mut stream, cookie_hit), "OK false 0 100");
    let left: i64 = redis_conn.get(cookies).unwrap();
    assert_eq!(left, 0);

    // A window Tollgate opened, continued and exhausted by divvy.
    let fresh = "divvy:ip=* method=GET path=/pantry/cookies/*:8.8.8.8:3:3600";
    let fresh_hit = "HIT method=GET path=/pantry/cookies/a ip=8.8.8.8";
    assert_eq!(request(&mut stream, fresh_hit), "OK true 2 3600");
    assert_eq!(divvy_hit(&mut redis_conn, fresh, 3600, 3), vec![1, 1, 3600]);
    assert_eq!(divvy_hit(&mut redis_conn, fresh, 3600, 3), vec![1, 0, 3600]);
    assert_eq!(request(&mut stream, fresh_hit), "OK false 0 3600");
    assert_eq!(divvy_hit(&mut redis_conn, fresh, 3600, 3), vec![0, 0, 3600]);
}

#[test]
fn peek_changes_nothing_in_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let server = start_on_redis(
        RuleSet::embedded_default(),
        &redis.url(),
        TIMEOUT_MS,
        UnavailablePolicy::Error,
    );
    let mut redis_conn = redis.connection();
    let mut stream = server.connect();
    let key = "divvy:method=GET path=/status::1000:60";
    assert_eq!(
        request(&mut stream, "PEEK method=GET path=/status"),
        "OK true 999 60"
    );
    let exists: bool = redis_conn.exists(key).unwrap();
    assert!(!exists, "PEEK created a key");
    let _: () = redis_conn.set_ex(key, 1, 40).unwrap();
    assert_eq!(
        request(&mut stream, "PEEK method=GET path=/status"),
        "OK true 0 40"
    );
    assert_eq!(
        request(&mut stream, "PEEK method=GET path=/status"),
        "OK true 0 40"
    );
    let left: i64 = redis_conn.get(key).unwrap();
    assert_eq!(left, 1, "PEEK changed the credit");
    assert_eq!(
        request(&mut stream, "HIT method=GET path=/status"),
        "OK true 0 40"
    );
    assert_eq!(
        request(&mut stream, "PEEK method=GET path=/status"),
        "OK false 0 40"
    );
}

#[test]
fn concurrent_connections_on_one_actor_admit_exactly_the_limit() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    const LIMIT: usize = 50;
    const CONNECTIONS: usize = 8;
    const HITS_PER_CONNECTION: usize = 25;
    let rules = RuleSet::from_ini(&format!(
        "[default]\ncreditLimit = {LIMIT}\nresetSeconds = 60\nactorField = user\n"
    ))
    .unwrap();
    let server = start_on_redis(rules, &redis.url(), TIMEOUT_MS, UnavailablePolicy::Error);
    let addr = server.addr;
    let threads: Vec<_> = (0..CONNECTIONS)
        .map(|_| {
            std::thread::spawn(move || {
                let mut stream = connect(addr);
                // Pipelined: every hit of this connection in one write.
                let batch = "HIT user=shared\n".repeat(HITS_PER_CONNECTION);
                stream.write_all(batch.as_bytes()).unwrap();
                (0..HITS_PER_CONNECTION)
                    .map(|_| read_line(&mut stream))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let answers: Vec<String> = threads
        .into_iter()
        .flat_map(|thread| thread.join().unwrap())
        .collect();
    assert_eq!(answers.len(), CONNECTIONS * HITS_PER_CONNECTION);
    let admitted = answers.iter().filter(|a| a.starts_with("OK true ")).count();
    let denied = answers
        .iter()
        .filter(|a| a.starts_with("OK false 0 "))
        .count();
    assert_eq!(admitted, LIMIT, "{answers:?}");
    assert_eq!(denied, answers.len() - LIMIT, "{answers:?}");
    let mut credits: Vec<i64> = answers
        .iter()
        .filter(|a| a.starts_with("OK true "))
        .map(|a| a.split(' ').nth(2).unwrap().parse().unwrap())
        .collect();
    credits.sort();
    assert_eq!(
        credits,
        (0..LIMIT as i64).collect::<Vec<_>>(),
        "each credit once"
    );
}

#[test]
fn script_flush_under_load_reaches_no_client() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let rules = RuleSet::from_ini(
        "[default]\ncreditLimit = 1000000\nresetSeconds = 60\nactorField = user\n",
    )
    .unwrap();
    let server = start_on_redis(rules, &redis.url(), TIMEOUT_MS, UnavailablePolicy::Error);
    let addr = server.addr;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flusher = {
        let stop = std::sync::Arc::clone(&stop);
        let mut conn = redis.connection();
        std::thread::spawn(move || {
            let mut flushes = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
                flushes += 1;
                std::thread::sleep(Duration::from_millis(3));
            }
            flushes
        })
    };
    let clients: Vec<_> = (0..4)
        .map(|client| {
            std::thread::spawn(move || {
                let mut stream = connect(addr);
                let mut answers = Vec::new();
                for _ in 0..300 {
                    let sent = stream.write_all(format!("HIT user=u{client}\n").as_bytes());
                    let answer = read_line(&mut stream);
                    let closed = sent.is_err() || answer.is_empty();
                    answers.push(answer);
                    if closed {
                        break;
                    }
                }
                answers
            })
        })
        .collect();
    let answers: Vec<String> = clients
        .into_iter()
        .flat_map(|client| client.join().unwrap())
        .collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let flushes = flusher.join().unwrap();
    assert!(
        flushes > 10,
        "only {flushes} SCRIPT FLUSH ran during the load"
    );
    let bad: Vec<&String> = answers
        .iter()
        .filter(|a| !a.starts_with("OK true "))
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} answers: {:?}",
        bad.len(),
        answers.len(),
        &bad[..bad.len().min(5)]
    );
    assert!(
        flushes > 10,
        "only {flushes} SCRIPT FLUSH ran during the load"
    );
    // The fallback really ran: Redis counted EVAL calls (by body) besides EVALSHA.
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.connection())
        .unwrap();
    assert!(
        stats.contains("cmdstat_eval:"),
        "no EVAL fallback ran:\n{stats}"
    );
}

#[test]
fn serve_reads_divvys_redis_environment() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let port = redis.port().to_string();
    let server = ServeProcess::start(
        &["--backend", "redis"],
        &[("REDIS_HOST", "127.0.0.1"), ("REDIS_PORT", port.as_str())],
    );
    let answer = util::redis::hit_once(
        server.addr,
        "HIT method=GET path=/status",
        Duration::from_secs(10),
    );
    assert_eq!(answer.as_deref(), Some("OK true 999 60"));
    let value: i64 = redis
        .connection()
        .get("divvy:method=GET path=/status::1000:60")
        .unwrap();
    assert_eq!(value, 999);
    server.terminate();
}
