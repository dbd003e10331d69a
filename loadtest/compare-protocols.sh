#!/usr/bin/env bash
# compare-protocols.sh: one Tollgate serving the three protocols (divvy's line protocol, droplet's
# WebSocket, Envoy's gRPC rate limit service), loaded by the same generator with the same connection
# and in-flight counts, runs ALTERNATING between the protocols (divvy, droplet, envoy-rls, divvy, ...)
# so that drifts of a shared machine hit all three alike. Besides the generator's throughput and
# latencies, it reads the server's CPU time from /proc/PID/stat around every run and reports the
# server's CPU per request (the figure that does not depend on how busy the machine's other core was).
#
# Then, open loop: envoy-rls at half of its median closed-loop throughput (latency measured from each
# call's intended send time), and divvy at the same rate for comparison.
#
# Requests (embedded default rules, 100k actors, uniform):
#   divvy      HIT method=GET path=/pantry/cookies/chocolate-chip ip=<actor>          (3 per hour per ip)
#   envoy-rls  domain=loadtest + the same three entries, one descriptor              (the same rule)
#   droplet    bucket=<actor> ls=1000 lm=50000                                        (a token bucket)
#
# Environment (all optional):
#   DURATION=5      measured seconds per run        WARMUP=1     unrecorded seconds before each run
#   ROUNDS=3        runs per protocol               THREADS=1    load generator threads
#   CONNECTIONS=64  connections per run             PIPELINE=32  requests (streams) in flight each
#   ACTORS=100000   PROTOCOLS="divvy droplet envoy-rls"   OPEN_LOOP=1 (0: skip the open-loop runs)
#   OUT=<dir>       where the JSON results and logs go (default: a new /tmp/tollgate-protocols.* dir)
#   CARGO_TARGET_DIR  as for cargo;  SKIP_BUILD=1  use the binaries already built
#   TOLLGATE_BIN, LOADTEST_BIN  binaries to use instead of the ones cargo builds
#   TOLLGATE_THREADS=1  serving threads: one, since the generator takes the other core of a 2-core
#                       machine (give more on a bigger machine)
#
# Every run uses its own actor names (prefix <protocol>r<round>), so each starts from fresh
# counters. Everything started here is stopped on exit.
set -euo pipefail

DURATION=${DURATION:-5}
WARMUP=${WARMUP:-1}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-1}
CONNECTIONS=${CONNECTIONS:-64}
PIPELINE=${PIPELINE:-32}
ACTORS=${ACTORS:-100000}
PROTOCOLS=${PROTOCOLS:-divvy droplet envoy-rls}
OPEN_LOOP=${OPEN_LOOP:-1}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=${OUT:-$(mktemp -d /tmp/tollgate-protocols.XXXXXX)}
mkdir -p "$OUT"

command -v python3 >/dev/null || { echo "compare-protocols.sh: python3 is needed" >&2; exit 1; }

# shellcheck source=loadtest/common.sh
source "$ROOT/loadtest/common.sh"
find_binaries compare-protocols.sh

echo "== starting tollgate (embedded default rules, three endpoints) on loopback; results in $OUT"
"$TOLLGATE" serve --listen 127.0.0.1:0 --droplet-listen 127.0.0.1:0 --grpc-listen=127.0.0.1:0 \
    --threads "${TOLLGATE_THREADS:-1}" >"$OUT/tollgate.log" 2>&1 &
SERVER_PID=$!
PIDS+=("$SERVER_PID")
addr_of() { # addr_of KIND: the address the log says KIND listens on
    python3 -c '
import re, sys
m = re.search(r"listening on (\S+) \(" + re.escape(sys.argv[2]), open(sys.argv[1], errors="replace").read())
print(m.group(1) if m else "")' "$OUT/tollgate.log" "$1"
}
for _ in $(seq 1 200); do
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "compare-protocols.sh: tollgate exited:" >&2; cat "$OUT/tollgate.log" >&2; exit 1; }
    [[ -n $(addr_of "Envoy") ]] && break
    sleep 0.1
done
declare -A TARGET=([divvy]=$(addr_of "divvy protocol") [droplet]=$(addr_of "droplet protocol") [envoy-rls]=$(addr_of "Envoy"))
for p in $PROTOCOLS; do
    [[ -n ${TARGET[$p]:-} ]] || { echo "compare-protocols.sh: no address for $p in the log:" >&2; cat "$OUT/tollgate.log" >&2; exit 1; }
done
echo "   divvy at ${TARGET[divvy]}, droplet at ${TARGET[droplet]}, envoy-rls at ${TARGET[envoy-rls]}"

# The server's user + system CPU time, in clock ticks.
server_ticks() { awk '{print $14 + $15}' "/proc/$SERVER_PID/stat"; }

