#!/usr/bin/env bash
# Two ranks that the scheduler put on one CPU: `oxccl perf all_reduce -n 2` starts normally (its
# ranks see every CPU, so a waiting rank spins before it yields), and 0.5 s after its ranks
# started (their communicator is up), every thread of both ranks is pinned to CPU 0 (`taskset
# -a -p`), as a busy machine's scheduler does for a while. Each binary given runs in turn,
# ROUNDS rounds (default 2), for each provider and size. The out-of-place time mixes calls
# before the pin with calls after it; the in-place time, measured after it, is all pinned.
#
# Usage: bench/colocated.sh OXCCL_BIN...
# Env: ROUNDS, PROVIDERS (default "shm tcp"), SIZES (default "8 64K"), SECS (how long each run
#      lasts, roughly, default 3).
set -euo pipefail
ROUNDS=${ROUNDS:-2} PROVIDERS=${PROVIDERS:-shm tcp} SIZES=${SIZES:-8 64K} SECS=${SECS:-3}
[ $# -ge 1 ] || { sed -n 2,12p "$0" >&2; exit 2; }
# Iterations for SECS seconds or more: from a short unpinned run's time per call, times 5 (a
# pinned call is slower).
iters() {
    local us
    us=$(OXCCL_PROVIDER=$2 "$1" perf all_reduce -n 2 -b "$3" -e "$3" -w 2000 -i 20000 -c 0 |
        awk '$1 > 0 && $1 !~ /#/ { print $6 }')
    awk -v us="$us" -v s="$SECS" 'BEGIN { n = int(s * 1e6 / (us * 5)); print (n < 100 ? 100 : n) }'
}
echo "# both ranks pinned to CPU 0 0.5 s after they start; $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs"
echo "# provider size binary iters oop_us(part pinned) ip_us(pinned)"
for p in $PROVIDERS; do
    for s in $SIZES; do
        n=$(iters "$1" "$p" "$s")
        for r in $(seq "$ROUNDS"); do
            for b in "$@"; do
                out=$(mktemp)
                OXCCL_PROVIDER=$p "$b" perf all_reduce -n 2 -b "$s" -e "$s" -w 10 -i "$n" -c 1 >"$out" 2>&1 &
                job=$!
                for _ in $(seq 100); do
                    [ -n "$(pgrep -P "$job")" ] && break
                    sleep 0.02
                done
                sleep 0.5
                for pid in $(pgrep -P "$job"; echo "$job"); do
                    taskset -a -p -c 0 "$pid" >/dev/null 2>&1 || true
                done
                wait "$job" || { echo "$b failed:"; cat "$out"; exit 1; }
                echo "$p $s $b $n $(awk '$1 > 0 && $1 !~ /#/ { print $6, $10, ($9 + $13 > 0 ? "WRONG" : "") }' "$out")"
                rm -f "$out"
            done
        done
    done
done
