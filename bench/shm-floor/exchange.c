/* The raw floor of a 2-rank 8 B all-reduce over shared memory: two processes, each with two
 * mailboxes (64-byte lines: 8 bytes of data and a sequence flag) in a shared anonymous mapping.
 * Per iteration each stores its 8 bytes into the peer's mailbox of the iteration's parity, flag
 * last (release), spins (acquire loads) until its own mailbox of that parity says the peer's
 * bytes of this iteration are there, and adds them to its own: the pattern of a 2-rank
 * all-reduce by one exchange, with no library around it. (Two mailboxes, as oxccl's: a rank
 * may send iteration k+1 before its peer has read iteration k.) Prints the median and best of R timed blocks of N/R iterations, in us per
 * iteration, and checks every sum. Build: cc -O2 -o exchange exchange.c; run: ./exchange [N] [R]
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct box {
    _Alignas(64) double data;
    _Atomic uint64_t flag;
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000000, r = argc > 2 ? atoi(argv[2]) : 10;
    struct box *boxes = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    double *times = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (boxes == MAP_FAILED || times == MAP_FAILED) return 2;
    memset(boxes, 0, 4096);
    pid_t child = fork();
    int me = child == 0, per = n / r, bad = 0;
    struct box *mine = &boxes[2 * me], *theirs = &boxes[2 * (1 - me)];
    uint64_t seq = 0;
    for (int b = -1; b < r; b++) { /* block -1: warm-up */
        double t0 = now();
        for (int i = 0; i < per; i++) {
            seq++;
            double v = (double)(me + 1) * (double)seq, sum = v;
            struct box *in = &mine[seq & 1], *out = &theirs[seq & 1];
            out->data = v;
            atomic_store_explicit(&out->flag, seq, memory_order_release);
            while (atomic_load_explicit(&in->flag, memory_order_acquire) != seq)
                ;
            sum += in->data;
            bad += sum != 3.0 * (double)seq;
        }
        if (b >= 0 && !me) times[b] = (now() - t0) / per;
    }
    if (me) _exit(bad != 0);
    int st;
    waitpid(child, &st, 0);
    qsort(times, r, sizeof *times, cmp);
    printf("shm exchange 8 B: median %.3f us, best %.3f us per iteration (%d x %d), wrong sums %d\n",
           times[r / 2], times[0], r, per, bad + (WEXITSTATUS(st) != 0));
    return bad != 0 || WEXITSTATUS(st) != 0;
}
