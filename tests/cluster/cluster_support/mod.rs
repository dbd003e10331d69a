//! Helpers for the cluster tests: real `tollgate` processes on loopback
//! (three nodes by default), killed with SIGKILL, restarted, and talked to
//! over real sockets. Every wait is bounded. A cluster started with
//! [`TestCluster::start_proxied`] sends every directed peer link through its
//! own fault-injection [`proxy::Proxy`], for partitions.
#![allow(dead_code)]

pub mod proxy;

use proxy::Proxy;
use std::collections::BTreeMap;
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

[path=/chaos]
creditLimit = 1000
resetSeconds = 3600
actorField = user

[path=/brief]
creditLimit = 3
resetSeconds = 4
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
    ports_of(&reserve_ports(count))
}

/// `count` free ports, held until the listeners are dropped: what else
/// binds port 0 meanwhile (a proxy) cannot be given one of them.
fn reserve_ports(count: usize) -> Vec<TcpListener> {
    (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind port 0"))
        .collect()
}

fn ports_of(listeners: &[TcpListener]) -> Vec<u16> {
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
    /// With [`TestCluster::start_proxied`]: the proxy of each directed link
    /// `(from, to)`, which node `from` dials instead of `to`'s peer port.
    pub proxies: BTreeMap<(u64, u64), Proxy>,
    /// The shared secret file every node is started with ([`SECRET`]).
    pub secret_path: PathBuf,
    /// With [`TestCluster::start_observed`]: each node's HTTP metrics and
    /// health listener (`--metrics-listen`, metrics at `/metrics`).
    pub metrics: BTreeMap<u64, SocketAddr>,
    /// With [`TestCluster::start_grpc`]: each node's gRPC endpoint
    /// (`--grpc-listen`, Envoy's rate limit service).
    pub grpc: BTreeMap<u64, SocketAddr>,
    /// With [`TestCluster::start_droplet`]: each node's droplet WebSocket
    /// endpoint (`--droplet-listen`).
    pub droplet: BTreeMap<u64, SocketAddr>,
    /// Environment variables node `id` is started with (from its next
    /// start on), e.g. the test-only `TOLLGATE_TEST_PEER_PROTOCOL`.
    pub env: BTreeMap<u64, Vec<(String, String)>>,
}

/// A shard's leader and term, as one node reports them.
type LeaderView = (Option<u64>, u64);

/// How [`TestCluster::isolate`] cuts a node off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Connections closed, new ones refused: peers notice at once.
    Cut,
    /// Connections open, bytes dropped: peers notice only by timeouts.
    Blackhole,
}

impl TestCluster {
    /// Starts `count` nodes with `shards` shards and extra `serve` flags, and
    /// waits until every shard has a leader.
    pub fn start(count: usize, shards: u32, args: &[&str]) -> TestCluster {
        Self::start_with(count, shards, args, false)
    }

    /// Like [`TestCluster::start`], with every directed peer link `i → j`
    /// going through its own proxy (node `i` runs with `--peer-route
    /// j=<proxy>`).
    pub fn start_proxied(count: usize, shards: u32, args: &[&str]) -> TestCluster {
        Self::start_with(count, shards, args, true)
    }

    /// Like [`TestCluster::start`] (proxied or not), every node also serving
    /// `/metrics`, `/healthz` and `/readyz` on its own port
    /// ([`TestCluster::metrics_addr`]).
    pub fn start_observed(count: usize, shards: u32, args: &[&str], proxied: bool) -> TestCluster {
        Self::start_full(count, shards, args, proxied, true, false, false, "")
    }

    /// Like [`TestCluster::start`], with `placement = ring` in the cluster
    /// file.
    pub fn start_ring(count: usize, shards: u32, args: &[&str]) -> TestCluster {
        Self::start_full(
            count,
            shards,
            args,
            false,
            false,
            false,
            false,
            "placement = ring\n",
        )
    }

    /// Like [`TestCluster::start`], every node also serving Envoy's rate
    /// limit service on its own port ([`TestCluster::grpc_addr`]).
    pub fn start_grpc(count: usize, shards: u32, args: &[&str]) -> TestCluster {
        Self::start_full(count, shards, args, false, false, true, false, "")
    }

