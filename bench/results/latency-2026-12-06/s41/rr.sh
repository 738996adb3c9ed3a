#!/bin/bash
# rr.sh ROUNDS PROVIDER SIZE BIN...: round-robin, rotating order; prints median and best per binary
R=$1 P=$2 S=$3; shift 3
bins=("$@"); n=${#bins[@]}
out=$(mktemp)
for r in $(seq $R); do
  for k in $(seq 0 $((n-1))); do
    b=${bins[$(( (k + r) % n ))]}
    t=$(OXCCL_PROVIDER=$P $b perf all_reduce -n 2 -b $S -e $S -w 20000 -i 100000 -c 0 | awk '$1>0 && $1 !~ /#/{print $6}')
    echo "$b $t" >> $out
  done
done
python3 - $out <<'PY'
import sys,statistics,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    b,t=l.split(); d[b].append(float(t))
for b,v in d.items():
    v.sort(); print("%-16s median %.3f best %.3f  q1 %.3f q3 %.3f  n %d"%(b,statistics.median(v),v[0],v[len(v)//4],v[3*len(v)//4],len(v)))
PY
