# What cluster/bench.sh, cluster/ab.sh and cluster/instructions.sh share,
# sourced by each: the bench rule file, the CPU time of processes from
# /proc, the wait for leader balancing before a measurement, and the A/B
# scripts' LABEL=BINARY arguments and round order. Expects SHARDS and
# BASE_PORT to be set.

# write_bench_rules PATH [LIMIT]: the rule every bench hit matches (by
# default a huge limit, so every hit is admitted and replicated; a small
# LIMIT makes nearly every hit a denial), and a default that denies.
write_bench_rules() {
  cat > "$1" <<INI
[path=/bench]
creditLimit = ${2:-1000000000}
resetSeconds = 3600
actorField = user

[default]
creditLimit = 0
resetSeconds = 60
INI
}

# cpu_ticks PIDS...: CPU ticks (user, system) the given processes used so far.
cpu_ticks() {
  local user=0 system=0 pid u s
  for pid in "$@"; do
    read -r u s < <(awk '{print $14, $15}' "/proc/$pid/stat")
    user=$((user + u)); system=$((system + s))
  done
  echo "$user $system"
}

# wait_balanced BINARY NODES: waits (up to 60 s) until NODES nodes are up and
# none leads more than its share (SHARDS / NODES, rounded up: what the leader
# balancer aims for), so that balancing (a handover collects and syncs the
# shard's counters) is over before measuring: the figures are the steady
# state's. If that does not happen, says so and measures anyway.
wait_balanced() {
  local binary=$1 nodes=$2 deadline=$((SECONDS + 60)) leads
  local fair=$(( (SHARDS + nodes - 1) / nodes ))
  while (( SECONDS < deadline )); do
    leads=$("$binary" cluster status --node "127.0.0.1:$BASE_PORT" 2>/dev/null \
      | awk '/^[0-9]+ +up / {print $NF}' | sort -n)
    if [[ $(wc -l <<< "$leads") -eq $nodes ]] && (( $(tail -1 <<< "$leads") <= fair )); then
      return 0
    fi
    sleep 0.5
  done
  echo "$(basename "$0"): leaders not balanced over $nodes nodes after 60 s (leads: $(echo $leads)); measuring anyway" >&2
}

# wait_first_replicas_lead BINARY: waits (up to 120 s) until every shard of
# a ring-placed cluster is led by its first replica (`preferred_leader` in
# `cluster status --json`), as leader balancing brings about after a join
# (docs/cluster.md, "Placement: spread or ring").
wait_first_replicas_lead() {
  local binary=$1 deadline=$((SECONDS + 120)) off=""
  while (( SECONDS < deadline )); do
    off=$("$binary" cluster status --json --node "127.0.0.1:$BASE_PORT" 2>/dev/null | python3 -c '
import json, sys
topology = json.load(sys.stdin)
print(sum(1 for s in topology["placement"] if s.get("preferred_leader") not in (None, s["leader"])))' 2>/dev/null || true)
    [[ $off == 0 ]] && return 0
    sleep 0.5
  done
  echo "$(basename "$0"): ${off:-?} shards not led by their first replica after 120 s; measuring anyway" >&2
}

# check_builds LABEL=BINARY...: stops the script unless every argument
# names a label and an executable build.
check_builds() {
  local spec script
  script=$(basename "$0")
  for spec in "$@"; do
    [[ $spec == *=* ]] || { echo "$script: expected LABEL=BINARY, got $spec" >&2; exit 2; }
    [[ -x ${spec#*=} ]] || { echo "$script: ${spec#*=} is not an executable" >&2; exit 2; }
  done
}

# round_order ROUND LABEL=BINARY...: sets `order` to the builds in the
# order round ROUND runs them: every other round reversed, so that no build
# always runs first.
round_order() {
  local round=$1 i; shift
  order=("$@")
  if (( round % 2 == 0 )); then
    order=(); for (( i = $# ; i >= 1; i-- )); do order+=("${!i}"); done
  fi
}