    /// Like [`TestCluster::start`], every node also serving droplet's
    /// WebSocket protocol on its own port ([`TestCluster::droplet_addr`]).
    pub fn start_droplet(count: usize, shards: u32, args: &[&str]) -> TestCluster {
        Self::start_full(count, shards, args, false, false, false, true, "")
    }

    /// Node `id`'s droplet endpoint (clusters started with `start_droplet`).
    pub fn droplet_addr(&self, id: u64) -> SocketAddr {
        *self
            .droplet
            .get(&id)
            .unwrap_or_else(|| panic!("node {id} serves no droplet: use start_droplet"))
    }

    /// Node `id`'s gRPC endpoint (clusters started with `start_grpc` only).
    pub fn grpc_addr(&self, id: u64) -> SocketAddr {
        *self
            .grpc
            .get(&id)
            .unwrap_or_else(|| panic!("node {id} serves no gRPC: use start_grpc"))
    }

    fn start_with(count: usize, shards: u32, args: &[&str], proxied: bool) -> TestCluster {
        Self::start_full(count, shards, args, proxied, false, false, false, "")
    }

    /// `layout`: more `[cluster]` lines of the cluster file.
    #[allow(clippy::too_many_arguments)]
    fn start_full(
        count: usize,
        shards: u32,
        args: &[&str],
        proxied: bool,
        observed: bool,
        grpc: bool,
        droplet: bool,
        layout: &str,
    ) -> TestCluster {
        let dir = tempfile::tempdir().expect("temp dir");
        // Every port the nodes will bind (clients, peers, metrics) stays
        // taken until the proxies are bound, which could be given one of
        // them otherwise.
        let per_node = 2 + usize::from(observed) + usize::from(grpc) + usize::from(droplet);
        let reserved = reserve_ports(count * per_node);
        let ports = ports_of(&reserved);
        // After the clients', peers' and metrics' ports (the droplet
        // endpoints' come last).
        let grpc_ports = &ports[count * (per_node - usize::from(grpc) - usize::from(droplet))..];
        let droplet_addrs: BTreeMap<u64, SocketAddr> = if droplet {
            (1..=count as u64)
                .zip(&ports[count * (per_node - 1)..])
                .map(|(id, &port)| (id, SocketAddr::from(([127, 0, 0, 1], port))))
                .collect()
        } else {
            BTreeMap::new()
        };
        let grpc_addrs: BTreeMap<u64, SocketAddr> = if grpc {
            (1..=count as u64)
                .zip(grpc_ports)
                .map(|(id, &port)| (id, SocketAddr::from(([127, 0, 0, 1], port))))
                .collect()
        } else {
            BTreeMap::new()
        };
        let metrics: BTreeMap<u64, SocketAddr> = if observed {
            (1..=count as u64)
                .zip(&ports[count * 2..])
                .map(|(id, &port)| (id, SocketAddr::from(([127, 0, 0, 1], port))))
                .collect()
        } else {
            BTreeMap::new()
        };
        let mut cluster_file = format!("[cluster]\nshards = {shards}\nreplicas = 3\n{layout}");
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
        let mut proxies = BTreeMap::new();
        if proxied {
            for from in &nodes {
                for to in nodes.iter().filter(|to| to.id != from.id) {
                    proxies.insert((from.id, to.id), Proxy::start(to.peer));
                }
            }
        }
        drop(reserved);
        let secret_path = dir.path().join("cluster.secret");
        write_secret_file(&secret_path, &[SECRET]);
        let mut cluster = TestCluster {
            dir,
            nodes,
            args: args.iter().map(|s| s.to_string()).collect(),
            rules_path,
            cluster_path,
            proxies,
            secret_path,
            metrics,
            grpc: grpc_addrs,
            droplet: droplet_addrs,
            env: BTreeMap::new(),
        };
        for id in 1..=count as u64 {
            cluster.spawn(id, None);
        }
        cluster.wait_healthy(Duration::from_secs(20));
        cluster
    }

