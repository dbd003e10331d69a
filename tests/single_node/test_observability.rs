//! Observability over real sockets: Prometheus scraped over HTTP after a known
//! sequence of hits (exact series, labels and counts, parsed with a Prometheus
//! text parser), health and readiness, statsd received on real UDP and TCP
//! sockets, and a dead or stalled statsd sink that must not slow hits.

use crate::util;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::metrics::StatsdDrop;
use tollgate::observability::health::Readiness;
use tollgate::observability::http::HttpConfig;
use tollgate::observability::statsd::{StatsdConfig, StatsdTransport};
use tollgate::observability::{Observability, Observed};
use util::{converse, request, TestServer};

/// A canary rule in front of a labelled stop rule, an unlabelled limited rule,
/// and an unlabelled always-deny default.
const RULES: &str = "
[method=GET path=/canary]
creditLimit = 1
resetSeconds = 60
matchPolicy = canary
label = canary-probe

[method=GET]
creditLimit = 2
resetSeconds = 60
label = get-limit

[method=PUT]
creditLimit = 5
resetSeconds = 60

[default]
creditLimit = 0
resetSeconds = 60
";

/// How long a test waits for something asynchronous before failing.
const PATIENCE: Duration = Duration::from_secs(10);

/// Runs the known sequence and returns how many connections it opened.
///
/// Expected counts: canary-accepted{canary-probe} 1, canary-rejected{canary-probe} 2,
/// accepted{get-limit} 2, rejected{get-limit} 1, accepted{""} 1 (PUT),
/// rejected{""} 1 (default); errors unknown-command 1, unknown 1; 5
/// successful HITs.
fn run_known_sequence(server: &TestServer) -> u64 {
    let answers = converse(
        server.addr,
        b"HIT method=GET path=/canary\nHIT method=GET path=/canary\nHIT method=GET path=/canary\n\
          HIT method=PUT\nHIT method=POST\n",
    );
    assert_eq!(
        answers,
        "OK true 1 60\nOK true 0 60\nOK false 0 60\nOK true 4 60\nOK false 0 -1\n"
    );
    assert_eq!(
        converse(server.addr, b"FOO bar\nHIT method=GET\n"),
        "ERR unknown-command \"Unrecognized command: FOO\"\n"
    );
    assert_eq!(
        converse(server.addr, b"HIT a b\n"),
        "ERR unknown \"Expected '=', found ' '\"\n"
    );
    3
}

fn observed(server: &TestServer) -> Observed {
    Observed {
        engine: Arc::clone(&server.engine),
        store: Some(Arc::clone(&server.store)),
        buckets: None,
        readiness: Arc::new(Readiness::new(Arc::clone(&server.engine.metrics))),
        cluster: None,
    }
}

fn start_http(server: &TestServer, path: &str) -> Observability {
    let config = HttpConfig::new("127.0.0.1:0".parse().unwrap(), path.to_owned());
    Observability::start_with(Some(config), None, observed(server)).expect("start the endpoint")
}

struct HttpAnswer {
    status: u16,
    headers: String,
    body: String,
}

/// One HTTP/1.1 request on a fresh connection, read until the server closes.
fn http_get(addr: SocketAddr, target: &str) -> HttpAnswer {
    let mut stream = TcpStream::connect(addr).expect("connect to the HTTP endpoint");
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        stream,
        "GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    stream
        .read_to_string(&mut raw)
        .expect("read the HTTP answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a header block");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("a status code");
    HttpAnswer {
        status,
        headers: head.to_owned(),
        body: body.to_owned(),
    }
}

fn scrape(addr: SocketAddr) -> prometheus_parse::Scrape {
    let answer = http_get(addr, "/metrics");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(
        answer.headers.lines().any(|line| line
            .trim_end()
            .eq_ignore_ascii_case("content-type: text/plain; version=0.0.4; charset=utf-8")),
        "{}",
        answer.headers
    );
    promtool_check(&answer.body);
    prometheus_parse::Scrape::parse(answer.body.lines().map(|l| Ok(l.to_owned())))
        .expect("the exposition parses")
}

