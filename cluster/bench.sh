#!/usr/bin/env bash
# Benchmarks one node against clusters on this machine, with the same load,
# in one run, and prints Markdown tables (the figures of docs/benchmarks.md,
# "Cluster data path").
#
#   cargo build --release --workspace
#   cluster/bench.sh            # results and JSON files in $OUT_DIR
#
# Every node and load generator shares this machine's cores, so compare the
# ratios of one run, not absolute figures across runs.
#
# 1. Closed loop (maximum throughput), CONNECTIONS connections x PIPELINE:
#    one node; three nodes strict; three nodes fast; three nodes fast with
#    leader-aware clients (`tollgate-loadtest --leader-aware`, every hit
#    straight to its shard's leader); five nodes strict (nodes 4 and 5
#    joined with `cluster add-node`), then again with CONNECTIONS x 25/9
#    connections (as many hits in flight per peer link as three nodes
#    have); five nodes fast (nodes 4 and 5 joined to the fast cluster), then
#    again with CONNECTIONS x 5/3 connections (as many per node as three
#    nodes have); five nodes strict, then fast, with ring placement
#    (`placement = ring`, nodes 4 and 5 joined likewise), and strict with
#    ring placement again with leader-aware clients, against three nodes
#    strict with leader-aware clients (what strict replication itself costs
#    at five nodes, without the forwarding of plain clients); three, then five
#    independent single nodes (no cluster: what that many processes cost
#    on these cores, the floor under the five-node ratio); three, then five
#    nodes of `tollgate-mesh-floor` (a strict cluster's divvy path as
#    messages only: forwards, rounds to two followers, acknowledgements,
#    relayed answers, one frame per peer per turn, and no rule, counter or
#    store; the floor of those messages under the five-node ratio); then
#    one node again. Fast mode runs
#    with its defaults, quota leases included (docs/cluster.md, "Quota
#    leases"); strict mode with its own, without leases. The ratios to one node use the mean of its
#    two runs: a single run of it swung the ratios by up to 15 % from one
#    bench to the next. Every hit is admitted (the rule has a
#    huge limit), so every hit is replicated: the worst case. One generator
#    per node, a share of the connections each, the same ACTORS actors for
#    every setup. For each: the servers' CPU per hit (user + system of every
#    server process over the measured window, from /proc) and system calls
#    per hit (`perf stat -e raw_syscalls:sys_enter`, when perf is
#    installed), and the data path's counters from `cluster status --json`
#    (replication rounds, states per round and per shard section, hits per
#    forwarded batch, frames per write).
# 2. Idle: a three-node cluster doing nothing, CPU over IDLE_SECONDS.
# 3. Open loop at a third of the strict cluster's maximum from step 1, for
#    one node and three nodes strict: p99 latency, with OPEN_CONNECTIONS
#    connections in all (up to 256 requests in flight each: the schedule,
#    not the pipeline, sets the pace), from one generator in both cases
#    (the cluster's connections spread over its nodes), so that the
#    clients' share of the machine is the same, and three strict nodes
#    with leader-aware clients (context), and three nodes of
#    `tollgate-mesh-floor` (the messages' floor under the strict row's
#    p99): OPEN_ROUNDS rounds of the four,
#    interleaved (the single node, the cluster and the floor up throughout,
#    each idle while the other runs), reported as each setup's median p99
#    and its range, because one run's p99 swings with what the host does
#    (docs/benchmarks.md, "Twenty-ninth round"); then the cluster and the
#    floor once each with every server thread and the generator pinned to
#    one CPU (context: the host's episodes, which hold one of the two
#    CPUs for a few milliseconds at a time, held for the whole run; p50,
#    p99 and the servers' CPU per hit, docs/benchmarks.md, "Thirty-fifth
#    round"); then once more with
#    CONNECTIONS connections, each sending every 100 us (context: a read
#    then carries about one hit, which costs a node several times its
#    closed-loop CPU per hit, and the machine's cores fill).
# 4. Failover under load (strict): while the open-loop load of step 3 runs,
#    the node leading the most shards is SIGKILLed; a probe
#    (`tollgate-loadtest failover-probe`) hitting every shard through a
#    surviving node measures the time from the kill until every shard
#    answers again. FAILOVERS rounds, the killed node restarted between.
#
# `cluster/bench.sh persist` measures data dirs instead (docs/benchmarks.md,
# "Data dirs"): strict three-node throughput with data dirs (each `--fsync`
# policy of POLICIES, default `interval`) against in memory (`--data-dir
# none`), alternating ROUNDS (2; 0 skips it) times, each once leaders are balanced (as
# above), then the time a full restart of
# three nodes holding COUNTERS (1000000; 0 skips it) live counters takes to
# serve again (`cluster/local.sh up`, until every shard is led), RESTARTS
# (1) times, the nodes stopped with `down` (SIGTERM) or, with
# RESTART_SIGNAL=KILL, SIGKILLed all at once. With
# BASELINE=/path/to/another/tollgate, each round also runs the default
# policy with that binary ("baseline"), between the others: an A/B of two
# builds within one run.
# Settings: LOADTEST, TOLLGATE, FLOOR (binaries; FLOOR is tollgate-mesh-floor
# beside LOADTEST), CONNECTIONS (48), PIPELINE (16),
# DURATION (10 s), WARMUP (3 s), ACTORS (100000), SHARDS (64), FAILOVERS (3),
# IDLE_SECONDS (10), BASE_PORT (28321, below the ephemeral range), OUT_DIR,
# OPEN_CONNECTIONS (15), PACE_US (500: the open-loop generators send once per
# 500 us, every request due by then in one write per connection, as a
# pipelining client does; the wait counts in the latencies),
# OPEN_ROUNDS (5), HOST_PROBE_SECONDS (5; 0 skips it: before the open
# loop, a busy loop per CPU on the otherwise idle machine times the gaps
# over 200 us in its own running, which is the host taking a virtual CPU
# away; reported as context for the open loop's tail).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOADTEST=${LOADTEST:-$ROOT/target/release/tollgate-loadtest}
TOLLGATE=${TOLLGATE:-$ROOT/target/release/tollgate}
FLOOR=${FLOOR:-$(dirname "$LOADTEST")/tollgate-mesh-floor}
for binary in "$LOADTEST" "$TOLLGATE" "$FLOOR"; do
  [[ -x $binary ]] || { echo "bench.sh: $binary is missing (cargo build --release --workspace, or set LOADTEST, TOLLGATE and FLOOR)" >&2; exit 1; }