run_one() { # run_one NAME PROTOCOL ARGS...: one generator run, its CPU beside its JSON
    local name=$1 proto=$2
    shift 2
    local rc=0 before after
    before=$(server_ticks)
    "$LOADTEST" --quiet --json "$OUT/$name.json" --interval-json "$OUT/$name.intervals" \
        --duration "$DURATION" --warmup "$WARMUP" --threads "$THREADS" --connections "$CONNECTIONS" \
        --actors "$ACTORS" --target "${TARGET[$proto]}" --protocol "$proto" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    after=$(server_ticks)
    if [[ $rc -ne 0 ]]; then
        echo "compare-protocols.sh: load generator failed (exit $rc):" >&2
        cat "$OUT/$name.log" >&2
        exit 1
    fi
    echo "$((after - before))" >"$OUT/$name.ticks"
    python3 - "$OUT" "$name" "$(getconf CLK_TCK)" <<'EOF'
import json, sys
out, name, hz = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = json.load(open(f"{out}/{name}.json"))
lines = [json.loads(l) for l in open(f"{out}/{name}.intervals") if l.strip()]
total = lines[-1]["requests_total"] if lines else r["requests"]
cpu_us = int(open(f"{out}/{name}.ticks").read()) * 1e6 / hz / max(total, 1)
l = r["latency_us"]
print(f"   {r['config']['protocol']:<10} {r['throughput_per_sec']:>10.0f}/s  p50 {l['p50']:>8.1f}  p99 {l['p99']:>8.1f}"
      f"  p99.9 {l['p999']:>8.1f} us  server CPU {cpu_us:5.2f} us/request"
      f"  ok {r['allowed']} over {r['denied']} errors {r['errors']} unanswered {r['unanswered']}")
json.dump({"cpu_us_per_request": cpu_us, "requests_total": total}, open(f"{out}/{name}.cpu.json", "w"))
EOF
}

# Fresh actors for every run, named alike for every protocol: the same
# length of counter key (a key's length decides whether the store keeps it
# inline in its slot), so that protocols differ only in their protocol.
declare -A CODE=([divvy]=d [droplet]=w [envoy-rls]=e)

echo "== closed loop: $CONNECTIONS connections x $PIPELINE in flight, $ROUNDS rounds of $DURATION s, alternating"
for r in $(seq 1 "$ROUNDS"); do
    for p in $PROTOCOLS; do
        run_one "closed-$p-$r" "$p" --pipeline "$PIPELINE" --actor-prefix "${CODE[$p]}r${r}a"
    done
done

if [[ $OPEN_LOOP == 1 && " $PROTOCOLS " == *" envoy-rls "* ]]; then
    HALF_RATE=$(python3 -c '
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{out}/closed-envoy-rls-{r}.json"))["throughput_per_sec"] for r in range(1, rounds + 1)]
print(int(statistics.median(runs) / 2))' "$OUT" "$ROUNDS")
    echo "== open loop at half of envoy-rls's median maximum: $HALF_RATE requests/s"
    for r in $(seq 1 "$ROUNDS"); do
        for p in envoy-rls divvy; do
            [[ " $PROTOCOLS " == *" $p "* ]] || continue
            run_one "open-$p-$r" "$p" --pipeline "$PIPELINE" --rate "$HALF_RATE" --actor-prefix "${CODE[$p]}o${r}a"
        done
    done
fi

echo
echo "== summary (medians over $ROUNDS rounds; ratio = protocol / divvy)"
python3 - "$OUT" "$ROUNDS" "$OPEN_LOOP" $PROTOCOLS <<'EOF'
import json, os, statistics, sys
out, rounds, open_loop, protocols = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:]
def load(kind, p):
    runs = []
    for r in range(1, rounds + 1):
        path = f"{out}/{kind}-{p}-{r}.json"
        if not os.path.exists(path):
            return None
        x = json.load(open(path))
        x["cpu"] = json.load(open(f"{out}/{kind}-{p}-{r}.cpu.json"))["cpu_us_per_request"]
        runs.append(x)
    return runs
def med(runs, f):
    return statistics.median(f(x) for x in runs)
summary = {}
for kind in ("closed", "open"):
    rows = {p: load(kind, p) for p in protocols}
    rows = {p: v for p, v in rows.items() if v}
    if not rows:
        continue
    print(f"{kind} loop:")
    print(f"  {'protocol':<10}{'thr/s':>11}{'p50 us':>10}{'p99 us':>10}{'p99.9 us':>10}{'CPU us/req':>12}{'errors':>8}   ratios to divvy (thr, CPU/req)")
    base = rows.get("divvy")
    summary[kind] = {}
    for p, runs in rows.items():
        m = {
            "throughput_per_sec": med(runs, lambda x: x["throughput_per_sec"]),
            "p50_us": med(runs, lambda x: x["latency_us"]["p50"]),
            "p99_us": med(runs, lambda x: x["latency_us"]["p99"]),
            "p999_us": med(runs, lambda x: x["latency_us"]["p999"]),
            "cpu_us_per_request": med(runs, lambda x: x["cpu"]),
            "errors": sum(x["errors"] + x["unanswered"] for x in runs),
            "throughput_per_round": [round(x["throughput_per_sec"]) for x in runs],
        }
        ratio = ""
        if base and p != "divvy":
            # Ratio per round (runs of one round ran back to back), then the median.
            thr = statistics.median(a["throughput_per_sec"] / b["throughput_per_sec"] for a, b in zip(runs, base))
            cpu = statistics.median(a["cpu"] / b["cpu"] for a, b in zip(runs, base))
            m["throughput_ratio_to_divvy"], m["cpu_ratio_to_divvy"] = thr, cpu
            ratio = f"   {thr:.3f}x, {cpu:.2f}x"
        summary[kind][p] = m
        print(f"  {p:<10}{m['throughput_per_sec']:>11.0f}{m['p50_us']:>10.1f}{m['p99_us']:>10.1f}{m['p999_us']:>10.1f}"
              f"{m['cpu_us_per_request']:>12.2f}{m['errors']:>8}{ratio}")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(f"\n(JSON: {out}/summary.json; per-run results and logs beside it)")
EOF
