#!/usr/bin/env bash
# soak.sh: a bounded soak of Tollgate on loopback: thousands of connections and a million distinct
# actors for a fixed time, with the server's resident memory sampled every second.
#
# What runs: `tollgate serve <rules> --listen 127.0.0.1:0 --threads 1` (plus --droplet-listen for
# SOAK_PROTOCOL=droplet) with a rule file written here:
#     [op=soak actor=*]  creditLimit = 1000000, resetSeconds = 3600, actorField = actor
#     [default]          creditLimit = 0
# and the load generator, closed loop, SOAK_CONNECTIONS connections with one request in flight
# each, actors drawn uniformly from SOAK_ACTORS (every actor gets its own counter, which lives for
# the rule's hour, so the server's key set grows until every actor has been seen, then stays put).
#
# The checks (any failure makes the exit status 1):
#   1. no errors: the generator reports 0 errors and 0 unanswered requests;
#   2. steady throughput: the mean throughput of the last third of the measured time is at least
#      70% of the first third's (per-second figures from the generator's --interval-json);
#   3. bounded memory: after the first third, the server's RSS never exceeds
#      1.5 x (its RSS at the end of the first third) + 64 MiB.
#      (The first third is where the key set fills; a leak per request or per connection keeps
#      growing after it, and a run long enough to matter crosses the bound.)
#
# Usage:
#   loadtest/soak.sh                                         # the long form: 60 s, 2000 connections
#   SOAK_SECONDS=15 SOAK_CONNECTIONS=1000 loadtest/soak.sh   # the short form (CI)
#   SOAK_SECONDS=3600 SOAK_CONNECTIONS=5000 loadtest/soak.sh # an operator's hour-long soak
# At tens of thousands of requests per second, a 60 s run sees most but not all of a million
# actors, so the key set (and RSS) is still growing, more slowly, after the first third; the summary
# prints the estimated number of counters and the RSS each new one cost, to tell that from a leak
# (hash tables grow by doubling, so RSS moves in steps: read that figure over long runs).
#
# Environment (all optional):
#   SOAK_SECONDS=60          measured seconds (the short CI form uses 15)
#   SOAK_CONNECTIONS=2000    connections (the short CI form uses 1000)
#   SOAK_ACTORS=1000000      distinct actors
#   SOAK_THREADS=1           load generator threads (the server has one)
#   SOAK_PIPELINE=1          requests in flight per connection
#   SOAK_PROTOCOL=divvy      divvy (HIT lines), take (TAKE lines) or droplet (WebSocket); take and
#                            droplet use the generator's default bucket template
#   SOAK_WARMUP=2            unmeasured seconds before the measured time
#   OUT=<dir>                where the CSV, JSON and logs go (default: a new /tmp/tollgate-soak.* dir)
#   TOLLGATE_BIN, LOADTEST_BIN  binaries to use; otherwise release binaries are built with cargo
#   CARGO_TARGET_DIR         as for cargo;  SKIP_BUILD=1  use the binaries already built
#
# Files in OUT: rss.csv (unix_time_secs,elapsed_secs,rss_kib: one server sample per second),
# intervals.jsonl (the generator's per-second lines), report.json (its final report), soak.ini,
# tollgate.log, loadtest.log, summary.json.
#
# Needs python3 (for the analysis) and Linux (/proc). Raises `ulimit -n` as far as the connections
# need (one descriptor each, in the server and in the generator); fails clearly if the hard limit is
# too low. Everything started here is stopped on exit.
set -euo pipefail
export LC_ALL=C # a '.' decimal point in $EPOCHREALTIME and awk

