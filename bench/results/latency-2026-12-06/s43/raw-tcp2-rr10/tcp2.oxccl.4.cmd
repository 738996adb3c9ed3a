$ env OXCCL_PROVIDER=tcp target/release/oxccl perf all_reduce -n 2 -b 2K -e 8K -f 4 -d float -o sum -c 1 -w 20000 -i 100000 --json
