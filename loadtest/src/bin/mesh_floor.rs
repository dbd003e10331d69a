//! `tollgate-mesh-floor`: the messages of a strict cluster's divvy path and
//! nothing else, to measure what this machine's scheduler and loopback TCP
//! cost a replicated hit before any of Tollgate's work.
//!
//! A node answers divvy `HIT` lines with a fixed `OK true 999 60`, but only
//! once each line has made the trips a strict Tollgate cluster makes it
//! make: a line's owner is a hash of it modulo the node count; a line this
//! node owns goes into its next round to its two followers (the next two
//! nodes, ring placement) and is answered at the first acknowledgement; a
//! line another node owns is forwarded to it, goes into the owner's next
//! round, and is answered when that round reaches this node, as a follower
//! (three nodes) or through the follower that relays the answer (four and
//! more). Every turn of the event loop writes at most one frame per peer
//! holding all of it, as the cluster does; a read batch's replies leave in
//! order, once all of its lines are answered, in one write. There is no
//! rule, counter, decision or store: what this costs in CPU and in latency
//! under `tollgate-loadtest` is the floor under a Tollgate cluster's own
//! figures on the same machine (docs/benchmarks.md, "Thirty-second
//! round"). `--serving-work-ns`, `--owner-work-ns` and `--follower-work-ns`
//! add a busy loop per line where a real node would work on it, to ask how
//! much work a latency target leaves room for.
//!
//! Not a server to deploy: no authentication, no failure handling (a lost
//! peer ends the process), no backpressure on a client that does not read
//! its replies; loopback measurements only.

use clap::Parser;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tollgate::stable_hash::stable_hash;

/// The followers of each owner's rounds: a three-replica shard's other two.
const FOLLOWERS: usize = 2;
/// Most bytes one read takes from a socket.
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// A peer frame longer than this ends the process (peers are this binary).
const FRAME_BYTES_MAX: usize = 64 * 1024 * 1024;
/// A client line longer than this ends its connection.
const LINE_BYTES_MAX: usize = 4096;
const REPLY: &[u8] = b"OK true 999 60\n";

const CLIENT_LISTENER: Token = Token(0);
const PEER_LISTENER: Token = Token(1);
/// Tokens from here on: peers' inbound connections, then clients.
const FIRST_PEER_IN: usize = 2;
const FIRST_OUT: usize = 1 << 20;
const FIRST_CLIENT: usize = 1 << 21;

const TAG_FORWARD: u8 = 1;
const TAG_ROUND: u8 = 2;
const TAG_ACK: u8 = 3;
const TAG_ANSWERS: u8 = 4;

#[derive(Parser)]
#[command(
    name = "tollgate-mesh-floor",
    about = "One node of a message-only mesh with a strict Tollgate cluster's divvy path (a measuring floor)"
)]
struct Args {
    /// This node's place in `--peers`, from 1.
    #[arg(long)]
    id: usize,
    /// Where divvy clients connect.
    #[arg(long)]
    listen: SocketAddr,
    /// Every node's peer address, in id order (this node listens on its own).
    #[arg(long, value_delimiter = ',', required = true)]
    peers: Vec<SocketAddr>,
    /// How long to keep trying to reach a peer at start-up, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    connect_timeout_ms: u64,
    /// CPU time spent on each line by the node its client sent it to, in
    /// nanoseconds (a busy loop standing for parsing, matching, replying).
    #[arg(long, default_value_t = 0)]
    serving_work_ns: u64,
    /// CPU time spent on each line by its owner, in nanoseconds (deciding).
    #[arg(long, default_value_t = 0)]
    owner_work_ns: u64,
    /// CPU time spent on each line by each follower of its round, in
    /// nanoseconds (merging the state).
    #[arg(long, default_value_t = 0)]
    follower_work_ns: u64,
}