done
CONNECTIONS=${CONNECTIONS:-48}
PIPELINE=${PIPELINE:-16}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-3}
ACTORS=${ACTORS:-100000}
FAILOVERS=${FAILOVERS:-3}
IDLE_SECONDS=${IDLE_SECONDS:-10}
SHARDS=${SHARDS:-64}
export SHARDS
BASE_PORT=${BASE_PORT:-28321}
PACE_US=${PACE_US:-500}
OPEN_CONNECTIONS=${OPEN_CONNECTIONS:-15}
HOST_PROBE_SECONDS=${HOST_PROBE_SECONDS:-5}
OPEN_ROUNDS=${OPEN_ROUNDS:-5}
[[ $OPEN_ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "bench.sh: OPEN_ROUNDS must be a whole number of at least 1, not '$OPEN_ROUNDS'" >&2; exit 1; }
OUT_DIR=${OUT_DIR:-${TMPDIR:-/tmp}/tollgate-bench-$$}
mkdir -p "$OUT_DIR"
export TOLLGATE BASE_PORT
export RUN_DIR="$OUT_DIR/run"
PERF=$(command -v perf || true)

# shellcheck source=cluster/bench-lib.sh
source "$ROOT/cluster/bench-lib.sh"
RULES="$OUT_DIR/bench.ini"
write_bench_rules "$RULES"
export RULES

# load NAME TARGET CONNECTIONS [MORE_LOADTEST_FLAGS...]
load() {
  local name=$1 target=$2 connections=$3; shift 3
  "$LOADTEST" --target "$target" --protocol divvy --connections "$connections" --pipeline "$PIPELINE" \
    --duration "$DURATION" --warmup "$WARMUP" --actors "$ACTORS" --actor-prefix a \
    --template 'path=/bench user={actor}' --quiet --json "$OUT_DIR/$name.json" "$@" > "$OUT_DIR/$name.txt"
}

# Writes NAME.cpu (user and system seconds over the measured window),
# NAME.syscalls (system calls then, when perf works) and, for a cluster,
# NAME.stats-before/after (the data path's counters).
measure() { # measure NAME STATUS_NODE PIDS...
  local name=$1 status_node=$2; shift 2
  sleep "$WARMUP"
  if [[ -n $status_node ]]; then
    "$TOLLGATE" cluster status --json --node "$status_node" > "$OUT_DIR/$name.stats-before" 2>/dev/null || true
  fi
  local before; before=$(cpu_ticks "$@")
  if [[ -n $PERF ]] && "$PERF" stat -e raw_syscalls:sys_enter -p "$(echo "$@" | tr ' ' ,)" -o "$OUT_DIR/$name.perf" -- sleep "$DURATION" 2>/dev/null; then
    :
  else
    sleep "$DURATION"
  fi
  local after; after=$(cpu_ticks "$@")
  if [[ -n $status_node ]]; then
    "$TOLLGATE" cluster status --json --node "$status_node" > "$OUT_DIR/$name.stats-after" 2>/dev/null || true
  fi
  echo "$before $after $(getconf CLK_TCK)" | awk '{printf "%.3f %.3f\n", ($3-$1)/$5, ($4-$2)/$5}' > "$OUT_DIR/$name.cpu"
}
cluster_pids() { cat "$RUN_DIR"/node*.pid; }

# sum_rate NAME NODES: hits/s of NAME's generators, one per node, summed.
sum_rate() {
  python3 - "$OUT_DIR" "$1" "$2" <<'PY'
import json, os, sys
out, name, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
print(int(sum(json.load(open(os.path.join(out, f"{name}-node{n}.json")))["throughput_per_sec"] for n in range(1, nodes + 1))))
PY
}

if [[ ${1:-} == persist ]]; then
  ROUNDS=${ROUNDS:-2}
  POLICIES=${POLICIES:-interval}
  COUNTERS=${COUNTERS:-1000000}
  export CONSISTENCY=strict
  declare -A total
  for round in $(seq 1 "$ROUNDS"); do
    setups="memory $POLICIES${BASELINE:+ baseline}"
    # Every other round in reverse order, so that no setup always runs
    # right after the same one.
    (( round % 2 == 0 )) && setups=$(echo "$setups" | tr ' ' '\n' | tac | tr '\n' ' ')
    for setup in $setups; do
      if [[ $setup == memory ]]; then
        DATA_DIRS=none "$ROOT/cluster/local.sh" up > /dev/null
      elif [[ $setup == baseline ]]; then
        TOLLGATE=$BASELINE "$ROOT/cluster/local.sh" up > /dev/null
      else
        EXTRA_ARGS="--fsync $setup" "$ROOT/cluster/local.sh" up > /dev/null
      fi
      wait_balanced "$TOLLGATE" 3
      for n in 1 2 3; do
        load "$setup-$round-node$n" "127.0.0.1:$((BASE_PORT + n - 1))" "$((CONNECTIONS / 3))" &
      done
      wait
      rate=$(sum_rate "$setup-$round" 3)
      echo "round $round, $setup: $rate hits/s" | tee -a "$OUT_DIR/result.md" >&2
      total[$setup]=$(( ${total[$setup]:-0} + rate ))
      "$ROOT/cluster/local.sh" down > /dev/null
      rm -rf "$RUN_DIR"
    done
  done
  (( ROUNDS > 0 )) && {
    echo
    echo "| setup | strict hits/s (mean of $ROUNDS) | ÷ in memory |"
    echo "|---|---:|---:|"
    for setup in memory $POLICIES${BASELINE:+ baseline}; do
      echo "| $setup | $(( total[$setup] / ROUNDS )) | $(python3 -c "print(f'{${total[$setup]} / ${total[memory]}:.0%}')") |"
    done
  } | tee -a "$OUT_DIR/result.md"
  if (( COUNTERS > 0 )); then
    # Fill: every actor hit a few times; then stop, and time a start.
    "$ROOT/cluster/local.sh" up > /dev/null
    for n in 1 2 3; do
      ACTORS=$COUNTERS DURATION=$(( COUNTERS / 100000 + 5 )) WARMUP=0 \
        load "fill-node$n" "127.0.0.1:$((BASE_PORT + n - 1))" "$((CONNECTIONS / 3))" &
    done
    wait
    live=$("$TOLLGATE" cluster status --json --node "127.0.0.1:$BASE_PORT" \
      | python3 -c 'import json,sys; print(max(n.get("live_keys") or 0 for n in json.load(sys.stdin)["nodes"]))')
    for restart in $(seq 1 "${RESTARTS:-1}"); do
      if [[ ${RESTART_SIGNAL:-TERM} == KILL ]]; then
        for n in 1 2 3; do "$ROOT/cluster/local.sh" kill "$n" > /dev/null; done
      else
        "$ROOT/cluster/local.sh" down > /dev/null
      fi
      size=$(du -sh "$RUN_DIR/data-node1" | cut -f1)
      started=$(date +%s.%N)
      "$ROOT/cluster/local.sh" up > /dev/null
      ended=$(date +%s.%N)
      loaded=$(grep -h "data dir loaded" "$RUN_DIR/node1.log" | tail -1 | sed 's/.*INFO //')
      {
        echo
        echo "full restart $restart (SIG${RESTART_SIGNAL:-TERM}) of three nodes, $live live counters each: serving after $(python3 -c "print(f'{$ended - $started:.2f}')") s"
        echo "node 1: $loaded; data dir $size"
      } | tee -a "$OUT_DIR/result.md"
    done
    "$ROOT/cluster/local.sh" down > /dev/null
    rm -rf "$RUN_DIR"
  fi
  exit 0
fi

# cluster_run NAME NODES [LOADTEST_FLAGS...]: load every node of a running
# cluster, a share of the connections each, while measuring.
cluster_run() {
  local name=$1 nodes=$2; shift 2
  # shellcheck disable=SC2046
  measure "$name" "127.0.0.1:$BASE_PORT" $(cluster_pids) &
  local m=$!
  for n in $(seq 1 "$nodes"); do
    load "$name-node$n" "127.0.0.1:$((BASE_PORT + n - 1))" "$((CONNECTIONS / nodes))" "$@" &
  done
  wait
  echo "$nodes" > "$OUT_DIR/$name.nodes"
}

# single_nodes_run NAME NODES: NODES single nodes, no cluster, each loaded
# with a share of the connections as a cluster's nodes are (one node: the
# ratios' denominator; three and five: what that many processes sharing
# this machine's cores cost per hit without any cluster work, the floor
# under the five-node target's ratio).
# loaded_run NAME NODES ADDRESS_OF PIDS...: loads NODES servers (node N's
# client address printed by `ADDRESS_OF N`), a share of the connections
# each, while measuring the processes PIDS.
loaded_run() {
  local name=$1 nodes=$2 address_of=$3 waits=() n
  shift 3
  measure "$name" "" "$@" &
  waits+=($!)
  for n in $(seq 1 "$nodes"); do
    load "$name-node$n" "$("$address_of" "$n")" "$((CONNECTIONS / nodes))" &
    waits+=($!)
  done
  # Not a bare wait: the servers are this shell's jobs too.
  wait "${waits[@]}"
  echo "$nodes" > "$OUT_DIR/$name.nodes"
}
single_client() { echo "127.0.0.1:$((BASE_PORT + $1 - 1))"; }

single_nodes_run() {
  local name=$1 nodes=$2 pids=() n
  echo "$nodes single node(s), no cluster ($name)" >&2
  for n in $(seq 1 "$nodes"); do
    "$TOLLGATE" serve --listen "$(single_client "$n")" "$RULES" > "$OUT_DIR/$name-$n.log" 2>&1 &
    pids+=($!)
  done
  sleep 1
  # A node that could not start (its port taken by a process left over
  # from an interrupted run) must not let the load measure that process.
  for n in $(seq 1 "$nodes"); do
    kill -0 "${pids[n - 1]}" 2> /dev/null \
      || { echo "bench.sh: single node $n did not start: $(tail -1 "$OUT_DIR/$name-$n.log")" >&2; exit 1; }
  done
  loaded_run "$name" "$nodes" single_client "${pids[@]}"
  kill "${pids[@]}"; wait "${pids[@]}" 2> /dev/null || true
}

single_nodes_run single 1
single_nodes_run singles-3 3
single_nodes_run singles-5 5

# Mesh floor nodes serve clients on BASE_PORT+20+N-1 and peers on
# BASE_PORT+1020+N-1, clear of the clusters' and the single node's ports.
floor_client() { echo "127.0.0.1:$((BASE_PORT + 20 + $1 - 1))"; }
# floor_up NODES: starts that many mesh floor nodes; their pids in FLOOR_PIDS.
floor_up() {
  local nodes=$1 n peers=""
  for n in $(seq 1 "$nodes"); do peers+="127.0.0.1:$((BASE_PORT + 1020 + n - 1)),"; done
  FLOOR_PIDS=()
  for n in $(seq 1 "$nodes"); do
    "$FLOOR" --id "$n" --listen "$(floor_client "$n")" --peers "${peers%,}" > "$OUT_DIR/floor-$nodes-$n.log" 2>&1 &
    FLOOR_PIDS+=($!)
  done
  sleep 1
  for n in $(seq 1 "$nodes"); do
    kill -0 "${FLOOR_PIDS[n - 1]}" 2> /dev/null \
      || { echo "bench.sh: mesh floor node $n did not start: $(tail -1 "$OUT_DIR/floor-$nodes-$n.log")" >&2
           kill "${FLOOR_PIDS[@]}" 2> /dev/null; exit 1; }
  done
}
floor_down() { kill "${FLOOR_PIDS[@]}"; wait "${FLOOR_PIDS[@]}" 2> /dev/null || true; }
# floor_run NAME NODES: the mesh floor loaded as a cluster's nodes are.
floor_run() {
  echo "$2 mesh floor nodes ($1)" >&2
  floor_up "$2"
  loaded_run "$1" "$2" floor_client "${FLOOR_PIDS[@]}"
  floor_down
}
floor_run floor-3 3
floor_run floor-5 5

# join_nodes_4_and_5 CONSISTENCY LABEL: grows the running cluster to five
# nodes (each started with the cluster's consistency, or it is refused);
# their output in $OUT_DIR/join-LABEL-N.txt.
join_nodes_4_and_5() {
  for n in 4 5; do
    CONSISTENCY=$1 "$ROOT/cluster/local.sh" join "$n" > "$OUT_DIR/join-$2-$n.txt"
  done
}

for mode in strict fast aware; do
  echo "three nodes, $mode" >&2
  consistency=$mode; flags=()
  if [[ $mode == aware ]]; then consistency=fast; flags=(--leader-aware --rules "$RULES"); fi
  CONSISTENCY=$consistency "$ROOT/cluster/local.sh" up > "$OUT_DIR/up-$mode.txt"
  wait_balanced "$TOLLGATE" 3
  cluster_run "$mode" 3 "${flags[@]}"
  if [[ $mode == fast ]]; then
    echo "five nodes, fast (nodes 4 and 5 join)" >&2
    join_nodes_4_and_5 fast fast
    wait_balanced "$TOLLGATE" 5
    cluster_run five-fast 5
    # Again with as many connections per node as three nodes have
    # (CONNECTIONS x 5/3): the same load on each node, as when a cluster
    # grows with its clients. Context for the five-node target.
    CONNECTIONS=$(( CONNECTIONS * 5 / 3 )) cluster_run five-fast-scaled 5
  fi
  if [[ $mode == strict ]]; then
    # Strict with leader-aware clients: no hit forwarded, the denominator
    # of the ring-placed five nodes' leader-aware row below.
    cluster_run strict-aware 3 --leader-aware --rules "$RULES"
    echo "idle three-node cluster, ${IDLE_SECONDS} s" >&2
    sleep 2
    # shellcheck disable=SC2046
    before=$(cpu_ticks $(cluster_pids)); sleep "$IDLE_SECONDS"
    # shellcheck disable=SC2046
    after=$(cpu_ticks $(cluster_pids))
    echo "$before $after $(getconf CLK_TCK) $IDLE_SECONDS" \
      | awk '{printf "%.2f\n", 100 * (($3-$1)+($4-$2)) / $5 / $6}' > "$OUT_DIR/idle.percent"
    echo "five nodes, strict (nodes 4 and 5 join)" >&2
    join_nodes_4_and_5 strict strict
    wait_balanced "$TOLLGATE" 5 # leader balancing hands the new nodes their share
    cluster_run five 5
    # Again with CONNECTIONS x 25/9 connections: a closed loop keeps
    # CONNECTIONS x PIPELINE hits in flight, so each of the N x (N - 1)
    # directed peer links carries about CONNECTIONS x PIPELINE / N^2 of
    # them; with 25/9 as many connections, five nodes' links carry as many
    # as three nodes' links do with CONNECTIONS (docs/benchmarks.md,
    # "Ninth round"). Context for the five-node target, not the target's
    # measure.
    CONNECTIONS=$(( CONNECTIONS * 25 / 9 )) cluster_run five-scaled 5
  fi
  "$ROOT/cluster/local.sh" status > "$OUT_DIR/status-$mode.txt" || true
  "$ROOT/cluster/local.sh" down > /dev/null
  rm -rf "$RUN_DIR"
done
export PLACEMENT=ring
for consistency in strict fast; do
  echo "five nodes, $consistency, ring placement (nodes 4 and 5 join)" >&2
  name=five-ring; [[ $consistency == fast ]] && name=five-ring-fast
  CONSISTENCY=$consistency "$ROOT/cluster/local.sh" up > "$OUT_DIR/up-$name.txt"
  wait_balanced "$TOLLGATE" 3
  join_nodes_4_and_5 "$consistency" "$name"
  wait_first_replicas_lead "$TOLLGATE"
  cluster_run "$name" 5
  if [[ $consistency == strict ]]; then
    cluster_run five-ring-aware 5 --leader-aware --rules "$RULES"
  fi
  "$ROOT/cluster/local.sh" status > "$OUT_DIR/status-$name.txt" || true
  "$ROOT/cluster/local.sh" down > /dev/null
  rm -rf "$RUN_DIR"
done
unset PLACEMENT
single_nodes_run single-again 1

# Step 3: open loop at a third of the strict cluster's maximum.
RATE=$(python3 - "$OUT_DIR" <<'PY'
import json, os, sys
total = sum(json.load(open(os.path.join(sys.argv[1], f"strict-node{n}.json")))["throughput_per_sec"] for n in (1, 2, 3))
print(max(300, int(total / 3)))
PY
)
export RATE
echo "open loop at $RATE hits/s" >&2
open_pin=() # a command before the generator (taskset), when it runs pinned
open_load() { # open_load NAME TARGET CONNECTIONS RATE [PACE_US [LOADTEST FLAGS...]]
  "${open_pin[@]}" "$LOADTEST" --target "$2" --protocol divvy --connections "$3" --pipeline 256 --rate "$4" \
    --pace-us "${5:-$PACE_US}" --duration "$DURATION" --warmup "$WARMUP" --actors "$ACTORS" --actor-prefix o \
    --template 'path=/bench user={actor}' --quiet --json "$OUT_DIR/$1.json" "${@:6}" > "$OUT_DIR/$1.txt"
}
# Host stalls: one busy loop per CPU, each pinned, noting every gap over
# 200 us between two reads of the clock (docs/benchmarks.md, "Twenty-ninth
# round": the host took this machine's CPUs away for up to 10 ms at a time).
host_probe() { # host_probe SECONDS CPU: one JSON line
  python3 - "$1" "$2" <<'PY'
import json, os, sys, time
seconds, cpu = float(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {cpu})
clock = time.perf_counter_ns
gaps = []
last = start = clock()
while last < start + int(seconds * 1e9):
    now = clock()
    if now - last > 200_000:
        gaps.append((now - last) / 1e6)
    last = now
print(json.dumps({"cpu": cpu, "gaps_over_1ms": sum(g > 1 for g in gaps), "stalled_ms": round(sum(gaps), 1),
                  "longest_ms": round(max(gaps, default=0), 2)}))
PY
}
: > "$OUT_DIR/host-stalls.jsonl"
if [[ $HOST_PROBE_SECONDS != 0 ]]; then
  echo "host stalls, ${HOST_PROBE_SECONDS} s" >&2
  # Each probe to a file of its own: two appending to one file at once
  # could interleave their lines.
  cpus=$(python3 -c "import os; print(' '.join(map(str, sorted(os.sched_getaffinity(0)))))")
  for cpu in $cpus; do
    host_probe "$HOST_PROBE_SECONDS" "$cpu" > "$OUT_DIR/host-stalls-cpu$cpu.json" &
  done
  wait
  for cpu in $cpus; do cat "$OUT_DIR/host-stalls-cpu$cpu.json" >> "$OUT_DIR/host-stalls.jsonl"; done
fi
per_node=$((OPEN_CONNECTIONS / 3))
per_node_rate=$((RATE / 3))
CONSISTENCY=strict "$ROOT/cluster/local.sh" up > /dev/null
wait_balanced "$TOLLGATE" 3
all_nodes="127.0.0.1:$BASE_PORT,127.0.0.1:$((BASE_PORT + 1)),127.0.0.1:$((BASE_PORT + 2))"
# The single node beside the cluster, on a port after the five nodes'.
single_open="127.0.0.1:$((BASE_PORT + 9))"
"$TOLLGATE" serve --listen "$single_open" "$RULES" > "$OUT_DIR/single-open.log" 2>&1 &
single=$!
floor_up 3
floor_open="$(floor_client 1),$(floor_client 2),$(floor_client 3)"
sleep 1
if ! kill -0 "$single" 2> /dev/null; then
  echo "bench.sh: the single node did not start on $single_open (see $OUT_DIR/single-open.log)" >&2
  floor_down
  "$ROOT/cluster/local.sh" down > /dev/null
  exit 1
fi
: > "$OUT_DIR/open-busy.percent"
for round in $(seq 1 "$OPEN_ROUNDS"); do
  echo "open loop, round $round of $OPEN_ROUNDS" >&2
  open_load "open-single-$round" "$single_open" "$OPEN_CONNECTIONS" "$RATE"
  open_load "open-strict-$round" "$all_nodes" "$OPEN_CONNECTIONS" "$RATE" &
  strict_load=$!
  # How busy the whole machine (servers and generator) is meanwhile.
  sleep "$WARMUP"; read -r -a stat_before < /proc/stat
  sleep "$(( ${DURATION%.*} > 2 ? ${DURATION%.*} - 1 : 1 ))"; read -r -a stat_after < /proc/stat
  python3 -c "import sys; a, b = [list(map(int, x.split()[1:])) for x in sys.argv[1:3]]; d = [y - x for x, y in zip(a, b)]; print(f'{100 * (1 - (d[3] + d[4]) / sum(d)):.0f}')" \
    "${stat_before[*]}" "${stat_after[*]}" >> "$OUT_DIR/open-busy.percent"
  wait "$strict_load"
  open_load "open-strict-aware-$round" "$all_nodes" "$OPEN_CONNECTIONS" "$RATE" "$PACE_US" --leader-aware --rules "$RULES"
  open_load "open-floor-$round" "$floor_open" "$OPEN_CONNECTIONS" "$RATE"
done
# Once more with the cluster, the floor and the generator on one CPU: the
# host's episodes, which take one of the two CPUs for a few milliseconds
# at a time, held for the whole run (docs/benchmarks.md, "Thirty-fifth
# round"). Every thread of the running servers is pinned, then let go.
one_cpu=$(python3 -c "import os; print(max(os.sched_getaffinity(0)))")
all_cpus=$(python3 -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0)))))")
pin_servers() { # pin_servers CPU_LIST: every thread of the cluster's and the floor's nodes
  local pid
  for pid in $(cluster_pids) "${FLOOR_PIDS[@]}"; do taskset -a -p -c "$1" "$pid" > /dev/null; done
}
echo "open loop on CPU $one_cpu only" >&2
pin_servers "$one_cpu"
open_pin=(taskset -c "$one_cpu")
one_cpu_run() { # one_cpu_run NAME TARGET PIDS...: the open loop, and the servers measured meanwhile
  local name=$1 target=$2 waits=()
  shift 2
  measure "$name" "" "$@" &
  waits+=($!)
  open_load "$name" "$target" "$OPEN_CONNECTIONS" "$RATE" &
  waits+=($!)
  wait "${waits[@]}"
}
# shellcheck disable=SC2046 # one pid per word
one_cpu_run open-strict-one-cpu "$all_nodes" $(cluster_pids)
one_cpu_run open-floor-one-cpu "$floor_open" "${FLOOR_PIDS[@]}"
open_pin=()
pin_servers "$all_cpus"
floor_down
open_load open-single-many "$single_open" "$CONNECTIONS" "$RATE" 100
kill "$single"; wait "$single" || true
open_load open-strict-many "$all_nodes" "$CONNECTIONS" "$RATE" 100

