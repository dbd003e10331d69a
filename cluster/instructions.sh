#!/usr/bin/env bash
# A/B of builds by the instructions their servers execute per hit, counted by
# valgrind's cachegrind: a figure that does not move with the machine's
# state, for cuts smaller than the spread of CPU time between runs
# (docs/benchmarks.md, "Cluster data path": cluster/ab.sh's medians move by
# a few per cent from run to run; this moves by under one). Instructions
# are not time (a cut can save instructions and stall more), so a cut is
# kept on cluster/ab.sh's word; this says whether it removed work at all.
#
#   cluster/instructions.sh before=/tmp/before after=target/release/tollgate
#
# Each server runs under cachegrind (every instruction of every thread);
# the generators send SMALL then LARGE hits in all (closed loop, pipeline
# PIPELINE), each run from a fresh start, and the difference of the two
# totals over the difference of hits is the figure: start-up, elections and
# shutdown cancel out. Setups (MODES, default "single fast"): single (one
# node, one generator of 12 connections), strict, fast, aware (three nodes
# in memory, leaders balanced, one generator of 4 connections on each;
# aware sends each hit to its shard's leader). The cluster's timeouts are
# raised (EXTRA_ARGS below) so that a node slowed by valgrind is not taken
# for dead. Under valgrind the servers are slow and read fewer lines per
# read than under the bench's load, so a read batch's own costs weigh more
# per hit here than there.
# Settings: ROUNDS (1), SMALL (30000), LARGE (230000), PIPELINE (16),
# ACTORS (100000), SHARDS (64), BASE_PORT (35321), LOADTEST, OUT_DIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
(( $# > 0 )) || { sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
LOADTEST=${LOADTEST:-$ROOT/target/release/tollgate-loadtest}
MODES=${MODES:-single fast}
ROUNDS=${ROUNDS:-1}
SMALL=${SMALL:-30000}
LARGE=${LARGE:-230000}
PIPELINE=${PIPELINE:-16}
ACTORS=${ACTORS:-100000}
BASE_PORT=${BASE_PORT:-35321}
SHARDS=${SHARDS:-64}
OUT_DIR=${OUT_DIR:-${TMPDIR:-/tmp}/tollgate-instructions-$$}
command -v valgrind > /dev/null || { echo "instructions.sh: needs valgrind (apt-get install -y valgrind)" >&2; exit 2; }
(( LARGE > SMALL )) || { echo "instructions.sh: LARGE ($LARGE) must be more than SMALL ($SMALL)" >&2; exit 2; }
# shellcheck source=cluster/bench-lib.sh
source "$ROOT/cluster/bench-lib.sh"
check_builds "$@"
[[ -x $LOADTEST ]] || { echo "instructions.sh: $LOADTEST is missing (cargo build --release --workspace)" >&2; exit 1; }
mkdir -p "$OUT_DIR"
export BASE_PORT SHARDS DATA_DIRS=none RUN_DIR="$OUT_DIR/run"
export RULES="$OUT_DIR/bench.ini"
write_bench_rules "$RULES"
RESULTS="$OUT_DIR/results.tsv"
: > "$RESULTS"

single_pid=""
cleanup() {
  [[ -n $single_pid ]] && kill "$single_pid" 2> /dev/null
  [[ -d $RUN_DIR ]] && TOLLGATE="$OUT_DIR/serve.sh" "$ROOT/cluster/local.sh" down > /dev/null 2>&1
  return 0
}
trap cleanup EXIT

# serve.sh: the binary under test, with `serve` under cachegrind (each
# process writes its own count, named by its pid); other commands (`cluster
# status`) run as they are.
serve_under_valgrind() { # serve_under_valgrind BINARY PREFIX
  cat > "$OUT_DIR/serve.sh" <<WRAP
#!/usr/bin/env bash
if [[ \$1 == serve ]]; then
  exec valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file="$2.%p" "$1" "\$@"
fi
exec "$1" "\$@"
WRAP
  chmod +x "$OUT_DIR/serve.sh"
}

generate() { # generate TARGET CONNECTIONS HITS JSON [FLAGS...]
  local target=$1 connections=$2 hits=$3 json=$4; shift 4
  "$LOADTEST" --target "$target" --protocol divvy --connections "$connections" \
    --pipeline "$PIPELINE" --requests "$hits" --duration 600 --actors "$ACTORS" --actor-prefix a \
    --template 'path=/bench user={actor}' --quiet --json "$json" "$@" > /dev/null
}

count() { # count LABEL BINARY MODE HITS: total instructions of the servers
  local label=$1 binary=$2 mode=$3 hits=$4 prefix
  prefix="$OUT_DIR/cg-$label-$mode-$hits"
  rm -f "$prefix".*
  serve_under_valgrind "$binary" "$prefix"
  case $mode in
    single)
      "$OUT_DIR/serve.sh" serve --listen "127.0.0.1:$BASE_PORT" "$RULES" > "$OUT_DIR/single.log" 2>&1 &
      single_pid=$!
      for _ in $(seq 150); do grep -q "listening" "$OUT_DIR/single.log" && break; sleep 0.2; done
      generate "127.0.0.1:$BASE_PORT" 12 "$hits" "$OUT_DIR/gen.json"
      kill -TERM "$single_pid"; wait "$single_pid" 2> /dev/null || true
      single_pid="" ;;
    strict|fast|aware)
      local consistency=$mode flags=() generators=() n
      [[ $mode == aware ]] && { consistency=fast; flags=(--leader-aware --rules "$RULES"); }
      TOLLGATE="$OUT_DIR/serve.sh" CONSISTENCY=$consistency WAIT_SECONDS=180 \
        EXTRA_ARGS="--raft-election-timeout-ms 10000 --forward-timeout-ms 60000 --commit-timeout-ms 60000" \
        "$ROOT/cluster/local.sh" up > "$OUT_DIR/up.txt" 2>&1 || { cat "$OUT_DIR/up.txt" >&2; exit 1; }
      wait_balanced "$binary" 3
      for n in 0 1 2; do
        generate "127.0.0.1:$((BASE_PORT + n))" 4 "$((hits / 3))" "$OUT_DIR/gen$n.json" "${flags[@]}" &
        generators+=($!)
      done
      wait "${generators[@]}"
      TOLLGATE="$OUT_DIR/serve.sh" "$ROOT/cluster/local.sh" down > /dev/null 2>&1 || true
      rm -rf "$RUN_DIR" ;;
    *) echo "instructions.sh: unknown mode $mode" >&2; exit 2 ;;
  esac
  # The servers write their counts as they exit.
  for _ in $(seq 100); do
    [[ $(cat "$prefix".* 2> /dev/null | grep -c '^summary:') -ge $([[ $mode == single ]] && echo 1 || echo 3) ]] && break
    sleep 0.2
  done
  cat "$prefix".* | awk '/^summary:/ {total += $2} END {printf "%d\n", total}'
}