/// `promtool check metrics` when promtool is installed (Debian's
/// `prometheus` package); the Rust parser above checks in every case.
fn promtool_check(text: &str) {
    let Ok(mut child) = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    else {
        eprintln!("promtool not found: skipping `promtool check metrics`");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let complaints = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    // promtool's lint asks counters to end in _total; divvy's gauge named
    // `divvy_tcp_connections_total` is kept for compatibility.
    let unexpected: Vec<&str> = complaints
        .lines()
        .filter(|line| !line.trim().is_empty())
        .filter(|line| !line.contains("divvy_tcp_connections_total"))
        .collect();
    assert!(unexpected.is_empty(), "promtool: {complaints}");
}

/// Series of one family as (labels, value), labels rendered `k=v,…` sorted.
fn series(scrape: &prometheus_parse::Scrape, name: &str) -> BTreeMap<String, f64> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .map(|s| {
            let mut labels: Vec<String> =
                s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            labels.sort();
            let value = match &s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => *v,
                other => panic!("{name}: unexpected value {other:?}"),
            };
            (labels.join(","), value)
        })
        .collect()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn prometheus_shows_divvys_series_with_exact_labels_and_counts() {
    let server = TestServer::start_ini(RULES);
    let observability = start_http(&server, "/metrics");
    let addr = observability.http_addr().unwrap();
    run_known_sequence(&server);
    wait_for("connections to close", || {
        server.engine.metrics.connections_open() == 0
    });

    let scraped = scrape(addr);
    let divvy_names: BTreeSet<&str> = scraped
        .samples
        .iter()
        .map(|s| s.metric.as_str())
        .filter(|name| name.starts_with("divvy_"))
        .collect();
    assert_eq!(
        divvy_names,
        BTreeSet::from([
            "divvy_errors_total",
            "divvy_hit_duration_seconds",
            "divvy_hit_duration_seconds_count",
            "divvy_hit_duration_seconds_sum",
            "divvy_hits_total",
            "divvy_tcp_connections_total",
        ])
    );
    assert_eq!(
        series(&scraped, "divvy_hits_total"),
        BTreeMap::from([
            ("rule_label=,status=accepted".to_owned(), 1.0),
            ("rule_label=,status=rejected".to_owned(), 1.0),
            (
                "rule_label=canary-probe,status=canary-accepted".to_owned(),
                1.0
            ),
            (
                "rule_label=canary-probe,status=canary-rejected".to_owned(),
                2.0
            ),
            ("rule_label=get-limit,status=accepted".to_owned(), 2.0),
            ("rule_label=get-limit,status=rejected".to_owned(), 1.0),
        ])
    );
    assert_eq!(
        series(&scraped, "divvy_errors_total"),
        BTreeMap::from([
            ("code=unknown".to_owned(), 1.0),
            ("code=unknown-command".to_owned(), 1.0),
        ])
    );
    assert_eq!(
        series(&scraped, "divvy_tcp_connections_total"),
        BTreeMap::from([(String::new(), 0.0)])
    );

    let histogram = scraped
        .samples
        .iter()
        .find(|s| s.metric == "divvy_hit_duration_seconds")
        .expect("the histogram");
    let prometheus_parse::Value::Histogram(buckets) = &histogram.value else {
        panic!("divvy_hit_duration_seconds is not a histogram: {histogram:?}");
    };
    let bounds: Vec<f64> = buckets.iter().map(|b| b.less_than).collect();
    assert_eq!(bounds, [0.001, 0.002, 0.005, 0.01, 0.1, 0.5, f64::INFINITY]);
    let counts: Vec<f64> = buckets.iter().map(|b| b.count).collect();
    assert!(
        counts.windows(2).all(|w| w[0] <= w[1]),
        "buckets are cumulative: {counts:?}"
    );
    assert_eq!(counts.last(), Some(&5.0), "5 successful HITs: {counts:?}");
    assert_eq!(
        series(&scraped, "divvy_hit_duration_seconds_count"),
        BTreeMap::from([(String::new(), 5.0)])
    );
    let sum = series(&scraped, "divvy_hit_duration_seconds_sum")[""];
    assert!(sum > 0.0 && sum < 5.0, "5 HITs took {sum} s in total");

    // The text itself, as divvy's prom-client wrote it.
    let text = http_get(addr, "/metrics").body;
    for line in [
        "# HELP divvy_tcp_connections_total Total number of open TCP connections to Divvy.",
        "# TYPE divvy_tcp_connections_total gauge",
        "divvy_tcp_connections_total 0",
        "# HELP divvy_hit_duration_seconds Histogram of Divvy processing time for HITs.",
        "# TYPE divvy_hit_duration_seconds histogram",
        "divvy_hit_duration_seconds_count 5",
        "# HELP divvy_hits_total Counter of total HITs to Divvy.",
        "# TYPE divvy_hits_total counter",
        "divvy_hits_total{status=\"accepted\",rule_label=\"get-limit\"} 2",
        "divvy_hits_total{status=\"rejected\",rule_label=\"\"} 1",
        "# HELP divvy_errors_total Counter of total Divvy errors.",
        "# TYPE divvy_errors_total counter",
        "divvy_errors_total{code=\"unknown-command\"} 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("divvy_hit_duration_seconds_bucket{le=\"0.001\"} ")),
        "{text}"
    );
    observability.stop();
}

