//! Authentication of the peer port: the mutual challenge-response handshake
//! that opens every peer connection before its first frame, with the
//! cluster's shared secret (read and checked in `secrets.rs`) and the two
//! nodes' peer protocol versions (negotiated by the rule in
//! `peer_protocol.rs`). Only a node that holds the secret can make another
//! node read a frame (a Hello, a Raft RPC, forwarded hits), and a dialer only
//! talks to a peer that holds it too. The links and the peer server only call
//! [`authenticate_client`] / [`accept_peer`].
//!
//! The handshake (all sizes fixed, nothing the peer chooses is allocated):
//!
//! 1. dialer → server: [`MAGIC`] (8 bytes), its peer protocol ([`Protocol`]:
//!    major, minor, oldest minor; 3 bytes), its 32-byte random nonce `c`;
//! 2. server → dialer: its own protocol (3 bytes). When the two are not
//!    compatible ([`Protocol::negotiate`]) both sides stop here, each logging
//!    the two versions and counting the refusal
//!    ([`version_refusals`]); a dialer whose major differs gets the answer
//!    as soon as its major byte is read. Otherwise the server's 32-byte
//!    random nonce `s`, then `HMAC-SHA256(secret, "tollgate-peer-server" ‖
//!    p ‖ c ‖ s)`, where `p` is the dialer's protocol then the server's;
//! 3. dialer → server: if the server's proof verified under one of the
//!    dialer's secrets, `HMAC-SHA256(secret, "tollgate-peer-client" ‖ p ‖
//!    s ‖ c)`; otherwise 32 zero bytes (a proof that matches nothing, so the
//!    server logs the refusal too) and the dialer hangs up;
//! 4. server → dialer: one verdict byte, [`ACCEPTED`] or [`REFUSED`] (so the
//!    dialer can say that the peer refused its secret rather than vanished).
//!
//! Versions: nodes of the same major talk, at the lower of their two minors,
//! as long as each one's minor is at least the other's oldest minor; so a
//! node of the next minor version joins a cluster of this one, one node at
//! a time (docs/cluster.md, "Rolling upgrade"). A minor release may only add
//! what it sends to peers that negotiated its minor; anything an older peer
//! could not read raises the major. `TOLLGATE_TEST_PEER_PROTOCOL` (tests
//! only) makes a node advertise another version ([`local_protocol`]).
//!
//! Proofs are compared in constant time. Each side signs with its first
//! secret and accepts any of its secrets, which is how the secret rotates
//! without downtime (docs/cluster.md, "Security of the peer port"). A
//! connection that does not start with [`MAGIC`] is closed without a byte
//! in answer. The handshake proves possession of the secret; it does not
//! encrypt what follows.

use super::links::LinkError;
use super::peer_protocol::{advertised, incompatible, note_version_refusal};
pub use super::peer_protocol::{
    local_protocol, version_refusals, Protocol, BATCH_ANSWERS_MINOR, LEASES_MINOR, PROTOCOL,
    RELAY_ANSWERS_MINOR, TEST_PROTOCOL_ENV,
};
pub use super::secrets::{PeerSecrets, Secret, SecretError, SECRET_BYTES_MIN};
use super::{ClusterError, NodeId};
use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First bytes of every peer connection.
pub const MAGIC: [u8; 8] = *b"TGPEER\r\n";
/// Bytes of each side's random nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of an HMAC-SHA256 proof.
pub const PROOF_BYTES: usize = 32;

/// The server's verdict after checking the dialer's proof.
pub const ACCEPTED: u8 = 1;
pub const REFUSED: u8 = 0;
/// How long the server gives a dialer to complete the handshake.
pub const AUTH_TIMEOUT_MS: u64 = 2_000;
/// A refused remote address is logged at most once per this interval.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

const SERVER_LABEL: &[u8] = b"tollgate-peer-server";
const CLIENT_LABEL: &[u8] = b"tollgate-peer-client";

