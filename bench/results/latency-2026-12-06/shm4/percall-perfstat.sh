#!/usr/bin/env bash
# per-call cost: perf stat over two iteration counts, difference / (N2-N1).
# usage: percall.sh SIZE OXBIN [N1 N2]
S=$1; OX=$2; N1=${3:-2000}; N2=${4:-12000}
ev=context-switches,cpu-migrations,task-clock,page-faults
run() { # side n
  if [ "$1" = ompi ]; then
    perf stat -x, -e $ev -o /tmp/shm-wait-ps.$$ mpirun --allow-run-as-root -np ${NR:-4} --oversubscribe --bind-to none --mca pml ob1 --mca btl self,vader target/bench/mpi_allreduce -b $S -e $S -w 0 -i $2 >/dev/null 2>&1
  else
    OXCCL_PROVIDER=shm perf stat -x, -e $ev -o /tmp/shm-wait-ps.$$ $OX perf all_reduce -n ${NR:-4} -b $S -e $S -w 0 -i $2 -c 0 >/dev/null 2>&1
  fi
  awk -F, '/^[0-9]/{printf "%s=%s ", $3, $1}' /tmp/shm-wait-ps.$$
}
for side in ${SIDES:-ompi oxccl}; do
  a=$(run $side $N1); b=$(run $side $N2)
  python3 - "$side" "$S" "$N1" "$N2" "$a" "$b" <<'PY'
import sys
side,S,n1,n2,a,b=sys.argv[1:]
pa=dict(x.split('=') for x in a.split()); pb=dict(x.split('=') for x in b.split())
d=int(n2)-int(n1)
out=[f"{side:6} size={S:>7}"]
for k in pa:
    try: out.append(f"{k}={(float(pb[k])-float(pa[k]))/d:.4f}")
    except: pass
print(" ".join(out), "(per call, all 4 ranks summed; task-clock in ms)")
PY
done
