#!/usr/bin/env bash
# torch.distributed.all_reduce on the "oxccl" backend against Gloo, side by side in one job,
# for 2 and 4 local ranks (8 B to 64 MiB, float32 sum, in place), and the Python layer's cost
# at 8 B (Rust loop / oxccl.Communicator / torch.distributed). Raw output:
# bench/results/torch-vs-gloo.txt. Needs the venv (scripts/python-env.sh) and the package
# (scripts/python-test.sh installs it, or: cd python && maturin develop --release).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/scripts/python-env.sh")
out="$root/bench/results/torch-vs-gloo.txt"
{
    echo "# bench/torch-vs-gloo.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
    for n in ${RANKS:-2 4}; do
        echo "## $n ranks"
        "$venv/bin/torchrun" --nproc-per-node "$n" --master-port $((29500 + RANDOM % 1000)) \
            "$root/bench/torch_vs_gloo.py" 2>&1 | grep -v -E '^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|socket\.cpp'
    done
} | tee "$out"
