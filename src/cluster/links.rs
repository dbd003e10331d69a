//! Outgoing peer connections: one persistent TCP connection per peer node,
//! carrying this node's control calls to the peer (every shard group's Raft
//! RPCs, status queries, collections, syncs), multiplexed by request id and
//! answered on the same connection in any order, and this node's data
//! stream to the peer (the peer's [`PeerOut`]: forwarded hits, answers,
//! rounds, acks). Whenever the writer wakes, everything queued (calls and
//! the outbox's frame) goes out in one write; with nothing to send for a
//! beat interval it sends a liveness beat, so peers notice a dead node
//! without per-shard heartbeats.
//!
//! A broken connection fails its calls at once (never a hang), tells the
//! data plane (which drops and answers what waited on it) and is
//! re-established when there is something to send; after a failed connect,
//! calls within [`RECONNECT_BACKOFF_MS`] fail immediately instead of
//! hammering a dead peer. A call that times out keeps its slot until its
//! answer arrives or the connection closes; the peer answers every request,
//! so slots do not pile up.
//!
//! Each link logs its peer's reachability when it changes
//! ([`reachability`]): connected, not connected, or connected but silent
//! for [`SILENT_PEER`].
//!
//! This module also adapts links to openraft's `RaftNetwork` for one shard.

mod reachability;

use super::auth::{self, PeerSecrets};
use super::codec;
use super::committed_rules::ClusterRules;
use super::dataplane::{DataPlane, DataStats, PeerOut};
use super::storage::TollgateRaft;
use super::wire::{Hello, NodeReport, PeerRequest, PeerResponse};
use super::NodeId;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use parking_lot::{Mutex, RwLock};
use reachability::Reachability;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// How long connecting (TCP plus the hello exchange) may take.
pub const CONNECT_TIMEOUT_MS: u64 = 500;
/// After a failed connect, calls fail at once for this long.
pub const RECONNECT_BACKOFF_MS: u64 = 100;
/// A peer that sent nothing (a peer beats every `--raft-heartbeat-ms`) for
/// this long on an open connection is logged as unreachable. Well above the
/// liveness timeout that moves leadership (0.6 s by default), so that a
/// loaded machine's pauses are not reported.
const SILENT_PEER: Duration = Duration::from_secs(3);
/// Shortest wait for a Raft RPC's answer. openraft asks for the heartbeat
/// interval, which a busy follower can miss while the answer is on its way;
/// treating that as a failure only resends the same entries.
const RAFT_RPC_TIMEOUT_FLOOR_MS: u64 = 1_000;
/// Bytes gathered into one write at most (a batch of queued calls).
const WRITE_BATCH_BYTES_MAX: usize = 1024 * 1024;

#[derive(Debug, Clone, thiserror::Error)]
pub enum LinkError {
    #[error("node {0} unreachable: {1}")]
    Unreachable(NodeId, String),
    #[error("node {0} refused us: {1}")]
    Refused(NodeId, String),
    /// The peer handshake failed: the two nodes' cluster secrets differ.
    #[error("{1}")]
    Unauthenticated(NodeId, String),
    #[error("node {0} did not answer within {1} ms")]
    Timeout(NodeId, u64),
    #[error("connection to node {0} lost: {1}")]
    Lost(NodeId, String),
    #[error("cannot send to node {0}: {1}")]
    Encode(NodeId, String),
}

type Reply = oneshot::Sender<Result<PeerResponse, LinkError>>;

struct Call {
    request: PeerRequest,
    reply: Reply,
}

/// The connection to one peer, used from any thread or runtime.
pub struct PeerLink {
    pub target: NodeId,
    pub addr: SocketAddr,
    calls: mpsc::UnboundedSender<Call>,
    /// The peer's answer to our last hello (what it knew when we connected).
    last_hello: Mutex<Option<Result<NodeReport, String>>>,
}

impl PeerLink {
    /// Creates the link and its task on `runtime`; nothing connects until the
    /// first call.
    pub fn spawn(
        target: NodeId,
        addr: SocketAddr,
        greeting: Greeting,
        secrets: Arc<PeerSecrets>,
        runtime: &tokio::runtime::Handle,
        data: Arc<DataPlane>,
        beat_ms: u64,
    ) -> Arc<PeerLink> {
        let (calls, receiver) = mpsc::unbounded_channel();
        let link = Arc::new(PeerLink {
            target,
            addr,
            calls,
            last_hello: Mutex::new(None),
        });
        runtime.spawn(run_link(
            Arc::downgrade(&link),
            LinkTarget {
                id: target,
                addr,
                greeting,
                secrets,
                data,
                beat: Duration::from_millis(beat_ms.max(1)),
            },
            receiver,
        ));
        link
    }

