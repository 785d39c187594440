#!/bin/bash
# A socket added to an epoll set BEFORE its nonblocking connect() (what nginx does for
# proxy_pass/fastcgi_pass upstreams: socket, FIONBIO, epoll_ctl(ADD, IN|OUT|RDHUP|ET), connect)
# never reports EPOLLOUT/EPOLLIN under the shim: the shim dup3()s its own socket over the fd
# at connect, so the epoll registration (made on the old file) is lost. Over TCP: EPOLLOUT at once.
# Exits 0 when shim == TCP, 1 when they differ.
SHIM=${SHIM:-$(cd "$(dirname "$0")/../../.." && pwd)/target/release/libsdp_preload.so}; PORT=${PORT:-8195}
D=$(mktemp -d); trap 'rm -rf $D' EXIT
cat > $D/srv.py <<'PY'
import socket, sys
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", int(sys.argv[1]))); l.listen(16)
while True:
    c, _ = l.accept(); d = c.recv(100); c.sendall(d.upper()); c.close()
PY
cat > $D/cli.py <<'PY'
import socket, select, sys, errno
s = socket.socket(); s.setblocking(False)
ep = select.epoll()
ep.register(s.fileno(), select.EPOLLIN | select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLET)  # before connect
rc = s.connect_ex(("127.0.0.1", int(sys.argv[1])))
ev = ep.poll(3)
out = "connect=%s epollout=%s" % (errno.errorcode.get(rc, rc), any(e & select.EPOLLOUT for _, e in ev))
if ev:
    s.send(b"ping\n"); got = b""
    for _ in range(10):
        if got.endswith(b"\n"): break
        if ep.poll(1):
            try: got += s.recv(100)
            except BlockingIOError: pass
    out += " reply=%r" % got
print(out)
PY
run() { # $1 = "" or shim path
  env ${1:+LD_PRELOAD=$1} timeout 20 python3 $D/srv.py $PORT & local sp=$!
  for i in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
  env ${1:+LD_PRELOAD=$1} ${1:+SDP_LOG=${SDP_LOG:-0}} timeout 10 python3 $D/cli.py $PORT
  kill $sp; wait $sp 2>/dev/null
  while ss -ltn | grep -q ":$PORT "; do sleep 0.1; done
}
T=$(run ""); S=$(run "$SHIM")
echo "tcp:  $T"; echo "shim: $S"
[ "$T" = "$S" ] && { echo SAME; exit 0; } || { echo DIFFERS; exit 1; }
