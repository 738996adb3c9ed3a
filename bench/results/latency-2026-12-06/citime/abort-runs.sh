#!/bin/bash
# 1 run of main's abort tests, then 5 of citime's, while a release build of oxccl-core.. runs beside (load)
new=$(ls -t /work/wt-citime/target/debug/deps/init_chaos-* | grep -v '\.d$' | head -1)
old=$(ls -t /tmp/ci-clone2/target/debug/deps/init_chaos-* | grep -v '\.d$' | head -1)
( cd /tmp/ci-clone2 && rm -rf target/release && cargo build --release -p oxccl-cli >/dev/null 2>&1 ) &
load=$!
run() { # label exe
  cd /work/wt-citime/crates/oxccl
  s=$(date +%s.%N)
  out=$(CI=true CARGO_MANIFEST_DIR=$PWD $2 abort_while --nocapture 2>&1); rc=$?
  printf "%s rc=%d wall=%.1f %s\n" "$1" $rc $(echo "$(date +%s.%N) - $s" | bc) "$(echo "$out" | grep '^test result')"
  echo "$out" | grep -E "^(hello|links|stored|connect|barrier) " | awk '{printf "   %s r1=%s r0=%s\n", $1, $2, $3}' | paste -sd' '
  echo "$out" | grep -E "FAILED|failed:|panicked" | head -5
}

for i in 6 7 8; do run "citime #$i (load: $(kill -0 $load 2>/dev/null && echo build running || echo none))" $new; done
wait
