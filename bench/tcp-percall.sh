#!/usr/bin/env bash
# Fixed cost per call of a 2-rank all-reduce over the tcp provider (loopback), both ranks together:
# syscalls (strace -f -c) and instructions / context switches (perf stat), each the difference of
# two runs with N1 and N2 iterations divided by 2 (N2 - N1) (`oxccl perf` runs N iterations out of
# place, then N in place), so start-up and teardown cancel out. perf stat also counts the system
# calls by tracepoint (no ptrace slow-down: strace's counts include extra empty polls).
# task-clock is CPU time of every thread of both ranks, in us; instructions read 0 where the
# machine has no PMU (a VM, as here).
#
# Usage: bench/tcp-percall.sh [SIZE] [N1] [N2]     (default 8 2000 12000)
# Env: OXCCL_BIN (default target/release/oxccl), EXTRA_ENV (e.g. "OXCCL_TCP_POLL=busy"),
#      PERF=0 skips perf stat, STRACE=0 skips strace.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:-8}
N1=${2:-2000}
N2=${3:-12000}
B=${OXCCL_BIN:-target/release/oxccl}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
run() { env OXCCL_PROVIDER=tcp ${EXTRA_ENV:-} "$@" "$B" perf all_reduce -n 2 -b "$SIZE" -e "$SIZE" -w 10 -c 0 -i "$N" >/dev/null; }
calls() { awk '/^-/ || /^% time/ { next } NF >= 5 { n = ($5 ~ /^[0-9]+$/) ? $6 : $5; print n, $4 }' "$1"; }
if [ "${STRACE:-1}" != 0 ]; then
    for N in "$N1" "$N2"; do run strace -f -c -o "$OUT/s.$N"; done
    echo "# syscalls per call (both ranks), size $SIZE, 2 x ($N2 - $N1) calls"
    join <(calls "$OUT/s.$N1" | sort) <(calls "$OUT/s.$N2" | sort) |
        awk -v d=$((2 * (N2 - N1))) '{ p = ($3 - $2) / d; if (p >= 0.05 || p <= -0.05) printf "%-16s %7.2f\n", $1, p }' | sort -k2 -nr
fi
if [ "${PERF:-1}" != 0 ]; then
    for N in "$N1" "$N2"; do
        run perf stat -x, -e instructions,context-switches,task-clock,raw_syscalls:sys_enter,syscalls:sys_enter_recvfrom,syscalls:sys_enter_sendmsg,syscalls:sys_enter_epoll_pwait,syscalls:sys_enter_sched_yield -o "$OUT/p.$N" --
    done
    echo "# perf stat per call (both ranks, all threads), size $SIZE"
    join -t, <(awk -F, 'NF>3 { print $3 "," $1 }' "$OUT/p.$N1" | sort) <(awk -F, 'NF>3 { print $3 "," $1 }' "$OUT/p.$N2" | sort) |
        awk -F, -v d=$((2 * (N2 - N1))) '{ v = ($3 - $2) / d; u = ""; if ($1 == "task-clock") { v *= 1000; u = " us" } printf "%-18s %10.3f%s\n", $1, v, u }'
fi