#[test]
fn connections_gauge_counts_open_connections() {
    let server = TestServer::start_ini(RULES);
    let observability = start_http(&server, "/metrics");
    let addr = observability.http_addr().unwrap();
    let mut first = server.connect();
    let mut second = server.connect();
    // A reply on each proves both are being served.
    assert_eq!(request(&mut first, "HIT method=PUT"), "OK true 4 60");
    assert_eq!(request(&mut second, "HIT method=PUT"), "OK true 3 60");
    let gauge = |addr| series(&scrape(addr), "divvy_tcp_connections_total")[""];
    assert_eq!(gauge(addr), 2.0);
    drop(first);
    wait_for("the gauge to drop to 1", || gauge(addr) == 1.0);
    drop(second);
    wait_for("the gauge to drop to 0", || gauge(addr) == 0.0);
}

#[test]
fn tollgate_series_report_keys_connections_and_backend() {
    let server = TestServer::start_ini(RULES);
    let observability = start_http(&server, "/metrics");
    let addr = observability.http_addr().unwrap();
    let connections = run_known_sequence(&server);
    wait_for("connections to close", || {
        server.engine.metrics.connections_open() == 0
    });
    let scraped = scrape(addr);
    let one = |name: &str| {
        let found = series(&scraped, name);
        assert_eq!(found.len(), 1, "{name}: {found:?}");
        found.into_values().next().unwrap()
    };
    // One counter each for the canary rule, get-limit and the PUT rule; the
    // always-deny default keeps none.
    assert_eq!(one("tollgate_live_keys"), 3.0);
    assert_eq!(
        one("tollgate_live_keys_max"),
        server.store.live_keys_max() as f64
    );
    assert_eq!(one("tollgate_rules"), 4.0);
    assert_eq!(
        one("tollgate_connections_accepted_total"),
        connections as f64
    );
    assert_eq!(one("tollgate_connections_refused_total"), 0.0);
    assert_eq!(
        series(&scraped, "tollgate_backend_healthy"),
        BTreeMap::from([("backend=memory".to_owned(), 1.0)])
    );
    assert_eq!(
        series(&scraped, "tollgate_backend_errors_total"),
        BTreeMap::from([("backend=memory".to_owned(), 0.0)])
    );
    assert_eq!(
        series(&scraped, "tollgate_statsd_dropped_total"),
        BTreeMap::from([
            ("reason=queue_full".to_owned(), 0.0),
            ("reason=send_failed".to_owned(), 0.0),
        ])
    );
    assert_eq!(
        series(&scraped, "tollgate_build_info"),
        BTreeMap::from([(format!("version={}", env!("CARGO_PKG_VERSION")), 1.0)])
    );
    // The sweeper is not running in tests: no sweeps yet, and the family is there.
    assert_eq!(one("tollgate_sweeps_total"), 0.0);
    assert_eq!(one("tollgate_swept_keys_total"), 0.0);

    server.engine.metrics.backend_error();
    server.engine.metrics.set_backend_healthy(false);
    let scraped = scrape(addr);
    assert_eq!(
        series(&scraped, "tollgate_backend_errors_total"),
        BTreeMap::from([("backend=memory".to_owned(), 1.0)])
    );
    assert_eq!(
        series(&scraped, "tollgate_backend_healthy"),
        BTreeMap::from([("backend=memory".to_owned(), 0.0)])
    );
}

