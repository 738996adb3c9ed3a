$ env OXCCL_PROVIDER=tcp /tmp/tcp-lat-oxccl-chunk perf all_reduce -n 2 -b 8 -e 64M -f 4 -d float -o sum -c 1 -w 5 -i 20 --json
