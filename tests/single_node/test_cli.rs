//! The `tollgate` binary as users run it: `check-config`, bad flags and
//! files, `serve` on the embedded default announcing its address, `PORT`,
//! and graceful shutdown on SIGTERM with in-flight requests answered.

use crate::util;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

fn write_temp(name: &str, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

#[test]
fn check_config_summarises_a_valid_file() {
    let (_dir, path) = write_temp(
        "rules.ini",
        "[method=GET path=/status]\ncreditLimit=1000\nresetSeconds=60\nlabel=status\n[ip=*]\ncreditLimit=5\nresetSeconds=1\nactorField=ip\nmatchPolicy=canary\n[default]\ncreditLimit=0\n",
    );
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("3 rules, valid"), "{stdout}");
    assert!(
        stdout.contains("[method=GET path=/status] 1000 per 60s, label status"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[ip=*] 5 per 1s, per ip, canary"),
        "{stdout}"
    );
    assert!(stdout.contains("[default] always deny"), "{stdout}");
}

#[test]
fn check_config_names_the_bad_rule_and_its_line() {
    let (_dir, path) = write_temp(
        "rules.ini",
        "[path=/pantry/*]\ncreditLimit=1\nresetSeconds=60\n\n[path=/pantry/cookies]\ncreditLimit=1\nresetSeconds=60\n[default]\ncreditLimit=0\n",
    );
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(
            "rule [path=/pantry/cookies] (line 5) is unreachable: rule [path=/pantry/*] (line 1)"
        ),
        "{stderr}"
    );
}

#[test]
fn bad_flags_and_unreadable_files_give_one_line_and_a_nonzero_exit() {
    let out = Command::new(BIN)
        .args(["serve", "--no-such-flag"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("tollgate: unexpected argument '--no-such-flag'"),
        "{stderr}"
    );

    let out = Command::new(BIN)
        .args(["serve", "/nonexistent/rules.ini", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cannot read /nonexistent/rules.ini"),
        "{stderr}"
    );

    let out = Command::new(BIN)
        .args(["check-config", "/nonexistent.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(!String::from_utf8(out.stderr).unwrap().contains("panicked"));
}

/// A `tollgate serve` child process, killed on drop.
struct Served {
    child: Child,
    addr: std::net::SocketAddr,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(args: &[&str], env: &[(&str, &str)]) -> Served {
    let mut child = Command::new(BIN)
        .arg("serve")
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first_line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first_line)
        .unwrap();
    let addr = first_line
        .split("listening on ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("no address in {first_line:?}"))
        .parse()
        .unwrap();
    assert!(first_line.contains("rules: "), "{first_line}");
    Served { child, addr }
}

fn terminate(served: &mut Served) -> std::process::ExitStatus {
    let status = Command::new("kill")
        .args(["-TERM", &served.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = served.child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serve_runs_the_embedded_default_and_shuts_down_gracefully() {
    let mut served = serve(&["--listen", "127.0.0.1:0", "--threads", "2"], &[]);
    let mut stream = util::connect(served.addr);
    assert_eq!(
        util::request(&mut stream, "HIT method=GET path=/status"),
        "OK true 999 60"
    );

    // An idle connection is closed by shutdown; the process exits 0.
    let status = terminate(&mut served);
    assert!(status.success(), "{status:?}");
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

#[test]
fn shutdown_answers_requests_already_received() {
    let mut served = serve(&["--listen", "127.0.0.1:0", "--threads", "1"], &[]);
    let mut stream = util::connect(served.addr);
    let batch: String = (0..2000).map(|_| "HIT method=GET path=/status\n").collect();
    stream.write_all(batch.as_bytes()).unwrap();
    // Give the server the bytes, then stop it before we read anything.
    let mut first = String::new();
    let mut reader = BufReader::new(stream);
    reader.read_line(&mut first).unwrap();
    assert_eq!(first, "OK true 999 60\n");
    let status = terminate(&mut served);
    assert!(status.success());
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    let answers: Vec<&str> = rest.lines().collect();
    // Every request the server had read was answered, in order, before it closed.
    assert!(!answers.is_empty());
    for (i, answer) in answers.iter().enumerate() {
        let expected = 998 - i as i64;
        if expected >= 0 {
            assert_eq!(*answer, format!("OK true {expected} 60"));
        } else {
            assert!(answer.starts_with("OK false 0 "), "{answer}");
        }
    }
}

#[test]
fn port_environment_variable_sets_the_port() {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let served = serve(&[], &[("PORT", &port.to_string())]);
    assert_eq!(served.addr.port(), port);
    let mut stream = util::connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    assert_eq!(
        util::request(&mut stream, "HIT method=GET path=/status"),
        "OK true 999 60"
    );
}

#[test]
fn a_second_server_on_the_same_port_is_refused() {
    let first = serve(&["--listen", "127.0.0.1:0", "--threads", "2"], &[]);
    let out = Command::new(BIN)
        .args(["serve", "--listen", &first.addr.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("already in use"), "{stderr}");
}

#[test]
fn cluster_mode_refuses_redis_persistence_and_the_redis_backend() {
    let (_dir, path) = write_temp(
        "cluster.ini",
        "[cluster]\nshards = 4\nreplicas = 3\n[node 1]\nclient = 127.0.0.1:1\npeer = 127.0.0.1:2\n",
    );
    for (flags, expected) in [
        (
            ["--persist-redis", "redis://127.0.0.1:1"],
            "--persist-redis cannot be used with --cluster",
        ),
        (
            ["--backend", "redis"],
            "--backend redis cannot be used with --cluster",
        ),
    ] {
        let out = Command::new(BIN)
            .arg("serve")
            .arg("--cluster")
            .arg(&path)
            .args(["--node-id", "1"])
            .args(flags)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{out:?}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(stderr.contains(expected), "{stderr}");
    }
}
