#!/usr/bin/env bash
# A link that slows while a job runs: 4 hosts at 1 Gbit/s run back-to-back 16 MiB
# all-reduces (crates/oxccl/examples/follow_rates.rs, only torchrun's variables and the
# secret); after call AT, host 3's link is reshaped to 0.25 Gbit/s (`tc qdisc change`, both
# directions). Side by side in the same run, the reference: the same job on a bed shaped
# 1, 1, 1, 0.25 from the start, with the rates given in a topology file and learning off,
# i.e. the aware algorithm with the rates known. Prints every call of both, then how many
# calls after the change the default took to get back to 90% of the reference's busbw.
# Needs root. About 2 minutes.
#
# Usage: bench/follow-rates.sh [CALLS] [AT]     (defaults 40 and 10)
set -euo pipefail
cd "$(dirname "$0")/.."
CALLS=${1:-40}
AT=${2:-10}
cargo build --release -q -p oxccl-testbed
cargo build --release -q -p oxccl --example follow_rates
TB=$PWD/target/release/oxccl-testbed
EX=$PWD/target/release/examples/follow_rates
TMP=$(mktemp -d)
cleanup() { "$TB" down --owner $$ >/dev/null 2>&1 || true; rm -rf "$TMP"; }
trap cleanup EXIT

# run NAME PORT [ENV..] -- EXTRA_ARGS: the job in bed NAME, rank 0's output on stdout.
run() {
    local name=$1 port=$2
    shift 2
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    local pids=()
    for h in 0 1 2 3; do
        "$TB" exec "$name" "$h" -- env RANK=$h WORLD_SIZE=4 LOCAL_RANK=0 MASTER_ADDR=10.77.0.1 \
            MASTER_PORT=$port OXCCL_SECRET=follow-rates "${envs[@]}" \
            "$EX" --calls "$CALLS" "$@" >"$TMP/$name.$h" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    cat "$TMP/$name.0"
}

lscpu | grep -m1 'Model name' | sed 's/^/# /'
REF=$("$TB" up --rates 1g,1g,1g,250m --owner-pid $$)
cat >"$TMP/known.json" <<'JSON'
{"hosts": [{"name": "h0", "ranks": [0], "link_gbps": 1.0}, {"name": "h1", "ranks": [1], "link_gbps": 1.0},
           {"name": "h2", "ranks": [2], "link_gbps": 1.0}, {"name": "h3", "ranks": [3], "link_gbps": 0.25}]}
JSON
echo "# reference: links 1, 1, 1, 0.25 from the start, rates known (topology file), learning off"
run "$REF" 29801 OXCCL_TOPO_FILE="$TMP/known.json" OXCCL_TOPO_LEARN=0 -- | tee "$TMP/ref.out"
"$TB" down "$REF"

BED=$("$TB" up --rates 1g,1g,1g,1g --owner-pid $$)
echo "# default: links at 1 Gbit/s; host 3's link reshaped to 0.25 Gbit/s after call $AT"
run "$BED" 29802 -- --at "$AT" -- "$TB" rate "$BED" 3 250m | tee "$TMP/follow.out"

MED=$(awk '/^ *[0-9]+ / && $1 > 5 { print $3 }' "$TMP/ref.out" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
awk -v at="$AT" -v med="$MED" '
    /^ *[0-9]+ / { bw[$1] = $3; last = $1 }
    END {
        target = 0.9 * med
        for (c = at + 1; c <= last; c++) if (bw[c] >= target) { back = c; break }
        printf "# reference median busbw %.4f GB/s (calls 6-); 90%% of it: %.4f\n", med, target
        if (back) printf "# back to >= 90%% at call %d: %d calls after the change (busbw %.4f, %.2f of the reference)\n", back, back - at, bw[back], bw[back] / med
        else printf "# never back to 90%% within %d calls after the change\n", last - at
        s = 0; k = 0; for (c = last - 9; c <= last; c++) { s += bw[c]; k++ }
        printf "# last 10 calls: mean busbw %.4f, %.2f of the reference\n", s / k, s / k / med
    }' "$TMP/follow.out"