# Step 4: failover under load, on the same cluster.
echo "failover, strict, $FAILOVERS rounds" >&2
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
      DURATION=$((WARMUP + 8)) open_load "failover-$round-node$n" "127.0.0.1:$((BASE_PORT + n - 1))" "$per_node" "$per_node_rate" &
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
  wait_balanced "$TOLLGATE" 3
done
"$ROOT/cluster/local.sh" down > /dev/null

python3 - "$OUT_DIR" "$CONNECTIONS" "$PIPELINE" "$DURATION" "$RATE" "$FAILOVERS" "$ACTORS" "$HOST_PROBE_SECONDS" "$OPEN_ROUNDS" <<'PY'
import json, os, re, sys
from statistics import median
out, connections, pipeline, duration, rate, failovers, actors, host_probe_seconds, open_rounds = sys.argv[1:10]
open_rounds = int(open_rounds)
duration = float(duration)
def path(name): return os.path.join(out, name)
def read(name):
    with open(path(name + ".json")) as f:
        return json.load(f)
def runs(name):
    nodes = int(open(path(name + ".nodes")).read())
    return [read(f"{name}-node{n}") for n in range(1, nodes + 1)]
def cpu(name):
    user, system = map(float, open(path(name + ".cpu")).read().split())
    return user, system
