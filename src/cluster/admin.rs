//! `tollgate cluster add-node|remove-node`: the operator's side of run-time
//! membership. The request goes to any member's *peer* port (the client
//! port is unauthenticated by design, for divvy compatibility, so it cannot
//! reshape the cluster); that node makes the next member list, pushes it to
//! every node and says how many shards will move. The moves themselves run
//! in the background on the shards' leaders; `tollgate cluster status` shows
//! them. Like a peer, the command proves it holds the cluster secret first
//! (`--cluster-secret-file`, or `TOLLGATE_CLUSTER_SECRET`).

use super::auth::{self, PeerSecrets};
use super::codec;
use super::config::NodeAddresses;
use super::wire::{AdminRequest, PeerResponse};
use super::NodeId;
use anyhow::{bail, Context};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Flags shared by the membership commands.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminTarget {
    /// Any member's peer address (HOST:PORT of a `peer =` line).
    #[arg(long, default_value = "127.0.0.1:9321")]
    pub node: String,
    /// How long to wait for the answer, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// The cluster's secret file (as given to `serve`).
    #[arg(long, value_name = "PATH")]
    pub cluster_secret_file: Option<PathBuf>,
    /// The cluster's secret(s), comma-separated; prefer the file.
    #[arg(
        long,
        value_name = "SECRET",
        env = "TOLLGATE_CLUSTER_SECRET",
        hide_env_values = true
    )]
    pub cluster_secret: Option<String>,
}

/// `tollgate cluster add-node`.
#[derive(Debug, Clone, clap::Args)]
pub struct AddNodeArgs {
    /// The new node's id (its `--node-id`).
    pub id: NodeId,
    /// Where the new node serves clients (IP:PORT).
    #[arg(long)]
    pub client: SocketAddr,
    /// Where the new node listens for peers (IP:PORT).
    #[arg(long)]
    pub peer: SocketAddr,
    #[command(flatten)]
    pub target: AdminTarget,
}

/// `tollgate cluster remove-node`.
#[derive(Debug, Clone, clap::Args)]
pub struct RemoveNodeArgs {
    /// The id of the node to remove.
    pub id: NodeId,
    #[command(flatten)]
    pub target: AdminTarget,
}

pub fn add_node_command(args: &AddNodeArgs) -> anyhow::Result<ExitCode> {
    let request = AdminRequest::AddNode {
        id: args.id,
        addresses: NodeAddresses {
            client: args.client,
            peer: args.peer,
        },
    };
    run(&args.target, request)
}

pub fn remove_node_command(args: &RemoveNodeArgs) -> anyhow::Result<ExitCode> {
    run(&args.target, AdminRequest::RemoveNode { id: args.id })
}

fn run(target: &AdminTarget, request: AdminRequest) -> anyhow::Result<ExitCode> {
    let secrets = PeerSecrets::from_flags(
        target.cluster_secret_file.as_deref(),
        target.cluster_secret.as_deref(),
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let timeout = Duration::from_millis(target.timeout_ms.max(1));
    let answer = runtime.block_on(async {
        tokio::time::timeout(timeout, send(&target.node, &secrets, request))
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "{} did not answer within {} ms",
                    target.node,
                    timeout.as_millis()
                )
            })?
    })?;
    match answer {
        Ok(done) => {
            println!("{done}");
            Ok(ExitCode::SUCCESS)
        }
        Err(why) => {
            eprintln!("tollgate: refused: {why}");
            Ok(ExitCode::FAILURE)
        }
    }
}

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
        .with_context(|| format!("{node} did not accept the cluster secret"))?;
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
