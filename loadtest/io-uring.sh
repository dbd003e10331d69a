#!/usr/bin/env bash
# io-uring.sh: Tollgate on epoll, Tollgate on io_uring (`--io-uring`, same binary) and Redis `INCR`,
# one serving thread each, on loopback, runs ALTERNATING (epoll, io_uring, redis, epoll, ...), with
# each server's CPU read from /proc over the measured window (CPU per request is the figure to
# quote on a shared machine) and, with SYSCALLS=1, its system calls counted by `perf stat -e
# raw_syscalls:sys_enter` over the same window (perf adds a little cost per system call).
#
# Environment (all optional):
#   WORKLOADS="1:100000 1:1000000 32:100000"  PIPELINE:ACTORS pairs, each with 64 connections
#   ROUNDS=3  DURATION=5 (seconds per run; CPU is read over the last DURATION-1)  WARMUP=1
#   SYSCALLS=1  also count system calls (needs perf and the raw_syscalls tracepoint)
#   OUT=<dir>  SKIP_BUILD=1  TOLLGATE_BIN  LOADTEST_BIN  CARGO_TARGET_DIR  as for compare.sh
# Prints one line per run: requests/s, the server's CPU, CPU per request, errors (and system
# calls per request). Every run uses its own actor names, so each starts from fresh counters.
set -euo pipefail

WORKLOADS=${WORKLOADS:-"1:100000 1:1000000 32:100000"}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
WARMUP=${WARMUP:-1}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=${OUT:-$(mktemp -d /tmp/tollgate-io-uring.XXXXXX)}
mkdir -p "$OUT"
((DURATION >= 2)) || { echo "io-uring.sh: DURATION must be at least 2" >&2; exit 1; }
command -v redis-server >/dev/null || { echo "io-uring.sh: redis-server not found" >&2; exit 1; }

# shellcheck source=loadtest/common.sh
source "$ROOT/loadtest/common.sh"
find_binaries io-uring.sh

declare -A PORT PID
start() { # start NAME COMMAND...: runs it on PORT[NAME], waits until the port accepts
    local name=$1
    shift
    "$@" >"$OUT/$name.log" 2>&1 &
    PIDS+=($!)
    PID[$name]=$!
    local i
    for i in $(seq 1 200); do
        kill -0 "${PID[$name]}" 2>/dev/null || { cat "$OUT/$name.log" >&2; exit 1; }
        python3 -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1)' \
            "${PORT[$name]}" 2>/dev/null && return
        sleep 0.1
    done
    echo "io-uring.sh: $name did not start; its log:" >&2
    cat "$OUT/$name.log" >&2
    exit 1
}
for name in epoll io_uring redis; do PORT[$name]=$(free_port); done
start epoll "$TOLLGATE" serve --listen "127.0.0.1:${PORT[epoll]}" --threads 1
start io_uring "$TOLLGATE" serve --listen "127.0.0.1:${PORT[io_uring]}" --threads 1 --io-uring
start redis redis-server --port "${PORT[redis]}" --bind 127.0.0.1 --save '' --appendonly no
echo "== epoll, io_uring and redis on 127.0.0.1:${PORT[epoll]}, :${PORT[io_uring]}, :${PORT[redis]}; results in $OUT"

HZ=$(getconf CLK_TCK)
WINDOW=$((DURATION - 1))
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

run() { # run NAME PROTOCOL PIPELINE ACTORS PREFIX
    local name=$1 protocol=$2 pipeline=$3 actors=$4 prefix=$5
    local pid=${PID[$name]} base=$OUT/$name-$prefix
    "$LOADTEST" --quiet --json "$base.json" --target "127.0.0.1:${PORT[$name]}" --protocol "$protocol" \
        --connections 64 --pipeline "$pipeline" --actors "$actors" --actor-prefix "$prefix" \
        --duration "$DURATION" --warmup "$WARMUP" >"$base.log" 2>&1 &
    local generator=$!
    sleep "$WARMUP"
    sleep 0.05
    local before after
    before=$(cpu_ticks "$pid")
    if [[ -n ${SYSCALLS:-} ]]; then
        perf stat -x, -e raw_syscalls:sys_enter -p "$pid" -o "$base.perf" -- sleep "$WINDOW" >/dev/null 2>&1
    else
        sleep "$WINDOW"
    fi
    after=$(cpu_ticks "$pid")
    wait "$generator" || { cat "$base.log" >&2; exit 1; }
    python3 - "$base" "$name" "$pipeline" "$actors" "$((after - before))" "$HZ" "$WINDOW" <<'EOF'
import json, os, sys
base, name, pipeline, actors, ticks, hz, window = sys.argv[1:]
r = json.load(open(base + ".json"))
rate, window = r["throughput_per_sec"], int(window)
cpu = int(ticks) / int(hz)
line = (f"   p{pipeline:<3} {actors:>8} actors  {name:<9} {rate:>10.0f}/s  cpu {cpu:5.2f} s "
        f"({cpu * 100 / window:3.0f}%)  {cpu / (rate * window) * 1e6:6.2f} us/request  errors {r['errors']}")
if os.path.exists(base + ".perf"):
    for row in open(base + ".perf"):
        if "raw_syscalls" in row:
            line += f"  system calls/request {float(row.split(',')[0]) / (rate * window):.3f}"
print(line, flush=True)
EOF
}

w=0
for workload in $WORKLOADS; do
    pipeline=${workload%%:*}
    actors=${workload##*:}
    w=$((w + 1))
    echo "== 64 connections, pipeline $pipeline, $actors actors"
    for r in $(seq 1 "$ROUNDS"); do
        prefix="u$$w${w}r${r}"
        run epoll divvy "$pipeline" "$actors" "${prefix}e"
        run io_uring divvy "$pipeline" "$actors" "${prefix}u"
        run redis resp-incr "$pipeline" "$actors" "${prefix}r"
    done
done
