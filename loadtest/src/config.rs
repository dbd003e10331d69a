//! Command-line configuration: the `Args` struct that clap parses (every flag documented here is what
//! `--help` prints), the protocol and distribution choices, and the checks that reject a configuration
//! before any socket is opened. The same struct is echoed into the JSON report, so field names here are
//! part of the JSON format.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use serde::Serialize;

use crate::droplet::BucketTemplate;
use crate::failover::ProbeArgs;
use crate::grpc::EnvoyTemplate;
use crate::windows::{window_count, WINDOWS_MAX, WINDOW_MS_DEFAULT, WINDOW_MS_MAX};

/// The template used when `--template` is not given: it matches the per-IP cookie rule of divvy's
/// example configuration (3 hits per hour per `ip`), which Tollgate embeds as its default rules.
pub const DEFAULT_TEMPLATE: &str = "method=GET path=/pantry/cookies/chocolate-chip ip={actor}";

/// The template of `--protocol take` and `--protocol droplet` when `--template` is not given: one
/// bucket per actor, 1000 tokens per second and 50000 per minute.
pub const DEFAULT_BUCKET_TEMPLATE: &str = "bucket={actor} ls=1000 lm=50000";

/// The template of `--protocol envoy-rls` when `--template` is not given: the default template's
/// operation under the domain `loadtest` (the same rule matches it: rules ignore keys they do not name).
pub const DEFAULT_ENVOY_TEMPLATE: &str =
    "domain=loadtest method=GET path=/pantry/cookies/chocolate-chip ip={actor}";

/// The rule operation used in Redis keys when `--redis-operation` is not given: the cookie rule's
/// operation with its keys sorted, as divvy writes it.
pub const DEFAULT_REDIS_OPERATION: &str = "ip=* method=GET path=/pantry/cookies/*";

/// Upper bound on `--actors`: the request table holds one preformatted request per actor.
pub const ACTORS_MAX: u64 = 20_000_000;

/// Upper bound on `--pipeline` and on `--connections`.
pub const PIPELINE_MAX: usize = 65_536;
pub const CONNECTIONS_MAX: usize = 100_000;

/// Measurements other than a load run.
#[derive(Subcommand, Clone, Debug)]
pub enum Mode {
    /// SIGKILL a cluster node and measure, through a surviving node, until every shard answers
    /// again; prints `failover_ms=N errors=N unanswered=N slowest_round_ms=N` (cluster/bench.sh
    /// reads it).
    FailoverProbe(ProbeArgs),
}

/// What to speak to the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    /// divvy's line protocol: `HIT <template>\n`, answers `OK <allowed> <credit> <reset>` or `ERR ...`.
    Divvy,
    /// Redis RESP `INCR <key>`: the cheapest possible Redis round trip (a baseline, not a limiter).
    RespIncr,
    /// Redis RESP `EVALSHA` of divvy's fixed-window Lua script (what divvy itself runs per hit).
    RespScript,
    /// Tollgate's droplet buckets on the line protocol: `TAKE <template>\n`, answers
    /// `OK true|false [l?=<balance> ...]` or `ERR ...` (after which the server closes).
    Take,
    /// droplet's protocol: a WebSocket upgrade per connection, then one masked binary frame per
    /// request carrying a protobuf `Droplet.Request` built from the template; answers are binary
    /// frames with a `Droplet.Response` (a close frame counts as an error).
    Droplet,
    /// Envoy's rate limit service: gRPC `ShouldRateLimit` calls over HTTP/2 (cleartext), `--pipeline`
    /// concurrent streams per connection, one descriptor per call built from the template
    /// (`domain=<d>` is the request's domain, every other word one entry); answers count as allowed
    /// (`OK`), denied (`OVER_LIMIT`) or errors (a gRPC error status, a reset stream, another code).
    EnvoyRls,
}

