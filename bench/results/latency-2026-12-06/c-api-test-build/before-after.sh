#!/bin/bash
# before/after of the C API test's builds, one run, CPU lock held
cd /work/wt-sealerr; export CARGO_INCREMENTAL=0; F=oxccl-verbs/ofi
T() { local key=$1; shift; local s=$(date +%s.%N); "$@" > /tmp/sealerr-m/ba-$key.out 2>&1; local rc=$?; printf "%-22s rc=%d %7.1f s" "$key" $rc $(echo "$(date +%s.%N) - $s" | bc); printf "   units compiled: %s\n" "$(grep -c '"fresh":false' /tmp/sealerr-m/ba-$key.out)"; }
for v in before after; do
  if [ $v = before ]; then git show main:crates/oxccl-c/tests/c_api.rs > crates/oxccl-c/tests/c_api.rs; else cp /tmp/sealerr-m/c_api.new.rs crates/oxccl-c/tests/c_api.rs; fi
  T $v-ws1 cargo test --workspace --features $F --no-run --message-format=json-render-diagnostics
  T $v-ws2 cargo test --workspace --features $F --no-run --message-format=json-render-diagnostics
  T $v-c_api cargo test --workspace --features $F --test c_api; grep "test result" /tmp/sealerr-m/ba-$v-c_api.out
  T $v-ws3 cargo test --workspace --features $F --no-run --message-format=json-render-diagnostics
done
git diff --stat
