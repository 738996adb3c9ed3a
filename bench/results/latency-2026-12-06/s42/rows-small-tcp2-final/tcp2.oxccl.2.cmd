$ env OXCCL_PROVIDER=tcp /tmp/oxccl-s42fin2 perf all_reduce -n 2 -b 8 -e 8K -f 4 -d float -o sum -c 1 -w 20000 -i 100000 --json
