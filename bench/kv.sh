#!/usr/bin/env bash
# The KV transfer engine (oxccl-kv) against its references, side by side in one run: the machine
# is shared and noisy, so each engine run sits next to its reference, the order alternates
# between rounds, and the summary gives the best of the rounds, their median, and the median of
# the rounds' paired ratios (engine / the reference measured next to it), which a bandwidth
# verdict is on; latency and CPU verdicts are on the median of the rounds.
#
#   loopback tcp, batches      kv-bench --protocol tcp (LANES lanes), WRITE and READ, blocks of
#                              1, 4 and 16 MiB in batches of 64 MiB, against raw-tcp: LANES plain
#                              TCP streams (kv-bench --protocol raw-tcp, the same block size and
#                              working set), and `verbs-perf tcp_bw` (1 stream) for reference
#       target: >= 80 % of the raw streams. Also reported, without a target: 4 MiB WRITEs over
#       one lane against one raw stream (the engine's cost per connection)
#   shm, batches               kv-bench --protocol shm, WRITE and READ, the same blocks and
#                              batches, against `verbs-perf memcpy_bw -s 64M` (one thread, the
#                              same 64 MiB working set), run next to each block size's pair
#       target: >= 90 % of memcpy_bw
#   4 KiB round trips          kv-bench --sync --block-size 4K, WRITE and READ, over tcp and shm;
#                              the median of each run's per-request latencies
#       targets: <= 20 us over tcp, <= 2 us over shm. Also reported: `verbs-perf read_lat -s 4K`
#       over each provider (a READ one at a time below the engine)
#   the waiting thread         kv-bench --sync --block-size 256M over tcp (WRITE): the calling
#                              thread's CPU time over its wall time (wait_cpu)
#       target: <= 10 % of a core
#   two hosts, 1 Gbit/s        a test bed (crates/oxccl-testbed) of two network namespaces whose
#                              links are shaped to 1 Gbit/s both ways (tc tbf): the target in
#                              host 0 (--role target), the initiator in host 1 (--role
#                              initiator), WRITE and READ of 4 MiB blocks in batches of 8, and
#                              raw-tcp in the same bed for reference
#       target: >= 95 % of the link rate
#
# Usage: bench/kv.sh [ROUNDS]        (default 3; the test bed runs 2 rounds)
# Env: SECS (seconds each bandwidth run moves data for, default 2), LAT_SECS (latency runs,
#      default 2), NET_SECS (test-bed runs, default 4), LANES (default 2), NETNS=0 skips the test
#      bed, OXCCL_BIN and OXCCL_TESTBED_BIN skip the cargo build, STRICT=1 exits 1 on a FAIL.
set -euo pipefail

cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECS=${SECS:-2}
LAT_SECS=${LAT_SECS:-2}
NET_SECS=${NET_SECS:-4}
LANES=${LANES:-2}
NETNS=${NETNS:-1}
if [ -z "${OXCCL_BIN:-}" ]; then
    if [ "$NETNS" = 1 ] && [ -z "${OXCCL_TESTBED_BIN:-}" ]; then
        cargo build --release -q -p oxccl-cli -p oxccl-testbed
    else
        cargo build --release -q -p oxccl-cli
    fi
elif [ "$NETNS" = 1 ] && [ -z "${OXCCL_TESTBED_BIN:-}" ]; then
    cargo build --release -q -p oxccl-testbed
fi
B=${OXCCL_BIN:-$PWD/target/release/oxccl}
TB=${OXCCL_TESTBED_BIN:-$PWD/target/release/oxccl-testbed}
unset OXCCL_TCP_POLL OXCCL_TCP_ADDR OXCCL_SECRET_FILE
# For the by-hand pairs in the test bed; it never leaves this machine.
OXCCL_SECRET=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
export OXCCL_SECRET

TMP=$(mktemp -d)
RES=$TMP/results
BED=
PIDS=()
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    if [ -n "$BED" ]; then
        "$TB" down --owner $$ >/dev/null || echo "kv.sh: teardown failed; \`$TB gc\` retries" >&2
    fi
    rm -rf "$TMP"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# field NAME: the value of a flat JSON row on stdin (numbers; null prints nothing).
