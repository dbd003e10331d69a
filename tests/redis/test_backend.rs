//! The redis backend against a real redis-server: the same transcripts give
//! the same answers as the memory backend, counters use divvy's exact keys
//! and TTLs, keys written by divvy are continued (and the other way round),
//! `SCRIPT FLUSH` under load reaches no client, concurrent connections on
//! one actor never admit more than the limit, and a read batch's script
//! call steps each key as divvy's script does, a failing request alone
//! failing.

use crate::util;

use redis::Commands;
use std::io::Write;
use std::time::Duration;
use tollgate::engine::UnavailablePolicy;
use tollgate::rules::RuleSet;
use tollgate::store::redis::script::BATCH_SCRIPT;
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

/// One call of the batch script: per request, its keys and whether it
/// peeks (every counter: 3 per 3600 s); answers flattened per counter.
fn batch_call(conn: &mut redis::Connection, requests: &[(&[String], bool)]) -> Vec<redis::Value> {
    let script = redis::Script::new(BATCH_SCRIPT);
    let mut invocation = script.prepare_invoke();
    invocation.arg(1).arg(3600).arg(2);
    for (keys, peek) in requests {
        let count = keys.len() as i64;
        invocation.arg(if *peek { -count } else { count });
        for key in keys.iter() {
            invocation.key(key.as_str()).arg(1);
        }
    }
    invocation.invoke(conn).unwrap()
}

fn int(value: &redis::Value) -> i64 {
    match value {
        redis::Value::Int(number) => *number,
        other => panic!("{other:?} is not a number"),
    }
}

/// Random batches of hits on a few keys, some with windows divvy left, give
/// every counter the answer divvy's own script gives it hit by hit, and
/// leave the same credit and TTL behind.
#[test]
fn the_batch_script_steps_each_key_as_divvys_script_does() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mut conn = redis.connection();
    let divvy = redis::Script::new(DIVVY_STEP);
    // Keys under two prefixes, one per way of counting, set up alike.
    let key = |way: &str, i: u64| format!("divvy:way={way}:k{i}:3:3600");
    for way in ["batch", "divvy"] {
        let _: () = conn.set_ex(key(way, 0), 0, 600).unwrap();
        let _: () = conn.set_ex(key(way, 1), 2, 600).unwrap();
    }
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |bound: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % bound
    };
    for _ in 0..40 {
        // A batch: 1 to 20 requests of 1 or 2 counters on 6 keys.
        let requests: Vec<Vec<u64>> = (0..1 + next(20))
            .map(|_| (0..1 + next(2)).map(|_| next(6)).collect())
            .collect();
        let batch_keys: Vec<Vec<String>> = requests
            .iter()
            .map(|keys| keys.iter().map(|&i| key("batch", i)).collect())
            .collect();
        let shaped: Vec<(&[String], bool)> =
            batch_keys.iter().map(|keys| (&keys[..], false)).collect();
        let answers = batch_call(&mut conn, &shaped);
        let expected: Vec<Vec<i64>> = requests
            .iter()
            .flatten()
            .map(|&i| {
                divvy
                    .key(key("divvy", i))
                    .arg(3600)
                    .arg(2)
                    .invoke(&mut conn)
                    .unwrap()
            })
            .collect();
        assert_eq!(answers.len(), expected.len() * 2);
        for (got, want) in answers.chunks_exact(2).zip(&expected) {
            // divvy: allowed, credit, TTL; the batch: credit or -1 (denied), TTL.
            let (allowed, credit) = (int(&got[0]) >= 0, int(&got[0]).max(0));
            assert_eq!([i64::from(allowed), credit], [want[0], want[1]], "{got:?}");
            assert!((int(&got[1]) - want[2]).abs() <= 1, "{got:?} vs {want:?}");
        }
    }
    for i in 0..6 {
        let (batch, divvy): (Option<i64>, Option<i64>) = (
            conn.get(key("batch", i)).unwrap(),
            conn.get(key("divvy", i)).unwrap(),
        );
        assert_eq!(batch, divvy, "credit left on key {i}");
        let (batch, divvy): (i64, i64) = (
            conn.ttl(key("batch", i)).unwrap(),
            conn.ttl(key("divvy", i)).unwrap(),
        );
        assert!(
            (batch - divvy).abs() <= 1,
            "TTL of key {i}: {batch} vs {divvy}"
        );
    }
}