labels=("$@")
for round in $(seq 1 "$ROUNDS"); do
  round_order "$round" "${labels[@]}"
  echo "round $round of $ROUNDS (label, setup, instructions per hit)" >&2
  for mode in $MODES; do
    for spec in "${order[@]}"; do
      label=${spec%%=*}; binary=${spec#*=}
      small=$(count "$label" "$binary" "$mode" "$SMALL")
      large=$(count "$label" "$binary" "$mode" "$LARGE")
      per_hit=$(( (large - small) / (LARGE - SMALL) ))
      printf '%s\t%s\t%s\n' "$label" "$mode" "$per_hit" | tee -a "$RESULTS"
    done
  done
done

python3 - "$RESULTS" "$MODES" "${labels[@]}" <<'PY'
import statistics, sys
results, modes, labels = sys.argv[1], sys.argv[2].split(), [s.split("=", 1)[0] for s in sys.argv[3:]]
rows = [line.rstrip("\n").split("\t") for line in open(results) if line.strip()]
print(f"\nMedian instructions per hit of the servers; in brackets, ÷ the same build's one node\n")
print("| build | " + " | ".join(modes) + " |")
print("|---|" + "---:|" * len(modes))
for label in labels:
    medians = {m: round(statistics.median(int(r[2]) for r in rows if r[0] == label and r[1] == m)) for m in modes}
    cells = []
    for m in modes:
        cell = f"{medians[m]:,}".replace(",", " ")
        if m != "single" and "single" in medians:
            cell += f" ({medians[m] / medians['single']:.2f}×)"
        cells.append(cell)
    print(f"| {label} | " + " | ".join(cells) + " |")
print(f"runs in {results}")
PY
