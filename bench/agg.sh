#!/usr/bin/env bash
# Issue 18's bed: all-reduce through the aggregation service (`oxccl agg`) against the ring, on
# hosts that are network namespaces with shaped links (bench/testbed.sh; needs root). The
# service runs in the bridge's namespace, where the switch stands (testbed.sh --switch), so it
# reaches every host through that host's shaped link. Every run checks its results (-c 1).
#
# Sections (SECTIONS, default "busbw dtypes twojobs"):
#   busbw    HOSTS hosts x PER_HOST ranks, links RATE; per round `oxccl perf all_reduce` of
#            float from MIN to MAX with OXCCL_ALGO=ring (or BASE), then OXCCL_ALGO=agg; a
#            summary of busbw per size and agg/base. The service prints what it reduced per
#            CPU-second (its own cost).
#   dtypes   one bed with the service: every data type at 1 MiB, sum and max, through it.
#   twojobs  4 hosts: job A on hosts 0-1, job B on hosts 2-3 (2 ranks each), both through the
#            one service; A alone (B idle), then A and B at once: busbw of each.
#
# Usage: bench/agg.sh    (HOSTS=4 PER_HOST=1 RATE=1g MIN=16M MAX=64M ROUNDS=2 ITERS=3 WARMUP=1)
# Env: the above, BASE (ring), SECTIONS, OXCCL_BIN (skip the build).
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-4}
PER_HOST=${PER_HOST:-1}
RATE=${RATE:-1g}
MIN=${MIN:-16M}
MAX=${MAX:-64M}
ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-3}
WARMUP=${WARMUP:-1}
BASE=${BASE:-ring}
SECTIONS=${SECTIONS:-busbw dtypes twojobs}
if [ -z "${OXCCL_BIN:-}" ]; then
    cargo build --release -q -p oxccl-cli -p oxccl-testbed
fi
BIN=${OXCCL_BIN:-$PWD/target/release/oxccl}
export OXCCL_SECRET=agg-bench
rates() { for _ in $(seq "$1"); do printf '%s,' "$RATE"; done | sed 's/,$//'; }
SWITCH="$BIN agg --listen 10.77.0.254:29600 --stats-every 2"
port=29700
res=$(mktemp)
trap 'rm -f "$res"' EXIT

# `perf` on every rank of a bed of $1 hosts; $2: OXCCL_ALGO; the rest: perf's arguments.
perf_bed() {
    local hosts=$1 algo=$2
    shift 2
    port=$((port + 1))
    bench/testbed.sh --rates "$(rates "$hosts")" --switch "$SWITCH" -- sh -c "
        for l in \$(seq 0 $((PER_HOST - 1))); do
            env RANK=\$((OXCCL_TESTBED_HOST * $PER_HOST + l)) LOCAL_RANK=\$l \
                LOCAL_WORLD_SIZE=$PER_HOST WORLD_SIZE=$((hosts * PER_HOST)) \
                MASTER_ADDR=10.77.0.1 MASTER_PORT=$port OXCCL_TIMEOUT=300 \
                OXCCL_ALGO=$algo OXCCL_AGG_ADDR=\$OXCCL_TESTBED_SWITCH_ADDR:29600 \
                $BIN perf all_reduce $* &
        done
        wait" 2>&1
}

# The largest #wrong of any rank's rows in perf output ($1).
wrong() { echo "$1" | awk '/^\[h[0-9]+\] +[0-9]+ / { if ($10 > w) w = $10; if ($14 > w) w = $14 } END { print w + 0 }'; }

