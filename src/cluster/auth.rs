//! Authentication of the peer port: the cluster's shared secret, where it is
//! read from (`--cluster-secret-file`, `--cluster-secret` or
//! `TOLLGATE_CLUSTER_SECRET`), and the mutual challenge-response handshake
//! that opens every peer connection before its first frame. Only a node that
//! holds the secret can make another node read a frame (a Hello, a Raft RPC,
//! forwarded hits), and a dialer only talks to a peer that holds it too.
//! All of it lives here so that the links and the peer server only call
//! [`authenticate_client`] / [`accept_peer`].
//!
//! The handshake (all sizes fixed, nothing the peer chooses is allocated):
//!
//! 1. dialer → server: [`MAGIC`] (8 bytes), [`VERSION`] (1 byte), its 32-byte
//!    random nonce `c`;
//! 2. server → dialer: its 32-byte random nonce `s`, then
//!    `HMAC-SHA256(secret, "tollgate-peer-server" ‖ version ‖ c ‖ s)`;
//! 3. dialer → server: if the server's proof verified under one of the
//!    dialer's secrets, `HMAC-SHA256(secret, "tollgate-peer-client" ‖
//!    version ‖ s ‖ c)`; otherwise 32 zero bytes (a proof that matches
//!    nothing, so the server logs the refusal too) and the dialer hangs up;
//! 4. server → dialer: one verdict byte, [`ACCEPTED`] or [`REFUSED`] (so the
//!    dialer can say that the peer refused its secret rather than vanished).
//!
//! Proofs are compared in constant time. Each side signs with its first
//! secret and accepts any of its secrets, which is how the secret rotates
//! without downtime (docs/cluster.md, "Security of the peer port"). A
//! connection that does not start with [`MAGIC`] is closed without a byte
//! in answer. The handshake proves possession of the secret; it does not
//! encrypt what follows.

use super::links::LinkError;
use super::{ClusterError, NodeId};
use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First bytes of every peer connection.
pub const MAGIC: [u8; 8] = *b"TGPEER\r\n";
/// Version of the handshake (and of the peer protocol behind it). 2: data
/// frames carry droplet buckets (a forwarded op code, a decision code and a
/// counter state of their own), which a node of version 1 cannot read.
pub const VERSION: u8 = 2;
/// Bytes of each side's random nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of an HMAC-SHA256 proof.
pub const PROOF_BYTES: usize = 32;
/// The server's verdict after checking the dialer's proof.
pub const ACCEPTED: u8 = 1;
pub const REFUSED: u8 = 0;
/// How long the server gives a dialer to complete the handshake.
pub const AUTH_TIMEOUT_MS: u64 = 2_000;
/// Shortest secret accepted, in bytes.
pub const SECRET_BYTES_MIN: usize = 16;
/// A refused remote address is logged at most once per this interval.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

const SERVER_LABEL: &[u8] = b"tollgate-peer-server";
const CLIENT_LABEL: &[u8] = b"tollgate-peer-client";

type HmacSha256 = Hmac<Sha256>;

/// One shared secret; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes redacted>)", self.0.len())
    }
}

