//! The node's metadata log (`meta.log` in the data dir): everything small
//! and rarely written that must survive a restart for the cluster to stay
//! safe: each shard group's Raft vote, log entries (membership and blank
//! entries only), committed and applied ids, membership and snapshot meta;
//! each shard's *fence* (the highest term promised, which must never go
//! backwards, or a deposed leader's states could be accepted); the member
//! list after `cluster add-node|remove-node`; and the rule set the cluster
//! last committed (a restarted node serves it, not its rule file).
//!
//! Each change is one record ([`MetaRecord`], bincode), written with one
//! `write(2)` before the change is acted on (a vote answered, a promise
//! given), and replayed in order at start-up. When the log holds many more
//! records than the state it describes, it is rewritten as that state
//! (a new file, synced, then renamed over the old one).

use super::records;
use super::FsyncPolicy;
use crate::cluster::committed_rules::RulesRecord;
use crate::cluster::members::Members;
use crate::cluster::storage::RaftEntry;
use crate::cluster::NodeId;
use openraft::{BasicNode, LogId, SnapshotMeta, StoredMembership, Vote};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Records appended since the last rewrite before the log is rewritten
/// (when they also outnumber the state's own records four to one).
const COMPACT_AFTER_RECORDS: u64 = 4_096;

/// One change to the node's metadata.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum MetaRecord {
    Members(Members),
    Vote {
        shard: u32,
        vote: Vote<NodeId>,
    },
    Committed {
        shard: u32,
        committed: Option<LogId<NodeId>>,
    },
    Append {
        shard: u32,
        entries: Vec<RaftEntry>,
    },
    /// Entries from this index on are gone.
    Truncate {
        shard: u32,
        from_index: u64,
    },
    /// Entries up to this id are gone.
    Purge {
        shard: u32,
        upto: LogId<NodeId>,
    },
    Applied {
        shard: u32,
        applied: Option<LogId<NodeId>>,
        membership: StoredMembership<NodeId, BasicNode>,
    },
    Snapshot {
        shard: u32,
        meta: SnapshotMeta<NodeId, BasicNode>,
    },
    Fence {
        shard: u32,
        term: u64,
    },
    /// The replica was retired: its state is dropped.
    Retire {
        shard: u32,
    },
    /// The cluster committed this rule set (see `committed_rules.rs`).
    Rules(RulesRecord),
}

/// What the metadata log says about one shard's replica.
#[derive(Debug, Clone, Default)]
pub struct ShardMeta {
    pub vote: Option<Vote<NodeId>>,
    pub committed: Option<LogId<NodeId>>,
    pub last_purged: Option<LogId<NodeId>>,
    pub entries: BTreeMap<u64, RaftEntry>,
    pub applied: Option<LogId<NodeId>>,
    pub membership: StoredMembership<NodeId, BasicNode>,
    pub snapshot: Option<SnapshotMeta<NodeId, BasicNode>>,
    pub fence: u64,
}

impl ShardMeta {
    /// Does this replica hold Raft state (a vote, a log or a snapshot)?
    pub fn established(&self) -> bool {
        self.vote.is_some()
            || !self.entries.is_empty()
            || self.last_purged.is_some()
            || self.snapshot.is_some()
    }
}

/// The node's metadata, as the log's records build it.
#[derive(Debug, Clone, Default)]
pub struct MetaState {
    pub members: Option<Members>,
    pub shards: BTreeMap<u32, ShardMeta>,
    /// The newest rule set the cluster committed, as this node took it.
    pub rules: Option<RulesRecord>,
}