field() { sed -n "s/.*\"$1\":\([-0-9.eE+]*\).*/\1/p"; }
ROUND=0
record() { echo "$1 $2 $ROUND" >>"$RES"; }

# kv KEY ARGS..: a kv-bench run (--json); records GB/s, p50, CPU per GB of both sides, wait_cpu.
kv() {
    local key=$1
    shift
    local row
    row=$("$B" kv-bench "$@" --json)
    local gbs p50 ci ct wc
    gbs=$(field gb_per_sec <<<"$row")
    p50=$(field p50_usec <<<"$row")
    ci=$(field cpu_init_s_per_gb <<<"$row")
    ct=$(field cpu_target_s_per_gb <<<"$row")
    wc=$(field wait_cpu_pct <<<"$row")
    record "$key.bw" "$gbs"
    [ -n "$p50" ] && record "$key.p50" "$p50"
    record "$key.cpu_init" "$ci"
    [ -n "$ct" ] && record "$key.cpu_target" "$ct"
    record "$key.wait_cpu" "$wc"
    printf '  %-22s %8.3f GB/s  p50 %10s us  CPU init %.3f target %5s s/GB  wait_cpu %5.1f %%\n' \
        "$key" "$gbs" "${p50:--}" "$ci" "$(awk -v c="${ct:-}" 'BEGIN { if (c == "") print "-"; else printf "%.3f", c }')" "$wc"
}

# vp KEY ARGS..: a verbs-perf bandwidth baseline; records its BW average.
vp() {
    local key=$1
    shift
    local row gbs
    row=$("$B" verbs-perf "$@" --json)
    gbs=$(field bw_average_gb_per_sec <<<"$row")
    record "$key.bw" "$gbs"
    printf '  %-22s %8.3f GB/s\n' "$key" "$gbs"
}

BLOCKS="1M 4M 16M"
bytes() { local n=${1%[KkMmGg]}; case "$1" in *[Kk]) echo $((n << 10)) ;; *[Mm]) echo $((n << 20)) ;; *) echo "$1" ;; esac; }
batch_of() { echo $(((64 << 20) / $(bytes "$1"))); }

tcp_runs() { # BLOCK
    local b=$1 n
    n=$(batch_of "$b")
    local common=(--block-size "$b" --batch-size "$n" --duration "$SECS" --lanes "$LANES")
    kv "tcp.write.$b" --protocol tcp --op write "${common[@]}"
    kv "raw.$b" --protocol raw-tcp "${common[@]}"
    kv "tcp.read.$b" --protocol tcp --op read "${common[@]}"
}
lane1_runs() { # 4 MiB blocks over one connection: the engine's per-connection cost (no target)
    local common=(--block-size 4M --batch-size 16 --duration "$SECS" --lanes 1)
    kv "tcp1.write.4M" --protocol tcp --op write "${common[@]}"
    kv "raw1.4M" --protocol raw-tcp "${common[@]}"
}
shm_runs() { # BLOCK
    local b=$1 n
    n=$(batch_of "$b")
    memcpy_run "$b"
    kv "shm.write.$b" --protocol shm --op write --block-size "$b" --batch-size "$n" --duration "$SECS"
    kv "shm.read.$b" --protocol shm --op read --block-size "$b" --batch-size "$n" --duration "$SECS"
}
# memcpy_bw over the same 64 MiB working set as the shm batches, run beside each pair of them.
memcpy_run() { vp "memcpy.64M.$1" memcpy_bw -s 64M -n $((SECS * 150)); }
raw1_run() { vp tcp_bw.1stream tcp_bw -s 1M -n $((SECS * 2500)); }
# vl KEY ARGS..: a verbs-perf latency reference; records its median (t_typical).
vl() {
    local key=$1
    shift
    local t
    t=$("$B" verbs-perf "$@" --json | field t_typical_usec)
    record "$key.p50" "$t"
    printf '  %-22s t_typical %8.3f us\n' "$key" "$t"
}
lat_runs() {
    # The providers' own 4 KiB READ, one at a time (what a sync READ costs below the engine).
    vl ref.read_lat.tcp read_lat --provider tcp -s 4K -n 5000
    vl ref.read_lat.shm read_lat --provider shm -s 4K -n 20000
    for p in tcp shm; do
        for op in write read; do
            kv "sync.$p.$op" --protocol "$p" --op "$op" --sync --block-size 4K --duration "$LAT_SECS"
        done
    done
}
wait_run() {
    kv wait.tcp.256M --protocol tcp --op write --sync --block-size 256M --buffer-size 256M \
        --iters 6 --warmup 2
}

