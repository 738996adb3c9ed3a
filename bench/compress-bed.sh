#!/usr/bin/env bash
# Issue 17's bed: the compressed all-reduce against the plain one on hosts that are network
# namespaces with shaped links (bench/testbed.sh; needs root). HOSTS hosts x 1 rank, each link
# RATE in both directions; for each round, `oxccl perf all_reduce` of SIZE float plain, then
# `--compress bfp8`, then `--compress bfp4`, all checked (-c 1). Prints each run's rank-0 table
# and a summary: time per call and its ratio to the plain run of the same round.
#
# Usage: bench/compress-bed.sh            (HOSTS=4 RATE=1g SIZE=64M ROUNDS=2 ITERS=3 WARMUP=1)
# Env: HOSTS, RATE (Mbit/s or 1g/500m), SIZE, ROUNDS, ITERS, WARMUP, OXCCL_BIN (skip the build).
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-4}
RATE=${RATE:-1g}
SIZE=${SIZE:-64M}
ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-3}
WARMUP=${WARMUP:-1}
if [ -z "${OXCCL_BIN:-}" ]; then
    cargo build --release -q -p oxccl-cli -p oxccl-testbed
fi
BIN=${OXCCL_BIN:-$PWD/target/release/oxccl}
rates=$(for _ in $(seq "$HOSTS"); do printf '%s,' "$RATE"; done)
rates=${rates%,}
port=29600
res=$(mktemp)
trap 'rm -f "$res"' EXIT
echo "== compress-bed: $HOSTS hosts x 1 rank, links $RATE, all_reduce of $SIZE float, $ROUNDS rounds =="
for ((r = 1; r <= ROUNDS; r++)); do
    for c in off bfp8 bfp4; do
        port=$((port + 1))
        echo "-- round $r, --compress $c"
        out=$(bench/testbed.sh --rates "$rates" -- sh -c "
            env RANK=\$OXCCL_TESTBED_HOST LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 WORLD_SIZE=$HOSTS \
                MASTER_ADDR=10.77.0.1 MASTER_PORT=$port OXCCL_SECRET=compress-bench \
                OXCCL_TIMEOUT=300 \
                $BIN perf all_reduce -b $SIZE -e $SIZE -d float -c 1 -w $WARMUP -i $ITERS \
                --compress $c" 2>&1)
        echo "$out" | grep '^\[h0\]'
        # After the [hI] prefix: the plain table's out-of-place time is field 7 (#wrong 10
        # and 14), the compressed table's time field 5 (#wrong 10).
        t=$(echo "$out" | awk -v c="$c" '
            /^\[h0\] +[0-9]+ / { print (c == "off" ? $7 : $5); exit }')
        w=$(echo "$out" | awk -v c="$c" '
            /^\[h[0-9]+\] +[0-9]+ / { x = $10; if (c == "off" && $14 > x) x = $14; if (x > w) w = x }
            END { print w + 0 }')
        echo "$r $c ${t:-nan} $w" >>"$res"
    done
done
echo
echo "== summary: time per call (us), and against the plain all-reduce of the same round =="
printf '%-6s %-6s %14s %10s %8s\n' round mode time_us vs_plain wrong
awk '$2 == "off" { plain[$1] = $3 } { row[NR] = $0 }
     END { for (i = 1; i <= NR; i++) { split(row[i], f, " ");
             printf "%-6s %-6s %14s %10.3f %8s\n", f[1], f[2], f[3], f[3] / plain[f[1]], f[4] } }' "$res"
