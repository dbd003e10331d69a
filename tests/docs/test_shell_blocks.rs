//! Runs the shell blocks of the documentation (see `blocks` for the labels)
//! the way a reader would, each file in order in a scratch directory of its
//! own: `bash -euo pipefail`, with the `tollgate` binary of this build on
//! `PATH` (and where the docs say a release build puts it,
//! `target/release/tollgate`), `rules.ini` holding divvy's example rules
//! and `cluster/` the repository's scripts. Documented addresses become free
//! ones: ports 8321-8324 and 9321-9324 (clients and peers of nodes 1-4),
//! 9102 (metrics), `:3000` and `:4000` (droplet), `:8081` (gRPC) are mapped
//! to free ports (and `PORT`, `BASE_PORT` say so to the server and
//! `cluster/local.sh`),
//! and `/etc/tollgate/` and `/run/` to directories of the scratch
//! directory. Each block's processes are killed when it ends, background
//! servers when the file's last block ran. Every failure is reported with
//! its file, line, script and output.

use crate::blocks::{blocks, output_matches, transcript, Block, Kind};
use std::collections::BTreeMap;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOLLGATE: &str = env!("CARGO_BIN_EXE_tollgate");
/// The longest a block may run.
const BLOCK_TIMEOUT: Duration = Duration::from_secs(180);
/// The longest a background server may take to announce itself.
const START_TIMEOUT: Duration = Duration::from_secs(30);
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files whose shell blocks are checked.
fn documents() -> Vec<PathBuf> {
    let root = repo();
    let mut files = vec![
        root.join("README.md"),
        root.join("cluster/README.md"),
        root.join("fuzz/README.md"),
    ];
    for dir in ["docs", "loadtest"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        let mut found: Vec<PathBuf> = entries
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|e| e == "md"))
            .collect();
        found.sort();
        files.extend(found);
    }
    files.retain(|path| path.exists());
    files
}

/// A documented port and the free port standing in for it.
struct Ports {
    map: Vec<(String, String)>,
    base: u16,
}

fn free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok() && TcpListener::bind(("0.0.0.0", port)).is_ok()
}

impl Ports {
    /// A base port B with B..B+7 and B+1000..B+1003 free.
    fn choose() -> Ports {
        let seed = std::process::id() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos() as u64;
        for attempt in 0..200u64 {
            let base = 20_000 + ((seed + attempt * 7919) % 1_500) as u16 * 8;
            let wanted: Vec<u16> = (0..8)
                .map(|i| base + i)
                .chain((0..4).map(|i| base + 1000 + i))
                .collect();
            if wanted.iter().all(|&port| free(port)) {
                let mut map = Vec::new();
                for i in 0..4 {
                    map.push(((8321 + i).to_string(), (base + i).to_string()));
                    map.push(((9321 + i).to_string(), (base + 1000 + i).to_string()));
                }
                map.push((":8081".into(), format!(":{}", base + 4)));
                map.push(("9102".into(), (base + 5).to_string()));
                map.push((":3000".into(), format!(":{}", base + 6)));
                map.push((":4000".into(), format!(":{}", base + 7)));
                return Ports { map, base };
            }
        }
        panic!("no free ports for the doc test");
    }
}

/// Replaces whole-number occurrences of `from` (not inside a longer number).
fn replace_number(text: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(from) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + from.len()..].chars().next();
        let digit = |c: Option<char>| c.is_some_and(|c| c.is_ascii_digit());
        out.push_str(&rest[..at]);
        if (from.starts_with(':') || !digit(before)) && !digit(after) {
            out.push_str(to);
        } else {
            out.push_str(from);
        }
        rest = &rest[at + from.len()..];
    }
    out.push_str(rest);
    out
}

/// A file's blocks, run in one scratch directory.
struct Session {
    dir: tempfile::TempDir,
    ports: Ports,
    background: Vec<Child>,
}

