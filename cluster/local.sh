#!/usr/bin/env bash
# Runs a three-node Tollgate cluster on loopback.
#
#   cluster/local.sh up | down | status | kill N | start N
#
# Ports come from BASE_PORT (default 8321): node N serves clients on
# BASE_PORT+N-1 and peers on BASE_PORT+1000+N-1. Logs, pids and the
# generated cluster file live in RUN_DIR (default /tmp/tollgate-cluster-
# $BASE_PORT), with the cluster secret, RUN_DIR/cluster.secret (mode 600,
# generated on first use and kept). `up` and `start` return once the cluster serves (every node
# up, every shard led), or fail after WAIT_SECONDS (default 30).
#
# Other settings: TOLLGATE (the binary; default target/release/tollgate,
# else target/debug/tollgate, else tollgate on PATH), RULES (a rule file;
# default: the embedded example rules), SHARDS (64), CONSISTENCY (strict or
# fast), EXTRA_ARGS (more `tollgate serve` flags).
set -euo pipefail

BASE_PORT=${BASE_PORT:-8321}
RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/tollgate-cluster-$BASE_PORT}
SHARDS=${SHARDS:-64}
CONSISTENCY=${CONSISTENCY:-strict}
WAIT_SECONDS=${WAIT_SECONDS:-30}
NODES=3
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [[ -z "${TOLLGATE:-}" ]]; then
  if [[ -x "$ROOT/target/release/tollgate" ]]; then TOLLGATE="$ROOT/target/release/tollgate"
  elif [[ -x "$ROOT/target/debug/tollgate" ]]; then TOLLGATE="$ROOT/target/debug/tollgate"
  else TOLLGATE=tollgate; fi
fi

client_port() { echo $((BASE_PORT + $1 - 1)); }
peer_port() { echo $((BASE_PORT + 1000 + $1 - 1)); }
pid_of() { cat "$RUN_DIR/node$1.pid" 2>/dev/null || true; }
alive() { local pid; pid=$(pid_of "$1"); [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; }

write_cluster_file() {
  mkdir -p "$RUN_DIR"
  {
    echo "[cluster]"
    echo "shards = $SHARDS"
    echo "replicas = 3"
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

start_node() {
  local n=$1
  if alive "$n"; then echo "node $n already runs (pid $(pid_of "$n"))"; return; fi
  ensure_secret
  # shellcheck disable=SC2086
  nohup "$TOLLGATE" serve --cluster "$RUN_DIR/cluster.ini" --node-id "$n" \
    --cluster-secret-file "$RUN_DIR/cluster.secret" \
    --consistency "$CONSISTENCY" ${EXTRA_ARGS:-} ${RULES:+"$RULES"} \
    >> "$RUN_DIR/node$n.log" 2>&1 &
  echo $! > "$RUN_DIR/node$n.pid"
  echo "node $n: pid $!, clients 127.0.0.1:$(client_port "$n"), log $RUN_DIR/node$n.log"
}

first_live_client() {
  for n in $(seq 1 $NODES); do
    if alive "$n"; then echo "127.0.0.1:$(client_port "$n")"; return; fi
  done
  return 1
}

# Waits until every running node serves and every shard has a leader.
wait_serving() {
  local deadline=$((SECONDS + WAIT_SECONDS))
  while (( SECONDS < deadline )); do
    local ok=1
    for n in $(seq 1 $NODES); do
      if alive "$n" && ! "$TOLLGATE" cluster status --node "127.0.0.1:$(client_port "$n")" \
          --timeout-ms 1000 > "$RUN_DIR/status.txt" 2>&1; then ok=0; fi
    done
    for n in $(seq 1 $NODES); do
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

stop_node() {
  local n=$1 signal=${2:-TERM}
  local pid; pid=$(pid_of "$n")
  if [[ -z "$pid" ]] || ! kill -0 "$pid" 2>/dev/null; then echo "node $n is not running"; return; fi
  kill "-$signal" "$pid"
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
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
    for n in $(seq 1 $NODES); do stop_node "$n" TERM; done
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
  *)
    echo "usage: $0 up | down | status | kill N | start N" >&2
    exit 2
    ;;
esac
