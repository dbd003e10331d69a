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
    serves_the_embedded_default_and_shuts_down_gracefully(&[]);
}

#[cfg(target_os = "linux")]
#[test]
fn serve_on_io_uring_runs_the_embedded_default_and_shuts_down_gracefully() {
    serves_the_embedded_default_and_shuts_down_gracefully(&["--io-uring"]);
}

fn serves_the_embedded_default_and_shuts_down_gracefully(flags: &[&str]) {
    let args = [&["--listen", "127.0.0.1:0", "--threads", "2"], flags].concat();
    let mut served = serve(&args, &[]);
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
    answers_requests_already_received_on_shutdown(&[]);
}

#[cfg(target_os = "linux")]
#[test]
fn shutdown_on_io_uring_answers_requests_already_received() {
    answers_requests_already_received_on_shutdown(&["--io-uring"]);
}

#[test]
fn io_uring_refuses_the_redis_backend() {
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--io-uring",
            "--backend",
            "redis",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("--io-uring serves the in-memory backend only"),
        "{stderr}"
    );
}

fn answers_requests_already_received_on_shutdown(flags: &[&str]) {
    let args = [&["--listen", "127.0.0.1:0", "--threads", "1"], flags].concat();
    let mut served = serve(&args, &[]);
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

/// Runs `tollgate ARGS` with `cwd` as the working directory and no cluster
/// secret in the environment; returns (exit code, stderr).
fn run_in(cwd: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        .env_remove("TOLLGATE_CLUSTER_SECRET")
        .env_remove("PORT")
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8(out.stderr).unwrap())
}

/// Each mistake of item 4 (issue 17) and exactly what the operator reads:
/// clap's detail kept on one line, each cause once, the command whose
/// `--help` to read.
#[test]
fn usage_and_startup_errors_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rules.txt"), "[default]\ncreditLimit=0\n").unwrap();
    std::fs::write(
        dir.path().join("cluster.ini"),
        "[cluster]\nshards = 4\n[node 1]\nclient = 127.0.0.1:1\npeer = 127.0.0.1:2\n",
    )
    .unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap().to_string();
    let snapshots: Vec<(Vec<&str>, i32, String)> = vec![
        (
            vec!["cluster", "add-node"],
            2,
            "tollgate: the following required arguments were not provided: --client <CLIENT>, --peer <PEER>, <ID> (see 'tollgate cluster add-node --help')".into(),
        ),
        (
            vec!["serve", "--lisen", "127.0.0.1:0"],
            2,
            "tollgate: unexpected argument '--lisen' found; did you mean '--listen'? (see 'tollgate serve --help')".into(),
        ),
        (
            vec!["serve", "--backend", "mysql"],
            2,
            "tollgate: invalid value 'mysql' for '--backend <BACKEND>'; possible values: memory, redis (see 'tollgate serve --help')".into(),
        ),
        (
            vec!["serve", "--lease-counters-max", "99999999999"],
            2,
            "tollgate: invalid value '99999999999' for '--lease-counters-max <LEASE_COUNTERS_MAX>': 99999999999 is not in 0..=16777216 (see 'tollgate serve --help')".into(),
        ),
        (
            vec!["chek-config", "rules.ini"],
            2,
            "tollgate: unrecognized subcommand 'chek-config'; did you mean 'check-config'? (see 'tollgate --help')".into(),
        ),
        (
            vec!["serve", "--listen", "nowhere"],
            2,
            "tollgate: invalid value 'nowhere' for '--listen <ADDR>': expected HOST:PORT (127.0.0.1:8321, localhost:8321, [::1]:8321) or a port (see 'tollgate serve --help')".into(),
        ),
        (
            vec!["serve", "--listen", "127.0.0.1:0", "nope.ini"],
            1,
            "tollgate: cannot read nope.ini: No such file or directory (os error 2)".into(),
        ),
        (
            vec!["check-config", "nope.ini"],
            1,
            "tollgate: cannot read nope.ini: No such file or directory (os error 2)".into(),
        ),
        (
            vec!["serve", "--listen", "127.0.0.1:0", "rules.txt"],
            1,
            "tollgate: rules.txt: unknown rule file type (expected .ini or .json)".into(),
        ),
        (
            vec!["check-config", "rules.txt"],
            1,
            "tollgate: rules.txt: unknown rule file type (expected .ini or .json)".into(),
        ),
        (
            vec!["serve", "--listen", &busy_addr],
            1,
            format!("tollgate: cannot listen on {busy_addr}: Address already in use (os error 98)"),
        ),
        (
            vec!["serve", "--cluster", "cluster.ini", "--node-id", "1", "--join"],
            1,
            "tollgate: a node joining a running cluster needs that cluster's secret: copy the secret file from a member and give --cluster-secret-file PATH (or --cluster-secret / TOLLGATE_CLUSTER_SECRET); a newly made secret would fail authentication".into(),
        ),
        (
            vec!["serve", "--cluster", "cluster.ini", "--node-id", "1"],
            1,
            "tollgate: cluster mode needs the cluster's shared secret, the same on every node: give --cluster-secret-file PATH (or --cluster-secret / TOLLGATE_CLUSTER_SECRET). For a new cluster make one with `head -c 32 /dev/urandom | base64 > /etc/tollgate/cluster.secret && chmod 600 /etc/tollgate/cluster.secret` and copy it to every node".into(),
        ),
        (
            vec!["cluster", "remove-node", "3", "--node", "127.0.0.1:9"],
            1,
            "tollgate: operator requests (add-node, remove-node, reload) must prove the cluster's secret: give the secret file the nodes were started with, --cluster-secret-file PATH (or --cluster-secret / TOLLGATE_CLUSTER_SECRET)".into(),
        ),
        (
            vec!["reload"],
            2,
            "tollgate: the following required arguments were not provided: --pid-file <PID_FILE> (see 'tollgate reload --help')".into(),
        ),
    ];
    let mut wrong = Vec::new();
    for (args, code, expected) in &snapshots {
        let (got_code, stderr) = run_in(dir.path(), args);
        if got_code != Some(*code) || stderr.trim_end() != expected {
            wrong.push(format!(
                "tollgate {}: exit {got_code:?}, stderr:\n{stderr}\nexpected exit {code}:\n{expected}",
                args.join(" ")
            ));
        }
    }
    drop(busy);
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
}

#[test]
fn a_bare_command_prints_its_help_and_exits_2() {
    for args in [&[][..], &["cluster"][..]] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(stderr.contains("Usage: tollgate"), "{stderr}");
        assert!(stderr.contains("Commands:"), "{stderr}");
    }
}

#[test]
fn admin_commands_at_a_client_port_say_what_it_is() {
    let served = serve(&["--listen", "127.0.0.1:0", "--threads", "1"], &[]);
    let addr = served.addr.to_string();
    let out = Command::new(BIN)
        .args(["cluster", "add-node", "4", "--client", "127.0.0.1:1"])
        .args(["--peer", "127.0.0.1:2", "--node", &addr])
        .args(["--cluster-secret", "0123456789abcdef0123"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim_end(),
        format!("tollgate: {addr} is the client port of a Tollgate that does not run in cluster mode; --node takes a cluster member's peer address (its `peer =` line)")
    );
}

#[test]
fn listen_accepts_a_host_name() {
    let served = serve(&["--listen", "localhost:0", "--threads", "1"], &[]);
    assert!(served.addr.ip().is_loopback(), "{}", served.addr);
    let mut stream = util::connect(served.addr);
    assert_eq!(
        util::request(&mut stream, "HIT method=GET path=/status"),
        "OK true 999 60"
    );
}
