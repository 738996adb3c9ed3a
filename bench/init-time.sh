#!/usr/bin/env bash
# How long a 4-host communicator takes to initialise, with the default link probe and
# without it (OXCCL_TOPO_PROBE=0), side by side: links 1, 1, 1 and 0.25 Gbit/s, one rank per
# host, only torchrun's variables and the secret; REPS runs of each, interleaved. The time
# is rank 0's, around Communicator::from_env (crates/oxccl/examples/follow_rates.rs).
# Needs root. Usage: bench/init-time.sh [REPS] (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-5}
cargo build --release -q -p oxccl-testbed
cargo build --release -q -p oxccl --example follow_rates
TB=$PWD/target/release/oxccl-testbed
EX=$PWD/target/release/examples/follow_rates
trap '"$TB" down --owner $$ >/dev/null 2>&1 || true' EXIT
BED=$("$TB" up --rates 1g,1g,1g,250m --owner-pid $$)
lscpu | grep -m1 'Model name' | sed 's/^/# /'
port=29900
init() {
    local pids=() out
    out=$(mktemp)
    for h in 0 1 2 3; do
        "$TB" exec "$BED" "$h" -- env RANK=$h WORLD_SIZE=4 LOCAL_RANK=0 MASTER_ADDR=10.77.0.1 \
            MASTER_PORT=$port OXCCL_SECRET=init-time "$@" "$EX" --calls 1 --bytes 4096 \
            >"$out.$h" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    sed -n 's/^# init: \([0-9]*\) ms.*/\1/p' "$out.0"
    rm -f "$out" "$out".*
    port=$((port + 1))
}
echo "# run  default_ms  no_probe_ms"
rows=$(for r in $(seq 1 "$REPS"); do
    a=$(init)
    b=$(init OXCCL_TOPO_PROBE=0)
    echo "$r $a $b"
done)
echo "$rows"
echo "$rows" | awk '{ a += $2; b += $3; n++ } END {
    printf "# mean: default %.0f ms, without the probe %.0f ms: the probe costs %.0f ms\n", a / n, b / n, (a - b) / n }'
