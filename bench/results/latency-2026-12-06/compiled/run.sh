#!/usr/bin/env bash
# The small-call path of issue 30 item 2 and the tcp half of item 3, side by side in one run:
#   1. compiled mailbox calls against the machine-driven ones (OXCCL_COMPILED=0), 2 ranks, shm
#   2. written mailboxes over tcp against the slot protocol (OXCCL_PROTO=slots), 2 ranks, tcp
#   3. main (b79541b, the session's start) against this build: tcp2 and shm2, small sizes
#   4. per-call syscalls and CPU of a tcp 8 B all-reduce, both builds (bench/tcp-percall.sh)
# Usage: bench/results/latency-2026-12-06/compiled/run.sh MAIN_BIN NEW_BIN
set -euo pipefail
cd "$(dirname "$0")/../../../.."
MAIN=$1 NEW=$2
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
printf '#!/bin/sh\nOXCCL_COMPILED=0 exec %s "$@"\n' "$NEW" > "$W/uncompiled"
printf '#!/bin/sh\nOXCCL_PROTO=slots exec %s "$@"\n' "$NEW" > "$W/slots"
chmod +x "$W/uncompiled" "$W/slots"
echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "## 1. shm2: uncompiled (before) vs compiled (after)"
OXCCL_PROVIDER=shm bench/before-after.sh "$W/uncompiled" "$NEW" 6 -- all_reduce -n 2 -b 8 -e 2K -f 4 -w 100000 -i 40000 -c 0
echo "## 2. tcp2: slots (before) vs written mailboxes (after)"
OXCCL_PROVIDER=tcp bench/before-after.sh "$W/slots" "$NEW" 6 -- all_reduce -n 2 -b 8 -e 64K -f 8 -w 200 -i 4000 -c 0
echo "## 3a. tcp2: main (before) vs this build (after)"
OXCCL_PROVIDER=tcp bench/before-after.sh "$MAIN" "$NEW" 6 -- all_reduce -n 2 -b 8 -e 64K -f 8 -w 200 -i 4000 -c 0
echo "## 3b. shm2: main (before) vs this build (after)"
OXCCL_PROVIDER=shm bench/before-after.sh "$MAIN" "$NEW" 6 -- all_reduce -n 2 -b 8 -e 2K -f 4 -w 100000 -i 40000 -c 0
for b in "$MAIN" "$NEW"; do
    echo "## 4. tcp 8 B per call: $b"
    OXCCL_BIN=$b STRACE=0 bench/tcp-percall.sh 8 2000 12000
done