    /// Sends a request and waits for its answer, at most `timeout_ms`.
    pub async fn call(
        &self,
        request: PeerRequest,
        timeout_ms: u64,
    ) -> Result<PeerResponse, LinkError> {
        let (reply, answer) = oneshot::channel();
        if self.calls.send(Call { request, reply }).is_err() {
            return Err(LinkError::Lost(self.target, "link closed".into()));
        }
        match tokio::time::timeout(Duration::from_millis(timeout_ms), answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(LinkError::Lost(self.target, "call dropped".into())),
            Err(_) => Err(LinkError::Timeout(self.target, timeout_ms)),
        }
    }

    /// The peer's answer to our last hello, if we connected at least once.
    pub fn last_hello(&self) -> Option<Result<NodeReport, String>> {
        self.last_hello.lock().clone()
    }
}

fn fail_all(receiver: &mut mpsc::UnboundedReceiver<Call>, first: Option<Call>, error: &LinkError) {
    if let Some(call) = first {
        let _ = call.reply.send(Err(error.clone()));
    }
    while let Ok(call) = receiver.try_recv() {
        let _ = call.reply.send(Err(error.clone()));
    }
}

/// Who a link talks to, and how.
struct LinkTarget {
    id: NodeId,
    addr: SocketAddr,
    greeting: Greeting,
    secrets: Arc<PeerSecrets>,
    data: Arc<DataPlane>,
    beat: Duration,
}

/// What a link says in its hello: this node's identity, and the rule set
/// in force when it connects (a reload changes it).
#[derive(Clone)]
pub struct Greeting {
    pub hello: Hello,
    pub rules: Arc<ClusterRules>,
}

impl Greeting {
    fn hello(&self) -> Hello {
        Hello {
            rules: self.rules.tag(),
            ..self.hello.clone()
        }
    }
}

async fn run_link(
    link: std::sync::Weak<PeerLink>,
    target: LinkTarget,
    mut receiver: mpsc::UnboundedReceiver<Call>,
) {
    let out = target.data.out(target.id);
    let mut last_failure: Option<(Instant, LinkError)> = None;
    let mut reach = Reachability::new(target.id, target.addr);
    // Why the last connection ended, for the line saying the peer is down.
    let mut lost: Option<String> = None;
    loop {
        // Connect when there is something to say: a call, data, or a beat.
        let first = tokio::select! {
            call = receiver.recv() => match call {
                Some(call) => Some(call),
                None => return,
            },
            _ = out.wake.notified() => None,
            _ = tokio::time::sleep(target.beat) => None,
        };
        if link.strong_count() == 0 {
            return;
        }
        if let Some((at, error)) = &last_failure {
            if at.elapsed() < Duration::from_millis(RECONNECT_BACKOFF_MS) {
                fail_all(&mut receiver, first, error);
                continue;
            }
        }
        let connected = tokio::time::timeout(
            Duration::from_millis(CONNECT_TIMEOUT_MS),
            connect(
                target.id,
                target.addr,
                &target.greeting.hello(),
                &target.secrets,
            ),
        )
        .await
        .unwrap_or_else(|_| {
            Err(LinkError::Unreachable(
                target.id,
                format!("no hello within {CONNECT_TIMEOUT_MS} ms"),
            ))
        });
        if let Some(link) = link.upgrade() {
            *link.last_hello.lock() = Some(match &connected {
                Ok((_, report, _)) => Ok(report.clone()),
                Err(error) => Err(error.to_string()),
            });
        }
        match connected {
            Err(error) => {
                let why = match lost.take() {
                    Some(lost) => format!("connection lost ({lost}), then {error}"),
                    None => error.to_string(),
                };
                reach.down(&why);
                fail_all(&mut receiver, first, &error);
                last_failure = Some((Instant::now(), error));
            }
            Ok((stream, _report, minor)) => {
                last_failure = None;
                reach.up();
                target.data.peer_connected(target.id, minor);
                let why =
                    serve_connection(&target, stream, first, &mut receiver, &out, &mut reach).await;
                tracing::debug!(peer = target.id, addr = %target.addr, "peer connection lost: {why}");
                target.data.peer_disconnected(target.id, &why);
                lost = Some(why);
            }
        }
    }
}

