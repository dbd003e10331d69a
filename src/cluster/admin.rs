//! `tollgate cluster add-node|remove-node|reload`: the operator's side of
//! run-time membership and cluster-wide rule changes. The request goes to
//! any member's *peer* port (the client port is unauthenticated by design,
//! for divvy compatibility, so it cannot reshape the cluster). For
//! membership, that node makes the next member list, pushes it to every
//! node and says how many shards will move; the moves themselves run in the
//! background on the shards' leaders, and `tollgate cluster status` shows
//! them. For a reload, that node has every member check the rule file's
//! text, then commits it on all of them (`committed_rules.rs`). Like a peer,
//! the command proves it holds the cluster secret first
//! (`--cluster-secret-file`, or `TOLLGATE_CLUSTER_SECRET`).

use super::auth::{self, PeerSecrets};
use super::codec;
use super::wire::{AdminRequest, PeerResponse};
use anyhow::{bail, Context};
use tokio::io::AsyncWriteExt;

/// Sends one operator request to a peer port and reads its answer.
pub async fn send(
    node: &str,
    secrets: &PeerSecrets,
    request: AdminRequest,
) -> anyhow::Result<Result<String, String>> {
    let mut stream = tokio::net::TcpStream::connect(node)
        .await
        .with_context(|| format!("cannot connect to the peer port {node}"))?;
    auth::authenticate_client(&mut stream, secrets)
        .await
        .map_err(|error| match error {
            auth::AuthError::Incompatible(why) => anyhow::anyhow!("{node}: {why}"),
            other => anyhow::anyhow!("{node} did not accept the cluster secret: {other}"),
        })?;
    let mut out = Vec::new();
    codec::encode_frame(&mut out, 1, &super::wire::PeerRequest::Admin(request))?;
    stream.write_all(&out).await?;
    let mut buf = Vec::new();
    let (_, response): (u64, PeerResponse) = codec::read_frame(&mut stream, &mut buf)
        .await
        .with_context(|| format!("no answer from {node}"))?;
    match response {
        PeerResponse::Admin(outcome) => Ok(outcome),
        PeerResponse::Refused(why) => Ok(Err(why)),
        other => bail!("{node} answered {other:?}"),
    }
}
