#!/usr/bin/env bash
# A/B of builds: the servers' CPU per hit of each build in each setup, in
# alternating rounds of one run, with the medians and each setup's ratio to
# the same build's one node at the end (docs/benchmarks.md, "Cluster data
# path": the machine's state moves the figures between runs, so builds are
# only compared within one run).
#
#   cargo build --release --workspace
#   cp target/release/tollgate /tmp/before     # then change, build again
#   cluster/ab.sh before=/tmp/before after=target/release/tollgate
#
# Setups (MODES, default "single strict fast aware"):
#   single  one node, one generator of CONNECTIONS connections;
#   tri     three independent nodes, one generator of CONNECTIONS / 3 on
#           each: the cluster's processes without a cluster;
#   strict, fast
#           three nodes (`cluster/local.sh up`, leaders balanced first), one
#           generator of CONNECTIONS / 3 on each node;
#   aware   three nodes fast, the generators' hits sent straight to their
#           shards' leaders (`tollgate-loadtest --leader-aware`);
#   open    three strict nodes under the bench's open loop: one generator
#           of OPEN_CONNECTIONS (15) connections over the three nodes,
#           pipeline 256, sending every OPEN_PACE_US (500) µs what is due
#           at OPEN_RATE hits/s (236055; the bench prints its own, a third
#           of the strict maximum). Its rows add the p50 and p99 (µs) and
#           the nodes' peer writes per hit, and the summary the median p99
#           and, against the first label, in how many rounds each build's
#           p99 was lower: a tail moves within a wide spread, so judge it
#           over many rounds (ROUNDS=20).
# The load is the bench's (cluster/bench.sh): closed loop, pipeline
# PIPELINE, ACTORS actors, every hit admitted and so replicated (unless
# CREDIT_LIMIT makes them denials); nodes keep
# their counters in memory only (no data dirs). CPU is user
# + system of every server process from /proc over DURATION seconds after
# WARMUP. With PERF_EVENTS (e.g. raw_syscalls:sys_enter,context-switches),
# `perf stat` counts those events of the servers per hit as well.
# Settings: ROUNDS (3), DURATION (5), WARMUP (2), CONNECTIONS (48),
# PIPELINE (16), ACTORS (100000), CREDIT_LIMIT (the bench rule's limit per
# hour, 1000000000: every hit admitted; 10: after the first moments every
# hit denied), SHARDS (64), BASE_PORT (26321), LOADTEST,
# OUT_DIR, CPUS (unset: any CPU; a taskset list such as 1 pins the servers
# and generators to it: with one CPU of two, how a setup fares while the
# machine's other work holds the other CPU, as it does for a few
# milliseconds at a time, docs/benchmarks.md, "Thirty-fifth round").
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
(( $# > 0 )) || { sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
LOADTEST=${LOADTEST:-$ROOT/target/release/tollgate-loadtest}
MODES=${MODES:-single strict fast aware}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
WARMUP=${WARMUP:-2}
CONNECTIONS=${CONNECTIONS:-48}
PIPELINE=${PIPELINE:-16}
ACTORS=${ACTORS:-100000}
CREDIT_LIMIT=${CREDIT_LIMIT:-1000000000}
OPEN_RATE=${OPEN_RATE:-236055}
OPEN_CONNECTIONS=${OPEN_CONNECTIONS:-15}
OPEN_PACE_US=${OPEN_PACE_US:-500}
BASE_PORT=${BASE_PORT:-26321}
SHARDS=${SHARDS:-64}
PERF_EVENTS=${PERF_EVENTS:-}
CPUS=${CPUS:-}
pin=()
if [[ -n $CPUS ]]; then
  command -v taskset > /dev/null || { echo "ab.sh: CPUS needs taskset (util-linux), which is not installed" >&2; exit 2; }
  taskset -c "$CPUS" true 2> /dev/null || { echo "ab.sh: CPUS '$CPUS' is not a CPU list this machine has (taskset -c)" >&2; exit 2; }
  pin=(taskset -c "$CPUS")
fi
OUT_DIR=${OUT_DIR:-${TMPDIR:-/tmp}/tollgate-ab-$$}
mkdir -p "$OUT_DIR"
export BASE_PORT SHARDS DATA_DIRS=none RUN_DIR="$OUT_DIR/run"
# shellcheck source=cluster/bench-lib.sh
source "$ROOT/cluster/bench-lib.sh"
check_builds "$@"
[[ -z $PERF_EVENTS ]] || command -v perf > /dev/null || { echo "ab.sh: PERF_EVENTS needs perf, which is not installed" >&2; exit 2; }
[[ -x $LOADTEST ]] || { echo "ab.sh: $LOADTEST is missing (cargo build --release --workspace)" >&2; exit 1; }
export RULES="$OUT_DIR/bench.ini"
write_bench_rules "$RULES" "$CREDIT_LIMIT"
RESULTS="$OUT_DIR/results.tsv"
: > "$RESULTS"
# Servers and generators of the run under way, stopped if the script ends early.
live_pids=""
cleanup() {
  # shellcheck disable=SC2086
  [[ -n $live_pids ]] && kill $live_pids 2> /dev/null
  [[ -d $RUN_DIR ]] && "$ROOT/cluster/local.sh" down > /dev/null 2>&1
  return 0
}
trap cleanup EXIT

peer_writes() { # peer_writes BINARY: data-stream writes of every node so far
  "$1" cluster status --json --node "127.0.0.1:$BASE_PORT" | python3 -c '
import json, sys
print(sum((n.get("stats") or {}).get("writes", 0) for n in json.load(sys.stdin)["nodes"]))'
}

run() { # run LABEL BINARY MODE: one measurement, appended to $RESULTS
  local label=$1 binary=$2 mode=$3 pids="" generators=() targets=() flags=() n
  case $mode in
    single)
      "${pin[@]}" "$binary" serve --listen "127.0.0.1:$BASE_PORT" "$RULES" > "$OUT_DIR/single.log" 2>&1 &
      pids=$!; targets=("127.0.0.1:$BASE_PORT"); sleep 1 ;;
    tri)
      for n in 0 1 2; do
        "${pin[@]}" "$binary" serve --listen "127.0.0.1:$((BASE_PORT + n))" "$RULES" > "$OUT_DIR/tri$n.log" 2>&1 &
        pids="$pids $!"; targets+=("127.0.0.1:$((BASE_PORT + n))")
      done
      sleep 1 ;;
    strict|fast|aware|open)
      local consistency=$mode
      [[ $mode == aware ]] && { consistency=fast; flags=(--leader-aware --rules "$RULES"); }
      [[ $mode == open ]] && consistency=strict
      TOLLGATE=$binary CONSISTENCY=$consistency "${pin[@]}" "$ROOT/cluster/local.sh" up > "$OUT_DIR/up.txt" 2>&1 \
        || { cat "$OUT_DIR/up.txt" >&2; exit 1; }
      wait_balanced "$binary" 3
      pids=$(cat "$RUN_DIR"/node*.pid | tr '\n' ' ')
      for n in 0 1 2; do targets+=("127.0.0.1:$((BASE_PORT + n))"); done ;;
    *) echo "ab.sh: unknown mode $mode" >&2; exit 2 ;;
  esac
  local share=$((CONNECTIONS / ${#targets[@]})) i=0 pipeline=$PIPELINE
  if [[ $mode == open ]]; then
    # One generator over every node, as the bench's open loop.
    targets=("$(IFS=,; echo "${targets[*]}")")
    share=$OPEN_CONNECTIONS pipeline=256
    flags=(--rate "$OPEN_RATE" --pace-us "$OPEN_PACE_US")
  fi
  for target in "${targets[@]}"; do
    "${pin[@]}" "$LOADTEST" --target "$target" --protocol divvy --connections "$share" --pipeline "$pipeline" \
      --duration "$DURATION" --warmup "$WARMUP" --actors "$ACTORS" --actor-prefix a \
      --template 'path=/bench user={actor}' --quiet --json "$OUT_DIR/gen$i.json" "${flags[@]}" \
      > /dev/null 2>&1 &
    generators+=($!); i=$((i + 1))
  done
  [[ $mode == single || $mode == tri ]] && live_pids="$pids"
  live_pids="$live_pids ${generators[*]}"
  sleep "$WARMUP"
  local before after counts="" writes_before=0 writes_after=0
  [[ $mode == open ]] && writes_before=$(peer_writes "$binary")
  # shellcheck disable=SC2086
  before=$(cpu_ticks $pids)
  if [[ -n $PERF_EVENTS ]]; then
    perf stat -x, -e "$PERF_EVENTS" -p "$(echo $pids | tr ' ' ,)" -o "$OUT_DIR/perf.csv" -- sleep "$DURATION" 2>/dev/null
    counts=$(awk -F, '$1 ~ /^[0-9]+$/ {printf "%s=%s ", $3, $1}' "$OUT_DIR/perf.csv")
  else
    sleep "$DURATION"
  fi
  # shellcheck disable=SC2086
  after=$(cpu_ticks $pids)
  [[ $mode == open ]] && writes_after=$(peer_writes "$binary")
  wait "${generators[@]}" || true
  if [[ $mode == single || $mode == tri ]]; then
    # shellcheck disable=SC2086
    kill $pids 2> /dev/null || true
    # shellcheck disable=SC2086
    wait $pids 2> /dev/null || true
  else
    "$ROOT/cluster/local.sh" down > /dev/null 2>&1 || true
    rm -rf "$RUN_DIR"
  fi
  live_pids=""
  python3 - "$OUT_DIR" "$i" "$label" "$mode" "$before" "$after" "$(getconf CLK_TCK)" "$DURATION" "$counts" \
    "$((writes_after - writes_before))" <<'PY' | tee -a "$RESULTS"
import json, sys
out, gens, label, mode, before, after, tck, duration, counts, writes = sys.argv[1:]
reports = [json.load(open(f"{out}/gen{i}.json")) for i in range(int(gens))]
hits = sum(r["throughput_per_sec"] for r in reports)
(bu, bs), (au, as_) = map(int, before.split()), map(int, after.split())
user, system = (au - bu) / int(tck) / float(duration), (as_ - bs) / int(tck) / float(duration)
per_hit = {name: int(value) / (hits * float(duration)) for name, value in (c.split("=") for c in counts.split())}
extra = "".join(f"\t{name}/hit={value:.4f}" for name, value in per_hit.items())
if mode == "open":
    latency = reports[0]["latency_us"]
    extra += f"\tp50={latency['p50']:.0f}\tp99={latency['p99']:.0f}"
    extra += f"\tpeer_writes/hit={int(writes) / (hits * float(duration)):.4f}"
print(f"{label}\t{mode}\t{hits:.0f}\t{(user + system) * 1e6 / hits:.3f}\t{user * 1e6 / hits:.3f}\t{system * 1e6 / hits:.3f}{extra}")
PY
}

labels=("$@")
for round in $(seq 1 "$ROUNDS"); do
  round_order "$round" "${labels[@]}"
  echo "round $round of $ROUNDS (label, setup, hits/s, µs per hit, user, system)" >&2
  for spec in "${order[@]}"; do
    for mode in $MODES; do run "${spec%%=*}" "${spec#*=}" "$mode"; done
  done
done

python3 - "$RESULTS" <<'PY'
import statistics, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
labels = list(dict.fromkeys(r[0] for r in rows)); modes = list(dict.fromkeys(r[1] for r in rows))
median = {(l, m): statistics.median(float(r[3]) for r in rows if r[0] == l and r[1] == m)
          for l in labels for m in modes if any(r[0] == l and r[1] == m for r in rows)}
print(f"\nMedian server CPU per hit (µs) of {len(rows) // max(1, len(median))} rounds; in brackets, ÷ the same build's one node\n")
print("| build | " + " | ".join(modes) + " |")
print("|---|" + "---:|" * len(modes))
for l in labels:
    cells = []
    for m in modes:
        v = median.get((l, m))
        base = median.get((l, "single"))
        cells.append("-" if v is None else f"{v:.3f}" + (f" ({v / base:.2f}×)" if base and m != "single" else ""))
    print(f"| {l} | " + " | ".join(cells) + " |")
# The open loop's tail: median p99, and the rounds in which each build's
# p99 was below the first label's in the same round.
p99 = {}
for r in rows:
    for field in r[6:]:
        if field.startswith("p99="):
            p99.setdefault(r[0], []).append(float(field[4:]))
if p99:
    first = labels[0]
    print("\nOpen loop, p99 (µs): median, and rounds below " + first + "'s\n")
    for l in labels:
        runs = p99.get(l, [])
        if not runs:
            continue
        below = sum(a < b for a, b in zip(runs, p99.get(first, [])))
        pairs = min(len(runs), len(p99.get(first, [])))
        tail = "" if l == first else f", below in {below} of {pairs}"
        print(f"{l}: {statistics.median(runs):.0f}{tail}")
PY
echo "runs in $RESULTS" >&2
