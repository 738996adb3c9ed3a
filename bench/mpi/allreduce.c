/*
 * MPI_Allreduce benchmark in the manner of nccl-tests' all_reduce_perf, as the Open MPI half of
 * bench/vs-openmpi.sh (which has the usage notes).
 *
 *   mpirun -np N mpi_allreduce [-b MIN] [-e MAX] [-f FACTOR] [-w WARMUP] [-i ITERS] [--json]
 *
 * Sizes are bytes with an optional K/M/G suffix (powers of 1024). Float, sum, out of place: one
 * send and one receive buffer of MAX bytes, allocated and touched once before any timing. Per
 * size (after a warmup at MAX and at MIN, as nccl-tests does first): barrier, WARMUP
 * all-reduces, barrier, ITERS timed all-reduces (MPI_Wtime); the figure is
 * the slowest rank's average per iteration (MPI_Reduce MAX). algbw = size / time (GB = 1e9 B),
 * busbw = algbw * 2 (n - 1) / n, as nccl-tests defines them. After the timed loop one more
 * all-reduce runs on fresh input (rank r sends r + 1 + (i mod 7) at element i: small integers,
 * so the float sum is exact) and the elements that differ from the expected sum are counted over
 * all ranks (#wrong).
 */
#include <mpi.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s [-b MIN] [-e MAX] [-f FACTOR] [-w WARMUP] [-i ITERS] [--json]\n"
            "  sizes in bytes, optional K/M/G suffix (1024-based); defaults -b 8 -e 32M -f 2 "
            "-w 5 -i 20\n",
            argv0);
}

/* Parses "64", "4K", "16M", "1G"; returns 0 on error. */
static size_t parse_size(const char *s) {
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return 0;
    switch (*end) {
    case '\0': break;
    case 'k': case 'K': v <<= 10; end++; break;
    case 'm': case 'M': v <<= 20; end++; break;
    case 'g': case 'G': v <<= 30; end++; break;
    default: return 0;
    }
    if (*end != '\0') return 0;
    return (size_t)v;
}

static long parse_int(const char *s, long min) {
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < min) return -1;
    return v;
}

static void fill(float *send, size_t count, int rank) {
    for (size_t i = 0; i < count; i++) send[i] = (float)(rank + 1 + (int)(i % 7));
}

