//! What this node should do about shard placement and leadership, as a
//! pure function of what it sees ([`ClusterView`] → [`ShardWork`]s), so the
//! rules are tested without a cluster; `moves.rs` gathers the view and runs
//! the work.
//!
//! The rules:
//! - A shard led here whose voters are not the member list's placement is
//!   *moved* there (new replicas join as learners and catch up, then one
//!   joint membership change), at most `moves_max` at a time; a leader that
//!   is not in the target hands leadership to a live target voter first.
//! - A replica here that the shard's leader no longer lists, outside the
//!   target, is *retired*.
//! - Leadership is *balanced*: a node leading more than its share (shards ÷
//!   live nodes, rounded up) hands one settled shard to a live, caught-up
//!   voter leading at least two fewer, one at a time, only while no shard
//!   of this node moves and every shard has a leader.
//! - With ring placement, leadership is *restored* first, under the same
//!   conditions: a settled shard led here whose preferred leader (its first
//!   replica) is another live, caught-up voter is handed to it, so that a
//!   node's led shards keep replicating to its next members only after a
//!   failover or a move (ring placement's preferred leaders are balanced).
//!   Balancing then sheds only shards whose first replica is another node
//!   (a dead node's), never one it would get back at once.

use super::NodeId;
use std::collections::{BTreeMap, BTreeSet};

/// A shard this node leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedShard {
    pub shard: u32,
    pub voters: BTreeSet<NodeId>,
    pub learners: BTreeSet<NodeId>,
    /// Where the member list places it.
    pub target: BTreeSet<NodeId>,
    /// A move or handover of it is running.
    pub busy: bool,
    /// The replica that should lead it (the first of its leader order).
    pub preferred: Option<NodeId>,
}

/// A replica here of a shard led elsewhere, as its leader last reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowedShard {
    pub shard: u32,
    pub target: BTreeSet<NodeId>,
    /// The leader's voters and learners (`None`: no report from a leader).
    pub listed_by_leader: Option<BTreeSet<NodeId>>,
}

/// What [`plan`] looks at.
#[derive(Debug, Clone, Default)]
pub struct ClusterView {
    pub me: NodeId,
    pub shards: u32,
    pub led: Vec<LedShard>,
    pub followed: Vec<FollowedShard>,
    /// Each shard's leader as far as this node knows.
    pub leaders: BTreeMap<u32, NodeId>,
    /// Nodes heard from recently (this node included).
    pub live: BTreeSet<NodeId>,
    /// `(node, shard)` replicas that restarted and are still catching up.
    pub recovering: BTreeSet<(NodeId, u32)>,
    /// Moves and handovers that may start now.
    pub free_slots: usize,
    /// Leader balancing is on and its cool-down is over.
    pub may_balance: bool,
    /// Shards go back to their preferred leaders (ring placement).
    pub restore_preferred: bool,
}

/// Work on one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardWork {
    /// Make `target` the voters (learners first).
    Move {
        shard: u32,
        voters: BTreeSet<NodeId>,
        learners: BTreeSet<NodeId>,
        target: BTreeSet<NodeId>,
    },
    /// Hand leadership to `successor` (leaving the shard, or balancing).
    HandOver {
        shard: u32,
        successor: NodeId,
        balancing: bool,
    },
    /// Stop this replica and drop its counters.
    Retire { shard: u32 },
}

impl LedShard {
    fn settled(&self) -> bool {
        self.voters == self.target && self.learners.iter().all(|l| self.target.contains(l))
    }
}

