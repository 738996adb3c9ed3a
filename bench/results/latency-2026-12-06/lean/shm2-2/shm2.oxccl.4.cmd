$ env OXCCL_PROVIDER=shm /tmp/oxccl-final perf all_reduce -n 2 -b 8 -e 512 -f 4 -d float -o sum -c 1 -w 20000 -i 100000 --json