SOAK_SECONDS=${SOAK_SECONDS:-60}
SOAK_CONNECTIONS=${SOAK_CONNECTIONS:-2000}
SOAK_ACTORS=${SOAK_ACTORS:-1000000}
SOAK_THREADS=${SOAK_THREADS:-1}
SOAK_PIPELINE=${SOAK_PIPELINE:-1}
SOAK_PROTOCOL=${SOAK_PROTOCOL:-divvy}
SOAK_WARMUP=${SOAK_WARMUP:-2}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=${OUT:-$(mktemp -d /tmp/tollgate-soak.XXXXXX)}
mkdir -p "$OUT"

fail() {
    echo "soak.sh: $*" >&2
    exit 1
}

command -v python3 >/dev/null || fail "python3 is needed"
[[ -n ${EPOCHREALTIME:-} ]] || fail "bash 5 or later is needed (for \$EPOCHREALTIME)"
[[ -r /proc/self/status ]] || fail "/proc is needed (Linux) to sample the server's memory"
case $SOAK_PROTOCOL in
    divvy | take | droplet) ;;
    *) fail "SOAK_PROTOCOL must be divvy, take or droplet, not $SOAK_PROTOCOL" ;;
esac
for v in SOAK_SECONDS SOAK_CONNECTIONS SOAK_ACTORS SOAK_THREADS SOAK_PIPELINE SOAK_WARMUP; do
    [[ ${!v} =~ ^[0-9]+$ ]] || fail "$v must be a whole number, not '${!v}'"
done
((SOAK_SECONDS >= 3)) || fail "SOAK_SECONDS must be at least 3 (the checks compare thirds)"

# shellcheck source=loadtest/common.sh
source "$ROOT/loadtest/common.sh"
find_binaries soak.sh

# Descriptors: each process holds one per connection, plus its own files and listeners.
NEED_FDS=$((SOAK_CONNECTIONS + 1024))
HARD_FDS=$(ulimit -Hn)
if [[ $HARD_FDS != unlimited ]] && ((HARD_FDS < NEED_FDS)); then
    fail "$SOAK_CONNECTIONS connections need about $NEED_FDS file descriptors per process, but the hard limit is $HARD_FDS: raise it (as root: ulimit -Hn $NEED_FDS) or lower SOAK_CONNECTIONS"
fi
if [[ $(ulimit -Sn) != unlimited ]] && (($(ulimit -Sn) < NEED_FDS)); then
    ulimit -Sn "$NEED_FDS"
fi

cat >"$OUT/soak.ini" <<'EOF'
; Written by loadtest/soak.sh: one counter per actor, a limit no soak reaches.
[op=soak actor=*]
creditLimit = 1000000
resetSeconds = 3600
actorField = actor

[default]
creditLimit = 0
resetSeconds = 60
EOF

echo "== starting tollgate (1 serving thread); results in $OUT"
SERVER_ARGS=(serve "$OUT/soak.ini" --listen 127.0.0.1:0 --threads 1
    --connections-max $((SOAK_CONNECTIONS + 100)))
if [[ $SOAK_PROTOCOL == droplet ]]; then
    SERVER_ARGS+=(--droplet-listen 127.0.0.1:0)
fi
"$TOLLGATE" "${SERVER_ARGS[@]}" >"$OUT/tollgate.log" 2>&1 &
SERVER_PID=$!
PIDS+=("$SERVER_PID")

# The address the server printed for PROTOCOL (divvy or droplet), once it has.
server_addr() {
    sed -n "s/.*listening on \([^ ]*\) ($1 protocol).*/\1/p" "$OUT/tollgate.log" | head -n 1
}
ADDR=
WANT=divvy
[[ $SOAK_PROTOCOL == droplet ]] && WANT=droplet
for _ in $(seq 1 200); do
    kill -0 "$SERVER_PID" 2>/dev/null || {
        cat "$OUT/tollgate.log" >&2
        fail "tollgate exited during startup (its log is above)"
    }
    ADDR=$(server_addr "$WANT")
    [[ -n $ADDR ]] && break
    sleep 0.1
