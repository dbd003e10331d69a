//! Hot reload of a real `tollgate serve` process: SIGHUP via `tollgate
//! reload` applies a valid file without dropping connections, keeps the
//! counters of rules whose identity is unchanged, and refuses an invalid file
//! (logged) while the old rules keep serving, also under load.

use crate::util;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

struct Served {
    child: Child,
    addr: std::net::SocketAddr,
    pid_file: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(dir: &std::path::Path, rules: &std::path::Path) -> Served {
    let pid_file = dir.join("tollgate.pid");
    let log = dir.join("tollgate.log");
    let mut child = Command::new(BIN)
        .arg("serve")
        .arg(rules)
        .args(["--listen", "127.0.0.1:0", "--threads", "2", "--pid-file"])
        .arg(&pid_file)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("listening on ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    Served {
        child,
        addr,
        pid_file,
        log,
    }
}

fn reload(served: &Served) {
    let out = Command::new(BIN)
        .arg("reload")
        .arg("--pid-file")
        .arg(&served.pid_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Repeats `line` on a fresh connection until the answer is `expected`.
fn wait_for_answer(addr: std::net::SocketAddr, line: &str, expected: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut stream = util::connect(addr);
        let answer = util::request(&mut stream, line);
        if answer == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still {answer:?}, expected {expected:?}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

const RULES_A: &str = "[op=a]\ncreditLimit=3\nresetSeconds=60\n[default]\ncreditLimit=0\n";
const RULES_B: &str = "[op=a]\ncreditLimit=3\nresetSeconds=60\nlabel=renamed\n[op=b]\ncreditLimit=1\nresetSeconds=60\n[default]\ncreditLimit=0\n";

#[test]
fn valid_reload_applies_without_dropping_connections_and_keeps_counters() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.ini");
    std::fs::write(&rules, RULES_A).unwrap();
    let served = serve(dir.path(), &rules);
    let mut stream = util::connect(served.addr);
    assert_eq!(util::request(&mut stream, "HIT op=a"), "OK true 2 60");
    assert_eq!(util::request(&mut stream, "HIT op=b"), "OK false 0 -1");

    std::fs::write(&rules, RULES_B).unwrap();
    reload(&served);
    wait_for_answer(served.addr, "PEEK op=b", "OK true 0 60");
    // Same connection, same counter for the unchanged rule.
    assert_eq!(util::request(&mut stream, "HIT op=a"), "OK true 1 60");
    assert_eq!(util::request(&mut stream, "HIT op=b"), "OK true 0 60");

    // An invalid file is refused; the current rules keep serving.
    std::fs::write(
        &rules,
        "[op=a]\ncreditLimit=-1\nresetSeconds=60\n[default]\ncreditLimit=0\n",
    )
    .unwrap();
    reload(&served);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&served.log)
        .unwrap()
        .contains("reload refused")
    {
        assert!(Instant::now() < deadline, "no refusal logged");
        std::thread::sleep(Duration::from_millis(25));
    }
    let log = std::fs::read_to_string(&served.log).unwrap();
    assert!(log.contains("creditLimit must be a number >= 0"), "{log}");
    assert_eq!(util::request(&mut stream, "HIT op=a"), "OK true 0 60");
    assert_eq!(util::request(&mut stream, "HIT op=b"), "OK false 0 60");
}

#[test]
fn identity_preserving_reloads_under_load_admit_exactly_the_limit() {
    const LIMIT: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.ini");
    let version = |n: usize| {
        format!("[op=load]\ncreditLimit={LIMIT}\nresetSeconds=3600\nactorField=u\nlabel=v{n}\n[default]\ncreditLimit=0\n")
    };
    std::fs::write(&rules, version(0)).unwrap();
    let served = serve(dir.path(), &rules);
    let addr = served.addr;
    let workers: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let mut stream = util::connect(addr);
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut allowed = 0;
                for _ in 0..40 {
                    let batch: String = (0..5).map(|_| "HIT op=load u=x\n").collect();
                    stream.write_all(batch.as_bytes()).unwrap();
                    for _ in 0..5 {
                        let mut line = String::new();
                        reader.read_line(&mut line).unwrap();
                        assert!(
                            line.starts_with("OK "),
                            "connection failed during reload: {line:?}"
                        );
                        allowed += usize::from(line.starts_with("OK true"));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                allowed
            })
        })
        .collect();
    for n in 1..=5 {
        std::fs::write(&rules, version(n)).unwrap();
        reload(&served);
        std::thread::sleep(Duration::from_millis(30));
    }
    let admitted: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    // 4 × 200 hits against a limit of 300 kept in one counter across five reloads.
    assert_eq!(admitted, LIMIT);
}
