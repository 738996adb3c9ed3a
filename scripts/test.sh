#!/usr/bin/env bash
# Every test: the Rust workspace's (unit, cross-process, namespace, launcher tests), then the
# Python package's (pytest, in the cached venv that scripts/python-env.sh keeps under
# $HOME/.cache). The README's test command; CI runs it after fmt and clippy (.ci/run).
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -p oxccl-verbs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# A hung test must fail the run with its name, not eat CI's whole budget: the tests run under
# a bound (builds first, unbounded), and cargo's harness names a test running past 60 s.
bounded() {
    local secs=$1
    shift
    local rc=0
    timeout -k 30 "$secs" "$@" || rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "scripts/test.sh: '$*' did not finish within ${secs} s (a hung test: see the" \
            "\"has been running for over 60 seconds\" lines above)" >&2
    fi
    return "$rc"
}
echo "== cargo test --workspace =="
cargo test --workspace --no-run "$@"
bounded 1500 cargo test --workspace "$@"
# The tcp provider again with three connections per queue pair (OXCCL_TCP_NSOCKS): WRITEs of
# 256 KiB and more are then striped, and the suites check that nothing else changes.
echo "== tcp provider suites with striping (OXCCL_TCP_NSOCKS=3) =="
OXCCL_TCP_NSOCKS=3 bounded 600 cargo test -p oxccl-verbs --test conformance --test properties --test hammer tcp
echo "== Python tests (scripts/python-test.sh) =="
scripts/python-test.sh
