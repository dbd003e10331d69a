//! Logging of `tollgate serve`: `RUST_LOG` filters (default `info`, and
//! openraft's own lines at `error` only), `--log-format` chooses text or
//! JSON on stderr, `DEBUG=divvy` adds the per-rule lines. An error line must
//! mean an operator should act, so openraft's errors about failing to reach
//! a peer (they wrap the peer link's `TransportError`: a peer down,
//! restarting, or not yet holding a shard while the cluster starts) and
//! about a call to a peer that timed out (a peer cut off, silent or slow for
//! a moment; openraft tries again, and elections follow the nodes'
//! liveness) are dropped: the link logs each change of a peer's
//! reachability once instead, a peer that goes silent on an open connection
//! included. openraft's other warnings and errors pass, at most one per
//! call site every [`OPENRAFT_REPEAT_INTERVAL`]. A `RUST_LOG` that names
//! openraft gets all of openraft's lines, unfiltered.

use super::serve::LogFormat;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};
use tracing::callsite::Identifier;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::EnvFilter;

/// The filter without `RUST_LOG`.
pub const DEFAULT_FILTER: &str = "info,openraft=error";
/// How often one openraft call site may log a warning or an error.
pub const OPENRAFT_REPEAT_INTERVAL: Duration = Duration::from_secs(10);
/// What openraft's messages about our peer links contain (its errors
/// name the source error's type).
const TRANSPORT_ERROR: &str = "links::TransportError";
/// What openraft's messages about a call to a peer that timed out contain
/// (`RPCError::Timeout`: `timeout after 200ms when Vote 1->3`).
const CALL_TIMEOUT: &str = "timeout after ";

/// divvy's `DEBUG=divvy` (a comma-separated list of names): log each
/// evaluated rule.
pub fn divvy_debug() -> bool {
    std::env::var("DEBUG").is_ok_and(|v| v.split(',').any(|name| name.trim() == "divvy"))
}

pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let from_env = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty());
    let mut filter = from_env
        .as_deref()
        .and_then(|directives| EnvFilter::try_new(directives).ok())
        .unwrap_or_else(|| EnvFilter::new(DEFAULT_FILTER));
    if divvy_debug() {
        if let Ok(directive) = "divvy=debug".parse() {
            filter = filter.add_directive(directive);
        }
    }
    let quiet = !from_env.is_some_and(|directives| directives.contains("openraft"));
    use std::io::IsTerminal as _;
    let ansi = std::io::stderr().is_terminal();
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(quiet.then(OpenraftNoise::default));
    let text = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => registry.with(text).init(),
        LogFormat::Json => registry.with(text.json()).init(),
    }
}

/// Drops openraft's lines about unreachable peers and repeats of its other
/// warnings and errors (see the module's documentation).
#[derive(Default)]
pub struct OpenraftNoise {
    repeats: RepeatLimit<Identifier>,
}

/// At most one event per key every [`OPENRAFT_REPEAT_INTERVAL`].
struct RepeatLimit<K> {
    last: Mutex<HashMap<K, Instant>>,
}

impl<K> Default for RepeatLimit<K> {
    fn default() -> Self {
        RepeatLimit {
            last: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: std::hash::Hash + Eq> RepeatLimit<K> {
    fn allows(&self, key: K, now: Instant) -> bool {
        let mut last = self.last.lock();
        match last.get(&key) {
            Some(&at) if now.duration_since(at) < OPENRAFT_REPEAT_INTERVAL => false,
            _ => {
                last.insert(key, now);
                true
            }
        }
    }
}

/// An event's fields as text.
#[derive(Default)]
struct FieldText(String);

impl Visit for FieldText {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl<S: Subscriber> Layer<S> for OpenraftNoise {
    fn event_enabled(&self, event: &Event<'_>, _ctx: Context<'_, S>) -> bool {
        let metadata = event.metadata();
        // `Level` orders verbosity: INFO and below are "greater" than WARN.
        if *metadata.level() > Level::WARN || !metadata.target().starts_with("openraft") {
            return true;
        }
        let mut fields = FieldText::default();
        event.record(&mut fields);
        let peer_transient = fields.0.contains(TRANSPORT_ERROR) || fields.0.contains(CALL_TIMEOUT);
        !peer_transient && self.repeats.allows(metadata.callsite(), Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Counts the events that reach it.
    struct Count(Arc<AtomicUsize>);

    impl<S: Subscriber> Layer<S> for Count {
        fn on_event(&self, _event: &Event<'_>, _ctx: Context<'_, S>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn peer_transients_are_dropped_and_repeats_limited() {
        use tracing_subscriber::layer::SubscriberExt as _;
        let seen = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry()
            .with(OpenraftNoise::default())
            .with(Count(Arc::clone(&seen)));
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..3 {
                tracing::error!(target: "openraft::replication", err = "Unreachable node: tollgate::cluster::links::TransportError: node 2 unreachable", "RPCError");
            }
            tracing::error!(target: "openraft::replication", err = "timeout after 200ms when AppendEntries 2->3", "RPCError");
            tracing::error!(target: "openraft::core::raft_core", error = "timeout after 201ms when Vote 1->3", target = "3", "timeout");
            assert_eq!(
                seen.load(Ordering::Relaxed),
                0,
                "transport errors and call timeouts dropped"
            );
            for _ in 0..3 {
                tracing::error!(target: "openraft::core", "a storage error");
            }
            assert_eq!(
                seen.load(Ordering::Relaxed),
                1,
                "one per call site per interval"
            );
            tracing::info!(target: "openraft::core", "info passes");
            tracing::error!(target: "tollgate::cluster", "ours pass");
            tracing::error!(target: "tollgate::cluster", "ours pass");
            assert_eq!(seen.load(Ordering::Relaxed), 4);
        });
    }

    #[test]
    fn a_call_site_may_log_again_after_the_interval() {
        let limit = RepeatLimit::default();
        let start = Instant::now();
        assert!(limit.allows("a", start));
        assert!(limit.allows("b", start));
        assert!(!limit.allows("a", start + Duration::from_secs(9)));
        assert!(limit.allows("a", start + OPENRAFT_REPEAT_INTERVAL));
    }
}
