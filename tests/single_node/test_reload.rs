//! Hot reload of a real `tollgate serve` process: `tollgate reload` (the
//! control socket) and SIGHUP apply a valid file without dropping
//! connections, keep the counters of rules whose identity is unchanged, and
//! refuse an invalid file (logged, and `tollgate reload` exits 1 with the
//! reason) while the old rules keep serving, also under load. A stale pid
//! file makes `tollgate reload` touch nothing and fail.

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

fn run_reload(served: &Served) -> std::process::Output {
    Command::new(BIN)
        .arg("reload")
        .arg("--pid-file")
        .arg(&served.pid_file)
        .output()
        .unwrap()
}

/// `tollgate reload` succeeds and says what the server loaded.
fn reload(served: &Served) {
    let out = run_reload(served);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.starts_with(&format!(
            "tollgate: process {}: reloaded ",
            served.child.id()
        )),
        "{stdout}"
    );
}

/// `tollgate reload` fails with the server's reason; returns its stderr.
fn reload_refused(served: &Served) -> String {
    let out = run_reload(served);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    String::from_utf8(out.stderr).unwrap()
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
    let refused = reload_refused(&served);
    assert_eq!(
        refused.trim_end(),
        format!(
            "tollgate: process {} kept its rules: {}: rule [op=a] (line 1): creditLimit must be a number >= 0, got '-1'",
            served.child.id(),
            rules.display()
        )
    );
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

#[test]
fn sighup_still_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.ini");
    std::fs::write(&rules, RULES_A).unwrap();
    let served = serve(dir.path(), &rules);
    std::fs::write(&rules, RULES_B).unwrap();
    let status = Command::new("kill")
        .args(["-HUP", &served.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    wait_for_answer(served.addr, "PEEK op=b", "OK true 0 60");
}

#[test]
fn a_stale_pid_file_signals_nothing_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    // An unrelated process holds the pid the file names; SIGHUP would end it.
    let mut unrelated = Command::new("sleep").arg("30").spawn().unwrap();
    let pid_file = dir.path().join("tollgate.pid");
    std::fs::write(&pid_file, format!("{}\n", unrelated.id())).unwrap();
    let reload = || util::reload_command(&["--pid-file".as_ref(), pid_file.as_os_str()]);
    let out = reload();
    std::thread::sleep(Duration::from_millis(200));
    let still_running = unrelated.try_wait().unwrap().is_none();
    let _ = unrelated.kill();
    let _ = unrelated.wait();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(still_running, "the unrelated process was signalled");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        stderr.trim_end(),
        format!(
            "tollgate: no Tollgate server answers for process {pid} (process {pid} is `sleep`; its control socket: Connection refused (os error 111)); nothing was signalled",
            pid = unrelated.id()
        )
    );

    // A pid file of a process that is gone, and one that holds no pid.
    std::fs::write(&pid_file, "999999999\n").unwrap();
    let out = reload();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("(there is no process 999999999; "),
        "{stderr}"
    );
    std::fs::write(&pid_file, "tollgate\n").unwrap();
    let out = reload();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim_end(),
        format!(
            "tollgate: {} does not hold a process id: \"tollgate\": invalid digit found in string",
            pid_file.display()
        )
    );
}
