//! Partitions with real processes: every peer link goes through a
//! fault-injection proxy (tests/cluster_support/proxy.rs). The proxy itself
//! is tested first against an echo server; then the node leading the most
//! shards is cut off under load (strict mode): it answers its hits with a
//! prompt `ERR` and never a `true`, the majority elects new leaders and
//! keeps serving, and after healing the cluster converges with no counter
//! going backwards and no limit exceeded. On four nodes, answers a
//! follower relays into a blackholed link are answered by the leader's
//! fallback.

use crate::cluster_support::proxy::{Mode, Proxy};
use crate::cluster_support::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// An echo server on a free port, on its own thread (one thread per
/// connection; it ends with the test process).
fn echo_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if stream.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

fn connect(proxy: &Proxy) -> TcpStream {
    let stream = TcpStream::connect(proxy.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(1_500)))
        .unwrap();
    stream
}

/// Sends `text` and reads the echo; `None` when nothing (or not all) came
/// back within the read timeout, or the connection closed.
fn echo(stream: &mut TcpStream, text: &[u8]) -> Option<Duration> {
    let sent = Instant::now();
    stream.write_all(text).ok()?;
    let mut got = vec![0u8; text.len()];
    stream.read_exact(&mut got).ok()?;
    assert_eq!(got, text);
    Some(sent.elapsed())
}

#[test]
fn the_proxy_forwards_cuts_blackholes_delays_and_heals() {
    let proxy = Proxy::start(echo_server());
    let mut stream = connect(&proxy);
    assert!(echo(&mut stream, b"hello").is_some());
    // The echo's bytes are counted just after they are written: on a loaded
    // machine the client may read them before they are counted.
    let deadline = Instant::now() + Duration::from_secs(1);
    while proxy.stats().bytes_forwarded < 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let stats = proxy.stats();
    assert_eq!((stats.connections, stats.bytes_forwarded), (1, 10));

    // Delay: each chunk arrives after the delay, both ways.
    proxy.set_delay(150);
    let took = echo(&mut stream, b"slow").unwrap();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    proxy.set_delay(0);

    // Blackhole: the connection stays open, nothing comes back, and the
    // bytes are counted as dropped; a new connection is blackholed too.
    proxy.blackhole();
    assert_eq!(proxy.mode(), Mode::Blackhole);
    assert!(echo(&mut stream, b"lost").is_none());
    let mut during = connect(&proxy);
    assert!(echo(&mut during, b"lost too").is_none());
    assert!(proxy.stats().bytes_dropped >= 12);

    // Heal: streams with holes are closed; new connections forward.
    proxy.heal();
    let mut buf = [0u8; 1];
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)));
    let mut stream = connect(&proxy);
    assert!(echo(&mut stream, b"back").is_some());

    // Cut: open connections close at once, new ones are closed on accept.
    proxy.cut();
    let cut_at = Instant::now();
    assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)));
    assert!(cut_at.elapsed() < Duration::from_millis(500));
    let mut refused = connect(&proxy);
    assert!(matches!(refused.read(&mut buf), Ok(0) | Err(_)));
    assert!(proxy.stats().refused >= 1);
    proxy.heal();
    let mut stream = connect(&proxy);
    assert!(echo(&mut stream, b"healed").is_some());
    // The last echo's bytes are counted just after they are written.
    let deadline = Instant::now() + Duration::from_secs(1);
    while proxy.stats().bytes_forwarded < 38 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let forwarded = proxy.stats().bytes_forwarded;
    drop(proxy);
    // Dropping the proxy closes its connections.
    assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)));
    assert!(forwarded >= 2 * (5 + 4 + 4 + 6) as u64, "{forwarded}");
}

const SHARDS: u32 = 8;
const BIG_LIMIT: i64 = 1_000_000;
const LIMITED: i64 = 200;
/// `--commit-timeout-ms` of this test: an isolated leader's hit waits for the
/// proposal in flight, then its own, so it answers within twice this.
const COMMIT_TIMEOUT_MS: u64 = 400;
const FORWARD_TIMEOUT_MS: u64 = 1_000;
/// Longest an isolated node may take to answer a hit: two commit timeouts
/// (or one forward timeout), plus slack for a loaded two-core machine.
const PROMPT_ERR_BOUND: Duration = Duration::from_millis(2 * COMMIT_TIMEOUT_MS + 700);

fn big_users() -> Vec<String> {
    (0..24).map(|i| format!("b{i}")).collect()
}

/// `used` per big user, read through `addr`.
fn sample(addr: std::net::SocketAddr) -> Vec<i64> {
    big_users()
        .iter()
        .map(|u| {
            peek_used(addr, "/big", BIG_LIMIT, u).unwrap_or_else(|| panic!("PEEK {u} via {addr}"))
        })
        .collect()
}