def syscalls(name):
    try:
        for line in open(path(name + ".perf")):
            m = re.match(r"\s*([\d,]+)\s+raw_syscalls", line)
            if m:
                return int(m.group(1).replace(",", ""))
    except OSError:
        pass
    return None
def stats_delta(name):
    try:
        before = {n["id"]: n.get("stats") or {} for n in json.load(open(path(name + ".stats-before")))["nodes"]}
        after = {n["id"]: n.get("stats") or {} for n in json.load(open(path(name + ".stats-after")))["nodes"]}
    except (OSError, ValueError, KeyError):
        return None
    keys = set().union(*[set(s) for s in after.values()]) if after else set()
    return {k: sum(after[i].get(k, 0) - before.get(i, {}).get(k, 0) for i in after) for k in keys}

rows = {}
for name, label in [("single", "one node"), ("strict", "three nodes, strict"), ("fast", "three nodes, fast"),
                    ("aware", "three nodes, fast, leader-aware clients"), ("five", "five nodes, strict"),
                    ("five-scaled", "five nodes, strict, {connections} connections"),
                    ("strict-aware", "three nodes, strict, leader-aware clients"),
                    ("five-ring", "five nodes, strict, ring placement"),
                    ("five-ring-aware", "five nodes, strict, ring placement, leader-aware clients"),
                    ("five-fast", "five nodes, fast"),
                    ("five-fast-scaled", "five nodes, fast, {connections} connections"),
                    ("five-ring-fast", "five nodes, fast, ring placement"),
                    ("singles-3", "three independent single nodes (no cluster)"),
                    ("singles-5", "five independent single nodes (no cluster)"),
                    ("floor-3", "three mesh floor nodes (messages only)"),
                    ("floor-5", "five mesh floor nodes (messages only)"),
                    ("single-again", "one node, again (after the clusters)")]:
    r = runs(name)
    label = label.format(connections=sum(x["config"]["connections"] for x in r))
    throughput = sum(x["throughput_per_sec"] for x in r)
    hits = throughput * duration
    user, system = cpu(name)
    calls = syscalls(name)
    rows[name] = dict(label=label, throughput=throughput,
                      p50=[x["latency_us"]["p50"] for x in r], p99=[x["latency_us"]["p99"] for x in r],
                      errors=sum(x["errors"] for x in r),
                      cpu=(user + system) * 1e6 / max(hits, 1), user=user * 1e6 / max(hits, 1),
                      system=system * 1e6 / max(hits, 1),
                      syscalls=None if calls is None else calls / max(hits, 1), stats=stats_delta(name))
