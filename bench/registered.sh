#!/usr/bin/env bash
# Registered buffers against plain ones, side by side: oxccl perf all_reduce with -R 0 (plain
# vectors), -R 1 (vectors registered with the communicator) and -R 2 (memory the communicator
# allocates, which peers of this host write in place), interleaved in ROUNDS rounds; prints
# each run's time, busbw and the bytes that went through rank 0's memory per call (the
# executor's own counters, `Communicator::stats`), then the fastest of each.
#
# Usage: [ROUNDS=5] [SIZE=64M] [NRANKS=2] [PROVIDER=shm] bench/registered.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
SIZE=${SIZE:-64M}
NRANKS=${NRANKS:-2}
PROVIDER=${PROVIDER:-shm}
cargo build --release -q -p oxccl-cli
BIN=target/release/oxccl
echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; git $(git rev-parse --short=12 HEAD)"
echo "# OXCCL_PROVIDER=$PROVIDER $BIN perf all_reduce -n $NRANKS -b $SIZE -e $SIZE -w 3 -i 10 -R R --json, rounds: $ROUNDS"
echo "# round R oop_us oop_busbw oop_moved ip_us ip_busbw ip_moved"
for round in $(seq "$ROUNDS"); do
    for r in 0 1 2; do
        OXCCL_PROVIDER=$PROVIDER $BIN perf all_reduce -n "$NRANKS" -b "$SIZE" -e "$SIZE" -w 3 -i 10 \
            -R "$r" --json | python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
row = d["rows"][0]
o, i = row["oop"], row["ip"]
print(sys.argv[1], sys.argv[2], "%.1f %.3f %d %.1f %.3f %d" % (
    o["time_us"], o["busbw"], o["moved_bytes"], i["time_us"], i["busbw"], i["moved_bytes"]))
' "$round" "$r"
    done
done | tee /dev/stderr | python3 -c '
import sys
best = {}
for line in sys.stdin:
    f = line.split()
    r = int(f[1]); oop, ip = float(f[2]), float(f[5])
    b = best.setdefault(r, [oop, ip, int(f[4]), int(f[7])])
    b[0] = min(b[0], oop); b[1] = min(b[1], ip)
names = {0: "plain", 1: "registered", 2: "allocated"}
print("# fastest of each: R name oop_us ip_us oop_moved_bytes ip_moved_bytes; time and bytes against plain")
for r in sorted(best):
    o, i, mo, mi = best[r]
    print(f"{r} {names[r]} {o:.1f} {i:.1f} {mo} {mi}  time x{best[0][0] / o:.2f} / x{best[0][1] / i:.2f}  bytes {mo / best[0][2]:.2f} / {mi / best[0][3]:.2f}")
'
