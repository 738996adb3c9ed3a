#!/usr/bin/env bash
# per call: wall, user, sys CPU (us) from two iteration counts. usage: SIZE OXBIN [N1 N2]; oxccl perf makes 2 calls per iteration
S=$1; OX=$2; N1=${3:-2000}; N2=${4:-22000}
run() {
  if [ "$1" = ompi ]; then
    perf stat -o /tmp/shm-wait-us.$$ mpirun --allow-run-as-root -np ${NR:-4} --oversubscribe --bind-to none --mca pml ob1 --mca btl self,vader target/bench/mpi_allreduce -b $S -e $S -w 0 -i $2 >/dev/null 2>&1
  else
    OXCCL_PROVIDER=shm perf stat -o /tmp/shm-wait-us.$$ $OX perf all_reduce -n ${NR:-4} -b $S -e $S -w 0 -i $2 -c 0 >/dev/null 2>&1
  fi
  awk '/seconds time elapsed/{e=$1} /seconds user/{u=$1} /seconds sys/{s=$1} /context-switches/{c=$1} END{print e, u, s, c}' /tmp/shm-wait-us.$$ | tr -d ,
}
for side in ${SIDES:-ompi oxccl}; do
  a=$(run $side $N1); b=$(run $side $N2)
  python3 -c "
import sys
a=[float(x) for x in '$a'.split()]; b=[float(x) for x in '$b'.split()]
calls=($N2-$N1)*(2 if '$side'!='ompi' else 1)
d=[(y-x)/calls for x,y in zip(a,b)]
print(f'$side size=$S per call: wall {d[0]*1e6:.2f} us, user {d[1]*1e6:.2f} us, sys {d[2]*1e6:.2f} us, context switches {d[3]:.2f}')
"
done
