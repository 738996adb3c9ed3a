$ mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 --mca pml ob1 --mca btl self,vader target/bench/mpi_allreduce -b 8 -e 64K -f 2 -w 1000 -i 20000 --json
