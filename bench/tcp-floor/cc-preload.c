#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
static void setcc(int fd) {
    const char *cc = getenv("CC_ALGO");
    if (cc && *cc) setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, strlen(cc));
}
int socket(int d, int t, int p) {
    static int (*real)(int, int, int);
    if (!real) real = dlsym(RTLD_NEXT, "socket");
    int fd = real(d, t, p);
    if (fd >= 0 && (d == AF_INET || d == AF_INET6) && (t & 0xf) == SOCK_STREAM) setcc(fd);
    return fd;
}
int accept4(int s, struct sockaddr *a, socklen_t *l, int f) {
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (!real) real = dlsym(RTLD_NEXT, "accept4");
    int fd = real(s, a, l, f);
    if (fd >= 0) setcc(fd);
    return fd;
}
int accept(int s, struct sockaddr *a, socklen_t *l) {
    static int (*real)(int, struct sockaddr *, socklen_t *);
    if (!real) real = dlsym(RTLD_NEXT, "accept");
    int fd = real(s, a, l);
    if (fd >= 0) setcc(fd);
    return fd;
}