impl Protocol {
    /// The name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Divvy => "divvy",
            Protocol::RespIncr => "resp-incr",
            Protocol::RespScript => "resp-script",
            Protocol::Take => "take",
            Protocol::Droplet => "droplet",
            Protocol::EnvoyRls => "envoy-rls",
        }
    }

    /// The server closes the connection after an error answer (so the generator reconnects).
    pub fn closes_after_error(self) -> bool {
        matches!(self, Protocol::Divvy | Protocol::Take | Protocol::Droplet)
    }

    /// Speaks droplet's token buckets (`--template` in `bucket=... ls=...` form).
    pub fn uses_buckets(self) -> bool {
        matches!(self, Protocol::Take | Protocol::Droplet)
    }

    /// Speaks Redis.
    pub fn is_resp(self) -> bool {
        matches!(self, Protocol::RespIncr | Protocol::RespScript)
    }
}

/// How actors are drawn for each request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Distribution {
    /// Every actor equally likely.
    Uniform,
    /// Zipf over actor ranks: actor 0 (`a0`) is the hottest (see `--zipf-exponent`).
    Zipf,
}

/// Load generator for divvy-protocol servers (Tollgate, divvy), droplet's token buckets (as `TAKE`
/// lines or protobuf over WebSocket), Envoy's rate limit service (gRPC) and Redis.
///
/// Closed loop by default: every connection keeps `--pipeline` requests in flight. With `--rate` it
/// runs open loop: requests are due on a fixed schedule and their latency is measured from the time
/// they were due, so a slow server cannot hide its queueing (no coordinated omission).
///
/// Exit status: 0 on success, 1 on a setup or I/O failure, 3 when `--check` found a violation.
#[derive(Parser, Clone, Debug, Serialize)]
#[command(
    name = "tollgate-loadtest",
    version,
    about,
    long_about,
    args_conflicts_with_subcommands = true
)]
pub struct Args {
    /// Instead of a load run, another measurement.
    #[command(subcommand)]
    #[serde(skip)]
    pub mode: Option<Mode>,

    /// Server address, HOST:PORT; or several, comma-separated (a cluster's
    /// nodes): connection `c` then goes to the `c mod n`-th, so one
    /// generator spreads its connections evenly over them.
    #[arg(long, default_value = "127.0.0.1:8321")]
    pub target: String,

    /// Cluster only (divvy protocol): ask `--target` for the topology and
    /// send each actor's hits straight to the node leading its counter's
    /// shard, as `tollgate::cluster::ClusterClient` does, instead of to
    /// `--target` (which then forwards). Connections are spread over the
    /// leaders in proportion to their actors; each connection draws only
    /// actors its node leads (uniformly). Needs the cluster's rules
    /// (`--rules`).
    #[arg(long)]
    pub leader_aware: bool,

    /// With `--leader-aware`: the rule file the cluster serves (default: the
    /// embedded example rules, as `tollgate serve` without a file).
    #[arg(long, value_name = "FILE")]
    pub rules: Option<std::path::PathBuf>,

    /// Wire protocol to speak.
    #[arg(long, value_enum, default_value_t = Protocol::Divvy)]
    pub protocol: Protocol,

    /// Event-loop threads (each runs one mio poll over its share of the connections).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,

    /// TCP connections in total, spread round-robin over the threads. Each needs a file descriptor:
    /// the generator raises its soft `ulimit -n` up to the hard limit as needed, and refuses to start
    /// when even that is too low. Connections are opened at most 256 at a time per thread.
    #[arg(long, default_value_t = 64)]
    pub connections: usize,

    /// Requests kept in flight per connection (1 = no pipelining); for envoy-rls, concurrent calls
    /// (HTTP/2 streams) per connection, at most what the server allows (`MAX_CONCURRENT_STREAMS`).
    /// In open loop it is the most a connection sends before waiting; further due requests queue
    /// (and keep aging).
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,

