/* Where a short connection's time goes: a client that connects, writes 100 bytes, reads the
 * echo and closes, N times in turn, against a server that accepts, reads, writes and closes.
 * Each side writes one line per connection of CLOCK_MONOTONIC stamps (microseconds) to FILE,
 * then a line "cpu MAIN OTHER": the CPU microseconds per connection of its main thread and of
 * its other threads (the shim's progress thread), over the connections after the first SKIP.
 * tests/preload/conn-phases.sh joins them. A benchmark tool, not a test.
 *
 *   conn-phases s PORT N SKIP FILE     server: N connections
 *   conn-phases c PORT N SKIP FILE     client: N connections to 127.0.0.1:PORT */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static double cpu_us(int who) {
    struct rusage r;
    getrusage(who, &r);
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1e6 + r.ru_utime.tv_usec + r.ru_stime.tv_usec;
}

/* CPU so far: [0] the main thread, [1] the whole process. */
static void cpu_now(double c[2]) {
    c[0] = cpu_us(RUSAGE_THREAD);
    c[1] = cpu_us(RUSAGE_SELF);
}

int main(int argc, char **argv) {
    if (argc != 6)
        return 2;
    int port = atoi(argv[2]), n = atoi(argv[3]), skip = atoi(argv[4]);
    double c0[2] = {0, 0}, c1[2];
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char buf[256];
    double *t = calloc((size_t)n * 4, sizeof(double));
    if (!t)
        return 1;
    if (strcmp(argv[1], "s") == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 128)) {
            perror("bind/listen");
            return 1;
        }
        for (int i = 0; i < n; i++) {
            if (i == skip)
                cpu_now(c0);
            t[i * 4] = now_us();
            int c = accept(l, NULL, NULL);
            if (c < 0)
                return 1;
            t[i * 4 + 1] = now_us();
            ssize_t r = read(c, buf, 100);
            t[i * 4 + 2] = now_us();
            if (r > 0 && write(c, buf, (size_t)r) != r)
                return 1;
            t[i * 4 + 3] = now_us();
            close(c);
        }
    } else {
        for (int i = 0; i < n; i++) {
            if (i == skip)
                cpu_now(c0);
            t[i * 4] = now_us();
            int s = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(s, (struct sockaddr *)&a, sizeof a)) {
                perror("connect");
                return 1;
            }
            t[i * 4 + 1] = now_us();
            memset(buf, 'x', 100);
            if (write(s, buf, 100) != 100)
                return 1;
            t[i * 4 + 2] = now_us();
            int got = 0;
            while (got < 100) {
                ssize_t r = read(s, buf, (size_t)(100 - got));
                if (r <= 0)
                    return 1;
                got += (int)r;
            }
            t[i * 4 + 3] = now_us();
            close(s);
        }
    }
    cpu_now(c1);
    FILE *f = fopen(argv[5], "w");
    if (!f)
        return 1;
    for (int i = 0; i < n; i++)
        fprintf(f, "%.1f %.1f %.1f %.1f\n", t[i * 4], t[i * 4 + 1], t[i * 4 + 2], t[i * 4 + 3]);
    int m = n - skip > 0 ? n - skip : 1;
    fprintf(f, "cpu %.1f %.1f\n", (c1[0] - c0[0]) / m, (c1[1] - c0[1] - (c1[0] - c0[0])) / m);
    fclose(f);
    return 0;
}
