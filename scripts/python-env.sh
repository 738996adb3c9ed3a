#!/usr/bin/env bash
# Creates, or reuses, the Python virtual environment of the Python tests, the DDP example and
# the torch benchmarks, and prints its path (the only thing on stdout).
#
# The venv lives outside the checkout, in ${OXCCL_VENV:-$HOME/.cache/oxccl/venv}, and carries a
# stamp: a hash of python/requirements-dev.txt and of the interpreter. A warm venv with a
# matching stamp is reused at once; a stale one is updated in place (pip install -r); a broken
# one is rebuilt. PyPI's torch is the CUDA build: triton (about 1 GB) is uninstalled after, as
# CPU tensors do not need it. Set OXCCL_PYTHON to choose the interpreter (default python3).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
req="$root/python/requirements-dev.txt"
venv="${OXCCL_VENV:-$HOME/.cache/oxccl/venv}"
python="${OXCCL_PYTHON:-python3}"

die() { echo "python-env.sh: $*" >&2; exit 1; }
command -v "$python" >/dev/null || die "no Python interpreter '$python' (set OXCCL_PYTHON)"
"$python" -c 'import sys; assert sys.version_info >= (3, 9), sys.version' \
    || die "$python is older than 3.9"
"$python" -c 'import venv, ensurepip' 2>/dev/null \
    || die "$python lacks the venv/ensurepip modules (Debian: apt-get install python3-venv)"

key=$( (cat "$req"; "$python" -c 'import sys; print(sys.version, sys.executable)') \
    | sha256sum | cut -c1-32)
stamp="$venv/.oxccl-stamp"
fresh() { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && "$venv/bin/python" -c '' 2>/dev/null; }

if fresh; then
    echo "$venv"
    exit 0
fi

mkdir -p "$(dirname "$venv")"
# One installer at a time (two test runs starting together share the cache).
exec 9>"$venv.lock"
flock -w 1800 9 || die "timed out waiting for another python-env.sh holding $venv.lock"
if fresh; then
    echo "$venv"
    exit 0
fi

start=$(date +%s)
if ! "$venv/bin/python" -c 'import pip' 2>/dev/null; then
    echo "python-env.sh: creating $venv with $("$python" --version 2>&1)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv" || die "python -m venv $venv failed"
else
    echo "python-env.sh: $venv is out of date: updating it" >&2
fi
rm -f "$stamp"
"$venv/bin/python" -m pip install -q --upgrade pip >&2 || die "upgrading pip failed"
echo "python-env.sh: installing $req (torch is ~2.5 GB of downloads on a fresh machine)" >&2
"$venv/bin/python" -m pip install -q -r "$req" >&2 \
    || die "pip install -r $req failed (is PyPI reachable?)"
# CPU tensors do not need triton (the GPU kernel compiler); it is about 1 GB.
"$venv/bin/python" -m pip uninstall -q -y triton >&2 2>/dev/null || true
"$venv/bin/python" -c 'import torch, numpy, pytest, matplotlib; import torch.distributed as d; assert d.is_available()' >&2 \
    || die "the installed packages do not import"
"$venv/bin/python" -m pip cache purge >/dev/null 2>&1 || true
echo "$key" >"$stamp"
echo "python-env.sh: ready in $(($(date +%s) - start)) s" >&2
echo "$venv"