#[test]
fn droplet_buckets_are_counted() {
    use tollgate::droplet::{Buckets, BucketsConfig};
    use tollgate::limiter::droplet_bucket::TakeRequest;
    let server = TestServer::start_ini(RULES);
    let buckets = Arc::new(Buckets::new(BucketsConfig::default()));
    let config = HttpConfig::new("127.0.0.1:0".parse().unwrap(), "/metrics".into());
    let observability = Observability::start_with(
        Some(config),
        None,
        Observed {
            buckets: Some(Arc::clone(&buckets)),
            ..observed(&server)
        },
    )
    .unwrap();
    let addr = observability.http_addr().unwrap();
    assert_eq!(
        series(&scrape(addr), "tollgate_droplet_buckets"),
        BTreeMap::from([(String::new(), 0.0)])
    );
    let mut per_second = TakeRequest::default();
    per_second.limits[0] = 10;
    for name in ["first", "second", "first"] {
        buckets
            .take(name.as_bytes(), &per_second, 1_700_000_000_000)
            .unwrap();
    }
    assert_eq!(
        series(&scrape(addr), "tollgate_droplet_buckets"),
        BTreeMap::from([(String::new(), 2.0)])
    );
}

#[test]
fn refused_connections_are_counted() {
    let limits = tollgate::server::Limits {
        connections_max: 1,
        ..Default::default()
    };
    let options = util::TestOptions {
        limits,
        ..Default::default()
    };
    let server = TestServer::start(tollgate::rules::RuleSet::from_ini(RULES).unwrap(), options);
    let observability = start_http(&server, "/metrics");
    let mut held = server.connect();
    assert_eq!(request(&mut held, "HIT method=PUT"), "OK true 4 60");
    assert_eq!(
        converse(server.addr, b"HIT method=PUT\n"),
        "ERR unknown \"too many connections\"\n"
    );
    let scraped = scrape(observability.http_addr().unwrap());
    assert_eq!(
        series(&scraped, "tollgate_connections_refused_total")[""],
        1.0
    );
}

#[test]
fn only_the_exact_metrics_path_serves_metrics() {
    let server = TestServer::start_ini(RULES);
    let observability = start_http(&server, "/custom/metrics");
    let addr = observability.http_addr().unwrap();
    assert_eq!(http_get(addr, "/custom/metrics").status, 200);
    for other in [
        "/metrics",
        "/custom/metrics/",
        "/custom/metrics?x=1",
        "/custom",
        "/",
    ] {
        let answer = http_get(addr, other);
        assert_eq!(answer.status, 404, "{other}");
        assert!(answer.body.is_empty(), "{other}: {}", answer.body);
    }
}