/// Notes, on each beat of an open connection, whether the peer still
/// speaks: a peer heard from before that has sent nothing (not even a
/// beat) for [`SILENT_PEER`] is unreachable though the connection is open
/// (its links blackholed, its process frozen); one never heard from yet
/// (a node that is not a member yet) counts as reachable.
fn note_silence(reach: &mut Reachability, out: &PeerOut, connected_at: Instant) {
    let limit_ms = SILENT_PEER.as_millis() as u64;
    let silent = connected_at.elapsed() >= SILENT_PEER
        && out.heard_within(u64::MAX)
        && !out.heard_within(limit_ms);
    if silent {
        reach.down(&format!(
            "the connection is open, but nothing was heard from it for {} s",
            SILENT_PEER.as_secs()
        ));
    } else {
        reach.up();
    }
}

/// Connects, authenticates (both ways) and exchanges hellos; the peer
/// refuses a mismatched hello. Returns the stream, the peer's report and
/// the peer protocol minor the two nodes talk at.
async fn connect(
    target: NodeId,
    addr: SocketAddr,
    hello: &Hello,
    secrets: &PeerSecrets,
) -> Result<(TcpStream, NodeReport, u8), LinkError> {
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|error| LinkError::Unreachable(target, error.to_string()))?;
    let _ = stream.set_nodelay(true);
    let minor = auth::authenticate_client(&mut stream, secrets)
        .await
        .map_err(|error| auth::link_error(target, addr, error))?;
    let mut out = Vec::new();
    codec::encode_frame(&mut out, 0, &PeerRequest::Hello(hello.clone()))
        .map_err(|error| LinkError::Encode(target, error.to_string()))?;
    stream
        .write_all(&out)
        .await
        .map_err(|error| LinkError::Unreachable(target, error.to_string()))?;
    let mut buf = Vec::new();
    let (_, response): (u64, PeerResponse) = codec::read_frame(&mut stream, &mut buf)
        .await
        .map_err(|error| LinkError::Unreachable(target, error.to_string()))?;
    match response {
        PeerResponse::Hello(report) => Ok((stream, report, minor)),
        PeerResponse::Refused(why) => Err(LinkError::Refused(target, why)),
        other => Err(LinkError::Refused(
            target,
            format!("unexpected answer to hello: {other:?}"),
        )),
    }
}

type Pending = Arc<Mutex<HashMap<u64, Reply>>>;

fn fail_pending(pending: &Pending, error: &LinkError) {
    for (_, reply) in pending.lock().drain() {
        let _ = reply.send(Err(error.clone()));
    }
}

