#!/usr/bin/env bash
# Every test: the Rust workspace's (unit, cross-process, namespace, launcher tests), then the
# Python package's (pytest, in the cached venv that scripts/python-env.sh keeps under
# $HOME/.cache). The README's test command; CI runs it after fmt and clippy (.ci/run).
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -p oxccl-verbs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "== cargo test --workspace =="
cargo test --workspace "$@"
echo "== Python tests (scripts/python-test.sh) =="
scripts/python-test.sh