#[test]
fn health_is_live_and_readiness_follows_serving_and_backend() {
    let server = TestServer::start_ini(RULES);
    let observability = start_http(&server, "/metrics");
    let addr = observability.http_addr().unwrap();
    let healthz = http_get(addr, "/healthz");
    assert_eq!((healthz.status, healthz.body.as_str()), (200, "ok\n"));

    let not_serving = http_get(addr, "/readyz");
    assert_eq!(not_serving.status, 503);
    assert!(
        not_serving.body.contains("not serving"),
        "{}",
        not_serving.body
    );

    observability.readiness().set_serving(true);
    let ready = http_get(addr, "/readyz");
    assert_eq!((ready.status, ready.body.as_str()), (200, "ready\n"));

    server.engine.metrics.set_backend_healthy(false);
    let backend_down = http_get(addr, "/readyz");
    assert_eq!(backend_down.status, 503);
    assert!(
        backend_down.body.contains("backend unavailable"),
        "{}",
        backend_down.body
    );
    assert_eq!(http_get(addr, "/healthz").status, 200, "still live");

    server.engine.metrics.set_backend_healthy(true);
    assert_eq!(http_get(addr, "/readyz").status, 200);
    observability.readiness().set_serving(false);
    assert_eq!(http_get(addr, "/readyz").status, 503, "draining");
}

#[test]
fn readiness_consults_extra_checks() {
    let server = TestServer::start_ini(RULES);
    let leaderless = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = Arc::clone(&leaderless);
    let readiness =
        Readiness::new(Arc::clone(&server.engine.metrics)).with_check(Arc::new(move || match flag
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            true => Err("shard 3 has no reachable leader".to_owned()),
            false => Ok(()),
        }));
    readiness.set_serving(true);
    let config = HttpConfig::new("127.0.0.1:0".parse().unwrap(), "/metrics".into());
    let observability = Observability::start_with(
        Some(config),
        None,
        Observed {
            readiness: Arc::new(readiness),
            ..observed(&server)
        },
    )
    .unwrap();
    let addr = observability.http_addr().unwrap();
    let answer = http_get(addr, "/readyz");
    assert_eq!(answer.status, 503);
    assert!(
        answer.body.contains("shard 3 has no reachable leader"),
        "{}",
        answer.body
    );
    leaderless.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(http_get(addr, "/readyz").status, 200);
}

/// Statsd lines received so far, with the datagrams they came in.
#[derive(Default)]
struct Received {
    datagrams: Vec<String>,
}

impl Received {
    fn lines(&self) -> impl Iterator<Item = &str> {
        self.datagrams
            .iter()
            .flat_map(|d| d.split('\n'))
            .filter(|l| !l.is_empty())
    }

    /// The sum of every `name:N|c` line.
    fn counter(&self, name: &str) -> u64 {
        self.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.strip_suffix("|c"))
            .map(|n| n.parse::<u64>().expect("a counter value"))
            .sum()
    }

    fn timings(&self, name: &str) -> Vec<f64> {
        self.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.strip_suffix("|ms"))
            .map(|n| n.parse::<f64>().expect("a timing value"))
            .collect()
    }

    fn last_gauge(&self, name: &str) -> Option<i64> {
        self.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.strip_suffix("|g"))
            .map(|n| n.parse::<i64>().expect("a gauge value"))
            .last()
    }

    fn names(&self) -> BTreeSet<String> {
        self.lines()
            .map(|l| l.split(':').next().unwrap().to_owned())
            .collect()
    }
}

fn statsd_config(port: u16, prefix: &str, transport: StatsdTransport) -> StatsdConfig {
    let mut config = StatsdConfig::new("127.0.0.1".into(), port, prefix.into(), transport);
    config.flush_interval_ms = 50;
    config
}