    /// Open loop: total requests per second, on a fixed schedule spread evenly over the connections.
    /// Latency is measured from each request's intended send time. Without it, the run is closed loop.
    #[arg(long)]
    pub rate: Option<f64>,

    /// Open loop: send at most once per this many microseconds, at the end of each interval, every
    /// request due by then in one write per connection, as a pipelining client sends what it has
    /// (0: each request at its due time). Latency is still measured from each request's due time,
    /// so the lateness this adds (up to the interval) is counted, not hidden; in exchange the
    /// generator makes one timer wake-up and one write per connection per interval instead of one
    /// per request, which on a small machine leaves the cores to the servers being measured.
    #[arg(long, default_value_t = 0)]
    pub pace_us: u64,

    /// Measured time in seconds (fractions allowed).
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,

    /// Seconds of load before the measured time; their answers are not recorded (but are checked).
    #[arg(long, default_value_t = 0.0)]
    pub warmup: f64,

    /// Stop after this many requests in total (0 = no limit); split evenly over the connections, so
    /// with `--seed` a run is fully deterministic. The run also ends after warmup + duration.
    #[arg(long, default_value_t = 0)]
    pub requests: u64,

    /// After the measured time, seconds to wait for answers still outstanding (and, in open loop, to
    /// send requests still queued); whatever is unanswered then is reported as `unanswered`.
    #[arg(long, default_value_t = 2.0)]
    pub drain_secs: f64,

    /// Seconds to wait for every connection to be established (and, for droplet, upgraded to
    /// WebSocket) before the run starts.
    #[arg(long, default_value_t = 5.0)]
    pub connect_timeout_secs: f64,

    /// Number of distinct actors, named `<prefix>0`, `<prefix>1`, ... (substituted for `{actor}`).
    #[arg(long, default_value_t = 100_000)]
    pub actors: u64,

    /// Prefix of actor names. Give each run its own (say `r1a`, `r2a`) to start from fresh counters
    /// on a server that keeps state between runs.
    #[arg(long, default_value = "a")]
    pub actor_prefix: String,

    /// How actors are drawn for each request.
    #[arg(long, value_enum, default_value_t = Distribution::Uniform)]
    pub distribution: Distribution,

    /// Exponent of the Zipf distribution (>= 0; 0 is uniform, larger is more skewed).
    #[arg(long, default_value_t = 1.0)]
    pub zipf_exponent: f64,

    /// The request, with `{actor}` replaced by the actor's name. divvy: what follows `HIT ` [default:
    /// `method=GET path=/pantry/cookies/chocolate-chip ip={actor}`]. take: what follows `TAKE `, sent
    /// as given; droplet: the same words, translated into protobuf fields [default for both:
    /// `bucket={actor} ls=1000 lm=50000`]. droplet's words (and take's, for --check): bucket
    /// (required), id, count, reset, ls, lm, lh, ld, lw, lo (limits per second, minute, hour, day,
    /// week, 30 days), and for droplet also type (take or query); `{actor}` may stand in bucket and
    /// id. envoy-rls: `domain=<name>` (required) is the request's domain and every other `key=value`
    /// word, in order, one entry of the call's single descriptor; `{actor}` may stand anywhere
    /// [default: `domain=loadtest method=GET path=/pantry/cookies/chocolate-chip ip={actor}`].
    #[arg(long)]
    pub template: Option<String>,

    /// Seed of the per-connection random generators (the actor sequence of connection i depends only
    /// on the seed and i).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// resp-*: the rule operation written into Redis keys `divvy:<operation>:<actor>:<limit>:<secs>`
    /// (keys sorted, `k=v` joined by one space, as divvy writes them).
    #[arg(long, default_value = DEFAULT_REDIS_OPERATION)]
    pub redis_operation: String,

    /// resp-*: creditLimit of the emulated rule (key suffix and script argument). For resp-incr an
    /// answer counts as allowed while the counter is <= this limit.
    #[arg(long, default_value_t = 3)]
    pub credit_limit: i64,

