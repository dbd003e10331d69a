//! Redis persistence of the in-memory counters (`--persist-redis`), on the
//! real binary: counters survive a graceful restart (last full pass at
//! shutdown) and a crash once an interval has passed (periodic writes);
//! changed limits start fresh counters. The ignored test measures the cost.

use crate::util;

use redis::Commands;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::clock::SystemClock;
use tollgate::limiter::{CounterState, WindowQuota};
use tollgate::rules::{CurrentRules, RuleSet};
use tollgate::store::redis::{PersistConfig, Persistence};
use tollgate::store::{memory_key, CounterOp, MemoryStore, MemoryStoreConfig};
use util::redis::{hit_once, RedisServer, ServeProcess};

fn rules_file(limit: u64) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new().suffix(".ini").tempfile().unwrap();
    std::io::Write::write_all(
        &mut file,
        format!("[default]\ncreditLimit = {limit}\nresetSeconds = 3600\nactorField = user\n")
            .as_bytes(),
    )
    .unwrap();
    file
}

fn hit(addr: SocketAddr, user: &str) -> String {
    hit_once(addr, &format!("HIT user={user}"), Duration::from_secs(10)).expect("an answer")
}

fn serve_persisting(
    config: &std::path::Path,
    redis: &RedisServer,
    interval_ms: u64,
) -> ServeProcess {
    let interval = interval_ms.to_string();
    ServeProcess::start(
        &[
            "--persist-redis",
            &redis.url(),
            "--persist-interval-ms",
            &interval,
            config.to_str().unwrap(),
        ],
        &[],
    )
}

#[test]
fn counters_survive_a_graceful_restart() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let config = rules_file(5);
    // A long interval: only the last pass at shutdown can have written.
    let server = serve_persisting(config.path(), &redis, 600_000);
    assert_eq!(hit(server.addr, "ann"), "OK true 4 3600");
    assert_eq!(hit(server.addr, "ann"), "OK true 3 3600");
    for _ in 0..3 {
        hit(server.addr, "bob");
    }
    server.terminate();

    let server = serve_persisting(config.path(), &redis, 600_000);
    let ann = hit(server.addr, "ann");
    assert!(ann.starts_with("OK true 2 "), "ann continued: {ann}");
    let reset: i64 = ann.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((3590..=3600).contains(&reset), "the window was kept: {ann}");
    assert!(hit(server.addr, "bob").starts_with("OK true 1 "));
    assert_eq!(
        hit(server.addr, "cat"),
        "OK true 4 3600",
        "a new actor starts fresh"
    );
    server.terminate();

    // Changed limits identify different counters: fresh quota, as divvy does.
    let changed = rules_file(7);
    let server = serve_persisting(changed.path(), &redis, 600_000);
    assert_eq!(hit(server.addr, "ann"), "OK true 6 3600");
    server.terminate();
}

#[test]
fn counters_survive_a_crash_once_an_interval_has_passed() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let config = rules_file(5);
    let server = serve_persisting(config.path(), &redis, 100);
    for expected in ["OK true 4 3600", "OK true 3 3600", "OK true 2 3600"] {
        assert_eq!(hit(server.addr, "ann"), expected);
    }
    // The persisted key: prefix, algorithm, limits, operation (with its
    // length), actor; the value is window end and hits used; Redis expires it
    // with the window.
    let key = "tollgate:persist:fixed-window:5:3600:0::ann";
    let mut conn = redis.connection();
    let written = util::redis::wait_for(Duration::from_secs(5), || {
        conn.get::<_, Option<String>>(key)
            .unwrap()
            .is_some_and(|value| value.ends_with(":3"))
    });
    assert!(written, "the counter was not persisted within the interval");
    let ttl_ms: i64 = conn.pttl(key).unwrap();
    assert!(ttl_ms > 3_590_000 && ttl_ms <= 3_600_000, "PTTL {ttl_ms}");
    server.kill();

    let server = serve_persisting(config.path(), &redis, 100);
    assert!(hit(server.addr, "ann").starts_with("OK true 1 "));
    assert!(hit(server.addr, "ann").starts_with("OK true 0 "));
    assert!(hit(server.addr, "ann").starts_with("OK false 0 "));
    server.kill();
}

/// Rules that never change, for persistence measured on its own.
struct FixedRules(Arc<RuleSet>);

impl CurrentRules for FixedRules {
    fn current(&self) -> Arc<RuleSet> {
        Arc::clone(&self.0)
    }
}

