#!/usr/bin/env bash
# per-call syscalls: strace -f -c over two iteration counts.  usage: SIZE OXBIN [N1 N2]
S=$1; OX=$2; N1=${3:-1000}; N2=${4:-6000}
run() {
  if [ "$1" = ompi ]; then
    strace -f -c -o /tmp/shm-wait-st.$$ mpirun --allow-run-as-root -np ${NR:-4} --oversubscribe --bind-to none --mca pml ob1 --mca btl self,vader target/bench/mpi_allreduce -b $S -e $S -w 0 -i $2 >/dev/null 2>&1
  else
    OXCCL_PROVIDER=shm strace -f -c -o /tmp/shm-wait-st.$$ $OX perf all_reduce -n ${NR:-4} -b $S -e $S -w 0 -i $2 -c 0 >/dev/null 2>&1
  fi
  awk '$1 ~ /^[0-9.]+$/ && $NF ~ /^[a-z_0-9]+$/ && $NF != "total" {c[$NF]=$4} END{for(k in c) printf "%s=%s ", k, c[k]}' /tmp/shm-wait-st.$$
}
for side in ${SIDES:-ompi oxccl}; do
  a=$(run $side $N1); b=$(run $side $N2)
  python3 - "$side" "$S" "$N1" "$N2" "$a" "$b" <<'PY'
import sys
side,S,n1,n2,a,b=sys.argv[1:]
pa=dict(x.split('=') for x in a.split()); pb=dict(x.split('=') for x in b.split())
d=(int(n2)-int(n1))*(2 if side=="oxccl" else 1)
out=[f"{side:6} size={S:>7} syscalls/call:"]
for k in sorted(pb):
    v=(float(pb[k])-float(pa.get(k,0)))/d
    if abs(v)>=0.05: out.append(f"{k}={v:.2f}")
print(" ".join(out))
PY
done