#[test]
fn strict_cut_off_leader_answers_err_promptly_majority_serves_and_heals() {
    isolated_leader_under_load(Fault::Cut);
}

#[test]
fn strict_blackholed_leader_answers_err_promptly_majority_serves_and_heals() {
    isolated_leader_under_load(Fault::Blackhole);
}

/// The tests of this file run one at a time: each measures timings on a
/// two-core machine.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn isolated_leader_under_load(fault: Fault) {
    let _machine = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let timeout_flags = [
        "--commit-timeout-ms".to_string(),
        COMMIT_TIMEOUT_MS.to_string(),
        "--forward-timeout-ms".to_string(),
        FORWARD_TIMEOUT_MS.to_string(),
    ];
    let flags: Vec<&str> = timeout_flags.iter().map(String::as_str).collect();
    let cluster = TestCluster::start_proxied(3, SHARDS, &flags);
    let mut lines: Vec<String> = big_users()
        .iter()
        .map(|u| format!("HIT path=/big user={u}"))
        .collect();
    let limited_users = ["l0", "l1", "l2"];
    for u in limited_users {
        lines.push(format!("HIT path=/limited user={u}"));
    }
    let shard_of_line: Vec<u32> = lines
        .iter()
        .map(|line| {
            let user = line.rsplit("user=").next().unwrap();
            if line.contains("/big") {
                shard_of_user(SHARDS, "path=/big", BIG_LIMIT as u64, 600, user)
            } else {
                shard_of_user(SHARDS, "path=/limited", LIMITED as u64, 60, user)
            }
        })
        .collect();
    let lines = std::sync::Arc::new(lines);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let log: HitLog = Default::default();
    let threads = spawn_load_on_all(&cluster, &lines, 8, Duration::from_millis(5), &stop, &log);
    std::thread::sleep(Duration::from_millis(1_500));

    // The victim: the node leading the most shards.
    let topology = cluster.topology().unwrap();
    let victim = (1..=3)
        .max_by_key(|&id| {
            topology
                .placement
                .iter()
                .filter(|s| s.leader == Some(id))
                .count()
        })
        .unwrap();
    let led: Vec<u32> = topology
        .placement
        .iter()
        .filter(|s| s.leader == Some(victim))
        .map(|s| s.shard)
        .collect();
    let majority: Vec<u64> = (1..=3).filter(|&id| id != victim).collect();
    for (&(from, to), proxy) in &cluster.proxies {
        assert!(
            proxy.stats().bytes_forwarded > 0,
            "nothing went through the proxy of {from} -> {to}"
        );
    }
    let before = sample(cluster.client(majority[0]));
    std::thread::sleep(Duration::from_millis(300));

    cluster.isolate(victim, fault);
    let cut_at = Instant::now();
    let election = wait_shards_serve(cluster.client(majority[0]), SHARDS, Duration::from_secs(10));
    let elected_at = Instant::now();
    wait_shards_serve(cluster.client(majority[1]), SHARDS, Duration::from_secs(5));
    // A hit of a shard the isolated node led, alone on its connection, every
    // 300 ms for 3 s: the load's own batches may never lead with one (the
    // server closes a connection after an `ERR`, so only a batch's first
    // failing hit gets its answer).
    let led_user = &users_led_by(&topology, SHARDS, victim, "isolated", 1)[0];
    let led_probe = [format!("HIT path=/big user={led_user}")];
    let mut led_answers: Vec<(Duration, String)> = Vec::new();
    let probing_until = Instant::now() + Duration::from_millis(3_000);
    while Instant::now() < probing_until {
        let sent = Instant::now();
        let answer = converse(cluster.client(victim), &led_probe)
            .pop()
            .unwrap_or_else(|| "(no answer)".into());
        led_answers.push((sent.elapsed(), answer));
        std::thread::sleep(Duration::from_millis(300));
    }
    let during = sample(cluster.client(majority[1]));
    let (refused, dropped): (u64, u64) = cluster
        .proxies
        .iter()
        .filter(|((from, to), _)| *from == victim || *to == victim)
        .map(|(_, p)| (p.stats().refused, p.stats().bytes_dropped))
        .fold((0, 0), |(r, d), (pr, pd)| (r + pr, d + pd));

    cluster.heal_all();
    let healed_at = Instant::now();
    cluster.wait_converged(Duration::from_secs(30));
    let converged = healed_at.elapsed();
    for node in 1..=3 {
        wait_shards_serve(cluster.client(node), SHARDS, Duration::from_secs(10));
    }
    let serving_at = Instant::now();
    std::thread::sleep(Duration::from_millis(1_500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    let after: Vec<Vec<i64>> = (1..=3).map(|node| sample(cluster.client(node))).collect();
    let log = std::mem::take(&mut *log.lock().unwrap());

    // 1. The isolated node: no `true` for anything sent after the cut, and
    //    every answer prompt; hits of the shards it led answer `ERR`.
    let partitioned = |h: &&Hit| h.sent >= cut_at && h.sent < healed_at;
    let on_victim: Vec<&Hit> = log
        .iter()
        .filter(|h| h.node == victim)
        .filter(partitioned)
        .collect();
    // A hit sent shortly before the healing may be retried (it was not
    // decided) and admitted by a leader reachable again after it: so the
    // property is that no `true` is answered while the node is cut off.
    let trues: Vec<Duration> = on_victim
        .iter()
        .filter(|h| h.answer == Answered::True && h.answered < healed_at)
        .map(|h| h.answered - h.sent)
        .collect();
    assert!(
        trues.is_empty(),
        "the isolated node admitted {} hits while cut off (answered after {trues:?})",
        trues.len()
    );
    let mut led_errs: Vec<Duration> = on_victim
        .iter()
        .filter(|h| led.contains(&shard_of_line[h.line]) && matches!(h.answer, Answered::Err(_)))
        .map(|h| h.answered - h.sent)
        .collect();
    for (took, answer) in &led_answers {
        assert!(
            answer.starts_with("ERR ") && *took <= PROMPT_ERR_BOUND,
            "a hit of shard {} (led by the isolated node {victim}) answered {answer:?} after {took:?}",
            shard_of_user(SHARDS, "path=/big", BIG_LIMIT as u64, 600, led_user)
        );
        led_errs.push(*took);
    }
    assert!(
        !led_errs.is_empty(),
        "no ERR for the led shards on the isolated node"
    );
    let slowest = on_victim
        .iter()
        .map(|h| h.answered - h.sent)
        .max()
        .unwrap_or_default();
    assert!(
        slowest <= PROMPT_ERR_BOUND,
        "the isolated node took {slowest:?} to answer"
    );
    let mut sorted = led_errs.clone();
    sorted.sort();

    // 2. The majority: after the election, every hit answers `OK`.
    let settled = elected_at + Duration::from_millis(1_000);
    let majority_after: Vec<&Hit> = log
        .iter()
        .filter(|h| h.node != victim && h.sent >= settled && h.sent < healed_at)
        .collect();
    let majority_failed: Vec<&&Hit> = majority_after
        .iter()
        .filter(|h| matches!(h.answer, Answered::Err(_) | Answered::Lost))
        .collect();
    for h in &majority_failed {
        eprintln!(
            "majority failure: node {} sent {:?} after the cut, answered in {:?}: {:?}",
            h.node,
            h.sent - cut_at,
            h.answered - h.sent,
            h.answer
        );
    }
    eprintln!("elected {:?} after the cut", elected_at - cut_at);
    assert!(
        majority_failed.is_empty(),
        "the majority failed {} of {} hits after electing: {:?}",
        majority_failed.len(),
        majority_after.len(),
        majority_failed.first()
    );
    assert!(
        majority_after.len() > 100,
        "too little load on the majority"
    );

    // 3. After healing: every node serves every shard; nothing sent once
    //    they all did fails.
    let late_failures = log
        .iter()
        .filter(|h| h.sent >= serving_at + Duration::from_millis(500))
        .filter(|h| matches!(h.answer, Answered::Err(_) | Answered::Lost))
        .count();
    assert_eq!(late_failures, 0, "hits failed after the cluster converged");

    // 4. Counters never went backwards; strict forgot no acknowledged hit
    //    and counted at most the failed ones on top; limits held.
    for view in &after[1..] {
        assert_eq!(view, &after[0], "nodes read different counters");
    }
    for (i, user) in big_users().iter().enumerate() {
        assert!(
            before[i] <= during[i] && during[i] <= after[0][i],
            "{user} went backwards: {} -> {} -> {}",
            before[i],
            during[i],
            after[0][i]
        );
        let acknowledged = log
            .iter()
            .filter(|h| h.line == i && h.answer == Answered::True)
            .count() as i64;
        let failed = log
            .iter()
            .filter(|h| h.line == i && matches!(h.answer, Answered::Err(_) | Answered::Lost))
            .count() as i64;
        assert!(
            after[0][i] >= acknowledged && after[0][i] <= acknowledged + failed,
            "{user}: counted {}, {acknowledged} acknowledged, {failed} failed",
            after[0][i]
        );
    }
    for (offset, user) in limited_users.iter().enumerate() {
        let line = big_users().len() + offset;
        let admitted = log
            .iter()
            .filter(|h| h.line == line && h.answer == Answered::True)
            .count() as i64;
        assert!(admitted <= LIMITED, "{user}: {admitted} admitted");
    }
    match fault {
        Fault::Cut => assert!(refused > 0, "the cut refused no reconnection"),
        Fault::Blackhole => assert!(dropped > 0, "the blackhole dropped nothing"),
    }
    // 4. The isolated node's log names each peer it lost, once it could
    //    not hear it (a blackholed connection stays open: it is the peer's
    //    silence that tells), and says when it was back.
    let victim_log = cluster.log(victim);
    for &peer in &majority {
        let addr = cluster.link(victim, peer).addr;
        let line = format!("peer node {peer} at {addr} is ");
        let lost = victim_log.find(&format!("{line}unreachable: "));
        let back = victim_log.find(&format!("{line}reachable again"));
        assert!(
            lost.is_some() && back > lost,
            "{fault:?}: node {victim}'s log does not say it lost node {peer}, then had it back:\n{victim_log}"
        );
    }
    eprintln!(
        "{fault:?}: victim {victim} led {led:?}; election {election:?}; isolated node: {} answers, {} ERR for led shards, latency median {:?} max {:?}, slowest answer {slowest:?}; majority {} hits after electing; converged {converged:?} after healing; {} hits in all",
        on_victim.len(),
        led_errs.len(),
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
        majority_after.len(),
        log.len()
    );
}

/// Pipelined through node `via`, two hits of each of `users` (of the
/// `[path=/chaos]` rule, 1000 an hour, fresh): each answered in request
/// order, counting down, none an error.
fn hit_twice_each(cluster: &TestCluster, via: u64, users: &[String]) {
    let lines: Vec<String> = users
        .iter()
        .flat_map(|u| [0, 1].map(|_| format!("HIT path=/chaos user={u}")))
        .collect();
    let answers = converse(cluster.client(via), &lines);
    assert_eq!(answers.len(), lines.len(), "node {via}: {answers:?}");
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(
            parse_ok(answer).map(|(_, credit, _)| credit),
            Some(if i % 2 == 0 { 999 } else { 998 }),
            "node {via}, {}: {answer}",
            lines[i]
        );
    }
}

