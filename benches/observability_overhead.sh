#!/usr/bin/env bash
# HIT throughput with the observability exporters on and off, alternating in
# one run so that load from elsewhere on the machine hits both alike.
#
#   off:  no HTTP endpoint, no statsd (the hot-path atomics are always there)
#   prom: HTTP endpoint, scraped every second
#   on:   prom, plus statsd over UDP to a local socket that never reads (sends
#         succeed and the kernel drops them, so the sink costs no CPU here):
#         the full export path, including one timing-queue push per HIT
#
# Two figures per run: throughput (what the load generator saw; sensitive to
# whatever else runs on the machine) and the server's CPU time per HIT
# (user + system time of the whole server process, exporter threads included,
# divided by the HITs answered; much less sensitive to other load).
#
# Usage: [DURATION=seconds] benches/observability_overhead.sh [ROUNDS] [SERVER_THREADS]
# Needs: target/release/tollgate (cargo build --release --bin tollgate),
#        $LOADTEST (default /work/target-loadtest/release/tollgate-loadtest),
#        python3 and curl. Uses loopback ports 18321, 19102 and 18125.
set -euo pipefail

ROUNDS=${1:-3}
SERVER_THREADS=${2:-2}
TOLLGATE=${TOLLGATE:-target/release/tollgate}
LOADTEST=${LOADTEST:-/work/target-loadtest/release/tollgate-loadtest}
OUT=${OUT:-$(mktemp -d)}
DURATION=${DURATION:-10}
LOAD_ARGS=(--target 127.0.0.1:18321 --connections 64 --pipeline 32 --duration "$DURATION" --quiet)

# utime + stime of a process, in clock ticks.
cpu_ticks() {
    awk '{ print $14 + $15 }' "/proc/$1/stat"
}

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

for round in $(seq 1 "$ROUNDS"); do
    for mode in off prom on; do
        env_args=()
        if [ "$mode" != off ]; then
            env_args+=(HTTP_SERVICE_PORT=127.0.0.1:19102 PROMETHEUS_METRICS_PATH=/metrics)
        fi
        if [ "$mode" = on ]; then
            env_args+=(STATSD_HOST=127.0.0.1 STATSD_PORT=18125 STATSD_PREFIX=bench)
        fi
        env "${env_args[@]}" "$TOLLGATE" serve --listen 127.0.0.1:18321 --threads "$SERVER_THREADS" \
            > "$OUT/server-$mode-$round.log" 2>&1 &
        server=$!
        pids+=("$server")
        sleep 1
        scraper=""
        if [ "$mode" != off ]; then
            (while sleep 1; do curl -s -o /dev/null 127.0.0.1:19102/metrics || true; done) &
            scraper=$!
            pids+=("$scraper")
        fi
        cpu_before=$(cpu_ticks "$server")
        "$LOADTEST" "${LOAD_ARGS[@]}" --actor-prefix "r${round}${mode}" \
            --json "$OUT/$mode-$round.json" > /dev/null
        cpu_after=$(cpu_ticks "$server")
        echo $((cpu_after - cpu_before)) > "$OUT/$mode-$round.cpu"
        [ -n "$scraper" ] && kill "$scraper"
        kill "$server"
        wait "$server" 2>/dev/null || true
        python3 - "$OUT" "$mode" "$round" "$(getconf CLK_TCK)" <<'EOF'
import json, sys
out, mode, rnd, hz = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
report = json.load(open(f"{out}/{mode}-{rnd}.json"))
cpu_s = int(open(f"{out}/{mode}-{rnd}.cpu").read()) / hz
print(f"{mode:>4} round {rnd}: {report['throughput_per_sec']:.0f} HIT/s, "
      f"{cpu_s * 1e6 / report['requests']:.3f} us CPU/HIT, errors {report['errors']}")
EOF
    done
done

python3 - "$OUT" "$ROUNDS" "$(getconf CLK_TCK)" <<'EOF'
import json, statistics, sys
out, rounds, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(mode, rnd):
    report = json.load(open(f"{out}/{mode}-{rnd}.json"))
    cpu_s = int(open(f"{out}/{mode}-{rnd}.cpu").read()) / hz
    return report["throughput_per_sec"], cpu_s * 1e6 / report["requests"]
modes = ("off", "prom", "on")
runs = {m: [load(m, r) for r in range(1, rounds + 1)] for m in modes}
for m in modes:
    rates, cpus = zip(*runs[m])
    print(f"{m:>4}: median {statistics.median(rates):.0f} HIT/s, {statistics.median(cpus):.3f} us CPU/HIT"
          f"  (runs {[round(x) for x in rates]}, {[round(x, 3) for x in cpus]})")
for m in ("prom", "on"):
    rate_ratios = [a[0] / off[0] for a, off in zip(runs[m], runs["off"])]
    cpu_ratios = [a[1] / off[1] for a, off in zip(runs[m], runs["off"])]
    print(f"{m}/off throughput: median of per-round ratios {statistics.median(rate_ratios):.3f} "
          f"{[round(x, 3) for x in rate_ratios]}")
    print(f"{m}/off CPU per HIT: median of per-round ratios {statistics.median(cpu_ratios):.3f} "
          f"{[round(x, 3) for x in cpu_ratios]}")
EOF