echo "== kv: $ROUNDS interleaved rounds on $(nproc) CPUs ($(lscpu | sed -n 's/^Model name: *//p'), $(uname -r)), load: $(cut -d' ' -f1-3 /proc/loadavg) =="
for ((r = 1; r <= ROUNDS; r++)); do
    echo "-- round $r"
    ROUND=$r
    if ((r % 2)); then
        for b in $BLOCKS; do tcp_runs "$b"; done
        lane1_runs
        raw1_run
        for b in $BLOCKS; do shm_runs "$b"; done
        lat_runs
        wait_run
    else
        wait_run
        lat_runs
        for b in $BLOCKS; do shm_runs "$b"; done
        raw1_run
        lane1_runs
        for b in $BLOCKS; do tcp_runs "$b"; done
    fi
done

# The test bed: the target in host 0, the initiator in host 1, a 1 Gbit/s link both ways.
NET_MBIT=1000
net_pair() { # KEY PROTOCOL PORT ARGS..: one initiator run against the target serving on PORT
    local key=$1 proto=$2 port=$3
    shift 3
    local row mbit
    row=$("$TB" exec "$BED" 1 -- "$B" kv-bench --role initiator --protocol "$proto" \
        --segment "10.77.0.1:$port" --duration "$NET_SECS" --json "$@")
    mbit=$(awk -v g="$(field gb_per_sec <<<"$row")" 'BEGIN { printf "%.1f", g * 8000 }')
    record "$key.mbit" "$mbit"
    printf '  %-22s %8s Mbit/s = %5.1f %% of the link   CPU init %s target %s s/GB\n' "$key" \
        "$mbit" "$(awk -v m="$mbit" -v l="$NET_MBIT" 'BEGIN { print 100 * m / l }')" \
        "$(field cpu_init_s_per_gb <<<"$row")" "$(field cpu_target_s_per_gb <<<"$row")"
}
net_target() { # PROTOCOL PORT: starts a target in host 0 and waits until it serves
    local out=$TMP/target.$2
    "$TB" exec "$BED" 0 -- "$B" kv-bench --role target --protocol "$1" \
        --listen "10.77.0.1:$2" --buffer-size 64M --block-size 4M >"$out" 2>"$out.err" &
    PIDS+=($!)
    for _ in $(seq 200); do
        grep -q "kv-bench target: segment" "$out" && return 0
        sleep 0.05
    done
    echo "kv.sh: the target in the test bed did not start:" >&2
    cat "$out.err" >&2
    exit 1
}
if [ "$NETNS" = 1 ]; then
    if ! why=$("$TB" available 2>&1); then
        echo "kv.sh: no test bed on this machine ($why): skipping the two-host runs" >&2
        NETNS=0
    fi
fi
if [ "$NETNS" = 1 ]; then
    BED=$("$TB" up --rates "$NET_MBIT,$NET_MBIT" --owner-pid $$)
    echo "-- test bed $BED: 2 hosts, ${NET_MBIT} Mbit/s links both ways (tbf, MTU 9000)"
    net_target tcp 18600
    net_target raw-tcp 18601
    NET=(--block-size 4M --batch-size 8 --lanes "$LANES")
    for ((r = 1; r <= 2; r++)); do
        ROUND=$r
        if ((r % 2)); then
            net_pair net.write tcp 18600 --op write "${NET[@]}"
            net_pair net.read tcp 18600 --op read "${NET[@]}"
            net_pair net.raw raw-tcp 18601 "${NET[@]}"
        else
            net_pair net.raw raw-tcp 18601 "${NET[@]}"
            net_pair net.read tcp 18600 --op read "${NET[@]}"
            net_pair net.write tcp 18600 --op write "${NET[@]}"
        fi
    done
