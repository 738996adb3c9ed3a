#!/bin/bash
# alternate: raw, base, new ; write_lat median (t_typical)
for r in 1 2 3; do
  for b in "$@"; do
    echo "$b $($b verbs-perf write_lat --provider tcp -s 8 -n 5000 --json | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["t_typical_usec"], d["t_min_usec"])')"
  done
  echo "raw $(/tmp/tcp-lat-oxccl-base verbs-perf tcp_lat -s 8 -n 5000 --busy --json | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["t_typical_usec"], d["t_min_usec"])')"
  for b in "$@"; do
    echo "$b-ar8 $(OXCCL_PROVIDER=tcp $b perf all_reduce -n 2 -b 8 -e 8 -w 100 -c 0 -i 5000 | awk '$1==8 {print $6, $10}')"
  done
done