/// Kills a block's whole process group (servers started with `&` or nohup).
fn kill_group(child: &mut Child) {
    // SAFETY: kill(2) with a negative pid signals that process group.
    unsafe {
        libc::kill(-(child.id() as i32), libc::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Session {
    fn drop(&mut self) {
        for child in &mut self.background {
            kill_group(child);
        }
    }
}

impl Session {
    fn new() -> Session {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let example = std::fs::read_to_string(repo().join("src/rules/default.ini")).unwrap();
        for sub in [
            "etc/tollgate",
            "run",
            "tmp",
            "target/release",
            "target/debug",
        ] {
            std::fs::create_dir_all(root.join(sub)).unwrap();
        }
        std::fs::write(root.join("rules.ini"), &example).unwrap();
        std::fs::write(root.join("etc/tollgate/rules.ini"), &example).unwrap();
        std::os::unix::fs::symlink(repo().join("cluster"), root.join("cluster")).unwrap();
        for build in ["release", "debug"] {
            std::os::unix::fs::symlink(TOLLGATE, root.join("target").join(build).join("tollgate"))
                .unwrap();
        }
        Session {
            dir,
            ports: Ports::choose(),
            background: Vec::new(),
        }
    }

    /// The block's text with documented ports and paths made local.
    fn localize(&self, text: &str) -> String {
        let root = self.dir.path().display().to_string();
        let mut text = text
            .replace("/etc/tollgate/", &format!("{root}/etc/tollgate/"))
            .replace("/run/", &format!("{root}/run/"));
        for (from, to) in &self.ports.map {
            text = replace_number(&text, from, to);
        }
        text
    }

    fn command(&self, script: &str, output: &Path) -> Command {
        let bin_dir = Path::new(TOLLGATE).parent().unwrap();
        let path = format!(
            "{}:{}",
            bin_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut command = Command::new("bash");
        // Only what a reader's shell surely has: no variable of the host
        // (RUST_LOG, REDIS_HOST, …) reaches the server.
        command
            .args(["-euo", "pipefail", "-c", script])
            .current_dir(self.dir.path())
            .env_clear()
            .env("HOME", std::env::var_os("HOME").unwrap_or_default())
            .env("PATH", path)
            .env("TOLLGATE", TOLLGATE)
            .env("BASE_PORT", self.ports.base.to_string())
            .env("PORT", self.ports.base.to_string())
            .env("TMPDIR", self.dir.path().join("tmp"))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(output).unwrap())
            .stderr(std::fs::File::create(output.with_extension("err")).unwrap());
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        command
    }

    fn output_of(&self, output: &Path) -> String {
        let read = |path: &Path| {
            let mut text = String::new();
            if let Ok(mut file) = std::fs::File::open(path) {
                let _ = file.read_to_string(&mut text);
            }
            text
        };
        format!("{}{}", read(output), read(&output.with_extension("err")))
    }

    /// Runs `script` to its end (at most [`BLOCK_TIMEOUT`]); its exit
    /// status (`None`: timed out) and output.
    fn run(&self, script: &str, name: &str) -> (Option<i32>, String) {
        let output = self.dir.path().join(format!("{name}.out"));
        let mut child = self.command(script, &output).spawn().unwrap();
        let deadline = Instant::now() + BLOCK_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.code();
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        kill_group(&mut child);
        (status, self.output_of(&output))
    }

    /// Starts a server block and waits for its `listening on` line.
    fn start(&mut self, script: &str, name: &str) -> Result<(), String> {
        let output = self.dir.path().join(format!("{name}.out"));
        let child = self.command(script, &output).spawn().unwrap();
        self.background.push(child);
        let child = self.background.last_mut().unwrap();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let text = std::fs::read_to_string(&output).unwrap_or_default();
            if text.contains("tollgate: listening on ") {
                return Ok(());
            }
            if let Some(status) = child.try_wait().unwrap() {
                return Err(format!(
                    "exited ({status}) before listening:\n{}",
                    self.output_of(&output)
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "not listening after {START_TIMEOUT:?}:\n{}",
                    self.output_of(&output)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs a block; `Err` says how it failed.
    fn block(&mut self, block: &Block, name: &str) -> Result<(), String> {
        let body = self.localize(&block.body);
        match &block.kind {
            Kind::Run => match self.run(&body, name) {
                (Some(0), _) => Ok(()),
                (status, output) => Err(format!(
                    "{}:\n{body}\noutput:\n{output}",
                    status.map_or("timed out".to_owned(), |code| format!("exit {code}"))
                )),
            },
            Kind::Background => self.start(&body, name),
            Kind::Transcript => {
                for (step, (command, expected)) in transcript(&body).iter().enumerate() {
                    let script = format!("exec 2>&1\n{command}");
                    let (status, output) = self.run(&script, &format!("{name}-{step}"));
                    let got: Vec<&str> = output.lines().collect();
                    if status.is_none() || !output_matches(expected, &got) {
                        return Err(format!(
                            "$ {command}\nexpected:\n{}\ngot ({}):\n{output}",
                            expected.join("\n"),
                            status.map_or("timed out".to_owned(), |code| format!("exit {code}"))
                        ));
                    }
                }
                Ok(())
            }
            Kind::Skip(_) | Kind::Other => Ok(()),
        }
    }
}

/// `nc` (OpenBSD's, for `-N`) and `curl` run in the blocks; without them
/// the test says so and checks only the labels (a failure under `CI`).
fn tools_missing() -> Vec<&'static str> {
    let has = |tool: &str, arg: &str| {
        Command::new(tool)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    };
    let mut missing = Vec::new();
    if !has("nc", "-h") {
        missing.push("nc (netcat-openbsd)");
    }
    if !has("curl", "--version") {
        missing.push("curl");
    }
    missing
}

#[test]
fn every_shell_block_of_the_docs_runs_as_written() {
    let mut failures = Vec::new();
    let mut skipped = BTreeMap::new();
    let mut ran = 0;
    let documents: Vec<(PathBuf, Vec<Block>)> = documents()
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let relative = path.strip_prefix(repo()).unwrap_or(&path).to_owned();
            let (found, errors) = blocks(&relative, &text);
            failures.extend(errors);
            (relative, found)
        })
        .collect();
    let missing = tools_missing();
    if !missing.is_empty() {
        assert!(
            std::env::var_os("CI").is_none(),
            "the doc test needs {missing:?} (.ci/run installs them)"
        );
        eprintln!("note: {missing:?} missing: the doc blocks' labels were checked, not run");
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
        return;
    }
    for (_, found) in documents {
        let runnable: Vec<&Block> = found
            .iter()
            .filter(|b| matches!(b.kind, Kind::Run | Kind::Background | Kind::Transcript))
            .collect();
        for block in &found {
            if let Kind::Skip(reason) = &block.kind {
                skipped.insert(block.place(), reason.clone());
            }
        }
        if runnable.is_empty() {
            continue;
        }
        let mut session = Session::new();
        for block in runnable {
            ran += 1;
            let started = Instant::now();
            let result = session.block(block, &format!("block{}", block.line));
            eprintln!("{} ran in {:?}", block.place(), started.elapsed());
            if let Err(why) = result {
                failures.push(format!("{}: {why}", block.place()));
                // Later blocks of the file build on this one.
                break;
            }
        }
    }
    for (place, reason) in &skipped {
        eprintln!("{place}: not run: {reason}");
    }
    assert!(ran > 0, "no runnable block found");
    assert!(
        failures.is_empty(),
        "{} failed:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn documented_ports_are_mapped_only_as_whole_numbers() {
    assert_eq!(
        replace_number("nc 127.0.0.1 8322", "8322", "20001"),
        "nc 127.0.0.1 20001"
    );
    assert_eq!(
        replace_number("18322 83221 8322", "8322", "1"),
        "18322 83221 1"
    );
    assert_eq!(
        replace_number("--drain 3000 :3000", ":3000", ":7"),
        "--drain 3000 :7"
    );
}