/// Checks the statsd view of [`run_known_sequence`] with prefix `p` (`"P."`
/// or `""`).
fn assert_statsd_sequence(received: &Received, p: &str) {
    let c = |name: &str| received.counter(&format!("{p}{name}"));
    assert_eq!(c("hit.accepted"), 3, "get-limit 2 + PUT 1");
    assert_eq!(c("hit.accepted.get-limit"), 2);
    assert_eq!(c("hit.rejected"), 2, "get-limit 1 + default 1");
    assert_eq!(c("hit.rejected.get-limit"), 1);
    assert_eq!(c("hit.canary-accepted"), 1);
    assert_eq!(c("hit.canary-accepted.canary-probe"), 1);
    assert_eq!(c("hit.canary-rejected"), 2);
    assert_eq!(c("hit.canary-rejected.canary-probe"), 2);
    assert_eq!(c("error.unknown-command"), 1);
    assert_eq!(c("error.unknown"), 1);
    let timings = received.timings(&format!("{p}hit"));
    assert_eq!(timings.len(), 5, "one timing per successful HIT");
    assert!(timings.iter().all(|&ms| (0.0..10_000.0).contains(&ms)));
    assert_eq!(received.last_gauge(&format!("{p}connections")), Some(0));
    let expected: BTreeSet<String> = [
        "hit.accepted",
        "hit.accepted.get-limit",
        "hit.rejected",
        "hit.rejected.get-limit",
        "hit.canary-accepted",
        "hit.canary-accepted.canary-probe",
        "hit.canary-rejected",
        "hit.canary-rejected.canary-probe",
        "error.unknown-command",
        "error.unknown",
        "hit",
        "connections",
    ]
    .iter()
    .map(|name| format!("{p}{name}"))
    .collect();
    assert_eq!(
        received.names(),
        expected,
        "no other name, no unlabelled `hit.<status>.`"
    );
}

/// Whether everything [`run_known_sequence`] produces has arrived.
fn sequence_arrived(received: &Received, p: &str) -> bool {
    received.timings(&format!("{p}hit")).len() >= 5
        && received.counter(&format!("{p}error.unknown")) >= 1
        && received.last_gauge(&format!("{p}connections")) == Some(0)
}

#[test]
fn statsd_over_udp_sends_divvys_names_packed_in_datagrams() {
    let sink = UdpSocket::bind("127.0.0.1:0").unwrap();
    sink.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let port = sink.local_addr().unwrap().port();
    let server = TestServer::start_ini(RULES);
    let observability = Observability::start_with(
        None,
        Some(statsd_config(port, "P", StatsdTransport::Udp)),
        observed(&server),
    )
    .unwrap();
    run_known_sequence(&server);
    // A pipelined burst: its timings are queued within one flush interval
    // or two, so they share datagrams.
    let burst = "HIT method=PUT\n".repeat(20);
    let answers = converse(server.addr, burst.as_bytes());
    assert_eq!(answers.lines().count(), 20);

    let mut received = Received::default();
    let deadline = Instant::now() + PATIENCE;
    let mut buf = [0u8; 65_536];
    while !(sequence_arrived(&received, "P.") && received.timings("P.hit").len() >= 25) {
        assert!(
            Instant::now() < deadline,
            "got only {:?}",
            received.datagrams
        );
        if let Ok(n) = sink.recv(&mut buf) {
            received
                .datagrams
                .push(String::from_utf8(buf[..n].to_vec()).unwrap());
        }
    }
    observability.stop();
    while let Ok(n) = sink.recv(&mut buf) {
        received
            .datagrams
            .push(String::from_utf8(buf[..n].to_vec()).unwrap());
    }
    assert!(received.datagrams.iter().all(|d| d.len() <= 1400));
    assert!(
        received.datagrams.iter().any(|d| d.split('\n').count() > 1),
        "several metrics per datagram: {:?}",
        received.datagrams
    );
    // The burst's 20 PUTs: 4 credits were left after the sequence's PUT.
    let burst_accepted = 4;
    assert_eq!(received.counter("P.hit.accepted"), 3 + burst_accepted);
    assert_eq!(
        received.counter("P.hit.rejected"),
        2 + (20 - burst_accepted)
    );
    assert_eq!(received.timings("P.hit").len(), 25);
    assert_eq!(
        received.counter("P.hit.accepted.get-limit"),
        2,
        "unlabelled PUTs add no labelled line"
    );
}

