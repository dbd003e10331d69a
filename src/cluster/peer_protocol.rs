//! The peer protocol's version: the version this build speaks
//! ([`PROTOCOL`]), the rule by which two nodes decide whether and at which
//! minor they talk ([`Protocol::negotiate`]), the test-only override of the
//! advertised version, and the count of handshakes refused for a version
//! mismatch. The handshake that exchanges versions is `auth.rs`; keeping the
//! versioning apart is what lets a rolling upgrade be reasoned about in one
//! place (docs/cluster.md, "Rolling upgrade").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The peer protocol this build speaks (see the module doc). Major 1 was
/// the handshake before versions were negotiated: one version byte, which
/// had to match exactly. 2.0 also brought data frames that carry droplet
/// buckets (an op code, a decision code and a counter state of their own)
/// and hellos that carry the committed rule set's version, which no node of
/// major 1 can read. 2.1 added [`ROUND_ANSWERS_MINOR`], 2.2
/// [`BATCH_ANSWERS_MINOR`], 2.3 [`LEASES_MINOR`], 2.4
/// [`RELAY_ANSWERS_MINOR`], 2.5 [`ACK_ON_ASK_MINOR`].
pub const PROTOCOL: Protocol = Protocol {
    major: 2,
    minor: 5,
    oldest_minor: 0,
};

/// The minor from which a leader answers the hits a replica forwarded in
/// the frame that carries their round (`data_frames::tag::ROUND_ANSWERS`)
/// instead of in a message of its own once the round commits.
pub const ROUND_ANSWERS_MINOR: u8 = 1;
/// The minor from which a leader answers a forwarded batch's hits decided
/// at once in a section of the batch's own, its entries' byte length first
/// (`data_frames::tag::BATCH_ANSWERS`), instead of as `(batch, index,
/// decision)` entries of one `ANSWERS` section per frame: the forwarder
/// finds the batch once and decodes each decision straight into its slot,
/// and the prefetch's walk over a frame steps over the section whole.
pub const BATCH_ANSWERS_MINOR: u8 = 2;
/// The minor from which a forwarded fixed-window hit may ask for a quota
/// lease (an op flag and the lease's size) and be answered with one
/// (`WireDecision::Leased`): fast mode's leases, `forward/leases.rs`.
pub const LEASES_MINOR: u8 = 3;
/// The minor from which a leader hands a follower, with a round's section,
/// the answers of hits that a node holding no replica of the shard
/// forwarded (`data_frames::tag::RELAY_ANSWERS`), and the follower, once it
/// has applied the section, sends them on to that node: strict mode's
/// answers then take three hops instead of four (forward, round, relayed
/// answers; not forward, round, ack, answers). Only the follower needs it:
/// what it sends on is an ordinary `ANSWERS` section.
pub const RELAY_ANSWERS_MINOR: u8 = 4;
/// The minor from which a follower acknowledges a round at once only when
/// the leader asks for it (`data_frames::tag::ACK_NOW` before a section:
/// the leader's own clients wait on it, or answers no follower carries on);
/// other acks go with its next frame to the leader or its link's next beat.
/// Most rounds of a three-node cluster need no ack soon (their forwarded
/// hits were answered with the round): a frame that carried only an ack
/// was 12 % of peer writes in an open-loop run (docs/benchmarks.md,
/// "Thirty-third round").
pub const ACK_ON_ASK_MINOR: u8 = 5;
/// Test-only: `MAJOR.MINOR` or `MAJOR.MINOR:OLDEST_MINOR`, a peer protocol
/// this node advertises instead of [`PROTOCOL`] (docs/cluster.md, "Rolling
/// upgrade", says how tests use it). Not for production: the node's frames
/// do not change with it.
pub const TEST_PROTOCOL_ENV: &str = "TOLLGATE_TEST_PEER_PROTOCOL";

/// Handshakes refused (either side) because the two nodes' peer protocols
/// are incompatible: `tollgate_cluster_peer_version_refusals_total`.
static VERSION_REFUSALS: AtomicU64 = AtomicU64::new(0);

