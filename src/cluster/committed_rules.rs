//! Cluster-wide rule sets: which rules every node serves, and how they
//! change while the cluster runs (`tollgate reload` or SIGHUP on any node,
//! or `tollgate cluster reload FILE`).
//!
//! The rules in force are a *committed rule set*: a [`RulesRecord`] (the
//! file's name and text) with a [`RulesTag`] (`version`, the node that
//! committed it, the rules' fingerprint). Version 0 is the rule file the
//! nodes started with, which must be identical on every node (peers compare
//! tags in the hello, `peer_server.rs`); each reload commits the next
//! version. A reload runs in two steps from the node that takes it: every
//! member *checks* the text (parses it as it would serve it, with its own
//! `--strict-rules`, and matches the fingerprint); a refusal from any node,
//! or fewer than a majority of the members answering, ends it with nothing
//! changed anywhere. Then the node *commits*: it writes the record to its
//! data dir, switches, and tells every member, each of which writes the
//! record and switches in turn. Nodes the commit missed (down, cut off)
//! learn the newest version from any peer's status report (every poll, and
//! at start-up before serving), and a restarted node serves the committed
//! set its data dir holds, not its rule file. A node's version only goes up
//! (the highest `(version, origin)` wins, as for member lists), and only
//! committed sets are ever served. See docs/cluster.md, "Cluster-wide
//! reload", for why a switch needs no barrier on the data path.

use super::disk::meta::MetaRecord;
use super::disk::NodeDisk;
use super::node::ClusterNode;
use super::wire::{NodeReport, PeerRequest, PeerResponse};
use super::NodeId;
use crate::rules::{diagnostics, RuleSet};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The largest rule file a cluster reload carries (it travels in one
/// control frame to every node and is kept in each data dir).
pub const RULES_TEXT_BYTES_MAX: usize = 16 * 1024 * 1024;

/// How long a peer may take to check or take a rule set (both steps fit
/// in the 10 s `tollgate cluster reload` waits by default).
const RULES_CALL_TIMEOUT_MS: u64 = 3_000;

/// A node that cannot take its peers' newer rules says so at most this often.
const LEARN_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// Which committed rule set a node serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RulesTag {
    /// 0: the rule file the nodes started with; each reload adds one.
    pub version: u64,
    /// The node that committed this version (0 for version 0).
    pub origin: NodeId,
    /// [`RuleSet::fingerprint`] of the rules.
    pub fingerprint: u64,
}

impl RulesTag {
    /// The rules a node started with, from its rule file.
    pub fn initial(rules: &RuleSet) -> RulesTag {
        RulesTag {
            version: 0,
            origin: 0,
            fingerprint: rules.fingerprint(),
        }
    }

    /// Is this a later rule set than `other`? (The higher version, then
    /// the higher origin, as for member lists.)
    pub fn supersedes(&self, other: &RulesTag) -> bool {
        (self.version, self.origin) > (other.version, other.origin)
    }

    /// `version 2 (committed by node 1, fingerprint …)`.
    pub fn describe(&self) -> String {
        if self.version == 0 {
            format!(
                "version 0 (the rule files the nodes started with, fingerprint {:016x})",
                self.fingerprint
            )
        } else {
            format!(
                "version {} (committed by node {}, fingerprint {:016x})",
                self.version, self.origin, self.fingerprint
            )
        }
    }
}

/// A committed rule set: its tag, and the rule file's name (whose
/// extension says its format) and text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RulesRecord {
    pub tag: RulesTag,
    pub name: String,
    pub text: String,
}

/// Parses a rule file's text as this node serves rules (`strict`:
/// `--strict-rules`); the error names the file.
pub fn parse_rules(name: &str, text: &str, strict: bool) -> Result<RuleSet, String> {
    if text.len() > RULES_TEXT_BYTES_MAX {
        return Err(format!(
            "{name}: {} bytes; a cluster-wide reload carries at most {RULES_TEXT_BYTES_MAX} bytes",
            text.len()
        ));
    }
    let loaded = diagnostics::load_text(name, text, strict)
        .map_err(|error| error.in_file(Path::new(name)))?;
    for warning in &loaded.warnings {
        tracing::warn!(file = name, "rule file: {warning}");
    }
    Ok(loaded.rules)
}

