# Shared setup of the loadtest/ comparison scripts, sourced after they set
# ROOT and TARGET_DIR: the release binaries (built unless SKIP_BUILD=1, or
# given as TOLLGATE_BIN / LOADTEST_BIN) and the processes started here,
# stopped on exit (add each one's pid to PIDS), and free_port.

# find_binaries SCRIPT_NAME: sets TOLLGATE and LOADTEST, building them first
# unless SKIP_BUILD is set or both are given; exits naming SCRIPT_NAME when
# one is missing.
find_binaries() {
    if [[ -z ${SKIP_BUILD:-} && (-z ${TOLLGATE_BIN:-} || -z ${LOADTEST_BIN:-}) ]]; then
        echo "== building release binaries"
        (cd "$ROOT" && cargo build --release -p tollgate -p tollgate-loadtest)
    fi
    TOLLGATE=${TOLLGATE_BIN:-$TARGET_DIR/release/tollgate}
    LOADTEST=${LOADTEST_BIN:-$TARGET_DIR/release/tollgate-loadtest}
    local b
    for b in "$TOLLGATE" "$LOADTEST"; do
        [[ -x $b ]] || { echo "$1: $b is missing (build it, or set TOLLGATE_BIN/LOADTEST_BIN)" >&2; exit 1; }
    done
}

PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    for p in "${PIDS[@]}"; do
        wait "$p" 2>/dev/null || true
    done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A free loopback port (the kernel's pick, released before it is used).
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
