#!/usr/bin/env bash
# Tensor parallelism (ColwiseParallel/RowwiseParallel blocks on a 1-D mesh) on 2 local ranks:
# step time on Gloo and on oxccl, and compute only (the same step with the all-reduces made
# no-ops); the exposed communication ratio oxccl/Gloo (bench/tp.py under torchrun).
# Raw output: bench/results/tp-<date>.txt. Needs the venv and the package (as
# bench/torch-overhead.sh). SHAPES (DIMxTOKENS ...), LAYERS, STEPS, ROUNDS override the shape.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/scripts/python-env.sh")
out="$root/bench/results/tp-$(date -u +%Y-%m-%d)${SUFFIX:-}.txt"
{
    echo "# bench/tp.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, git $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo +dirty)"
    for shape in ${SHAPES:-256x32 1024x64}; do
        DIM=${shape%x*} TOKENS=${shape#*x} OMP_NUM_THREADS=1 "$venv/bin/torchrun" --nproc-per-node "${RANKS:-2}" \
            --master-port $((29500 + RANDOM % 1000)) "$root/bench/tp.py" 2>&1 \
            | grep -v -E '^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|socket\.cpp'
    done
} | tee "$out"