/// Strict mode on four nodes: the node holding no replica of a shard gets
/// its forwarded hits' answers from a follower the leader relays them
/// through (peer protocol 2.4). With both followers' links to that node
/// blackholed (open, every byte dropped), what they relay is lost, and the
/// leader's own answers, its fallback, still answer every hit right and in
/// order, whichever follower's ack committed their round.
#[test]
fn answers_relayed_into_a_blackhole_are_answered_by_the_leader() {
    const SHARDS: u32 = 8;
    let cluster = TestCluster::start_observed(4, SHARDS, &[], true);
    let topology = cluster.wait_healthy(Duration::from_secs(30));
    let shard = topology
        .placement
        .iter()
        .find(|s| s.replicas.len() == 3 && s.leader.is_some())
        .expect("a led shard of three replicas");
    let leader = shard.leader.unwrap();
    let followers: Vec<u64> = shard
        .replicas
        .iter()
        .copied()
        .filter(|&n| n != leader)
        .collect();
    let outsider = (1..=4).find(|n| !shard.replicas.contains(n)).unwrap();
    let users_of_shard = |prefix: &str| -> Vec<String> {
        (0..)
            .map(|i| format!("{prefix}-{i}"))
            .filter(|u| shard_of_user(SHARDS, "path=/chaos", 1000, 3600, u) == shard.shard)
            .take(12)
            .collect()
    };
    let relayed = || -> f64 {
        followers
            .iter()
            .map(|&f| {
                metric(
                    cluster.metrics_addr(f),
                    "tollgate_cluster_relayed_answers_total",
                )
                .unwrap_or_else(|| panic!("node {f} has no relayed answers series"))
            })
            .sum()
    };
    // Linked up: the followers relay the outsider's answers.
    let before = relayed();
    hit_twice_each(&cluster, outsider, &users_of_shard("linked"));
    assert!(
        relayed() > before,
        "shard {}: nothing relayed to node {outsider}",
        shard.shard
    );
    // Both followers' links to the outsider swallow what they send.
    for &follower in &followers {
        cluster.link(follower, outsider).blackhole();
    }
    // Each follower in turn gets its rounds late (300 ms), so that the
    // other one's ack commits them: whichever of the two relays, in one of
    // the turns its own ack commits the section, and the leader then sends
    // its fallback with its next write rather than at once.
    for (turn, &late) in followers.iter().enumerate() {
        cluster.link(leader, late).set_delay(300);
        let before = relayed();
        hit_twice_each(
            &cluster,
            outsider,
            &users_of_shard(&format!("blackholed-{turn}")),
        );
        // The late follower may relay after the hits were answered.
        let deadline = Instant::now() + Duration::from_secs(10);
        while relayed() <= before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            relayed() > before,
            "turn {turn}: the followers relayed into the blackhole"
        );
        cluster.link(leader, late).set_delay(0);
    }
    for &follower in &followers {
        cluster.link(follower, outsider).heal();
    }
}
