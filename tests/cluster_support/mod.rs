//! Helpers for the cluster tests: real `tollgate` processes on loopback
//! (three nodes by default), killed with SIGKILL, restarted, and talked to
//! over real sockets. Every wait is bounded.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tollgate::cluster::status::fetch_topology;
use tollgate::cluster::Topology;

pub const TOLLGATE: &str = env!("CARGO_BIN_EXE_tollgate");

/// Rules shared by the cluster tests.
pub const RULES: &str = "\
[path=/canary*]
creditLimit = 3
resetSeconds = 60
actorField = user
matchPolicy = canary

[path=/limited]
creditLimit = 200
resetSeconds = 60
actorField = user

[path=/big]
creditLimit = 1000000
resetSeconds = 600
actorField = user

[path=/bucket]
creditLimit = 4
resetSeconds = 3600
actorField = user
algorithm = token-bucket

[path=/sliding]
creditLimit = 4
resetSeconds = 3600
actorField = user
algorithm = sliding-window

[default]
creditLimit = 5
resetSeconds = 60
actorField = ip
";

/// The cluster secret the test nodes share.
pub const SECRET: &str = "test-cluster-secret-0123456789abcdef";

/// Writes a secret file (mode 600) holding `secrets`, one per line.
pub fn write_secret_file(path: &Path, secrets: &[&str]) {
    std::fs::write(path, secrets.join("\n") + "\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
}

/// Ports that were free a moment ago (bound to port 0, then released).
pub fn free_ports(count: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind port 0"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

pub struct Node {
    pub id: u64,
    pub client: SocketAddr,
    pub peer: SocketAddr,
    child: Option<Child>,
    restarts: usize,
}

impl Node {
    /// The process id of the running node.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }
}

pub struct TestCluster {
    pub dir: tempfile::TempDir,
    pub nodes: Vec<Node>,
    pub args: Vec<String>,
    pub rules_path: PathBuf,
    pub cluster_path: PathBuf,
    /// The shared secret file every node is started with ([`SECRET`]).
    pub secret_path: PathBuf,
}

impl TestCluster {
    /// Starts `count` nodes with `shards` shards and extra `serve` flags, and
    /// waits until every shard has a leader.
    pub fn start(count: usize, shards: u32, args: &[&str]) -> TestCluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let ports = free_ports(count * 2);
        let mut cluster_file = format!("[cluster]\nshards = {shards}\nreplicas = 3\n");
        let mut nodes = Vec::new();
        for i in 0..count {
            let id = i as u64 + 1;
            let client: SocketAddr = format!("127.0.0.1:{}", ports[2 * i]).parse().unwrap();
            let peer: SocketAddr = format!("127.0.0.1:{}", ports[2 * i + 1]).parse().unwrap();
            cluster_file.push_str(&format!(
                "\n[node {id}]\nclient = {client}\npeer = {peer}\n"
            ));
            nodes.push(Node {
                id,
                client,
                peer,
                child: None,
                restarts: 0,
            });
        }
        let cluster_path = dir.path().join("cluster.ini");
        std::fs::write(&cluster_path, cluster_file).unwrap();
        let rules_path = dir.path().join("rules.ini");
        std::fs::write(&rules_path, RULES).unwrap();
        let secret_path = dir.path().join("cluster.secret");
        write_secret_file(&secret_path, &[SECRET]);
        let mut cluster = TestCluster {
            dir,
            nodes,
            args: args.iter().map(|s| s.to_string()).collect(),
            rules_path,
            cluster_path,
            secret_path,
        };
        for id in 1..=count as u64 {
            cluster.spawn(id, None);
        }
        cluster.wait_healthy(Duration::from_secs(20));
        cluster
    }

    fn node(&mut self, id: u64) -> &mut Node {
        &mut self.nodes[(id - 1) as usize]
    }

    pub fn client(&self, id: u64) -> SocketAddr {
        self.nodes[(id - 1) as usize].client
    }

    pub fn clients(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(|n| n.client).collect()
    }

    /// Starts node `id` (again), optionally with another rule file.
    pub fn spawn(&mut self, id: u64, rules: Option<&PathBuf>) {
        let secret = self.secret_path.clone();
        self.spawn_with_secret(id, rules, &secret);
    }

    /// Starts node `id` (again) with another secret file.
    pub fn spawn_with_secret(&mut self, id: u64, rules: Option<&PathBuf>, secret: &Path) {
        let log_dir = self.dir.path().to_path_buf();
        let rules = rules.unwrap_or(&self.rules_path).clone();
        let cluster_path = self.cluster_path.clone();
        let args = self.args.clone();
        let node = self.node(id);
        node.restarts += 1;
        let log =
            std::fs::File::create(log_dir.join(format!("node{id}-{}.log", node.restarts))).unwrap();
        let child = Command::new(TOLLGATE)
            .arg("serve")
            .arg("--cluster")
            .arg(&cluster_path)
            .arg("--node-id")
            .arg(id.to_string())
            .args(["--threads", "1"])
            .arg("--cluster-secret-file")
            .arg(secret)
            .env_remove("TOLLGATE_CLUSTER_SECRET")
            .args(&args)
            .arg(&rules)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tollgate");
        node.child = Some(child);
    }

    /// SIGKILLs node `id`.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut child) = self.node(id).child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The process of node `id` exited by itself (with its status).
    pub fn wait_exit(&mut self, id: u64, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        let child = self.node(id).child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self, id: u64) -> String {
        let restarts = self.nodes[(id - 1) as usize].restarts;
        std::fs::read_to_string(self.dir.path().join(format!("node{id}-{restarts}.log")))
            .unwrap_or_default()
    }

    /// The topology as a live node sees it.
    pub fn topology(&self) -> Option<Topology> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .find_map(|n| fetch_topology(&n.client.to_string(), Duration::from_secs(2)).ok())
    }

    /// Waits until every live node answers and every shard has a leader
    /// with no recovering replica on a live node.
    pub fn wait_healthy(&self, timeout: Duration) -> Topology {
        let deadline = Instant::now() + timeout;
        let live: Vec<u64> = self
            .nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.id)
            .collect();
        loop {
            // Every live node must serve clients (its client port opens
            // after it has joined), and agree that the cluster is whole.
            let all_serve = live.iter().all(|&id| {
                fetch_topology(&self.client(id).to_string(), Duration::from_secs(2)).is_ok()
            });
            if let Some(topology) = self.topology().filter(|_| all_serve) {
                let nodes_up = topology
                    .nodes
                    .iter()
                    .filter(|n| live.contains(&n.id))
                    .all(|n| n.up);
                let led = topology.placement.iter().all(|s| s.leader.is_some());
                let recovered = topology.placement.iter().all(|s| s.recovering.is_empty());
                if nodes_up && led && recovered {
                    return topology;
                }
            }
            if Instant::now() >= deadline {
                let logs: Vec<String> = live.iter().map(|&id| self.log(id)).collect();
                panic!(
                    "cluster not healthy within {timeout:?}: {:?}\nlogs:\n{}",
                    self.topology(),
                    logs.join("\n---\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// A pipelining line-protocol connection.
pub struct Conn {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> std::io::Result<Conn> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Conn {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    /// Sends every line, then reads one answer per line (fewer when the
    /// server closes after an `ERR`).
    pub fn pipeline(&mut self, lines: &[String]) -> Vec<String> {
        let mut batch = String::new();
        for line in lines {
            batch.push_str(line);
            batch.push('\n');
        }
        if self.writer.write_all(batch.as_bytes()).is_err() {
            return Vec::new();
        }
        let mut answers = Vec::with_capacity(lines.len());
        for _ in lines {
            let mut answer = String::new();
            match self.reader.read_line(&mut answer) {
                Ok(0) | Err(_) => break,
                Ok(_) => answers.push(answer.trim_end().to_string()),
            }
        }
        answers
    }
}

/// Sends lines on a fresh connection and returns the answers.
pub fn converse(addr: SocketAddr, lines: &[String]) -> Vec<String> {
    match Conn::open(addr) {
        Ok(mut conn) => conn.pipeline(lines),
        Err(_) => Vec::new(),
    }
}

/// `(allowed, credit, next_reset_seconds)` of an `OK` line.
pub fn parse_ok(answer: &str) -> Option<(bool, i64, i64)> {
    let parts: Vec<&str> = answer.split(' ').collect();
    match parts[..] {
        ["OK", allowed, credit, reset] => {
            Some((allowed == "true", credit.parse().ok()?, reset.parse().ok()?))
        }
        _ => None,
    }
}

/// Runs a single-node server (no cluster) on the same rules.
pub struct SingleNode {
    child: Child,
    pub addr: SocketAddr,
}

impl SingleNode {
    pub fn start(rules: &PathBuf) -> SingleNode {
        let port = free_ports(1)[0];
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let child = Command::new(TOLLGATE)
            .args(["serve", "--threads", "1", "--listen", &addr.to_string()])
            .arg(rules)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tollgate");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "single node did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        SingleNode { child, addr }
    }
}

impl Drop for SingleNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