/// The work this node should start now (see the module doc).
pub fn plan(view: &ClusterView) -> Vec<ShardWork> {
    let mut work = Vec::new();
    let mut slots = view.free_slots;
    let recovering = |node: NodeId, shard: u32| view.recovering.contains(&(node, shard));
    for led in &view.led {
        if led.settled() || led.busy || slots == 0 {
            continue;
        }
        // A leader staying in the target moves the shard; one leaving hands
        // it to a live target voter, or (none yet) brings the target in first.
        let successor = led
            .voters
            .iter()
            .copied()
            .filter(|&v| v != view.me && led.target.contains(&v) && view.live.contains(&v))
            .min_by_key(|&v| (recovering(v, led.shard), v))
            .filter(|_| !led.target.contains(&view.me));
        work.push(match successor {
            Some(successor) => ShardWork::HandOver {
                shard: led.shard,
                successor,
                balancing: false,
            },
            None => ShardWork::Move {
                shard: led.shard,
                voters: led.voters.clone(),
                learners: led.learners.clone(),
                target: led.target.clone(),
            },
        });
        slots -= 1;
    }
    for followed in &view.followed {
        if followed.target.contains(&view.me) {
            continue;
        }
        if let Some(listed) = &followed.listed_by_leader {
            if !listed.is_empty() && !listed.contains(&view.me) {
                work.push(ShardWork::Retire {
                    shard: followed.shard,
                });
            }
        }
    }
    if let Some(handover) = balance(view, slots) {
        work.push(handover);
    }
    work
}

