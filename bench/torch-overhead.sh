#!/usr/bin/env bash
# The Python ProcessGroup path's per-call cost for small all-reduces (8 B .. 64 KiB float32
# SUM, in place) at 2 and 4 local ranks, in one run: Rust's loop inside the job
# (Communicator._rust_loop), oxccl.Communicator from Python, dist.all_reduce on "oxccl"
# (blocking and async+wait), funcol.all_reduce+wait_tensor (what DTensor/TP call), Gloo
# (bench/torch_overhead.py under torchrun); then `oxccl perf all_reduce` (target/release/oxccl,
# its own ranks) at the same sizes. Raw output: bench/results/torch-overhead-<date>.txt.
# Needs the venv (scripts/python-env.sh), the package importable (maturin develop, or
# PYTHONPATH=python with the extension built there) and target/release/oxccl.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/scripts/python-env.sh")
out="$root/bench/results/torch-overhead-$(date -u +%Y-%m-%d)${SUFFIX:-}.txt"
oxccl="${OXCCL_BIN:-$root/target/release/oxccl}"
{
    echo "# bench/torch-overhead.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, git $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo +dirty)"
    for n in ${RANKS:-2 4}; do
        echo "## $n ranks: torch.distributed"
        OMP_NUM_THREADS=1 "$venv/bin/torchrun" --nproc-per-node "$n" --master-port $((29500 + RANDOM % 1000)) \
            "$root/bench/torch_overhead.py" 2>&1 | grep -v -E '^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|socket\.cpp|^\{'
        echo "## $n ranks: oxccl perf all_reduce -b 8 -e 64K -f 8 -i 2000 -w 50 -c 0 (its own ranks)"
        "$oxccl" perf all_reduce -n "$n" -b 8 -e 64K -f 8 -i 2000 -w 50 -c 0 2>&1
    done
} | tee "$out"
