//! `tollgate-mesh-floor` as real processes on loopback: three nodes (every
//! forwarder a follower) and five (answers relayed through a follower)
//! answer every line sent through every node, in order, one reply per line;
//! a client whose line outgrows the limit is dropped while the others are
//! still served; the work asked for per line is done before the line is
//! answered; and a node whose peers never come up says so and exits.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const FLOOR: &str = env!("CARGO_BIN_EXE_tollgate-mesh-floor");

/// The mesh's processes, killed when the test ends however it ends.
struct Mesh {
    children: Vec<Child>,
    clients: Vec<SocketAddr>,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn start(nodes: usize) -> Mesh {
    start_with(nodes, &[])
}

fn start_with(nodes: usize, extra: &[&str]) -> Mesh {
    let peers: Vec<SocketAddr> = (0..nodes).map(|_| free_addr()).collect();
    let clients: Vec<SocketAddr> = (0..nodes).map(|_| free_addr()).collect();
    let peer_list = peers
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let children = (0..nodes)
        .map(|n| {
            Command::new(FLOOR)
                .args([
                    "--id",
                    &(n + 1).to_string(),
                    "--listen",
                    &clients[n].to_string(),
                ])
                .args(["--peers", &peer_list])
                .args(extra)
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    Mesh { children, clients }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => {
                stream
                    .set_read_timeout(Some(Duration::from_secs(30)))
                    .unwrap();
                return stream;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("cannot reach the floor node at {addr}: {e}"),
        }
    }
}

/// Sends `lines` hits for distinct actors (so every node owns some) in
/// one write, then reads as many replies.
fn hits_answered(addr: SocketAddr, lines: usize, tag: &str) -> Vec<String> {
    let mut stream = connect(addr);
    let batch: String = (0..lines)
        .map(|i| format!("HIT path=/t user={tag}{i}\n"))
        .collect();
    stream.write_all(batch.as_bytes()).unwrap();
    let mut reader = BufReader::new(stream);
    (0..lines)
        .map(|_| {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            line
        })
        .collect()
}

fn every_line_answered_through_every_node(nodes: usize) {
    let mesh = start(nodes);
    for (n, &addr) in mesh.clients.iter().enumerate() {
        let replies = hits_answered(addr, 300, &format!("n{n}a"));
        assert_eq!(replies.len(), 300);
        for (i, reply) in replies.iter().enumerate() {
            assert_eq!(
                reply,
                "OK true 999 60\n",
                "reply {i} through node {}",
                n + 1
            );
        }
    }
}

#[test]
fn three_nodes_answer_every_line_through_every_node() {
    every_line_answered_through_every_node(3);
}

#[test]
fn five_nodes_answer_every_line_through_every_node_relaying_answers() {
    every_line_answered_through_every_node(5);
}

#[test]
fn a_client_with_an_overlong_line_is_dropped_and_the_others_served() {
    let mesh = start(3);
    let mut bad = connect(mesh.clients[0]);
    bad.write_all(&vec![b'x'; 8192]).unwrap();
    let mut reader = BufReader::new(bad);
    let mut rest = String::new();
    assert_eq!(
        reader.read_line(&mut rest).unwrap(),
        0,
        "the connection is closed, unanswered"
    );
    let replies = hits_answered(mesh.clients[0], 50, "ok");
    assert!(
        replies.iter().all(|r| r == "OK true 999 60\n"),
        "{replies:?}"
    );
}

#[test]
fn a_node_whose_peers_never_come_up_names_them_and_exits() {
    let peers = [free_addr(), free_addr(), free_addr()];
    let list = peers
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let out = Command::new(FLOOR)
        .args([
            "--id",
            "1",
            "--listen",
            &free_addr().to_string(),
            "--peers",
            &list,
        ])
        .args(["--connect-timeout-ms", "300"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("peer 2 at {}", peers[1])),
        "{stderr}"
    );
}

#[test]
fn the_owners_work_per_line_is_done_before_the_lines_are_answered() {
    // 1 ms per line at its owner: of 300 lines, some node owns at least
    // 100, so the batch cannot be answered in under 100 ms however fast
    // the machine (a lower bound only: a loaded machine is slower still).
    let mesh = start_with(3, &["--owner-work-ns", "1000000"]);
    drop(connect(mesh.clients[0]));
    let started = Instant::now();
    let replies = hits_answered(mesh.clients[0], 300, "w");
    let took = started.elapsed();
    assert!(
        replies.iter().all(|r| r == "OK true 999 60\n"),
        "{replies:?}"
    );
    assert!(
        took >= Duration::from_millis(100),
        "300 lines answered in {took:?}"
    );
}
