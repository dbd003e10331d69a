#!/usr/bin/env bash
# The whole test suite, as the README gives it: formatting and lints, the
# build at the declared rust-version (when that toolchain is installed), the
# pinned Node clients the compatibility tests drive, then every test of the
# workspace (unit, integration over real sockets, Redis, cluster, loadtest,
# and tests/workspace: module layering, dependencies' rust-version).
# System packages (redis-server, node) and the rust-version toolchain are
# installed by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all --check
(cd fuzz && cargo fmt --all --check)
# Clippy also refuses standard-library items newer than rust-version
# (incompatible_msrv) in our code.
cargo clippy --workspace --all-targets --locked -- -D warnings

# The declared rust-version, built for real when its toolchain is installed
# (.ci/run installs it with rustup when it can). Without it, tests/workspace
# and clippy check what they can, and this says so.
msrv=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
if cargo "+$msrv" --version >/dev/null 2>&1; then
  echo "building with Rust $msrv (the declared rust-version)"
  CARGO_TARGET_DIR=target/msrv cargo "+$msrv" check --workspace --all-targets --locked
else
  echo "note: no Rust $msrv toolchain here; the rust-version is checked by clippy (incompatible_msrv) and tests/workspace only" >&2
fi

npm ci --prefix tests/node --no-audit --no-fund --loglevel=error
# Every locked package, for every platform: tests/workspace reads the whole
# lockfile's metadata offline, and a fresh machine has downloaded only what
# its own builds needed (a no-op once they are all in cargo's cache).
cargo fetch --locked
cargo test --workspace --all-targets --locked

# The soak in its short form, on the binaries the tests just built: a thousand
# connections and up to a million actors for 15 s; no errors, steady
# throughput, bounded memory (loadtest/soak.sh states the checks; its long
# form is for operators, see docs/operations.md).
SKIP_BUILD=1 TOLLGATE_BIN=target/debug/tollgate LOADTEST_BIN=target/debug/tollgate-loadtest \
  SOAK_SECONDS="${SOAK_SECONDS:-15}" SOAK_CONNECTIONS="${SOAK_CONNECTIONS:-1000}" loadtest/soak.sh

# Coverage-guided fuzzing, briefly, when cargo-fuzz is installed (.ci/run
# installs it). Each target starts from a scratch copy of its seed corpus.
if cargo fuzz --version >/dev/null 2>&1; then
  fuzz_seconds="${FUZZ_SECONDS:-10}"
  for target in $(cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz list); do
    scratch="$(mktemp -d)"
    cp -r "fuzz/corpus/$target/." "$scratch/"
    echo "fuzzing $target for ${fuzz_seconds}s"
    (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" "$scratch" -- \
      -max_total_time="$fuzz_seconds" -rss_limit_mb=2048 -print_final_stats=0 2>&1 | tail -n 3)
    rm -rf "$scratch"
  done
elif [ -n "${CI:-}" ]; then
  echo "cargo-fuzz is not installed; .ci/run installs it" >&2
  exit 1
fi
