#!/usr/bin/env bash
# The providers between two hosts: two network namespaces of a test bed (crates/oxccl-testbed)
# whose link is shaped to RATE in both directions (default 1 Gbit/s). `oxccl verbs-perf write_bw
# --provider P --server` runs in host 0, `--connect` in host 1, for each provider P of PROVIDERS
# (tcp, and ofi over libfabric's tcp;ofi_rxm bound to each host's address), and the raw baseline `tcp_bw`
# (one TCP stream, 1 MiB writes) runs in the same bed, interleaved with it; write_bw runs twice,
# spinning on its completion queue (perftest's default) and sleeping on it (-e), whose CPU cost
# per GB differs. Prints write_bw as a
# fraction of the link rate (target >= 95 %; TCP payload over MTU 9000 carries at most 99.3 %
# of a tbf-shaped rate, see oxccl_testbed::Shaping) and against the raw stream.
#
# The bed is always torn down: on success, failure, Ctrl-C and SIGTERM (a SIGKILLed run leaves it
# behind; the next bed created on the machine, or `oxccl-testbed gc`, deletes it). Needs root.
#
# Usage: bench/verbs-netns.sh [RATE]        RATE in Mbit/s or with a suffix (250m, 1g); default 1g
# Env: PROVIDERS (default "tcp ofi"), SIZES (message sizes, default "4M"; e.g. "64K 1M 4M 16M 64M"), SECS (seconds each
#      measured run moves data for, default 3), ROUNDS (default 2), OXCCL_BIN and
#      OXCCL_TESTBED_BIN (skip the cargo build).
set -euo pipefail

cd "$(dirname "$0")/.."
RATE=${1:-1g}
SIZES=${SIZES:-4M}
PROVIDERS=${PROVIDERS:-tcp ofi}
SECS=${SECS:-3}
ROUNDS=${ROUNDS:-2}
if [ -z "${OXCCL_BIN:-}" ] || [ -z "${OXCCL_TESTBED_BIN:-}" ]; then
    cargo build --release -q -p oxccl-cli -p oxccl-testbed
fi
B=${OXCCL_BIN:-$PWD/target/release/oxccl}
TB=${OXCCL_TESTBED_BIN:-$PWD/target/release/oxccl-testbed}

case "$RATE" in
*g | *G) MBIT=$(awk -v r="${RATE%[gG]}" 'BEGIN { printf "%d", r * 1000 }') ;;
*m | *M) MBIT=${RATE%[mM]} ;;
*) MBIT=$RATE ;;
esac
if ! [[ "$MBIT" =~ ^[0-9]+$ ]] || [ "$MBIT" -eq 0 ]; then
    echo "verbs-netns.sh: bad rate $RATE" >&2
    exit 2
fi

if ! "$TB" available >/dev/null; then
    echo "verbs-netns.sh: no test bed on this machine: $("$TB" available 2>&1 || true)" >&2
    exit 1
fi

OXCCL_SECRET=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
export OXCCL_SECRET
unset OXCCL_TCP_ADDR OXCCL_TCP_POLL OXCCL_SECRET_FILE OXCCL_OFI_ADDR OXCCL_OFI_PROVIDER
TMP=$(mktemp -d)
SRV_PID=
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    [ -n "$SRV_PID" ] && kill "$SRV_PID" 2>/dev/null
    "$TB" down --owner $$ || echo "verbs-netns.sh: teardown failed; \`$TB gc\` retries" >&2
    rm -rf "$TMP"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

NAME=$("$TB" up --rates "${MBIT},${MBIT}" --owner-pid $$)
SERVER=10.77.0.1
CLIENT=10.77.0.2
echo "== verbs-netns: test bed $NAME, 2 hosts, link ${MBIT} Mbit/s both directions (MTU 9000), $ROUNDS rounds =="

# bytes SIZE: the size in bytes (K, M, G suffixes are powers of 1024).
bytes() {
    local s=$1 n=${1%[KkMmGg]}
    case "$s" in
    *[Kk]) echo $((n << 10)) ;;
    *[Mm]) echo $((n << 20)) ;;
    *[Gg]) echo $((n << 30)) ;;
    *) echo "$s" ;;
    esac
}
field() { sed -n "s/.*\"$1\":\([-0-9.eE+]*\).*/\1/p"; }

