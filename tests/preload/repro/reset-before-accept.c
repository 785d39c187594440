// A client connects, writes 100 bytes and closes with SO_LINGER {1,0} (a reset) before the
// server accepts. Kernel TCP: accept() returns the connection, getsockname()/getpeername()
// succeed, read() gives the 100 bytes or ECONNRESET. Prints what each call gave.
#include <stdio.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
int main(int argc, char **argv) {
  int delay_ms = argc > 1 ? atoi(argv[1]) : 300;
  int pp[2]; pipe(pp);
  struct sockaddr_in a = {0};
  pid_t pid = fork();
  if (pid == 0) { // the client: waits for the port, connects, writes, resets
    if (read(pp[0], &a, sizeof a) != sizeof a) _exit(4);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void*)&a, sizeof a)) { perror("connect"); _exit(3); }
    char b[100]; memset(b, 'x', sizeof b); write(s, b, sizeof b);
    struct linger lg = {1, 0}; setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(s); _exit(0);
  }
  int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t al = sizeof a;
  if (bind(l, (void*)&a, sizeof a) || listen(l, 8)) { perror("bind/listen"); return 2; }
  getsockname(l, (void*)&a, &al);
  write(pp[1], &a, sizeof a);
  waitpid(pid, 0, 0);
  usleep(delay_ms * 1000);
  int c = accept(l, 0, 0);
  printf("accept: %s\n", c >= 0 ? "ok" : strerror(errno));
  if (c < 0) return 1;
  struct sockaddr_in x; socklen_t xl = sizeof x; int r;
  r = getsockname(c, (void*)&x, &xl);
  printf("getsockname: %s\n", r == 0 ? "ok" : strerror(errno));
  xl = sizeof x; r = getpeername(c, (void*)&x, &xl);
  printf("getpeername: %s\n", r == 0 ? "ok" : strerror(errno));
  char b[200]; ssize_t n = read(c, b, sizeof b);
  printf("read: %s\n", n >= 0 ? (n == 100 ? "100 bytes" : n == 0 ? "EOF" : "partial") : strerror(errno));
  n = read(c, b, sizeof b);
  printf("read2: %s\n", n >= 0 ? (n == 0 ? "EOF" : "data") : strerror(errno));
  return 0;
}
