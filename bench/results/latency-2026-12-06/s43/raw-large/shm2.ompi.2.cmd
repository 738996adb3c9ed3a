$ mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 --mca pml ob1 --mca btl self,vader target/bench/mpi_allreduce -b 32K -e 64M -f 4 -w 5 -i 20 --json
