#!/usr/bin/env bash
# The small-message tcp rows side by side in one run, alternating, ROUNDS rounds (default 3):
#   raw exchange (bench/tcp-floor/exchange.c: both ends send 8 B, busy recv: the floor of a
#   2-rank 8 B all-reduce over TCP loopback), Open MPI's tcp BTL 8 B all-reduce, oxccl 8 B
#   all-reduce (tcp) for each binary given, raw busy ping-pong (verbs-perf tcp_lat --busy,
#   half round trip) and write_lat 8 B (tcp, half round trip) for each binary.
# Usage: bench/tcp-floor/small.sh OXCCL_BIN... (first is also used for tcp_lat); ROUNDS env.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}
X=$(mktemp -d)/exchange
cc -O2 -o "$X" bench/tcp-floor/exchange.c
MPI=target/bench/mpi_allreduce
[ -x "$MPI" ] || mpicc -O2 -o "$MPI" bench/mpi/allreduce.c
j() { python3 -c 'import json,sys; d=json.loads(sys.stdin.readline()); print(" ".join(str(d[k]) for k in sys.argv[1:]))' "$@"; }
for r in $(seq "$ROUNDS"); do
    echo "round $r"
    echo "  raw_exchange_us(median best) $("$X" 20000 10 | head -1 | j median_usec best_usec)"
    echo "  ompi_allreduce8_us $(mpirun -np 2 --oversubscribe --bind-to none --mca pml ob1 --mca btl self,tcp \
        --mca btl_tcp_if_include lo --mca coll ^sm --allow-run-as-root "$MPI" -b 8 -e 8 -w 500 -i 20000 2>/dev/null |
        awk '$1 == 8 { print $6 }')"
    for b in "$@"; do
        echo "  oxccl_allreduce8_us[$b](oop ip) $(OXCCL_PROVIDER=tcp "$b" perf all_reduce -n 2 -b 8 -e 8 -w 500 -c 0 -i 20000 |
            awk '$1 == 8 { print $6, $10 }')"
    done
    echo "  raw_tcp_lat_busy_us(typical min) $("$1" verbs-perf tcp_lat -s 8 -n 5000 --busy --json | j t_typical_usec t_min_usec)"
    for b in "$@"; do
        echo "  write_lat_us[$b](typical min) $("$b" verbs-perf write_lat --provider tcp -s 8 -n 5000 --json | j t_typical_usec t_min_usec)"
    done
done