/// Runs one connection until it breaks: writes queued calls and the data
/// outbox in one write per wake-up, and beats when idle; a reader task
/// answers calls by id. Returns why it ended.
async fn serve_connection(
    target: &LinkTarget,
    stream: TcpStream,
    first: Option<Call>,
    receiver: &mut mpsc::UnboundedReceiver<Call>,
    out: &PeerOut,
    reach: &mut Reachability,
) -> String {
    let peer = target.id;
    let connected_at = Instant::now();
    let (read_half, mut write_half) = stream.into_split();
    let pending: Pending = Arc::default();
    let reader_pending = Arc::clone(&pending);
    let mut reader = tokio::spawn(async move {
        let mut read_half = BufReader::with_capacity(64 * 1024, read_half);
        let mut buf = Vec::new();
        loop {
            let (id, response) =
                match codec::read_frame::<PeerResponse>(&mut read_half, &mut buf).await {
                    Ok(frame) => frame,
                    Err(error) => return error.to_string(),
                };
            let reply = reader_pending.lock().remove(&id);
            if let Some(reply) = reply {
                let _ = reply.send(Ok(response));
            }
        }
    });
    let stats = &target.data.stats;
    let mut beat = super::cadence::interval(target.beat);
    let mut next_id: u64 = 1;
    let mut buf = Vec::new();
    let mut next_call = first;
    let mut wrote_since_beat = false;
    let lost = loop {
        let mut beat_due = false;
        if next_call.is_none() {
            tokio::select! {
                call = receiver.recv() => match call {
                    Some(call) => next_call = Some(call),
                    None => break "link closed".to_string(),
                },
                _ = out.wake.notified() => {}
                _ = beat.tick() => {
                    beat_due = !wrote_since_beat;
                    wrote_since_beat = false;
                    note_silence(reach, out, connected_at);
                }
                ended = &mut reader => break ended.unwrap_or_else(|e| e.to_string()),
            }
        }
        // Let the tasks woken with this one (connections forwarding their
        // read batches, frame readers) add to the outbox first, then go
        // behind them once more: the replicator, woken with them, itself
        // waits once behind them before it closes the round, and the round
        // then goes out in this write, not in a second one (strict mode: 5 %
        // fewer system calls per hit, docs/benchmarks.md, "Twentieth round").
        super::cadence::behind_woken_tasks().await;
        super::cadence::behind_woken_tasks().await;
        buf.clear();
        let mut frames = 0u64;
        let mut queue = |call: Call, buf: &mut Vec<u8>| {
            let id = next_id;
            next_id += 1;
            match codec::encode_frame(buf, id, &call.request) {
                Ok(()) => {
                    pending.lock().insert(id, call.reply);
                }
                Err(error) => {
                    let _ = call
                        .reply
                        .send(Err(LinkError::Encode(peer, error.to_string())));
                }
            }
        };
        if let Some(call) = next_call.take() {
            queue(call, &mut buf);
            frames += 1;
        }
        while buf.len() < WRITE_BATCH_BYTES_MAX {
            match receiver.try_recv() {
                Ok(call) => {
                    queue(call, &mut buf);
                    frames += 1;
                }
                Err(_) => break,
            }
        }
        let data = out.take_frame();
        // The frame may acknowledge states: they are written out first.
        if let (Some(_), Some(disk)) = (&data, &target.data.disk) {
            disk.write_pending();
        }
        if data.is_none() && beat_due && buf.is_empty() {
            buf.extend_from_slice(&PeerOut::beat_frame());
            frames += 1;
        }
        let written = match data {
            // Nothing else to say: the outbox's frame goes out as it is.
            Some(frame) if buf.is_empty() => {
                let bytes = frame.len();
                let result = write_half.write_all(&frame).await;
                out.give_back(frame);
                result.map(|()| bytes)
            }
            Some(frame) => {
                buf.extend_from_slice(&frame);
                out.give_back(frame);
                frames += 1;
                write_half.write_all(&buf).await.map(|()| buf.len())
            }
            None if buf.is_empty() => continue,
            None => write_half.write_all(&buf).await.map(|()| buf.len()),
        };
        let bytes = match written {
            Ok(bytes) => bytes,
            Err(error) => break error.to_string(),
        };
        wrote_since_beat = true;
        DataStats::add(&stats.writes, 1);
        DataStats::add(&stats.frames_written, frames.max(1));
        DataStats::add(&stats.bytes_written, bytes as u64);
    };
    reader.abort();
    fail_pending(&pending, &LinkError::Lost(peer, lost.clone()));
    lost
}

/// All links of a node, by peer id. Links are made when a peer first
/// matters (a member at start-up, a node added at run time, a replica a
/// shard group's membership names) and kept while the process runs.
pub struct Links {
    links: RwLock<BTreeMap<NodeId, Arc<PeerLink>>>,
    greeting: Greeting,
    runtime: tokio::runtime::Handle,
    /// Peers dialled somewhere other than their advertised peer address
    /// (`--peer-route`: NAT, tunnels, fault-injection proxies).
    routes: BTreeMap<NodeId, SocketAddr>,
    /// The cluster secret every connection proves first (see `auth.rs`).
    secrets: Arc<PeerSecrets>,
    data: Arc<DataPlane>,
    beat_ms: u64,
}

impl Links {
    pub fn new(
        greeting: Greeting,
        runtime: tokio::runtime::Handle,
        routes: BTreeMap<NodeId, SocketAddr>,
        secrets: Arc<PeerSecrets>,
        data: Arc<DataPlane>,
        beat_ms: u64,
    ) -> Links {
        Links {
            links: RwLock::default(),
            greeting,
            runtime,
            routes,
            secrets,
            data,
            beat_ms,
        }
    }

    pub fn get(&self, peer: NodeId) -> Option<Arc<PeerLink>> {
        self.links.read().get(&peer).cloned()
    }