/// The secrets of this node, in order: the first signs, every one is
/// accepted (several only while rotating).
#[derive(Debug, Clone)]
pub struct PeerSecrets {
    secrets: Vec<Secret>,
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "cluster mode needs the cluster's shared secret, the same on every node: give \
         --cluster-secret-file PATH (or --cluster-secret / TOLLGATE_CLUSTER_SECRET). For a \
         new cluster make one with `head -c 32 /dev/urandom | base64 > \
         /etc/tollgate/cluster.secret && chmod 600 /etc/tollgate/cluster.secret` and copy \
         it to every node"
    )]
    Missing,
    #[error(
        "give either --cluster-secret-file or --cluster-secret (TOLLGATE_CLUSTER_SECRET), not both"
    )]
    Both,
    #[error("cannot read the cluster secret file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the cluster secret file {0} holds no secret (one per line; blank lines and # comments are ignored)")]
    EmptyFile(PathBuf),
    #[error("{path} line {line}: the cluster secret is {len} bytes; use at least {SECRET_BYTES_MIN} (e.g. head -c 32 /dev/urandom | base64)")]
    TooShortInFile {
        path: PathBuf,
        line: usize,
        len: usize,
    },
    #[error("--cluster-secret / TOLLGATE_CLUSTER_SECRET: secret {index} is {len} bytes; use at least {SECRET_BYTES_MIN} (e.g. head -c 32 /dev/urandom | base64)")]
    TooShortInValue { index: usize, len: usize },
    #[error("--cluster-secret / TOLLGATE_CLUSTER_SECRET holds no secret")]
    EmptyValue,
}

impl PeerSecrets {
    /// Secrets in order (first signs). Each must be ≥ [`SECRET_BYTES_MIN`].
    pub fn new(secrets: Vec<Vec<u8>>) -> Result<PeerSecrets, SecretError> {
        if secrets.is_empty() {
            return Err(SecretError::EmptyValue);
        }
        for (i, secret) in secrets.iter().enumerate() {
            if secret.len() < SECRET_BYTES_MIN {
                return Err(SecretError::TooShortInValue {
                    index: i + 1,
                    len: secret.len(),
                });
            }
        }
        Ok(PeerSecrets {
            secrets: secrets.into_iter().map(Secret).collect(),
        })
    }

    /// The secrets the flags give: a file, or a comma-separated value.
    pub fn from_flags(
        file: Option<&Path>,
        value: Option<&str>,
    ) -> Result<PeerSecrets, SecretError> {
        match (file, value.filter(|v| !v.is_empty())) {
            (Some(_), Some(_)) => Err(SecretError::Both),
            (Some(path), None) => PeerSecrets::load(path),
            (None, Some(value)) => PeerSecrets::parse_value(value),
            (None, None) => Err(SecretError::Missing),
        }
    }

    /// `a,b,c`: spaces around each secret are trimmed, empty items skipped.
    pub fn parse_value(value: &str) -> Result<PeerSecrets, SecretError> {
        let secrets: Vec<Vec<u8>> = value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.as_bytes().to_vec())
            .collect();
        PeerSecrets::new(secrets)
    }

    /// One secret per line (trimmed); blank lines and `#` comments ignored.
    /// Warns when the file is readable by its group or others.
    pub fn load(path: &Path) -> Result<PeerSecrets, SecretError> {
        let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(meta) = std::fs::metadata(path) {
                let mode = meta.permissions().mode();
                if mode & 0o077 != 0 {
                    tracing::warn!(
                        "the cluster secret file {} is readable by other users (mode {:o}); chmod 600 it",
                        path.display(),
                        mode & 0o777
                    );
                }
            }
        }
        let mut secrets = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line.len() < SECRET_BYTES_MIN {
                return Err(SecretError::TooShortInFile {
                    path: path.to_path_buf(),
                    line: number + 1,
                    len: line.len(),
                });
            }
            secrets.push(line.as_bytes().to_vec());
        }
        if secrets.is_empty() {
            return Err(SecretError::EmptyFile(path.to_path_buf()));
        }
        PeerSecrets::new(secrets)
    }

    pub fn len(&self) -> usize {
        self.secrets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    fn signing(&self) -> &Secret {
        &self.secrets[0]
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("not a Tollgate peer (bad handshake magic)")]
    BadMagic,
    #[error("unsupported peer handshake version {0} (this node speaks {VERSION})")]
    BadVersion(u8),
    #[error("wrong cluster secret (the peer's proof matches none of ours)")]
    BadProof,
    #[error("the peer refused our cluster secret")]
    Refused,
    #[error("unexpected verdict byte {0}")]
    BadVerdict(u8),
    #[error("handshake not completed within {0} ms")]
    Timeout(u64),
    #[error("the peer closed the connection during the handshake")]
    Closed,
    #[error("handshake: {0}")]
    Io(std::io::Error),
}

