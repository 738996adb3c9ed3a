#!/usr/bin/env bash
# Issue 6's test-bed scenarios: the plain ring against the topology-aware all-reduce, side by
# side, on hosts that are network namespaces with shaped links (bench/testbed.sh; needs root).
#
#   a  4 hosts x 1 rank, links 1, 1, 1, 1 Gbit/s       (ring busbw against the link rate)
#   b  2 hosts x 2 ranks, links 1, 1 Gbit/s            (hierarchical two-tier)
#   c  4 hosts x 1 rank, links 1, 1, 1, 0.25 Gbit/s    (proportional shares)
#   d  4 hosts x 1 rank, links 2, 1, 1, 0.5 Gbit/s     (proportional shares)
#
#   bench/topology.sh [a b c d]      # default: all four
#
# Every rank gets OXCCL_TOPO_FILE describing its bed (hosts, ranks, rates), so the tuner sees
# the rates; the ring run forces OXCCL_ALGO=ring. busbw is computed from the measured time
# (nccl-tests' all-reduce factor 2(n-1)/n), in MB/s, next to the slowest link's rate in MB/s
# and the optimum `oxccl::schedule::proportional_shares` derives (the "bound" column: the
# best time for this algorithm family on these rates, as a busbw; for b, the two-tier bound:
# each host link carries 2(H-1)/H of the buffer instead of the flat ring's 2(n-1)/n).
#
# Knobs: SIZES (default "16M 64M"), ITERS (3), WARMUP (1), PORT (first store port, 29700),
# COLL (the collective, default all_reduce; busbw uses nccl-tests' factor for it), DTYPE
# (default float), PROBE=1 (the topology-aware run gets no rates from the file: the ranks
# measure them at init with OXCCL_TOPO_PROBE=1), PROBE=default (no topology file and no
# variable at all, for either run: what a new user gets, the rates probed at init and
# learned as the job runs).
#
#   bench/topology.sh exact [a b c d]   # every dtype at 1 MiB and 64 KiB + 3 B, both
#                                       # algorithms, -c 1: prints #wrong per run
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

cargo build --release -q -p oxccl-cli -p oxccl-testbed
BIN=$PWD/target/release/oxccl
export OXCCL_TESTBED_BIN=$PWD/target/release/oxccl-testbed
exact=0
if [ "${1:-}" = exact ]; then
    exact=1
    shift
fi
read -r -a scenarios <<<"${*:-a b c d}"
coll=${COLL:-all_reduce}
dtype=${DTYPE:-float}
probe=${PROBE:-0}
read -r -a sizes <<<"${SIZES:-16M 64M}"
iters=${ITERS:-3}
warmup=${WARMUP:-1}
port=${PORT:-29700}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# shellcheck source=bench/scenarios.sh
source bench/scenarios.sh

# Runs `oxccl perf $coll` for one size on the bed; prints "time_us wrong" of rank 0 (wrong:
# the most any rank reported).
run() {
    local rates=$1 rph=$2 topo=$3 algo=$4 size=$5 dt=${6:-$dtype}
    local hosts world mbit
    hosts=$(echo "$rates" | tr ',' '\n' | wc -l)
    world=$((hosts * rph))
    mbit=$(echo "$rates" | tr ',' '\n' | awk '{printf "%s%dm", (NR>1?",":""), $1*1000}')
    port=$((port + 1))
    local algo_env="OXCCL_TOPO_FILE=$topo"
    [ "$probe" = default ] && algo_env=""
    [ "$algo" = ring ] && algo_env="$algo_env OXCCL_ALGO=ring"
    [ "$algo" != ring ] && [ "$probe" = 1 ] && algo_env="OXCCL_TOPO_PROBE=1"
    bench/testbed.sh --rates "$mbit" -- sh -c "
        for i in \$(seq 0 $((rph - 1))); do
            env RANK=\$((OXCCL_TESTBED_HOST * $rph + i)) LOCAL_RANK=\$i LOCAL_WORLD_SIZE=$rph \
                WORLD_SIZE=$world MASTER_ADDR=10.77.0.1 MASTER_PORT=$port OXCCL_SECRET=topology-bench \
                OXCCL_TIMEOUT=120 $algo_env \
                $BIN perf $coll -b $size -e $size -d $dt -w $warmup -i $iters -c 1 &
        done
        wait" 2>&1 | awk '
            /^\[h0\] +[0-9]+ / && !t { t = $7 }
            /^\[h[0-9]+\] +[0-9]+ / { if ($10 > w) w = $10 }
            END { print (t ? t : "nan"), w + 0 }'
}

