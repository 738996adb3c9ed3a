#!/usr/bin/env bash
# Two ranks on one CPU, waiting as ranks that see two CPUs do: `oxccl perf all_reduce -n 2`
# under `taskset -c 0` (every thread of both ranks on CPU 0, as a busy machine's scheduler puts
# them for a while), with OXCCL_SPIN_US=50, the spin a rank picks when its host has as many CPUs
# as ranks (pinned, it would see one CPU and pick 0: an oversubscribed rank's yield at once).
# Each binary given runs in turn, ROUNDS rounds (default 2), for each provider and size; prints
# the out-of-place and in-place times.
#
# Usage: bench/colocated.sh OXCCL_BIN...
# Env: ROUNDS, PROVIDERS (default "shm tcp"), SIZES (default "8 64K"), ITERS (default 20000),
#      CPU (default 0).
set -euo pipefail
ROUNDS=${ROUNDS:-2} PROVIDERS=${PROVIDERS:-shm tcp} SIZES=${SIZES:-8 64K}
ITERS=${ITERS:-20000} CPU=${CPU:-0}
[ $# -ge 1 ] || { sed -n 2,11p "$0" >&2; exit 2; }
echo "# both ranks on CPU $CPU (taskset), OXCCL_SPIN_US=50, $ITERS iterations;" \
    "$(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs"
echo "# provider size binary oop_us ip_us"
for p in $PROVIDERS; do
    for s in $SIZES; do
        for r in $(seq "$ROUNDS"); do
            for b in "$@"; do
                row=$(OXCCL_PROVIDER=$p OXCCL_SPIN_US=50 taskset -c "$CPU" "$b" perf all_reduce -n 2 \
                    -b "$s" -e "$s" -w 200 -i "$ITERS" -c 1 | awk '$1 > 0 && $1 !~ /#/ {
                        print $6, $10, ($9 + $13 > 0 ? "WRONG" : "") }')
                [ -n "$row" ] || { echo "$b: no result for $p $s" >&2; exit 1; }
                echo "$p $s $b $row"
            done
        done
    done
done