impl From<std::io::Error> for AuthError {
    fn from(error: std::io::Error) -> AuthError {
        if error.kind() == std::io::ErrorKind::UnexpectedEof {
            AuthError::Closed
        } else {
            AuthError::Io(error)
        }
    }
}

#[allow(clippy::expect_used)] // no randomness, no safe handshake: stop loudly
fn nonce() -> [u8; NONCE_BYTES] {
    let mut nonce = [0u8; NONCE_BYTES];
    getrandom::fill(&mut nonce).expect("the OS random source failed");
    nonce
}

#[allow(clippy::expect_used)] // HMAC accepts keys of any length
fn mac(secret: &Secret, label: &[u8], first: &[u8], second: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(&secret.0).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(&[VERSION]);
    mac.update(first);
    mac.update(second);
    mac
}

/// True when `proof` is the MAC of the transcript under any of `secrets`
/// (each comparison in constant time).
fn verify_any(
    secrets: &PeerSecrets,
    label: &[u8],
    first: &[u8],
    second: &[u8],
    proof: &[u8],
) -> bool {
    secrets.secrets.iter().fold(false, |ok, secret| {
        mac(secret, label, first, second)
            .verify_slice(proof)
            .is_ok()
            | ok
    })
}

/// The dialer's side: proves the secret and checks the server's proof.
pub async fn authenticate_client<S>(stream: &mut S, secrets: &PeerSecrets) -> Result<(), AuthError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let client_nonce = nonce();
    let mut hello = [0u8; MAGIC.len() + 1 + NONCE_BYTES];
    hello[..MAGIC.len()].copy_from_slice(&MAGIC);
    hello[MAGIC.len()] = VERSION;
    hello[MAGIC.len() + 1..].copy_from_slice(&client_nonce);
    stream.write_all(&hello).await?;
    let mut answer = [0u8; NONCE_BYTES + PROOF_BYTES];
    stream.read_exact(&mut answer).await?;
    let (server_nonce, server_proof) = answer.split_at(NONCE_BYTES);
    if !verify_any(
        secrets,
        SERVER_LABEL,
        &client_nonce,
        server_nonce,
        server_proof,
    ) {
        // Tell the server (so it logs the refusal too) with a proof that
        // matches nothing, rather than one under our secret: a peer that
        // cannot prove the secret gets nothing it could replay elsewhere.
        let _ = stream.write_all(&[0u8; PROOF_BYTES]).await;
        let _ = stream.flush().await;
        return Err(AuthError::BadProof);
    }
    let proof = mac(secrets.signing(), CLIENT_LABEL, server_nonce, &client_nonce)
        .finalize()
        .into_bytes();
    stream.write_all(&proof).await?;
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict).await?;
    match verdict[0] {
        ACCEPTED => Ok(()),
        REFUSED => Err(AuthError::Refused),
        other => Err(AuthError::BadVerdict(other)),
    }
}

