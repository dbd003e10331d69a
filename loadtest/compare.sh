#!/usr/bin/env bash
# compare.sh: Tollgate (divvy line protocol, in memory) against Redis doing divvy's own per-hit work,
# on loopback, with the same load generator and the same workloads, runs ALTERNATING between the two
# (tollgate, redis, tollgate, redis, ...) so that drifts of the machine hit both alike.
#
# Workloads (100k actors, uniform, closed loop):
#   1. 64 connections, no pipelining:   divvy  vs  resp-incr   (INCR: the cheapest Redis round trip)
#   2. 64 connections, pipeline 32:     divvy  vs  resp-incr
#   3. 64 connections, pipeline 32:     divvy  vs  resp-script (EVALSHA of divvy's fixed-window script)
#
# Environment (all optional):
#   DURATION=10     measured seconds per run        WARMUP=1     unrecorded seconds before each run
#   ROUNDS=2        runs per target and workload    THREADS=1    load generator threads
#   CONNECTIONS=64  connections per run             ACTORS=100000
#   OUT=<dir>       where the JSON results and logs go (default: a new /tmp/tollgate-compare.* dir)
#   CARGO_TARGET_DIR  as for cargo;  SKIP_BUILD=1  use the binaries already built
#   TOLLGATE_BIN, LOADTEST_BIN  binaries to use instead of the ones cargo builds
#   REDIS_SERVER=redis-server
#   TOLLGATE_THREADS=1  serving threads: one, like Redis, since the generator takes the other core
#                       of a 2-core machine (give more on a bigger machine)
#   TOLLGATE_SERVE_ARGS  more flags for `tollgate serve`, split on spaces (e.g. --io-uring)
#
# Every run uses its own actor names (prefix w<workload>r<round>), so each starts from fresh
# counters on both servers. Everything started here is stopped on exit.
set -euo pipefail

DURATION=${DURATION:-10}
WARMUP=${WARMUP:-1}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-1}
CONNECTIONS=${CONNECTIONS:-64}
ACTORS=${ACTORS:-100000}
REDIS_SERVER=${REDIS_SERVER:-redis-server}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=${OUT:-$(mktemp -d /tmp/tollgate-compare.XXXXXX)}
mkdir -p "$OUT"

command -v python3 >/dev/null || { echo "compare.sh: python3 is needed" >&2; exit 1; }
command -v "$REDIS_SERVER" >/dev/null || { echo "compare.sh: $REDIS_SERVER not found" >&2; exit 1; }

# shellcheck source=loadtest/common.sh
source "$ROOT/loadtest/common.sh"
find_binaries compare.sh

# answers HOST:PORT PAYLOAD PREFIX: true when the server answers PAYLOAD with a line starting with PREFIX.
answers() {
    python3 - "$1" "$2" "$3" <<'EOF'
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
try:
    s = socket.create_connection((host, int(port)), timeout=1)
    s.settimeout(1)
    s.sendall(sys.argv[2].encode().decode("unicode_escape").encode())
    data = b""
    while b"\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    sys.exit(0 if b"\n" in data and data.startswith(sys.argv[3].encode()) else 1)
except OSError:
    sys.exit(1)
EOF
}

# wait_for NAME PID CHECK...: poll CHECK for up to 20 s while PID lives.
wait_for() {
    local name=$1 pid=$2
    shift 2
    local i
    for i in $(seq 1 200); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "compare.sh: $name exited during startup; its log:" >&2
            cat "$OUT/$name.log" >&2 || true
            exit 1
        fi
        if "$@"; then
            return 0
        fi
        sleep 0.1
    done
    echo "compare.sh: $name did not answer within 20 s; its log:" >&2
    cat "$OUT/$name.log" >&2 || true
    exit 1
}

echo "== starting tollgate (embedded default rules) and redis on loopback; results in $OUT"
# shellcheck disable=SC2086 # the extra flags are meant to split
"$TOLLGATE" serve --listen 127.0.0.1:0 --threads "${TOLLGATE_THREADS:-1}" ${TOLLGATE_SERVE_ARGS:-} \
    >"$OUT/tollgate.log" 2>&1 &
