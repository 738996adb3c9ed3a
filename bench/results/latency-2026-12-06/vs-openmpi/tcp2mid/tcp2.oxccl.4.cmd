$ env OXCCL_PROVIDER=tcp /tmp/oxccl-all perf all_reduce -n 2 -b 1M -e 4M -f 2 -d float -o sum -c 1 -w 5 -i 50 --json