# pair TEST SERVER_ARGS -- CLIENT_ARGS: one run between host 0 (server) and host 1 (client);
# prints the client's JSON row.
pair() {
    local test=$1
    shift
    local sargs=()
    while [ "$1" != -- ]; do
        sargs+=("$1")
        shift
    done
    shift
    : >"$TMP/srv.out"
    # The ofi provider binds the address it is given (else loopback, which another host cannot
    # reach); the tcp provider finds its own.
    "$TB" exec "$NAME" 0 -- env OXCCL_OFI_ADDR="$SERVER" "$B" verbs-perf "$test" "${sargs[@]}" --server \
        --bind "$SERVER:18515" --wait 30 >"$TMP/srv.out" 2>"$TMP/srv.err" &
    SRV_PID=$!
    for _ in $(seq 200); do
        grep -q "listening on" "$TMP/srv.out" && break
        sleep 0.05
    done
    local row rc=0
    row=$("$TB" exec "$NAME" 1 -- env OXCCL_OFI_ADDR="$CLIENT" "$B" verbs-perf "$test" "$@" --connect "$SERVER" --wait 30 \
        --json --cpu) || rc=$?
    wait "$SRV_PID" || rc=$?
    SRV_PID=
    if [ "$rc" != 0 ]; then
        echo "verbs-netns.sh: $test failed; server said:" >&2
        cat "$TMP/srv.err" >&2
        exit 1
    fi
    echo "$row"
}

RES=$TMP/results
# run KEY SIZE TEST SERVER_ARGS -- CLIENT_ARGS: a bandwidth run sized to move data for SECS.
run() {
    local key=$1 size=$2
    shift 2
    local row gbps mbit
    row=$(pair "$@")
    gbps=$(field bw_average_gb_per_sec <<<"$row")
    mbit=$(awk -v g="$gbps" 'BEGIN { printf "%.1f", g * 8000 }')
    echo "$key $size $mbit" >>"$RES"
    printf '  %-16s %-6s %8s Mbit/s  = %5.1f %% of the link   CPU init %.4f, target %.4f s/GB\n' \
        "$key" "$size" "$mbit" "$(awk -v m="$mbit" -v l="$MBIT" 'BEGIN { print 100 * m / l }')" \
        "$(field cpu_init_s_per_gb <<<"$row")" "$(field cpu_target_s_per_gb <<<"$row")"
}

LINK_BYTES=$((MBIT * 1000000 / 8))
for ((r = 1; r <= ROUNDS; r++)); do
    echo "-- round $r"
    for size in $SIZES; do
        b=$(bytes "$size")
        n=$(((LINK_BYTES * SECS + b - 1) / b))
        [ "$n" -lt 4 ] && n=4
        raw_n=$(((LINK_BYTES * SECS + 1048575) / 1048576))
        raw() { run tcp_bw "$size" tcp_bw -- -s 1M -n "$raw_n"; }
        if ! ((r % 2)); then raw; fi
        for p in $PROVIDERS; do
            wbw=(write_bw --provider "$p" -- --provider "$p" -s "$size" -n "$n" -t 16)
            run "write_bw/$p" "$size" "${wbw[@]}"
            run "write_bw-e/$p" "$size" "${wbw[@]}" -e
        done
        if ((r % 2)); then raw; fi
    done
done

echo
echo "== summary: best and median of $ROUNDS rounds, Mbit/s (1 Mbit = 1e6 bit) on a ${MBIT} Mbit/s link =="
printf '%-16s %-8s %10s %10s %10s %10s  %s\n' test size "best" "median" "% of link" "vs raw" "target >= 95 % of link"
FAILS=0
for size in $SIZES; do
  for key in $(for p in $PROVIDERS; do echo "write_bw/$p write_bw-e/$p"; done); do
    stats() { # KEY: best median
        awk -v k="$1" -v s="$size" '$1 == k && $2 == s { v[n++] = $3 }
            END { for (i = 0; i < n; i++) for (j = i + 1; j < n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
                  m = (n % 2) ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2; print v[n - 1], m }' "$RES"
    }
    read -r wb wm <<<"$(stats $key)"
    read -r rb rm <<<"$(stats tcp_bw)"
    pct=$(awk -v w="$wb" -v l="$MBIT" 'BEGIN { printf "%.1f", 100 * w / l }')
    vs=$(awk -v w="$wb" -v r="$rb" 'BEGIN { printf "%.3f", w / r }')
    ok=$(awk -v p="$pct" -v m="$wm" -v l="$MBIT" 'BEGIN { print (p >= 95 ? "PASS" : "FAIL") " (median " (100 * m / l >= 95 ? "PASS" : "FAIL") ")" }')
    [[ "$ok" == PASS* ]] || FAILS=$((FAILS + 1))
    printf '%-16s %-8s %10s %10s %10s %10s  %s\n' "$key" "$size" "$wb" "$wm" "$pct" "$vs" "$ok"
  done
  printf '%-16s %-8s %10s %10s %10s\n' tcp_bw "1M" "$rb" "$rm" \
      "$(awk -v w="$rb" -v l="$MBIT" 'BEGIN { printf "%.1f", 100 * w / l }')"
done
echo "(% of link and vs raw from the best runs; the verdict is on the best run, the median's in brackets)"
[ "${STRICT:-0}" = 1 ] && [ "$FAILS" -gt 0 ] && exit 1
exit 0
