#!/bin/bash
# usage: strace-count.sh BINARY  -> getrandom syscalls (all processes) for -i 50 and -i 150, 1 MiB all_reduce, 2 ranks, shm
bin=$1
for n in 50 150; do
  strace -f -c -e trace=getrandom -o /tmp/citime/strace.$$.$n $bin perf all_reduce -n 2 -b 1M -e 1M -w 5 -i $n >/dev/null 2>&1
  c=$(awk '$NF=="getrandom"{print $4}' /tmp/citime/strace.$$.$n)
  echo "iters=$n getrandom_total=${c:-0}"
done
