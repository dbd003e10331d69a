#!/usr/bin/env bash
# Benchmarks one node against a three-node cluster (strict, then fast) on
# this machine, with the same load, in one run, and prints a Markdown table.
#
#   cluster/bench.sh            # results and JSON files in $OUT_DIR
#
# Load: tollgate-loadtest, closed loop. Every hit is admitted (the rule has a
# huge limit), so in cluster mode every hit is replicated: the worst case.
# For the cluster, one load generator per node runs at once (each with a
# third of the connections); throughputs add up, latencies are per node.
# Settings: LOADTEST (binary), TOLLGATE, CONNECTIONS (48), PIPELINE (16),
# DURATION (10 s), WARMUP (2 s), ACTORS (100000), BASE_PORT (28321, below
# the ephemeral port range), SHARDS (64), OUT_DIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOADTEST=${LOADTEST:-/work/target-loadtest/release/tollgate-loadtest}
TOLLGATE=${TOLLGATE:-$ROOT/target/release/tollgate}
CONNECTIONS=${CONNECTIONS:-48}
PIPELINE=${PIPELINE:-16}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
ACTORS=${ACTORS:-100000}
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

echo "single node" >&2
"$TOLLGATE" serve --listen "127.0.0.1:$BASE_PORT" "$RULES" > "$OUT_DIR/single.log" 2>&1 &
single=$!
sleep 1
load single "127.0.0.1:$BASE_PORT" "$CONNECTIONS" s
kill "$single"; wait "$single" || true

for mode in strict fast; do
  echo "three nodes, $mode" >&2
  CONSISTENCY=$mode "$ROOT/cluster/local.sh" up > "$OUT_DIR/up-$mode.txt"
  per_node=$((CONNECTIONS / 3))
  for n in 1 2 3; do
    load "$mode-node$n" "127.0.0.1:$((BASE_PORT + n - 1))" "$per_node" "$mode$n" &
  done
  wait %1 %2 %3 2>/dev/null || wait
  "$ROOT/cluster/local.sh" status > "$OUT_DIR/status-$mode.txt" || true
  "$ROOT/cluster/local.sh" down > /dev/null
done

python3 - "$OUT_DIR" "$CONNECTIONS" "$PIPELINE" "$DURATION" <<'PY'
import json, os, sys
out, connections, pipeline, duration = sys.argv[1:5]
def read(name):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)
print(f"Closed loop, {connections} connections x pipeline {pipeline}, {duration} s measured, "
      "every hit admitted (and so replicated). Cluster: one generator per node, "
      "a third of the connections each; latency columns give the range over the three nodes.")
print()
print("| setup | throughput (hits/s) | p50 (us) | p99 (us) | errors |")
print("|---|---:|---:|---:|---:|")
single = read("single")
lat = single["latency_us"]
print(f"| one node | {single['throughput_per_sec']:.0f} | {lat['p50']:.0f} | {lat['p99']:.0f} | {single['errors']} |")
for mode in ("strict", "fast"):
    runs = [read(f"{mode}-node{n}") for n in (1, 2, 3)]
    total = sum(r["throughput_per_sec"] for r in runs)
    p50 = [r["latency_us"]["p50"] for r in runs]
    p99 = [r["latency_us"]["p99"] for r in runs]
    errors = sum(r["errors"] for r in runs)
    print(f"| three nodes, {mode} | {total:.0f} | {min(p50):.0f}-{max(p50):.0f} | {min(p99):.0f}-{max(p99):.0f} | {errors} |")
PY
echo "results in $OUT_DIR" >&2