    /// resp-*: resetSeconds of the emulated rule (key suffix and script argument).
    #[arg(long, default_value_t = 3600)]
    pub reset_seconds: i64,

    /// Check the answers: no actor may be allowed more than `--check-limit` times per window of
    /// `--check-window-secs` (divvy's fixed windows, aligned at the hit that opened them). Violations
    /// are reported and make the exit status 3. Not available with resp-incr. With take and droplet
    /// it checks the token-bucket bound instead: over any t seconds, a bucket admits at most
    /// `limit + limit * t / period` tokens for every period the template gives (its limits, not
    /// `--check-limit`; the template must take a positive count and not reset).
    #[arg(long)]
    pub check: bool,

    /// Allowed hits per actor and window for `--check` (default: `--credit-limit`).
    #[arg(long)]
    pub check_limit: Option<i64>,

    /// Window length in seconds for `--check` (default: `--reset-seconds`).
    #[arg(long)]
    pub check_window_secs: Option<f64>,

    /// Write one JSON line per second of the run to FILE (from the moment every connection is up):
    /// `elapsed_secs`, `interval_secs`, `phase` (warmup, measure or drain), `requests` and `errors`
    /// answered in the interval, `throughput_per_sec`, the running totals `requests_total` and
    /// `errors_total`, and `unix_time_secs` (wall clock, to line up with other samples). Each line
    /// is flushed as it is written, so the file can be followed live.
    #[arg(long, value_name = "FILE")]
    pub interval_json: Option<PathBuf>,

    /// Write latency over time to FILE as CSV, once the run is over (FILE is created when the run
    /// starts, so a path that cannot be written is refused before any load): the measured time
    /// cut into windows of `--window-ms`, one line per window after a header line
    /// `start_ms,hits,p50_us,p90_us,p99_us,max_us,over_1ms,over_2ms`. A hit belongs to the window
    /// of its due time (the time its latency is measured from); the windows hold the hits the
    /// latency figures hold. `start_ms`: the window's start in ms since the end of the warm-up;
    /// `hits`: the hits due in it; `p50_us`, `p90_us`, `p99_us`: upper bounds in µs, the upper
    /// bound of the coarse latency bucket the percentile falls in (buckets from 1 µs, each about
    /// 25 % wider than the one before; never above `max_us`, and `max_us` above about 1.27 s);
    /// `max_us`: the largest latency; `over_1ms`, `over_2ms`: the hits whose latency exceeded 1 ms
    /// and 2 ms, counted exactly. A window without hits has `hits` 0 and empty latency fields.
    /// With `--json`, the report gains `windows`: `window_ms`, `count`, `over_2ms` (the hits over
    /// 2 ms in all) and `share_of_over_2ms_in_worst_tenth` (the fraction of them in the tenth of
    /// the windows with the most, 0 when there are none).
    #[arg(long, value_name = "FILE")]
    pub window_log: Option<PathBuf>,

    /// With `--window-log`: the windows' length in milliseconds, 1 to 60000 (default: 10). The
    /// measured time may make at most 100000 windows.
    #[arg(long)]
    pub window_ms: Option<u64>,

    /// Write the results (and this configuration) as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Draw the latency percentile curve as an SVG to FILE.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,

    /// Never draw the live progress line (it is already hidden when stdout is not a terminal).
    #[arg(long)]
    pub quiet: bool,
}