    /// The link to `peer` (advertised at `advertised`), made if there is
    /// none yet, or remade if the peer's address changed.
    pub fn ensure(&self, peer: NodeId, advertised: SocketAddr) -> Arc<PeerLink> {
        let addr = self.routes.get(&peer).copied().unwrap_or(advertised);
        if let Some(link) = self.get(peer) {
            if link.addr == addr {
                return link;
            }
        }
        let mut links = self.links.write();
        match links.get(&peer) {
            Some(link) if link.addr == addr => Arc::clone(link),
            _ => {
                let link = PeerLink::spawn(
                    peer,
                    addr,
                    self.greeting.clone(),
                    Arc::clone(&self.secrets),
                    &self.runtime,
                    Arc::clone(&self.data),
                    self.beat_ms,
                );
                links.insert(peer, Arc::clone(&link));
                link
            }
        }
    }

    /// Every link, by peer id.
    pub fn all(&self) -> Vec<(NodeId, Arc<PeerLink>)> {
        self.links
            .read()
            .iter()
            .map(|(&peer, link)| (peer, Arc::clone(link)))
            .collect()
    }
}

/// openraft's network factory for one shard group.
pub struct ShardNetworkFactory {
    pub shard: u32,
    pub links: Arc<Links>,
}

impl RaftNetworkFactory<TollgateRaft> for ShardNetworkFactory {
    type Network = ShardNetwork;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> ShardNetwork {
        // The group's membership carries each replica's peer address, so a
        // replica added at run time is reachable before this node has heard
        // of the new member list.
        let link = self.links.get(target).or_else(|| {
            node.addr
                .parse()
                .ok()
                .map(|addr| self.links.ensure(target, addr))
        });
        ShardNetwork {
            shard: self.shard,
            target,
            link,
        }
    }
}

/// openraft's view of one peer, for one shard group.
pub struct ShardNetwork {
    shard: u32,
    target: NodeId,
    link: Option<Arc<PeerLink>>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TransportError(String);

impl ShardNetwork {
    async fn call<E: std::error::Error>(
        &self,
        request: PeerRequest,
        option: &RPCOption,
    ) -> Result<PeerResponse, RPCError<NodeId, BasicNode, E>> {
        let Some(link) = &self.link else {
            return Err(RPCError::Unreachable(Unreachable::new(&TransportError(
                format!("node {} has no known peer address", self.target),
            ))));
        };
        let timeout_ms = (option.hard_ttl().as_millis() as u64).max(RAFT_RPC_TIMEOUT_FLOOR_MS);
        match link.call(request, timeout_ms).await {
            Ok(PeerResponse::Refused(why)) => Err(RPCError::Unreachable(Unreachable::new(
                &TransportError(why),
            ))),
            Ok(response) => Ok(response),
            Err(
                error @ (LinkError::Unreachable(..)
                | LinkError::Refused(..)
                | LinkError::Unauthenticated(..)),
            ) => Err(RPCError::Unreachable(Unreachable::new(&TransportError(
                error.to_string(),
            )))),
            Err(error) => Err(RPCError::Network(NetworkError::new(&TransportError(
                error.to_string(),
            )))),
        }
    }

    fn unexpected<E: std::error::Error>(response: PeerResponse) -> RPCError<NodeId, BasicNode, E> {
        RPCError::Network(NetworkError::new(&TransportError(format!(
            "unexpected answer: {response:?}"
        ))))
    }
}

impl RaftNetwork<TollgateRaft> for ShardNetwork {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TollgateRaft>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let request = PeerRequest::Append {
            shard: self.shard,
            rpc,
        };
        match self.call(request, &option).await? {
            PeerResponse::Append(Ok(response)) => Ok(response),
            PeerResponse::Append(Err(error)) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, error)))
            }
            other => Err(Self::unexpected(other)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TollgateRaft>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        let request = PeerRequest::Snapshot {
            shard: self.shard,
            rpc,
        };
        match self.call(request, &option).await? {
            PeerResponse::Snapshot(Ok(response)) => Ok(response),
            PeerResponse::Snapshot(Err(error)) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, error)))
            }
            other => Err(Self::unexpected(other)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let request = PeerRequest::Vote {
            shard: self.shard,
            rpc,
        };
        match self.call(request, &option).await? {
            PeerResponse::Vote(Ok(response)) => Ok(response),
            PeerResponse::Vote(Err(error)) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, error)))
            }
            other => Err(Self::unexpected(other)),
        }
    }
}
