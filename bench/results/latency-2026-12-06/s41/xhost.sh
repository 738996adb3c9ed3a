#!/bin/bash
# xhost.sh ARGS BIN...: perf all_reduce across two netns hosts (unshaped), rank 0's rows
A=$1; shift
cd /work/main
for b in "$@"; do echo "$(basename $b) $(OXCCL_TESTBED_BIN=target/release/oxccl-testbed timeout 120 bench/testbed.sh --rates none,none -- sh -c "env RANK=\$OXCCL_TESTBED_HOST WORLD_SIZE=2 MASTER_ADDR=10.77.0.1 MASTER_PORT=29511 OXCCL_SECRET=x $b perf all_reduce $A -c 0" 2>&1 | awk '/^\[h0\] +[0-9]+ /{printf "%s:%s/%s ", $2, $7, $11}')"; done