/// A request whose key holds something that is not a credit fails alone:
/// the requests before and after it in the same call are decided, its
/// counters after the failing one are not applied (those before it are, as
/// when it was a call of its own), and the wrong key is left as it was.
#[test]
fn a_failing_request_fails_alone_within_a_batch() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mut conn = redis.connection();
    let keys: Vec<String> = ["a", "list", "b", "c", "text", "d"]
        .iter()
        .map(|name| format!("divvy:x:{name}:3:3600"))
        .collect();
    let _: () = conn.rpush(&keys[1], "not a credit").unwrap();
    let _: () = conn.set(&keys[4], "abc").unwrap();
    let answers = batch_call(
        &mut conn,
        &[
            (&keys[0..1], false),
            (&keys[1..3], false), // fails on its first key
            (&keys[3..5], false), // fails on its second key
            (&keys[5..6], true),
        ],
    );
    assert_eq!(answers.len(), 6 * 2, "{answers:?}");
    assert_eq!(int(&answers[0]), 2, "{answers:?}");
    assert_eq!(int(&answers[1]), 3600, "{answers:?}");
    let message = |counter: usize| {
        assert_eq!(int(&answers[counter * 2]), -2, "{answers:?}");
        match &answers[counter * 2 + 1] {
            redis::Value::BulkString(text) => String::from_utf8_lossy(text).into_owned(),
            other => panic!("{other:?}"),
        }
    };
    assert!(message(1).contains("WRONGTYPE"), "{}", message(1));
    assert_eq!(message(1), message(2));
    assert!(message(3).contains("compare"), "{}", message(3));
    assert_eq!(message(3), message(4));
    // The peek after them answers a fresh window and creates nothing.
    assert_eq!([int(&answers[10]), int(&answers[11])], [2, 3600]);
    let exists = |conn: &mut redis::Connection, key: &String| -> bool { conn.exists(key).unwrap() };
    assert!(exists(&mut conn, &keys[0]));
    assert!(
        !exists(&mut conn, &keys[2]),
        "a counter after the failure was applied"
    );
    let applied: i64 = conn.get(&keys[3]).unwrap();
    assert_eq!(applied, 2, "the counter before the failure stays applied");
    let text: String = conn.get(&keys[4]).unwrap();
    assert_eq!(text, "abc");
    assert!(!exists(&mut conn, &keys[5]), "PEEK created a key");
}

/// Through the server: a pipelined read whose middle request hits a key of
/// the wrong type answers the requests before it, then that request's
/// `ERR` (naming Redis's reason), and closes, as any `ERR` does.
#[test]
fn a_wrong_key_in_a_pipelined_read_answers_err_for_its_request() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let rules =
        RuleSet::from_ini("[default]\ncreditLimit = 5\nresetSeconds = 60\nactorField = user\n")
            .unwrap();
    let server = start_on_redis(rules, &redis.url(), TIMEOUT_MS, UnavailablePolicy::Error);
    let mut conn = redis.connection();
    let _: () = conn.rpush("divvy::bad:5:60", "x").unwrap();
    let answers = converse(
        server.addr,
        b"HIT user=a\nHIT user=b\nHIT user=bad\nHIT user=c\n",
    );
    let lines: Vec<&str> = answers.lines().collect();
    assert_eq!(lines.len(), 3, "{answers}");
    assert!(lines[0].starts_with("OK true 4 "), "{answers}");
    assert!(lines[1].starts_with("OK true 4 "), "{answers}");
    assert!(
        lines[2].starts_with("ERR unknown \"backend unavailable: redis: WRONGTYPE"),
        "{answers}"
    );
    assert!(server.engine.metrics.backend_errors() >= 1);
    // The next connection is served as usual.
    assert_eq!(request(&mut server.connect(), "HIT user=a"), "OK true 3 60");
}
