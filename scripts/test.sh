#!/usr/bin/env bash
# Every test: the Rust workspace's (unit, cross-process, namespace, launcher tests), then the
# Python package's (pytest, in the cached venv that scripts/python-env.sh keeps under
# $HOME/.cache). The README's test command; CI runs it after fmt and clippy (.ci/run).
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -p oxccl-verbs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "== cargo test --workspace =="
cargo test --workspace "$@"
# The tcp provider again with three connections per queue pair (OXCCL_TCP_NSOCKS): WRITEs of
# 256 KiB and more are then striped, and the suites check that nothing else changes.
echo "== tcp provider suites with striping (OXCCL_TCP_NSOCKS=3) =="
OXCCL_TCP_NSOCKS=3 cargo test -p oxccl-verbs --test conformance --test properties --test hammer tcp
echo "== Python tests (scripts/python-test.sh) =="
scripts/python-test.sh