/// One balancing handover: a shard back to its preferred leader (ring
/// placement), else one off this node if it leads more than its share.
fn balance(view: &ClusterView, slots: usize) -> Option<ShardWork> {
    if !view.may_balance || slots == 0 || view.led.iter().any(|l| l.busy || !l.settled()) {
        return None;
    }
    if view.leaders.len() < view.shards as usize
        || view.live.len() < 2
        || !view.live.contains(&view.me)
    {
        return None; // An election is under way, or nobody to share with.
    }
    if view.restore_preferred {
        let restored = view.led.iter().find_map(|led| {
            let preferred = led.preferred.filter(|&p| {
                p != view.me
                    && led.voters.contains(&p)
                    && view.live.contains(&p)
                    && !view.recovering.contains(&(p, led.shard))
            })?;
            Some(ShardWork::HandOver {
                shard: led.shard,
                successor: preferred,
                balancing: true,
            })
        });
        if restored.is_some() {
            return restored;
        }
    }
    let mut leads: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &leader in view.leaders.values() {
        *leads.entry(leader).or_default() += 1;
    }
    let fair = (view.shards as usize).div_ceil(view.live.len());
    let mine = leads.get(&view.me).copied().unwrap_or(0);
    if mine <= fair {
        return None;
    }
    let mut best: Option<(usize, NodeId, u32)> = None;
    // Restoring: a shard this node is first replica of stays (its
    // successor would hand it straight back).
    let sheddable = |led: &&LedShard| !(view.restore_preferred && led.preferred == Some(view.me));
    for led in view.led.iter().filter(sheddable) {
        for &voter in led
            .voters
            .iter()
            .filter(|&&v| v != view.me && view.live.contains(&v))
        {
            let theirs = leads.get(&voter).copied().unwrap_or(0);
            if theirs + 2 > mine || view.recovering.contains(&(voter, led.shard)) {
                continue;
            }
            if best.is_none_or(|(least, ..)| theirs < least) {
                best = Some((theirs, voter, led.shard));
            }
        }
    }
    best.map(|(_, successor, shard)| ShardWork::HandOver {
        shard,
        successor,
        balancing: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(nodes: &[NodeId]) -> BTreeSet<NodeId> {
        nodes.iter().copied().collect()
    }

    fn led(shard: u32, voters: &[NodeId], target: &[NodeId]) -> LedShard {
        LedShard {
            shard,
            voters: set(voters),
            learners: BTreeSet::new(),
            target: set(target),
            busy: false,
            preferred: None,
        }
    }

    fn view(me: NodeId, led: Vec<LedShard>) -> ClusterView {
        ClusterView {
            me,
            shards: 4,
            led,
            live: set(&[1, 2, 3, 4]),
            free_slots: 2,
            ..ClusterView::default()
        }
    }

    #[test]
    fn a_shard_off_target_moves_and_a_leaving_leader_hands_over() {
        let plan = plan(&view(
            1,
            vec![
                led(0, &[1, 2, 3], &[1, 2, 4]),
                led(1, &[1, 2, 3], &[2, 3, 4]),
                led(2, &[1, 2, 3], &[1, 2, 3]),
            ],
        ));
        assert_eq!(
            plan,
            vec![
                ShardWork::Move {
                    shard: 0,
                    voters: set(&[1, 2, 3]),
                    learners: BTreeSet::new(),
                    target: set(&[1, 2, 4]),
                },
                ShardWork::HandOver {
                    shard: 1,
                    successor: 2,
                    balancing: false
                },
            ]
        );
    }

    #[test]
    fn moves_respect_the_free_slots_and_skip_busy_shards() {
        let mut busy = led(0, &[1, 2, 3], &[1, 2, 4]);
        busy.busy = true;
        let mut v = view(
            1,
            vec![
                busy,
                led(1, &[1, 2, 3], &[1, 3, 4]),
                led(2, &[1, 2, 3], &[1, 2, 4]),
            ],
        );
        v.free_slots = 1;
        let plan = plan(&v);
        assert_eq!(plan.len(), 1);
        assert!(matches!(plan[0], ShardWork::Move { shard: 1, .. }));
    }

    #[test]
    fn a_handover_never_goes_to_a_dead_node_and_prefers_caught_up_ones() {
        let mut v = view(1, vec![led(0, &[1, 2, 3], &[2, 3, 4])]);
        v.live = set(&[1, 3, 4]);
        assert_eq!(
            plan(&v),
            vec![ShardWork::HandOver {
                shard: 0,
                successor: 3,
                balancing: false
            }]
        );
        v.live = set(&[1, 2, 3, 4]);
        v.recovering = [(2, 0)].into_iter().collect();
        assert!(matches!(
            plan(&v)[0],
            ShardWork::HandOver { successor: 3, .. }
        ));
    }

    #[test]
    fn a_replica_is_retired_only_when_its_leader_stops_listing_it() {
        let mut v = view(4, vec![]);
        v.followed = vec![
            FollowedShard {
                shard: 0,
                target: set(&[1, 2, 3]),
                listed_by_leader: Some(set(&[1, 2, 3])),
            },
            FollowedShard {
                shard: 1,
                target: set(&[1, 2, 3]),
                listed_by_leader: Some(set(&[1, 2, 3, 4])),
            },
            FollowedShard {
                shard: 2,
                target: set(&[1, 2, 3]),
                listed_by_leader: None,
            },
            FollowedShard {
                shard: 3,
                target: set(&[2, 3, 4]),
                listed_by_leader: Some(set(&[1, 2, 3])),
            },
        ];
        assert_eq!(plan(&v), vec![ShardWork::Retire { shard: 0 }]);
    }

    #[test]
    fn balancing_hands_one_shard_to_the_least_loaded_voter() {
        let mut v = view(1, (0..4).map(|s| led(s, &[1, 2, 3], &[1, 2, 3])).collect());
        v.live = set(&[1, 2, 3]);
        v.leaders = (0..4).map(|s| (s, 1)).collect();
        v.may_balance = true;
        let plan = plan(&v);
        assert_eq!(plan.len(), 1);
        assert!(matches!(
            plan[0],
            ShardWork::HandOver {
                balancing: true,
                successor: 2,
                ..
            }
        ));
        // Not while an election is under way (a shard without a leader).
        v.leaders.remove(&3);
        assert!(super::plan(&v).is_empty());
    }

    #[test]
    fn ring_placement_hands_a_shard_back_to_its_preferred_leader() {
        // Node 2 leads its share (2 of 4) but shard 1 prefers node 3.
        let mut shards: Vec<LedShard> = (0..2).map(|s| led(s, &[1, 2, 3], &[1, 2, 3])).collect();
        shards[0].preferred = Some(2);
        shards[1].preferred = Some(3);
        let mut v = view(2, shards);
        v.live = set(&[1, 2, 3]);
        v.leaders = [(0, 2), (1, 2), (2, 1), (3, 3)].into_iter().collect();
        v.may_balance = true;
        // Spread placement: within its share, nothing to do.
        assert!(plan(&v).is_empty());
        v.restore_preferred = true;
        assert_eq!(
            plan(&v),
            vec![ShardWork::HandOver {
                shard: 1,
                successor: 3,
                balancing: true
            }]
        );
        // Not to a preferred leader catching up, down, or not a voter, nor
        // while balancing waits (cool-down, a move).
        v.recovering.insert((3, 1));
        assert!(plan(&v).is_empty());
        v.recovering.clear();
        v.live.remove(&3);
        assert!(plan(&v).is_empty());
        v.live.insert(3);
        v.led[1].voters = set(&[1, 2, 4]);
        v.led[1].target = set(&[1, 2, 4]);
        assert!(plan(&v).is_empty());
        v.led[1].voters = set(&[1, 2, 3]);
        v.led[1].target = set(&[1, 2, 3]);
        v.may_balance = false;
        assert!(plan(&v).is_empty());
    }

    #[test]
    fn ring_placement_balancing_sheds_only_shards_whose_first_replica_is_elsewhere() {
        // Node 2 leads its own two shards and two of node 1's (down): it
        // sheds node 1's, never its own, which would come straight back.
        let mut shards: Vec<LedShard> = (0..4).map(|s| led(s, &[1, 2, 3], &[1, 2, 3])).collect();
        for (shard, first) in shards.iter_mut().zip([2, 2, 1, 1]) {
            shard.preferred = Some(first);
        }
        let mut v = view(2, shards);
        v.live = set(&[2, 3]);
        v.leaders = (0..4).map(|s| (s, 2)).collect();
        v.may_balance = true;
        v.restore_preferred = true;
        match plan(&v).as_slice() {
            [ShardWork::HandOver {
                shard,
                successor: 3,
                balancing: true,
            }] => assert!(*shard >= 2, "shed its own shard {shard}"),
            other => panic!("{other:?}"),
        }
        // With only its own shards over its share, it keeps them.
        for shard in &mut v.led {
            shard.preferred = Some(2);
        }
        assert!(plan(&v).is_empty());
    }

    proptest! {
        /// Whatever the view: no more moves and handovers than free slots,
        /// none on a busy shard, handovers only to live voters other than
        /// this node, at most one balancing handover, and balancing only
        /// from a node leading more than its share or, with ring placement,
        /// to a shard's preferred leader.
        #[test]
        fn plans_keep_their_invariants(
            me in 1u64..5,
            shards in proptest::collection::vec(
                (proptest::collection::btree_set(1u64..6, 1..4),
                 proptest::collection::btree_set(1u64..6, 1..4),
                 any::<bool>()),
                0..8),
            live in proptest::collection::btree_set(1u64..6, 0..6),
            free_slots in 0usize..3,
            may_balance in any::<bool>(),
            restore_preferred in any::<bool>(),
            leaders in proptest::collection::vec(1u64..6, 0..8),
        ) {
            let led: Vec<LedShard> = shards
                .iter()
                .enumerate()
                .map(|(i, (voters, target, busy))| {
                    let mut voters = voters.clone();
                    voters.insert(me);
                    let preferred = target.iter().next().copied();
                    LedShard { shard: i as u32, voters, learners: BTreeSet::new(), target: target.clone(), busy: *busy, preferred }
                })
                .collect();
            let view = ClusterView {
                me,
                shards: leaders.len() as u32,
                led: led.clone(),
                followed: Vec::new(),
                leaders: leaders.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect(),
                live: live.clone(),
                recovering: BTreeSet::new(),
                free_slots,
                may_balance,
                restore_preferred,
            };
            let work = plan(&view);
            let started = work.iter().filter(|w| !matches!(w, ShardWork::Retire { .. })).count();
            prop_assert!(started <= free_slots);
            let mut balancing = 0;
            for w in &work {
                match w {
                    ShardWork::Move { shard, .. } => {
                        prop_assert!(!led[*shard as usize].busy);
                    }
                    ShardWork::HandOver { shard, successor, balancing: b } => {
                        let shard = &led[*shard as usize];
                        prop_assert!(!shard.busy);
                        prop_assert!(*successor != me);
                        prop_assert!(shard.voters.contains(successor));
                        prop_assert!(live.contains(successor));
                        if *b {
                            balancing += 1;
                            let mine = leaders.iter().filter(|&&l| l == me).count();
                            // A restore hands a shard to its preferred
                            // leader; a balancing handover sheds leadership
                            // above the share.
                            prop_assert!(
                                (restore_preferred && shard.preferred == Some(*successor))
                                    || mine > leaders.len().div_ceil(live.len().max(1))
                            );
                            // Restoring, a node never sheds a shard it is
                            // first replica of.
                            prop_assert!(!(restore_preferred && shard.preferred == Some(me)));
                        }
                    }
                    ShardWork::Retire { .. } => {}
                }
            }
            prop_assert!(balancing <= 1);
        }
    }
}
