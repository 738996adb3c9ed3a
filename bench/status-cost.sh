#!/usr/bin/env bash
# What the `oxccl status` service costs the data path: `oxccl perf` small all-reduces with the
# service (the default) and without it (OXCCL_STATUS=0), alternated ROUNDS times in one run;
# prints each run's 8 B..1 KiB out-of-place times, then per size each side's best and median
# and the ratios service/off.
# A baseline binary (e.g. the main branch's) can join as a third side: BASE=path/to/oxccl.
#
# Usage: bench/status-cost.sh [NRANKS] [ROUNDS]     (default: 2 ranks, 5 rounds)
set -euo pipefail

cd "$(dirname "$0")/.."
N=${1:-2}
ROUNDS=${2:-5}
cargo build --release -q -p oxccl-cli
BIN=target/release/oxccl
ARGS=(perf all_reduce -n "$N" -b 8 -e 1K -f 4 -w 20000 -i 200000 -c 0)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; oxccl ${ARGS[*]}"
sides=(service off)
[ -n "${BASE:-}" ] && sides+=(base)
for round in $(seq "$ROUNDS"); do
    for side in "${sides[@]}"; do
        case $side in
            service) env -u OXCCL_STATUS "$BIN" "${ARGS[@]}" >"$OUT/$side.$round" ;;
            off) OXCCL_STATUS=0 "$BIN" "${ARGS[@]}" >"$OUT/$side.$round" ;;
            base) "$BASE" "${ARGS[@]}" >"$OUT/$side.$round" ;;
        esac
        # size and out-of-place time (us), as nccl-tests columns.
        echo "round $round $side: $(awk '!/^#/ && NF > 5 { printf "%s=%sus ", $1, $6 }' "$OUT/$side.$round")"
    done
done
echo "# best and median of $ROUNDS runs (out-of-place us) per size:"
for side in "${sides[@]}"; do
    cat "$OUT/$side".* | awk -v side="$side" '!/^#/ && NF > 5 { print side, $1, $6 }'
done | sort -k1,1 -k2,2n -k3,3g | awk '
    { k = $1 " " $2; v[k, ++n[k]] = $3; sizes[$2] = 1 }
    END {
        for (s in sizes) {
            split("service off base", sides, " ")
            line = sprintf("size %6d B:", s)
            for (i = 1; i <= 3; i++) {
                k = sides[i] " " s
                if (!(k in n)) continue
                best[i] = v[k, 1]; med[i] = v[k, int((n[k] + 1) / 2)]
                line = line sprintf(" %s best %s median %s;", sides[i], best[i], med[i])
            }
            line = line sprintf(" service/off: best %.3f, median %.3f", best[1] / best[2], med[1] / med[2])
            print line
        }
    }' | sort -k2,2n
