#!/bin/bash
B=/tmp/tcp-lat-oxccl-hot
for r in 1 2 3; do
for cfg in "1M 4" "512K 4" "256K 4" "512K 8"; do
  set -- $cfg
  c=$(numfmt --from=iec $1)
  echo "chunk $1 slots $2: $(OXCCL_CHUNK_SIZE=$c OXCCL_SLOTS=$2 OXCCL_PROVIDER=tcp $B perf all_reduce -n 2 -b 512K -e 32M -f 4 -w 5 -c 0 -i 40 | awk '$1 ~ /^[0-9]+$/ {printf "%s:%s ", $1, $6}')"
done
echo "ompi: $(mpirun -np 2 --oversubscribe --bind-to none --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo --mca coll ^sm --allow-run-as-root target/bench/mpi_allreduce -b 512K -e 32M -f 4 -w 5 -i 40 2>/dev/null | awk '$1 ~ /^[0-9]+$/ {printf "%s:%s ", $1, $6}')"
done
