#!/bin/bash
# Raw tcp_lat --busy, then write_lat 8 B of each BIN, per round; the raw ping-pong runs from
# $RAW (default: the first BIN). N: iterations (default 20000).
# usage: wlrr.sh ROUNDS BIN... ; prints per round raw typical and write_lat typical per bin, then median ratios
R=$1; shift
j() { python3 -c 'import json,sys; d=json.loads(sys.stdin.readline()); print(d["t_typical_usec"])'; }
for r in $(seq $R); do
  line="$(${RAW:-$1} verbs-perf tcp_lat -s 8 -n ${N:-20000} --busy --json | j)"
  for b in "$@"; do line="$line $($b verbs-perf write_lat --provider tcp -s 8 -n ${N:-20000} --json | j)"; done
  echo "$line"
done | tee /tmp/wlrr.out | python3 -c '
import sys,statistics
rows=[list(map(float,l.split())) for l in sys.stdin if l.strip()]
for k in range(1,len(rows[0])):
    rs=sorted(r[k]/r[0] for r in rows)
    print("bin%d ratio median %.3f min %.3f  typical median %.3f"%(k,statistics.median(rs),rs[0],statistics.median(r[k] for r in rows)))
print("raw median %.3f"%statistics.median(r[0] for r in rows))'
