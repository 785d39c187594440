/* The shim's cost on fds it does not own (issue 13 §6): calls on a pipe, a file and an AF_UNIX
 * socket pair go straight to libc under the shim, one atomic load later. Prints nanoseconds
 * per call for each kind, best of 5 rounds; tests/preload/bench.sh runs it with and without
 * the shim and prints the ratio. A benchmark, not a test.
 *
 *   passthrough [ITERATIONS]   (default 200000 per round) */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

#define CHECK(c) do { if (!(c)) { perror(#c); exit(1); } } while (0)

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000;
    int p[2], sp[2];
    CHECK(pipe(p) == 0);
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sp) == 0);
    char path[] = "/tmp/sdp-passthrough.XXXXXX";
    int f = mkstemp(path);
    CHECK(f >= 0);
    unlink(path);
    char b[64] = {0};
    CHECK(write(f, b, sizeof b) == sizeof b);
    double best[4] = {1e18, 1e18, 1e18, 1e18};
    for (int round = 0; round < 5; round++) {
        double t = now_ns();
        for (long i = 0; i < n; i++) {
            CHECK(write(p[1], b, 1) == 1);
            CHECK(read(p[0], b, 1) == 1);
        }
        double d = (now_ns() - t) / (2.0 * n);
        if (d < best[0]) best[0] = d;
        t = now_ns();
        for (long i = 0; i < n; i++) {
            CHECK(lseek(f, 0, SEEK_SET) == 0);
            CHECK(read(f, b, sizeof b) == sizeof b);
        }
        d = (now_ns() - t) / (2.0 * n);
        if (d < best[1]) best[1] = d;
        t = now_ns();
        for (long i = 0; i < n; i++) {
            CHECK(send(sp[0], b, 1, 0) == 1);
            CHECK(recv(sp[1], b, 1, 0) == 1);
        }
        d = (now_ns() - t) / (2.0 * n);
        if (d < best[2]) best[2] = d;
        t = now_ns();
        for (long i = 0; i < n; i++)
            CHECK(fcntl(p[0], F_GETFL) >= 0);
        d = (now_ns() - t) / (double)n;
        if (d < best[3]) best[3] = d;
    }
    printf("pipe %.1f\nfile %.1f\nunix %.1f\nfcntl %.1f\n", best[0], best[1], best[2], best[3]);
    return 0;
}
