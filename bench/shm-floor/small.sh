#!/usr/bin/env bash
# The shm2 8 B row side by side in one run, alternating, ROUNDS rounds (default 4): the raw
# exchange (bench/shm-floor/exchange.c: two processes, flags in shared memory, nothing around
# them: the floor of a 2-rank 8 B all-reduce), Open MPI's vader 8 B all-reduce, and oxccl's 8 B
# all-reduce (shm) for each binary given (an OXCCL_* setting can be given by a wrapper script).
# Times are us per call; whether the two vCPUs share a core changes all three alike, so compare
# only within a round.
# Usage: bench/shm-floor/small.sh OXCCL_BIN...; ROUNDS, ITERS (default 200000) env.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-4}
ITERS=${ITERS:-200000}
X=$(mktemp -d)/exchange
cc -O2 -o "$X" bench/shm-floor/exchange.c
MPI=target/bench/mpi_allreduce
[ -x "$MPI" ] || { mkdir -p target/bench && mpicc -O2 -o "$MPI" bench/mpi/allreduce.c; }
for r in $(seq "$ROUNDS"); do
    echo "round $r"
    echo "  raw_exchange_us $("$X" "$ITERS" 10)"
    echo "  ompi_allreduce8_us $(mpirun -np 2 --oversubscribe --bind-to none --mca pml ob1 --mca btl self,vader \
        --allow-run-as-root "$MPI" -b 8 -e 8 -w 20000 -i "$ITERS" 2>/dev/null | awk '$1 == 8 { print $6 }')"
    for b in "$@"; do
        echo "  oxccl_allreduce8_us[$b](oop ip) $(OXCCL_PROVIDER=shm "$b" perf all_reduce -n 2 -b 8 -e 8 -w 20000 -c 0 \
            -i "$ITERS" | awk '$1 == 8 { print $6, $10 }')"
    done
done