impl MetaState {
    pub fn apply(&mut self, record: MetaRecord) {
        match record {
            MetaRecord::Members(members) => {
                if self
                    .members
                    .as_ref()
                    .is_none_or(|m| !m.supersedes(&members))
                {
                    self.members = Some(members);
                }
            }
            MetaRecord::Vote { shard, vote } => self.shard(shard).vote = Some(vote),
            MetaRecord::Committed { shard, committed } => self.shard(shard).committed = committed,
            MetaRecord::Append { shard, entries } => {
                let meta = self.shard(shard);
                for entry in entries {
                    meta.entries.insert(entry.log_id.index, entry);
                }
            }
            MetaRecord::Truncate { shard, from_index } => {
                let _gone = self.shard(shard).entries.split_off(&from_index);
            }
            MetaRecord::Purge { shard, upto } => {
                let meta = self.shard(shard);
                meta.last_purged = Some(upto);
                meta.entries = meta.entries.split_off(&(upto.index + 1));
            }
            MetaRecord::Applied {
                shard,
                applied,
                membership,
            } => {
                let meta = self.shard(shard);
                meta.applied = applied;
                meta.membership = membership;
            }
            MetaRecord::Snapshot { shard, meta } => self.shard(shard).snapshot = Some(meta),
            MetaRecord::Fence { shard, term } => {
                let meta = self.shard(shard);
                meta.fence = meta.fence.max(term);
            }
            MetaRecord::Retire { shard } => {
                self.shards.remove(&shard);
            }
            MetaRecord::Rules(record) => {
                if self
                    .rules
                    .as_ref()
                    .is_none_or(|held| record.tag.supersedes(&held.tag))
                {
                    self.rules = Some(record);
                }
            }
        }
    }

    fn shard(&mut self, shard: u32) -> &mut ShardMeta {
        self.shards.entry(shard).or_default()
    }

    /// The records that rebuild this state.
    fn records(&self) -> Vec<MetaRecord> {
        let mut out = Vec::new();
        if let Some(members) = &self.members {
            out.push(MetaRecord::Members(members.clone()));
        }
        if let Some(rules) = &self.rules {
            out.push(MetaRecord::Rules(rules.clone()));
        }
        for (&shard, meta) in &self.shards {
            if let Some(vote) = meta.vote {
                out.push(MetaRecord::Vote { shard, vote });
            }
            if let Some(upto) = meta.last_purged {
                out.push(MetaRecord::Purge { shard, upto });
            }
            if !meta.entries.is_empty() {
                out.push(MetaRecord::Append {
                    shard,
                    entries: meta.entries.values().cloned().collect(),
                });
            }
            out.push(MetaRecord::Committed {
                shard,
                committed: meta.committed,
            });
            out.push(MetaRecord::Applied {
                shard,
                applied: meta.applied,
                membership: meta.membership.clone(),
            });
            if let Some(snapshot) = &meta.snapshot {
                out.push(MetaRecord::Snapshot {
                    shard,
                    meta: snapshot.clone(),
                });
            }
            out.push(MetaRecord::Fence {
                shard,
                term: meta.fence,
            });
        }
        out
    }
}

fn encode(record: &MetaRecord) -> std::io::Result<Vec<u8>> {
    bincode::serde::encode_to_vec(record, bincode::config::standard())
        .map_err(|error| std::io::Error::other(format!("cannot encode a metadata record: {error}")))
}

fn decode(payload: &[u8]) -> Result<MetaRecord, String> {
    bincode::serde::decode_from_slice(payload, bincode::config::standard())
        .map(|(record, _)| record)
        .map_err(|error| error.to_string())
}

/// What opening the metadata log found.
pub struct MetaLoad {
    pub state: MetaState,
    /// Damage found (naming the file), if any. A corrupt log is set aside
    /// and the node starts without Raft state (see `disk/mod.rs`).
    pub damage: Option<String>,
    /// The log was corrupt: its Raft state was not used.
    pub discarded: bool,
}

struct Writer {
    file: File,
    state: MetaState,
    records_since_compaction: u64,
}

/// The metadata log, open for appending.
pub struct MetaLog {
    path: PathBuf,
    policy: FsyncPolicy,
    writer: Mutex<Writer>,
}

