#!/usr/bin/env bash
# Runs a three-node Tollgate cluster on loopback.
#
#   cluster/local.sh up | down | status | kill N | start N | join N | remove N
#
# `join N` starts node N (4, 5, …) with `serve --join` and adds it with
# `tollgate cluster add-node`; `remove N` removes node N from the cluster
# with `tollgate cluster remove-node` (it keeps running until `kill N`).
# Both return once every shard sits on its new replicas.
#
# Ports come from BASE_PORT (default 8321): node N serves clients on
# BASE_PORT+N-1 and peers on BASE_PORT+1000+N-1. Logs, pids and the
# generated cluster file live in RUN_DIR (default /tmp/tollgate-cluster-
# $BASE_PORT), with the cluster secret, RUN_DIR/cluster.secret (mode 600,
# generated on first use and kept), and each node's data dir,
# RUN_DIR/data-nodeN (its Raft state, member list and counters): `down`
# then `up`, or `kill N` then `start N`, resume with the counters; remove
# RUN_DIR to start a new cluster. `up` and `start` return once the cluster serves (every node
# up, every shard led), or fail after WAIT_SECONDS (default 30).
#
# Other settings: TOLLGATE (the binary; default target/release/tollgate,
# else target/debug/tollgate, else tollgate on PATH), RULES (a rule file;
# default: the embedded example rules), SHARDS (64), CONSISTENCY (strict or
# fast), EXTRA_ARGS (more `tollgate serve` flags, e.g. `--fsync batch`),
# DATA_DIRS (`none`: no data dirs, counters in memory only), PLACEMENT
# (`spread`, the default, or `ring`: the cluster file's `placement`).
set -euo pipefail

BASE_PORT=${BASE_PORT:-8321}
RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/tollgate-cluster-$BASE_PORT}
SHARDS=${SHARDS:-64}
CONSISTENCY=${CONSISTENCY:-strict}
WAIT_SECONDS=${WAIT_SECONDS:-30}
NODES=3
# Nodes this run dir knows: the first three, plus any joined since.
node_ids() {
  { seq 1 $NODES; ls "$RUN_DIR" 2>/dev/null | sed -n 's/^node\([0-9][0-9]*\)\.pid$/\1/p'; } | sort -nu
}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [[ -z "${TOLLGATE:-}" ]]; then
  if [[ -x "$ROOT/target/release/tollgate" ]]; then TOLLGATE="$ROOT/target/release/tollgate"
  elif [[ -x "$ROOT/target/debug/tollgate" ]]; then TOLLGATE="$ROOT/target/debug/tollgate"
  else TOLLGATE=tollgate; fi
fi

client_port() { echo $((BASE_PORT + $1 - 1)); }
peer_port() { echo $((BASE_PORT + 1000 + $1 - 1)); }
pid_of() { cat "$RUN_DIR/node$1.pid" 2>/dev/null || true; }
# A process that exited but was not reaped yet (a zombie: its parent, this
# script's earlier run, is gone) still answers `kill -0`; it is not running.
running() { kill -0 "$1" 2>/dev/null && [[ "$(ps -o stat= -p "$1" 2>/dev/null)" != Z* ]]; }
alive() { local pid; pid=$(pid_of "$1"); [[ -n "$pid" ]] && running "$pid"; }

write_cluster_file() {
  mkdir -p "$RUN_DIR"
  {
    echo "[cluster]"
    echo "shards = $SHARDS"
    echo "replicas = 3"
    if [[ -n "${PLACEMENT:-}" ]]; then echo "placement = $PLACEMENT"; fi
    for n in $(seq 1 $NODES); do
      echo
      echo "[node $n]"
      echo "client = 127.0.0.1:$(client_port "$n")"
      echo "peer = 127.0.0.1:$(peer_port "$n")"
    done
  } > "$RUN_DIR/cluster.ini"
}

# The shared secret peers must prove they hold (see docs/cluster.md).
ensure_secret() {
  mkdir -p "$RUN_DIR"
  if [[ ! -s "$RUN_DIR/cluster.secret" ]]; then
    (umask 077; head -c 32 /dev/urandom | base64 > "$RUN_DIR/cluster.secret")
  fi
  chmod 600 "$RUN_DIR/cluster.secret"
}

# DATA_DIRS=none runs the nodes in memory only (`--data-dir none`).
data_dir() { if [[ ${DATA_DIRS:-} == none ]]; then echo none; else echo "$RUN_DIR/data-node$1"; fi; }

start_node() {
  local n=$1 file=$RUN_DIR/cluster.ini
  if alive "$n"; then echo "node $n already runs (pid $(pid_of "$n"))"; return; fi
  ensure_secret
  [[ -f "$RUN_DIR/cluster-$n.ini" ]] && file=$RUN_DIR/cluster-$n.ini
  # shellcheck disable=SC2086
  nohup "$TOLLGATE" serve --cluster "$file" --node-id "$n" ${JOIN_FLAG:-} \
    --cluster-secret-file "$RUN_DIR/cluster.secret" --data-dir "$(data_dir "$n")" \
    --consistency "$CONSISTENCY" ${EXTRA_ARGS:-} ${RULES:+"$RULES"} \
    >> "$RUN_DIR/node$n.log" 2>&1 &
  echo $! > "$RUN_DIR/node$n.pid"
  echo "node $n: pid $!, clients 127.0.0.1:$(client_port "$n"), log $RUN_DIR/node$n.log"
}

