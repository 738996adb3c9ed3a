#!/bin/bash
# 4 runs of elastic_chaos (TIMEOUT_S = 2) beside a looping release build of oxccl-core.. (load)
rm -f /tmp/citime/stop-load
( cd /tmp/ci-clone2 && while [ ! -e /tmp/citime/stop-load ]; do touch crates/oxccl-core/src/lib.rs; cargo build --release -p oxccl-cli >/dev/null 2>&1; done ) &
cd /work/wt-citime/crates/oxccl
exe=$(ls -t /work/wt-citime/target/debug/deps/elastic_chaos-* | grep -v '\.d$' | head -1)
for i in 2 3 4 5; do
  s=$(date +%s.%N)
  out=$(CI=true $exe --nocapture 2>&1); rc=$?
  printf "TIMEOUT_S=2 run #%d (beside a release build) rc=%d wall=%.1f %s\n" $i $rc $(echo "$(date +%s.%N) - $s" | bc) "$(echo "$out" | grep '^test result')"
  echo "$out" | grep -E "trials ended" | sed 's/{.*}; slowest/... slowest/; s/^/   /'
  echo "$out" | grep -E "FAILED|panicked" | head -5
done
touch /tmp/citime/stop-load; wait
