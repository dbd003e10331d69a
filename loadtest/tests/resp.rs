//! The RESP protocols: `INCR` and divvy's script by `EVALSHA` against a fake Redis (including the
//! recovery from `NOSCRIPT`), and, when a `redis-server` binary is installed, against a real one.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{args, resp_server};

#[test]
fn incr_counts_against_the_limit() {
    let srv = resp_server(3, 0);
    let a = args(&format!(
        "--target {} --protocol resp-incr --actors 10 --requests 500 --connections 2 --pipeline 8 --credit-limit 3",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert_eq!((r.allowed, r.denied, r.errors), (30, 470, 0), "{r:?}");
    let keys = srv.tally.per_actor.lock().unwrap();
    assert!(
        keys.contains_key("divvy:ip=* method=GET path=/pantry/cookies/*:a7:3:3600"),
        "{keys:?}"
    );
}

#[test]
fn script_recovers_from_noscript() {
    // The first 3 EVALSHAs answer NOSCRIPT: counted as errors, the script is loaded again.
    let srv = resp_server(5, 3);
    let a = args(&format!(
        "--target {} --protocol resp-script --actors 10 --requests 600 --connections 3 --pipeline 4 --credit-limit 5 --check",
        srv.target()
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert_eq!(r.errors, 3, "{r:?}");
    assert_eq!(r.allowed + r.denied, 597);
    assert_eq!(r.allowed, 50);
    let t = &srv.tally;
    // The preflight and each connection load the script once; each NOSCRIPT at most once more.
    let loads = t.get(&t.lines) - 600;
    assert!((4..=7).contains(&loads), "{loads} SCRIPT LOADs");
    assert_eq!(r.check.as_ref().unwrap().violations, 0);
}

/// A `redis-server` on a free loopback port, killed on drop.
struct Redis(Child, u16);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> Option<Redis> {
    let port = TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let redis = Redis(child, port);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some(redis);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn real_redis_script_enforces_the_window() {
    let Some(redis) = start_redis() else {
        eprintln!("redis-server not available: skipped");
        return;
    };
    let target = format!("127.0.0.1:{}", redis.1);
    let a = args(&format!(
        "--target {} --protocol resp-script --actors 20 --requests 1000 --connections 4 --pipeline 8 --credit-limit 5 --reset-seconds 60 --check",
        target
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert_eq!((r.allowed, r.denied, r.errors), (100, 900, 0), "{r:?}");
    assert_eq!(r.check.as_ref().unwrap().violations, 0);
    // INCR on fresh keys (another prefix): the counter passes the limit after 5.
    let a = args(&format!(
        "--target {} --protocol resp-incr --actors 20 --requests 1000 --connections 4 --pipeline 8 --credit-limit 5 --actor-prefix i",
        target
    ));
    let r = tollgate_loadtest::run(&a).unwrap();
    assert_eq!((r.allowed, r.denied, r.errors), (100, 900, 0), "{r:?}");
}