done
[[ -n $ADDR ]] || fail "tollgate did not report its address within 20 s (see $OUT/tollgate.log)"
echo "   tollgate pid $SERVER_PID at $ADDR ($SOAK_PROTOCOL)"

# One RSS sample per second until the server exits or the sampler is stopped.
sample_rss() {
    local start=$EPOCHREALTIME rss now
    echo "unix_time_secs,elapsed_secs,rss_kib"
    while rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$SERVER_PID/status" 2>/dev/null) && [[ -n $rss ]]; do
        now=$EPOCHREALTIME
        echo "$now,$(awk -v a="$now" -v b="$start" 'BEGIN {printf "%.3f", a - b}'),$rss"
        sleep 1
    done
}
sample_rss >"$OUT/rss.csv" &
SAMPLER_PID=$!
PIDS+=("$SAMPLER_PID")

GEN_ARGS=(--target "$ADDR" --protocol "$SOAK_PROTOCOL" --connections "$SOAK_CONNECTIONS"
    --threads "$SOAK_THREADS" --pipeline "$SOAK_PIPELINE" --actors "$SOAK_ACTORS"
    --distribution uniform --duration "$SOAK_SECONDS" --warmup "$SOAK_WARMUP" --drain-secs 10
    --connect-timeout-secs 120 --quiet --interval-json "$OUT/intervals.jsonl"
    --json "$OUT/report.json")
if [[ $SOAK_PROTOCOL == divvy ]]; then
    GEN_ARGS+=(--template "op=soak actor={actor}")
fi
echo "== soaking: $SOAK_CONNECTIONS connections x pipeline $SOAK_PIPELINE, $SOAK_ACTORS actors (uniform), ${SOAK_WARMUP} s warmup + ${SOAK_SECONDS} s"
GEN_RC=0
"$LOADTEST" "${GEN_ARGS[@]}" >"$OUT/loadtest.log" 2>&1 &
GEN_PID=$!
PIDS+=("$GEN_PID")
wait "$GEN_PID" || GEN_RC=$?
cat "$OUT/loadtest.log"
kill "$SAMPLER_PID" 2>/dev/null || true
wait "$SAMPLER_PID" 2>/dev/null || true
kill -0 "$SERVER_PID" 2>/dev/null || fail "tollgate died during the soak (see $OUT/tollgate.log)"
[[ $GEN_RC -eq 0 ]] || fail "the load generator failed (exit $GEN_RC; its output is above)"

python3 - "$OUT" "$SOAK_WARMUP" "$SOAK_SECONDS" <<'EOF'
import csv, json, math, sys

out, warmup, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
report = json.load(open(f"{out}/report.json"))
lines = [json.loads(l) for l in open(f"{out}/intervals.jsonl") if l.strip()]
samples = [(float(r["unix_time_secs"]), int(r["rss_kib"])) for r in csv.DictReader(open(f"{out}/rss.csv"))]
if not lines or not samples:
    sys.exit("soak.sh: no per-second figures or no RSS samples were recorded")

# The run's time origin on the wall clock (every connection up), from the generator's lines.
origin = lines[0]["unix_time_secs"] - lines[0]["elapsed_secs"]
third = seconds / 3
first_end, last_start, end = warmup + third, warmup + 2 * third, warmup + seconds

def throughput(lo, hi):
    # Per-second lines whose interval's middle is in (lo, hi]: answers / seconds.
    sel = [l for l in lines if l["interval_secs"] >= 0.5 and lo < l["elapsed_secs"] - l["interval_secs"] / 2 <= hi]
    secs = sum(l["interval_secs"] for l in sel)
    return (sum(l["requests"] for l in sel) / secs if secs else 0.0), len(sel)

first_tp, n_first = throughput(warmup, first_end)
last_tp, n_last = throughput(last_start, end)
rates = [l["throughput_per_sec"] for l in lines if l["phase"] == "measure" and l["interval_secs"] >= 0.5]