/// Keeps the CPU busy for `per_line_ns` times `lines` nanoseconds: the
/// work a real node would do on those lines, for asking how much of it a
/// latency target leaves room for.
fn work(per_line_ns: u64, lines: usize) {
    if per_line_ns == 0 || lines == 0 {
        return;
    }
    let until = Instant::now() + Duration::from_nanos(per_line_ns.saturating_mul(lines as u64));
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// How many lines a round's or a forward's bytes carry (each a length
/// byte and that many bytes).
fn lines_in(mut bytes: &[u8]) -> usize {
    let mut lines = 0;
    while let Some((&len, rest)) = bytes.split_first() {
        bytes = rest.get(usize::from(len)..).unwrap_or_default();
        lines += 1;
    }
    lines
}

/// A client's read batch: its lines, and how many still wait for an answer.
struct Batch {
    client: usize,
    lines: u32,
    waiting: u32,
}

struct Client {
    stream: TcpStream,
    read: Vec<u8>,
    /// The client's batches in arrival order, by id into `Node::batches`.
    order: VecDeque<u32>,
    write: Vec<u8>,
    open: bool,
}

/// What goes to one peer in this turn's frame.
#[derive(Default)]
struct Outgoing {
    /// `FORWARD` entries: (batch id, lines) and the lines' bytes.
    forwards: Vec<(u32, u32)>,
    forward_bytes: Vec<u8>,
    /// Answers relayed to this peer as a forwarder (`ANSWERS`).
    answers: Vec<(u32, u32)>,
    /// The latest round of this peer's this node holds, to acknowledge.
    ack: Option<u64>,
}

/// A round this node owns, waiting for a follower's acknowledgement.
struct Round {
    id: u64,
    own: Vec<(u32, u32)>,
}

struct Node {
    id: usize,
    nodes: usize,
    serving_work_ns: u64,
    owner_work_ns: u64,
    follower_work_ns: u64,
    batches: Vec<Option<Batch>>,
    free_batches: Vec<u32>,
    clients: Vec<Option<Client>>,
    outs: Vec<Option<TcpStream>>,
    out_pending: Vec<Vec<u8>>,
    ins: Vec<(TcpStream, Vec<u8>)>,
    outgoing: Vec<Outgoing>,
    /// The open round: this node's own lines and forwarded ones, by forwarder.
    round_own: Vec<(u32, u32)>,
    round_forwarded: Vec<(usize, u32, u32)>,
    round_bytes: Vec<u8>,
    next_round: u64,
    rounds: VecDeque<Round>,
    replied: Vec<usize>,
    /// Where every socket read lands first.
    scratch: Vec<u8>,
}

/// The node that owns `line`: any even spread will do, and every node
/// must agree, so the project's process-independent hash.
fn owner_of(line: &[u8], nodes: usize) -> usize {
    (stable_hash(0, line) % nodes as u64) as usize
}

fn followers_of(owner: usize, nodes: usize) -> impl Iterator<Item = usize> {
    (1..=FOLLOWERS.min(nodes - 1)).map(move |step| (owner + step) % nodes)
}

fn put_entries(frame: &mut Vec<u8>, entries: &[(u32, u32)]) {
    frame.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (batch, lines) in entries {
        frame.extend_from_slice(&batch.to_le_bytes());
        frame.extend_from_slice(&lines.to_le_bytes());
    }
}

/// Reads little-endian integers and entry lists from a frame body.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.bytes.len() < n {
            return Err("a frame ends inside a section".into());
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut bytes = [0u8; N];
        bytes.copy_from_slice(self.take(N)?);
        Ok(bytes)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn entries(&mut self, mut each: impl FnMut(u32, u32)) -> Result<(), String> {
        for _ in 0..self.u32()? {
            let batch = self.u32()?;
            let lines = u32::from_le_bytes(self.array()?);
            each(batch, lines);
        }
        Ok(())
    }
}

impl Node {
    fn answer(&mut self, batch: u32, lines: u32) {
        let Some(Some(b)) = self.batches.get_mut(batch as usize) else {
            return;
        };
        b.waiting = b.waiting.saturating_sub(lines);
        if b.waiting == 0 {
            self.replied.push(b.client);
        }
    }

