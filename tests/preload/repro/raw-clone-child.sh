#!/bin/bash
# A server that accepts and then starts the per-connection child with a raw clone system call
# (vsftpd: syscall(__NR_clone, CLONE_NEWIPC|SIGCHLD) in standalone mode, then CLONE_NEWNET for
# its unprivileged child) and closes its own copy of the connection, as every accept-then-fork
# server does. The shim's fork handlers (pthread_atfork) do not run for a raw clone, so the
# parent's close() ends the SDP connection although the child still holds it: the client reads
# EOF at once (vsftpd under the shim: no "220" banner, curl rc=56). Kernel TCP: the child's
# greeting and reply arrive. Prints tcp vs shim; exits 1 when they differ.
SHIM=${SHIM:-$(cd "$(dirname "$0")/../../.." && pwd)/target/release/libsdp_preload.so}
PORT=${PORT:-18393}
D=$(mktemp -d); trap 'rm -rf $D' EXIT
cat > $D/srv.c <<'C'
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int raw = argc > 2 && atoi(argv[2]);
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (bind(l, (void *)&a, sizeof a) || listen(l, 8)) { perror("listen"); return 2; }
    printf("ready\n"); fflush(stdout);
    for (int i = 0; i < 2; i++) {
        int c = accept(l, 0, 0);
        pid_t p = raw ? (pid_t)syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0) : fork();
        if (p == 0) {               /* the per-connection child: greet, answer one line */
            close(l);
            dup2(c, 0); dup2(c, 1); close(c);
            usleep(50000);
            write(1, "220 hello\r\n", 11);
            char buf[64]; ssize_t n = read(0, buf, sizeof buf);
            if (n > 0) write(1, "221 bye\r\n", 9);
            _exit(0);
        }
        close(c);                   /* the parent's copy, at once */
        waitpid(p, 0, 0);
    }
    return 0;
}
C
gcc -O1 -o $D/srv $D/srv.c || exit 2
cat > $D/cli.py <<'PY'
import socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1]))); c.settimeout(3)
try:
    b = c.recv(100); c.sendall(b"QUIT\r\n"); r = c.recv(100)
    print(repr(b + r))
except OSError as e:
    print("error", e)
PY
run() { # $1 preload env, $2 raw
  rm -f $D/out; $1 timeout 20 $D/srv $PORT $2 > $D/out & local S=$!
  for i in $(seq 50); do grep -q ready $D/out 2>/dev/null && break; sleep 0.1; done
  $1 timeout 10 python3 $D/cli.py $PORT; $1 timeout 10 python3 $D/cli.py $PORT
  wait $S
}
P="env LD_PRELOAD=$SHIM"
tcp_raw=$(run env 1 | tr '\n' ' '); shim_raw=$(run "$P" 1 | tr '\n' ' '); shim_fork=$(run "$P" 0 | tr '\n' ' ')
echo "raw clone child, tcp:  $tcp_raw"
echo "raw clone child, shim: $shim_raw"
echo "fork() child,    shim: $shim_fork   (for comparison)"
[ "$tcp_raw" = "$shim_raw" ] && { echo SAME; exit 0; }
echo DIFFER; exit 1
