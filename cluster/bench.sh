#!/usr/bin/env bash
# Benchmarks one node against a three-node cluster (strict, then fast) on
# this machine, with the same load, in one run, and prints Markdown tables.
#
#   cargo build --release --workspace
#   cluster/bench.sh            # results and JSON files in $OUT_DIR
#
# 1. Closed loop (maximum throughput): one node, then three nodes strict,
#    then fast, with the CPU time the servers used per hit (all three nodes
#    together for the cluster; from /proc, over the measured window). Every hit is admitted (the rule has a huge limit), so in
#    cluster mode every hit is replicated: the worst case. For the cluster,
#    one load generator per node runs at once (each with a third of the
#    connections); throughputs add up, latencies are per node.
# 2. Open loop at one rate for all three setups: a third of the strict
#    cluster's maximum from step 1 (so strict runs at a third of its own
#    maximum, and fast and one node run at the same offered load).
# 3. Failover under load (strict): while the open-loop load of step 2 runs,
#    the node leading the most shards is SIGKILLed; a probe
#    (`tollgate-loadtest failover-probe`) hitting every shard through a
#    surviving node, round after round, measures the time from the kill
#    until every shard answers again.
#    FAILOVERS rounds, the killed node restarted between them.
# Settings: LOADTEST (binary), TOLLGATE, CONNECTIONS (48), PIPELINE (16),
# DURATION (10 s), WARMUP (2 s), ACTORS (100000), BASE_PORT (28321, below
# the ephemeral port range), SHARDS (64), FAILOVERS (3), OUT_DIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOADTEST=${LOADTEST:-$ROOT/target/release/tollgate-loadtest}
TOLLGATE=${TOLLGATE:-$ROOT/target/release/tollgate}
for binary in "$LOADTEST" "$TOLLGATE"; do
  [[ -x $binary ]] || { echo "bench.sh: $binary is missing (cargo build --release --workspace, or set LOADTEST and TOLLGATE)" >&2; exit 1; }
done
CONNECTIONS=${CONNECTIONS:-48}
PIPELINE=${PIPELINE:-16}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
ACTORS=${ACTORS:-100000}
FAILOVERS=${FAILOVERS:-3}
SHARDS=${SHARDS:-64}
export SHARDS
BASE_PORT=${BASE_PORT:-28321}
OUT_DIR=${OUT_DIR:-${TMPDIR:-/tmp}/tollgate-bench-$$}
mkdir -p "$OUT_DIR"
export TOLLGATE BASE_PORT
export RUN_DIR="$OUT_DIR/run"

RULES="$OUT_DIR/bench.ini"
cat > "$RULES" <<'INI'
[path=/bench]
creditLimit = 1000000000
resetSeconds = 3600
actorField = user

[default]
creditLimit = 0
resetSeconds = 60
INI
export RULES

load() { # load NAME TARGET CONNECTIONS PREFIX
  "$LOADTEST" --target "$2" --protocol divvy --connections "$3" --pipeline "$PIPELINE" \
    --duration "$DURATION" --warmup "$WARMUP" --actors "$ACTORS" --actor-prefix "$4" \
    --template 'path=/bench user={actor}' --quiet --json "$OUT_DIR/$1.json" > "$OUT_DIR/$1.txt"
}