    /// Node `id`'s data dir (`--data-dir`), kept across its restarts.
    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("data-node-{id}"))
    }

    /// Starts node `id` (again) with its original cluster file, as a node
    /// that was added with `start_joining_node` is restarted: without
    /// `--join`, from its data dir.
    pub fn spawn_member(&mut self, id: u64) {
        let joined_file = self.dir.path().join(format!("cluster-{id}.ini"));
        if joined_file.exists() {
            let original = std::mem::replace(&mut self.cluster_path, joined_file);
            self.spawn(id, None);
            self.cluster_path = original;
        } else {
            self.spawn(id, None);
        }
    }

    /// Whether node `id`'s process is running (as far as the harness knows).
    pub fn running(&self, id: u64) -> bool {
        self.nodes[(id - 1) as usize].child.is_some()
    }

    fn node(&mut self, id: u64) -> &mut Node {
        &mut self.nodes[(id - 1) as usize]
    }

    /// Node `id`'s metrics and health listener (observed clusters only).
    pub fn metrics_addr(&self, id: u64) -> SocketAddr {
        *self
            .metrics
            .get(&id)
            .unwrap_or_else(|| panic!("node {id} serves no metrics: use start_observed"))
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
        let mut args = self.args.clone();
        for ((_, to), proxy) in self.proxies.range((id, 0)..=(id, u64::MAX)) {
            args.push("--peer-route".to_string());
            args.push(format!("{to}={}", proxy.addr));
        }
        if let Some(addr) = self.grpc.get(&id) {
            args.extend(["--grpc-listen".to_string(), addr.to_string()]);
        }
        if let Some(addr) = self.droplet.get(&id) {
            args.push(format!("--droplet-listen={addr}"));
        }
        if let Some(addr) = self.metrics.get(&id) {
            args.extend([
                "--metrics-listen".to_string(),
                addr.to_string(),
                "--metrics-path".to_string(),
                "/metrics".to_string(),
            ]);
        }
        if !args.iter().any(|a| a == "--data-dir") {
            args.push("--data-dir".to_string());
            args.push(self.data_dir(id).display().to_string());
        }
        let env = self.env.get(&id).cloned().unwrap_or_default();
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
            .envs(env)
            .args(&args)
            .arg(&rules)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn tollgate");
        node.child = Some(child);
    }

    /// Starts one more node with `serve --join`: its cluster file lists the
    /// members plus itself. It is not a member until `cluster add-node`.
    pub fn start_joining_node(&mut self) -> u64 {
        let id = self.nodes.len() as u64 + 1;
        let ports = free_ports(2);
        let client: SocketAddr = format!("127.0.0.1:{}", ports[0]).parse().unwrap();
        let peer: SocketAddr = format!("127.0.0.1:{}", ports[1]).parse().unwrap();
        let mut file = std::fs::read_to_string(&self.cluster_path).unwrap();
        file.push_str(&format!(
            "\n[node {id}]\nclient = {client}\npeer = {peer}\n"
        ));
        let path = self.dir.path().join(format!("cluster-{id}.ini"));
        std::fs::write(&path, file).unwrap();
        self.nodes.push(Node {
            id,
            client,
            peer,
            child: None,
            restarts: 1,
        });
        let log = std::fs::File::create(self.dir.path().join(format!("node{id}-1.log"))).unwrap();
        let child = Command::new(TOLLGATE)
            .arg("serve")
            .arg("--cluster")
            .arg(&path)
            .arg("--node-id")
            .arg(id.to_string())
            .arg("--join")
            .args(["--threads", "1"])
            .arg("--cluster-secret-file")
            .arg(&self.secret_path)
            .env_remove("TOLLGATE_CLUSTER_SECRET")
            .arg("--data-dir")
            .arg(self.data_dir(id))
            .args(&self.args)
            .arg(&self.rules_path)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn tollgate");
        self.node(id).child = Some(child);
        id
    }

    /// Waits until node `id` answers `TOPOLOGY` on its client port (a
    /// joining node does once it has joined).
    pub fn wait_serving(&self, id: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while fetch_topology(&self.client(id).to_string(), Duration::from_secs(1)).is_err() {
            assert!(
                Instant::now() < deadline,
                "node {id} did not serve within {timeout:?}: {}",
                self.log(id)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `tollgate cluster add-node` of node `id` (started with
    /// [`TestCluster::start_joining_node`]), asked of node `via`.
    pub fn add_node(&self, via: u64, id: u64) -> (bool, String) {
        let client = self.client(id).to_string();
        let peer = self.nodes[(id - 1) as usize].peer.to_string();
        self.admin(
            via,
            &[
                "add-node",
                &id.to_string(),
                "--client",
                &client,
                "--peer",
                &peer,
            ],
        )
    }

    /// Runs `tollgate cluster <command> …` against node `via`'s peer port;
    /// returns (success, stdout + stderr).
    pub fn admin(&self, via: u64, command: &[&str]) -> (bool, String) {
        let output = Command::new(TOLLGATE)
            .arg("cluster")
            .args(command)
            .arg("--node")
            .arg(self.nodes[(via - 1) as usize].peer.to_string())
            .arg("--cluster-secret-file")
            .arg(&self.secret_path)
            .env_remove("TOLLGATE_CLUSTER_SECRET")
            .output()
            .expect("run tollgate cluster");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), text)
    }

    /// Waits until `via` reports the member list `members`, every shard
    /// led, on its target replicas, and none recovering.
    pub fn wait_settled(&self, via: u64, members: &[u64], timeout: Duration) -> Topology {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        loop {
            if let Ok(topology) =
                fetch_topology(&self.client(via).to_string(), Duration::from_secs(2))
            {
                let ids: Vec<u64> = topology.nodes.iter().map(|n| n.id).collect();
                if ids == members && topology.settled() {
                    return topology;
                }
                last = Some(topology);
            }
            if Instant::now() >= deadline {
                let logs: Vec<String> = self.nodes.iter().map(|n| self.log(n.id)).collect();
                panic!(
                    "cluster did not settle on members {members:?} within {timeout:?}: {}\nlogs:\n{}",
                    last.map(|t| tollgate::cluster::status::render(&t))
                        .unwrap_or_default(),
                    logs.join("\n---\n")
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGKILLs node `id`.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut child) = self.node(id).child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops node `id` gracefully (SIGTERM: it drains its clients), then
    /// SIGKILLs it if it is still running after `timeout`.
    pub fn stop(&mut self, id: u64, timeout: Duration) {
        let Some(pid) = self.node(id).pid() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        if self.wait_exit(id, timeout).is_none() {
            eprintln!("node {id} ignored SIGTERM for {timeout:?}; killing it");
        }
        self.kill(id);
    }

    /// The proxy of the directed link `from → to` (proxied clusters only).
    pub fn link(&self, from: u64, to: u64) -> &Proxy {
        self.proxies
            .get(&(from, to))
            .unwrap_or_else(|| panic!("no proxy for link {from} -> {to}: use start_proxied"))
    }

    /// Cuts the directed link `from → to` (node `from`'s connection to `to`,
    /// which carries `from`'s requests and `to`'s answers to them).
    pub fn cut_link(&self, from: u64, to: u64) {
        self.link(from, to).cut();
    }

    /// Cuts (or blackholes) every link to and from `node`.
    pub fn isolate(&self, node: u64, fault: Fault) {
        for (&(from, to), proxy) in &self.proxies {
            if from == node || to == node {
                match fault {
                    Fault::Cut => proxy.cut(),
                    Fault::Blackhole => proxy.blackhole(),
                }
            }
        }
    }

    /// Heals every link (and clears delays).
    pub fn heal_all(&self) {
        for proxy in self.proxies.values() {
            proxy.set_delay(0);
            proxy.heal();
        }
    }

    /// Waits until the cluster is healthy (see [`TestCluster::wait_healthy`])
    /// and every live node, asked in turn, names the same leader and term
    /// for every shard.
    pub fn wait_converged(&self, timeout: Duration) -> Topology {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let topology = self.wait_healthy(left.max(Duration::from_millis(1)));
            let views: Vec<Option<Vec<LeaderView>>> = self
                .nodes
                .iter()
                .filter(|n| n.child.is_some())
                .map(|n| {
                    fetch_topology(&n.client.to_string(), Duration::from_secs(2))
                        .ok()
                        .map(|t| t.placement.iter().map(|s| (s.leader, s.term)).collect())
                })
                .collect();
            let agreed = views.iter().all(|v| v.is_some() && *v == views[0]);
            if agreed {
                return topology;
            }
            assert!(
                Instant::now() < deadline,
                "nodes disagree on leaders after {timeout:?}: {views:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
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

    /// What node `id` (its latest start) wrote: its log on stderr and its
    /// `tollgate: listening on …` lines on stdout.
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
    /// Waits until the cluster is healthy and no shard's leader has changed
    /// for `quiet` (leader balancing hands over at most one shard per node
    /// per second: a `quiet` of a few seconds means it is done).
    pub fn wait_leaders_stable(&self, quiet: Duration, timeout: Duration) -> Topology {
        let deadline = Instant::now() + timeout;
        let leaders =
            |t: &Topology| -> Vec<Option<u64>> { t.placement.iter().map(|s| s.leader).collect() };
        let mut last = self.wait_healthy(timeout);
        let mut since = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let now = self.wait_healthy(deadline.saturating_duration_since(Instant::now()));
            if leaders(&now) != leaders(&last) {
                since = Instant::now();
            } else if since.elapsed() >= quiet {
                return now;
            }
            assert!(
                Instant::now() < deadline,
                "leaders still changing after {timeout:?}: {}",
                tollgate::cluster::status::render(&now)
            );
            last = now;
        }
    }

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

/// The shard of `user`'s counter under a rule (`operation` as the rule
/// file's section, e.g. `path=/big`), in a cluster of `shards` shards on
/// nodes 1..=3.
pub fn shard_of_user(
    shards: u32,
    operation: &str,
    limit: u64,
    reset_seconds: u64,
    user: &str,
) -> u32 {
    use tollgate::cluster::placement::{counter_key, stable_counter_id, Placement};
    let placement = Placement::new(shards, 3, vec![1, 2, 3]);
    let counter = stable_counter_id(operation, limit, reset_seconds * 1000, "fixed-window");
    let mut key = Vec::new();
    counter_key(&mut key, counter, user);
    placement.shard_of(&key)
}

/// How a hit was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered {
    True,
    False,
    /// `ERR …`, with its text.
    Err(String),
    /// No answer: the connection closed (after an `ERR`) or failed.
    Lost,
}

/// One hit sent by a load thread.
#[derive(Debug, Clone)]
pub struct Hit {
    /// The node it was sent to.
    pub node: u64,
    /// Its index in the thread's lines.
    pub line: usize,
    pub sent: Instant,
    pub answered: Instant,
    pub answer: Answered,
}

pub type HitLog = std::sync::Arc<std::sync::Mutex<Vec<Hit>>>;

/// [`spawn_load`] on every node of `cluster`, each sending `lines` `batch`
/// at a time with `pause` between batches, until `stop`.
pub fn spawn_load_on_all(
    cluster: &TestCluster,
    lines: &std::sync::Arc<Vec<String>>,
    batch: usize,
    pause: Duration,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    log: &HitLog,
) -> Vec<std::thread::JoinHandle<()>> {
    cluster
        .nodes
        .iter()
        .map(|node| {
            spawn_load(
                node.id,
                node.client,
                std::sync::Arc::clone(lines),
                batch,
                pause,
                std::sync::Arc::clone(stop),
                std::sync::Arc::clone(log),
            )
        })
        .collect()
}

/// A load thread on node `node`: sends `lines` round-robin, `batch` per
/// pipelined request then `pause`, reconnecting after a close, and logs
/// every hit until `stop`.
pub fn spawn_load(
    node: u64,
    addr: SocketAddr,
    lines: std::sync::Arc<Vec<String>>,
    batch: usize,
    pause: Duration,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    log: HitLog,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut conn: Option<Conn> = None;
        let mut next = (node as usize * 7) % lines.len();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if conn.is_none() {
                conn = Conn::open(addr).ok();
                if conn.is_none() {
                    // A refused connection is a lost hit, logged once per try.
                    let now = Instant::now();
                    log.lock().unwrap().push(Hit {
                        node,
                        line: next,
                        sent: now,
                        answered: now,
                        answer: Answered::Lost,
                    });
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }
            let indexes: Vec<usize> = (0..batch).map(|i| (next + i) % lines.len()).collect();
            next = (next + batch) % lines.len();
            let request: Vec<String> = indexes.iter().map(|&i| lines[i].clone()).collect();
            let sent = Instant::now();
            let answers = conn
                .as_mut()
                .map(|c| c.pipeline(&request))
                .unwrap_or_default();
            let answered = Instant::now();
            {
                let mut log = log.lock().unwrap();
                for (position, &line) in indexes.iter().enumerate() {
                    let answer = match answers.get(position) {
                        Some(a) if a.starts_with("OK true") => Answered::True,
                        Some(a) if a.starts_with("OK false") => Answered::False,
                        Some(a) => Answered::Err(a.clone()),
                        None => Answered::Lost,
                    };
                    log.push(Hit {
                        node,
                        line,
                        sent,
                        answered,
                        answer,
                    });
                }
            }
            if answers.len() < request.len() {
                conn = None; // the server closes after an ERR
            }
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
    })
}

/// `(allowed, credit)` that a `PEEK` of `user` under `path` sent to `addr`
/// answers; panics unless it answers `OK`.
pub fn peek_credit(addr: SocketAddr, path: &str, user: &str) -> (bool, i64) {
    let answers = converse(addr, &[format!("PEEK path={path} user={user}")]);
    let (allowed, credit, _) = answers
        .first()
        .and_then(|a| parse_ok(a))
        .unwrap_or_else(|| panic!("PEEK via {addr}: {answers:?}"));
    (allowed, credit)
}

/// Latency budgets for tests of moves under load: the hits' longest wait
/// for a leader and for a commit. The property those tests check is that
/// moves cost no errors, only latency; with the defaults (2 s and 1 s) a
/// suite running two clusters at once on two loaded cores sometimes needs
/// more, so these budgets are the machine's, not the product's.
pub const MOVE_TIME_BUDGETS: &[&str] = &[
    "--forward-timeout-ms",
    "10000",
    "--commit-timeout-ms",
    "5000",
];

/// Credit used by `user` under `path` (limit `limit`), from a `PEEK` sent to
/// `addr`; `None` when it did not answer `OK`.
pub fn peek_used(addr: SocketAddr, path: &str, limit: i64, user: &str) -> Option<i64> {
    let answers = converse(addr, &[format!("PEEK path={path} user={user}")]);
    let (_, credit, _) = answers.first().and_then(|a| parse_ok(a))?;
    Some(limit - 1 - credit)
}

/// `count` users on `path=/big`, named `{prefix}{n}`, whose shards node
/// `leader` leads in `topology` (a cluster of `shards` shards).
pub fn users_led_by(
    topology: &Topology,
    shards: u32,
    leader: u64,
    prefix: &str,
    count: usize,
) -> Vec<String> {
    let led: Vec<u32> = topology
        .placement
        .iter()
        .filter(|s| s.leader == Some(leader))
        .map(|s| s.shard)
        .collect();
    assert!(!led.is_empty(), "node {leader} leads nothing");
    (0..)
        .map(|n| format!("{prefix}{n}"))
        .filter(|user| led.contains(&shard_of_user(shards, "path=/big", 1_000_000, 600, user)))
        .take(count)
        .collect()
}

/// One user per shard on `path=/big`, so probes touch every shard.
pub fn probe_users(shards: u32) -> Vec<String> {
    let mut users: Vec<Option<String>> = vec![None; shards as usize];
    for i in 0.. {
        let user = format!("probe{i}");
        let slot = &mut users[shard_of_user(shards, "path=/big", 1_000_000, 600, &user) as usize];
        if slot.is_none() {
            *slot = Some(user);
        }
        if users.iter().all(Option::is_some) {
            break;
        }
    }
    users.into_iter().flatten().collect()
}

/// Waits until a PEEK of every shard through `addr` answers `OK`; returns
/// how long that took. Panics after `bound`.
pub fn wait_shards_serve(addr: SocketAddr, shards: u32, bound: Duration) -> Duration {
    let users = probe_users(shards);
    let start = Instant::now();
    loop {
        let lines: Vec<String> = users
            .iter()
            .map(|u| format!("PEEK path=/big user={u}"))
            .collect();
        let answers = converse(addr, &lines);
        if answers.len() == lines.len() && answers.iter().all(|a| a.starts_with("OK")) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < bound,
            "shards still unavailable through {addr} after {:?}: {answers:?}",
            start.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET path` over HTTP/1.1 on a fresh connection: the status code and the
/// body; `None` when the server does not answer.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::Read;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// The value of the Prometheus sample `series` (name and labels, exactly as
/// exposed) at `addr`'s `/metrics`.
pub fn metric(addr: SocketAddr, series: &str) -> Option<f64> {
    let (_, body) = http_get(addr, "/metrics")?;
    body.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}