if [[ " $SECTIONS " == *" busbw "* ]]; then
    echo "== busbw: $HOSTS hosts x $PER_HOST ranks, links $RATE, all_reduce float $MIN..$MAX, $ROUNDS rounds, $BASE vs agg =="
    for ((r = 1; r <= ROUNDS; r++)); do
        for algo in "$BASE" agg; do
            echo "-- round $r, OXCCL_ALGO=$algo"
            out=$(perf_bed "$HOSTS" "$algo" -b "$MIN" -e "$MAX" -f 4 -d float -c 1 -w "$WARMUP" -i "$ITERS")
            echo "$out" | grep -E '^\[h0\]|^\[sw\]' || true
            # Out-of-place time (us) is field 7 after the [hI] prefix.
            echo "$out" | awk -v r="$r" -v a="$algo" -v w="$(wrong "$out")" \
                '/^\[h0\] +[0-9]+ / { print r, a, $2, $7, w }' >>"$res"
        done
    done
    echo
    echo "== summary: rank 0's out-of-place busbw (GB/s, from its time: bytes/time x 2(n-1)/n), agg against $BASE in the same round =="
    printf '%-6s %12s %10s %10s %8s %8s\n' round bytes "$BASE" agg ratio wrong
    awk -v base="$BASE" -v n=$((HOSTS * PER_HOST)) '
         function bw(bytes, us) { return bytes / us / 1e3 * 2 * (n - 1) / n }
         $2 == base { b[$1 " " $3] = $4; wb[$1 " " $3] = $5 }
         $2 == "agg" { k = $1 " " $3; w = $5 > wb[k] ? $5 : wb[k];
                       printf "%-6s %12s %10.4f %10.4f %8.3f %8s\n", $1, $3, bw($3, b[k]), bw($3, $4), b[k] / $4, w }' "$res"
fi

if [[ " $SECTIONS " == *" dtypes "* ]]; then
    echo
    echo "== dtypes: every type at 1 MiB through the service, sum and max, $HOSTS hosts =="
    port=$((port + 1))
    out=$(bench/testbed.sh --rates "$(rates "$HOSTS")" --switch "$SWITCH" -- sh -c "
        i=0
        for d in int8 uint8 int32 uint32 int64 uint64 half bfloat16 float double f8e4m3 f8e5m2; do
            for o in sum max; do
                i=\$((i + 1)); port=\$(($port + i))
                env RANK=\$OXCCL_TESTBED_HOST WORLD_SIZE=$HOSTS MASTER_ADDR=10.77.0.1 \
                    MASTER_PORT=\$port OXCCL_TIMEOUT=120 OXCCL_ALGO=agg \
                    OXCCL_AGG_ADDR=\$OXCCL_TESTBED_SWITCH_ADDR:29600 \
                    $BIN perf all_reduce -b 1M -e 1M -d \$d -o \$o -c 1 -w 1 -i 2 || echo FAILED \$d \$o
            done
        done" 2>&1)
    echo "$out" | grep -E '^\[h0\] +[0-9]+ |FAILED' || true
    echo "dtypes: $(echo "$out" | grep -cE '^\[h[0-9]+\] +[0-9]+ ') rows, largest #wrong $(wrong "$out"), $(echo "$out" | grep -c FAILED) failed runs"
fi

if [[ " $SECTIONS " == *" twojobs "* ]]; then
    echo
    echo "== twojobs: job A (hosts 0-1) and job B (hosts 2-3) on one service, links $RATE, $MAX float =="
    for both in 0 1; do
        port=$((port + 2))
        out=$(bench/testbed.sh --rates "$(rates 4)" --switch "$SWITCH" -- sh -c "
            job=\$((OXCCL_TESTBED_HOST / 2))
            if [ $both = 0 ] && [ \$job = 1 ]; then exit 0; fi
            env RANK=\$((OXCCL_TESTBED_HOST % 2)) WORLD_SIZE=2 \
                MASTER_ADDR=10.77.0.\$((job * 2 + 1)) MASTER_PORT=\$(($port + job)) \
                OXCCL_TIMEOUT=300 OXCCL_ALGO=agg OXCCL_AGG_ADDR=\$OXCCL_TESTBED_SWITCH_ADDR:29600 \
                $BIN perf all_reduce -b $MAX -e $MAX -d float -c 1 -w $WARMUP -i $((ITERS * 2))" 2>&1)
        label=$([ $both = 0 ] && echo "A alone" || echo "A and B at once")
        echo "-- $label"
        echo "$out" | grep -E '^\[h[02]\] +[0-9]+ |^\[sw\]' || true
        # 2 ranks: busbw = bytes / time.
        echo "$out" | awk -v l="$label" '/^\[h[02]\] +[0-9]+ / {
            printf "%s: %s %s us, busbw %.4f GB/s\n", l, ($1 == "[h0]" ? "job A" : "job B"), $7, $2 / $7 / 1e3 }'
        echo "largest #wrong: $(wrong "$out")"
    done
fi