# One node's figures, the denominator of every ratio: the mean of its two
# runs (before and after the clusters).
runs_of_one = [rows["single"], rows["single-again"]]
single = {key: sum(r[key] for r in runs_of_one) / 2 for key in ("cpu", "throughput")}
print(f"Closed loop, {connections} connections x pipeline {pipeline}, {duration:g} s measured, {actors} actors, "
      "every hit admitted (and so replicated). Clusters: one generator per node, a share of the connections each; "
      "latency columns give the range over the nodes.")
print()
print(f"One node's CPU per hit, the ratios' denominator, is the mean of its two runs: {single['cpu']:.2f} us.")
print()
print("| setup | hits/s | p50 (us) | p99 (us) | errors | server CPU per hit (us) | user / system | syscalls per hit | CPU per hit / one node's |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, row in rows.items():
    calls = "-" if row["syscalls"] is None else f"{row['syscalls']:.2f}"
    print(f"| {row['label']} | {row['throughput']:.0f} | {min(row['p50']):.0f}-{max(row['p50']):.0f} | "
          f"{min(row['p99']):.0f}-{max(row['p99']):.0f} | {row['errors']} | {row['cpu']:.2f} | "
          f"{row['user']:.2f} / {row['system']:.2f} | {calls} | {row['cpu'] / single['cpu']:.2f}x |")
print()
print("Data path during the measured window (all nodes together):")
print()
print("| setup | rounds/s | states per round | states per shard section | hits per forwarded batch | frames per write | writes per hit |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name in ("strict", "strict-aware", "fast", "aware", "five", "five-scaled", "five-ring", "five-ring-aware",
             "five-fast", "five-fast-scaled",
             "five-ring-fast"):
    s = rows[name]["stats"]
    if not s:
        continue
    ratio = lambda a, b: f"{s.get(a, 0) / s[b]:.1f}" if s.get(b) else "-"
    hits = rows[name]["throughput"] * duration
    print(f"| {rows[name]['label']} | {s.get('rounds', 0) / duration:.0f} | {ratio('states_replicated', 'rounds')} | "
          f"{ratio('states_replicated', 'round_sections')} | {ratio('forwarded_ops', 'forward_batches')} | "
          f"{ratio('frames_written', 'writes')} | {s.get('writes', 0) / max(hits, 1):.3f} |")
print()
idle = float(open(path("idle.percent")).read())
print(f"Idle three-node cluster: {idle:.1f}% of one core (all three processes).")
print()
busy = [int(x) for x in open(path("open-busy.percent")).read().split()]
open_config = read("open-single-1")["config"]
print(f"Open loop at {rate} hits/s offered (a third of the strict cluster's maximum above), {open_config['connections']} connections, "
      f"from one generator sending every {open_config['pace_us']} us what is due by then (latency from each request's due time; "
      f"the cluster's connections spread over its three nodes); {open_rounds} rounds of one node, three strict nodes, three "
      f"strict nodes with leader-aware clients and three mesh floor nodes, interleaved (medians, and the range over the rounds); the whole machine was "
      f"{min(busy)}-{max(busy)}% busy during the cluster's runs. Then once with {connections} connections sending every 100 us.")
print()
print("| setup | hits/s | p50 (us) | p99 (us), median | p99 (us), rounds | errors |")
print("|---|---:|---:|---:|---|---:|")
def open_row(names, label):
    got = [read(name) for name in names]
    p99 = [run["latency_us"]["p99"] for run in got]
    print(f"| {label} | {median([r['throughput_per_sec'] for r in got]):.0f} | "
          f"{median([r['latency_us']['p50'] for r in got]):.0f} | {median(p99):.0f} | "
          f"{', '.join(f'{x:.0f}' for x in p99)} | {sum(r['errors'] for r in got)} |")
    return median(p99)
rounds_of = lambda name: [f"{name}-{r}" for r in range(1, open_rounds + 1)]
single_p99 = open_row(rounds_of("open-single"), "one node")
strict_p99 = open_row(rounds_of("open-strict"), "three nodes, strict")
strict_aware_p99 = open_row(rounds_of("open-strict-aware"), "three nodes, strict, leader-aware clients")
floor_p99 = open_row(rounds_of("open-floor"), "three mesh floor nodes (messages only)")
many = f", {connections} connections every 100 us"
single_many_p99 = open_row(["open-single-many"], f"one node{many}")
strict_many_p99 = open_row(["open-strict-many"], f"three nodes, strict{many}")
failover_ms = []
for r in range(1, int(failovers) + 1):
    for word in open(path(f"failover-{r}.txt")).read().split():
        if word.startswith("failover_ms="):
            failover_ms.append(float(word.split("=")[1]))
print()
print("| measure | figure | target |")
print("|---|---:|---|")
ratio = lambda name: rows[name]["cpu"] / single["cpu"]
print(f"| strict: CPU per hit / one node's | {ratio('strict'):.2f}x | <= 3x |")
print(f"| fast: CPU per hit / one node's | {ratio('fast'):.2f}x | <= 2x |")
print(f"| fast, leader-aware: CPU per hit / one node's | {ratio('aware'):.2f}x | <= 1.6x |")
print(f"| strict throughput / one node's | {100 * rows['strict']['throughput'] / single['throughput']:.0f}% | >= 25% |")
s = rows["strict"]["stats"] or {}
if s.get("rounds"):
    print(f"| strict: hits per replication round, at maximum load | {s['states_replicated'] / s['rounds']:.0f} | >= 50 |")
print(f"| idle three-node cluster | {idle:.1f}% of a core | <= 3% |")
print(f"| five nodes strict: CPU per hit / three nodes' | {rows['five']['cpu'] / rows['strict']['cpu']:.2f}x | <= 1.15x |")
print(f"| (five nodes strict with as many hits in flight per peer link as three: CPU per hit / three nodes') | "
      f"{rows['five-scaled']['cpu'] / rows['strict']['cpu']:.2f}x | context |")
print(f"| five nodes strict, ring placement: CPU per hit / three nodes' | "
      f"{rows['five-ring']['cpu'] / rows['strict']['cpu']:.2f}x | <= 1.15x |")
print(f"| (five nodes strict, ring placement, leader-aware clients: CPU per hit / three nodes' strict with "
      f"leader-aware clients) | {rows['five-ring-aware']['cpu'] / rows['strict-aware']['cpu']:.2f}x | context |")
print(f"| five nodes fast: CPU per hit / three nodes' | {rows['five-fast']['cpu'] / rows['fast']['cpu']:.2f}x | <= 1.15x |")
print(f"| five nodes fast, ring placement: CPU per hit / three nodes' | "
      f"{rows['five-ring-fast']['cpu'] / rows['fast']['cpu']:.2f}x | <= 1.15x |")
floor = rows["singles-5"]["cpu"] / rows["singles-3"]["cpu"]
print(f"| (five independent single nodes: CPU per hit / three's, no cluster at all: this machine's floor) | "
      f"{floor:.2f}x | context |")
print(f"| (five nodes fast / three, over that floor: what the cluster adds) | "
      f"{rows['five-fast']['cpu'] / rows['fast']['cpu'] / floor:.2f}x | context |")
print(f"| (five nodes strict / three, over that floor) | {rows['five']['cpu'] / rows['strict']['cpu'] / floor:.2f}x | context |")
print(f"| (five mesh floor nodes / three: a strict cluster's messages alone, no work) | "
      f"{rows['floor-5']['cpu'] / rows['floor-3']['cpu']:.2f}x | context |")
print(f"| (five nodes fast with as many connections per node as three: CPU per hit / three nodes') | "
      f"{rows['five-fast-scaled']['cpu'] / rows['fast']['cpu']:.2f}x | context |")
print(f"| strict p99 at a third of its maximum, open loop, median of {open_rounds} rounds | "
      f"{strict_p99 / 1000:.2f} ms (one node {single_p99 / 1000:.2f} ms) | <= 2 ms |")
print(f"| (the same, leader-aware clients) | {strict_aware_p99 / 1000:.2f} ms | context |")
def one_cpu_figures(name):
    run = read(f"open-{name}-one-cpu")
    cpu_us = sum(cpu(f"open-{name}-one-cpu")) * 1e6 / (run["throughput_per_sec"] * duration)
    latency = run["latency_us"]
    return f"{latency['p50'] / 1000:.2f} / {latency['p99'] / 1000:.2f} ms, {cpu_us:.2f} us per hit"
print(f"| (the same, servers and generator on one CPU, one run: p50 / p99, servers' CPU per hit) | "
      f"{one_cpu_figures('strict')} (mesh floor {one_cpu_figures('floor')}) | context |")
print(f"| (the same, three mesh floor nodes: the messages alone) | {floor_p99 / 1000:.2f} ms | context |")
stalls = [json.loads(line) for line in open(path("host-stalls.jsonl")) if line.strip()]
if stalls:
    print(f"| (host stalls on the idle machine before the open loop, {host_probe_seconds} s: per CPU, gaps over 1 ms, "
          f"stalled ms, longest ms) | " + "; ".join(f"cpu{x['cpu']} {x['gaps_over_1ms']}, {x['stalled_ms']}, {x['longest_ms']}"
          for x in sorted(stalls, key=lambda x: x["cpu"])) + " | context |")
print(f"| (the same, {connections} connections every 100 us) | {strict_many_p99 / 1000:.2f} ms (one node {single_many_p99 / 1000:.2f} ms) | context |")
if failover_ms:
    ms = sorted(failover_ms)
    print(f"| failover under load, {len(ms)} rounds (min / median / max) | {ms[0]:.0f} / {ms[len(ms)//2]:.0f} / {ms[-1]:.0f} ms | <= 2 s |")
PY
echo "results in $OUT_DIR" >&2
