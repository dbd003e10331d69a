#!/usr/bin/env bash
# bench-redis-backend.sh: Tollgate on the redis backend (clients speak divvy's protocol to Tollgate,
# which runs divvy's script in Redis, multiplexed) against the load generator running divvy's script
# directly on the same Redis (resp-script: one EVALSHA per hit, what divvy itself does per hit).
# Runs alternate (tollgate, direct, tollgate, ...) so that drifts of the machine hit both alike.
#
# Both do the same Redis work per hit: EVALSHA on `divvy:ip=* method=GET path=/pantry/cookies/*:<ip>:3:3600`
# (the embedded default rules' cookie rule; the load generator's default template and key).
# Besides throughput and latency, each run reports the CPU time that redis-server and Tollgate spent
# per answered request (from /proc/<pid>/stat), which depends much less on other load on the machine.
# With TOLLGATE_BASE_BIN set, a second Tollgate (another build, e.g. main's) runs on the same Redis, in
# the same alternation (base, tollgate, direct, base, ...), and the summary gives its ratios too.
#
# Environment (all optional):
#   DURATION=10  WARMUP=0  ROUNDS=3  THREADS=1 (load generator)  CONNECTIONS=64  ACTORS=100000
#   PIPELINES="1 16"  TOLLGATE_THREADS=2
#   TOLLGATE_BIN (default target/release/tollgate)  LOADTEST_BIN (default target/release/tollgate-loadtest;
#   both are built by `cargo build --release --workspace`)  TOLLGATE_BASE_BIN (unset: no base runs)
#   OUT=<dir> (default: a new /tmp/tollgate-redis-bench.* dir)
set -euo pipefail

DURATION=${DURATION:-10}
WARMUP=${WARMUP:-0}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-1}
CONNECTIONS=${CONNECTIONS:-64}
ACTORS=${ACTORS:-100000}
PIPELINES=${PIPELINES:-1 16}
TOLLGATE_THREADS=${TOLLGATE_THREADS:-2}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOLLGATE=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
LOADTEST=${LOADTEST_BIN:-$ROOT/target/release/tollgate-loadtest}
OUT=${OUT:-$(mktemp -d /tmp/tollgate-redis-bench.XXXXXX)}
mkdir -p "$OUT"
for b in "$TOLLGATE" "$LOADTEST"; do
    [[ -x $b ]] || { echo "bench-redis-backend.sh: $b is missing" >&2; exit 1; }
done

# The processes started here (PIDS), stopped on exit.
# shellcheck source=loadtest/common.sh
source "$ROOT/loadtest/common.sh"

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no >"$OUT/redis.log" 2>&1 &
PIDS+=($!)
REDIS_PID=$!
for _ in $(seq 1 100); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
    sleep 0.1
done

# start_tollgate BIN NAME: a Tollgate on the redis backend; sets STARTED_PORT and STARTED_PID.
start_tollgate() {
    STARTED_PORT=$(free_port)
    "$1" serve --listen "127.0.0.1:$STARTED_PORT" --threads "$TOLLGATE_THREADS" \
        --backend redis --redis-url "redis://127.0.0.1:$REDIS_PORT" >"$OUT/$2.log" 2>&1 &
    STARTED_PID=$!
    PIDS+=("$STARTED_PID")
    for _ in $(seq 1 100); do
        grep -q "listening on" "$OUT/$2.log" && break
        sleep 0.1
    done
}

start_tollgate "$TOLLGATE" tollgate
TOLLGATE_PORT=$STARTED_PORT
TOLLGATE_PID=$STARTED_PID
BASE_PID=0
TARGETS="tollgate direct"
if [[ -n ${TOLLGATE_BASE_BIN:-} ]]; then
    start_tollgate "$TOLLGATE_BASE_BIN" base
    BASE_PORT=$STARTED_PORT
    BASE_PID=$STARTED_PID
    TARGETS="base tollgate direct"
    echo "== base tollgate ($TOLLGATE_BASE_BIN) at 127.0.0.1:$BASE_PORT"
fi
echo "== redis at 127.0.0.1:$REDIS_PORT, tollgate (redis backend) at 127.0.0.1:$TOLLGATE_PORT; results in $OUT"
echo "   load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

