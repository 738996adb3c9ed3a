#!/usr/bin/env bash
# Two builds of oxccl side by side in one run: `oxccl perf` with the same arguments, the two
# binaries alternating round by round (the machine is shared and noisy: a figure is only
# compared with its neighbour), then per size the median and the best out-of-place time of each
# and their ratios (after / before: below 1 means the after build is faster).
#
# Usage: bench/before-after.sh BEFORE_BIN AFTER_BIN [ROUNDS] -- PERF_ARGS...
#   e.g. bench/before-after.sh /tmp/oxccl-main target/release/oxccl 6 -- \
#          all_reduce -n 2 -b 8 -e 4K -f 8 -w 1000 -i 20000 -c 0
# Env: OXCCL_PROVIDER and the other OXCCL_* variables pass through to both builds alike.
# Output: one line per round and build (times in us per size), then the summary table.
set -euo pipefail

if [ $# -lt 4 ]; then
    sed -n 2,11p "$0" >&2
    exit 2
fi
BEFORE=$1 AFTER=$2
shift 2
ROUNDS=6
if [ "$1" != "--" ]; then
    ROUNDS=$1
    shift
fi
[ "$1" = "--" ] || { echo "before-after.sh: expected -- before the perf arguments" >&2; exit 2; }
shift
for b in "$BEFORE" "$AFTER"; do
    [ -x "$b" ] || { echo "before-after.sh: $b is not an executable" >&2; exit 2; }
done

# times BIN: the out-of-place time per size, space-separated, from `oxccl perf --json`.
times() {
    local bin=$1
    shift
    "$bin" perf "$@" --json | python3 -c '
import json, sys
rows = json.load(sys.stdin)["rows"]
bad = [r["size"] for r in rows if r["oop"]["wrong"]]
if bad:
    sys.exit(f"wrong results at sizes {bad}")
print(" ".join(str(r["size"]) + ":" + format(r["oop"]["time_us"], ".3f") for r in rows))'
}

echo "# oxccl perf $*; before=$BEFORE after=$AFTER; $ROUNDS rounds, alternating;" \
    "$(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
    "load $(cut -d' ' -f1-3 /proc/loadavg)"
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
for r in $(seq 1 "$ROUNDS"); do
    # Alternate which goes first, so neither always runs on a warmer (or busier) machine.
    if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
    for which in $order; do
        if [ "$which" = before ]; then bin=$BEFORE; else bin=$AFTER; fi
        line=$(times "$bin" "$@" | sed "s|^|$which |")
        echo "$line" | tee -a "$LOG"
    done
done
python3 - "$LOG" <<'EOF'
import statistics, sys
t = {"before": {}, "after": {}}
for line in open(sys.argv[1]):
    which, *cells = line.split()
    for c in cells:
        size, us = c.split(":")
        t[which].setdefault(int(size), []).append(float(us))
print("medians, and the best (fastest) round of each: a busy neighbour only ever adds time")
print(f"{'size':>10} {'before_us':>10} {'after_us':>10} {'after/before':>12}"
      f" {'best_before':>11} {'best_after':>10} {'best ratio':>10}")
for size in sorted(t["before"]):
    b, a = statistics.median(t["before"][size]), statistics.median(t["after"][size])
    bb, ba = min(t["before"][size]), min(t["after"][size])
    print(f"{size:>10} {b:>10.3f} {a:>10.3f} {a / b:>12.3f} {bb:>11.3f} {ba:>10.3f} {ba / bb:>10.3f}")
EOF
