#!/usr/bin/env bash
# `oxccl status` on a hung job: 4 ranks of `oxccl perf` (8-byte all-reduces) on this host, rank 2
# stops itself (SIGSTOP) at call #30; `oxccl status` as text and JSON, then again once rank 2
# is resumed (SIGCONT); the job is killed at the end. Usage: bench/status-demo.sh [PORT]
set -u
cd "$(dirname "$0")/.."
B=target/release/oxccl
cargo build --release -q -p oxccl-cli
PORT=${1:-29733}
export OXCCL_SECRET=demo-secret-for-status
pids=()
for r in 0 1 2 3; do
  RANK=$r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT OXCCL_TIMEOUT=120 \
    OXCCL_FAULT=stop:rank=2,seq=30 setsid $B perf all_reduce -b 8 -e 8 -w 5 -i 100000000 -c 0 \
    >/dev/null 2>/dev/null &
  pids+=($!)
done
for _ in $(seq 600); do
  [ "$(awk '{print $3}' /proc/${pids[2]}/stat 2>/dev/null)" = T ] && break
  sleep 0.05
done
echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
# (The others reach call #30 and wait there.)
sleep 2
echo "\$ oxccl status --store 127.0.0.1:$PORT      # rank 2 (pid ${pids[2]}) was stopped with SIGSTOP"
/usr/bin/time -f "(%e s wall)" $B status --store 127.0.0.1:$PORT; echo "exit status $?"
echo
echo "\$ oxccl status --store 127.0.0.1:$PORT --json | head -40"
$B status --store 127.0.0.1:$PORT --json | head -40
kill -CONT ${pids[2]}
sleep 1
echo
echo "\$ oxccl status --store 127.0.0.1:$PORT      # after kill -CONT ${pids[2]}"
$B status --store 127.0.0.1:$PORT; echo "exit status $?"
kill -KILL "${pids[@]}" 2>/dev/null
wait 2>/dev/null