/// The server's side, without a timeout (see [`accept_peer`]): answers
/// nothing unless the stream starts with [`MAGIC`] and our version.
pub async fn authenticate_server<S>(stream: &mut S, secrets: &PeerSecrets) -> Result<(), AuthError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut magic = [0u8; MAGIC.len()];
    stream.read_exact(&mut magic).await?;
    if magic != MAGIC {
        return Err(AuthError::BadMagic);
    }
    let mut version = [0u8; 1];
    stream.read_exact(&mut version).await?;
    if version[0] != VERSION {
        return Err(AuthError::BadVersion(version[0]));
    }
    let mut client_nonce = [0u8; NONCE_BYTES];
    stream.read_exact(&mut client_nonce).await?;
    let server_nonce = nonce();
    let proof = mac(
        secrets.signing(),
        SERVER_LABEL,
        &client_nonce,
        &server_nonce,
    )
    .finalize()
    .into_bytes();
    let mut answer = [0u8; NONCE_BYTES + PROOF_BYTES];
    answer[..NONCE_BYTES].copy_from_slice(&server_nonce);
    answer[NONCE_BYTES..].copy_from_slice(&proof);
    stream.write_all(&answer).await?;
    let mut client_proof = [0u8; PROOF_BYTES];
    stream.read_exact(&mut client_proof).await?;
    if verify_any(
        secrets,
        CLIENT_LABEL,
        &server_nonce,
        &client_nonce,
        &client_proof,
    ) {
        stream.write_all(&[ACCEPTED]).await?;
        Ok(())
    } else {
        let _ = stream.write_all(&[REFUSED]).await;
        Err(AuthError::BadProof)
    }
}

/// The peer server's hook: runs the handshake within [`AUTH_TIMEOUT_MS`] and
/// logs a refusal (at most once per remote IP every 10 s). True when the
/// remote proved the secret and frames may flow.
pub async fn accept_peer<S>(
    stream: &mut S,
    remote: Option<SocketAddr>,
    secrets: &PeerSecrets,
) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    accept_peer_within(stream, remote, secrets, AUTH_TIMEOUT_MS).await
}

async fn accept_peer_within<S>(
    stream: &mut S,
    remote: Option<SocketAddr>,
    secrets: &PeerSecrets,
    timeout_ms: u64,
) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let result = tokio::time::timeout(
        Duration::from_millis(timeout_ms),
        authenticate_server(stream, secrets),
    )
    .await
    .unwrap_or(Err(AuthError::Timeout(timeout_ms)));
    match result {
        Ok(()) => true,
        // Closed before a byte: a port probe or health check, not worth a warning.
        Err(AuthError::Closed) => {
            tracing::debug!(?remote, "peer connection closed during the handshake");
            false
        }
        Err(error) => {
            let remote_text = remote.map_or_else(|| "an unknown address".into(), |r| r.to_string());
            if should_log_refusal(remote.map(|r| r.ip()), Instant::now()) {
                let why = match error {
                    AuthError::BadProof => {
                        "wrong cluster secret (authentication failed)".to_string()
                    }
                    other => other.to_string(),
                };
                tracing::warn!("refused a peer connection from {remote_text}: {why}");
            }
            false
        }
    }
}

/// Rate limit of the refusal log: true at most once per IP per interval.
fn should_log_refusal(ip: Option<IpAddr>, now: Instant) -> bool {
    static LAST: OnceLock<Mutex<HashMap<Option<IpAddr>, Instant>>> = OnceLock::new();
    let mut last = LAST.get_or_init(Default::default).lock();
    if last.len() > 4_096 {
        last.retain(|_, at| now.duration_since(*at) < REFUSAL_LOG_INTERVAL);
    }
    match last.get(&ip) {
        Some(at) if now.duration_since(*at) < REFUSAL_LOG_INTERVAL => false,
        _ => {
            last.insert(ip, now);
            true
        }
    }
}

/// The dialer's hook: what a failed handshake with node `target` means to
/// the link (a refusal when secrets differ, else the peer is unreachable).
pub fn link_error(target: NodeId, addr: SocketAddr, error: AuthError) -> LinkError {
    let detail = match error {
        AuthError::BadProof => "its proof matches none of our secrets",
        AuthError::Refused => "it refused our proof",
        other => {
            return LinkError::Unreachable(target, format!("peer handshake with {addr}: {other}"))
        }
    };
    LinkError::Unauthenticated(
        target,
        format!(
            "authentication failed: node {target} at {addr} does not hold the same cluster secret ({detail})"
        ),
    )
}

