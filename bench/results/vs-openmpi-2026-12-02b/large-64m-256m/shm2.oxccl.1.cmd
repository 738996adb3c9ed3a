$ env OXCCL_PROVIDER=shm target/release/oxccl perf all_reduce -n 2 -b 64M -e 256M -f 4 -d float -o sum -c 1 -w 3 -i 10 --json
