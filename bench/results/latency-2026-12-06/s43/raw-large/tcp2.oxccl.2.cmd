$ env OXCCL_PROVIDER=tcp target/release/oxccl perf all_reduce -n 2 -b 32K -e 64M -f 4 -d float -o sum -c 1 -w 5 -i 20 --json