/// Measures persistence: the time of one tick writing N counters, and of
/// loading them at start. `TOLLGATE_PERSIST_COUNTERS` sets N (default
/// 100 000). Run with
/// `cargo test --release --test redis persistence_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check; run by hand (docs/redis.md)"]
fn persistence_cost() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let counters: usize = std::env::var("TOLLGATE_PERSIST_COUNTERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    let rules =
        RuleSet::from_ini("[default]\ncreditLimit = 100\nresetSeconds = 3600\nactorField = user\n")
            .unwrap();
    let clock = SystemClock;
    let now_ms = tollgate::clock::Clock::now_ms(&clock);
    let current_rules =
        || -> Arc<dyn CurrentRules> { Arc::new(FixedRules(Arc::new(rules.clone()))) };
    let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
    let rule = &rules.rules()[0];
    let mut key = Vec::new();
    for i in 0..counters {
        let actor = format!("user-{i}");
        memory_key(
            &mut key,
            &CounterOp {
                rule,
                actor: &actor,
                quota: WindowQuota::new(100, 3600).unwrap(),
                peek: false,
            },
        );
        let state = CounterState::Window {
            end_ms: now_ms + 3_600_000,
            used: 1 + (i as u64 % 99),
        };
        store.merge(&key, state, now_ms).unwrap();
    }
    let config = PersistConfig {
        connection_info: redis::IntoConnectionInfo::into_connection_info(redis.url().as_str())
            .unwrap(),
        interval_ms: 100,
        counters_per_tick: counters,
        key_prefix: "tollgate:persist:".into(),
        timeout_ms: 10_000,
    };
    let persistence = Persistence::start(
        config.clone(),
        Arc::clone(&store),
        current_rules(),
        Arc::new(SystemClock),
    )
    .unwrap();
    let stats = persistence.stats();
    // One tick is one full pass here (the budget is every counter). Returns
    // the time and the counters written of the pass that ends `passes`.
    let pass = |passes: u64| {
        let deadline = Instant::now() + Duration::from_secs(120);
        while stats.passes.load(Ordering::Relaxed) < passes {
            assert!(Instant::now() < deadline, "no full pass");
            std::thread::sleep(Duration::from_millis(5));
        }
        (
            stats.last_tick_micros.load(Ordering::Relaxed),
            stats.last_tick_counters.load(Ordering::Relaxed),
        )
    };
    let (all_micros, all_written) = pass(1);
    let (unchanged_micros, unchanged_written) = pass(2);
    let passes_before = stats.passes.load(Ordering::Relaxed);
    let written_before = stats.counters_written.load(Ordering::Relaxed);
    let micros_before = stats.tick_micros_total.load(Ordering::Relaxed);
    // One counter in ten takes a hit.
    for i in (0..counters).step_by(10) {
        let actor = format!("user-{i}");
        memory_key(
            &mut key,
            &CounterOp {
                rule,
                actor: &actor,
                quota: WindowQuota::new(100, 3600).unwrap(),
                peek: false,
            },
        );
        let state = CounterState::Window {
            end_ms: now_ms + 3_600_000,
            used: 100,
        };
        store.merge(&key, state, now_ms).unwrap();
    }
    // Passes running meanwhile may see some of the changes, later ones the rest.
    pass(passes_before + 3);
    let tenth_written = stats.counters_written.load(Ordering::Relaxed) - written_before;
    let tenth_micros = stats.tick_micros_total.load(Ordering::Relaxed) - micros_before;
    let ms = |micros: u64| micros as f64 / 1000.0;
    let per_counter = |micros: u64, written: u64| micros as f64 / written.max(1) as f64;
    println!(
        "persistence cost, {counters} counters: first pass wrote {all_written} in {:.1} ms ({:.2} µs per counter); \
         unchanged pass wrote {unchanged_written} in {:.1} ms; the three passes after 10% changed wrote {tenth_written} in {:.1} ms",
        ms(all_micros),
        per_counter(all_micros, all_written),
        ms(unchanged_micros),
        ms(tenth_micros)
    );
    let flush_started = Instant::now();
    let flushed = persistence.stop_and_flush();
    let flush_ms = flush_started.elapsed().as_millis();
    let used_memory: String = redis::cmd("INFO")
        .arg("memory")
        .query(&mut redis.connection())
        .unwrap();
    let used_memory = used_memory
        .lines()
        .find(|line| line.starts_with("used_memory_human:"))
        .unwrap_or("")
        .to_string();

    let fresh = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
    let started = Instant::now();
    let reloaded = Persistence::start(
        config,
        Arc::clone(&fresh),
        current_rules(),
        Arc::new(SystemClock),
    )
    .unwrap();
    let load_ms = started.elapsed().as_millis();
    assert_eq!(fresh.live_keys(), counters);
    drop(reloaded);
    println!(
        "persistence cost, {counters} counters: final flush at shutdown: {flushed:?} in {flush_ms} ms; \
         loading took {load_ms} ms; redis {used_memory}"
    );
}

#[test]
fn counters_are_written_again_after_the_persistence_redis_lost_them() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let config = rules_file(5);
    let server = serve_persisting(config.path(), &redis, 100);
    assert_eq!(hit(server.addr, "ann"), "OK true 4 3600");
    let key = "tollgate:persist:fixed-window:5:3600:0::ann";
    let persisted = |redis: &RedisServer, within: Duration| {
        util::redis::wait_for(within, || {
            redis
                .connection()
                .get::<_, Option<String>>(key)
                .unwrap()
                .is_some_and(|value| value.ends_with(":1"))
        })
    };
    assert!(persisted(&redis, Duration::from_secs(5)), "not persisted");
    // Redis restarts empty; the counter has not changed, yet it must be
    // written again once persistence has reconnected (a ping within 1 s, a
    // reconnection within 1 s more), well before the periodic full rewrite
    // (every 60 passes: 6 s here).
    redis.restart();
    assert!(
        persisted(&redis, Duration::from_secs(4)),
        "not written again after Redis lost it"
    );
    server.kill();
}
