$ env OXCCL_PROVIDER=shm target/release/oxccl perf all_reduce -n 2 -b 32 -e 512 -f 4 -d float -o sum -c 1 -w 20000 -i 100000 --json
