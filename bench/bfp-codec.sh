#!/usr/bin/env bash
# The BFP codec's rate on one core (GB/s of f32 input, encode and decode, per width, block size
# and kernel set) beside a memcpy of the same bytes, in one run.
# Usage: bench/bfp-codec.sh [MiB=64] [reps=20] [out-dir]
# FEATURES=avx512 (the default) adds the AVX-512 kernels, which need Rust 1.89; FEATURES= leaves
# them out.
set -euo pipefail
cd "$(dirname "$0")/.."
MIB=${1:-64}
REPS=${2:-20}
OUT=${3:-}
FEATURES=${FEATURES-avx512}
cargo build --release -q -p oxccl-core --example bfp_bench --features "$FEATURES"
BIN="${CARGO_TARGET_DIR:-target}/release/examples/bfp_bench"
# One core: pinned to the last CPU when taskset is there.
PIN=()
if command -v taskset >/dev/null; then PIN=(taskset -c "$(($(nproc) - 1))"); fi
run() {
    echo "# $(rustc --version), features: ${FEATURES:-none}, ${PIN[*]:-unpinned}," \
        "load average: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs"
    "${PIN[@]}" "$BIN" "$MIB" "$REPS"
}
if [[ -n "$OUT" ]]; then
    mkdir -p "$OUT"
    run | tee "$OUT/bfp-codec.txt"
else
    run
fi
