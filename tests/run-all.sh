#!/usr/bin/env bash
# The whole test suite, as the README gives it: installs the pinned Node
# clients the compatibility tests drive, then runs every test of the
# workspace (unit, integration over real sockets, Redis, cluster, loadtest).
# System packages (redis-server, node) are installed by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
npm ci --prefix tests/node --no-audit --no-fund --loglevel=error
cargo test --workspace --all-targets