cpu_ticks() { # PID (0: none)
    if [[ $1 == 0 ]]; then echo 0; else awk '{print $14 + $15}' "/proc/$1/stat"; fi
}

run_one() { # run_one JSON SERVER_PID ARGS...
    local json=$1 server_pid=$2
    shift 2
    local r0 t0
    r0=$(cpu_ticks "$REDIS_PID")
    t0=$(cpu_ticks "$server_pid")
    "$LOADTEST" --quiet --json "$json" --duration "$DURATION" --warmup "$WARMUP" \
        --threads "$THREADS" --connections "$CONNECTIONS" --actors "$ACTORS" "$@" >"$json.log" 2>&1
    python3 - "$json" "$r0" "$(cpu_ticks "$REDIS_PID")" "$t0" "$(cpu_ticks "$server_pid")" \
        "$(getconf CLK_TCK)" "$server_pid" <<'EOF'
import json, sys
path, (r0, r1, t0, t1, hz, pid) = sys.argv[1], map(float, sys.argv[2:])
r = json.load(open(path))
answered = max(1, r["allowed"] + r["denied"] + r["errors"])
r["cpu_us_per_request"] = {"redis": (r1 - r0) / hz * 1e6 / answered, "tollgate": (t1 - t0) / hz * 1e6 / answered}
json.dump(r, open(path, "w"))
l, c = r["latency_us"], r["cpu_us_per_request"]
name = {0: "direct"}.get(int(pid), r["config"]["protocol"] + (" (base)" if "base" in path else ""))
print(f"   {name:<15} {r['throughput_per_sec']:>10.0f}/s  p50 {l['p50']:>8.1f}  "
      f"p99 {l['p99']:>8.1f} us  cpu/request: redis {c['redis']:5.1f} us, tollgate {c['tollgate']:5.1f} us  errors {r['errors']}")
EOF
}

for p in $PIPELINES; do
    echo "== $CONNECTIONS connections, pipeline $p"
    for r in $(seq 1 "$ROUNDS"); do
        prefix="p${p}r${r}a"
        if [[ $BASE_PID != 0 ]]; then
            run_one "$OUT/p$p-base-$r.json" "$BASE_PID" --target "127.0.0.1:$BASE_PORT" \
                --protocol divvy --pipeline "$p" --actor-prefix "${prefix}b"
        fi
        run_one "$OUT/p$p-tollgate-$r.json" "$TOLLGATE_PID" --target "127.0.0.1:$TOLLGATE_PORT" \
            --protocol divvy --pipeline "$p" --actor-prefix "$prefix"
        run_one "$OUT/p$p-direct-$r.json" 0 --target "127.0.0.1:$REDIS_PORT" --protocol resp-script \
            --pipeline "$p" --actor-prefix "${prefix}d"
    done
done
echo "   load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

echo
echo "== summary (median over $ROUNDS rounds of $DURATION s; ratio = tollgate / direct)"
python3 - "$OUT" "$ROUNDS" "$TARGETS" $PIPELINES <<'EOF'
import json, statistics, sys
out, rounds, targets, pipelines = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4:]
for p in pipelines:
    med = {}
    for target in targets:
        runs = [json.load(open(f"{out}/p{p}-{target}-{r}.json")) for r in range(1, rounds + 1)]
        med[target] = (statistics.median(x["throughput_per_sec"] for x in runs),
                       statistics.median(x["latency_us"]["p50"] for x in runs),
                       statistics.median(x["latency_us"]["p99"] for x in runs),
                       sum(x["errors"] for x in runs),
                       statistics.median(x["cpu_us_per_request"]["redis"] for x in runs),
                       statistics.median(x["cpu_us_per_request"]["tollgate"] for x in runs))
    d = med["direct"]
    print(f"pipeline {p:>3}:")
    for target in targets[:-1]:
        t = med[target]
        print(f"  {target:<8} {t[0]:>9.0f}/s (p50 {t[1]:.0f} us, p99 {t[2]:.0f} us, errors {t[3]}, "
              f"cpu/request redis {t[4]:.1f} us + tollgate {t[5]:.1f} us)  ratio {t[0] / d[0]:.2f}x")
    print(f"  direct   {d[0]:>9.0f}/s (p50 {d[1]:.0f} us, p99 {d[2]:.0f} us, errors {d[3]}, "
          f"cpu/request redis {d[4]:.1f} us)")
EOF