    /// Takes a client's whole lines as one batch. Err: the client sent a
    /// line too long, and is to be dropped.
    fn on_client_bytes(&mut self, client: usize) -> Result<(), String> {
        let Some(c) = self.clients[client].as_mut() else {
            return Ok(());
        };
        let Some(end) = c.read.iter().rposition(|&b| b == b'\n') else {
            if c.read.len() > LINE_BYTES_MAX {
                return Err(format!("a line over {LINE_BYTES_MAX} bytes"));
            }
            return Ok(());
        };
        let batch_id = self.free_batches.pop().unwrap_or_else(|| {
            self.batches.push(None);
            (self.batches.len() - 1) as u32
        });
        let taken: Vec<u8> = c.read.drain(..=end).collect();
        let mut lines = 0u32;
        let mut own = 0u32;
        let mut forwarded = vec![0u32; self.nodes];
        for line in taken.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            lines += 1;
            let owner = owner_of(line, self.nodes);
            let bytes = if owner == self.id {
                own += 1;
                &mut self.round_bytes
            } else {
                forwarded[owner] += 1;
                &mut self.outgoing[owner].forward_bytes
            };
            bytes.push(line.len().min(255) as u8);
            bytes.extend_from_slice(&line[..line.len().min(255)]);
        }
        work(self.serving_work_ns, lines as usize);
        work(self.owner_work_ns, own as usize);
        c.order.push_back(batch_id);
        self.batches[batch_id as usize] = Some(Batch {
            client,
            lines,
            waiting: lines,
        });
        if own > 0 {
            self.round_own.push((batch_id, own));
        }
        for (owner, &count) in forwarded.iter().enumerate() {
            if count > 0 {
                self.outgoing[owner].forwards.push((batch_id, count));
            }
        }
        if lines == 0 {
            self.replied.push(client);
        }
        Ok(())
    }

    fn on_frame(&mut self, from: usize, body: &[u8]) -> Result<(), String> {
        let mut reader = Reader { bytes: body };
        while !reader.bytes.is_empty() {
            match reader.u8()? {
                TAG_FORWARD => {
                    let round_forwarded = &mut self.round_forwarded;
                    reader.entries(|batch, lines| round_forwarded.push((from, batch, lines)))?;
                    let bytes = reader.u32()? as usize;
                    let forwarded = reader.take(bytes)?;
                    work(self.owner_work_ns, lines_in(forwarded));
                    self.round_bytes.extend_from_slice(forwarded);
                }
                TAG_ROUND => {
                    let round = reader.u64()?;
                    let bytes = reader.u32()? as usize;
                    work(self.follower_work_ns, lines_in(reader.take(bytes)?));
                    reader.entries(|batch, lines| self.answer(batch, lines))?;
                    for _ in 0..reader.u32()? {
                        let to = reader.u8()? as usize;
                        let relayed = &mut self
                            .outgoing
                            .get_mut(to)
                            .ok_or_else(|| format!("relay to unknown node {to}"))?
                            .answers;
                        reader.entries(|batch, lines| relayed.push((batch, lines)))?;
                    }
                    self.outgoing[from].ack = Some(round);
                }
                TAG_ACK => {
                    let acked = reader.u64()?;
                    while let Some(round) = self.rounds.pop_front() {
                        if round.id > acked {
                            self.rounds.push_front(round);
                            break;
                        }
                        for (batch, lines) in round.own {
                            self.answer(batch, lines);
                        }
                    }
                }
                TAG_ANSWERS => reader.entries(|batch, lines| self.answer(batch, lines))?,
                other => return Err(format!("unknown section tag {other}")),
            }
        }
        Ok(())
    }

    /// Ends a turn: closes the round, writes one frame per peer, then the
    /// replies of every client whose leading batches are all answered.
    fn flush(&mut self) -> Result<(), String> {
        let mut frames: Vec<Vec<u8>> = vec![Vec::new(); self.nodes];
        for (peer, out) in self.outgoing.iter_mut().enumerate() {
            let frame = &mut frames[peer];
            if !out.forwards.is_empty() {
                frame.push(TAG_FORWARD);
                put_entries(frame, &out.forwards);
                frame.extend_from_slice(&(out.forward_bytes.len() as u32).to_le_bytes());
                frame.extend_from_slice(&out.forward_bytes);
                out.forwards.clear();
                out.forward_bytes.clear();
            }
            if !out.answers.is_empty() {
                frame.push(TAG_ANSWERS);
                put_entries(frame, &out.answers);
                out.answers.clear();
            }
            if let Some(round) = out.ack.take() {
                frame.push(TAG_ACK);
                frame.extend_from_slice(&round.to_le_bytes());
            }
        }
        if !self.round_own.is_empty() || !self.round_forwarded.is_empty() {
            self.next_round += 1;
            let round = self.next_round;
            let followers: Vec<usize> = followers_of(self.id, self.nodes).collect();
            for (place, &follower) in followers.iter().enumerate() {
                let frame = &mut frames[follower];
                frame.push(TAG_ROUND);
                frame.extend_from_slice(&round.to_le_bytes());
                frame.extend_from_slice(&(self.round_bytes.len() as u32).to_le_bytes());
                frame.extend_from_slice(&self.round_bytes);
                let mine: Vec<(u32, u32)> = self
                    .round_forwarded
                    .iter()
                    .filter(|(from, ..)| *from == follower)
                    .map(|&(_, batch, lines)| (batch, lines))
                    .collect();
                put_entries(frame, &mine);
                // The first follower relays the answers of forwarders that
                // hold no replica.
                let mut relayed: Vec<(usize, Vec<(u32, u32)>)> = Vec::new();
                if place == 0 {
                    for &(from, batch, lines) in &self.round_forwarded {
                        if followers.contains(&from) {
                            continue;
                        }
                        match relayed.iter_mut().find(|(to, _)| *to == from) {
                            Some((_, entries)) => entries.push((batch, lines)),
                            None => relayed.push((from, vec![(batch, lines)])),
                        }
                    }
                }
                frame.extend_from_slice(&(relayed.len() as u32).to_le_bytes());
                for (to, entries) in relayed {
                    frame.push(to as u8);
                    put_entries(frame, &entries);
                }
            }
            self.rounds.push_back(Round {
                id: round,
                own: std::mem::take(&mut self.round_own),
            });
            self.round_forwarded.clear();
            self.round_bytes.clear();
        }
        for (peer, body) in frames.into_iter().enumerate() {
            if body.is_empty() {
                continue;
            }
            let pending = &mut self.out_pending[peer];
            pending.extend_from_slice(&(body.len() as u32).to_le_bytes());
            pending.extend_from_slice(&body);
            self.write_peer(peer)?;
        }
        let mut replied = std::mem::take(&mut self.replied);
        replied.sort_unstable();
        replied.dedup();
        for &client in &replied {
            self.reply(client);
        }
        replied.clear();
        self.replied = replied;
        Ok(())
    }

    fn write_peer(&mut self, peer: usize) -> Result<(), String> {
        let stream = self.outs[peer].as_mut().ok_or("no link")?;
        let pending = &mut self.out_pending[peer];
        let mut written = 0;
        while written < pending.len() {
            match stream.write(&pending[written..]) {
                Ok(0) => return Err(format!("peer {} closed", peer + 1)),
                Ok(n) => written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("peer {}: {e}", peer + 1)),
            }
        }
        pending.drain(..written);
        Ok(())
    }

    fn reply(&mut self, client: usize) {
        let Some(c) = self.clients[client].as_mut() else {
            return;
        };
        while let Some(&front) = c.order.front() {
            let Some(b) = self.batches[front as usize].as_ref() else {
                c.order.pop_front();
                continue;
            };
            if b.waiting > 0 {
                break;
            }
            for _ in 0..b.lines {
                c.write.extend_from_slice(REPLY);
            }
            self.batches[front as usize] = None;
            self.free_batches.push(front);
            c.order.pop_front();
        }
        write_client(c);
    }
}