# CPU seconds the given processes used so far (user + system).
cpu_seconds() {
  local ticks=0 pid
  for pid in "$@"; do
    ticks=$((ticks + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
  done
  echo "$ticks $(getconf CLK_TCK)" | awk '{printf "%.2f", $1 / $2}'
}
# Writes NAME.cpu: the CPU seconds PIDS used during the measured window.
measure_cpu() { # measure_cpu NAME PIDS...
  local name=$1; shift
  sleep "$WARMUP"
  local before; before=$(cpu_seconds "$@")
  sleep "$DURATION"
  echo "$before $(cpu_seconds "$@")" | awk '{printf "%.2f\n", $2 - $1}' > "$OUT_DIR/$name.cpu"
}
cluster_pids() { cat "$RUN_DIR"/node[123].pid; }

echo "single node" >&2
"$TOLLGATE" serve --listen "127.0.0.1:$BASE_PORT" "$RULES" > "$OUT_DIR/single.log" 2>&1 &
single=$!
sleep 1
measure_cpu single "$single" &
cpu=$!
load single "127.0.0.1:$BASE_PORT" "$CONNECTIONS" s
wait "$cpu"
kill "$single"; wait "$single" || true

for mode in strict fast; do
  echo "three nodes, $mode" >&2
  CONSISTENCY=$mode "$ROOT/cluster/local.sh" up > "$OUT_DIR/up-$mode.txt"
  per_node=$((CONNECTIONS / 3))
  # shellcheck disable=SC2046
  measure_cpu "$mode" $(cluster_pids) &
  for n in 1 2 3; do
    load "$mode-node$n" "127.0.0.1:$((BASE_PORT + n - 1))" "$per_node" "$mode$n" &
  done
  wait
  "$ROOT/cluster/local.sh" status > "$OUT_DIR/status-$mode.txt" || true
  "$ROOT/cluster/local.sh" down > /dev/null
done

# Step 2: open loop at a third of the strict cluster's maximum.
RATE=$(python3 - "$OUT_DIR" <<'PY'
import json, os, sys
total = sum(json.load(open(os.path.join(sys.argv[1], f"strict-node{n}.json")))["throughput_per_sec"] for n in (1, 2, 3))
print(max(300, int(total / 3)))
PY
)
export RATE
echo "open loop at $RATE hits/s" >&2
open_load() { # open_load NAME TARGET CONNECTIONS RATE PREFIX
  "$LOADTEST" --target "$2" --protocol divvy --connections "$3" --pipeline "$PIPELINE" --rate "$4" \
    --duration "$DURATION" --warmup "$WARMUP" --actors "$ACTORS" --actor-prefix "$5" \
    --template 'path=/bench user={actor}' --quiet --json "$OUT_DIR/$1.json" > "$OUT_DIR/$1.txt"
}
"$TOLLGATE" serve --listen "127.0.0.1:$BASE_PORT" "$RULES" > "$OUT_DIR/single-open.log" 2>&1 &
single=$!
sleep 1
open_load open-single "127.0.0.1:$BASE_PORT" "$CONNECTIONS" "$RATE" os
kill "$single"; wait "$single" || true
per_node=$((CONNECTIONS / 3))
per_node_rate=$((RATE / 3))
for mode in strict fast; do
  CONSISTENCY=$mode "$ROOT/cluster/local.sh" up > /dev/null
  for n in 1 2 3; do
    open_load "open-$mode-node$n" "127.0.0.1:$((BASE_PORT + n - 1))" "$per_node" "$per_node_rate" "o$mode$n" &
  done
  wait %1 %2 %3 2>/dev/null || wait
  "$ROOT/cluster/local.sh" down > /dev/null
done

# Step 3: failover under load.
echo "failover, strict, $FAILOVERS rounds" >&2
CONSISTENCY=strict "$ROOT/cluster/local.sh" up > /dev/null
for round in $(seq 1 "$FAILOVERS"); do
  "$TOLLGATE" cluster status --json --node "127.0.0.1:$BASE_PORT" > "$OUT_DIR/topology-$round.json"
  victim=$(python3 - "$OUT_DIR/topology-$round.json" <<'PY'
import collections, json, sys
t = json.load(open(sys.argv[1]))
leads = collections.Counter(s["leader"] for s in t["placement"])
print(leads.most_common(1)[0][0])
PY
)
  survivor=$(( victim % 3 + 1 ))
  for n in 1 2 3; do
    if (( n != victim )); then
      DURATION=$((WARMUP + 8)) open_load "failover-$round-node$n" "127.0.0.1:$((BASE_PORT + n - 1))" "$per_node" "$per_node_rate" "f$round$n" &
    fi
  done
  sleep "$((WARMUP + 2))"
  "$LOADTEST" failover-probe --node "127.0.0.1:$((BASE_PORT + survivor - 1))" \
    --pid "$(cat "$RUN_DIR/node$victim.pid")" --shards "$SHARDS" --timeout-secs 10 \
    > "$OUT_DIR/failover-$round.txt"
  echo "round $round: killed node $victim: $(cat "$OUT_DIR/failover-$round.txt")" >&2
  wait || true
  rm -f "$RUN_DIR/node$victim.pid"
  "$ROOT/cluster/local.sh" start "$victim" > /dev/null
done
"$ROOT/cluster/local.sh" down > /dev/null

python3 - "$OUT_DIR" "$CONNECTIONS" "$PIPELINE" "$DURATION" "$RATE" "$FAILOVERS" <<'PY'
import json, os, sys
out, connections, pipeline, duration, rate, failovers = sys.argv[1:7]
def read(name):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)
def cluster(prefix):
    runs = [read(f"{prefix}-node{n}") for n in (1, 2, 3)]
    total = sum(r["throughput_per_sec"] for r in runs)
    p50 = [r["latency_us"]["p50"] for r in runs]
    p99 = [r["latency_us"]["p99"] for r in runs]
    errors = sum(r["errors"] for r in runs)
    return total, p50, p99, errors
print(f"Closed loop, {connections} connections x pipeline {pipeline}, {duration} s measured, "
      "every hit admitted (and so replicated). Cluster: one generator per node, "
      "a third of the connections each; latency columns give the range over the three nodes.")
print()
def cpu_us_per_hit(name, throughput):
    try:
        seconds = float(open(os.path.join(out, name + ".cpu")).read())
    except (OSError, ValueError):
        return "-"
    return f"{seconds * 1e6 / max(throughput * float(duration), 1):.1f}"
print("| setup | throughput (hits/s) | p50 (us) | p99 (us) | errors | server CPU per hit (us) |")
print("|---|---:|---:|---:|---:|---:|")
single = read("single")
lat = single["latency_us"]
print(f"| one node | {single['throughput_per_sec']:.0f} | {lat['p50']:.0f} | {lat['p99']:.0f} | {single['errors']} | {cpu_us_per_hit('single', single['throughput_per_sec'])} |")
closed = {}
for mode in ("strict", "fast"):
    total, p50, p99, errors = cluster(mode)
    closed[mode] = total
    print(f"| three nodes, {mode} | {total:.0f} | {min(p50):.0f}-{max(p50):.0f} | {min(p99):.0f}-{max(p99):.0f} | {errors} | {cpu_us_per_hit(mode, total)} |")
print()
print(f"Open loop at {rate} hits/s offered (a third of the strict cluster's maximum above), "
      f"{connections} connections, {duration} s measured.")
print()
print("| setup | throughput (hits/s) | p50 (us) | p99 (us) | errors |")
print("|---|---:|---:|---:|---:|")
single_open = read("open-single")
lat = single_open["latency_us"]
print(f"| one node | {single_open['throughput_per_sec']:.0f} | {lat['p50']:.0f} | {lat['p99']:.0f} | {single_open['errors']} |")
open_p99 = {}
for mode in ("strict", "fast"):
    total, p50, p99, errors = cluster(f"open-{mode}")
    open_p99[mode] = max(p99)
    print(f"| three nodes, {mode} | {total:.0f} | {min(p50):.0f}-{max(p50):.0f} | {min(p99):.0f}-{max(p99):.0f} | {errors} |")
failover_ms = []
for r in range(1, int(failovers) + 1):
    text = open(os.path.join(out, f"failover-{r}.txt")).read()
    for word in text.split():
        if word.startswith("failover_ms="):
            failover_ms.append(float(word.split("=")[1]))
print()
print("| measure | figure | target |")
print("|---|---:|---|")
print(f"| fast-mode p99 ÷ one node's p99, open loop, same rate | {open_p99['fast'] / max(lat['p99'], 1):.2f}x | <= 1.5x |")
print(f"| strict-mode p99 at a third of its maximum | {open_p99['strict'] / 1000:.2f} ms | <= 2 ms |")
print(f"| strict-mode throughput ÷ one node's, closed loop | {100 * closed['strict'] / single['throughput_per_sec']:.0f}% | >= 40% |")
if failover_ms:
    ms = sorted(failover_ms)
    print(f"| failover under load (SIGKILL to every shard serving), {len(ms)} rounds | {ms[0]:.0f} / {ms[len(ms)//2]:.0f} / {ms[-1]:.0f} ms (min / median / max) | <= 2 s |")
PY
echo "results in $OUT_DIR" >&2