/// Where a node's new rules go once committed (the engine's rule swap).
pub type RulesSink = Box<dyn Fn(RuleSet) + Send + Sync>;

/// This node's committed rule set, and what switching to a newer one does.
pub struct ClusterRules {
    strict: bool,
    disk: Option<Arc<NodeDisk>>,
    state: Mutex<RulesState>,
    /// One reload at a time from this node.
    reloading: tokio::sync::Mutex<()>,
    /// When this node last warned that it could not take newer rules.
    warned_at: Mutex<Option<Instant>>,
}

struct RulesState {
    tag: RulesTag,
    /// The committed record (`None` at version 0: the rule file).
    record: Option<RulesRecord>,
    /// A set adopted before the engine existed, for it to start with.
    undelivered: Option<RuleSet>,
    sink: Option<RulesSink>,
}

impl ClusterRules {
    /// Starts from the rule file's rules, or from the committed set the
    /// data dir holds (`persisted`), which wins: a restarted node serves
    /// what the cluster committed, not a rule file that may be stale.
    pub fn new(
        file_rules: &RuleSet,
        persisted: Option<RulesRecord>,
        strict: bool,
        disk: Option<Arc<NodeDisk>>,
    ) -> Result<ClusterRules, String> {
        let mut state = RulesState {
            tag: RulesTag::initial(file_rules),
            record: None,
            undelivered: None,
            sink: None,
        };
        if let Some(record) = persisted.filter(|record| record.tag.version > 0) {
            let kept_in = disk
                .as_ref()
                .map_or_else(String::new, |d| d.meta_path().display().to_string());
            let set = committed_set(&record, strict).map_err(|error| {
                format!(
                    "the cluster's rules {} kept in {kept_in} do not load: {error}",
                    record.tag.describe()
                )
            })?;
            if set.fingerprint() != file_rules.fingerprint() {
                tracing::warn!(
                    "the rule file {} differs from the cluster's committed rules {} (kept in {kept_in}): serving the committed rules; `tollgate cluster reload FILE` changes them on every node",
                    file_rules.source,
                    record.tag.describe()
                );
            }
            state.tag = record.tag;
            state.record = Some(record);
            state.undelivered = Some(set);
        }
        Ok(ClusterRules {
            strict,
            disk,
            state: Mutex::new(state),
            reloading: tokio::sync::Mutex::new(()),
            warned_at: Mutex::new(None),
        })
    }

    /// The rule set in force here.
    pub fn tag(&self) -> RulesTag {
        self.state.lock().tag
    }

    /// The committed record in force here (`None`: version 0).
    pub fn record(&self) -> Option<RulesRecord> {
        self.state.lock().record.clone()
    }

    /// The rules to serve from the start when they are not the rule file's
    /// (from the data dir, or learned from peers while joining).
    pub fn take_undelivered(&self) -> Option<RuleSet> {
        self.state.lock().undelivered.take()
    }

    /// From now on, rule sets this node adopts go to `sink`; one adopted
    /// since [`ClusterRules::take_undelivered`] goes there at once.
    pub fn attach(&self, sink: RulesSink) {
        let mut state = self.state.lock();
        if let Some(set) = state.undelivered.take() {
            sink(set);
        }
        state.sink = Some(sink);
    }

    /// Should a failure to take newer rules be logged now? (At most once
    /// per [`LEARN_WARNING_INTERVAL`]: peers are polled four times a second.)
    pub fn warn_now(&self) -> bool {
        let mut warned_at = self.warned_at.lock();
        if warned_at.is_some_and(|at| at.elapsed() < LEARN_WARNING_INTERVAL) {
            return false;
        }
        *warned_at = Some(Instant::now());
        true
    }

    /// Parses a rule file as this node would serve it.
    pub fn parse(&self, name: &str, text: &str) -> Result<RuleSet, String> {
        parse_rules(name, text, self.strict)
    }

