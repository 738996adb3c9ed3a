/* The raw floor of a 2-rank 8 B exchange over TCP loopback, the pattern of a 2-rank all-reduce
 * by recursive doubling: both ends send 8 bytes at once, then busy-poll recv(MSG_DONTWAIT) until
 * the peer's 8 bytes are there; repeated N times. Also the ping-pong (one end answers), for
 * comparison. Prints the median and best of R timed blocks of N/R iterations, in us per
 * iteration. Build: cc -O2 -o exchange exchange.c; run: ./exchange [N] [R] */
#include <arpa/inet.h>
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
static void rd(int fd, char *b, int n) {
    int got = 0;
    while (got < n) {
        ssize_t r = recv(fd, b + got, n - got, MSG_DONTWAIT);
        if (r > 0) got += r;
        else if (r == 0) exit(1);
    }
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 20000, r = argc > 2 ? atoi(argv[2]) : 10, one = 1;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (bind(l, (void *)&a, sizeof a) || listen(l, 1) || getsockname(l, (void *)&a, &al)) return 2;
    for (int mode = 0; mode < 2; mode++) {
        fflush(stdout);
        pid_t p = fork();
        if (p == 0) {
            int c = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(c, (void *)&a, sizeof a)) exit(3);
            setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            char b[8] = {0};
            for (int i = 0; i < n + 1000; i++) {
                if (mode == 0) { send(c, b, 8, 0); rd(c, b, 8); }
                else { rd(c, b, 8); send(c, b, 8, 0); }
            }
            _exit(0);
        }
        int s = accept(l, NULL, NULL);
        setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char b[8] = {0};
        for (int i = 0; i < 1000; i++) { send(s, b, 8, 0); rd(s, b, 8); }
        double *t = calloc(r, sizeof *t);
        for (int k = 0; k < r; k++) {
            double t0 = now();
            for (int i = 0; i < n / r; i++) { send(s, b, 8, 0); rd(s, b, 8); }
            t[k] = (now() - t0) / (n / r);
        }
        qsort(t, r, sizeof *t, cmp);
        printf("{\"test\":\"%s\",\"bytes\":8,\"iterations\":%d,\"median_usec\":%.3f,\"best_usec\":%.3f}\n",
               mode == 0 ? "raw_exchange" : "raw_pingpong_rtt", n, t[r / 2], t[0]);
        close(s);
        waitpid(p, NULL, 0);
    }
    return 0;
}