first_live_client() {
  for n in $(node_ids); do
    if alive "$n"; then echo "127.0.0.1:$(client_port "$n")"; return; fi
  done
  return 1
}

# Waits until every running node serves and every shard has a leader.
wait_serving() {
  local deadline=$((SECONDS + WAIT_SECONDS))
  while (( SECONDS < deadline )); do
    local ok=1
    for n in $(node_ids); do
      if alive "$n" && ! "$TOLLGATE" cluster status --node "127.0.0.1:$(client_port "$n")" \
          --timeout-ms 1000 > "$RUN_DIR/status.txt" 2>&1; then ok=0; fi
    done
    for n in $(node_ids); do
      if alive "$n" && grep -Eq "^$n +DOWN" "$RUN_DIR/status.txt"; then ok=0; fi
    done
    if (( ok )) && grep -q "answered by" "$RUN_DIR/status.txt" \
        && ! awk '/^SHARD/{s=1;next} s && $2=="NONE"{bad=1} END{exit !bad}' "$RUN_DIR/status.txt" \
        && ! grep -q recovering "$RUN_DIR/status.txt"; then
      echo "cluster serves (run dir $RUN_DIR)"
      return 0
    fi
    sleep 0.2
  done
  echo "cluster did not serve within ${WAIT_SECONDS}s; logs in $RUN_DIR" >&2
  return 1
}

# The peer address of a running node other than $1.
first_live_peer() {
  local n
  for n in $(node_ids); do
    if [[ "$n" != "$1" ]] && alive "$n"; then echo "127.0.0.1:$(peer_port "$n")"; return; fi
  done
  return 1
}

first_live_other() {
  local n
  for n in $(node_ids); do
    if [[ "$n" != "$1" ]] && alive "$n"; then echo "$n"; return; fi
  done
  return 1
}

# Waits until node $1 sees every shard on its target replicas.
wait_settled() {
  local deadline=$((SECONDS + WAIT_SECONDS * 4))
  while (( SECONDS < deadline )); do
    if "$TOLLGATE" cluster status --check --settled --node "127.0.0.1:$(client_port "$1")" \
        --timeout-ms 1000 > "$RUN_DIR/status.txt" 2>&1; then
      echo "every shard is on its replicas (run dir $RUN_DIR)"
      return 0
    fi
    sleep 0.5
  done
  cat "$RUN_DIR/status.txt" >&2
  echo "shards did not settle within $((WAIT_SECONDS * 4))s; logs in $RUN_DIR" >&2
  return 1
}

stop_node() {
  local n=$1 signal=${2:-TERM}
  local pid; pid=$(pid_of "$n")
  if [[ -z "$pid" ]] || ! running "$pid"; then echo "node $n is not running"; return; fi
  kill "-$signal" "$pid"
  for _ in $(seq 1 100); do running "$pid" || break; sleep 0.1; done
  rm -f "$RUN_DIR/node$n.pid"
  echo "node $n stopped (SIG$signal)"
}

case "${1:-}" in
  up)
    write_cluster_file
    for n in $(seq 1 $NODES); do start_node "$n"; done
    wait_serving
    ;;
  down)
    for n in $(node_ids); do stop_node "$n" TERM; done
    ;;
  status)
    client=$(first_live_client) || { echo "no node is running"; exit 1; }
    "$TOLLGATE" cluster status --node "$client"
    ;;
  kill)
    [[ -n "${2:-}" ]] || { echo "usage: $0 kill N" >&2; exit 2; }
    stop_node "$2" KILL
    ;;
  start)
    [[ -n "${2:-}" ]] || { echo "usage: $0 start N" >&2; exit 2; }
    [[ -f "$RUN_DIR/cluster.ini" ]] || write_cluster_file
    start_node "$2"
    wait_serving
    ;;
  join)
    [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "usage: $0 join N" >&2; exit 2; }
    n=$2
    { cat "$RUN_DIR/cluster.ini"; printf '\n[node %s]\nclient = 127.0.0.1:%s\npeer = 127.0.0.1:%s\n' \
        "$n" "$(client_port "$n")" "$(peer_port "$n")"; } > "$RUN_DIR/cluster-$n.ini"
    JOIN_FLAG=--join start_node "$n"
    for _ in $(seq 1 $((WAIT_SECONDS * 5))); do
      "$TOLLGATE" cluster status --node "127.0.0.1:$(client_port "$n")" --timeout-ms 500 \
        > /dev/null 2>&1 && break
      sleep 0.2
    done
    via=$(first_live_peer "$n") || { echo "no member is running" >&2; exit 1; }
    "$TOLLGATE" cluster add-node "$n" --client "127.0.0.1:$(client_port "$n")" \
      --peer "127.0.0.1:$(peer_port "$n")" --node "$via" \
      --cluster-secret-file "$RUN_DIR/cluster.secret"
    wait_settled "$n"
    ;;
  remove)
    [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "usage: $0 remove N" >&2; exit 2; }
    via=$(first_live_peer "$2") || { echo "no other node is running" >&2; exit 1; }
    "$TOLLGATE" cluster remove-node "$2" --node "$via" \
      --cluster-secret-file "$RUN_DIR/cluster.secret"
    wait_settled "$(first_live_other "$2")"
    ;;
  *)
    echo "usage: $0 up | down | status | kill N | start N | join N | remove N" >&2
    exit 2
    ;;
esac