    /// Could this node switch to `record`? (Step one of a reload.)
    pub fn check(&self, record: &RulesRecord) -> Result<(), String> {
        let tag = self.tag();
        if !record.tag.supersedes(&tag) {
            return Err(format!(
                "it serves rules {} already, not older than the proposed {}",
                tag.describe(),
                record.tag.describe()
            ));
        }
        committed_set(record, self.strict).map(drop)
    }

    /// Switches to `record` if it is newer than the set in force: writes
    /// it to the data dir first, then hands the rules to the engine. Says
    /// whether it switched.
    pub fn adopt(&self, record: &RulesRecord) -> Result<bool, String> {
        let mut state = self.state.lock();
        if !record.tag.supersedes(&state.tag) {
            return Ok(false);
        }
        let set = committed_set(record, self.strict)?;
        if let Some(disk) = &self.disk {
            disk.meta_append(MetaRecord::Rules(record.clone()))
                .map_err(|error| {
                    format!(
                        "cannot write the new rules to {}: {error}",
                        disk.meta_path().display()
                    )
                })?;
        }
        state.tag = record.tag;
        state.record = Some(record.clone());
        match &state.sink {
            Some(sink) => sink(set),
            None => state.undelivered = Some(set),
        }
        tracing::info!(
            file = %record.name,
            "switched to the cluster's rules {}",
            record.tag.describe()
        );
        Ok(true)
    }

    /// A reload's second step: switches to `record`; `Err` when it could
    /// not, or when a newer set was committed meanwhile (a reload taken at
    /// the same time elsewhere), which this node serves instead.
    pub fn commit(&self, record: &RulesRecord) -> Result<(), String> {
        self.adopt(record)?;
        let tag = self.tag();
        if tag != record.tag {
            return Err(format!(
                "it serves rules {} committed meanwhile, not {}",
                tag.describe(),
                record.tag.describe()
            ));
        }
        Ok(())
    }
}

/// The rules of a committed record, checked against its fingerprint (a
/// node whose parser disagrees must not serve other rules under the tag).
fn committed_set(record: &RulesRecord, strict: bool) -> Result<RuleSet, String> {
    let mut set = parse_rules(&record.name, &record.text, strict)?;
    if set.fingerprint() != record.tag.fingerprint {
        return Err(format!(
            "{}: its rules have fingerprint {:016x} here, not the proposed {:016x}",
            record.name,
            set.fingerprint(),
            record.tag.fingerprint
        ));
    }
    set.source = format!(
        "{} (cluster rules version {}, from node {})",
        record.name, record.tag.version, record.tag.origin
    );
    Ok(set)
}

impl ClusterNode {
    /// Serves a reload taken by this node (`tollgate reload`, SIGHUP,
    /// `tollgate cluster reload`): checks the file on every member, then
    /// commits it (see the module doc). `Err` says why nothing changed.
    pub async fn reload_rules(&self, name: String, text: String) -> Result<String, String> {
        let _one_at_a_time = self.rules.reloading.lock().await;
        let set = self.rules.parse(&name, &text)?;
        let current = self.rules.tag();
        if set.fingerprint() == current.fingerprint {
            return Ok(format!(
                "{name}: these are the rules in force already, {}; nothing to change",
                current.describe()
            ));
        }
        let newest = self
            .last_reports
            .lock()
            .values()
            .map(|report| report.rules.version)
            .max()
            .unwrap_or(0)
            .max(current.version);
        let count = set.rules().len();
        let record = RulesRecord {
            tag: RulesTag {
                version: newest + 1,
                origin: self.id,
                fingerprint: set.fingerprint(),
            },
            name,
            text,
        };
        let members = self.members();
        if !members.nodes.contains_key(&self.id) {
            return Err(format!(
                "node {} is not a member of the cluster yet (members {}): reload on a member, nothing changed",
                self.id,
                members.describe()
            ));
        }
        // Step one: every member checks the rules.
        let checked = self
            .ask_members(|| PeerRequest::RulesPrepare(record.clone()))
            .await;
        let mut accepted = vec![self.id];
        let mut silent = Vec::new();
        for (peer, answer) in checked {
            match answer {
                Ok(()) => accepted.push(peer),
                Err(Some(why)) => {
                    return Err(format!(
                        "node {peer} refused the new rules, nothing changed: {why}"
                    ))
                }
                Err(None) => silent.push(peer),
            }
        }
        let majority = members.nodes.len() / 2 + 1;
        if accepted.len() < majority {
            return Err(format!(
                "only {} of the {} members checked the new rules (no answer from {}); a cluster-wide reload needs a majority of them, nothing changed",
                accepted.len(),
                members.nodes.len(),
                list(&silent)
            ));
        }
        // Step two: commit here, then on every member.
        self.rules
            .commit(&record)
            .map_err(|why| format!("nothing changed by this reload: {why}"))?;
        let committed = self
            .ask_members(|| PeerRequest::RulesCommit(record.clone()))
            .await;
        let mut switched = vec![self.id];
        let mut missed = Vec::new();
        for (peer, answer) in committed {
            match answer {
                Ok(()) => switched.push(peer),
                Err(why) => {
                    tracing::warn!(
                        peer,
                        why = why.as_deref().unwrap_or("no answer"),
                        "a node did not take the new rules at once; it takes them from its peers"
                    );
                    missed.push(peer);
                }
            }
        }
        switched.sort_unstable();
        let later = if missed.is_empty() {
            String::new()
        } else {
            format!(
                "; nodes {} take them from their peers once they answer",
                list(&missed)
            )
        };
        Ok(format!(
            "{}: {count} rules committed as {}; serving them: nodes {}{later}",
            record.name,
            record.tag.describe(),
            list(&switched)
        ))
    }

