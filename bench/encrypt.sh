#!/usr/bin/env bash
# Issue 31's cost table: the same runs sealed (OXCCL_ENCRYPT=on) and plain (OXCCL_ENCRYPT=off),
# side by side in one run (the machine is shared and noisy: each sealed run is compared with the
# plain run next to it; the order alternates between rounds).
#
#   cipher          one core's AES-256-GCM seal and open speed (oxccl-seal's cipher_speed
#                   example), and the link rate it keeps up with
#   loopback tcp    `oxccl perf all_reduce -n 2` over the tcp provider, 1 MiB and 64 MiB
#                   (bench/before-after.sh, with the plain build as "before")
#       target: 64 MiB sealed >= 0.6x plain
#   KV, loopback    kv-bench --protocol tcp WRITE, 4 MiB blocks in batches of 16 (64 MiB)
#       target: >= 0.6x plain
#   the bed         HOSTS namespace hosts x 1 rank, links RATE (bench/testbed.sh; needs root),
#                   `oxccl perf all_reduce` of 64 MiB float
#       target: >= 0.95x plain at 1 Gbit/s, 4 hosts
#
# Usage: bench/encrypt.sh          (ROUNDS=4 SECS=2 HOSTS=4 RATE=1g BED_ROUNDS=2 PARTS="cipher loopback kv bed")
# Env: OXCCL_BIN (skip the build), ROUNDS, SECS, HOSTS, RATE, BED_ROUNDS, PARTS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-4}
SECS=${SECS:-2}
HOSTS=${HOSTS:-4}
RATE=${RATE:-1g}
BED_ROUNDS=${BED_ROUNDS:-2}
PARTS=${PARTS:-cipher loopback kv bed}
if [ -z "${OXCCL_BIN:-}" ]; then
    cargo build --release -q -p oxccl-cli -p oxccl-testbed
fi
B=${OXCCL_BIN:-$PWD/target/release/oxccl}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for mode in off on; do
    printf '#!/bin/sh\nOXCCL_ENCRYPT=%s exec %q "$@"\n' "$mode" "$B" >"$tmp/oxccl-$mode"
    chmod +x "$tmp/oxccl-$mode"
done
has() { [[ " $PARTS " == *" $1 "* ]]; }

if has cipher; then
    echo "== cipher: one core =="
    cargo run --release -q -p oxccl-seal --example cipher_speed 1
fi

if has loopback; then
    echo
    echo "== loopback tcp, 2 ranks: sealed (after) against plain (before), $ROUNDS rounds =="
    OXCCL_PROVIDER=tcp bench/before-after.sh "$tmp/oxccl-off" "$tmp/oxccl-on" "$ROUNDS" -- \
        all_reduce -n 2 -b 1M -e 64M -f 64 -w 2 -i 10 -c 1
fi

field() { sed -n "s/.*\"$1\":\([-0-9.eE+]*\).*/\1/p"; }

if has kv; then
    echo
    echo "== KV, loopback tcp: WRITE 4 MiB blocks, batches of 16, $ROUNDS rounds =="
    : >"$tmp/kv"
    for ((r = 1; r <= ROUNDS; r++)); do
        order="off on"
        [ $((r % 2)) = 0 ] && order="on off"
        for m in $order; do
            row=$("$tmp/oxccl-$m" kv-bench --protocol tcp --op write --block-size 4M \
                --batch-size 16 --duration "$SECS" --json)
            g=$(field gb_per_sec <<<"$row")
            sealed=$(sed -n 's/.*"encrypted":\([a-z]*\).*/\1/p' <<<"$row")
            printf '  round %d %-3s %8.3f GB/s (lanes sealed: %s)\n' "$r" "$m" "$g" "$sealed"
            echo "$r $m $g" >>"$tmp/kv"
        done
    done
    ratios=$(awk '{ g[$1 " " $2] = $3; if ($1 > n) n = $1 }
         END { for (r = 1; r <= n; r++) printf "%.3f\n", g[r " on"] / g[r " off"] }' "$tmp/kv")
    echo "  sealed/plain per round: $(echo $ratios)"
    echo "  median sealed/plain: $(echo "$ratios" | sort -n | awk '{ v[NR] = $1 }
        END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
fi

if has bed; then
    echo
    echo "== the bed: $HOSTS hosts x 1 rank, links $RATE, all_reduce 64 MiB float, $BED_ROUNDS rounds =="
    rates=$(for _ in $(seq "$HOSTS"); do printf '%s,' "$RATE"; done)
    rates=${rates%,}
    port=29700
    : >"$tmp/bed"
    for ((r = 1; r <= BED_ROUNDS; r++)); do
        order="off on"
        [ $((r % 2)) = 0 ] && order="on off"
        for m in $order; do
            port=$((port + 1))
            out=$(bench/testbed.sh --rates "$rates" -- sh -c "
                env RANK=\$OXCCL_TESTBED_HOST LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 WORLD_SIZE=$HOSTS \
                    MASTER_ADDR=10.77.0.1 MASTER_PORT=$port OXCCL_SECRET=encrypt-bench \
                    OXCCL_TIMEOUT=300 OXCCL_DEBUG=INFO OXCCL_PROVIDER=tcp \
                    $tmp/oxccl-$m perf all_reduce -b 64M -e 64M -d float -c 1 -w 1 -i 3" 2>&1)
            echo "$out" | grep -E '^\[h0\] +[0-9]+ |^\[h0\].*(sealed|encrypt)' | head -4
            # After the [hI] prefix the out-of-place time (us) is field 7, #wrong field 10
            # (busbw has two decimals only: the ratio is of the times).
            t=$(echo "$out" | awk '/^\[h0\] +[0-9]+ / { print $7; exit }')
            w=$(echo "$out" | awk '/^\[h[0-9]+\] +[0-9]+ / { if ($10 > w) w = $10 } END { print w + 0 }')
            printf '  round %d %-3s time %s us, wrong %s\n' "$r" "$m" "${t:-nan}" "$w"
            echo "$r $m ${t:-nan}" >>"$tmp/bed"
        done
    done
    awk '{ g[$1 " " $2] = $3; if ($1 > n) n = $1 }
         END { for (r = 1; r <= n; r++) printf "  round %d sealed/plain busbw %.3f\n", r, g[r " off"] / g[r " on"] }' "$tmp/bed"
fi
