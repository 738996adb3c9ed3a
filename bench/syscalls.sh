#!/usr/bin/env bash
# Shows that the shm data path makes no system call: counts every syscall of
# `oxccl verbs-perf write_bw -s 8 -n N` (client and its spawned server, strace -f) for growing N
# and prints the totals side by side, then every syscall whose count changed with N.
#
# A count that does not grow with N means the WRITEs themselves make no syscall. What does grow
# with the run's duration (not with N) is listed too, with its per-second rate.
#
# Usage: bench/syscalls.sh [N...]        (default: 100000 1000000 10000000)
set -euo pipefail

cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then NS=("$@"); else NS=(100000 1000000 10000000); fi

if ! command -v strace >/dev/null 2>&1; then
    echo "== strace is missing: installing it =="
    if [ "$(id -u)" != 0 ]; then
        echo "error: strace is not installed and this is not root; apt-get install strace" >&2
        exit 1
    fi
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq strace >/dev/null
fi

echo "== building (release) =="
cargo build --release -q -p oxccl-cli
BIN=target/release/oxccl
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

for n in "${NS[@]}"; do
    start=$(date +%s.%N)
    strace -f -c -o "$OUT/strace.$n" "$BIN" verbs-perf write_bw -s 8 -n "$n" --json >"$OUT/row.$n"
    end=$(date +%s.%N)
    awk -v s="$start" -v e="$end" 'BEGIN { printf "%.3f\n", e - s }' >"$OUT/secs.$n"
    echo "  -n $n: $(cat "$OUT/row.$n")"
done

# calls FILE: "syscall calls" lines of a strace -c table (total included).
calls() {
    awk '/^-/ { next } /^% time/ { next } NF >= 5 {
        name = $NF; c = ($(NF - 1) ~ /^[0-9]+$/ && $(NF - 2) ~ /^[0-9]+$/ && NF == 6) ? $(NF - 2) : $(NF - 1)
        print name, c }' "$1"
}
for n in "${NS[@]}"; do calls "$OUT/strace.$n" | sort >"$OUT/calls.$n"; done

echo
echo "== total syscalls (client + server, strace -f -c) =="
printf "%-22s" "WRITEs (-n)"
for n in "${NS[@]}"; do printf " %12s" "$n"; done
echo
printf "%-22s" "wall seconds (traced)"
for n in "${NS[@]}"; do printf " %12s" "$(cat "$OUT/secs.$n")"; done
echo
printf "%-22s" "total syscalls"
for n in "${NS[@]}"; do printf " %12s" "$(awk '$1 == "total" { print $2 }' "$OUT/calls.$n")"; done
echo

echo
echo "== syscalls whose count changed with N =="
names=$(cat "$OUT"/calls.* | awk '$1 != "total" { print $1 }' | sort -u)
changed=0
for s in $names; do
    row=""
    first=""
    differs=0
    for n in "${NS[@]}"; do
        c=$(awk -v s="$s" '$1 == s { print $2 }' "$OUT/calls.$n")
        c=${c:-0}
        [ -z "$first" ] && first=$c
        [ "$c" != "$first" ] && differs=1
        row+=$(printf " %12s" "$c")
    done
    if [ $differs = 1 ]; then
        printf "%-22s%s\n" "$s" "$row"
        changed=1
    fi
done
[ $changed = 0 ] && echo "(none)"
echo
echo "Notes: ppoll is the verbs library's liveness check of the peer process (a poll on its pidfd,"
echo "at most once per OXCCL_LIVENESS_MS, default 20 ms): it grows with the run's duration, not with"
echo "the number of WRITEs. mmap/munmap/brk changes are the client's result buffers growing with N."
