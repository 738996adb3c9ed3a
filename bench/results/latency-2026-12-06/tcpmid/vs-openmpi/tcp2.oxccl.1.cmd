$ env OXCCL_PROVIDER=tcp /tmp/oxccl-tcpmid-new perf all_reduce -n 2 -b 8 -e 32M -f 4 -d float -o sum -c 1 -w 5 -i 20 --json