#[test]
fn statsd_over_tcp_sends_newline_terminated_lines_without_prefix() {
    let sink = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = sink.local_addr().unwrap().port();
    let server = TestServer::start_ini(RULES);
    let observability = Observability::start_with(
        None,
        Some(statsd_config(port, "", StatsdTransport::Tcp)),
        observed(&server),
    )
    .unwrap();
    run_known_sequence(&server);
    let (stream, _) = sink.accept().unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut reader = BufReader::new(stream);
    let mut received = Received::default();
    let deadline = Instant::now() + PATIENCE;
    while !sequence_arrived(&received, "") {
        assert!(
            Instant::now() < deadline,
            "got only {:?}",
            received.datagrams
        );
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("read a statsd line");
        assert!(n > 0, "the sender closed the connection early");
        assert!(line.ends_with('\n'), "{line:?}");
        received
            .datagrams
            .push(line.trim_end_matches('\n').to_owned());
    }
    observability.stop();
    assert_statsd_sequence(&received, "");
}

#[test]
fn statsd_view_of_the_known_sequence_over_udp() {
    let sink = UdpSocket::bind("127.0.0.1:0").unwrap();
    sink.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let port = sink.local_addr().unwrap().port();
    let server = TestServer::start_ini(RULES);
    let observability = Observability::start_with(
        None,
        Some(statsd_config(port, "P", StatsdTransport::Udp)),
        observed(&server),
    )
    .unwrap();
    run_known_sequence(&server);
    let mut received = Received::default();
    let deadline = Instant::now() + PATIENCE;
    let mut buf = [0u8; 65_536];
    while !sequence_arrived(&received, "P.") {
        assert!(
            Instant::now() < deadline,
            "got only {:?}",
            received.datagrams
        );
        if let Ok(n) = sink.recv(&mut buf) {
            received
                .datagrams
                .push(String::from_utf8(buf[..n].to_vec()).unwrap());
        }
    }
    observability.stop();
    while let Ok(n) = sink.recv(&mut buf) {
        received
            .datagrams
            .push(String::from_utf8(buf[..n].to_vec()).unwrap());
    }
    assert_statsd_sequence(&received, "P.");
}

/// Sends `count` pipelined HITs on one connection and returns how long the
/// answers took; every answer must be an `OK`.
fn timed_hits(server: &TestServer, count: usize) -> Duration {
    let started = Instant::now();
    let answers = converse(server.addr, "HIT method=GET\n".repeat(count).as_bytes());
    let elapsed = started.elapsed();
    assert_eq!(answers.lines().count(), count);
    assert!(answers.lines().all(|l| l.starts_with("OK ")), "{answers}");
    elapsed
}

/// A loopback listener whose connections have a tiny receive buffer.
fn stalled_listener() -> TcpListener {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(1024).unwrap();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    socket.bind(&addr.into()).unwrap();
    socket.listen(8).unwrap();
    socket.into()
}

#[test]
fn a_dead_or_stalled_statsd_sink_does_not_slow_or_fail_hits() {
    // Nobody listens on these ports any more.
    let closed_udp = UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let closed_tcp = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // This one accepts (the kernel completes the handshake) and never reads;
    // with a tiny receive buffer its window closes at once and writes stall.
    let stalled = stalled_listener();
    let stalled_port = stalled.local_addr().unwrap().port();

    for (what, port, transport) in [
        ("closed UDP port", closed_udp, StatsdTransport::Udp),
        ("closed TCP port", closed_tcp, StatsdTransport::Tcp),
        ("stalled TCP sink", stalled_port, StatsdTransport::Tcp),
    ] {
        let server = TestServer::start_ini(RULES);
        let mut config = statsd_config(port, "P", transport);
        // A small queue, so the stalled sink also overflows it.
        config.timing_queue_len = 256;
        config.tcp_timeout_ms = 500;
        let observability =
            Observability::start_with(None, Some(config), observed(&server)).unwrap();
        let metrics = Arc::clone(&server.engine.metrics);
        let mut slowest = Duration::ZERO;
        for _ in 0..20 {
            slowest = slowest.max(timed_hits(&server, 500));
        }
        // 500 pipelined hits take milliseconds; one blocking statsd send per
        // hit (or per batch, with a 500 ms timeout) would take far longer.
        assert!(
            slowest < Duration::from_secs(2),
            "{what}: 500 hits took {slowest:?}"
        );
        // Keep hitting: a closed UDP port refuses only the datagram after
        // the one that drew the ICMP "port unreachable".
        wait_for(&format!("{what}: failed sends to be counted"), || {
            timed_hits(&server, 200);
            metrics.statsd_dropped_total(StatsdDrop::SendFailed) > 0
        });
        assert!(
            metrics.statsd_dropped_total(StatsdDrop::QueueFull) > 0,
            "{what}: 500 timings at once overflow a 256-slot queue"
        );
        let stopping = Instant::now();
        observability.stop();
        assert!(
            stopping.elapsed() < Duration::from_secs(5),
            "{what}: stopping took {:?}",
            stopping.elapsed()
        );
    }
    drop(stalled);
}

