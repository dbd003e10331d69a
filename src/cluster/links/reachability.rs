//! The one log line per change of a peer's reachability that a link
//! writes: when the peer is first reached (or found not reachable yet), a
//! warning when it becomes unreachable (with the reason), a line when it is
//! back. openraft's own errors about unreachable peers are dropped from the
//! logs (see `cli::logging`), so these lines are what an operator reads
//! about peers. A peer that flaps gets [`REACHABILITY_LINES_BURST`] lines at
//! once, then one per [`REACHABILITY_LOG_INTERVAL`] at most, each counting
//! the changes it did not report.

use crate::cluster::NodeId;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Reachability lines a peer may log at once...
const REACHABILITY_LINES_BURST: u32 = 3;
/// ...and one more per this interval.
const REACHABILITY_LOG_INTERVAL: Duration = Duration::from_secs(5);

/// Whether a peer answers, as its link last found out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    Unknown,
    Up,
    Down,
}

/// A peer's reachability and what of it has been logged.
pub(super) struct Reachability {
    peer: NodeId,
    addr: SocketAddr,
    state: Reach,
    /// Reached at least once.
    ever_up: bool,
    /// A line said it was reachable.
    logged_up: bool,
    /// The state last logged.
    logged: Reach,
    /// Lines that may be logged now, and when the last one was earned.
    tokens: u32,
    earned_at: Option<Instant>,
    /// Changes not logged (rate limit).
    unlogged: u32,
    /// Why the state is `Down`.
    why: String,
}

/// A reachability line: a warning (the peer became unreachable) or not.
#[derive(Debug, PartialEq, Eq)]
struct ReachLine {
    warning: bool,
    text: String,
}

impl Reachability {
    pub(super) fn new(peer: NodeId, addr: SocketAddr) -> Reachability {
        Reachability {
            peer,
            addr,
            state: Reach::Unknown,
            ever_up: false,
            logged_up: false,
            logged: Reach::Unknown,
            tokens: REACHABILITY_LINES_BURST,
            earned_at: None,
            unlogged: 0,
            why: String::new(),
        }
    }

    /// Connected (or still connected: called on every beat, so that a state
    /// reached while the rate limit held is logged once it allows).
    pub(super) fn up(&mut self) {
        self.log(Reach::Up, "");
    }

    /// A connect failed.
    pub(super) fn down(&mut self, why: &str) {
        self.log(Reach::Down, why);
    }

    fn log(&mut self, state: Reach, why: &str) {
        match self.observe(state, why, Instant::now()) {
            Some(ReachLine {
                warning: true,
                text,
            }) => tracing::warn!("{text}"),
            Some(line) => tracing::info!("{}", line.text),
            None => {}
        }
    }

    /// Records `state` at `now`; the line to log, if one is due.
    fn observe(&mut self, state: Reach, why: &str, now: Instant) -> Option<ReachLine> {
        if state != self.state {
            self.unlogged += 1;
            self.state = state;
            self.ever_up |= state == Reach::Up;
            why.clone_into(&mut self.why);
        }
        if self.unlogged == 0 || self.state == Reach::Unknown || !self.take_token(now) {
            return None;
        }
        let (peer, addr) = (self.peer, self.addr);
        // Changes since the previous line besides the one this line reports.
        let unreported = if self.state == self.logged {
            self.unlogged
        } else {
            self.unlogged - 1
        };
        let more = match unreported {
            0 => String::new(),
            n => format!(" ({n} more changes since the last line)"),
        };
        let reached = if self.state == Reach::Up {
            self.logged_up
        } else {
            self.ever_up
        };
        let line = match (self.state, reached) {
            (Reach::Up, false) => ReachLine {
                warning: false,
                text: format!("peer node {peer} at {addr} is reachable{more}"),
            },
            (Reach::Up, true) => ReachLine {
                warning: false,
                text: format!("peer node {peer} at {addr} is reachable again{more}"),
            },
            (_, false) => ReachLine {
                warning: false,
                text: format!(
                    "peer node {peer} at {addr} is not reachable yet: {}{more}",
                    self.why
                ),
            },
            (_, true) => ReachLine {
                warning: true,
                text: format!(
                    "peer node {peer} at {addr} is unreachable: {}{more}",
                    self.why
                ),
            },
        };
        self.logged_up |= self.state == Reach::Up;
        self.logged = self.state;
        self.unlogged = 0;
        Some(line)
    }

    /// One line's worth of the rate limit, if there is one at `now`.
    fn take_token(&mut self, now: Instant) -> bool {
        let earned_at = *self.earned_at.get_or_insert(now);
        let intervals = now.saturating_duration_since(earned_at).as_millis()
            / REACHABILITY_LOG_INTERVAL.as_millis();
        if intervals > 0 {
            let earned = u32::try_from(intervals).unwrap_or(u32::MAX);
            self.tokens = self
                .tokens
                .saturating_add(earned)
                .min(REACHABILITY_LINES_BURST);
            self.earned_at = Some(now);
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(reach: &mut Reachability, events: &[(u64, Option<&str>)]) -> Vec<String> {
        let start = Instant::now();
        events
            .iter()
            .filter_map(|&(at_ms, down)| {
                let now = start + Duration::from_millis(at_ms);
                let line = match down {
                    Some(why) => reach.observe(Reach::Down, why, now),
                    None => reach.observe(Reach::Up, "", now),
                }?;
                Some(format!(
                    "{}{}",
                    if line.warning { "WARN " } else { "" },
                    line.text
                ))
            })
            .collect()
    }

    #[test]
    fn each_reachability_change_is_logged_once() {
        let mut reach = Reachability::new(2, "10.0.0.2:9321".parse().unwrap());
        let lines = texts(
            &mut reach,
            &[
                (0, Some("refused")),
                (100, Some("refused")),
                (300, None),
                (400, None),
                (20_000, Some("connection lost (eof), then refused")),
                (20_100, Some("refused")),
                (30_000, None),
                (30_100, None),
            ],
        );
        assert_eq!(
            lines,
            [
                "peer node 2 at 10.0.0.2:9321 is not reachable yet: refused",
                "peer node 2 at 10.0.0.2:9321 is reachable",
                "WARN peer node 2 at 10.0.0.2:9321 is unreachable: connection lost (eof), then refused",
                "peer node 2 at 10.0.0.2:9321 is reachable again",
            ]
        );
    }

    #[test]
    fn a_flapping_peer_gets_a_few_lines_then_one_per_interval_with_the_count() {
        let mut reach = Reachability::new(3, "10.0.0.3:9321".parse().unwrap());
        let mut events = vec![(0, None)];
        // Down and up every 200 ms for 3 s, then down for good; beats and
        // connect attempts keep calling in.
        for i in 0..15u64 {
            events.push((1_000 + i * 200, Some("refused")));
            events.push((1_100 + i * 200, None));
        }
        events.extend([
            (4_500, Some("refused")),
            (5_200, Some("refused")),
            (9_000, Some("refused")),
            (12_000, Some("refused")),
        ]);
        let lines = texts(&mut reach, &events);
        assert_eq!(
            lines,
            [
                "peer node 3 at 10.0.0.3:9321 is reachable",
                "WARN peer node 3 at 10.0.0.3:9321 is unreachable: refused",
                "peer node 3 at 10.0.0.3:9321 is reachable again",
                "WARN peer node 3 at 10.0.0.3:9321 is unreachable: refused (28 more changes since the last line)",
            ]
        );
    }
}
