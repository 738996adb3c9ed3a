$ mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 --mca pml ob1 --mca btl self,vader target/bench/mpi_allreduce -b 32 -e 512 -f 4 -w 20000 -i 100000 --json