rss = [(t - origin, kib) for t, kib in samples]
before = [kib for t, kib in rss if t <= first_end]
after = [kib for t, kib in rss if first_end < t <= end]
baseline = before[-1] if before else rss[0][1]
peak_after = max(after) if after else baseline
bound = 1.5 * baseline + 64 * 1024
during = [kib for t, kib in rss if 0 <= t <= end]

checks = [
    ("no errors", report["errors"] == 0 and report["unanswered"] == 0,
     f"errors {report['errors']}, unanswered {report['unanswered']}, reconnects {report['reconnects']}"),
    ("steady throughput", n_first > 0 and n_last > 0 and last_tp >= 0.7 * first_tp,
     f"last third {last_tp:,.0f}/s vs first third {first_tp:,.0f}/s "
     f"({(last_tp / first_tp * 100) if first_tp else 0:.0f}%, need >= 70%)"),
    ("bounded memory", bool(after) and peak_after <= bound,
     f"peak RSS after the first third {peak_after / 1024:.1f} MiB vs bound {bound / 1024:.1f} MiB "
     f"(1.5 x {baseline / 1024:.1f} MiB + 64 MiB)"),
]
# Information only: the counters the server should hold (uniform draws: actors * (1 - e^(-n/actors))
# distinct actors after n requests), and what each new one cost after the first third.
actors = report["config"]["actors"]
def seen(t):
    done = [l["requests_total"] for l in lines if l["elapsed_secs"] <= t + 0.5]
    return actors * (1 - math.exp(-(done[-1] if done else 0) / actors))
keys_first, keys_end = seen(first_end), seen(end)
per_key = (((during[-1] if during else baseline) - baseline) * 1024 / (keys_end - keys_first)) if keys_end - keys_first > 1000 else None
lat = report["latency_us"]
print()
print("== soak summary")
print(f"   measured      {report['duration_secs']:.1f} s, {report['requests']:,} requests, "
      f"{report['throughput_per_sec']:,.0f}/s overall (allowed {report['allowed']:,}, denied {report['denied']:,})")
if rates:
    print(f"   per second    min {min(rates):,.0f}  median {sorted(rates)[len(rates) // 2]:,.0f}  max {max(rates):,.0f}")
print(f"   latency (us)  p50 {lat['p50']}  p99 {lat['p99']}  p99.9 {lat['p999']}  max {lat['max']}")
if during:
    print(f"   server RSS    start {during[0] / 1024:.1f} MiB, end of first third {baseline / 1024:.1f} MiB, "
          f"end {during[-1] / 1024:.1f} MiB, peak {max(during) / 1024:.1f} MiB ({len(during)} samples)")
print(f"   counters      ~{keys_first:,.0f} distinct actors seen by the end of the first third, ~{keys_end:,.0f} by the end"
      + (f"; RSS grew {per_key:,.0f} bytes per new one since" if per_key is not None else ""))
ok = True
for name, passed, detail in checks:
    ok &= passed
    print(f"   {'PASS' if passed else 'FAIL'}  {name:<18} {detail}")
json.dump({
    "passed": ok,
    "checks": {name: {"passed": passed, "detail": detail} for name, passed, detail in checks},
    "throughput_first_third_per_sec": first_tp,
    "throughput_last_third_per_sec": last_tp,
    "rss_kib_end_of_first_third": baseline,
    "rss_kib_peak_after_first_third": peak_after,
    "rss_kib_bound": bound,
    "distinct_actors_estimated_end_of_first_third": keys_first,
    "distinct_actors_estimated_end": keys_end,
    "rss_bytes_per_new_actor_after_first_third": per_key,
    "report": {k: report[k] for k in ("requests", "throughput_per_sec", "allowed", "denied", "errors",
                                       "unanswered", "reconnects", "latency_us", "duration_secs")},
}, open(f"{out}/summary.json", "w"), indent=2)
print(f"   (files in {out})")
sys.exit(0 if ok else 1)
EOF