int main(int argc, char **argv) {
    size_t min_bytes = 8, max_bytes = 32u << 20;
    long factor = 2, warmup = 5, iters = 20;
    int json = 0;

    MPI_Init(&argc, &argv);
    int rank, nranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a];
        const char *val = a + 1 < argc ? argv[a + 1] : NULL;
        int bad = 0;
        if (strcmp(arg, "--json") == 0) {
            json = 1;
            continue;
        } else if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            if (rank == 0) usage(argv[0]);
            MPI_Finalize();
            return 0;
        } else if (val == NULL) {
            bad = 1;
        } else if (strcmp(arg, "-b") == 0) {
            bad = (min_bytes = parse_size(val)) == 0;
        } else if (strcmp(arg, "-e") == 0) {
            bad = (max_bytes = parse_size(val)) == 0;
        } else if (strcmp(arg, "-f") == 0) {
            bad = (factor = parse_int(val, 2)) < 0;
        } else if (strcmp(arg, "-w") == 0) {
            bad = (warmup = parse_int(val, 0)) < 0;
        } else if (strcmp(arg, "-i") == 0) {
            bad = (iters = parse_int(val, 1)) < 0;
        } else {
            bad = 1;
        }
        if (bad) {
            if (rank == 0) {
                fprintf(stderr, "mpi_allreduce: bad argument '%s'%s%s\n", arg,
                        val ? " " : "", val ? val : "");
                usage(argv[0]);
            }
            MPI_Finalize();
            return 2;
        }
        a++;
    }
    if (min_bytes < sizeof(float)) min_bytes = sizeof(float);
    if (max_bytes < min_bytes) {
        if (rank == 0) fprintf(stderr, "mpi_allreduce: -e %zu is below -b %zu\n", max_bytes, min_bytes);
        MPI_Finalize();
        return 2;
    }

    size_t max_count = max_bytes / sizeof(float);
    if (max_count > (size_t)INT_MAX) {
        if (rank == 0) fprintf(stderr, "mpi_allreduce: -e %zu is over INT_MAX floats\n", max_bytes);
        MPI_Finalize();
        return 2;
    }
    float *send = malloc(max_count * sizeof(float));
    float *recv = malloc(max_count * sizeof(float));
    if (send == NULL || recv == NULL) {
        fprintf(stderr, "mpi_allreduce: rank %d: cannot allocate 2 x %zu bytes\n", rank, max_bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    /* Touch every page before timing; the timed loops all-reduce this (valid) data. */
    fill(send, max_count, rank);
    memset(recv, 0, max_count * sizeof(float));

    if (rank == 0) {
        if (json) {
            printf("{\"nranks\":%d,\"dtype\":\"float\",\"op\":\"sum\",\"rows\":[", nranks);
        } else {
            printf("# MPI_Allreduce, %d ranks, float sum, out of place, warmup %ld, iters %ld\n",
                   nranks, warmup, iters);
            printf("# %12s %12s %8s %6s %6s %10s %12s %12s %8s\n", "size", "count", "type",
                   "redop", "root", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
        }
        fflush(stdout);
    }

    /* As nccl-tests does before its loop: warm up at the largest and the smallest size, so that
     * connection setup and first-use costs land in no row. */
    for (long i = 0; i < warmup; i++)
        MPI_Allreduce(send, recv, (int)max_count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    for (long i = 0; i < warmup; i++)
        MPI_Allreduce(send, recv, (int)(min_bytes / sizeof(float)), MPI_FLOAT, MPI_SUM,
                      MPI_COMM_WORLD);

    int first = 1;
    for (size_t bytes = min_bytes; bytes <= max_bytes;) {
        int count = (int)(bytes / sizeof(float));
        size_t size = (size_t)count * sizeof(float);

        MPI_Barrier(MPI_COMM_WORLD);
        for (long i = 0; i < warmup; i++)
            MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (long i = 0; i < iters; i++)
            MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double local = (MPI_Wtime() - t0) / (double)iters, slowest = 0;
        MPI_Reduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

        /* Check: one more all-reduce on freshly filled input into a cleared output. */
        fill(send, (size_t)count, rank);
        for (int i = 0; i < count; i++) recv[i] = -1.0f;
        MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        long long wrong_local = 0, wrong = 0;
        long long base = (long long)nranks * (nranks + 1) / 2;
        for (int i = 0; i < count; i++) {
            float want = (float)(base + (long long)nranks * (i % 7));
            if (recv[i] != want) wrong_local++;
        }
        MPI_Reduce(&wrong_local, &wrong, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);

        if (rank == 0) {
            double us = slowest * 1e6;
            double algbw = (double)size / slowest / 1e9;
            double busbw = algbw * 2.0 * (nranks - 1) / nranks;
            if (json) {
                printf("%s{\"size\":%zu,\"count\":%d,\"time_us\":%.3f,\"algbw\":%.4f,"
                       "\"busbw\":%.4f,\"wrong\":%lld}",
                       first ? "" : ",", size, count, us, algbw, busbw, wrong);
            } else {
                printf("  %12zu %12d %8s %6s %6d %10.2f %12.3f %12.3f %8lld\n", size, count,
                       "float", "sum", -1, us, algbw, busbw, wrong);
            }
            fflush(stdout);
        }
        first = 0;

        if (bytes > max_bytes / (size_t)factor) break; /* next would pass MAX (or overflow) */
        bytes *= (size_t)factor;
    }
    if (rank == 0 && json) printf("]}\n");

    free(send);
    free(recv);
    MPI_Finalize();
    return 0;
}
