//! The peer port: every connection proves the cluster secret (`auth.rs`),
//! then says hello (a node whose layout or consistency differs, or whose
//! rules differ at the same committed rules version, is refused), then
//! streams frames. Data frames are handled inline, in order, on the
//! connection's task (`dataplane.rs`); control requests run as tasks of
//! their own (Raft RPCs may wait) and are answered on the same connection
//! by one writer. Anything heard from a peer counts as a sign of life for
//! the failure detector.

use super::auth::{self, PeerSecrets};
use super::codec;
use super::data_frames::DATA_FRAME_ID;
use super::dataplane::DataStats;
use super::node::ClusterNode;
use super::wire::{Hello, PeerRequest, PeerResponse};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// The warning about refused handshakes is logged at most this often.
const HANDSHAKE_REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Handshakes in progress at most: a connection accepted beyond it is
/// closed at once (and counted), so a flood of connections that never
/// authenticate holds at most this many sockets and tasks for at most
/// [`auth::AUTH_TIMEOUT_MS`] each. Established peer connections are not
/// affected, and a refused peer dials again.
pub const PEER_HANDSHAKES_MAX: usize = 64;

/// Serves the peer port until the process ends.
pub async fn serve_peers(listener: TcpListener, node: Arc<ClusterNode>, secrets: Arc<PeerSecrets>) {
    let handshakes = Arc::new(Semaphore::new(PEER_HANDSHAKES_MAX));
    let mut refusals_logged_at: Option<Instant> = None;
    loop {
        match listener.accept().await {
            Ok((stream, remote)) => {
                let Ok(handshake) = Arc::clone(&handshakes).try_acquire_owned() else {
                    drop(stream);
                    DataStats::add(&node.dp.stats.handshakes_refused, 1);
                    if refusals_logged_at
                        .is_none_or(|at| at.elapsed() >= HANDSHAKE_REFUSAL_LOG_INTERVAL)
                    {
                        refusals_logged_at = Some(Instant::now());
                        tracing::warn!(
                            "closing peer connections at once: {PEER_HANDSHAKES_MAX} handshakes in progress (latest from {remote}); tollgate_cluster_peer_handshakes_refused_total counts them"
                        );
                    }
                    continue;
                };
                let secrets = Arc::clone(&secrets);
                tokio::spawn(serve_peer(
                    stream,
                    remote,
                    Arc::clone(&node),
                    secrets,
                    handshake,
                ));
            }
            Err(error) => {
                tracing::warn!(%error, "peer accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Checks a peer's hello against ours; `Err` says why it is refused.
///
/// Rules: two nodes serving the same committed version must serve the
/// same rules (at version 0, the rule files they started with must be
/// identical). Nodes at different versions talk: the one behind takes the
/// newer set from its peers (`committed_rules.rs`) before it serves, when
/// it starts, or within a poll when it runs.
fn check_hello(ours: &Hello, theirs: &Hello) -> Result<(), String> {
    let (mine, other) = (&ours.rules, &theirs.rules);
    let same_version = (mine.version, mine.origin) == (other.version, other.origin);
    if same_version && mine.fingerprint != other.fingerprint {
        let remedy = if mine.version == 0 {
            "the rule file must be identical on every node when a cluster starts (change rules later with `tollgate cluster reload FILE`)"
        } else {
            "two nodes disagree on a committed rule set"
        };
        return Err(format!(
            "rules differ: node {} has rules fingerprint {:016x}, node {} has {:016x} (both at rules version {}); {remedy}",
            theirs.node_id, other.fingerprint, ours.node_id, mine.fingerprint, mine.version
        ));
    }
    if theirs.layout_fingerprint != ours.layout_fingerprint {
        return Err(format!(
            "cluster layouts differ between node {} and node {}; the [cluster] section (shards, replicas, placement) must be identical on every node",
            theirs.node_id, ours.node_id
        ));
    }
    if theirs.consistency != ours.consistency {
        return Err(format!(
            "consistency differs: node {} runs {}, node {} runs {}",
            theirs.node_id, theirs.consistency, ours.node_id, ours.consistency
        ));
    }
    if theirs.node_id == ours.node_id {
        return Err(format!("two nodes claim id {}", ours.node_id));
    }
    Ok(())
}

async fn serve_peer(
    mut stream: TcpStream,
    remote: std::net::SocketAddr,
    node: Arc<ClusterNode>,
    secrets: Arc<PeerSecrets>,
    handshake: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let accepted = auth::accept_peer(&mut stream, Some(remote), &secrets).await;
    drop(handshake);
    if !accepted {
        return;
    }
    let (read_half, mut write_half) = stream.into_split();
    let mut read_half = BufReader::with_capacity(64 * 1024, read_half);
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let Ok((id, first)) = codec::read_frame::<PeerRequest>(&mut read_half, &mut buf).await else {
        return;
    };
    let (peer, peer_boot) = match first {
        PeerRequest::Admin(request) => {
            let outcome = node.admin(request).await;
            match &outcome {
                Ok(done) => tracing::info!(node = node.id, "{done}"),
                Err(why) => tracing::warn!(node = node.id, "refused an operator request: {why}"),
            }
            if codec::encode_frame(&mut out, id, &PeerResponse::Admin(outcome)).is_ok() {
                let _ = write_half.write_all(&out).await;
            }
            return;
        }
        PeerRequest::Hello(hello) => match check_hello(&node.current_hello(), &hello) {
            Ok(()) => {
                if codec::encode_frame(&mut out, id, &PeerResponse::Hello(node.report())).is_err()
                    || write_half.write_all(&out).await.is_err()
                {
                    return;
                }
                (hello.node_id, hello.boot_id)
            }
            Err(why) => {
                tracing::error!("refusing a peer connection: {why}");
                if codec::encode_frame(&mut out, id, &PeerResponse::Refused(why)).is_ok() {
                    let _ = write_half.write_all(&out).await;
                }
                return;
            }
        },
        _ => {
            let refusal = PeerResponse::Refused("expected a hello first".into());
            if codec::encode_frame(&mut out, id, &refusal).is_ok() {
                let _ = write_half.write_all(&out).await;
            }
            return;
        }
    };
    let from = node.dp.out(peer);
    from.note_boot(peer_boot);
    from.heard();
    let (answers, mut to_write) = mpsc::unbounded_channel::<(u64, PeerResponse)>();
    let writer = tokio::spawn(async move {
        let mut out = Vec::new();
        while let Some((id, response)) = to_write.recv().await {
            out.clear();
            let mut next = Some((id, response));
            while let Some((id, response)) = next.take() {
                if let Err(error) = codec::encode_frame(&mut out, id, &response) {
                    tracing::warn!(%error, "cannot encode a peer answer");
                }
                if out.len() < 1024 * 1024 {
                    next = to_write.try_recv().ok();
                }
            }
            if write_half.write_all(&out).await.is_err() {
                return;
            }
        }
    });
    loop {
        // A data frame the read buffer holds whole is handled where it lies;
        // anything else (a control frame, a frame split across reads) is
        // copied out first.
        let in_place = match read_half.fill_buf().await {
            Ok([]) => {
                tracing::debug!(peer, "peer connection ended");
                break;
            }
            Ok(buffered) => match codec::whole_frame_at(buffered) {
                Ok(Some((DATA_FRAME_ID, body))) => {
                    let used = body.end;
                    from.heard();
                    if let Err(error) = node.dp.on_data_frame(&from, peer_boot, &buffered[body]) {
                        tracing::warn!(peer, %error, "dropping a peer connection: bad data frame");
                        break;
                    }
                    Some(used)
                }
                Ok(_) => None,
                Err(error) => {
                    tracing::warn!(peer, %error, "dropping a peer connection: bad frame");
                    break;
                }
            },
            Err(error) => {
                tracing::debug!(peer, %error, "peer connection ended");
                break;
            }
        };
        if let Some(used) = in_place {
            read_half.consume(used);
            continue;
        }
        let id = match codec::read_raw_frame(&mut read_half, &mut buf).await {
            Ok(id) => id,
            Err(error) => {
                tracing::debug!(peer, %error, "peer connection ended");
                break;
            }
        };
        from.heard();
        if id == DATA_FRAME_ID {
            if let Err(error) = node.dp.on_data_frame(&from, peer_boot, &buf) {
                tracing::warn!(peer, %error, "dropping a peer connection: bad data frame");
                break;
            }
            continue;
        }
        let request = match codec::decode::<PeerRequest>(&buf) {
            Ok(request) => request,
            Err(error) => {
                tracing::warn!(peer, %error, "dropping a peer connection: bad request");
                break;
            }
        };
        let node = Arc::clone(&node);
        let answers = answers.clone();
        tokio::spawn(async move {
            let response = handle(&node, request).await;
            let _ = answers.send((id, response));
        });
    }
    drop(answers);
    writer.abort();
}

async fn handle(node: &Arc<ClusterNode>, request: PeerRequest) -> PeerResponse {
    let replica = |shard: u32| {
        node.replica(shard)
            .ok_or_else(|| format!("shard {shard} is not replicated on node {}", node.id))
    };
    match request {
        PeerRequest::Hello(_) => PeerResponse::Refused("hello sent twice".into()),
        PeerRequest::Vote { shard, rpc } => match replica(shard) {
            Err(why) => PeerResponse::Refused(why),
            Ok(replica) => match replica.may_vote(&rpc) {
                Err(why) => PeerResponse::Refused(why),
                Ok(()) => PeerResponse::Vote(replica.raft.vote(rpc).await),
            },
        },
        PeerRequest::Append { shard, rpc } => match replica(shard) {
            Err(why) => PeerResponse::Refused(why),
            Ok(replica) => PeerResponse::Append(replica.raft.append_entries(rpc).await),
        },
        PeerRequest::Snapshot { shard, rpc } => match replica(shard) {
            Err(why) => PeerResponse::Refused(why),
            Ok(replica) => PeerResponse::Snapshot(replica.raft.install_snapshot(rpc).await),
        },
        PeerRequest::Collect { shard, term } => {
            PeerResponse::Collected(node.collect(shard, term).await)
        }
        PeerRequest::Sync {
            shard,
            term,
            stamped_ms,
            counters,
        } => PeerResponse::Synced(node.dp.apply_sync(shard, term, stamped_ms, &counters)),
        PeerRequest::Status => PeerResponse::Status(node.report()),
        PeerRequest::Members(members) => {
            node.adopt(&members);
            PeerResponse::Members((*node.members()).clone())
        }
        PeerRequest::Elect { shard } => match replica(shard) {
            Err(why) => PeerResponse::Refused(why),
            Ok(replica) if replica.recovering() => {
                PeerResponse::Refused(format!("shard {shard}: this replica is recovering"))
            }
            Ok(replica) => match replica.raft.trigger().elect().await {
                Ok(()) => PeerResponse::Electing,
                Err(error) => PeerResponse::Refused(error.to_string()),
            },
        },
        PeerRequest::Admin(request) => PeerResponse::Admin(node.admin(request).await),
        PeerRequest::RulesPrepare(record) => PeerResponse::RulesChecked(node.rules.check(&record)),
        PeerRequest::RulesCommit(record) => PeerResponse::RulesChecked(node.rules.commit(&record)),
        PeerRequest::Rules => PeerResponse::Rules(node.rules.record()),
    }
}

#[cfg(test)]
mod tests {
    use super::check_hello;
    use crate::cluster::committed_rules::RulesTag;
    use crate::cluster::wire::Hello;

    fn hello(node_id: u64, version: u64, fingerprint: u64) -> Hello {
        Hello {
            node_id,
            rules: RulesTag {
                version,
                origin: u64::from(version > 0),
                fingerprint,
            },
            layout_fingerprint: 1,
            consistency: "strict".into(),
            boot_id: 1,
        }
    }

    #[test]
    fn rules_must_agree_only_at_the_same_version() {
        assert!(check_hello(&hello(1, 0, 7), &hello(2, 0, 7)).is_ok());
        let error = check_hello(&hello(1, 0, 7), &hello(2, 0, 8)).unwrap_err();
        assert!(
            error.contains("rules differ") && error.contains("identical on every node"),
            "{error}"
        );
        // A node behind (or ahead) talks, and takes the newer set.
        assert!(check_hello(&hello(1, 2, 7), &hello(2, 0, 8)).is_ok());
        assert!(check_hello(&hello(1, 0, 7), &hello(2, 3, 9)).is_ok());
        let error = check_hello(&hello(1, 2, 7), &hello(2, 2, 8)).unwrap_err();
        assert!(error.contains("committed rule set"), "{error}");
    }
}