# busbw factor of nccl-tests for $coll on n ranks.
factor() {
    case $coll in
    all_reduce) awk -v n="$1" 'BEGIN { print 2 * (n - 1) / n }' ;;
    reduce_scatter | all_gather) awk -v n="$1" 'BEGIN { print (n - 1) / n }' ;;
    *) echo 1 ;;
    esac
}

if [ "$exact" = 1 ]; then
    printf '%-9s %-9s %-10s %-6s %s\n' scenario dtype size algo wrong
    bad=0
    for s in "${scenarios[@]}"; do
        read -r rates rph <<<"$(spec "$s")"
        topo=$work/topo-$s.toml
        topo_file "$rates" "$rph" "$topo"
        for dt in float half bfloat16 double int8 uint8 int32 uint32 int64 uint64; do
            for size in 1M 65539; do
                for algo in ring aware; do
                    read -r t w <<<"$(iters=1 warmup=0 run "$rates" "$rph" "$topo" $algo $size $dt)"
                    # No time: the job failed (no table), which is not a pass.
                    [ "$t" = nan ] && w="FAILED"
                    printf '%-9s %-9s %-10s %-6s %s\n' "$s" "$dt" "$size" "$algo" "$w"
                    [ "$w" = 0 ] || bad=1
                done
            done
        done
    done
    exit $bad
fi

for s in "${scenarios[@]}"; do
    read -r rates rph <<<"$(spec "$s")"
    topo=$work/topo-$s.toml
    topo_file "$rates" "$rph" "$topo"
    hosts=$(echo "$rates" | tr ',' '\n' | wc -l)
    world=$((hosts * rph))
    slowest=$(echo "$rates" | tr ',' '\n' | sort -g | head -1)
    # The derived optimum for one rank per link: T* = max(T_s, N / r_min) (see the docs of
    # proportional_shares), as a busbw in MB/s.
    bound=$(echo "$rates" | tr ',' '\n' | awk -v n="$world" '
        { r[NR] = $1 * 125 }                     # Gbit/s -> MB/s
        END {
            m = r[1]; for (i = 2; i <= NR; i++) if (r[i] < m) m = r[i]
            if (NR < 3) { print m; exit }
            # smallest T with sum max(0, T r_i - 1) = n - 2 (N = 1 MB), by bisection
            lo = 0; hi = 1e6
            for (it = 0; it < 200; it++) {
                t = (lo + hi) / 2; f = 0
                for (i = 1; i <= NR; i++) if (t * r[i] > 1) f += t * r[i] - 1
                if (f >= n - 2) hi = t; else lo = t
            }
            t = hi; if (1 / m > t) t = 1 / m
            printf "%.1f", 2 * (n - 1) / n / t
        }')
    if [ "$rph" -gt 1 ]; then
        # Two tiers: the host links carry 2(H-1)/H of the buffer.
        bound=$(awk -v n="$world" -v h="$hosts" -v m="$slowest" \
            'BEGIN { printf "%.1f", (2 * (n - 1) / n) / (2 * (h - 1) / h) * m * 125 }')
    fi
    [ "$coll" = all_reduce ] || bound="-"
    echo "== scenario $s: $coll, $dtype, $hosts hosts x $rph rank(s), links $rates Gbit/s (slowest $(awk -v r="$slowest" 'BEGIN{print r*125}') MB/s)$([ "$probe" = 1 ] && echo ", rates probed")$([ "$probe" = default ] && echo ", no file and no variable: the default")"
    printf '%-10s %12s %12s %7s %10s %12s %6s\n' size ring_MB/s aware_MB/s ratio ring/link bound_MB/s wrong
    for size in "${sizes[@]}"; do
        bytes=$(numfmt --from=iec "$size")
        read -r t_ring w_ring <<<"$(run "$rates" "$rph" "$topo" ring "$size")"
        read -r t_aware w_aware <<<"$(run "$rates" "$rph" "$topo" aware "$size")"
        awk -v b="$bytes" -v f="$(factor "$world")" -v tr="$t_ring" -v ta="$t_aware" -v link="$slowest" \
            -v bound="$bound" -v wr="$w_ring" -v wa="$w_aware" -v sz="$size" -v s="$s" 'BEGIN {
            ring = b / tr * f; aware = b / ta * f      # bytes/us = MB/s
            printf "%-10s %12.1f %12.1f %6.2fx %9.1f%% %12s %6s\n", sz, ring, aware, aware / ring,
                100 * ring / (link * 125), bound, wr + wa
        }'
    done
done