impl Args {
    /// Parse from an argument list whose first item is the program name (as `std::env::args`).
    pub fn parse_from_iter<I, T>(iter: I) -> Result<Args>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Ok(Args::try_parse_from(iter)?)
    }

    /// Reject configurations that cannot run, before anything is opened.
    pub fn validate(&self) -> Result<()> {
        if self.threads == 0 {
            bail!("--threads must be at least 1");
        }
        if self.connections == 0 || self.connections > CONNECTIONS_MAX {
            bail!("--connections must be in 1..={CONNECTIONS_MAX}");
        }
        if self.threads > self.connections {
            bail!(
                "--threads ({}) exceeds --connections ({})",
                self.threads,
                self.connections
            );
        }
        if self.pipeline == 0 || self.pipeline > PIPELINE_MAX {
            bail!("--pipeline must be in 1..={PIPELINE_MAX}");
        }
        if self.leader_aware
            && (self.protocol != Protocol::Divvy || self.distribution != Distribution::Uniform)
        {
            bail!("--leader-aware needs --protocol divvy and --distribution uniform");
        }
        if self.rules.is_some() && !self.leader_aware {
            bail!("--rules is only used with --leader-aware");
        }
        if self.pace_us > 0 && self.rate.is_none() {
            bail!(
                "--pace-us {} paces an open loop: it needs --rate",
                self.pace_us
            );
        }
        if self.pace_us > 1_000_000 {
            bail!(
                "--pace-us {} is over a second: at most 1000000",
                self.pace_us
            );
        }
        if let Some(ms) = self.window_ms {
            if self.window_log.is_none() {
                bail!("--window-ms {ms} sets the windows of --window-log: it needs --window-log");
            }
            if !(1..=WINDOW_MS_MAX).contains(&ms) {
                bail!("--window-ms {ms} is out of range: 1..={WINDOW_MS_MAX}");
            }
        }
        if let Some(rate) = self.rate {
            if !(rate.is_finite() && rate > 0.0) {
                bail!("--rate must be a positive number of requests per second");
            }
        }
        for (name, v) in [
            ("--duration", self.duration),
            ("--warmup", self.warmup),
            ("--drain-secs", self.drain_secs),
            ("--connect-timeout-secs", self.connect_timeout_secs),
        ] {
            if !(v.is_finite() && (0.0..=86_400.0).contains(&v)) {
                bail!("{name} must be between 0 and 86400 seconds");
            }
        }
        if self.duration <= 0.0 {
            bail!("--duration must be positive");
        }
        if self.window_log.is_some() {
            let windows = window_count(self.duration_ns(), self.window_ns());
            if windows > WINDOWS_MAX {
                bail!(
                    "--duration {} s in windows of --window-ms {} makes {windows} windows: at \
                     most {WINDOWS_MAX} (lengthen --window-ms or shorten --duration)",
                    self.duration,
                    self.window_ms()
                );
            }
        }
        if self.actors == 0 || self.actors > ACTORS_MAX {
            bail!("--actors must be in 1..={ACTORS_MAX}");
        }
        if !(self.zipf_exponent.is_finite() && self.zipf_exponent >= 0.0) {
            bail!("--zipf-exponent must be a number >= 0");
        }
        if self.actor_prefix.contains(['\r', '\n']) {
            bail!("--actor-prefix must be a single line");
        }
        if self.template().contains(['\r', '\n']) {
            bail!("--template must be a single line");
        }
        // A TAKE template is sent as it is (the server judges it); a droplet one must translate.
        if self.protocol == Protocol::Droplet {
            let template = self.bucket_template()?;
            if self.actor_prefix.len() + template.bucket.len() + template.id.len() > 16 * 1024 {
                bail!("--template and --actor-prefix make droplet requests larger than 16 KiB");
            }
        }
        if self.protocol == Protocol::EnvoyRls {
            self.envoy_template()?;
            if self.check {
                bail!("--check is not available with --protocol envoy-rls");
            }
        }
        if self.protocol.is_resp() && self.redis_operation.contains(['\r', '\n']) {
            bail!("--redis-operation must be a single line");
        }
        if self.check {
            if self.protocol == Protocol::RespIncr {
                bail!(
                    "--check needs allowed/denied answers: use --protocol divvy, resp-script, \
                     take or droplet"
                );
            }
            if self.protocol.uses_buckets() {
                let t = self.bucket_template()?;
                let p = self.protocol.name();
                if t.given_limits().is_empty() {
                    bail!(
                        "--check with --protocol {p}: the template gives no limit (ls=, lm=, ...)"
                    );
                }
                // droplet's default count is 1.
                let positive_count = matches!(t.count, None | Some(1..));
                if !positive_count || t.reset == Some(true) || t.kind.unwrap_or(0) != 0 {
                    bail!(
                        "--check with --protocol {p}: the template must take a positive count, \
                         without reset=true or type=query"
                    );
                }
                if self.check_limit.is_some() || self.check_window_secs.is_some() {
                    bail!(
                        "--check-limit and --check-window-secs are for fixed windows; with \
                         --protocol {p} the template's limits are checked"
                    );
                }
                return Ok(());
            }
            if self.check_limit() < 0 {
                bail!("--check-limit must be >= 0");
            }
            let w = self.check_window_secs();
            if !(w.is_finite() && w > 0.0) {
                bail!("--check-window-secs must be positive");
            }
        }
        Ok(())
    }

    /// The template in effect: `--template`, or the protocol's default.
    pub fn template(&self) -> &str {
        match (&self.template, self.protocol) {
            (Some(t), _) => t,
            (None, Protocol::EnvoyRls) => DEFAULT_ENVOY_TEMPLATE,
            (None, p) if p.uses_buckets() => DEFAULT_BUCKET_TEMPLATE,
            (None, _) => DEFAULT_TEMPLATE,
        }
    }

    /// The template parsed as a domain and descriptor entries (envoy-rls).
    pub fn envoy_template(&self) -> Result<EnvoyTemplate> {
        EnvoyTemplate::parse(self.template())
            .with_context(|| format!("--template {:?}", self.template()))
    }

    /// The template parsed as bucket words (take and droplet).
    pub fn bucket_template(&self) -> Result<BucketTemplate> {
        BucketTemplate::parse(self.template(), self.protocol == Protocol::Droplet)
            .with_context(|| format!("--template {:?}", self.template()))
    }

    /// The limit `--check` enforces.
    pub fn check_limit(&self) -> i64 {
        self.check_limit.unwrap_or(self.credit_limit)
    }

    /// The window `--check` enforces, in seconds.
    pub fn check_window_secs(&self) -> f64 {
        self.check_window_secs.unwrap_or(self.reset_seconds as f64)
    }

    /// `--duration` in ns (the measured time's length in the run's plan).
    pub fn duration_ns(&self) -> u64 {
        (self.duration * 1e9) as u64
    }

    /// The windows' length of `--window-log` in ms: `--window-ms`, or its default.
    pub fn window_ms(&self) -> u64 {
        self.window_ms.unwrap_or(WINDOW_MS_DEFAULT)
    }

    /// The windows' length of `--window-log` in ns.
    pub fn window_ns(&self) -> u64 {
        self.window_ms().saturating_mul(1_000_000)
    }

    /// The first of `--target`'s addresses (see [`Args::target_addrs`]).
    pub fn target_addr(&self) -> Result<SocketAddr> {
        Ok(self.target_addrs()?[0])
    }

    /// Resolves each of `--target`'s comma-separated addresses to one socket
    /// address (the first the resolver gives).
    pub fn target_addrs(&self) -> Result<Vec<SocketAddr>> {
        self.target
            .split(',')
            .map(|target| {
                let target = target.trim();
                target
                    .to_socket_addrs()
                    .with_context(|| format!("cannot resolve --target {target}"))?
                    .next()
                    .with_context(|| format!("--target {target} resolves to no address"))
            })
            .collect()
    }

    /// The first of `--target`'s addresses as given (a host name for the
    /// protocols that send one).
    pub fn first_target(&self) -> &str {
        self.target.split(',').next().unwrap_or_default().trim()
    }
}