type HmacSha256 = Hmac<Sha256>;

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("not a Tollgate peer (bad handshake magic)")]
    BadMagic,
    /// The two nodes' peer protocols cannot talk (see [`Protocol::negotiate`]).
    #[error("{0}")]
    Incompatible(String),
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
        use std::io::ErrorKind;
        if matches!(
            error.kind(),
            ErrorKind::UnexpectedEof | ErrorKind::BrokenPipe | ErrorKind::ConnectionReset
        ) {
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
fn mac(
    secret: &Secret,
    label: &[u8],
    protocols: &[u8; 6],
    first: &[u8],
    second: &[u8],
) -> HmacSha256 {
    let mut mac =
        HmacSha256::new_from_slice(secret.bytes()).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(protocols);
    mac.update(first);
    mac.update(second);
    mac
}

/// True when `proof` is the MAC of the transcript under any of `secrets`
/// (each comparison in constant time).
fn verify_any(
    secrets: &PeerSecrets,
    label: &[u8],
    protocols: &[u8; 6],
    first: &[u8],
    second: &[u8],
    proof: &[u8],
) -> bool {
    secrets.all().iter().fold(false, |ok, secret| {
        mac(secret, label, protocols, first, second)
            .verify_slice(proof)
            .is_ok()
            | ok
    })
}

/// Both protocols, the dialer's first, as the proofs cover them.
fn transcript(client: Protocol, server: Protocol) -> [u8; 6] {
    let (c, s) = (client.bytes(), server.bytes());
    [c[0], c[1], c[2], s[0], s[1], s[2]]
}

/// The dialer's side: proves the secret and checks the server's proof.
/// Returns the minor the two nodes talk at.
pub async fn authenticate_client<S>(stream: &mut S, secrets: &PeerSecrets) -> Result<u8, AuthError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    authenticate_client_as(stream, secrets, advertised()).await
}

async fn authenticate_client_as<S>(
    stream: &mut S,
    secrets: &PeerSecrets,
    ours: Protocol,
) -> Result<u8, AuthError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let client_nonce = nonce();
    let mut hello = [0u8; MAGIC.len() + 3 + NONCE_BYTES];
    hello[..MAGIC.len()].copy_from_slice(&MAGIC);
    hello[MAGIC.len()..MAGIC.len() + 3].copy_from_slice(&ours.bytes());
    hello[MAGIC.len() + 3..].copy_from_slice(&client_nonce);
    stream.write_all(&hello).await?;
    let mut theirs = [0u8; 3];
    stream.read_exact(&mut theirs).await?;
    let theirs = Protocol::from_bytes(theirs);
    let Some(minor) = ours.negotiate(theirs) else {
        note_version_refusal();
        return Err(AuthError::Incompatible(incompatible(
            ours,
            &format!("{theirs} (it talks to {})", theirs.range()),
        )));
    };
    let protocols = transcript(ours, theirs);
    let mut answer = [0u8; NONCE_BYTES + PROOF_BYTES];
    stream.read_exact(&mut answer).await?;
    let (server_nonce, server_proof) = answer.split_at(NONCE_BYTES);
    if !verify_any(
        secrets,
        SERVER_LABEL,
        &protocols,
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
    let proof = mac(
        secrets.signing(),
        CLIENT_LABEL,
        &protocols,
        server_nonce,
        &client_nonce,
    )
    .finalize()
    .into_bytes();
    stream.write_all(&proof).await?;
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict).await?;
    match verdict[0] {
        ACCEPTED => Ok(minor),
        REFUSED => Err(AuthError::Refused),
        other => Err(AuthError::BadVerdict(other)),
    }
}

/// The server's side, without a timeout (see [`accept_peer`]): answers
/// nothing unless the stream starts with [`MAGIC`]; a dialer of an
/// incompatible protocol gets this node's protocol, then the connection
/// closes. Returns the minor the two nodes talk at.
pub async fn authenticate_server<S>(stream: &mut S, secrets: &PeerSecrets) -> Result<u8, AuthError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    authenticate_server_as(stream, secrets, advertised()).await
}