/// The join's hook: a node that no peer accepted (every peer that answered
/// refused its secret) must not sit half-joined; it stops with the reasons.
pub fn check_join(
    peers_accepted: usize,
    unauthenticated: &BTreeMap<NodeId, String>,
) -> Result<(), ClusterError> {
    if peers_accepted > 0 || unauthenticated.is_empty() {
        return Ok(());
    }
    let reasons: Vec<&str> = unauthenticated.values().map(String::as_str).collect();
    Err(ClusterError::Unauthenticated(reasons.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    fn secrets(list: &[&str]) -> PeerSecrets {
        PeerSecrets::new(list.iter().map(|s| s.as_bytes().to_vec()).collect()).unwrap()
    }

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    /// Runs both sides; each drops its end when done (as a socket closes).
    async fn run(
        client: &PeerSecrets,
        server: &PeerSecrets,
    ) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut c, mut s) = duplex(1024);
        tokio::join!(
            async move { authenticate_client(&mut c, client).await },
            async move { authenticate_server(&mut s, server).await }
        )
    }

    #[tokio::test]
    async fn same_secret_succeeds_both_ways() {
        let (client, server) = run(&secrets(&[A]), &secrets(&[A])).await;
        client.unwrap();
        server.unwrap();
    }

    #[tokio::test]
    async fn different_secrets_fail_on_both_sides() {
        let (client, server) = run(&secrets(&[A]), &secrets(&[B])).await;
        assert!(matches!(client, Err(AuthError::BadProof)), "{client:?}");
        // The client sends a proof that matches nothing, so the server
        // refuses (and logs) too.
        assert!(matches!(server, Err(AuthError::BadProof)), "{server:?}");
    }

    #[tokio::test]
    async fn server_refuses_a_client_that_accepts_it_but_signs_with_another_secret() {
        // The client accepts A (the server's) but signs with B, unknown there.
        let (client, server) = run(&secrets(&[B, A]), &secrets(&[A])).await;
        assert!(matches!(client, Err(AuthError::Refused)), "{client:?}");
        assert!(matches!(server, Err(AuthError::BadProof)), "{server:?}");
    }

    #[tokio::test]
    async fn rotation_steps_keep_every_pair_talking() {
        let old = secrets(&[A]);
        let old_plus_new = secrets(&[A, B]);
        let new_plus_old = secrets(&[B, A]);
        let new = secrets(&[B]);
        // Step 1 (B added as accepted), step 2 (B first), step 3 (A dropped):
        // nodes in adjacent steps must accept each other, either side dialing.
        for (x, y) in [
            (&old, &old_plus_new),
            (&old_plus_new, &new_plus_old),
            (&new_plus_old, &new),
        ] {
            for (client, server) in [(x, y), (y, x)] {
                let (c, s) = run(client, server).await;
                c.unwrap();
                s.unwrap();
            }
        }
        // Skipping step 2 breaks: old-only and new-only do not talk.
        let (c, _) = run(&old, &new).await;
        assert!(c.is_err());
    }

    #[tokio::test]
    async fn bad_magic_gets_no_answer() {
        let (mut c, mut s) = duplex(1024);
        let server = tokio::spawn(async move {
            let result = authenticate_server(&mut s, &secrets(&[A])).await;
            drop(s);
            result
        });
        c.write_all(b"HIT path=/x user=a\n").await.unwrap();
        let result = server.await.unwrap();
        assert!(matches!(result, Err(AuthError::BadMagic)), "{result:?}");
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "answered {rest:?}");
    }

    #[tokio::test]
    async fn wrong_version_is_refused() {
        // A newer node, and an older one (version 1 cannot read droplet's
        // buckets in data frames).
        for version in [VERSION + 1, VERSION - 1] {
            let (mut c, mut s) = duplex(1024);
            let mut hello = MAGIC.to_vec();
            hello.push(version);
            hello.extend_from_slice(&[0u8; NONCE_BYTES]);
            c.write_all(&hello).await.unwrap();
            let result = authenticate_server(&mut s, &secrets(&[A])).await;
            assert!(
                matches!(result, Err(AuthError::BadVersion(v)) if v == version),
                "{result:?}"
            );
        }
    }

    #[tokio::test]
    async fn truncated_handshake_fails_and_silence_times_out() {
        // Closed halfway through the nonce.
        let (mut c, mut s) = duplex(1024);
        c.write_all(&MAGIC).await.unwrap();
        c.write_all(&[VERSION, 1, 2, 3]).await.unwrap();
        drop(c);
        let result = authenticate_server(&mut s, &secrets(&[A])).await;
        assert!(matches!(result, Err(AuthError::Closed)), "{result:?}");
        // A garbage proof is refused.
        let (mut c, mut s) = duplex(1024);
        let server = tokio::spawn(async move { authenticate_server(&mut s, &secrets(&[A])).await });
        let mut hello = MAGIC.to_vec();
        hello.push(VERSION);
        hello.extend_from_slice(&[7u8; NONCE_BYTES]);
        c.write_all(&hello).await.unwrap();
        let mut answer = [0u8; NONCE_BYTES + PROOF_BYTES];
        c.read_exact(&mut answer).await.unwrap();
        c.write_all(&[0u8; PROOF_BYTES]).await.unwrap();
        let mut verdict = [9u8; 1];
        c.read_exact(&mut verdict).await.unwrap();
        assert_eq!(verdict[0], REFUSED);
        assert!(matches!(server.await.unwrap(), Err(AuthError::BadProof)));
        // Silence: the server gives up after its timeout.
        let (_c, mut s) = duplex(1024);
        let started = Instant::now();
        assert!(!accept_peer_within(&mut s, None, &secrets(&[A]), 100).await);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(5));
    }

    #[test]
    fn refusals_are_logged_once_per_ip_per_interval() {
        let ip: Option<IpAddr> = Some("192.0.2.77".parse().unwrap());
        let now = Instant::now();
        assert!(should_log_refusal(ip, now));
        assert!(!should_log_refusal(ip, now + Duration::from_secs(1)));
        assert!(should_log_refusal(
            Some("192.0.2.78".parse().unwrap()),
            now + Duration::from_secs(1)
        ));
        assert!(should_log_refusal(ip, now + REFUSAL_LOG_INTERVAL));
    }

    #[test]
    fn secret_files_and_values_parse_with_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.secret");
        std::fs::write(&path, format!("# rotation\n\n{B}\n  {A}  \n")).unwrap();
        let loaded = PeerSecrets::load(&path).unwrap();
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded.signing().0, B.as_bytes());
        assert!(
            !format!("{loaded:?}").contains(B),
            "secrets are never printed"
        );

        std::fs::write(&path, "# nothing\n\n").unwrap();
        let error = PeerSecrets::load(&path).unwrap_err().to_string();
        assert!(
            error.contains("holds no secret") && error.contains("cluster.secret"),
            "{error}"
        );

        std::fs::write(&path, format!("{A}\nshort\n")).unwrap();
        let error = PeerSecrets::load(&path).unwrap_err().to_string();
        assert!(
            error.contains("line 2") && error.contains("at least 16"),
            "{error}"
        );

        assert_eq!(
            PeerSecrets::parse_value(&format!("{A}, {B}"))
                .unwrap()
                .len(),
            2
        );
        assert!(PeerSecrets::parse_value("tooshort").is_err());
        assert!(matches!(
            PeerSecrets::from_flags(None, None),
            Err(SecretError::Missing)
        ));
        assert!(matches!(
            PeerSecrets::from_flags(Some(&path), Some(A)),
            Err(SecretError::Both)
        ));
        let missing = SecretError::Missing.to_string();
        assert!(
            missing.contains("head -c 32 /dev/urandom | base64"),
            "{missing}"
        );
    }
}