impl MetaLog {
    /// Opens (or creates) `dir/meta.log` and replays it. A truncated tail
    /// is cut off (a crash while appending: that record was never acted
    /// on); a corrupt log is renamed aside (`meta.log.corrupt-<unix secs>`)
    /// and the node starts without metadata.
    pub fn open(dir: &Path, policy: FsyncPolicy) -> std::io::Result<(MetaLog, MetaLoad)> {
        let path = dir.join("meta.log");
        let _ = std::fs::remove_file(dir.join("meta.log.tmp"));
        let mut state = MetaState::default();
        let mut damage = None;
        let mut discarded = false;
        let file = if path.exists() {
            let mut undecodable = None;
            let scan = records::scan_file(&path, |payload| {
                if undecodable.is_some() {
                    return;
                }
                match decode(payload) {
                    Ok(record) => state.apply(record),
                    Err(why) => undecodable = Some(why),
                }
            })?;
            let corrupt = match (&scan.end, undecodable) {
                (_, Some(why)) => Some(format!(
                    "{}: a record does not decode ({why})",
                    path.display()
                )),
                (records::End::Corrupt { .. }, None) => scan.damage(&path),
                (records::End::TruncatedTail { .. }, None) => {
                    damage = scan.damage(&path);
                    None
                }
                (records::End::Clean, None) => None,
            };
            if let Some(why) = corrupt {
                let aside = dir.join(format!(
                    "meta.log.corrupt-{}",
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs())
                ));
                std::fs::rename(&path, &aside)?;
                damage = Some(format!(
                    "{why}; moved to {} and starting without Raft state: this node's replicas recover from their peers",
                    aside.display()
                ));
                discarded = true;
                state = MetaState::default();
                records::create(&path)?
            } else {
                records::open_append(&path, scan.valid_bytes)?
            }
        } else {
            records::create(&path)?
        };
        file.sync_all()?;
        records::sync_dir(dir)?;
        let log = MetaLog {
            path,
            policy,
            writer: Mutex::new(Writer {
                file,
                state: state.clone(),
                records_since_compaction: 0,
            }),
        };
        Ok((
            log,
            MetaLoad {
                state,
                damage,
                discarded,
            },
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one change (one `write(2)`; synced under `--fsync batch`)
    /// before returning.
    pub fn append(&self, record: MetaRecord) -> std::io::Result<()> {
        let payload = encode(&record)?;
        let mut bytes = Vec::with_capacity(payload.len() + 8);
        records::frame(&mut bytes, &payload);
        let mut writer = self.writer.lock();
        writer.file.write_all(&bytes)?;
        if self.policy == FsyncPolicy::Batch {
            writer.file.sync_data()?;
        }
        writer.state.apply(record);
        writer.records_since_compaction += 1;
        let live = writer.state.shards.len() as u64 * 8 + 1;
        if writer.records_since_compaction > COMPACT_AFTER_RECORDS.max(live * 4) {
            self.compact(&mut writer)?;
        }
        Ok(())
    }

    /// Rewrites the log as its current state (a new file, synced, renamed).
    fn compact(&self, writer: &mut Writer) -> std::io::Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join("meta.log.tmp");
        let mut file = records::create(&tmp)?;
        let mut bytes = Vec::new();
        for record in writer.state.records() {
            records::frame(&mut bytes, &encode(&record)?);
        }
        file.write_all(&bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        records::sync_dir(dir)?;
        writer.file = std::fs::OpenOptions::new().append(true).open(&self.path)?;
        writer.records_since_compaction = 0;
        Ok(())
    }

    /// Syncs the log to the disk.
    pub fn sync(&self) -> std::io::Result<()> {
        let file = self.writer.lock().file.try_clone()?;
        file.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(epoch: u64) -> Members {
        Members {
            epoch,
            origin: 1,
            nodes: BTreeMap::new(),
        }
    }

    #[test]
    fn records_replay_into_the_same_state_after_a_restart_and_a_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (log, load) = MetaLog::open(dir.path(), FsyncPolicy::Never).unwrap();
            assert!(load.state.shards.is_empty() && load.damage.is_none());
            log.append(MetaRecord::Members(members(3))).unwrap();
            log.append(MetaRecord::Fence { shard: 7, term: 5 }).unwrap();
            log.append(MetaRecord::Fence { shard: 7, term: 4 }).unwrap();
            log.append(MetaRecord::Vote {
                shard: 7,
                vote: Vote::new_committed(5, 2),
            })
            .unwrap();
            log.append(MetaRecord::Retire { shard: 9 }).unwrap();
            log.append(MetaRecord::Rules(rules_record(2))).unwrap();
            log.append(MetaRecord::Rules(rules_record(1))).unwrap();
            // Enough records to force a rewrite.
            for term in 0..(COMPACT_AFTER_RECORDS + 10) {
                log.append(MetaRecord::Fence { shard: 1, term }).unwrap();
            }
        }
        let (_log, load) = MetaLog::open(dir.path(), FsyncPolicy::Never).unwrap();
        assert!(load.damage.is_none(), "{:?}", load.damage);
        assert_eq!(load.state.members, Some(members(3)));
        let seven = &load.state.shards[&7];
        assert_eq!(seven.fence, 5, "a fence never goes backwards");
        assert_eq!(seven.vote, Some(Vote::new_committed(5, 2)));
        assert!(seven.established());
        assert_eq!(load.state.shards[&1].fence, COMPACT_AFTER_RECORDS + 9);
        assert!(!load.state.shards.contains_key(&9));
        assert_eq!(
            load.state.rules,
            Some(rules_record(2)),
            "the newest rule set is kept, through a rewrite"
        );
    }

    fn rules_record(version: u64) -> RulesRecord {
        RulesRecord {
            tag: crate::cluster::committed_rules::RulesTag {
                version,
                origin: 1,
                fingerprint: version * 7,
            },
            name: "rules.ini".into(),
            text: format!("; version {version}\n"),
        }
    }

    /// A log holding fences of term 9 for shards 2 and 3; its path.
    fn two_fences(dir: &Path, policy: FsyncPolicy) -> PathBuf {
        let (log, _) = MetaLog::open(dir, policy).unwrap();
        log.append(MetaRecord::Fence { shard: 2, term: 9 }).unwrap();
        log.append(MetaRecord::Fence { shard: 3, term: 9 }).unwrap();
        dir.join("meta.log")
    }

    #[test]
    fn a_corrupt_log_is_set_aside_with_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = two_fences(dir.path(), FsyncPolicy::Never);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = records::MAGIC.len() + 10;
        bytes[at] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let (log, load) = MetaLog::open(dir.path(), FsyncPolicy::Never).unwrap();
        let damage = load.damage.unwrap();
        assert!(damage.contains(&path.display().to_string()), "{damage}");
        assert!(damage.contains("corrupt"), "{damage}");
        assert!(load.discarded);
        assert!(load.state.shards.is_empty());
        let aside = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("meta.log.corrupt-")
            });
        assert!(aside, "the corrupt log is kept aside");
        log.append(MetaRecord::Fence { shard: 2, term: 1 }).unwrap();
    }

    #[test]
    fn a_truncated_tail_loses_only_the_last_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = two_fences(dir.path(), FsyncPolicy::Batch);
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 3)
            .unwrap();
        let (log, load) = MetaLog::open(dir.path(), FsyncPolicy::Never).unwrap();
        assert!(load.damage.unwrap().contains("truncated"));
        assert!(!load.discarded);
        assert_eq!(load.state.shards[&2].fence, 9);
        assert!(!load.state.shards.contains_key(&3));
        log.append(MetaRecord::Fence { shard: 4, term: 1 }).unwrap();
        drop(log);
        let (_log, load) = MetaLog::open(dir.path(), FsyncPolicy::Never).unwrap();
        assert!(load.damage.is_none());
        assert_eq!(load.state.shards[&4].fence, 1);
    }
}