/// Handshakes this process refused, or was refused, for incompatible peer
/// protocol versions (as dialer and as server).
pub fn version_refusals() -> u64 {
    VERSION_REFUSALS.load(Ordering::Relaxed)
}

/// A peer protocol version, as exchanged in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocol {
    pub major: u8,
    pub minor: u8,
    /// The oldest minor (of the same major) this node still talks to.
    pub oldest_minor: u8,
}

impl Protocol {
    /// The minor two nodes talk at, or `None` when they cannot talk: their
    /// majors differ, or one's minor is older than the other's oldest.
    /// Symmetric, so both sides of a handshake decide alike.
    pub fn negotiate(self, peer: Protocol) -> Option<u8> {
        (self.major == peer.major
            && peer.minor >= self.oldest_minor
            && self.minor >= peer.oldest_minor)
            .then_some(self.minor.min(peer.minor))
    }

    pub(super) fn bytes(self) -> [u8; 3] {
        [self.major, self.minor, self.oldest_minor]
    }

    pub(super) fn from_bytes(bytes: [u8; 3]) -> Protocol {
        Protocol {
            major: bytes[0],
            minor: bytes[1],
            oldest_minor: bytes[2],
        }
    }

    /// Parses `MAJOR.MINOR` or `MAJOR.MINOR:OLDEST_MINOR` (the oldest minor
    /// defaults to 0, and may not be above the minor).
    pub fn parse(text: &str) -> Result<Protocol, String> {
        let bad = || {
            format!("'{text}' is not a peer protocol version (MAJOR.MINOR or MAJOR.MINOR:OLDEST_MINOR, each 0-255, e.g. 2.1 or 2.1:1)")
        };
        let (version, oldest) = match text.trim().split_once(':') {
            Some((version, oldest)) => (version, Some(oldest)),
            None => (text.trim(), None),
        };
        let (major, minor) = version.split_once('.').ok_or_else(bad)?;
        let major: u8 = major.parse().map_err(|_| bad())?;
        let minor: u8 = minor.parse().map_err(|_| bad())?;
        let oldest_minor: u8 = match oldest {
            Some(oldest) => oldest.parse().map_err(|_| bad())?,
            None => 0,
        };
        if oldest_minor > minor {
            return Err(format!(
                "'{text}': the oldest minor ({oldest_minor}) is above the minor ({minor})"
            ));
        }
        Ok(Protocol {
            major,
            minor,
            oldest_minor,
        })
    }

    /// The versions this one talks to: its major, from its oldest minor on
    /// (a newer minor also needs its own oldest minor to reach ours), e.g.
    /// `2.0-2.x`.
    pub fn range(self) -> String {
        format!("{}.{}-{}.x", self.major, self.oldest_minor, self.major)
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The peer protocol this node advertises: [`PROTOCOL`], unless the
/// test-only [`TEST_PROTOCOL_ENV`] names another one. An invalid value is
/// an error naming the variable (checked when a cluster node starts).
pub fn local_protocol() -> Result<Protocol, String> {
    static LOCAL: OnceLock<Result<Protocol, String>> = OnceLock::new();
    LOCAL
        .get_or_init(|| match std::env::var(TEST_PROTOCOL_ENV) {
            Ok(value) => {
                Protocol::parse(&value).map_err(|why| format!("{TEST_PROTOCOL_ENV}: {why}"))
            }
            Err(_) => Ok(PROTOCOL),
        })
        .clone()
}

/// [`local_protocol`], or [`PROTOCOL`] when the variable is invalid (the
/// node refused to start then; this keeps tools that dial working).
pub(super) fn advertised() -> Protocol {
    local_protocol().unwrap_or(PROTOCOL)
}

/// The sentence both sides log for an incompatible peer.
pub(super) fn incompatible(ours: Protocol, theirs: &str) -> String {
    format!(
        "incompatible peer protocol: the peer speaks {theirs}, this node {ours} (it talks to {}); nodes talk when their major versions match and each one's minor is at least the other's oldest (docs/cluster.md, \"Rolling upgrade\")",
        ours.range()
    )
}

/// Counts a handshake refused (either side) for incompatible versions.
pub(super) fn note_version_refusal() {
    VERSION_REFUSALS.fetch_add(1, Ordering::Relaxed);
}
