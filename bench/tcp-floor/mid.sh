#!/usr/bin/env bash
# The tcp2 mid-size rows side by side, alternating per round: Open MPI's tcp BTL all-reduce, then
# each oxccl binary given (tcp provider), then the raw floor (bench/tcp-floor/bulk.c) when
# FLOOR=1. Prints one line per round and side: the out-of-place time in us per size.
# Usage: ROUNDS=8 MIN=512K MAX=8M ITERS=50 bench/tcp-floor/mid.sh OXCCL_BIN...
# Env: EXTRA_ENV (word-split, e.g. "LD_PRELOAD=x.so CC_ALGO=reno") applies to Open MPI (mpirun -x)
# and every oxccl binary alike.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-8} MIN=${MIN:-512K} MAX=${MAX:-8M} ITERS=${ITERS:-50}
MPI=target/bench/mpi_allreduce
[ -x "$MPI" ] || { mkdir -p target/bench && mpicc -O2 -o "$MPI" bench/mpi/allreduce.c; }
X=""
if [ "${FLOOR:-0}" = 1 ]; then X=$(mktemp -d)/bulk; cc -O2 -march=native -o "$X" bench/tcp-floor/bulk.c; fi
MX=()
for e in ${EXTRA_ENV:-}; do MX+=(-x "$e"); done
for r in $(seq "$ROUNDS"); do
    echo "round $r ompi $(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 "${MX[@]}" \
        --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo --mca coll ^sm \
        "$MPI" -b "$MIN" -e "$MAX" -f 2 -w 5 -i "$ITERS" 2>/dev/null | awk '$1 > 0 { printf "%s:%s ", $1, $6 }')"
    for b in "$@"; do
        echo "round $r $b $(env ${EXTRA_ENV:-} OXCCL_PROVIDER=tcp "$b" perf all_reduce -n 2 -b "$MIN" -e "$MAX" -f 2 \
            -d float -o sum -c 1 -w 5 -i "$ITERS" | awk '$1 > 0 && $1 !~ /#/ { printf "%s:%s ", $1, $6 }')"
    done
    if [ -n "$X" ]; then echo "round $r floor-ring $("$X" "$ITERS" 3 | awk -F'[:,}]' '/ring/ { printf "%d:%s ", $4, $6 + 0 }')"; fi
done
