#!/usr/bin/env bash
# Instructions the server executes per HIT with the observability exporters
# off, with Prometheus only, and with Prometheus plus statsd: a figure that,
# unlike throughput, does not move with whatever else runs on the machine.
#
# The server runs under valgrind's cachegrind (which counts every instruction
# of every thread, exporter threads included); each mode is run with two
# request counts and the difference is divided by the difference of HITs, so
# start-up and shutdown cancel out. Contention between cores is not modelled
# (cachegrind serialises threads): see observability_overhead.sh for that.
#
# Usage: benches/observability_instructions.sh
# Needs: target/release/tollgate, valgrind, python3, and $LOADTEST (default
# /work/target-loadtest/release/tollgate-loadtest). Uses loopback ports 18321,
# 19102 and 18125.
set -euo pipefail

TOLLGATE=${TOLLGATE:-target/release/tollgate}
LOADTEST=${LOADTEST:-/work/target-loadtest/release/tollgate-loadtest}
OUT=${OUT:-$(mktemp -d)}
SMALL=${SMALL:-50000}
LARGE=${LARGE:-250000}

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

python3 -c 'import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 18125))
time.sleep(3600)' &
pids+=($!)

# Total instructions ("I refs") of a cachegrind output file.
instructions() {
    python3 -c 'import sys
for line in open(sys.argv[1]):
    if line.startswith("summary:"):
        print(line.split()[1])' "$1"
}

for mode in off prom on; do
    for requests in "$SMALL" "$LARGE"; do
        env_args=()
        if [ "$mode" != off ]; then
            env_args+=(HTTP_SERVICE_PORT=127.0.0.1:19102 PROMETHEUS_METRICS_PATH=/metrics)
        fi
        if [ "$mode" = on ]; then
            env_args+=(STATSD_HOST=127.0.0.1 STATSD_PORT=18125 STATSD_PREFIX=bench)
        fi
        env "${env_args[@]}" valgrind --tool=cachegrind --cache-sim=no \
            --cachegrind-out-file="$OUT/cg-$mode-$requests" \
            "$TOLLGATE" serve --listen 127.0.0.1:18321 --threads 2 \
            > "$OUT/server-$mode-$requests.log" 2>&1 &
        server=$!
        pids+=("$server")
        for _ in $(seq 100); do
            grep -q "listening on" "$OUT/server-$mode-$requests.log" && break
            sleep 0.2
        done
        if [ "$mode" != off ]; then
            curl -s -o /dev/null 127.0.0.1:19102/metrics
        fi
        "$LOADTEST" --target 127.0.0.1:18321 --connections 16 --pipeline 32 \
            --requests "$requests" --duration 600 --quiet --actor-prefix "$mode$requests" \
            --json "$OUT/$mode-$requests.json" > /dev/null
        kill -TERM "$server"
        wait "$server" 2>/dev/null || true
        echo "$mode $requests: $(instructions "$OUT/cg-$mode-$requests") instructions"
    done
done

python3 - "$OUT" "$SMALL" "$LARGE" <<'EOF'
import json, sys
out, small, large = sys.argv[1], sys.argv[2], sys.argv[3]
def total(mode, n):
    for line in open(f"{out}/cg-{mode}-{n}"):
        if line.startswith("summary:"):
            return int(line.split()[1])
def answered(mode, n):
    return json.load(open(f"{out}/{mode}-{n}.json"))["requests"]
per_hit = {}
for mode in ("off", "prom", "on"):
    hits = answered(mode, large) - answered(mode, small)
    per_hit[mode] = (total(mode, large) - total(mode, small)) / hits
    print(f"{mode:>4}: {per_hit[mode]:.0f} instructions per HIT (over {hits} HITs)")
for mode in ("prom", "on"):
    print(f"{mode}/off: {per_hit[mode] / per_hit['off']:.3f}")
EOF