    /// Sends a rules request to every other member at once: per peer,
    /// `Ok`, `Err(Some(why))` when it refused, `Err(None)` when it did not
    /// answer.
    async fn ask_members(
        &self,
        request: impl Fn() -> PeerRequest,
    ) -> Vec<(NodeId, Result<(), Option<String>>)> {
        let calls = self.ensure_member_links().into_iter().map(|(peer, link)| {
            let request = request();
            async move {
                let answer = match link.call(request, RULES_CALL_TIMEOUT_MS).await {
                    Ok(PeerResponse::RulesChecked(Ok(()))) => Ok(()),
                    Ok(PeerResponse::RulesChecked(Err(why)) | PeerResponse::Refused(why)) => {
                        Err(Some(why))
                    }
                    Ok(other) => Err(Some(format!("unexpected answer {other:?}"))),
                    Err(error) => {
                        tracing::debug!(peer, %error, "rules request not answered");
                        Err(None)
                    }
                };
                (peer, answer)
            }
        });
        futures_util::future::join_all(calls).await
    }

    /// Takes the newest rule set a peer reports, if it is newer than the
    /// one in force here; says whether it switched.
    pub(super) async fn learn_rules(
        &self,
        reports: &BTreeMap<NodeId, NodeReport>,
    ) -> Result<bool, String> {
        let ours = self.rules.tag();
        let Some((&peer, newest)) = reports
            .iter()
            .filter(|(_, report)| report.rules.supersedes(&ours))
            .max_by_key(|(_, report)| (report.rules.version, report.rules.origin))
            .map(|(peer, report)| (peer, report.rules))
        else {
            return Ok(false);
        };
        let Some(link) = self.links.get(peer) else {
            return Err(format!("no link to node {peer}"));
        };
        match link.call(PeerRequest::Rules, RULES_CALL_TIMEOUT_MS).await {
            Ok(PeerResponse::Rules(Some(record))) => {
                let switched = self.rules.adopt(&record)?;
                if switched {
                    tracing::info!(
                        peer,
                        "took the cluster's newer rules {} from node {peer}",
                        record.tag.describe()
                    );
                }
                Ok(switched)
            }
            Ok(other) => Err(format!(
                "node {peer} reported rules {} but answered {other:?}",
                newest.describe()
            )),
            Err(error) => Err(format!(
                "node {peer} reported rules {} but did not send them: {error}",
                newest.describe()
            )),
        }
    }
}