fn write_client(c: &mut Client) {
    let mut written = 0;
    while written < c.write.len() {
        match c.stream.write(&c.write[written..]) {
            Ok(0) => {
                c.open = false;
                break;
            }
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => {
                c.open = false;
                break;
            }
        }
    }
    c.write.drain(..written);
}

/// Reads what a socket holds into `buf`, through `scratch` (zeroed once
/// per node, not per read: a read costs what it copies); false once the
/// peer closed it.
fn read_into(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    scratch: &mut [u8],
) -> std::io::Result<bool> {
    loop {
        match stream.read(scratch) {
            Ok(0) => return Ok(false),
            Ok(n) => {
                buf.extend_from_slice(&scratch[..n]);
                // A short read drained the socket: with edge-triggered
                // readiness the next bytes raise a new event, so no second
                // read to find it empty (tokio reads the same way).
                if n < scratch.len() {
                    return Ok(true);
                }
            }
            Err(e) => match e.kind() {
                ErrorKind::WouldBlock => return Ok(true),
                ErrorKind::Interrupted => {}
                _ => return Err(e),
            },
        }
    }
}

fn main() {
    if let Err(why) = run(Args::parse()) {
        eprintln!("tollgate-mesh-floor: {why}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    let nodes = args.peers.len();
    if args.id == 0 || args.id > nodes {
        return Err(format!(
            "--id {} is not a place in --peers (1 to {nodes})",
            args.id
        ));
    }
    if !(2..=255).contains(&nodes) {
        return Err(format!("--peers names {nodes} nodes: 2 to 255"));
    }
    let me = args.id - 1;
    let mut poll = Poll::new().map_err(|e| e.to_string())?;
    let mut clients_listener =
        TcpListener::bind(args.listen).map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let mut peer_listener = TcpListener::bind(args.peers[me])
        .map_err(|e| format!("peer address {}: {e}", args.peers[me]))?;
    poll.registry()
        .register(&mut clients_listener, CLIENT_LISTENER, Interest::READABLE)
        .map_err(|e| e.to_string())?;
    poll.registry()
        .register(&mut peer_listener, PEER_LISTENER, Interest::READABLE)
        .map_err(|e| e.to_string())?;
    let mut node = Node {
        id: me,
        nodes,
        serving_work_ns: args.serving_work_ns,
        owner_work_ns: args.owner_work_ns,
        follower_work_ns: args.follower_work_ns,
        batches: Vec::new(),
        free_batches: Vec::new(),
        clients: Vec::new(),
        outs: (0..nodes).map(|_| None).collect(),
        out_pending: vec![Vec::new(); nodes],
        ins: Vec::new(),
        outgoing: (0..nodes).map(|_| Outgoing::default()).collect(),
        round_own: Vec::new(),
        round_forwarded: Vec::new(),
        round_bytes: Vec::new(),
        next_round: 0,
        rounds: VecDeque::new(),
        replied: Vec::new(),
        scratch: vec![0; READ_CHUNK_BYTES],
    };
    // Dial every peer (a link carries this node's frames one way; the
    // peer's frames come on the connection it dialed), naming this node.
    let deadline = Instant::now() + Duration::from_millis(args.connect_timeout_ms);
    for (peer, &addr) in args.peers.iter().enumerate() {
        if peer == me {
            continue;
        }
        let stream = loop {
            match std::net::TcpStream::connect(addr) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(format!("peer {} at {addr}: {e}", peer + 1)),
            }
        };
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        (&stream)
            .write_all(&[me as u8])
            .map_err(|e| e.to_string())?;
        stream.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut stream = TcpStream::from_std(stream);
        poll.registry()
            .register(&mut stream, Token(FIRST_OUT + peer), Interest::WRITABLE)
            .map_err(|e| e.to_string())?;
        node.outs[peer] = Some(stream);
    }
    let mut in_from: Vec<Option<usize>> = Vec::new();
    let mut events = Events::with_capacity(1024);
    loop {
        poll.poll(&mut events, None).map_err(|e| e.to_string())?;
        for event in events.iter() {
            match event.token() {
                CLIENT_LISTENER => loop {
                    match clients_listener.accept() {
                        Ok((mut stream, _)) => {
                            let _ = stream.set_nodelay(true);
                            let slot = node
                                .clients
                                .iter()
                                .position(Option::is_none)
                                .unwrap_or_else(|| {
                                    node.clients.push(None);
                                    node.clients.len() - 1
                                });
                            poll.registry()
                                .register(
                                    &mut stream,
                                    Token(FIRST_CLIENT + slot),
                                    Interest::READABLE | Interest::WRITABLE,
                                )
                                .map_err(|e| e.to_string())?;
                            node.clients[slot] = Some(Client {
                                stream,
                                read: Vec::new(),
                                order: VecDeque::new(),
                                write: Vec::new(),
                                open: true,
                            });
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) => return Err(format!("accepting a client: {e}")),
                    }
                },
                PEER_LISTENER => loop {
                    match peer_listener.accept() {
                        Ok((mut stream, _)) => {
                            let _ = stream.set_nodelay(true);
                            let token = Token(FIRST_PEER_IN + node.ins.len());
                            poll.registry()
                                .register(&mut stream, token, Interest::READABLE)
                                .map_err(|e| e.to_string())?;
                            node.ins.push((stream, Vec::new()));
                            in_from.push(None);
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) => return Err(format!("accepting a peer: {e}")),
                    }
                },
                Token(t) if t >= FIRST_CLIENT => {
                    let slot = t - FIRST_CLIENT;
                    let open = match node.clients[slot].as_mut() {
                        Some(c) => {
                            if event.is_writable() {
                                write_client(c);
                            }
                            read_into(&mut c.stream, &mut c.read, &mut node.scratch)
                                .unwrap_or(false)
                                && c.open
                        }
                        None => continue,
                    };
                    let open = match node.on_client_bytes(slot) {
                        Ok(()) => open,
                        Err(why) => {
                            eprintln!("tollgate-mesh-floor: dropping a client: {why}");
                            false
                        }
                    };
                    if !open {
                        // Its batches' ids are not reused: an answer still
                        // on its way must not count for another batch.
                        node.clients[slot] = None;
                    }
                }
                Token(t) if t >= FIRST_OUT => {
                    if event.is_writable() {
                        node.write_peer(t - FIRST_OUT)?;
                    }
                }
                Token(t) => {
                    let index = t - FIRST_PEER_IN;
                    let (stream, buf) = &mut node.ins[index];
                    if !read_into(stream, buf, &mut node.scratch).map_err(|e| e.to_string())? {
                        return Err("a peer closed its link".into());
                    }
                    let mut buf = std::mem::take(buf);
                    let mut at = 0;
                    if in_from[index].is_none() && !buf.is_empty() {
                        in_from[index] = Some(buf[0] as usize);
                        at = 1;
                    }
                    let from = in_from[index].unwrap_or(0);
                    while buf.len() >= at + 4 {
                        let mut len_bytes = [0u8; 4];
                        len_bytes.copy_from_slice(&buf[at..at + 4]);
                        let len = u32::from_le_bytes(len_bytes) as usize;
                        if len > FRAME_BYTES_MAX {
                            return Err(format!(
                                "a peer frame of {len} bytes (most {FRAME_BYTES_MAX})"
                            ));
                        }
                        if buf.len() < at + 4 + len {
                            break;
                        }
                        node.on_frame(from, &buf[at + 4..at + 4 + len])?;
                        at += 4 + len;
                    }
                    buf.drain(..at);
                    node.ins[index].1 = buf;
                }
            }
        }
        node.flush()?;
        for c in node.clients.iter_mut().flatten() {
            if !c.write.is_empty() {
                write_client(c);
            }
        }
    }
}