#[test]
fn requests_are_counted_per_protocol() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    use tollgate::droplet::proto::RequestMessage;
    use tollgate::droplet::DropletConfig;
    use tollgate::envoy::GrpcConfig;
    use util::envoy::{descriptor, request, GrpcClient};

    let config = tollgate::app::ServeConfig {
        droplet: DropletConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            ..DropletConfig::default()
        },
        grpc: GrpcConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            ..GrpcConfig::default()
        },
        ..util::test_config(tollgate::rules::RuleSet::from_ini(RULES).unwrap())
    };
    let server = TestServer::start_app(config, tollgate::app::Hooks::default());
    let observability = start_http(&server, "/metrics");
    let addr = observability.http_addr().unwrap();
    let counts = |divvy: f64, droplet: f64, envoy: f64| {
        BTreeMap::from([
            ("protocol=divvy".to_owned(), divvy),
            ("protocol=droplet".to_owned(), droplet),
            ("protocol=envoy".to_owned(), envoy),
        ])
    };
    assert_eq!(
        series(&scrape(addr), "tollgate_requests_total"),
        counts(0.0, 0.0, 0.0)
    );

    // The line protocol: six lines in one write, then a line the server
    // refuses (it counts too) on another connection.
    let answers = converse(server.addr, "HIT method=PUT\n".repeat(6).as_bytes());
    assert_eq!(answers.lines().count(), 6, "{answers}");
    assert!(converse(server.addr, b"FOO\n").starts_with("ERR unknown-command"));

    // droplet: three requests on one WebSocket.
    let droplet_url = format!("ws://{}/", server.app.droplet_addr().unwrap());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (mut ws, _) = tokio_tungstenite::connect_async(droplet_url).await.unwrap();
        for _ in 0..3 {
            let take = RequestMessage {
                bucket: Some(b"b".to_vec()),
                id: Some(b"test".to_vec()),
                ls: Some(10),
                ..RequestMessage::default()
            };
            ws.send(Message::Binary(prost::Message::encode_to_vec(&take).into()))
                .await
                .unwrap();
            let answer = tokio::time::timeout(PATIENCE, ws.next()).await.unwrap();
            assert!(matches!(answer, Some(Ok(Message::Binary(_)))), "{answer:?}");
        }
    });

    // Envoy: four calls, one of them refused (empty domain).
    let mut grpc = GrpcClient::connect(server.app.grpc_addr().unwrap());
    for _ in 0..3 {
        grpc.call(request(vec![descriptor(&[("method", "PUT")])]))
            .unwrap();
    }
    let mut empty_domain = request(vec![descriptor(&[("method", "PUT")])]);
    empty_domain.domain = String::new();
    assert_eq!(
        grpc.call(empty_domain).unwrap_err().code(),
        tonic::Code::InvalidArgument
    );

    // The divvy count is added when a read batch is done, after its answers
    // were written: wait for it rather than race it.
    wait_for("every request counted", || {
        series(&scrape(addr), "tollgate_requests_total") == counts(7.0, 3.0, 4.0)
    });
}