/// `1,2,3`, or `none`.
fn list(nodes: &[NodeId]) -> String {
    if nodes.is_empty() {
        return "none".to_string();
    }
    nodes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = "[a=1]\ncreditLimit = 5\nresetSeconds = 60\n\n[default]\ncreditLimit = 1\nresetSeconds = 60\n";
    const NEW: &str = "[a=1]\ncreditLimit = 7\nresetSeconds = 60\n\n[default]\ncreditLimit = 1\nresetSeconds = 60\n";

    fn record(version: u64, origin: NodeId, text: &str) -> RulesRecord {
        let set = parse_rules("rules.ini", text, false).unwrap();
        RulesRecord {
            tag: RulesTag {
                version,
                origin,
                fingerprint: set.fingerprint(),
            },
            name: "rules.ini".into(),
            text: text.into(),
        }
    }

    fn rules_with_sink() -> (ClusterRules, Arc<Mutex<Vec<u64>>>) {
        let old = parse_rules("rules.ini", OLD, false).unwrap();
        let rules = ClusterRules::new(&old, None, false, None).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        rules.attach(Box::new(move |set: RuleSet| {
            sink.lock().push(set.fingerprint())
        }));
        (rules, seen)
    }

    #[test]
    fn versions_only_go_up() {
        let (rules, seen) = rules_with_sink();
        let v2 = record(2, 1, NEW);
        assert!(rules.check(&v2).is_ok());
        assert_eq!(rules.adopt(&v2), Ok(true));
        assert_eq!(rules.tag(), v2.tag);
        // The same version again, or an older one: nothing happens.
        assert_eq!(rules.adopt(&v2), Ok(false));
        assert_eq!(rules.adopt(&record(1, 3, OLD)), Ok(false));
        let error = rules.check(&record(1, 3, OLD)).unwrap_err();
        assert!(error.contains("not older than"), "{error}");
        // The same version from a higher node wins (as member lists do).
        assert_eq!(rules.commit(&record(2, 2, OLD)), Ok(()));
        assert_eq!(seen.lock().len(), 2);
        // A commit overtaken by a newer set says so.
        let error = rules.commit(&record(2, 1, NEW)).unwrap_err();
        assert!(error.contains("committed meanwhile"), "{error}");
    }

    #[test]
    fn a_bad_record_changes_nothing_and_names_the_file() {
        let (rules, seen) = rules_with_sink();
        let mut bad = record(1, 1, NEW);
        bad.text = "[a=1]\ncreditLimit = -3\n".into();
        let error = rules.adopt(&bad).unwrap_err();
        assert!(error.starts_with("rules.ini"), "{error}");
        let mut mismatched = record(1, 1, NEW);
        mismatched.tag.fingerprint ^= 1;
        let error = rules.check(&mismatched).unwrap_err();
        assert!(error.contains("fingerprint"), "{error}");
        assert_eq!(rules.tag().version, 0);
        assert!(seen.lock().is_empty());
        let huge = "x".repeat(RULES_TEXT_BYTES_MAX + 1);
        let error = parse_rules("big.ini", &huge, false).unwrap_err();
        assert!(
            error.contains("big.ini") && error.contains("at most"),
            "{error}"
        );
    }

    #[test]
    fn a_persisted_set_wins_over_the_rule_file_until_attached() {
        let old = parse_rules("rules.ini", OLD, false).unwrap();
        let v3 = record(3, 2, NEW);
        let rules = ClusterRules::new(&old, Some(v3.clone()), false, None).unwrap();
        assert_eq!(rules.tag(), v3.tag);
        let served = rules.take_undelivered().unwrap();
        assert_eq!(served.fingerprint(), v3.tag.fingerprint);
        assert!(served.source.contains("version 3"), "{}", served.source);
        // Adopted after the engine took its rules, before it attached.
        let v4 = record(4, 1, OLD);
        assert_eq!(rules.adopt(&v4), Ok(true));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        rules.attach(Box::new(move |set: RuleSet| {
            sink.lock().push(set.fingerprint())
        }));
        assert_eq!(*seen.lock(), vec![v4.tag.fingerprint]);
        // A persisted set that no longer loads refuses the start.
        let mut broken = record(5, 1, NEW);
        broken.text = "[default]\n".into();
        let error = ClusterRules::new(&old, Some(broken), false, None)
            .err()
            .unwrap();
        assert!(error.contains("do not load"), "{error}");
    }
}