PIDS+=($!)
TOLLGATE_PID=$!
tollgate_addr() {
    TOLLGATE_ADDR=$(python3 -c '
import re, sys
m = re.search(r"listening on (\S+)", open(sys.argv[1], errors="replace").read())
print(m.group(1) if m else "")' "$OUT/tollgate.log")
    [[ -n $TOLLGATE_ADDR ]]
}
wait_for tollgate "$TOLLGATE_PID" tollgate_addr
wait_for tollgate "$TOLLGATE_PID" answers "$TOLLGATE_ADDR" 'HIT method=GET path=/status\n' ''

REDIS_PORT=$(free_port)
REDIS_ADDR=127.0.0.1:$REDIS_PORT
"$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no >"$OUT/redis.log" 2>&1 &
PIDS+=($!)
REDIS_PID=$!
wait_for redis "$REDIS_PID" answers "$REDIS_ADDR" '*1\r\n$4\r\nPING\r\n' '+PONG'
echo "   tollgate at $TOLLGATE_ADDR, redis at $REDIS_ADDR"

# Workloads: name | description | generator flags | redis protocol
WORKLOADS=(
    "p1-incr|$CONNECTIONS connections, no pipelining, $ACTORS actors: divvy vs INCR|--pipeline 1|resp-incr"
    "p32-incr|$CONNECTIONS connections, pipeline 32, $ACTORS actors: divvy vs INCR|--pipeline 32|resp-incr"
    "p32-script|$CONNECTIONS connections, pipeline 32, $ACTORS actors: divvy vs divvy's Lua script|--pipeline 32|resp-script"
)

run_one() { # run_one JSON LOG ARGS...
    local json=$1 log=$2
    shift 2
    local rc=0
    "$LOADTEST" --quiet --json "$json" --duration "$DURATION" --warmup "$WARMUP" \
        --threads "$THREADS" --connections "$CONNECTIONS" --actors "$ACTORS" "$@" >"$log" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "compare.sh: load generator failed (exit $rc):" >&2
        cat "$log" >&2
        exit 1
    fi
    python3 - "$json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
l = r["latency_us"]
print(f"   {r['config']['protocol']:<12} {r['throughput_per_sec']:>12.0f}/s  p50 {l['p50']:>9.1f}  "
      f"p99 {l['p99']:>9.1f}  p99.9 {l['p999']:>9.1f}  max {l['max']:>9.1f} us  "
      f"allowed {r['allowed']} denied {r['denied']} errors {r['errors']}")
EOF
}

w=0
for spec in "${WORKLOADS[@]}"; do
    IFS='|' read -r name desc flags redis_proto <<<"$spec"
    w=$((w + 1))
    echo "== $name: $desc"
    for r in $(seq 1 "$ROUNDS"); do
        prefix="w${w}r${r}a"
        # shellcheck disable=SC2086 # flags are meant to split
        run_one "$OUT/$name-tollgate-$r.json" "$OUT/$name-tollgate-$r.log" \
            --target "$TOLLGATE_ADDR" --protocol divvy --actor-prefix "$prefix" $flags
        # shellcheck disable=SC2086
        run_one "$OUT/$name-redis-$r.json" "$OUT/$name-redis-$r.log" \
            --target "$REDIS_ADDR" --protocol "$redis_proto" --actor-prefix "$prefix" $flags
    done
done

# Open loop at half of Tollgate's measured maximum (the pipelined INCR workload's median), so
# latency is measured against a schedule, not against the server's own pace.
HALF_RATE=$(python3 -c '
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{out}/p32-incr-tollgate-{r}.json"))["throughput_per_sec"] for r in range(1, rounds + 1)]
print(int(statistics.median(runs) / 2))' "$OUT" "$ROUNDS")
echo "== open loop at half of tollgate's maximum: $HALF_RATE requests/s"
run_one "$OUT/open-tollgate.json" "$OUT/open-tollgate.log" --target "$TOLLGATE_ADDR" --protocol divvy \
    --actor-prefix open --rate "$HALF_RATE" --pipeline 32 --plot "$OUT/open-tollgate.svg"
run_one "$OUT/open-redis.json" "$OUT/open-redis.log" --target "$REDIS_ADDR" --protocol resp-incr \
    --actor-prefix open --rate "$HALF_RATE" --pipeline 32 --plot "$OUT/open-redis.svg"

echo
echo "== summary (median over $ROUNDS rounds of $DURATION s; ratio = tollgate / redis)"
python3 - "$OUT" "$ROUNDS" "${WORKLOADS[@]}" <<'EOF'
import json, statistics, sys
out, rounds, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
fields = [("throughput_per_sec", "thr/s"), ("p50", "p50 us"), ("p99", "p99 us"), ("p999", "p99.9 us"), ("max", "max us")]
def get(r, f):
    return r[f] if f in r else r["latency_us"][f]
print(f"{'workload':<12} {'target':<22}" + "".join(f"{h:>12}" for _, h in fields) + f"{'errors':>9}")
summary = {}
for spec in specs:
    name, desc, _, redis_proto = spec.split("|")
    med = {}
    for target, proto in (("tollgate", "divvy"), ("redis", redis_proto)):
        runs = [json.load(open(f"{out}/{name}-{target}-{r}.json")) for r in range(1, rounds + 1)]
        med[target] = {f: statistics.median(get(x, f) for x in runs) for f, _ in fields}
        med[target]["errors"] = sum(x["errors"] for x in runs)
        print(f"{name:<12} {target + ' (' + proto + ')':<22}"
              + "".join(f"{med[target][f]:>12.1f}" for f, _ in fields) + f"{med[target]['errors']:>9}")
    ratio = {f: (med["tollgate"][f] / med["redis"][f] if med["redis"][f] else float("nan")) for f, _ in fields}
    print(f"{name:<12} {'ratio':<22}" + "".join(f"{ratio[f]:>11.2f}x" for f, _ in fields))
    summary[name] = {"description": desc, "tollgate": med["tollgate"], "redis": med["redis"], "ratio": ratio}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(f"\n(JSON: {out}/summary.json; per-run results and logs beside it)")
EOF