async fn authenticate_server_as<S>(
    stream: &mut S,
    secrets: &PeerSecrets,
    ours: Protocol,
) -> Result<u8, AuthError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut magic = [0u8; MAGIC.len()];
    stream.read_exact(&mut magic).await?;
    if magic != MAGIC {
        return Err(AuthError::BadMagic);
    }
    let mut major = [0u8; 1];
    stream.read_exact(&mut major).await?;
    if major[0] != ours.major {
        // Another major may lay out the rest otherwise (major 1 sent its
        // nonce right after its one version byte): answer at once.
        note_version_refusal();
        let _ = stream.write_all(&ours.bytes()).await;
        let _ = stream.flush().await;
        return Err(AuthError::Incompatible(incompatible(
            ours,
            &format!("major version {}", major[0]),
        )));
    }
    let mut rest = [0u8; 2];
    stream.read_exact(&mut rest).await?;
    let theirs = Protocol::from_bytes([major[0], rest[0], rest[1]]);
    stream.write_all(&ours.bytes()).await?;
    if ours.negotiate(theirs).is_none() {
        note_version_refusal();
        let _ = stream.flush().await;
        return Err(AuthError::Incompatible(incompatible(
            ours,
            &format!("{theirs} (it talks to {})", theirs.range()),
        )));
    }
    let minor = ours.minor.min(theirs.minor);
    let protocols = transcript(theirs, ours);
    let mut client_nonce = [0u8; NONCE_BYTES];
    stream.read_exact(&mut client_nonce).await?;
    let server_nonce = nonce();
    let proof = mac(
        secrets.signing(),
        SERVER_LABEL,
        &protocols,
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
        &protocols,
        &server_nonce,
        &client_nonce,
        &client_proof,
    ) {
        stream.write_all(&[ACCEPTED]).await?;
        Ok(minor)
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
        Ok(_) => true,
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
        // Refused like a wrong secret: a join that no peer accepts stops.
        AuthError::Incompatible(why) => {
            return LinkError::Unauthenticated(target, format!("node {target} at {addr}: {why}"))
        }
        AuthError::Closed => {
            return LinkError::Unreachable(
                target,
                format!(
                    "peer handshake with {addr}: {}; a node of peer protocol 1 (before versions were negotiated) closes so when it gets a newer handshake",
                    AuthError::Closed
                ),
            )
        }
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
    ) -> (Result<u8, AuthError>, Result<u8, AuthError>) {
        run_as(client, PROTOCOL, server, PROTOCOL).await
    }

    async fn run_as(
        client: &PeerSecrets,
        client_protocol: Protocol,
        server: &PeerSecrets,
        server_protocol: Protocol,
    ) -> (Result<u8, AuthError>, Result<u8, AuthError>) {
        let (mut c, mut s) = duplex(1024);
        tokio::join!(
            async move { authenticate_client_as(&mut c, client, client_protocol).await },
            async move { authenticate_server_as(&mut s, server, server_protocol).await }
        )
    }

    fn protocol(text: &str) -> Protocol {
        Protocol::parse(text).unwrap()
    }

    #[tokio::test]
    async fn the_next_minor_talks_and_incompatible_versions_are_refused_on_both_sides() {
        let a = secrets(&[A]);
        // This version and the next minor talk at this one's minor, either
        // side dialing; the proofs cover both versions.
        for (client, server) in [
            ("2.0", "2.1"),
            ("2.1", "2.0"),
            ("2.1:1", "2.1"),
            ("2.3:1", "2.1"),
        ] {
            let (c, s) = run_as(&a, protocol(client), &a, protocol(server)).await;
            let expected = protocol(client).minor.min(protocol(server).minor);
            assert_eq!(c.unwrap(), expected, "{client} dialing {server}");
            assert_eq!(s.unwrap(), expected, "{client} dialing {server}");
        }
        // Another major, or a minor below the other's oldest: both sides
        // refuse, each naming both versions, and both count it.
        for (client, server) in [
            ("3.0", "2.0"),
            ("2.0", "3.0"),
            ("2.2:2", "2.1"),
            ("2.1", "2.2:2"),
        ] {
            let before = version_refusals();
            let (c, s) = run_as(&a, protocol(client), &a, protocol(server)).await;
            let (Err(AuthError::Incompatible(c)), Err(AuthError::Incompatible(s))) = (c, s) else {
                panic!("{client} dialing {server}: both sides refuse");
            };
            let (client, server) = (protocol(client), protocol(server));
            assert!(c.contains(&format!("the peer speaks {server}")), "{c}");
            assert!(c.contains(&format!("this node {client}")), "{c}");
            assert!(s.contains(&format!("this node {server}")), "{s}");
            assert!(s.contains("Rolling upgrade"), "{s}");
            assert!(version_refusals() >= before + 2);
        }
        // The handshake of major 1 (one version byte, then the nonce) is
        // answered with this node's version and refused.
        let (mut c, mut s) = duplex(1024);
        let mut hello = MAGIC.to_vec();
        hello.push(1);
        hello.extend_from_slice(&[0u8; NONCE_BYTES]);
        c.write_all(&hello).await.unwrap();
        let result = authenticate_server(&mut s, &a).await;
        assert!(
            matches!(&result, Err(AuthError::Incompatible(why)) if why.contains("major version 1")),
            "{result:?}"
        );
        drop(s);
        let mut answer = Vec::new();
        c.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, PROTOCOL.bytes());
    }

    #[test]
    fn protocol_versions_parse_with_clear_errors() {
        assert_eq!(
            protocol("2.1"),
            Protocol {
                major: 2,
                minor: 1,
                oldest_minor: 0
            }
        );
        assert_eq!(protocol(" 3.4:2 ").oldest_minor, 2);
        for bad in ["", "2", "2.x", "2.1:", "256.0", "2.1:3", "-1.0"] {
            let error = Protocol::parse(bad).unwrap_err();
            assert!(error.contains(&format!("'{bad}'")), "{error}");
        }
        assert_eq!(PROTOCOL.negotiate(PROTOCOL), Some(PROTOCOL.minor));
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
        // A newer major, and an older one (major 1 cannot read droplet's
        // buckets in data frames, nor the hellos' rule set versions).
        for major in [PROTOCOL.major + 1, PROTOCOL.major - 1] {
            let (mut c, mut s) = duplex(1024);
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&[major, 0, 0]);
            hello.extend_from_slice(&[0u8; NONCE_BYTES]);
            c.write_all(&hello).await.unwrap();
            let result = authenticate_server(&mut s, &secrets(&[A])).await;
            assert!(
                matches!(result, Err(AuthError::Incompatible(_))),
                "major {major}: {result:?}"
            );
        }
    }

    #[tokio::test]
    async fn truncated_handshake_fails_and_silence_times_out() {
        // Closed halfway through the nonce.
        let (mut c, mut s) = duplex(1024);
        c.write_all(&MAGIC).await.unwrap();
        c.write_all(&PROTOCOL.bytes()).await.unwrap();
        c.write_all(&[1, 2, 3]).await.unwrap();
        drop(c);
        let result = authenticate_server(&mut s, &secrets(&[A])).await;
        assert!(matches!(result, Err(AuthError::Closed)), "{result:?}");
        // A garbage proof is refused.
        let (mut c, mut s) = duplex(1024);
        let server = tokio::spawn(async move { authenticate_server(&mut s, &secrets(&[A])).await });
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&PROTOCOL.bytes());
        hello.extend_from_slice(&[7u8; NONCE_BYTES]);
        c.write_all(&hello).await.unwrap();
        let mut answer = [0u8; 3 + NONCE_BYTES + PROOF_BYTES];
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
        assert_eq!(loaded.signing().bytes(), B.as_bytes());
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
