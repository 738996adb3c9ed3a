/* The raw floor of a 2-rank mid-size float-sum all-reduce over TCP loopback: two processes
 * joined by one TCP connection (TCP_NODELAY, non-blocking, busy-polled), each holding SIZE
 * bytes of floats, run the byte exchange of the algorithm named, with the reduction done in
 * plain C (the compiler vectorizes it) and nothing else: no headers, credits or slots.
 *   ring: reduce-scatter then all-gather: each side sends its peer's half (SIZE/2) while it
 *         receives its own half into a scratch buffer and adds it in CHUNK pieces as they land;
 *         then sends its reduced half while it receives the peer's reduced half in place.
 *   rd:   recursive doubling (Open MPI's choice for 2 ranks up to its switch point): each side
 *         sends all SIZE bytes while it receives all SIZE bytes into scratch, adding CHUNK
 *         pieces as they land.
 * Prints per size and algorithm the median and best of R timed blocks of N iterations (us per
 * all-reduce). Build: cc -O2 -march=native -o bulk bulk.c; run: ./bulk [N] [R] [CHUNK]. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static void add(float *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] += s[i];
}
/* Sends sb[0..n) and receives n bytes into rb while both are due; every `chunk` bytes
 * received, adds them (as floats) into acc when acc is set. */
static void exchange(int fd, const char *sb, char *rb, size_t n, float *acc, size_t chunk) {
    size_t sent = 0, got = 0, done = 0;
    while (sent < n || got < n) {
        if (sent < n) {
            ssize_t w = send(fd, sb + sent, n - sent, MSG_DONTWAIT);
            if (w > 0) sent += w;
            else if (w < 0 && errno != EAGAIN) exit(3);
        }
        if (got < n) {
            ssize_t r = recv(fd, rb + got, n - got, MSG_DONTWAIT);
            if (r > 0) got += r;
            else if (r == 0 || (r < 0 && errno != EAGAIN)) exit(4);
        }
        while (acc && got - done >= chunk) {
            add(acc + done / 4, (const float *)(rb + done), chunk / 4);
            done += chunk;
        }
    }
    if (acc && got > done) add(acc + done / 4, (const float *)(rb + done), (got - done) / 4);
}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 50, r = argc > 2 ? atoi(argv[2]) : 7, one = 1;
    size_t chunk = argc > 3 ? strtoul(argv[3], 0, 0) : 256 << 10;
    size_t sizes[] = {512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20};
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (bind(l, (void *)&a, sizeof a) || listen(l, 1) || getsockname(l, (void *)&a, &al)) return 2;
    pid_t kid = fork();
    int fd;
    if (kid == 0) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (void *)&a, sizeof a)) return 2;
    } else {
        fd = accept(l, 0, 0);
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    size_t max = 8 << 20;
    float *buf = malloc(max), *scratch = malloc(max), *send_buf = malloc(max);
    for (size_t i = 0; i < max / 4; i++) send_buf[i] = (float)(i % 7);
    for (int alg = 0; alg < 2; alg++) {
        for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
            size_t s = sizes[si], h = s / 2;
            double *t = calloc(r, sizeof *t);
            for (int b = -1; b < r; b++) {
                double t0 = now();
                for (int i = 0; i < n; i++) {
                    memcpy(buf, send_buf, s); /* out of place, as both benchmarks run it */
                    if (alg == 0) {
                        size_t mine = kid == 0 ? 0 : h, theirs = h - mine;
                        exchange(fd, (char *)buf + theirs, (char *)scratch, h,
                                 (float *)((char *)buf + mine), chunk);
                        exchange(fd, (char *)buf + mine, (char *)buf + theirs, h, 0, chunk);
                    } else {
                        exchange(fd, (char *)buf, (char *)scratch, s, buf, chunk);
                    }
                }
                if (b >= 0) t[b] = (now() - t0) / n;
            }
            qsort(t, r, sizeof *t, cmp);
            if (kid != 0)
                printf("{\"alg\": \"%s\", \"size\": %zu, \"median_usec\": %.1f, \"best_usec\": %.1f}\n",
                       alg == 0 ? "ring" : "rd", s, t[r / 2], t[0]);
            free(t);
        }
    }
    if (kid != 0) waitpid(kid, 0, 0);
    return 0;
}