fi

# stat KEY best|median: over the rounds; best is the minimum for latencies and CPU, else the max.
stat() {
    awk -v k="$1" -v how="$2" '
        $1 == k { v[n++] = $2 }
        END {
            if (n == 0) { print "nan"; exit }
            for (i = 0; i < n; i++) for (j = i + 1; j < n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
            if (how == "median") x = (n % 2) ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2
            else if (k ~ /(p50|cpu|wait_cpu)$/) x = v[0]
            else x = v[n - 1]
            printf "%.3f\n", x
        }' "$RES"
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "nan" }'; }
verdict() { awk -v v="$1" -v op="$2" -v l="$3" 'BEGIN { ok = (op == "<=") ? v <= l : v >= l; print ok ? "PASS" : "FAIL" }'; }

FAILS=0
# paired KEY REFKEY: the median over the rounds of each round's KEY/REFKEY (the two measured
# next to each other, so that a quiet or a busy moment hits both).
paired() {
    awk -v k="$1" -v r="$2" '
        $1 == k { a[$3] = $2 } $1 == r { b[$3] = $2 }
        END {
            for (i in a) if ((i in b) && b[i] > 0) v[n++] = a[i] / b[i]
            if (n == 0) { print "nan"; exit }
            for (i = 0; i < n; i++) for (j = i + 1; j < n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
            printf "%.3f\n", (n % 2) ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2
        }' "$RES"
}
# target NAME KEY REFKEY OP LIMIT [info]: the ratio KEY/REFKEY: best/best, median/median, and
# the median of the per-round (paired) ratios, which the verdict is on.
target() {
    local rb rm rp vb vm vp
    rb=$(ratio "$(stat "$2" best)" "$(stat "$3" best)")
    rm=$(ratio "$(stat "$2" median)" "$(stat "$3" median)")
    rp=$(paired "$2" "$3")
    if [ "${6:-}" = info ]; then
        printf '%-36s %7s %7s %7s   (reported, no target)\n' "$1" "$rb" "$rm" "$rp"
        return
    fi
    vb=$(verdict "$rb" "$4" "$5")
    vm=$(verdict "$rm" "$4" "$5")
    vp=$(verdict "$rp" "$4" "$5")
    printf '%-36s %7s %7s %7s   %s %s: %s on the paired median (best/best %s, median/median %s)\n' \
        "$1" "$rb" "$rm" "$rp" "$4" "$5" "$vp" "$vb" "$vm"
    [ "$vp" = PASS ] || FAILS=$((FAILS + 1))
}
# absolute NAME KEY OP LIMIT UNIT: a figure against a limit (median of the rounds, best shown).
absolute() {
    local b m v
    b=$(stat "$2" best)
    m=$(stat "$2" median)
    v=$(verdict "$m" "$3" "$4")
    printf '%-36s %7s %7s   %s %s %s: %s on the median\n' "$1" "$b" "$m" "$3" "$4" "$5" "$v"
    [ "$v" = PASS ] || FAILS=$((FAILS + 1))
}

echo
echo "== summary over $ROUNDS rounds (best, median of the rounds) =="
printf '%-36s %7s %7s\n' "bandwidth [GB/s]" best median
for k in $(awk '$1 ~ /\.bw$/ { print $1 }' "$RES" | sort -u); do
    printf '  %-32s %8s %8s\n' "${k%.bw}" "$(stat "$k" best)" "$(stat "$k" median)"
done
printf '%-36s %7s %7s\n' "CPU [s/GB] initiator / target" best median
for k in $(awk '$1 ~ /\.cpu_init$/ { print $1 }' "$RES" | sort -u); do
    n=${k%.cpu_init}
    printf '  %-32s %8s %8s   target %s %s\n' "$n" "$(stat "$k" best)" "$(stat "$k" median)" \
        "$(stat "$n.cpu_target" best)" "$(stat "$n.cpu_target" median)"
done

echo
echo "== targets over $ROUNDS rounds: ratio best/best, median/median, and the median of the rounds' paired ratios =="
printf '%-36s %7s %7s %7s\n' "" best median paired
for b in $BLOCKS; do
    target "tcp WRITE $b / raw $LANES streams" "tcp.write.$b.bw" "raw.$b.bw" ">=" 0.80
    target "tcp READ $b / raw $LANES streams" "tcp.read.$b.bw" "raw.$b.bw" ">=" 0.80
done
target "tcp WRITE 4M, 1 lane / raw 1 stream" tcp1.write.4M.bw raw1.4M.bw ">=" 0.80 info
target "raw 1 stream / verbs-perf tcp_bw" raw1.4M.bw tcp_bw.1stream.bw ">=" 0 info
for b in $BLOCKS; do
    target "shm WRITE $b / memcpy_bw 64M" "shm.write.$b.bw" "memcpy.64M.$b.bw" ">=" 0.90
    target "shm READ $b / memcpy_bw 64M" "shm.read.$b.bw" "memcpy.64M.$b.bw" ">=" 0.90
done
echo
printf '%-36s %7s %7s\n' "" best median
absolute "4K sync WRITE tcp, p50 [us]" sync.tcp.write.p50 "<=" 20 us
absolute "4K sync READ tcp, p50 [us]" sync.tcp.read.p50 "<=" 20 us
absolute "4K sync WRITE shm, p50 [us]" sync.shm.write.p50 "<=" 2 us
absolute "4K sync READ shm, p50 [us]" sync.shm.read.p50 "<=" 2 us
printf '%-36s %7s %7s   (reported, no target: the provider alone, verbs-perf read_lat)\n' \
    "  4K read_lat tcp [us]" "$(stat ref.read_lat.tcp.p50 best)" "$(stat ref.read_lat.tcp.p50 median)"
printf '%-36s %7s %7s   (reported, no target: the provider alone, verbs-perf read_lat)\n' \
    "  4K read_lat shm [us]" "$(stat ref.read_lat.shm.p50 best)" "$(stat ref.read_lat.shm.p50 median)"
absolute "256M sync WRITE tcp, wait_cpu [%]" wait.tcp.256M.wait_cpu "<=" 10 "% of a core"
if grep -q '^net\.' "$RES"; then
    echo
    printf '%-36s %7s %7s\n' "two hosts, 1 Gbit/s [Mbit/s]" best median
    for k in net.write net.read net.raw; do
        printf '  %-32s %8s %8s   %5.1f %% of the link (best)\n' "$k" "$(stat "$k.mbit" best)" \
            "$(stat "$k.mbit" median)" "$(awk -v m="$(stat "$k.mbit" best)" -v l="$NET_MBIT" 'BEGIN { print 100 * m / l }')"
    done
    for k in net.write net.read; do
        pct=$(awk -v m="$(stat "$k.mbit" best)" -v l="$NET_MBIT" 'BEGIN { printf "%.3f", m / l }')
        pm=$(awk -v m="$(stat "$k.mbit" median)" -v l="$NET_MBIT" 'BEGIN { printf "%.3f", m / l }')
        v=$(verdict "$pct" ">=" 0.95)
        printf '%-36s %7s %7s   >= 0.95 of the link: %s on best-of-2 (median: %s)\n' \
            "${k/net./two hosts } / link" "$pct" "$pm" "$v" "$(verdict "$pm" ">=" 0.95)"
        [ "$v" = PASS ] || FAILS=$((FAILS + 1))
    done
fi
echo "($FAILS target(s) missed)"
if [ "${STRICT:-0}" = 1 ] && [ "$FAILS" -gt 0 ]; then
    exit 1
fi
