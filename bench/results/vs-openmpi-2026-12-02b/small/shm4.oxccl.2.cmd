$ env OXCCL_PROVIDER=shm target/release/oxccl perf all_reduce -n 4 -b 8 -e 64K -f 2 -d float -o sum -c 1 -w 1000 -i 20000 --json
