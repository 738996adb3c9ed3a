#!/usr/bin/env bash
# The Python tests: the venv (scripts/python-env.sh), the package built and installed into it
# (maturin develop --release: the extension crate crates/oxccl-py), then pytest on
# python/tests with a per-test timeout. Under CI=true nothing skips (a missing prerequisite
# fails). Extra arguments go to pytest (e.g. -k allreduce).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=$(scripts/python-env.sh)
export VIRTUAL_ENV="$venv"
export PATH="$venv/bin:$PATH"
start=$(date +%s)
echo "== building the oxccl Python package (maturin develop --release) =="
# The wheel's extension is built in the workspace's target/ (release profile), so later runs
# rebuild only what changed.
(cd python && "$venv/bin/maturin" develop --release --quiet) >/dev/null
echo "   built in $(($(date +%s) - start)) s"
# maturin develop links python/oxccl into the venv (python-source in python/pyproject.toml).
"$venv/bin/python" -c 'import oxccl, oxccl.torch; print("   oxccl", oxccl.__version__, "from", oxccl.__file__)'
echo "== pytest python/tests =="
exec "$venv/bin/python" -m pytest python/tests -q -p no:cacheprovider --timeout=300 "$@"
