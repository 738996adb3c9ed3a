$ env OXCCL_PROVIDER=tcp /tmp/oxccl-s42final perf all_reduce -n 2 -b 8K -e 64M -f 4 -d float -o sum -c 1 -w 5 -i 50 --json
